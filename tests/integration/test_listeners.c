/* The metrics listener (docs/operations.md, "Metrics listener"):
 * --metrics-listen serves GET /metrics, /healthz and /readyz on an address
 * of its own and counts what the public listener does; the public
 * listener then answers /metrics 404 as an unknown path (and 200 without
 * the flag); a bad or taken address is a start-up error; idemd stops
 * cleanly with connections open on both. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

static const char *idemd_bin;

#define PAYMENT "{\"amount\": 15990, \"currency\": \"BRL\", \"order_id\": \"ord_42\"}"
#define NEW_PAYMENTS "idem_requests_total{operation=\"create_payment\",outcome=\"new\"}"
#define OTHER_INVALID "idem_requests_total{operation=\"other\",outcome=\"invalid\"}"

static void nap_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* A stand-in for `s` whose port is its metrics listener's, read from its
 * "listening" line (started with --metrics-listen 127.0.0.1:0). Fails. */
static h_server_t metrics_side(h_server_t *s) {
  h_server_t m = {0};
  char *log = h_read_file(s->log, NULL);
  const char *at = log ? strstr(log, "\"metrics_listen\":\"127.0.0.1:") : NULL;
  if (at == NULL)
    fail_msg("no metrics_listen in the listening line of %s", s->log);
  m.port = atoi(at + strlen("\"metrics_listen\":\"127.0.0.1:"));
  free(log);
  assert_true(m.port > 0 && m.port != s->port);
  return m;
}

/* Reads GET /metrics on `m` until `name` reaches `want`, at most 5 s (a
 * request is counted once its answer is out). Fails. */
static void await_metric(h_server_t *m, const char *name, double want) {
  double seen = -1;
  for (double deadline = h_now() + 5; h_now() < deadline; nap_ms(10)) {
    h_resp_t r;
    h_get(m, "/metrics", NULL, &r);
    h_assert_status(&r, 200);
    seen = h_metric(r.body, name);
    h_resp_free(&r);
    if (seen == want)
      return;
  }
  fail_msg("%s is %g on the metrics listener, want %g", name, seen, want);
}

static void test_metrics_on_their_own_listener(void **state) {
  static const char *const flags[] = {"--metrics-listen", "127.0.0.1:0", NULL};
  h_server_t *s = h_server_start(flags);
  h_server_t m = metrics_side(s);
  const char *tok = h_tenant(s, "acme");
  CURL *keep = curl_easy_init();
  h_resp_t r;
  (void)state;

  assert_non_null(keep);
  h_post(s, "/payments", tok, "l-1", PAYMENT, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);
  await_metric(&m, NEW_PAYMENTS, 1);

  /* The Prometheus text, as on the public listener without the flag. */
  h_get(&m, "/metrics", NULL, &r);
  h_assert_status(&r, 200);
  assert_int_equal(strncmp(r.content_type, "text/plain", 10), 0);
  assert_non_null(strstr(r.body, "\n# TYPE idem_request_duration_seconds histogram\n"));
  assert_true(
      h_metric(r.body,
               "idem_request_duration_seconds_count{operation=\"create_payment\"}") == 1);
  h_resp_free(&r);
  {
    h_req_t q = {.method = "HEAD", .path = "/metrics"};
    h_http(&m, &q, &r);
    h_assert_status(&r, 200);
    h_resp_free(&r);
  }
  /* The probes are there too; nothing else is. */
  h_get(&m, "/healthz", NULL, &r);
  h_assert_status(&r, 200);
  h_resp_free(&r);
  h_get(&m, "/readyz", NULL, &r);
  h_assert_status(&r, 200);
  h_resp_free(&r);
  h_post(&m, "/payments", tok, "l-2", PAYMENT, &r);
  h_assert_error(&r, 404, "not found");
  h_resp_free(&r);
  h_get(&m, "/payments/pay_x", tok, &r);
  h_assert_error(&r, 404, "not found");
  h_resp_free(&r);
  h_assert_db(s, 1, "SELECT COUNT(*) FROM payments");

  /* The public listener: /metrics is an unknown path, counted as one (the
   * two 404s above, and this one); the probes stay. */
  h_get(s, "/metrics", NULL, &r);
  h_assert_error(&r, 404, "not found");
  h_resp_free(&r);
  await_metric(&m, OTHER_INVALID, 3);
  h_get(s, "/healthz", NULL, &r);
  h_assert_status(&r, 200);
  h_resp_free(&r);
  h_get(s, "/readyz", NULL, &r);
  h_assert_status(&r, 200);
  h_resp_free(&r);

  /* idemd stops cleanly (exit 0, no sanitizer report) with a kept-alive
   * connection open on the metrics listener. */
  {
    h_req_t q = {.path = "/metrics"};
    h_http_on(keep, &m, &q, &r);
    h_assert_status(&r, 200);
    h_resp_free(&r);
  }
  h_server_stop(s);
  curl_easy_cleanup(keep);
}

/* Without the flag, /metrics stays on the one listener. */
static void test_metrics_on_public_listener_by_default(void **state) {
  h_server_t *s = h_server_start(NULL);
  char *log = h_read_file(s->log, NULL);
  h_resp_t r;
  (void)state;

  assert_non_null(log);
  assert_null(strstr(log, "\"metrics_listen\""));
  free(log);
  h_get(s, "/metrics", NULL, &r);
  h_assert_status(&r, 200);
  assert_true(h_metric(r.body, NEW_PAYMENTS) == 0);
  h_resp_free(&r);
  h_server_stop(s);
}

