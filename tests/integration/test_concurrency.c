/* Concurrency: requests released together with one key create exactly one
 * resource and all get its answer; sequential retries add no rows; two
 * payloads racing on one key give one winner; many connections with unique
 * keys give no 5xx and one payment per 201; a request that arrives while
 * the one before it on its connection waits is answered after it. */
#define _GNU_SOURCE /* memmem, strcasestr */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
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

/* N requests with one key released together: one resource, N answers 201
 * with its id, exactly one of them the first answer. */
static void together_one_key(h_server_t *s, const char *tok, int p, const char *key) {
  h_req_t reqs[N];
  h_resp_t out[N];
  const char *id = NULL;
  int firsts = 0;
  char *db_id;

  for (int i = 0; i < N; i++)
    reqs[i] = (h_req_t){
        .method = "POST", .path = paths[p], .token = tok, .key = key, .body = bodies[p]};
  h_together(s, reqs, N, out);
  for (int i = 0; i < N; i++) {
    h_context("%s, answer %d of %d", paths[p], i, N);
    h_assert_status(&out[i], 201);
    if (id == NULL)
      id = h_id(&out[i]);
    assert_string_equal(h_id(&out[i]), id);
    if (out[i].replayed[0] == '\0')
      firsts++;
  }
  h_context("%s", paths[p]);
  assert_int_equal(firsts, 1);
  for (int i = 0; i < N; i++)
    if (out[i].replayed[0] == '\0')
      for (int k = 0; k < N; k++)
        if (k != i)
          h_assert_replay_of(&out[k], &out[i]);
  h_assert_db(s, 1, "SELECT count(*) FROM resources WHERE kind = ?1 AND id = ?2",
              kinds[p], id);
  h_assert_db(s, 1, "SELECT count(*) FROM idempotency_records WHERE key = ?1", key);
  db_id = h_db_text(s, "SELECT resource_id FROM idempotency_records WHERE key = ?1", key);
  assert_non_null(db_id);
  assert_string_equal(db_id, id);
  free(db_id);
  h_context_clear();
  for (int i = 0; i < N; i++)
    h_resp_free(&out[i]);
}

static void run_together(const char *const *flags) {
  h_server_t *s = h_server_start(flags);
  const char *tok = h_tenant(s, "acme");
  char key[64];

  for (int round = 0; round < 3; round++)
    for (int p = 0; p < 2; p++) {
      snprintf(key, sizeof key, "together-%d-%d", p, round);
      together_one_key(s, tok, p, key);
    }
  h_assert_db(s, 3, "SELECT count(*) FROM resources WHERE kind = 'payment'");
  h_assert_db(s, 3, "SELECT count(*) FROM resources WHERE kind = 'order'");
  h_assert_db(s, 0, "SELECT count(*) FROM outbox");
  h_server_stop(s);
}

static void test_together_same_key(void **state) {
  (void)state;
  run_together(NULL);
}

/* The same with a slow provider, so the duplicates really wait. */
static void test_together_same_key_slow_provider(void **state) {
  static const char *const flags[] = {"--sandbox-delay", "300ms", NULL};
  (void)state;
  run_together(flags);
}

/* The same for outcomes other than 201: a pending payment (202) and a
 * declined one (402) are one payment each, every answer naming it. */
