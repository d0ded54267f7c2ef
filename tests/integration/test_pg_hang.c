/* A database that hangs must not hang idem (docs/operations.md, "When
 * PostgreSQL hangs"): with --db-timeout=1s, new payments answer 503 with
 * Retry-After within a generous bound (10 s) while another session holds
 * an ACCESS EXCLUSIVE lock on the records table, and while every process
 * of the cluster is stopped with SIGSTOP; afterwards idemd, never
 * restarted, answers 201 again, the keys cut off (with 16 new payments
 * sent at once, a batch of many) make one payment each,
 * and nothing acknowledged is lost or made twice. A start against a
 * stopped cluster exits with a message instead of hanging. PostgreSQL
 * only: run it through scripts/with-pg.sh (IDEM_TEST_PG_DIR). */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <libpq-fe.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

#define BOUND_S 10.0 /* the bound is 1 s (2 s for a stopped server) */
#define KEYS 4
#define TOGETHER 16 /* new payments sent at once while the table is locked */

static const char *const flags[] = {"--db-timeout=1s", "--lease=1s",
                                    "--provider-timeout=500ms",
                                    "--reconcile-interval=200ms", NULL};

/* The cluster's processes this test stopped, resumed on every path. */
static pid_t stopped[256];
static int nstopped;
/* The session that locks the records table, closed on every path. */
static PGconn *locker;

static void resume_all(void) {
  for (int i = 0; i < nstopped; i++)
    (void)kill(stopped[i], SIGCONT);
  nstopped = 0;
}

static void nap_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
}

/* A new-key payment that must answer 503, a plain error with Retry-After,
 * within the bound. Returns the seconds it took. */
static double expect_503(h_server_t *s, const char *tok, const char *key) {
  h_resp_t r;
  double took;
  h_context("POST /payments %s while the database hangs", key);
  h_post(s, "/payments", tok, key, "{\"amount\": 500}", &r);
  h_assert_error(&r, 503, NULL);
  if (r.retry_after[0] == '\0')
    fail_msg("503 without Retry-After");
  if (r.seconds > BOUND_S)
    fail_msg("answered after %.1f s", r.seconds);
  took = r.seconds;
  h_resp_free(&r);
  h_context_clear();
  return took;
}

/* GET `path` until it answers `status` (bounded); returns the seconds. */
static double await_status(h_server_t *s, const char *path, long status) {
  double t0 = h_now();
  for (;;) {
    h_resp_t r;
    h_get(s, path, NULL, &r);
    long got = r.status;
    h_resp_free(&r);
    if (got == status)
      return h_now() - t0;
    if (h_now() - t0 > BOUND_S)
      fail_msg("GET %s: %ld, not %ld, for %.0f s", path, got, status, BOUND_S);
    nap_ms(50);
  }
}

/* A client retries `key` as Retry-After says until it gets a final answer:
 * a 201. Returns its payment id (malloc'd). */
static char *retry_until_201(h_server_t *s, const char *tok, const char *key) {
  h_resp_t r = {0};
  char *id;
  h_context("retry of %s after the database came back", key);
  for (int attempt = 0; attempt < 15; attempt++) {
    h_post(s, "/payments", tok, key, "{\"amount\": 500}", &r);
    if (r.status != 409 && r.status != 503)
      break;
    h_resp_free(&r);
    nap_ms(1000);
  }
  h_assert_status(&r, 201);
  id = strdup(h_id(&r));
  h_resp_free(&r);
  h_context_clear();
  return id;
}

/* New payments under prefix-0.. while the database hangs: each 503 (see
 * expect_503()). Returns the seconds from `since` to the first answer. */
static double all_503(h_server_t *s, const char *tok, const char *prefix, double since) {
  double first = 0;
  for (int i = 0; i < KEYS; i++) {
    char key[32];
    snprintf(key, sizeof key, "%s-%d", prefix, i);
    (void)expect_503(s, tok, key);
    if (i == 0)
      first = h_now() - since;
  }
  return first;
}

