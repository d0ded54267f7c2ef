/* Every row of the idempotency rules table (docs/idempotency.md, section 2.4)
 * against the real idemd: key checks, new keys, replays, fingerprints,
 * in-flight duplicates, and the pending, declined and failed payment
 * outcomes. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#define PAYMENT "{\"amount\": 15990, \"currency\": \"BRL\", \"order_id\": \"ord_42\"}"
#define ORDER                                                                            \
  "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":2,"                   \
  "\"unit_price\":1000}],\"currency\":\"BRL\"}"
#define REQUIRED "Idempotency-Key header is required"
#define MISMATCH "Idempotency-Key was already used with a different request"

#define COUNT_PAYMENTS "SELECT count(*) FROM resources WHERE kind = 'payment'"
#define COUNT_ORDERS "SELECT count(*) FROM resources WHERE kind = 'order'"
#define COUNT_RECORDS "SELECT count(*) FROM idempotency_records"

static const char *const paths[] = {"/payments", "/orders"};
static const char *const bodies[] = {PAYMENT, ORDER};

/* A POST with a request id of our choosing (seen in the record's
 * correlation id). */
static void post_rid(h_server_t *s, const char *path, const char *tok, const char *key,
                     const char *body, const char *rid, h_resp_t *out) {
  char line[128];
  h_req_t r = {.method = "POST", .path = path, .token = tok, .key = key, .body = body};
  snprintf(line, sizeof line, "X-Request-Id: %s", rid);
  r.headers[0] = line;
  h_http(s, &r, out);
}

/* Missing, empty or blank keys: 400 with the fixed message, nothing stored. */
static void test_key_missing_or_blank(void **state) {
  static const char *const blank_raw[] = {"", " ", "   ", "\t", " \t \t "};
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  h_resp_t r;
  (void)state;

  for (int p = 0; p < 2; p++) {
    h_context("%s without the header", paths[p]);
    h_post(s, paths[p], tok, NULL, bodies[p], &r);
    h_assert_error(&r, 400, REQUIRED);
    h_resp_free(&r);

    h_context("%s with an empty header", paths[p]);
    h_post(s, paths[p], tok, "", bodies[p], &r);
    h_assert_error(&r, 400, REQUIRED);
    h_resp_free(&r);

    for (size_t i = 0; i < sizeof blank_raw / sizeof *blank_raw; i++) {
      h_context("%s with the key '%s'", paths[p], blank_raw[i]);
      h_raw_post(s, paths[p], tok, blank_raw[i], bodies[p], &r);
      h_assert_error(&r, 400, REQUIRED);
      h_resp_free(&r);
    }
  }
  h_context_clear();
  h_assert_db(s, 0, COUNT_RECORDS);
  h_assert_db(s, 0, "SELECT count(*) FROM resources");
  h_assert_healthy(s);
  h_server_stop(s);
}

/* Malformed keys: 400 {"error"}; the boundaries (255 characters, quoting,
 * trimming) are the same key as their plain form. */
