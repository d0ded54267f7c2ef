/* The database goes away under load and comes back (docs/scaling.md,
 * "Failover and restarts"): a steady load of new payments against one
 * idemd while the PostgreSQL cluster is stopped and started again. During
 * the outage requests answer 503 with a plain error and /healthz is 503;
 * afterwards idemd, never restarted, answers 201 again; every 201 stands
 * for exactly one payment, and a key cut off by the outage, retried, ends
 * with one payment too. PostgreSQL only: run it through scripts/with-pg.sh,
 * which sets IDEM_TEST_PG_DIR for scripts/pg-cluster.sh stop and start. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

#ifndef IDEM_PG_CLUSTER_SH
#define IDEM_PG_CLUSTER_SH "scripts/pg-cluster.sh"
#endif

#define LOADERS 3
#define MAX_ANSWERS 6000 /* per loader: 5 ms apart, far more than a run sends */
#define PACE_MS 5
#define OUTAGE_S 1.5
#define AFTER_S 2.0
#define LAST_N 30

/* One answer of the load, as the loader saw it. */
struct answer {
  char key[32];
  char id[64];     /* 201: the payment id */
  long status;     /* 0: transport error */
  int body_ok;     /* 201: the payment for this key; else {"error": "..."} alone */
  int retry_after; /* the header was there */
  char body[200];  /* the start of the body, for messages */
  double t_start, t_end;
};

struct loader {
  int index;
  h_server_t *s;
  const char *tok;
  struct answer *a;
  int n; /* answers recorded; guarded by lock */
  pthread_t thread;
  int running; /* started and not yet joined */
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static atomic_int stop_load;
static struct loader loaders[LOADERS];
static struct answer **all; /* every answer, sorted by the time it was sent */

static void nap_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
}

/* Waits (bounded) until the clock passes `t`: the length of the outage is
 * itself what the test is about. */
static void run_until(double t) {
  while (h_now() < t)
    nap_ms(10);
}

/* Text from a library or the store that must not reach a client. */
static const char *leak_in(const char *body) {
  static const char *const words[] = {"server", "connection", "socket",   "pg",
                                      "sql",    "/tmp",       "postgres", "libpq",
                                      "fatal",  "errno",      "terminat"};
  for (size_t i = 0; i < sizeof words / sizeof *words; i++)
    if (strcasestr(body, words[i]))
      return words[i];
  return NULL;
}

/* {"error": "<non-empty>"} and nothing else, without library text. */
static int plain_error(const h_resp_t *r) {
  json_t *e = json_object_get(r->json, "error");
  return json_is_object(r->json) && json_object_size(r->json) == 1 && json_is_string(e) &&
         json_string_length(e) > 0 && leak_in(r->body) == NULL;
}

static void record(struct loader *l, const char *key, long amount, const h_resp_t *r) {
  struct answer *a = &l->a[l->n];
  memset(a, 0, sizeof *a);
  snprintf(a->key, sizeof a->key, "%s", key);
  a->status = r->status;
  a->retry_after = r->retry_after[0] != '\0';
  a->t_end = r->t_end;
  a->t_start = r->t_end - r->seconds;
  snprintf(a->body, sizeof a->body, "%s", r->body ? r->body : "");
  if (r->status == 201) {
    const char *id = json_string_value(json_object_get(r->json, "id"));
    snprintf(a->id, sizeof a->id, "%s", id ? id : "");
    a->body_ok = id != NULL &&
                 json_integer_value(json_object_get(r->json, "amount")) == amount &&
                 r->replayed[0] == '\0';
  } else {
    a->body_ok = plain_error(r);
  }
  pthread_mutex_lock(&lock);
  l->n++;
  pthread_cond_broadcast(&changed);
  pthread_mutex_unlock(&lock);
}

/* A client that sends new payments one after another, each under a new
 * key, until told to stop. */
static void *load_main(void *p) {
  struct loader *l = p;
  CURL *c = curl_easy_init();
  char key[32], body[64];
  h_req_t req = {
      .method = "POST", .path = "/payments", .token = l->tok, .key = key, .body = body};
  if (c == NULL)
    return NULL;
  for (int i = 0; i < MAX_ANSWERS && !atomic_load(&stop_load); i++) {
    h_resp_t r;
    long amount = 100 + i;
    snprintf(key, sizeof key, "load-%d-%d", l->index, i);
    snprintf(body, sizeof body, "{\"amount\": %ld}", amount);
    h_http_on(c, l->s, &req, &r);
    record(l, key, amount, &r);
    h_resp_free(&r);
    nap_ms(PACE_MS);
  }
  curl_easy_cleanup(c);
  return NULL;
}

