/* Tests the gateway's pure parts (src/gateway/): route specs and their
 * matching, flags, hop-by-hop headers, and the stored forms of answers
 * and requests, which must give back every byte; and, on a SQLite file,
 * its schema's upgrade to the audit trail and that trail's rows as
 * `idemd gateway audit` prints them. */
#include "data/audit.h"
#include "data/sql.h"
#include "gateway/answer.h"
#include "gateway/gateway.h"
#include "gateway/requests.h"
#include "gateway/upstream.h"
#include "support.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct route_case {
  const char *spec;
  int ok;
};

static const struct route_case route_cases[] = {
    {"POST /orders", 1},
    {"POST /carts/{id}/checkout", 1},
    {"PUT /a/{x}/b/{y}", 1},
    {"POST /", 1},
    {"post /orders", 0},          /* methods are upper case */
    {"POST orders", 0},           /* a path starts with / */
    {"POST", 0},                  /* no path */
    {" /orders", 0},              /* no method */
    {"POST /orders?x=1", 0},      /* no query */
    {"POST /a/{id", 0},           /* unclosed */
    {"POST /a/x{id}", 0},         /* a parameter is a whole segment */
    {"POST /a/{id}x", 0},
    {"POST /a/{}", 0},            /* unnamed */
    {"POST /a/}", 0},
    {"POST /a b", 0},
    {"POST /orders/", 0},         /* no empty segment: paths are matched without */
    {"POST //orders", 0},
};

static void test_route_parse(void **state) {
  (void)state;
  for (size_t i = 0; i < ARRAY_LEN(route_cases); i++) {
    gw_route_t r;
    int rc = gw_route_parse(route_cases[i].spec, &r);
    if ((rc == 0) != route_cases[i].ok)
      fail_msg("'%s': got %d", route_cases[i].spec, rc);
  }
}

static void test_route_operation(void **state) {
  gw_route_t a, b, c;
  (void)state;
  assert_int_equal(gw_route_parse("POST /orders", &a), 0);
  assert_string_equal(a.operation, "POST /orders");
  /* Too long for an operation: its start and a hash of all of it, so two
   * long routes with one start still differ. */
  assert_int_equal(gw_route_parse("POST /carts/{id}/checkout/confirm/now", &b), 0);
  assert_int_equal(gw_route_parse("POST /carts/{id}/checkout/confirm/later", &c), 0);
  assert_true(strlen(b.operation) <= IDEM_OPERATION_MAX);
  assert_string_not_equal(b.operation, c.operation);
  assert_memory_equal(b.operation, "POST /carts/{id}/checko", 23);
}

struct match_case {
  const char *method, *path;
  const char *route; /* the matched route's operation, or NULL */
};

static const struct match_case match_cases[] = {
    {"POST", "/orders", "POST /orders"},
    {"GET", "/orders", NULL},
    {"POST", "/orders/", "POST /orders"}, /* empty segments do not count: an */
    {"POST", "//orders", "POST /orders"}, /* application may route them as /orders */
    {"POST", "/orders//", "POST /orders"},
    {"POST", "/carts/42//checkout", "POST /carts/{id}/checkout"},
    {"POST", "/orders/1", NULL},
    {"POST", "/carts/42/checkout", "POST /carts/{id}/checkout"},
    {"POST", "/carts//checkout", NULL}, /* an empty segment is no parameter */
    {"POST", "/carts/4/2/checkout", NULL},
    {"POST", "/carts/42/checkout/x", NULL},
    {"PUT", "/orders/ord_1", "PUT /orders/{id}"},
};

static void test_route_match(void **state) {
  gw_config_t cfg;
  (void)state;
  gw_config_defaults(&cfg);
  assert_int_equal(gw_route_parse("POST /orders", &cfg.routes[0]), 0);
  assert_int_equal(gw_route_parse("POST /carts/{id}/checkout", &cfg.routes[1]), 0);
  assert_int_equal(gw_route_parse("PUT /orders/{id}", &cfg.routes[2]), 0);
  cfg.nroutes = 3;
  for (size_t i = 0; i < ARRAY_LEN(match_cases); i++) {
    const gw_route_t *r = gw_route_match(&cfg, match_cases[i].method, match_cases[i].path);
    const char *want = match_cases[i].route;
    if ((r == NULL) != (want == NULL) || (r && strcmp(r->operation, want) != 0))
      fail_msg("%s %s: got %s", match_cases[i].method, match_cases[i].path,
               r ? r->operation : "none");
  }
}

