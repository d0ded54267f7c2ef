/* The `idem` command against the real idemd and the provider simulator
 * (idem-psp) with faults: answers lost on the way back (a proxy in front of
 * idemd drops them after idemd did the work), an idemd that is not up yet,
 * and a provider that times out after charging, fails and drops at random
 * (--chaos). Whatever happens, the command ends with the payment (201) and
 * the provider charged it exactly once. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <curl/curl.h>

#include "support.h"

#define RUN_TIMEOUT_S 120.0
#define NPAYMENTS 5
#define DEFAULT_SEED "20261130"

/* idemd's side of docs/idempotency.md, section 4, made fast: a provider call
 * past 500 ms is uncertain (202, pending), and the reconciler settles it within
 * ~200 ms. */
#define IDEMD_FLAGS(provider)                                                            \
  "--provider", (provider), "--provider-timeout", "500ms", "--lease", "2s",              \
      "--reconcile-interval", "200ms"

/* What one test started; the teardown cleans up after a failure. */
static struct env {
  char *dir;
  ct_proc_t psp, idemd;
  ct_proxy_t *proxy;
  char *token;
  char psp_url[64];
  char db[512];
} g;

static const char *seed(void) {
  const char *s = getenv("IDEM_TEST_SEED");
  return s && s[0] ? s : DEFAULT_SEED;
}

static int setup(void **state) {
  (void)state;
  memset(&g, 0, sizeof g);
  g.dir = ct_tempdir();
  snprintf(g.db, sizeof g.db, "%s/idem.db", g.dir);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  ct_proxy_stop(g.proxy);
  ct_proc_kill(&g.idemd);
  ct_proc_kill(&g.psp);
  free(g.token);
  ct_rmdir(g.dir);
  memset(&g, 0, sizeof g);
  return 0;
}

static void start_psp(const char *const *flags) {
  ct_psp_start(&g.psp, g.dir, flags);
  snprintf(g.psp_url, sizeof g.psp_url, "http://127.0.0.1:%d", g.psp.port);
}

/* Runs `idem request --max-time 60 [extra] POST URL BODY` to completion;
 * the token travels in the environment, as a script would pass it. */
static void pay(ct_run_t *r, int port, const char *extra, const char *body) {
  char env[512];
  char url[128];
  const char *argv[12];
  int n = 0;

  snprintf(env, sizeof env, "IDEM_TOKEN=%s", g.token);
  snprintf(url, sizeof url, "http://127.0.0.1:%d/payments", port);
  argv[n++] = ct_cli_path();
  argv[n++] = "request";
  argv[n++] = "--max-time";
  argv[n++] = "60";
  if (extra)
    argv[n++] = extra;
  argv[n++] = "POST";
  argv[n++] = url;
  argv[n++] = body;
  argv[n] = NULL;
  ct_run(r, argv, (const char *const[]){env, NULL}, RUN_TIMEOUT_S);
  if (r->timed_out)
    fail_msg("idem did not finish; stderr: %s", r->err);
  print_message("%s", r->err);
}

/* The payment the command printed: its id (into `id`), status succeeded. */
static void assert_paid(const ct_run_t *r, char *id, size_t cap) {
  json_t *doc = json_loads(r->out, 0, NULL);
  const char *pid = json_string_value(json_object_get(doc, "id"));
  const char *status = json_string_value(json_object_get(doc, "status"));
  if (pid == NULL || status == NULL || strcmp(status, "succeeded") != 0 ||
      strncmp(pid, "pay_", 4) != 0)
    fail_msg("not a succeeded payment: %s", r->out);
  snprintf(id, cap, "%s", pid);
  json_decref(doc);
}

/* idem-psp's /stats: total charges, and the charges under provider key
 * `key` (idemd's key at the provider is the payment id). */
static void psp_charges(const char *key, int64_t *total, int64_t *for_key,
                        size_t *nkeys) {
  json_t *stats = ct_get_json(g.psp.port, "/stats", NULL);
  json_t *keys = json_object_get(stats, "keys");
  if (!json_is_integer(json_object_get(stats, "charges")) || !json_is_object(keys))
    fail_msg("bad /stats from idem-psp");
  *total = json_integer_value(json_object_get(stats, "charges"));
  *for_key = json_integer_value(json_object_get(json_object_get(keys, key), "charges"));
  *nkeys = json_object_size(keys);
  json_decref(stats);
}

