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

/* More entries than buckets, so that buckets hold several: entries
 * replaced, expired and evicted from anywhere in a bucket leave the rest
 * of it whole (under AddressSanitizer, a bucket left pointing at a freed
 * entry is an error at the next look). */
static void test_many_in_each_bucket(void **state) {
  enum { KEYS = 100000 };
  idemd_replay_cache_t *c = idemd_replay_cache_new((size_t)64 << 20);
  char key[32], body[32];
  idemd_replay_t out;
  (void)state;

  for (int i = 0; i < KEYS; i++) {
    idem_scope_t sc = {1, "create_payment", key};
    snprintf(key, sizeof key, "k%d", i);
    snprintf(body, sizeof body, "{\"v\":%d}", i);
    /* Every fifth expires at 100 ms, the rest much later. */
    idemd_replay_cache_put(c, &sc, FP_A, 201, body, "/payments/x",
                           i % 5 == 0 ? 100 : 1000000);
  }
  for (int i = 0; i < KEYS; i += 3) { /* replaced */
    idem_scope_t sc = {1, "create_payment", key};
    snprintf(key, sizeof key, "k%d", i);
    snprintf(body, sizeof body, "{\"w\":%d}", i);
    idemd_replay_cache_put(c, &sc, FP_B, 402, body, "", 1000000);
  }
  for (int pass = 0; pass < 2; pass++) /* the first pass drops the expired */
    for (int i = 0; i < KEYS; i++) {
      idem_scope_t sc = {1, "create_payment", key};
      int replaced = i % 3 == 0, expired = !replaced && i % 5 == 0;
      snprintf(key, sizeof key, "k%d", i);
      snprintf(body, sizeof body, replaced ? "{\"w\":%d}" : "{\"v\":%d}", i);
      if (idemd_replay_cache_get(c, &sc, 200, &out) != !expired)
        fail_msg("pass %d, key %d: %s", pass, i, expired ? "expired, found" : "missing");
      if (!expired) {
        assert_string_equal(out.body, body);
        assert_string_equal(out.fingerprint, replaced ? FP_B : FP_A);
        assert_string_equal(out.location, replaced ? "" : "/payments/x");
        free(out.body);
      }
    }
  idemd_replay_cache_free(c);

  /* Evicted: 40 MiB hold some 130,000 of these entries, more than the
   * 65,536 buckets, so the least recently used goes from wherever it is in
   * its bucket. */
  c = idemd_replay_cache_new((size_t)40 << 20);
  for (int i = 0; i < 2 * KEYS; i++) {
    idem_scope_t sc = {1, "create_payment", key};
    snprintf(key, sizeof key, "k%d", i);
    idemd_replay_cache_put(c, &sc, FP_A, 201, "{}", "/payments/x", 1000000);
  }
  for (int i = 0; i < 2 * KEYS; i++) {
    idem_scope_t sc = {1, "create_payment", key};
    int found;
    snprintf(key, sizeof key, "k%d", i);
    found = idemd_replay_cache_get(c, &sc, 200, &out);
    if (found)
      free(out.body);
    if (i < KEYS / 2 && found)
      fail_msg("key %d of the first half was kept", i);
    if (i >= KEYS + KEYS / 2 && !found)
      fail_msg("key %d of the last half is missing", i);
  }
  idemd_replay_cache_free(c);
}

/* put_value()/use(): a caller's own value, handed to use() while live,
 * freed once when replaced, expired, over the budget or with the cache,
 * and at once when it cannot be kept. */
static int freed;
static void free_counted(void *v) {
  freed++;
  free(v);
}

static int use_it(void *value, int status, const char *fingerprint, void *arg) {
  *(const char **)arg = value;
  assert_int_equal(status, 201);
  assert_string_equal(fingerprint, FP_A);
  return 1;
}

static void test_values(void **state) {
  idemd_replay_cache_t *c = idemd_replay_cache_new(16 * 4096);
  idem_scope_t sc = {7, "create_payment", "k1"}, other = {7, "create_payment", "k2"};
  const char *seen = NULL;
  (void)state;

  freed = 0;
  assert_int_equal(idemd_replay_cache_use(c, &sc, 1000, use_it, &seen), 0);
  idemd_replay_cache_put_value(c, &sc, FP_A, 201, strdup("one"), 3, free_counted, 5000);
  assert_int_equal(idemd_replay_cache_use(c, &sc, 1000, use_it, &seen), 1);
  assert_string_equal(seen, "one");
  assert_int_equal(idemd_replay_cache_hits(c), 1);
  /* Replaced: the old value freed. */
  idemd_replay_cache_put_value(c, &sc, FP_A, 201, strdup("two"), 3, free_counted, 5000);
  assert_int_equal(freed, 1);
  assert_int_equal(idemd_replay_cache_use(c, &sc, 1000, use_it, &seen), 1);
  assert_string_equal(seen, "two");
  /* Expired: a miss, and freed. */
  assert_int_equal(idemd_replay_cache_use(c, &sc, 5000, use_it, &seen), 0);
  assert_int_equal(freed, 2);
  /* Too large for a shard: not kept, freed at once. */
  idemd_replay_cache_put_value(c, &other, FP_A, 201, strdup("big"), 4096, free_counted, 5000);
  assert_int_equal(freed, 3);
  assert_int_equal(idemd_replay_cache_use(c, &other, 1000, use_it, &seen), 0);
  /* Freed with the cache. */
  idemd_replay_cache_put_value(c, &other, FP_A, 201, strdup("three"), 3, free_counted, 5000);
  idemd_replay_cache_free(c);
  assert_int_equal(freed, 4);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_hit_and_miss),     cmocka_unit_test(test_expired_is_a_miss),
      cmocka_unit_test(test_scopes_are_separate), cmocka_unit_test(test_put_replaces),
      cmocka_unit_test(test_budget),      cmocka_unit_test(test_many_in_each_bucket),
      cmocka_unit_test(test_values),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
