/* The audit trail and an operator's resolution of a pending payment or
 * refund (docs/operations.md, "The audit trail" and "A payment that stays
 * pending"): every state change of a payment, refund or order appends one
 * row, which `idemd audit` prints as JSON lines; `idemd payments resolve`
 * and `idemd refunds resolve` settle a pending one by hand, so that its
 * replays answer 201 or 402, and refuse anything else with nothing
 * changed, also while idemd itself is settling it. The sandbox provider
 * makes the outcomes: 666 declined, 777 charged with its answer lost
 * (pending), which a lookup finds charged. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

#define DECLINED "666"
#define UNCERTAIN "777"
#define NO_RECONCILER "--reconcile-interval", "1h"

static const char *const sandbox_flags[] = {"--sandbox-decline-amount", DECLINED,
                                            "--sandbox-uncertain-amount", UNCERTAIN,
                                            NO_RECONCILER, NULL};

/* ---- helpers ------------------------------------------------------------ */

/* The rows `idemd audit ARGS` prints, each line parsed (a JSON array the
 * caller frees), after checking it exited 0 and printed only JSON
 * objects with the seven fields. Fails. */
static json_t *audit_rows(h_server_t *s, const char *tenant, const char *resource) {
  const char *args[] = {"audit", "--tenant", tenant, resource ? "--resource" : NULL,
                        resource, NULL};
  char *out = NULL, *line, *save = NULL;
  json_t *rows = json_array();
  int rc = h_cli(s, args, &out);

  if (rc != 0)
    fail_msg("idemd audit --tenant %s exited %d (see %s)", tenant, rc, s->cli_log);
  for (line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
    json_t *row = json_loads(line, 0, NULL);
    static const char *const fields[] = {"at",    "tenant", "resource", "from",
                                         "to",    "actor",  "reason"};
    if (!json_is_object(row) || json_object_size(row) != 7)
      fail_msg("idemd audit printed a line that is not a row: %s", line);
    for (size_t i = 0; i < sizeof fields / sizeof *fields; i++)
      if (json_object_get(row, fields[i]) == NULL)
        fail_msg("an audit row lacks \"%s\": %s", fields[i], line);
    assert_string_equal(json_string_value(json_object_get(row, "tenant")), tenant);
    json_array_append_new(rows, row);
  }
  free(out);
  return rows;
}

/* The rows of `resource` among `rows`, as "from>to actor|reason" lines
 * ("-" for null), in the order printed, into `out`. */
static void changes_of(const json_t *rows, const char *resource, char *out, size_t cap) {
  size_t i, used = 0;
  json_t *row;

  out[0] = '\0';
  json_array_foreach(rows, i, row) {
    const char *from = json_string_value(json_object_get(row, "from"));
    const char *reason = json_string_value(json_object_get(row, "reason"));
    if (strcmp(json_string_value(json_object_get(row, "resource")), resource) != 0)
      continue;
    used += (size_t)snprintf(out + used, cap - used, "%s>%s %s|%s\n", from ? from : "-",
                             json_string_value(json_object_get(row, "to")),
                             json_string_value(json_object_get(row, "actor")),
                             reason ? reason : "-");
    assert_true(used < cap);
  }
}

static void assert_changes(const json_t *rows, const char *resource, const char *want) {
  char got[2048];
  changes_of(rows, resource, got, sizeof got);
  if (strcmp(got, want) != 0)
    fail_msg("audit of %s:\n%s\nwanted:\n%s", resource, got, want);
}

/* POST `path` with `body` under `key`; the answer in `r`, its status checked. */
static void post(h_server_t *s, const char *token, const char *path, const char *key,
                 const char *body, long status, h_resp_t *r) {
  h_post(s, path, token, key, body, r);
  h_assert_status(r, status);
}

/* Runs `idemd ARGS`; returns its exit status, its stdout freed. */
static int cli(h_server_t *s, const char *const *args) {
  char *out = NULL;
  int rc = h_cli(s, args, &out);
  free(out);
  return rc;
}

static int resolve(h_server_t *s, const char *what, const char *id, const char *as,
                   const char *reason, const char *operator) {
  const char *args[] = {what, "resolve", id, "--as", as, "--reason", reason,
                        "--operator", operator, NULL};
  return cli(s, args);
}

