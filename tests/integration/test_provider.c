/* Payments through a real provider (docs/idempotency.md, section 4;
 * docs/payments.md): idemd with --provider pointing at idem-psp, the simulator,
 * whose faults stand for what goes wrong between us and a payment provider.
 * Each test ends by asking the provider how many charges it made (GET /stats):
 * one per payment, whatever happened in between. Section 7 calls the HTTP
 * provider itself for refunds, and counts the refunds the same way. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "provider/provider.h"
#include "psp_harness.h"

#define PAYMENT "{\"amount\": 15990, \"currency\": \"BRL\", \"order_id\": \"ord_42\"}"
#define COUNT_PAYMENTS "SELECT count(*) FROM payments"
#define RECORD_IN_STATE                                                                  \
  "SELECT count(*) FROM idempotency_records WHERE key = ?1 AND state = ?2"
#define PAY_ID_OF_KEY "SELECT resource_id FROM idempotency_records WHERE key = ?1"

/* --provider URL plus `extra` (NULL-terminated), in `out`. */
static void idemd_flags(const p_psp_t *p, const char *const *extra, const char **out,
                        int cap) {
  int n = 0;
  out[n++] = "--provider";
  out[n++] = p->url;
  for (int i = 0; extra && extra[i]; i++) {
    assert_true(n < cap - 1);
    out[n++] = extra[i];
  }
  out[n] = NULL;
}

/* Waits until the record of `key` is in `state`; fails after timeout_ms. */
static void wait_record(h_server_t *s, const char *key, const char *state,
                        int timeout_ms) {
  if (!h_db_wait(s, timeout_ms, RECORD_IN_STATE, key, state))
    fail_msg("the record of key '%s' did not become '%s' within %d ms", key, state,
             timeout_ms);
}

/* The payment id the key's record points at (malloc'd). Fails if none. */
static char *pay_id_of(h_server_t *s, const char *key) {
  char *id = h_db_text(s, PAY_ID_OF_KEY, key);
  if (id == NULL || strncmp(id, "pay_", 4) != 0)
    fail_msg("key '%s' has no payment (resource_id '%s')", key, id ? id : "(null)");
  return id;
}

static const char *str_field(const h_resp_t *r, const char *name) {
  const char *v = json_string_value(json_object_get(r->json, name));
  if (v == NULL)
    fail_msg("answer has no string \"%s\": %.400s", name, r->body ? r->body : "");
  return v;
}

/* A replay (header and body marker) of payment `id` with `status`, in the
 * payment state `pay_status`, at /payments/id. */
static void assert_replay(const h_resp_t *r, long status, const char *id,
                          const char *pay_status) {
  char location[128];
  h_assert_status(r, status);
  if (strcmp(r->replayed, "true") != 0 ||
      !json_is_true(json_object_get(r->json, "replayed")))
    fail_msg("not marked as a replay (header '%s'): %.400s", r->replayed, r->body);
  assert_string_equal(h_id(r), id);
  assert_string_equal(str_field(r, "status"), pay_status);
  snprintf(location, sizeof location, "/payments/%s", id);
  assert_string_equal(r->location, location);
}

/* The provider made exactly `charges` charges and `declines` declines, and
 * key `id` (when given) is among them with its own counts. */
static void assert_provider(p_psp_t *p, int64_t charges, int64_t declines, const char *id,
                            int64_t id_charges, int64_t id_declines) {
  json_t *stats = p_stats(p);
  char *text = json_dumps(stats, JSON_COMPACT);
  h_context("provider stats %s", text ? text : "?");
  free(text);
  if (p_total(stats, "charges") != charges || p_total(stats, "declines") != declines)
    fail_msg("provider made %lld charges and %lld declines, want %lld and %lld",
             (long long)p_total(stats, "charges"), (long long)p_total(stats, "declines"),
             (long long)charges, (long long)declines);
  if (id && (p_key(stats, id, "charges") != id_charges ||
             p_key(stats, id, "declines") != id_declines))
    fail_msg("provider key %s: %lld charges, %lld declines; want %lld and %lld", id,
             (long long)p_key(stats, id, "charges"),
             (long long)p_key(stats, id, "declines"), (long long)id_charges,
             (long long)id_declines);
  h_context_clear();
  json_decref(stats);
}

/* A POST from another thread, for requests whose answer is lost or slow. */
struct bg {
  h_server_t *s;
  const char *tok, *key, *body;
  const char *path; /* NULL: /payments */
  h_resp_t resp;
  pthread_t thread;
};

static void *bg_main(void *arg) {
  struct bg *b = arg;
  h_post(b->s, b->path ? b->path : "/payments", b->tok, b->key, b->body, &b->resp);
  return NULL;
}

static void bg_start(struct bg *b) {
  assert_int_equal(pthread_create(&b->thread, NULL, bg_main, b), 0);
}

/* ---- 1. the response is lost after the result was persisted ------------ */

/* Connects and sends a POST /payments, and returns the socket without
 * reading anything. */
static int send_unread(h_server_t *s, const char *tok, const char *key,
                       const char *body) {
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)s->port)};
  char req[1024];
  int n, fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

  assert_true(fd >= 0);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
  n = snprintf(req, sizeof req,
               "POST /payments HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
               "Authorization: Bearer %s\r\nIdempotency-Key: %s\r\n"
               "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
               s->port, tok, key, strlen(body), body);
  assert_true(n > 0 && (size_t)n < sizeof req);
  assert_int_equal(send(fd, req, (size_t)n, MSG_NOSIGNAL), n);
  return fd;
}

/* The client goes away while idemd is at the provider (a reset, and a
 * client-side timeout); idemd finishes the payment anyway, and the retry
 * gets it back: the same payment, replayed, one charge. */