/* Waits (at most timeout_s) until the load has `want` answers with
 * `status` sent at `since` or later. Returns 1 if it did. */
static int wait_answers(long status, double since, int want, double timeout_s) {
  double deadline = h_now() + timeout_s;
  int ok = 0;
  pthread_mutex_lock(&lock);
  for (;;) {
    struct timespec ts;
    int got = 0;
    for (int l = 0; l < LOADERS; l++)
      for (int i = 0; i < loaders[l].n; i++)
        if (loaders[l].a[i].status == status && loaders[l].a[i].t_start >= since)
          got++;
    if (got >= want) {
      ok = 1;
      break;
    }
    if (h_now() > deadline)
      break;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 100 * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&changed, &lock, &ts);
  }
  pthread_mutex_unlock(&lock);
  return ok;
}

static void stop_loaders(void) {
  atomic_store(&stop_load, 1);
  for (int l = 0; l < LOADERS; l++)
    if (loaders[l].running) {
      pthread_join(loaders[l].thread, NULL);
      loaders[l].running = 0;
    }
}

/* scripts/pg-cluster.sh CMD DIR; fails unless it exits 0. */
static void pg_cluster(const char *cmd) {
  const char *script = getenv("IDEM_TEST_PG_CLUSTER");
  const char *dir = getenv("IDEM_TEST_PG_DIR");
  int status;
  pid_t pid;

  if (script == NULL || script[0] == '\0')
    script = IDEM_PG_CLUSTER_SH;
  assert_non_null(dir);
  pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    int devnull = open("/dev/null", O_WRONLY);
    if (devnull >= 0)
      dup2(devnull, 1); /* `start` prints the URL */
    execl(script, script, cmd, dir, (char *)NULL);
    _exit(127);
  }
  assert_int_equal(waitpid(pid, &status, 0), pid);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    fail_msg("%s %s %s: status 0x%x", script, cmd, dir, status);
}

/* GET /healthz answers `status`; a 503 is a plain error. */
static void assert_health(h_server_t *s, long status, const char *when) {
  h_resp_t r;
  h_context("GET /healthz %s", when);
  h_get(s, "/healthz", NULL, &r);
  if (status == 200) {
    h_assert_status(&r, 200);
    assert_string_equal(json_string_value(json_object_get(r.json, "status")), "ok");
  } else {
    h_assert_error(&r, status, NULL);
    if (leak_in(r.body))
      fail_msg("GET /healthz %s shows '%s': %s", when, leak_in(r.body), r.body);
  }
  h_context_clear();
  h_resp_free(&r);
}

static int by_start(const void *x, const void *y) {
  const struct answer *a = *(const struct answer *const *)x,
                      *b = *(const struct answer *const *)y;
  return a->t_start < b->t_start ? -1 : a->t_start > b->t_start;
}

static int by_id(const void *x, const void *y) {
  return strcmp((*(const struct answer *const *)x)->id,
                (*(const struct answer *const *)y)->id);
}

/* A PostgreSQL text[] literal of the keys (which = 0) or ids (which = 1) of
 * the answers (plain [a-z0-9_-] text: no quoting needed). malloc'd. */
static char *array_of(struct answer *const *v, int n, int which) {
  size_t cap = 2 + (size_t)n * 66, len = 0;
  char *out = malloc(cap);
  assert_non_null(out);
  out[len++] = '{';
  for (int i = 0; i < n; i++)
    len += (size_t)snprintf(out + len, cap - len, "%s%s", i ? "," : "",
                            which ? v[i]->id : v[i]->key);
  snprintf(out + len, cap - len, "}");
  return out;
}

/* A client retries a key the outage cut off (503) until it gets a final
 * answer, as Retry-After tells it to. It must be a 201 with the key's one
 * payment, whatever state the outage left the key in. */