#define AUDIT_ROWS "SELECT count(*) FROM audit"

static int occurrences(const char *text, const char *what) {
  int n = 0;
  for (const char *at = strstr(text, what); at; at = strstr(at + 1, what))
    n++;
  return n;
}

/* ---- every transition --------------------------------------------------- */

/* A payment settled by its request's provider answer (succeeded, then
 * declined), one left pending and settled by the reconciler, a refund, an
 * order created, cancelled twice (one change) and one put under a chosen
 * id: each change one row with the request's id (or "reconciler") as
 * actor, oldest first; another tenant's rows are not printed, and
 * --resource keeps one resource's. */
static void test_every_transition(void **state) {
  static const char *const flags[] = {"--sandbox-decline-amount", DECLINED,
                                      "--sandbox-uncertain-amount", UNCERTAIN,
                                      "--reconcile-interval", "50ms", NULL};
  h_server_t *s = h_server_start(flags);
  const char *acme = h_tenant(s, "acme"), *globex = h_tenant(s, "globex");
  h_resp_t ok, no, unknown, refund, order, cancel, again, put, other;
  char want[1024], path[128], ok_id[64], no_id[64], unknown_id[64], order_id[64];
  json_t *rows;
  (void)state;

  post(s, acme, "/payments", "ok", "{\"amount\": 1000}", 201, &ok);
  post(s, acme, "/payments", "no", "{\"amount\": " DECLINED "}", 402, &no);
  post(s, acme, "/payments", "unknown", "{\"amount\": " UNCERTAIN "}", 202, &unknown);
  snprintf(ok_id, sizeof ok_id, "%s", h_id(&ok));
  snprintf(no_id, sizeof no_id, "%s", h_id(&no));
  snprintf(unknown_id, sizeof unknown_id, "%s", h_id(&unknown));
  if (!h_db_wait(s, 10000, "SELECT count(*) FROM payments WHERE id = ?1 AND status = "
                           "'succeeded'", unknown_id))
    fail_msg("the reconciler did not settle %s", unknown_id);
  snprintf(path, sizeof path, "/payments/%s/refunds", ok_id);
  post(s, acme, path, "refund", "{\"amount\": 400}", 201, &refund);
  post(s, acme, "/orders", "order", "{\"customer_id\": \"c1\", \"items\": [{\"sku\": "
       "\"A1\", \"quantity\": 1, \"unit_price\": 500}]}", 201, &order);
  snprintf(order_id, sizeof order_id, "%s", h_id(&order));
  snprintf(path, sizeof path, "/orders/%s/cancel", order_id);
  {
    h_req_t req = {.method = "POST", .path = path, .token = acme, .body = ""};
    h_http(s, &req, &cancel);
    h_assert_status(&cancel, 200);
    h_http(s, &req, &again);
    h_assert_status(&again, 200);
  }
  {
    h_req_t req = {.method = "PUT", .path = "/orders/ord_chosen", .token = acme,
                   .body = "{\"customer_id\": \"c1\", \"items\": [{\"sku\": \"A1\", "
                           "\"quantity\": 1, \"unit_price\": 500}]}"};
    h_http(s, &req, &put);
    h_assert_status(&put, 201);
  }
  post(s, globex, "/payments", "ok", "{\"amount\": 1000}", 201, &other);

  rows = audit_rows(s, "acme", NULL);
  snprintf(want, sizeof want,
           "->pending %s|POST /payments\npending>succeeded %s|the provider's answer\n",
           ok.request_id, ok.request_id);
  assert_changes(rows, ok_id, want);
  snprintf(want, sizeof want,
           "->pending %s|POST /payments\npending>declined %s|the provider's answer\n",
           no.request_id, no.request_id);
  assert_changes(rows, no_id, want);
  snprintf(want, sizeof want,
           "->pending %s|POST /payments\n"
           "pending>succeeded reconciler|looked up at the provider\n",
           unknown.request_id);
  assert_changes(rows, unknown_id, want);
  snprintf(want, sizeof want,
           "->pending %s|POST /payments/{id}/refunds\n"
           "pending>succeeded %s|the provider's answer\n",
           refund.request_id, refund.request_id);
  assert_changes(rows, h_id(&refund), want);
  snprintf(want, sizeof want,
           "->created %s|POST /orders\ncreated>cancelled %s|POST /orders/{id}/cancel\n",
           order.request_id, cancel.request_id);
  assert_changes(rows, order_id, want);
  snprintf(want, sizeof want, "->created %s|PUT /orders/{id}\n", put.request_id);
  assert_changes(rows, "ord_chosen", want);
  /* Nothing else, and none of globex's. */
  assert_int_equal(json_array_size(rows), 2 + 2 + 2 + 2 + 2 + 1);
  assert_changes(rows, h_id(&other), "");
  /* Oldest first: each row's time at or after the one before. */
  for (size_t i = 1; i < json_array_size(rows); i++)
    assert_true(strcmp(json_string_value(json_object_get(json_array_get(rows, i - 1), "at")),
                       json_string_value(json_object_get(json_array_get(rows, i), "at"))) <= 0);
  json_decref(rows);

  rows = audit_rows(s, "acme", order_id);
  assert_int_equal(json_array_size(rows), 2);
  json_decref(rows);
  rows = audit_rows(s, "globex", NULL);
  assert_int_equal(json_array_size(rows), 2);
  snprintf(want, sizeof want,
           "->pending %s|POST /payments\npending>succeeded %s|the provider's answer\n",
           other.request_id, other.request_id);
  assert_changes(rows, h_id(&other), want);
  json_decref(rows);
  {
    const char *no_tenant[] = {"audit", "--tenant", "initech", NULL};
    const char *usage[] = {"audit", NULL};
    assert_int_equal(cli(s, no_tenant), 1);
    assert_int_equal(cli(s, usage), 2);
  }
  h_resp_t *all[] = {&ok, &no, &unknown, &refund, &order, &cancel, &again, &put, &other};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++)
    h_resp_free(all[i]);
  h_server_stop(s);
}

