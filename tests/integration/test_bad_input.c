/* Bad input (docs/idempotency.md, section 3): each answered with the right
 * status and body shape, in the documented check order, with nothing written to
 * the database, the key still free afterwards and the server still healthy. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness.h"

#define PAYMENT "{\"amount\": 15990, \"currency\": \"BRL\", \"order_id\": \"ord_42\"}"
#define ORDER                                                                            \
  "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":2,"                   \
  "\"unit_price\":1000}],\"currency\":\"BRL\"}"
#define REQUIRED "Idempotency-Key header is required"
#define ALL_ROWS                                                                         \
  "SELECT (SELECT count(*) FROM resources) + (SELECT count(*) FROM "                     \
  "idempotency_records) + (SELECT count(*) FROM outbox)"

/* One bad request: what it sends and what it must get. */
struct bad {
  const char *name;
  const char *body;
  size_t body_len;   /* 0: strlen */
  long status;       /* 400 or 422 */
  const char *field; /* for 422 */
};

static int key_counter;

/* Sends req (with a fresh key unless it has one), checks the answer, that
 * nothing was written, and that the same key then creates a new resource
 * from `valid`. */
static void check_bad(h_server_t *s, h_req_t *req, long status, const char *field,
                      const char *message, const char *valid) {
  char key[64];
  int64_t before = h_db_int(s, ALL_ROWS);
  h_resp_t r;

  if (req->key == NULL) {
    snprintf(key, sizeof key, "bad-input-%d", ++key_counter);
    req->key = key;
  }
  h_http(s, req, &r);
  if (status == 422)
    h_assert_field_error(&r, field);
  else
    h_assert_error(&r, status, message);
  h_resp_free(&r);
  h_assert_db(s, before, ALL_ROWS);
  if (valid) {
    /* The key is still free: a valid request gets a first answer. */
    h_post(s, req->path, req->token, req->key, valid, &r);
    h_assert_first(&r, 201);
    h_resp_free(&r);
    h_assert_db(s, before + 2, ALL_ROWS);
  }
  req->key = NULL;
}

/* Table rows run as one cmocka test each, against one server per table
 * (started by the group setup), so one failing row hides no other. */
struct row {
  const char *path;
  const struct bad *bad;
  const char *valid;
  char name[200];
};

static h_server_t *shared;
static const char *shared_tok;

static int shared_setup(void **state) {
  (void)state;
  shared = h_server_start(NULL);
  shared_tok = h_tenant(shared, "acme");
  return 0;
}

static int shared_teardown(void **state) {
  shared = NULL;
  return h_teardown(state);
}

static void test_row(void **state) {
  const struct row *row = *state;
  h_req_t req = {.method = "POST",
                 .path = row->path,
                 .token = shared_tok,
                 .body = row->bad->body,
                 .body_len = row->bad->body_len};
  h_context("%s", row->name);
  check_bad(shared, &req, row->bad->status, row->bad->field, NULL, row->valid);
}

/* The last test of each table: the server took every row in its stride. */
static void test_still_healthy(void **state) {
  (void)state;
  h_assert_healthy(shared);
  h_server_stop(shared); /* and exits 0 */
}

static int run_rows(const char *group, const char *path, const struct bad *bad, size_t n,
                    const char *valid) {
  struct row *rows = calloc(n, sizeof *rows);
  struct CMUnitTest *tests = calloc(n + 1, sizeof *tests);
  int failed;

  if (rows == NULL || tests == NULL)
    abort();
  for (size_t i = 0; i < n; i++) {
    rows[i] = (struct row){.path = path, .bad = &bad[i], .valid = valid};
    if (bad[i].status == 422)
      snprintf(rows[i].name, sizeof rows[i].name, "POST %s: %s -> 422 %s", path,
               bad[i].name, bad[i].field);
    else
      snprintf(rows[i].name, sizeof rows[i].name, "POST %s: %s -> %ld", path, bad[i].name,
               bad[i].status);
    tests[i] = (struct CMUnitTest){
        .name = rows[i].name, .test_func = test_row, .initial_state = &rows[i]};
  }
  tests[n] = (struct CMUnitTest){.name = "server still healthy, exits 0",
                                 .test_func = test_still_healthy};
  failed = _cmocka_run_group_tests(group, tests, n + 1, shared_setup, shared_teardown);
  free(tests);
  free(rows);
  return failed;
}

/* `depth` nested arrays under "x", the innermost holding `leaf`. */
static char *nested(int depth, const char *leaf) {
  size_t cap = (size_t)depth * 2 + 64;
  char *b = malloc(cap);
  size_t n = 0;
  if (b == NULL)
    abort();
  n += (size_t)snprintf(b, cap, "{\"amount\":100,\"x\":");
  for (int i = 0; i < depth; i++)
    b[n++] = '[';
  n += (size_t)snprintf(b + n, cap - n, "%s", leaf);
  for (int i = 0; i < depth; i++)
    b[n++] = ']';
  b[n++] = '}';
  b[n] = '\0';
  return b;
}

static char long_id[300];
static char many_items[128 * 60];

