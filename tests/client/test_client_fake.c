/* The client against a scripted fake server on 127.0.0.1: what it retries
 * (409 with Retry-After, 5xx, dropped connections, timeouts) and what it
 * does not (other 4xx), that every attempt carries one Idempotency-Key, how
 * a 202 is followed, and the `idem` command's output and exit status. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <curl/curl.h>

#include "idem/client.h"
#include "support.h"

#define RUN_TIMEOUT_S 60.0
#define LIVENESS_S 25.0 /* generous: a bound on hanging, not on speed */

static const char PAY_PENDING[] =
    "{\"id\":\"pay_1\",\"amount\":100,\"status\":\"pending\"}";
static const char PAY_OK[] = "{\"id\":\"pay_1\",\"amount\":100,\"status\":\"succeeded\"}";
static const char PAY_REPLAY[] =
    "{\"id\":\"pay_1\",\"amount\":100,\"status\":\"succeeded\",\"replayed\":true}";
static const char BODY[] = "{\"amount\":100}";

static void url_of(const ct_fake_t *f, const char *path, char *out, size_t cap) {
  snprintf(out, cap, "http://127.0.0.1:%d%s", ct_fake_port(f), path);
}

/* Runs the real `idem` with `args` after the binary's path. */
static void cli(ct_run_t *r, const char *const *args, const char *const *env) {
  const char *argv[CT_MAX_ARGS + 1] = {ct_cli_path()};
  int n = 1;
  while (args[n - 1] && n < CT_MAX_ARGS) {
    argv[n] = args[n - 1];
    n++;
  }
  argv[n] = NULL;
  ct_run(r, argv, env, RUN_TIMEOUT_S);
  if (r->timed_out)
    fail_msg("idem did not finish in %.0f s; stderr: %s", RUN_TIMEOUT_S, r->err);
}

/* Every request the fake saw is `method` `path` (or any when NULL) with the
 * key `key`; returns how many. */
static int assert_all_with_key(ct_fake_t *f, const char *method, const char *key) {
  static ct_seen_t seen[CT_MAX_SEEN];
  int n = ct_fake_seen(f, seen);
  for (int i = 0; i < n && i < CT_MAX_SEEN; i++) {
    if (method && strcmp(seen[i].method, method) != 0)
      continue;
    if (!seen[i].has_key || strcmp(seen[i].key, key) != 0)
      fail_msg("request %d carried key '%s', want '%s'", i, seen[i].key, key);
  }
  return n;
}

static int is_uuid_v4(const char *s) {
  static const char hex[] = "0123456789abcdef";
  if (strlen(s) != 36 || s[14] != '4' || strchr("89ab", s[19]) == NULL)
    return 0;
  for (int i = 0; i < 36; i++)
    if ((i == 8 || i == 13 || i == 18 || i == 23) ? s[i] != '-'
                                                  : strchr(hex, s[i]) == NULL)
      return 0;
  return 1;
}

/* 409 with Retry-After: 1, twice, then 201: the command waits as told,
 * succeeds on the third attempt, and sends one key (a fresh UUID v4) on all
 * three, with the same token, type and body. */
static void test_409_retry_after_then_201(void **state) {
  static const ct_reply_t script[] = {
      {409, "Retry-After: 1\r\n", "{\"error\":\"in flight\"}", 0},
      {409, "Retry-After: 1\r\n", "{\"error\":\"in flight\"}", 0},
      {201, "Location: /payments/pay_1\r\n", PAY_OK, 0},
  };
  static ct_seen_t seen[CT_MAX_SEEN];
  ct_fake_t *f = ct_fake_start(script, 3);
  char url[128], key[300];
  long status;
  int attempts, polls;
  ct_run_t r;
  double t0, took;
  (void)state;

  url_of(f, "/payments", url, sizeof url);
  t0 = ct_now();
  cli(&r, (const char *const[]){"request", "--token", "tok_1", "POST", url, BODY, NULL},
      NULL);
  took = ct_now() - t0;
  assert_int_equal(r.exit_code, 0);
  assert_int_equal(ct_parse_line(r.err, &status, key, &attempts, &polls), 0);
  assert_int_equal(status, 201);
  assert_int_equal(attempts, 3);
  assert_int_equal(polls, 0);
  assert_true(is_uuid_v4(key));
  assert_non_null(strstr(r.out, "\"pay_1\""));
  assert_true(took >= 1.9);
  assert_true(took < LIVENESS_S);

  assert_int_equal(ct_fake_seen(f, seen), 3);
  assert_int_equal(assert_all_with_key(f, NULL, key), 3);
  for (int i = 0; i < 3; i++) {
    assert_string_equal(seen[i].method, "POST");
    assert_string_equal(seen[i].path, "/payments");
    assert_string_equal(seen[i].auth, "Bearer tok_1");
    assert_string_equal(seen[i].content_type, "application/json");
    assert_string_equal(seen[i].body, BODY);
  }
  /* Each wait honoured its Retry-After: 1 (a lower bound only). */
  assert_true(seen[1].at - seen[0].at >= 0.95);
  assert_true(seen[2].at - seen[1].at >= 0.95);
  ct_run_free(&r);
  ct_fake_stop(f);
}

/* A 4xx other than 409 is the answer: one attempt, exit 3, the body on
 * stdout. The script's second answer would be a 201 if it retried. */
static void test_4xx_not_retried(void **state) {
  static const int statuses[] = {400, 401, 402, 404, 422};
  (void)state;
  for (size_t i = 0; i < sizeof statuses / sizeof *statuses; i++) {
    const ct_reply_t script[] = {
        {statuses[i], NULL, "{\"errors\":[{\"field\":\"amount\"}]}", 0},
        {201, NULL, PAY_OK, 0},
    };
    ct_fake_t *f = ct_fake_start(script, 2);
    char url[128], key[300];
    long status;
    int attempts, polls;
    ct_run_t r;

    url_of(f, "/payments", url, sizeof url);
    cli(&r, (const char *const[]){"request", "--token", "t", "POST", url, BODY, NULL},
        NULL);
    if (r.exit_code != 3)
      fail_msg("%d: exit %d, want 3; stderr %s", statuses[i], r.exit_code, r.err);
    assert_int_equal(ct_parse_line(r.err, &status, key, &attempts, &polls), 0);
    assert_int_equal(status, statuses[i]);
    assert_int_equal(attempts, 1);
    assert_non_null(strstr(r.err, "answer not retried"));
    assert_non_null(strstr(r.out, "\"errors\""));
    assert_int_equal(assert_all_with_key(f, NULL, key), 1);
    ct_run_free(&r);
    ct_fake_stop(f);
  }
}