static void test_key_malformed(void **state) {
  static const char *const bad_raw[] = {
      " a\x01"
      "b",            /* control byte */
      " caf\xc3\xa9", /* non-ASCII (UTF-8) */
      " \xff\xfe",    /* non-ASCII bytes */
      " a\x7f"
      "b",          /* DEL */
      " a b",       /* inner space */
      " a\tb",      /* inner tab */
      " \"abc",     /* unterminated quoted string */
      " \"a\"b\"",  /* quote inside a quoted string */
      " \"a\\qb\"", /* bad escape */
      " \"a b\"",   /* space, once unquoted */
      " \"\\\"",    /* escape running into the closing quote */
  };
  char long_key[300], key255[300], quoted[310], line[320];
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  h_resp_t r, first;
  (void)state;

  memset(long_key, 'k', 256);
  long_key[256] = '\0';
  for (int p = 0; p < 2; p++) {
    h_context("%s with a 256-character key", paths[p]);
    h_post(s, paths[p], tok, long_key, bodies[p], &r);
    h_assert_error(&r, 400, NULL);
    assert_string_not_equal(json_string_value(json_object_get(r.json, "error")),
                            REQUIRED);
    h_resp_free(&r);

    h_context("%s with a quoted 256-character key", paths[p]);
    snprintf(quoted, sizeof quoted, "\"%s\"", long_key);
    h_post(s, paths[p], tok, quoted, bodies[p], &r);
    h_assert_error(&r, 400, NULL);
    h_resp_free(&r);

    for (size_t i = 0; i < sizeof bad_raw / sizeof *bad_raw; i++) {
      h_context("%s with raw key #%zu", paths[p], i);
      h_raw_post(s, paths[p], tok, bad_raw[i], bodies[p], &r);
      h_assert_error(&r, 400, NULL);
      assert_string_not_equal(json_string_value(json_object_get(r.json, "error")),
                              REQUIRED);
      h_resp_free(&r);
    }
  }
  h_context_clear();
  h_assert_db(s, 0, COUNT_RECORDS);
  h_assert_db(s, 0, "SELECT count(*) FROM resources");

  /* 255 visible characters is the longest key; its quoted form is the same
   * key, so it replays. */
  for (int i = 0; i < 255; i++)
    key255[i] = (char)(0x21 + i % 94);
  key255[255] = '\0';
  for (int i = 0; i < 255; i++) /* no quote or backslash: plain and sf-string alike */
    if (key255[i] == '"' || key255[i] == '\\')
      key255[i] = 'x';
  h_context("255-character key");
  h_post(s, "/payments", tok, key255, PAYMENT, &first);
  h_assert_first(&first, 201);
  snprintf(quoted, sizeof quoted, "\"%s\"", key255);
  h_post(s, "/payments", tok, quoted, PAYMENT, &r);
  h_assert_replay_of(&r, &first);
  h_resp_free(&r);
  h_resp_free(&first);
  h_assert_db(s, 1, "SELECT count(*) FROM idempotency_records WHERE key = ?1", key255);

  /* Trimmed of spaces and tabs, and unquoted: all one key. */
  h_context("trim and unquote");
  h_post(s, "/payments", tok, "same-key-7", PAYMENT, &first);
  h_assert_first(&first, 201);
  h_raw_post(s, "/payments", tok, " \t same-key-7 \t", PAYMENT, &r);
  h_assert_replay_of(&r, &first);
  h_resp_free(&r);
  h_raw_post(s, "/payments", tok, " \"same-key-7\"", PAYMENT, &r);
  h_assert_replay_of(&r, &first);
  h_resp_free(&r);
  snprintf(line, sizeof line, "\t \"same-key-7\" \t");
  h_raw_post(s, "/payments", tok, line, PAYMENT, &r);
  h_assert_replay_of(&r, &first);
  h_resp_free(&r);
  h_resp_free(&first);
  /* An escaped quote in an sf-string is a literal quote in the key. */
  h_raw_post(s, "/payments", tok, " \"q\\\"k\"", PAYMENT, &first);
  h_assert_first(&first, 201);
  h_raw_post(s, "/payments", tok, " q\"k", PAYMENT, &r);
  h_assert_replay_of(&r, &first);
  h_resp_free(&r);
  h_resp_free(&first);

  h_context_clear();
  h_assert_db(s, 3, COUNT_RECORDS);
  h_assert_db(s, 3, COUNT_PAYMENTS);
  h_assert_healthy(s);
  h_server_stop(s);
}

/* A body that fails validation is 422 and stores nothing: the same key then
 * creates a new resource. */
static void test_validation_leaves_key_free(void **state) {
  static const char *const invalid[] = {
      "{\"amount\": 0, \"currency\": \"BRL\"}",
      "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":0,\"unit_price\":"
      "1000}]}",
  };
  static const char *const field[] = {"amount", "items[0].quantity"};
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  h_resp_t r, first;
  (void)state;

  for (int p = 0; p < 2; p++) {
    h_context("%s", paths[p]);
    h_post(s, paths[p], tok, "free-after-422", invalid[p], &r);
    h_assert_field_error(&r, field[p]);
    h_resp_free(&r);
    h_assert_db(s, p, COUNT_RECORDS);
    h_assert_db(s, p, "SELECT count(*) FROM resources");

    h_post(s, paths[p], tok, "free-after-422", bodies[p], &first);
    h_assert_first(&first, 201);
    h_assert_db(s, p + 1, COUNT_RECORDS);
    h_assert_db(s, p + 1, "SELECT count(*) FROM resources");
    /* and that is now a completed key like any other */
    h_post(s, paths[p], tok, "free-after-422", bodies[p], &r);
    h_assert_replay_of(&r, &first);
    h_resp_free(&r);
    h_resp_free(&first);
  }
  h_server_stop(s);
}