/* Payment fields: 422 naming the field. */
static const struct bad payment_fields[] = {
    {"amount 1.5", "{\"amount\": 1.5}", 0, 422, "amount"},
    {"amount 1.0", "{\"amount\": 1.0}", 0, 422, "amount"},
    {"amount 1e3", "{\"amount\": 1e3}", 0, 422, "amount"},
    {"amount -5", "{\"amount\": -5}", 0, 422, "amount"},
    {"amount 0", "{\"amount\": 0}", 0, 422, "amount"},
    {"amount -0", "{\"amount\": -0}", 0, 422, "amount"},
    {"amount SQL", "{\"amount\": \"100; DROP TABLE payments\"}", 0, 422, "amount"},
    {"amount 2^53", "{\"amount\": 9007199254740992}", 0, 422, "amount"},
    {"amount \"2^53\"", "{\"amount\": \"9007199254740992\"}", 0, 422, "amount"},
    {"amount beyond int64", "{\"amount\": 99999999999999999999}", 0, 422, "amount"},
    {"amount digits beyond int64", "{\"amount\": \"99999999999999999999\"}", 0, 422,
     "amount"},
    {"amount 1e400", "{\"amount\": 1e400}", 0, 422, "amount"},
    {"amount true", "{\"amount\": true}", 0, 422, "amount"},
    {"amount null", "{\"amount\": null}", 0, 422, "amount"},
    {"amount array", "{\"amount\": [100]}", 0, 422, "amount"},
    {"amount object", "{\"amount\": {\"v\": 100}}", 0, 422, "amount"},
    {"amount empty string", "{\"amount\": \"\"}", 0, 422, "amount"},
    {"amount \"12a\"", "{\"amount\": \"12a\"}", 0, 422, "amount"},
    {"amount \"-5\"", "{\"amount\": \"-5\"}", 0, 422, "amount"},
    {"amount \"+5\"", "{\"amount\": \"+5\"}", 0, 422, "amount"},
    {"amount \" 5\"", "{\"amount\": \" 5\"}", 0, 422, "amount"},
    {"amount \"1.0\"", "{\"amount\": \"1.0\"}", 0, 422, "amount"},
    {"amount \"0\"", "{\"amount\": \"0\"}", 0, 422, "amount"},
    {"amount missing", "{\"currency\": \"BRL\"}", 0, 422, "amount"},
    {"empty object", "{}", 0, 422, "amount"},
    {"unknown field", "{\"amount\": 100, \"note\": \"x\"}", 0, 422, "note"},
    {"unknown field, overflowing", "{\"amount\": 100, \"n\": 99999999999999999999}", 0,
     422, "n"},
    {"currency lower case", "{\"amount\": 100, \"currency\": \"brl\"}", 0, 422,
     "currency"},
    {"currency 4 letters", "{\"amount\": 100, \"currency\": \"BRLX\"}", 0, 422,
     "currency"},
    {"currency empty", "{\"amount\": 100, \"currency\": \"\"}", 0, 422, "currency"},
    {"currency number", "{\"amount\": 100, \"currency\": 986}", 0, 422, "currency"},
    {"currency SQL", "{\"amount\": 100, \"currency\": \"'; DROP TABLE payments; --\"}", 0,
     422, "currency"},
    {"order_id empty", "{\"amount\": 100, \"order_id\": \"\"}", 0, 422, "order_id"},
    {"order_id number", "{\"amount\": 100, \"order_id\": 5}", 0, 422, "order_id"},
    {"order_id space", "{\"amount\": 100, \"order_id\": \"ord 1\"}", 0, 422, "order_id"},
    {"order_id non-ASCII", "{\"amount\": 100, \"order_id\": \"caf\\u00e9\"}", 0, 422,
     "order_id"},
    {"order_id SQL", "{\"amount\": 100, \"order_id\": \"1'); DROP TABLE payments; --\"}",
     0, 422, "order_id"},
    {"order_id too long", long_id, 0, 422, "order_id"},
};