/* POST -> 202 with Location; GET -> 202, then 200 succeeded; the request
 * is sent once more under its key and the server's replay (201) is the
 * answer. The polls carry the token but no key. */
static void test_202_followed_until_final(void **state) {
  static const ct_reply_t script[] = {
      {202, "Location: /payments/pay_1\r\n", PAY_PENDING, 0},
      {202, NULL, PAY_PENDING, 0},
      {200, NULL, PAY_OK, 0},
      {201, "Location: /payments/pay_1\r\nIdempotent-Replayed: true\r\n", PAY_REPLAY, 0},
  };
  static ct_seen_t seen[CT_MAX_SEEN];
  ct_fake_t *f = ct_fake_start(script, 4);
  char url[128], key[300];
  long status;
  int attempts, polls;
  ct_run_t r;
  (void)state;

  url_of(f, "/payments", url, sizeof url);
  cli(&r, (const char *const[]){"request", "--token", "tok_2", "POST", url, BODY, NULL},
      NULL);
  assert_int_equal(r.exit_code, 0);
  assert_int_equal(ct_parse_line(r.err, &status, key, &attempts, &polls), 0);
  assert_int_equal(status, 201);
  assert_int_equal(attempts, 2);
  assert_int_equal(polls, 2);
  assert_non_null(strstr(r.out, "\"succeeded\""));

  assert_int_equal(ct_fake_seen(f, seen), 4);
  assert_int_equal(assert_all_with_key(f, "POST", key), 4);
  assert_string_equal(seen[0].method, "POST");
  assert_string_equal(seen[3].method, "POST");
  for (int i = 1; i <= 2; i++) {
    assert_string_equal(seen[i].method, "GET");
    assert_string_equal(seen[i].path, "/payments/pay_1");
    assert_string_equal(seen[i].auth, "Bearer tok_2");
    assert_false(seen[i].has_key);
  }
  ct_run_free(&r);
  ct_fake_stop(f);
}

/* A 202 that stays pending past --max-time: exit 5, "still pending", the
 * 202's body on stdout and the key on stderr to retry with later. */
static void test_202_still_pending_at_time_limit(void **state) {
  ct_reply_t script[41];
  ct_fake_t *f;
  char url[128], key[300];
  long status;
  int attempts, polls;
  ct_run_t r;
  double t0, took;
  (void)state;

  script[0] = (ct_reply_t){202, "Location: /payments/pay_1\r\n", PAY_PENDING, 0};
  for (int i = 1; i < 41; i++)
    script[i] = (ct_reply_t){200, NULL, PAY_PENDING, 0};
  f = ct_fake_start(script, 41);
  url_of(f, "/payments", url, sizeof url);
  t0 = ct_now();
  cli(&r,
      (const char *const[]){"request", "--max-time", "1.5", "--token", "t", "POST", url,
                            BODY, NULL},
      NULL);
  took = ct_now() - t0;
  assert_int_equal(r.exit_code, 5);
  assert_int_equal(ct_parse_line(r.err, &status, key, &attempts, &polls), 0);
  assert_int_equal(status, 202);
  assert_int_equal(attempts, 1);
  assert_true(polls >= 1);
  assert_non_null(strstr(r.err, "still pending"));
  assert_non_null(strstr(r.out, "\"pending\""));
  assert_true(took < LIVENESS_S);
  ct_run_free(&r);
  ct_fake_stop(f);
}

/* 5xx every time: --max-attempts 3 sends exactly three, one key, exit 4. */
static void test_gives_up_after_max_attempts(void **state) {
  static const ct_reply_t script[] = {
      {503, NULL, "{\"error\":\"down\"}", 0},
      {500, NULL, "{\"error\":\"x\"}", 0},
      {502, NULL, "{\"error\":\"x\"}", 0},
      {201, NULL, PAY_OK, 0},
  };
  ct_fake_t *f = ct_fake_start(script, 4);
  char url[128], key[300];
  long status;
  int attempts, polls;
  ct_run_t r;
  (void)state;

  url_of(f, "/payments", url, sizeof url);
  cli(&r,
      (const char *const[]){"request", "--max-attempts", "3", "--token", "t", "POST", url,
                            BODY, NULL},
      NULL);
  assert_int_equal(r.exit_code, 4);
  assert_int_equal(ct_parse_line(r.err, &status, key, &attempts, &polls), 0);
  assert_int_equal(status, 502);
  assert_int_equal(attempts, 3);
  assert_non_null(strstr(r.err, "gave up"));
  assert_int_equal(assert_all_with_key(f, NULL, key), 3);
  ct_run_free(&r);
  ct_fake_stop(f);
}

/* Nothing listens: every attempt is refused; exit 4 with the reason. */
static void test_gives_up_when_refused(void **state) {
  char url[128], key[300];
  long status;
  int attempts, polls;
  ct_run_t r;
  (void)state;
  snprintf(url, sizeof url, "http://127.0.0.1:%d/payments", ct_free_port());
  cli(&r,
      (const char *const[]){"request", "--max-attempts", "4", "POST", url, BODY, NULL},
      NULL);
  assert_int_equal(r.exit_code, 4);
  assert_int_equal(ct_parse_line(r.err, &status, key, &attempts, &polls), 0);
  assert_int_equal(status, 0);
  assert_int_equal(attempts, 4);
  assert_non_null(strstr(r.err, "gave up: "));
  assert_string_equal(r.out, "");
  ct_run_free(&r);
}

