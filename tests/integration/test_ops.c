/* Operations (docs/idempotency.md, sections 5 and 6; docs/operations.md): one
 * JSON log line per request with an HMAC key id and never the raw key,
 * X-Request-Id echoed or generated, /healthz and /metrics and the counters they
 * move, SIGTERM letting the requests in flight finish, the sweeper, and the
 * tenant and record tools of the command line run against a live server. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

/* The idemd binary, for the commands this file runs itself. */
static const char *idemd_bin;

#define PAYMENT "{\"amount\": 15990, \"currency\": \"BRL\", \"order_id\": \"ord_42\"}"
#define ORDER                                                                            \
  "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":2,"                   \
  "\"unit_price\":1000}],\"currency\":\"BRL\"}"

/* The request log line with this request id (borrowed from `lines`). */
static json_t *line_for(json_t *lines, const char *rid) {
  size_t i;
  json_t *l, *found = NULL;
  json_array_foreach(lines, i, l) {
    const char *v = json_string_value(json_object_get(l, "request_id"));
    if (v && strcmp(v, rid) == 0 &&
        strcmp(json_string_value(json_object_get(l, "msg")), "request") == 0) {
      if (found)
        fail_msg("two log lines for request %s", rid);
      found = l;
    }
  }
  if (found == NULL)
    fail_msg("no log line for request %s", rid);
  return found;
}

/* Every line of the log, each a JSON object. */
static json_t *read_log(h_server_t *s) {
  char *text = h_read_file(s->log, NULL);
  json_t *lines = json_array();
  char *save = NULL;
  assert_non_null(text);
  for (char *line = strtok_r(text, "\n", &save); line;
       line = strtok_r(NULL, "\n", &save)) {
    json_t *l = json_loads(line, 0, NULL);
    if (!json_is_object(l))
      fail_msg("log line is not a JSON object: %.300s", line);
    json_array_append_new(lines, l);
  }
  free(text);
  return lines;
}

static void nap_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

struct logged {
  const char *path, *key, *body, *rid;
  long status;
  const char *outcome;
};

/* Known keys through every outcome; then the log has one line per request
 * with the right outcome and a key id, and none of the raw keys. */
static void test_log_lines_hide_keys(void **state) {
  static const char *const flags[] = {"--sandbox-uncertain-amount", "7070",
                                      "--reconcile-interval", "1h", NULL};
  /* Distinctive keys, so a substring match cannot be a coincidence. */
  static const char K1[] = "RAWKEY-alpha-7f3a9c1e5b";
  static const char K2[] = "RAWKEY-bravo-0c8d2e4f6a";
  static const char K3[] = "RAWKEY-charlie-93b1d7";
  static const char K4[] = "RAWKEY-delta-quoted-55e";
  static const struct logged reqs[] = {
      {"/payments", K1, PAYMENT, "rid-1", 201, "new"},
      {"/payments", K1, PAYMENT, "rid-2", 201, "replay"},
      {"/payments", K1, "{\"amount\": 1}", "rid-3", 422, "mismatch"},
      {"/payments", K2, "{\"amount\": 0}", "rid-4", 422, "invalid"},
      {"/payments", K2, "{\"amount\": 7070}", "rid-5", 202, "pending"},
      {"/payments", K2, "{\"amount\": 7070}", "rid-6", 202, "pending"},
      {"/orders", K1, ORDER, "rid-7", 201, "new"},
      {"/orders", K3, "[1]", "rid-8", 400, "invalid"},
      {"/orders", K3, ORDER, "rid-9", 201, "new"},
      {"/payments",
       "\""
       "RAWKEY-delta-quoted-55e"
       "\"",
       PAYMENT, "rid-10", 201, "new"},
  };
  const size_t n = sizeof reqs / sizeof *reqs;
  h_server_t *s = h_server_start(flags);
  const char *tok = h_tenant(s, "acme");
  const char *raw_keys[] = {K1, K2, K3, K4};
  char key_ids[sizeof reqs / sizeof *reqs][40];
  json_t *lines;
  char *text;
  h_resp_t r;
  (void)state;

  for (size_t i = 0; i < n; i++) {
    char rid[64];
    h_req_t q = {.method = "POST",
                 .path = reqs[i].path,
                 .token = tok,
                 .key = reqs[i].key,
                 .body = reqs[i].body};
    snprintf(rid, sizeof rid, "X-Request-Id: %s", reqs[i].rid);
    q.headers[0] = rid;
    h_context("request %s", reqs[i].rid);
    h_http(s, &q, &r);
    h_assert_status(&r, reqs[i].status);
    h_resp_free(&r);
  }
  /* Requests rejected before the key is read must not log it either. */
  h_post(s, "/payments", NULL, K4, PAYMENT, &r);
  h_assert_status(&r, 401);
  h_resp_free(&r);
  {
    h_req_t q = {.method = "POST",
                 .path = "/payments",
                 .token = tok,
                 .key = K4,
                 .body = PAYMENT,
                 .content_type = "text/plain"};
    h_http(s, &q, &r);
    h_assert_status(&r, 415);
    h_resp_free(&r);
  }
  h_context_clear();
  h_server_stop(s); /* every line is written */

  text = h_read_file(s->log, NULL);
  assert_non_null(text);
  for (size_t k = 0; k < 4; k++)
    if (strstr(text, raw_keys[k]))
      fail_msg("the log contains the raw key %s", raw_keys[k]);
  /* nor in a transformed form that is easy to spot */
  assert_null(strstr(text, "RAWKEY"));
  free(text);

  lines = read_log(s);
  for (size_t i = 0; i < n; i++) {
    json_t *l = line_for(lines, reqs[i].rid);
    const char *kid = json_string_value(json_object_get(l, "key_id"));
    h_context("log line of %s", reqs[i].rid);
    if (kid == NULL || strlen(kid) < 8)
      fail_msg("no key_id in the log line of %s", reqs[i].rid);
    snprintf(key_ids[i], sizeof key_ids[i], "%s", kid);
    assert_string_equal(json_string_value(json_object_get(l, "method")), "POST");
    assert_string_equal(json_string_value(json_object_get(l, "path")), reqs[i].path);
    assert_string_equal(json_string_value(json_object_get(l, "tenant")), "acme");
    assert_string_equal(json_string_value(json_object_get(l, "outcome")),
                        reqs[i].outcome);
    assert_int_equal(json_integer_value(json_object_get(l, "status")), reqs[i].status);
    assert_non_null(json_object_get(l, "ts"));
    assert_true(json_is_number(json_object_get(l, "latency_ms")));
    assert_string_equal(json_string_value(json_object_get(l, "operation")),
                        strcmp(reqs[i].path, "/payments") == 0 ? "create_payment"
                                                               : "create_order");
  }
  h_context_clear();
  /* Request lines are written in batches, event lines at once: the order
   * still holds, every request line before the stop's "shutting down". */
  {
    size_t i, last_request = 0, shutting_down = 0;
    json_t *l;
    json_array_foreach(lines, i, l) {
      const char *msg = json_string_value(json_object_get(l, "msg"));
      if (msg && strcmp(msg, "request") == 0)
        last_request = i;
      else if (msg && strcmp(msg, "shutting down") == 0)
        shutting_down = i;
    }
    assert_true(shutting_down > last_request);
  }
  /* The key id names (tenant, operation, key): the same for one key on one
   * route, different across keys and across routes. */
  assert_string_equal(key_ids[0], key_ids[1]);
  assert_string_equal(key_ids[0], key_ids[2]);
  assert_string_equal(key_ids[3], key_ids[4]);
  assert_string_equal(key_ids[7], key_ids[8]);
  assert_string_not_equal(key_ids[0], key_ids[3]);
  assert_string_not_equal(key_ids[0], key_ids[6]); /* K1 on /orders */
  assert_string_not_equal(key_ids[0], key_ids[9]);
  for (size_t i = 0; i < n; i++) {
    assert_null(strstr(key_ids[i], "RAWKEY"));
    assert_null(strstr(key_ids[i], "alpha"));
  }
  json_decref(lines);
}