/* Each of those retried until 201; ids[i] gets its payment. Returns the
 * seconds from `since` to the first 201. */
static double retry_all(h_server_t *s, const char *tok, const char *prefix, char **ids,
                        double since) {
  double first = 0;
  for (int i = 0; i < KEYS; i++) {
    char key[32];
    snprintf(key, sizeof key, "%s-%d", prefix, i);
    ids[i] = retry_until_201(s, tok, key);
    if (i == 0)
      first = h_now() - since;
  }
  return first;
}

/* Payments acknowledged before: each still its key's replay, same id. */
static void assert_replays(h_server_t *s, const char *tok, char **ids, const char *prefix) {
  for (int i = 0; i < KEYS; i++) {
    char key[32];
    h_resp_t r;
    snprintf(key, sizeof key, "%s-%d", prefix, i);
    h_context("replay of %s", key);
    h_post(s, "/payments", tok, key, "{\"amount\": 500}", &r);
    h_assert_status(&r, 201);
    assert_string_equal(r.replayed, "true");
    assert_string_equal(h_id(&r), ids[i]);
    h_resp_free(&r);
  }
  h_context_clear();
}

static void pay_all(h_server_t *s, const char *tok, const char *prefix, char **ids) {
  for (int i = 0; i < KEYS; i++) {
    char key[32];
    h_resp_t r;
    snprintf(key, sizeof key, "%s-%d", prefix, i);
    h_post(s, "/payments", tok, key, "{\"amount\": 500}", &r);
    h_assert_first(&r, 201);
    ids[i] = strdup(h_id(&r));
    h_resp_free(&r);
  }
}

/* Every key made exactly one payment, which its completed record names,
 * and nothing is left half done. */
static void assert_one_payment_per_key(h_server_t *s, int keys) {
  if (!h_db_wait(s, 10000,
                 "SELECT CASE WHEN count(*) = 0 THEN 1 ELSE 0 END FROM "
                 "idempotency_records WHERE state IN ('processing', 'pending')"))
    fail_msg("records still processing or pending 10 s after recovery");
  h_assert_db(s, keys, "SELECT count(*) FROM payments");
  h_assert_db(s, keys, "SELECT count(DISTINCT id) FROM payments");
  h_assert_db(s, keys,
              "SELECT count(*) FROM idempotency_records r JOIN payments p ON p.id = "
              "r.resource_id AND p.status = 'succeeded' WHERE r.state = 'completed' "
              "AND r.response_status = 201 AND r.operation = 'create_payment'");
  h_assert_db(s, keys, "SELECT count(*) FROM idempotency_records");
  h_assert_db(s, 0, "SELECT count(*) FROM outbox");
}

/* TOGETHER new payments at once (writes enough to meet the lock in a
 * batch of many): each answers 503 with Retry-After within the bound, as a
 * write alone does (docs/operations.md, "When PostgreSQL hangs"). */
static void together_503(h_server_t *s, const char *tok) {
  h_req_t reqs[TOGETHER];
  h_resp_t out[TOGETHER];
  char keys[TOGETHER][32];

  memset(reqs, 0, sizeof reqs);
  for (int i = 0; i < TOGETHER; i++) {
    snprintf(keys[i], sizeof keys[i], "together-%d", i);
    reqs[i] = (h_req_t){.method = "POST", .path = "/payments", .token = tok,
                        .key = keys[i], .body = "{\"amount\": 500}"};
  }
  h_together(s, reqs, TOGETHER, out);
  for (int i = 0; i < TOGETHER; i++) {
    h_context("POST /payments %s, one of %d at once, while the database hangs",
              keys[i], TOGETHER);
    h_assert_error(&out[i], 503, NULL);
    if (out[i].retry_after[0] == '\0')
      fail_msg("503 without Retry-After");
    if (out[i].seconds > BOUND_S)
      fail_msg("answered after %.1f s", out[i].seconds);
    h_resp_free(&out[i]);
  }
  h_context_clear();
}