/* The provider made `want` charges in all; when not, says how idemd's
 * payments ended (a payment marked failed after its charge went out, then
 * run again under the same key as a new payment, is a second charge). */
static void assert_total_charges(int64_t total, int64_t want) {
  if (total != want)
    fail_msg("the provider made %lld charges for %lld intents (seed %s); idemd has "
             "%lld payments, %lld of them failed",
             (long long)total, (long long)want, seed(),
             (long long)ct_db_int(g.db, "SELECT count(*) FROM payments"),
             (long long)ct_db_int(
                 g.db, "SELECT count(*) FROM payments WHERE status = 'failed'"));
}

static void stop_all(void) {
  ct_proxy_stop(g.proxy);
  g.proxy = NULL;
  ct_proc_stop(&g.idemd);
  ct_proc_stop(&g.psp);
}

/* The first two answers are lost after idemd did the work (the first one
 * charged, under chaos at the provider): the command sends the same
 * request under the same key until one answer arrives, and the provider
 * charged once. */
static void test_lost_answers_one_charge(void **state) {
  char chaos_seed[32], key[300], id[64];
  ct_seen_t seen[CT_MAX_SEEN];
  long status;
  int attempts, polls, n;
  int64_t total, for_key;
  size_t nkeys;
  ct_run_t r;
  (void)state;

  snprintf(chaos_seed, sizeof chaos_seed, "%s", seed());
  start_psp((const char *const[]){"--chaos", "0.6", "--seed", chaos_seed, NULL});
  ct_idemd_start(&g.idemd, g.dir, 0, (const char *const[]){IDEMD_FLAGS(g.psp_url), NULL});
  g.token = ct_tenant(g.dir, "shop");
  g.proxy = ct_proxy_start(g.idemd.port, 2);

  pay(&r, ct_proxy_port(g.proxy), NULL, "{\"amount\":15990,\"order_id\":\"ord_42\"}");
  if (r.exit_code != 0)
    fail_msg("exit %d (seed %s); stderr: %s", r.exit_code, chaos_seed, r.err);
  assert_int_equal(ct_parse_line(r.err, &status, key, &attempts, &polls), 0);
  assert_int_equal(status, 201);
  assert_true(attempts >= 3); /* two answers lost, then one heard */
  assert_paid(&r, id, sizeof id);

  /* Every request of the intent carried its one key. */
  n = ct_proxy_seen(g.proxy, seen);
  assert_true(n >= attempts);
  for (int i = 0; i < n && i < CT_MAX_SEEN; i++)
    if (strcmp(seen[i].method, "POST") == 0 && strcmp(seen[i].key, key) != 0)
      fail_msg("request %d had key '%s', want '%s'", i, seen[i].key, key);

  psp_charges(id, &total, &for_key, &nkeys);
  assert_total_charges(total, 1);
  assert_int_equal(for_key, 1);
  assert_int_equal(nkeys, 1);
  stop_all();
  assert_int_equal(ct_db_int(g.db, "SELECT count(*) FROM payments"), 1);
  assert_int_equal(
      ct_db_int(g.db, "SELECT count(*) FROM payments WHERE status = 'succeeded'"), 1);
  ct_run_free(&r);
}

/* idemd is not up when the command starts (connections refused), and when
 * it is, the provider times out after charging (202, then the reconciler
 * settles it): the command retries, follows the 202, and ends with 201 and
 * one charge. */
