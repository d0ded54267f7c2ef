/* POST /payments/{id}/refunds and GET /refunds/{id} (docs/idempotency.md,
 * section 4.5): a refund's answers, its outcomes at the sandbox provider,
 * refusals that store nothing and leave the key free, one refund per key
 * under a race, and the payment's refundable amount, checked in the
 * transaction that reserves the key, never exceeded by refunds racing
 * under different keys (on PostgreSQL, over two idemd instances). On
 * SQLite and PostgreSQL alike. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"

#define N 20
#define DECLINE "777"     /* the sandbox declines this amount, charge or refund */
#define UNCERTAIN "555"   /* made, its answer lost: pending */
#define UNAVAILABLE "333" /* never reaches the provider */

static const char *const sandbox_flags[] = {
    "--sandbox-decline-amount", DECLINE, "--sandbox-uncertain-amount", UNCERTAIN,
    "--sandbox-unavailable-amount", UNAVAILABLE, "--reconcile-interval", "200ms", NULL};

/* A succeeded payment of `amount`; its id (malloc'd). */
static char *pay(h_server_t *s, const char *tok, const char *key, long amount) {
  char body[64];
  h_resp_t r;
  char *id;

  snprintf(body, sizeof body, "{\"amount\":%ld}", amount);
  h_post(s, "/payments", tok, key, body, &r);
  h_assert_status(&r, amount == atol(DECLINE) ? 402 : 201);
  id = strdup(h_id(&r));
  h_resp_free(&r);
  return id;
}

static void refund(h_server_t *s, const char *tok, const char *payment, const char *key,
                   const char *body, h_resp_t *out) {
  char path[128];
  snprintf(path, sizeof path, "/payments/%s/refunds", payment);
  h_post(s, path, tok, key, body, out);
}

static int64_t num(const h_resp_t *r, const char *name) {
  json_t *v = json_object_get(r->json, name);
  if (!json_is_integer(v))
    fail_msg("no integer \"%s\" in %s", name, r->body ? r->body : "(no body)");
  return json_integer_value(v);
}

static const char *str(const h_resp_t *r, const char *name) {
  const char *v = json_string_value(json_object_get(r->json, name));
  if (v == NULL)
    fail_msg("no \"%s\" in %s", name, r->body ? r->body : "(no body)");
  return v;
}

/* The payment's amount_refunded as GET /payments/{id} shows it. */
static int64_t refunded(h_server_t *s, const char *tok, const char *payment) {
  char path[128];
  h_resp_t r;
  int64_t n;

  snprintf(path, sizeof path, "/payments/%s", payment);
  h_get(s, path, tok, &r);
  h_assert_status(&r, 200);
  n = num(&r, "amount_refunded");
  h_resp_free(&r);
  return n;
}

#define REFUND_RECORDS "SELECT count(*) FROM idempotency_records WHERE operation = 'create_refund'"
#define REFUND_ROWS "SELECT count(*) FROM resources WHERE kind = 'refund'"

/* A refund of part, its replay, GET /refunds/{id}, the payment's
 * amount_refunded; a refund of all that is left by default; then nothing
 * is left: 409, with nothing stored and the key free for another
 * request. */