/* X-Request-Id: a valid one is echoed (and logged), anything else is
 * replaced by a generated one; every answer has one. */
static void test_request_id(void **state) {
  static const char *const invalid[] = {
      "has space",
      "semi;colon",
      "",
      "0123456789012345678901234567890123456789012345678901234567890123456789",
      "quote\"d",
  };
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  char seen[8][160];
  json_t *lines;
  h_resp_t r;
  (void)state;

  {
    h_req_t q = {.method = "POST",
                 .path = "/payments",
                 .token = tok,
                 .key = "rid-ok",
                 .body = PAYMENT};
    q.headers[0] = "X-Request-Id: client-req_42.a:b-c";
    h_http(s, &q, &r);
    h_assert_first(&r, 201);
    assert_string_equal(r.request_id, "client-req_42.a:b-c");
    h_resp_free(&r);
    q.path = "/nowhere";
    q.headers[0] = "X-Request-Id: client-req_43";
    h_http(s, &q, &r);
    h_assert_status(&r, 404);
    assert_string_equal(r.request_id, "client-req_43");
    h_resp_free(&r);
  }
  for (size_t i = 0; i < sizeof invalid / sizeof *invalid; i++) {
    char line[200];
    h_req_t q = {.method = "GET", .path = "/healthz"};
    snprintf(line, sizeof line, "X-Request-Id: %s", invalid[i]);
    q.headers[0] = line;
    h_context("X-Request-Id '%s'", invalid[i]);
    h_http(s, &q, &r);
    h_assert_status(&r, 200);
    assert_true(r.request_id[0] != '\0');
    if (invalid[i][0])
      assert_null(strstr(r.request_id, invalid[i]));
    snprintf(seen[i], sizeof seen[i], "%s", r.request_id);
    for (size_t k = 0; k < i; k++)
      assert_string_not_equal(seen[i], seen[k]);
    h_resp_free(&r);
  }
  h_context_clear();
  /* No header at all: generated too. */
  h_get(s, "/healthz", NULL, &r);
  assert_true(r.request_id[0] != '\0');
  h_resp_free(&r);
  h_server_stop(s);

  /* The log line carries the same id. */
  lines = read_log(s);
  assert_int_equal(json_integer_value(
                       json_object_get(line_for(lines, "client-req_42.a:b-c"), "status")),
                   201);
  assert_int_equal(
      json_integer_value(json_object_get(line_for(lines, "client-req_43"), "status")),
      404);
  for (size_t i = 0; i < sizeof invalid / sizeof *invalid; i++)
    (void)line_for(lines, seen[i]);
  json_decref(lines);
}

/* ---- counters ---------------------------------------------------------- */

#define PAY_COUNTER(outcome)                                                             \
  "idem_requests_total{operation=\"create_payment\",outcome=\"" outcome "\"}"

static const char *const pay_outcomes[] = {PAY_COUNTER("new"),       PAY_COUNTER("replay"),
                                           PAY_COUNTER("mismatch"),  PAY_COUNTER("invalid"),
                                           PAY_COUNTER("in_flight"), PAY_COUNTER("pending"),
                                           PAY_COUNTER("read"),      PAY_COUNTER("error")};
#define NPAY_OUTCOMES (sizeof pay_outcomes / sizeof *pay_outcomes)

/* GET /metrics; fails unless it answers 200. Caller frees with h_resp_free. */
static void get_metrics(h_server_t *s, h_resp_t *r) {
  h_get(s, "/metrics", NULL, r);
  h_assert_status(r, 200);
}

/* The current values of pay_outcomes[] (each must be listed). */
static void read_pay_counters(h_server_t *s, double *out) {
  h_resp_t r;
  get_metrics(s, &r);
  for (size_t i = 0; i < NPAY_OUTCOMES; i++) {
    out[i] = h_metric(r.body, pay_outcomes[i]);
    if (out[i] < 0)
      fail_msg("%s is not in /metrics", pay_outcomes[i]);
  }
  h_resp_free(&r);
}

/* Reads the counters until each has moved by at least want[i] from
 * base[i] (base NULL: from zero), at most 5 s: a request is counted once
 * its answer is out, possibly just after the client has read it, and
 * requests on different connections may be counted in any order. */
static void settle_pay_counters(h_server_t *s, const double *base, const double *want,
                                double *out) {
  double deadline = h_now() + 5;
  for (;;) {
    int all = 1;
    read_pay_counters(s, out);
    for (size_t i = 0; i < NPAY_OUTCOMES; i++)
      all = all && out[i] - (base ? base[i] : 0) >= want[i];
    if (all || h_now() > deadline)
      return;
    struct timespec ts = {0, 10 * 1000000L};
    nanosleep(&ts, NULL);
  }
}

/* /healthz and /metrics answer without credentials; the metrics of
 * docs/idempotency.md, section 5.2, are there and count what happened. */