struct flags_case {
  const char *args[8];
  int ok;
};

static const struct flags_case flags_cases[] = {
    {{"--upstream", "http://127.0.0.1:9000", "--route", "POST /orders"}, 1},
    {{"--route", "POST /orders"}, 0}, /* --upstream is required */
    {{"--upstream", "ftp://x"}, 0},
    {{"--upstream", "http://x", "--route", "POST orders"}, 0},
    {{"--upstream", "http://x", "--replay-header", "Set-Cookie"}, 0},
    {{"--upstream", "http://x", "--replay-header", "X Trace"}, 0},
    {{"--upstream", "http://x", "--scope-header", "X-Api-Key"}, 1},
    {{"--upstream", "http://x", "--upstream-timeout", "40s"}, 0}, /* not under --lease */
    {{"--upstream", "http://x", "--upstream-timeout", "40s", "--lease", "1m"}, 1},
    /* a margin for the queues before the send (gateway/upstream.h) */
    {{"--upstream", "http://x", "--upstream-timeout", "10s", "--lease", "10100ms"}, 0},
    {{"--upstream", "http://x", "--upstream-timeout", "10s", "--lease", "10500ms"}, 1},
    {{"--upstream", "http://x", "--max-body", "0"}, 0},
    {{"--upstream", "http://x", "--bogus", "1"}, 0},
    {{"--upstream", "http://x", "--upstream-idempotent", "--listen", "127.0.0.1:0"}, 1},
    {{"--upstream", "http://x", "--listen", "1.2.3.4:9", "--admin-listen", "1.2.3.4:9"}, 0},
};

static void test_flags(void **state) {
  (void)state;
  for (size_t i = 0; i < ARRAY_LEN(flags_cases); i++) {
    gw_config_t cfg;
    char *argv[8];
    int argc = 0;
    FILE *err = fopen("/dev/null", "w");
    for (; argc < 8 && flags_cases[i].args[argc]; argc++)
      argv[argc] = (char *)flags_cases[i].args[argc];
    gw_config_defaults(&cfg);
    int rc = gw_config_parse(&cfg, argc, argv, err);
    fclose(err);
    if ((rc == 0) != flags_cases[i].ok)
      fail_msg("case %zu (%s %s ...): got %d", i, argv[0], argc > 1 ? argv[1] : "", rc);
  }
}

/* A keyed call goes only if it can end before its key's lease does. */
static void test_upstream_deadline(void **state) {
  static const struct {
    int64_t timeout, lease_expires_at, now, want;
  } cases[] = {
      {10000, 0, 5000, 10000},               /* no lease: the timeout */
      {10000, 100000, 50000, 10000},         /* time enough */
      {10000, 100000, 100000 - 10250, 10000}, /* just enough, with the slack */
      {10000, 100000, 100000 - 10249, -1},    /* a millisecond too late */
      {10000, 100000, 100000, -1},            /* the lease is over */
      {10000, 100000, 200000, -1},
  };
  (void)state;
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    assert_int_equal(gw_upstream_deadline(cases[i].timeout, cases[i].lease_expires_at,
                                          cases[i].now),
                     cases[i].want);
}

