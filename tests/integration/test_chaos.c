/* Chaos: clients that retry as they should, a provider that fails at random
 * (idem-psp --chaos), and an idemd that is killed with SIGKILL and started
 * again on its database while they work. Whatever happened, in the end:
 * no provider key charged twice, every payment a client saw succeed charged
 * exactly once, every charge made is a succeeded payment; each succeeded
 * payment then half refunded, every refund a client saw made made once at
 * the provider, none beyond its payment; and nothing left
 * processing or pending (docs/idempotency.md, section 4.1: "One payment is
 * one charge at the provider at most, whatever crashes or times out between
 * the steps").
 *
 * The provider also sends its signed events to idemd's POST
 * /webhooks/provider, some twice, some delayed and reordered (idem-psp
 * --webhook-url, --webhook-duplicates, --chaos), racing the reconciler to
 * settle what is pending; idem-psp is restarted with idemd's new address
 * after each kill (its queue of events is lost then: the reconciler stays
 * the safety net).
 *
 * With IDEM_TEST_PROVIDER_IDEMPOTENCY=off (ctest integration_chaos_keyless)
 * the provider ignores keys (idem-psp --ignore-idempotency-key) and idemd
 * runs with --provider-idempotency off: the same rules hold, counted per
 * merchant reference instead of per key (docs/payments.md, "Providers that
 * ignore idempotency keys"). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "psp_harness.h"

#define NCLIENTS 4
#define NINTENTS 24 /* per client */
#define NKILLS 3
#define DECLINE_AMOUNT 4040
#define CLIENT_DEADLINE_S 50.0
#define SETTLE_TIMEOUT_MS 20000
#define DEFAULT_SEED "20260611"
#define WEBHOOK_SECRET "whsec_chaos_93d1"
#define PROBLEM_MAX 512 /* struct intent's problem */
/* 1 when no record is processing or pending; the same text on both stores. */
#define NOTHING_OPEN                                                                     \
  "SELECT CASE WHEN count(*) = 0 THEN 1 ELSE 0 END FROM idempotency_records "            \
  "WHERE state IN ('processing', 'pending')"

/* One request a client wants to succeed: one key, kept across its
 * retries. */
struct call {
  char key[64];
  char path[96];
  char body[96];
  const char *prefix; /* of the ids its answers carry: "pay_", "re_" */
  long final;         /* 201 or 402 once answered; 0 until then */
  char id[64];        /* the id the answers carry (once one did) */
  int attempts;       /* requests sent, replays included */
  long last_status;   /* of the last request */
  char *problem;      /* its intent's */
};

/* One payment a client wants made and, once it succeeded, half of it
 * refunded. */
struct intent {
  int amount;
  struct call pay, refund;
  char problem[512]; /* a broken rule, seen by the client thread */
};

struct client {
  int index;
  const char *tok;
  struct intent intents[NINTENTS];
  pthread_t thread;
};

/* Shared with the client threads: where idemd listens now (it changes on
 * every restart), how many intents are done, and the clients' deadline. */
static atomic_int g_port;
static atomic_int g_done;
static double g_deadline;
/* Answers by class, for the summary. */
static atomic_int g_n201, g_n402, g_n202, g_n409, g_n503, g_ntransport, g_nother;

/* One POST of the call to wherever idemd is now. */
static void send_call(CURL *c, const struct client *cl, struct call *it, h_resp_t *r) {
  h_server_t view;
  h_req_t req = {.method = "POST",
                 .path = it->path,
                 .token = cl->tok,
                 .key = it->key,
                 .body = it->body};
  memset(&view, 0, sizeof view);
  view.port = atomic_load(&g_port);
  h_http_on(c, &view, &req, r);
  it->attempts++;
  it->last_status = r->status;
}

/* Checks an answer that carries the call's payment or refund; returns 0,
 * or -1 with the broken rule in it->problem. */
