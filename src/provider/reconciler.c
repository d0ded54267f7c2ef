/* The reconciler thread and its pass (see reconciler.h). */
#include "provider/reconciler.h"

#include <stdlib.h>
#include <string.h>

#include "data/resources.h"
#include "idem/clock.h"
#include "provider/payment.h"
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

/* Settles one claimed record. Returns 1 when it was settled, 0 when it is
 * still unresolved, -1 on a store error. */
static int settle_one(idem_store_t *store, idem_provider_t *provider,
                      const idem_reconciler_options_t *opts, idem_record_t *rec) {
  idem_scope_t scope = {rec->tenant_id, rec->operation, rec->key};
  idem_charge_result_t res = {0};
  idem_settlement_t settled;
  idem_payment_t payment;
  char *body = NULL;
  int rc;

  rc = idemd_resource_get(store, rec->tenant_id, "payment", rec->resource_id, &body);
  if (rc != IDEM_OK || idem_payment_parse(body, &payment) != IDEM_OK) {
    free(body);
    emit(opts, IDEM_RECONCILE_ERROR, rec, 0);
    return -1;
  }
  free(body);

  idem_charge_t charge = {.provider_key = payment.id, .amount = payment.amount,
                          .currency = payment.currency};
  provider->lookup(provider, &charge, &res);
  if (res.outcome == IDEM_CHARGE_NOT_FOUND) {
    /* The provider never saw it (the worker died before its call, or the
     * call was lost on the way): send it now, under the same key, so a
     * call still in flight and this one make one charge. */
    memset(&res, 0, sizeof res);
    provider->charge(provider, &charge, &res);
  }
  if (idem_payment_settle(&payment, &res, 0, &settled) != IDEM_OK) {
    emit(opts, IDEM_RECONCILE_ERROR, rec, 0);
    return -1;
  }
  idemd_resource_update_t update = {.tenant_id = rec->tenant_id, .id = payment.id,
                                    .status = settled.status,
                                    .body = settled.resource_body,
                                    .provider_ref = settled.outcome.provider_ref,
                                    .state = settled.outcome.state};
  idem_complete_t c = {.scope = scope, .owner_token = rec->owner_token,
                       .now_ms = idem_now_ms(), .ttl_ms = opts->ttl_ms,
                       .outcome = settled.outcome,
                       .effect = {idemd_resource_update, &update}};
  rc = idem_store_complete(store, &c);
  idem_settlement_free(&settled);
  if (rc == IDEM_ELOST)
    return 0; /* someone else holds it now; they will finish it */
  if (rc != IDEM_OK) {
    emit(opts, IDEM_RECONCILE_ERROR, rec, 0);
    return -1;
  }
  if (c.outcome.state == IDEM_STATE_PENDING) {
    emit(opts, IDEM_RECONCILE_UNRESOLVED, rec, 202);
    return 0;
  }
  emit(opts, IDEM_RECONCILE_SETTLED, rec, c.outcome.status);
  return 1;
}

int idem_reconcile_once(idem_store_t *store, idem_provider_t *provider,
                        const idem_reconciler_options_t *opts, int *settled_out,
                        int *unresolved_out) {
  int batch = opts->batch > 0 ? opts->batch : 64;
  idem_record_t *recs = calloc((size_t)batch, sizeof *recs);
  int n = 0, settled = 0, unresolved = 0, rc;

  if (recs == NULL)
    return IDEM_ENOMEM;
  rc = idemd_outbox_claim(store, opts->lease_ms, batch, recs, &n);
  for (int i = 0; i < n; i++) {
    int r = settle_one(store, provider, opts, &recs[i]);
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