/* A new key: reserve, execute, store, answer 201 with the payment and its
 * Location; GET reads the same payment. */
static void test_new_key_payment(void **state) {
  static const char *const fields[] = {"id",       "amount", "amount_refunded", "currency",
                                       "order_id", "status", "created_at"};
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  char location[128];
  h_resp_t r, got;
  const char *id;
  char *v;
  (void)state;

  h_post(s, "/payments", tok, "new-key-1", PAYMENT, &r);
  h_assert_first(&r, 201);
  id = h_id(&r);
  assert_int_equal(strncmp(id, "pay_", 4), 0);
  assert_int_equal(json_object_size(r.json), sizeof fields / sizeof *fields);
  for (size_t i = 0; i < sizeof fields / sizeof *fields; i++)
    assert_non_null(json_object_get(r.json, fields[i]));
  assert_true(json_is_integer(json_object_get(r.json, "amount")));
  assert_int_equal(json_integer_value(json_object_get(r.json, "amount")), 15990);
  assert_string_equal(json_string_value(json_object_get(r.json, "currency")), "BRL");
  assert_string_equal(json_string_value(json_object_get(r.json, "order_id")), "ord_42");
  assert_string_equal(json_string_value(json_object_get(r.json, "status")), "succeeded");
  assert_true(json_string_length(json_object_get(r.json, "created_at")) > 0);
  snprintf(location, sizeof location, "/payments/%s", id);
  assert_string_equal(r.location, location);

  h_get(s, location, tok, &got);
  h_assert_status(&got, 200);
  assert_true(json_equal(got.json, r.json));
  h_resp_free(&got);

  h_assert_db(s, 1, COUNT_PAYMENTS);
  h_assert_db(s, 1,
              "SELECT count(*) FROM payments WHERE id = ?1 AND "
              "status = 'succeeded' AND amount = 15990 AND currency = 'BRL'",
              id);
  h_assert_db(s, 1,
              "SELECT count(*) FROM idempotency_records WHERE key = 'new-key-1' "
              "AND state = 'completed' AND response_status = 201 AND "
              "operation = 'create_payment' AND resource_id = ?1",
              id);
  v = h_db_text(s, "SELECT location FROM idempotency_records WHERE key = 'new-key-1'");
  assert_non_null(v);
  assert_string_equal(v, location);
  free(v);
  h_resp_free(&r);
  h_server_stop(s);
}

/* A completed key replays: the stored status and body plus "replayed":
 * true, the header, the same Location, and no second payment. */
static void test_replay_completed(void **state) {
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  h_resp_t first, r;
  (void)state;

  for (int p = 0; p < 2; p++) {
    h_context("%s", paths[p]);
    h_post(s, paths[p], tok, "replay-me", bodies[p], &first);
    h_assert_first(&first, 201);
    for (int i = 0; i < 3; i++) {
      h_post(s, paths[p], tok, "replay-me", bodies[p], &r);
      h_assert_replay_of(&r, &first);
      assert_string_equal(h_id(&r), h_id(&first));
      h_resp_free(&r);
    }
    h_resp_free(&first);
  }
  h_context_clear();
  h_assert_db(s, 1, COUNT_PAYMENTS);
  h_assert_db(s, 1, COUNT_ORDERS);
  h_assert_db(s, 2, COUNT_RECORDS);
  h_server_stop(s);
}

/* What the fingerprint ignores: key order, whitespace, "15990" vs 15990, an
 * omitted currency vs "BRL", and transport headers. */
