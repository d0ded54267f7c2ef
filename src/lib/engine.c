/* The idempotency engine (docs/idempotency.md, section 2): the decision
 * table, the blocking loop that reads, reserves and waits around it, and
 * the same loop as steps that an event loop runs without waiting (each
 * write queued on the store, each wait parked on the key). */
#include "idem/engine.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "idem/clock.h"

#define DEFAULT_LEASE_MS (30 * 1000)
#define DEFAULT_TTL_MS (24LL * 60 * 60 * 1000)
#define DEFAULT_INFLIGHT_WAIT_MS (5 * 1000)
/* Reservations one request may lose before it gives up (IDEM_ETIMEDOUT):
 * each loss means the key changed hands in between, so this is never
 * reached in practice; it keeps a bug from spinning. */
#define MAX_RESERVATIONS 1000

struct idem_engine {
  idem_store_t *store;
  idem_engine_config_t cfg;
  atomic_int parked; /* asynchronous requests parked on a key in flight */
};

const char *idem_decision_name(idem_decision_t d) {
  switch (d) {
  case IDEM_DECIDE_RESERVE:
    return "reserve";
  case IDEM_DECIDE_EXECUTE:
    return "execute";
  case IDEM_DECIDE_REPLAY:
    return "replay";
  case IDEM_DECIDE_MISMATCH:
    return "mismatch";
  case IDEM_DECIDE_IN_FLIGHT:
    return "in_flight";
  case IDEM_DECIDE_PENDING:
    return "pending";
  }
  return "unknown";
}

/* The one place the rows of the table are written. The store's
 * reservation statement applies the same rule to the free keys (expired,
 * or failed with the same fingerprint) inside its transaction; this
 * function decides on a record read before, or on the one a lost
 * reservation reports. */
idem_decision_t idem_decide(const idem_record_t *rec, const char *fingerprint,
                            int64_t now_ms) {
  if (rec == NULL || rec->state == IDEM_STATE_NONE)
    return IDEM_DECIDE_RESERVE;
  /* An expired record is as if never seen, whatever its request was. */
  if ((rec->state == IDEM_STATE_COMPLETED || rec->state == IDEM_STATE_FAILED) &&
      rec->expires_at != 0 && rec->expires_at <= now_ms)
    return IDEM_DECIDE_RESERVE;
  /* Another request under this key: never executed, whatever its state. */
  if (fingerprint == NULL || strcmp(rec->fingerprint, fingerprint) != 0)
    return IDEM_DECIDE_MISMATCH;
  switch (rec->state) {
  case IDEM_STATE_COMPLETED:
    return IDEM_DECIDE_REPLAY;
  case IDEM_STATE_PENDING:
    return IDEM_DECIDE_PENDING;
  case IDEM_STATE_PROCESSING:
    return IDEM_DECIDE_IN_FLIGHT;
  case IDEM_STATE_FAILED: /* a definite failure left nothing behind */
  case IDEM_STATE_NONE:
    break;
  }
  return IDEM_DECIDE_RESERVE;
}

int idem_engine_new(idem_store_t *store, const idem_engine_config_t *cfg,
                    idem_engine_t **out) {
  idem_engine_t *e;

  *out = NULL;
  if (store == NULL || (cfg && (cfg->lease_ms < 0 || cfg->ttl_ms < 0)))
    return IDEM_EINVAL;
  if ((e = calloc(1, sizeof *e)) == NULL)
    return IDEM_ENOMEM;
  e->store = store;
  if (cfg)
    e->cfg = *cfg;
  if (e->cfg.lease_ms == 0)
    e->cfg.lease_ms = DEFAULT_LEASE_MS;
  if (e->cfg.ttl_ms == 0)
    e->cfg.ttl_ms = DEFAULT_TTL_MS;
  if (e->cfg.inflight_wait_ms == 0)
    e->cfg.inflight_wait_ms = DEFAULT_INFLIGHT_WAIT_MS;
  *out = e;
  return IDEM_OK;
}

void idem_engine_free(idem_engine_t *engine) { free(engine); }

idem_store_t *idem_engine_store(const idem_engine_t *engine) { return engine->store; }

/* Sets the bound of `b`'s wait for a duplicate in flight, the first time
 * it finds one. Returns the time left (at most 0: none). */
static int64_t wait_left(const idem_engine_t *e, idem_begin_t *b) {
  if (b->wait_until_ms == 0)
    b->wait_until_ms = e->cfg.inflight_wait_ms < 0
                           ? -1
                           : idem_mono_ms() + e->cfg.inflight_wait_ms;
  return b->wait_until_ms < 0 ? 0 : b->wait_until_ms - idem_mono_ms();
}