static void test_together_pending_and_declined(void **state) {
  static const char *const flags[] = {"--sandbox-delay",
                                      "300ms",
                                      "--sandbox-uncertain-amount",
                                      "7070",
                                      "--sandbox-decline-amount",
                                      "4040",
                                      "--reconcile-interval",
                                      "1h",
                                      NULL};
  static const struct {
    const char *key, *body;
    long status;
  } cases[] = {{"together-pending", "{\"amount\": 7070}", 202},
               {"together-declined", "{\"amount\": 4040}", 402}};
  h_server_t *s = h_server_start(flags);
  const char *tok = h_tenant(s, "acme");
  (void)state;

  for (size_t c = 0; c < 2; c++) {
    h_req_t reqs[N];
    h_resp_t out[N];
    int firsts = 0;
    for (int i = 0; i < N; i++)
      reqs[i] = (h_req_t){.method = "POST",
                          .path = "/payments",
                          .token = tok,
                          .key = cases[c].key,
                          .body = cases[c].body};
    h_together(s, reqs, N, out);
    for (int i = 0; i < N; i++) {
      h_context("%s, answer %d", cases[c].key, i);
      h_assert_status(&out[i], cases[c].status);
      assert_string_equal(h_id(&out[i]), h_id(&out[0]));
      if (out[i].replayed[0] == '\0')
        firsts++;
    }
    h_context("%s", cases[c].key);
    assert_int_equal(firsts, 1);
    h_assert_db(s, 1, "SELECT count(*) FROM payments WHERE id = ?1", h_id(&out[0]));
    h_context_clear();
    for (int i = 0; i < N; i++)
      h_resp_free(&out[i]);
  }
  h_assert_db(s, 2, "SELECT count(*) FROM payments");
  h_assert_db(s, 1, "SELECT count(*) FROM payments WHERE status = 'pending'");
  h_assert_db(s, 1, "SELECT count(*) FROM payments WHERE status = 'declined'");
  h_server_stop(s);
}

/* Ten identical requests in a row: one row in the business table. */
static void test_sequential_identical(void **state) {
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  h_resp_t first, r;
  (void)state;

  for (int p = 0; p < 2; p++) {
    h_context("%s", paths[p]);
    h_post(s, paths[p], tok, "seq-1", bodies[p], &first);
    h_assert_first(&first, 201);
    for (int i = 1; i < 10; i++) {
      h_post(s, paths[p], tok, "seq-1", bodies[p], &r);
      h_assert_replay_of(&r, &first);
      h_resp_free(&r);
    }
    h_resp_free(&first);
  }
  h_context_clear();
  h_assert_db(s, 1, "SELECT count(*) FROM payments");
  h_assert_db(s, 1, "SELECT count(*) FROM orders");
  h_assert_db(s, 2, "SELECT count(*) FROM idempotency_records");
  h_server_stop(s);
}

/* One key, two payloads, ten each, released together: one resource; the
 * winner's payload gets its answer, the other payload 422. */
static void two_payloads(h_server_t *s, const char *tok, int p, const char *key) {
  static const char *const payloads[2][2] = {
      {"{\"amount\": 1111}", "{\"amount\": 2222}"},
      {"{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":1,\"unit_price\":"
       "1111}]}",
       "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":1,\"unit_price\":"
       "2222}]}"},
  };
  h_req_t reqs[N];
  h_resp_t out[N];
  int64_t winner_value;
  int winner, firsts = 0;
  char *id;

  for (int i = 0; i < N; i++)
    reqs[i] = (h_req_t){.method = "POST",
                        .path = paths[p],
                        .token = tok,
                        .key = key,
                        .body = payloads[p][i % 2]};
  h_together(s, reqs, N, out);

  h_context("%s", paths[p]);
  h_assert_db(s, 1, "SELECT count(*) FROM resources WHERE kind = ?1", kinds[p]);
  winner_value =
      h_db_int(s, p == 0 ? "SELECT amount FROM payments" : "SELECT total FROM orders");
  assert_true(winner_value == 1111 || winner_value == 2222);
  winner = winner_value == 1111 ? 0 : 1;
  id = h_db_text(s, "SELECT id FROM resources WHERE kind = ?1", kinds[p]);
  assert_non_null(id);
  for (int i = 0; i < N; i++) {
    h_context("%s, request %d (payload %d, winner %d)", paths[p], i, i % 2, winner);
    if (i % 2 == winner) {
      h_assert_status(&out[i], 201);
      assert_string_equal(h_id(&out[i]), id);
      if (out[i].replayed[0] == '\0')
        firsts++;
    } else {
      h_assert_error(&out[i], 422, MISMATCH);
    }
  }
  h_context("%s", paths[p]);
  assert_int_equal(firsts, 1);
  h_context_clear();
  free(id);
  for (int i = 0; i < N; i++)
    h_resp_free(&out[i]);
}

