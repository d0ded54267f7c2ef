/* Tests lib/json_text.c's numbers against printf's "%lld". (Its strings
 * are checked against jansson through the payment's and the order's text,
 * in test_payment and test_validate.) */
#include "support.h"

#include <limits.h>
#include <stdlib.h>

#include "../../src/lib/json_text.h"

static void check(long long v) {
  char got[IDEM_JSON_INT_MAX + 1], want[32];
  size_t n;

  memset(got, 'x', sizeof got);
  n = idem__json_int(got, v);
  snprintf(want, sizeof want, "%lld", v);
  assert_true(n <= IDEM_JSON_INT_MAX);
  assert_int_equal(n, strlen(want));
  assert_memory_equal(got, want, n);
  assert_int_equal(got[n], 'x'); /* nothing past the digits */
}

static void test_int_matches_printf(void **state) {
  static const long long edges[] = {
      0,       1,         -1,        9,         10,           -10,
      99,      100,       15990,     -15990,    INT_MAX,      INT_MIN,
      LLONG_MAX, LLONG_MIN, LLONG_MIN + 1, LLONG_MAX - 1};
  (void)state;

  for (size_t i = 0; i < ARRAY_LEN(edges); i++)
    check(edges[i]);
  /* Every power of ten, and one either side of it, both signs. */
  for (long long p = 1; p <= LLONG_MAX / 10; p *= 10)
    for (long long d = -1; d <= 1; d++) {
      check(p * 10 + d);
      check(-(p * 10 + d));
    }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_int_matches_printf),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
