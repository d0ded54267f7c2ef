/* Payments and refunds through a provider that ignores idempotency keys
 * (docs/payments.md, "Providers that ignore idempotency keys"): idem-psp
 * --ignore-idempotency-key, where every POST charges anew, behind idemd
 * --provider-idempotency off, which looks a payment or refund up by its
 * merchant reference (its id) before any second send, and sends again
 * only when that shows none. Faults after the charge leave payments
 * pending, idemd is killed at the provider, the provider disappears; in
 * the end every payment and refund is settled and made exactly once, by
 * the provider's own count per reference. The last test shows why the
 * flag exists: with it on, the same provider charges twice. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "psp_harness.h"

#define WAIT_MS 20000
#define DECLINE_AMOUNT 4040
#define PAY_ID_OF_KEY "SELECT resource_id FROM idempotency_records WHERE key = ?1"
#define NOTHING_OPEN                                                                     \
  "SELECT CASE WHEN count(*) = 0 THEN 1 ELSE 0 END FROM idempotency_records "            \
  "WHERE state IN ('processing', 'pending')"

/* idemd's flags: this provider, keys off, short bounds so that the
 * reconciler comes by often; `extra` (NULL-terminated, may be NULL)
 * after them. */
static void keyless_flags(const p_psp_t *p, const char *const *extra, const char **out,
                          int cap) {
  const char *base[] = {"--provider",
                        p->url,
                        "--provider-idempotency",
                        "off",
                        "--provider-timeout",
                        "500ms",
                        "--lease",
                        "2s",
                        "--reconcile-interval",
                        "200ms"};
  int n = 0;
  for (size_t i = 0; i < sizeof base / sizeof *base; i++)
    out[n++] = base[i];
  for (int i = 0; extra && extra[i]; i++) {
    assert_true(n < cap - 1);
    out[n++] = extra[i];
  }
  out[n] = NULL;
}

/* psp flags: --ignore-idempotency-key and `fault` (may be NULL). */
static p_psp_t *keyless_psp(const char *const *fault) {
  const char *flags[8] = {"--ignore-idempotency-key", "--decline-amount", "4040"};
  int n = 3;
  for (int i = 0; fault && fault[i]; i++)
    flags[n++] = fault[i];
  flags[n] = NULL;
  return p_start(flags);
}

/* stats[table][reference][field]; 0 when the reference is absent. */
static int64_t made(const json_t *stats, const char *table, const char *reference,
                    const char *field) {
  json_t *r = json_object_get(json_object_get(stats, table), reference);
  return r ? json_integer_value(json_object_get(r, field)) : 0;
}

/* The provider made exactly `charges` and `declines` under `reference`
 * (a payment's id) or, with `refund`, `charges` refunds and `declines`
 * declined ones; and was sent `requests` POSTs for it. */
static void assert_made(p_psp_t *p, const char *reference, int refund, int64_t charges,
                        int64_t declines, int64_t requests) {
  json_t *stats = p_stats(p);
  const char *table = refund ? "refund_references" : "references";
  int64_t c = made(stats, table, reference, refund ? "refunds" : "charges");
  int64_t d = made(stats, table, reference, "declines");
  json_t *k =
      json_object_get(json_object_get(stats, refund ? "refund_keys" : "keys"), reference);
  int64_t req = json_integer_value(json_object_get(k, "requests"));
  json_decref(stats);
  if (c != charges || d != declines || req != requests)
    fail_msg("provider, %s %s: %lld made, %lld declined, %lld requests; want %lld, "
             "%lld and %lld",
             refund ? "refund" : "payment", reference, (long long)c, (long long)d,
             (long long)req, (long long)charges, (long long)declines,
             (long long)requests);
}

/* POST `path` under `key`: the first answer, 202 pending; returns the id
 * (malloc'd). */
static char *post_pending(h_server_t *s, const char *tok, const char *path,
                          const char *key, const char *body) {
  h_resp_t r;
  char *id;
  h_post(s, path, tok, key, body, &r);
  h_assert_first(&r, 202);
  assert_string_equal(json_string_value(json_object_get(r.json, "status")), "pending");
  id = strdup(h_id(&r));
  h_resp_free(&r);
  return id;
}

/* Waits until the payment (or refund) `id` is `status`. */
static void wait_status(h_server_t *s, const char *table, const char *id,
                        const char *status) {
  char sql[128];
  snprintf(sql, sizeof sql, "SELECT count(*) FROM %s WHERE id = ?1 AND status = ?2",
           table);
  if (!h_db_wait(s, WAIT_MS, sql, id, status))
    fail_msg("%s %s did not become %s within %d ms", table, id, status, WAIT_MS);
}