static void test_health_and_metrics(void **state) {
  static const char *const flags[] = {"--sandbox-uncertain-amount", "7070",
                                      "--reconcile-interval", "1h", NULL};
  static const char *const names[] = {
      "idem_requests_total{",         "idem_records_pending ",
      "idem_oldest_pending_seconds ", "idem_reconcile_unresolved ",
      "idem_store_errors_total ",     "idem_request_duration_seconds_bucket{"};
  h_server_t *s = h_server_start(flags);
  const char *tok = h_tenant(s, "acme");
  char missing[256] = "";
  h_resp_t r;
  (void)state;

  h_post(s, "/payments", tok, "m-1", PAYMENT, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);
  h_post(s, "/payments", tok, "m-1", PAYMENT, &r);
  h_assert_status(&r, 201);
  h_resp_free(&r);
  h_post(s, "/payments", tok, "m-2", "{\"amount\": 7070}", &r);
  h_assert_first(&r, 202);
  h_resp_free(&r);

  {
    /* new, replay, pending: counted once each answer is out */
    const double want[NPAY_OUTCOMES] = {1, 1, 0, 0, 0, 1, 0, 0};
    double seen[NPAY_OUTCOMES];
    settle_pay_counters(s, NULL, want, seen);
  }

  h_get(s, "/healthz", NULL, &r);
  h_assert_status(&r, 200);
  assert_int_equal(json_object_size(r.json), 1);
  assert_string_equal(json_string_value(json_object_get(r.json, "status")), "ok");
  h_resp_free(&r);
  {
    h_req_t q = {.method = "HEAD", .path = "/healthz"};
    h_http(s, &q, &r);
    h_assert_status(&r, 200);
    h_resp_free(&r);
  }
  h_get(s, "/metrics", NULL, &r);
  h_assert_status(&r, 200);
  assert_int_equal(strncmp(r.content_type, "text/plain", 10), 0);
  for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
    char line[80];
    snprintf(line, sizeof line, "\n%s", names[i]);
    if (strstr(r.body, line) == NULL)
      snprintf(missing + strlen(missing), sizeof missing - strlen(missing), " %.*s",
               (int)strlen(names[i]) - 1, names[i]);
  }
  if (missing[0])
    fail_msg("metrics missing from /metrics:%s", missing);
  assert_true(h_metric(r.body, "idem_records_pending") == 1);
  assert_true(h_metric(r.body, "idem_oldest_pending_seconds") >= 0);
  assert_true(h_metric(r.body, "idem_store_errors_total") == 0);
  assert_true(
      h_metric(r.body, "idem_request_duration_seconds_count{operation=\"create_payment\"}") ==
      3);
  assert_true(h_metric(r.body, "idem_request_duration_seconds_bucket{operation=\"create_"
                             "payment\",le=\"+Inf\"}") == 3);
  /* GET and HEAD above, and the harness's own while idemd started */
  assert_true(h_metric(r.body, "idem_request_duration_seconds_count{operation=\"healthz\"}") >=
              2);
  /* The 404 below is not counted yet. */
  assert_true(h_metric(r.body, "idem_requests_total{operation=\"other\",outcome=\"invalid\"}") <
              0);
  assert_true(h_metric(r.body, "process_open_fds") > 3);
  assert_true(h_metric(r.body, "process_resident_memory_bytes") > 0);
  assert_true(h_metric(r.body, "process_cpu_seconds_total") >= 0);
  assert_true(
      h_metric(r.body,
             "idem_requests_total{operation=\"create_payment\",outcome=\"new\"}") == 1);
  assert_true(
      h_metric(r.body,
             "idem_requests_total{operation=\"create_payment\",outcome=\"replay\"}") ==
      1);
  assert_true(
      h_metric(r.body,
             "idem_requests_total{operation=\"create_payment\",outcome=\"pending\"}") ==
      1);
  h_resp_free(&r);

  /* A path no route matches: 404, counted as operation "other", outcome
   * "invalid", in both the counter and the histogram
   * (docs/operations.md). */
  h_get(s, "/no-such-route", NULL, &r);
  h_assert_status(&r, 404);
  h_resp_free(&r);
  for (double deadline = h_now() + 5;; nap_ms(10)) {
    get_metrics(s, &r);
    if (h_metric(r.body, "idem_requests_total{operation=\"other\",outcome=\"invalid\"}") == 1)
      break;
    if (h_now() > deadline)
      fail_msg("the 404 is not counted as other/invalid");
    h_resp_free(&r);
  }
  assert_true(h_metric(r.body, "idem_request_duration_seconds_count{operation=\"other\"}") == 1);
  h_resp_free(&r);
  h_server_stop(s);
}

struct bg {
  h_server_t *s;
  const char *tok;
  h_resp_t resp;
};

static void *bg_main(void *p) {
  struct bg *b = p;
  h_post(b->s, "/payments", b->tok, "in-flight-at-stop", PAYMENT, &b->resp);
  return NULL;
}

/* SIGTERM while a request is at the provider: it still gets its 201, the
 * work is stored, and idemd exits 0; the next start replays it. */
static void test_sigterm_lets_request_finish(void **state) {
  static const char *const flags[] = {"--sandbox-delay", "1s", NULL};
  h_server_t *s = h_server_start(flags);
  struct bg b = {.s = s};
  pthread_t t;
  h_resp_t r;
  (void)state;

  b.tok = h_tenant(s, "acme");
  assert_int_equal(pthread_create(&t, NULL, bg_main, &b), 0);
  if (!h_db_wait(s, 10000,
                 "SELECT count(*) FROM idempotency_records WHERE "
                 "key = 'in-flight-at-stop' AND state = 'processing'"))
    fail_msg("the request never reached the provider");
  h_server_stop(s); /* SIGTERM, exit 0 */
  pthread_join(t, NULL);
  h_assert_first(&b.resp, 201);
  h_assert_db(s, 1,
              "SELECT count(*) FROM idempotency_records WHERE "
              "key = 'in-flight-at-stop' AND state = 'completed'");

  h_server_restart(s, NULL);
  h_post(s, "/payments", b.tok, "in-flight-at-stop", PAYMENT, &r);
  h_assert_replay_of(&r, &b.resp);
  h_resp_free(&r);
  h_resp_free(&b.resp);
  h_server_stop(s);
}

/* The event lines of the log whose "msg" is `msg`. */
static size_t count_events(h_server_t *s, const char *msg) {
  json_t *lines = read_log(s), *l;
  size_t i, n = 0;
  json_array_foreach(lines, i, l) {
    const char *m = json_string_value(json_object_get(l, "msg"));
    n += m && strcmp(m, msg) == 0;
  }
  json_decref(lines);
  return n;
}

/* SIGHUP (systemctl reload, a closed terminal) does not end idemd: with a
 * payment at the provider, two SIGHUPs are each logged as ignored, the
 * payment still gets its 201, idemd keeps serving, and SIGTERM still stops
 * it cleanly (exit 0, checked by h_server_stop). */
static void test_sighup_ignored(void **state) {
  static const char *const flags[] = {"--sandbox-delay", "1s", NULL};
  h_server_t *s = h_server_start(flags);
  struct bg b = {.s = s};
  pthread_t t;
  h_resp_t r;
  (void)state;

  b.tok = h_tenant(s, "acme");
  assert_int_equal(pthread_create(&t, NULL, bg_main, &b), 0);
  if (!h_db_wait(s, 10000,
                 "SELECT count(*) FROM idempotency_records WHERE "
                 "key = 'in-flight-at-stop' AND state = 'processing'"))
    fail_msg("the request never reached the provider");
  for (int i = 1; i <= 2; i++) {
    assert_int_equal(kill(s->pid, SIGHUP), 0);
    for (double deadline = h_now() + 5; count_events(s, "SIGHUP: ignored") < (size_t)i;
         nap_ms(20))
      if (h_now() > deadline)
        fail_msg("no log line 'SIGHUP: ignored' (%d) in %s", i, s->log);
  }
  pthread_join(t, NULL);
  h_assert_first(&b.resp, 201);
  h_assert_healthy(s);
  h_post(s, "/payments", b.tok, "in-flight-at-stop", PAYMENT, &r);
  h_assert_replay_of(&r, &b.resp);
  h_resp_free(&r);
  h_resp_free(&b.resp);
  assert_int_equal(count_events(s, "shutting down"), 0);
  h_server_stop(s);
}

/* Sends `key`'s payment on a new connection with request id `rid`, and
 * closes the connection after `ms`, before the answer. */
static void post_and_leave(h_server_t *s, const char *tok, const char *key, const char *rid,
                           int ms) {
  char req[1024];
  int fd = h_dial(s);
  int n = snprintf(req, sizeof req,
                   "POST /payments HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n"
                   "Idempotency-Key: %s\r\nX-Request-Id: %s\r\n"
                   "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
                   tok, key, rid, strlen(PAYMENT), PAYMENT);
  assert_true(n > 0 && (size_t)n < sizeof req);
  assert_int_equal(send(fd, req, (size_t)n, MSG_NOSIGNAL), n);
  nap_ms(ms);
  close(fd);
}

/* The log line of `rid`, waited for up to 10 s (a request's line is
 * written when its connection is done). Caller json_decref()s `*lines`. */
