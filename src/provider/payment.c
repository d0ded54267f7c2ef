/* Payment bodies and settlement: from a provider answer to the record's
 * outcome, the stored response and the payment's status. */
#include "provider/payment.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "util/json_text.h"

int idem_payment_parse(const char *body, idem_payment_t *p) {
  json_t *v = json_loads(body ? body : "", 0, NULL);
  json_t *amount = json_object_get(v, "amount");
  json_t *refunded = json_object_get(v, "amount_refunded");
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
    p->amount_refunded = json_is_integer(refunded) ? json_integer_value(refunded) : 0;
    rc = IDEM_OK;
  }
  json_decref(v);
  return rc;
}

char *idem_payment_with_refunded(const char *body, int64_t refunded) {
  json_t *v = json_loads(body ? body : "", 0, NULL);
  char *text = NULL;

  if (json_is_object(v) &&
      json_object_set_new(v, "amount_refunded", json_integer(refunded)) == 0)
    text = json_dumps(v, JSON_COMPACT | JSON_PRESERVE_ORDER);
  json_decref(v);
  return text;
}

/* Written directly rather than built with jansson: a payment is written
 * two or three times per request, always in this one shape, and building
 * it as a json_t and dumping it was a seventh of a new payment's
 * instructions (docs/performance.md). For validated fields (visible
 * ASCII) the output is what json_dumps() with JSON_COMPACT gave for the
 * same fields, in the same order (tests/unit/test_payment.c). */
char *idem_payment_json(const idem_payment_t *p, const char *status,
                        const char *error) {
  /* Every string at most 6 bytes per input byte once escaped. */
  size_t cap = 160 + 6 * (strlen(p->id) + strlen(p->currency) +
                          strlen(p->order_id) + strlen(status) +
                          strlen(p->created_at) + (error ? strlen(error) : 0));
  char *out = malloc(cap);
  size_t n;

  if (out == NULL)
    return NULL;
  n = IDEM_JSON_LIT(out, "{\"id\":");
  n += idem__json_string(out + n, p->id);
  n += IDEM_JSON_LIT(out + n, ",\"amount\":");
  n += idem__json_int(out + n, (long long)p->amount);
  n += IDEM_JSON_LIT(out + n, ",\"amount_refunded\":");
  n += idem__json_int(out + n, (long long)p->amount_refunded);
  n += IDEM_JSON_LIT(out + n, ",\"currency\":");
  n += idem__json_string(out + n, p->currency);
  n += IDEM_JSON_LIT(out + n, ",\"order_id\":");
  if (p->order_id[0])
    n += idem__json_string(out + n, p->order_id);
  else
    n += IDEM_JSON_LIT(out + n, "null");
  n += IDEM_JSON_LIT(out + n, ",\"status\":");
  n += idem__json_string(out + n, status);
  n += IDEM_JSON_LIT(out + n, ",\"created_at\":");
  n += idem__json_string(out + n, p->created_at);
  if (error) {
    n += IDEM_JSON_LIT(out + n, ",\"error\":");
    n += idem__json_string(out + n, error);
  }
  out[n++] = '}';
  out[n] = '\0';
  return out;
}

const char *idem_settle_outcome(const idem_charge_result_t *r, int may_fail,
                                idem_outcome_t *o) {
  switch (r->outcome) {
  case IDEM_CHARGE_SUCCEEDED:
    o->state = IDEM_STATE_COMPLETED;
    o->status = 201;
    return "succeeded";
  case IDEM_CHARGE_DECLINED:
    o->state = IDEM_STATE_COMPLETED;
    o->status = 402;
    return "declined";
  case IDEM_CHARGE_NOT_SENT:
    if (may_fail) {
      o->state = IDEM_STATE_FAILED;
      o->status = 503;
      return "failed";
    }
    /* The reconciler never fails a call: it stays pending. */
    __attribute__((fallthrough));
  default:
    o->state = IDEM_STATE_PENDING;
    o->status = 202;
    return "pending";
  }
}

int idem_settlement_fill(idem_settlement_t *s, const idem_charge_result_t *r,
                         const char *status, const char *path, const char *id,
                         char *resource_body, char *declined_body) {
  idem_outcome_t *o = &s->outcome;
  size_t n = strlen(path);

  s->resource_body = resource_body;
  if (o->state == IDEM_STATE_FAILED) {
    free(declined_body);
    s->response_body = strdup(IDEM_PROVIDER_UNREACHABLE);
  } else if (declined_body) {
    s->response_body = declined_body;
  } else if (resource_body) {
    s->response_body = strdup(resource_body);
  }
  if (s->resource_body == NULL || s->response_body == NULL ||
      n + strlen(id) >= sizeof s->location) {
    idem_settlement_free(s);
    return IDEM_ENOMEM;
  }
  memcpy(s->location, path, n);
  idem_copy(s->location + n, sizeof s->location - n, id);
  idem_copy(s->provider_ref, sizeof s->provider_ref, r->reference);
  o->body = s->response_body;
  o->location = o->state == IDEM_STATE_FAILED ? NULL : s->location;
  o->resource_id = id;
  s->status = status;
  o->provider_ref = s->provider_ref[0] ? s->provider_ref : NULL;
  return IDEM_OK;
}

int idem_payment_settle(const idem_payment_t *p, const idem_charge_result_t *r,
                        int may_fail, idem_settlement_t *s) {
  const char *status;

  memset(s, 0, sizeof *s);
  status = idem_settle_outcome(r, may_fail, &s->outcome);
  return idem_settlement_fill(
      s, r, status, "/payments/", p->id, idem_payment_json(p, status, NULL),
      s->outcome.status == 402 ? idem_payment_json(p, status, "the payment was declined")
                               : NULL);
}

void idem_settlement_free(idem_settlement_t *s) {
  free(s->resource_body);
  free(s->response_body);
  memset(s, 0, sizeof *s);
}