static void retry_cut_off(h_server_t *s, const char *tok, const struct answer *a) {
  char body[64];
  h_resp_t r = {0};
  char *db_id;

  snprintf(body, sizeof body, "{\"amount\": %ld}",
           100 + strtol(strrchr(a->key, '-') + 1, NULL, 10));
  h_context("retry of %s (503 during the outage)", a->key);
  for (int attempt = 0; attempt < 8; attempt++) {
    h_post(s, "/payments", tok, a->key, body, &r);
    if (r.status != 409 && r.status != 503)
      break;
    h_resp_free(&r);
    nap_ms(1000); /* Retry-After: 1 */
  }
  h_assert_status(&r, 201);
  h_assert_db(s, 1,
              "SELECT count(*) FROM idempotency_records r JOIN payments p ON p.id = "
              "r.resource_id WHERE r.key = ?1 AND r.state = 'completed'",
              a->key);
  db_id =
      h_db_text(s, "SELECT resource_id FROM idempotency_records WHERE key = ?1", a->key);
  assert_non_null(db_id);
  assert_string_equal(db_id, h_id(&r));
  free(db_id);
  h_resp_free(&r);
  h_context_clear();
}

static void test_database_restart_under_load(void **state) {
  /* A short lease and reconciler period, so that a payment cut off between
   * its reservation and its completion is taken over soon after. */
  static const char *const flags[] = {"--lease=1s", "--provider-timeout=500ms",
                                      "--reconcile-interval=200ms", "--inflight-wait=3s",
                                      NULL};
  h_server_t *s = h_server_start(flags);
  const char *tok = h_tenant(s, "acme");
  int total = 0, n201 = 0, in_outage = 0, before = 0, after = 0, after_not_201 = 0,
      retried = 0, with_record = 0;
  double t_stop, t_down, t_restart, t_up;
  int64_t payments;
  char *keys, *ids;
  (void)state;

  atomic_store(&stop_load, 0);
  for (int l = 0; l < LOADERS; l++) {
    loaders[l] = (struct loader){.index = l, .s = s, .tok = tok};
    loaders[l].a = calloc(MAX_ANSWERS, sizeof *loaders[l].a);
    assert_non_null(loaders[l].a);
  }
  for (int l = 0; l < LOADERS; l++) {
    assert_int_equal(pthread_create(&loaders[l].thread, NULL, load_main, &loaders[l]), 0);
    loaders[l].running = 1;
  }

  /* Steady state, then the database stops under the load. */
  if (!wait_answers(201, 0, 30, 20.0))
    fail_msg("the load got no 201 answers before the outage");
  assert_health(s, 200, "before the outage");
  t_stop = h_now();
  pg_cluster("stop");
  t_down = h_now();
  assert_health(s, 503, "during the outage");
  if (!wait_answers(503, t_down, 10, 10.0))
    fail_msg("the load got no 503 answers during the outage");
  run_until(t_down + OUTAGE_S);
  assert_health(s, 503, "at the end of the outage");

  /* The database is back: idemd, not restarted, serves again. */
  t_restart = h_now();
  pg_cluster("start");
  t_up = h_now();
  assert_health(s, 200, "right after the database came back");
  if (!wait_answers(201, t_up, LAST_N, 10.0))
    fail_msg("no %d answers 201 after the database came back", LAST_N);
  run_until(t_up + AFTER_S);
  stop_loaders();

  /* Every answer, in the order sent. */
  for (int l = 0; l < LOADERS; l++)
    total += loaders[l].n;
  all = calloc((size_t)total, sizeof *all);
  assert_non_null(all);
  total = 0;
  for (int l = 0; l < LOADERS; l++)
    for (int i = 0; i < loaders[l].n; i++)
      all[total++] = &loaders[l].a[i];
  qsort(all, (size_t)total, sizeof *all, by_start);

  for (int i = 0; i < total; i++) {
    const struct answer *a = all[i];
    h_context("%s sent %+.3f s after the stop: %ld %s", a->key, a->t_start - t_stop,
              a->status, a->body);
    if (a->status != 201 && a->status != 503)
      fail_msg("[%s] want 201 or 503", a->key);
    if (!a->body_ok)
      fail_msg("[%s] %ld with a body that is not %s: %s", a->key, a->status,
               a->status == 201 ? "the payment" : "{\"error\": \"...\"} alone", a->body);
    if (a->status == 503 && !a->retry_after)
      fail_msg("[%s] 503 without Retry-After", a->key);
    if (a->t_end < t_stop) {
      before++;
      assert_int_equal(a->status, 201); /* the database was up */
    }
    if (a->t_start >= t_down && a->t_end <= t_restart) {
      in_outage++;
      assert_int_equal(a->status, 503); /* the database was down */
    }
    if (a->t_start >= t_up) {
      after++;
      if (a->status != 201)
        after_not_201++;
    }
    if (a->status == 201)
      n201++;
  }
  h_context_clear();
  fprintf(stderr,
          "load: %d answers, %d before the outage, %d inside it (%.1f s), %d after it "
          "(%d of them not 201)\n",
          total, before, in_outage, t_restart - t_down, after, after_not_201);
  assert_true(before >= 30);
  assert_true(in_outage >= 10);
  /* Recovered without a restart: the last answers are all 201. */
  assert_true(total > LAST_N);
  for (int i = total - LAST_N; i < total; i++) {
    h_context("answer %d of the last %d: %s", i - (total - LAST_N), LAST_N, all[i]->key);
    assert_int_equal(all[i]->status, 201);
  }
  h_context_clear();

  /* Every 201 is its own payment: distinct ids... */
  {
    struct answer **ok = calloc((size_t)n201 + 1, sizeof *ok);
    int k = 0;
    assert_non_null(ok);
    for (int i = 0; i < total; i++)
      if (all[i]->status == 201)
        ok[k++] = all[i];
    qsort(ok, (size_t)k, sizeof *ok, by_id);
    for (int i = 1; i < k; i++)
      if (strcmp(ok[i]->id, ok[i - 1]->id) == 0)
        fail_msg("keys %s and %s both answered payment %s", ok[i - 1]->key, ok[i]->key,
                 ok[i]->id);
    /* ...each in the database, the one payment of its completed key. */
    keys = array_of(ok, k, 0);
    ids = array_of(ok, k, 1);
    h_assert_db(s, k,
                "SELECT count(*) FROM unnest(?1::text[], ?2::text[]) AS a(key, id) "
                "JOIN idempotency_records r ON r.key = a.key AND r.resource_id = a.id "
                "AND r.operation = 'create_payment' AND r.state = 'completed' "
                "AND r.response_status = 201 "
                "JOIN payments p ON p.id = a.id AND p.status = 'succeeded'",
                keys, ids);
    free(keys);
    free(ids);
    free(ok);
  }

  /* Keys the outage cut off after their reservation committed: a retry
   * settles them (a replay or a fresh execution), never a second payment.
   * Plus a few that left nothing behind: they simply execute. */
  for (int i = 0; i < total; i++) {
    const struct answer *a = all[i];
    int has_record;
    if (a->status != 503)
      continue;
    has_record = (int)h_db_int(
        s, "SELECT count(*) FROM idempotency_records WHERE key = ?1", a->key);
    if (has_record || retried < 3) {
      retry_cut_off(s, tok, a);
      retried++;
      with_record += has_record;
    }
  }
  fprintf(stderr, "retried %d keys answered 503, %d of them left a record behind\n",
          retried, with_record);
  assert_true(retried >= 3);

  /* Nothing is left half done, and no payment exists twice. */
  if (!h_db_wait(
          s, 10000,
          "SELECT CASE WHEN count(*) = 0 THEN 1 ELSE 0 END FROM idempotency_records "
          "WHERE state IN ('processing', 'pending')"))
    fail_msg("%lld records still processing or pending 10 s after recovery",
             (long long)h_db_int(s, "SELECT count(*) FROM idempotency_records WHERE "
                                    "state IN ('processing', 'pending')"));
  h_assert_db(s, 0, "SELECT count(*) FROM outbox");
  h_assert_db(s, 0,
              "SELECT count(*) FROM (SELECT resource_id FROM idempotency_records WHERE "
              "resource_id IS NOT NULL GROUP BY resource_id HAVING count(*) > 1) d");
  h_assert_db(s, 0,
              "SELECT count(*) FROM payments p WHERE NOT EXISTS (SELECT 1 FROM "
              "idempotency_records r WHERE r.resource_id = p.id AND r.operation = "
              "'create_payment')");
  /* each payment is the one its key asked for (amount 100 + the key's number) */
  h_assert_db(s, 0,
              "SELECT count(*) FROM payments p JOIN idempotency_records r ON "
              "r.resource_id = p.id WHERE p.amount <> 100 + split_part(r.key, '-', "
              "3)::bigint");
  h_assert_db(s, 0,
              "SELECT count(*) FROM idempotency_records WHERE key NOT LIKE 'load-%'");
  payments = h_db_int(s, "SELECT count(*) FROM payments");
  if (payments < n201 || payments > total)
    fail_msg("%lld payments for %d answers 201 out of %d keys", (long long)payments, n201,
             total);
  h_assert_db(s, payments, "SELECT count(DISTINCT id) FROM payments");
  h_assert_db(s, payments,
              "SELECT count(*) FROM idempotency_records WHERE state = 'completed' AND "
              "response_status = 201");

  assert_health(s, 200, "at the end");
  h_server_stop(s); /* and it exits 0 */
}