static void test_idemd_started_late(void **state) {
  char env[512], url[128], key[300], id[64];
  long status;
  int attempts, polls, port = ct_free_port();
  int64_t total, for_key;
  size_t nkeys;
  ct_run_t r;
  (void)state;

  start_psp((const char *const[]){"--delay-after-charge", "1s", NULL});
  g.token = ct_tenant(g.dir, "shop"); /* creates the database before idemd runs */
  snprintf(env, sizeof env, "IDEM_TOKEN=%s", g.token);
  snprintf(url, sizeof url, "http://127.0.0.1:%d/payments", port);
  ct_run_start(&r,
               (const char *const[]){ct_cli_path(), "request", "--max-time", "60",
                                     "--max-attempts", "40", "POST", url,
                                     "{\"amount\":2500}", NULL},
               (const char *const[]){env, NULL});
  ct_nap_ms(1500);
  ct_idemd_start(&g.idemd, g.dir, port,
                 (const char *const[]){IDEMD_FLAGS(g.psp_url), NULL});
  ct_run_wait(&r, RUN_TIMEOUT_S);
  print_message("%s", r.err);
  if (r.exit_code != 0)
    fail_msg("exit %d; stderr: %s", r.exit_code, r.err);
  assert_int_equal(ct_parse_line(r.err, &status, key, &attempts, &polls), 0);
  assert_int_equal(status, 201);
  assert_true(attempts >= 2); /* refused at least once */
  assert_paid(&r, id, sizeof id);

  psp_charges(id, &total, &for_key, &nkeys);
  assert_total_charges(total, 1);
  assert_int_equal(for_key, 1);
  stop_all();
  assert_int_equal(ct_db_int(g.db, "SELECT count(*) FROM payments"), 1);
  ct_run_free(&r);
}

/* Several payments, one after the other, each its own intent and key,
 * against a provider that fails at random: each ends 201, each is charged
 * once, and nothing else is. */
static void test_chaos_payments(void **state) {
  char chaos_seed[32], ids[NPAYMENTS][64], keys[NPAYMENTS][300];
  int64_t total, for_key;
  size_t nkeys;
  (void)state;

  snprintf(chaos_seed, sizeof chaos_seed, "%s", seed());
  start_psp((const char *const[]){"--chaos", "0.6", "--seed", chaos_seed, NULL});
  ct_idemd_start(&g.idemd, g.dir, 0, (const char *const[]){IDEMD_FLAGS(g.psp_url), NULL});
  g.token = ct_tenant(g.dir, "shop");
  /* The answer to the very first request is lost too. */
  g.proxy = ct_proxy_start(g.idemd.port, 1);

  for (int i = 0; i < NPAYMENTS; i++) {
    char body[64];
    long status;
    int attempts, polls;
    ct_run_t r;
    snprintf(body, sizeof body, "{\"amount\":%d}", 1000 + i);
    pay(&r, ct_proxy_port(g.proxy), NULL, body);
    if (r.exit_code != 0)
      fail_msg("payment %d: exit %d (seed %s); stderr: %s", i, r.exit_code, chaos_seed,
               r.err);
    assert_int_equal(ct_parse_line(r.err, &status, keys[i], &attempts, &polls), 0);
    assert_int_equal(status, 201);
    assert_paid(&r, ids[i], sizeof ids[i]);
    for (int j = 0; j < i; j++) {
      assert_string_not_equal(keys[i], keys[j]);
      assert_string_not_equal(ids[i], ids[j]);
    }
    ct_run_free(&r);
  }
  for (int i = 0; i < NPAYMENTS; i++) {
    psp_charges(ids[i], &total, &for_key, &nkeys);
    if (for_key != 1)
      fail_msg("%s charged %lld times (seed %s)", ids[i], (long long)for_key, chaos_seed);
  }
  assert_total_charges(total, NPAYMENTS);
  assert_int_equal(nkeys, NPAYMENTS);
  stop_all();
  assert_int_equal(ct_db_int(g.db, "SELECT count(*) FROM payments"), NPAYMENTS);
}

/* Against idemd itself: -H X-Request-Id is the id idemd logs and echoes;
 * the same --key again, with --data from a file, is a replay, and
 * --verbose says so with the payment's Location; one charge. */