/* Order fields: 422 naming the field, down to items[i].name. */
static const struct bad order_fields[] = {
    {"customer_id missing",
     "{\"items\":[{\"sku\":\"A1\",\"quantity\":1,\"unit_price\":1}]}", 0, 422,
     "customer_id"},
    {"customer_id empty",
     "{\"customer_id\":\"\",\"items\":[{\"sku\":\"A1\",\"quantity\":1,\"unit_price\":1}]"
     "}",
     0, 422, "customer_id"},
    {"customer_id number",
     "{\"customer_id\":7,\"items\":[{\"sku\":\"A1\",\"quantity\":1,\"unit_price\":1}]}",
     0, 422, "customer_id"},
    {"customer_id space",
     "{\"customer_id\":\"c "
     "1\",\"items\":[{\"sku\":\"A1\",\"quantity\":1,\"unit_price\":1}]}",
     0, 422, "customer_id"},
    {"items missing", "{\"customer_id\":\"c1\"}", 0, 422, "items"},
    {"items string", "{\"customer_id\":\"c1\",\"items\":\"A1\"}", 0, 422, "items"},
    {"items object", "{\"customer_id\":\"c1\",\"items\":{\"sku\":\"A1\"}}", 0, 422,
     "items"},
    {"items empty", "{\"customer_id\":\"c1\",\"items\":[]}", 0, 422, "items"},
    {"items 101", many_items, 0, 422, "items"},
    {"item not an object", "{\"customer_id\":\"c1\",\"items\":[1]}", 0, 422, "items[0]"},
    {"sku missing",
     "{\"customer_id\":\"c1\",\"items\":[{\"quantity\":1,\"unit_price\":1}]}", 0, 422,
     "items[0].sku"},
    {"sku empty",
     "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"\",\"quantity\":1,\"unit_price\":1}]"
     "}",
     0, 422, "items[0].sku"},
    {"sku number",
     "{\"customer_id\":\"c1\",\"items\":[{\"sku\":12,\"quantity\":1,\"unit_price\":1}]}",
     0, 422, "items[0].sku"},
    {"quantity 0",
     "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":0,\"unit_price\":1}"
     "]}",
     0, 422, "items[0].quantity"},
    {"quantity -1",
     "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":-1,\"unit_price\":"
     "1}]}",
     0, 422, "items[0].quantity"},
    {"quantity 1.5",
     "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":1.5,\"unit_price\":"
     "1}]}",
     0, 422, "items[0].quantity"},
    {"quantity 1.0",
     "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":1.0,\"unit_price\":"
     "1}]}",
     0, 422, "items[0].quantity"},
    {"quantity SQL",
     "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":\"1; DROP TABLE "
     "orders\",\"unit_price\":1}]}",
     0, 422, "items[0].quantity"},
    {"quantity 2^53",
     "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":9007199254740992,"
     "\"unit_price\":1}]}",
     0, 422, "items[0].quantity"},
    {"quantity true",
     "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":true,\"unit_"
     "price\":1}]}",
     0, 422, "items[0].quantity"},
    {"quantity missing",
     "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"unit_price\":1}]}", 0, 422,
     "items[0].quantity"},
    {"second item's quantity",
     "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":1,\"unit_price\":1}"
     ",{\"sku\":\"B2\",\"quantity\":0,\"unit_price\":1}]}",
     0, 422, "items[1].quantity"},
    {"unit_price 0",
     "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":1,\"unit_price\":0}"
     "]}",
     0, 422, "items[0].unit_price"},
    {"unit_price string",
     "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":1,\"unit_price\":"
     "\"ten\"}]}",
     0, 422, "items[0].unit_price"},
    {"unit_price beyond int64",
     "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":1,\"unit_price\":"
     "99999999999999999999}]}",
     0, 422, "items[0].unit_price"},
    {"unit_price missing",
     "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":1}]}", 0, 422,
     "items[0].unit_price"},
    {"unknown item field",
     "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":1,\"unit_price\":1,"
     "\"color\":\"red\"}]}",
     0, 422, "items[0].color"},
    {"unknown field",
     "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":1,\"unit_price\":1}"
     "],\"discount\":5}",
     0, 422, "discount"},
    {"total beyond 2^53",
     "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":9007199254740991,"
     "\"unit_price\":2}]}",
     0, 422, "items"},
    {"currency",
     "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":1,\"unit_price\":1}"
     "],\"currency\":\"usd\"}",
     0, 422, "currency"},
};

/* Bodies that are not a JSON object: 400 {"error"}. */
static const struct bad not_an_object[] = {
    {"empty", "", 0, 400, NULL},
    {"truncated", "{\"amount\": 100", 0, 400, NULL},
    {"form encoded", "amount=100&currency=BRL", 0, 400, NULL},
    {"array", "[{\"amount\": 100}]", 0, 400, NULL},
    {"empty array", "[]", 0, 400, NULL},
    {"string", "\"amount\"", 0, 400, NULL},
    {"number", "100", 0, 400, NULL},
    {"null", "null", 0, 400, NULL},
    {"true", "true", 0, 400, NULL},
    {"duplicate keys", "{\"amount\": 100, \"amount\": 200}", 0, 400, NULL},
    {"duplicate nested keys", "{\"amount\": 100, \"x\": {\"a\": 1, \"a\": 1}}", 0, 400,
     NULL},
    {"invalid UTF-8",
     "{\"amount\": 100, \"order_id\": \"a\xff"
     "b\"}",
     0, 400, NULL},
    {"overlong UTF-8",
     "{\"amount\": 100, \"order_id\": \"a\xc0\xaf"
     "b\"}",
     0, 400, NULL},
    {"UTF-8 surrogate",
     "{\"amount\": 100, \"order_id\": \"a\xed\xa0\x80"
     "b\"}",
     0, 400, NULL},
    {"lone surrogate escape", "{\"amount\": 100, \"order_id\": \"\\ud800\"}", 0, 400,
     NULL},
    {"NUL byte", "{\"amount\": 100}\0", 16, 400, NULL},
    {"NUL in a string", "{\"amount\": 100, \"order_id\": \"a\\u0000b\"}", 0, 400, NULL},
    {"trailing garbage", "{\"amount\": 100} x", 0, 400, NULL},
    {"two objects", "{\"amount\": 100}{\"amount\": 100}", 0, 400, NULL},
    {"single quotes", "{'amount': 100}", 0, 400, NULL},
    {"comment", "{\"amount\": 100 /* c */}", 0, 400, NULL},
    {"NaN", "{\"amount\": NaN}", 0, 400, NULL},
    {"trailing comma", "{\"amount\": 100,}", 0, 400, NULL},
};

/* The nesting boundary: {"amount":100,"x":[[...]]} has the object at level
 * 1, so 31 arrays make 32 levels (allowed: then the fields decide, and "x"
 * is unknown) and 32 arrays make 33. */
static struct bad nesting[] = {
    {"33 levels", NULL, 0, 400, NULL},
    {"32 levels, empty innermost array", NULL, 0, 422, "x"},
    {"32 levels, a number in the innermost array", NULL, 0, 422, "x"},
    {"2000 levels", NULL, 0, 400, NULL},
};

/* Every check, in its order: the earlier check answers even when later
 * ones would fail too. */
