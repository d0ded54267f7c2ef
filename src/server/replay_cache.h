/* Replays from memory. A completed record never changes until it expires,
 * so its replay (status, body marked "replayed", Location) can be kept in
 * memory and served without touching the store. The cache is bounded in
 * bytes (least recently used entries go first) and sharded, so threads do
 * not queue on one lock. An entry past its record's expiry is a miss, as
 * the record itself would be. */
#ifndef IDEMD_REPLAY_CACHE_H
#define IDEMD_REPLAY_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "idem/record.h"

typedef struct idemd_replay_cache idemd_replay_cache_t;

/* A cached replay; `body` is malloc'd for the caller (free it). */
typedef struct idemd_replay {
  char fingerprint[IDEM_FINGERPRINT_LEN];
  int status;
  char *body;
  char location[IDEM_LOCATION_MAX + 1];
} idemd_replay_t;

/* Creates a cache holding at most about `max_bytes`. Returns NULL when
 * out of memory, or when max_bytes is 0 (no cache: every call below
 * accepts NULL and does nothing). */
idemd_replay_cache_t *idemd_replay_cache_new(size_t max_bytes);

/* Frees the cache and its entries. NULL is fine. */
void idemd_replay_cache_free(idemd_replay_cache_t *c);

/* Remembers the replay of a completed record of `scope` (everything is
 * copied). `expires_at_ms` is the record's expiry; 0 means do not cache. */
void idemd_replay_cache_put(idemd_replay_cache_t *c, const idem_scope_t *scope,
                            const char *fingerprint, int status,
                            const char *replay_body, const char *location,
                            int64_t expires_at_ms);

/* Looks `scope` up at `now_ms`. Returns 1 and fills `out` for a live
 * entry, 0 otherwise. */
int idemd_replay_cache_get(idemd_replay_cache_t *c, const idem_scope_t *scope,
                           int64_t now_ms, idemd_replay_t *out);

/* As idemd_replay_cache_put(), for a caller's own form of the replay
 * (idemd gateway's ready answer): `value` is the cache's from here, freed
 * with free_value(value) once dropped (or at once when not kept), and
 * charged `value_bytes` against the budget. */
void idemd_replay_cache_put_value(idemd_replay_cache_t *c, const idem_scope_t *scope,
                                  const char *fingerprint, int status, void *value,
                                  size_t value_bytes, void (*free_value)(void *value),
                                  int64_t expires_at_ms);

/* Looks `scope` up at `now_ms` and, for a live entry put with a value,
 * calls use(value, status, fingerprint, arg) under the entry's lock (it
 * must not wait, nor call the cache): `value` stays valid only during
 * the call. Returns what use() returned (not 0 counts as a hit), or 0
 * when there is no such entry. */
int idemd_replay_cache_use(idemd_replay_cache_t *c, const idem_scope_t *scope,
                           int64_t now_ms,
                           int (*use)(void *value, int status, const char *fingerprint,
                                      void *arg),
                           void *arg);

/* Hits so far (for /metrics). */
uint64_t idemd_replay_cache_hits(const idemd_replay_cache_t *c);

#endif
