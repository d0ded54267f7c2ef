/* A request's own provider call that would start after its lease
 * (docs/idempotency.md, section 2.8): the key is reserved, then the call
 * waits for a worker (held here with IDEM_HOLD_CALLS_FILE, as behind a
 * long queue) while the lease runs out. The record is then settled by the
 * reconciler, which takes it over and charges, or by an operator (`idemd
 * refunds resolve`), or by nobody. Released, the request sends nothing to
 * the provider and answers with what the record now says (its own pending
 * completion when nobody took it). Nothing asserts on time: each step
 * waits for the state the one before leaves (once, for the store's clock
 * to pass a lease). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "psp_harness.h"

#define PAYMENT "{\"amount\": 15990, \"currency\": \"BRL\"}"
#define RECORD_IN_STATE                                                                  \
  "SELECT count(*) FROM idempotency_records WHERE key = ?1 AND state = ?2"
#define RESOURCE_OF_KEY "SELECT resource_id FROM idempotency_records WHERE key = ?1"

/* A POST from another thread: its answer comes once the hold is lifted. */
struct bg {
  h_server_t *s;
  const char *tok, *key, *body, *path;
  h_resp_t resp;
  pthread_t thread;
};

static void *bg_main(void *arg) {
  struct bg *b = arg;
  h_post(b->s, b->path, b->tok, b->key, b->body, &b->resp);
  return NULL;
}

/* The hold file, in the test's temp dir, and idemd started with it named
 * in IDEM_HOLD_CALLS_FILE (absent: calls go at once). */
static h_server_t *start_idemd(p_psp_t *p, const char *reconcile, char *hold,
                               size_t cap) {
  const char *flags[] = {"--provider", p->url,   "--provider-timeout",   "1s",
                         "--lease",    "1500ms", "--reconcile-interval", reconcile,
                         NULL};
  h_server_t *s;

  snprintf(hold, cap, "%s/hold", p->dir);
  assert_int_equal(setenv("IDEM_HOLD_CALLS_FILE", hold, 1), 0);
  s = h_server_start(flags);
  unsetenv("IDEM_HOLD_CALLS_FILE");
  return s;
}

static void hold(const char *path) {
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fclose(f);
}

/* Waits until the record of `key` is in `state`; fails after timeout_ms. */
static void wait_record(h_server_t *s, const char *key, const char *state,
                        int timeout_ms) {
  if (!h_db_wait(s, timeout_ms, RECORD_IN_STATE, key, state))
    fail_msg("the record of key '%s' did not become '%s' within %d ms", key, state,
             timeout_ms);
}

/* A payment reserved, its call held; its lease runs out, the reconciler
 * takes it over, charges and settles it. Released, the request sends
 * nothing (one charge request at the provider, the reconciler's) and
 * answers the settled payment, 201. */
static void test_payment_taken_over_while_held(void **state) {
  p_psp_t *p = p_start(NULL);
  char path[300];
  h_server_t *s = start_idemd(p, "100ms", path, sizeof path);
  struct bg b = {.s = s, .key = "late-1", .body = PAYMENT, .path = "/payments"};
  json_t *stats;
  char *id;
  (void)state;

  b.tok = h_tenant(s, "acme");
  hold(path);
  assert_int_equal(pthread_create(&b.thread, NULL, bg_main, &b), 0);
  wait_record(s, "late-1", "processing", 10000);
  id = h_db_text(s, RESOURCE_OF_KEY, "late-1");
  assert_non_null(id);
  /* The reconciler took the record over once its lease ran out, and
   * settled it. */
  wait_record(s, "late-1", "completed", 20000);
  h_assert_db(
      s, 1,
      "SELECT count(*) FROM audit WHERE resource_id = ?1 AND actor = 'reconciler' "
      "AND from_status = 'pending' AND to_status = 'pending'",
      id);
  assert_int_equal(unlink(path), 0);
  pthread_join(b.thread, NULL);

  h_assert_status(&b.resp, 201);
  assert_string_equal(h_id(&b.resp), id);
  assert_string_equal(json_string_value(json_object_get(b.resp.json, "status")),
                      "succeeded");
  h_resp_free(&b.resp);
  h_assert_db(s, 1, "SELECT count(*) FROM payments");
  stats = p_stats(p);
  assert_int_equal(p_key(stats, id, "requests"), 1);
  assert_int_equal(p_key(stats, id, "charges"), 1);
  json_decref(stats);
  free(id);
  h_server_stop(s);
  p_stop(p);
}

/* The store's clock, in ms since the epoch (SQLite's to the second, which
 * only makes a wait on it longer). */
static const char *db_now_ms(void) {
  return h_store_is_pg() ? "CAST(extract(epoch FROM clock_timestamp()) * 1000 AS BIGINT)"
                         : "CAST(strftime('%s', 'now') AS INTEGER) * 1000";
}