static void test_response_lost(void **state) {
  static const char *const psp_flags[] = {"--latency", "1s", NULL};
  p_psp_t *p = p_start(psp_flags);
  const char *flags[8];
  h_server_t *s;
  const char *tok;
  struct linger hard = {1, 0};
  h_resp_t r;
  char *id1, *id2;
  int fd;
  (void)state;

  idemd_flags(p, NULL, flags, 8);
  s = h_server_start(flags);
  tok = h_tenant(s, "acme");

  /* A reset while the provider is still working. */
  fd = send_unread(s, tok, "lost-1", PAYMENT);
  wait_record(s, "lost-1", "processing", 10000);
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &hard, sizeof hard);
  close(fd);
  wait_record(s, "lost-1", "completed", 10000);
  id1 = pay_id_of(s, "lost-1");
  h_post(s, "/payments", tok, "lost-1", PAYMENT, &r);
  assert_replay(&r, 201, id1, "succeeded");
  h_resp_free(&r);

  /* A client that gives up after 200 ms, the provider still working. */
  assert_int_equal(h_post_timeout(s, "/payments", tok, "lost-2", PAYMENT, 200),
                   CURLE_OPERATION_TIMEDOUT);
  h_assert_db(s, 1, RECORD_IN_STATE, "lost-2", "processing");
  wait_record(s, "lost-2", "completed", 10000);
  id2 = pay_id_of(s, "lost-2");
  h_post(s, "/payments", tok, "lost-2", PAYMENT, &r);
  assert_replay(&r, 201, id2, "succeeded");
  h_resp_free(&r);

  h_assert_db(s, 2, COUNT_PAYMENTS);
  assert_provider(p, 2, 0, id1, 1, 0);
  assert_provider(p, 2, 0, id2, 1, 0);
  {
    json_t *stats = p_stats(p);
    /* idemd called the provider once per payment: the retries replayed. */
    assert_int_equal(p_key(stats, id1, "requests"), 1);
    assert_int_equal(p_key(stats, id2, "requests"), 1);
    assert_int_equal(p_nkeys(stats), 2);
    json_decref(stats);
  }
  free(id1);
  free(id2);
  h_server_stop(s);
  p_stop(p);
}

/* ---- 2. twenty requests with one key, the provider slow ----------------- */

/* Twenty requests released together with one key while the provider takes
 * 1 s. With a wait bound longer than that, all twenty answer with the one
 * payment; with a short bound, the ones still waiting at it get 409 with
 * Retry-After. Never a second payment, never a second charge. */
static void run_twenty(const char *inflight_wait, int expect_409) {
  enum { N = 20 };
  static const char *const psp_flags[] = {"--latency", "1s", NULL};
  p_psp_t *p = p_start(psp_flags);
  const char *extra[] = {"--inflight-wait", inflight_wait, NULL};
  const char *flags[8];
  h_req_t reqs[N];
  h_resp_t out[N], r;
  h_server_t *s;
  const char *tok, *id = NULL;
  int first = -1, replays = 0, conflicts = 0;

  idemd_flags(p, extra, flags, 8);
  s = h_server_start(flags);
  tok = h_tenant(s, "acme");
  for (int i = 0; i < N; i++)
    reqs[i] = (h_req_t){.method = "POST",
                        .path = "/payments",
                        .token = tok,
                        .key = "twenty",
                        .body = PAYMENT};
  h_together(s, reqs, N, out);

  for (int i = 0; i < N; i++) {
    h_context("--inflight-wait %s, answer %d", inflight_wait, i);
    if (out[i].status == 409) {
      char *end;
      long retry = strtol(out[i].retry_after, &end, 10);
      h_assert_error(&out[i], 409, NULL);
      if (out[i].retry_after[0] == '\0' || *end != '\0' || retry < 1)
        fail_msg("409 without a usable Retry-After ('%s')", out[i].retry_after);
      conflicts++;
      continue;
    }
    h_assert_status(&out[i], 201);
    if (id == NULL)
      id = h_id(&out[i]);
    if (strcmp(h_id(&out[i]), id) != 0)
      fail_msg("two payments for one key: %s and %s", id, h_id(&out[i]));
    if (out[i].replayed[0] == '\0') {
      if (first >= 0)
        fail_msg("answers %d and %d are both first answers", first, i);
      h_assert_first(&out[i], 201);
      first = i;
    } else {
      replays++;
    }
  }
  h_context_clear();
  if (first < 0)
    fail_msg("no first answer among the twenty");
  for (int i = 0; i < N; i++)
    if (i != first && out[i].status == 201)
      h_assert_replay_of(&out[i], &out[first]);
  if (expect_409 && conflicts == 0)
    fail_msg("--inflight-wait %s: no 409 although the provider took 1 s", inflight_wait);
  if (!expect_409 && conflicts != 0)
    fail_msg("--inflight-wait %s: %d answers were 409", inflight_wait, conflicts);
  assert_int_equal(1 + replays + conflicts, N);

  /* A retry after it all replays the one payment. */
  h_post(s, "/payments", tok, "twenty", PAYMENT, &r);
  h_assert_replay_of(&r, &out[first]);
  h_resp_free(&r);
  h_assert_db(s, 1, COUNT_PAYMENTS);
  assert_provider(p, 1, 0, h_id(&out[first]), 1, 0);
  {
    json_t *stats = p_stats(p);
    assert_int_equal(p_total(stats, "requests"), 1);
    json_decref(stats);
  }
  for (int i = 0; i < N; i++)
    h_resp_free(&out[i]);
  h_server_stop(s);
  p_stop(p);
}

static void test_twenty_long_wait(void **state) {
  (void)state;
  run_twenty("10s", 0);
}

static void test_twenty_short_wait(void **state) {
  (void)state;
  run_twenty("200ms", 1);
}

/* ---- 3. kill -9 of idemd while the provider works ------------------------ */

/* Waits until the provider has received a charge request for `id`. */
static void wait_provider_request(p_psp_t *p, const char *id, int64_t n) {
  if (!p_wait_key(p, id, "requests", n, 10000))
    fail_msg("the provider did not receive %lld request(s) for %s", (long long)n, id);
}