/* A kept replay is charged its real size: headers of 60 KiB count. */
static void test_answer_bytes(void **state) {
  static const char *const extra[] = {"Idempotent-Replayed", "true", NULL};
  gw_answer_t a = {0};
  char *big = malloc(60 * 1024 + 1);
  size_t small;
  (void)state;
  assert_non_null(big);
  memset(big, 'v', 60 * 1024);
  big[60 * 1024] = '\0';
  assert_int_equal(gw_answer_own(201, "{\"ok\":true}", &a), IDEM_OK);
  small = gw_answer_bytes(&a, NULL);
  assert_true(small >= a.len + strlen("Content-Type") + strlen("application/json"));
  assert_true(gw_answer_bytes(&a, extra) >= small + strlen("Idempotent-Replayed") + 4);
  a.headers = realloc(a.headers, 2 * sizeof *a.headers);
  assert_non_null(a.headers);
  a.headers[1] = (gw_header_t){strdup("X-Big"), big};
  a.nheaders = 2;
  assert_true(gw_answer_bytes(&a, NULL) >= small + 60 * 1024 + 5);
  gw_answer_free(&a);
}

/* A replay kept in memory on PostgreSQL stays at most 60 s, whatever
 * clock set its record's expiry. */
static void test_replay_keep_until(void **state) {
  static const struct {
    int64_t expires_at, now;
    int local;
    int64_t want;
  } cases[] = {
      {1000000000, 5000, 1, 1000000000},     /* SQLite: this clock, the record's */
      {1000000000, 5000, 0, 5000 + GW_REPLAY_KEEP_MS}, /* PostgreSQL: capped */
      {30000, 5000, 0, 30000},               /* sooner than the cap */
      {4000, 5000, 0, 4000},                 /* already over: the cache drops it */
      {0, 5000, 0, 0},                       /* no expiry: not kept */
  };
  (void)state;
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    assert_int_equal(gw_replay_keep_until(cases[i].expires_at, cases[i].now, cases[i].local),
                     cases[i].want);
}

static void test_env(void **state) {
  gw_config_t cfg;
  char *argv[] = {"--upstream", "http://127.0.0.1:2"};
  FILE *err = fopen("/dev/null", "w");
  (void)state;
  setenv("IDEMD_GATEWAY_UPSTREAM", "http://127.0.0.1:1", 1);
  setenv("IDEMD_GATEWAY_ROUTE", "POST /orders;POST /carts/{id}/checkout", 1);
  setenv("IDEMD_GATEWAY_UPSTREAM_TIMEOUT", "3s", 1);
  setenv("IDEMD_GATEWAY_UPSTREAM_IDEMPOTENT", "1", 1);
  gw_config_defaults(&cfg);
  assert_int_equal(gw_config_parse(&cfg, 0, NULL, err), 0);
  assert_string_equal(cfg.upstream, "http://127.0.0.1:1");
  assert_int_equal(cfg.nroutes, 2);
  assert_string_equal(cfg.routes[1].pattern, "/carts/{id}/checkout");
  assert_int_equal(cfg.upstream_timeout_ms, 3000);
  assert_int_equal(cfg.upstream_idempotent, 1);
  /* Flags win. */
  gw_config_defaults(&cfg);
  assert_int_equal(gw_config_parse(&cfg, 2, argv, err), 0);
  assert_string_equal(cfg.upstream, "http://127.0.0.1:2");
  /* A bad value in a variable is an error, as in a flag. */
  setenv("IDEMD_GATEWAY_ROUTE", "POST /orders;orders", 1);
  gw_config_defaults(&cfg);
  assert_int_equal(gw_config_parse(&cfg, 0, NULL, err), -1);
  unsetenv("IDEMD_GATEWAY_UPSTREAM");
  unsetenv("IDEMD_GATEWAY_ROUTE");
  unsetenv("IDEMD_GATEWAY_UPSTREAM_TIMEOUT");
  unsetenv("IDEMD_GATEWAY_UPSTREAM_IDEMPOTENT");
  fclose(err);
}

static void test_hop_by_hop(void **state) {
  (void)state;
  assert_true(gw_hop_by_hop("Connection", NULL));
  assert_true(gw_hop_by_hop("transfer-encoding", NULL));
  assert_true(gw_hop_by_hop("Keep-Alive", NULL));
  assert_true(gw_hop_by_hop("TE", NULL));
  assert_true(gw_hop_by_hop("Upgrade", NULL));
  assert_true(gw_hop_by_hop("Proxy-Connection", NULL));
  assert_true(gw_hop_by_hop("X-Hop", "keep-alive, X-Hop"));
  assert_true(gw_hop_by_hop("x-hop", "X-Hop,close"));
  assert_false(gw_hop_by_hop("X-Hop", "keep-alive, X-Hopper"));
  assert_false(gw_hop_by_hop("Content-Type", "close"));
  assert_false(gw_hop_by_hop("Trailer-X", NULL));
}

