/* The engine (include/idem/engine.h): the decision table row by row, then
 * idem_engine_begin(), _complete() and _release() over a real store, the
 * one IDEM_TEST_STORE_URL names or a fresh SQLite file per test, and the
 * asynchronous form (idem_engine_begin_async(), SQLite only). */
#include "support.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "idem/clock.h"
#include "idem/crypto.h"
#include "idem/engine.h"

#define FP_A "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
#define FP_B "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
#define OP "create_thing"
#define NOW 1700000000000LL

/* ---- the decision table ---------------------------------------------- */

static idem_record_t record(idem_state_t state, const char *fp, int64_t expires_at) {
  idem_record_t r = {.state = state, .expires_at = expires_at};
  idem_copy(r.fingerprint, sizeof r.fingerprint, fp);
  return r;
}

static void test_decide_table(void **state) {
  (void)state;
  static const struct {
    const char *name;
    int has_record;
    idem_state_t st;
    const char *stored_fp; /* the record's */
    int64_t expires_at;
    const char *fp; /* the request's */
    idem_decision_t want;
  } rows[] = {
      {"never seen", 0, 0, NULL, 0, FP_A, IDEM_DECIDE_RESERVE},
      {"completed, same request", 1, IDEM_STATE_COMPLETED, FP_A, NOW + 1, FP_A,
       IDEM_DECIDE_REPLAY},
      {"completed, another request", 1, IDEM_STATE_COMPLETED, FP_A, NOW + 1, FP_B,
       IDEM_DECIDE_MISMATCH},
      {"processing, same request", 1, IDEM_STATE_PROCESSING, FP_A, 0, FP_A,
       IDEM_DECIDE_IN_FLIGHT},
      {"processing, another request", 1, IDEM_STATE_PROCESSING, FP_A, 0, FP_B,
       IDEM_DECIDE_MISMATCH},
      {"pending, same request", 1, IDEM_STATE_PENDING, FP_A, 0, FP_A, IDEM_DECIDE_PENDING},
      {"pending, another request", 1, IDEM_STATE_PENDING, FP_A, 0, FP_B,
       IDEM_DECIDE_MISMATCH},
      {"failed, same request: runs again", 1, IDEM_STATE_FAILED, FP_A, NOW + 1, FP_A,
       IDEM_DECIDE_RESERVE},
      {"failed, another request", 1, IDEM_STATE_FAILED, FP_A, NOW + 1, FP_B,
       IDEM_DECIDE_MISMATCH},
      {"completed, expired: new", 1, IDEM_STATE_COMPLETED, FP_A, NOW - 1, FP_A,
       IDEM_DECIDE_RESERVE},
      {"completed, expired, another request: new", 1, IDEM_STATE_COMPLETED, FP_A, NOW - 1,
       FP_B, IDEM_DECIDE_RESERVE},
      {"completed, expiring this millisecond: new", 1, IDEM_STATE_COMPLETED, FP_A, NOW, FP_B,
       IDEM_DECIDE_RESERVE},
      {"failed, expired, another request: new", 1, IDEM_STATE_FAILED, FP_A, NOW - 1, FP_B,
       IDEM_DECIDE_RESERVE},
      /* Only finished records expire: an expiry on a pending or processing
       * one (never written by a store) does not free the key. */
      {"pending, with a past expiry", 1, IDEM_STATE_PENDING, FP_A, NOW - 1, FP_A,
       IDEM_DECIDE_PENDING},
      {"processing, with a past expiry, another request", 1, IDEM_STATE_PROCESSING, FP_A,
       NOW - 1, FP_B, IDEM_DECIDE_MISMATCH},
      {"no fingerprint given", 1, IDEM_STATE_COMPLETED, FP_A, NOW + 1, NULL,
       IDEM_DECIDE_MISMATCH},
      {"a record in no state", 1, IDEM_STATE_NONE, FP_A, 0, FP_B, IDEM_DECIDE_RESERVE},
  };

  for (size_t i = 0; i < ARRAY_LEN(rows); i++) {
    idem_record_t r = record(rows[i].st, rows[i].stored_fp, rows[i].expires_at);
    idem_decision_t got = idem_decide(rows[i].has_record ? &r : NULL, rows[i].fp, NOW);
    if (got != rows[i].want)
      fail_msg("%s: %s, want %s", rows[i].name, idem_decision_name(got),
               idem_decision_name(rows[i].want));
  }
}

static void test_decision_names(void **state) {
  (void)state;
  assert_string_equal(idem_decision_name(IDEM_DECIDE_RESERVE), "reserve");
  assert_string_equal(idem_decision_name(IDEM_DECIDE_EXECUTE), "execute");
  assert_string_equal(idem_decision_name(IDEM_DECIDE_REPLAY), "replay");
  assert_string_equal(idem_decision_name(IDEM_DECIDE_MISMATCH), "mismatch");
  assert_string_equal(idem_decision_name(IDEM_DECIDE_IN_FLIGHT), "in_flight");
  assert_string_equal(idem_decision_name(IDEM_DECIDE_PENDING), "pending");
  assert_string_equal(idem_decision_name((idem_decision_t)99), "unknown");
}

/* ---- over a store ----------------------------------------------------- */

typedef struct fixture {
  idem_store_t *store;
  idem_engine_t *engine;
  char dir[512];
  char path[600];
  int64_t tenant_id;
  int waits; /* on_wait(.., 1) calls */
  int waiting;
  pthread_mutex_t mu;
} fixture_t;

static void count_waits(void *arg, int waiting) {
  fixture_t *fx = arg;
  pthread_mutex_lock(&fx->mu);
  if (waiting)
    fx->waits++;
  fx->waiting += waiting ? 1 : -1;
  pthread_mutex_unlock(&fx->mu);
}