/* Through the C API: a dropped connection, a 500 with Retry-After: 0, then
 * 201. Three attempts, one key, the last answer kept. */
static void test_api_drop_and_5xx_then_201(void **state) {
  static const ct_reply_t script[] = {
      {0, NULL, NULL, 0},
      {500, "Retry-After: 0\r\n", "{\"error\":\"x\"}", 0},
      {201, NULL, PAY_OK, 0},
  };
  ct_fake_t *f = ct_fake_start(script, 3);
  char url[128];
  idem_client_request_t req = {.method = "POST", .token = "t", .body = BODY};
  idem_client_result_t res;
  (void)state;

  url_of(f, "/payments", url, sizeof url);
  req.url = url;
  assert_int_equal(idem_client_request(&req, NULL, &res), IDEM_OK);
  assert_int_equal(res.outcome, IDEM_CLIENT_DONE);
  assert_int_equal(res.status, 201);
  assert_int_equal(res.attempts, 3);
  assert_int_equal(res.polls, 0);
  assert_string_equal(res.body, PAY_OK);
  assert_int_equal(res.body_len, strlen(PAY_OK));
  assert_int_equal(assert_all_with_key(f, NULL, res.key), 3);
  idem_client_result_free(&res);
  assert_null(res.body);
  ct_fake_stop(f);
}

/* An attempt that outlives attempt_timeout_ms is abandoned and sent again
 * under the same key: the timeout is not taken for a failure. */
static void test_api_attempt_timeout_retried_same_key(void **state) {
  static const ct_reply_t script[] = {
      {201, NULL, "{\"late\":true}", 1500},
      {201, NULL, PAY_OK, 0},
  };
  ct_fake_t *f = ct_fake_start(script, 2);
  char url[128];
  idem_client_request_t req = {.method = "POST", .body = BODY, .key = "k-timeout-1"};
  idem_client_opts_t o;
  idem_client_result_t res;
  (void)state;

  idem_client_opts_default(&o);
  o.attempt_timeout_ms = 300;
  url_of(f, "/payments", url, sizeof url);
  req.url = url;
  assert_int_equal(idem_client_request(&req, &o, &res), IDEM_OK);
  assert_int_equal(res.outcome, IDEM_CLIENT_DONE);
  assert_true(res.attempts >= 2);
  assert_string_equal(res.body, PAY_OK);
  assert_string_equal(res.key, "k-timeout-1");
  assert_int_equal(assert_all_with_key(f, NULL, "k-timeout-1"), 2);
  idem_client_result_free(&res);
  ct_fake_stop(f);
}

/* A 202 whose Location is on another origin is not followed (the token
 * would go there): the request itself is sent again instead. */
static void test_api_location_elsewhere_not_followed(void **state) {
  static const ct_reply_t other_script[] = {{200, NULL, PAY_OK, 0}};
  ct_fake_t *other = ct_fake_start(other_script, 1);
  char loc[160], url[128];
  ct_reply_t script[2];
  ct_fake_t *f;
  idem_client_request_t req = {.method = "POST", .token = "secret", .body = BODY};
  idem_client_result_t res;
  static ct_seen_t seen[CT_MAX_SEEN];
  (void)state;

  snprintf(loc, sizeof loc, "Location: http://127.0.0.1:%d/payments/pay_1\r\n",
           ct_fake_port(other));
  script[0] = (ct_reply_t){202, loc, PAY_PENDING, 0};
  script[1] = (ct_reply_t){201, NULL, PAY_OK, 0};
  f = ct_fake_start(script, 2);
  url_of(f, "/payments", url, sizeof url);
  req.url = url;
  assert_int_equal(idem_client_request(&req, NULL, &res), IDEM_OK);
  assert_int_equal(res.outcome, IDEM_CLIENT_DONE);
  assert_int_equal(res.status, 201);
  assert_int_equal(res.attempts, 2);
  assert_int_equal(res.polls, 0);
  assert_int_equal(ct_fake_seen(other, seen), 0);
  idem_client_result_free(&res);
  ct_fake_stop(f);
  ct_fake_stop(other);
}

/* A 202 whose Location then says 402: the request is sent again and its
 * replayed 402 is the answer, not retried. */
static void test_api_202_then_declined(void **state) {
  static const char declined[] = "{\"id\":\"pay_1\",\"status\":\"declined\"}";
  static const ct_reply_t script[] = {
      {202, "Location: /payments/pay_1\r\n", PAY_PENDING, 0},
      {402, NULL, declined, 0},
      {402, NULL, declined, 0},
      {201, NULL, PAY_OK, 0},
  };
  ct_fake_t *f = ct_fake_start(script, 4);
  char url[128];
  idem_client_request_t req = {.method = "POST", .body = BODY};
  idem_client_result_t res;
  (void)state;

  url_of(f, "/payments", url, sizeof url);
  req.url = url;
  assert_int_equal(idem_client_request(&req, NULL, &res), IDEM_OK);
  assert_int_equal(res.outcome, IDEM_CLIENT_REJECTED);
  assert_int_equal(res.status, 402);
  assert_int_equal(res.attempts, 2);
  assert_int_equal(res.polls, 1);
  assert_string_equal(res.body, declined);
  idem_client_result_free(&res);
  ct_fake_stop(f);
}

/* Retry-After as an HTTP-date two seconds ahead: the wait is at least the
 * second the date's resolution guarantees. */
