/* idemd's /metrics through Prometheus' own checker: `promtool check
 * metrics` (Debian's prometheus package, scripts/deps.sh) finds no problem
 * in the text, after requests of every kind have filled its series.
 * Exits 77 (skipped, see CMakeLists.txt) when promtool is not installed
 * (IDEM_TEST_PROMTOOL names it, else it is looked for on PATH). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

#define PAYMENT "{\"amount\": 15990, \"currency\": \"BRL\", \"order_id\": \"ord_42\"}"

static char promtool[512];

/* promtool's path into `promtool`; 0 when found. */
static int find_promtool(void) {
  const char *env = getenv("IDEM_TEST_PROMTOOL"), *path = getenv("PATH");
  if (env && env[0]) {
    snprintf(promtool, sizeof promtool, "%s", env);
    return access(promtool, X_OK);
  }
  for (const char *p = path; p && *p;) {
    size_t n = strcspn(p, ":");
    snprintf(promtool, sizeof promtool, "%.*s/promtool", (int)n, n ? p : ".");
    if (access(promtool, X_OK) == 0)
      return 0;
    p += n + (p[n] == ':');
  }
  return -1;
}

/* Runs `promtool check metrics` on `text`; returns its exit status, its
 * output (stdout and stderr) in `out` (malloc'd). */
static int check_metrics(h_server_t *s, const char *text, char **out) {
  char in[400], res[400], cmd[1400];
  FILE *f;
  int status;

  snprintf(in, sizeof in, "%s/metrics.txt", s->dir);
  snprintf(res, sizeof res, "%s/promtool.out", s->dir);
  f = fopen(in, "w");
  assert_non_null(f);
  assert_int_equal(fputs(text, f) >= 0, 1);
  assert_int_equal(fclose(f), 0);
  snprintf(cmd, sizeof cmd, "'%s' check metrics <'%s' >'%s' 2>&1", promtool, in, res);
  status = system(cmd);
  *out = h_read_file(res, NULL);
  assert_non_null(*out);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void test_promtool_clean(void **state) {
  static const char *const flags[] = {"--sandbox-uncertain-amount", "7070", NULL};
  h_server_t *s = h_server_start(flags);
  const char *tok = h_tenant(s, "acme");
  char path[96], *out;
  h_resp_t r;
  int rc;
  (void)state;

  /* new, replay, mismatch, pending, a read, 401, 404 */
  h_post(s, "/payments", tok, "p-1", PAYMENT, &r);
  h_assert_first(&r, 201);
  snprintf(path, sizeof path, "/payments/%s", h_id(&r));
  h_resp_free(&r);
  h_post(s, "/payments", tok, "p-1", PAYMENT, &r);
  h_assert_status(&r, 201);
  h_resp_free(&r);
  h_post(s, "/payments", tok, "p-1", "{\"amount\": 1}", &r);
  h_assert_status(&r, 422);
  h_resp_free(&r);
  h_post(s, "/payments", tok, "p-2", "{\"amount\": 7070}", &r);
  h_assert_first(&r, 202);
  h_resp_free(&r);
  h_get(s, path, tok, &r);
  h_assert_status(&r, 200);
  h_resp_free(&r);
  h_post(s, "/payments", "wrong", "p-3", PAYMENT, &r);
  h_assert_status(&r, 401);
  h_resp_free(&r);
  h_get(s, "/nowhere", NULL, &r);
  h_assert_status(&r, 404);
  h_resp_free(&r);

  h_get(s, "/metrics", NULL, &r);
  h_assert_status(&r, 200);
  assert_non_null(strstr(r.body, "\nidem_build_info{"));
  assert_non_null(strstr(r.body, "\nprocess_open_fds "));
  rc = check_metrics(s, r.body, &out);
  if (rc != 0 || out[0] != '\0')
    fail_msg("promtool check metrics: exit %d: %s", rc, out);
  free(out);
  h_resp_free(&r);

  /* The checker does find problems: a counter without _total, and a
   * metric without its TYPE. */
  rc = check_metrics(s, "# HELP idem_things Things.\n# TYPE idem_things counter\n"
                        "idem_things 1\nuntyped_thing 2\n",
                     &out);
  if (rc == 0)
    fail_msg("promtool check metrics passed a counter without _total: %s", out);
  free(out);
  h_server_stop(s);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_promtool_clean, h_teardown),
  };
  int rc;
  h_init(argc, argv);
  if (find_promtool() != 0) {
    fprintf(stderr, "promtool not found (Debian's prometheus package): skipped\n");
    curl_global_cleanup();
    return 77;
  }
  rc = cmocka_run_group_tests_name("integration: /metrics through promtool check metrics",
                                   tests, NULL, NULL);
  curl_global_cleanup();
  return rc;
}