static json_t *wait_line(h_server_t *s, const char *rid, json_t **lines) {
  for (double deadline = h_now() + 10; h_now() < deadline; nap_ms(20)) {
    size_t i;
    json_t *l;
    *lines = read_log(s);
    json_array_foreach(*lines, i, l) {
      const char *v = json_string_value(json_object_get(l, "request_id"));
      if (v && strcmp(v, rid) == 0)
        return l;
    }
    json_decref(*lines);
  }
  fail_msg("no log line for request %s", rid);
  return NULL;
}

/* A client that leaves before its answer: its payment is made all the
 * same (a retry replays it), and its log line and count say so ("new").
 * A duplicate that was waiting on it and left too is logged as what it
 * was ("in_flight", or "replay" if it was answered into the closed
 * connection), not "invalid", which the check it had passed presumed. */
static void test_client_leaves_before_answer(void **state) {
  static const char *const flags[] = {"--sandbox-delay", "500ms", NULL};
  h_server_t *s = h_server_start(flags);
  const char *tok = h_tenant(s, "acme");
  double before[NPAY_OUTCOMES], after[NPAY_OUTCOMES];
  json_t *lines, *l;
  const char *outcome;
  h_resp_t r;
  (void)state;

  read_pay_counters(s, before);
  post_and_leave(s, tok, "left-1", "req_left_first", 100);
  post_and_leave(s, tok, "left-1", "req_left_dup", 100);
  if (!h_db_wait(s, 10000,
                 "SELECT count(*) FROM idempotency_records WHERE key = ?1 AND state = ?2",
                 "left-1", "completed"))
    fail_msg("the payment of a client that left was not completed");
  l = wait_line(s, "req_left_first", &lines);
  assert_string_equal(json_string_value(json_object_get(l, "outcome")), "new");
  json_decref(lines);
  l = wait_line(s, "req_left_dup", &lines);
  outcome = json_string_value(json_object_get(l, "outcome"));
  assert_non_null(outcome);
  if (strcmp(outcome, "in_flight") != 0 && strcmp(outcome, "replay") != 0)
    fail_msg("the duplicate that left was logged '%s'", outcome);
  json_decref(lines);
  read_pay_counters(s, after);
  assert_true(after[0] - before[0] == 1); /* new */
  assert_true(after[3] - before[3] == 0); /* invalid */
  h_post(s, "/payments", tok, "left-1", PAYMENT, &r);
  h_assert_status(&r, 201);
  assert_string_equal(r.replayed, "true");
  h_resp_free(&r);
  h_server_stop(s);
}

/* One request of each outcome on POST /payments moves its own counter by
 * one and no other. */
static void test_request_counters(void **state) {
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  const double warm[NPAY_OUTCOMES] = {1, 0, 0, 0, 0, 0, 0, 0};
  const double want[NPAY_OUTCOMES] = {1, 1, 1, 1, 0, 0, 0, 0};
  double before[NPAY_OUTCOMES], after[NPAY_OUTCOMES];
  h_resp_t r;
  (void)state;

  /* Something on the books first, so "before" is not all zeros. */
  h_post(s, "/payments", tok, "warm-up", PAYMENT, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);
  settle_pay_counters(s, NULL, warm, before);

  h_post(s, "/payments", tok, "count-1", PAYMENT, &r); /* new */
  h_assert_first(&r, 201);
  h_resp_free(&r);
  h_post(s, "/payments", tok, "count-1", PAYMENT, &r); /* replay */
  h_assert_status(&r, 201);
  assert_string_equal(r.replayed, "true");
  h_resp_free(&r);
  h_post(s, "/payments", tok, "count-1", "{\"amount\": 1}", &r); /* mismatch */
  h_assert_error(&r, 422, "Idempotency-Key was already used with a different request");
  h_resp_free(&r);
  h_post(s, "/payments", tok, "count-2", "{\"amount\": 0}", &r); /* invalid */
  h_assert_field_error(&r, "amount");
  h_resp_free(&r);

  settle_pay_counters(s, before, want, after);
  for (size_t i = 0; i < NPAY_OUTCOMES; i++) {
    h_context("%s: before %.0f, after %.0f", pay_outcomes[i], before[i], after[i]);
    assert_true(after[i] - before[i] == want[i]);
  }
  h_context_clear();
  h_server_stop(s);
}

/* ---- the command line ------------------------------------------------- */

/* Runs a command that must succeed; returns its stdout (malloc'd). */
static char *cli_ok(h_server_t *s, const char *const *args) {
  char *out = NULL;
  int rc = h_cli(s, args, &out);
  if (rc != 0)
    fail_msg("idemd %s %s exited %d (stdout: %s; see %s)", args[0], args[1] ? args[1] : "",
             rc, out, s->cli_log);
  return out;
}

/* /metrics names the build as `idemd --version` does: idem_build_info's
 * version and revision are what --version prints ("idemd VERSION" or
 * "idemd VERSION (git REVISION)"), its store the backend serving. */
static void test_build_info(void **state) {
  h_server_t *s = h_server_start(NULL);
  char *out = cli_ok(s, (const char *const[]){"--version", NULL});
  char want[512], version[128] = "", revision[128] = "";
  const char *store = h_store_is_pg() ? "postgresql" : "sqlite";
  h_resp_t r;
  (void)state;

  if (sscanf(out, "idemd %127s (git %127[^)])", version, revision) < 1)
    fail_msg("idemd --version printed '%s'", out);
  snprintf(want, sizeof want,
           "\nidem_build_info{version=\"%s\",revision=\"%s\",store=\"%s\"} 1\n", version,
           revision, store);
  get_metrics(s, &r);
  if (strstr(r.body, want) == NULL)
    fail_msg("/metrics lacks%sfor `idemd --version` '%s'", want, out);
  if (strstr(r.body, "\n# TYPE idem_build_info gauge\n") == NULL)
    fail_msg("idem_build_info is not declared a gauge");
  h_resp_free(&r);
  free(out);
  h_server_stop(s);
}

/* The value printed after `label` on a line of `idemd records show`
 * ("label<spaces>value"), copied into `val`; fails if there is none. */
static void show_field(const char *out, const char *label, char *val, size_t cap) {
  size_t n = strlen(label);
  for (const char *p = out; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
    const char *v;
    size_t len;
    if (strncmp(p, label, n) != 0 || p[n] != ' ')
      continue;
    for (v = p + n; *v == ' '; v++)
      ;
    len = strcspn(v, "\n");
    if (len >= cap)
      fail_msg("records show: %s is too long", label);
    memcpy(val, v, len);
    val[len] = '\0';
    return;
  }
  fail_msg("records show printed no '%s' line:\n%s", label, out);
}

/* The line of a `tenant list` or `records` listing that holds `needle`
 * (copied into `line`), or 0 if none does. Not inlined: GCC 12 at -O2
 * then took `out` for a pointer into cli_ok()'s local variable and warned
 * of a dangling pointer (-Wdangling-pointer, a false positive). */
__attribute__((noinline)) static int line_with(const char *out, const char *needle,
                                                char *line, size_t cap) {
  const char *hit = strstr(out, needle);
  const char *start;
  size_t len;
  if (hit == NULL)
    return 0;
  for (start = hit; start > out && start[-1] != '\n'; start--)
    ;
  len = strcspn(start, "\n");
  snprintf(line, cap, "%.*s", (int)len, start);
  return 1;
}

