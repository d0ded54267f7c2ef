/* Tenants on either store (see tenants.h), and the cache of tenants found
 * by key. */
#include "data/tenants.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "data/sql.h"
#include "idem/clock.h"

#define TEXT IDEMD_SQL_TEXT
#define NUM IDEMD_SQL_NUM

/* SQLite keeps a key's hash as a BLOB, PostgreSQL as hex text; both are
 * read as hex. The statements that differ are made from one text. */
#define KEY_COLUMNS(hash)                                                                \
  "k.id, k.tenant_id, k.name, k.key_lookup, " hash ", k.created_at, "                    \
  "coalesce(k.last_used_at, 0), coalesce(k.revoked_at, 0)"
#define BOTH(sql, rest)                                                                  \
  { sql("hex(k.key_hash)") rest, sql("k.key_hash") rest }

/* Columns read back from a key: KEY_COLUMNS, then (finds) its tenant's. */
enum {
  K_ID,
  K_TENANT,
  K_NAME,
  K_LOOKUP,
  K_HASH,
  K_CREATED,
  K_USED,
  K_REVOKED,
  K_TENANT_NAME,
  K_DISABLED,
  K_TENANT_CREATED
};

#define FIND_SQL(hash)                                                                   \
  "SELECT " KEY_COLUMNS(hash) ", t.name, t.disabled, t.created_at FROM api_keys k "      \
                              "JOIN tenants t ON t.id = k.tenant_id WHERE k.key_lookup " \
                              "= $1 AND k.revoked_at IS NULL"
#define LIST_SQL(hash)                                                                   \
  "SELECT " KEY_COLUMNS(hash) " FROM api_keys k JOIN tenants t ON t.id = k.tenant_id "   \
                              "WHERE t.name = $1 ORDER BY k.revoked_at IS NOT NULL, "    \
                              "k.created_at, k.id LIMIT $2"
static const char *const find_sql[2] = BOTH(FIND_SQL, "");
static const char *const list_keys_sql[2] = BOTH(LIST_SQL, "");

static const char insert_tenant_sql[] =
    "INSERT INTO tenants (name, created_at) VALUES ($1, $2) RETURNING id";
static const char tenant_by_name_sql[] =
    "SELECT id, name, disabled, created_at FROM tenants WHERE name = $1";
static const char list_tenants_sql[] =
    "SELECT t.id, t.name, t.disabled, t.created_at, (SELECT count(*) FROM api_keys k "
    "WHERE k.tenant_id = t.id AND k.revoked_at IS NULL) FROM tenants t ORDER BY t.name "
    "LIMIT $1";
static const char set_disabled_sql[] = "UPDATE tenants SET disabled = $1 WHERE name = $2";
/* A key of the tenant named $5, if there is one. */
static const char insert_key_sql[] =
    "INSERT INTO api_keys (tenant_id, name, key_lookup, key_hash, created_at) "
    "SELECT id, $1, $2, $3, $4 FROM tenants WHERE name = $5 RETURNING id, tenant_id";
static const char revoke_sql[] =
    "UPDATE api_keys SET revoked_at = $1 WHERE revoked_at IS NULL AND name = $2 "
    "AND tenant_id = (SELECT id FROM tenants WHERE name = $3)";
static const char revoke_all_sql[] =
    "UPDATE api_keys SET revoked_at = $1 WHERE revoked_at IS NULL "
    "AND tenant_id = (SELECT id FROM tenants WHERE name = $2)";
static const char used_sql[] = "UPDATE api_keys SET last_used_at = $1 WHERE id = $2 "
                               "AND (last_used_at IS NULL OR last_used_at < $1)";

