/* The reconciler thread and its pass (see reconciler.h). */
#include "provider/reconciler.h"

#include <stdlib.h>
#include <string.h>

#include "data/refunds.h"
#include "data/resources.h"
#include "idem/clock.h"
#include "provider/payment.h"
#include "provider/refund.h"
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

/* What a claimed record's call is: its resource read back, the provider's
 * answer to a lookup (and to a second send under the same key when the
 * provider never saw it), and the completion that answer makes. */
struct settling {
  idem_charge_result_t res;
  idem_settlement_t settled;
  idem_payment_t payment;
  idem_refund_t refund;
  idemd_resource_update_t update;
  idemd_refund_update_t refund_update;
  idem_effect_t effect;
};

/* A payment's charge: looked up, sent again when the provider never saw
 * it. Returns IDEM_OK with s->settled and s->effect set. */
static int settle_payment(idem_provider_t *provider, const char *body,
                          const idem_record_t *rec, struct settling *s) {
  idem_payment_t *p = &s->payment;
  idem_charge_t charge;

  if (idem_payment_parse(body, p) != IDEM_OK)
    return IDEM_EJSON;
  charge = (idem_charge_t){.provider_key = p->id, .amount = p->amount,
                           .currency = p->currency};
  provider->lookup(provider, &charge, &s->res);
  if (s->res.outcome == IDEM_CHARGE_NOT_FOUND) {
    /* The provider never saw it (the worker died before its call, or the
     * call was lost on the way): send it now, under the same key, so a
     * call still in flight and this one make one charge. */
    memset(&s->res, 0, sizeof s->res);
    provider->charge(provider, &charge, &s->res);
  }
  if (idem_payment_settle(p, &s->res, 0, &s->settled) != IDEM_OK)
    return IDEM_ENOMEM;
  s->update =
      (idemd_resource_update_t){.tenant_id = rec->tenant_id,
                                .id = p->id,
                                .status = s->settled.status,
                                .body = s->settled.resource_body,
                                .provider_ref = s->settled.outcome.provider_ref,
                                .state = s->settled.outcome.state,
                                .who = {"reconciler", "looked up at the provider"}};
  s->effect = (idem_effect_t){idemd_resource_update, &s->update};
  return IDEM_OK;
}

/* A refund, as a payment: its completion also counts it on its payment,
 * or gives the amount back (data/refunds.h). */
static int settle_refund(idem_provider_t *provider, const char *body,
                         const idem_record_t *rec, struct settling *s) {
  idem_refund_t *f = &s->refund;
  idem_refund_req_t req;

  if (idem_refund_parse(body, f) != IDEM_OK)
    return IDEM_EJSON;
  req = (idem_refund_req_t){.provider_key = f->id, .charge_key = f->payment_id,
                            .amount = f->amount, .currency = f->currency};
  provider->refund_lookup(provider, &req, &s->res);
  if (s->res.outcome == IDEM_CHARGE_NOT_FOUND) {
    memset(&s->res, 0, sizeof s->res);
    provider->refund(provider, &req, &s->res);
  }
  if (idem_refund_settle(f, &s->res, 0, &s->settled) != IDEM_OK)
    return IDEM_ENOMEM;
  s->refund_update = (idemd_refund_update_t){
      .refund = {.tenant_id = rec->tenant_id,
                 .id = f->id,
                 .status = s->settled.status,
                 .body = s->settled.resource_body,
                 .provider_ref = s->settled.outcome.provider_ref,
                 .state = s->settled.outcome.state,
                 .who = {"reconciler", "looked up at the provider"}},
      .payment_id = f->payment_id,
      .amount = f->amount};
  s->effect = (idem_effect_t){idemd_refund_settled, &s->refund_update};
  return IDEM_OK;
}

/* Settles one claimed record. Returns 1 when it was settled, 0 when it is
 * still unresolved, -1 on a store error. */
static int settle_one(idem_store_t *store, idem_provider_t *provider,
                      const idem_reconciler_options_t *opts, idem_record_t *rec) {
  idem_scope_t scope = {rec->tenant_id, rec->operation, rec->key};
  int refund = strcmp(rec->operation, "create_refund") == 0;
  struct settling *s = calloc(1, sizeof *s);
  char *body = NULL;
  int rc;

  if (s == NULL ||
      idemd_resource_get(store, rec->tenant_id, refund ? "refund" : "payment",
                         rec->resource_id, &body) != IDEM_OK ||
      (refund ? settle_refund : settle_payment)(provider, body, rec, s) != IDEM_OK) {
    free(body);
    free(s);
    emit(opts, IDEM_RECONCILE_ERROR, rec, 0);
    return -1;
  }
  free(body);
  idem_complete_t c = {.scope = scope, .owner_token = rec->owner_token,
                       .now_ms = idem_now_ms(), .ttl_ms = opts->ttl_ms,
                       .outcome = s->settled.outcome, .effect = s->effect};
  rc = idem_store_complete(store, &c);
  idem_settlement_free(&s->settled);
  free(s);
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
