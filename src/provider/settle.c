/* Settling a pending payment or refund (see settle.h). */
#include "provider/settle.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/events.h"
#include "data/refunds.h"
#include "data/resources.h"
#include "data/sql.h"
#include "idem/clock.h"
#include "provider/payment.h"
#include "provider/refund.h"

/* Whether the event was applied, and the pending payment's or refund's
 * outbox row with its resource: one row with NULLs when there is none. */
static const char find_sql[] =
    "SELECT e.n, o.tenant_id, o.key, r.body FROM "
    "(SELECT count(*) AS n FROM processed_events WHERE event_id = $1) e "
    "LEFT JOIN outbox o ON o.resource_id = $2 AND o.operation = $3 "
    "AND (CAST($4 AS BIGINT) = 0 OR o.tenant_id = $4) "
    "LEFT JOIN resources r ON r.tenant_id = o.tenant_id AND r.id = o.resource_id";
static const char status_sql[] =
    "SELECT status FROM resources WHERE id = $1 AND kind = $2 "
    "AND (CAST($3 AS BIGINT) = 0 OR tenant_id = $3)";

#define TEXT IDEMD_SQL_TEXT
#define NUM IDEMD_SQL_NUM

struct claim {
  int refund, tell;
  int64_t tenant_id, lease_ms;
  const char *id;
  const idem_webhook_event_t *ev; /* NULL: not a provider's event */
  int rows, seen;
  int64_t row_tenant;
  char key[IDEM_KEY_MAX + 1];
  idemd_pending_t *p;
  idemd_claim_t found;
};

static const char *operation_of(int refund) {
  return refund ? "create_refund" : "create_payment";
}

static int got_pending(void *arg, const char *const *cols) {
  struct claim *c = arg;

  c->seen = cols[0] && strcmp(cols[0], "0") != 0;
  if (!cols[1] || !cols[2] || !cols[3] || ++c->rows > 1)
    return IDEM_OK;
  c->row_tenant = strtoll(cols[1], NULL, 10);
  snprintf(c->key, sizeof c->key, "%s", cols[2]);
  free(c->p->body);
  c->p->body = strdup(cols[3]);
  return c->p->body ? IDEM_OK : IDEM_ENOMEM;
}

static int got_status(void *arg, const char *const *cols) {
  struct claim *c = arg;

  if (++c->rows == 1)
    snprintf(c->p->status, sizeof c->p->status, "%s", cols[0] ? cols[0] : "");
  return IDEM_OK;
}

/* The "amount" of a stored payment or refund; 0 when it has none. */
static int64_t amount_of(const char *body) {
  json_t *v = json_loads(body, 0, NULL);
  int64_t amount = (int64_t)json_integer_value(json_object_get(v, "amount"));

  json_decref(v);
  return amount;
}

/* A provider's event signed as it should be, yet for another amount than
 * the one we asked for (docs/idempotency.md, section 4.6): nothing of the
 * payment or refund changes, and its record is not taken (a worker or
 * the reconciler may hold it); what stays is the event, kept as
 * processed so that its next delivery is a duplicate, and an audit row,
 * pending to pending, so that an operator sees it (`idemd audit`). */
static int mismatch(struct claim *c, idem_tx_t *tx) {
  const idem_webhook_event_t *ev = c->ev;
  const char *type = idem_webhook_type(ev);
  char reason[160];
  idemd_event_t seen = {ev->id, type, c->row_tenant, c->id};
  idemd_actor_t who = {ev->id, reason};
  int rc;

  snprintf(reason, sizeof reason, "%s of amount %lld ignored: the %s's is %lld", type,
           (long long)ev->amount, c->refund ? "refund" : "payment",
           (long long)c->p->amount);
  rc = idemd_event_record(&seen, tx);
  if (rc == IDEM_OK)
    rc = idemd_audit_append(tx, c->row_tenant, c->id, "pending", "pending", &who);
  if (rc == IDEM_OK)
    c->found = IDEMD_CLAIM_MISMATCH;
  return rc;
}

