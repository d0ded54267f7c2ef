/* idem-psp's own events, end to end (docs/payments.md, "Webhooks";
 * tools/psp/README.md, "Webhooks"): idem-psp --webhook-url pointing at
 * idemd's POST /webhooks/provider, with the shared secret, sending every
 * event twice (--webhook-duplicates 1), and charging before it drops each
 * answer (--drop-after). idemd runs no reconciler pass during the test, so
 * only the provider's events can settle what its lost answers left
 * pending: payments (succeeded and declined) and a refund, each once, the
 * duplicates answered and changing nothing. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "psp_harness.h"

#define SECRET "whsec_e2e_51c0"
#define WAIT_MS 20000

/* The lines of idem-psp's log that have both `a` and `b`. */
static int psp_log_lines(const p_psp_t *p, const char *a, const char *b) {
  size_t len;
  char *text = h_read_file(p->log, &len), *line, *save = NULL;
  int n = 0;
  for (line = text ? strtok_r(text, "\n", &save) : NULL; line;
       line = strtok_r(NULL, "\n", &save))
    n += strstr(line, a) != NULL && strstr(line, b) != NULL;
  free(text);
  return n;
}

/* Waits until idem-psp logged `n` deliveries its receiver took (2xx). */
static void wait_delivered(const p_psp_t *p, int n) {
  double deadline = h_now() + WAIT_MS / 1000.0;
  while (psp_log_lines(p, "\"event\":\"webhook\"", "\"status\":200,") < n) {
    if (h_now() > deadline)
      fail_msg("%d deliveries taken, want %d",
               psp_log_lines(p, "\"event\":\"webhook\"", "\"status\":200,"), n);
    p_nap_ms(20);
  }
}

/* POST `path`: a first answer, 202 pending; returns the id (malloc'd). */
static char *post_pending(h_server_t *s, const char *tok, const char *path,
                          const char *key, const char *body) {
  h_resp_t r;
  char *id;
  h_post(s, path, tok, key, body, &r);
  h_assert_first(&r, 202);
  id = strdup(h_id(&r));
  h_resp_free(&r);
  return id;
}

static void wait_status(h_server_t *s, const char *table, const char *id,
                        const char *status) {
  char sql[128];
  snprintf(sql, sizeof sql, "SELECT count(*) FROM %s WHERE id = ?1 AND status = ?2",
           table);
  if (!h_db_wait(s, WAIT_MS, sql, id, status))
    fail_msg("%s %s did not become %s within %d ms (no reconciler pass ran)", table, id,
             status, WAIT_MS);
}

static void test_events_settle_pending(void **state) {
  p_psp_t *p = p_start(NULL);
  const char *idemd_flags[] = {"--provider",
                               p->url,
                               "--reconcile-interval",
                               "1h",
                               "--provider-webhook-secret",
                               SECRET,
                               NULL};
  char url[96], path[96];
  h_server_t *s;
  const char *tok;
  char *paid, *declined, *refund;
  h_resp_t r;
  (void)state;

  /* idemd first, for its port; then the provider again, on its own port,
   * sending its events there. */
  s = h_server_start(idemd_flags);
  tok = h_tenant(s, "acme");
  snprintf(url, sizeof url, "http://127.0.0.1:%d/webhooks/provider", s->port);
  {
    const char *psp_flags[] = {"--drop-after",       "--decline-amount",
                               "4040",               "--webhook-url",
                               url,                  "--webhook-secret",
                               SECRET,               "--webhook-duplicates",
                               "1",                  NULL};
    p_stop(p);
    p_restart(p, psp_flags);
  }

  paid = post_pending(s, tok, "/payments", "e2e-pay", "{\"amount\": 5000}");
  declined = post_pending(s, tok, "/payments", "e2e-declined", "{\"amount\": 4040}");
  wait_status(s, "payments", paid, "succeeded");
  wait_status(s, "payments", declined, "declined");
  h_post(s, "/payments", tok, "e2e-declined", "{\"amount\": 4040}", &r);
  h_assert_status(&r, 402);
  assert_string_equal(r.replayed, "true");
  h_resp_free(&r);

  snprintf(path, sizeof path, "/payments/%s/refunds", paid);
  refund = post_pending(s, tok, path, "e2e-refund", "{\"amount\": 2000}");
  wait_status(s, "refunds", refund, "succeeded");
  h_post(s, path, tok, "e2e-refund", "{\"amount\": 2000}", &r);
  h_assert_status(&r, 201);
  assert_string_equal(r.replayed, "true");
  h_resp_free(&r);
  h_post(s, "/payments", tok, "e2e-pay", "{\"amount\": 5000}", &r);
  h_assert_status(&r, 201);
  assert_string_equal(r.replayed, "true");
  h_resp_free(&r);
  snprintf(path, sizeof path, "/payments/%s", paid);
  h_get(s, path, tok, &r);
  h_assert_status(&r, 200);
  assert_int_equal(json_integer_value(json_object_get(r.json, "amount_refunded")), 2000);
  h_resp_free(&r);

  /* Three events, each delivered twice and each delivery taken once
   * (after a 503 while idemd was still at the provider, sent again): one
   * applied, one a duplicate. */
  wait_delivered(p, 6);
  assert_int_equal(psp_log_lines(p, "\"event\":\"webhook\"", "\"status\":200,"), 6);
  h_assert_db(s, 3, "SELECT count(*) FROM processed_events");
  h_assert_db(s, 0,
              "SELECT count(*) FROM idempotency_records WHERE state IN ('processing', "
              "'pending')");
  free(paid);
  free(declined);
  free(refund);
  h_server_stop(s);
  p_stop(p);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_events_settle_pending, p_teardown),
  };
  int rc;
  h_init(argc, argv);
  p_init(argc, argv);
  rc = cmocka_run_group_tests_name("integration: idem-psp's events", tests, NULL, NULL);
  curl_global_cleanup();
  return rc;
}