/* A new API key for `tenant` from `idemd tenant rotate` (malloc'd). */
static char *rotate(h_server_t *s, const char *tenant) {
  const char *const args[] = {"tenant", "rotate", tenant, NULL};
  char *out = cli_ok(s, args);
  size_t n = strlen(out);
  assert_true(n > 5 && out[n - 1] == '\n');
  out[n - 1] = '\0';
  assert_null(strchr(out, '\n')); /* the key alone on stdout */
  assert_int_equal(strncmp(out, "idem_", 5), 0);
  return out;
}

static void tenant_action(h_server_t *s, const char *action, const char *tenant) {
  const char *const args[] = {"tenant", action, tenant, NULL};
  free(cli_ok(s, args));
}

/* The tenant's STATUS column in `idemd tenant list`. */
static void assert_tenant_status(h_server_t *s, const char *tenant, const char *status) {
  const char *const args[] = {"tenant", "list", NULL};
  char *out = cli_ok(s, args);
  char line[256], name[80], st[32];
  if (!line_with(out, tenant, line, sizeof line))
    fail_msg("tenant list has no %s:\n%s", tenant, out);
  assert_int_equal(sscanf(line, "%79s %31s", name, st), 2);
  assert_string_equal(name, tenant);
  assert_string_equal(st, status);
  free(out);
}

/* A GET of `path` with `tok` answers `status`. */
static void assert_get(h_server_t *s, const char *path, const char *tok, long status) {
  h_resp_t r;
  h_get(s, path, tok, &r);
  h_assert_status(&r, status);
  h_resp_free(&r);
}

/* `idemd tenant rotate|disable|enable` while the server runs: the next
 * request sees the change; the tenant's resources and keys stay its own. */
static void test_tenant_rotate_disable_enable(void **state) {
  h_server_t *s = h_server_start(NULL);
  const char *old = h_tenant(s, "acme");
  const char *bystander = h_tenant(s, "globex");
  char loc[256], *fresh;
  h_resp_t first, r;
  (void)state;

  h_post(s, "/payments", old, "before-rotate", PAYMENT, &first);
  h_assert_first(&first, 201);
  snprintf(loc, sizeof loc, "%s", first.location);
  assert_get(s, loc, old, 200);
  assert_tenant_status(s, "acme", "active");

  fresh = rotate(s, "acme");
  assert_string_not_equal(fresh, old);
  /* The old key is refused at once, on reads and writes. */
  assert_get(s, loc, old, 401);
  h_post(s, "/payments", old, "after-rotate-old", PAYMENT, &r);
  h_assert_error(&r, 401, NULL);
  assert_string_equal(r.www_authenticate, "Bearer");
  h_resp_free(&r);
  /* The new one is the same tenant: its payment, its keys. */
  assert_get(s, loc, fresh, 200);
  h_post(s, "/payments", fresh, "before-rotate", PAYMENT, &r);
  h_assert_replay_of(&r, &first);
  h_resp_free(&r);
  h_post(s, "/payments", fresh, "after-rotate", PAYMENT, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);
  assert_tenant_status(s, "acme", "active");

  tenant_action(s, "disable", "acme");
  assert_tenant_status(s, "acme", "disabled");
  assert_get(s, loc, fresh, 401);
  h_post(s, "/payments", fresh, "while-disabled", PAYMENT, &r);
  h_assert_error(&r, 401, NULL);
  h_resp_free(&r);
  h_assert_db(s, 0, "SELECT count(*) FROM idempotency_records WHERE key = 'while-disabled'");
  /* Another tenant is not affected. */
  h_post(s, "/payments", bystander, "globex-1", PAYMENT, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);

  tenant_action(s, "enable", "acme");
  assert_tenant_status(s, "acme", "active");
  assert_get(s, loc, fresh, 200);
  assert_get(s, loc, old, 401); /* enabling does not bring the old key back */
  h_post(s, "/payments", fresh, "after-enable", PAYMENT, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);

  /* An unknown tenant is an error, not a silent no-op. */
  {
    const char *const args[] = {"tenant", "rotate", "nobody", NULL};
    char *out = NULL;
    assert_int_equal(h_cli(s, args, &out), 1);
    assert_string_equal(out, "");
    free(out);
  }
  free(fresh);
  h_resp_free(&first);
  h_server_stop(s);
}

/* A key from `idemd tenant key add TENANT NAME` (malloc'd). */
static char *key_add(h_server_t *s, const char *tenant, const char *name) {
  const char *const args[] = {"tenant", "key", "add", tenant, name, NULL};
  char *out = cli_ok(s, args);
  size_t n = strlen(out);
  assert_true(n > 5 && out[n - 1] == '\n');
  out[n - 1] = '\0';
  assert_null(strchr(out, '\n')); /* the key alone on stdout */
  assert_int_equal(strncmp(out, "idem_", 5), 0);
  return out;
}

/* The line of `idemd tenant key list TENANT` for the key named `name` in
 * use (or revoked, `revoked`): its STATUS and LAST USED columns. */
static void key_line(h_server_t *s, const char *tenant, const char *name, int revoked,
                     char *status, char *used) {
  const char *const args[] = {"tenant", "key", "list", tenant, NULL};
  char *out = cli_ok(s, args), *line = out;
  char got[80], prefix[80], created[32], when[32];

  for (; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
    if (sscanf(line, "%79s %31s %79s %31s %31s", got, status, prefix, created, when) == 5 &&
        strcmp(got, name) == 0 && (strcmp(status, "revoked") == 0) == revoked) {
      snprintf(used, 32, "%s", when);
      assert_int_equal(strncmp(prefix, "idem_", 5), 0);
      free(out);
      return;
    }
  }
  fail_msg("tenant key list has no %s key named %s:\n%s", revoked ? "revoked" : "active",
           name, out);
}

/* `idemd tenant key add|revoke|list` while the server runs: a second key
 * works beside the first (a rotation's overlap), the first revoked is
 * refused at once, and the listing shows each key's state and last use
 * (written by the server as it stops, at the latest). */