/* In one write; it may run again (SQLite's batches): it starts afresh. */
static int claim_fn(void *arg, idem_tx_t *tx) {
  struct claim *c = arg;
  idemd_sql_param_t f[4] = {TEXT(c->ev ? c->ev->id : NULL), TEXT(c->id),
                            TEXT(operation_of(c->refund)), NUM(c->tenant_id)};
  idemd_sql_param_t q[3] = {TEXT(c->id), TEXT(c->refund ? "refund" : "payment"),
                            NUM(c->tenant_id)};
  int rc;

  idemd_settle_reset(c->p);
  c->rows = c->seen = 0;
  c->found = IDEMD_CLAIM_UNKNOWN;
  rc = idemd_sql_run(tx, IDEMD_SQL_OUTBOX_FIND, find_sql, f, 4, got_pending, c, NULL);
  if (rc != IDEM_OK)
    return rc;
  if (c->seen) {
    c->found = IDEMD_CLAIM_DUPLICATE;
    return IDEM_OK;
  }
  if (c->rows == 1 && c->p->body) {
    idem_scope_t scope = {c->row_tenant, operation_of(c->refund), c->key};
    c->p->amount = amount_of(c->p->body);
    if (c->ev && c->ev->amount != c->p->amount)
      return mismatch(c, tx);
    rc = idem_tx_take_over(tx, &scope, c->lease_ms, &c->p->rec);
    if (rc == IDEM_ENOTFOUND) { /* held under a live lease */
      idem_record_reset(&c->p->rec);
      c->found = IDEMD_CLAIM_BUSY;
      return IDEM_OK;
    }
    if (rc != IDEM_OK)
      return rc;
    snprintf(c->p->status, sizeof c->p->status, "pending");
    if (c->p->rec.resource_id[0] == '\0')
      snprintf(c->p->rec.resource_id, sizeof c->p->rec.resource_id, "%s", c->id);
    c->found = IDEMD_CLAIM_TAKEN;
    return IDEM_OK;
  }
  if (c->rows > 1 || !c->tell)
    return IDEM_OK;
  c->rows = 0;
  /* A tool's question: made each time rather than kept in a slot. */
  rc = idemd_sql_run(tx, IDEMD_SQL_COUNT, status_sql, q, 3, got_status, c, NULL);
  if (rc == IDEM_OK && c->rows == 1)
    c->found = IDEMD_CLAIM_SETTLED;
  return rc;
}

int idemd_settle_claim(idem_store_t *store, int refund, int64_t tenant_id, const char *id,
                       const idem_webhook_event_t *ev, int tell, int64_t lease_ms,
                       idemd_pending_t *p, idemd_claim_t *found) {
  struct claim c = {.refund = refund,
                    .tell = tell,
                    .tenant_id = tenant_id,
                    .lease_ms = lease_ms,
                    .id = id,
                    .ev = ev,
                    .p = p};
  idem_effect_t e = {claim_fn, &c};
  int rc;

  memset(p, 0, sizeof *p);
  *found = IDEMD_CLAIM_UNKNOWN;
  if ((rc = idem_store_write(store, &e)) != IDEM_OK) {
    idemd_settle_reset(p);
    /* The same event recorded by another delivery since our read (a
     * mismatch's, on PostgreSQL): the write rolled back. */
    if (rc == IDEM_EEXIST && ev) {
      *found = IDEMD_CLAIM_DUPLICATE;
      return IDEM_OK;
    }
    return rc;
  }
  if (c.found != IDEMD_CLAIM_TAKEN) {
    char status[sizeof p->status];
    int64_t amount = p->amount;
    memcpy(status, p->status, sizeof status);
    idemd_settle_reset(p);
    if (c.found == IDEMD_CLAIM_SETTLED)
      memcpy(p->status, status, sizeof status);
    if (c.found == IDEMD_CLAIM_MISMATCH)
      p->amount = amount;
  }
  *found = c.found;
  return IDEM_OK;
}