/* idemd reserves the key and calls a slow provider, and dies (kill -9).
 * Started again on the same database, its reconciler takes the record over
 * once the dead worker's lease ran out, finds the charge at the provider,
 * and settles it: the retry gets the payment (201, replayed); one charge,
 * and no second charge request (the lookup found it). */
static void test_kill9_while_at_provider(void **state) {
  static const char *const psp_flags[] = {"--latency", "2s", NULL};
  /* The lease is written into the record by the worker that dies, so the
   * first run needs a short one too. */
  static const char *const extra[] = {"--provider-timeout",   "3s",    "--lease", "4s",
                                      "--reconcile-interval", "200ms", NULL};
  p_psp_t *p = p_start(psp_flags);
  const char *flags[12];
  struct bg first = {.key = "crash-1", .body = PAYMENT};
  h_server_t *s;
  h_resp_t r;
  char *id;
  (void)state;

  idemd_flags(p, extra, flags, 12);
  s = h_server_start(flags);
  first.s = s;
  first.tok = h_tenant(s, "acme");
  bg_start(&first);
  wait_record(s, "crash-1", "processing", 10000);
  id = pay_id_of(s, "crash-1");
  wait_provider_request(p, id, 1);
  p_kill_idemd(s);
  pthread_join(first.thread, NULL);
  /* The client lost its answer with the process. */
  assert_int_equal(first.resp.status, 0);
  h_resp_free(&first.resp);
  h_assert_db(s, 1, RECORD_IN_STATE, "crash-1", "processing");

  h_server_restart(s, flags);
  wait_record(s, "crash-1", "completed", 20000);
  h_post(s, "/payments", first.tok, "crash-1", PAYMENT, &r);
  assert_replay(&r, 201, id, "succeeded");
  h_resp_free(&r);
  h_assert_db(s, 1, COUNT_PAYMENTS);
  h_assert_db(s, 1,
              "SELECT count(*) FROM payments WHERE id = ?1 AND status = 'succeeded'", id);
  h_assert_db(s, 0, "SELECT count(*) FROM outbox");
  assert_provider(p, 1, 0, id, 1, 0);
  {
    json_t *stats = p_stats(p);
    assert_int_equal(p_key(stats, id, "requests"), 1);
    assert_int_equal(p_nkeys(stats), 1);
    json_decref(stats);
  }
  free(id);
  h_server_stop(s);
  p_stop(p);
}

/* The same crash, but the reconciler gets there before the provider has
 * charged: the lookup finds nothing, so it sends the charge again under the
 * same key while the first call is still in flight at the provider. Both
 * calls make one charge, and the payment settles as succeeded. */
static void test_kill9_resend_same_key(void **state) {
  static const char *const psp_flags[] = {"--latency", "3s", NULL};
  static const char *const extra[] = {
      "--provider-timeout",   "1s",    "--lease", "1500ms",
      "--reconcile-interval", "200ms", NULL};
  p_psp_t *p = p_start(psp_flags);
  const char *flags[12];
  struct bg first = {.key = "crash-2", .body = PAYMENT};
  h_server_t *s;
  h_resp_t r;
  char *id;
  (void)state;

  idemd_flags(p, extra, flags, 12);
  s = h_server_start(flags);
  first.s = s;
  first.tok = h_tenant(s, "acme");
  bg_start(&first);
  wait_record(s, "crash-2", "processing", 10000);
  id = pay_id_of(s, "crash-2");
  wait_provider_request(p, id, 1);
  p_kill_idemd(s);
  pthread_join(first.thread, NULL);
  assert_int_equal(first.resp.status, 0);
  h_resp_free(&first.resp);

  h_server_restart(s, flags);
  /* The reconciler sent the charge again, under the same provider key. */
  wait_provider_request(p, id, 2);
  wait_record(s, "crash-2", "completed", 20000);
  h_post(s, "/payments", first.tok, "crash-2", PAYMENT, &r);
  assert_replay(&r, 201, id, "succeeded");
  h_resp_free(&r);
  h_assert_db(s, 1, COUNT_PAYMENTS);
  assert_provider(p, 1, 0, id, 1, 0);
  {
    json_t *stats = p_stats(p);
    assert_int_equal(p_nkeys(stats), 1);
    json_decref(stats);
  }
  free(id);
  h_server_stop(s);
  p_stop(p);
}

/* ---- 4. the provider answers after idemd's deadline ---------------------- */

/* The provider charges, then takes 2 s to answer; idemd gives up at 500 ms:
 * 202 with the pending payment, replayed as 202 while nobody settles it.
 * Once the reconciler runs it finds the charge, and replays answer 201 with
 * the same payment. One charge, and the reconciler did not send another. */
static void test_answer_after_deadline(void **state) {
  static const char *const psp_flags[] = {"--delay-after-charge", "2s", NULL};
  static const char *const frozen[] = {"--provider-timeout",   "500ms", "--lease", "1s",
                                       "--reconcile-interval", "1h",    NULL};
  static const char *const live[] = {"--provider-timeout",   "500ms", "--lease", "1s",
                                     "--reconcile-interval", "200ms", NULL};
  p_psp_t *p = p_start(psp_flags);
  const char *flags[12];
  char location[128];
  h_server_t *s;
  const char *tok;
  h_resp_t first, r;
  (void)state;

  idemd_flags(p, frozen, flags, 12);
  s = h_server_start(flags);
  tok = h_tenant(s, "acme");
  h_post(s, "/payments", tok, "late-1", PAYMENT, &first);
  h_assert_first(&first, 202);
  assert_string_equal(str_field(&first, "status"), "pending");
  snprintf(location, sizeof location, "/payments/%s", h_id(&first));
  assert_string_equal(first.location, location);
  /* Answered at idemd's deadline, not the provider's 2 s. */
  if (first.seconds > 1.8)
    fail_msg("the 202 took %.3f s: idemd waited past its provider deadline",
             first.seconds);
  h_post(s, "/payments", tok, "late-1", PAYMENT, &r);
  h_assert_replay_of(&r, &first);
  h_resp_free(&r);
  h_assert_db(s, 1, RECORD_IN_STATE, "late-1", "pending");
  /* The provider did charge. */
  assert_provider(p, 1, 0, h_id(&first), 1, 0);
  h_server_stop(s);

  idemd_flags(p, live, flags, 12);
  h_server_restart(s, flags);
  wait_record(s, "late-1", "completed", 15000);
  h_post(s, "/payments", tok, "late-1", PAYMENT, &r);
  assert_replay(&r, 201, h_id(&first), "succeeded");
  h_resp_free(&r);
  h_get(s, location, tok, &r);
  h_assert_status(&r, 200);
  assert_string_equal(str_field(&r, "status"), "succeeded");
  h_resp_free(&r);
  h_assert_db(s, 1, COUNT_PAYMENTS);
  h_assert_db(s, 0, "SELECT count(*) FROM outbox");
  assert_provider(p, 1, 0, h_id(&first), 1, 0);
  {
    json_t *stats = p_stats(p);
    assert_int_equal(p_key(stats, h_id(&first), "requests"), 1);
    json_decref(stats);
  }
  h_resp_free(&first);
  h_server_stop(s);
  p_stop(p);
}

