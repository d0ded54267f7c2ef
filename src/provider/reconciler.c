/* The reconciler thread and its pass (see reconciler.h). */
#include "provider/reconciler.h"

#include <stdlib.h>
#include <string.h>

#include "data/resources.h"
#include "idem/clock.h"
#include "provider/payment.h"
#include "provider/refund.h"
#include "provider/settle.h"
#include "util/ticker.h"

struct idem_reconciler {
  idem_store_t *store;
  idem_provider_t *provider;
  idem_reconciler_options_t opts;
  idem__ticker_t *ticker;
};

static void emit(const idem_reconciler_options_t *o, idem_reconcile_event_t ev,
                 const idem_record_t *rec, int status) {
  if (o->on_event)
    o->on_event(o->ctx, ev, rec, status);
}

/* 1 when a provider call started now ends before `last_start` + the
 * call's bound, that is within the claim's lease. */
static int may_call(int64_t last_start) { return idem_now_ms() <= last_start; }

/* Asks the provider what became of the payment or refund stored as
 * `body` (`refund` 1), and sends it again under the same key when the
 * provider never saw it (the worker died before its call, or the call was
 * lost on the way), so that a call still in flight and this one make one
 * charge or refund. Each call starts only up to `last_start` (within the
 * lease); IDEM_ETIMEDOUT when one could not, and the record is left to
 * the next pass. IDEM_EJSON when `body` cannot be read. */
static int ask_provider(idem_provider_t *provider, int refund, const char *body,
                        int64_t last_start, idem_charge_result_t *res) {
  memset(res, 0, sizeof *res);
  if (refund) {
    idem_refund_t f;
    if (idem_refund_parse(body, &f) != IDEM_OK)
      return IDEM_EJSON;
    idem_refund_req_t req = {.provider_key = f.id, .charge_key = f.payment_id,
                             .amount = f.amount, .currency = f.currency};
    if (!may_call(last_start))
      return IDEM_ETIMEDOUT;
    provider->refund_lookup(provider, &req, res);
    if (res->outcome == IDEM_CHARGE_NOT_FOUND) {
      if (!may_call(last_start))
        return IDEM_ETIMEDOUT;
      memset(res, 0, sizeof *res);
      provider->refund(provider, &req, res);
    }
    return IDEM_OK;
  }
  idem_payment_t p;
  if (idem_payment_parse(body, &p) != IDEM_OK)
    return IDEM_EJSON;
  idem_charge_t charge = {.provider_key = p.id, .amount = p.amount, .currency = p.currency};
  if (!may_call(last_start))
    return IDEM_ETIMEDOUT;
  provider->lookup(provider, &charge, res);
  if (res->outcome == IDEM_CHARGE_NOT_FOUND) {
    if (!may_call(last_start))
      return IDEM_ETIMEDOUT;
    memset(res, 0, sizeof *res);
    provider->charge(provider, &charge, res);
  }
  return IDEM_OK;
}

/* Settles one claimed record with the provider's answer, as an operator or
 * a webhook would with theirs (provider/settle.h), calling the provider
 * only up to `last_start`. Returns 1 when it was settled, 0 when it is
 * still unresolved (or left to the next pass), -1 on a store error. */
static int settle_one(idem_store_t *store, idem_provider_t *provider,
                      const idem_reconciler_options_t *opts, idem_record_t *rec,
                      int64_t last_start) {
  static const idemd_actor_t who = {"reconciler", "looked up at the provider"};
  int refund = strcmp(rec->operation, "create_refund") == 0;
  idem_charge_result_t res;
  char *body = NULL;
  int status = 0, rc;

  if ((rc = idemd_resource_get(store, rec->tenant_id, refund ? "refund" : "payment",
                               rec->resource_id, &body)) == IDEM_OK)
    rc = ask_provider(provider, refund, body, last_start, &res);
  if (rc == IDEM_ETIMEDOUT) { /* the lease is too short for a call now */
    free(body);
    emit(opts, IDEM_RECONCILE_UNRESOLVED, rec, 202);
    return 0;
  }
  if (rc != IDEM_OK) {
    free(body);
    emit(opts, IDEM_RECONCILE_ERROR, rec, 0);
    return -1;
  }
  rc = idemd_settle(store, rec, body, &res, &who, NULL, opts->ttl_ms, &status);
  free(body);
  if (rc == IDEM_ELOST)
    return 0; /* someone else holds it now; they will finish it */
  if (rc != IDEM_OK) {
    emit(opts, IDEM_RECONCILE_ERROR, rec, 0);
    return -1;
  }
  if (status == 202) {
    emit(opts, IDEM_RECONCILE_UNRESOLVED, rec, 202);
    return 0;
  }
  emit(opts, IDEM_RECONCILE_SETTLED, rec, status);
  return 1;
}

int idem_reconcile_once(idem_store_t *store, idem_provider_t *provider,
                        const idem_reconciler_options_t *opts, int *settled_out,
                        int *unresolved_out) {
  int batch = opts->batch > 0 ? opts->batch : 64;
  idem_record_t *recs = calloc((size_t)batch, sizeof *recs);
  int n = 0, settled = 0, unresolved = 0, rc;

  /* The claim's leases end no sooner than lease_ms from now: the last
   * moment a call of at most call_ms may start. The records of a batch
   * are handled one after another, and a slow provider can use up the
   * lease of those near its end: they are left to the next pass. */
  int64_t call_ms = opts->call_ms > 0 ? opts->call_ms : opts->lease_ms;
  int64_t last_start = idem_now_ms() + opts->lease_ms - call_ms;

  if (recs == NULL)
    return IDEM_ENOMEM;
  rc = idemd_outbox_claim(store, opts->lease_ms, batch, recs, &n);
  for (int i = 0; i < n; i++) {
    int r = settle_one(store, provider, opts, &recs[i], last_start);
    if (r > 0)
      settled++;
    else
      unresolved++;
    idem_record_reset(&recs[i]);
  }
  free(recs);
  if (opts->on_pass && rc == IDEM_OK)
    opts->on_pass(opts->ctx, settled, unresolved);
  if (settled_out)
    *settled_out = settled;
  if (unresolved_out)
    *unresolved_out = unresolved;
  return rc;
}

static void pass(void *arg) {
  idem_reconciler_t *r = arg;
  (void)idem_reconcile_once(r->store, r->provider, &r->opts, NULL, NULL);
}

idem_reconciler_t *idem_reconciler_start(idem_store_t *store,
                                         idem_provider_t *provider,
                                         const idem_reconciler_options_t *opts) {
  idem_reconciler_t *r = calloc(1, sizeof *r);
  if (r == NULL)
    return NULL;
  r->store = store;
  r->provider = provider;
  r->opts = *opts;
  if ((r->ticker = idem__ticker_start(opts->interval_ms, pass, r)) == NULL) {
    free(r);
    return NULL;
  }
  return r;
}

void idem_reconciler_stop(idem_reconciler_t *r) {
  if (r == NULL)
    return;
  idem__ticker_stop(r->ticker);
  free(r);
}