static void test_refund(void **state) {
  h_server_t *s = h_server_start(sandbox_flags);
  const char *tok = h_tenant(s, "shop");
  char *pid = pay(s, tok, "p1", 10000);
  char path[128];
  h_resp_t first, r, got;
  (void)state;

  assert_int_equal(refunded(s, tok, pid), 0);
  refund(s, tok, pid, "r1", "{\"amount\":3000,\"reason\":\"devolu\\u00e7\\u00e3o\"}",
         &first);
  h_assert_first(&first, 201);
  assert_true(strncmp(h_id(&first), "re_", 3) == 0);
  snprintf(path, sizeof path, "/refunds/%s", h_id(&first));
  assert_string_equal(first.location, path);
  assert_string_equal(str(&first, "payment_id"), pid);
  assert_int_equal(num(&first, "amount"), 3000);
  assert_string_equal(str(&first, "currency"), "BRL");
  assert_string_equal(str(&first, "status"), "succeeded");
  assert_string_equal(str(&first, "reason"), "devolução");
  (void)str(&first, "created_at");
  assert_int_equal(json_object_size(first.json), 7);

  refund(s, tok, pid, "r1", "{\"reason\":\"devolução\",\"amount\":\"3000\"}", &r);
  h_assert_replay_of(&r, &first);
  h_resp_free(&r);
  h_get(s, path, tok, &got);
  h_assert_status(&got, 200);
  assert_string_equal(got.body, first.body);
  h_resp_free(&got);
  assert_int_equal(refunded(s, tok, pid), 3000);

  /* All that is left, by default; reason null. */
  refund(s, tok, pid, "r2", "{}", &r);
  h_assert_first(&r, 201);
  assert_int_equal(num(&r, "amount"), 7000);
  assert_true(json_is_null(json_object_get(r.json, "reason")));
  h_resp_free(&r);
  assert_int_equal(refunded(s, tok, pid), 10000);

  /* Nothing left: refused, nothing stored, the key still free. */
  refund(s, tok, pid, "r3", "{}", &r);
  h_assert_error(&r, 409, "refund exceeds the refundable amount");
  h_resp_free(&r);
  refund(s, tok, pid, "r3", "{\"amount\":1}", &r);
  h_assert_error(&r, 409, "refund exceeds the refundable amount");
  h_resp_free(&r);
  h_assert_db(s, 2, REFUND_RECORDS);
  h_assert_db(s, 2, REFUND_ROWS);
  h_assert_db(s, 2, "SELECT count(*) FROM refunds WHERE status = 'succeeded'");
  h_assert_db(s, 0, "SELECT count(*) FROM outbox");

  /* A second payment: the refused key now refunds it. */
  {
    char *other = pay(s, tok, "p2", 500);
    refund(s, tok, other, "r3", "{\"amount\":1}", &r);
    h_assert_first(&r, 201);
    h_resp_free(&r);
    free(other);
  }
  h_resp_free(&first);
  free(pid);
  h_server_stop(s);
}

/* Refusals and bad input: 404 for an unknown payment or another tenant's,
 * 409 for a payment not succeeded, 422 naming the field; each stores
 * nothing. A key reused for another payment's refund is a mismatch. */
static void test_refusals(void **state) {
  static const struct {
    const char *body, *field;
  } bad[] = {
      {"{\"amount\":0}", "amount"},
      {"{\"amount\":-5}", "amount"},
      {"{\"amount\":1.5}", "amount"},
      {"{\"amount\":\"abc\"}", "amount"},
      {"{\"amount\":9007199254740992}", "amount"},
      {"{\"reason\":42}", "reason"},
      {"{\"reason\":[\"x\"]}", "reason"},
      {"{\"amount\":10,\"note\":\"x\"}", "note"},
  };
  h_server_t *s = h_server_start(sandbox_flags);
  const char *tok = h_tenant(s, "shop");
  const char *other_tok = h_tenant(s, "other");
  char *pid = pay(s, tok, "p1", 10000);
  char *declined = pay(s, tok, "p2", atol(DECLINE));
  char long_reason[256], body[320];
  h_resp_t r, first;
  (void)state;

  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    h_context("body %s", bad[i].body);
    refund(s, tok, pid, "bad", bad[i].body, &r);
    h_assert_field_error(&r, bad[i].field);
    h_resp_free(&r);
  }
  h_context_clear();
  memset(long_reason, 'x', 201);
  long_reason[201] = '\0';
  snprintf(body, sizeof body, "{\"reason\":\"%s\"}", long_reason);
  refund(s, tok, pid, "bad", body, &r);
  h_assert_field_error(&r, "reason");
  h_resp_free(&r);
  /* 200 characters of two bytes each are fine. */
  {
    char ok[512] = "{\"amount\":1,\"reason\":\"";
    for (int i = 0; i < 200; i++)
      strcat(ok, "é");
    strcat(ok, "\"}");
    refund(s, tok, pid, "long-ok", ok, &first);
    h_assert_first(&first, 201);
    h_resp_free(&first);
  }

  refund(s, tok, "pay_unknown", "k1", "{}", &r);
  h_assert_error(&r, 404, "payment not found");
  h_resp_free(&r);
  refund(s, other_tok, pid, "k1", "{}", &r);
  h_assert_error(&r, 404, "payment not found");
  h_resp_free(&r);
  refund(s, tok, declined, "k1", "{}", &r);
  h_assert_error(&r, 409, "payment is not refundable");
  h_resp_free(&r);
  {
    h_req_t q = {.method = "POST", .path = "/payments/x/refunds", .token = tok,
                 .body = "{}"};
    h_http(s, &q, &r); /* no key */
    h_assert_status(&r, 400);
    h_resp_free(&r);
  }
  h_assert_db(s, 1, REFUND_RECORDS);
  h_assert_db(s, 1, REFUND_ROWS);
  assert_int_equal(refunded(s, tok, pid), 1);

  /* One key, two payments: a mismatch. */
  refund(s, tok, pid, "k2", "{\"amount\":10}", &first);
  h_assert_first(&first, 201);
  {
    char *third = pay(s, tok, "p3", 900);
    refund(s, tok, third, "k2", "{\"amount\":10}", &r);
    h_assert_error(&r, 422, "Idempotency-Key was already used with a different request");
    h_resp_free(&r);
    free(third);
  }
  /* Another tenant reads neither the refund nor the payment. */
  {
    char path[128];
    snprintf(path, sizeof path, "/refunds/%s", h_id(&first));
    h_get(s, path, other_tok, &r);
    h_assert_error(&r, 404, "refund not found");
    h_resp_free(&r);
    h_get(s, "/refunds/re_nope", tok, &r);
    h_assert_error(&r, 404, "refund not found");
    h_resp_free(&r);
  }
  h_resp_free(&first);
  free(pid);
  free(declined);
  h_server_stop(s);
}