static void test_api_retry_after_http_date(void **state) {
  char hdr[96], url[128];
  ct_reply_t script[2];
  ct_fake_t *f;
  idem_client_request_t req = {.method = "POST", .body = BODY};
  idem_client_result_t res;
  static ct_seen_t seen[CT_MAX_SEEN];
  time_t when = time(NULL) + 2;
  struct tm tm;
  (void)state;

  gmtime_r(&when, &tm);
  strftime(hdr, sizeof hdr, "Retry-After: %a, %d %b %Y %H:%M:%S GMT\r\n", &tm);
  script[0] = (ct_reply_t){503, hdr, "{\"error\":\"busy\"}", 0};
  script[1] = (ct_reply_t){201, NULL, PAY_OK, 0};
  f = ct_fake_start(script, 2);
  url_of(f, "/payments", url, sizeof url);
  req.url = url;
  assert_int_equal(idem_client_request(&req, NULL, &res), IDEM_OK);
  assert_int_equal(res.outcome, IDEM_CLIENT_DONE);
  assert_int_equal(res.attempts, 2);
  assert_int_equal(ct_fake_seen(f, seen), 2);
  assert_true(seen[1].at - seen[0].at >= 0.9);
  assert_true(seen[1].at - seen[0].at < LIVENESS_S);
  idem_client_result_free(&res);
  ct_fake_stop(f);
}

/* Starts the fake with `script` and makes one library call of BODY to its
 * /payments with `o` (NULL: the defaults). Returns the fake, to check and
 * stop; `res` is the caller's to free. */
static ct_fake_t *api_call(const ct_reply_t *script, int n, const idem_client_opts_t *o,
                           idem_client_result_t *res) {
  ct_fake_t *f = ct_fake_start(script, n);
  char url[128];
  idem_client_request_t req = {.method = "POST", .body = BODY};

  url_of(f, "/payments", url, sizeof url);
  req.url = url;
  assert_int_equal(idem_client_request(&req, o, res), IDEM_OK);
  return f;
}

/* An answer over max_response_bytes is a local failure, not retried. */
static void test_api_answer_too_large(void **state) {
  static char big[4096];
  ct_reply_t script[2];
  ct_fake_t *f;
  idem_client_opts_t o;
  idem_client_result_t res;
  (void)state;

  memset(big, 'x', sizeof big - 1);
  script[0] = (ct_reply_t){201, NULL, big, 0};
  script[1] = (ct_reply_t){201, NULL, PAY_OK, 0};
  idem_client_opts_default(&o);
  o.max_response_bytes = 1000;
  f = api_call(script, 2, &o, &res);
  assert_int_equal(res.outcome, IDEM_CLIENT_FAILED);
  assert_int_equal(res.attempts, 1);
  assert_non_null(strstr(res.error, "larger than 1000 bytes"));
  idem_client_result_free(&res);
  ct_fake_stop(f);
}

/* An answer over max_response_bytes still has its status: a 5xx one (a
 * proxy's error page, say) is retried like any 5xx, and a final one is
 * reported with its own status, not the one an earlier attempt got (a 201
 * over the cap says the payment was made). */
static void test_api_large_answer_keeps_status(void **state) {
  static char big[4096];
  ct_reply_t retried[2], final[2];
  ct_fake_t *f;
  idem_client_opts_t o;
  idem_client_result_t res;
  (void)state;

  memset(big, 'x', sizeof big - 1);
  idem_client_opts_default(&o);
  o.max_response_bytes = 1000;
  o.base_delay_ms = 1;

  retried[0] = (ct_reply_t){503, NULL, big, 0};
  retried[1] = (ct_reply_t){201, NULL, PAY_OK, 0};
  f = api_call(retried, 2, &o, &res);
  assert_int_equal(res.outcome, IDEM_CLIENT_DONE);
  assert_int_equal(res.status, 201);
  assert_int_equal(res.attempts, 2);
  assert_string_equal(res.error, "");
  idem_client_result_free(&res);
  ct_fake_stop(f);

  final[0] = (ct_reply_t){503, NULL, "{}", 0};
  final[1] = (ct_reply_t){201, NULL, big, 0};
  f = api_call(final, 2, &o, &res);
  assert_int_equal(res.outcome, IDEM_CLIENT_FAILED);
  assert_int_equal(res.status, 201);
  assert_null(res.body);
  assert_int_equal(res.attempts, 2);
  assert_non_null(strstr(res.error, "larger than 1000 bytes"));
  idem_client_result_free(&res);
  ct_fake_stop(f);
}

/* Over the cap while following a 202: a poll answer too large to read
 * sends the request again, whose own answer is the one reported; a 202
 * too large to read, without a Location, is sent again as any 202 is. */
static void test_api_large_answer_while_pending(void **state) {
  static char big[4096];
  ct_reply_t poll_big[3], pending_big[2];
  idem_client_opts_t o;
  idem_client_result_t res;
  ct_fake_t *f;
  (void)state;

  memset(big, 'x', sizeof big - 1);
  idem_client_opts_default(&o);
  o.max_response_bytes = 1000;
  o.base_delay_ms = 1;

  poll_big[0] = (ct_reply_t){202, "Location: /payments/pay_1\r\n", PAY_PENDING, 0};
  poll_big[1] = (ct_reply_t){200, NULL, big, 0};
  poll_big[2] = (ct_reply_t){201, NULL, PAY_OK, 0};
  f = api_call(poll_big, 3, &o, &res);
  assert_int_equal(res.outcome, IDEM_CLIENT_DONE);
  assert_int_equal(res.status, 201);
  assert_int_equal(res.attempts, 2);
  assert_int_equal(res.polls, 1);
  assert_string_equal(res.error, "");
  idem_client_result_free(&res);
  ct_fake_stop(f);

  pending_big[0] = (ct_reply_t){202, NULL, big, 0};
  pending_big[1] = (ct_reply_t){201, NULL, PAY_OK, 0};
  f = api_call(pending_big, 2, &o, &res);
  assert_int_equal(res.outcome, IDEM_CLIENT_DONE);
  assert_int_equal(res.status, 201);
  assert_int_equal(res.attempts, 2);
  idem_client_result_free(&res);
  ct_fake_stop(f);
}

/* 429 and 408 ask for later: retried (as the answer's Retry-After says),
 * under the same key. */
