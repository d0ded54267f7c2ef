/* Refund bodies and settlement (see refund.h). Refunds are written less
 * often than payments, and carry a reason in any language: jansson writes
 * them. */
#include "provider/refund.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "util/json_text.h"

char *idem_refund_json(const idem_refund_t *r, const char *status, const char *error) {
  json_t *v = json_pack("{s:s, s:s, s:I, s:s, s:s, s:o, s:s}", "id", r->id, "payment_id",
                        r->payment_id, "amount", (json_int_t)r->amount, "currency",
                        r->currency, "status", status, "reason",
                        r->has_reason ? json_string(r->reason) : json_null(),
                        "created_at", r->created_at);
  char *text = NULL;

  if (v && (error == NULL || json_object_set_new(v, "error", json_string(error)) == 0))
    text = json_dumps(v, JSON_COMPACT | JSON_PRESERVE_ORDER);
  json_decref(v);
  return text;
}

int idem_refund_parse(const char *body, idem_refund_t *r) {
  json_t *v = json_loads(body ? body : "", 0, NULL);
  json_t *amount = json_object_get(v, "amount");
  json_t *reason = json_object_get(v, "reason");
  const char *id = json_string_value(json_object_get(v, "id"));
  const char *payment = json_string_value(json_object_get(v, "payment_id"));
  const char *currency = json_string_value(json_object_get(v, "currency"));
  const char *created = json_string_value(json_object_get(v, "created_at"));
  int rc = IDEM_EJSON;

  memset(r, 0, sizeof *r);
  if (id && payment && currency && created && json_is_integer(amount) &&
      (reason == NULL || json_is_null(reason) || json_is_string(reason)) &&
      idem_copy(r->id, sizeof r->id, id) == 0 &&
      idem_copy(r->payment_id, sizeof r->payment_id, payment) == 0 &&
      idem_copy(r->currency, sizeof r->currency, currency) == 0 &&
      idem_copy(r->created_at, sizeof r->created_at, created) == 0 &&
      (!json_is_string(reason) ||
       idem_copy(r->reason, sizeof r->reason, json_string_value(reason)) == 0)) {
    r->amount = json_integer_value(amount);
    r->has_reason = json_is_string(reason);
    rc = IDEM_OK;
  }
  json_decref(v);
  return rc;
}

int idem_refund_settle(const idem_refund_t *r, const idem_charge_result_t *res,
                       int may_fail, idem_settlement_t *s) {
  const char *status;

  memset(s, 0, sizeof *s);
  status = idem_settle_outcome(res, may_fail, &s->outcome);
  return idem_settlement_fill(
      s, res, status, "/refunds/", r->id, idem_refund_json(r, status, NULL),
      s->outcome.status == 402 ? idem_refund_json(r, status, "the refund was declined")
                               : NULL);
}