static void engine_with(fixture_t *fx, int64_t lease_ms, int64_t ttl_ms,
                        int64_t inflight_wait_ms) {
  idem_engine_config_t cfg = {.lease_ms = lease_ms, .ttl_ms = ttl_ms,
                              .inflight_wait_ms = inflight_wait_ms,
                              .on_wait = count_waits, .on_wait_arg = fx};
  idem_engine_free(fx->engine);
  fx->engine = NULL;
  assert_int_equal(idem_engine_new(fx->store, &cfg, &fx->engine), IDEM_OK);
}

static int setup(void **state) {
  fixture_t *fx = calloc(1, sizeof *fx);
  const char *url = getenv("IDEM_TEST_STORE_URL");
  uint64_t bits;
  int rc;

  assert_non_null(fx);
  pthread_mutex_init(&fx->mu, NULL);
  if (url == NULL || url[0] == '\0') {
    const char *tmp = getenv("TMPDIR");
    snprintf(fx->dir, sizeof fx->dir, "%s/idem-engine-XXXXXX",
             tmp && tmp[0] ? tmp : "/tmp");
    if (mkdtemp(fx->dir) == NULL)
      fail_msg("mkdtemp %s failed", fx->dir);
    snprintf(fx->path, sizeof fx->path, "%s/idem.db", fx->dir);
    url = fx->path;
  }
  if ((rc = idem_store_open(url, NULL, &fx->store)) != IDEM_OK ||
      (rc = idem_store_migrate(fx->store)) != IDEM_OK)
    fail_msg("store: %s (%s)", idem_err_name(rc), idem_store_last_error());
  /* Each test in a scope of its own (a tenant is the caller's number), so
   * a shared database is fine. */
  assert_int_equal(idem_random_bytes(&bits, sizeof bits), IDEM_OK);
  fx->tenant_id = (int64_t)(bits >> 2) + 1;
  engine_with(fx, 30000, 86400000, 5000);
  *state = fx;
  return 0;
}

static int teardown(void **state) {
  fixture_t *fx = *state;
  idem_engine_free(fx->engine);
  idem_store_close(fx->store);
  if (fx->dir[0]) {
    remove_sqlite_files(fx->path);
    rmdir(fx->dir);
  }
  pthread_mutex_destroy(&fx->mu);
  free(fx);
  return 0;
}

static idem_begin_t begin_of(const fixture_t *fx, const char *key, const char *fp) {
  return (idem_begin_t){.scope = {fx->tenant_id, OP, key},
                        .fingerprint = fp,
                        .correlation_id = "req_test"};
}

/* Begins, requiring IDEM_OK; returns the decision, `rec` filled. */
static idem_decision_t begin(fixture_t *fx, idem_begin_t *b, idem_record_t *rec) {
  idem_decision_t d = 0;
  int rc;
  idem_record_reset(rec);
  if ((rc = idem_engine_begin(fx->engine, b, rec, &d)) != IDEM_OK)
    fail_msg("begin: %s (%s)", idem_err_name(rc), idem_store_last_error());
  return d;
}

static idem_outcome_t done_with(int status, const char *body, const char *location) {
  return (idem_outcome_t){.state = IDEM_STATE_COMPLETED, .status = status,
                          .body = body, .location = location};
}

/* A new key is executed once; then the same request replays the stored
 * answer and another request under the key is a mismatch. */
static void test_execute_complete_replay(void **state) {
  fixture_t *fx = *state;
  idem_begin_t b = begin_of(fx, "k1", FP_A), other = begin_of(fx, "k1", FP_B);
  idem_record_t rec = {0};
  idem_outcome_t out = done_with(201, "{\"id\":\"t_1\"}", "/things/t_1");

  assert_int_equal(begin(fx, &b, &rec), IDEM_DECIDE_EXECUTE);
  assert_int_equal(rec.state, IDEM_STATE_PROCESSING);
  assert_true(strlen(rec.owner_token) > 0);
  assert_int_equal(idem_engine_complete(fx->engine, &rec, &out, NULL), IDEM_OK);

  assert_int_equal(begin(fx, &b, &rec), IDEM_DECIDE_REPLAY);
  assert_int_equal(rec.response_status, 201);
  assert_string_equal(rec.response_body, "{\"id\":\"t_1\"}");
  assert_string_equal(rec.location, "/things/t_1");
  assert_string_equal(rec.owner_token, ""); /* nobody's to complete */

  assert_int_equal(begin(fx, &other, &rec), IDEM_DECIDE_MISMATCH);
  assert_int_equal(fx->waits, 0);
  idem_record_reset(&rec);
}

/* The same key under another operation or tenant is another key. */
static void test_scopes_are_apart(void **state) {
  fixture_t *fx = *state;
  idem_begin_t b = begin_of(fx, "k", FP_A), op = begin_of(fx, "k", FP_B);
  idem_record_t rec = {0};
  idem_outcome_t out = done_with(201, "{}", NULL);

  op.scope.operation = "create_other";
  assert_int_equal(begin(fx, &b, &rec), IDEM_DECIDE_EXECUTE);
  assert_int_equal(idem_engine_complete(fx->engine, &rec, &out, NULL), IDEM_OK);
  assert_int_equal(begin(fx, &op, &rec), IDEM_DECIDE_EXECUTE);
  idem_record_reset(&rec);
}

/* A single-step request's outcome is written with its reservation: the
 * record is completed at once. */
static void test_single_step(void **state) {
  fixture_t *fx = *state;
  idem_outcome_t out = done_with(201, "{\"id\":\"t_2\"}", "/things/t_2");
  idem_begin_t b = begin_of(fx, "k2", FP_A);
  idem_record_t rec = {0};

  b.outcome = &out;
  assert_int_equal(begin(fx, &b, &rec), IDEM_DECIDE_EXECUTE);
  assert_int_equal(rec.state, IDEM_STATE_COMPLETED);
  assert_int_equal(rec.response_status, 201);
  assert_int_equal(begin(fx, &b, &rec), IDEM_DECIDE_REPLAY);
  assert_string_equal(rec.response_body, "{\"id\":\"t_2\"}");
  idem_record_reset(&rec);
}