static int check_answer(struct call *it, const h_resp_t *r) {
  const char *want = r->status == 201   ? "succeeded"
                     : r->status == 402 ? "declined"
                                        : "pending";
  const char *id = json_string_value(json_object_get(r->json, "id"));
  const char *status = json_string_value(json_object_get(r->json, "status"));

  if (id == NULL || strncmp(id, it->prefix, strlen(it->prefix)) != 0 || status == NULL) {
    snprintf(it->problem, PROBLEM_MAX, "%s: %ld without its resource: %.300s", it->key,
             r->status, r->body);
    return -1;
  }
  if (strcmp(status, want) != 0) {
    snprintf(it->problem, PROBLEM_MAX, "%s: %ld with status '%s'", it->key, r->status,
             status);
    return -1;
  }
  /* Once a payment or refund was answered for this key (pending or
   * final), every later answer is that one: a pending one never runs
   * again. */
  if (it->id[0] && strcmp(it->id, id) != 0) {
    snprintf(it->problem, PROBLEM_MAX, "%s: two resources for one key: %s, then %s",
             it->key, it->id, id);
    return -1;
  }
  snprintf(it->id, sizeof it->id, "%s", id);
  return 0;
}

/* Retries the call until a final answer (201/402) or the deadline. */
static void run_call(CURL *c, const struct client *cl, struct call *it) {
  while (h_now() < g_deadline) {
    h_resp_t r;
    send_call(c, cl, it, &r);
    switch (r.status) {
    case 201:
    case 402:
      atomic_fetch_add(r.status == 201 ? &g_n201 : &g_n402, 1);
      if (check_answer(it, &r) == 0)
        it->final = r.status;
      h_resp_free(&r);
      return;
    case 202:
      atomic_fetch_add(&g_n202, 1);
      if (check_answer(it, &r) != 0) {
        h_resp_free(&r);
        return;
      }
      break;
    case 409: /* still processing elsewhere: retry */
      atomic_fetch_add(&g_n409, 1);
      break;
    case 503: /* nothing was sent: retry, it runs again */
      atomic_fetch_add(&g_n503, 1);
      break;
    case 0: /* idemd is down (killed), or restarting on another port */
      atomic_fetch_add(&g_ntransport, 1);
      break;
    default:
      atomic_fetch_add(&g_nother, 1);
      snprintf(it->problem, PROBLEM_MAX, "%s: unexpected %ld: %.300s", it->key, r.status,
               r.body);
      h_resp_free(&r);
      return;
    }
    h_resp_free(&r);
    p_nap_ms(50);
  }
}

/* After the final answer: a retry replays it (same status, same payment
 * or refund). */
static void check_replay(CURL *c, const struct client *cl, struct call *it) {
  while (h_now() < g_deadline) {
    h_resp_t r;
    send_call(c, cl, it, &r);
    if (r.status == 0) { /* idemd restarting: try again */
      h_resp_free(&r);
      p_nap_ms(50);
      continue;
    }
    if (r.status != it->final || strcmp(r.replayed, "true") != 0 ||
        check_answer(it, &r) != 0) {
      if (it->problem[0] == '\0')
        snprintf(
            it->problem, PROBLEM_MAX,
            "%s: final %ld, then a retry answered %ld (Idempotent-Replayed '%s'): %.300s",
            it->key, it->final, r.status, r.replayed, r.body);
    }
    h_resp_free(&r);
    return;
  }
  snprintf(it->problem, PROBLEM_MAX, "%s: no answer to the replay by the deadline",
           it->key);
}

/* idem-psp again on its port, with `flags` (NULL-terminated) and its
 * events sent to idemd `s`, as it now listens. */
static void psp_hooked_to(p_psp_t *p, const char *const *flags, const h_server_t *s) {
  static char url[96];
  const char *all[P_MAX_FLAGS + 1];
  int n = 0;

  snprintf(url, sizeof url, "http://127.0.0.1:%d/webhooks/provider", s->port);
  for (int i = 0; flags[i]; i++)
    all[n++] = flags[i];
  all[n++] = "--webhook-url";
  all[n++] = url;
  all[n++] = "--webhook-secret";
  all[n++] = WEBHOOK_SECRET;
  all[n++] = "--webhook-duplicates";
  all[n++] = "0.5";
  all[n] = NULL;
  p_stop(p);
  p_restart(p, all);
}

/* A call to its final answer, then its replay. */
static void run_and_replay(CURL *c, const struct client *cl, struct call *it) {
  run_call(c, cl, it);
  if (it->final && it->problem[0] == '\0')
    check_replay(c, cl, it);
}

