/* The provider's events at POST /webhooks/provider (docs/payments.md,
 * "Webhooks"), signed here as the provider signs them
 * (Idem-Psp-Signature: t=<unix s>,v1=<hex HMAC-SHA256 of "<t>.<body>">),
 * against idemd with idem-psp as its provider: payments and refunds left
 * pending by the provider's faults (it charges, then answers 500) are
 * settled by their event once, with the event's id as the audit's actor;
 * a duplicate changes nothing; events for nothing pending are ignored;
 * an event of another amount changes nothing but leaves an audit row;
 * unsigned, forged, stale, malformed and oversized events answer 400 or
 * 413 and change nothing; every one is counted in idem_webhooks_total. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "idem/crypto.h"
#include "psp_harness.h"

#define SECRET "whsec_test_7f3a"

/* idemd on `p`, without a reconciler pass during the test, with the
 * webhook secret. */
static h_server_t *start_idemd(p_psp_t *p, const char *secret) {
  const char *flags[] = {"--provider", p->url, "--reconcile-interval", "1h",
                         secret ? "--provider-webhook-secret" : NULL, secret, NULL};
  return h_server_start(flags);
}

/* The Idem-Psp-Signature header of `body` signed at `t` under `secret`. */
static void sign(const char *secret, long long t, const char *body, char *header,
                 size_t cap) {
  char signed_text[16384], hex[2 * IDEM_SHA256_LEN + 1];
  unsigned char mac[IDEM_SHA256_LEN];
  int n = snprintf(signed_text, sizeof signed_text, "%lld.%s", t, body);

  assert_true(n > 0 && (size_t)n < sizeof signed_text);
  assert_int_equal(idem_hmac_sha256(secret, strlen(secret), signed_text, (size_t)n, mac),
                   IDEM_OK);
  idem_hex(mac, sizeof mac, hex);
  snprintf(header, cap, "Idem-Psp-Signature: t=%lld,v1=%s", t, hex);
}

/* An event's body. */
static void event(char *out, size_t cap, const char *id, const char *type, const char *key,
                  const char *ref, long long amount) {
  snprintf(out, cap,
           "{\"id\":\"%s\",\"type\":\"%s\",\"created\":%lld,\"data\":{\"key\":\"%s\","
           "\"id\":\"%s\",\"amount\":%lld}}",
           id, type, (long long)(h_wall_ms() / 1000), key, ref, amount);
}

/* POSTs `body` to /webhooks/provider with `header` (NULL: none). */
static void deliver(h_server_t *s, const char *body, const char *header, h_resp_t *out) {
  h_req_t req = {.method = "POST", .path = "/webhooks/provider", .body = body,
                 .headers = {header}};
  h_http(s, &req, out);
}

/* Delivers `body` signed now under SECRET; asserts 200 {"status": want}. */
static void deliver_ok(h_server_t *s, const char *body, const char *want) {
  char header[160];
  h_resp_t r;
  sign(SECRET, h_wall_ms() / 1000, body, header, sizeof header);
  deliver(s, body, header, &r);
  h_assert_status(&r, 200);
  if (json_object_size(r.json) != 1 ||
      strcmp(json_string_value(json_object_get(r.json, "status")) ?: "", want) != 0)
    fail_msg("wanted {\"status\":\"%s\"}, got %s", want, r.body);
  h_resp_free(&r);
}

/* The provider's charge (or refund) id for idemd's key `key`. */
static char *provider_id(p_psp_t *p, const char *path, const char *key) {
  char url[128];
  h_resp_t r;
  char *id;
  snprintf(url, sizeof url, "/%s/%s", path, key);
  h_get(&p->http, url, NULL, &r);
  h_assert_status(&r, 200);
  id = strdup(json_string_value(json_object_get(r.json, "id")));
  h_resp_free(&r);
  return id;
}

static double webhooks_metric(h_server_t *s, const char *result) {
  char name[64];
  h_resp_t r;
  double v;
  snprintf(name, sizeof name, "idem_webhooks_total{result=\"%s\"}", result);
  h_get(s, "/metrics", NULL, &r);
  h_assert_status(&r, 200);
  v = h_metric(r.body, name);
  h_resp_free(&r);
  return v;
}