struct header_case {
  const char *name, *value;
  int ok;
};

static const struct header_case header_cases[] = {
    {"X-G", "a b\tc", 1},
    {"X-Name", "caf\xe9", 1},             /* obs-text passes */
    {"X-E", "", 1},
    {"X-G", "a\rContent-Length: 0", 0}, /* a bare CR would end the line upstream */
    {"X-G", "a\nb", 0},
    {"X-G", "a\x01", 0},
    {"X-G", "a\x7f", 0},
    {"X G", "a", 0},                      /* a name is a token */
    {"X:G", "a", 0},
    {"X-G\r", "a", 0},
    {"", "a", 0},
    {"X-\xe9", "a", 0},
};

static void test_header_ok(void **state) {
  (void)state;
  for (size_t i = 0; i < ARRAY_LEN(header_cases); i++)
    if (gw_header_ok(header_cases[i].name, header_cases[i].value) != header_cases[i].ok)
      fail_msg("case %zu: '%s'", i, header_cases[i].name);
}

struct target_case {
  const char *target;
  int ok;
};

static const struct target_case target_cases[] = {
    {"/", 1},
    {"/orders", 1},
    {"/orders?x=1&y=/../z", 1}, /* the query is not a path */
    {"/a%20b/c.d/..e/...", 1},
    {"//orders/", 1},           /* empty segments: the routes do not count them */
    {"@127.0.0.1:19101/secret", 0},
    {".evil.com/", 0},
    {"*", 0},
    {"http://127.0.0.1/x", 0},
    {"", 0},
    {"/x/../orders", 0},
    {"/x/./orders", 0},
    {"/orders/..", 0},
    {"/orders/.", 0},
    {"/x/%2e%2E/orders", 0},
    {"/x/.%2e/orders", 0},
    {"/orders#f", 0},
    {"/p\xff", 0},
    {"/a b", 0},
    {"/a\tb", 0},
    {"/a\x7f", 0},
};

static void test_target_ok(void **state) {
  (void)state;
  for (size_t i = 0; i < ARRAY_LEN(target_cases); i++)
    if (gw_target_ok(target_cases[i].target) != target_cases[i].ok)
      fail_msg("'%s': got %d", target_cases[i].target, !target_cases[i].ok);
}

/* A replayed header whose value is not UTF-8 is kept byte for byte. */
static void test_answer_header_bytes(void **state) {
  gw_config_t cfg;
  gw_answer_t a = {.status = 201}, back;
  char *text = NULL;
  (void)state;
  gw_config_defaults(&cfg);
  snprintf(cfg.replay_headers[0], sizeof cfg.replay_headers[0], "X-Trace");
  cfg.nreplay_headers = 1;
  a.headers = calloc(2, sizeof *a.headers);
  a.headers[0] = (gw_header_t){strdup("Location"), strdup("/orders/caf\xe9")};
  a.headers[1] = (gw_header_t){strdup("X-Trace"), strdup("\xff\xfe")};
  a.nheaders = 2;
  assert_int_equal(gw_answer_encode(&a, &cfg, &text), IDEM_OK);
  assert_int_equal(gw_answer_decode(text, &back), IDEM_OK);
  assert_int_equal(back.nheaders, 2);
  assert_string_equal(back.headers[0].value, "/orders/caf\xe9");
  assert_string_equal(back.headers[1].value, "\xff\xfe");
  gw_answer_free(&a);
  gw_answer_free(&back);
  free(text);
}

static void add(gw_answer_t *a, const char *name, const char *value) {
  a->headers = realloc(a->headers, (size_t)(a->nheaders + 1) * sizeof *a->headers);
  a->headers[a->nheaders].name = strdup(name);
  a->headers[a->nheaders].value = strdup(value);
  a->nheaders++;
}