static void test_together_two_payloads(void **state) {
  static const char *const flags[] = {"--sandbox-delay", "300ms", NULL};
  h_server_t *s = h_server_start(NULL);
  h_server_t *slow;
  const char *tok = h_tenant(s, "acme");
  (void)state;

  two_payloads(s, tok, 0, "two-payloads");
  two_payloads(s, tok, 1, "two-payloads");
  h_server_stop(s);

  slow = h_server_start(flags);
  tok = h_tenant(slow, "acme");
  two_payloads(slow, tok, 0, "two-payloads-slow");
  two_payloads(slow, tok, 1, "two-payloads-slow");
  h_server_stop(slow);
}

/* Many clients at once, unique keys. */
#define CLIENTS 64
#define PER_CLIENT 20

struct client {
  h_server_t *s;
  const char *tok;
  int index;
  pthread_barrier_t *barrier;
  int created, server_errors, transport_errors, other;
  long other_status;
  char sample[200];
};

static void *client_main(void *p) {
  struct client *c = p;
  CURL *h = curl_easy_init();
  char key[64], body[96];

  pthread_barrier_wait(c->barrier);
  for (int i = 0; i < PER_CLIENT && h; i++) {
    h_req_t q = {
        .method = "POST", .path = "/payments", .token = c->tok, .key = key, .body = body};
    h_resp_t r;
    snprintf(key, sizeof key, "load-%d-%d", c->index, i);
    snprintf(body, sizeof body, "{\"amount\": %d, \"order_id\": \"o%d\"}",
             1000 + c->index * PER_CLIENT + i, i);
    h_http_on(h, c->s, &q, &r);
    if (r.status == 201)
      c->created++;
    else if (r.status >= 500)
      c->server_errors++;
    else if (r.status == 0)
      c->transport_errors++;
    else
      c->other++;
    if (r.status != 201 && c->sample[0] == '\0') {
      c->other_status = r.status;
      snprintf(c->sample, sizeof c->sample, "%ld %.150s", r.status, r.body);
    }
    h_resp_free(&r);
  }
  curl_easy_cleanup(h);
  return NULL;
}

static void test_many_connections_unique_keys(void **state) {
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  struct client clients[CLIENTS];
  pthread_t threads[CLIENTS];
  pthread_barrier_t barrier;
  int created = 0, errors5 = 0, transport = 0, other = 0;
  (void)state;

  assert_int_equal(pthread_barrier_init(&barrier, NULL, CLIENTS), 0);
  for (int i = 0; i < CLIENTS; i++) {
    clients[i] = (struct client){.s = s, .tok = tok, .index = i, .barrier = &barrier};
    assert_int_equal(pthread_create(&threads[i], NULL, client_main, &clients[i]), 0);
  }
  for (int i = 0; i < CLIENTS; i++)
    pthread_join(threads[i], NULL);
  pthread_barrier_destroy(&barrier);
  for (int i = 0; i < CLIENTS; i++) {
    created += clients[i].created;
    errors5 += clients[i].server_errors;
    transport += clients[i].transport_errors;
    other += clients[i].other;
    if (clients[i].sample[0])
      print_message("client %d: %s\n", i, clients[i].sample);
  }
  assert_int_equal(errors5, 0);
  assert_int_equal(transport, 0);
  assert_int_equal(other, 0);
  assert_int_equal(created, CLIENTS * PER_CLIENT);
  h_assert_db(s, created, "SELECT count(*) FROM payments");
  h_assert_db(s, created, "SELECT count(*) FROM payments WHERE status = 'succeeded'");
  h_assert_db(s, created,
              "SELECT count(*) FROM idempotency_records WHERE state = 'completed'");
  h_assert_db(s, 0, "SELECT count(*) FROM outbox");
  h_assert_healthy(s);
  h_server_stop(s);
}

struct slow_batch {
  h_server_t *s;
  h_req_t reqs[3];
  h_resp_t out[3];
};

static void *slow_batch_main(void *arg) {
  struct slow_batch *b = arg;
  h_together(b->s, b->reqs, 3, b->out);
  return NULL;
}

/* Requests that wait hold up no other: with one event thread and two
 * workers, three payments sit in a 3 s provider call (the third queued for
 * a worker) while a replay, a read, a health check and a 422 on the same
 * server are all answered before any of the three. On PostgreSQL, whose
 * reads all go to workers, there are four workers, so one is left for the
 * quick requests. */