/* The same deadline on a kept-alive provider connection: idemd's worker
 * (one worker thread, so one libcurl handle) has just made a payment, and the
 * provider hangs on the next one (SIGSTOP) until after the deadline, then
 * charges it. The request was sent, so the outcome is unknown: 202, and
 * whatever the client retries, one charge for the payment. */
static void test_deadline_on_kept_alive_connection(void **state) {
  static const char *const extra[] = {"--workers", "1",  "--provider-timeout",   "500ms",
                                      "--lease",   "1s", "--reconcile-interval", "200ms",
                                      NULL};
  p_psp_t *p = p_start(NULL);
  const char *flags[12];
  h_server_t *s;
  const char *tok;
  h_resp_t a, b, r;
  char *id_b;
  long last = 0;
  int64_t charges;
  json_t *stats;
  char *text, why[1024];
  (void)state;

  idemd_flags(p, extra, flags, 12);
  s = h_server_start(flags);
  tok = h_tenant(s, "acme");
  h_post(s, "/payments", tok, "alive-a", PAYMENT, &a);
  h_assert_first(&a, 201);

  p_pause(p);
  h_post(s, "/payments", tok, "alive-b", PAYMENT, &b);
  p_resume(p);
  id_b = pay_id_of(s, "alive-b");
  if (!p_wait_key(p, id_b, "charges", 1, 10000))
    fail_msg("the provider never charged %s after it resumed", id_b);

  /* The client retries until it has a final answer, as a client should. */
  for (double deadline = h_now() + 15; h_now() < deadline; p_nap_ms(100)) {
    h_post(s, "/payments", tok, "alive-b", PAYMENT, &r);
    last = r.status;
    h_resp_free(&r);
    if (last == 201 || last == 402)
      break;
  }
  stats = p_stats(p);
  charges = p_total(stats, "charges");
  text = json_dumps(stats, JSON_COMPACT);
  snprintf(why, sizeof why,
           "key alive-b: idemd answered %ld for %s, which the provider charged (the "
           "request went out on a kept-alive connection; want 202), then %ld to the "
           "retry; the provider made %lld charges for 2 payments: %.600s",
           b.status, id_b, last, (long long)charges, text ? text : "?");
  free(text);
  json_decref(stats);
  /* Payment a, and payment b once. */
  if (charges != 2) {
    free(id_b);
    fail_msg("%s", why);
  }
  h_assert_status(&b, 202);
  assert_string_equal(h_id(&b), id_b);
  assert_int_equal(last, 201);
  h_post(s, "/payments", tok, "alive-b", PAYMENT, &r);
  assert_replay(&r, 201, id_b, "succeeded");
  h_resp_free(&r);
  h_assert_db(s, 2, COUNT_PAYMENTS);
  free(id_b);
  h_resp_free(&a);
  h_resp_free(&b);
  h_server_stop(s);
  p_stop(p);
}

/* ---- 5. the provider refuses connections --------------------------------- */

/* Nothing listens at the provider's address: 503 with Retry-After, nothing
 * stored but a failed record, and the same key executes again (503 again,
 * not a replay). Once the provider is back, the same key succeeds as a
 * first answer (201, not a replay) and then replays; one charge. */
static void test_provider_refuses(void **state) {
  p_psp_t *p = p_start(NULL);
  const char *flags[8];
  h_server_t *s;
  const char *tok;
  h_resp_t r, first;
  (void)state;

  idemd_flags(p, NULL, flags, 8);
  s = h_server_start(flags);
  tok = h_tenant(s, "acme");
  p_stop(p); /* its port now refuses connections */

  for (int i = 0; i < 2; i++) {
    h_context("attempt %d while the provider is down", i + 1);
    h_post(s, "/payments", tok, "down-1", PAYMENT, &r);
    h_assert_error(&r, 503, NULL);
    assert_string_equal(r.replayed, "");
    if (r.retry_after[0] == '\0')
      fail_msg("503 without Retry-After");
    h_resp_free(&r);
    h_assert_db(s, 1, RECORD_IN_STATE, "down-1", "failed");
  }
  h_context_clear();
  h_assert_db(s, 2, "SELECT count(*) FROM payments WHERE status = 'failed'");

  p_restart(p, NULL);
  h_post(s, "/payments", tok, "down-1", PAYMENT, &first);
  h_assert_first(&first, 201);
  assert_string_equal(str_field(&first, "status"), "succeeded");
  h_post(s, "/payments", tok, "down-1", PAYMENT, &r);
  h_assert_replay_of(&r, &first);
  h_resp_free(&r);
  h_assert_db(s, 1, RECORD_IN_STATE, "down-1", "completed");
  h_assert_db(s, 1, "SELECT count(*) FROM payments WHERE status = 'succeeded'");
  assert_provider(p, 1, 0, h_id(&first), 1, 0);
  {
    json_t *stats = p_stats(p);
    /* The refused attempts never reached it. */
    assert_int_equal(p_total(stats, "requests"), 1);
    assert_int_equal(p_nkeys(stats), 1);
    json_decref(stats);
  }
  h_resp_free(&first);
  h_server_stop(s);
  p_stop(p);
}

