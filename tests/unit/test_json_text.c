/* Tests util/json_text.c's numbers against printf's "%lld", and the
 * escaping for the log line, whole and cut at every length. (Its JSON
 * strings are checked against jansson through the payment's and the
 * order's text, in test_payment and test_validate.) */
#include "support.h"

#include <limits.h>
#include <stdlib.h>

#include "util/json_text.h"

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

/* Each byte alone as a JSON string: as jansson writes it for visible
 * ASCII (and DEL), \u00XX below 0x20. */
static void test_string_bytes(void **state) {
  char in[2] = {0, 0}, got[IDEM_JSON_STRING_MAX(1)], want[16];
  (void)state;

  for (int c = 1; c < 0x80; c++) {
    in[0] = (char)c;
    if (c < 0x20) {
      snprintf(want, sizeof want, "\"\\u%04x\"", c);
    } else {
      json_t *v = json_string(in);
      char *text = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
      assert_non_null(text);
      snprintf(want, sizeof want, "%s", text);
      free(text);
      json_decref(v);
    }
    size_t n = idem__json_string(got, in);
    assert_int_equal(n, strlen(want));
    assert_memory_equal(got, want, n);
  }
}

/* Escapes `in` with each cap from 0 to past its escaped length: each time
 * the first `cap` bytes of `want`, and nothing written past them. */
static void check_escape(const char *in, const char *want) {
  size_t len = strlen(want);
  char got[256];

  assert_true(len + 2 < sizeof got);
  for (size_t cap = 0; cap <= len + 2; cap++) {
    size_t expect = cap < len ? cap : len;
    memset(got, 'x', sizeof got);
    assert_int_equal(idem__json_escape_ascii(got, cap, in), expect);
    assert_memory_equal(got, want, expect);
    assert_int_equal(got[expect], 'x');
  }
}

static void test_escape_ascii(void **state) {
  static const struct {
    const char *in, *want;
  } cases[] = {
      {"", ""},
      {"req_01 /payments?x=1~", "req_01 /payments?x=1~"},
      {"a\"b", "a\\\"b"},
      {"back\\slash", "back\\\\slash"},
      {"\n\t\x01\x1f", "\\u000a\\u0009\\u0001\\u001f"},
      {"\x7f", "\\u007f"},
      {"caf\xc3\xa9", "caf\\u00c3\\u00a9"}, /* UTF-8 bytes, one by one */
      {"\xff\"", "\\u00ff\\\""},
  };
  char in[2], want[8], got[8];
  (void)state;

  for (size_t i = 0; i < ARRAY_LEN(cases); i++)
    check_escape(cases[i].in, cases[i].want);
  /* Every byte alone: itself when visible ASCII or space, else escaped. */
  for (int c = 1; c < 256; c++) {
    in[0] = (char)c;
    in[1] = '\0';
    if (c == '"' || c == '\\')
      snprintf(want, sizeof want, "\\%c", c);
    else if (c < 0x20 || c > 0x7e)
      snprintf(want, sizeof want, "\\u%04x", c);
    else
      snprintf(want, sizeof want, "%c", c);
    assert_int_equal(idem__json_escape_ascii(got, sizeof got, in), strlen(want));
    assert_memory_equal(got, want, strlen(want));
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_int_matches_printf),
      cmocka_unit_test(test_string_bytes),
      cmocka_unit_test(test_escape_ascii),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
