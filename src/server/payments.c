/* POST /payments and GET /payments/{id}: the three steps of
 * docs/idempotency.md, section 4.1.
 * 1. reserve the key, insert the payment as pending and an outbox row, in
 *    one transaction (idemd_flow_run -> the engine's reservation, with
 *    the rows as its effect, src/data/resources.h);
 * 2. call the provider outside any transaction, under a provider key
 *    derived from the payment (its id), so every retry reuses it;
 * 3. store the outcome, the reference, the payment's new status and the
 *    response in one transaction (the engine's completion, with the
 *    payment's update as its effect). */
#include <stdlib.h>
#include <string.h>

#include "idem/canon.h"
#include "idem/clock.h"
#include "idem/crypto.h"
#include "data/resources.h"
#include "provider/payment.h"
#include "server/flow.h"
#include "server/log.h"
#include "server/reply.h"
#include "server/payment_cmd.h"

#define OPERATION "create_payment"

typedef struct payment_call {
  idemd_server_t *srv;
  idem_payment_t payment;
  char fingerprint[IDEM_FINGERPRINT_LEN];
  const char *key;           /* the request's Idempotency-Key */
  const char *request_id;    /* the actor of its audit rows */
  char *pending_body;        /* step 1's payment, made by prepare() */
  idemd_resource_t row;      /* step 1's rows: points at the above */
  idem_settlement_t settled;
  idemd_resource_update_t update; /* step 3's: points at `settled` */
  idemd_effect_t effect;
} payment_call_t;

static void payment_call_free(void *call) {
  payment_call_t *pc = call;
  free(pc->pending_body);
  idem_settlement_free(&pc->settled);
  free(pc);
}

/* Gives the payment its id and its pending body: only when the key is to
 * be reserved, so replays skip it. Called again when a reservation lost
 * its race and the key was free again by the next one: a new id and body. */
static int prepare(void *ctx) {
  payment_call_t *pc = ctx;
  idem_payment_t *p = &pc->payment;
  char token[25];
  int64_t now = idem_now_ms();

  if (idem_sortable_token(token, 24, now) != IDEM_OK)
    return IDEM_ECRYPTO;
  _Static_assert(sizeof p->id >= 4 + sizeof token, "a payment id holds pay_ and a token");
  memcpy(p->id, "pay_", 4);
  memcpy(p->id + 4, token, sizeof token); /* 24 characters and the NUL */
  idem_format_time(now, p->created_at, sizeof p->created_at);
  free(pc->pending_body);
  if ((pc->pending_body = idem_payment_json(p, "pending", NULL)) == NULL)
    return IDEM_ENOMEM;
  pc->row = (idemd_resource_t){.tenant_id = pc->row.tenant_id,
                               .kind = "payment",
                               .id = p->id,
                               .status = "pending",
                               .body = pc->pending_body,
                               .operation = OPERATION,
                               .key = pc->key,
                               .due_after_ms = pc->srv->cfg.lease_ms,
                               .who = {pc->request_id, "POST /payments"}};
  return IDEM_OK;
}

/* Step 2, and the outcome step 3 stores. */
static void charge(void *ctx, const idem_record_t *rec, idem_outcome_t *out,
                   idem_effect_t *then) {
  payment_call_t *pc = ctx;
  idem_charge_t c = {.provider_key = pc->payment.id,
                     .amount = pc->payment.amount,
                     .currency = pc->payment.currency};
  idem_charge_result_t res = {0};
  int sent = idem_provider_call_may_start(
      rec->lease_expires_at, pc->srv->cfg.provider_timeout_ms, idem_now_ms());

  idem_settlement_free(&pc->settled); /* a second call, after a lost lease */
  if (sent) {
    pc->srv->provider->charge(pc->srv->provider, &c, &res);
  } else {
    /* Its lease would end before the call (it waited for a worker): the
     * record may be another's by now (docs/idempotency.md, section 2.8).
     * Nothing is sent; the payment stays pending for the reconciler, and
     * a completion refused by the owner token answers from the new
     * owner's work. */
    res.outcome = IDEM_CHARGE_NOT_SENT;
    idemd_log_event("warn",
                    "a payment's provider call did not start: its lease would "
                    "end first; left to the reconciler",
                    "resource", pc->payment.id, NULL);
  }
  /* Not sent for want of a lease is not a failure: pending. */
  if (idem_payment_settle(&pc->payment, &res, sent, &pc->settled) != IDEM_OK) {
    /* Out of memory after the charge: leave the record pending for the
     * reconciler rather than lose what the provider did. */
    static const char pending[] = "{\"status\":\"pending\"}";
    memset(out, 0, sizeof *out);
    out->state = IDEM_STATE_PENDING;
    out->status = 202;
    out->body = pending;
    return;
  }
  *out = pc->settled.outcome;
  pc->update =
      (idemd_resource_update_t){.tenant_id = pc->row.tenant_id,
                                .id = pc->payment.id,
                                .status = pc->settled.status,
                                .body = pc->settled.resource_body,
                                .provider_ref = out->provider_ref,
                                .state = out->state,
                                .who = {pc->request_id, "the provider's answer"}};
  *then = (idem_effect_t){idemd_resource_update, &pc->update};
}

enum MHD_Result idemd_payments_create(idemd_request_t *r, const json_t *body) {
  payment_call_t *pc;
  idem_payment_t *p;
  idemd_payment_cmd_t cmd;
  json_t *errors = NULL;
  char canon[IDEMD_PAYMENT_CANON_MAX];
  size_t len;
  int rc;

  if (idemd_validate_payment_cmd(body, &cmd, &errors) != 0) {
    r->outcome = OUTCOME_INVALID;
    return idemd_reply_errors(r, errors);
  }
  if ((pc = calloc(1, sizeof *pc)) == NULL)
    return idemd_reply_store_error(r, IDEM_ENOMEM);
  idemd_request_own(r, pc, payment_call_free);
  pc->srv = r->srv;
  pc->key = r->key;
  pc->request_id = r->request_id;
  pc->row.tenant_id = r->tenant.id;
  p = &pc->payment;
  /* The canonical command written directly: building it in jansson and
   * dumping it was 4 % of a new payment's instructions (docs/performance.md). */
  len = idemd_payment_canon(&cmd, canon);
  if ((rc = idem_fingerprint_text(OPERATION, canon, len, pc->fingerprint)) != IDEM_OK)
    return idemd_reply_store_error(r, rc);
  p->amount = cmd.amount;
  _Static_assert(sizeof p->currency >= sizeof cmd.currency, "currency fits");
  _Static_assert(sizeof p->order_id >= sizeof cmd.order_id, "order_id fits");
  memcpy(p->currency, cmd.currency, sizeof cmd.currency);
  memcpy(p->order_id, cmd.order_id, sizeof cmd.order_id);

  /* Step 1 writes the payment as pending, with an outbox row. */
  pc->effect = (idemd_effect_t){.operation = OPERATION, .fingerprint = pc->fingerprint,
                                .resource_id = p->id,
                                .written = {idemd_resource_insert, &pc->row},
                                .prepare = prepare, .execute = charge,
                                .execute_never_waits = r->srv->provider->never_waits,
                                .ctx = pc};
  return idemd_flow_run(r, &pc->effect);
}