static void test_check_order(void **state) {
  static const char *const paths[] = {"/payments", "/orders"};
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  char *big = malloc(70 * 1024 + 1);
  h_resp_t r;
  (void)state;

  assert_non_null(big);
  memset(big, 'x', 70 * 1024);
  big[70 * 1024] = '\0';
  for (int p = 0; p < 2; p++) {
    char unknown[64];
    snprintf(unknown, sizeof unknown, "%s-v2", paths[p]);
    {
      h_req_t q = {
          .method = "POST", .path = unknown, .body = big, .content_type = "text/plain"};
      h_context("%s: 404 before everything", paths[p]);
      h_http(s, &q, &r);
      h_assert_error(&r, 404, NULL);
      h_resp_free(&r);
    }
    {
      h_req_t q = {
          .method = "PUT", .path = paths[p], .body = big, .content_type = "text/plain"};
      h_context("%s: 405 before 401", paths[p]);
      h_http(s, &q, &r);
      h_assert_error(&r, 405, NULL);
      assert_string_equal(r.allow, "POST");
      h_resp_free(&r);
    }
    {
      h_req_t q = {
          .method = "POST", .path = paths[p], .body = big, .content_type = "text/plain"};
      h_context("%s: 401 before 413", paths[p]);
      h_http(s, &q, &r);
      h_assert_error(&r, 401, NULL);
      assert_string_equal(r.www_authenticate, "Bearer");
      h_resp_free(&r);
    }
    {
      h_req_t q = {.method = "POST",
                   .path = paths[p],
                   .token = tok,
                   .body = big,
                   .content_type = "text/plain"};
      h_context("%s: 413 before 415 and 400", paths[p]);
      h_http(s, &q, &r);
      h_assert_error(&r, 413, NULL);
      h_resp_free(&r);
    }
    {
      h_req_t q = {.method = "POST",
                   .path = paths[p],
                   .token = tok,
                   .body = "{",
                   .content_type = "text/plain"};
      h_context("%s: 415 before the key", paths[p]);
      h_http(s, &q, &r);
      h_assert_error(&r, 415, NULL);
      h_resp_free(&r);
    }
    {
      h_req_t q = {.method = "POST", .path = paths[p], .token = tok, .body = "{"};
      h_context("%s: the key before the body", paths[p]);
      h_http(s, &q, &r);
      h_assert_error(&r, 400, REQUIRED);
      h_resp_free(&r);
    }
    {
      h_req_t q = {.method = "POST",
                   .path = paths[p],
                   .token = tok,
                   .key = "order-check",
                   .body = "[{\"amount\": 0}]"};
      h_context("%s: the body before its fields", paths[p]);
      h_http(s, &q, &r);
      h_assert_error(&r, 400, NULL);
      assert_string_not_equal(json_string_value(json_object_get(r.json, "error")),
                              REQUIRED);
      h_resp_free(&r);
    }
  }
  h_context_clear();
  free(big);
  h_assert_db(s, 0, ALL_ROWS);
  h_assert_healthy(s);
  h_server_stop(s);
}