/* The same POST again: the stored answer, `status`, replayed. */
static void assert_replayed(h_server_t *s, const char *tok, const char *path,
                            const char *key, const char *body, long status,
                            const char *id) {
  h_resp_t r;
  h_post(s, path, tok, key, body, &r);
  h_assert_status(&r, status);
  assert_string_equal(r.replayed, "true");
  assert_string_equal(h_id(&r), id);
  h_resp_free(&r);
}

/* Nothing left processing or pending, nothing in the outbox. */
static void assert_all_settled(h_server_t *s) {
  if (!h_db_wait(s, WAIT_MS, NOTHING_OPEN))
    fail_msg("records still processing or pending");
  h_assert_db(s, 0, "SELECT count(*) FROM outbox");
}

/* Every POST the provider gets is made and then answered badly (or not at
 * all, or late): each payment and refund is pending, then found by its
 * reference and settled, one POST each, never sent again. */
static void run_fault(const char *const *fault) {
  p_psp_t *p = keyless_psp(fault);
  const char *flags[16];
  const int amounts[] = {1000, 2000, DECLINE_AMOUNT};
  enum { N = sizeof amounts / sizeof *amounts };
  char key[32], body[64], path[96], *pay[N], *re[N];
  h_server_t *s;
  const char *tok;

  h_context("idem-psp fault %s", fault[0]);
  keyless_flags(p, NULL, flags, 16);
  s = h_server_start(flags);
  tok = h_tenant(s, "acme");
  for (int i = 0; i < N; i++) {
    snprintf(key, sizeof key, "pay-%d", i);
    snprintf(body, sizeof body, "{\"amount\": %d}", amounts[i]);
    pay[i] = post_pending(s, tok, "/payments", key, body);
  }
  for (int i = 0; i < N; i++) {
    int declined = amounts[i] == DECLINE_AMOUNT;
    snprintf(key, sizeof key, "pay-%d", i);
    snprintf(body, sizeof body, "{\"amount\": %d}", amounts[i]);
    wait_status(s, "payments", pay[i], declined ? "declined" : "succeeded");
    assert_replayed(s, tok, "/payments", key, body, declined ? 402 : 201, pay[i]);
    assert_made(p, pay[i], 0, !declined, declined, 1);
  }
  /* Half of each succeeded payment refunded, through the same faults. */
  for (int i = 0; i < N - 1; i++) {
    snprintf(key, sizeof key, "refund-%d", i);
    snprintf(body, sizeof body, "{\"amount\": %d}", amounts[i] / 2);
    snprintf(path, sizeof path, "/payments/%s/refunds", pay[i]);
    re[i] = post_pending(s, tok, path, key, body);
  }
  for (int i = 0; i < N - 1; i++) {
    snprintf(key, sizeof key, "refund-%d", i);
    snprintf(body, sizeof body, "{\"amount\": %d}", amounts[i] / 2);
    snprintf(path, sizeof path, "/payments/%s/refunds", pay[i]);
    wait_status(s, "refunds", re[i], "succeeded");
    assert_replayed(s, tok, path, key, body, 201, re[i]);
    assert_made(p, re[i], 1, 1, 0, 1);
    free(re[i]);
  }
  assert_all_settled(s);
  {
    json_t *stats = p_stats(p);
    assert_int_equal(p_total(stats, "charges"), N - 1);
    assert_int_equal(p_total(stats, "declines"), 1);
    assert_int_equal(p_total(stats, "requests"), N);
    assert_int_equal(p_total(stats, "refunds"), N - 1);
    assert_int_equal(p_total(stats, "refund_requests"), N - 1);
    json_decref(stats);
  }
  for (int i = 0; i < N; i++)
    free(pay[i]);
  h_context_clear();
  h_server_stop(s);
  p_stop(p);
}

static void test_timeouts_after_charge(void **state) {
  static const char *const faults[][3] = {
      {"--fail-after", NULL},
      {"--drop-after", NULL},
      {"--delay-after-charge", "1500ms", NULL},
  };
  (void)state;
  for (size_t i = 0; i < sizeof faults / sizeof *faults; i++)
    run_fault(faults[i]);
}

/* Counts `needle` in idemd's log. */
static int log_count(const h_server_t *s, const char *needle) {
  size_t len;
  char *text = h_read_file(s->log, &len);
  int n = 0;
  for (const char *at = text; at && (at = strstr(at, needle)) != NULL; at++)
    n++;
  free(text);
  return n;
}