/* ---- resolve ------------------------------------------------------------ */

/* A pending payment resolved as succeeded, another as declined: exit 0,
 * replays then answer 201 and 402 with the settled payment, the outbox row
 * is gone and the audit holds the operator's row with its reason. Any
 * other state, an unknown id, a refund's id given as a payment's: exit 1
 * and nothing changed. Bad usage: exit 2 and nothing changed. */
static void test_resolve_payment(void **state) {
  h_server_t *s = h_server_start(sandbox_flags);
  const char *acme = h_tenant(s, "acme");
  h_resp_t a, b, done, replay, read;
  char a_id[64], b_id[64], path[128];
  json_t *rows;
  (void)state;

  post(s, acme, "/payments", "a", "{\"amount\": " UNCERTAIN "}", 202, &a);
  post(s, acme, "/payments", "b", "{\"amount\": " UNCERTAIN "}", 202, &b);
  post(s, acme, "/payments", "done", "{\"amount\": 1000}", 201, &done);
  snprintf(a_id, sizeof a_id, "%s", h_id(&a));
  snprintf(b_id, sizeof b_id, "%s", h_id(&b));
  h_assert_db(s, 2, "SELECT count(*) FROM outbox");

  /* Bad usage changes nothing. */
  {
    const char *no_operator[] = {"payments", "resolve", a_id, "--as", "succeeded",
                                 "--reason", "x", NULL};
    const char *no_reason[] = {"payments", "resolve", a_id, "--as", "succeeded",
                               "--operator", "alice", NULL};
    const char *no_id[] = {"payments", "resolve", "--as", "succeeded", "--reason", "x",
                           "--operator", "alice", NULL};
    /* Which would it be? Refused, as the gateway's resolve refuses it. */
    const char *twice[] = {"payments", "resolve", a_id, "--as", "succeeded", "--as",
                           "declined", "--reason", "x", "--operator", "alice", NULL};
    int64_t rows_before = h_db_int(s, AUDIT_ROWS);
    assert_int_equal(cli(s, twice), 2);
    assert_int_equal(cli(s, no_operator), 2);
    assert_int_equal(cli(s, no_reason), 2);
    assert_int_equal(cli(s, no_id), 2);
    assert_int_equal(resolve(s, "payments", a_id, "maybe", "x", "alice"), 2);
    assert_int_equal(resolve(s, "payments", a_id, "succeeded", "", "alice"), 2);
    /* Not UTF-8, or a control character: the audit could not print it. */
    assert_int_equal(resolve(s, "payments", a_id, "succeeded", "caf\xe9", "alice"), 2);
    assert_int_equal(resolve(s, "payments", a_id, "succeeded", "two\nlines", "alice"), 2);
    assert_int_equal(resolve(s, "payments", a_id, "succeeded", "x", "bad name!"), 2);
    h_assert_db(s, rows_before, AUDIT_ROWS);
    h_assert_db(s, 2, "SELECT count(*) FROM payments WHERE status = 'pending'");
  }

  /* --tenant: another tenant's id is unknown; an unknown tenant refused. */
  h_tenant(s, "globex");
  {
    const char *other[] = {"payments", "resolve", a_id, "--as", "succeeded", "--reason", "x",
                           "--operator", "alice", "--tenant", "globex", NULL};
    const char *nobody[] = {"payments", "resolve", a_id, "--as", "succeeded", "--reason", "x",
                            "--operator", "alice", "--tenant", "initech", NULL};
    assert_int_equal(cli(s, other), 1);
    assert_int_equal(cli(s, nobody), 1);
    h_assert_db(s, 2, "SELECT count(*) FROM payments WHERE status = 'pending'");
  }
  {
    const char *own[] = {"payments", "resolve", a_id, "--as", "succeeded", "--reason",
                         "charged, per the provider's dashboard (ticket 42)", "--operator",
                         "alice", "--tenant", "acme", NULL};
    assert_int_equal(cli(s, own), 0);
  }
  assert_int_equal(resolve(s, "payments", b_id, "declined", "the provider lost it; "
                           "never charged", "bob"), 0);
  h_assert_db(s, 0, "SELECT count(*) FROM outbox");
  h_assert_db(s, 1, "SELECT count(*) FROM idempotency_records WHERE resource_id = ?1 AND "
                    "state = 'completed' AND response_status = 201", a_id);

  post(s, acme, "/payments", "a", "{\"amount\": " UNCERTAIN "}", 201, &replay);
  assert_string_equal(replay.replayed, "true");
  assert_string_equal(h_id(&replay), a_id);
  assert_string_equal(json_string_value(json_object_get(replay.json, "status")), "succeeded");
  h_resp_free(&replay);
  post(s, acme, "/payments", "b", "{\"amount\": " UNCERTAIN "}", 402, &replay);
  assert_string_equal(replay.replayed, "true");
  assert_string_equal(json_string_value(json_object_get(replay.json, "status")), "declined");
  h_resp_free(&replay);
  snprintf(path, sizeof path, "/payments/%s", b_id);
  h_get(s, path, acme, &read);
  h_assert_status(&read, 200);
  assert_string_equal(json_string_value(json_object_get(read.json, "status")), "declined");
  h_resp_free(&read);

  rows = audit_rows(s, "acme", NULL);
  char want[512];
  snprintf(want, sizeof want,
           "->pending %s|POST /payments\n"
           "pending>succeeded operator:alice|charged, per the provider's dashboard "
           "(ticket 42)\n",
           a.request_id);
  assert_changes(rows, a_id, want);
  snprintf(want, sizeof want,
           "->pending %s|POST /payments\n"
           "pending>declined operator:bob|the provider lost it; never charged\n",
           b.request_id);
  assert_changes(rows, b_id, want);
  json_decref(rows);

  /* Refused, nothing changed: settled ones, an unknown id. */
  int64_t rows_before = h_db_int(s, AUDIT_ROWS);
  assert_int_equal(resolve(s, "payments", a_id, "declined", "again", "alice"), 1);
  assert_int_equal(resolve(s, "payments", h_id(&done), "declined", "x", "alice"), 1);
  assert_int_equal(resolve(s, "payments", "pay_unknown", "declined", "x", "alice"), 1);
  assert_int_equal(resolve(s, "refunds", a_id, "declined", "x", "alice"), 1);
  h_assert_db(s, rows_before, AUDIT_ROWS);
  h_assert_db(s, 1, "SELECT count(*) FROM payments WHERE id = ?1 AND status = 'succeeded'",
              a_id);

  h_resp_free(&a);
  h_resp_free(&b);
  h_resp_free(&done);
  h_server_stop(s);
}