/* One payment per thread, all at once, to fill idemd's pool of database
 * connections. */
struct warm {
  h_server_t *s;
  const char *tok;
  char key[32];
  long status;
  pthread_t thread;
};

static void *warm_one(void *arg) {
  struct warm *w = arg;
  h_resp_t r;
  h_post(w->s, "/payments", w->tok, w->key, "{\"amount\": 100, \"currency\": \"BRL\"}", &r);
  w->status = r.status;
  h_resp_free(&r);
  return NULL;
}

/* The database restarts while idemd is idle: its pooled connections were
 * closed by the server (each after a FATAL message), and none of them may
 * fail the request it is next given. The first /healthz after the restart
 * is 200, and a payment for each connection the pool held is 201. (Reading
 * the FATAL message alone left libpq's status OK, and each pooled
 * connection answered one request 503.) */
static void test_restart_while_idle(void **state) {
  enum { WARM = 8 };
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  struct warm w[WARM];
  char key[32];
  h_resp_t r;
  (void)state;

  for (int i = 0; i < WARM; i++) {
    w[i] = (struct warm){.s = s, .tok = tok};
    snprintf(w[i].key, sizeof w[i].key, "warm-%d", i);
    assert_int_equal(pthread_create(&w[i].thread, NULL, warm_one, &w[i]), 0);
  }
  for (int i = 0; i < WARM; i++) /* all joined before any assertion */
    pthread_join(w[i].thread, NULL);
  for (int i = 0; i < WARM; i++)
    assert_int_equal(w[i].status, 201);
  pg_cluster("stop");
  pg_cluster("start");
  assert_health(s, 200, "first, after the restart");
  for (int i = 0; i < WARM; i++) {
    snprintf(key, sizeof key, "after-%d", i);
    h_context("payment %d after the restart", i);
    h_post(s, "/payments", tok, key, "{\"amount\": 100, \"currency\": \"BRL\"}", &r);
    h_assert_first(&r, 201);
    h_resp_free(&r);
  }
  h_context_clear();
  h_server_stop(s);
  /* The server's FATAL at its shutdown did not reach the log as raw text:
   * every line is still a JSON object. */
  {
    char *text = h_read_file(s->log, NULL), *save = NULL;
    assert_non_null(text);
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
      json_t *l = json_loads(line, 0, NULL);
      if (!json_is_object(l))
        fail_msg("a log line that is not JSON: %.200s", line);
      json_decref(l);
    }
    free(text);
  }
}

/* The load threads are joined on every path (a failed assertion jumps
 * here with them still running). */
static int teardown(void **state) {
  stop_loaders();
  for (int l = 0; l < LOADERS; l++) {
    free(loaders[l].a);
    loaders[l].a = NULL;
  }
  free(all);
  all = NULL;
  return h_teardown(state);
}

/* Exits 77 (skipped, see CMakeLists.txt) unless IDEM_TEST_STORE_URL names
 * a PostgreSQL cluster and IDEM_TEST_PG_DIR its directory. */
int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_database_restart_under_load, teardown),
      cmocka_unit_test_teardown(test_restart_while_idle, h_teardown),
  };
  int rc;
  h_init(argc, argv);
  if (!h_store_is_pg() || getenv("IDEM_TEST_PG_DIR") == NULL) {
    fprintf(stderr, "needs a PostgreSQL cluster of its own (run it through "
                    "scripts/with-pg.sh): skipped\n");
    curl_global_cleanup();
    return 77;
  }
  rc = cmocka_run_group_tests_name("integration: the database restarts under load", tests,
                                   NULL, NULL);
  curl_global_cleanup();
  return rc;
}