static void test_waiting_requests_hold_up_no_other(void **state) {
  const char *const flags[] = {"--threads", "1", "--workers", h_store_is_pg() ? "4" : "2",
                               "--sandbox-delay", "3s", NULL};
  h_server_t *s = h_server_start(flags);
  const char *tok = h_tenant(s, "acme");
  struct slow_batch b = {.s = s};
  h_resp_t order, quick[4];
  char path[128];
  double first_slow = 1e300, last_quick = 0;
  pthread_t t;
  (void)state;

  h_post(s, "/orders", tok, "ready-order", ORDER, &order);
  h_assert_first(&order, 201);
  snprintf(path, sizeof path, "/orders/%s", h_id(&order));
  for (int i = 0; i < 3; i++) {
    static const char *const keys[] = {"slow-a", "slow-b", "slow-c"};
    b.reqs[i] = (h_req_t){
        .method = "POST", .path = "/payments", .token = tok, .key = keys[i], .body = PAYMENT};
  }
  assert_int_equal(pthread_create(&t, NULL, slow_batch_main, &b), 0);
  /* Until the payments are at the provider (their records processing). */
  if (!h_db_wait(s, 10000, "SELECT count(*) - 1 FROM idempotency_records "
                           "WHERE key LIKE 'slow-%' AND state = 'processing'")) {
    pthread_join(t, NULL);
    fail_msg("the slow payments never reached the provider");
  }
  h_post(s, "/orders", tok, "ready-order", ORDER, &quick[0]);
  h_get(s, path, tok, &quick[1]);
  h_get(s, "/healthz", NULL, &quick[2]);
  h_post(s, "/payments", tok, "bad-amount", "{\"amount\": -1}", &quick[3]);
  pthread_join(t, NULL);

  h_assert_replay_of(&quick[0], &order);
  h_assert_status(&quick[1], 200);
  h_assert_status(&quick[2], 200);
  h_assert_status(&quick[3], 422);
  for (int i = 0; i < 3; i++) {
    h_context("slow payment %d", i);
    h_assert_first(&b.out[i], 201);
    if (b.out[i].t_end < first_slow)
      first_slow = b.out[i].t_end;
  }
  h_context_clear();
  for (int i = 0; i < 4; i++)
    if (quick[i].t_end > last_quick)
      last_quick = quick[i].t_end;
  if (!(last_quick < first_slow))
    fail_msg("a quick request waited behind the provider calls: last quick answer "
             "at %.3f s, first slow one at %.3f s",
             last_quick, first_slow);
  for (int i = 0; i < 4; i++)
    h_resp_free(&quick[i]);
  for (int i = 0; i < 3; i++)
    h_resp_free(&b.out[i]);
  h_resp_free(&order);
  h_server_stop(s);
}

/* Requests sent together from another thread. */
struct batch {
  h_server_t *s;
  int n;
  h_req_t reqs[N];
  h_resp_t out[N];
};

static void *batch_main(void *arg) {
  struct batch *b = arg;
  h_together(b->s, b->reqs, b->n, b->out);
  return NULL;
}

static long metric(h_server_t *s, const char *name) {
  char line[96];
  h_resp_t r;
  const char *p;
  long v = -1;
  snprintf(line, sizeof line, "\n%s ", name);
  h_get(s, "/metrics", NULL, &r);
  if (r.body && (p = strstr(r.body, line)) != NULL)
    v = strtol(p + strlen(line), NULL, 10);
  h_resp_free(&r);
  return v;
}

/* Starts idemd with `flags` and one payment whose provider call holds its
 * only worker, and waits until the payment's record is processing. */
static h_server_t *start_slow_original(const char *const *flags, struct batch *orig,
                                       pthread_t *t) {
  h_server_t *s = h_server_start(flags);
  const char *tok = h_tenant(s, "acme");

  *orig = (struct batch){.s = s, .n = 1};
  orig->reqs[0] = (h_req_t){
      .method = "POST", .path = "/payments", .token = tok, .key = "held", .body = PAYMENT};
  assert_int_equal(pthread_create(t, NULL, batch_main, orig), 0);
  if (!h_db_wait(s, 10000, "SELECT count(*) FROM idempotency_records "
                           "WHERE key = 'held' AND state = 'processing'")) {
    pthread_join(*t, NULL);
    fail_msg("the payment never reached the provider");
  }
  return s;
}