/* A provider that dies after charging a request that came on a kept-alive
 * connection: it answers the first POST /charges, reads the second on the
 * same connection (the charge is made), then closes its listening socket
 * and that connection without answering. libcurl sends a request that a
 * reused connection dropped unanswered again on a new connection, which is
 * refused: the transfer fails with "couldn't connect" although the request
 * reached the provider. */
struct dying_psp {
  int lfd;
  int port;
  pthread_t thread;
  int requests;          /* POST /charges read */
  char charged[128];     /* the Idempotency-Key of the charge it died on */
};

/* Reads one request (headers and Content-Length body) from fd within 10 s;
 * its Idempotency-Key into key. 0 on success. */
static int dying_read(int fd, char key[128]) {
  char buf[8192];
  size_t len = 0;
  for (double deadline = h_now() + 10; h_now() < deadline;) {
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    if (poll(&pfd, 1, 100) <= 0)
      continue;
    ssize_t n = recv(fd, buf + len, sizeof buf - 1 - len, 0);
    if (n <= 0)
      return -1;
    len += (size_t)n;
    buf[len] = '\0';
    char *end = strstr(buf, "\r\n\r\n");
    if (end == NULL)
      continue;
    const char *cl = strcasestr(buf, "\r\nContent-Length:");
    const char *k = strcasestr(buf, "\r\nIdempotency-Key:");
    size_t body = cl ? strtoul(cl + 17, NULL, 10) : 0;
    if ((size_t)(buf + len - (end + 4)) < body)
      continue;
    key[0] = '\0';
    if (k != NULL)
      sscanf(k + 18, " %127[^\r\n]", key);
    return 0;
  }
  return -1;
}

static void *dying_main(void *arg) {
  struct dying_psp *d = arg;
  static const char answer[] = "HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n"
                               "Content-Length: 38\r\n\r\n"
                               "{\"id\":\"ch_first\",\"status\":\"succeeded\"}";
  char key[128];
  struct pollfd pfd = {.fd = d->lfd, .events = POLLIN};
  int fd;

  if (poll(&pfd, 1, 10000) != 1 || (fd = accept4(d->lfd, NULL, NULL, SOCK_CLOEXEC)) < 0)
    return NULL;
  for (;;) {
    if (dying_read(fd, key) != 0)
      break;
    if (++d->requests == 1) {
      if (send(fd, answer, sizeof answer - 1, MSG_NOSIGNAL) != (ssize_t)sizeof answer - 1)
        break;
      continue;
    }
    snprintf(d->charged, sizeof d->charged, "%s", key);
    break;
  }
  /* The listening socket first, so libcurl's second try is refused. */
  close(d->lfd);
  d->lfd = -1;
  close(fd);
  return NULL;
}

/* Starts a dying provider on a free loopback port: its URL in `url`.
 * CLOEXEC: idemd, started after it, must not hold it open. */
static void dying_start(struct dying_psp *d, char *url, size_t urllen) {
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t alen = sizeof a;

  *d = (struct dying_psp){.lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)};
  assert_true(d->lfd >= 0);
  assert_int_equal(bind(d->lfd, (struct sockaddr *)&a, sizeof a), 0);
  assert_int_equal(listen(d->lfd, 8), 0);
  assert_int_equal(getsockname(d->lfd, (struct sockaddr *)&a, &alen), 0);
  d->port = ntohs(a.sin_port);
  snprintf(url, urllen, "http://127.0.0.1:%d", d->port);
  assert_int_equal(pthread_create(&d->thread, NULL, dying_main, d), 0);
}

/* The provider charged the second payment and died before answering. The
 * request had gone out, so its outcome is unknown: 202, the payment and
 * record pending for the reconciler, never failed (a failed payment is
 * retried under a new payment id, which the provider would charge again). */
static void test_crash_after_charge_on_kept_alive_connection(void **state) {
  /* Static: its thread may outlive a failed assertion here. */
  static struct dying_psp d;
  char url[64];
  const char *flags[] = {"--provider", url, "--workers", "1", "--reconcile-interval", "1h",
                         NULL};
  h_server_t *s;
  const char *tok;
  h_resp_t first, second, again;
  char *id;
  (void)state;

  dying_start(&d, url, sizeof url);

  s = h_server_start(flags);
  tok = h_tenant(s, "acme");
  h_post(s, "/payments", tok, "kept-1", PAYMENT, &first);
  h_assert_first(&first, 201);
  h_post(s, "/payments", tok, "kept-2", PAYMENT, &second);
  pthread_join(d.thread, NULL);
  id = pay_id_of(s, "kept-2");
  /* The provider had the request: it charged it. */
  assert_int_equal(d.requests, 2);
  assert_string_equal(d.charged, id);
  h_assert_status(&second, 202);
  assert_string_equal(str_field(&second, "status"), "pending");
  h_assert_db(s, 1, RECORD_IN_STATE, "kept-2", "pending");
  h_assert_db(s, 1, "SELECT count(*) FROM payments WHERE id = ?1 AND status = 'pending'", id);
  h_assert_db(s, 0, "SELECT count(*) FROM payments WHERE status = 'failed'");
  /* A retry makes no new payment: the same one, still pending. */
  h_post(s, "/payments", tok, "kept-2", PAYMENT, &again);
  h_assert_status(&again, 202);
  assert_string_equal(h_id(&again), id);
  h_assert_db(s, 2, COUNT_PAYMENTS);
  free(id);
  h_resp_free(&first);
  h_resp_free(&second);
  h_resp_free(&again);
  h_server_stop(s);
}