static int prepared;
static int prepare_ok(void *arg) {
  (void)arg;
  prepared++;
  return IDEM_OK;
}
static int prepare_fails(void *arg) {
  (void)arg;
  prepared++;
  return IDEM_ECRYPTO;
}

/* prepare() runs once, only for a reservation: a replay never pays for
 * it, and its error is returned with nothing written. */
static void test_prepare(void **state) {
  fixture_t *fx = *state;
  idem_outcome_t out = done_with(201, "{}", NULL);
  idem_begin_t b = begin_of(fx, "k3", FP_A);
  idem_record_t rec = {0};
  idem_decision_t d;

  prepared = 0;
  b.prepare = prepare_fails;
  assert_int_equal(idem_engine_begin(fx->engine, &b, &rec, &d), IDEM_ECRYPTO);
  assert_int_equal(prepared, 1);
  idem_scope_t sc = b.scope;
  assert_int_equal(idem_store_lookup(fx->store, &sc, idem_now_ms(), &rec), IDEM_ENOTFOUND);

  prepared = 0;
  b.prepare = prepare_ok;
  b.outcome = &out;
  assert_int_equal(begin(fx, &b, &rec), IDEM_DECIDE_EXECUTE);
  assert_int_equal(begin(fx, &b, &rec), IDEM_DECIDE_REPLAY);
  assert_int_equal(prepared, 1);
  idem_record_reset(&rec);
}

/* A pending record answers its stored current state, and is never
 * executed again, nor expires. */
static void test_pending(void **state) {
  fixture_t *fx = *state;
  idem_outcome_t out = {.state = IDEM_STATE_PENDING, .status = 202,
                        .body = "{\"status\":\"pending\"}", .location = "/things/t_3"};
  idem_begin_t b = begin_of(fx, "k4", FP_A);
  idem_record_t rec = {0};

  assert_int_equal(begin(fx, &b, &rec), IDEM_DECIDE_EXECUTE);
  assert_int_equal(idem_engine_complete(fx->engine, &rec, &out, NULL), IDEM_OK);
  assert_int_equal(begin(fx, &b, &rec), IDEM_DECIDE_PENDING);
  assert_int_equal(rec.response_status, 202);
  assert_string_equal(rec.response_body, "{\"status\":\"pending\"}");
  assert_string_equal(rec.location, "/things/t_3");
  assert_int_equal(rec.expires_at, 0);
  idem_record_reset(&rec);
}

/* A released (failed) key runs again for the same request, under a new
 * owner; another request is still a mismatch. */
static void test_release_then_retry(void **state) {
  fixture_t *fx = *state;
  idem_begin_t b = begin_of(fx, "k5", FP_A), other = begin_of(fx, "k5", FP_B);
  idem_record_t rec = {0};
  char first[IDEM_TOKEN_MAX + 1];

  assert_int_equal(begin(fx, &b, &rec), IDEM_DECIDE_EXECUTE);
  memcpy(first, rec.owner_token, sizeof first);
  assert_int_equal(idem_engine_release(fx->engine, &rec), IDEM_OK);
  /* Released once: the old owner can neither release nor complete again. */
  assert_int_equal(idem_engine_release(fx->engine, &rec), IDEM_ELOST);

  assert_int_equal(begin(fx, &other, &rec), IDEM_DECIDE_MISMATCH);
  assert_int_equal(rec.state, IDEM_STATE_FAILED);
  assert_int_equal(begin(fx, &b, &rec), IDEM_DECIDE_EXECUTE);
  assert_int_equal(rec.state, IDEM_STATE_PROCESSING);
  assert_string_not_equal(rec.owner_token, first);
  idem_record_reset(&rec);
}

/* A finished record past its TTL is as if never seen, for any request. */
static void test_expiry(void **state) {
  fixture_t *fx = *state;
  idem_begin_t b = begin_of(fx, "k6", FP_A), other = begin_of(fx, "k6", FP_B);
  idem_outcome_t out = done_with(201, "{}", NULL);
  idem_record_t rec = {0};

  engine_with(fx, 30000, 1, 5000); /* records live 1 ms */
  assert_int_equal(begin(fx, &b, &rec), IDEM_DECIDE_EXECUTE);
  assert_int_equal(idem_engine_complete(fx->engine, &rec, &out, NULL), IDEM_OK);
  usleep(20 * 1000);
  assert_int_equal(begin(fx, &other, &rec), IDEM_DECIDE_EXECUTE);
  assert_string_equal(rec.fingerprint, FP_B);
  idem_record_reset(&rec);
}

/* A duplicate of a request in flight, with no time to wait, is told so
 * at once; with a bound, it waits and is told so at the bound. */
static void test_in_flight_bound(void **state) {
  fixture_t *fx = *state;
  idem_begin_t b = begin_of(fx, "k7", FP_A), dup = begin_of(fx, "k7", FP_A);
  idem_record_t rec = {0}, seen = {0};

  assert_int_equal(begin(fx, &b, &rec), IDEM_DECIDE_EXECUTE);
  dup.wait_until_ms = -1;
  assert_int_equal(begin(fx, &dup, &seen), IDEM_DECIDE_IN_FLIGHT);
  assert_int_equal(seen.state, IDEM_STATE_PROCESSING);
  assert_int_equal(fx->waits, 0);

  dup.wait_until_ms = idem_mono_ms() + 50;
  assert_int_equal(begin(fx, &dup, &seen), IDEM_DECIDE_IN_FLIGHT);
  assert_true(fx->waits >= 1);
  assert_int_equal(fx->waiting, 0);

  /* The bound set by the engine stays set on `b`: a later call does not
   * start the wait again. */
  idem_begin_t late = begin_of(fx, "k7", FP_A);
  engine_with(fx, 30000, 86400000, 30);
  assert_int_equal(begin(fx, &late, &seen), IDEM_DECIDE_IN_FLIGHT);
  assert_true(late.wait_until_ms > 0);
  int waits = fx->waits;
  assert_int_equal(begin(fx, &late, &seen), IDEM_DECIDE_IN_FLIGHT);
  assert_int_equal(fx->waits, waits); /* its bound has passed: no wait */
  idem_record_reset(&rec);
  idem_record_reset(&seen);
}