/* Duplicates of a key in flight wait without a thread (SQLite): with one
 * worker, busy in the original's provider call, all of them are parked
 * (idem_inflight_parked) and each gets the original's answer once it
 * completes. On PostgreSQL they wait in workers: not this test. */
static void test_duplicates_wait_without_a_thread(void **state) {
  const char *const flags[] = {"--threads", "1", "--workers", "1",
                               "--sandbox-delay", "4s", "--inflight-wait", "30s", NULL};
  struct batch orig, dups;
  pthread_t t_orig, t_dups;
  h_server_t *s;
  long parked = -1;
  (void)state;

  if (h_store_is_pg())
    skip();
  s = start_slow_original(flags, &orig, &t_orig);
  dups = (struct batch){.s = s, .n = N};
  for (int i = 0; i < N; i++)
    dups.reqs[i] = orig.reqs[0];
  assert_int_equal(pthread_create(&t_dups, NULL, batch_main, &dups), 0);
  /* Within the original's 4 s (slow builds, sanitizers, take longer). */
  for (int i = 0; i < 800 && parked != N; i++) {
    struct timespec ts = {0, 5 * 1000000L};
    parked = metric(s, "idem_inflight_parked");
    nanosleep(&ts, NULL);
  }
  pthread_join(t_orig, NULL);
  pthread_join(t_dups, NULL);
  assert_int_equal(parked, N);
  h_assert_first(&orig.out[0], 201);
  for (int i = 0; i < N; i++) {
    h_context("duplicate %d", i);
    h_assert_replay_of(&dups.out[i], &orig.out[0]);
  }
  h_context_clear();
  assert_int_equal(metric(s, "idem_inflight_parked"), 0);
  h_assert_db(s, 1, "SELECT count(*) FROM payments");
  for (int i = 0; i < N; i++)
    h_resp_free(&dups.out[i]);
  h_resp_free(&orig.out[0]);
  h_server_stop(s);
}

/* --inflight-wait counts from a duplicate's arrival, and its 409 needs no
 * worker: with the only worker in a 3 s provider call, duplicates bounded
 * at 300 ms are all answered 409 (Retry-After) before the original. */
static void test_inflight_wait_bound_without_a_worker(void **state) {
  const char *const flags[] = {"--threads", "1", "--workers", "1",
                               "--sandbox-delay", "3s", "--inflight-wait", "300ms", NULL};
  struct batch orig, dups;
  pthread_t t_orig;
  h_server_t *s;
  (void)state;

  if (h_store_is_pg())
    skip();
  s = start_slow_original(flags, &orig, &t_orig);
  dups = (struct batch){.s = s, .n = 5};
  for (int i = 0; i < dups.n; i++)
    dups.reqs[i] = orig.reqs[0];
  batch_main(&dups);
  pthread_join(t_orig, NULL);
  h_assert_first(&orig.out[0], 201);
  for (int i = 0; i < dups.n; i++) {
    h_context("duplicate %d", i);
    h_assert_status(&dups.out[i], 409);
    assert_string_equal(dups.out[i].retry_after, "1");
    if (!(dups.out[i].t_end < orig.out[0].t_end))
      fail_msg("the duplicate's 409 came after the original's answer");
  }
  h_context_clear();
  for (int i = 0; i < dups.n; i++)
    h_resp_free(&dups.out[i]);
  h_resp_free(&orig.out[0]);
  h_server_stop(s);
}

struct quitter {
  h_server_t *s;
  const char *tok;
  int index;
};

/* Sends new-key orders and payments, giving up on each after 1 to 4 ms, so
 * that some are abandoned at every step of their flow (before the write,
 * while it is queued, just after it is answered). */
static void *quitter_main(void *p) {
  struct quitter *q = p;
  char key[96];

  for (int i = 0; i < 150; i++) {
    int order = i % 2;
    snprintf(key, sizeof key, "quit-%d-%d", q->index, i);
    /* mostly a timeout: the point */
    (void)h_post_timeout(q->s, order ? "/orders" : "/payments", q->tok, key,
                         order ? ORDER : PAYMENT, 1L + (long)(i % 4));
  }
  return NULL;
}

