/* The order routes that are idempotent by design, without a key
 * (docs/idempotency.md, section 3.5): PUT /orders/{id} with a client's
 * id, decided by the unique key (tenant, id), and POST
 * /orders/{id}/cancel, which sets a state. On SQLite and PostgreSQL
 * alike. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"

#define ORDER                                                                            \
  "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":2,"                   \
  "\"unit_price\":1000},{\"sku\":\"B2\",\"quantity\":1,\"unit_price\":5}],"              \
  "\"currency\":\"BRL\"}"
/* The same command: keys reordered, a digit string, the default currency. */
#define ORDER_RESPELLED                                                                  \
  "{\"items\":[{\"unit_price\":1000,\"sku\":\"A1\",\"quantity\":\"2\"},"                 \
  "{\"quantity\":1,\"unit_price\":\"5\",\"sku\":\"B2\"}],\"customer_id\":\"c1\"}"
/* Other commands: another quantity; the items in another order. */
#define ORDER_OTHER                                                                      \
  "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":3,"                   \
  "\"unit_price\":1000},{\"sku\":\"B2\",\"quantity\":1,\"unit_price\":5}]}"
#define ORDER_SWAPPED                                                                    \
  "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"B2\",\"quantity\":1,"                   \
  "\"unit_price\":5},{\"sku\":\"A1\",\"quantity\":2,\"unit_price\":1000}]}"

#define ALL_ROWS "SELECT (SELECT count(*) FROM resources) + (SELECT count(*) FROM " \
                 "idempotency_records)"

static void put(h_server_t *s, const char *id, const char *tok, const char *body,
                h_resp_t *out) {
  char path[256];
  h_req_t q = {.method = "PUT", .path = path, .token = tok, .body = body};
  snprintf(path, sizeof path, "/orders/%s", id);
  h_http(s, &q, out);
}

static void cancel(h_server_t *s, const char *id, const char *tok, h_resp_t *out) {
  char path[256];
  h_req_t q = {.method = "POST", .path = path, .token = tok, .body = ""};
  snprintf(path, sizeof path, "/orders/%s/cancel", id);
  h_http(s, &q, out);
}

static const char *str(const h_resp_t *r, const char *name) {
  const char *v = json_string_value(json_object_get(r->json, name));
  if (v == NULL)
    fail_msg("no \"%s\" in %s", name, r->body ? r->body : "(no body)");
  return v;
}

/* 201 with Location on the first PUT; 200 with the very same body for the
 * same command however spelled; 409 for another command (the items'
 * order counts). An Idempotency-Key, even a malformed one, is ignored:
 * no record is kept. GET reads the order; a PUT over an id POST /orders
 * made compares with that order. */
static void test_put(void **state) {
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "shop");
  h_resp_t first, r;
  (void)state;

  put(s, "ord_client-1_A", tok, ORDER, &first);
  h_assert_first(&first, 201);
  assert_string_equal(first.location, "/orders/ord_client-1_A");
  assert_string_equal(h_id(&first), "ord_client-1_A");
  assert_string_equal(str(&first, "status"), "created");
  assert_string_equal(str(&first, "currency"), "BRL");
  assert_int_equal(json_integer_value(json_object_get(first.json, "total")), 2005);
  assert_int_equal(json_array_size(json_object_get(first.json, "items")), 2);

  sleep(1); /* a second PUT that made a new order would show a new created_at */
  put(s, "ord_client-1_A", tok, ORDER_RESPELLED, &r);
  h_assert_status(&r, 200);
  assert_string_equal(r.body, first.body);
  assert_string_equal(r.replayed, "");
  h_resp_free(&r);
  {
    h_req_t q = {.method = "PUT", .path = "/orders/ord_client-1_A", .token = tok,
                 .key = "bad key\x01", .body = ORDER};
    h_http(s, &q, &r);
    h_assert_status(&r, 200);
    assert_string_equal(r.body, first.body);
    h_resp_free(&r);
  }
  put(s, "ord_client-1_A", tok, ORDER_OTHER, &r);
  h_assert_error(&r, 409, "order exists with different content");
  h_resp_free(&r);
  put(s, "ord_client-1_A", tok, ORDER_SWAPPED, &r);
  h_assert_error(&r, 409, "order exists with different content");
  h_resp_free(&r);

  h_get(s, "/orders/ord_client-1_A", tok, &r);
  h_assert_status(&r, 200);
  assert_string_equal(r.body, first.body);
  h_resp_free(&r);
  h_assert_db(s, 1, "SELECT count(*) FROM orders");
  h_assert_db(s, 0, "SELECT count(*) FROM idempotency_records");

  /* An id that POST /orders made: the same command is 200, another 409. */
  {
    h_resp_t made;
    char id[128];
    h_post(s, "/orders", tok, "cart-1", ORDER, &made);
    h_assert_first(&made, 201);
    snprintf(id, sizeof id, "%s", h_id(&made));
    put(s, id, tok, ORDER_RESPELLED, &r);
    h_assert_status(&r, 200);
    assert_string_equal(r.body, made.body);
    h_resp_free(&r);
    put(s, id, tok, ORDER_OTHER, &r);
    h_assert_error(&r, 409, "order exists with different content");
    h_resp_free(&r);
    h_resp_free(&made);
  }
  /* The longest id: ord_ and 64. */
  {
    char id[80] = "ord_";
    memset(id + 4, 'z', 64);
    id[68] = '\0';
    put(s, id, tok, ORDER, &r);
    h_assert_first(&r, 201);
    assert_string_equal(h_id(&r), id);
    h_resp_free(&r);
  }
  h_assert_db(s, 3, "SELECT count(*) FROM orders");
  h_resp_free(&first);
  h_server_stop(s);
}