static void test_tenant_keys(void **state) {
  h_server_t *s = h_server_start(NULL);
  const char *first = h_tenant(s, "acme");
  char *second, status[32], used[32];
  h_resp_t paid, r;
  (void)state;

  h_post(s, "/payments", first, "with-first", PAYMENT, &paid);
  h_assert_first(&paid, 201);
  second = key_add(s, "acme", "ci");
  assert_string_not_equal(second, first);
  /* Both keys are the tenant's: the same payment, the same keys. */
  assert_get(s, paid.location, first, 200);
  assert_get(s, paid.location, second, 200);
  h_post(s, "/payments", second, "with-first", PAYMENT, &r);
  h_assert_replay_of(&r, &paid);
  h_resp_free(&r);
  key_line(s, "acme", "default", 0, status, used);
  assert_string_equal(status, "active");
  key_line(s, "acme", "ci", 0, status, used);
  assert_string_equal(status, "active");

  /* A name in use, a bad name, an unknown tenant, an unknown key. */
  {
    const char *const taken[] = {"tenant", "key", "add", "acme", "ci", NULL};
    const char *const bad[] = {"tenant", "key", "add", "acme", "c i", NULL};
    const char *const nobody[] = {"tenant", "key", "add", "nobody", "x", NULL};
    const char *const unknown[] = {"tenant", "key", "revoke", "acme", "nope", NULL};
    const char *const usage[] = {"tenant", "key", "add", "acme", NULL};
    char *out = NULL;
    assert_int_equal(h_cli(s, taken, &out), 1);
    assert_string_equal(out, "");
    free(out);
    assert_int_equal(h_cli(s, bad, &out), 2);
    free(out);
    assert_int_equal(h_cli(s, nobody, &out), 1);
    free(out);
    assert_int_equal(h_cli(s, unknown, &out), 1);
    free(out);
    assert_int_equal(h_cli(s, usage, &out), 2);
    free(out);
  }

  /* The first revoked: refused at once; the second still works. */
  free(cli_ok(s, (const char *const[]){"tenant", "key", "revoke", "acme", "default", NULL}));
  assert_get(s, paid.location, first, 401);
  h_post(s, "/payments", first, "after-revoke", PAYMENT, &r);
  h_assert_error(&r, 401, NULL);
  h_resp_free(&r);
  assert_get(s, paid.location, second, 200);
  h_post(s, "/payments", second, "after-revoke", PAYMENT, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);
  key_line(s, "acme", "default", 1, status, used);
  assert_string_equal(status, "revoked");

  /* Stopped, the server has written when each key was last used. */
  h_server_stop(s);
  key_line(s, "acme", "default", 1, status, used);
  assert_string_not_equal(used, "-");
  key_line(s, "acme", "ci", 0, status, used);
  assert_string_not_equal(used, "-");
  /* A key never used has none. */
  free(key_add(s, "acme", "spare"));
  key_line(s, "acme", "spare", 0, status, used);
  assert_string_equal(used, "-");
  free(second);
  h_resp_free(&paid);
}

/* `idemd records` and `records show` print a tenant's records (state,
 * fingerprint, resource, provider reference) and nothing of another
 * tenant's, even under the same key. */
static void test_records_tools(void **state) {
  static const char *const flags[] = {"--sandbox-uncertain-amount", "7070",
                                      "--reconcile-interval", "1h", NULL};
  h_server_t *s = h_server_start(flags);
  const char *acme = h_tenant(s, "acme");
  const char *globex = h_tenant(s, "globex");
  char acme_pay[64], globex_pay[64], pending_pay[64], order_id[64];
  char val[512], line[512];
  char *fp, *ref, *globex_fp, *globex_ref, *pending_ref, *out;
  h_resp_t r;
  (void)state;

  h_post(s, "/payments", acme, "shared-key", PAYMENT, &r);
  h_assert_first(&r, 201);
  snprintf(acme_pay, sizeof acme_pay, "%s", h_id(&r));
  h_resp_free(&r);
  h_post(s, "/payments", globex, "shared-key", "{\"amount\": 4242, \"currency\": \"USD\"}", &r);
  h_assert_first(&r, 201);
  snprintf(globex_pay, sizeof globex_pay, "%s", h_id(&r));
  h_resp_free(&r);
  h_post(s, "/payments", globex, "globex-only", PAYMENT, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);
  h_post(s, "/payments", acme, "acme-pending", "{\"amount\": 7070}", &r);
  h_assert_first(&r, 202);
  snprintf(pending_pay, sizeof pending_pay, "%s", h_id(&r));
  h_resp_free(&r);
  h_post(s, "/orders", acme, "acme-order", ORDER, &r);
  h_assert_first(&r, 201);
  snprintf(order_id, sizeof order_id, "%s", h_id(&r));
  h_resp_free(&r);

#define OF_TENANT(t) "(SELECT id FROM tenants WHERE name = '" t "')"
  fp = h_db_text(s, "SELECT fingerprint FROM idempotency_records WHERE key = 'shared-key' "
                    "AND tenant_id = " OF_TENANT("acme"));
  ref = h_db_text(s, "SELECT provider_ref FROM idempotency_records WHERE key = 'shared-key' "
                     "AND tenant_id = " OF_TENANT("acme"));
  globex_fp = h_db_text(s, "SELECT fingerprint FROM idempotency_records WHERE key = "
                           "'shared-key' AND tenant_id = " OF_TENANT("globex"));
  globex_ref = h_db_text(s, "SELECT provider_ref FROM idempotency_records WHERE key = "
                            "'shared-key' AND tenant_id = " OF_TENANT("globex"));
  pending_ref = h_db_text(s, "SELECT provider_ref FROM idempotency_records WHERE key = "
                             "'acme-pending'");
  assert_non_null(fp);
  assert_non_null(ref);
  assert_non_null(globex_fp);
  assert_non_null(globex_ref);
  assert_non_null(pending_ref);
  assert_string_not_equal(fp, globex_fp); /* different bodies */

  /* The list: acme's three records, none of globex's. */
  {
    const char *const args[] = {"records", "--tenant", "acme", NULL};
    out = cli_ok(s, args);
    if (!line_with(out, acme_pay, line, sizeof line))
      fail_msg("records --tenant acme lacks %s:\n%s", acme_pay, out);
    assert_non_null(strstr(line, "completed"));
    assert_non_null(strstr(line, "create_payment"));
    assert_non_null(strstr(line, "shared-key"));
    if (!line_with(out, pending_pay, line, sizeof line))
      fail_msg("records --tenant acme lacks %s:\n%s", pending_pay, out);
    assert_non_null(strstr(line, "pending"));
    assert_non_null(strstr(line, "202"));
    assert_non_null(strstr(line, "acme-pending"));
    if (!line_with(out, order_id, line, sizeof line))
      fail_msg("records --tenant acme lacks %s:\n%s", order_id, out);
    assert_non_null(strstr(line, "create_order"));
    assert_non_null(strstr(line, "acme-order"));
    assert_null(strstr(out, globex_pay));
    assert_null(strstr(out, "globex-only"));
    free(out);
  }
  /* --state narrows it. */
  {
    const char *const args[] = {"records", "--tenant", "acme", "--state", "pending", NULL};
    out = cli_ok(s, args);
    assert_non_null(strstr(out, pending_pay));
    assert_null(strstr(out, acme_pay));
    assert_null(strstr(out, order_id));
    free(out);
  }
  /* One record in full. */
  {
    const char *const args[] = {"records",     "show",           "--tenant", "acme",
                                "--operation", "create_payment", "--key",    "shared-key",
                                NULL};
    out = cli_ok(s, args);
    show_field(out, "tenant", val, sizeof val);
    assert_string_equal(val, "acme");
    show_field(out, "state", val, sizeof val);
    assert_string_equal(val, "completed");
    show_field(out, "fingerprint", val, sizeof val);
    assert_string_equal(val, fp);
    show_field(out, "resource", val, sizeof val);
    assert_string_equal(val, acme_pay);
    show_field(out, "provider ref", val, sizeof val);
    assert_string_equal(val, ref);
    show_field(out, "response status", val, sizeof val);
    assert_string_equal(val, "201");
    assert_null(strstr(out, globex_pay));
    assert_null(strstr(out, globex_fp));
    assert_null(strstr(out, globex_ref));
    free(out);
  }
  {
    const char *const args[] = {"records",     "show",           "--tenant", "acme",
                                "--operation", "create_payment", "--key",    "acme-pending",
                                NULL};
    out = cli_ok(s, args);
    show_field(out, "state", val, sizeof val);
    assert_string_equal(val, "pending");
    show_field(out, "resource", val, sizeof val);
    assert_string_equal(val, pending_pay);
    show_field(out, "provider ref", val, sizeof val);
    assert_string_equal(val, pending_ref);
    free(out);
  }
  /* globex's view of the shared key is globex's record. */
  {
    const char *const args[] = {"records",     "show",           "--tenant", "globex",
                                "--operation", "create_payment", "--key",    "shared-key",
                                NULL};
    out = cli_ok(s, args);
    show_field(out, "resource", val, sizeof val);
    assert_string_equal(val, globex_pay);
    show_field(out, "fingerprint", val, sizeof val);
    assert_string_equal(val, globex_fp);
    assert_null(strstr(out, acme_pay));
    free(out);
  }
  /* Another tenant's key, or another operation's, is not there. */
  {
    const char *const other_tenant[] = {"records",     "show",           "--tenant", "globex",
                                        "--operation", "create_payment", "--key",
                                        "acme-pending", NULL};
    const char *const other_op[] = {"records",     "show",         "--tenant", "acme",
                                    "--operation", "create_order", "--key",    "shared-key",
                                    NULL};
    const char *const no_tenant[] = {"records", "--tenant", "nobody", NULL};
    assert_int_equal(h_cli(s, other_tenant, &out), 1);
    assert_null(strstr(out, pending_pay));
    assert_string_equal(out, "");
    free(out);
    assert_int_equal(h_cli(s, other_op, &out), 1);
    assert_string_equal(out, "");
    free(out);
    assert_int_equal(h_cli(s, no_tenant, &out), 1);
    assert_string_equal(out, "");
    free(out);
  }
#undef OF_TENANT
  free(fp);
  free(ref);
  free(globex_fp);
  free(globex_ref);
  free(pending_ref);
  h_server_stop(s);
}