static void send_all(int fd, const char *bytes, size_t len) {
  while (len > 0) {
    ssize_t w = send(fd, bytes, len, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      fail_msg("send: %s (the server closed before reading the body)", strerror(errno));
    bytes += w;
    len -= (size_t)w;
  }
}

/* Everything the server sends until it closes, NUL-terminated; the caller
 * frees it. */
static char *read_to_close(int fd) {
  size_t n = 0, cap = 16384;
  char *buf = malloc(cap);
  struct pollfd p = {.fd = fd, .events = POLLIN};

  assert_non_null(buf);
  for (;;) {
    ssize_t got;
    if (n + 1 == cap) {
      buf = realloc(buf, cap *= 2);
      assert_non_null(buf);
    }
    if (poll(&p, 1, 10000) != 1)
      fail_msg("no answer within 10 s");
    got = recv(fd, buf + n, cap - 1 - n, 0);
    if (got < 0 && errno == EINTR)
      continue;
    if (got < 0)
      fail_msg("recv: %s", strerror(errno));
    if (got == 0)
      break;
    n += (size_t)got;
  }
  buf[n] = '\0';
  return buf;
}

static void assert_starts_with_status(const char *text, long status) {
  char want[32];
  snprintf(want, sizeof want, "HTTP/1.1 %ld ", status);
  if (strncmp(text, want, strlen(want)) != 0)
    fail_msg("want %s..., got: %.200s", want, text);
}

/* A refusal decided from the headers alone (404, 405, 401, 413) to a
 * request whose body the client sends without asking waits for that body.
 * Sent while the body is still coming, the connection would close with it
 * unread, and the reset that follows could reach the client before the
 * answer (curl then reports a failed send, not the status). After it the
 * connection still serves a next request. With "Expect: 100-continue", a
 * declared length beyond what idemd reads (8 MiB), or a body framed by
 * something idemd cannot find the end of, the answer comes at once. */
static void test_refusal_after_body(void **state) {
  static const struct {
    const char *method, *path;
    int token;
    size_t len;  /* body bytes */
    int chunked; /* sent as two chunks instead of with Content-Length */
    long status;
    const char *header; /* the answer must carry it */
  } cases[] = {
      {"POST", "/payments-v2", 1, 70 * 1024, 0, 404, NULL},
      {"POST", "/payments-v2", 1, 4096, 1, 404, NULL},
      {"PUT", "/orders", 1, 70 * 1024, 0, 405, "\r\nAllow: POST\r\n"},
      {"POST", "/payments", 0, 4096, 0, 401, "\r\nWWW-Authenticate: Bearer\r\n"},
      {"POST", "/orders", 0, 4096, 1, 401, "\r\nWWW-Authenticate: Bearer\r\n"},
      {"POST", "/payments", 0, 70 * 1024, 0, 401, "\r\nWWW-Authenticate: Bearer\r\n"},
      {"POST", "/payments", 1, 70 * 1024, 0, 413, NULL},
      {"POST", "/orders", 1, 70 * 1024, 0, 413, NULL},
  };
  static const struct {
    const char *name, *path, *framing;
    long status;
  } at_once[] = {
      {"Expect: 100-continue", "/payments",
       "Expect: 100-continue\r\nContent-Length: 71680\r\n", 413},
      {"Content-Length of 9 MiB", "/payments", "Content-Length: 9437184\r\n", 413},
      {"Transfer-Encoding: gzip", "/payments-v2", "Transfer-Encoding: gzip\r\n", 501},
  };
  const size_t cap = 70 * 1024, first = 1024;
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  char *body = malloc(cap), head[512], auth[160], framing[64];
  (void)state;

  assert_non_null(body);
  memset(body, ' ', cap);
  snprintf(auth, sizeof auth, "Authorization: Bearer %s\r\n", tok);
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    static const char next[] = "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                               "Connection: close\r\n\r\n";
    size_t len = cases[i].len;
    struct pollfd p;
    int fd = h_dial(s);
    char *text;

    if (cases[i].chunked)
      snprintf(framing, sizeof framing, "Transfer-Encoding: chunked\r\n\r\n%zx\r\n", first);
    else
      snprintf(framing, sizeof framing, "Content-Length: %zu\r\n\r\n", len);
    snprintf(head, sizeof head,
             "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\n%sContent-Type: application/json\r\n"
             "Idempotency-Key: after-body\r\n%s",
             cases[i].method, cases[i].path, cases[i].token ? auth : "", framing);
    h_context("%s %s, %zu bytes%s -> %ld", cases[i].method, cases[i].path, len,
              cases[i].chunked ? " chunked" : "", cases[i].status);
    send_all(fd, head, strlen(head));
    send_all(fd, body, first);
    p = (struct pollfd){.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 300) != 0)
      fail_msg("answered (or closed) with %zu of %zu body bytes unsent", len - first, len);
    if (cases[i].chunked) {
      snprintf(framing, sizeof framing, "\r\n%zx\r\n", len - first);
      send_all(fd, framing, strlen(framing));
    }
    send_all(fd, body + first, len - first);
    if (cases[i].chunked)
      send_all(fd, "\r\n0\r\n\r\n", 7);
    send_all(fd, next, strlen(next));
    text = read_to_close(fd);
    assert_starts_with_status(text, cases[i].status);
    if (cases[i].header && strstr(text, cases[i].header) == NULL)
      fail_msg("no %s in: %.300s", cases[i].header + 2, text);
    if (strstr(text + 1, "HTTP/1.1 200 ") == NULL)
      fail_msg("the connection did not serve the next request: %.300s", text);
    free(text);
    close(fd);
  }
  for (size_t i = 0; i < sizeof at_once / sizeof *at_once; i++) {
    int fd = h_dial(s);
    char *text;
    snprintf(head, sizeof head,
             "POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\n%sContent-Type: application/json\r\n"
             "Idempotency-Key: at-once\r\n%s\r\n",
             at_once[i].path, auth, at_once[i].framing);
    h_context("%s", at_once[i].name);
    send_all(fd, head, strlen(head)); /* and no body */
    text = read_to_close(fd);
    assert_starts_with_status(text, at_once[i].status);
    free(text);
    close(fd);
  }
  h_context_clear();
  free(body);
  h_assert_db(s, 0, ALL_ROWS);
  h_assert_healthy(s);
  h_server_stop(s);
}

/* 413, 415, 401, 404 and 405 each on their own, with a valid key: nothing
 * stored and the key still free. Also the accepted boundaries. */
