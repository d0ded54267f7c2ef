/* The idempotency engine: the rules of docs/idempotency.md, section 2.4
 * ("What a request with a key gets"), decided in one place, over a store,
 * with no HTTP. A server calls idem_engine_begin() with a request's scope and
 * fingerprint and does what the decision says: execute the request (it
 * won the key) and then idem_engine_complete() or idem_engine_release();
 * or answer the stored response (replay, pending); or refuse it
 * (mismatch, in flight). */
#ifndef IDEM_ENGINE_H
#define IDEM_ENGINE_H

#include <stdint.h>

#include "idem/error.h"
#include "idem/record.h"
#include "idem/store.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a keyed request does next. */
typedef enum idem_decision {
  /* Only from idem_decide(): the key is free (never seen, expired, or
   * failed with this fingerprint); try to win it with a reservation. */
  IDEM_DECIDE_RESERVE = 1,
  /* The key is this request's: execute it, then complete or release the
   * record (its owner token is in the record). */
  IDEM_DECIDE_EXECUTE,
  /* Completed with this fingerprint: answer the stored status, body and
   * Location, marked as a replay. */
  IDEM_DECIDE_REPLAY,
  /* Held by a request with another fingerprint: refuse (422); nothing is
   * executed. */
  IDEM_DECIDE_MISMATCH,
  /* Processing with this fingerprint: wait for it (bounded), then decide
   * again; at the bound, refuse (409, Retry-After). */
  IDEM_DECIDE_IN_FLIGHT,
  /* The outcome of the first execution is unknown (with a provider):
   * answer the stored current answer (202); never execute again. */
  IDEM_DECIDE_PENDING
} idem_decision_t;

/* "reserve", "execute", "replay", "mismatch", "in_flight", "pending", or
 * "unknown". */
const char *idem_decision_name(idem_decision_t d);

/* The decision table: what a request with `fingerprint` does about the
 * record `rec` that holds its key (NULL: none) at `now_ms`. Pure: it reads
 * only its arguments. A completed or failed record whose expires_at is at
 * or before `now_ms` counts as none. Never returns IDEM_DECIDE_EXECUTE:
 * only a won reservation makes a request the owner. */
idem_decision_t idem_decide(const idem_record_t *rec, const char *fingerprint,
                            int64_t now_ms);

typedef struct idem_engine idem_engine_t;

typedef struct idem_engine_config {
  int64_t lease_ms;         /* how long an owner keeps a processing record; 0: 30 s */
  int64_t ttl_ms;           /* lifetime of completed and failed records; 0: 24 h */
  int64_t inflight_wait_ms; /* how long a duplicate waits for its original; 0: 5 s,
                             * negative: not at all */
  /* Optional: called around each blocking wait for a duplicate in flight
   * (waiting 1, then 0), e.g. so a thread pool does not count the thread
   * as busy. */
  void (*on_wait)(void *arg, int waiting);
  void *on_wait_arg;
} idem_engine_config_t;

/* Makes an engine over `store`, which it borrows (close the store after
 * the engine). `cfg` may be NULL for the defaults. Returns IDEM_OK and
 * `*out` (free with idem_engine_free()), IDEM_EINVAL for a negative lease
 * or TTL, or IDEM_ENOMEM. */
IDEM_WARN_UNUSED int idem_engine_new(idem_store_t *store,
                                     const idem_engine_config_t *cfg,
                                     idem_engine_t **out);

/* Frees the engine (not its store). NULL is fine. */
void idem_engine_free(idem_engine_t *engine);

/* The store the engine was made over. */
idem_store_t *idem_engine_store(const idem_engine_t *engine);

/* One keyed request. Borrowed: everything it points at must stay valid
 * for the call. */
typedef struct idem_begin {
  idem_scope_t scope;
  const char *fingerprint;    /* idem_fingerprint() of the validated command */
  const char *correlation_id; /* stored with the record (a request id) */
  /* Written in the transaction that wins the key, and only then: the
   * caller's own rows (`effect`, store.h) and, for a request whose whole
   * effect is those rows, its final outcome (the record is then completed
   * at once). `resource_id` is stored with the record (what the request
   * makes, for the caller's own use). All optional. */
  idem_effect_t effect;
  const char *resource_id;
  const idem_outcome_t *outcome;
  /* Optional: called once, just before the first reservation, to fill in
   * what `resource_id`, `outcome` and the effect point at (a new id,
   * say), so a replay never pays for it. Returns IDEM_OK, or an error
   * idem_engine_begin() then returns with nothing written. */
  int (*prepare)(void *arg);
  void *arg;
  /* When a wait for a duplicate in flight ends, on the idem_mono_ms()
   * clock; negative: no wait at all. 0: the engine sets it, when the
   * request first finds its key in flight, to inflight_wait_ms from then,
   * and leaves it set, so that calling again with the same `b` (after
   * IDEM_ELOST, or from another thread) waits no longer in all. */
  int64_t wait_until_ms;
  /* 1: make the first reservation without reading the record first. For
   * a key most likely new (one a replay cache does not know): the
   * reservation reports any record there is, changing nothing, and the
   * engine decides on it, so the answer is the same, one read cheaper.
   * Later attempts always read. */
  int skip_read;
} idem_begin_t;