/* ---- retention -------------------------------------------------------- */

/* The sweeper deletes expired completed and failed records, and nothing
 * else: not the pending record, not a payment or an order. */
static void test_sweeper_deletes_only_expired(void **state) {
  static const char *const flags[] = {
      "--key-ttl", "1s", "--sweep-interval", "200ms", "--sandbox-uncertain-amount", "7070",
      "--sandbox-unavailable-amount", "5030", "--reconcile-interval", "1h", NULL};
  h_server_t *s = h_server_start(flags);
  const char *tok = h_tenant(s, "acme");
  char ids[5][256];
  h_resp_t pending, r;
  double swept = -1, deadline;
  (void)state;

  for (int i = 0; i < 3; i++) {
    char key[32];
    snprintf(key, sizeof key, "sweep-done-%d", i);
    h_post(s, "/payments", tok, key, PAYMENT, &r);
    h_assert_first(&r, 201);
    snprintf(ids[i], sizeof ids[i], "%s", r.location);
    h_resp_free(&r);
  }
  h_post(s, "/orders", tok, "sweep-order", ORDER, &r);
  h_assert_first(&r, 201);
  snprintf(ids[3], sizeof ids[3], "%s", r.location);
  h_resp_free(&r);
  h_post(s, "/payments", tok, "sweep-failed", "{\"amount\": 5030}", &r);
  h_assert_status(&r, 503);
  h_resp_free(&r);
  h_post(s, "/payments", tok, "sweep-pending", "{\"amount\": 7070}", &pending);
  h_assert_first(&pending, 202);
  snprintf(ids[4], sizeof ids[4], "%s", pending.location);
  h_assert_db(s, 6, "SELECT count(*) FROM idempotency_records");

  /* Bounded: the TTL is 1 s and the sweeper runs every 200 ms. */
  if (!h_db_wait(s, 15000,
                 "SELECT CASE WHEN count(*) = 0 THEN 1 ELSE 0 END FROM idempotency_records "
                 "WHERE state IN ('completed', 'failed')"))
    fail_msg("the sweeper left expired records: %lld",
             (long long)h_db_int(s, "SELECT count(*) FROM idempotency_records "
                                    "WHERE state IN ('completed', 'failed')"));
  /* The pending record stays, still pending, and replays as such. */
  h_assert_db(s, 1, "SELECT count(*) FROM idempotency_records");
  h_assert_db(s, 1,
              "SELECT count(*) FROM idempotency_records WHERE key = 'sweep-pending' "
              "AND state = 'pending'");
  h_post(s, "/payments", tok, "sweep-pending", "{\"amount\": 7070}", &r);
  h_assert_replay_of(&r, &pending);
  h_resp_free(&r);
  /* Every resource stays: three succeeded, one failed, one pending, one order. */
  h_assert_db(s, 3, "SELECT count(*) FROM payments WHERE status = 'succeeded'");
  h_assert_db(s, 1, "SELECT count(*) FROM payments WHERE status = 'failed'");
  h_assert_db(s, 1, "SELECT count(*) FROM payments WHERE status = 'pending'");
  h_assert_db(s, 1, "SELECT count(*) FROM orders");
  for (int i = 0; i < 5; i++)
    assert_get(s, ids[i], tok, 200);

  /* The metric counted them: four completed and one failed. */
  deadline = h_now() + 5;
  do {
    get_metrics(s, &r);
    swept = h_metric(r.body, "idem_records_swept_total");
    h_resp_free(&r);
    if (swept >= 5)
      break;
    struct timespec ts = {0, 20 * 1000000L};
    nanosleep(&ts, NULL);
  } while (h_now() < deadline);
  h_context("idem_records_swept_total %.0f", swept);
  assert_true(swept == 5);
  h_context_clear();
  h_resp_free(&pending);
  h_server_stop(s);
}

/* ---- shutdown under load ---------------------------------------------- */

#define LOAD 10

struct slow {
  h_server_t *s;
  const char *tok;
  char key[32];
  h_resp_t resp;
};

static void *slow_main(void *p) {
  struct slow *w = p;
  h_post(w->s, "/payments", w->tok, w->key, PAYMENT, &w->resp);
  return NULL;
}

/* SIGTERM while ten slow payments are in flight: no new connection
 * is taken from then on, every accepted request gets its whole 201, idemd
 * exits 0, and nothing is half-written. The provider takes 2 s: the
 * refusal must be seen before the first answer, and on a loaded machine
 * (a CI run beside a build) the steps before it once took 1.1 s. */
