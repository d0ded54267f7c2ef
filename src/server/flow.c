/* The idempotent request flow (SPEC section 2). */
#include "server/flow.h"

#include <stdlib.h>
#include <string.h>

#include "idem/clock.h"
#include "server/reply.h"

/* Sends a stored response again, marked as a replay. */
static enum MHD_Result replay(idemd_request_t *r, const idem_record_t *rec,
                              idemd_outcome_t outcome) {
  idemd_reply_headers_t h = {.location = rec->location, .replayed = 1};
  char *body = idemd_mark_replayed(rec->response_body);
  enum MHD_Result ret;

  if (body == NULL)
    return idemd_reply_store_error(r, IDEM_ENOMEM);
  r->outcome = outcome;
  ret = idemd_reply(r, rec->response_status, body, strlen(body), &h);
  free(body);
  return ret;
}

/* Sends the first answer of a request that won its key. */
static enum MHD_Result answer_new(idemd_request_t *r, int status,
                                  const char *body, const char *location,
                                  idem_state_t state) {
  idemd_reply_headers_t h = {.location = location};
  if (status == 503)
    h.retry_after = 1;
  r->outcome = state == IDEM_STATE_PENDING ? OUTCOME_PENDING : OUTCOME_NEW;
  return idemd_reply(r, status, body, strlen(body), &h);
}

enum MHD_Result idemd_flow_run(idemd_request_t *r, const idemd_effect_t *e) {
  idemd_server_t *srv = r->srv;
  idem_scope_t scope = {r->tenant.id, e->operation, r->key};
  int64_t deadline = idem_mono_ms() + srv->cfg.inflight_wait_ms;
  idem_record_t rec = {0};
  enum MHD_Result ret;
  int prepared = e->prepare == NULL;
  int rc;

  /* Bounded: each pass either answers, waits for a change, or follows a
   * record that changed hands; a handful of passes is plenty. */
  for (int pass = 0; pass < 1000; pass++) {
    uint64_t ticket = idem_store_watch(srv->store, &scope);
    idem_reserve_result_t result = IDEM_RESERVE_EXISTS;

    /* Fast path: a completed key is answered from a read, without taking
     * the write lock. The reservation below is still the only way in. */
    rc = idem_store_lookup(srv->store, &scope, idem_now_ms(), &rec);
    if (rc == IDEM_ENOTFOUND ||
        (rc == IDEM_OK && rec.state == IDEM_STATE_FAILED &&
         strcmp(rec.fingerprint, e->fingerprint) == 0)) {
      if (!prepared) {
        if ((rc = e->prepare(e->ctx)) != IDEM_OK) {
          idem_record_reset(&rec);
          return idemd_reply_store_error(r, rc);
        }
        prepared = 1;
      }
      idem_reserve_t req = {
          .scope = scope,
          .fingerprint = e->fingerprint,
          .correlation_id = r->request_id,
          .now_ms = idem_now_ms(),
          .lease_ms = srv->cfg.lease_ms,
          .ttl_ms = srv->cfg.key_ttl_ms,
          .resource = e->resource,
          .enqueue_outbox = e->enqueue_outbox,
          .outcome = e->outcome,
      };
      rc = idem_store_reserve(srv->store, &req, &rec, &result);
    }
    if (rc != IDEM_OK) {
      idem_record_reset(&rec);
      return idemd_reply_store_error(r, rc);
    }

    if (result == IDEM_RESERVE_WON) {
      if (e->execute) {
        idem_outcome_t out = {0};
        idem_complete_t c = {.scope = scope, .owner_token = rec.owner_token};
        e->execute(e->ctx, &rec, &out);
        c.now_ms = idem_now_ms();
        c.ttl_ms = srv->cfg.key_ttl_ms;
        c.outcome = out;
        rc = idem_store_complete(srv->store, &c);
        if (rc == IDEM_ELOST)
          continue; /* our lease ran out and another owner took over */
        idem_record_reset(&rec);
        if (rc != IDEM_OK)
          return idemd_reply_store_error(r, rc);
        return answer_new(r, out.status, out.body, out.location, out.state);
      }
      ret = answer_new(r, rec.response_status, rec.response_body, rec.location,
                       rec.state);
      idem_record_reset(&rec);
      return ret;
    }

    /* The key is held by an earlier request. */
    if (strcmp(rec.fingerprint, e->fingerprint) != 0) {
      idem_record_reset(&rec);
      r->outcome = OUTCOME_MISMATCH;
      return idemd_reply_error(
          r, 422, "Idempotency-Key was already used with a different request", NULL);
    }
    switch (rec.state) {
    case IDEM_STATE_COMPLETED:
      ret = replay(r, &rec, OUTCOME_REPLAY);
      idem_record_reset(&rec);
      return ret;
    case IDEM_STATE_PENDING:
      ret = replay(r, &rec, OUTCOME_PENDING);
      idem_record_reset(&rec);
      return ret;
    case IDEM_STATE_PROCESSING: {
      int64_t left = deadline - idem_mono_ms();
      idem_record_reset(&rec);
      if (left <= 0) {
        idemd_reply_headers_t h = {.retry_after = 1};
        atomic_fetch_add_explicit(&srv->metrics.inflight_timeouts, 1,
                                  memory_order_relaxed);
        r->outcome = OUTCOME_IN_FLIGHT;
        return idemd_reply_error(
            r, 409, "a request with this Idempotency-Key is still being processed",
            &h);
      }
      (void)idem_store_wait(srv->store, &scope, ticket, left);
      continue;
    }
    default:
      /* failed with our fingerprint: the next pass takes it over */
      idem_record_reset(&rec);
      continue;
    }
  }
  return idemd_reply_store_error(r, IDEM_ETIMEDOUT);
}