/* A pending refund resolved as declined gives its amount back to the
 * payment (a refund of all of it is then taken), one resolved as
 * succeeded counts on it; replays answer 402 and 201. */
static void test_resolve_refund(void **state) {
  h_server_t *s = h_server_start(sandbox_flags);
  const char *acme = h_tenant(s, "acme");
  h_resp_t pay, r1, r2, replay, rest, read;
  char path[128], r1_id[64], r2_id[64];
  json_t *rows;
  (void)state;

  post(s, acme, "/payments", "pay", "{\"amount\": 2000}", 201, &pay);
  snprintf(path, sizeof path, "/payments/%s/refunds", h_id(&pay));
  post(s, acme, path, "r1", "{\"amount\": " UNCERTAIN "}", 202, &r1);
  post(s, acme, path, "r2", "{\"amount\": " UNCERTAIN "}", 202, &r2);
  snprintf(r1_id, sizeof r1_id, "%s", h_id(&r1));
  snprintf(r2_id, sizeof r2_id, "%s", h_id(&r2));

  assert_int_equal(resolve(s, "payments", r1_id, "declined", "x", "alice"), 1);
  assert_int_equal(resolve(s, "refunds", r1_id, "declined", "refused by the bank", "alice"),
                   0);
  assert_int_equal(resolve(s, "refunds", r2_id, "succeeded", "seen at the provider",
                           "alice"), 0);
  assert_int_equal(resolve(s, "refunds", r2_id, "declined", "x", "alice"), 1);

  post(s, acme, path, "r1", "{\"amount\": " UNCERTAIN "}", 402, &replay);
  assert_string_equal(replay.replayed, "true");
  assert_string_equal(json_string_value(json_object_get(replay.json, "status")), "declined");
  h_resp_free(&replay);
  post(s, acme, path, "r2", "{\"amount\": " UNCERTAIN "}", 201, &replay);
  assert_string_equal(json_string_value(json_object_get(replay.json, "status")), "succeeded");
  h_resp_free(&replay);
  /* 2000 - 777 refunded: all that is left is 1223. */
  post(s, acme, path, "rest", "{}", 201, &rest);
  assert_int_equal(json_integer_value(json_object_get(rest.json, "amount")), 2000 - 777);
  snprintf(path, sizeof path, "/payments/%s", h_id(&pay));
  h_get(s, path, acme, &read);
  assert_int_equal(json_integer_value(json_object_get(read.json, "amount_refunded")), 2000);

  rows = audit_rows(s, "acme", r1_id);
  char want[512];
  snprintf(want, sizeof want,
           "->pending %s|POST /payments/{id}/refunds\n"
           "pending>declined operator:alice|refused by the bank\n",
           r1.request_id);
  assert_changes(rows, r1_id, want);
  json_decref(rows);

  h_resp_t *all[] = {&pay, &r1, &r2, &rest, &read};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++)
    h_resp_free(all[i]);
  h_server_stop(s);
}