static void test_transport_rejections(void **state) {
  static const char *const bad_types[] = {"text/plain",
                                          "application/x-www-form-urlencoded",
                                          "application/json-patch+json",
                                          "application/jsonx",
                                          "multipart/form-data; boundary=x",
                                          "json"};
  static const char *const good_types[] = {"application/json; charset=utf-8",
                                           "APPLICATION/JSON",
                                           "application/json;charset=UTF-8"};
  const size_t cap = 64 * 1024;
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  const char *other;
  char *body = malloc(cap + 2), *chunked;
  char wrong[128], key[64];
  h_resp_t r;
  size_t n;
  (void)state;

  other = h_tenant(s, "other");
  assert_non_null(body);

  /* 64 KiB + 1: 413, with a Content-Length. */
  memset(body, ' ', cap + 1);
  memcpy(body, PAYMENT, strlen(PAYMENT));
  body[cap + 1] = '\0';
  {
    h_req_t q = {.method = "POST", .path = "/payments", .token = tok, .body = body};
    h_context("64 KiB + 1");
    check_bad(s, &q, 413, NULL, NULL, PAYMENT);
  }
  /* 64 KiB + 1 sent chunked (no Content-Length): 413 too. */
  chunked = malloc(cap + 1024);
  assert_non_null(chunked);
  n = (size_t)snprintf(
      chunked, cap + 1024,
      "POST /payments HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
      "Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
      "Idempotency-Key: chunked-413\r\nTransfer-Encoding: chunked\r\n\r\n",
      tok);
  for (size_t off = 0; off < cap + 1; off += 8192) {
    size_t len = cap + 1 - off < 8192 ? cap + 1 - off : 8192;
    n += (size_t)snprintf(chunked + n, cap + 1024 - n, "%zx\r\n", len);
    memcpy(chunked + n, body + off, len);
    n += len;
    memcpy(chunked + n, "\r\n", 2);
    n += 2;
  }
  memcpy(chunked + n, "0\r\n\r\n", 5);
  n += 5;
  h_context("64 KiB + 1, chunked");
  h_raw(s, chunked, n, &r);
  h_assert_error(&r, 413, NULL);
  h_resp_free(&r);
  free(chunked);
  h_post(s, "/payments", tok, "chunked-413", PAYMENT, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);
  /* Far beyond the cap (2 MiB), chunked: still a 413, not a dropped
   * connection. */
  {
    size_t huge = 2 * 1024 * 1024;
    char *b = malloc(huge + 1);
    h_req_t q = {
        .method = "POST", .path = "/payments", .token = tok, .body = b, .body_len = huge};
    assert_non_null(b);
    memset(b, ' ', huge);
    b[0] = '{';
    b[huge - 1] = '}';
    b[huge] = '\0';
    q.headers[0] = "Transfer-Encoding: chunked";
    h_context("2 MiB, chunked");
    check_bad(s, &q, 413, NULL, NULL, PAYMENT);
    free(b);
  }

  /* Exactly 64 KiB is accepted. */
  body[cap] = '\0';
  h_context("exactly 64 KiB");
  h_post(s, "/payments", tok, "exactly-64k", body, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);

  /* Content-Type: 415 when not JSON or missing. */
  for (size_t i = 0; i < sizeof bad_types / sizeof *bad_types; i++) {
    h_req_t q = {.method = "POST",
                 .path = "/payments",
                 .token = tok,
                 .body = PAYMENT,
                 .content_type = bad_types[i]};
    h_context("Content-Type %s", bad_types[i]);
    check_bad(s, &q, 415, NULL, NULL, PAYMENT);
  }
  for (int p = 0; p < 2; p++) {
    h_req_t q = {.method = "POST",
                 .path = p ? "/orders" : "/payments",
                 .token = tok,
                 .body = p ? ORDER : PAYMENT,
                 .content_type = H_NO_CONTENT_TYPE};
    h_context("%s without Content-Type", q.path);
    check_bad(s, &q, 415, NULL, NULL, q.body);
  }
  for (size_t i = 0; i < sizeof good_types / sizeof *good_types; i++) {
    h_req_t q = {.method = "POST",
                 .path = "/payments",
                 .token = tok,
                 .body = PAYMENT,
                 .content_type = good_types[i]};
    snprintf(key, sizeof key, "good-type-%zu", i);
    q.key = key;
    h_context("Content-Type %s", good_types[i]);
    h_http(s, &q, &r);
    h_assert_first(&r, 201);
    h_resp_free(&r);
  }

  /* Credentials: 401 with WWW-Authenticate: Bearer. */
  snprintf(wrong, sizeof wrong, "%s", tok);
  wrong[strlen(wrong) - 1] = wrong[strlen(wrong) - 1] == 'a' ? 'b' : 'a';
  {
    char zeros[80];
    const char *tokens[] = {NULL, wrong, "x", "", zeros};
    /* well formed, but no such tenant */
    snprintf(zeros, sizeof zeros, "idem_%.12s_%.40s", "000000000000",
             "0000000000000000000000000000000000000000");
    for (size_t i = 0; i < sizeof tokens / sizeof *tokens; i++) {
      for (int p = 0; p < 2; p++) {
        h_req_t q = {.method = "POST",
                     .path = p ? "/orders" : "/payments",
                     .token = tokens[i],
                     .body = p ? ORDER : PAYMENT};
        h_resp_t a;
        snprintf(key, sizeof key, "auth-%zu-%d", i, p);
        q.key = key;
        h_context("%s with token #%zu", q.path, i);
        h_http(s, &q, &a);
        h_assert_error(&a, 401, NULL);
        assert_string_equal(a.www_authenticate, "Bearer");
        h_resp_free(&a);
        /* the key is free for the tenant the token was meant to be */
        h_post(s, q.path, tok, key, q.body, &a);
        h_assert_first(&a, 201);
        h_resp_free(&a);
      }
    }
    /* Other schemes are not credentials. */
    {
      char basic[200];
      h_req_t q = {
          .method = "POST", .path = "/payments", .key = "auth-basic", .body = PAYMENT};
      snprintf(basic, sizeof basic, "Authorization: Basic %s", other);
      q.headers[0] = basic;
      h_context("Basic scheme");
      h_http(s, &q, &r);
      h_assert_error(&r, 401, NULL);
      assert_string_equal(r.www_authenticate, "Bearer");
      h_resp_free(&r);
    }
    /* GETs need credentials too. */
    h_context("GET without a token");
    h_get(s, "/payments/pay_x", NULL, &r);
    h_assert_error(&r, 401, NULL);
    assert_string_equal(r.www_authenticate, "Bearer");
    h_resp_free(&r);
    h_get(s, "/orders/ord_x", wrong, &r);
    h_assert_error(&r, 401, NULL);
    h_resp_free(&r);
  }

  /* Unknown paths: 404. */
  {
    static const char *const unknown[] = {
        "/payment",      "/paymentsx", "/v1/payments",  "/",
        "/orders/",      "/payments/", "/payments/a/b", "/payments/has%20space",
        "/payments/%00", "/healthz/x", "/PAYMENTS"};
    for (size_t i = 0; i < sizeof unknown / sizeof *unknown; i++) {
      h_req_t q = {.method = "POST", .path = unknown[i], .token = tok, .body = PAYMENT};
      h_context("POST %s", unknown[i]);
      check_bad(s, &q, 404, NULL, NULL, NULL);
      h_context("GET %s", unknown[i]);
      h_get(s, unknown[i], tok, &r);
      h_assert_error(&r, 404, NULL);
      h_resp_free(&r);
    }
    h_context("GET a payment that does not exist");
    h_get(s, "/payments/pay_doesnotexist", tok, &r);
    h_assert_error(&r, 404, NULL);
    h_resp_free(&r);
    h_get(s, "/orders/ord_doesnotexist", tok, &r);
    h_assert_error(&r, 404, NULL);
    h_resp_free(&r);
  }

  /* Wrong methods: 405 with Allow. */
  {
    static const struct {
      const char *method, *path, *allow;
    } wrong_methods[] = {
        {"GET", "/payments", "POST"},
        {"PUT", "/payments", "POST"},
        {"DELETE", "/payments", "POST"},
        {"PATCH", "/orders", "POST"},
        {"GET", "/orders", "POST"},
        {"POST", "/payments/pay_x", "GET, HEAD"},
        {"DELETE", "/orders/ord_x", "GET, HEAD, PUT"},
        {"PUT", "/payments/pay_x", "GET, HEAD"},
        {"POST", "/healthz", "GET, HEAD"},
        {"DELETE", "/metrics", "GET, HEAD"},
    };
    for (size_t i = 0; i < sizeof wrong_methods / sizeof *wrong_methods; i++) {
      h_req_t q = {.method = wrong_methods[i].method,
                   .path = wrong_methods[i].path,
                   .token = tok,
                   .body = PAYMENT};
      if (strcmp(q.method, "GET") == 0)
        q.body = NULL;
      h_context("%s %s", q.method, q.path);
      snprintf(key, sizeof key, "method-%zu", i);
      q.key = key;
      h_http(s, &q, &r);
      h_assert_error(&r, 405, NULL);
      assert_string_equal(r.allow, wrong_methods[i].allow);
      h_resp_free(&r);
    }
    h_context_clear();
    /* none of those keys was used */
    h_assert_db(s, 0,
                "SELECT count(*) FROM idempotency_records WHERE key LIKE 'method-%'");
  }
  h_context_clear();
  /* Every payment created here came from a valid request. */
  h_assert_db(s, h_db_int(s, "SELECT count(*) FROM idempotency_records"),
              "SELECT count(*) FROM resources");
  free(body);
  h_assert_healthy(s);
  h_server_stop(s);
}

