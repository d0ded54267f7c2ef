/* Operations (SPEC sections 5 and 6): one JSON log line per request with an
 * HMAC key id and never the raw key, X-Request-Id echoed or generated,
 * /healthz and /metrics, and SIGTERM letting a request in flight finish. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

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

/* The value of an unlabelled metric line "name value", or -1 if absent. */
static double metric(const char *text, const char *name) {
  size_t n = strlen(name);
  for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
    if (strncmp(p, name, n) == 0 && p[n] == ' ')
      return strtod(p + n + 1, NULL);
  return -1;
}

/* /healthz and /metrics answer without credentials; the metrics of SPEC
 * section 5 are there and count what happened. */
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
  assert_true(metric(r.body, "idem_records_pending") == 1);
  assert_true(metric(r.body, "idem_oldest_pending_seconds") >= 0);
  assert_true(metric(r.body, "idem_store_errors_total") == 0);
  assert_true(metric(r.body, "idem_request_duration_seconds_count") >= 3);
  assert_true(
      metric(r.body,
             "idem_requests_total{operation=\"create_payment\",outcome=\"new\"}") == 1);
  assert_true(
      metric(r.body,
             "idem_requests_total{operation=\"create_payment\",outcome=\"replay\"}") ==
      1);
  assert_true(
      metric(r.body,
             "idem_requests_total{operation=\"create_payment\",outcome=\"pending\"}") ==
      1);
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

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_log_lines_hide_keys, h_teardown),
      cmocka_unit_test_teardown(test_request_id, h_teardown),
      cmocka_unit_test_teardown(test_health_and_metrics, h_teardown),
      cmocka_unit_test_teardown(test_sigterm_lets_request_finish, h_teardown),
  };
  int rc;
  h_init(argc, argv);
  rc = cmocka_run_group_tests_name("integration: logs, request ids, metrics, shutdown",
                                   tests, NULL, NULL);
  curl_global_cleanup();
  return rc;
}