/* Resolutions racing the reconciler: all started at once, as idemd starts
 * again with its reconciler, whose first pass settles as succeeded every
 * payment still pending. Each payment is settled once, by one of them: a
 * resolve that exits 0 settled it (declined, its row the operator's), one
 * that exits 1 found it settled by the reconciler or held by it, and
 * changed nothing. Which wins each is up to the machine. */
static void test_resolve_races_reconciler(void **state) {
  enum { N = 16 };
  static const char *const racing[] = {"--sandbox-uncertain-amount", UNCERTAIN,
                                       "--reconcile-interval", "50ms", NULL};
  h_server_t *s = h_server_start(sandbox_flags);
  const char *acme = h_tenant(s, "acme");
  char ids[N][64], key[16], want[512];
  int exits[N], by_operator = 0, devnull, errfd;
  pid_t pids[N];
  json_t *rows;
  (void)state;

  for (int i = 0; i < N; i++) {
    h_resp_t r;
    snprintf(key, sizeof key, "race-%d", i);
    post(s, acme, "/payments", key, "{\"amount\": " UNCERTAIN "}", 202, &r);
    snprintf(ids[i], sizeof ids[i], "%s", h_id(&r));
    h_resp_free(&r);
  }
  h_server_stop(s);
  devnull = open("/dev/null", O_WRONLY | O_CLOEXEC);
  errfd = open(s->cli_log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  assert_true(devnull >= 0 && errfd >= 0);
  for (int i = 0; i < N; i++) {
    char *const argv[] = {(char *)getenv("IDEM_TEST_IDEMD"), "payments", "resolve", ids[i],
                          "--as", "declined", "--reason", "race", "--operator", "carol",
                          "--db", s->db, NULL};
    assert_non_null(argv[0]);
    pids[i] = h_spawn(argv, devnull, errfd, "IDEMD_");
    assert_true(pids[i] > 0);
  }
  h_server_restart(s, racing);
  for (int i = 0; i < N; i++) {
    int status;
    while (waitpid(pids[i], &status, 0) < 0)
      assert_int_equal(errno, EINTR);
    exits[i] = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  close(devnull);
  close(errfd);
  if (!h_db_wait(s, 10000, "SELECT CASE WHEN count(*) = 0 THEN 1 ELSE 0 END FROM outbox"))
    fail_msg("payments are still pending");
  rows = audit_rows(s, "acme", NULL);
  for (int i = 0; i < N; i++) {
    char got[512];
    const char *status = exits[i] == 0 ? "declined" : "succeeded";
    h_context("payment %d (%s), resolve exited %d", i, ids[i], exits[i]);
    assert_true(exits[i] == 0 || exits[i] == 1);
    h_assert_db(s, 1, "SELECT count(*) FROM payments WHERE id = ?1 AND status = ?2", ids[i],
                status);
    changes_of(rows, ids[i], got, sizeof got);
    snprintf(want, sizeof want, "pending>%s %s\n", status,
             exits[i] == 0 ? "operator:carol|race" : "reconciler|looked up at the provider");
    if (strstr(got, want) == NULL || occurrences(got, "pending>") != 1)
      fail_msg("audit of %s:\n%s\nwanted one settlement: %s", ids[i], got, want);
    by_operator += exits[i] == 0;
  }
  h_context_clear();
  print_message("# %d of %d settled by the operator, the rest by the reconciler\n",
                by_operator, N);
  json_decref(rows);
  h_server_stop(s);
}

/* A payment whose request is still at the provider (the sandbox waits
 * 1.5 s) is held under its request's lease: resolve waits for it, finds
 * it settled by its request, and exits 1 with nothing changed; the request
 * answers 201. */
struct slow_post {
  h_server_t *s;
  const char *token;
  h_resp_t r;
};

static void *slow_post(void *arg) {
  struct slow_post *p = arg;
  h_post(p->s, "/payments", p->token, "slow", "{\"amount\": 1000}", &p->r);
  return NULL;
}

static void test_resolve_waits_for_the_request(void **state) {
  static const char *const slow[] = {"--sandbox-delay", "1500ms", NO_RECONCILER, NULL};
  h_server_t *s = h_server_start(slow);
  struct slow_post p = {s, h_tenant(s, "acme"), {0}};
  pthread_t t;
  char *id;
  (void)state;

  assert_int_equal(pthread_create(&t, NULL, slow_post, &p), 0);
  if (!h_db_wait(s, 10000, "SELECT count(*) FROM idempotency_records WHERE key = 'slow' "
                           "AND state = 'processing'"))
    fail_msg("the payment was never in flight");
  id = h_db_text(s, "SELECT resource_id FROM idempotency_records WHERE key = 'slow'");
  assert_int_equal(resolve(s, "payments", id, "declined", "x", "alice"), 1);
  pthread_join(t, NULL);
  h_assert_status(&p.r, 201);
  h_assert_db(s, 1, "SELECT count(*) FROM payments WHERE id = ?1 AND status = 'succeeded'",
              id);
  h_assert_db(s, 0, "SELECT count(*) FROM audit WHERE actor LIKE 'operator:%'");
  free(id);
  h_resp_free(&p.r);
  h_server_stop(s);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_every_transition, h_teardown),
      cmocka_unit_test_teardown(test_resolve_payment, h_teardown),
      cmocka_unit_test_teardown(test_resolve_refund, h_teardown),
      cmocka_unit_test_teardown(test_resolve_races_reconciler, h_teardown),
      cmocka_unit_test_teardown(test_resolve_waits_for_the_request, h_teardown),
  };
  int rc;
  h_init(argc, argv);
  rc = cmocka_run_group_tests_name("integration: audit", tests, NULL, NULL);
  curl_global_cleanup();
  return rc;
}