#define PENDING_PAYMENT "SELECT count(*) FROM payments WHERE id = ?1 AND status = 'pending'"
#define ROWS_CHANGED                                                                     \
  "SELECT (SELECT count(*) FROM audit) + (SELECT count(*) FROM processed_events)"

/* A payment and a refund left pending settle on their events (succeeded,
 * declined, a refund succeeded): 200 applied, replays then 201 or 402, the
 * event's id the audit row's actor and in processed_events. A second
 * delivery: duplicate, nothing changed. An event for a payment settled
 * already, or for no payment: ignored, nothing changed. */
static void test_events_settle(void **state) {
  p_psp_t *p = p_start(NULL);
  h_server_t *s = start_idemd(p, SECRET);
  const char *tok = h_tenant(s, "acme");
  const char *const faulty[] = {"--fail-after", NULL};
  char body[512], path[128], a[64], b[64], c[64], re[64];
  char *ref_a, *ref_b, *ref_re;
  h_resp_t r;
  int64_t changed;
  (void)state;

  h_post(s, "/payments", tok, "c", "{\"amount\": 3000}", &r);
  h_assert_status(&r, 201);
  snprintf(c, sizeof c, "%s", h_id(&r));
  h_resp_free(&r);
  p_stop(p);
  p_restart(p, faulty); /* it charges, then answers 500: pending */
  h_post(s, "/payments", tok, "a", "{\"amount\": 1500}", &r);
  h_assert_status(&r, 202);
  snprintf(a, sizeof a, "%s", h_id(&r));
  h_resp_free(&r);
  h_post(s, "/payments", tok, "b", "{\"amount\": 2500}", &r);
  h_assert_status(&r, 202);
  snprintf(b, sizeof b, "%s", h_id(&r));
  h_resp_free(&r);
  snprintf(path, sizeof path, "/payments/%s/refunds", c);
  h_post(s, path, tok, "re", "{\"amount\": 1000}", &r);
  h_assert_status(&r, 202);
  snprintf(re, sizeof re, "%s", h_id(&r));
  h_resp_free(&r);
  ref_a = provider_id(p, "charges", a);
  ref_b = provider_id(p, "charges", b);
  ref_re = provider_id(p, "refunds", re);

  event(body, sizeof body, "evt_a1", "charge.succeeded", a, ref_a, 1500);
  deliver_ok(s, body, "applied");
  h_post(s, "/payments", tok, "a", "{\"amount\": 1500}", &r);
  h_assert_status(&r, 201);
  assert_string_equal(r.replayed, "true");
  assert_string_equal(json_string_value(json_object_get(r.json, "status")), "succeeded");
  h_resp_free(&r);
  h_assert_db(s, 1, "SELECT count(*) FROM payments WHERE id = ?1 AND provider_ref = ?2", a,
              ref_a);
  h_assert_db(s, 1, "SELECT count(*) FROM audit WHERE resource_id = ?1 AND from_status = "
                    "'pending' AND to_status = 'succeeded' AND actor = 'evt_a1' AND reason = "
                    "'charge.succeeded'", a);
  h_assert_db(s, 1, "SELECT count(*) FROM processed_events WHERE event_id = 'evt_a1' AND "
                    "resource_id = ?1", a);

  /* The same event again, and a second event for the settled payment. */
  changed = h_db_int(s, ROWS_CHANGED);
  deliver_ok(s, body, "duplicate");
  event(body, sizeof body, "evt_a2", "charge.declined", a, ref_a, 1500);
  deliver_ok(s, body, "ignored");
  event(body, sizeof body, "evt_zz", "charge.succeeded", "pay_unknown", "ch_x", 1500);
  deliver_ok(s, body, "ignored");
  h_assert_db(s, changed, ROWS_CHANGED);
  h_assert_db(s, 1, "SELECT count(*) FROM payments WHERE id = ?1 AND status = 'succeeded'",
              a);

  event(body, sizeof body, "evt_b1", "charge.declined", b, ref_b, 2500);
  deliver_ok(s, body, "applied");
  h_post(s, "/payments", tok, "b", "{\"amount\": 2500}", &r);
  h_assert_status(&r, 402);
  assert_string_equal(json_string_value(json_object_get(r.json, "status")), "declined");
  h_resp_free(&r);

  event(body, sizeof body, "evt_r1", "refund.succeeded", re, ref_re, 1000);
  deliver_ok(s, body, "applied");
  h_post(s, path, tok, "re", "{\"amount\": 1000}", &r);
  h_assert_status(&r, 201);
  assert_string_equal(json_string_value(json_object_get(r.json, "status")), "succeeded");
  h_resp_free(&r);
  snprintf(path, sizeof path, "/payments/%s", c);
  h_get(s, path, tok, &r);
  assert_int_equal(json_integer_value(json_object_get(r.json, "amount_refunded")), 1000);
  h_resp_free(&r);

  h_assert_db(s, 0, "SELECT count(*) FROM outbox");
  h_assert_db(s, 3, "SELECT count(*) FROM processed_events");
  assert_true(webhooks_metric(s, "applied") == 3);
  assert_true(webhooks_metric(s, "duplicate") == 1);
  assert_true(webhooks_metric(s, "ignored") == 2);
  /* One charge per payment at the provider: the events sent nothing. */
  {
    json_t *stats = p_stats(p);
    assert_int_equal(p_key(stats, a, "charges"), 1);
    assert_int_equal(p_key(stats, b, "charges"), 1);
    json_decref(stats);
  }
  free(ref_a);
  free(ref_b);
  free(ref_re);
  h_server_stop(s);
  p_stop(p);
}