static void test_api_429_and_408_retried(void **state) {
  static const int statuses[] = {429, 408};
  (void)state;
  for (size_t i = 0; i < sizeof statuses / sizeof *statuses; i++) {
    const ct_reply_t script[] = {
        {statuses[i], "Retry-After: 0\r\n", "{\"error\":\"later\"}", 0},
        {201, NULL, PAY_OK, 0},
    };
    idem_client_result_t res;
    ct_fake_t *f = api_call(script, 2, NULL, &res);

    assert_int_equal(res.outcome, IDEM_CLIENT_DONE);
    assert_int_equal(res.status, 201);
    assert_int_equal(res.attempts, 2);
    assert_int_equal(assert_all_with_key(f, NULL, res.key), 2);
    idem_client_result_free(&res);
    ct_fake_stop(f);
  }
}

/* No time limit, said as INT64_MAX: one attempt, answered (the deadline
 * once overflowed, and the call gave up before sending anything). */
static void test_api_no_time_limit(void **state) {
  static const ct_reply_t script[] = {{201, NULL, PAY_OK, 0}};
  idem_client_opts_t o;
  idem_client_result_t res;
  ct_fake_t *f;
  (void)state;

  idem_client_opts_default(&o);
  o.max_time_ms = INT64_MAX;
  f = api_call(script, 1, &o, &res);
  assert_int_equal(res.outcome, IDEM_CLIENT_DONE);
  assert_int_equal(res.attempts, 1);
  idem_client_result_free(&res);
  ct_fake_stop(f);
}

/* --key is sent as given; the token comes from IDEM_TOKEN, and --token
 * takes precedence over it. */
static void test_cli_key_and_token_sources(void **state) {
  static const ct_reply_t script[] = {{201, NULL, PAY_OK, 0}, {201, NULL, PAY_OK, 0}};
  static ct_seen_t seen[CT_MAX_SEEN];
  ct_fake_t *f = ct_fake_start(script, 2);
  char url[128], key[300];
  long status;
  int attempts, polls;
  ct_run_t r;
  (void)state;

  url_of(f, "/orders", url, sizeof url);
  cli(&r, (const char *const[]){"request", "--key=order-42", "post", url, BODY, NULL},
      (const char *const[]){"IDEM_TOKEN=from_env", NULL});
  assert_int_equal(r.exit_code, 0);
  assert_int_equal(ct_parse_line(r.err, &status, key, &attempts, &polls), 0);
  assert_string_equal(key, "order-42");
  ct_run_free(&r);
  cli(&r, (const char *const[]){"request", "--token", "from_flag", "GET", url, NULL},
      (const char *const[]){"IDEM_TOKEN=from_env", NULL});
  assert_int_equal(r.exit_code, 0);
  ct_run_free(&r);

  assert_int_equal(ct_fake_seen(f, seen), 2);
  assert_string_equal(seen[0].method, "POST");
  assert_string_equal(seen[0].key, "order-42");
  assert_string_equal(seen[0].auth, "Bearer from_env");
  assert_string_equal(seen[1].method, "GET");
  assert_string_equal(seen[1].auth, "Bearer from_flag");
  assert_string_equal(seen[1].content_type, ""); /* no JSON, no Content-Type */
  ct_fake_stop(f);
}

/* Bad usage is exit 2 and sends nothing; --help is exit 0. */
static void test_cli_usage(void **state) {
  static const char *const rows[][8] = {
      {NULL},
      {"pay", NULL},
      {"request", NULL},
      {"request", "POST", NULL},
      {"request", "--bogus", "POST", "http://127.0.0.1:1/x", NULL},
      {"request", "--token", NULL},
      {"request", "POST", "ftp://127.0.0.1:1/x", NULL},
      {"request", "--max-attempts", "0", "POST", "http://127.0.0.1:1/x", NULL},
      {"request", "--max-attempts", "x", "POST", "http://127.0.0.1:1/x", NULL},
      {"request", "--max-time", "-1", "POST", "http://127.0.0.1:1/x", NULL},
      {"request", "--key", "a b", "POST", "http://127.0.0.1:1/x", NULL},
      {"request", "POST", "http://127.0.0.1:1/x", "{}", "extra", NULL},
      {"request", "-H", "NoColon", "POST", "http://127.0.0.1:1/x", NULL},
      {"request", "-H", "Bad Name: x", "POST", "http://127.0.0.1:1/x", NULL},
      {"request", "-H", ": x", "POST", "http://127.0.0.1:1/x", NULL},
      {"request", "-H", "X-A: 1\r\nX-Injected: 2", "POST", "http://127.0.0.1:1/x", NULL},
      {"request", "-H", "idempotency-key: k", "POST", "http://127.0.0.1:1/x", NULL},
      {"request", "-H", "Content-Length: 3", "POST", "http://127.0.0.1:1/x", NULL},
      {"request", "--header", "Transfer-Encoding: chunked", "POST",
       "http://127.0.0.1:1/x", NULL},
      {"request", "POST", "http://127.0.0.1:1/x", "-H", NULL},
      {"request", "--data", "@/nonexistent/body.json", "POST", "http://127.0.0.1:1/x",
       NULL},
      {"request", "--data", "@/", "POST", "http://127.0.0.1:1/x", NULL},
      {"request", "--data", "{}", "POST", "http://127.0.0.1:1/x", "{}", NULL},
      {"request", "-d", "{}", "--data", "{}", "POST", "http://127.0.0.1:1/x", NULL},
      {"request", "--", "--token", "POST", "http://127.0.0.1:1/x", NULL},
      {"request", "POST", "http://127.0.0.1:1/x", "--", "{}", "extra", NULL},
  };
  ct_run_t r;
  (void)state;
  for (size_t i = 0; i < sizeof rows / sizeof *rows; i++) {
    cli(&r, rows[i], NULL);
    if (r.exit_code != 2)
      fail_msg("row %zu: exit %d, want 2; stderr %s", i, r.exit_code, r.err);
    long status;
    char key[300];
    int attempts, polls;
    /* Nothing was sent: no result line. */
    assert_int_equal(ct_parse_line(r.err, &status, key, &attempts, &polls), -1);
    ct_run_free(&r);
  }
  cli(&r, (const char *const[]){"--help", NULL}, NULL);
  assert_int_equal(r.exit_code, 0);
  assert_non_null(strstr(r.out, "exit status"));
  assert_non_null(strstr(r.out, "IDEM_TOKEN"));
  ct_run_free(&r);
}