/* Clients that hang up in the middle of their requests leave idemd
 * healthy, and able to stop at once (nothing is left waiting for a
 * connection that is gone); every order it wrote is whole, and every key
 * it won is soon finished (a payment whose client left is still charged
 * and completed, not left to wait out its lease). */
static void test_clients_hanging_up(void **state) {
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  struct quitter q[8];
  pthread_t t[8];
  (void)state;

  for (int i = 0; i < 8; i++) {
    q[i] = (struct quitter){s, tok, i};
    assert_int_equal(pthread_create(&t[i], NULL, quitter_main, &q[i]), 0);
  }
  for (int i = 0; i < 8; i++)
    pthread_join(t[i], NULL);
  /* The connections they dropped close as idemd notices (a suspended one
   * once its write is done); until then they count against the cap. */
  for (double deadline = h_now() + 10; h_now() < deadline;) {
    h_resp_t r;
    long status;
    h_get(s, "/healthz", NULL, &r);
    status = r.status;
    h_resp_free(&r);
    if (status == 200)
      break;
    poll(NULL, 0, 50);
  }
  h_assert_healthy(s);
  if (!h_db_wait(s, 10000, "SELECT CASE WHEN count(*) = 0 THEN 1 ELSE 0 END FROM "
                           "idempotency_records WHERE state = 'processing'"))
    fail_msg("%lld records were still processing 10 s after their clients left",
             (long long)h_db_int(s, "SELECT count(*) FROM idempotency_records "
                                    "WHERE state = 'processing'"));
  h_assert_db(s, 0, "SELECT count(*) FROM idempotency_records r WHERE r.operation = "
                    "'create_order' AND (r.state <> 'completed' OR NOT EXISTS "
                    "(SELECT 1 FROM orders o WHERE o.id = r.resource_id))");
  h_server_stop(s); /* fails when idemd does not exit promptly */
}

/* Sends a duplicate of the held payment and hangs up after `ms`. */
static void *short_duplicate(void *p) {
  struct quitter *q = p;
  (void)h_post_timeout(q->s, "/payments", q->tok, "held", PAYMENT, 200); /* a timeout */
  return NULL;
}

/* Duplicates whose clients hang up while they are parked leave nothing
 * behind: once the original completes they are resumed, find their
 * connection gone, and idemd stops at once (a parked request still
 * counted would hold the stop up for ever). */
static void test_parked_clients_hanging_up(void **state) {
  const char *const flags[] = {"--threads", "1", "--workers", "1",
                               "--sandbox-delay", "1s", NULL};
  struct batch orig;
  struct quitter q[8];
  pthread_t t_orig, t[8];
  h_server_t *s;
  (void)state;

  if (h_store_is_pg())
    skip();
  s = start_slow_original(flags, &orig, &t_orig);
  for (int i = 0; i < 8; i++) {
    q[i] = (struct quitter){s, orig.reqs[0].token, i};
    assert_int_equal(pthread_create(&t[i], NULL, short_duplicate, &q[i]), 0);
  }
  for (int i = 0; i < 8; i++)
    pthread_join(t[i], NULL);
  pthread_join(t_orig, NULL);
  h_assert_first(&orig.out[0], 201);
  h_resp_free(&orig.out[0]);
  if (!h_db_wait(s, 5000, "SELECT count(*) FROM idempotency_records "
                          "WHERE key = 'held' AND state = 'completed'"))
    fail_msg("the original never completed");
  for (int i = 0; i < 200 && metric(s, "idem_inflight_parked") != 0; i++)
    poll(NULL, 0, 10);
  assert_int_equal(metric(s, "idem_inflight_parked"), 0);
  h_server_stop(s); /* fails when idemd does not exit promptly */
}

/* Reads HTTP answers from `fd` until `n` have come whole, the connection
 * ends, or nothing comes for 10 s; their statuses go to `status`. Returns
 * how many came. Answers carry a Content-Length (idemd's all do). */