/* Ids are a tenant's: two tenants may both have ord_same, with different
 * content; each reads and cancels its own, and never the other's. */
static void test_ids_per_tenant(void **state) {
  h_server_t *s = h_server_start(NULL);
  const char *a = h_tenant(s, "tenant-a");
  const char *b = h_tenant(s, "tenant-b");
  h_resp_t ra, rb, r;
  (void)state;

  put(s, "ord_same", a, ORDER, &ra);
  h_assert_first(&ra, 201);
  put(s, "ord_same", b, ORDER_OTHER, &rb);
  h_assert_first(&rb, 201);
  assert_string_not_equal(ra.body, rb.body);
  h_get(s, "/orders/ord_same", a, &r);
  assert_string_equal(r.body, ra.body);
  h_resp_free(&r);
  h_get(s, "/orders/ord_same", b, &r);
  assert_string_equal(r.body, rb.body);
  h_resp_free(&r);

  cancel(s, "ord_same", b, &r);
  h_assert_status(&r, 200);
  assert_string_equal(str(&r, "status"), "cancelled");
  h_resp_free(&r);
  h_get(s, "/orders/ord_same", a, &r);
  assert_string_equal(r.body, ra.body);
  h_resp_free(&r);
  cancel(s, "ord_only-a", a, &r); /* no such order of a's */
  h_assert_error(&r, 404, "order not found");
  h_resp_free(&r);
  put(s, "ord_only-a", a, ORDER, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);
  cancel(s, "ord_only-a", b, &r);
  h_assert_error(&r, 404, "order not found");
  h_resp_free(&r);
  h_get(s, "/orders/ord_only-a", b, &r);
  h_assert_error(&r, 404, "order not found");
  h_resp_free(&r);
  h_assert_db(s, 3, "SELECT count(*) FROM orders");
  h_assert_db(s, 1, "SELECT count(*) FROM orders WHERE status = 'cancelled'");
  h_resp_free(&ra);
  h_resp_free(&rb);
  h_server_stop(s);
}

/* Bad input changes nothing and answers a clear 4xx, in the order of the
 * checks: a malformed id 400, the body's 413, 415 and 400, the fields'
 * 422 as POST /orders has them; methods the paths do not take 405. */