/* A NUL byte in a header is refused (400), nothing stored. libmicrohttpd
 * hands header values on as C strings, so "abc<NUL>zzz" reached idemd as
 * "abc": two different Idempotency-Key values named one key. idem's build
 * of the library refuses the line (scripts/mhd-header-nul.patch); the
 * system's library, which IDEM_TEST_SYSTEM_LIBS=1 tests with, does not. */
static void test_nul_in_header(void **state) {
  static const char nul_key[] = "abc\0zzz";
  const char *patched = getenv("IDEM_TEST_MHD_PATCHED");
  h_server_t *s;
  const char *tok;
  char req[1024];
  size_t n;
  h_resp_t r;
  (void)state;

  if (patched == NULL || strcmp(patched, "1") != 0)
    skip();
  s = h_server_start(NULL);
  tok = h_tenant(s, "acme");
  n = (size_t)snprintf(req, sizeof req,
                       "POST /payments HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                       "Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
                       "Content-Length: %zu\r\nIdempotency-Key: ",
                       tok, strlen(PAYMENT));
  memcpy(req + n, nul_key, sizeof nul_key - 1); /* the NUL included */
  n += sizeof nul_key - 1;
  n += (size_t)snprintf(req + n, sizeof req - n, "\r\n\r\n%s", PAYMENT);
  h_raw(s, req, n, &r);
  h_assert_status(&r, 400);
  h_resp_free(&r);
  h_assert_db(s, 0, ALL_ROWS);
  /* "abc" is a key of its own: a first payment, not a replay. */
  h_post(s, "/payments", tok, "abc", PAYMENT, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);
  h_assert_healthy(s);
  h_server_stop(s);
}