/* Each of those retried until 201, once the database is back: a key cut
 * off makes one payment. */
static void together_201(h_server_t *s, const char *tok) {
  for (int i = 0; i < TOGETHER; i++) {
    char key[32];
    snprintf(key, sizeof key, "together-%d", i);
    free(retry_until_201(s, tok, key));
  }
}

static void free_ids(char **ids) {
  for (int i = 0; i < KEYS; i++)
    free(ids[i]);
}

static void test_records_table_locked(void **state) {
  h_server_t *s = h_server_start(flags);
  const char *tok = h_tenant(s, "acme");
  char *before[KEYS], *cut[KEYS];
  PGresult *res;
  double t_lock, first_503 = 0, ready_503, t_release, recovered;
  h_resp_t r;
  (void)state;

  pay_all(s, tok, "before", before);
  locker = PQconnectdb(s->db);
  assert_int_equal(PQstatus(locker), CONNECTION_OK);
  res = PQexec(locker, "BEGIN; LOCK TABLE idempotency_records IN ACCESS EXCLUSIVE MODE");
  assert_int_equal(PQresultStatus(res), PGRES_COMMAND_OK);
  PQclear(res);
  t_lock = h_now();

  first_503 = all_503(s, tok, "locked", t_lock);
  together_503(s, tok);
  /* /readyz: the probe (each second without a write) takes the lock a
   * write of a record takes, and fails at lock_timeout. /healthz, the
   * liveness check, asks the store a SELECT 1, which the lock does not
   * stop: 200 (a restart would not help). */
  ready_503 = await_status(s, "/readyz", 503);
  h_get(s, "/readyz", NULL, &r);
  h_assert_error(&r, 503, "writes are failing");
  h_resp_free(&r);
  h_get(s, "/healthz", NULL, &r);
  h_assert_status(&r, 200);
  h_resp_free(&r);

  res = PQexec(locker, "ROLLBACK");
  PQclear(res);
  PQfinish(locker);
  locker = NULL;
  t_release = h_now();
  recovered = retry_all(s, tok, "locked", cut, t_release);
  await_status(s, "/readyz", 200);
  assert_replays(s, tok, before, "before");
  assert_replays(s, tok, cut, "locked");
  together_201(s, tok);
  assert_one_payment_per_key(s, 2 * KEYS + TOGETHER);
  fprintf(stderr,
          "records table locked: first 503 %.3f s after the lock, /readyz 503 %.3f s "
          "later (/healthz 200); first 201 %.3f s after its release\n",
          first_503, ready_503, recovered);
  free_ids(before);
  free_ids(cut);
  h_server_stop(s);
}

/* The postmaster's pid (data/postmaster.pid, first line) and those of its
 * children, stopped in that order: a stopped postmaster forks no more. */
static void stop_cluster(void) {
  char path[512], line[32];
  FILE *f;
  pid_t pm;
  DIR *d;
  struct dirent *e;

  snprintf(path, sizeof path, "%s/data/postmaster.pid", getenv("IDEM_TEST_PG_DIR"));
  f = fopen(path, "r");
  assert_non_null(f);
  assert_non_null(fgets(line, sizeof line, f));
  fclose(f);
  pm = (pid_t)atoi(line);
  assert_true(pm > 1);
  assert_int_equal(kill(pm, SIGSTOP), 0);
  stopped[nstopped++] = pm;
  assert_non_null(d = opendir("/proc"));
  while ((e = readdir(d)) != NULL && nstopped < (int)(sizeof stopped / sizeof *stopped)) {
    char stat[1024], *close_paren;
    int ppid = 0;
    pid_t pid = (pid_t)atoi(e->d_name);
    if (pid <= 0)
      continue;
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    if ((f = fopen(path, "r")) == NULL)
      continue;
    if (fgets(stat, sizeof stat, f) && (close_paren = strrchr(stat, ')')) != NULL &&
        sscanf(close_paren + 2, "%*c %d", &ppid) == 1 && ppid == pm &&
        kill(pid, SIGSTOP) == 0)
      stopped[nstopped++] = pid;
    fclose(f);
  }
  closedir(d);
  assert_true(nstopped > 1); /* the postmaster and its backends */
}