/* Waits until `needle` is in idemd's log more than `n` times. */
static void wait_log_count(const h_server_t *s, const char *needle, int n) {
  double deadline = h_now() + WAIT_MS / 1000.0;
  while (log_count(s, needle) <= n) {
    if (h_now() > deadline)
      fail_msg("'%s' not logged more than %d times within %d ms", needle, n, WAIT_MS);
    p_nap_ms(20);
  }
}

/* A send the provider refused (fail-before: nothing made) shows none by
 * reference: the reconciler sends again, and again, until one is made;
 * then never more. */
static void test_sends_again_when_none(void **state) {
  static const char *const fail_before[] = {"--fail-before", NULL};
  static const char *const healthy[] = {"--ignore-idempotency-key", NULL};
  p_psp_t *p = keyless_psp(fail_before);
  const char *flags[16];
  h_server_t *s;
  const char *tok;
  json_t *stats;
  char *id;
  (void)state;

  keyless_flags(p, NULL, flags, 16);
  s = h_server_start(flags);
  tok = h_tenant(s, "acme");
  id = post_pending(s, tok, "/payments", "again-1", "{\"amount\": 1500}");
  /* The reconciler found none and sent it again: refused again. */
  if (!p_wait_key(p, id, "requests", 3, WAIT_MS))
    fail_msg("the reconciler did not send %s again", id);
  h_assert_db(s, 1, "SELECT count(*) FROM payments WHERE id = ?1 AND status = 'pending'",
              id);
  p_stop(p);
  p_restart(p, healthy);
  wait_status(s, "payments", id, "succeeded");
  assert_replayed(s, tok, "/payments", "again-1", "{\"amount\": 1500}", 201, id);
  stats = p_stats(p);
  assert_int_equal(made(stats, "references", id, "charges"), 1);
  assert_int_equal(p_total(stats, "charges"), 1);
  json_decref(stats);
  assert_all_settled(s);
  free(id);
  h_server_stop(s);
  p_stop(p);
}

/* A POST from another thread: its answer dies with idemd. */
struct bg {
  h_server_t *s;
  const char *tok;
  h_resp_t resp;
  pthread_t thread;
};

static void *bg_main(void *arg) {
  struct bg *b = arg;
  h_post(b->s, "/payments", b->tok, "crash-1", "{\"amount\": 2500}", &b->resp);
  return NULL;
}

/* idemd dies (kill -9) while the provider, having charged, is still
 * answering. Started again, its reconciler takes the payment over once
 * the dead worker's lease is out, finds the charge by its reference and
 * settles it: one POST, one charge. */
static void test_kill9_at_provider(void **state) {
  static const char *const slow[] = {"--delay-after-charge", "3s", NULL};
  /* The call outlives the kill: idemd dies with the record processing. */
  static const char *const extra[] = {"--provider-timeout", "5s", "--lease", "6s", NULL};
  p_psp_t *p = keyless_psp(slow);
  const char *flags[16];
  struct bg first = {0};
  h_server_t *s;
  json_t *stats;
  char *id;
  (void)state;

  keyless_flags(p, extra, flags, 16);
  s = h_server_start(flags);
  first.s = s;
  first.tok = h_tenant(s, "acme");
  assert_int_equal(pthread_create(&first.thread, NULL, bg_main, &first), 0);
  if (!h_db_wait(s, WAIT_MS,
                 "SELECT count(*) FROM idempotency_records WHERE key = 'crash-1' AND "
                 "state = 'processing'"))
    fail_msg("crash-1 was never processing");
  id = h_db_text(s, PAY_ID_OF_KEY, "crash-1");
  assert_non_null(id);
  if (!p_wait_key(p, id, "requests", 1, WAIT_MS))
    fail_msg("the provider never got the charge of %s", id);
  p_kill_idemd(s);
  pthread_join(first.thread, NULL);
  h_resp_free(&first.resp);

  h_server_restart(s, flags);
  wait_status(s, "payments", id, "succeeded");
  assert_replayed(s, first.tok, "/payments", "crash-1", "{\"amount\": 2500}", 201, id);
  assert_made(p, id, 0, 1, 0, 1);
  stats = p_stats(p);
  assert_int_equal(p_total(stats, "charges"), 1);
  json_decref(stats);
  assert_all_settled(s);
  free(id);
  h_server_stop(s);
  p_stop(p);
}

/* The provider is gone: a lookup has no answer, so the payment stays
 * pending and nothing is sent; back, it is found and settled. */
