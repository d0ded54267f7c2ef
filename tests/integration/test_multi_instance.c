/* Many idemd instances on one PostgreSQL database (docs/scaling.md): copies
 * of one request spread over two instances create exactly one resource and
 * all get its answer; a copy on one instance waits for the original on the
 * other and is woken (LISTEN/NOTIFY) as soon as it finishes, well before the
 * wait bound; a key used on one instance is a replay or a mismatch on the
 * other; an API key revoked while another instance remembers it stops
 * working there once the change's NOTIFY arrives. PostgreSQL only: run it
 * through scripts/with-pg.sh. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"

#define N 20
#define PAYMENT "{\"amount\": 15990, \"currency\": \"BRL\", \"order_id\": \"ord_42\"}"
#define ORDER                                                                            \
  "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":2,"                   \
  "\"unit_price\":1000}],\"currency\":\"BRL\"}"
#define MISMATCH "Idempotency-Key was already used with a different request"

static const char *const kinds[] = {"payment", "order"};
static const char *const paths[] = {"/payments", "/orders"};
static const char *const bodies[] = {PAYMENT, ORDER};

/* The provider takes 300 ms, so copies released together really find the
 * key processing, some of them on the other instance. */
static const char *const slow_flags[] = {"--sandbox-delay", "300ms", NULL};

/* N copies of one request with one key, released together, split N/2 and
 * N/2 over instances a and b. One resource; N answers 201 with its id,
 * exactly one of them the first answer and the others its replays. For
 * payments (300 ms at the provider) the copies on the instance that did not
 * win must have waited for the other one's record. */
static void together_two_instances(h_server_t *a, h_server_t *b, const char *tok, int p,
                                   const char *key) {
  h_server_t *to[N];
  h_req_t reqs[N];
  h_resp_t out[N];
  const char *id = NULL;
  int first = -1, waited = 0, early = 0;
  double t0 = 1e300;
  char *db_id;

  for (int i = 0; i < N; i++) {
    to[i] = i % 2 ? b : a;
    reqs[i] = (h_req_t){
        .method = "POST", .path = paths[p], .token = tok, .key = key, .body = bodies[p]};
  }
  h_together_on(to, reqs, N, out);
  for (int i = 0; i < N; i++) {
    h_context("%s, answer %d of %d (instance %s)", paths[p], i, N, i % 2 ? "B" : "A");
    h_assert_status(&out[i], 201);
    if (id == NULL)
      id = h_id(&out[i]);
    assert_string_equal(h_id(&out[i]), id);
    if (out[i].replayed[0] == '\0') {
      if (first >= 0)
        fail_msg("answers %d and %d are both first answers", first, i);
      first = i;
    }
    if (out[i].t_end - out[i].seconds < t0)
      t0 = out[i].t_end - out[i].seconds;
  }
  h_context("%s", paths[p]);
  if (first < 0)
    fail_msg("no answer is a first answer: all %d are replays", N);
  h_assert_first(&out[first], 201);
  for (int i = 0; i < N; i++)
    if (i != first) {
      h_context("%s, answer %d replays answer %d", paths[p], i, first);
      h_assert_replay_of(&out[i], &out[first]);
    }
  h_context("%s", paths[p]);

  if (p == 0) {
    /* The winner reserved at t0 or later and completed 300 ms after that:
     * a copy on the other instance sent within 200 ms of the release found
     * the key processing, so its replay cannot have come before t0 + 0.3. */
    for (int i = 0; i < N; i++) {
      if (i % 2 == first % 2 || out[i].t_end - out[i].seconds > t0 + 0.2)
        continue;
      early++;
      if (out[i].t_end < t0 + 0.3)
        fail_msg("answer %d (other instance) replayed %.3f s after the release, before "
                 "the original can have completed",
                 i, out[i].t_end - t0);
      /* woken by the other instance's completion, not by the 5 s bound */
      if (out[i].t_end > out[first].t_end + 1.0)
        fail_msg("answer %d (other instance) came %.3f s after the original", i,
                 out[i].t_end - out[first].t_end);
      waited++;
    }
    /* Premise: the copies did overlap the original (else this proves nothing). */
    if (early < N / 4)
      fail_msg("only %d copies on the other instance were sent while the original was "
               "at the provider",
               early);
    assert_int_equal(waited, early);
  }

  h_assert_db(a, 1, "SELECT count(*) FROM resources WHERE kind = ?1", kinds[p]);
  h_assert_db(a, 1, "SELECT count(*) FROM resources WHERE kind = ?1 AND id = ?2",
              kinds[p], id);
  h_assert_db(a, 1,
              p == 0 ? "SELECT count(*) FROM payments" : "SELECT count(*) FROM orders");
  h_assert_db(a, 1, "SELECT count(*) FROM idempotency_records WHERE key = ?1", key);
  h_assert_db(a, 1,
              "SELECT count(*) FROM idempotency_records WHERE key = ?1 AND "
              "state = 'completed' AND response_status = 201",
              key);
  db_id = h_db_text(a, "SELECT resource_id FROM idempotency_records WHERE key = ?1", key);
  assert_non_null(db_id);
  assert_string_equal(db_id, id);
  free(db_id);
  h_assert_db(a, 0, "SELECT count(*) FROM outbox");
  h_context_clear();
  for (int i = 0; i < N; i++)
    h_resp_free(&out[i]);
}

