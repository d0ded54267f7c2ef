/* Tests lib/clock.c: RFC 3339 timestamps, formatted once per second per
 * thread, against gmtime_r() and strftime() called every time. */
#include "support.h"

#include <pthread.h>
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
}

/* A buffer too small for the text gets an empty string, as from
 * strftime(), whether the second was formatted before or not; one of no
 * bytes is not written. */
static void test_small_buffers(void **state) {
  (void)state;
  for (size_t outlen = 0; outlen <= 22; outlen++) {
    check(1796040801000 + (int64_t)outlen * 1000, outlen); /* a new second */
    check(1796040799000, 64);
    check(1796040799000, outlen); /* the second just formatted */
  }
  check(253402300800000, 21); /* year 10000: 21 characters */
  check(253402300800000, 22);
}

/* Two threads formatting different seconds at once each get their own:
 * the remembered second is per thread (ThreadSanitizer, which runs the
 * unit tests, would report one shared between threads). */
struct stamper {
  int64_t base_ms;
  int wrong;
};

static void *stamp_many(void *p) {
  struct stamper *st = p;
  for (int i = 0; i < 20000; i++) {
    int64_t ms = st->base_ms + (int64_t)(i % 7) * 1000;
    char got[64], want[64];
    idem_format_time(ms, got, sizeof got);
    with_libc(ms, want, sizeof want);
    st->wrong += strcmp(got, want) != 0;
  }
  return NULL;
}

static void test_per_thread(void **state) {
  struct stamper st[2] = {{1796040799000, 0}, {946684800000, 0}};
  pthread_t t[2];
  (void)state;

  for (int i = 0; i < 2; i++)
    assert_int_equal(pthread_create(&t[i], NULL, stamp_many, &st[i]), 0);
  for (int i = 0; i < 2; i++)
    pthread_join(t[i], NULL);
  assert_int_equal(st[0].wrong, 0);
  assert_int_equal(st[1].wrong, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_matches_libc),
      cmocka_unit_test(test_small_buffers),
      cmocka_unit_test(test_per_thread),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