/* ---- 6. a decline ---------------------------------------------------------- */

/* The provider declines 4040: 402 with the declined payment, stored and
 * replayed as 402; no successful charge, one decline. Another amount on
 * another key still goes through. */
static void test_decline(void **state) {
  static const char *const psp_flags[] = {"--decline-amount", "4040", NULL};
  static const char *const body = "{\"amount\": 4040, \"currency\": \"BRL\"}";
  p_psp_t *p = p_start(psp_flags);
  const char *flags[8];
  h_server_t *s;
  const char *tok;
  h_resp_t first, r;
  (void)state;

  idemd_flags(p, NULL, flags, 8);
  s = h_server_start(flags);
  tok = h_tenant(s, "acme");
  h_post(s, "/payments", tok, "decline-1", body, &first);
  h_assert_first(&first, 402);
  assert_string_equal(str_field(&first, "status"), "declined");
  assert_true(strlen(str_field(&first, "error")) > 0);
  for (int i = 0; i < 2; i++) {
    h_post(s, "/payments", tok, "decline-1", body, &r);
    h_assert_replay_of(&r, &first);
    h_resp_free(&r);
  }
  assert_provider(p, 0, 1, h_id(&first), 0, 1);
  h_assert_db(s, 1, "SELECT count(*) FROM payments WHERE status = 'declined'");
  h_assert_db(s, 1, RECORD_IN_STATE, "decline-1", "completed");

  h_post(s, "/payments", tok, "decline-2", PAYMENT, &r);
  h_assert_first(&r, 201);
  assert_provider(p, 1, 1, h_id(&first), 0, 1);
  {
    json_t *stats = p_stats(p);
    assert_int_equal(p_key(stats, h_id(&first), "requests"), 1);
    assert_int_equal(p_key(stats, h_id(&r), "charges"), 1);
    json_decref(stats);
  }
  h_resp_free(&r);
  h_resp_free(&first);
  h_server_stop(s);
  p_stop(p);
}

/* ---- 7. refunds through the HTTP provider ---------------------------------- */

/* The HTTP provider itself (src/provider/http.c), called as idemd's worker
 * and reconciler call it, against idem-psp: each outcome of a refund, and
 * the refund made once per provider key whatever goes wrong. */

#define CONNECT_TIMEOUT_MS 2000

static idem_provider_t *http_provider(const char *url, int64_t timeout_ms) {
  idem_provider_t *pr = idem_http_provider_new(url, CONNECT_TIMEOUT_MS, timeout_ms);
  assert_non_null(pr);
  return pr;
}

static const char *outcome_name(idem_charge_outcome_t o) {
  switch (o) {
  case IDEM_CHARGE_SUCCEEDED:
    return "SUCCEEDED";
  case IDEM_CHARGE_DECLINED:
    return "DECLINED";
  case IDEM_CHARGE_UNKNOWN:
    return "UNKNOWN";
  case IDEM_CHARGE_NOT_SENT:
    return "NOT_SENT";
  case IDEM_CHARGE_NOT_FOUND:
    return "NOT_FOUND";
  }
  return "?";
}

/* `res` is `want`, with a reference starting with `prefix` (NULL: none). */
static void assert_outcome(const char *what, const idem_charge_result_t *res,
                           idem_charge_outcome_t want, const char *prefix) {
  if (res->outcome != want)
    fail_msg("%s: %s, want %s", what, outcome_name(res->outcome), outcome_name(want));
  if (prefix ? strncmp(res->reference, prefix, strlen(prefix)) != 0 ||
                   strlen(res->reference) <= strlen(prefix)
             : res->reference[0] != '\0')
    fail_msg("%s: reference '%s', want %s", what, res->reference,
             prefix ? prefix : "none");
}

/* stats["refund_keys"][key][field]; 0 when the key is absent. */
static int64_t refund_key_stat(const json_t *stats, const char *key, const char *field) {
  json_t *k = json_object_get(json_object_get(stats, "refund_keys"), key);
  return json_integer_value(json_object_get(k, field));
}

/* The provider made `refunds` refunds and `declines` declined ones. */
static void assert_refunds(p_psp_t *p, int64_t refunds, int64_t declines) {
  json_t *stats = p_stats(p);
  if (p_total(stats, "refunds") != refunds || p_total(stats, "refund_declines") != declines)
    fail_msg("provider made %lld refunds and %lld declines, want %lld and %lld",
             (long long)p_total(stats, "refunds"),
             (long long)p_total(stats, "refund_declines"), (long long)refunds,
             (long long)declines);
  json_decref(stats);
}

static void charge_for_refunds(idem_provider_t *pr, const char *key, int64_t amount) {
  idem_charge_t ch = {.provider_key = key, .amount = amount, .currency = "BRL"};
  idem_charge_result_t res;
  pr->charge(pr, &ch, &res);
  assert_outcome("the charge to refund", &res, IDEM_CHARGE_SUCCEEDED, "ch_");
}

/* A refund's worker dies (kill -9) while the provider is refunding. Started
 * again, the reconciler takes the refund's record over once the dead
 * worker's lease ran out, finds the refund at the provider by its key and
 * settles it: the retry gets the refund (201, replayed), the provider made
 * one refund and got no second request for it, and the payment shows it. */
