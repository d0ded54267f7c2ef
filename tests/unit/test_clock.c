/* Tests lib/clock.c: RFC 3339 timestamps, formatted once per second per
 * thread, against gmtime_r() and strftime() called every time. */
#include "support.h"

#include <time.h>

#include "idem/clock.h"

/* What idem_format_time() wrote before it remembered a second. */
static void with_libc(int64_t ms, char *out, size_t outlen) {
  time_t secs = (time_t)(ms / 1000);
  struct tm tm;
  gmtime_r(&secs, &tm);
  if (strftime(out, outlen, "%Y-%m-%dT%H:%M:%SZ", &tm) == 0 && outlen > 0)
    out[0] = '\0';
}

static void check(int64_t ms, size_t outlen) {
  char got[64], want[64];

  memset(got, 'x', sizeof got);
  memset(want, 'x', sizeof want);
  idem_format_time(ms, got, outlen);
  with_libc(ms, want, outlen);
  if (outlen > 0 && strcmp(got, want) != 0)
    fail_msg("%lld ms, %zu bytes: \"%s\", want \"%s\"", (long long)ms, outlen, got, want);
  for (size_t i = outlen; i < sizeof got; i++) /* nothing written past outlen */
    if (got[i] != 'x')
      fail_msg("%lld ms, %zu bytes: byte %zu written", (long long)ms, outlen, i);
}

/* The same second twice, the next, an earlier one again, milliseconds
 * within one second, before the epoch, and far years. */
static void test_matches_libc(void **state) {
  static const int64_t ms[] = {
      1796040799000, 1796040799999, 1796040800000, 1796040799500, 0, 999, 1000,
      -1,  -1000, -1001, 946684800000, 4102444800000, 253402300799000, 253402300800000,
      1796040800000, 1796040800001};
  (void)state;

  for (size_t i = 0; i < ARRAY_LEN(ms); i++)
    check(ms[i], 64);
  assert_int_equal(strlen("2026-12-01T00:00:00Z"), 20);
}

/* A buffer too small for the text gets an empty string, as from
 * strftime(), whether the second was formatted before or not; one of no
 * bytes is not written. */
static void test_small_buffers(void **state) {
  (void)state;
  for (size_t outlen = 0; outlen <= 22; outlen++) {
    check(1796040799000, outlen); /* remembered from the check before */
    check(1796040801000 + (int64_t)outlen * 1000, outlen); /* a new second */
  }
  check(253402300800000, 21); /* year 10000: 21 characters */
  check(253402300800000, 22);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_matches_libc),
      cmocka_unit_test(test_small_buffers),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