/* `idemd migrate` against the stopped cluster ends, with a message, in
 * the bound. */
static void assert_start_is_bounded(h_server_t *s) {
  char log[300], why[128], db[600];
  const char *idemd = getenv("IDEM_TEST_IDEMD");
  double t0 = h_now();
  int status = 0;
  pid_t pid;

  snprintf(log, sizeof log, "%s/migrate-stuck.log", s->dir);
  snprintf(db, sizeof db, "%s", s->db);
  char *argv[] = {(char *)idemd, "migrate", "--db", db, "--db-timeout=1s", NULL};
  pid = h_spawn_logged(argv, log, "IDEMD_", why, sizeof why);
  assert_true(pid > 0);
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (h_now() - t0 > BOUND_S) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      fail_msg("idemd migrate against a stopped database ran for %.0f s", BOUND_S);
    }
    nap_ms(50);
  }
  assert_true(WIFEXITED(status) && WEXITSTATUS(status) != 0);
  char *text = h_read_file(log, NULL);
  assert_non_null(text);
  if (strstr(text, "idemd: cannot") == NULL)
    fail_msg("no clear message from idemd migrate: %s", text);
  fprintf(stderr, "idemd migrate on the stopped cluster: exit %d after %.3f s\n",
          WEXITSTATUS(status), h_now() - t0);
  free(text);
}

static void test_server_stopped(void **state) {
  h_server_t *s = h_server_start(flags);
  const char *tok = h_tenant(s, "acme");
  char *before[KEYS], *cut[KEYS], *after[KEYS];
  double t_stop, first_503 = 0, health_503, t_cont, health_200, recovered;
  (void)state;

  pay_all(s, tok, "before", before);
  t_stop = h_now();
  stop_cluster();
  first_503 = all_503(s, tok, "stopped", t_stop);
  together_503(s, tok);
  health_503 = await_status(s, "/healthz", 503);
  assert_start_is_bounded(s);

  int nproc = nstopped;
  t_cont = h_now();
  resume_all();
  health_200 = await_status(s, "/healthz", 200);
  recovered = retry_all(s, tok, "stopped", cut, t_cont);
  pay_all(s, tok, "after", after);
  assert_replays(s, tok, before, "before");
  assert_replays(s, tok, cut, "stopped");
  together_201(s, tok);
  assert_one_payment_per_key(s, 3 * KEYS + TOGETHER);
  fprintf(stderr,
          "cluster stopped (%d processes): first 503 %.3f s after SIGSTOP, /healthz 503 "
          "%.3f s later; after SIGCONT /healthz 200 in %.3f s, first 201 in %.3f s\n",
          nproc, first_503, health_503, health_200, recovered);
  free_ids(before);
  free_ids(cut);
  free_ids(after);
  h_server_stop(s);
}

/* The cluster is resumed on every path (a failed assertion jumps here). */
static int teardown(void **state) {
  resume_all();
  PQfinish(locker);
  locker = NULL;
  return h_teardown(state);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_records_table_locked, teardown),
      cmocka_unit_test_teardown(test_server_stopped, teardown),
  };
  int rc;
  h_init(argc, argv);
  if (!h_store_is_pg() || getenv("IDEM_TEST_PG_DIR") == NULL) {
    fprintf(stderr, "needs a PostgreSQL cluster of its own (run it through "
                    "scripts/with-pg.sh): skipped\n");
    curl_global_cleanup();
    return 77;
  }
  atexit(resume_all);
  rc = cmocka_run_group_tests_name("integration: a database that hangs", tests, NULL,
                                   NULL);
  resume_all();
  curl_global_cleanup();
  return rc;
}
