/* POST /payments and GET /payments/{id}: the three steps of SPEC section 4.
 * 1. reserve the key, insert the payment as pending and an outbox row, in
 *    one transaction (idemd_flow_run -> idem_store_reserve);
 * 2. call the provider outside any transaction, under a provider key
 *    derived from the payment (its id), so every retry reuses it;
 * 3. store the outcome, the reference and the response in one transaction
 *    (idem_store_complete). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "idem/canon.h"
#include "idem/clock.h"
#include "idem/crypto.h"
#include "server/flow.h"
#include "server/log.h"
#include "server/reply.h"
#include "server/validate.h"

#define OPERATION "create_payment"

typedef struct payment {
  idemd_server_t *srv;
  char id[32];
  char created_at[32];
  char location[64];
  json_int_t amount;
  const char *currency;
  const char *order_id; /* NULL when not given */
  char *resource_body;  /* the payment as stored */
  char *response_body;  /* what the client gets */
  char provider_ref[IDEM_REF_MAX + 1];
} payment_t;

/* The payment as a JSON object text, malloc'd. `error` adds that field
 * (used for the 402 answer). */
static char *payment_json(const payment_t *p, const char *status,
                          const char *error) {
  json_t *v = json_pack("{s:s, s:I, s:s, s:s?, s:s, s:s}", "id", p->id, "amount",
                        p->amount, "currency", p->currency, "order_id",
                        p->order_id, "status", status, "created_at",
                        p->created_at);
  char *text;
  if (v == NULL)
    return NULL;
  if (error)
    json_object_set_new(v, "error", json_string(error));
  text = json_dumps(v, JSON_COMPACT);
  json_decref(v);
  return text;
}

/* Step 2 and the outcome of step 3. */
static void charge(void *ctx, const idem_record_t *rec, idem_outcome_t *out) {
  payment_t *p = ctx;
  idem_charge_t c = {.provider_key = p->id, .amount = p->amount,
                     .currency = p->currency};
  idem_charge_result_t res = {0};
  const char *status;

  (void)rec;
  p->srv->provider->charge(p->srv->provider, &c, &res);
  switch (res.outcome) {
  case IDEM_CHARGE_SUCCEEDED:
    status = "succeeded";
    out->state = IDEM_STATE_COMPLETED;
    out->status = 201;
    break;
  case IDEM_CHARGE_DECLINED:
    status = "declined";
    out->state = IDEM_STATE_COMPLETED;
    out->status = 402;
    break;
  case IDEM_CHARGE_UNKNOWN:
    status = "pending";
    out->state = IDEM_STATE_PENDING;
    out->status = 202;
    break;
  default:
    status = "failed";
    out->state = IDEM_STATE_FAILED;
    out->status = 503;
    break;
  }
  p->resource_body = payment_json(p, status, NULL);
  if (out->status == 402)
    p->response_body = payment_json(p, status, "the payment was declined");
  else if (out->status == 503)
    p->response_body = strdup("{\"error\":\"the payment provider could not be "
                              "reached; retry with the same Idempotency-Key\"}");
  else
    p->response_body = p->resource_body ? strdup(p->resource_body) : NULL;
  if (p->resource_body == NULL || p->response_body == NULL) {
    /* Out of memory after the charge: leave the payment pending, which the
     * reconciler settles, rather than lose what the provider did. */
    free(p->response_body);
    p->response_body = strdup("{\"status\":\"pending\"}");
    out->state = IDEM_STATE_PENDING;
    out->status = 202;
    status = "pending";
  }
  out->body = p->response_body ? p->response_body : "{}";
  out->location = out->status == 503 ? NULL : p->location;
  out->resource_id = p->id;
  out->resource_status = status;
  out->resource_body = p->resource_body;
  idem_copy(p->provider_ref, sizeof p->provider_ref, res.reference);
  out->provider_ref = p->provider_ref[0] ? p->provider_ref : NULL;
}

enum MHD_Result idemd_payments_create(idemd_request_t *r, const json_t *body,
                                      int lossy) {
  payment_t p = {.srv = r->srv};
  json_t *cmd = NULL, *errors = NULL;
  char fp[IDEM_FINGERPRINT_LEN];
  char token[25];
  char *pending_body;
  enum MHD_Result ret;

  if (idemd_validate_payment(body, lossy, &cmd, &errors) != 0) {
    r->outcome = OUTCOME_INVALID;
    return idemd_reply_errors(r, errors);
  }
  if (idem_fingerprint(OPERATION, cmd, fp) != IDEM_OK ||
      idem_random_token(token, 24) != IDEM_OK) {
    json_decref(cmd);
    return idemd_reply_store_error(r, IDEM_ECRYPTO);
  }
  snprintf(p.id, sizeof p.id, "pay_%s", token);
  snprintf(p.location, sizeof p.location, "/payments/%s", p.id);
  idem_format_time(idem_now_ms(), p.created_at, sizeof p.created_at);
  p.amount = json_integer_value(json_object_get(cmd, "amount"));
  p.currency = json_string_value(json_object_get(cmd, "currency"));
  p.order_id = json_string_value(json_object_get(cmd, "order_id"));

  pending_body = payment_json(&p, "pending", NULL);
  if (pending_body == NULL) {
    json_decref(cmd);
    return idemd_reply_store_error(r, IDEM_ENOMEM);
  }
  idem_resource_t res = {.kind = "payment", .id = p.id, .status = "pending",
                         .body = pending_body};
  idemd_effect_t e = {.operation = OPERATION, .fingerprint = fp,
                      .resource = &res, .enqueue_outbox = 1,
                      .execute = charge, .ctx = &p};
  ret = idemd_flow_run(r, &e);
  free(pending_body);
  free(p.resource_body);
  free(p.response_body);
  json_decref(cmd);
  return ret;
}

enum MHD_Result idemd_payments_get(idemd_request_t *r) {
  char *body = NULL;
  enum MHD_Result ret;
  int rc = idem_store_resource_get(r->srv->store, r->tenant.id, "payment",
                                   r->resource_id, &body);
  if (rc == IDEM_ENOTFOUND) {
    r->outcome = OUTCOME_INVALID;
    return idemd_reply_error(r, 404, "payment not found", NULL);
  }
  if (rc != IDEM_OK)
    return idemd_reply_store_error(r, rc);
  r->outcome = OUTCOME_READ;
  ret = idemd_reply(r, 200, body, strlen(body), NULL);
  free(body);
  return ret;
}