/* Waits for the key of `b`, which a request with its fingerprint holds,
 * to change since `ticket`. Returns 0 after a wait (decide again), -1
 * when the bound has passed. */
static int wait_in_flight(idem_engine_t *e, idem_begin_t *b, uint64_t ticket) {
  int64_t left = wait_left(e, b);

  if (left <= 0)
    return -1;
  if (e->cfg.on_wait)
    e->cfg.on_wait(e->cfg.on_wait_arg, 1);
  (void)idem_store_wait(e->store, &b->scope, ticket, left);
  if (e->cfg.on_wait)
    e->cfg.on_wait(e->cfg.on_wait_arg, 0);
  return 0;
}

/* Reads the record of `b`'s key and decides on it. Returns IDEM_OK and
 * `*d`, or the store's error. */
static int read_and_decide(idem_engine_t *e, const idem_begin_t *b, idem_record_t *rec,
                           idem_decision_t *d) {
  int64_t now = idem_now_ms();
  int rc;

  idem_record_reset(rec);
  /* The read is a shortcut: a finished key is answered without the
   * write lock. The reservation is still the only way to own a key. */
  rc = idem_store_lookup(e->store, &b->scope, now, rec);
  if (rc == IDEM_ENOTFOUND) {
    *d = IDEM_DECIDE_RESERVE;
    return IDEM_OK;
  }
  if (rc == IDEM_OK)
    *d = idem_decide(rec, b->fingerprint, now);
  return rc;
}

/* The reservation of `b`'s key, now. */
static idem_reserve_t reservation(const idem_engine_t *e, const idem_begin_t *b) {
  return (idem_reserve_t){.scope = b->scope,
                          .fingerprint = b->fingerprint,
                          .correlation_id = b->correlation_id ? b->correlation_id : "",
                          .now_ms = idem_now_ms(),
                          .lease_ms = e->cfg.lease_ms,
                          .ttl_ms = e->cfg.ttl_ms,
                          .resource_id = b->resource_id,
                          .effect = b->effect,
                          .outcome = b->outcome};
}

/* What a reservation that was written says: EXECUTE when it won the key;
 * else the decision on the record it reported (RESERVE again when that
 * record freed the key in between). */
static idem_decision_t reserved_decision(const idem_reserve_t *req,
                                         idem_reserve_result_t result,
                                         const idem_record_t *rec) {
  if (result == IDEM_RESERVE_WON)
    return IDEM_DECIDE_EXECUTE;
  return idem_decide(rec, req->fingerprint, req->now_ms);
}

int idem_engine_begin(idem_engine_t *e, idem_begin_t *b, idem_record_t *rec,
                      idem_decision_t *decision) {
  int prepared = b->prepare == NULL;
  int read = !b->skip_read;
  int rc;

  if (b->fingerprint == NULL)
    return IDEM_EINVAL;
  /* Bounded: each pass answers, waits for a change, or follows a record
   * that changed hands between the read and the reservation. */
  for (int pass = 0; pass < MAX_RESERVATIONS; pass++) {
    /* Taken before the read, so a completion just after it still wakes
     * the wait below. */
    uint64_t ticket = idem_store_watch(e->store, &b->scope);
    idem_decision_t d = IDEM_DECIDE_RESERVE;

    if (read && (rc = read_and_decide(e, b, rec, &d)) != IDEM_OK)
      return rc;
    read = 1;
    if (d == IDEM_DECIDE_RESERVE) {
      idem_reserve_result_t result = IDEM_RESERVE_EXISTS;
      idem_reserve_t req;

      idem_record_reset(rec);
      if (!prepared) {
        if ((rc = b->prepare(b->arg)) != IDEM_OK)
          return rc;
        prepared = 1;
      }
      req = reservation(e, b);
      if ((rc = idem_store_reserve(e->store, &req, rec, &result)) != IDEM_OK)
        return rc;
      /* Lost: another request won it between the read and the
       * reservation; decide on the record it reported. */
      if ((d = reserved_decision(&req, result, rec)) == IDEM_DECIDE_RESERVE)
        continue;
    }
    if (d == IDEM_DECIDE_IN_FLIGHT && wait_in_flight(e, b, ticket) == 0)
      continue;
    *decision = d;
    return IDEM_OK;
  }
  idem_record_reset(rec);
  return IDEM_ETIMEDOUT;
}