static void test_kill9_refund_while_at_provider(void **state) {
  static const char *const psp_flags[] = {"--latency", "2s", NULL};
  static const char *const extra[] = {"--provider-timeout",   "3s",    "--lease", "4s",
                                      "--reconcile-interval", "200ms", NULL};
  p_psp_t *p = p_start(psp_flags);
  const char *flags[12];
  struct bg first = {.key = "refund-crash-1", .body = "{\"amount\": 5000}"};
  char path[128], location[160];
  h_server_t *s;
  h_resp_t r;
  char *pid, *rid;
  json_t *stats;
  (void)state;

  idemd_flags(p, extra, flags, 12);
  s = h_server_start(flags);
  first.s = s;
  first.tok = h_tenant(s, "acme");
  h_post(s, "/payments", first.tok, "refund-crash-pay", PAYMENT, &r);
  h_assert_first(&r, 201);
  pid = strdup(h_id(&r));
  h_resp_free(&r);
  snprintf(path, sizeof path, "/payments/%s/refunds", pid);
  first.path = path;
  bg_start(&first);
  wait_record(s, "refund-crash-1", "processing", 10000);
  rid = h_db_text(s, PAY_ID_OF_KEY, "refund-crash-1");
  if (rid == NULL || strncmp(rid, "re_", 3) != 0)
    fail_msg("the refund's record names '%s'", rid ? rid : "(null)");
  for (int i = 0; i < 500; i++) { /* the request reached the provider */
    stats = p_stats(p);
    int64_t n = refund_key_stat(stats, rid, "requests");
    json_decref(stats);
    if (n >= 1)
      break;
    if (i == 499)
      fail_msg("the provider did not receive the refund %s", rid);
    p_nap_ms(20);
  }
  p_kill_idemd(s);
  pthread_join(first.thread, NULL);
  assert_int_equal(first.resp.status, 0); /* lost with the process */
  h_resp_free(&first.resp);
  h_assert_db(s, 1, RECORD_IN_STATE, "refund-crash-1", "processing");

  h_server_restart(s, flags);
  wait_record(s, "refund-crash-1", "completed", 20000);
  h_post(s, path, first.tok, "refund-crash-1", first.body, &r);
  h_assert_status(&r, 201);
  assert_string_equal(r.replayed, "true");
  assert_string_equal(h_id(&r), rid);
  assert_string_equal(str_field(&r, "status"), "succeeded");
  snprintf(location, sizeof location, "/refunds/%s", rid);
  assert_string_equal(r.location, location);
  h_resp_free(&r);
  h_assert_db(s, 1, "SELECT count(*) FROM refunds WHERE id = ?1 AND status = 'succeeded'",
              rid);
  h_assert_db(s, 0, "SELECT count(*) FROM outbox");
  snprintf(location, sizeof location, "/payments/%s", pid);
  h_get(s, location, first.tok, &r);
  h_assert_status(&r, 200);
  assert_int_equal(json_integer_value(json_object_get(r.json, "amount_refunded")), 5000);
  h_resp_free(&r);
  assert_refunds(p, 1, 0);
  stats = p_stats(p);
  assert_int_equal(refund_key_stat(stats, rid, "requests"), 1);
  json_decref(stats);
  free(rid);
  free(pid);
  h_server_stop(s);
  p_stop(p);
}

static void test_http_refund(void **state) {
  p_psp_t *p = p_start(NULL);
  idem_provider_t *pr = http_provider(p->url, 5000);
  idem_refund_req_t r1 = {.provider_key = "re/1?x%#", .charge_key = "pay_r1",
                          .amount = 4000, .currency = "BRL"};
  idem_refund_req_t unknown = {.provider_key = "re_2", .charge_key = "pay_none",
                               .amount = 1, .currency = "BRL"};
  idem_refund_req_t over = {.provider_key = "re_3", .charge_key = "pay_r1",
                            .amount = 6001, .currency = "BRL"};
  idem_refund_req_t never = {.provider_key = "re_never", .charge_key = "pay_r1",
                             .amount = 1, .currency = "BRL"};
  idem_charge_result_t first, res;
  json_t *stats;
  (void)state;

  charge_for_refunds(pr, "pay_r1", 10000);
  pr->refund(pr, &r1, &first);
  assert_outcome("refund", &first, IDEM_CHARGE_SUCCEEDED, "re_");
  /* The same provider key again is the same refund. */
  pr->refund(pr, &r1, &res);
  assert_outcome("refund again", &res, IDEM_CHARGE_SUCCEEDED, "re_");
  assert_string_equal(res.reference, first.reference);
  /* Looked up by its key (escaped in the path). */
  pr->refund_lookup(pr, &r1, &res);
  assert_outcome("refund_lookup", &res, IDEM_CHARGE_SUCCEEDED, "re_");
  assert_string_equal(res.reference, first.reference);
  pr->refund_lookup(pr, &never, &res);
  assert_outcome("refund_lookup of an unknown key", &res, IDEM_CHARGE_NOT_FOUND, NULL);

  /* An unknown charge, and more than is left of one: declined, for good. */
  pr->refund(pr, &unknown, &res);
  assert_outcome("refund of an unknown charge", &res, IDEM_CHARGE_DECLINED, "re_");
  pr->refund(pr, &over, &res);
  assert_outcome("refund past the charge", &res, IDEM_CHARGE_DECLINED, "re_");
  pr->refund_lookup(pr, &over, &res);
  assert_outcome("refund_lookup of a declined refund", &res, IDEM_CHARGE_DECLINED, "re_");

  assert_refunds(p, 1, 2);
  stats = p_stats(p);
  assert_int_equal(refund_key_stat(stats, "re/1?x%#", "requests"), 2);
  assert_int_equal(refund_key_stat(stats, "re/1?x%#", "refunds"), 1);
  /* A refund is not a charge. */
  assert_int_equal(p_total(stats, "charges"), 1);
  json_decref(stats);
  pr->close(pr);
  p_stop(p);
}

/* Each thing that goes wrong between us and the provider, on a refund:
 * a refused connection is NOT_SENT and nothing is refunded; a 5xx, a
 * dropped connection and a timeout are UNKNOWN, and refund_lookup then
 * tells what the provider did. */
