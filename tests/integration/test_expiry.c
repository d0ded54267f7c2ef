/* Retention: with --key-ttl 1s a completed key is forgotten after its TTL
 * (the same key executes anew), while a pending payment's key never
 * expires. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "harness.h"

#define PAYMENT "{\"amount\": 15990, \"currency\": \"BRL\", \"order_id\": \"ord_42\"}"
#define ORDER                                                                            \
  "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":2,"                   \
  "\"unit_price\":1000}],\"currency\":\"BRL\"}"

/* The reconciler is kept away: it would settle the pending payment. */
static const char *const ttl_flags[] = {
    "--key-ttl", "1s", "--sandbox-uncertain-amount", "7070", "--reconcile-interval",
    "1h",        NULL};

/* Waits (bounded) until the wall clock is past `ms`; time itself is what
 * the test waits for here. */
static void wait_until_wall_ms(int64_t ms) {
  double give_up = h_now() + 10.0;
  while (h_wall_ms() <= ms) {
    struct timespec ts = {0, 10 * 1000000L};
    if (h_now() > give_up)
      fail_msg("the clock did not reach %lld", (long long)ms);
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
      ;
  }
}

/* The record's expiry as stored, in wall-clock milliseconds. */
static int64_t expires_at(h_server_t *s, const char *key, const char *operation) {
  int64_t at = h_db_int(s,
                        "SELECT expires_at FROM idempotency_records WHERE key = ?1 "
                        "AND operation = ?2",
                        key, operation);
  int64_t now = h_wall_ms();
  /* 1 s after completion, give or take the time the request took */
  if (at <= now - 2000 || at > now + 1500)
    fail_msg("expires_at %lld is not about 1 s from now (%lld)", (long long)at,
             (long long)now);
  return at;
}

/* Before the TTL: a replay. After: a new resource, a first answer. */
static void test_completed_key_expires(void **state) {
  static const char *const paths[] = {"/payments", "/orders"};
  static const char *const bodies[] = {PAYMENT, ORDER};
  static const char *const ops[] = {"create_payment", "create_order"};
  h_server_t *s = h_server_start(ttl_flags);
  const char *tok = h_tenant(s, "acme");
  h_resp_t first, r, again;
  (void)state;

  for (int p = 0; p < 2; p++) {
    int64_t at;
    h_context("%s", paths[p]);
    h_post(s, paths[p], tok, "ttl-1", bodies[p], &first);
    h_assert_first(&first, 201);
    at = expires_at(s, "ttl-1", ops[p]);
    h_post(s, paths[p], tok, "ttl-1", bodies[p], &r);
    if (h_wall_ms() < at) /* only meaningful while the key is alive */
      h_assert_replay_of(&r, &first);
    h_resp_free(&r);

    wait_until_wall_ms(at);
    h_post(s, paths[p], tok, "ttl-1", bodies[p], &again);
    h_assert_first(&again, 201);
    assert_string_not_equal(h_id(&again), h_id(&first));
    /* and the new answer is now the one replayed */
    h_post(s, paths[p], tok, "ttl-1", bodies[p], &r);
    if (h_wall_ms() < expires_at(s, "ttl-1", ops[p]))
      h_assert_replay_of(&r, &again);
    h_resp_free(&r);
    h_resp_free(&again);
    h_resp_free(&first);
  }
  h_context_clear();
  h_assert_db(s, 2, "SELECT count(*) FROM payments");
  h_assert_db(s, 2, "SELECT count(*) FROM orders");
  h_assert_db(s, 2, "SELECT count(*) FROM idempotency_records");
  h_server_stop(s);
}

/* An expired key is "never seen": a different request on it is not a
 * mismatch. */
static void test_expired_key_takes_any_request(void **state) {
  h_server_t *s = h_server_start(ttl_flags);
  const char *tok = h_tenant(s, "acme");
  h_resp_t first, r;
  int64_t at;
  (void)state;

  h_post(s, "/payments", tok, "ttl-2", PAYMENT, &first);
  h_assert_first(&first, 201);
  at = expires_at(s, "ttl-2", "create_payment");
  wait_until_wall_ms(at);
  h_post(s, "/payments", tok, "ttl-2", "{\"amount\": 123}", &r);
  h_assert_first(&r, 201);
  assert_int_equal(json_integer_value(json_object_get(r.json, "amount")), 123);
  assert_string_not_equal(h_id(&r), h_id(&first));
  h_resp_free(&r);
  h_resp_free(&first);
  h_assert_db(s, 2, "SELECT count(*) FROM payments");
  h_server_stop(s);
}

/* A pending payment's key outlives the TTL: still 202, same payment. */
static void test_pending_never_expires(void **state) {
  h_server_t *s = h_server_start(ttl_flags);
  const char *tok = h_tenant(s, "acme");
  h_resp_t first, r;
  (void)state;

  h_post(s, "/payments", tok, "ttl-pending", "{\"amount\": 7070}", &first);
  h_assert_first(&first, 202);
  h_assert_db(s, 1,
              "SELECT count(*) FROM idempotency_records WHERE key = 'ttl-pending' "
              "AND state = 'pending' AND expires_at IS NULL");
  wait_until_wall_ms(h_wall_ms() + 1500);
  h_post(s, "/payments", tok, "ttl-pending", "{\"amount\": 7070}", &r);
  h_assert_replay_of(&r, &first);
  h_resp_free(&r);
  h_assert_db(s, 1, "SELECT count(*) FROM payments");
  h_resp_free(&first);
  h_server_stop(s);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_completed_key_expires, h_teardown),
      cmocka_unit_test_teardown(test_expired_key_takes_any_request, h_teardown),
      cmocka_unit_test_teardown(test_pending_never_expires, h_teardown),
  };
  int rc;
  h_init(argc, argv);
  rc = cmocka_run_group_tests_name("integration: key expiry", tests, NULL, NULL);
  curl_global_cleanup();
  return rc;
}
