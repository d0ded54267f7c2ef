/* POST /payments/{id}/refunds: a refund in the three steps of a payment
 * (docs/idempotency.md, sections 4.1 and 4.5).
 * 1. reserve the key, take the refund's amount from what is left of the
 *    payment (refused, with nothing written and the key free, when the
 *    payment is unknown, not succeeded, or has less left), and insert the
 *    refund as pending with an outbox row, in one transaction;
 * 2. call the provider's refund outside any transaction, under a provider
 *    key derived from the refund (its id);
 * 3. store the outcome, the refund's new status and the payment's count of
 *    what was refunded (or give the amount back when it was declined or
 *    never sent) with the completion. */
#include <stdlib.h>
#include <string.h>

#include "data/refunds.h"
#include "idem/canon.h"
#include "idem/clock.h"
#include "idem/crypto.h"
#include "provider/refund.h"
#include "server/refund_cmd.h"
#include "server/flow.h"
#include "server/log.h"
#include "server/reply.h"

#define OPERATION "create_refund"

typedef struct refund_call {
  idemd_server_t *srv;
  idem_refund_t refund;
  int64_t want; /* 0: all that is left */
  char fingerprint[IDEM_FINGERPRINT_LEN];
  const char *key;
  const char *request_id;         /* the actor of its audit rows */
  idemd_refund_refusal_t refusal; /* why step 1 refused it */
  char *pending_body;             /* step 1's refund, made in its transaction */
  idemd_resource_t row;
  idem_settlement_t settled;
  idemd_refund_update_t update; /* step 3's */
  idemd_effect_t effect;
} refund_call_t;

static void refund_call_free(void *call) {
  refund_call_t *rc = call;
  free(rc->pending_body);
  idem_settlement_free(&rc->settled);
  free(rc);
}

/* The fingerprint names the payment as well as the command: one key sent
 * for a refund of another payment is a mismatch. */
static int fingerprint(refund_call_t *rc, json_t *cmd) {
  char *canon;
  int err;

  if (json_object_set_new(cmd, "payment_id", json_string(rc->refund.payment_id)) != 0 ||
      (canon = idem_canon_dump(cmd)) == NULL)
    return IDEM_ENOMEM;
  err = idem_fingerprint_text(OPERATION, canon, strlen(canon), rc->fingerprint);
  free(canon);
  return err;
}

/* Gives the refund its id: only when the key is to be reserved (again,
 * when a reservation lost its race and the key was free by the next). */
static int prepare(void *ctx) {
  refund_call_t *rc = ctx;
  idem_refund_t *f = &rc->refund;
  char token[25];
  int64_t now = idem_now_ms();

  /* An unknown or unsucceeded payment is refused before the write: on
   * SQLite a refused write makes the writer run its batch again, write by
   * write (docs/idempotency.md, section 4.5). Neither can become true of
   * a payment a replay's refund was made of, so no replay is refused. */
  int err = idemd_refund_precheck(rc->srv->store, rc->row.tenant_id, f->payment_id,
                                  &rc->refusal);
  if (err != IDEM_OK)
    return err;
  if (idem_sortable_token(token, 24, now) != IDEM_OK)
    return IDEM_ECRYPTO;
  _Static_assert(sizeof f->id >= 3 + sizeof token, "a refund id holds re_ and a token");
  memcpy(f->id, "re_", 3);
  memcpy(f->id + 3, token, sizeof token);
  idem_format_time(now, f->created_at, sizeof f->created_at);
  return IDEM_OK;
}

/* Step 1's rows, in the transaction that wins the key. It may run again
 * (SQLite's batches): everything it reports is set afresh. */
static int reserve(void *arg, idem_tx_t *tx) {
  refund_call_t *rc = arg;
  idem_refund_t *f = &rc->refund;
  int err = idemd_refund_hold(tx, rc->row.tenant_id, f->payment_id, rc->want, &f->amount,
                              f->currency, &rc->refusal);

  if (err != IDEM_OK)
    return err;
  free(rc->pending_body);
  if ((rc->pending_body = idem_refund_json(f, "pending", NULL)) == NULL)
    return IDEM_ENOMEM;
  rc->row = (idemd_resource_t){.tenant_id = rc->row.tenant_id,
                               .kind = "refund",
                               .id = f->id,
                               .status = "pending",
                               .body = rc->pending_body,
                               .operation = OPERATION,
                               .key = rc->key,
                               .due_after_ms = rc->srv->cfg.lease_ms,
                               .who = {rc->request_id, "POST /payments/{id}/refunds"}};
  return idemd_resource_insert(&rc->row, tx);
}