static void test_bad_input(void **state) {
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "shop");
  char big[70 * 1024 + 64], long_id[80] = "ord_";
  h_resp_t r;
  (void)state;

  memset(long_id + 4, 'a', 65);
  long_id[69] = '\0';
  snprintf(big, sizeof big, "{\"customer_id\":\"%0*d\"}", 70 * 1024, 0);
  {
    static const char *const bad_ids[] = {"ord_", "abc", "ORD_x", "ord_a.b",
                                          "ord_a:b", "pay_x"};
    for (size_t i = 0; i < sizeof bad_ids / sizeof *bad_ids; i++) {
      h_context("PUT /orders/%s", bad_ids[i]);
      put(s, bad_ids[i], tok, ORDER, &r);
      h_assert_error(&r, 400,
                     "order id must be ord_ followed by 1 to 64 of A-Z a-z 0-9 _ -");
      h_resp_free(&r);
    }
    h_context("PUT a 65-character id");
    put(s, long_id, tok, ORDER, &r);
    h_assert_error(&r, 400, NULL);
    h_resp_free(&r);
  }
  {
    static const struct {
      const char *body, *field;
    } bad_fields[] = {
        {"{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":0,"
         "\"unit_price\":1}]}",
         "items[0].quantity"},
        {"{\"customer_id\":\"c1\",\"items\":[]}", "items"},
        {"{\"items\":[{\"sku\":\"A1\",\"quantity\":1,\"unit_price\":1}]}", "customer_id"},
        {"{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":1,"
         "\"unit_price\":1.5}]}",
         "items[0].unit_price"},
        {"{\"customer_id\":\"c1\",\"currency\":\"brl\",\"items\":[{\"sku\":\"A1\","
         "\"quantity\":1,\"unit_price\":1}]}",
         "currency"},
        {"{\"customer_id\":\"c1\",\"id\":\"ord_x\",\"items\":[{\"sku\":\"A1\","
         "\"quantity\":1,\"unit_price\":1}]}",
         "id"},
    };
    for (size_t i = 0; i < sizeof bad_fields / sizeof *bad_fields; i++) {
      h_context("PUT with a bad %s", bad_fields[i].field);
      put(s, "ord_x", tok, bad_fields[i].body, &r);
      h_assert_field_error(&r, bad_fields[i].field);
      h_resp_free(&r);
    }
  }
  {
    const struct {
      const char *method, *path, *ctype, *body;
      long status;
      const char *message;
    } bad[] = {
        {"PUT", "/orders/ord_x", "text/plain", ORDER, 415,
         "Content-Type must be application/json"},
        {"PUT", "/orders/ord_x", NULL, "", 400, NULL},
        {"PUT", "/orders/ord_x", NULL, "{not json", 400, "request body is not valid JSON"},
        {"PUT", "/orders/ord_x", NULL, "[1]", 400, "request body must be a JSON object"},
        {"PUT", "/orders/ord_x", NULL, big, 413, "request body is larger than 64 KiB"},
        {"POST", "/orders/ord_x/cancel", "text/plain", "", 415, NULL},
        {"POST", "/orders/ord_x/cancel", H_NO_CONTENT_TYPE, "", 415, NULL},
        {"POST", "/orders/ord_x/cancel", NULL, "[]", 400, NULL},
        {"POST", "/orders/ord_x/cancel", NULL, big, 413, NULL},
        {"DELETE", "/orders/ord_x", NULL, NULL, 405, "method not allowed"},
        {"PATCH", "/orders/ord_x", NULL, ORDER, 405, "method not allowed"},
        {"GET", "/orders/ord_x/cancel", NULL, NULL, 405, "method not allowed"},
        {"PUT", "/orders/ord_x/cancel", NULL, ORDER, 405, "method not allowed"},
        {"PUT", "/orders", NULL, ORDER, 405, "method not allowed"},
        {"POST", "/orders/ord_x/cancel/x", NULL, "", 404, "not found"},
        {"POST", "/orders//cancel", NULL, "", 404, "not found"},
        {"PUT", "/orders/ord_a%20b", NULL, ORDER, 404, "not found"},
        {"PUT", "/orders/ord_%C3%A9", NULL, ORDER, 404, "not found"},
        /* a NUL would end the id at ord_a */
        {"PUT", "/orders/ord_a%00b", NULL, ORDER, 400,
         "order id must be ord_ followed by 1 to 64 of A-Z a-z 0-9 _ -"},
        {"POST", "/orders/ord_a%00b/cancel", NULL, "", 404, "order not found"},
        {"PUT", "/orders/ord_x/", NULL, ORDER, 404, "not found"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
      h_req_t q = {.method = bad[i].method, .path = bad[i].path, .token = tok,
                   .content_type = bad[i].ctype, .body = bad[i].body};
      h_context("%s %s (%s)", bad[i].method, bad[i].path, bad[i].ctype ? bad[i].ctype : "-");
      h_http(s, &q, &r);
      h_assert_error(&r, bad[i].status, bad[i].message);
      if (bad[i].status == 405)
        assert_string_equal(r.allow, strstr(bad[i].path, "/cancel") ? "POST"
                                     : strcmp(bad[i].path, "/orders") == 0 ? "POST"
                                                                          : "GET, HEAD, PUT");
      h_resp_free(&r);
    }
  }
  /* Credentials, before any of it. */
  put(s, "bad", NULL, "[", &r);
  h_assert_error(&r, 401, "missing or invalid API key");
  assert_string_equal(r.www_authenticate, "Bearer");
  h_resp_free(&r);
  cancel(s, "ord_x", "idem_wrong", &r);
  h_assert_error(&r, 401, NULL);
  h_resp_free(&r);
  h_context_clear();
  h_assert_db(s, 0, ALL_ROWS);

  /* A cancellation takes no field; with one, nothing is cancelled. */
  put(s, "ord_x", tok, ORDER, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);
  {
    /* Not ord_x: an id cut short at a NUL would be. */
    h_req_t q = {.method = "GET", .path = "/orders/ord_x%00zz", .token = tok};
    h_http(s, &q, &r);
    h_assert_error(&r, 404, "order not found");
    h_resp_free(&r);
  }
  {
    h_req_t q = {.method = "POST", .path = "/orders/ord_x/cancel", .token = tok,
                 .body = "{\"reason\":\"changed my mind\"}"};
    h_http(s, &q, &r);
    h_assert_field_error(&r, "reason");
    h_resp_free(&r);
  }
  cancel(s, "bad.id", tok, &r);
  h_assert_error(&r, 404, "order not found");
  h_resp_free(&r);
  h_assert_db(s, 0, "SELECT count(*) FROM orders WHERE status <> 'created'");
  h_server_stop(s);
}