/* -H lines reach every attempt and the polls (Content-* ones the attempts
 * only); one named as the client's own replaces it, not doubles it; an
 * empty value is sent empty. --data @FILE sends the file as it is, a NUL
 * byte included. */
static void test_cli_headers_and_data_file(void **state) {
  static const ct_reply_t script[] = {
      {202, "Location: /payments/pay_1\r\n", PAY_PENDING, 0},
      {200, NULL, PAY_OK, 0},
      {201, "Location: /payments/pay_1\r\nIdempotent-Replayed: true\r\n", PAY_REPLAY, 0},
  };
  static const char file_body[] = "{\"amount\":100}\0tail";
  static ct_seen_t seen[CT_MAX_SEEN];
  ct_fake_t *f = ct_fake_start(script, 3);
  char *dir = ct_tempdir(), path[600], url[128], data[620], v[256];
  FILE *fp;
  ct_run_t r;
  (void)state;

  snprintf(path, sizeof path, "%s/body.json", dir);
  assert_non_null(fp = fopen(path, "wb"));
  assert_int_equal(fwrite(file_body, 1, sizeof file_body - 1, fp), sizeof file_body - 1);
  assert_int_equal(fclose(fp), 0);
  snprintf(data, sizeof data, "@%s", path);
  url_of(f, "/payments", url, sizeof url);
  cli(&r,
      (const char *const[]){"request", "--token", "tok", "-H", "X-Trace: abc 1",
                            "--header=Accept: application/problem+json",
                            "-HX-Empty:", "-H", "User-Agent: mine/1", "-H",
                            "Content-Type: application/merge-patch+json", "--data", data,
                            "POST", url, NULL},
      NULL);
  if (r.exit_code != 0)
    fail_msg("exit %d; stderr %s", r.exit_code, r.err);
  assert_int_equal(ct_fake_seen(f, seen), 3);
  for (int i = 0; i < 3; i++) {
    int poll = i == 1;
    assert_int_equal(ct_header_count(&seen[i], "X-Trace", v, sizeof v), 1);
    assert_string_equal(v, "abc 1");
    assert_int_equal(ct_header_count(&seen[i], "Accept", v, sizeof v), 1);
    assert_string_equal(v, "application/problem+json");
    assert_int_equal(ct_header_count(&seen[i], "X-Empty", v, sizeof v), 1);
    assert_string_equal(v, "");
    assert_int_equal(ct_header_count(&seen[i], "User-Agent", v, sizeof v), 1);
    assert_string_equal(v, "mine/1");
    assert_int_equal(ct_header_count(&seen[i], "Authorization", v, sizeof v), 1);
    assert_string_equal(v, "Bearer tok");
    assert_int_equal(ct_header_count(&seen[i], "Content-Type", v, sizeof v),
                     poll ? 0 : 1);
    if (!poll) {
      assert_string_equal(v, "application/merge-patch+json");
      assert_int_equal(seen[i].body_len, sizeof file_body - 1);
      assert_memory_equal(seen[i].body, file_body, sizeof file_body - 1);
    }
  }
  assert_string_equal(seen[1].method, "GET");
  ct_run_free(&r);
  ct_fake_stop(f);
  ct_rmdir(dir);
}

/* --data @- reads the body from standard input; --data TEXT is the body;
 * after --, what looks like an option is an argument (here the body). */
static void test_cli_data_stdin_and_double_dash(void **state) {
  static const ct_reply_t script[] = {
      {201, NULL, PAY_OK, 0}, {201, NULL, PAY_OK, 0}, {201, NULL, PAY_OK, 0}};
  static ct_seen_t seen[CT_MAX_SEEN];
  static const char piped[] = "{\"amount\": 7,\n \"from\": \"stdin\"}\n";
  ct_fake_t *f = ct_fake_start(script, 3);
  char *dir = ct_tempdir(), path[600], url[128];
  FILE *fp;
  ct_run_t r;
  (void)state;

  snprintf(path, sizeof path, "%s/stdin.json", dir);
  assert_non_null(fp = fopen(path, "wb"));
  assert_int_equal(fputs(piped, fp) >= 0, 1);
  assert_int_equal(fclose(fp), 0);
  url_of(f, "/payments", url, sizeof url);
  ct_run_start_stdin(
      &r,
      (const char *const[]){ct_cli_path(), "request", "--data", "@-", "POST", url, NULL},
      NULL, path);
  ct_run_wait(&r, RUN_TIMEOUT_S);
  if (r.exit_code != 0)
    fail_msg("--data @-: exit %d; stderr %s", r.exit_code, r.err);
  ct_run_free(&r);
  cli(&r, (const char *const[]){"request", "-d", "{\"amount\":8}", "POST", url, NULL},
      NULL);
  assert_int_equal(r.exit_code, 0);
  ct_run_free(&r);
  /* Without --, "-5" is an unknown option and nothing is sent. */
  cli(&r, (const char *const[]){"request", "POST", url, "-5", NULL}, NULL);
  assert_int_equal(r.exit_code, 2);
  assert_non_null(strstr(r.err, "unknown option '-5'"));
  ct_run_free(&r);
  cli(&r, (const char *const[]){"request", "--", "POST", url, "-5", NULL}, NULL);
  assert_int_equal(r.exit_code, 0);
  ct_run_free(&r);

  assert_int_equal(ct_fake_seen(f, seen), 3);
  assert_string_equal(seen[0].body, piped);
  assert_int_equal(seen[0].body_len, strlen(piped));
  assert_string_equal(seen[0].content_type, "application/json");
  assert_string_equal(seen[1].body, "{\"amount\":8}");
  assert_string_equal(seen[2].body, "-5");
  ct_fake_stop(f);
  ct_rmdir(dir);
}