static void run_together(int p) {
  h_server_t *a = h_server_start(slow_flags);
  h_server_t *b = h_server_start_on(a->db, slow_flags);
  const char *tok = h_tenant(a, "acme");

  assert_int_not_equal(a->port, b->port);
  together_two_instances(a, b, tok, p, p == 0 ? "multi-pay-1" : "multi-order-1");
  h_assert_healthy(a);
  h_assert_healthy(b);
  h_server_stop(b);
  h_server_stop(a);
}

static void test_together_payment_two_instances(void **state) {
  (void)state;
  run_together(0);
}

static void test_together_order_two_instances(void **state) {
  (void)state;
  run_together(1);
}

/* A key used on A is the same key on B: the same request replays there,
 * a different one is a mismatch, and B reads A's resources. */
static void test_key_shared_across_instances(void **state) {
  h_server_t *a = h_server_start(NULL);
  h_server_t *b = h_server_start_on(a->db, NULL);
  const char *tok = h_tenant(a, "acme");
  h_resp_t first, r;
  char path[128];
  (void)state;

  for (int p = 0; p < 2; p++) {
    h_context("%s", paths[p]);
    h_post(a, paths[p], tok, "shared-1", bodies[p], &first);
    h_assert_first(&first, 201);
    h_post(b, paths[p], tok, "shared-1", bodies[p], &r);
    h_assert_replay_of(&r, &first);
    h_resp_free(&r);
    h_post(b, paths[p], tok, "shared-1",
           p == 0 ? "{\"amount\": 1}"
                  : "{\"customer_id\":\"c2\",\"items\":[{\"sku\":\"B\",\"quantity\":1,"
                    "\"unit_price\":1}]}",
           &r);
    h_assert_error(&r, 422, MISMATCH);
    h_resp_free(&r);
    snprintf(path, sizeof path, "%s/%s", paths[p], h_id(&first));
    h_get(b, path, tok, &r);
    h_assert_status(&r, 200);
    assert_string_equal(h_id(&r), h_id(&first));
    h_resp_free(&r);
    h_resp_free(&first);
  }
  h_context_clear();
  h_assert_db(b, 1, "SELECT count(*) FROM payments");
  h_assert_db(b, 1, "SELECT count(*) FROM orders");
  h_assert_db(b, 2, "SELECT count(*) FROM idempotency_records");
  h_server_stop(b);
  h_server_stop(a);
}

/* Runs idemd's CLI on `s`'s database; returns its first line of output
 * (caller frees), asserting it succeeded. */
static char *cli_line(h_server_t *s, const char *const *args) {
  char *out = NULL;
  assert_int_equal(h_cli(s, args, &out), 0);
  assert_non_null(out);
  out[strcspn(out, "\n")] = '\0';
  return out;
}