/* Twenty requests with one key at once: one executes; the others wait for
 * it and replay its answer. The bound (2 min) is past the test's own
 * timeout, so only a completion's wake-up lets them return in time. */
#define RACERS 20

struct racer {
  fixture_t *fx;
  pthread_barrier_t *go;
  idem_decision_t d;
  int rc;
  int status;
  char body[64];
};

static void *race(void *arg) {
  struct racer *r = arg;
  idem_begin_t b = begin_of(r->fx, "k8", FP_A);
  idem_record_t rec = {0};

  b.wait_until_ms = idem_mono_ms() + 120000;
  pthread_barrier_wait(r->go);
  r->rc = idem_engine_begin(r->fx->engine, &b, &rec, &r->d);
  if (r->rc == IDEM_OK && r->d == IDEM_DECIDE_EXECUTE) {
    char body[64];
    snprintf(body, sizeof body, "{\"winner\":\"%p\"}", (void *)r);
    idem_outcome_t out = done_with(201, body, NULL);
    usleep(50 * 1000); /* the others find it in flight */
    r->rc = idem_engine_complete(r->fx->engine, &rec, &out, NULL);
    r->status = 201;
    snprintf(r->body, sizeof r->body, "%s", body);
  } else if (r->rc == IDEM_OK) {
    r->status = rec.response_status;
    snprintf(r->body, sizeof r->body, "%s", rec.response_body ? rec.response_body : "");
  }
  idem_record_reset(&rec);
  return NULL;
}

static void test_concurrent_same_key(void **state) {
  fixture_t *fx = *state;
  pthread_t th[RACERS];
  struct racer rs[RACERS];
  pthread_barrier_t go;
  int executed = 0;

  pthread_barrier_init(&go, NULL, RACERS);
  for (int i = 0; i < RACERS; i++) {
    rs[i] = (struct racer){.fx = fx, .go = &go};
    assert_int_equal(pthread_create(&th[i], NULL, race, &rs[i]), 0);
  }
  for (int i = 0; i < RACERS; i++)
    pthread_join(th[i], NULL);
  pthread_barrier_destroy(&go);
  for (int i = 0; i < RACERS; i++) {
    assert_int_equal(rs[i].rc, IDEM_OK);
    if (rs[i].d == IDEM_DECIDE_EXECUTE)
      executed++;
    else
      assert_int_equal(rs[i].d, IDEM_DECIDE_REPLAY);
    assert_int_equal(rs[i].status, 201);
    assert_string_equal(rs[i].body, rs[0].body);
  }
  assert_int_equal(executed, 1);
  assert_int_equal(fx->waiting, 0);
}

/* A recoverer's take-over of `key` (idem_tx_take_over()) in a write of
 * its own, as idemd's reconciler makes it. */
struct take_over {
  idem_scope_t scope;
  int rc;
  idem_record_t rec;
};

static int take_over_fn(void *arg, idem_tx_t *tx) {
  struct take_over *t = arg;
  idem_record_reset(&t->rec);
  t->rc = idem_tx_take_over(tx, &t->scope, 60000, &t->rec);
  return IDEM_OK;
}

static void take_over(fixture_t *fx, const char *key, idem_record_t *out) {
  struct take_over t = {.scope = {fx->tenant_id, OP, key}};
  idem_effect_t e = {take_over_fn, &t};
  assert_int_equal(idem_store_write(fx->store, &e), IDEM_OK);
  assert_int_equal(t.rc, IDEM_OK);
  *out = t.rec;
}

/* A worker whose lease ran out is fenced off: once a recoverer has taken
 * its record over (a new owner token), the old owner's completion is
 * refused and changes nothing, and the new owner's stands. */
static void test_lease_takeover_is_fenced(void **state) {
  fixture_t *fx = *state;
  idem_begin_t b = begin_of(fx, "k9", FP_A);
  idem_record_t rec = {0}, claimed = {0};
  idem_outcome_t late = done_with(201, "{\"by\":\"old\"}", NULL);
  idem_outcome_t settled = done_with(201, "{\"by\":\"new\"}", NULL);

  engine_with(fx, 1, 86400000, 5000); /* a lease of 1 ms */
  assert_int_equal(begin(fx, &b, &rec), IDEM_DECIDE_EXECUTE);
  usleep(20 * 1000);
  take_over(fx, "k9", &claimed);
  assert_string_not_equal(claimed.owner_token, rec.owner_token);

  assert_int_equal(idem_engine_complete(fx->engine, &rec, &late, NULL), IDEM_ELOST);
  assert_int_equal(idem_engine_release(fx->engine, &rec), IDEM_ELOST);
  assert_int_equal(idem_engine_complete(fx->engine, &claimed, &settled, NULL), IDEM_OK);
  idem_record_reset(&claimed);

  assert_int_equal(begin(fx, &b, &rec), IDEM_DECIDE_REPLAY);
  assert_string_equal(rec.response_body, "{\"by\":\"new\"}");
  idem_record_reset(&rec);
}