/* The provider's answers: a declined refund is 402, stored and replayed,
 * and gives its amount back; one whose answer is lost is 202 pending and
 * settled by the reconciler (its replays then 201, the payment counting
 * it); one that never reached the provider is 503, its amount given back
 * and its key free. */
static void test_outcomes(void **state) {
  h_server_t *s = h_server_start(sandbox_flags);
  const char *tok = h_tenant(s, "shop");
  char *pid = pay(s, tok, "p1", 2000);
  h_resp_t first, r;
  (void)state;

  refund(s, tok, pid, "declined", "{\"amount\":" DECLINE "}", &first);
  h_assert_first(&first, 402);
  assert_string_equal(str(&first, "status"), "declined");
  assert_string_equal(str(&first, "error"), "the refund was declined");
  refund(s, tok, pid, "declined", "{\"amount\":" DECLINE "}", &r);
  h_assert_replay_of(&r, &first);
  h_resp_free(&r);
  h_resp_free(&first);
  assert_int_equal(refunded(s, tok, pid), 0);

  refund(s, tok, pid, "unavailable", "{\"amount\":" UNAVAILABLE "}", &r);
  h_assert_error(&r, 503, NULL);
  assert_string_equal(r.retry_after, "1");
  h_resp_free(&r);

  refund(s, tok, pid, "lost", "{\"amount\":" UNCERTAIN "}", &first);
  h_assert_first(&first, 202);
  assert_string_equal(str(&first, "status"), "pending");
  if (!h_db_wait(s, 10000, "SELECT count(*) FROM refunds WHERE status = 'succeeded'"))
    fail_msg("the reconciler did not settle the pending refund");
  refund(s, tok, pid, "lost", "{\"amount\":" UNCERTAIN "}", &r);
  h_assert_status(&r, 201);
  assert_string_equal(r.replayed, "true");
  assert_string_equal(str(&r, "id"), h_id(&first));
  assert_string_equal(str(&r, "status"), "succeeded");
  h_resp_free(&r);
  h_resp_free(&first);
  assert_int_equal(refunded(s, tok, pid), atol(UNCERTAIN));

  /* What the declined and unsent refunds held is back: all the rest. */
  refund(s, tok, pid, "rest", "{}", &r);
  h_assert_first(&r, 201);
  assert_int_equal(num(&r, "amount"), 2000 - atol(UNCERTAIN));
  h_resp_free(&r);
  assert_int_equal(refunded(s, tok, pid), 2000);
  h_assert_db(s, 0, "SELECT count(*) FROM outbox");
  free(pid);
  h_server_stop(s);
}

/* N copies of one refund under one key, released together while the
 * provider takes 300 ms: one refund, one first answer, the others its
 * replays. */