/* B remembers the key (its replays are answered from memory in its event
 * thread); A's CLI revokes it: B refuses it once the NOTIFY arrives, well
 * before an entry's 30 s lifetime (src/data/tenants.c), while another key
 * of the tenant still gets the replay. The bound is generous: only a
 * missed notification would reach it. */
static void test_revoked_key_on_other_instance(void **state) {
  h_server_t *a = h_server_start(NULL);
  h_server_t *b = h_server_start_on(a->db, NULL);
  const char *tok = h_tenant(a, "acme");
  char *tok2;
  h_resp_t first, r;
  double until;
  long status = 0;
  (void)state;

  h_post(b, "/payments", tok, "rev-1", PAYMENT, &first);
  h_assert_first(&first, 201);
  for (int i = 0; i < 3; i++) { /* remembered on b now */
    h_post(b, "/payments", tok, "rev-1", PAYMENT, &r);
    h_assert_replay_of(&r, &first);
    h_resp_free(&r);
  }
  tok2 =
      cli_line(a, (const char *const[]){"tenant", "key", "add", "acme", "second", NULL});
  free(cli_line(
      a, (const char *const[]){"tenant", "key", "revoke", "acme", "default", NULL}));
  for (until = h_now() + 10; h_now() < until;) {
    h_post(b, "/payments", tok, "rev-1", PAYMENT, &r);
    status = r.status;
    h_resp_free(&r);
    if (status == 401)
      break;
    assert_int_equal(status, 201); /* still the replay, until then */
    usleep(20 * 1000);
  }
  assert_int_equal(status, 401);
  h_post(a, "/payments", tok, "rev-1", PAYMENT, &r);
  h_assert_status(&r, 401);
  h_resp_free(&r);
  h_post(b, "/payments", tok2, "rev-1", PAYMENT, &r);
  h_assert_replay_of(&r, &first);
  h_resp_free(&r);
  h_post(b, "/payments", tok2, "rev-2", PAYMENT, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);
  h_resp_free(&first);
  free(tok2);
  h_server_stop(b);
  h_server_stop(a);
}

/* A request sent from a thread. */
struct bg {
  h_server_t *s;
  const char *tok, *key;
  h_resp_t resp;
  pthread_t thread;
};

static void *bg_main(void *p) {
  struct bg *b = p;
  h_post(b->s, "/payments", b->tok, b->key, PAYMENT, &b->resp);
  return NULL;
}

/* Sends the original to A in the background and returns once its record is
 * processing (A is at the provider). */
static void start_original(struct bg *orig) {
  assert_int_equal(pthread_create(&orig->thread, NULL, bg_main, orig), 0);
  if (!h_db_wait(orig->s, 10000,
                 "SELECT count(*) FROM idempotency_records WHERE key = ?1 AND "
                 "state = 'processing'",
                 orig->key)) {
    pthread_join(orig->thread, NULL);
    fail_msg("the original never reserved its key");
  }
}

/* Liveness of the cross-instance wake-up: with a 30 s wait bound and 2 s at
 * the provider, duplicates on B answer about when A's original finishes,
 * not at the bound. The duplicates must be sent while A is at the provider;
 * when a loaded machine notices the reservation too late for that, the
 * round is run again under a new key rather than judged. */