/* ---- The cache -----------------------------------------------------------
 *
 * Every request checks its API key, and reading the key's tenant was a
 * quarter of a replay's CPU (a read transaction: file locks, a statement).
 * Tenants found are remembered, and forgotten as soon as any tenant
 * changes, in any process: every change made here (idemd tenant create,
 * rotate, disable, enable) appends one byte to a file beside the database
 * (`<db>-tenants`, opened O_APPEND by every process that uses the
 * database), and an entry counts only while that file's size is what it
 * was before the entry was read. The byte is written after the change
 * commits, so by the time the command returns, no process answers with the
 * old key. Each thread reads the file's size at most once every
 * RECHECK_US (an fstat() per lookup was 4 % of a replay's CPU), and a
 * change's command returns only after waiting that long past its byte:
 * whatever a thread remembers of the size was read before, so by then
 * every lookup reads it again. An entry also lasts at most TTL_MS, which
 * bounds staleness after a change made another way (SQL on the file by
 * hand, a replaced file) or a command killed between its commit and its
 * byte. Without the file (say, a read-only directory), every key is read
 * from the database.
 *
 * On PostgreSQL, whose instances may be on other machines, the count is
 * the store's listener's instead (idem_store_listen()): every change sends
 * a NOTIFY on TENANTS_CHANNEL in its own transaction, and each
 * notification the listener receives counts one. While the listener is
 * not listening (before its LISTEN succeeded, after it lost its
 * connection) a notification may be missed: nothing is remembered, and
 * its next LISTEN counts one more, so that entries from before are not
 * trusted after. An entry lasts at most PG_TTL_MS there, which bounds
 * staleness after a change that sent no NOTIFY (by hand in SQL) or one
 * lost on a connection that died silently (keepalives find that within
 * about twice --db-timeout): docs/scaling.md, "API keys on PostgreSQL". */
#define CACHE_ENTRIES 64 /* direct-mapped by key lookup */
#define TTL_MS 1000
#define PG_TTL_MS 30000
#define RECHECK_US 2000
#define TENANTS_CHANNEL "idem_tenants"

struct entry {
  idemd_api_key_t key;
  idemd_tenant_t tenant;
  int64_t changed;  /* the file's size when they were read */
  int64_t until_ms; /* idem_mono_ms() */
  int used;
};

/* Keys' last uses, noted per request and written in a batch
 * (idemd_keys_flush()): open addressing by key id, at most PROBES slots
 * from a key's own. */
#define USE_SLOTS 1024
#define PROBES 8

struct use {
  int64_t key_id;     /* 0: free */
  int64_t at;         /* the last use noted */
  int64_t written_at; /* the last use written */
};

struct idemd_tenants {
  idem_store_t *store;
  char path[4096]; /* the change file's */
  int fd;          /* the change file; -1: no cache */
  int writable;    /* 0: this process only reads it */
  int exists;      /* the file exists, whether this process can use it */
  uint64_t serial; /* tells these apart in per-thread state */
  int watched;     /* PostgreSQL: the count is `notified`, not the file */
  atomic_int listening;
  atomic_int_fast64_t notified;
  pthread_mutex_t lock;
  struct entry *cache; /* CACHE_ENTRIES */
  pthread_mutex_t use_lock;
  struct use uses[USE_SLOTS];
};

static atomic_uint_fast64_t serials;

/* The change count: the file's size; -1 when it cannot be read. */
static int64_t changed_now(const idemd_tenants_t *t) {
  struct stat st;
  return fstat(t->fd, &st) == 0 ? (int64_t)st.st_size : -1;
}

/* The change count as this thread last read it, read again when that was
 * RECHECK_US ago or more (or for other tenants). The time is taken
 * before the read, so a size is never trusted longer than that after it
 * was read. */
static int64_t changed_lately(const idemd_tenants_t *t) {
  static __thread uint64_t serial; /* of the tenants last read */
  static __thread int64_t read_us; /* idem_mono_us() before that read */
  static __thread int64_t count;
  int64_t now = idem_mono_us();

  if (serial != t->serial || count < 0 || now - read_us >= RECHECK_US) {
    count = changed_now(t);
    read_us = now;
    serial = t->serial;
  }
  return count;
}

/* Sleeps `us` microseconds, through signals. */
static void sleep_us(long long us) {
  struct timespec left = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000L};
  while (nanosleep(&left, &left) != 0 && errno == EINTR)
    ;
}

/* After a change to a tenant (committed, or maybe: an extra count only
 * empties the caches). When this process cannot count it in the file the
 * servers read (not writable by this user, or not there), it waits until
 * every entry remembered before the change has expired, so the change
 * still holds for everyone once the command returns. */
static void bump(idemd_tenants_t *t) {
  if (t->fd >= 0 && t->writable && write(t->fd, "+", 1) == 1) {
    /* Until every thread that read the size before this byte reads it
     * again (changed_lately). */
    sleep_us(RECHECK_US + 1000);
    return;
  }
  if (!t->exists)
    return; /* no file, so no server remembers keys */
  fprintf(stderr,
          "idemd: cannot count a tenant change in %s; waiting %d ms "
          "for servers to forget the old key\n",
          t->path, TTL_MS + 100);
  sleep_us((TTL_MS + 100) * 1000LL);
}

