/* Unit tests of the client's pure parts: the full-jitter backoff, Retry-After
 * parsing, generated keys (UUID v4), and the arguments idem_client_request()
 * refuses before sending anything. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>
#include <curl/curl.h>

#include "idem/client.h"
#include "idem/crypto.h"

#define DRAWS 2000

static uint64_t random_u64(void) {
  uint64_t v = 0;
  assert_int_equal(idem_random_bytes(&v, sizeof v), IDEM_OK);
  return v;
}

/* The ceiling min(cap, base * 2^retry), computed the slow way. */
static int64_t ceiling_of(const idem_client_opts_t *o, int retry) {
  int64_t c = o->base_delay_ms;
  for (int i = 0; i < retry; i++) {
    if (c >= o->max_delay_ms)
      return o->max_delay_ms;
    c *= 2;
  }
  return c < o->max_delay_ms ? c : o->max_delay_ms;
}

static void test_defaults(void **state) {
  idem_client_opts_t o;
  (void)state;
  memset(&o, 0xff, sizeof o);
  idem_client_opts_default(&o);
  assert_int_equal(o.max_attempts, 8);
  assert_int_equal(o.max_time_ms, 30000);
  assert_int_equal(o.base_delay_ms, 100);
  assert_int_equal(o.max_delay_ms, 5000);
  assert_int_equal(o.attempt_timeout_ms, 10000);
  assert_int_equal(o.max_response_bytes, 1024 * 1024);
  assert_null(o.on_event);
  assert_null(o.event_ctx);
}

/* Every draw lies in [0, ceiling]; the draws spread over that range (no
 * constant, no "ceiling always"); the ceiling doubles then stops at the cap. */
static void test_backoff_full_jitter(void **state) {
  idem_client_opts_t o;
  (void)state;
  idem_client_opts_default(&o);
  for (int retry = 0; retry <= 12; retry++) {
    int64_t ceil = ceiling_of(&o, retry), lo = INT64_MAX, hi = -1;
    for (int i = 0; i < DRAWS; i++) {
      int64_t d = idem_client_backoff_ms(&o, retry, random_u64());
      assert_in_range(d, 0, ceil);
      lo = d < lo ? d : lo;
      hi = d > hi ? d : hi;
    }
    /* With 2000 uniform draws, the extremes fall within 10% of the ends. */
    assert_true(lo <= ceil / 10);
    assert_true(hi >= ceil - ceil / 10);
  }
  assert_int_equal(ceiling_of(&o, 0), 100);
  assert_int_equal(ceiling_of(&o, 3), 800);
  assert_int_equal(ceiling_of(&o, 6), 5000);
}

/* The ends of the mapping, the cap at absurd retry numbers, and degenerate
 * knobs. */
static void test_backoff_bounds(void **state) {
  static const struct {
    int64_t base, cap;
    int retry;
    uint64_t rnd;
    int64_t want;
  } rows[] = {
      {100, 5000, 0, 0, 0},
      {100, 5000, 0, 100, 100}, /* rnd % 101: the ceiling itself is reachable */
      {100, 5000, 0, 101, 0},
      {100, 5000, 2, 400, 400},
      {100, 5000, 2, 401, 0},
      {100, 5000, 30, 5000, 5000},   /* capped */
      {100, 5000, 1000, 5000, 5000}, /* no overflow on a huge retry */
      {100, 5000, 62, UINT64_MAX, (int64_t)(UINT64_MAX % 5001)},
      {100, 50, 0, 50, 50},   /* cap below base: the cap wins */
      {0, 5000, 5, 12345, 0}, /* base 0: no wait */
      {100, 0, 5, 12345, 0},  /* cap 0: no wait */
      {-5, -5, 3, 12345, 0},  /* negative knobs count as 0 */
      {INT64_MAX / 2, INT64_MAX, 3, 7, 7},
  };
  (void)state;
  for (size_t i = 0; i < sizeof rows / sizeof *rows; i++) {
    idem_client_opts_t o;
    idem_client_opts_default(&o);
    o.base_delay_ms = rows[i].base;
    o.max_delay_ms = rows[i].cap;
    if (idem_client_backoff_ms(&o, rows[i].retry, rows[i].rnd) != rows[i].want)
      fail_msg("row %zu: got %lld, want %lld", i,
               (long long)idem_client_backoff_ms(&o, rows[i].retry, rows[i].rnd),
               (long long)rows[i].want);
  }
}

/* 1994-11-06T08:49:37Z, the date of RFC 9110's examples. */
#define RFC_DATE_MS 784111777000LL