/* --verbose: a line per attempt, wait and poll, in order, then the final
 * answer's details (replayed, Location, X-Request-Id), then the usual
 * last line; without it, none of those. */
static void test_cli_verbose(void **state) {
  static const ct_reply_t script[] = {
      {503, NULL, "{\"error\":\"busy\"}", 0},
      {202, "Location: /payments/pay_1\r\nRetry-After: 0\r\n", PAY_PENDING, 0},
      {200, NULL, PAY_OK, 0},
      {201,
       "Location: /payments/pay_1\r\nIdempotent-Replayed: true\r\nX-Request-Id: "
       "req_abc\r\n",
       PAY_REPLAY, 0},
      {201, "X-Request-Id: req_quiet\r\n", PAY_OK, 0},
  };
  ct_fake_t *f = ct_fake_start(script, 5);
  char url[128], poll_url[128], want[6][300], key[300];
  const char *at;
  long status;
  int attempts, polls;
  ct_run_t r;
  (void)state;

  url_of(f, "/payments", url, sizeof url);
  url_of(f, "/payments/pay_1", poll_url, sizeof poll_url);
  cli(&r, (const char *const[]){"request", "-v", "POST", url, BODY, NULL}, NULL);
  if (r.exit_code != 0)
    fail_msg("exit %d; stderr %s", r.exit_code, r.err);
  snprintf(want[0], sizeof want[0], "idem: attempt 1: POST %s: 503 (", url);
  snprintf(want[1], sizeof want[1], "ms (backoff), then attempt 2\n");
  snprintf(want[2], sizeof want[2], "idem: attempt 2: POST %s: 202 (", url);
  snprintf(want[3], sizeof want[3],
           "idem: wait 0 ms (Retry-After), then poll 1\n"
           "idem: poll 1: GET %s: 200 (",
           poll_url);
  snprintf(want[4], sizeof want[4], "idem: attempt 3: POST %s: 201 (", url);
  snprintf(want[5], sizeof want[5],
           "\nidem: answer 201 replayed location=/payments/pay_1 "
           "request_id=req_abc\nidem: 201 ");
  at = r.err;
  for (int i = 0; i < 6; i++) {
    const char *p = strstr(at, want[i]);
    if (p == NULL)
      fail_msg("stderr lacks, in order, '%s':\n%s", want[i], r.err);
    at = p + strlen(want[i]);
  }
  assert_int_equal(ct_parse_line(r.err, &status, key, &attempts, &polls), 0);
  assert_int_equal(status, 201);
  assert_int_equal(attempts, 3);
  assert_int_equal(polls, 1);
  ct_run_free(&r);

  cli(&r, (const char *const[]){"request", "POST", url, BODY, NULL}, NULL);
  assert_int_equal(r.exit_code, 0);
  assert_null(strstr(r.err, "attempt 1"));
  assert_null(strstr(r.err, "req_quiet"));
  assert_int_equal(ct_parse_line(r.err, &status, key, &attempts, &polls), 0);
  ct_run_free(&r);
  ct_fake_stop(f);
}

/* The events opts.on_event was told of, copied. */
struct events {
  idem_client_event_t ev[16];
  char urls[16][128];
  int n;
};

static void collect(const idem_client_event_t *ev, void *ctx) {
  struct events *e = ctx;
  if (e->n < 16) {
    e->ev[e->n] = *ev;
    snprintf(e->urls[e->n], sizeof e->urls[e->n], "%s", ev->url ? ev->url : "");
    e->ev[e->n].url = e->ev[e->n].method = e->ev[e->n].error = NULL; /* theirs, gone */
  }
  e->n++;
}

/* What the C API hands back besides the status: the replayed flag, the
 * Location and the X-Request-Id of the answer that gave the status (not of
 * an earlier one); each attempt, poll and wait told to on_event; extra
 * headers and a body with a NUL (body_len) sent as given. */