/* A payment reserved, its call held until its lease would end before the
 * call's 1 s, with no reconciler running to take it over. Released, the
 * request sends nothing, still holds its record and completes it as
 * pending: 202, the payment pending, its outbox row left for the
 * reconciler. */
static void test_payment_own_lease_too_short(void **state) {
  p_psp_t *p = p_start(NULL);
  char path[300], sql[400];
  h_server_t *s = start_idemd(p, "1h", path, sizeof path);
  struct bg b = {.s = s, .key = "late-2", .body = PAYMENT, .path = "/payments"};
  json_t *stats;
  char *id;
  (void)state;

  b.tok = h_tenant(s, "acme");
  hold(path);
  assert_int_equal(pthread_create(&b.thread, NULL, bg_main, &b), 0);
  wait_record(s, "late-2", "processing", 10000);
  id = h_db_text(s, RESOURCE_OF_KEY, "late-2");
  assert_non_null(id);
  /* Held until a call of --provider-timeout (1 s) would end after the
   * lease, by the store's clock. */
  snprintf(sql, sizeof sql,
           "SELECT count(*) FROM idempotency_records WHERE key = ?1 AND "
           "lease_expires_at - 1000 < %s",
           db_now_ms());
  if (!h_db_wait(s, 10000, sql, "late-2"))
    fail_msg("the lease of late-2 did not run short");
  assert_int_equal(unlink(path), 0);
  pthread_join(b.thread, NULL);

  h_assert_status(&b.resp, 202);
  assert_string_equal(h_id(&b.resp), id);
  assert_string_equal(json_string_value(json_object_get(b.resp.json, "status")),
                      "pending");
  h_resp_free(&b.resp);
  h_assert_db(s, 1, RECORD_IN_STATE, "late-2", "pending");
  h_assert_db(s, 1, "SELECT count(*) FROM outbox WHERE resource_id = ?1", id);
  stats = p_stats(p);
  assert_int_equal(p_key(stats, id, "requests"), 0);
  json_decref(stats);
  free(id);
  h_server_stop(s);
  p_stop(p);
}

/* A refund reserved, its call held; once its lease ran out an operator
 * resolves it as declined. Released, the request sends nothing (no refund
 * request at the provider) and answers the resolved refund, 402. */
static void test_refund_resolved_while_held(void **state) {
  p_psp_t *p = p_start(NULL);
  char path[300], refunds[128];
  h_server_t *s = start_idemd(p, "1h", path, sizeof path);
  struct bg b = {.s = s, .key = "late-re", .body = "{\"amount\": 5000}"};
  const char *args[] = {"refunds",  "resolve", NULL,         "--as", "declined",
                        "--reason", "checked", "--operator", "ops",  NULL};
  json_t *stats;
  char *id, *out = NULL;
  h_resp_t r;
  int rc = 1;
  (void)state;

  b.tok = h_tenant(s, "acme");
  h_post(s, "/payments", b.tok, "late-pay", PAYMENT, &r);
  h_assert_status(&r, 201);
  snprintf(refunds, sizeof refunds, "/payments/%s/refunds", h_id(&r));
  h_resp_free(&r);
  b.path = refunds;
  hold(path);
  assert_int_equal(pthread_create(&b.thread, NULL, bg_main, &b), 0);
  wait_record(s, "late-re", "processing", 10000);
  id = h_db_text(s, RESOURCE_OF_KEY, "late-re");
  assert_non_null(id);
  args[2] = id;
  /* Refused (exit 1) while the request's lease holds the record. */
  for (int i = 0; i < 200 && rc != 0; i++) {
    free(out);
    out = NULL;
    if ((rc = h_cli(s, args, &out)) != 0)
      p_nap_ms(50);
  }
  free(out);
  assert_int_equal(rc, 0);
  assert_int_equal(unlink(path), 0);
  pthread_join(b.thread, NULL);

  h_assert_status(&b.resp, 402);
  assert_string_equal(h_id(&b.resp), id);
  assert_string_equal(json_string_value(json_object_get(b.resp.json, "status")),
                      "declined");
  h_resp_free(&b.resp);
  stats = p_stats(p);
  assert_int_equal(p_total(stats, "refund_requests"), 0);
  json_decref(stats);
  free(id);
  h_server_stop(s);
  p_stop(p);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_payment_taken_over_while_held, p_teardown),
      cmocka_unit_test_teardown(test_payment_own_lease_too_short, p_teardown),
      cmocka_unit_test_teardown(test_refund_resolved_while_held, p_teardown),
  };
  int rc;
  h_init(argc, argv);
  p_init(argc, argv);
  rc = cmocka_run_group_tests_name("integration: late calls", tests, NULL, NULL);
  curl_global_cleanup();
  return rc;
}