/* SQL-looking keys and values are data: stored literally, tables intact. */
static void test_sql_looking_input(void **state) {
  static const char *const keys[] = {
      "';DROP/**/TABLE/**/idempotency_records;--",
      "1'OR'1'='1",
      "x\");DELETE/**/FROM/**/resources;--",
      "%s%s%s%n%x",
      "${jndi:ldap://x}",
      "k');UPDATE/**/idempotency_records/**/SET/**/state='failed';--",
  };
  static const char *const order_id = "o');DROP/**/TABLE/**/resources;--";
  static const char *const customer = "c'||(SELECT/**/name/**/FROM/**/tenants)||'";
  static const char *const sku = "A1';DELETE/**/FROM/**/outbox;--";
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  char body[512];
  h_resp_t first, r;
  char *v;
  (void)state;

  for (size_t i = 0; i < sizeof keys / sizeof *keys; i++) {
    h_context("key %s", keys[i]);
    h_post(s, "/payments", tok, keys[i], PAYMENT, &first);
    h_assert_first(&first, 201);
    h_post(s, "/payments", tok, keys[i], PAYMENT, &r);
    h_assert_replay_of(&r, &first);
    h_resp_free(&r);
    h_resp_free(&first);
    h_assert_db(s, 1,
                "SELECT count(*) FROM idempotency_records WHERE key = ?1 AND "
                "state = 'completed'",
                keys[i]);
  }
  h_context_clear();
  h_assert_db(s, (int64_t)(sizeof keys / sizeof *keys), "SELECT count(*) FROM payments");

  snprintf(body, sizeof body, "{\"amount\": 100, \"order_id\": \"%s\"}", order_id);
  h_post(s, "/payments", tok, "sql-body-1", body, &first);
  h_assert_first(&first, 201);
  assert_string_equal(json_string_value(json_object_get(first.json, "order_id")),
                      order_id);
  v = h_db_text(s, "SELECT order_id FROM payments WHERE id = ?1", h_id(&first));
  assert_non_null(v);
  assert_string_equal(v, order_id);
  free(v);
  h_resp_free(&first);

  snprintf(body, sizeof body,
           "{\"customer_id\": \"%s\", \"items\": [{\"sku\": \"%s\", \"quantity\": 1, "
           "\"unit_price\": 5}]}",
           customer, sku);
  h_post(s, "/orders", tok, "sql-body-2", body, &first);
  h_assert_first(&first, 201);
  assert_string_equal(json_string_value(json_object_get(first.json, "customer_id")),
                      customer);
  v = h_db_text(s, "SELECT customer_id FROM orders WHERE id = ?1", h_id(&first));
  assert_non_null(v);
  assert_string_equal(v, customer);
  free(v);
  v = h_db_text(s,
                h_store_is_pg()
                    ? "SELECT body::jsonb #>> '{items,0,sku}' FROM resources WHERE id = ?1"
                    : "SELECT json_extract(body, '$.items[0].sku') FROM resources "
                      "WHERE id = ?1",
                h_id(&first));
  assert_non_null(v);
  assert_string_equal(v, sku);
  free(v);
  h_resp_free(&first);

  /* Everything is still there. */
  h_assert_db(s, 5,
              h_store_is_pg()
                  ? "SELECT count(*) FROM information_schema.tables WHERE table_schema = "
                    "current_schema() AND table_type = 'BASE TABLE' AND table_name IN "
                    "('meta', 'tenants', 'idempotency_records', 'resources', 'outbox')"
                  : "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name IN "
                    "('meta', 'tenants', 'idempotency_records', 'resources', 'outbox')");
  h_assert_db(s, 1, "SELECT count(*) FROM tenants");
  h_assert_db(s, 8, "SELECT count(*) FROM idempotency_records WHERE state = 'completed'");
  h_assert_db(s, 8, "SELECT count(*) FROM resources");
  h_assert_healthy(s);
  h_server_stop(s);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_check_order, h_teardown),
      cmocka_unit_test_teardown(test_transport_rejections, h_teardown),
      cmocka_unit_test_teardown(test_refusal_after_body, h_teardown),
      cmocka_unit_test_teardown(test_nul_in_header, h_teardown),
      cmocka_unit_test_teardown(test_sql_looking_input, h_teardown),
  };
  char id256[257];
  size_t n;
  int failed = 0;

  h_init(argc, argv);
  memset(id256, 'o', 256);
  id256[256] = '\0';
  snprintf(long_id, sizeof long_id, "{\"amount\": 100, \"order_id\": \"%s\"}", id256);
  n = (size_t)snprintf(many_items, sizeof many_items,
                       "{\"customer_id\":\"c1\",\"items\":[");
  for (int i = 0; i < 101; i++)
    n += (size_t)snprintf(many_items + n, sizeof many_items - n,
                          "%s{\"sku\":\"S%d\",\"quantity\":1,\"unit_price\":1}",
                          i ? "," : "", i);
  snprintf(many_items + n, sizeof many_items - n, "]}");
  nesting[0].body = nested(32, "");
  nesting[1].body = nested(31, "");
  nesting[2].body = nested(31, "1");
  nesting[3].body = nested(2000, "");

  failed += cmocka_run_group_tests_name(
      "integration: check order, transport, SQL-looking input", tests, NULL, NULL);
  failed += run_rows("integration: payment fields", "/payments", payment_fields,
                     sizeof payment_fields / sizeof *payment_fields, PAYMENT);
  failed += run_rows("integration: order fields", "/orders", order_fields,
                     sizeof order_fields / sizeof *order_fields, ORDER);
  failed +=
      run_rows("integration: payment body not a JSON object", "/payments", not_an_object,
               sizeof not_an_object / sizeof *not_an_object, PAYMENT);
  failed += run_rows("integration: order body not a JSON object", "/orders",
                     not_an_object, sizeof not_an_object / sizeof *not_an_object, ORDER);
  failed += run_rows("integration: nesting depth", "/payments", nesting,
                     sizeof nesting / sizeof *nesting, PAYMENT);
  for (size_t i = 0; i < sizeof nesting / sizeof *nesting; i++)
    free((char *)nesting[i].body);
  curl_global_cleanup();
  return failed ? 1 : 0;
}