static void test_api_result_and_events(void **state) {
  static const ct_reply_t script[] = {
      {500, "X-Request-Id: req_first\r\nLocation: /wrong\r\n", "{}", 0},
      {202, "Location: /payments/pay_1\r\n", PAY_PENDING, 0},
      {200, NULL, PAY_OK, 0},
      {201,
       "Location: /payments/pay_1\r\nIdempotent-Replayed: true\r\nX-Request-Id: "
       "req_2\r\n",
       PAY_REPLAY, 0},
      {201, NULL, PAY_OK, 0},
  };
  static const char nul_body[] = "{\"a\":1}\0zz";
  static ct_seen_t seen[CT_MAX_SEEN];
  const char *const headers[] = {"X-One: 1", "content-type: text/plain", NULL};
  ct_fake_t *f = ct_fake_start(script, 5);
  struct events e = {.n = 0};
  idem_client_opts_t o;
  idem_client_result_t res;
  char url[128];
  idem_client_request_t req = {.method = "POST",
                               .body = nul_body,
                               .body_len = sizeof nul_body - 1,
                               .headers = headers};
  (void)state;

  url_of(f, "/payments", url, sizeof url);
  req.url = url;
  idem_client_opts_default(&o);
  o.base_delay_ms = 1;
  o.on_event = collect;
  o.event_ctx = &e;
  assert_int_equal(idem_client_request(&req, &o, &res), IDEM_OK);
  assert_int_equal(res.outcome, IDEM_CLIENT_DONE);
  assert_int_equal(res.status, 201);
  assert_int_equal(res.replayed, 1);
  assert_string_equal(res.location, "/payments/pay_1");
  assert_string_equal(res.request_id, "req_2");
  /* attempt, wait, attempt (202), wait, poll, attempt (201) */
  assert_int_equal(e.n, 6);
  {
    static const struct {
      idem_client_event_kind_t kind;
      int number;
      long status;
      const char *path;
    } want[] = {
        {IDEM_CLIENT_EVENT_ATTEMPT, 1, 500, "/payments"},
        {IDEM_CLIENT_EVENT_WAIT, 2, 0, NULL},
        {IDEM_CLIENT_EVENT_ATTEMPT, 2, 202, "/payments"},
        {IDEM_CLIENT_EVENT_WAIT, 1, 0, NULL},
        {IDEM_CLIENT_EVENT_POLL, 1, 200, "/payments/pay_1"},
        {IDEM_CLIENT_EVENT_ATTEMPT, 3, 201, "/payments"},
    };
    for (int i = 0; i < 6; i++) {
      char wurl[160];
      if (e.ev[i].kind != want[i].kind || e.ev[i].number != want[i].number ||
          e.ev[i].status != want[i].status)
        fail_msg("event %d: kind %d number %d status %ld", i, e.ev[i].kind,
                 e.ev[i].number, e.ev[i].status);
      if (want[i].path) {
        url_of(f, want[i].path, wurl, sizeof wurl);
        assert_string_equal(e.urls[i], wurl);
        assert_true(e.ev[i].took_ms >= 0);
      } else {
        assert_false(e.ev[i].retry_after);
        assert_true(e.ev[i].wait_ms >= 0 && e.ev[i].wait_ms <= 5000);
      }
    }
    assert_false(e.ev[1].next_is_poll);
    assert_true(e.ev[3].next_is_poll);
  }
  idem_client_result_free(&res);
  assert_null(res.location);
  assert_null(res.request_id);

  assert_int_equal(ct_fake_seen(f, seen), 4);
  for (int i = 0; i < 4; i++) {
    char v[128];
    assert_int_equal(ct_header_count(&seen[i], "X-One", v, sizeof v), 1);
    assert_string_equal(v, "1");
    if (strcmp(seen[i].method, "POST") == 0) {
      assert_int_equal(ct_header_count(&seen[i], "Content-Type", v, sizeof v), 1);
      assert_string_equal(v, "text/plain");
      assert_int_equal(seen[i].body_len, sizeof nul_body - 1);
      assert_memory_equal(seen[i].body, nul_body, sizeof nul_body - 1);
    }
  }

  /* No Location, no id, not replayed: all empty, not left from before. */
  req.headers = NULL;
  req.body = BODY;
  req.body_len = 0;
  o.on_event = NULL;
  assert_int_equal(idem_client_request(&req, &o, &res), IDEM_OK);
  assert_int_equal(res.status, 201);
  assert_int_equal(res.replayed, 0);
  assert_null(res.location);
  assert_null(res.request_id);
  idem_client_result_free(&res);
  ct_fake_stop(f);
}

#define NTHREADS 4

struct thread_call {
  const char *url;
  idem_client_result_t res;
  int rc;
};

static void *call_thread(void *arg) {
  struct thread_call *t = arg;
  idem_client_request_t req = {.method = "POST", .url = t->url, .body = BODY};
  t->rc = idem_client_request(&req, NULL, &t->res);
  return NULL;
}

/* Calls from several threads at once: each its own key, each done. */
static void test_api_threads(void **state) {
  ct_reply_t script[NTHREADS];
  struct thread_call calls[NTHREADS];
  pthread_t th[NTHREADS];
  ct_fake_t *f;
  char url[128];
  (void)state;

  for (int i = 0; i < NTHREADS; i++)
    script[i] = (ct_reply_t){201, NULL, PAY_OK, 20};
  f = ct_fake_start(script, NTHREADS);
  url_of(f, "/payments", url, sizeof url);
  for (int i = 0; i < NTHREADS; i++) {
    calls[i] = (struct thread_call){.url = url};
    assert_int_equal(pthread_create(&th[i], NULL, call_thread, &calls[i]), 0);
  }
  for (int i = 0; i < NTHREADS; i++)
    pthread_join(th[i], NULL);
  for (int i = 0; i < NTHREADS; i++) {
    assert_int_equal(calls[i].rc, IDEM_OK);
    assert_int_equal(calls[i].res.outcome, IDEM_CLIENT_DONE);
    assert_int_equal(calls[i].res.attempts, 1);
    for (int j = 0; j < i; j++)
      assert_string_not_equal(calls[i].res.key, calls[j].res.key);
  }
  for (int i = 0; i < NTHREADS; i++)
    idem_client_result_free(&calls[i].res);
  ct_fake_stop(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_409_retry_after_then_201),
      cmocka_unit_test(test_4xx_not_retried),
      cmocka_unit_test(test_api_large_answer_keeps_status),
      cmocka_unit_test(test_api_large_answer_while_pending),
      cmocka_unit_test(test_api_429_and_408_retried),
      cmocka_unit_test(test_api_no_time_limit),
      cmocka_unit_test(test_202_followed_until_final),
      cmocka_unit_test(test_202_still_pending_at_time_limit),
      cmocka_unit_test(test_gives_up_after_max_attempts),
      cmocka_unit_test(test_gives_up_when_refused),
      cmocka_unit_test(test_api_drop_and_5xx_then_201),
      cmocka_unit_test(test_api_attempt_timeout_retried_same_key),
      cmocka_unit_test(test_api_location_elsewhere_not_followed),
      cmocka_unit_test(test_api_202_then_declined),
      cmocka_unit_test(test_api_retry_after_http_date),
      cmocka_unit_test(test_api_answer_too_large),
      cmocka_unit_test(test_cli_key_and_token_sources),
      cmocka_unit_test(test_cli_usage),
      cmocka_unit_test(test_cli_headers_and_data_file),
      cmocka_unit_test(test_cli_data_stdin_and_double_dash),
      cmocka_unit_test(test_cli_verbose),
      cmocka_unit_test(test_api_result_and_events),
      cmocka_unit_test(test_api_threads),
  };
  int failed;
  if (ct_cli_path() == NULL) {
    fprintf(stderr, "set IDEM_TEST_CLI to the idem binary\n");
    return 2;
  }
  curl_global_init(CURL_GLOBAL_DEFAULT);
  failed = cmocka_run_group_tests(tests, NULL, NULL);
  curl_global_cleanup();
  return failed;
}