static int read_answers(int fd, int n, long *status) {
  struct timeval tv = {10, 0};
  char buf[16384];
  size_t len = 0;
  int got = 0;

  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  while (got < n) {
    char *end = memmem(buf, len, "\r\n\r\n", 4), *cl;
    size_t whole;
    ssize_t r;

    if (end != NULL) {
      *end = '\0';
      cl = strcasestr(buf, "\r\nContent-Length:");
      whole = (size_t)(end + 4 - buf) + (cl ? strtoul(cl + 17, NULL, 10) : 0);
      *end = '\r';
      if (len >= whole) {
        status[got++] = strtol(buf + 9, NULL, 10); /* "HTTP/1.1 201 ..." */
        memmove(buf, buf + whole, len - whole);
        len -= whole;
        continue;
      }
    }
    if (len == sizeof buf)
      break;
    r = recv(fd, buf + len, sizeof buf - len, 0);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      break;
    len += (size_t)r;
  }
  return got;
}

/* Sends all of `text` on `fd`. Fails. */
static void send_all(int fd, const char *text) {
  size_t len = strlen(text), sent = 0;
  while (sent < len) {
    ssize_t w = send(fd, text + sent, len - sent, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      fail_msg("send: %s", strerror(errno));
    sent += (size_t)w;
  }
}

/* A request that arrives on a connection while the request before it is
 * suspended (its payment's provider call under way) is answered after it.
 * The event loop keeps a suspended connection in its epoll set and only
 * notes the readiness its edges report (scripts/mhd-epoll-suspend.patch):
 * an edge lost while suspended would leave the second request unread, and
 * its answer would never come. */
static void test_request_arriving_while_suspended(void **state) {
  static const char *const flags[] = {"--sandbox-delay", "500ms", NULL};
  h_server_t *s = h_server_start(flags);
  const char *tok = h_tenant(s, "acme");
  char req[1024];
  long status[2] = {0, 0};
  int fd;
  (void)state;

  fd = h_dial(s);
  for (int i = 1; i <= 2; i++) {
    snprintf(req, sizeof req,
             "POST /payments HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n%s"
             "Content-Type: application/json\r\nContent-Length: %zu\r\n"
             "Authorization: Bearer %s\r\nIdempotency-Key: while-suspended-%d\r\n\r\n%s",
             s->port, i == 2 ? "Connection: close\r\n" : "", strlen(PAYMENT), tok, i,
             PAYMENT);
    send_all(fd, req);
    /* The first is reserved: its connection stays suspended until the
     * provider's answer (500 ms) is written. */
    if (i == 1 && !h_db_wait(s, 5000,
                             "SELECT count(*) FROM idempotency_records WHERE "
                             "key = 'while-suspended-1' AND state = 'processing'"))
      fail_msg("the first payment was never reserved");
  }
  h_context("answers on one connection, the second request sent while the first waited");
  assert_int_equal(read_answers(fd, 2, status), 2);
  assert_int_equal(status[0], 201);
  assert_int_equal(status[1], 201);
  h_context_clear();
  close(fd);
  h_assert_db(s, 2, "SELECT count(*) FROM idempotency_records WHERE key LIKE "
                    "'while-suspended-%' AND state = 'completed'");
  h_server_stop(s);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_together_same_key, h_teardown),
      cmocka_unit_test_teardown(test_together_same_key_slow_provider, h_teardown),
      cmocka_unit_test_teardown(test_together_pending_and_declined, h_teardown),
      cmocka_unit_test_teardown(test_sequential_identical, h_teardown),
      cmocka_unit_test_teardown(test_together_two_payloads, h_teardown),
      cmocka_unit_test_teardown(test_many_connections_unique_keys, h_teardown),
      cmocka_unit_test_teardown(test_waiting_requests_hold_up_no_other, h_teardown),
      cmocka_unit_test_teardown(test_clients_hanging_up, h_teardown),
      cmocka_unit_test_teardown(test_duplicates_wait_without_a_thread, h_teardown),
      cmocka_unit_test_teardown(test_inflight_wait_bound_without_a_worker, h_teardown),
      cmocka_unit_test_teardown(test_parked_clients_hanging_up, h_teardown),
      cmocka_unit_test_teardown(test_request_arriving_while_suspended, h_teardown),
  };
  int rc;
  h_init(argc, argv);
  rc = cmocka_run_group_tests_name("integration: concurrency", tests, NULL, NULL);
  curl_global_cleanup();
  return rc;
}
