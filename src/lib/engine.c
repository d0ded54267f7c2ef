/* The idempotency engine (docs/idempotency.md, section 2): the decision
 * table, and the blocking loop that reads, reserves and waits around it. */
#include "idem/engine.h"

#include <stdlib.h>
#include <string.h>

#include "idem/clock.h"

#define DEFAULT_LEASE_MS (30 * 1000)
#define DEFAULT_TTL_MS (24LL * 60 * 60 * 1000)
#define DEFAULT_INFLIGHT_WAIT_MS (5 * 1000)

struct idem_engine {
  idem_store_t *store;
  idem_engine_config_t cfg;
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

/* Waits for the key of `b`, which a request with its fingerprint holds,
 * to change since `ticket`. Returns 0 after a wait (decide again), -1
 * when the bound has passed. */
static int wait_in_flight(idem_engine_t *e, idem_begin_t *b, uint64_t ticket) {
  int64_t left;

  if (b->wait_until_ms == 0)
    b->wait_until_ms = e->cfg.inflight_wait_ms < 0
                           ? -1
                           : idem_mono_ms() + e->cfg.inflight_wait_ms;
  if (b->wait_until_ms < 0 || (left = b->wait_until_ms - idem_mono_ms()) <= 0)
    return -1;
  if (e->cfg.on_wait)
    e->cfg.on_wait(e->cfg.on_wait_arg, 1);
  (void)idem_store_wait(e->store, &b->scope, ticket, left);
  if (e->cfg.on_wait)
    e->cfg.on_wait(e->cfg.on_wait_arg, 0);
  return 0;
}

int idem_engine_begin(idem_engine_t *e, idem_begin_t *b, idem_record_t *rec,
                      idem_decision_t *decision) {
  int prepared = b->prepare == NULL;
  int rc;

  if (b->fingerprint == NULL)
    return IDEM_EINVAL;
  /* Bounded: each pass answers, waits for a change, or follows a record
   * that changed hands between the read and the reservation. */
  for (int pass = 0; pass < 1000; pass++) {
    /* Taken before the read, so a completion just after it still wakes
     * the wait below. */
    uint64_t ticket = idem_store_watch(e->store, &b->scope);
    int64_t now = idem_now_ms();
    idem_decision_t d;

    idem_record_reset(rec);
    /* The read is a shortcut: a finished key is answered without the
     * write lock. The reservation is still the only way to own a key. */
    rc = idem_store_lookup(e->store, &b->scope, now, rec);
    if (rc != IDEM_OK && rc != IDEM_ENOTFOUND)
      return rc;
    d = rc == IDEM_ENOTFOUND ? IDEM_DECIDE_RESERVE : idem_decide(rec, b->fingerprint, now);
    if (d == IDEM_DECIDE_RESERVE) {
      idem_reserve_result_t result = IDEM_RESERVE_EXISTS;
      idem_reserve_t req;

      idem_record_reset(rec);
      if (!prepared) {
        if ((rc = b->prepare(b->arg)) != IDEM_OK)
          return rc;
        prepared = 1;
      }
      req = (idem_reserve_t){.scope = b->scope,
                             .fingerprint = b->fingerprint,
                             .correlation_id = b->correlation_id ? b->correlation_id : "",
                             .now_ms = idem_now_ms(),
                             .lease_ms = e->cfg.lease_ms,
                             .ttl_ms = e->cfg.ttl_ms,
                             .resource = b->resource,
                             .effect = b->effect,
                             .enqueue_outbox = b->enqueue_outbox,
                             .outcome = b->outcome};
      if ((rc = idem_store_reserve(e->store, &req, rec, &result)) != IDEM_OK)
        return rc;
      if (result == IDEM_RESERVE_WON) {
        *decision = IDEM_DECIDE_EXECUTE;
        return IDEM_OK;
      }
      /* Another request won it between the read and the reservation:
       * decide on the record it reported. */
      d = idem_decide(rec, b->fingerprint, req.now_ms);
      if (d == IDEM_DECIDE_RESERVE)
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
