/* Tests provider/payment.c: the payment's JSON text (written by hand for
 * speed, so checked here against jansson) and settlement. */
#include "support.h"

#include <stdlib.h>

#include "provider/payment.h"

/* What json_dumps(JSON_COMPACT) gives for the same fields and order. */
static char *with_jansson(const idem_payment_t *p, const char *status,
                          const char *error) {
  json_t *v = json_pack("{s:s, s:I, s:I, s:s, s:s?, s:s, s:s}", "id", p->id, "amount",
                        (json_int_t)p->amount, "amount_refunded",
                        (json_int_t)p->amount_refunded, "currency", p->currency,
                        "order_id", p->order_id[0] ? p->order_id : NULL,
                        "status", status, "created_at", p->created_at);
  char *text;
  if (error)
    json_object_set_new(v, "error", json_string(error));
  text = json_dumps(v, JSON_COMPACT);
  json_decref(v);
  return text;
}

static void check_same(const idem_payment_t *p, const char *status,
                       const char *error) {
  char *got = idem_payment_json(p, status, error);
  char *want = with_jansson(p, status, error);
  assert_non_null(got);
  assert_string_equal(got, want);
  free(got);
  free(want);
}

static void test_json_matches_jansson(void **state) {
  idem_payment_t p = {.id = "pay_0123456789abcdefghijklmn", .amount = 15990,
                      .currency = "BRL", .created_at = "2026-11-30T13:00:00.000Z"};
  (void)state;
  check_same(&p, "pending", NULL);
  check_same(&p, "declined", "the payment was declined");
  strcpy(p.order_id, "ord_1");
  check_same(&p, "succeeded", NULL);
  /* Visible ASCII may hold the two characters JSON must escape. */
  strcpy(p.order_id, "a\"b\\c/d{}[],:");
  check_same(&p, "succeeded", NULL);
  p.amount = INT64_MAX;
  p.amount_refunded = 4000;
  check_same(&p, "succeeded", NULL);
  memset(p.order_id, '"', sizeof p.order_id - 1);
  p.order_id[sizeof p.order_id - 1] = '\0';
  check_same(&p, "pending", NULL);
}

/* Control characters never pass validation, but the text stays valid
 * JSON and reads back the same if one gets there. */
static void test_json_escapes_control_characters(void **state) {
  idem_payment_t p = {.id = "pay_x", .amount = 1, .currency = "BRL",
                      .order_id = "a\x01\n\tb", .created_at = "t"};
  char *text = idem_payment_json(&p, "pending", NULL);
  json_t *v;
  (void)state;
  assert_non_null(text);
  v = json_loads(text, JSON_REJECT_DUPLICATES, NULL);
  assert_non_null(v);
  assert_string_equal(json_string_value(json_object_get(v, "order_id")), p.order_id);
  json_decref(v);
  free(text);
}

/* A settled payment reads back as the payment it was made from. */
static void test_settle_round_trip(void **state) {
  idem_payment_t p = {.id = "pay_y", .amount = 700, .currency = "USD",
                      .order_id = "ord_\\9", .created_at = "2026-01-01T00:00:00.000Z"};
  idem_payment_t back;
  idem_charge_result_t ok = {.outcome = IDEM_CHARGE_SUCCEEDED, .reference = "psp_1"};
  idem_charge_result_t no = {.outcome = IDEM_CHARGE_DECLINED, .reference = "psp_2"};
  idem_settlement_t s;
  (void)state;

  assert_int_equal(idem_payment_settle(&p, &ok, 1, &s), IDEM_OK);
  assert_int_equal(s.outcome.status, 201);
  assert_string_equal(s.response_body, s.resource_body);
  assert_int_equal(idem_payment_parse(s.resource_body, &back), IDEM_OK);
  assert_string_equal(back.id, p.id);
  assert_string_equal(back.order_id, p.order_id);
  assert_true(back.amount == p.amount);
  idem_settlement_free(&s);

  assert_int_equal(idem_payment_settle(&p, &no, 1, &s), IDEM_OK);
  assert_int_equal(s.outcome.status, 402);
  assert_non_null(strstr(s.response_body, "\"error\":\"the payment was declined\""));
  assert_null(strstr(s.resource_body, "\"error\""));
  idem_settlement_free(&s);
}

/* A read sets amount_refunded in place, and gives it to a payment written
 * before refunds existed. */
static void test_with_refunded(void **state) {
  idem_payment_t p = {.id = "pay_z", .amount = 900, .currency = "BRL", .created_at = "t"};
  char *body = idem_payment_json(&p, "succeeded", NULL), *read;
  (void)state;

  read = idem_payment_with_refunded(body, 300);
  p.amount_refunded = 300;
  free(body);
  body = idem_payment_json(&p, "succeeded", NULL);
  assert_string_equal(read, body);
  free(read);
  free(body);
  read = idem_payment_with_refunded("{\"id\":\"pay_old\",\"amount\":5}", 0);
  assert_string_equal(read, "{\"id\":\"pay_old\",\"amount\":5,\"amount_refunded\":0}");
  free(read);
  assert_null(idem_payment_with_refunded("[1]", 0));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_json_matches_jansson),
      cmocka_unit_test(test_json_escapes_control_characters),
      cmocka_unit_test(test_settle_round_trip),
      cmocka_unit_test(test_with_refunded),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