static void test_wakeup_across_instances(void **state) {
  static const char *const flags[] = {"--sandbox-delay", "2s", "--inflight-wait", "30s",
                                      NULL};
  enum { DUPS = 5, ROUNDS = 3 };
  h_server_t *a = h_server_start(flags);
  h_server_t *b = h_server_start_on(a->db, flags);
  const char *tok = h_tenant(a, "acme");
  int judged = 0, round;
  (void)state;

  for (round = 0; round < ROUNDS && !judged; round++) {
    char key[32];
    struct bg orig = {.s = a, .tok = tok, .key = key};
    h_server_t *to[DUPS];
    h_req_t reqs[DUPS];
    h_resp_t dup[DUPS];
    double sent, orig_start;

    snprintf(key, sizeof key, "wake-%d", round);
    start_original(&orig);
    sent = h_now();
    for (int i = 0; i < DUPS; i++) {
      to[i] = b;
      reqs[i] = (h_req_t){.method = "POST",
                          .path = "/payments",
                          .token = tok,
                          .key = key,
                          .body = PAYMENT};
    }
    h_together_on(to, reqs, DUPS, dup);
    pthread_join(orig.thread, NULL);

    h_assert_first(&orig.resp, 201);
    orig_start = orig.resp.t_end - orig.resp.seconds;
    /* premise: sent while A was at the provider (2 s from its start) */
    judged = sent < orig_start + 1.5;
    if (!judged)
      print_message("round %d: duplicates sent %.3f s after the original; again\n",
                    round, sent - orig_start);
    for (int i = 0; i < DUPS; i++) {
      h_context("round %d, duplicate %d on B", round, i);
      h_assert_replay_of(&dup[i], &orig.resp);
      /* the replay cannot have come before A's provider call ended */
      if (dup[i].t_end < orig_start + 2.0)
        fail_msg("replayed %.3f s after the original was sent, before it can have "
                 "completed",
                 dup[i].t_end - orig_start);
      /* ...and promptly: woken by A's NOTIFY, not by the 30 s bound */
      if (judged && dup[i].t_end - orig.resp.t_end > 10.0)
        fail_msg("answered %.3f s after the original: not woken by the other instance",
                 dup[i].t_end - orig.resp.t_end);
      h_resp_free(&dup[i]);
    }
    h_context_clear();
    h_resp_free(&orig.resp);
  }
  if (!judged)
    fail_msg("premise never held in %d rounds: the machine is too loaded", ROUNDS);
  /* one payment per round, however many duplicates */
  h_assert_db(a, round, "SELECT count(*) FROM payments");
  h_server_stop(b);
  h_server_stop(a);
}

/* The wait on another instance's key is bounded: B's --inflight-wait
 * 200 ms runs out while A is still at the provider (3 s, wide enough for a
 * loaded machine), and B answers 409 with Retry-After; once A finishes, B
 * replays A's answer. */
static void test_wait_bound_across_instances(void **state) {
  static const char *const a_flags[] = {"--sandbox-delay", "3s", NULL};
  static const char *const b_flags[] = {"--inflight-wait", "200ms", NULL};
  h_server_t *a = h_server_start(a_flags);
  h_server_t *b = h_server_start_on(a->db, b_flags);
  struct bg orig = {.s = a, .key = "bound-1"};
  h_resp_t r;
  (void)state;

  orig.tok = h_tenant(a, "acme");
  start_original(&orig);
  h_post(b, "/payments", orig.tok, orig.key, PAYMENT, &r);
  h_assert_error(&r, 409, NULL);
  assert_true(r.retry_after[0] != '\0');
  assert_true(r.seconds >= 0.15);
  assert_true(r.seconds < 2.5);
  h_resp_free(&r);
  pthread_join(orig.thread, NULL);
  h_assert_first(&orig.resp, 201);
  h_post(b, "/payments", orig.tok, orig.key, PAYMENT, &r);
  h_assert_replay_of(&r, &orig.resp);
  h_resp_free(&r);
  h_assert_db(b, 1, "SELECT count(*) FROM payments");
  h_resp_free(&orig.resp);
  h_server_stop(b);
  h_server_stop(a);
}

/* Exits 77 (skipped, see CMakeLists.txt) unless IDEM_TEST_STORE_URL names
 * a PostgreSQL cluster. */
int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_together_payment_two_instances, h_teardown),
      cmocka_unit_test_teardown(test_together_order_two_instances, h_teardown),
      cmocka_unit_test_teardown(test_key_shared_across_instances, h_teardown),
      cmocka_unit_test_teardown(test_revoked_key_on_other_instance, h_teardown),
      cmocka_unit_test_teardown(test_wakeup_across_instances, h_teardown),
      cmocka_unit_test_teardown(test_wait_bound_across_instances, h_teardown),
  };
  int rc;
  h_init(argc, argv);
  if (!h_store_is_pg()) {
    fprintf(stderr, "needs PostgreSQL (run it through scripts/with-pg.sh): skipped\n");
    curl_global_cleanup();
    return 77;
  }
  rc = cmocka_run_group_tests_name("integration: many instances on one database", tests,
                                   NULL, NULL);
  curl_global_cleanup();
  return rc;
}