/* Twenty PUTs of one id at once: one order, one 201 and nineteen 200, all
 * with the same body; the metrics and logs name the operation. */
static void test_put_race(void **state) {
  enum { N = 20 };
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "shop");
  h_req_t reqs[N];
  h_resp_t out[N], m;
  int created = 0, same = 0;
  char line[128];
  (void)state;

  for (int i = 0; i < N; i++)
    reqs[i] = (h_req_t){.method = "PUT", .path = "/orders/ord_race", .token = tok,
                        .body = i % 2 ? ORDER : ORDER_RESPELLED};
  h_together(s, reqs, N, out);
  for (int i = 0; i < N; i++) {
    h_context("PUT %d", i);
    if (out[i].status == 201)
      created++;
    else
      h_assert_status(&out[i], 200);
    same += out[i].body && out[0].body && strcmp(out[i].body, out[0].body) == 0;
  }
  h_context_clear();
  assert_int_equal(created, 1);
  assert_int_equal(same, N);
  assert_string_equal(h_id(&out[0]), "ord_race");
  h_assert_db(s, 1, "SELECT count(*) FROM orders WHERE id = 'ord_race'");
  h_get(s, "/metrics", NULL, &m);
  h_assert_status(&m, 200);
  snprintf(line, sizeof line, "idem_requests_total{operation=\"put_order\",outcome=\"new\"} 1\n");
  assert_non_null(strstr(m.body, line));
  snprintf(line, sizeof line,
           "idem_requests_total{operation=\"put_order\",outcome=\"replay\"} %d\n", N - 1);
  assert_non_null(strstr(m.body, line));
  h_resp_free(&m);
  h_server_stop(s);
  {
    char *log = h_read_file(s->log, NULL);
    assert_non_null(log);
    assert_non_null(strstr(log, "\"operation\":\"put_order\""));
    free(log);
  }
  for (int i = 0; i < N; i++)
    h_resp_free(&out[i]);
}

/* Cancelling sets a state: 200 with the order cancelled and cancelled_at
 * (created_at's format); again, later, the same body; GET shows it; the
 * key's replay of POST /orders still answers what was created. Twenty at
 * once all answer one cancelled_at. */