/* The change count of a lookup, read before its key: -1 when nothing may
 * be remembered. On PostgreSQL `notified` is read before `listening`,
 * which the listener sets before counting: a count read while it was not
 * listening is counted past once it listens again. */
static int64_t change_count(idemd_tenants_t *t) {
  if (t->watched) {
    int64_t n = atomic_load(&t->notified);
    return atomic_load(&t->listening) ? n : -1;
  }
  return t->fd < 0 ? -1 : changed_lately(t);
}

/* The listener's (idem_store_listen()): a tenant or key changed on some
 * instance, or notifications may be missed (`listening` 0), or no longer. */
static void tenants_notified(void *arg, int listening) {
  idemd_tenants_t *t = arg;
  atomic_store(&t->listening, listening);
  atomic_fetch_add(&t->notified, 1);
}

/* On PostgreSQL: the cache, counted by the listener's notifications; for
 * the store's first handle only (one function per store): another reads
 * every key. */
static void watch_changes(idemd_tenants_t *t) {
  if (strcmp(idem_store_backend(t->store), "postgresql") != 0 ||
      (t->cache = calloc(CACHE_ENTRIES, sizeof *t->cache)) == NULL)
    return;
  if (idem_store_listen(t->store, TENANTS_CHANNEL, tenants_notified, t) == IDEM_OK) {
    t->watched = 1;
    return;
  }
  free(t->cache);
  t->cache = NULL;
}

/* The database's file, as SQLite resolved it (symbolic links and all, as
 * its -wal and -shm are). */
static int db_file(void *arg, idem_tx_t *tx) {
  const char *name = sqlite3_db_filename(idem_tx_handle(tx), "main");
  snprintf(arg, 4096, "%s", name ? name : "");
  return IDEM_OK;
}

/* Opens the change file of a SQLite database, creating it with the
 * database's mode and owner as SQLite does for its -wal and -shm.
 * Read-only when this user may not write it (its changes then wait
 * instead); no cache at all when it cannot be opened. */
static void open_change_file(idemd_tenants_t *t) {
  char name[4096] = "";
  idem_effect_t e = {db_file, name};
  struct stat st;
  int fd;

  if (strcmp(idem_store_backend(t->store), "sqlite") != 0 ||
      idem_store_read(t->store, &e) != IDEM_OK || name[0] == '\0' ||
      stat(name, &st) != 0 ||
      snprintf(t->path, sizeof t->path, "%s-tenants", name) >= (int)sizeof t->path)
    return;
  if ((t->cache = calloc(CACHE_ENTRIES, sizeof *t->cache)) == NULL) {
    t->exists = access(t->path, F_OK) == 0;
    return;
  }
  fd = open(t->path, O_WRONLY | O_APPEND | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
            st.st_mode & 0777);
  if (fd >= 0) {
    (void)fchmod(fd, st.st_mode & 0777); /* not narrowed by the umask */
    if (geteuid() == 0)
      (void)fchown(fd, st.st_uid, st.st_gid);
    t->writable = 1;
  } else if (errno == EEXIST) {
    fd = open(t->path, O_WRONLY | O_APPEND | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0)
      t->writable = 1;
    else if (errno == EACCES)
      fd = open(t->path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  }
  if (fd >= 0 && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))) {
    close(fd);
    fd = -1;
    t->writable = 0;
  }
  t->fd = fd;
  t->exists = fd >= 0 || access(t->path, F_OK) == 0;
}

int idemd_tenants_open(idem_store_t *store, idemd_tenants_t **out) {
  idemd_tenants_t *t = calloc(1, sizeof *t);

  *out = NULL;
  if (t == NULL)
    return IDEM_ENOMEM;
  t->store = store;
  t->fd = -1;
  t->serial = atomic_fetch_add(&serials, 1) + 1;
  pthread_mutex_init(&t->lock, NULL);
  pthread_mutex_init(&t->use_lock, NULL);
  open_change_file(t);
  watch_changes(t);
  *out = t;
  return IDEM_OK;
}

void idemd_tenants_close(idemd_tenants_t *t) {
  if (t == NULL)
    return;
  (void)idemd_keys_flush(t);
  if (t->watched)
    (void)idem_store_listen(t->store, NULL, tenants_notified, t);
  if (t->fd >= 0)
    close(t->fd);
  pthread_mutex_destroy(&t->lock);
  pthread_mutex_destroy(&t->use_lock);
  free(t->cache);
  free(t);
}

