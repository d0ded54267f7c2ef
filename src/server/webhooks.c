/* POST /webhooks/provider: the provider's events (docs/payments.md,
 * "Webhooks"). No API key: the signature authenticates. In the event
 * thread, before anything else is spent on it, the body's size, the
 * Idem-Psp-Signature (HMAC under --provider-webhook-secret, within 5
 * minutes, provider/webhook.h) and the event itself are checked, so a
 * flood of forged events costs an HMAC each and never reaches a worker or
 * the store. A valid event is applied by a worker in one transaction with
 * the insert of its id into the processed-events table, through the one
 * path that settles a pending payment or refund (provider/settle.h), with
 * the event's id as the audit row's actor. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/events.h"
#include "idem/clock.h"
#include "provider/settle.h"
#include "provider/webhook.h"
#include "server/log.h"
#include "server/reply.h"
#include "server/suspend.h"

typedef struct webhook_call {
  idem_webhook_event_t ev;
} webhook_call_t;

static void count(idemd_request_t *r, idemd_webhook_result_t result) {
  atomic_fetch_add_explicit(&r->srv->metrics.webhooks[result], 1, memory_order_relaxed);
}

/* 200 {"status": what became of the event}. */
static enum MHD_Result answer(idemd_request_t *r, idemd_webhook_result_t result) {
  static const char *const bodies[] = {
      [WEBHOOK_APPLIED] = "{\"status\":\"applied\"}",
      [WEBHOOK_DUPLICATE] = "{\"status\":\"duplicate\"}",
      [WEBHOOK_IGNORED] = "{\"status\":\"ignored\"}",
      [WEBHOOK_AMOUNT_MISMATCH] = "{\"status\":\"ignored\"}",
  };
  count(r, result);
  r->outcome = result == WEBHOOK_APPLIED     ? OUTCOME_NEW
               : result == WEBHOOK_DUPLICATE ? OUTCOME_REPLAY
                                             : OUTCOME_READ;
  return idemd_reply(r, 200, bodies[result], strlen(bodies[result]), NULL);
}

static enum MHD_Result refuse(idemd_request_t *r, idemd_webhook_result_t result,
                              int status, const char *message) {
  count(r, result);
  r->outcome = OUTCOME_INVALID;
  return idemd_reply_error(r, status, message, NULL);
}

/* 503 with Retry-After: the provider sends the event again (it retries
 * until a 2xx), and nothing was applied. */
static enum MHD_Result later(idemd_request_t *r, idemd_webhook_result_t result) {
  idemd_reply_headers_t h = {.retry_after = 1};
  count(r, result);
  r->outcome = result == WEBHOOK_BUSY ? OUTCOME_IN_FLIGHT : OUTCOME_ERROR;
  return idemd_reply_error(r, 503,
                           result == WEBHOOK_BUSY
                               ? "the payment or refund is being settled now; send the "
                                 "event again"
                               : "the store failed; send the event again",
                           &h);
}

/* In a worker: the event applied, or found applied before, or for nothing
 * pending, or for another amount than the one pending. */
static enum MHD_Result apply(idemd_request_t *r) {
  const webhook_call_t *call = r->call;
  const idem_webhook_event_t *ev = &call->ev;
  idemd_server_t *srv = r->srv;
  idemd_pending_t p;
  idemd_claim_t found;
  int status = 0;
  int rc = idemd_settle_claim(srv->store, ev->refund, 0, ev->key, ev, 0,
                              srv->cfg.lease_ms, &p, &found);

  if (rc != IDEM_OK) {
    idemd_log_event("error", "a provider event could not be applied", "event", ev->id,
                    "error", idem_store_last_error(), NULL);
    return later(r, WEBHOOK_ERROR);
  }
  if (found == IDEMD_CLAIM_DUPLICATE)
    return answer(r, WEBHOOK_DUPLICATE);
  if (found == IDEMD_CLAIM_BUSY)
    return later(r, WEBHOOK_BUSY);
  if (found == IDEMD_CLAIM_MISMATCH) {
    /* Signed by the provider, yet not what we asked of it: nothing
     * changed but the audit row the claim wrote; the reconciler's
     * look-up settles it (docs/idempotency.md, section 4.6). */
    char theirs[24], ours[24];
    snprintf(theirs, sizeof theirs, "%lld", (long long)ev->amount);
    snprintf(ours, sizeof ours, "%lld", (long long)p.amount);
    idemd_log_event(
        "warn", "a provider event's amount differs from what we hold; ignored", "event",
        ev->id, "resource", ev->key, "event_amount", theirs, "amount", ours, NULL);
    return answer(r, WEBHOOK_AMOUNT_MISMATCH);
  }
  if (found != IDEMD_CLAIM_TAKEN)
    return answer(r, WEBHOOK_IGNORED);

  idem_charge_result_t res = {.outcome = ev->succeeded ? IDEM_CHARGE_SUCCEEDED
                                                       : IDEM_CHARGE_DECLINED};
  idemd_event_t seen = {ev->id, idem_webhook_type(ev), p.rec.tenant_id, ev->key};
  idem_effect_t also = {idemd_event_record, &seen};
  idemd_actor_t who = {ev->id, idem_webhook_type(ev)};
  idem_copy(res.reference, sizeof res.reference, ev->provider_ref);
  rc = idemd_settle(srv->store, &p.rec, p.body, &res, &who, &also, srv->cfg.key_ttl_ms,
                    &status);
  idemd_settle_reset(&p);
  if (rc == IDEM_OK)
    return answer(r, WEBHOOK_APPLIED);
  if (rc == IDEM_EEXIST) /* the same event applied meanwhile */
    return answer(r, WEBHOOK_DUPLICATE);
  if (rc == IDEM_ELOST) /* taken over by another settler since the claim */
    return later(r, WEBHOOK_BUSY);
  idemd_log_event(
      "error", "a provider event could not be applied", "event", ev->id, "error",
      rc == IDEM_EJSON ? "the stored resource is unreadable" : idem_store_last_error(),
      NULL);
  return later(r, WEBHOOK_ERROR);
}

enum MHD_Result idemd_webhook_receive(idemd_request_t *r) {
  const char *sig =
      MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, "Idem-Psp-Signature");
  const char *body = r->body ? r->body : "", *why = NULL;
  webhook_call_t *call;

  if (r->body_too_large || r->body_len > IDEM_WEBHOOK_MAX_BODY)
    return refuse(r, WEBHOOK_TOO_LARGE, 413, "request body is larger than 8 KiB");
  switch (idem_webhook_verify(r->srv->webhook_mac, sig, body, r->body_len,
                              idem_now_ms() / 1000)) {
  case IDEM_WEBHOOK_OK:
    break;
  case IDEM_WEBHOOK_UNSIGNED:
    return refuse(r, WEBHOOK_UNSIGNED, 400,
                  "Idem-Psp-Signature must be t=<unix seconds>,v1=<hex HMAC-SHA256>");
  case IDEM_WEBHOOK_STALE:
    return refuse(r, WEBHOOK_STALE, 400,
                  "Idem-Psp-Signature's time is more than 5 minutes away from ours");
  default:
    return refuse(r, WEBHOOK_FORGED, 400, "Idem-Psp-Signature does not match the body");
  }
  if ((call = calloc(1, sizeof *call)) == NULL)
    return idemd_reply_store_error(r, IDEM_ENOMEM);
  idemd_request_own(r, call, free);
  if (idem_webhook_parse(body, r->body_len, &call->ev, &why) != 0)
    return refuse(r, WEBHOOK_MALFORMED, 400, why ? why : "the event is malformed");
  return idemd_defer(r, apply);
}
