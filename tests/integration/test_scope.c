/* Key scope and tenancy: a key is scoped by (tenant, operation, key), a
 * tenant never sees another's resources, and requests without valid
 * credentials are 401. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#define PAYMENT "{\"amount\": 15990, \"currency\": \"BRL\", \"order_id\": \"ord_42\"}"
#define ORDER                                                                            \
  "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":2,"                   \
  "\"unit_price\":1000}],\"currency\":\"BRL\"}"

/* The same key under two tenants: two unrelated keys, even with different
 * bodies (no 422), each replaying its own answer. */
static void test_same_key_two_tenants(void **state) {
  h_server_t *s = h_server_start(NULL);
  const char *a = h_tenant(s, "tenant-a");
  const char *b = h_tenant(s, "tenant-b");
  h_resp_t ra, rb, r;
  (void)state;

  h_post(s, "/payments", a, "shared-key", PAYMENT, &ra);
  h_assert_first(&ra, 201);
  h_post(s, "/payments", b, "shared-key", "{\"amount\": 777}", &rb);
  h_assert_first(&rb, 201);
  assert_string_not_equal(h_id(&ra), h_id(&rb));
  assert_int_equal(json_integer_value(json_object_get(rb.json, "amount")), 777);

  h_post(s, "/payments", a, "shared-key", PAYMENT, &r);
  h_assert_replay_of(&r, &ra);
  h_resp_free(&r);
  h_post(s, "/payments", b, "shared-key", "{\"amount\": 777}", &r);
  h_assert_replay_of(&r, &rb);
  h_resp_free(&r);

  /* Identical bodies under two tenants are still two payments. */
  h_post(s, "/orders", a, "shared-order", ORDER, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);
  h_post(s, "/orders", b, "shared-order", ORDER, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);

  h_assert_db(s, 2, "SELECT count(*) FROM payments");
  h_assert_db(s, 2, "SELECT count(*) FROM orders");
  h_assert_db(s, 2,
              "SELECT count(DISTINCT tenant_id) FROM idempotency_records "
              "WHERE key = 'shared-key'");
  h_assert_db(s, 1,
              "SELECT count(*) FROM payments p JOIN tenants t ON t.id = p.tenant_id "
              "WHERE t.name = 'tenant-b' AND p.amount = 777");
  h_resp_free(&ra);
  h_resp_free(&rb);
  h_server_stop(s);
}

/* The same key on POST /payments and POST /orders: independent. */
static void test_same_key_two_operations(void **state) {
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  h_resp_t pay, ord, r;
  (void)state;

  h_post(s, "/payments", tok, "one-key", PAYMENT, &pay);
  h_assert_first(&pay, 201);
  h_post(s, "/orders", tok, "one-key", ORDER, &ord);
  h_assert_first(&ord, 201);
  assert_int_equal(strncmp(h_id(&pay), "pay_", 4), 0);
  assert_int_equal(strncmp(h_id(&ord), "ord_", 4), 0);

  h_post(s, "/payments", tok, "one-key", PAYMENT, &r);
  h_assert_replay_of(&r, &pay);
  h_resp_free(&r);
  h_post(s, "/orders", tok, "one-key", ORDER, &r);
  h_assert_replay_of(&r, &ord);
  h_resp_free(&r);

  h_assert_db(s, 1, "SELECT count(*) FROM payments");
  h_assert_db(s, 1, "SELECT count(*) FROM orders");
  h_assert_db(s, 2, "SELECT count(*) FROM idempotency_records WHERE key = 'one-key'");
  h_resp_free(&pay);
  h_resp_free(&ord);
  h_server_stop(s);
}

/* A tenant reads its own resources and gets 404 for another's, even with
 * the exact id and Location. */
