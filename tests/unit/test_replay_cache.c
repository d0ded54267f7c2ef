/* Unit tests of the replay cache: hits, expiry, scope isolation,
 * replacement, and the byte budget. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "server/replay_cache.h"

#define FP_A "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
#define FP_B "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"

static void test_hit_and_miss(void **state) {
  idemd_replay_cache_t *c = idemd_replay_cache_new(1 << 20);
  idem_scope_t sc = {7, "create_payment", "k1"};
  idemd_replay_t out;
  (void)state;

  assert_non_null(c);
  assert_int_equal(idemd_replay_cache_get(c, &sc, 1000, &out), 0);
  idemd_replay_cache_put(c, &sc, FP_A, 201, "{\"id\":\"pay_1\",\"replayed\":true}",
                         "/payments/pay_1", 5000);
  assert_int_equal(idemd_replay_cache_get(c, &sc, 1000, &out), 1);
  assert_int_equal(out.status, 201);
  assert_string_equal(out.fingerprint, FP_A);
  assert_string_equal(out.location, "/payments/pay_1");
  assert_string_equal(out.body, "{\"id\":\"pay_1\",\"replayed\":true}");
  free(out.body);
  assert_int_equal(idemd_replay_cache_hits(c), 1);
  idemd_replay_cache_free(c);
}

static void test_expired_is_a_miss(void **state) {
  idemd_replay_cache_t *c = idemd_replay_cache_new(1 << 20);
  idem_scope_t sc = {7, "create_payment", "k1"};
  idemd_replay_t out;
  (void)state;

  idemd_replay_cache_put(c, &sc, FP_A, 201, "{}", "", 5000);
  assert_int_equal(idemd_replay_cache_get(c, &sc, 5000, &out), 0); /* at expiry */
  assert_int_equal(idemd_replay_cache_get(c, &sc, 1000, &out), 0); /* dropped */
  idemd_replay_cache_put(c, &sc, FP_A, 201, "{}", "", 0);           /* 0: not cached */
  assert_int_equal(idemd_replay_cache_get(c, &sc, 1, &out), 0);
  idemd_replay_cache_free(c);
}

static void test_scopes_are_separate(void **state) {
  idemd_replay_cache_t *c = idemd_replay_cache_new(1 << 20);
  idem_scope_t a = {7, "create_payment", "k1"};
  idem_scope_t other_tenant = {8, "create_payment", "k1"};
  idem_scope_t other_op = {7, "create_order", "k1"};
  idem_scope_t other_key = {7, "create_payment", "k2"};
  idemd_replay_t out;
  (void)state;

  idemd_replay_cache_put(c, &a, FP_A, 201, "{\"a\":1}", "", 5000);
  assert_int_equal(idemd_replay_cache_get(c, &other_tenant, 1, &out), 0);
  assert_int_equal(idemd_replay_cache_get(c, &other_op, 1, &out), 0);
  assert_int_equal(idemd_replay_cache_get(c, &other_key, 1, &out), 0);
  idemd_replay_cache_free(c);
}

static void test_put_replaces(void **state) {
  idemd_replay_cache_t *c = idemd_replay_cache_new(1 << 20);
  idem_scope_t sc = {7, "create_payment", "k1"};
  idemd_replay_t out;
  (void)state;

  idemd_replay_cache_put(c, &sc, FP_A, 201, "{\"v\":1}", "", 5000);
  idemd_replay_cache_put(c, &sc, FP_B, 402, "{\"v\":2}", "", 9000);
  assert_int_equal(idemd_replay_cache_get(c, &sc, 6000, &out), 1);
  assert_int_equal(out.status, 402);
  assert_string_equal(out.fingerprint, FP_B);
  assert_string_equal(out.body, "{\"v\":2}");
  free(out.body);
  idemd_replay_cache_free(c);
}

/* Many more entries than fit: the oldest go, the newest stay, and a
 * disabled cache (0 bytes) holds nothing. */
static void test_budget(void **state) {
  idemd_replay_cache_t *c = idemd_replay_cache_new(64 * 1024);
  char key[32], body[200];
  idemd_replay_t out;
  int first_kept = 0, last_kept = 0;
  (void)state;

  memset(body, 'x', sizeof body - 1);
  body[sizeof body - 1] = '\0';
  for (int i = 0; i < 5000; i++) {
    idem_scope_t sc = {1, "create_payment", key};
    snprintf(key, sizeof key, "k%d", i);
    idemd_replay_cache_put(c, &sc, FP_A, 201, body, "", 1000000);
  }
  for (int i = 0; i < 5000; i++) {
    idem_scope_t sc = {1, "create_payment", key};
    snprintf(key, sizeof key, "k%d", i);
    if (idemd_replay_cache_get(c, &sc, 1, &out)) {
      free(out.body);
      if (i < 100)
        first_kept++;
      if (i >= 4900)
        last_kept++;
    }
  }
  assert_int_equal(first_kept, 0);
  assert_true(last_kept > 50);
  idemd_replay_cache_free(c);

  assert_null(idemd_replay_cache_new(0));
  idem_scope_t sc = {1, "create_payment", "k"};
  idemd_replay_cache_put(NULL, &sc, FP_A, 201, "{}", "", 5000);
  assert_int_equal(idemd_replay_cache_get(NULL, &sc, 1, &out), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_hit_and_miss),     cmocka_unit_test(test_expired_is_a_miss),
      cmocka_unit_test(test_scopes_are_separate), cmocka_unit_test(test_put_replaces),
      cmocka_unit_test(test_budget),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