static struct entry *slot_of(idemd_tenants_t *t, const char *lookup) {
  uint32_t h = 2166136261u;
  for (const unsigned char *p = (const unsigned char *)lookup; *p; p++)
    h = (h ^ *p) * 16777619u;
  return &t->cache[h % CACHE_ENTRIES];
}

/* ---- Reads --------------------------------------------------------------- */

static int unhex(const char *hex, unsigned char *out, size_t len) {
  if (hex == NULL || strlen(hex) != 2 * len)
    return -1;
  for (size_t i = 0; i < len; i++) {
    unsigned v;
    if (sscanf(hex + 2 * i, "%2x", &v) != 1)
      return -1;
    out[i] = (unsigned char)v;
  }
  return 0;
}

static int64_t num(const char *col) {
  return col ? strtoll(col, NULL, 10) : 0;
}

static void copy(char *dst, size_t cap, const char *col) {
  (void)idem_copy(dst, cap, col ? col : "");
}

static void row_to_key(const char *const *cols, idemd_api_key_t *k) {
  memset(k, 0, sizeof *k);
  k->id = num(cols[K_ID]);
  k->tenant_id = num(cols[K_TENANT]);
  copy(k->name, sizeof k->name, cols[K_NAME]);
  copy(k->lookup, sizeof k->lookup, cols[K_LOOKUP]);
  if (unhex(cols[K_HASH], k->hash, sizeof k->hash) != 0)
    memset(k->hash, 0, sizeof k->hash); /* matches no key */
  k->created_at = num(cols[K_CREATED]);
  k->last_used_at = num(cols[K_USED]);
  k->revoked_at = num(cols[K_REVOKED]);
}

/* Rows read, up to `max`, into `keys` or `tenants`; `tenant` gets a found
 * key's tenant. */
struct rows {
  idemd_api_key_t *keys;
  idemd_tenant_t *tenants, *tenant;
  int max, n;
};

static int got_key(void *arg, const char *const *cols) {
  struct rows *r = arg;
  if (r->n >= r->max)
    return IDEM_OK;
  row_to_key(cols, &r->keys[r->n++]);
  if (r->tenant) {
    memset(r->tenant, 0, sizeof *r->tenant);
    r->tenant->id = num(cols[K_TENANT]);
    copy(r->tenant->name, sizeof r->tenant->name, cols[K_TENANT_NAME]);
    r->tenant->disabled = (int)num(cols[K_DISABLED]);
    r->tenant->created_at = num(cols[K_TENANT_CREATED]);
  }
  return IDEM_OK;
}

static int got_tenant(void *arg, const char *const *cols) {
  struct rows *r = arg;
  idemd_tenant_t *t;

  if (r->n >= r->max)
    return IDEM_OK;
  t = &r->tenants[r->n++];
  memset(t, 0, sizeof *t);
  t->id = num(cols[0]);
  copy(t->name, sizeof t->name, cols[1]);
  t->disabled = (int)num(cols[2]);
  t->created_at = num(cols[3]);
  t->keys = (int)num(cols[4]);
  return IDEM_OK;
}

/* One read: statement `slot` (SQLite's text first, PostgreSQL's second;
 * the same when only one is given) with `n` parameters into `rows`. */
struct query {
  enum idemd_sql_slot slot;
  const char *const *sql; /* [2] */
  idemd_sql_param_t p[2];
  int n;
  idemd_sql_row_fn row;
  struct rows rows;
};

static int query_fn(void *arg, idem_tx_t *tx) {
  struct query *q = arg;
  q->rows.n = 0;
  return idemd_sql_run(tx, q->slot, q->sql[idemd_sql_is_sqlite(tx) ? 0 : 1], q->p, q->n,
                       q->row, &q->rows, NULL);
}

static int read_rows(idemd_tenants_t *t, struct query *q) {
  idem_effect_t e = {query_fn, q};
  int rc = idem_store_read(t->store, &e);
  if (rc != IDEM_OK)
    q->rows.n = 0;
  return rc;
}