static void test_http_refund_faults(void **state) {
  static const char *const fail_before[] = {"--fail-before", NULL};
  static const char *const fail_after[] = {"--fail-after", NULL};
  static const char *const drop_after[] = {"--drop-after", NULL};
  static const char *const delay[] = {"--delay-after-charge", "3s", NULL};
  static const struct {
    const char *const *flags;
    const char *key;
    int64_t timeout_ms;
    idem_charge_outcome_t looked_up;
  } phases[] = {
      {fail_before, "re_fb", 5000, IDEM_CHARGE_NOT_FOUND},
      {fail_after, "re_fa", 5000, IDEM_CHARGE_SUCCEEDED},
      {drop_after, "re_da", 5000, IDEM_CHARGE_SUCCEEDED},
      {delay, "re_late", 500, IDEM_CHARGE_SUCCEEDED},
  };
  p_psp_t *p = p_start(NULL);
  idem_provider_t *pr = http_provider(p->url, 5000);
  idem_refund_req_t r = {.charge_key = "pay_f", .amount = 10, .currency = "BRL"};
  idem_charge_result_t res, again;
  json_t *stats;
  (void)state;

  charge_for_refunds(pr, "pay_f", 1000);
  pr->close(pr);

  /* Nothing listens: NOT_SENT. */
  p_stop(p);
  pr = http_provider(p->url, 5000);
  r.provider_key = "re_refused";
  pr->refund(pr, &r, &res);
  assert_outcome("refund while the provider is down", &res, IDEM_CHARGE_NOT_SENT, NULL);
  pr->refund_lookup(pr, &r, &res);
  assert_outcome("refund_lookup while the provider is down", &res, IDEM_CHARGE_UNKNOWN,
                 NULL);
  pr->close(pr);

  /* A 500 before (nothing made), a 500 after, a dropped connection, an
   * answer after our deadline: UNKNOWN to us, and the lookup tells. */
  for (size_t i = 0; i < sizeof phases / sizeof *phases; i++) {
    char what[64];
    p_restart(p, phases[i].flags);
    pr = http_provider(p->url, phases[i].timeout_ms);
    r.provider_key = phases[i].key;
    snprintf(what, sizeof what, "refund %s", phases[i].key);
    pr->refund(pr, &r, &res);
    assert_outcome(what, &res, IDEM_CHARGE_UNKNOWN, NULL);
    snprintf(what, sizeof what, "refund_lookup %s", phases[i].key);
    pr->refund_lookup(pr, &r, &res);
    assert_outcome(what, &res, phases[i].looked_up,
                   phases[i].looked_up == IDEM_CHARGE_SUCCEEDED ? "re_" : NULL);
    pr->close(pr);
    p_stop(p);
  }

  /* Sent again under their keys, they are the refunds made: one each. */
  p_restart(p, NULL);
  pr = http_provider(p->url, 5000);
  for (int i = 0; i < 3; i++) {
    static const char *const keys[] = {"re_fa", "re_da", "re_late"};
    r.provider_key = keys[i];
    pr->refund_lookup(pr, &r, &res);
    pr->refund(pr, &r, &again);
    assert_outcome(keys[i], &again, IDEM_CHARGE_SUCCEEDED, "re_");
    assert_string_equal(again.reference, res.reference);
  }
  /* The refused and fail-before ones reached nothing: a first refund. */
  r.provider_key = "re_fb";
  pr->refund(pr, &r, &res);
  assert_outcome("refund after fail-before", &res, IDEM_CHARGE_SUCCEEDED, "re_");
  assert_refunds(p, 4, 0);
  stats = p_stats(p);
  assert_int_equal(refund_key_stat(stats, "re_refused", "requests"), 0);
  assert_int_equal(refund_key_stat(stats, "re_fb", "requests"), 2);
  assert_int_equal(p_total(stats, "charges"), 1);
  json_decref(stats);
  pr->close(pr);
  p_stop(p);
}

/* The provider answers a charge on a kept-alive connection, then dies
 * after reading the refund sent on it: libcurl's second try on a new
 * connection is refused, but the refund had gone out: UNKNOWN, as for a
 * charge (test_crash_after_charge_on_kept_alive_connection). */
static void test_http_refund_crash_on_kept_alive_connection(void **state) {
  static struct dying_psp d; /* static: its thread may outlive a failure */
  idem_refund_req_t r = {.provider_key = "re_kept", .charge_key = "pay_kept",
                         .amount = 10, .currency = "BRL"};
  idem_charge_result_t res;
  idem_provider_t *pr;
  char url[64];
  (void)state;

  dying_start(&d, url, sizeof url);

  pr = http_provider(url, 5000);
  charge_for_refunds(pr, "pay_kept", 100);
  pr->refund(pr, &r, &res);
  pthread_join(d.thread, NULL);
  assert_int_equal(d.requests, 2);
  assert_string_equal(d.charged, "re_kept");
  assert_outcome("refund the provider died on", &res, IDEM_CHARGE_UNKNOWN, NULL);
  pr->close(pr);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_response_lost, p_teardown),
      cmocka_unit_test_teardown(test_twenty_long_wait, p_teardown),
      cmocka_unit_test_teardown(test_twenty_short_wait, p_teardown),
      cmocka_unit_test_teardown(test_kill9_while_at_provider, p_teardown),
      cmocka_unit_test_teardown(test_kill9_resend_same_key, p_teardown),
      cmocka_unit_test_teardown(test_kill9_refund_while_at_provider, p_teardown),
      cmocka_unit_test_teardown(test_answer_after_deadline, p_teardown),
      cmocka_unit_test_teardown(test_deadline_on_kept_alive_connection, p_teardown),
      cmocka_unit_test_teardown(test_crash_after_charge_on_kept_alive_connection, p_teardown),
      cmocka_unit_test_teardown(test_provider_refuses, p_teardown),
      cmocka_unit_test_teardown(test_decline, p_teardown),
      cmocka_unit_test_teardown(test_http_refund, p_teardown),
      cmocka_unit_test_teardown(test_http_refund_faults, p_teardown),
      cmocka_unit_test_teardown(test_http_refund_crash_on_kept_alive_connection,
                                p_teardown),
  };
  int rc;
  h_init(argc, argv);
  p_init(argc, argv);
  rc = cmocka_run_group_tests_name("integration: payment provider", tests, NULL, NULL);
  curl_global_cleanup();
  return rc;
}
