/* The gateway's resolver (docs/gateway.md, "Pending requests"): a thread
 * that takes over the keys whose outcome is unsettled once no gateway's
 * lease holds them, those a gateway left processing when it died and the
 * pending ones due again. With --upstream-idempotent it sends such a
 * request again, under its key, and completes the record with the answer
 * (at most GW_RETRY_ATTEMPTS times, the waits doubling); without it, a
 * request some gateway began and never finished becomes pending, and
 * stays so: the upstream might run it twice. */
#include "gateway/resolver.h"

#include <stdlib.h>
#include <string.h>

#include "gateway/answer.h"
#include "gateway/request.h"
#include "gateway/requests.h"
#include "idem/clock.h"
#include "server/log.h"
#include "util/ticker.h"

#define BATCH 32

struct take {
  const idem_scope_t *scope;
  int64_t lease_ms;
  int attempts; /* the attempt about to be made; over the bound: none */
  idem_record_t *rec;
};

/* The wait before attempt `n` (1, 2, ...) sends again. */
static int64_t backoff_ms(int n) {
  int64_t ms = GW_RETRY_FIRST_MS;
  while (--n > 0 && ms < GW_RETRY_MAX_MS)
    ms *= 2;
  return ms < GW_RETRY_MAX_MS ? ms : GW_RETRY_MAX_MS;
}

/* In one transaction: the record, if no lease holds it, and its request
 * due again only after the backoff of the next attempt and the new lease
 * (another gateway's resolver then leaves it alone), or never past the
 * bound: so a send whose outcome is never written (the gateway died, the
 * store failed) is still counted and spaced. */
static int take_fn(void *arg, idem_tx_t *tx) {
  struct take *t = arg;
  int64_t wait = backoff_ms(t->attempts + 1);
  gw_due_t due = {t->scope, t->attempts,
                  t->attempts >= GW_RETRY_ATTEMPTS
                      ? GW_NEVER
                      : idem_tx_now_ms(tx) + (wait > t->lease_ms ? wait : t->lease_ms)};
  int rc;

  idem_record_reset(t->rec);
  if ((rc = idem_tx_take_over(tx, t->scope, t->lease_ms, t->rec)) != IDEM_OK)
    return rc;
  return gw_due_fn(&due, tx);
}

/* Sends the kept request `text` of `rec` (this gateway's now) again and
 * completes the record with what came of it. */
static void resend(gw_t *gw, const idem_record_t *rec, const char *text, int attempt) {
  char *method = NULL, *target = NULL, *body = NULL, **headers = NULL;
  size_t body_len = 0;
  gw_answer_t a = {0}, own = {0};
  gw_up_result_t res = GW_UP_NO_ANSWER;
  int rc = gw_request_decode(text, &method, &target, &headers, &body, &body_len);

  if (rc == IDEM_OK) {
    gw_up_request_t up = {.method = method, .target = target,
                          .headers = (const char *const *)headers, .body = body,
                          .body_len = body_len, .once = 1,
                          .lease_expires_at = rec->lease_expires_at};
    res = gw_upstream_call(gw->upstream, &up, &a);
  }
  if (res == GW_UP_ANSWERED && a.status < 500) {
    rc = gw_keep(gw, rec, IDEM_STATE_COMPLETED, &a, 0, 0);
  } else if (res == GW_UP_TOO_LARGE) {
    rc = gw_answer_own(502,
                       "{\"error\":\"the upstream's answer was too large to keep; "
                       "it is not replayed and the request is not sent again\"}",
                       &own);
    if (rc == IDEM_OK)
      rc = gw_keep(gw, rec, IDEM_STATE_COMPLETED, &own, 0, 0);
  } else {
    /* Not yet: pending again, sent later (or, past the bound, never). */
    int64_t next = attempt >= GW_RETRY_ATTEMPTS ? GW_NEVER
                                                : idem_now_ms() + backoff_ms(attempt + 1);
    rc = gw_answer_own(202, GW_PENDING_BODY, &own);
    if (rc == IDEM_OK)
      rc = gw_keep(gw, rec, IDEM_STATE_PENDING, &own, attempt, next);
  }
  if (rc == IDEM_OK && res == GW_UP_ANSWERED && a.status < 500)
    atomic_fetch_add(&gw->counters.resolved, 1);
  if (rc != IDEM_OK)
    idemd_log_event("warn", "gateway: cannot complete a pending record", "error",
                    idem_strerror(rc), NULL);
  gw_answer_free(&a);
  gw_answer_free(&own);
  gw_free_lines(headers);
  free(method);
  free(target);
  free(body);
}

/* A record some gateway began and never finished, with an upstream that
 * may not be sent it again: pending, for good. */
static void give_up(gw_t *gw, const idem_record_t *rec, int attempts) {
  gw_answer_t own = {0};
  int rc = gw_answer_own(202, GW_PENDING_BODY, &own);
  if (rc == IDEM_OK)
    rc = gw_keep(gw, rec, IDEM_STATE_PENDING, &own, attempts, GW_NEVER);
  if (rc != IDEM_OK)
    idemd_log_event("warn", "gateway: cannot mark a record pending", "error",
                    idem_strerror(rc), NULL);
  gw_answer_free(&own);
}

/* One request due: taken over, or left (its record is held by a live
 * lease, or settled: then its row goes). */
static void resolve_one(gw_t *gw, const gw_saved_t *s) {
  idem_record_t rec = {0};
  /* Past the bound nothing is sent: the record is taken to be marked
   * pending for good, its attempts as they are. */
  int spent = s->attempts >= GW_RETRY_ATTEMPTS || !gw->cfg.upstream_idempotent;
  struct take t = {&s->scope, gw->cfg.lease_ms, spent ? s->attempts : s->attempts + 1, &rec};
  idem_effect_t e = {take_fn, &t};
  int rc = idem_store_write(gw->store, &e);

  if (rc == IDEM_ENOTFOUND) {
    /* No record to take: settled (or gone) drops its row; one held by a
     * live lease is left to its owner. */
    idem_effect_t drop = {gw_drop_listed_fn, (void *)s};
    idem_record_reset(&rec);
    rc = idem_store_lookup(gw->store, &s->scope, idem_now_ms(), &rec);
    if (rc == IDEM_ENOTFOUND ||
        (rc == IDEM_OK && rec.state != IDEM_STATE_PROCESSING &&
         rec.state != IDEM_STATE_PENDING)) {
      if (idem_store_write(gw->store, &drop) != IDEM_OK) /* tried again next tick */
        idemd_log_event("warn", "gateway: cannot drop a settled request", NULL);
    }
  } else if (rc == IDEM_OK) {
    if (!spent)
      resend(gw, &rec, s->request, s->attempts + 1);
    else
      give_up(gw, &rec, s->attempts);
  }
  idem_record_reset(&rec);
}

static void tick(void *arg) {
  gw_t *gw = arg;
  gw_saved_t due[BATCH];
  int n = 0;

  if (gw_due_list(gw->store, idem_now_ms(), due, BATCH, &n) != IDEM_OK)
    return;
  for (int i = 0; i < n; i++) {
    resolve_one(gw, &due[i]);
    free(due[i].request);
  }
}

struct idem__ticker *gw_resolver_start(gw_t *gw, int64_t every_ms) {
  return idem__ticker_start(every_ms, tick, gw);
}