static void test_cross_tenant_read(void **state) {
  h_server_t *s = h_server_start(NULL);
  const char *a = h_tenant(s, "tenant-a");
  const char *b = h_tenant(s, "tenant-b");
  const char *c;
  h_resp_t pay, ord, r;
  (void)state;

  h_post(s, "/payments", a, "a-pay", PAYMENT, &pay);
  h_assert_first(&pay, 201);
  h_post(s, "/orders", a, "a-ord", ORDER, &ord);
  h_assert_first(&ord, 201);

  h_get(s, pay.location, a, &r);
  h_assert_status(&r, 200);
  assert_true(json_equal(r.json, pay.json));
  h_resp_free(&r);
  h_get(s, ord.location, a, &r);
  h_assert_status(&r, 200);
  assert_true(json_equal(r.json, ord.json));
  h_resp_free(&r);

  h_get(s, pay.location, b, &r);
  h_assert_error(&r, 404, NULL);
  assert_null(strstr(r.body, h_id(&pay)));
  h_resp_free(&r);
  h_get(s, ord.location, b, &r);
  h_assert_error(&r, 404, NULL);
  h_resp_free(&r);

  /* A tenant created while the server runs: nothing of a's either. */
  c = h_tenant(s, "tenant-c");
  h_get(s, pay.location, c, &r);
  h_assert_error(&r, 404, NULL);
  h_resp_free(&r);
  h_post(s, "/payments", c, "a-pay", PAYMENT, &r);
  h_assert_first(&r, 201);
  assert_string_not_equal(h_id(&r), h_id(&pay));
  h_resp_free(&r);

  /* A payment id is not an order id, and the other way round. */
  {
    char path[128];
    snprintf(path, sizeof path, "/orders/%s", h_id(&pay));
    h_get(s, path, a, &r);
    h_assert_error(&r, 404, NULL);
    h_resp_free(&r);
    snprintf(path, sizeof path, "/payments/%s", h_id(&ord));
    h_get(s, path, a, &r);
    h_assert_error(&r, 404, NULL);
    h_resp_free(&r);
  }
  /* HEAD is allowed on reads. */
  {
    h_req_t q = {.method = "HEAD", .path = pay.location, .token = a};
    h_http(s, &q, &r);
    h_assert_status(&r, 200);
    assert_int_equal(r.body_len, 0);
    h_resp_free(&r);
    q.token = b;
    h_http(s, &q, &r);
    h_assert_status(&r, 404);
    h_resp_free(&r);
  }
  h_resp_free(&pay);
  h_resp_free(&ord);
  h_server_stop(s);
}

/* No token or a wrong one: 401 with WWW-Authenticate: Bearer, and nothing
 * stored; /healthz and /metrics need none. */
static void test_unauthenticated(void **state) {
  h_server_t *s = h_server_start(NULL);
  const char *a = h_tenant(s, "tenant-a");
  const char *b = h_tenant(s, "tenant-b");
  char tampered[128], swapped[128];
  const char *bad[5];
  h_resp_t pay, r;
  size_t n;
  (void)state;

  h_post(s, "/payments", a, "auth-pay", PAYMENT, &pay);
  h_assert_first(&pay, 201);

  snprintf(tampered, sizeof tampered, "%s", a);
  n = strlen(tampered);
  tampered[n - 1] = tampered[n - 1] == 'a' ? 'b' : 'a';
  /* a's lookup part with b's secret */
  snprintf(swapped, sizeof swapped, "%.18s%s", a, b + 18);
  bad[0] = NULL;
  bad[1] = tampered;
  bad[2] = swapped;
  bad[3] = "not-a-key";
  bad[4] = "";
  for (int i = 0; i < 5; i++) {
    h_context("token #%d", i);
    h_post(s, "/payments", bad[i], "auth-new", PAYMENT, &r);
    h_assert_error(&r, 401, NULL);
    assert_string_equal(r.www_authenticate, "Bearer");
    h_resp_free(&r);
    h_post(s, "/orders", bad[i], "auth-new", ORDER, &r);
    h_assert_error(&r, 401, NULL);
    assert_string_equal(r.www_authenticate, "Bearer");
    h_resp_free(&r);
    /* a replay needs credentials too */
    h_post(s, "/payments", bad[i], "auth-pay", PAYMENT, &r);
    h_assert_error(&r, 401, NULL);
    assert_null(strstr(r.body, h_id(&pay)));
    h_resp_free(&r);
    h_get(s, pay.location, bad[i], &r);
    h_assert_error(&r, 401, NULL);
    assert_string_equal(r.www_authenticate, "Bearer");
    h_resp_free(&r);
  }
  h_context_clear();
  h_assert_db(s, 1, "SELECT count(*) FROM idempotency_records");
  h_assert_db(s, 1, "SELECT count(*) FROM resources");

  h_get(s, "/healthz", NULL, &r);
  h_assert_status(&r, 200);
  h_resp_free(&r);
  h_get(s, "/metrics", NULL, &r);
  h_assert_status(&r, 200);
  assert_non_null(strstr(r.body, "idem_requests_total"));
  h_resp_free(&r);
  h_resp_free(&pay);
  h_server_stop(s);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_same_key_two_tenants, h_teardown),
      cmocka_unit_test_teardown(test_same_key_two_operations, h_teardown),
      cmocka_unit_test_teardown(test_cross_tenant_read, h_teardown),
      cmocka_unit_test_teardown(test_unauthenticated, h_teardown),
  };
  int rc;
  h_init(argc, argv);
  rc = cmocka_run_group_tests_name("integration: key scope and tenancy", tests, NULL,
                                   NULL);
  curl_global_cleanup();
  return rc;
}