static void test_fingerprint_ignores(void **state) {
  static const struct {
    const char *name, *body, *header, *content_type;
  } same[] = {
      {"key order", "{\"order_id\":\"ord_42\",\"currency\":\"BRL\",\"amount\":15990}",
       NULL, NULL},
      {"whitespace",
       "{\n  \"amount\" :\t15990 ,\r\n\"currency\":\"BRL\", \"order_id\" : "
       "\"ord_42\"\n}\n",
       NULL, NULL},
      {"amount as string",
       "{\"amount\":\"15990\",\"currency\":\"BRL\",\"order_id\":\"ord_42\"}", NULL, NULL},
      {"currency omitted", "{\"amount\":15990,\"order_id\":\"ord_42\"}", NULL, NULL},
      {"User-Agent", PAYMENT, "User-Agent: another-client/9.9", NULL},
      {"X-Request-Id", PAYMENT, "X-Request-Id: a-different-request-id", NULL},
      {"Date", PAYMENT, "Date: Tue, 01 Jan 2030 00:00:00 GMT", NULL},
      {"traceparent", PAYMENT,
       "traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", NULL},
      {"charset", PAYMENT, NULL, "application/json; charset=utf-8"},
  };
  static const struct {
    const char *name, *body;
  } same_order[] = {
      {"key order", "{\"currency\":\"BRL\",\"items\":[{\"unit_price\":1000,\"quantity\":"
                    "2,\"sku\":\"A1\"}],\"customer_id\":\"c1\"}"},
      {"strings", "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":\"2\","
                  "\"unit_price\":\"1000\"}]}"},
  };
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  h_resp_t first, r;
  (void)state;

  h_post(s, "/payments", tok, "fp-1", PAYMENT, &first);
  h_assert_first(&first, 201);
  for (size_t i = 0; i < sizeof same / sizeof *same; i++) {
    h_req_t q = {.method = "POST",
                 .path = "/payments",
                 .token = tok,
                 .key = "fp-1",
                 .body = same[i].body,
                 .content_type = same[i].content_type};
    q.headers[0] = same[i].header;
    h_context("payment: %s", same[i].name);
    h_http(s, &q, &r);
    h_assert_replay_of(&r, &first);
    h_resp_free(&r);
  }
  h_resp_free(&first);

  h_context("order");
  h_post(s, "/orders", tok, "fp-2", ORDER, &first);
  h_assert_first(&first, 201);
  for (size_t i = 0; i < sizeof same_order / sizeof *same_order; i++) {
    h_context("order: %s", same_order[i].name);
    h_post(s, "/orders", tok, "fp-2", same_order[i].body, &r);
    h_assert_replay_of(&r, &first);
    h_resp_free(&r);
  }
  h_resp_free(&first);
  h_context_clear();
  h_assert_db(s, 1, COUNT_PAYMENTS);
  h_assert_db(s, 1, COUNT_ORDERS);
  h_server_stop(s);
}

/* A key reused with a different request: 422, nothing executed, and the
 * original answer is untouched. */