/* The key in use with this lookup, and its tenant, from the database. */
static int read_key(idemd_tenants_t *t, const char *lookup, idemd_api_key_t *key,
                    idemd_tenant_t *tenant) {
  struct query q = {IDEMD_SQL_KEY_FIND,       find_sql, {TEXT(lookup)}, 1, got_key,
                    {key, NULL, tenant, 1, 0}};
  int rc = read_rows(t, &q);

  if (rc == IDEM_OK && q.rows.n == 0)
    rc = IDEM_ENOTFOUND;
  if (rc != IDEM_OK) {
    memset(key, 0, sizeof *key);
    memset(tenant, 0, sizeof *tenant);
  }
  return rc;
}

int idemd_key_find(idemd_tenants_t *t, const char *lookup, idemd_api_key_t *key,
                   idemd_tenant_t *tenant) {
  struct entry *e;
  int64_t changed, now;
  int rc;

  if ((changed = change_count(t)) < 0)
    return read_key(t, lookup, key, tenant);
  /* `changed` is read before the key: a change after it makes the entry
   * stale at once. */
  now = idem_mono_ms();
  e = slot_of(t, lookup);
  pthread_mutex_lock(&t->lock);
  if (e->used && e->changed == changed && e->until_ms > now &&
      strcmp(e->key.lookup, lookup) == 0) {
    *key = e->key;
    *tenant = e->tenant;
    pthread_mutex_unlock(&t->lock);
    return IDEM_OK;
  }
  pthread_mutex_unlock(&t->lock);
  rc = read_key(t, lookup, key, tenant);
  if (rc == IDEM_OK) { /* unknown keys are not remembered */
    pthread_mutex_lock(&t->lock);
    *e = (struct entry){*key, *tenant, changed, now + (t->watched ? PG_TTL_MS : TTL_MS),
                        1};
    pthread_mutex_unlock(&t->lock);
  }
  return rc;
}

int idemd_key_remembered(idemd_tenants_t *t, const char *lookup, idemd_api_key_t *key,
                         idemd_tenant_t *tenant) {
  struct entry *e;
  int64_t changed = change_count(t);
  int rc = IDEM_EAGAIN;

  if (changed < 0)
    return IDEM_EAGAIN;
  e = slot_of(t, lookup);
  pthread_mutex_lock(&t->lock);
  if (e->used && e->changed == changed && e->until_ms > idem_mono_ms() &&
      strcmp(e->key.lookup, lookup) == 0) {
    *key = e->key;
    *tenant = e->tenant;
    rc = IDEM_OK;
  }
  pthread_mutex_unlock(&t->lock);
  return rc;
}

int idemd_tenant_by_name(idemd_tenants_t *t, const char *name, idemd_tenant_t *out) {
  static const char *const sql[2] = {tenant_by_name_sql, tenant_by_name_sql};
  /* The listing's row, without its count of keys. */
  struct query q = {IDEMD_SQL_TENANT_BY_NAME, sql, {TEXT(name)}, 1, got_tenant,
                    {NULL, out, NULL, 1, 0}};
  int rc = read_rows(t, &q);

  if (rc == IDEM_OK && q.rows.n == 0)
    rc = IDEM_ENOTFOUND;
  if (rc != IDEM_OK)
    memset(out, 0, sizeof *out);
  return rc;
}

int idemd_tenant_list(idemd_tenants_t *t, idemd_tenant_t *out, int max, int *n) {
  static const char *const sql[2] = {list_tenants_sql, list_tenants_sql};
  struct query q = {IDEMD_SQL_TENANT_LIST,    sql, {NUM(max)}, 1, got_tenant,
                    {NULL, out, NULL, max, 0}};
  int rc = max > 0 ? read_rows(t, &q) : IDEM_EINVAL;

  *n = rc == IDEM_OK ? q.rows.n : 0;
  return rc;
}

int idemd_key_list(idemd_tenants_t *t, const char *tenant, idemd_api_key_t *out, int max,
                   int *n) {
  struct query q = {
      IDEMD_SQL_KEY_LIST,       list_keys_sql, {TEXT(tenant), NUM(max)}, 2, got_key,
      {out, NULL, NULL, max, 0}};
  int rc = max > 0 ? read_rows(t, &q) : IDEM_EINVAL;

  *n = rc == IDEM_OK ? q.rows.n : 0;
  return rc;
}

/* ---- Changes -------------------------------------------------------------
 *
 * Each is one write, then counted in the change file (bump()), so that it
 * holds for every process once it returns; on PostgreSQL the write sends
 * its NOTIFY (changed_fn()), and holds on each instance once that
 * arrives. A write that failed may still
 * have committed (the connection broke after COMMIT): it is counted too,
 * which at worst empties the caches once more. */

