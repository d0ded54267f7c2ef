/* The replay cache (see replay_cache.h): 16 shards, each a hash table with
 * an LRU list and a byte budget. */
#include "server/replay_cache.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define SHARDS 16
#define BUCKETS 4096 /* per shard */

struct entry {
  uint64_t hash;
  struct entry *chain;       /* next in the bucket */
  struct entry **pchain;     /* what points at it in the bucket */
  struct entry *prev, *next; /* LRU, most recent first */
  int64_t tenant_id;
  int64_t expires_at;
  int status;
  size_t size; /* bytes charged to the budget */
  char fingerprint[IDEM_FINGERPRINT_LEN];
  char location[IDEM_LOCATION_MAX + 1];
  char *operation, *key, *body; /* point into `data` */
  void *value;                  /* idemd_replay_cache_put_value()'s, or NULL */
  void (*free_value)(void *value);
  char data[];
};

struct shard {
  pthread_mutex_t lock;
  struct entry *buckets[BUCKETS];
  struct entry *head, *tail;
  size_t bytes, budget;
};

struct idemd_replay_cache {
  struct shard shards[SHARDS];
  atomic_uint_fast64_t hits;
};

static uint64_t hash_scope(const idem_scope_t *sc) {
  uint64_t h = 1469598103934665603ULL;
  for (int i = 0; i < 8; i++) {
    h ^= (uint64_t)((sc->tenant_id >> (8 * i)) & 0xff);
    h *= 1099511628211ULL;
  }
  for (const char *p = sc->operation; *p; p++) {
    h ^= (unsigned char)*p;
    h *= 1099511628211ULL;
  }
  h ^= 0xff; /* separates operation from key */
  h *= 1099511628211ULL;
  for (const char *p = sc->key; *p; p++) {
    h ^= (unsigned char)*p;
    h *= 1099511628211ULL;
  }
  return h;
}

static int same_scope(const struct entry *e, uint64_t h, const idem_scope_t *sc) {
  return e->hash == h && e->tenant_id == sc->tenant_id &&
         strcmp(e->operation, sc->operation) == 0 && strcmp(e->key, sc->key) == 0;
}

/* Unlinks `e` from its bucket and the LRU list, and frees it: without
 * walking its bucket, since the entry dropped to make room is the least
 * recently used, whose bucket is as cold as it is. */
static void drop(struct shard *s, struct entry *e) {
  *e->pchain = e->chain;
  if (e->chain)
    e->chain->pchain = e->pchain;
  if (e->prev)
    e->prev->next = e->next;
  else
    s->head = e->next;
  if (e->next)
    e->next->prev = e->prev;
  else
    s->tail = e->prev;
  s->bytes -= e->size;
  if (e->value)
    e->free_value(e->value);
  free(e);
}

static void to_front(struct shard *s, struct entry *e) {
  if (s->head == e)
    return;
  e->prev->next = e->next; /* e is not the head, so it has a prev */
  if (e->next)
    e->next->prev = e->prev;
  else
    s->tail = e->prev;
  e->prev = NULL;
  e->next = s->head;
  s->head->prev = e;
  s->head = e;
}

idemd_replay_cache_t *idemd_replay_cache_new(size_t max_bytes) {
  idemd_replay_cache_t *c;
  if (max_bytes == 0 || (c = calloc(1, sizeof *c)) == NULL)
    return NULL;
  for (int i = 0; i < SHARDS; i++) {
    pthread_mutex_init(&c->shards[i].lock, NULL);
    c->shards[i].budget = max_bytes / SHARDS;
  }
  return c;
}

void idemd_replay_cache_free(idemd_replay_cache_t *c) {
  if (c == NULL)
    return;
  for (int i = 0; i < SHARDS; i++) {
    while (c->shards[i].head)
      drop(&c->shards[i], c->shards[i].head);
    pthread_mutex_destroy(&c->shards[i].lock);
  }
  free(c);
}

/* Both forms of put: `value` (NULL: none) is the cache's from here,
 * freed with `free_value` when not kept. */