static void test_arguments(void **state) {
  fixture_t *fx = *state;
  idem_engine_t *e = (idem_engine_t *)1;
  idem_engine_config_t bad = {.lease_ms = -1};
  idem_begin_t b = begin_of(fx, "k10", NULL);
  idem_record_t rec = {0};
  idem_decision_t d;

  assert_int_equal(idem_engine_new(NULL, NULL, &e), IDEM_EINVAL);
  assert_null(e);
  assert_int_equal(idem_engine_new(fx->store, &bad, &e), IDEM_EINVAL);
  assert_int_equal(idem_engine_begin(fx->engine, &b, &rec, &d), IDEM_EINVAL);
  assert_true(idem_engine_store(fx->engine) == fx->store);
  idem_engine_free(NULL);
}

/* ---- the asynchronous form ------------------------------------------- */

/* A request in the asynchronous form, as an event loop would hold it:
 * suspend() and wake() counted, and a wake-up waited for with a bound. */
typedef struct areq {
  idem_async_t a;
  pthread_mutex_t mu;
  pthread_cond_t cond;
  int suspends, wakes;
  idem_decision_t decided_at_wake; /* a->decision when wake() ran */
  int rc_at_wake;
} areq_t;

static void areq_wake(idem_async_t *a) {
  areq_t *q = a->arg;
  pthread_mutex_lock(&q->mu);
  q->wakes++;
  q->decided_at_wake = a->decision;
  q->rc_at_wake = a->rc;
  pthread_cond_signal(&q->cond);
  pthread_mutex_unlock(&q->mu);
}

static void areq_suspend(idem_async_t *a) {
  areq_t *q = a->arg;
  pthread_mutex_lock(&q->mu);
  q->suspends++;
  pthread_mutex_unlock(&q->mu);
}

static void areq_init(areq_t *q, const idem_begin_t *b) {
  memset(q, 0, sizeof *q);
  pthread_mutex_init(&q->mu, NULL);
  pthread_cond_init(&q->cond, NULL);
  q->a.begin = *b;
  q->a.wake = areq_wake;
  q->a.suspend = areq_suspend;
  q->a.arg = q;
}

static void areq_free(areq_t *q) {
  idem_record_reset(&q->a.rec);
  pthread_mutex_destroy(&q->mu);
  pthread_cond_destroy(&q->cond);
}

static int areq_wakes(areq_t *q) {
  int n;
  pthread_mutex_lock(&q->mu);
  n = q->wakes;
  pthread_mutex_unlock(&q->mu);
  return n;
}

/* Waits (at most 10 s) for the `n`th wake-up. Returns 0, or -1. */
static int areq_wait(areq_t *q, int n) {
  int64_t until = idem_mono_ms() + 10000;
  int ok;
  pthread_mutex_lock(&q->mu);
  while (q->wakes < n && idem_mono_ms() < until) {
    pthread_mutex_unlock(&q->mu);
    usleep(1000);
    pthread_mutex_lock(&q->mu);
  }
  ok = q->wakes >= n;
  pthread_mutex_unlock(&q->mu);
  return ok ? 0 : -1;
}

static int store_is_async(const fixture_t *fx) {
  return idem_store_local_reads(fx->store) && idem_store_async_writes(fx->store);
}

/* Runs `q` to its decision as an event loop does: each IDEM_EAGAIN is
 * followed by exactly one wake-up, after one suspend(), and the call is
 * made again. Returns the last call's result. */
static int areq_run(fixture_t *fx, areq_t *q) {
  for (;;) {
    /* Read before the call: the wake-up may come before it returns. */
    int wakes = areq_wakes(q);
    int rc = idem_engine_begin_async(fx->engine, &q->a);
    if (rc != IDEM_EAGAIN)
      return rc;
    assert_int_equal(areq_wait(q, wakes + 1), 0);
  }
}

/* Completes `q` (decided EXECUTE) with `out`; returns the wake's rc. */
static int areq_complete(fixture_t *fx, areq_t *q, const idem_outcome_t *out) {
  int wakes = areq_wakes(q);
  assert_int_equal(idem_engine_complete_async(fx->engine, &q->a, out, NULL), IDEM_EAGAIN);
  assert_int_equal(areq_wait(q, wakes + 1), 0);
  assert_int_equal(q->wakes, wakes + 1);
  return q->a.rc;
}

/* A new key: the reservation is queued, and the won key is decided on the
 * store's thread, before the wake-up (so a caller may execute there). The
 * completion is queued the same way; the same request then replays,
 * queued without a read (skip_read) or read at once, and another request
 * under the key is a mismatch. */
static void test_async_execute_complete_replay(void **state) {
  fixture_t *fx = *state;
  idem_begin_t b = begin_of(fx, "ka1", FP_A);
  idem_outcome_t out = done_with(201, "{\"id\":\"t_a1\"}", "/things/t_a1");
  areq_t q, replay, read, other;

  if (!store_is_async(fx))
    skip();
  b.skip_read = 1;
  areq_init(&q, &b);
  assert_int_equal(idem_engine_begin_async(fx->engine, &q.a), IDEM_EAGAIN);
  assert_int_equal(areq_wait(&q, 1), 0);
  assert_int_equal(q.suspends, 1);
  assert_int_equal(q.decided_at_wake, IDEM_DECIDE_EXECUTE);
  assert_int_equal(q.rc_at_wake, IDEM_OK);
  assert_int_equal(q.a.rec.state, IDEM_STATE_PROCESSING);
  assert_true(strlen(q.a.rec.owner_token) > 0);
  /* Called again: the decision made at the wake-up. */
  assert_int_equal(idem_engine_begin_async(fx->engine, &q.a), IDEM_OK);
  assert_int_equal(q.a.decision, IDEM_DECIDE_EXECUTE);
  assert_int_equal(areq_complete(fx, &q, &out), IDEM_OK);
  assert_int_equal(q.suspends, 1); /* a completion hands nothing back */

  areq_init(&replay, &b);
  assert_int_equal(areq_run(fx, &replay), IDEM_OK);
  assert_int_equal(replay.a.decision, IDEM_DECIDE_REPLAY);
  assert_int_equal(replay.wakes, 1);
  assert_int_equal(replay.decided_at_wake, IDEM_DECIDE_REPLAY);
  assert_int_equal(replay.a.rec.response_status, 201);
  assert_string_equal(replay.a.rec.response_body, "{\"id\":\"t_a1\"}");
  assert_string_equal(replay.a.rec.location, "/things/t_a1");
  assert_string_equal(replay.a.rec.owner_token, "");

  b.skip_read = 0;
  areq_init(&read, &b);
  assert_int_equal(idem_engine_begin_async(fx->engine, &read.a), IDEM_OK);
  assert_int_equal(read.a.decision, IDEM_DECIDE_REPLAY);
  assert_int_equal(read.suspends, 0);

  b.fingerprint = FP_B;
  b.skip_read = 1;
  areq_init(&other, &b);
  assert_int_equal(areq_run(fx, &other), IDEM_OK);
  assert_int_equal(other.a.decision, IDEM_DECIDE_MISMATCH);
  assert_int_equal(other.a.rec.state, IDEM_STATE_COMPLETED);
  areq_free(&q);
  areq_free(&replay);
  areq_free(&read);
  areq_free(&other);
}