static void test_replay_verbose(void **state) {
  char env[512], url[128], path[600], data[620], want[256], id[64];
  int64_t total, for_key;
  size_t nkeys;
  FILE *f;
  ct_run_t r;
  (void)state;

  start_psp(NULL);
  ct_idemd_start(&g.idemd, g.dir, 0, (const char *const[]){IDEMD_FLAGS(g.psp_url), NULL});
  g.token = ct_tenant(g.dir, "shop");
  snprintf(env, sizeof env, "IDEM_TOKEN=%s", g.token);
  snprintf(url, sizeof url, "http://127.0.0.1:%d/payments", g.idemd.port);
  snprintf(path, sizeof path, "%s/pay.json", g.dir);
  assert_non_null(f = fopen(path, "w"));
  fputs("{\"amount\": 4200, \"order_id\": \"ord_7\"}\n", f);
  assert_int_equal(fclose(f), 0);
  snprintf(data, sizeof data, "@%s", path);

  for (int i = 0; i < 2; i++) {
    ct_run(&r,
           (const char *const[]){ct_cli_path(), "request", "--verbose", "--key",
                                 "intent-7", "-H",
                                 i ? "X-Request-Id: trace-2" : "X-Request-Id: trace-1",
                                 "--data", data, "--", "POST", url, NULL},
           (const char *const[]){env, NULL}, RUN_TIMEOUT_S);
    print_message("%s", r.err);
    if (r.exit_code != 0)
      fail_msg("run %d: exit %d; stderr: %s", i, r.exit_code, r.err);
    if (i == 0)
      assert_paid(&r, id, sizeof id);
    snprintf(want, sizeof want,
             "\nidem: answer 201%s location=/payments/%s request_id=trace-%d\n",
             i ? " replayed" : "", id, i + 1);
    if (strstr(r.err, want) == NULL)
      fail_msg("run %d: stderr lacks '%s': %s", i, want + 1, r.err);
    assert_non_null(strstr(r.err, "idem: attempt 1: POST "));
    ct_run_free(&r);
  }
  psp_charges(id, &total, &for_key, &nkeys);
  assert_total_charges(total, 1);
  stop_all();
}

/* `PROGRAM --version` exits 0 and prints one line "NAME VERSION"; returns
 * VERSION (malloc'd). */
static char *version_of(const char *path, const char *name) {
  ct_run_t r;
  size_t n = strlen(name);
  char *v;

  ct_run(&r, (const char *const[]){path, "--version", NULL}, NULL, 30);
  if (r.exit_code != 0 || strncmp(r.out, name, n) != 0 || r.out[n] != ' ' ||
      r.out_len < n + 3 || r.out[r.out_len - 1] != '\n' ||
      memchr(r.out, '\n', r.out_len - 1) != NULL)
    fail_msg("%s --version: exit %d, stdout '%s', stderr '%s'", name, r.exit_code, r.out,
             r.err);
  v = strndup(r.out + n + 1, r.out_len - n - 2);
  ct_run_free(&r);
  return v;
}

/* idemd, idem and idem-psp print one version: the project's (CMake's
 * project(VERSION), in IDEM_TEST_VERSION), with the same git revision. */
static void test_versions_agree(void **state) {
  const char *want = getenv("IDEM_TEST_VERSION");
  char *d = version_of(ct_idemd_path(), "idemd");
  char *c = version_of(ct_cli_path(), "idem");
  char *p = version_of(ct_psp_path(), "idem-psp");
  size_t n = want ? strlen(want) : 0;
  (void)state;

  if (want == NULL || n == 0)
    fail_msg("set IDEM_TEST_VERSION to the project's version");
  if (strncmp(d, want, n) != 0 || (d[n] != '\0' && strncmp(d + n, " (git ", 6) != 0) ||
      (d[n] != '\0' && d[strlen(d) - 1] != ')'))
    fail_msg("idemd --version says '%s', not %s or %s (git ...)", d, want, want);
  assert_string_equal(c, d);
  assert_string_equal(p, d);
  free(d);
  free(c);
  free(p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_versions_agree),
      cmocka_unit_test_setup_teardown(test_replay_verbose, setup, teardown),
      cmocka_unit_test_setup_teardown(test_lost_answers_one_charge, setup, teardown),
      cmocka_unit_test_setup_teardown(test_idemd_started_late, setup, teardown),
      cmocka_unit_test_setup_teardown(test_chaos_payments, setup, teardown),
  };
  int failed;
  if (!ct_cli_path() || !ct_idemd_path() || !ct_psp_path()) {
    fprintf(stderr, "set IDEM_TEST_CLI, IDEM_TEST_IDEMD and IDEM_TEST_PSP\n");
    return 2;
  }
  curl_global_init(CURL_GLOBAL_DEFAULT);
  failed = cmocka_run_group_tests(tests, NULL, NULL);
  curl_global_cleanup();
  return failed;
}