static void put(idemd_replay_cache_t *c, const idem_scope_t *scope, const char *fingerprint,
                int status, const char *replay_body, const char *location,
                int64_t expires_at_ms, void *value, size_t value_bytes,
                void (*free_value)(void *)) {
  uint64_t h;
  struct shard *s;
  struct entry *e, **slot;
  size_t oplen, keylen, bodylen, size;

  if (c == NULL || replay_body == NULL || expires_at_ms == 0) {
    if (value)
      free_value(value);
    return;
  }
  h = hash_scope(scope);
  s = &c->shards[h % SHARDS];
  oplen = strlen(scope->operation) + 1;
  keylen = strlen(scope->key) + 1;
  bodylen = strlen(replay_body) + 1;
  size = sizeof *e + oplen + keylen + bodylen + value_bytes;
  /* one entry never takes over a shard */
  if (size > s->budget / 4 || (e = malloc(sizeof *e + oplen + keylen + bodylen)) == NULL) {
    if (value)
      free_value(value);
    return;
  }
  e->prev = NULL; /* the rest is set below */
  e->value = value;
  e->free_value = free_value;
  e->hash = h;
  e->tenant_id = scope->tenant_id;
  e->expires_at = expires_at_ms;
  e->status = status;
  e->size = size;
  idem_copy(e->fingerprint, sizeof e->fingerprint, fingerprint);
  idem_copy(e->location, sizeof e->location, location);
  e->operation = e->data;
  e->key = e->operation + oplen;
  e->body = e->key + keylen;
  memcpy(e->operation, scope->operation, oplen);
  memcpy(e->key, scope->key, keylen);
  memcpy(e->body, replay_body, bodylen);

  pthread_mutex_lock(&s->lock);
  slot = &s->buckets[(h / SHARDS) % BUCKETS];
  for (struct entry *old = *slot; old; old = old->chain)
    if (same_scope(old, h, scope)) {
      drop(s, old);
      break;
    }
  e->chain = *slot;
  if (e->chain)
    e->chain->pchain = &e->chain;
  e->pchain = slot;
  *slot = e;
  e->next = s->head;
  if (s->head)
    s->head->prev = e;
  s->head = e;
  if (s->tail == NULL)
    s->tail = e;
  s->bytes += size;
  while (s->bytes > s->budget && s->tail != e)
    drop(s, s->tail);
  pthread_mutex_unlock(&s->lock);
}

void idemd_replay_cache_put(idemd_replay_cache_t *c, const idem_scope_t *scope,
                            const char *fingerprint, int status,
                            const char *replay_body, const char *location,
                            int64_t expires_at_ms) {
  put(c, scope, fingerprint, status, replay_body, location, expires_at_ms, NULL, 0, NULL);
}

void idemd_replay_cache_put_value(idemd_replay_cache_t *c, const idem_scope_t *scope,
                                  const char *fingerprint, int status, void *value,
                                  size_t value_bytes, void (*free_value)(void *value),
                                  int64_t expires_at_ms) {
  put(c, scope, fingerprint, status, "", "", expires_at_ms, value, value_bytes, free_value);
}

/* The live entry of `scope` in its shard `s` (locked by the caller), or
 * NULL; an expired one is dropped on the way, the key as good as never
 * seen. */
static struct entry *find_live(struct shard *s, uint64_t h, const idem_scope_t *scope,
                               int64_t now_ms) {
  for (struct entry *e = s->buckets[(h / SHARDS) % BUCKETS]; e; e = e->chain) {
    if (!same_scope(e, h, scope))
      continue;
    if (e->expires_at > now_ms)
      return e;
    drop(s, e);
    return NULL;
  }
  return NULL;
}

int idemd_replay_cache_use(idemd_replay_cache_t *c, const idem_scope_t *scope,
                           int64_t now_ms,
                           int (*use)(void *value, int status, const char *fingerprint,
                                      void *arg),
                           void *arg) {
  uint64_t h;
  struct shard *s;
  struct entry *e;
  int used = 0;

  if (c == NULL)
    return 0;
  h = hash_scope(scope);
  s = &c->shards[h % SHARDS];
  pthread_mutex_lock(&s->lock);
  e = find_live(s, h, scope, now_ms);
  if (e && e->value && (used = use(e->value, e->status, e->fingerprint, arg)) != 0)
    to_front(s, e);
  pthread_mutex_unlock(&s->lock);
  if (used)
    atomic_fetch_add_explicit(&c->hits, 1, memory_order_relaxed);
  return used;
}

int idemd_replay_cache_get(idemd_replay_cache_t *c, const idem_scope_t *scope,
                           int64_t now_ms, idemd_replay_t *out) {
  uint64_t h;
  struct shard *s;
  struct entry *e;
  int found = 0;

  if (c == NULL)
    return 0;
  h = hash_scope(scope);
  s = &c->shards[h % SHARDS];
  pthread_mutex_lock(&s->lock);
  e = find_live(s, h, scope, now_ms);
  if (e && (out->body = strdup(e->body)) != NULL) {
    /* Strings only: an entry's arrays are not zeroed past them. */
    idem_copy(out->fingerprint, sizeof out->fingerprint, e->fingerprint);
    idem_copy(out->location, sizeof out->location, e->location);
    out->status = e->status;
    to_front(s, e);
    found = 1;
  }
  pthread_mutex_unlock(&s->lock);
  if (found)
    atomic_fetch_add_explicit(&c->hits, 1, memory_order_relaxed);
  return found;
}

uint64_t idemd_replay_cache_hits(const idemd_replay_cache_t *c) {
  return c ? atomic_load(&((idemd_replay_cache_t *)c)->hits) : 0;
}