static void *client_main(void *arg) {
  struct client *cl = arg;
  CURL *c = curl_easy_init();
  if (c == NULL)
    return NULL; /* the intents stay unanswered: the main thread reports it */
  for (int i = 0; i < NINTENTS; i++) {
    struct intent *it = &cl->intents[i];
    run_and_replay(c, cl, &it->pay);
    if (it->pay.final == 201 && it->problem[0] == '\0') {
      char id[sizeof it->pay.id];
      memcpy(id, it->pay.id, sizeof id); /* one struct: gcc sees an overlap otherwise */
      snprintf(it->refund.path, sizeof it->refund.path, "/payments/%s/refunds", id);
      run_and_replay(c, cl, &it->refund);
    }
    atomic_fetch_add(&g_done, 1);
  }
  curl_easy_cleanup(c);
  return NULL;
}

static void test_chaos(void **state) {
  const char *seed = getenv("IDEM_TEST_CHAOS_SEED");
  const char *mode = getenv("IDEM_TEST_PROVIDER_IDEMPOTENCY");
  int keyless = mode && strcmp(mode, "off") == 0;
  /* What the provider made, per key; without keys, per reference (the
   * payment's or refund's id: its key when keys are on). */
  const char *made_by = keyless ? "references" : "keys";
  const char *refunds_by = keyless ? "refund_references" : "refund_keys";
  const char *psp_flags[] = {"--chaos", "0.5", "--seed", NULL, "--decline-amount", "4040",
                             keyless ? "--ignore-idempotency-key" : NULL, NULL};
  const char *flags[20];
  static struct client clients[NCLIENTS];
  p_psp_t *p;
  h_server_t *s;
  const char *tok;
  json_t *stats, *v;
  const char *key;
  int kills = 0, n201 = 0, n402 = 0, bad = 0;
  int64_t charges, declines, refunds;
  double start;
  (void)state;

  psp_flags[3] = seed && seed[0] ? seed : DEFAULT_SEED;
  p = p_start(psp_flags);
  {
    const char *f[] = {
        "--provider",           p->url,  "--provider-timeout", "800ms", "--lease", "2s",
        "--reconcile-interval", "200ms", "--inflight-wait",    "1s",
        "--provider-idempotency", keyless ? "off" : "on",
        "--provider-webhook-secret", WEBHOOK_SECRET, NULL};
    memcpy(flags, f, sizeof f);
  }
  s = h_server_start(flags);
  tok = h_tenant(s, "acme");
  psp_hooked_to(p, psp_flags, s);
  atomic_store(&g_port, s->port);
  atomic_store(&g_done, 0);

  memset(clients, 0, sizeof clients);
  for (int t = 0; t < NCLIENTS; t++) {
    clients[t].index = t;
    clients[t].tok = tok;
    for (int i = 0; i < NINTENTS; i++) {
      struct intent *it = &clients[t].intents[i];
      it->amount = i % 4 == 3 ? DECLINE_AMOUNT : 1000 + t * 100 + i;
      it->pay.problem = it->refund.problem = it->problem;
      it->pay.prefix = "pay_";
      it->refund.prefix = "re_";
      snprintf(it->pay.key, sizeof it->pay.key, "chaos-%d-%d", t, i);
      snprintf(it->pay.path, sizeof it->pay.path, "/payments");
      snprintf(it->pay.body, sizeof it->pay.body,
               "{\"amount\": %d, \"currency\": \"BRL\"}", it->amount);
      snprintf(it->refund.key, sizeof it->refund.key, "chaos-refund-%d-%d", t, i);
      snprintf(it->refund.body, sizeof it->refund.body, "{\"amount\": %d}",
               it->amount / 2);
    }
  }
  fprintf(stderr, "chaos: seed %s, %d clients x %d intents, %d kills of idemd, keys %s\n",
          psp_flags[3], NCLIENTS, NINTENTS, NKILLS, keyless ? "ignored" : "honoured");

  start = h_now();
  g_deadline = start + CLIENT_DEADLINE_S;
  for (int t = 0; t < NCLIENTS; t++)
    assert_int_equal(pthread_create(&clients[t].thread, NULL, client_main, &clients[t]),
                     0);

  /* Kill idemd at a quarter, a half and three quarters of the work (or
   * every 4 s if the work stalls), while the clients are mid-request. */
  while (atomic_load(&g_done) < NCLIENTS * NINTENTS && h_now() < g_deadline) {
    int done = atomic_load(&g_done);
    double since = h_now() - start;
    if (kills < NKILLS && (done >= (kills + 1) * NCLIENTS * NINTENTS / (NKILLS + 1) ||
                           since > 4.0 * (kills + 1))) {
      p_kill_idemd(s);
      kills++;
      p_nap_ms(200); /* down for a moment: clients see refused connections */
      h_server_restart(s, flags);
      atomic_store(&g_port, s->port);
      psp_hooked_to(p, psp_flags, s);
      fprintf(stderr,
              "chaos: killed and restarted idemd (%d) at %.1f s, %d intents done\n",
              kills, h_now() - start, done);
    }
    p_nap_ms(20);
  }
  for (int t = 0; t < NCLIENTS; t++)
    pthread_join(clients[t].thread, NULL);
  fprintf(stderr,
          "chaos: clients done in %.1f s; answers: %d x 201, %d x 402, %d x 202, "
          "%d x 409, %d x 503, %d transport errors, %d other\n",
          h_now() - start, atomic_load(&g_n201), atomic_load(&g_n402),
          atomic_load(&g_n202), atomic_load(&g_n409), atomic_load(&g_n503),
          atomic_load(&g_ntransport), atomic_load(&g_nother));
  if (kills < NKILLS)
    fail_msg("only %d of %d kills happened before the clients finished", kills, NKILLS);

  /* What each client saw. */
  for (int t = 0; t < NCLIENTS; t++)
    for (int i = 0; i < NINTENTS; i++) {
      struct intent *it = &clients[t].intents[i];
      long want = it->amount == DECLINE_AMOUNT ? 402 : 201;
      if (it->problem[0]) {
        fprintf(stderr, "chaos: %s\n", it->problem);
        bad++;
      } else if (it->pay.final != want) {
        fprintf(stderr,
                "chaos: key %s: final answer %ld, want %ld (%d attempts, last %ld)\n",
                it->pay.key, it->pay.final, want, it->pay.attempts, it->pay.last_status);
        bad++;
      } else if (want == 201 && it->refund.final != 201) {
        fprintf(stderr,
                "chaos: key %s: refund's final answer %ld (%d attempts, last %ld)\n",
                it->refund.key, it->refund.final, it->refund.attempts,
                it->refund.last_status);
        bad++;
      }
      n201 += it->pay.final == 201;
      n402 += it->pay.final == 402;
    }
  if (bad)
    fail_msg("%d of %d keys broke a rule or got no final answer (see above)", bad,
             NCLIENTS * NINTENTS);

  /* A last reconciler pass (bounded): nothing left processing or pending. */
  if (!h_db_wait(s, SETTLE_TIMEOUT_MS, NOTHING_OPEN))
    fail_msg("records still processing or pending %d s after the clients finished: "
             "%lld processing, %lld pending",
             SETTLE_TIMEOUT_MS / 1000,
             (long long)h_db_int(s, "SELECT count(*) FROM idempotency_records WHERE "
                                    "state = 'processing'"),
             (long long)h_db_int(s, "SELECT count(*) FROM idempotency_records WHERE "
                                    "state = 'pending'"));
  h_assert_db(s, 0,
              "SELECT count(*) FROM idempotency_records WHERE state = 'processing'");
  h_assert_db(s, 0, "SELECT count(*) FROM idempotency_records WHERE state = 'pending'");
  h_assert_db(s, 0, "SELECT count(*) FROM payments WHERE status = 'pending'");
  h_assert_db(s, 0, "SELECT count(*) FROM outbox");
  h_assert_db(s, NCLIENTS * NINTENTS + n201, "SELECT count(*) FROM idempotency_records");
  /* The provider's events took part: some settled what was pending. */
  fprintf(stderr, "chaos: %lld provider events applied\n",
          (long long)h_db_int(s, "SELECT count(*) FROM processed_events"));
  if (h_db_int(s, "SELECT count(*) FROM processed_events") == 0)
    fail_msg("no provider event was applied");

  /* What the provider did. */
  stats = p_stats(p);
  fprintf(stderr,
          "chaos: provider: %lld charges, %lld declines, %lld requests, %zu keys\n",
          (long long)p_total(stats, "charges"), (long long)p_total(stats, "declines"),
          (long long)p_total(stats, "requests"), p_nkeys(stats));
  bad = 0;
  json_object_foreach(json_object_get(stats, made_by), key, v) {
    int64_t kc = json_integer_value(json_object_get(v, "charges"));
    int64_t kd = json_integer_value(json_object_get(v, "declines"));
    if (kc > 1 || kc + kd > 1) {
      fprintf(stderr, "chaos: provider key %s charged %lld times, declined %lld\n", key,
              (long long)kc, (long long)kd);
      bad++;
    }
    if (kc + kd == 1) {
      /* The provider's answer is final: the payment must say the same. */
      const char *want = kc ? "succeeded" : "declined";
      char *status = h_db_text(s, "SELECT status FROM payments WHERE id = ?1", key);
      if (status == NULL || strcmp(status, want) != 0) {
        fprintf(stderr,
                "chaos: provider key %s was %s, but its payment is '%s': the client "
                "was never told, and its retry ran again as a new payment\n",
                key, kc ? "charged" : "declined", status ? status : "(none)");
        bad++;
      }
      free(status);
    }
  }
  for (int t = 0; t < NCLIENTS; t++)
    for (int i = 0; i < NINTENTS; i++) {
      struct intent *it = &clients[t].intents[i];
      const char *want = it->pay.final == 201 ? "succeeded" : "declined";
      char *status = h_db_text(s, "SELECT status FROM payments WHERE id = ?1", it->pay.id);
      json_t *k = json_object_get(json_object_get(stats, made_by), it->pay.id);
      int64_t charged = json_integer_value(json_object_get(k, "charges"));
      int64_t declined = json_integer_value(json_object_get(k, "declines"));
      if (status == NULL || strcmp(status, want) != 0 ||
          charged != (it->pay.final == 201) || declined != (it->pay.final == 402)) {
        fprintf(stderr,
                "chaos: key %s answered %ld with %s: payment '%s', provider %lld "
                "charges, %lld declines\n",
                it->pay.key, it->pay.final, it->pay.id, status ? status : "(none)",
                (long long)charged, (long long)declined);
        bad++;
      }
      free(status);
    }
  /* Refunds: each provider refund key is an idemd refund that says the
   * same; every refund a client saw made was made once at the provider. */
  json_object_foreach(json_object_get(stats, refunds_by), key, v) {
    int64_t kr = json_integer_value(json_object_get(v, "refunds"));
    int64_t kd = json_integer_value(json_object_get(v, "declines"));
    char *status = h_db_text(s, "SELECT status FROM refunds WHERE id = ?1", key);
    if (kr + kd == 1 && (status == NULL || strcmp(status, kr ? "succeeded" : "declined"))) {
      fprintf(stderr, "chaos: provider refund %s was %s, but idemd's refund is '%s'\n", key,
              kr ? "made" : "declined", status ? status : "(none)");
      bad++;
    }
    free(status);
  }
  for (int t = 0; t < NCLIENTS; t++)
    for (int i = 0; i < NINTENTS; i++) {
      struct intent *it = &clients[t].intents[i];
      json_t *k = json_object_get(json_object_get(stats, refunds_by), it->refund.id);
      if (it->refund.final == 201 &&
          json_integer_value(json_object_get(k, "refunds")) != 1) {
        fprintf(stderr, "chaos: key %s answered 201 with %s, not refunded at the provider\n",
                it->refund.key, it->refund.id);
        bad++;
      }
    }
  refunds = p_total(stats, "refunds");
  charges = p_total(stats, "charges");
  declines = p_total(stats, "declines");
  json_decref(stats); /* before anything fails: it is big */
  if (bad)
    fail_msg("%d broken payment or refund rules (see above); seed %s", bad, psp_flags[3]);
  fprintf(stderr, "chaos: provider: %lld refunds\n", (long long)refunds);
  assert_int_equal(refunds, n201);
  h_assert_db(s, refunds, "SELECT count(*) FROM refunds WHERE status = 'succeeded'");
  /* Nothing pending: what refunds took of a payment is what they
   * refunded, and never more than its amount. */
  h_assert_db(s, 0,
              "SELECT count(*) FROM payments p JOIN resources r ON r.id = p.id AND "
              "r.tenant_id = p.tenant_id WHERE r.refunded <> r.refund_taken OR "
              "r.refund_taken > p.amount");
  h_assert_db(s, charges, "SELECT count(*) FROM payments WHERE status = 'succeeded'");
  h_assert_db(s, declines, "SELECT count(*) FROM payments WHERE status = 'declined'");
  assert_int_equal(charges, n201);
  assert_int_equal(declines, n402);
  h_server_stop(s);
  p_stop(p);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_chaos, p_teardown),
  };
  int rc;
  h_init(argc, argv);
  p_init(argc, argv);
  rc = cmocka_run_group_tests_name("integration: chaos", tests, NULL, NULL);
  curl_global_cleanup();
  return rc;
}