/* What a client can see of pending payment or refund `id`: its record,
 * its row and its outbox row, as one text. */
#define HELD                                                                             \
  "SELECT r.state || '|' || coalesce(r.owner_token, '') || '|' || "                      \
  "CAST(coalesce(r.lease_expires_at, 0) AS TEXT) || '|' || CAST(r.updated_at AS TEXT) "   \
  "|| '|' || CAST(r.response_status AS TEXT) || '|' || r.response_body || '|' || "       \
  "p.status || '|' || p.body || '|' || CAST(p.updated_at AS TEXT) || '|' || "            \
  "CAST(o.attempts AS TEXT) || '|' || CAST(o.next_attempt_at AS TEXT) "                  \
  "FROM idempotency_records r JOIN resources p ON p.id = r.resource_id "                  \
  "JOIN outbox o ON o.resource_id = p.id WHERE p.id = ?1"
#define MISMATCH_ROW                                                                     \
  "SELECT count(*) FROM audit WHERE resource_id = ?1 AND from_status = 'pending' AND "    \
  "to_status = 'pending' AND actor = ?2 AND reason LIKE ?3"

/* An event signed by the provider whose amount is not the payment's (or
 * refund's) changes nothing a client sees: its record, row and outbox row
 * stay as they were, a replay still answers 202. It answers 200 ignored,
 * is counted as amount_mismatch and leaves one audit row (pending to
 * pending, the event's id as actor, both amounts in the reason); a second
 * delivery is a duplicate and writes no second row. The right event is
 * then applied. */