/* Single step and pending, as in the blocking form; prepare() runs once,
 * before the reservation, and its error is returned with nothing written
 * and nothing handed off. */
static void test_async_single_step_pending_prepare(void **state) {
  fixture_t *fx = *state;
  idem_outcome_t single = done_with(201, "{\"id\":\"t_a2\"}", NULL);
  idem_outcome_t pending = {.state = IDEM_STATE_PENDING, .status = 202,
                            .body = "{\"status\":\"pending\"}"};
  idem_begin_t b = begin_of(fx, "ka2", FP_A), p = begin_of(fx, "ka3", FP_A);
  areq_t q, again, bad, pq, pr;
  idem_record_t rec = {0};

  if (!store_is_async(fx))
    skip();
  prepared = 0;
  b.outcome = &single;
  b.prepare = prepare_fails;
  areq_init(&bad, &b);
  assert_int_equal(idem_engine_begin_async(fx->engine, &bad.a), IDEM_ECRYPTO);
  assert_int_equal(bad.suspends, 0);
  assert_int_equal(prepared, 1);
  idem_scope_t sc = b.scope;
  assert_int_equal(idem_store_lookup(fx->store, &sc, idem_now_ms(), &rec), IDEM_ENOTFOUND);

  b.prepare = prepare_ok;
  areq_init(&q, &b);
  assert_int_equal(areq_run(fx, &q), IDEM_OK);
  assert_int_equal(q.a.decision, IDEM_DECIDE_EXECUTE);
  assert_int_equal(q.a.rec.state, IDEM_STATE_COMPLETED);
  assert_int_equal(prepared, 2);
  areq_init(&again, &b);
  assert_int_equal(areq_run(fx, &again), IDEM_OK);
  assert_int_equal(again.a.decision, IDEM_DECIDE_REPLAY);
  assert_int_equal(prepared, 2); /* a replay never pays for it */

  areq_init(&pq, &p);
  assert_int_equal(areq_run(fx, &pq), IDEM_OK);
  assert_int_equal(pq.a.decision, IDEM_DECIDE_EXECUTE);
  assert_int_equal(areq_complete(fx, &pq, &pending), IDEM_OK);
  p.skip_read = 1;
  areq_init(&pr, &p);
  assert_int_equal(areq_run(fx, &pr), IDEM_OK);
  assert_int_equal(pr.a.decision, IDEM_DECIDE_PENDING);
  assert_string_equal(pr.a.rec.response_body, "{\"status\":\"pending\"}");
  areq_free(&q);
  areq_free(&again);
  areq_free(&bad);
  areq_free(&pq);
  areq_free(&pr);
  idem_record_reset(&rec);
}

/* A duplicate of a request in flight parks, holding no thread, until the
 * original completes, then replays it. One that lost the race for the key
 * (queued without a read) parks too; a released original lets it win. */
static void test_async_in_flight_parks(void **state) {
  fixture_t *fx = *state;
  idem_begin_t b = begin_of(fx, "ka4", FP_A), d = begin_of(fx, "ka4", FP_A);
  idem_begin_t r = begin_of(fx, "ka5", FP_A);
  idem_outcome_t out = done_with(201, "{\"id\":\"t_a4\"}", NULL);
  idem_record_t rec = {0}, rrec = {0};
  areq_t dup, lost;

  if (!store_is_async(fx))
    skip();
  assert_int_equal(begin(fx, &b, &rec), IDEM_DECIDE_EXECUTE);
  d.wait_until_ms = idem_mono_ms() + 120000; /* only a wake-up ends it in time */
  areq_init(&dup, &d);
  assert_int_equal(idem_engine_begin_async(fx->engine, &dup.a), IDEM_EAGAIN);
  assert_int_equal(dup.suspends, 1);
  assert_int_equal(idem_engine_parked(fx->engine), 1);
  assert_int_equal(dup.wakes, 0);
  assert_int_equal(idem_engine_complete(fx->engine, &rec, &out, NULL), IDEM_OK);
  assert_int_equal(areq_wait(&dup, 1), 0);
  assert_int_equal(idem_engine_parked(fx->engine), 0);
  assert_int_equal(idem_engine_begin_async(fx->engine, &dup.a), IDEM_OK);
  assert_int_equal(dup.a.decision, IDEM_DECIDE_REPLAY);
  assert_string_equal(dup.a.rec.response_body, "{\"id\":\"t_a4\"}");
  assert_int_equal(fx->waits, 0); /* never the blocking wait */

  assert_int_equal(begin(fx, &r, &rrec), IDEM_DECIDE_EXECUTE);
  r.skip_read = 1;
  r.wait_until_ms = idem_mono_ms() + 120000;
  areq_init(&lost, &r);
  /* The reservation reports the record in flight: woken undecided, it
   * reads and parks. */
  assert_int_equal(idem_engine_begin_async(fx->engine, &lost.a), IDEM_EAGAIN);
  assert_int_equal(areq_wait(&lost, 1), 0);
  assert_int_equal(lost.decided_at_wake, 0);
  assert_int_equal(idem_engine_begin_async(fx->engine, &lost.a), IDEM_EAGAIN);
  assert_int_equal(idem_engine_parked(fx->engine), 1);
  assert_int_equal(idem_engine_release(fx->engine, &rrec), IDEM_OK);
  assert_int_equal(areq_wait(&lost, 2), 0);
  /* Released: the key is free for it, and won by a new reservation. */
  assert_int_equal(areq_run(fx, &lost), IDEM_OK);
  assert_int_equal(lost.a.decision, IDEM_DECIDE_EXECUTE);
  assert_string_not_equal(lost.a.rec.owner_token, rrec.owner_token);
  assert_int_equal(lost.suspends, 3); /* reserve, park, reserve */
  areq_free(&dup);
  areq_free(&lost);
  idem_record_reset(&rec);
  idem_record_reset(&rrec);
}

