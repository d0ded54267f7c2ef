/* Payment bodies and settlement: from a provider answer to the record's
 * outcome, the stored response and the payment's status. */
#include "provider/payment.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int idem_payment_parse(const char *body, idem_payment_t *p) {
  json_t *v = json_loads(body ? body : "", 0, NULL);
  json_t *amount = json_object_get(v, "amount");
  const char *id = json_string_value(json_object_get(v, "id"));
  const char *currency = json_string_value(json_object_get(v, "currency"));
  const char *order_id = json_string_value(json_object_get(v, "order_id"));
  const char *created = json_string_value(json_object_get(v, "created_at"));
  int rc = IDEM_EJSON;

  memset(p, 0, sizeof *p);
  if (id && currency && created && json_is_integer(amount) &&
      idem_copy(p->id, sizeof p->id, id) == 0 &&
      idem_copy(p->currency, sizeof p->currency, currency) == 0 &&
      idem_copy(p->order_id, sizeof p->order_id, order_id) == 0 &&
      idem_copy(p->created_at, sizeof p->created_at, created) == 0) {
    p->amount = json_integer_value(amount);
    rc = IDEM_OK;
  }
  json_decref(v);
  return rc;
}

char *idem_payment_json(const idem_payment_t *p, const char *status,
                        const char *error) {
  json_t *v = json_pack("{s:s, s:I, s:s, s:s?, s:s, s:s}", "id", p->id, "amount",
                        (json_int_t)p->amount, "currency", p->currency,
                        "order_id", p->order_id[0] ? p->order_id : NULL,
                        "status", status, "created_at", p->created_at);
  char *text;
  if (v == NULL)
    return NULL;
  if (error)
    json_object_set_new(v, "error", json_string(error));
  text = json_dumps(v, JSON_COMPACT);
  json_decref(v);
  return text;
}

int idem_payment_settle(const idem_payment_t *p, const idem_charge_result_t *r,
                        int may_fail, idem_settlement_t *s) {
  idem_outcome_t *o = &s->outcome;
  const char *status;
  const char *error = NULL;

  memset(s, 0, sizeof *s);
  snprintf(s->location, sizeof s->location, "/payments/%s", p->id);
  switch (r->outcome) {
  case IDEM_CHARGE_SUCCEEDED:
    status = "succeeded";
    o->state = IDEM_STATE_COMPLETED;
    o->status = 201;
    break;
  case IDEM_CHARGE_DECLINED:
    status = "declined";
    o->state = IDEM_STATE_COMPLETED;
    o->status = 402;
    error = "the payment was declined";
    break;
  case IDEM_CHARGE_NOT_SENT:
    if (may_fail) {
      status = "failed";
      o->state = IDEM_STATE_FAILED;
      o->status = 503;
      break;
    }
    /* The reconciler never fails a payment: it stays pending. */
    __attribute__((fallthrough));
  default:
    status = "pending";
    o->state = IDEM_STATE_PENDING;
    o->status = 202;
    break;
  }
  s->resource_body = idem_payment_json(p, status, NULL);
  if (o->state == IDEM_STATE_FAILED)
    s->response_body = strdup("{\"error\":\"the payment provider could not be "
                              "reached; retry with the same Idempotency-Key\"}");
  else
    s->response_body = idem_payment_json(p, status, error);
  if (s->resource_body == NULL || s->response_body == NULL) {
    idem_settlement_free(s);
    return IDEM_ENOMEM;
  }
  idem_copy(s->provider_ref, sizeof s->provider_ref, r->reference);
  o->body = s->response_body;
  o->location = o->state == IDEM_STATE_FAILED ? NULL : s->location;
  o->resource_id = p->id;
  o->resource_status = status;
  o->resource_body = s->resource_body;
  o->provider_ref = s->provider_ref[0] ? s->provider_ref : NULL;
  return IDEM_OK;
}

void idem_settlement_free(idem_settlement_t *s) {
  free(s->resource_body);
  free(s->response_body);
  memset(s, 0, sizeof *s);
}