int idem_engine_complete(idem_engine_t *e, const idem_record_t *rec,
                         const idem_outcome_t *out, const idem_effect_t *effect) {
  idem_complete_t c;

  if (rec == NULL || out == NULL)
    return IDEM_EINVAL;
  c = (idem_complete_t){
      .scope = {.tenant_id = rec->tenant_id, .operation = rec->operation, .key = rec->key},
      .owner_token = rec->owner_token,
      .now_ms = idem_now_ms(),
      .ttl_ms = e->cfg.ttl_ms,
      .outcome = *out,
      .row = rec->row};
  if (effect)
    c.effect = *effect;
  return idem_store_complete(e->store, &c);
}

int idem_engine_release(idem_engine_t *e, const idem_record_t *rec) {
  idem_outcome_t failed = {.state = IDEM_STATE_FAILED};
  return idem_engine_complete(e, rec, &failed, NULL);
}

/* The asynchronous form. A request goes through these stages; each
 * IDEM_EAGAIN leaves it in one, and its wake-up brings it back to
 * idem_engine_begin_async(), on its caller's thread, which goes on from
 * there. */
enum async_stage {
  ASYNC_DECIDING = 0, /* on the caller's thread */
  ASYNC_RESERVING,    /* a reservation queued on the store */
  ASYNC_PARKED,       /* parked on a key in flight */
  ASYNC_COMPLETING    /* a completion queued on the store */
};

#define ASYNC_OF(ptr, member) ((idem_async_t *)((char *)(ptr) - offsetof(idem_async_t, member)))

/* On a store thread: the reservation is written (or failed). A won key,
 * or one whose record settles the request, is decided here, so that the
 * caller may act on it without a trip to its own thread. */
static void async_reserved(void *arg, int rc) {
  idem_async_t *a = arg;

  a->rc = rc;
  if (rc == IDEM_OK) {
    idem_decision_t d = reserved_decision(&a->priv_.write.reserve, a->priv_.result, &a->rec);
    /* In flight: a wait needs a ticket taken before a fresh read; freed
     * in between: another reservation. Both on the caller's thread. */
    if (d != IDEM_DECIDE_IN_FLIGHT && d != IDEM_DECIDE_RESERVE)
      a->decision = d;
  }
  if (rc != IDEM_OK || a->decision != 0)
    a->priv_.stage = ASYNC_DECIDING; /* decided: a completion may follow at once */
  a->wake(a);
}

static void async_completed(void *arg, int rc) {
  idem_async_t *a = arg;
  a->rc = rc;
  a->wake(a);
}

/* From the thread that changed the key or expired the wait. */
static void async_unparked(idem_store_waiter_t *w, int timed_out) {
  idem_async_t *a = ASYNC_OF(w, priv_.waiter);
  (void)timed_out; /* the next pass finds the bound passed */
  atomic_fetch_sub_explicit(&a->priv_.engine->parked, 1, memory_order_relaxed);
  a->wake(a);
}

static void async_suspend(idem_async_t *a) {
  if (a->suspend)
    a->suspend(a);
}

/* Queues the reservation of `a`'s key. Returns IDEM_EAGAIN (the wake-up
 * follows, also when the store refused it at once), or prepare()'s
 * error. */
static int async_reserve(idem_engine_t *e, idem_async_t *a) {
  int rc;

  idem_record_reset(&a->rec);
  if (!a->priv_.prepared) {
    if ((rc = a->begin.prepare(a->begin.arg)) != IDEM_OK)
      return rc;
    a->priv_.prepared = 1;
  }
  a->priv_.reservations++;
  a->priv_.write.reserve = reservation(e, &a->begin);
  a->priv_.result = IDEM_RESERVE_EXISTS;
  a->priv_.stage = ASYNC_RESERVING;
  async_suspend(a);
  rc = idem_store_reserve_async(e->store, &a->priv_.write.reserve, &a->rec,
                                &a->priv_.result, async_reserved, a);
  if (rc != IDEM_OK)
    async_reserved(a, rc); /* not queued: as a failed write */
  return IDEM_EAGAIN;
}

/* Parks `a` until its key changes since `ticket` or its wait ends.
 * Returns IDEM_EAGAIN. */
static int async_park(idem_engine_t *e, idem_async_t *a, uint64_t ticket) {
  idem_store_waiter_t *w = &a->priv_.waiter;

  idem_record_reset(&a->rec);
  *w = (idem_store_waiter_t){.wake = async_unparked, .deadline_ms = a->begin.wait_until_ms};
  a->priv_.stage = ASYNC_PARKED;
  atomic_fetch_add_explicit(&e->parked, 1, memory_order_relaxed);
  async_suspend(a); /* before parking: a wake-up may follow at once */
  if (idem_store_park(e->store, &a->begin.scope, ticket, w) != 0)
    async_unparked(w, 0); /* it changed meanwhile: look again */
  return IDEM_EAGAIN;
}