static void test_different_fingerprint(void **state) {
  static const char *const other_payments[] = {
      "{\"amount\": 15991, \"currency\": \"BRL\", \"order_id\": \"ord_42\"}",
      "{\"amount\": 15990, \"currency\": \"USD\", \"order_id\": \"ord_42\"}",
      "{\"amount\": 15990, \"currency\": \"BRL\", \"order_id\": \"ord_43\"}",
      "{\"amount\": 15990, \"currency\": \"BRL\"}",
  };
  static const char *const other_orders[] = {
      "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":3,\"unit_price\":"
      "1000}]}",
      "{\"customer_id\":\"c2\",\"items\":[{\"sku\":\"A1\",\"quantity\":2,\"unit_price\":"
      "1000}]}",
      "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":2,\"unit_price\":"
      "1000},"
      "{\"sku\":\"B2\",\"quantity\":1,\"unit_price\":5}]}",
  };
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  h_resp_t first, r;
  char *fp_before, *fp_after;
  (void)state;

  h_post(s, "/payments", tok, "mismatch-1", PAYMENT, &first);
  h_assert_first(&first, 201);
  fp_before = h_db_text(
      s, "SELECT fingerprint FROM idempotency_records WHERE key = 'mismatch-1'");
  for (size_t i = 0; i < sizeof other_payments / sizeof *other_payments; i++) {
    h_context("payment #%zu", i);
    h_post(s, "/payments", tok, "mismatch-1", other_payments[i], &r);
    h_assert_error(&r, 422, MISMATCH);
    assert_string_equal(r.replayed, "");
    h_resp_free(&r);
  }
  h_context_clear();
  h_assert_db(s, 1, COUNT_PAYMENTS);
  h_assert_db(s, 1, COUNT_RECORDS);
  fp_after = h_db_text(
      s, "SELECT fingerprint FROM idempotency_records WHERE key = 'mismatch-1'");
  assert_non_null(fp_before);
  assert_non_null(fp_after);
  assert_string_equal(fp_before, fp_after);
  free(fp_before);
  free(fp_after);
  h_post(s, "/payments", tok, "mismatch-1", PAYMENT, &r);
  h_assert_replay_of(&r, &first);
  h_resp_free(&r);
  h_resp_free(&first);

  h_post(s, "/orders", tok, "mismatch-2", ORDER, &first);
  h_assert_first(&first, 201);
  for (size_t i = 0; i < sizeof other_orders / sizeof *other_orders; i++) {
    h_context("order #%zu", i);
    h_post(s, "/orders", tok, "mismatch-2", other_orders[i], &r);
    h_assert_error(&r, 422, MISMATCH);
    h_resp_free(&r);
  }
  h_context_clear();
  h_post(s, "/orders", tok, "mismatch-2", ORDER, &r);
  h_assert_replay_of(&r, &first);
  h_resp_free(&r);
  h_resp_free(&first);
  h_assert_db(s, 1, COUNT_ORDERS);
  h_assert_db(s, 2, COUNT_RECORDS);
  h_server_stop(s);
}

/* An order: 201 with its total and Location, one row, replayed. */
static void test_new_order(void **state) {
  static const char *const fields[] = {"id",    "customer_id", "items",     "currency",
                                       "total", "status",      "created_at"};
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  json_t *items;
  char location[128];
  h_resp_t r, got;
  const char *id;
  (void)state;

  h_post(s, "/orders", tok, "order-1", ORDER, &r);
  h_assert_first(&r, 201);
  id = h_id(&r);
  assert_int_equal(strncmp(id, "ord_", 4), 0);
  assert_int_equal(json_object_size(r.json), sizeof fields / sizeof *fields);
  for (size_t i = 0; i < sizeof fields / sizeof *fields; i++)
    assert_non_null(json_object_get(r.json, fields[i]));
  assert_string_equal(json_string_value(json_object_get(r.json, "customer_id")), "c1");
  assert_string_equal(json_string_value(json_object_get(r.json, "currency")), "BRL");
  assert_string_equal(json_string_value(json_object_get(r.json, "status")), "created");
  assert_int_equal(json_integer_value(json_object_get(r.json, "total")), 2000);
  items = json_loads("[{\"sku\":\"A1\",\"quantity\":2,\"unit_price\":1000}]", 0, NULL);
  assert_true(json_equal(json_object_get(r.json, "items"), items));
  json_decref(items);
  snprintf(location, sizeof location, "/orders/%s", id);
  assert_string_equal(r.location, location);

  h_get(s, location, tok, &got);
  h_assert_status(&got, 200);
  assert_true(json_equal(got.json, r.json));
  h_resp_free(&got);
  h_assert_db(s, 1, COUNT_ORDERS);
  h_assert_db(s, 1,
              "SELECT count(*) FROM orders WHERE id = ?1 AND total = 2000 "
              "AND customer_id = 'c1' AND status = 'created'",
              id);
  h_resp_free(&r);

  /* Several items, digit strings: the total is the sum of the lines. */
  h_post(
      s, "/orders", tok, "order-2",
      "{\"customer_id\":\"c9\",\"items\":[{\"sku\":\"A1\",\"quantity\":2,\"unit_price\":"
      "1000},"
      "{\"sku\":\"B2\",\"quantity\":\"3\",\"unit_price\":\"250\"}],\"currency\":\"USD\"}",
      &r);
  h_assert_first(&r, 201);
  assert_int_equal(json_integer_value(json_object_get(r.json, "total")), 2750);
  assert_string_equal(json_string_value(json_object_get(r.json, "currency")), "USD");
  h_resp_free(&r);
  h_assert_db(s, 2, COUNT_ORDERS);
  h_assert_db(s, 0, COUNT_PAYMENTS);
  h_server_stop(s);
}