/* The bound of a parked wait: idem_engine_expire() wakes it once it has
 * passed (not before), and it decides IN_FLIGHT; woken early (expire with
 * INT64_MAX, as a server that drains) it parks again unless its caller
 * ends the wait (wait_until_ms -1), and with no time to wait it is told
 * at once, nothing handed off. */
static void test_async_in_flight_bound(void **state) {
  fixture_t *fx = *state;
  idem_begin_t b = begin_of(fx, "ka6", FP_A), d = begin_of(fx, "ka6", FP_A);
  idem_record_t rec = {0};
  areq_t now, bounded, drained;

  if (!store_is_async(fx))
    skip();
  assert_int_equal(begin(fx, &b, &rec), IDEM_DECIDE_EXECUTE);

  d.wait_until_ms = -1;
  areq_init(&now, &d);
  assert_int_equal(idem_engine_begin_async(fx->engine, &now.a), IDEM_OK);
  assert_int_equal(now.a.decision, IDEM_DECIDE_IN_FLIGHT);
  assert_int_equal(now.a.rec.state, IDEM_STATE_PROCESSING);
  assert_int_equal(now.suspends, 0);

  d.wait_until_ms = idem_mono_ms() + 60000;
  areq_init(&bounded, &d);
  assert_int_equal(idem_engine_begin_async(fx->engine, &bounded.a), IDEM_EAGAIN);
  assert_int_equal(idem_engine_expire(fx->engine, idem_mono_ms()), 0);
  assert_int_equal(bounded.wakes, 0);
  bounded.a.begin.wait_until_ms = idem_mono_ms() + 30; /* not the engine's to move */
  assert_int_equal(idem_engine_expire(fx->engine, d.wait_until_ms), 1);
  assert_int_equal(areq_wait(&bounded, 1), 0);
  usleep(40 * 1000);
  assert_int_equal(idem_engine_begin_async(fx->engine, &bounded.a), IDEM_OK);
  assert_int_equal(bounded.a.decision, IDEM_DECIDE_IN_FLIGHT);

  d.wait_until_ms = 0; /* the engine's bound: 5 s */
  areq_init(&drained, &d);
  assert_int_equal(idem_engine_begin_async(fx->engine, &drained.a), IDEM_EAGAIN);
  assert_true(drained.a.begin.wait_until_ms > idem_mono_ms());
  assert_int_equal(idem_engine_expire(fx->engine, INT64_MAX), 1);
  assert_int_equal(areq_wait(&drained, 1), 0);
  assert_int_equal(idem_engine_begin_async(fx->engine, &drained.a), IDEM_EAGAIN);
  assert_int_equal(idem_engine_parked(fx->engine), 1); /* its bound has not passed */
  assert_int_equal(idem_engine_expire(fx->engine, INT64_MAX), 1);
  assert_int_equal(areq_wait(&drained, 2), 0);
  drained.a.begin.wait_until_ms = -1;
  assert_int_equal(idem_engine_begin_async(fx->engine, &drained.a), IDEM_OK);
  assert_int_equal(drained.a.decision, IDEM_DECIDE_IN_FLIGHT);
  assert_int_equal(idem_engine_parked(fx->engine), 0);
  areq_free(&now);
  areq_free(&bounded);
  areq_free(&drained);
  idem_record_reset(&rec);
}

/* A completion whose lease was taken over is refused (IDEM_ELOST, nothing
 * written); called again, the engine decides anew and replays the new
 * owner's answer. */
static void test_async_lost_lease(void **state) {
  fixture_t *fx = *state;
  idem_begin_t b = begin_of(fx, "ka7", FP_A);
  idem_outcome_t late = done_with(201, "{\"by\":\"old\"}", NULL);
  idem_outcome_t settled = done_with(201, "{\"by\":\"new\"}", NULL);
  idem_record_t claimed = {0};
  areq_t q;

  if (!store_is_async(fx))
    skip();
  engine_with(fx, 1, 86400000, 5000); /* a lease of 1 ms */
  areq_init(&q, &b);
  assert_int_equal(areq_run(fx, &q), IDEM_OK);
  assert_int_equal(q.a.decision, IDEM_DECIDE_EXECUTE);
  usleep(20 * 1000);
  take_over(fx, "ka7", &claimed);
  assert_int_equal(areq_complete(fx, &q, &late), IDEM_ELOST);
  assert_int_equal(idem_engine_complete(fx->engine, &claimed, &settled, NULL), IDEM_OK);
  idem_record_reset(&claimed);
  assert_int_equal(areq_run(fx, &q), IDEM_OK);
  assert_int_equal(q.a.decision, IDEM_DECIDE_REPLAY);
  assert_string_equal(q.a.rec.response_body, "{\"by\":\"new\"}");
  /* Decided and completed: nothing more to decide, nor to complete. */
  assert_int_equal(idem_engine_complete_async(fx->engine, &q.a, &late, NULL), IDEM_EINVAL);
  areq_free(&q);
}