static void round_trip(const char *body, size_t len, const char *want_field) {
  gw_config_t cfg;
  gw_answer_t a = {.status = 201}, back;
  char *text = NULL;

  gw_config_defaults(&cfg);
  snprintf(cfg.replay_headers[0], sizeof cfg.replay_headers[0], "X-Trace");
  cfg.nreplay_headers = 1;
  add(&a, "Content-Type", "application/octet-stream");
  add(&a, "Set-Cookie", "sid=1");
  add(&a, "X-Trace", "t-1");
  add(&a, "Location", "/orders/1");
  add(&a, "Server", "app");
  a.body = malloc(len + 1);
  memcpy(a.body, body, len);
  a.body[len] = '\0';
  a.len = len;
  assert_int_equal(gw_answer_encode(&a, &cfg, &text), IDEM_OK);
  assert_non_null(strstr(text, want_field));
  assert_int_equal(gw_answer_decode(text, &back), IDEM_OK);
  assert_int_equal(back.status, 201);
  assert_int_equal(back.len, len);
  assert_memory_equal(back.body, body, len);
  /* Kept: Content-Type, Location and the --replay-header; never
   * Set-Cookie, nor anything else. */
  assert_int_equal(back.nheaders, 3);
  for (int i = 0; i < back.nheaders; i++) {
    assert_string_not_equal(back.headers[i].name, "Set-Cookie");
    assert_string_not_equal(back.headers[i].name, "Server");
  }
  gw_answer_free(&a);
  gw_answer_free(&back);
  free(text);
}

static void test_answer_round_trip(void **state) {
  static const char binary[] = {'a', 0, (char)0xff, (char)0xfe, '\n', 'z'};
  static const char latin1[] = {'c', 'a', 'f', (char)0xe9};
  (void)state;
  round_trip("{\"id\":1}", 8, "\"body\":");
  round_trip("caf\xc3\xa9 \xe2\x82\xac", 9, "\"body\":");  /* UTF-8 text */
  round_trip(binary, sizeof binary, "\"body_b64\":");       /* a NUL */
  round_trip(latin1, sizeof latin1, "\"body_b64\":");       /* not UTF-8 */
  round_trip("x", 1, "\"body\":");
  round_trip("", 0, "\"body\":\"\"");
}

static void test_answer_decode_refuses(void **state) {
  static const char *const bad[] = {
      NULL, "", "[]", "{}", "{\"status\":201}", "{\"status\":\"201\",\"headers\":[],\"body\":\"\"}",
      "{\"status\":201,\"headers\":[]}", "{\"status\":201,\"headers\":[],\"body_b64\":\"abc\"}"};
  (void)state;
  for (size_t i = 0; i < ARRAY_LEN(bad); i++) {
    gw_answer_t a;
    if (gw_answer_decode(bad[i], &a) == IDEM_OK)
      fail_msg("decoded '%s'", bad[i] ? bad[i] : "(null)");
  }
}

static void test_request_round_trip(void **state) {
  static const char body[] = {'{', 0, (char)0x80, '}'};
  char *lines[] = {"Host: example", "Idempotency-Key: k1", "X-Name: caf\xe9", NULL};
  char *text = gw_request_encode("POST", "/orders?a=%20b", lines, body, sizeof body);
  char *method, *target, *got_body, **headers;
  size_t len;
  (void)state;
  assert_non_null(text);
  assert_int_equal(gw_request_decode(text, &method, &target, &headers, &got_body, &len),
                   IDEM_OK);
  assert_string_equal(method, "POST");
  assert_string_equal(target, "/orders?a=%20b");
  assert_int_equal(len, sizeof body);
  assert_memory_equal(got_body, body, sizeof body);
  for (int i = 0; i < 3; i++)
    assert_string_equal(headers[i], lines[i]);
  assert_null(headers[3]);
  for (int i = 0; headers[i]; i++)
    free(headers[i]);
  free(headers);
  free(method);
  free(target);
  free(got_body);
  free(text);
}

struct reason_case {
  const char *text;
  int max, ok;
};