/* A request sent from a thread, for the in-flight tests. */
struct bg {
  h_server_t *s;
  const char *tok, *key, *body;
  h_resp_t resp;
  pthread_t thread;
};

static void *bg_main(void *p) {
  struct bg *b = p;
  h_post(b->s, "/payments", b->tok, b->key, b->body, &b->resp);
  return NULL;
}

static void bg_start(struct bg *b) {
  assert_int_equal(pthread_create(&b->thread, NULL, bg_main, b), 0);
}

/* Blocks until the key's record is `processing`: the first request owns it
 * and is at the provider. */
static void wait_processing(h_server_t *s, const char *key) {
  if (!h_db_wait(s, 10000,
                 "SELECT count(*) FROM idempotency_records WHERE key = ?1 AND "
                 "state = 'processing'",
                 key))
    fail_msg("the first request never reserved its key");
}

/* Same key, same request, still processing: the duplicate waits and is
 * woken when the first finishes, then replays. */
static void test_inflight_wait_then_replay(void **state) {
  static const char *const flags[] = {"--sandbox-delay", "1s", NULL};
  h_server_t *s = h_server_start(flags);
  struct bg first = {.s = s, .key = "inflight-1", .body = PAYMENT};
  h_resp_t dup;
  (void)state;

  first.tok = h_tenant(s, "acme");
  bg_start(&first);
  wait_processing(s, "inflight-1");
  h_post(s, "/payments", first.tok, "inflight-1", PAYMENT, &dup);
  pthread_join(first.thread, NULL);

  h_assert_first(&first.resp, 201);
  h_assert_replay_of(&dup, &first.resp);
  /* It really waited (the provider still had most of its second to go)... */
  assert_true(dup.seconds > 0.5);
  /* ...and was woken by the first one's completion, not by the 5 s bound. */
  if (dup.t_end - first.resp.t_end > 0.5)
    fail_msg("duplicate answered %.3f s after the first", dup.t_end - first.resp.t_end);
  h_assert_db(s, 1, COUNT_PAYMENTS);
  h_resp_free(&dup);
  h_resp_free(&first.resp);
  h_server_stop(s);
}

/* Still processing at the bound: 409 with Retry-After; the first request
 * is unaffected and later retries replay it. */
static void test_inflight_409_at_bound(void **state) {
  static const char *const flags[] = {"--sandbox-delay", "2s", "--inflight-wait", "200ms",
                                      NULL};
  h_server_t *s = h_server_start(flags);
  struct bg first = {.s = s, .key = "inflight-2", .body = PAYMENT};
  h_resp_t dup, later;
  char *end;
  long retry;
  (void)state;

  first.tok = h_tenant(s, "acme");
  bg_start(&first);
  wait_processing(s, "inflight-2");
  h_post(s, "/payments", first.tok, "inflight-2", PAYMENT, &dup);
  h_assert_error(&dup, 409, NULL);
  assert_true(dup.retry_after[0] != '\0');
  retry = strtol(dup.retry_after, &end, 10);
  assert_true(*end == '\0' && retry >= 1);
  assert_string_equal(dup.replayed, "");
  /* It waited for the bound, not for the provider. */
  assert_true(dup.seconds >= 0.15);
  assert_true(dup.seconds < 1.5);

  pthread_join(first.thread, NULL);
  h_assert_first(&first.resp, 201);
  h_post(s, "/payments", first.tok, "inflight-2", PAYMENT, &later);
  h_assert_replay_of(&later, &first.resp);
  h_assert_db(s, 1, COUNT_PAYMENTS);
  h_resp_free(&later);
  h_resp_free(&dup);
  h_resp_free(&first.resp);
  h_server_stop(s);
}

/* The provider's outcome is unknown: 202 with the pending payment and its
 * Location, replayed as 202, and never a second payment. */