/* Decides request `b`, waiting (blocking this thread, at most until its
 * bound) while another request with the same fingerprint holds the key.
 * On IDEM_OK `*decision` is EXECUTE (`rec` is the won record, with its
 * owner token; or, with b->outcome, the completed record), REPLAY or
 * PENDING (`rec` holds the stored answer), MISMATCH or IN_FLIGHT (the
 * bound passed; `rec` is the record that holds the key). Any other return
 * is a store error or prepare()'s, and `*decision` is unset. `rec` must be
 * zeroed before and reset with idem_record_reset() after, either way. */
IDEM_WARN_UNUSED int idem_engine_begin(idem_engine_t *engine, idem_begin_t *b,
                                       idem_record_t *rec, idem_decision_t *decision);

/* Ends the execution of the record `rec` that idem_engine_begin() gave
 * this request (EXECUTE) with `out` (state COMPLETED or PENDING, the
 * status and body to replay) and the caller's `effect` (may be NULL:
 * none), in one transaction, and wakes the requests waiting on it.
 * Returns IDEM_ELOST, with nothing written, when the record's lease ran
 * out and another owner took it (decide again with idem_engine_begin());
 * the effect's error, with nothing written, when it fails. */
IDEM_WARN_UNUSED int idem_engine_complete(idem_engine_t *engine, const idem_record_t *rec,
                                          const idem_outcome_t *out,
                                          const idem_effect_t *effect);

/* Ends the execution of `rec` as failed before any effect: the key is
 * free again for a request with the same fingerprint (a different one
 * still gets MISMATCH until the record expires). IDEM_ELOST as above. */
IDEM_WARN_UNUSED int idem_engine_release(idem_engine_t *engine, const idem_record_t *rec);

/* One keyed request decided without a thread waiting on it, for an event
 * loop (idem_engine_begin_async()). The caller owns it: zero it, set
 * `begin`, `wake` and, optionally, `suspend` and `arg`, and keep it, and
 * everything `begin` points at, until the request is over. */
typedef struct idem_async idem_async_t;
struct idem_async {
  idem_begin_t begin;
  /* Called once after each IDEM_EAGAIN, from a store thread or the one
   * that called idem_engine_expire(), when the request can go on: call
   * idem_engine_begin_async() again (or, after a completion, read `rc`).
   * It must not wait. It may run before the call that returned
   * IDEM_EAGAIN has returned; the engine does not touch `a` once it has
   * called it. `decision` and `rc` are already set when the write it
   * waited for decided the request (a won reservation: EXECUTE), so a
   * caller may act on them on that thread (start the execution there). */
  void (*wake)(idem_async_t *a);
  /* Optional: called on the caller's thread just before the engine hands
   * `a` to another thread (a queued write, a wait), e.g. to suspend a
   * connection that `wake` then resumes. */
  void (*suspend)(idem_async_t *a);
  void *arg;
  /* What the engine found, as in idem_engine_begin(): the decision (0
   * until decided), the result of the last write, and the record (reset
   * it with idem_record_reset() when the request is over). */
  idem_decision_t decision;
  int rc;
  idem_record_t rec;
  /* The engine's own while the request goes on. */
  struct {
    idem_engine_t *engine;
    int stage;
    int reservations;
    int read;
    int prepared;
    idem_reserve_result_t result;
    idem_store_waiter_t waiter;
    union {
      idem_reserve_t reserve;
      idem_complete_t complete;
    } write;
  } priv_;
};

/* The asynchronous form of idem_engine_begin(), on a store whose reads
 * are local and whose writes have asynchronous forms (SQLite): it never
 * waits, and a wait for a duplicate in flight holds no thread. Returns
 * IDEM_OK when decided (`a->decision` and `a->rec` as in
 * idem_engine_begin()); IDEM_EAGAIN when a write or a wait is under way:
 * `a->suspend` was called, `a->wake` follows exactly once, and the caller
 * calls this again from its own thread to go on (the decision, or the
 * write's error, is returned then); IDEM_ENOTSUP at once, with nothing
 * done, on a store without both (PostgreSQL: decide in a thread that may
 * wait, with idem_engine_begin()); otherwise an error of the store or of
 * prepare(). The decision table and the rules are the blocking form's. */
IDEM_WARN_UNUSED int idem_engine_begin_async(idem_engine_t *engine, idem_async_t *a);

/* The asynchronous form of idem_engine_complete(), for a request that
 * idem_engine_begin_async() decided EXECUTE; from any thread. Returns
 * IDEM_EAGAIN when the completion is queued: `a->wake` follows once, with
 * `a->rc` IDEM_OK, IDEM_ELOST (nothing written; idem_engine_begin_async()
 * may then be called again, and decides anew), or the store's or the
 * effect's error. `out`, what it points at and `effect` must stay valid
 * until then. Any other return: nothing was queued and `wake` will not be
 * called. An outcome with state FAILED releases the key. */
IDEM_WARN_UNUSED int idem_engine_complete_async(idem_engine_t *engine, idem_async_t *a,
                                                const idem_outcome_t *out,
                                                const idem_effect_t *effect);

/* Wakes, as timed out, every request the engine parked on a duplicate in
 * flight whose wait ends at or before `now_ms` (idem_mono_ms(); INT64_MAX:
 * all of them); each then decides IN_FLIGHT. Call it often (every few
 * tens of milliseconds) while idem_engine_parked() is not 0: a wait lasts
 * that much longer than its bound. Returns how many it woke. */
int idem_engine_expire(idem_engine_t *engine, int64_t now_ms);

/* How many requests are parked on a duplicate in flight now. */
int idem_engine_parked(const idem_engine_t *engine);

#ifdef __cplusplus
}
#endif
#endif