/* Runs `idemd serve` on a database in `dir` with --listen on a free port
 * and `flag` `value`; returns its exit status (-1 if it still serves
 * after 10 s, then killed) and its output in `out` (malloc'd). */
static int serve_status(const char *dir, const char *flag, const char *value,
                        char **out) {
  char db[300], log[300], listen[64], why[256];
  char *argv[] = {(char *)idemd_bin, "serve",       "--db", db, "--listen", listen,
                  (char *)flag,      (char *)value, NULL};
  int status = 0;
  pid_t pid;

  snprintf(db, sizeof db, "%s/idem.db", dir);
  snprintf(log, sizeof log, "%s/idemd.log", dir);
  snprintf(listen, sizeof listen, "127.0.0.1:%d", h_free_port());
  unlink(log);
  if ((pid = h_spawn_logged(argv, log, "IDEMD_", why, sizeof why)) < 0)
    fail_msg("cannot start idemd: %s", why);
  for (double deadline = h_now() + 10;; nap_ms(10)) {
    pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid)
      break;
    if (h_now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      status = -1;
      break;
    }
  }
  *out = h_read_file(log, NULL);
  assert_non_null(*out);
  return status >= 0 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* A bad or unusable --metrics-listen is a start-up error: a usage error
 * (2) when it is not HOST:PORT or is --listen's own address, a failure
 * (1) naming the flag when it cannot be bound or resolved. */
static void test_bad_metrics_address(void **state) {
  char dir[] = "/tmp/idem-listeners-XXXXXX";
  struct sockaddr_in a = {.sin_family = AF_INET,
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t alen = sizeof a;
  char taken[64], *out = NULL;
  int fd, rc;
  (void)state;

  assert_non_null(mkdtemp(dir));
  /* A port this test holds, listening. */
  fd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  assert_int_equal(listen(fd, 1), 0);
  assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &alen), 0);
  snprintf(taken, sizeof taken, "127.0.0.1:%d", ntohs(a.sin_port));

  static const struct {
    const char *value;
    int status;
    const char *message;
  } cases[] = {
      {"9100", 2, "invalid value for --metrics-listen: '9100'"},
      {"127.0.0.1:", 2, "invalid value for --metrics-listen"},
      {"127.0.0.1:65536", 2, "invalid value for --metrics-listen"},
      {"", 2, "invalid value for --metrics-listen"},
      {NULL /* the port held above */, 1,
       "--metrics-listen: cannot listen on 127.0.0.1:"},
      {"192.0.2.1:9100" /* TEST-NET-1: not this host's */, 1,
       "--metrics-listen: cannot listen on 192.0.2.1:9100"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    const char *v = cases[i].value ? cases[i].value : taken;
    h_context("--metrics-listen '%s'", v);
    rc = serve_status(dir, "--metrics-listen", v, &out);
    if (rc != cases[i].status || strstr(out, cases[i].message) == NULL)
      fail_msg("--metrics-listen '%s': exit %d, want %d with '%s'; said: %.400s", v, rc,
               cases[i].status, cases[i].message, out);
    assert_null(strstr(out, "\"msg\":\"listening\""));
    free(out);
  }
  h_context_clear();
  close(fd);
  {
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
  }
}

/* The same address as --listen is refused before anything starts. */
static void test_metrics_address_of_listen(void **state) {
  char dir[] = "/tmp/idem-listeners-XXXXXX";
  char db[300], log[300], why[256], *out;
  char *argv[] = {
      (char *)idemd_bin,  "serve",          "--db", db, "--listen", "127.0.0.1:8099",
      "--metrics-listen", "127.0.0.1:8099", NULL};
  int status = 0;
  pid_t pid;
  (void)state;

  assert_non_null(mkdtemp(dir));
  snprintf(db, sizeof db, "%s/idem.db", dir);
  snprintf(log, sizeof log, "%s/idemd.log", dir);
  pid = h_spawn_logged(argv, log, "IDEMD_", why, sizeof why);
  assert_true(pid > 0);
  assert_int_equal(waitpid(pid, &status, 0), pid);
  out = h_read_file(log, NULL);
  assert_non_null(out);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 2 ||
      strstr(out, "--metrics-listen must differ from --listen") == NULL)
    fail_msg("status 0x%x; said: %.400s", status, out);
  free(out);
  unlink(log);
  unlink(db);
  rmdir(dir);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_metrics_on_their_own_listener, h_teardown),
      cmocka_unit_test_teardown(test_metrics_on_public_listener_by_default, h_teardown),
      cmocka_unit_test_teardown(test_bad_metrics_address, h_teardown),
      cmocka_unit_test_teardown(test_metrics_address_of_listen, h_teardown),
  };
  int failed;

  h_init(argc, argv);
  idemd_bin = getenv("IDEM_TEST_IDEMD");
  if ((idemd_bin == NULL || idemd_bin[0] == '\0') && argc > 1)
    idemd_bin = argv[1];
  assert_non_null(idemd_bin);
  failed =
      cmocka_run_group_tests_name("integration: the metrics listener", tests, NULL, NULL);
  curl_global_cleanup();
  return failed ? 1 : 0;
}