static void test_pending_202(void **state) {
  /* The reconciler would settle it (docs/idempotency.md, section 4.3): keep
   * it away. */
  static const char *const flags[] = {"--sandbox-uncertain-amount", "7070",
                                      "--reconcile-interval", "1h", NULL};
  h_server_t *s = h_server_start(flags);
  const char *tok = h_tenant(s, "acme");
  char location[128];
  h_resp_t first, r;
  (void)state;

  h_post(s, "/payments", tok, "pending-1", "{\"amount\": 7070}", &first);
  h_assert_first(&first, 202);
  assert_string_equal(json_string_value(json_object_get(first.json, "status")),
                      "pending");
  snprintf(location, sizeof location, "/payments/%s", h_id(&first));
  assert_string_equal(first.location, location);
  for (int i = 0; i < 3; i++) {
    h_post(s, "/payments", tok, "pending-1",
           "{\"amount\": \"7070\", \"currency\": \"BRL\"}", &r);
    h_assert_replay_of(&r, &first);
    h_resp_free(&r);
  }
  h_get(s, location, tok, &r);
  h_assert_status(&r, 200);
  assert_string_equal(json_string_value(json_object_get(r.json, "status")), "pending");
  h_resp_free(&r);
  h_assert_db(s, 1, COUNT_PAYMENTS);
  h_assert_db(s, 1, "SELECT count(*) FROM payments WHERE status = 'pending' AND id = ?1",
              h_id(&first));
  h_assert_db(s, 1,
              "SELECT count(*) FROM idempotency_records WHERE key = 'pending-1' "
              "AND state = 'pending' AND response_status = 202");
  /* A different payment on the same key is still a mismatch. */
  h_post(s, "/payments", tok, "pending-1", "{\"amount\": 7071}", &r);
  h_assert_error(&r, 422, MISMATCH);
  h_resp_free(&r);
  h_assert_db(s, 1, COUNT_PAYMENTS);
  h_resp_free(&first);
  h_server_stop(s);
}

/* Once the reconciler settles a pending payment, replays of its key answer
 * with the settled payment (201), still the same one. */
static void test_pending_settled_then_replayed(void **state) {
  static const char *const flags[] = {"--sandbox-uncertain-amount", "7070",
                                      "--reconcile-interval", "100ms", NULL};
  h_server_t *s = h_server_start(flags);
  const char *tok = h_tenant(s, "acme");
  h_resp_t first, r;
  (void)state;

  h_post(s, "/payments", tok, "pending-2", "{\"amount\": 7070}", &first);
  h_assert_first(&first, 202);
  if (!h_db_wait(s, 15000,
                 "SELECT count(*) FROM idempotency_records WHERE "
                 "key = 'pending-2' AND state = 'completed'"))
    fail_msg("the reconciler did not settle the pending payment");
  h_post(s, "/payments", tok, "pending-2", "{\"amount\": 7070}", &r);
  h_assert_status(&r, 201);
  assert_string_equal(r.replayed, "true");
  assert_true(json_is_true(json_object_get(r.json, "replayed")));
  assert_string_equal(h_id(&r), h_id(&first));
  assert_string_equal(r.location, first.location);
  assert_string_equal(json_string_value(json_object_get(r.json, "status")), "succeeded");
  h_resp_free(&r);
  h_get(s, first.location, tok, &r);
  h_assert_status(&r, 200);
  assert_string_equal(json_string_value(json_object_get(r.json, "status")), "succeeded");
  h_resp_free(&r);
  h_assert_db(s, 1, COUNT_PAYMENTS);
  h_assert_db(s, 0, "SELECT count(*) FROM outbox");
  h_resp_free(&first);
  h_server_stop(s);
}

/* A decline is a final answer: 402, stored and replayed as 402. */
static void test_declined_402(void **state) {
  static const char *const flags[] = {"--sandbox-decline-amount", "4040", NULL};
  h_server_t *s = h_server_start(flags);
  const char *tok = h_tenant(s, "acme");
  h_resp_t first, r;
  (void)state;

  h_post(s, "/payments", tok, "declined-1", "{\"amount\": 4040}", &first);
  h_assert_first(&first, 402);
  assert_string_equal(json_string_value(json_object_get(first.json, "status")),
                      "declined");
  assert_int_equal(strncmp(h_id(&first), "pay_", 4), 0);
  h_post(s, "/payments", tok, "declined-1", "{\"amount\": 4040}", &r);
  h_assert_replay_of(&r, &first);
  h_resp_free(&r);
  h_assert_db(s, 1, COUNT_PAYMENTS);
  h_assert_db(s, 1, "SELECT count(*) FROM payments WHERE status = 'declined'");
  h_assert_db(s, 1,
              "SELECT count(*) FROM idempotency_records WHERE state = 'completed' "
              "AND response_status = 402");
  h_resp_free(&first);
  h_server_stop(s);
}