/* Twenty asynchronous requests with one key at once, from twenty threads:
 * one executes (completing asynchronously after 50 ms); the others park
 * or replay, and all answer its body. */
struct aracer {
  fixture_t *fx;
  pthread_barrier_t *go;
  areq_t q;
  int rc;
  char body[64];
};

static void *arace(void *arg) {
  struct aracer *r = arg;
  idem_begin_t b = begin_of(r->fx, "ka8", FP_A);

  b.skip_read = 1;
  b.wait_until_ms = idem_mono_ms() + 120000;
  areq_init(&r->q, &b);
  pthread_barrier_wait(r->go);
  r->rc = areq_run(r->fx, &r->q);
  if (r->rc == IDEM_OK && r->q.a.decision == IDEM_DECIDE_EXECUTE) {
    idem_outcome_t out;
    snprintf(r->body, sizeof r->body, "{\"winner\":\"%p\"}", (void *)r);
    out = done_with(201, r->body, NULL);
    usleep(50 * 1000);
    r->rc = areq_complete(r->fx, &r->q, &out);
  } else if (r->rc == IDEM_OK) {
    snprintf(r->body, sizeof r->body, "%s",
             r->q.a.rec.response_body ? r->q.a.rec.response_body : "");
  }
  return NULL;
}

static void test_async_concurrent_same_key(void **state) {
  fixture_t *fx = *state;
  pthread_t th[RACERS];
  static struct aracer rs[RACERS];
  pthread_barrier_t go;
  int executed = 0;

  if (!store_is_async(fx))
    skip();
  pthread_barrier_init(&go, NULL, RACERS);
  for (int i = 0; i < RACERS; i++) {
    rs[i] = (struct aracer){.fx = fx, .go = &go};
    assert_int_equal(pthread_create(&th[i], NULL, arace, &rs[i]), 0);
  }
  for (int i = 0; i < RACERS; i++)
    pthread_join(th[i], NULL);
  pthread_barrier_destroy(&go);
  for (int i = 0; i < RACERS; i++) {
    assert_int_equal(rs[i].rc, IDEM_OK);
    if (rs[i].q.a.decision == IDEM_DECIDE_EXECUTE)
      executed++;
    else
      assert_int_equal(rs[i].q.a.decision, IDEM_DECIDE_REPLAY);
    assert_string_equal(rs[i].body, rs[0].body);
  }
  assert_int_equal(executed, 1);
  assert_int_equal(idem_engine_parked(fx->engine), 0);
  assert_int_equal(fx->waits, 0);
  for (int i = 0; i < RACERS; i++)
    areq_free(&rs[i].q);
}

/* Bad arguments, and a store without the asynchronous form (PostgreSQL):
 * refused at once, nothing handed off. */
static void test_async_arguments(void **state) {
  fixture_t *fx = *state;
  idem_begin_t b = begin_of(fx, "ka9", NULL);
  idem_outcome_t out = done_with(201, "{}", NULL);
  areq_t q;

  areq_init(&q, &b);
  if (!store_is_async(fx)) {
    b.fingerprint = FP_A;
    areq_init(&q, &b);
    assert_int_equal(idem_engine_begin_async(fx->engine, &q.a), IDEM_ENOTSUP);
    assert_int_equal(q.suspends, 0);
    areq_free(&q);
    return;
  }
  assert_int_equal(idem_engine_begin_async(fx->engine, &q.a), IDEM_EINVAL);
  assert_int_equal(idem_engine_complete_async(fx->engine, &q.a, &out, NULL), IDEM_EINVAL);
  q.a.begin.fingerprint = FP_A;
  q.a.wake = NULL;
  assert_int_equal(idem_engine_begin_async(fx->engine, &q.a), IDEM_EINVAL);
  assert_int_equal(q.suspends, 0);
  areq_free(&q);
}

int main(int argc, char **argv) {
  const char *url = getenv("IDEM_TEST_STORE_URL");
  if ((url == NULL || url[0] == '\0') && argc > 1 && strcmp(argv[1], "--require-url") == 0) {
    fprintf(stderr, "IDEM_TEST_STORE_URL is not set: skipped\n");
    return 77;
  }
#define ENGINE_TEST(f) cmocka_unit_test_setup_teardown(f, setup, teardown)
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_decide_table),
      cmocka_unit_test(test_decision_names),
      ENGINE_TEST(test_execute_complete_replay),
      ENGINE_TEST(test_scopes_are_apart),
      ENGINE_TEST(test_single_step),
      ENGINE_TEST(test_prepare),
      ENGINE_TEST(test_pending),
      ENGINE_TEST(test_release_then_retry),
      ENGINE_TEST(test_expiry),
      ENGINE_TEST(test_in_flight_bound),
      ENGINE_TEST(test_concurrent_same_key),
      ENGINE_TEST(test_lease_takeover_is_fenced),
      ENGINE_TEST(test_arguments),
      ENGINE_TEST(test_async_execute_complete_replay),
      ENGINE_TEST(test_async_single_step_pending_prepare),
      ENGINE_TEST(test_async_in_flight_parks),
      ENGINE_TEST(test_async_in_flight_bound),
      ENGINE_TEST(test_async_lost_lease),
      ENGINE_TEST(test_async_concurrent_same_key),
      ENGINE_TEST(test_async_arguments),
  };
#undef ENGINE_TEST
  return cmocka_run_group_tests_name("engine", tests, NULL, NULL);
}