static int got_ids(void *arg, const char *const *cols) {
  idemd_api_key_t *k = arg;
  k->id = num(cols[0]);
  k->tenant_id = num(cols[1]);
  return IDEM_OK;
}

/* Inserts `k` for the tenant named `tenant`: IDEM_ENOTFOUND when none. */
static int insert_key(idem_tx_t *tx, const char *tenant, idemd_api_key_t *k) {
  idemd_sql_param_t p[5] = {TEXT(k->name), TEXT(k->lookup),
                            IDEMD_SQL_BYTES(k->hash, sizeof k->hash), NUM(k->created_at),
                            TEXT(tenant)};
  int rc;

  k->id = k->tenant_id = 0;
  rc = idemd_sql_run(tx, IDEMD_SQL_KEY_INSERT, insert_key_sql, p, 5, got_ids, k, NULL);
  return rc == IDEM_OK && k->id == 0 ? IDEM_ENOTFOUND : rc;
}

struct create {
  idemd_tenant_t *tenant;
  idemd_api_key_t *key;
};

static int got_id(void *arg, const char *const *cols) {
  *(int64_t *)arg = num(cols[0]);
  return IDEM_OK;
}

static int create_fn(void *arg, idem_tx_t *tx) {
  struct create *c = arg;
  idemd_sql_param_t p[2] = {TEXT(c->tenant->name), NUM(c->tenant->created_at)};
  int rc;

  c->tenant->id = 0;
  rc = idemd_sql_run(tx, IDEMD_SQL_TENANT_INSERT, insert_tenant_sql, p, 2, got_id,
                     &c->tenant->id, NULL);
  return rc == IDEM_OK ? insert_key(tx, c->tenant->name, c->key) : rc;
}

struct changed {
  int (*fn)(void *, idem_tx_t *);
  void *arg;
};

/* A change's write; on PostgreSQL with its NOTIFY, sent at its commit. */
static int changed_fn(void *arg, idem_tx_t *tx) {
  struct changed *c = arg;
  int rc = c->fn(c->arg, tx);

  if (rc == IDEM_OK && !idemd_sql_is_sqlite(tx))
    rc = idemd_sql_run(tx, IDEMD_SQL_COUNT, "SELECT pg_notify('" TENANTS_CHANNEL "', '')",
                       NULL, 0, NULL, NULL, NULL);
  return rc;
}

/* Runs `fn` in a write and counts it in the change file unless `rc` is
 * `unchanged`, an answer that means nothing was written. */
static int change(idemd_tenants_t *t, int (*fn)(void *, idem_tx_t *), void *arg,
                  int unchanged) {
  struct changed c = {fn, arg};
  idem_effect_t e = {changed_fn, &c};
  int rc = idem_store_write(t->store, &e);

  if (rc != unchanged) {
    if (t->watched) /* this handle's cache at once; others' at the NOTIFY */
      atomic_fetch_add(&t->notified, 1);
    bump(t);
  }
  return rc;
}

int idemd_tenant_create(idemd_tenants_t *t, idemd_tenant_t *tenant,
                        idemd_api_key_t *key) {
  struct create c = {tenant, key};
  return change(t, create_fn, &c, IDEM_EEXIST);
}

struct named {
  const char *tenant, *name;
  int64_t num;
  idemd_api_key_t *key;
};

static int set_disabled_fn(void *arg, idem_tx_t *tx) {
  struct named *a = arg;
  idemd_sql_param_t p[2] = {NUM(a->num), TEXT(a->tenant)};
  int changes = 0;
  int rc = idemd_sql_run(tx, IDEMD_SQL_TENANT_SET_DISABLED, set_disabled_sql, p, 2, NULL,
                         NULL, &changes);
  return rc == IDEM_OK && changes == 0 ? IDEM_ENOTFOUND : rc;
}

int idemd_tenant_set_disabled(idemd_tenants_t *t, const char *name, int disabled) {
  struct named a = {name, NULL, disabled != 0, NULL};
  return change(t, set_disabled_fn, &a, IDEM_ENOTFOUND);
}

static int add_fn(void *arg, idem_tx_t *tx) {
  struct named *a = arg;
  return insert_key(tx, a->tenant, a->key);
}