static void test_other_amount_changes_nothing(void **state) {
  p_psp_t *p = p_start(NULL);
  h_server_t *s = start_idemd(p, SECRET);
  const char *tok = h_tenant(s, "acme");
  const char *const faulty[] = {"--fail-after", NULL};
  char body[512], path[128], pay[64], paid[64], re[64];
  char *held_pay, *held_re, *now_pay, *now_re, *ref_pay, *ref_re;
  h_resp_t r;
  (void)state;

  h_post(s, "/payments", tok, "paid", "{\"amount\": 3000}", &r);
  h_assert_status(&r, 201);
  snprintf(paid, sizeof paid, "%s", h_id(&r));
  h_resp_free(&r);
  p_stop(p);
  p_restart(p, faulty); /* it charges, then answers 500: pending */
  h_post(s, "/payments", tok, "a", "{\"amount\": 1500}", &r);
  h_assert_status(&r, 202);
  snprintf(pay, sizeof pay, "%s", h_id(&r));
  h_resp_free(&r);
  snprintf(path, sizeof path, "/payments/%s/refunds", paid);
  h_post(s, path, tok, "re", "{\"amount\": 1000}", &r);
  h_assert_status(&r, 202);
  snprintf(re, sizeof re, "%s", h_id(&r));
  h_resp_free(&r);
  ref_pay = provider_id(p, "charges", pay);
  ref_re = provider_id(p, "refunds", re);
  held_pay = h_db_text(s, HELD, pay);
  held_re = h_db_text(s, HELD, re);
  assert_non_null(held_pay);
  assert_non_null(held_re);

  event(body, sizeof body, "evt_m1", "charge.succeeded", pay, ref_pay, 999);
  deliver_ok(s, body, "ignored");
  event(body, sizeof body, "evt_m2", "refund.succeeded", re, ref_re, 1);
  deliver_ok(s, body, "ignored");

  now_pay = h_db_text(s, HELD, pay);
  now_re = h_db_text(s, HELD, re);
  assert_string_equal(now_pay, held_pay);
  assert_string_equal(now_re, held_re);
  h_assert_db(s, 1, MISMATCH_ROW, pay, "evt_m1", "%999%1500%");
  h_assert_db(s, 1, MISMATCH_ROW, re, "evt_m2", "%1%1000%");
  event(body, sizeof body, "evt_m1", "charge.succeeded", pay, ref_pay, 999);
  deliver_ok(s, body, "duplicate");
  h_assert_db(s, 1, "SELECT count(*) FROM audit WHERE actor = 'evt_m1'");
  assert_true(webhooks_metric(s, "amount_mismatch") == 2);
  assert_true(webhooks_metric(s, "duplicate") == 1);
  assert_true(webhooks_metric(s, "applied") == 0);
  h_post(s, "/payments", tok, "a", "{\"amount\": 1500}", &r);
  h_assert_status(&r, 202);
  h_resp_free(&r);
  h_post(s, path, tok, "re", "{\"amount\": 1000}", &r);
  h_assert_status(&r, 202);
  h_resp_free(&r);

  /* The provider's right events still settle both. */
  event(body, sizeof body, "evt_m3", "charge.succeeded", pay, ref_pay, 1500);
  deliver_ok(s, body, "applied");
  event(body, sizeof body, "evt_m4", "refund.succeeded", re, ref_re, 1000);
  deliver_ok(s, body, "applied");
  h_post(s, "/payments", tok, "a", "{\"amount\": 1500}", &r);
  h_assert_status(&r, 201);
  h_resp_free(&r);
  h_post(s, path, tok, "re", "{\"amount\": 1000}", &r);
  h_assert_status(&r, 201);
  h_resp_free(&r);
  free(held_pay);
  free(held_re);
  free(now_pay);
  free(now_re);
  free(ref_pay);
  free(ref_re);
  h_server_stop(s);
  p_stop(p);
}

/* What changes nothing: a missing, malformed or forged signature, a time
 * more than 5 minutes away, a body that is not an event idemd knows
 * (400 {"error"}), a body over 8 KiB (413); a GET is 405. The pending
 * payment stays pending, nothing is written, each is counted. No Bearer
 * is ever asked for. */