/* The provider could not be reached: 503, the record is failed, and the
 * same request executes again under the same key (not a replay); once the
 * provider is back it succeeds. */
static void test_failed_executes_again(void **state) {
  static const char *const down[] = {"--sandbox-unavailable-amount", "5030", NULL};
  static const char *const body = "{\"amount\": 5030, \"order_id\": \"ord_9\"}";
  h_server_t *s = h_server_start(down);
  const char *tok = h_tenant(s, "acme");
  h_resp_t r, first;
  char *v;
  (void)state;

  post_rid(s, "/payments", tok, "failed-1", body, "attempt-1", &r);
  h_assert_error(&r, 503, NULL);
  assert_string_equal(r.replayed, "");
  h_resp_free(&r);
  h_assert_db(s, 1,
              "SELECT count(*) FROM idempotency_records WHERE key = 'failed-1' "
              "AND state = 'failed' AND correlation_id = 'attempt-1'");

  post_rid(s, "/payments", tok, "failed-1", body, "attempt-2", &r);
  h_assert_error(&r, 503, NULL);
  assert_string_equal(r.replayed, "");
  h_resp_free(&r);
  /* The record was taken over by the second attempt. */
  v = h_db_text(s,
                "SELECT correlation_id FROM idempotency_records WHERE key = 'failed-1'");
  assert_non_null(v);
  assert_string_equal(v, "attempt-2");
  free(v);
  h_assert_db(s, 0, "SELECT count(*) FROM payments WHERE status = 'succeeded'");
  h_server_stop(s);

  /* The provider is reachable again. */
  h_server_restart(s, NULL);
  post_rid(s, "/payments", tok, "failed-1", body, "attempt-3", &first);
  h_assert_first(&first, 201);
  assert_string_equal(json_string_value(json_object_get(first.json, "status")),
                      "succeeded");
  h_assert_db(s, 1,
              "SELECT count(*) FROM idempotency_records WHERE key = 'failed-1' "
              "AND state = 'completed' AND correlation_id = 'attempt-3'");
  post_rid(s, "/payments", tok, "failed-1", body, "attempt-4", &r);
  h_assert_replay_of(&r, &first);
  h_resp_free(&r);
  h_assert_db(s, 1, "SELECT count(*) FROM payments WHERE status = 'succeeded'");
  h_resp_free(&first);
  h_server_stop(s);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_key_missing_or_blank, h_teardown),
      cmocka_unit_test_teardown(test_key_malformed, h_teardown),
      cmocka_unit_test_teardown(test_validation_leaves_key_free, h_teardown),
      cmocka_unit_test_teardown(test_new_key_payment, h_teardown),
      cmocka_unit_test_teardown(test_replay_completed, h_teardown),
      cmocka_unit_test_teardown(test_fingerprint_ignores, h_teardown),
      cmocka_unit_test_teardown(test_different_fingerprint, h_teardown),
      cmocka_unit_test_teardown(test_new_order, h_teardown),
      cmocka_unit_test_teardown(test_inflight_wait_then_replay, h_teardown),
      cmocka_unit_test_teardown(test_inflight_409_at_bound, h_teardown),
      cmocka_unit_test_teardown(test_pending_202, h_teardown),
      cmocka_unit_test_teardown(test_pending_settled_then_replayed, h_teardown),
      cmocka_unit_test_teardown(test_declined_402, h_teardown),
      cmocka_unit_test_teardown(test_failed_executes_again, h_teardown),
  };
  int rc;
  h_init(argc, argv);
  rc = cmocka_run_group_tests_name("integration: idempotency rules", tests, NULL, NULL);
  curl_global_cleanup();
  return rc;
}