int idemd_key_add(idemd_tenants_t *t, const char *tenant, idemd_api_key_t *key) {
  struct named a = {tenant, NULL, 0, key};
  return change(t, add_fn, &a, IDEM_ENOTFOUND);
}

static int revoke_fn(void *arg, idem_tx_t *tx) {
  struct named *a = arg;
  idemd_sql_param_t p[3] = {NUM(idem_tx_now_ms(tx)), TEXT(a->name), TEXT(a->tenant)};
  int changes = 0;
  int rc =
      idemd_sql_run(tx, IDEMD_SQL_KEY_REVOKE, revoke_sql, p, 3, NULL, NULL, &changes);
  return rc == IDEM_OK && changes == 0 ? IDEM_ENOTFOUND : rc;
}

int idemd_key_revoke(idemd_tenants_t *t, const char *tenant, const char *name) {
  struct named a = {tenant, name, 0, NULL};
  return change(t, revoke_fn, &a, IDEM_ENOTFOUND);
}

static int replace_all_fn(void *arg, idem_tx_t *tx) {
  struct named *a = arg;
  idemd_sql_param_t p[2] = {NUM(idem_tx_now_ms(tx)), TEXT(a->tenant)};
  int rc =
      idemd_sql_run(tx, IDEMD_SQL_KEY_REVOKE_ALL, revoke_all_sql, p, 2, NULL, NULL, NULL);
  return rc == IDEM_OK ? insert_key(tx, a->tenant, a->key) : rc;
}

int idemd_key_replace_all(idemd_tenants_t *t, const char *tenant, idemd_api_key_t *key) {
  struct named a = {tenant, NULL, 0, key};
  return change(t, replace_all_fn, &a, IDEM_ENOTFOUND);
}

/* ---- Last uses ----------------------------------------------------------- */

void idemd_key_used(idemd_tenants_t *t, int64_t key_id, int64_t now_ms) {
  uint64_t h = (uint64_t)key_id * 0x9e3779b97f4a7c15ull;

  pthread_mutex_lock(&t->use_lock);
  for (int i = 0; i < PROBES; i++) {
    struct use *u = &t->uses[(h + (uint64_t)i) % USE_SLOTS];
    if (u->key_id == 0)
      u->key_id = key_id;
    if (u->key_id == key_id) {
      if (now_ms > u->at)
        u->at = now_ms;
      break;
    }
  }
  pthread_mutex_unlock(&t->use_lock);
}

struct flush {
  int n;
  struct {
    int slot;
    int64_t key_id, at;
  } uses[USE_SLOTS];
};

static int flush_fn(void *arg, idem_tx_t *tx) {
  struct flush *f = arg;
  int rc = IDEM_OK;

  for (int i = 0; rc == IDEM_OK && i < f->n; i++) {
    idemd_sql_param_t p[2] = {NUM(f->uses[i].at), NUM(f->uses[i].key_id)};
    rc = idemd_sql_run(tx, IDEMD_SQL_KEY_USED, used_sql, p, 2, NULL, NULL, NULL);
  }
  return rc;
}

int idemd_keys_flush(idemd_tenants_t *t) {
  struct flush *f = malloc(sizeof *f);
  idem_effect_t e = {flush_fn, f};
  int rc = IDEM_OK;

  if (f == NULL)
    return IDEM_ENOMEM;
  f->n = 0;
  pthread_mutex_lock(&t->use_lock);
  for (int i = 0; i < USE_SLOTS; i++) {
    struct use *u = &t->uses[i];
    if (u->key_id != 0 && u->at > u->written_at) {
      f->uses[f->n].slot = i;
      f->uses[f->n].key_id = u->key_id;
      f->uses[f->n++].at = u->at;
    }
  }
  pthread_mutex_unlock(&t->use_lock);
  if (f->n > 0)
    rc = idem_store_write(t->store, &e);
  if (rc == IDEM_OK) {
    /* Written: a slot not used since is free again. (A key whose probe
     * passed it may then take a second slot: both are written, and the
     * later time wins in the table.) */
    pthread_mutex_lock(&t->use_lock);
    for (int i = 0; i < f->n; i++) {
      struct use *u = &t->uses[f->uses[i].slot];
      if (u->key_id != f->uses[i].key_id)
        continue;
      if (u->at <= f->uses[i].at)
        *u = (struct use){0};
      else
        u->written_at = f->uses[i].at;
    }
    pthread_mutex_unlock(&t->use_lock);
  }
  free(f);
  return rc;
}