static void test_bad_events_change_nothing(void **state) {
  static const char *const faulty[] = {"--fail-after", NULL};
  p_psp_t *p = p_start(faulty);
  h_server_t *s = start_idemd(p, SECRET);
  const char *tok = h_tenant(s, "acme");
  char body[512], header[160], pay[64], *big;
  long long now = h_wall_ms() / 1000;
  h_resp_t r;
  int64_t changed;
  (void)state;

  h_post(s, "/payments", tok, "a", "{\"amount\": 1500}", &r);
  h_assert_status(&r, 202);
  snprintf(pay, sizeof pay, "%s", h_id(&r));
  h_resp_free(&r);
  changed = h_db_int(s, ROWS_CHANGED);
  event(body, sizeof body, "evt_bad", "charge.succeeded", pay, "ch_1", 1500);

  struct {
    const char *name, *body, *header, *result;
    long status;
  } cases[8];
  char forged[160], stale[160], future[160], garbage_sig[160], unknown_sig[160];
  const char *garbage = "{\"id\":\"evt_x\",", *unknown =
      "{\"id\":\"evt_u\",\"type\":\"charge.refunded\",\"created\":1,"
      "\"data\":{\"key\":\"pay_x\",\"id\":\"ch_1\",\"amount\":1}}";
  sign("another secret", now, body, forged, sizeof forged);
  /* Well past the window, whatever second idemd's clock reads when it
   * checks (301 s ahead read 300 s on a slow run); unit_webhook checks
   * the window's edges against a fixed clock. */
  sign(SECRET, now - 330, body, stale, sizeof stale);
  sign(SECRET, now + 330, body, future, sizeof future);
  sign(SECRET, now, garbage, garbage_sig, sizeof garbage_sig);
  sign(SECRET, now, unknown, unknown_sig, sizeof unknown_sig);
  int n = 0;
  cases[n++] = (typeof(cases[0])){"no signature", body, NULL, "unsigned", 400};
  cases[n++] = (typeof(cases[0])){"malformed signature", body, "Idem-Psp-Signature: v1=abc",
                                   "unsigned", 400};
  cases[n++] = (typeof(cases[0])){"another secret", body, forged, "forged", 400};
  cases[n++] = (typeof(cases[0])){"330 s old", body, stale, "stale", 400};
  cases[n++] = (typeof(cases[0])){"330 s ahead", body, future, "stale", 400};
  cases[n++] = (typeof(cases[0])){"not JSON", garbage, garbage_sig, "malformed", 400};
  cases[n++] = (typeof(cases[0])){"unknown type", unknown, unknown_sig, "malformed", 400};
  for (int i = 0; i < n; i++) {
    h_context("%s", cases[i].name);
    deliver(s, cases[i].body, cases[i].header, &r);
    h_assert_error(&r, cases[i].status, NULL);
    h_resp_free(&r);
  }
  h_context_clear();

  big = malloc(9001);
  assert_non_null(big);
  memset(big, ' ', 9000);
  memcpy(big, body, strlen(body));
  big[9000] = '\0';
  sign(SECRET, now, big, header, sizeof header);
  deliver(s, big, header, &r);
  h_assert_error(&r, 413, NULL);
  h_resp_free(&r);
  free(big);
  {
    h_req_t get = {.path = "/webhooks/provider"};
    h_http(s, &get, &r);
    h_assert_status(&r, 405);
    assert_string_equal(r.allow, "POST");
    h_resp_free(&r);
  }

  h_assert_db(s, changed, ROWS_CHANGED);
  h_assert_db(s, 1, PENDING_PAYMENT, pay);
  assert_true(webhooks_metric(s, "unsigned") == 2);
  assert_true(webhooks_metric(s, "forged") == 1);
  assert_true(webhooks_metric(s, "stale") == 2);
  assert_true(webhooks_metric(s, "malformed") == 2);
  assert_true(webhooks_metric(s, "too_large") == 1);
  assert_true(webhooks_metric(s, "applied") == 0);
  /* The same event, signed right, is then applied. */
  deliver_ok(s, body, "applied");
  h_assert_db(s, 0, PENDING_PAYMENT, pay);
  h_server_stop(s);
  p_stop(p);
}

/* Without a secret the route does not exist: 404, whatever is sent. */
static void test_no_secret_no_route(void **state) {
  p_psp_t *p = p_start(NULL);
  h_server_t *s = start_idemd(p, NULL);
  char body[256], header[160];
  h_resp_t r;
  (void)state;

  event(body, sizeof body, "evt_1", "charge.succeeded", "pay_x", "ch_1", 1);
  sign(SECRET, h_wall_ms() / 1000, body, header, sizeof header);
  deliver(s, body, header, &r);
  h_assert_error(&r, 404, NULL);
  h_resp_free(&r);
  h_server_stop(s);
  p_stop(p);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_events_settle, p_teardown),
      cmocka_unit_test_teardown(test_other_amount_changes_nothing, p_teardown),
      cmocka_unit_test_teardown(test_bad_events_change_nothing, p_teardown),
      cmocka_unit_test_teardown(test_no_secret_no_route, p_teardown),
  };
  int rc;
  h_init(argc, argv);
  p_init(argc, argv);
  rc = cmocka_run_group_tests_name("integration: webhooks", tests, NULL, NULL);
  curl_global_cleanup();
  return rc;
}
