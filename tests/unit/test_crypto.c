/* Tests the random tokens of idem/crypto.h: their alphabet, and the order
 * of sortable tokens (resource ids rely on it to append to their index). */
#include "support.h"

#include <pthread.h>
#include <string.h>

#include "idem/crypto.h"

static int in_alphabet(const char *s) {
  return strspn(s, "0123456789abcdefghijklmnopqrstuv") == strlen(s);
}

static void test_random_token(void **state) {
  char a[25], b[25];
  (void)state;
  assert_int_equal(idem_random_token(a, 24), IDEM_OK);
  assert_int_equal(idem_random_token(b, 24), IDEM_OK);
  assert_int_equal(strlen(a), 24);
  assert_true(in_alphabet(a));
  assert_string_not_equal(a, b);
}

/* Later times sort after earlier ones, whatever the random part, across
 * every carry of the time digits. */
static void test_sortable_token_order(void **state) {
  static const int64_t times[] = {0, 1, 31, 32, 1023, 1024, 1796083200000,
                                  1796083200001, 1796083200031, 1796083200032,
                                  ((int64_t)1 << 50) - 1};
  char prev[25], cur[25];
  (void)state;
  for (size_t i = 0; i < sizeof times / sizeof *times; i++) {
    assert_int_equal(idem_sortable_token(cur, 24, times[i]), IDEM_OK);
    assert_int_equal(strlen(cur), 24);
    assert_true(in_alphabet(cur));
    if (i > 0)
      assert_true(strcmp(prev, cur) < 0);
    memcpy(prev, cur, sizeof cur);
  }
}

/* The same millisecond gives different tokens: the random part differs. */
static void test_sortable_token_unique(void **state) {
  char a[25], b[25];
  (void)state;
  assert_int_equal(idem_sortable_token(a, 24, 1796083200000), IDEM_OK);
  assert_int_equal(idem_sortable_token(b, 24, 1796083200000), IDEM_OK);
  assert_memory_equal(a, b, 10);
  assert_string_not_equal(a, b);
}

static void test_sortable_token_too_short(void **state) {
  char out[11] = "xxxxxxxxxx";
  (void)state;
  assert_int_equal(idem_sortable_token(out, 10, 1), IDEM_EINVAL);
  assert_string_equal(out, "");
}

/* SHA-256 of "abc" (FIPS 180-2), several times on one thread's context. */
static void test_sha256_known_answer(void **state) {
  static const char want[] =
      "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
  unsigned char d[IDEM_SHA256_LEN];
  char hex[2 * IDEM_SHA256_LEN + 1];
  (void)state;
  for (int i = 0; i < 3; i++) {
    assert_int_equal(idem_sha256("abc", 3, d), IDEM_OK);
    idem_hex(d, sizeof d, hex);
    assert_string_equal(hex, want);
    assert_int_equal(idem_sha256("", 0, d), IDEM_OK); /* in between */
  }
}

/* A keyed HMAC gives what the one-shot form gives, call after call, with
 * two keys used in turn (each thread keeps a copy of the last one used). */
static void check_hmac_matches(void) {
  static const char *const msgs[] = {"", "a", "key id input", "another message"};
  idem_hmac_t *h1 = idem_hmac_new("k1", 2);
  idem_hmac_t *h2 = idem_hmac_new("second key", 10);
  unsigned char got[IDEM_SHA256_LEN], want[IDEM_SHA256_LEN];

  assert_non_null(h1);
  assert_non_null(h2);
  for (int round = 0; round < 3; round++) {
    for (size_t i = 0; i < sizeof msgs / sizeof *msgs; i++) {
      size_t len = strlen(msgs[i]);
      assert_int_equal(idem_hmac_compute(h1, msgs[i], len, got), IDEM_OK);
      assert_int_equal(idem_hmac_sha256("k1", 2, msgs[i], len, want), IDEM_OK);
      assert_memory_equal(got, want, sizeof got);
      assert_int_equal(idem_hmac_compute(h1, msgs[i], len, got), IDEM_OK);
      assert_memory_equal(got, want, sizeof got);
      if (round > 0) {
        assert_int_equal(idem_hmac_compute(h2, msgs[i], len, got), IDEM_OK);
        assert_int_equal(idem_hmac_sha256("second key", 10, msgs[i], len, want), IDEM_OK);
        assert_memory_equal(got, want, sizeof got);
      }
    }
  }
  idem_hmac_free(h1);
  /* A new key after a free is never mistaken for the freed one, even at
   * the same address. */
  h1 = idem_hmac_new("k3", 2);
  assert_non_null(h1);
  assert_int_equal(idem_hmac_compute(h1, "x", 1, got), IDEM_OK);
  assert_int_equal(idem_hmac_sha256("k3", 2, "x", 1, want), IDEM_OK);
  assert_memory_equal(got, want, sizeof got);
  idem_hmac_free(h1);
  idem_hmac_free(h2);
}

static void *hmac_thread(void *arg) {
  (void)arg;
  check_hmac_matches();
  return NULL;
}

static void test_hmac_matches_one_shot(void **state) {
  pthread_t t[4];
  (void)state;
  check_hmac_matches();
  for (int i = 0; i < 4; i++)
    assert_int_equal(pthread_create(&t[i], NULL, hmac_thread, NULL), 0);
  for (int i = 0; i < 4; i++)
    assert_int_equal(pthread_join(t[i], NULL), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_random_token),
      cmocka_unit_test(test_sortable_token_order),
      cmocka_unit_test(test_sortable_token_unique),
      cmocka_unit_test(test_sortable_token_too_short),
      cmocka_unit_test(test_sha256_known_answer),
      cmocka_unit_test(test_hmac_matches_one_shot),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