/* The passes of the blocking loop, each ending where it would wait. */
static int async_run(idem_engine_t *e, idem_async_t *a) {
  for (int pass = 0; pass < MAX_RESERVATIONS && a->priv_.reservations < MAX_RESERVATIONS;
       pass++) {
    uint64_t ticket = idem_store_watch(e->store, &a->begin.scope);
    idem_decision_t d = IDEM_DECIDE_RESERVE;
    int rc;

    if (a->priv_.read && (rc = read_and_decide(e, &a->begin, &a->rec, &d)) != IDEM_OK)
      return rc;
    a->priv_.read = 1;
    if (d == IDEM_DECIDE_RESERVE)
      return async_reserve(e, a);
    if (d == IDEM_DECIDE_IN_FLIGHT && wait_left(e, &a->begin) > 0) {
      /* Changed since the read: read again now, rather than park. */
      if (idem_store_watch(e->store, &a->begin.scope) != ticket)
        continue;
      return async_park(e, a, ticket);
    }
    a->decision = d;
    return IDEM_OK;
  }
  idem_record_reset(&a->rec);
  return IDEM_ETIMEDOUT;
}

int idem_engine_begin_async(idem_engine_t *e, idem_async_t *a) {
  switch (a->priv_.stage) {
  case ASYNC_DECIDING:
    if (a->priv_.engine != NULL)
      break; /* called again after a decision or an error */
    if (!idem_store_local_reads(e->store) || !idem_store_async_writes(e->store))
      return IDEM_ENOTSUP;
    if (a->begin.fingerprint == NULL || a->wake == NULL)
      return IDEM_EINVAL;
    a->priv_.engine = e;
    a->priv_.read = !a->begin.skip_read;
    a->priv_.prepared = a->begin.prepare == NULL;
    a->decision = 0;
    a->rc = IDEM_OK;
    return async_run(e, a);
  case ASYNC_RESERVING: /* written, and not decided by it */
    a->priv_.stage = ASYNC_DECIDING;
    return async_run(e, a);
  case ASYNC_PARKED:
    a->priv_.stage = ASYNC_DECIDING;
    return async_run(e, a);
  case ASYNC_COMPLETING:
    a->priv_.stage = ASYNC_DECIDING;
    if (a->rc != IDEM_ELOST)
      return IDEM_EINVAL; /* completed: nothing left to decide */
    /* Our lease ran out and another owner took the key over: decide
     * again, from a read. */
    idem_record_reset(&a->rec);
    a->decision = 0;
    a->rc = IDEM_OK;
    a->priv_.read = 1;
    return async_run(e, a);
  }
  return a->decision != 0 ? IDEM_OK : a->rc != IDEM_OK ? a->rc : IDEM_EINVAL;
}

int idem_engine_complete_async(idem_engine_t *e, idem_async_t *a, const idem_outcome_t *out,
                               const idem_effect_t *effect) {
  const idem_record_t *rec = &a->rec;
  idem_complete_t *c = &a->priv_.write.complete;
  int rc;

  if (out == NULL || a->decision != IDEM_DECIDE_EXECUTE || a->priv_.stage != ASYNC_DECIDING)
    return IDEM_EINVAL;
  *c = (idem_complete_t){
      .scope = a->begin.scope,
      .owner_token = rec->owner_token,
      .now_ms = idem_now_ms(),
      .ttl_ms = e->cfg.ttl_ms,
      .outcome = *out,
      .row = rec->row};
  if (effect)
    c->effect = *effect;
  a->priv_.stage = ASYNC_COMPLETING;
  rc = idem_store_complete_async(e->store, c, async_completed, a);
  if (rc != IDEM_OK) {
    a->priv_.stage = ASYNC_DECIDING;
    return rc;
  }
  return IDEM_EAGAIN;
}

int idem_engine_expire(idem_engine_t *e, int64_t now_ms) {
  /* One parking now is seen at the next call. */
  if (atomic_load_explicit(&e->parked, memory_order_relaxed) == 0)
    return 0;
  return idem_store_expire_waiters(e->store, now_ms);
}

int idem_engine_parked(const idem_engine_t *e) {
  return atomic_load_explicit(&((idem_engine_t *)e)->parked, memory_order_relaxed);
}