static void test_sigterm_drains_load(void **state) {
  static const char *const flags[] = {"--sandbox-delay", "2s", "--shutdown-timeout", "30s",
                                      NULL};
  h_server_t *s = h_server_start(flags);
  const char *tok = h_tenant(s, "acme");
  struct slow w[LOAD];
  pthread_t t[LOAD];
  double refused_at = 0, first_answer = 1e300;
  char *log;
  (void)state;

  for (int i = 0; i < LOAD; i++) {
    memset(&w[i], 0, sizeof w[i]);
    w[i].s = s;
    w[i].tok = tok;
    snprintf(w[i].key, sizeof w[i].key, "drain-%d", i);
    assert_int_equal(pthread_create(&t[i], NULL, slow_main, &w[i]), 0);
  }
  /* How many of the ten are at the provider at once varies: an HTTP worker
   * thread that accepted several connections serves them one after the
   * other. So: the first at the provider, the others sent by then and in
   * flight or queued; the shutdown bound leaves room for all ten in a row. */
  if (!h_db_wait(s, 10000,
                 "SELECT count(*) FROM idempotency_records WHERE state = 'processing'"))
    fail_msg("the payments never reached the provider");
  {
    struct timespec ts = {0, 100 * 1000000L};
    nanosleep(&ts, NULL);
  }
  assert_int_equal(kill(s->pid, SIGTERM), 0);
  /* From now on connections are refused, while the ten are still running. */
  for (int i = 0; i < 200 && refused_at == 0; i++) {
    h_resp_t r;
    h_get(s, "/healthz", NULL, &r);
    if (r.status == 0)
      refused_at = h_now();
    h_resp_free(&r);
    if (refused_at == 0) {
      struct timespec ts = {0, 2 * 1000000L};
      nanosleep(&ts, NULL);
    }
  }
  for (int i = 0; i < LOAD; i++)
    pthread_join(t[i], NULL);
  h_server_stop(s); /* exit status 0, no sanitizer report */

  for (int i = 0; i < LOAD; i++) {
    h_context("request %s", w[i].key);
    h_assert_first(&w[i].resp, 201);
    assert_true(w[i].resp.json != NULL);
    assert_string_equal(json_string_value(json_object_get(w[i].resp.json, "status")),
                        "succeeded");
    h_assert_db(s, 1, "SELECT count(*) FROM payments WHERE id = ?1 AND status = 'succeeded'",
                h_id(&w[i].resp));
    h_assert_db(s, 1,
                "SELECT count(*) FROM idempotency_records WHERE key = ?1 AND "
                "state = 'completed' AND resource_id = ?2",
                w[i].key, h_id(&w[i].resp));
    if (w[i].resp.t_end < first_answer)
      first_answer = w[i].resp.t_end;
  }
  h_context_clear();
  if (refused_at == 0 || refused_at >= first_answer)
    fail_msg("new connections were still accepted while draining (refused at %.3f, first "
             "answer at %.3f)",
             refused_at, first_answer);
  h_assert_db(s, 0, "SELECT count(*) FROM idempotency_records WHERE state <> 'completed'");
  h_assert_db(s, 0, "SELECT count(*) FROM payments WHERE status <> 'succeeded'");
  h_assert_db(s, 0, "SELECT count(*) FROM outbox");
  log = h_read_file(s->log, NULL);
  assert_non_null(log);
  assert_null(strstr(log, "\"aborted\":true"));
  assert_null(strstr(log, "cut off"));
  assert_non_null(strstr(log, "\"msg\":\"stopped\""));
  free(log);
}

/* ---- no arguments at all ---------------------------------------------- */

/* docs/idempotency.md, sections 5.3 and 6: `idemd` alone serves, with the
 * defaults, on SQLite in the current directory. The port comes from
 * IDEMD_LISTEN (an environment variable, not a flag) so the test does not
 * take 8080. */
static void test_no_arguments_serves(void **state) {
  char dir[] = "/tmp/idem-noargs-XXXXXX";
  char listen[64], db[300], log[300];
  h_server_t at = {0};
  int status = 0, up = 0, exited = 0;
  pid_t pid;
  h_resp_t r;
  (void)state;

  assert_non_null(mkdtemp(dir));
  {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    at.port = ntohs(a.sin_port);
    close(fd);
  }
  snprintf(listen, sizeof listen, "127.0.0.1:%d", at.port);
  snprintf(db, sizeof db, "%s/idem.db", dir);
  snprintf(log, sizeof log, "%s/idemd.log", dir);
  pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    char *const argv[] = {(char *)idemd_bin, NULL};
    char *env[] = {NULL, NULL, NULL, NULL};
    char e_listen[96], e_asan[512], e_ubsan[512];
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    const char *asan = getenv("ASAN_OPTIONS"), *ubsan = getenv("UBSAN_OPTIONS");
    int k = 0;
    if (fd < 0 || chdir(dir) != 0)
      _exit(126);
    dup2(fd, 1);
    dup2(fd, 2);
    snprintf(e_listen, sizeof e_listen, "IDEMD_LISTEN=%s", listen);
    env[k++] = e_listen;
    if (asan) {
      snprintf(e_asan, sizeof e_asan, "ASAN_OPTIONS=%s", asan);
      env[k++] = e_asan;
    }
    if (ubsan) {
      snprintf(e_ubsan, sizeof e_ubsan, "UBSAN_OPTIONS=%s", ubsan);
      env[k++] = e_ubsan;
    }
    execve(idemd_bin, argv, env);
    _exit(127);
  }
  for (int i = 0; i < 1000 && !up && !exited; i++) {
    h_get(&at, "/healthz", NULL, &r);
    up = r.status == 200;
    h_resp_free(&r);
    if (!up && waitpid(pid, &status, WNOHANG) == pid)
      exited = 1;
    if (!up && !exited) {
      struct timespec ts = {0, 10 * 1000000L};
      nanosleep(&ts, NULL);
    }
  }
  if (!exited) {
    kill(pid, SIGTERM);
    assert_int_equal(waitpid(pid, &status, 0), pid);
  }
  {
    char *text = h_read_file(log, NULL);
    char out[600], p[320];
    int made = access(db, F_OK) == 0;
    int clean = text == NULL || (strstr(text, "Sanitizer") == NULL &&
                                 strstr(text, "runtime error") == NULL);
    int ok = up && WIFEXITED(status) && WEXITSTATUS(status) == 0 && made && clean;
    snprintf(out, sizeof out, "%s", text ? text : "");
    free(text);
    unlink(db);
    snprintf(p, sizeof p, "%s-wal", db);
    unlink(p);
    snprintf(p, sizeof p, "%s-shm", db);
    unlink(p);
    snprintf(p, sizeof p, "%s-tenants", db);
    unlink(p);
    unlink(log);
    rmdir(dir);
    if (!ok)
      fail_msg("`idemd` with no arguments (IDEMD_LISTEN=%s) %s; exit status 0x%x; ./idem.db "
               "%s; output: %s",
               listen, up ? "served" : "never served", status, made ? "made" : "not made",
               out);
  }
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_log_lines_hide_keys, h_teardown),
      cmocka_unit_test_teardown(test_request_id, h_teardown),
      cmocka_unit_test_teardown(test_health_and_metrics, h_teardown),
      cmocka_unit_test_teardown(test_build_info, h_teardown),
      cmocka_unit_test_teardown(test_request_counters, h_teardown),
      cmocka_unit_test_teardown(test_client_leaves_before_answer, h_teardown),
      cmocka_unit_test_teardown(test_sigterm_lets_request_finish, h_teardown),
      cmocka_unit_test_teardown(test_sighup_ignored, h_teardown),
      cmocka_unit_test_teardown(test_sigterm_drains_load, h_teardown),
      cmocka_unit_test_teardown(test_sweeper_deletes_only_expired, h_teardown),
      cmocka_unit_test_teardown(test_tenant_rotate_disable_enable, h_teardown),
      cmocka_unit_test_teardown(test_tenant_keys, h_teardown),
      cmocka_unit_test_teardown(test_records_tools, h_teardown),
      cmocka_unit_test(test_no_arguments_serves),
  };
  int rc;
  h_init(argc, argv);
  idemd_bin = getenv("IDEM_TEST_IDEMD");
  if ((idemd_bin == NULL || idemd_bin[0] == '\0') && argc > 1)
    idemd_bin = argv[1];
  rc = cmocka_run_group_tests_name(
      "integration: logs, request ids, metrics, shutdown, retention, tenant and record tools",
      tests, NULL, NULL);
  curl_global_cleanup();
  return rc;
}