static void test_one_key_race(void **state) {
  static const char *const slow[] = {"--sandbox-delay", "300ms", NULL};
  h_server_t *s = h_server_start(slow);
  const char *tok = h_tenant(s, "shop");
  char *pid = pay(s, tok, "p1", 10000);
  char path[128];
  h_req_t reqs[N];
  h_resp_t out[N];
  int first = -1;
  (void)state;

  snprintf(path, sizeof path, "/payments/%s/refunds", pid);
  for (int i = 0; i < N; i++)
    reqs[i] = (h_req_t){.method = "POST", .path = path, .token = tok, .key = "same",
                        .body = "{\"amount\":2500}"};
  h_together(s, reqs, N, out);
  for (int i = 0; i < N; i++) {
    h_context("copy %d", i);
    h_assert_status(&out[i], 201);
    if (out[i].replayed[0] == '\0') {
      if (first >= 0)
        fail_msg("copies %d and %d are both first answers", first, i);
      first = i;
    }
  }
  h_context_clear();
  if (first < 0)
    fail_msg("no first answer");
  for (int i = 0; i < N; i++)
    if (i != first)
      h_assert_replay_of(&out[i], &out[first]);
  h_assert_db(s, 1, REFUND_ROWS);
  assert_int_equal(refunded(s, tok, pid), 2500);
  for (int i = 0; i < N; i++)
    h_resp_free(&out[i]);
  free(pid);
  h_server_stop(s);
}

/* N refunds of a tenth of a payment under N keys, released together (on
 * PostgreSQL half of them through a second idemd on the same database):
 * exactly ten are made, the others refused 409, and the payment's
 * refunds add up to its amount and no more. */
static void test_refundable_amount_race(void **state) {
  static const char *const slow[] = {"--sandbox-delay", "50ms", NULL};
  h_server_t *a = h_server_start(slow);
  h_server_t *b = h_store_is_pg() ? h_server_start_on(a->db, slow) : a;
  const char *tok = h_tenant(a, "shop");
  char *pid = pay(a, tok, "p1", 10000);
  char path[128], keys[N][16];
  h_server_t *to[N];
  h_req_t reqs[N];
  h_resp_t out[N];
  int made = 0, refused = 0;
  (void)state;

  snprintf(path, sizeof path, "/payments/%s/refunds", pid);
  for (int i = 0; i < N; i++) {
    snprintf(keys[i], sizeof keys[i], "part-%d", i);
    to[i] = i % 2 ? b : a;
    reqs[i] = (h_req_t){.method = "POST", .path = path, .token = tok, .key = keys[i],
                        .body = "{\"amount\":1000}"};
  }
  h_together_on(to, reqs, N, out);
  for (int i = 0; i < N; i++) {
    h_context("refund %d", i);
    if (out[i].status == 201)
      made++;
    else if (out[i].status == 409)
      h_assert_error(&out[i], 409, "refund exceeds the refundable amount"), refused++;
    else
      h_assert_status(&out[i], 201);
  }
  h_context_clear();
  assert_int_equal(made, 10);
  assert_int_equal(refused, N - 10);
  h_assert_db(a, 10, REFUND_ROWS);
  h_assert_db(a, 10000, "SELECT sum(amount) FROM refunds");
  h_assert_db(a, 10000, "SELECT refund_taken FROM resources WHERE kind = 'payment'");
  assert_int_equal(refunded(a, tok, pid), 10000);
  assert_int_equal(refunded(b, tok, pid), 10000);
  for (int i = 0; i < N; i++)
    h_resp_free(&out[i]);
  free(pid);

  /* N refunds of all that is left, under N keys: one gets it all. */
  pid = pay(a, tok, "p2", 7000);
  snprintf(path, sizeof path, "/payments/%s/refunds", pid);
  for (int i = 0; i < N; i++) {
    snprintf(keys[i], sizeof keys[i], "all-%d", i);
    reqs[i] = (h_req_t){.method = "POST", .path = path, .token = tok, .key = keys[i],
                        .body = "{}"};
  }
  h_together_on(to, reqs, N, out);
  made = 0;
  for (int i = 0; i < N; i++) {
    h_context("refund of all %d", i);
    if (out[i].status == 201) {
      made++;
      assert_int_equal(num(&out[i], "amount"), 7000);
    } else {
      h_assert_error(&out[i], 409, "refund exceeds the refundable amount");
    }
    h_resp_free(&out[i]);
  }
  h_context_clear();
  assert_int_equal(made, 1);
  assert_int_equal(refunded(a, tok, pid), 7000);
  free(pid);
  if (b != a)
    h_server_stop(b);
  h_server_stop(a);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_refund, h_teardown),
      cmocka_unit_test_teardown(test_refusals, h_teardown),
      cmocka_unit_test_teardown(test_outcomes, h_teardown),
      cmocka_unit_test_teardown(test_one_key_race, h_teardown),
      cmocka_unit_test_teardown(test_refundable_amount_race, h_teardown),
  };
  int rc;
  h_init(argc, argv);
  rc = cmocka_run_group_tests_name("integration: refunds", tests, NULL, NULL);
  curl_global_cleanup();
  return rc;
}
