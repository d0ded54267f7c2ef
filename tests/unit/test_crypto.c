/* Tests the random tokens of idem/crypto.h: their alphabet, and the order
 * of sortable tokens (resource ids rely on it to append to their index). */
#include "support.h"

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

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_random_token),
      cmocka_unit_test(test_sortable_token_order),
      cmocka_unit_test(test_sortable_token_unique),
      cmocka_unit_test(test_sortable_token_too_short),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