static void test_unknown_lookup_stays_pending(void **state) {
  static const char *const drop[] = {"--drop-after", NULL};
  static const char *const healthy[] = {"--ignore-idempotency-key", NULL};
  p_psp_t *p = keyless_psp(drop);
  const char *flags[16];
  h_server_t *s;
  const char *tok;
  char *id;
  int seen;
  (void)state;

  keyless_flags(p, NULL, flags, 16);
  s = h_server_start(flags);
  tok = h_tenant(s, "acme");
  id = post_pending(s, tok, "/payments", "gone-1", "{\"amount\": 3000}");
  p_kill(p);
  seen = log_count(s, "payment still pending");
  wait_log_count(s, "payment still pending", seen + 2);
  h_assert_db(s, 1, "SELECT count(*) FROM payments WHERE id = ?1 AND status = 'pending'",
              id);
  p_restart(p, healthy);
  wait_status(s, "payments", id, "succeeded");
  assert_replayed(s, tok, "/payments", "gone-1", "{\"amount\": 3000}", 201, id);
  assert_made(p, id, 0, 1, 0, 1);
  assert_all_settled(s);
  free(id);
  h_server_stop(s);
  p_stop(p);
}

/* libcurl sends a request again by itself when a kept-alive connection it
 * reused closes unanswered; to a provider that ignores keys that would be
 * a second charge. One worker, so one connection, kept alive: the first
 * payment goes through, then the provider charges the second and drops
 * the connection unanswered (--chaos 0.5 --seed 15 draws no fault, then
 * drop-after). It is charged once, and settled by the lookup. */
static void test_dropped_on_kept_alive_connection(void **state) {
  static const char *const chaos[] = {"--chaos", "0.5", "--seed", "15", NULL};
  static const char *const extra[] = {"--workers", "1", NULL};
  p_psp_t *p = keyless_psp(chaos);
  const char *flags[16];
  h_server_t *s;
  const char *tok;
  h_resp_t r;
  char *id1, *id2;
  (void)state;

  keyless_flags(p, extra, flags, 16);
  s = h_server_start(flags);
  tok = h_tenant(s, "acme");
  h_post(s, "/payments", tok, "kept-1", "{\"amount\": 1100}", &r);
  h_assert_first(&r, 201);
  id1 = strdup(h_id(&r));
  h_resp_free(&r);
  id2 = post_pending(s, tok, "/payments", "kept-2", "{\"amount\": 1200}");
  wait_status(s, "payments", id2, "succeeded");
  assert_made(p, id1, 0, 1, 0, 1);
  assert_made(p, id2, 0, 1, 0, 1);
  assert_all_settled(s);
  free(id1);
  free(id2);
  h_server_stop(s);
  p_stop(p);
}

/* Why --provider-idempotency off exists: with it on, idemd trusts the
 * provider's key, so against one that ignores keys the reconciler's
 * lookup by key finds nothing and its second send charges again. */
static void test_keys_on_charges_twice(void **state) {
  static const char *const drop[] = {"--drop-after", NULL};
  p_psp_t *p = keyless_psp(drop);
  const char *flags[16];
  h_server_t *s;
  const char *tok;
  char *id;
  (void)state;

  keyless_flags(p, NULL, flags, 16);
  flags[3] = "on";
  s = h_server_start(flags);
  tok = h_tenant(s, "acme");
  id = post_pending(s, tok, "/payments", "twice-1", "{\"amount\": 1200}");
  if (!p_wait_key(p, id, "requests", 2, WAIT_MS))
    fail_msg("with keys on, the reconciler never sent %s again", id);
  {
    json_t *stats = p_stats(p);
    if (made(stats, "references", id, "charges") < 2)
      fail_msg("with keys on, %s was sent twice but charged %lld times", id,
               (long long)made(stats, "references", id, "charges"));
    json_decref(stats);
  }
  free(id);
  h_server_stop(s);
  p_stop(p);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_timeouts_after_charge, p_teardown),
      cmocka_unit_test_teardown(test_sends_again_when_none, p_teardown),
      cmocka_unit_test_teardown(test_kill9_at_provider, p_teardown),
      cmocka_unit_test_teardown(test_unknown_lookup_stays_pending, p_teardown),
      cmocka_unit_test_teardown(test_dropped_on_kept_alive_connection, p_teardown),
      cmocka_unit_test_teardown(test_keys_on_charges_twice, p_teardown),
  };
  int rc;
  h_init(argc, argv);
  p_init(argc, argv);
  rc = cmocka_run_group_tests_name("integration: provider without keys", tests, NULL,
                                   NULL);
  curl_global_cleanup();
  return rc;
}