static void test_reason_valid(void **state) {
  static const struct reason_case cases[] = {
      {"checked by hand", 200, 1},
      {"caf\xc3\xa9 \xe2\x82\xac", 6, 1}, /* characters, not bytes */
      {"caf\xc3\xa9 \xe2\x82\xac", 5, 0},
      {"", 200, 0},
      {"two\nlines", 200, 0},
      {"tab\there", 200, 0},
      {"del\x7f", 200, 0},
      {"not \xff UTF-8", 200, 0},
      {"\xc3\x28", 200, 0},
  };
  (void)state;
  for (size_t i = 0; i < ARRAY_LEN(cases); i++)
    if (idemd_audit_text_valid(cases[i].text, cases[i].max) != cases[i].ok)
      fail_msg("case %zu: '%s' max %d should be %s", i, cases[i].text, cases[i].max,
               cases[i].ok ? "valid" : "refused");
}

/* Takes a database of the gateway's back to its schema 1. */
static int gw_v1_fn(void *arg, idem_tx_t *tx) {
  char err[256];
  int rc = idemd_sql_exec(tx,
                          "DROP TABLE gateway_audit; DELETE FROM gateway_schema; "
                          "INSERT INTO gateway_schema VALUES (1)",
                          err, sizeof err);
  (void)arg;
  if (rc != IDEM_OK)
    fail_msg("back to 1: %s", err);
  return rc;
}

static int append_fn(void *arg, idem_tx_t *tx) {
  static const idemd_actor_t who = {"operator:alice", "ticket \"4521\""};
  static const idemd_actor_t odd = {"operator:bob", "caf\xe9"}; /* written by hand */
  idem_scope_t a = {4736541207291548671LL, "POST /orders", "k1"};
  idem_scope_t b = {4611686018427387905LL, "PUT /orders/{id}", "k2"};
  int rc;
  (void)arg;
  if ((rc = idemd_audit_append_key(tx, &a, "pending", "completed", &who)) != IDEM_OK)
    return rc;
  return idemd_audit_append_key(tx, &b, "processing", "completed", &odd);
}

struct lines {
  char text[2][512];
  int n;
};

static int got_line(void *arg, const idemd_audit_row_t *row) {
  struct lines *l = arg;
  char *line = idemd_audit_json(row, NULL);
  const char *after_at;
  assert_non_null(line);
  /* Never the time: what follows it. */
  after_at = strstr(line, "\"scope\"");
  assert_non_null(after_at);
  assert_true(strncmp(line, "{\"at\":\"", 7) == 0);
  if (l->n < 2)
    snprintf(l->text[l->n], sizeof l->text[0], "%s", after_at);
  l->n++;
  free(line);
  return IDEM_OK;
}

/* A database of the gateway's schema 1 upgraded to 2 gains the audit
 * table; rows appended in a write read back oldest first, all or one
 * key's, printed as JSON lines. */