/* Step 2, and what step 3 stores. */
static void call_provider(void *ctx, const idem_record_t *rec, idem_outcome_t *out,
                          idem_effect_t *then) {
  refund_call_t *rc = ctx;
  idem_refund_t *f = &rc->refund;
  idem_refund_req_t req = {.provider_key = f->id, .charge_key = f->payment_id,
                           .amount = f->amount, .currency = f->currency};
  idem_charge_result_t res = {0};
  int sent = idem_provider_call_may_start(
      rec->lease_expires_at, rc->srv->cfg.provider_timeout_ms, idem_now_ms());

  idem_settlement_free(&rc->settled); /* a second call, after a lost lease */
  if (sent) {
    rc->srv->provider->refund(rc->srv->provider, &req, &res);
  } else {
    /* As a payment's (server/payments.c): not sent, left pending. */
    res.outcome = IDEM_CHARGE_NOT_SENT;
    idemd_log_event("warn",
                    "a refund's provider call did not start: its lease would "
                    "end first; left to the reconciler",
                    "resource", f->id, NULL);
  }
  if (idem_refund_settle(f, &res, sent, &rc->settled) != IDEM_OK) {
    /* Out of memory after the call: pending, for the reconciler. */
    static const char pending[] = "{\"status\":\"pending\"}";
    memset(out, 0, sizeof *out);
    out->state = IDEM_STATE_PENDING;
    out->status = 202;
    out->body = pending;
    return;
  }
  *out = rc->settled.outcome;
  rc->update = (idemd_refund_update_t){
      .refund = {.tenant_id = rc->row.tenant_id,
                 .id = f->id,
                 .status = rc->settled.status,
                 .body = rc->settled.resource_body,
                 .provider_ref = out->provider_ref,
                 .state = out->state,
                 .who = {rc->request_id, "the provider's answer"}},
      .payment_id = f->payment_id,
      .amount = f->amount};
  *then = (idem_effect_t){idemd_refund_settled, &rc->update};
}

/* The answer of a refund step 1 refused: nothing was written. */
static enum MHD_Result refused(idemd_request_t *r, void *ctx) {
  refund_call_t *rc = ctx;

  r->outcome = OUTCOME_INVALID;
  switch (rc->refusal) {
  case IDEMD_REFUND_NO_PAYMENT:
    return idemd_reply_error(r, 404, "payment not found", NULL);
  case IDEMD_REFUND_NOT_REFUNDABLE:
    return idemd_reply_error(r, 409, "payment is not refundable", NULL);
  case IDEMD_REFUND_EXCEEDS:
    return idemd_reply_error(r, 409, "refund exceeds the refundable amount", NULL);
  case IDEMD_REFUND_ALLOWED:
    break;
  }
  return idemd_reply_store_error(r, IDEM_EREFUSED);
}

enum MHD_Result idemd_refunds_create(idemd_request_t *r, const json_t *body) {
  refund_call_t *rc;
  json_t *cmd = NULL, *errors = NULL;
  const char *reason;
  int err;

  if (idemd_validate_refund(body, &cmd, &errors) != 0) {
    r->outcome = OUTCOME_INVALID;
    return idemd_reply_errors(r, errors);
  }
  if (strlen(r->resource_id) >= sizeof rc->refund.payment_id) {
    json_decref(cmd);
    r->outcome = OUTCOME_INVALID; /* longer than any payment id */
    return idemd_reply_error(r, 404, "payment not found", NULL);
  }
  if ((rc = calloc(1, sizeof *rc)) == NULL) {
    json_decref(cmd);
    return idemd_reply_store_error(r, IDEM_ENOMEM);
  }
  idemd_request_own(r, rc, refund_call_free);
  rc->srv = r->srv;
  rc->key = r->key;
  rc->request_id = r->request_id;
  rc->row.tenant_id = r->tenant.id;
  rc->want = json_integer_value(json_object_get(cmd, "amount")); /* 0 when absent */
  if ((reason = json_string_value(json_object_get(cmd, "reason"))) != NULL) {
    rc->refund.has_reason = 1;
    idem_copy(rc->refund.reason, sizeof rc->refund.reason, reason);
  }
  idem_copy(rc->refund.payment_id, sizeof rc->refund.payment_id, r->resource_id);
  err = fingerprint(rc, cmd);
  json_decref(cmd);
  if (err != IDEM_OK)
    return idemd_reply_store_error(r, err);
  rc->effect = (idemd_effect_t){.operation = OPERATION, .fingerprint = rc->fingerprint,
                                .resource_id = rc->refund.id,
                                .written = {reserve, rc},
                                .prepare = prepare, .execute = call_provider,
                                .execute_never_waits = r->srv->provider->never_waits,
                                .refused = refused, .ctx = rc};
  return idemd_flow_run(r, &rc->effect);
}