static void test_retry_after(void **state) {
  static const struct {
    const char *value;
    int64_t now_ms;
    int rc;
    int64_t want;
  } rows[] = {
      {"1", 0, IDEM_OK, 1000},
      {"0", 0, IDEM_OK, 0},
      {"120", 0, IDEM_OK, 120000},
      {"  2\t", 0, IDEM_OK, 2000},
      {"007", 0, IDEM_OK, 7000},
      {"99999999999999999999999", 0, IDEM_OK, 1000000000LL * 1000},
      {"Sun, 06 Nov 1994 08:49:37 GMT", RFC_DATE_MS - 3000, IDEM_OK, 3000},
      {"Sunday, 06-Nov-94 08:49:37 GMT", RFC_DATE_MS - 1500, IDEM_OK, 1500},
      {"Sun Nov  6 08:49:37 1994", RFC_DATE_MS - 60000, IDEM_OK, 60000},
      {"Sun, 06 Nov 1994 08:49:37 GMT", RFC_DATE_MS + 5000, IDEM_OK, 0}, /* past */
      {"", 0, IDEM_EINVAL, -7},
      {"   ", 0, IDEM_EINVAL, -7},
      {"-1", 0, IDEM_EINVAL, -7},
      {"+3", 0, IDEM_EINVAL, -7},
      {"1.5", 0, IDEM_EINVAL, -7},
      {"1 2", 0, IDEM_EINVAL, -7},
      {"10s", 0, IDEM_EINVAL, -7},
      {"soon", 0, IDEM_EINVAL, -7},
      {"Sun, 99 Foo 1994 99:99:99 GMT", 0, IDEM_EINVAL, -7},
  };
  int64_t d;
  (void)state;
  for (size_t i = 0; i < sizeof rows / sizeof *rows; i++) {
    int rc;
    d = -7;
    rc = idem_client_retry_after_ms(rows[i].value, rows[i].now_ms, &d);
    if (rc != rows[i].rc || d != rows[i].want)
      fail_msg("'%s': rc %d delay %lld, want rc %d delay %lld", rows[i].value, rc,
               (long long)d, rows[i].rc, (long long)rows[i].want);
  }
  d = -7;
  assert_int_equal(idem_client_retry_after_ms(NULL, 0, &d), IDEM_EINVAL);
  assert_int_equal(d, -7);
}