static void test_cancel(void **state) {
  enum { N = 20 };
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "shop");
  h_resp_t made, first, r, m;
  h_req_t reqs[N];
  h_resp_t out[N];
  char path[160];
  (void)state;

  h_post(s, "/orders", tok, "cart-1", ORDER, &made);
  h_assert_first(&made, 201);
  cancel(s, h_id(&made), tok, &first);
  h_assert_status(&first, 200);
  assert_string_equal(h_id(&first), h_id(&made));
  assert_string_equal(str(&first, "status"), "cancelled");
  assert_int_equal(strlen(str(&first, "cancelled_at")), strlen(str(&made, "created_at")));
  assert_int_equal(str(&first, "cancelled_at")[4], '-');
  assert_int_equal(str(&first, "cancelled_at")[strlen(str(&made, "created_at")) - 1], 'Z');
  assert_true(strcmp(str(&first, "cancelled_at"), str(&made, "created_at")) >= 0);
  {
    /* All but status and cancelled_at as created. */
    json_t *was = json_deep_copy(made.json), *now = json_deep_copy(first.json);
    json_object_del(was, "status");
    json_object_del(now, "status");
    json_object_del(now, "cancelled_at");
    assert_true(json_equal(was, now));
    json_decref(was);
    json_decref(now);
  }
  sleep(1); /* a second cancellation that stamped again would show it */
  cancel(s, h_id(&made), tok, &r);
  h_assert_status(&r, 200);
  assert_string_equal(r.body, first.body);
  h_resp_free(&r);
  {
    h_req_t q = {.method = "POST", .token = tok, .key = "ignored", .body = "{}"};
    snprintf(path, sizeof path, "/orders/%s/cancel", h_id(&made));
    q.path = path;
    h_http(s, &q, &r);
    h_assert_status(&r, 200);
    assert_string_equal(r.body, first.body);
    h_resp_free(&r);
  }
  snprintf(path, sizeof path, "/orders/%s", h_id(&made));
  h_get(s, path, tok, &r);
  h_assert_status(&r, 200);
  assert_string_equal(r.body, first.body);
  h_resp_free(&r);
  h_post(s, "/orders", tok, "cart-1", ORDER, &r);
  h_assert_replay_of(&r, &made);
  h_resp_free(&r);
  h_assert_db(s, 1, "SELECT count(*) FROM orders WHERE status = 'cancelled'");
  h_assert_db(s, 1, "SELECT count(*) FROM idempotency_records");

  /* A PUT of a cancelled order's command answers it as it stands. */
  put(s, "ord_put-then-cancel", tok, ORDER, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);
  for (int i = 0; i < N; i++)
    reqs[i] = (h_req_t){.method = "POST", .path = "/orders/ord_put-then-cancel/cancel",
                        .token = tok, .body = i % 2 ? "" : "{}"};
  h_together(s, reqs, N, out);
  for (int i = 0; i < N; i++) {
    h_context("cancel %d", i);
    h_assert_status(&out[i], 200);
    assert_string_equal(out[i].body, out[0].body);
  }
  h_context_clear();
  assert_string_equal(str(&out[0], "status"), "cancelled");
  put(s, "ord_put-then-cancel", tok, ORDER_RESPELLED, &r);
  h_assert_status(&r, 200);
  assert_string_equal(r.body, out[0].body);
  h_resp_free(&r);
  h_get(s, "/metrics", NULL, &m);
  assert_non_null(
      strstr(m.body, "idem_requests_total{operation=\"cancel_order\",outcome=\"new\"} 2\n"));
  h_resp_free(&m);
  for (int i = 0; i < N; i++)
    h_resp_free(&out[i]);
  h_resp_free(&made);
  h_resp_free(&first);
  h_server_stop(s);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_put, h_teardown),
      cmocka_unit_test_teardown(test_ids_per_tenant, h_teardown),
      cmocka_unit_test_teardown(test_bad_input, h_teardown),
      cmocka_unit_test_teardown(test_put_race, h_teardown),
      cmocka_unit_test_teardown(test_cancel, h_teardown),
  };
  int rc;
  h_init(argc, argv);
  rc = cmocka_run_group_tests_name("integration: orders without a key", tests, NULL, NULL);
  curl_global_cleanup();
  return rc;
}