void idemd_settle_reset(idemd_pending_t *p) {
  idem_record_reset(&p->rec);
  free(p->body);
  memset(p, 0, sizeof *p);
}

/* What one settlement writes with the completion. */
struct settling {
  idem_settlement_t settled;
  idem_payment_t payment;
  idem_refund_t refund;
  idemd_resource_update_t update;
  idemd_refund_update_t refund_update;
  idem_effect_t also, change;
};

/* The caller's effect first, then the resource's: both or neither. */
static int both_fn(void *arg, idem_tx_t *tx) {
  struct settling *s = arg;
  int rc = s->also.fn ? s->also.fn(s->also.arg, tx) : IDEM_OK;
  return rc == IDEM_OK ? s->change.fn(s->change.arg, tx) : rc;
}

/* s->settled and s->change from the stored `body` and the answer `res`. */
static int settlement(struct settling *s, const idem_record_t *rec, const char *body,
                      const idem_charge_result_t *res, const idemd_actor_t *who) {
  if (strcmp(rec->operation, "create_refund") == 0) {
    idem_refund_t *f = &s->refund;
    if (idem_refund_parse(body, f) != IDEM_OK)
      return IDEM_EJSON;
    if (idem_refund_settle(f, res, 0, &s->settled) != IDEM_OK)
      return IDEM_ENOMEM;
    s->refund_update = (idemd_refund_update_t){
        .refund = {.tenant_id = rec->tenant_id,
                   .id = f->id,
                   .status = s->settled.status,
                   .body = s->settled.resource_body,
                   .provider_ref = s->settled.outcome.provider_ref,
                   .state = s->settled.outcome.state,
                   .who = *who},
        .payment_id = f->payment_id,
        .amount = f->amount};
    s->change = (idem_effect_t){idemd_refund_settled, &s->refund_update};
    return IDEM_OK;
  }
  idem_payment_t *p = &s->payment;
  if (idem_payment_parse(body, p) != IDEM_OK)
    return IDEM_EJSON;
  if (idem_payment_settle(p, res, 0, &s->settled) != IDEM_OK)
    return IDEM_ENOMEM;
  s->update = (idemd_resource_update_t){.tenant_id = rec->tenant_id,
                                        .id = p->id,
                                        .status = s->settled.status,
                                        .body = s->settled.resource_body,
                                        .provider_ref = s->settled.outcome.provider_ref,
                                        .state = s->settled.outcome.state,
                                        .who = *who};
  s->change = (idem_effect_t){idemd_resource_update, &s->update};
  return IDEM_OK;
}

int idemd_settle(idem_store_t *store, const idem_record_t *rec, const char *body,
                 const idem_charge_result_t *res, const idemd_actor_t *who,
                 const idem_effect_t *also, int64_t ttl_ms, int *status) {
  struct settling *s = calloc(1, sizeof *s);
  idem_scope_t scope = {rec->tenant_id, rec->operation, rec->key};
  int rc;

  *status = 0;
  if (s == NULL)
    return IDEM_ENOMEM;
  if ((rc = settlement(s, rec, body, res, who)) != IDEM_OK) {
    free(s);
    return rc;
  }
  if (also)
    s->also = *also;
  idem_complete_t c = {.scope = scope,
                       .owner_token = rec->owner_token,
                       .now_ms = idem_now_ms(),
                       .ttl_ms = ttl_ms,
                       .outcome = s->settled.outcome,
                       .effect = {both_fn, s}};
  rc = idem_store_complete(store, &c);
  if (rc == IDEM_OK)
    *status = c.outcome.state == IDEM_STATE_PENDING ? 202 : c.outcome.status;
  idem_settlement_free(&s->settled);
  free(s);
  return rc;
}