/* xxxxxxxx-xxxx-4xxx-[89ab]xxx-xxxxxxxxxxxx, lower-case hex. */
static int is_uuid_v4(const char *s) {
  if (strlen(s) != IDEM_CLIENT_UUID_LEN)
    return 0;
  for (int i = 0; i < IDEM_CLIENT_UUID_LEN; i++) {
    int dash = i == 8 || i == 13 || i == 18 || i == 23;
    if (dash ? s[i] != '-'
             : !((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
      return 0;
  }
  return s[14] == '4' && strchr("89ab", s[19]) != NULL;
}

static void test_is_uuid_v4_itself(void **state) {
  (void)state;
  assert_true(is_uuid_v4("0b7c6a4e-1f2d-4e8a-9c3f-2d6b8e1a5f40"));
  assert_false(is_uuid_v4("0b7c6a4e-1f2d-1e8a-9c3f-2d6b8e1a5f40")); /* version 1 */
  assert_false(is_uuid_v4("0b7c6a4e-1f2d-4e8a-7c3f-2d6b8e1a5f40")); /* variant */
  assert_false(is_uuid_v4("0B7C6A4E-1F2D-4E8A-9C3F-2D6B8E1A5F40")); /* upper case */
  assert_false(is_uuid_v4("0b7c6a4e1f2d-4e8a-9c3f-2d6b8e1a5f40-"));
  assert_false(is_uuid_v4("0b7c6a4e-1f2d-4e8a-9c3f-2d6b8e1a5f4"));
}

#define NKEYS 512

/* Valid v4 shape, all different; the variant nibble takes all four values
 * and the other nibbles vary (the bits are random, not a counter). */
static void test_new_key(void **state) {
  static char keys[NKEYS][IDEM_CLIENT_UUID_LEN + 1];
  int variants[4] = {0};
  (void)state;
  for (int i = 0; i < NKEYS; i++) {
    assert_int_equal(idem_client_new_key(keys[i]), IDEM_OK);
    if (!is_uuid_v4(keys[i]))
      fail_msg("not a UUID v4: %s", keys[i]);
    variants[strchr("89ab", keys[i][19]) - "89ab"]++;
    for (int j = 0; j < i; j++)
      if (strcmp(keys[i], keys[j]) == 0)
        fail_msg("the same key twice: %s", keys[i]);
  }
  for (int v = 0; v < 4; v++)
    assert_true(variants[v] > 0);
  for (int pos = 0; pos < IDEM_CLIENT_UUID_LEN; pos++) {
    int differs = 0;
    if (pos == 8 || pos == 13 || pos == 14 || pos == 18 || pos == 23)
      continue;
    for (int i = 1; i < NKEYS && !differs; i++)
      differs = keys[i][pos] != keys[0][pos];
    if (!differs)
      fail_msg("position %d is the same in %d keys", pos, NKEYS);
  }
}

static void test_outcome_names(void **state) {
  (void)state;
  assert_int_equal(IDEM_CLIENT_DONE, 0);
  assert_string_equal(idem_client_outcome_str(IDEM_CLIENT_DONE), "final answer");
  assert_string_equal(idem_client_outcome_str(IDEM_CLIENT_REJECTED),
                      "answer not retried");
  assert_string_equal(idem_client_outcome_str(IDEM_CLIENT_GAVE_UP), "gave up");
  assert_string_equal(idem_client_outcome_str(IDEM_CLIENT_PENDING), "still pending");
  assert_string_equal(idem_client_outcome_str(IDEM_CLIENT_FAILED), "local failure");
  assert_string_equal(idem_client_outcome_str(IDEM_CLIENT_OUTCOME_MAX_),
                      "unknown outcome");
  assert_string_equal(idem_client_outcome_str(-1), "unknown outcome");
}

/* Refused before anything is sent: the URL points at a port nothing
 * listens on, so a request that did go out would come back GAVE_UP, not
 * IDEM_EINVAL. */
static void test_invalid_requests(void **state) {
  static const char url[] = "http://127.0.0.1:1/payments";
  char long_key[IDEM_KEY_MAX + 2];
  static char long_line[IDEM_CLIENT_HEADER_LINE_MAX + 2];
  static const char *too_many[IDEM_CLIENT_HEADERS_MAX + 2];
  idem_client_opts_t zero_attempts, zero_time, zero_bytes;
  struct {
    idem_client_request_t req;
    const idem_client_opts_t *opts;
  } rows[] = {
      {{.url = NULL}, NULL},
      {{.url = "ftp://127.0.0.1/x"}, NULL},
      {{.url = "not a url"}, NULL},
      {{.url = "/payments"}, NULL},
      {{.url = url, .method = "post"}, NULL},
      {{.url = url, .method = "PO ST"}, NULL},
      {{.url = url, .method = ""}, NULL},
      {{.url = url, .key = ""}, NULL},
      {{.url = url, .key = "a b"}, NULL},
      {{.url = url, .key = "abc\r\nX-Injected: 1"}, NULL},
      {{.url = url, .key = "caf\xc3\xa9"}, NULL},
      {{.url = url, .key = long_key}, NULL},
      {{.url = url, .token = "tok en"}, NULL},
      {{.url = url, .token = "tok\nen"}, NULL},
      {{.url = url}, &zero_attempts},
      {{.url = url}, &zero_time},
      {{.url = url}, &zero_bytes},
      {{.url = url, .headers = (const char *const[]){"NoColon", NULL}}, NULL},
      {{.url = url, .headers = (const char *const[]){": empty name", NULL}}, NULL},
      {{.url = url, .headers = (const char *const[]){"Bad Name: x", NULL}}, NULL},
      {{.url = url, .headers = (const char *const[]){"X(y): x", NULL}}, NULL},
      {{.url = url, .headers = (const char *const[]){"X-A: 1\r\nX-B: 2", NULL}}, NULL},
      {{.url = url, .headers = (const char *const[]){"X-A: 1\n", NULL}}, NULL},
      {{.url = url, .headers = (const char *const[]){"X-A: \x7f", NULL}}, NULL},
      {{.url = url,
        .headers = (const char *const[]){"X-Ok: 1", "Idempotency-Key: k", NULL}},
       NULL},
      {{.url = url, .headers = (const char *const[]){"IDEMPOTENCY-KEY: k", NULL}}, NULL},
      {{.url = url, .headers = (const char *const[]){"content-length: 1", NULL}}, NULL},
      {{.url = url, .headers = (const char *const[]){"Transfer-Encoding: chunked", NULL}},
       NULL},
      {{.url = url, .headers = (const char *const[]){long_line, NULL}}, NULL},
      {{.url = url, .headers = too_many}, NULL},
  };
  (void)state;
  memset(long_line, 'v', sizeof long_line - 1);
  memcpy(long_line, "X-Long: ", 8);
  for (int i = 0; i <= IDEM_CLIENT_HEADERS_MAX; i++)
    too_many[i] = "X-Many: 1";
  memset(long_key, 'k', sizeof long_key - 1);
  long_key[sizeof long_key - 1] = '\0';
  idem_client_opts_default(&zero_attempts);
  zero_attempts.max_attempts = 0;
  idem_client_opts_default(&zero_time);
  zero_time.max_time_ms = 0;
  idem_client_opts_default(&zero_bytes);
  zero_bytes.max_response_bytes = 0;
  for (size_t i = 0; i < sizeof rows / sizeof *rows; i++) {
    idem_client_result_t r;
    memset(&r, 0x5a, sizeof r);
    int rc = idem_client_request(&rows[i].req, rows[i].opts, &r);
    if (rc != IDEM_EINVAL)
      fail_msg("row %zu: rc %d, want IDEM_EINVAL", i, rc);
    assert_null(r.body);
    assert_int_equal(r.attempts, 0);
    idem_client_result_free(&r); /* harmless on what a failure leaves */
  }
  assert_int_equal(idem_client_request(NULL, NULL, NULL), IDEM_EINVAL);
  idem_client_result_free(NULL);
}

/* A key of exactly 255 characters is accepted (and then not sent
 * anywhere that answers: port 1 refuses, so the call gives up). */
static void test_longest_key_accepted(void **state) {
  char key[IDEM_KEY_MAX + 1];
  idem_client_opts_t o;
  idem_client_result_t r;
  idem_client_request_t req = {.url = "http://127.0.0.1:1/payments", .key = key};
  (void)state;
  memset(key, 'k', IDEM_KEY_MAX);
  key[IDEM_KEY_MAX] = '\0';
  idem_client_opts_default(&o);
  o.max_attempts = 2;
  o.base_delay_ms = 1;
  assert_int_equal(idem_client_request(&req, &o, &r), IDEM_OK);
  assert_int_equal(r.outcome, IDEM_CLIENT_GAVE_UP);
  assert_int_equal(r.attempts, 2);
  assert_int_equal(r.status, 0);
  assert_string_equal(r.key, key);
  assert_true(r.error[0] != '\0');
  idem_client_result_free(&r);
}

/* Extra headers at the limits are accepted: IDEM_CLIENT_HEADERS_MAX lines,
 * one of them IDEM_CLIENT_HEADER_LINE_MAX bytes, tabs and bytes past ASCII
 * in a value, an empty value. */
static void test_headers_at_limits_accepted(void **state) {
  static char long_line[IDEM_CLIENT_HEADER_LINE_MAX + 1];
  static const char *headers[IDEM_CLIENT_HEADERS_MAX + 1];
  idem_client_opts_t o;
  idem_client_result_t r;
  idem_client_request_t req = {.url = "http://127.0.0.1:1/payments", .headers = headers};
  (void)state;
  memset(long_line, 'v', sizeof long_line - 1);
  memcpy(long_line, "X-Long: ", 8);
  headers[0] = long_line;
  headers[1] = "X-Tab: a\tb";
  headers[2] = "X-Utf8: caf\xc3\xa9";
  headers[3] = "X-Empty:";
  for (int i = 4; i < IDEM_CLIENT_HEADERS_MAX; i++)
    headers[i] = "X-Many: 1";
  idem_client_opts_default(&o);
  o.max_attempts = 1;
  assert_int_equal(idem_client_request(&req, &o, &r), IDEM_OK);
  assert_int_equal(r.outcome, IDEM_CLIENT_GAVE_UP);
  assert_int_equal(r.attempts, 1);
  idem_client_result_free(&r);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_defaults),
      cmocka_unit_test(test_backoff_full_jitter),
      cmocka_unit_test(test_backoff_bounds),
      cmocka_unit_test(test_retry_after),
      cmocka_unit_test(test_is_uuid_v4_itself),
      cmocka_unit_test(test_new_key),
      cmocka_unit_test(test_outcome_names),
      cmocka_unit_test(test_invalid_requests),
      cmocka_unit_test(test_longest_key_accepted),
      cmocka_unit_test(test_headers_at_limits_accepted),
  };
  int failed;
  curl_global_init(CURL_GLOBAL_DEFAULT);
  failed = cmocka_run_group_tests(tests, NULL, NULL);
  curl_global_cleanup();
  return failed;
}