static void test_audit_trail(void **state) {
  const char *tmp = getenv("TMPDIR");
  char dir[512], path[600], why[256];
  idem_store_t *store = NULL;
  idem_effect_t v1 = {gw_v1_fn, NULL}, append = {append_fn, NULL};
  struct lines all = {0}, one = {0};
  (void)state;

  snprintf(dir, sizeof dir, "%s/idem-gw-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
  assert_non_null(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/gw.db", dir);
  assert_int_equal(idem_store_open(path, NULL, &store), IDEM_OK);
  assert_int_equal(idem_store_migrate(store), IDEM_OK);
  assert_int_equal(gw_schema_migrate(store, why, sizeof why), IDEM_OK);
  assert_int_equal(idem_store_write(store, &v1), IDEM_OK);
  assert_int_equal(gw_schema_migrate(store, why, sizeof why), IDEM_OK); /* 1 to 2 */
  assert_int_equal(gw_schema_migrate(store, why, sizeof why), IDEM_OK); /* again: nothing */
  assert_int_equal(idem_store_write(store, &append), IDEM_OK);
  assert_int_equal(idemd_audit_list_keys(store, NULL, got_line, &all), IDEM_OK);
  assert_int_equal(idemd_audit_list_keys(store, "k2", got_line, &one), IDEM_OK);
  assert_int_equal(all.n, 2);
  assert_string_equal(all.text[0],
                      "\"scope\":\"4736541207291548671\",\"route\":\"POST /orders\","
                      "\"key\":\"k1\",\"from\":\"pending\",\"to\":\"completed\","
                      "\"actor\":\"operator:alice\",\"reason\":\"ticket \\\"4521\\\"\"}");
  assert_string_equal(all.text[1],
                      "\"scope\":\"4611686018427387905\",\"route\":\"PUT /orders/{id}\","
                      "\"key\":\"k2\",\"from\":\"processing\",\"to\":\"completed\","
                      "\"actor\":\"operator:bob\",\"reason\":\"caf\\\\xe9\"}");
  assert_int_equal(one.n, 1);
  assert_string_equal(one.text[0], all.text[1]);
  idem_store_close(store);
  remove_sqlite_files(path);
  rmdir(dir);
}

/* The resolver drops a settled key's row only if it is still the row it
 * listed: a request that won the key since wrote its own, which stays. */
static void test_drop_listed(void **state) {
  char path[] = "/tmp/idem-unit-gw-XXXXXX";
  char why[128];
  int fd = mkstemp(path);
  idem_store_t *store = NULL;
  idem_scope_t scope = {(int64_t)1 << 62, "POST /orders", "k1"};
  gw_save_t first = {&scope, "{\"first\":1}", 0}, second = {&scope, "{\"second\":1}", 5000};
  idem_effect_t save1 = {gw_save_fn, &first}, save2 = {gw_save_fn, &second};
  gw_saved_t listed[2], now[2];
  int n = 0;
  (void)state;

  assert_true(fd >= 0);
  close(fd);
  assert_int_equal(idem_store_open(path, NULL, &store), IDEM_OK);
  assert_int_equal(idem_store_migrate(store), IDEM_OK);
  assert_int_equal(gw_schema_migrate(store, why, sizeof why), IDEM_OK);
  assert_int_equal(idem_store_write(store, &save1), IDEM_OK);
  assert_int_equal(gw_due_list(store, GW_NEVER, listed, 2, &n), IDEM_OK);
  assert_int_equal(n, 1);
  /* A new request wins the key after the listing. */
  assert_int_equal(idem_store_write(store, &save2), IDEM_OK);
  idem_effect_t drop_old = {gw_drop_listed_fn, &listed[0]};
  assert_int_equal(idem_store_write(store, &drop_old), IDEM_OK);
  assert_int_equal(gw_due_list(store, GW_NEVER, now, 2, &n), IDEM_OK);
  assert_int_equal(n, 1);
  assert_string_equal(now[0].request, "{\"second\":1}");
  /* The row as listed now goes. */
  idem_effect_t drop_now = {gw_drop_listed_fn, &now[0]};
  assert_int_equal(idem_store_write(store, &drop_now), IDEM_OK);
  free(now[0].request);
  assert_int_equal(gw_due_list(store, GW_NEVER, now, 2, &n), IDEM_OK);
  assert_int_equal(n, 0);
  free(listed[0].request);
  idem_store_close(store);
  unlink(path);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_route_parse),        cmocka_unit_test(test_route_operation),
      cmocka_unit_test(test_route_match),        cmocka_unit_test(test_flags),
      cmocka_unit_test(test_env),                cmocka_unit_test(test_upstream_deadline),
      cmocka_unit_test(test_answer_bytes),       cmocka_unit_test(test_replay_keep_until),
      cmocka_unit_test(test_hop_by_hop),         cmocka_unit_test(test_answer_round_trip),
      cmocka_unit_test(test_answer_decode_refuses), cmocka_unit_test(test_request_round_trip),
      cmocka_unit_test(test_reason_valid),       cmocka_unit_test(test_audit_trail),
      cmocka_unit_test(test_header_ok),          cmocka_unit_test(test_target_ok),
      cmocka_unit_test(test_answer_header_bytes), cmocka_unit_test(test_drop_listed),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
