/* A payment's refundable balance on either store (see refunds.h). */
#include "data/refunds.h"

#include <stdlib.h>
#include <string.h>

#include "data/sql.h"
#include "idem/clock.h"

/* The payment's state, amount, what its refunds have taken and its
 * currency. PostgreSQL locks its row for the rest of the transaction
 * (another instance's refund of it waits here, then reads what this one
 * left); SQLite has one writer. */
#define READ_PAYMENT(amount, currency, lock)                                             \
  "SELECT status, " amount ", refund_taken, " currency " FROM resources "                \
  "WHERE id = $1 AND tenant_id = $2 AND kind = 'payment'" lock
#define AMOUNT_SQLITE "json_extract(body, '$.amount')"
#define AMOUNT_PG "CAST(body::jsonb ->> 'amount' AS BIGINT)"
static const char read_sqlite[] =
    READ_PAYMENT(AMOUNT_SQLITE, "json_extract(body, '$.currency')", "");
static const char read_pg[] =
    READ_PAYMENT(AMOUNT_PG, "body::jsonb ->> 'currency'", " FOR UPDATE");

/* The condition repeats what was read: nothing takes the payment past its
 * amount, whatever a caller got wrong. */
#define TAKE(amount)                                                                     \
  "UPDATE resources SET refund_taken = refund_taken + $1, updated_at = $2 "              \
  "WHERE id = $3 AND tenant_id = $4 AND kind = 'payment' AND status = 'succeeded' "      \
  "AND refund_taken + $1 <= " amount
static const char take_sqlite[] = TAKE(AMOUNT_SQLITE);
static const char take_pg[] = TAKE(AMOUNT_PG);
static const char give_back[] =
    "UPDATE resources SET refund_taken = refund_taken - $1, updated_at = $2 "
    "WHERE id = $3 AND tenant_id = $4 AND kind = 'payment' AND refund_taken >= $1";
static const char count_refunded[] =
    "UPDATE resources SET refunded = refunded + $1, updated_at = $2 "
    "WHERE id = $3 AND tenant_id = $4 AND kind = 'payment' AND refunded + $1 <= refund_taken";

#define TEXT IDEMD_SQL_TEXT
#define NUM IDEMD_SQL_NUM

struct payment_row {
  int found, succeeded;
  int64_t amount, taken;
  char currency[4];
};

static int got_payment(void *arg, const char *const *cols) {
  struct payment_row *p = arg;

  p->found = 1;
  p->succeeded = cols[0] && strcmp(cols[0], "succeeded") == 0;
  p->amount = cols[1] ? strtoll(cols[1], NULL, 10) : 0;
  p->taken = cols[2] ? strtoll(cols[2], NULL, 10) : 0;
  snprintf(p->currency, sizeof p->currency, "%s", cols[3] ? cols[3] : "");
  return IDEM_OK;
}

/* Without the row lock: a read on either store (SQLite's is the same). */
static const char peek_pg[] =
    READ_PAYMENT(AMOUNT_PG, "body::jsonb ->> 'currency'", "");

struct precheck {
  int64_t tenant_id;
  const char *id;
  struct payment_row row;
};

static int precheck_fn(void *arg, idem_tx_t *tx) {
  struct precheck *c = arg;
  idemd_sql_param_t key[2] = {TEXT(c->id), NUM(c->tenant_id)};
  memset(&c->row, 0, sizeof c->row);
  return idemd_sql_run(tx, IDEMD_SQL_REFUND_PEEK,
                       idemd_sql_is_sqlite(tx) ? read_sqlite : peek_pg, key, 2, got_payment,
                       &c->row, NULL);
}

int idemd_refund_precheck(idem_store_t *store, int64_t tenant_id, const char *payment_id,
                          idemd_refund_refusal_t *why) {
  struct precheck c = {tenant_id, payment_id, {0}};
  idem_effect_t e = {precheck_fn, &c};
  int rc = idem_store_read(store, &e);

  *why = IDEMD_REFUND_ALLOWED;
  if (rc != IDEM_OK)
    return rc;
  if (!c.row.found)
    *why = IDEMD_REFUND_NO_PAYMENT;
  else if (!c.row.succeeded)
    *why = IDEMD_REFUND_NOT_REFUNDABLE;
  return *why == IDEMD_REFUND_ALLOWED ? IDEM_OK : IDEM_EREFUSED;
}

static const char get_payment[] =
    "SELECT body, refunded FROM resources WHERE id = $1 AND tenant_id = $2 "
    "AND kind = 'payment'";

struct payment_get {
  int64_t tenant_id;
  const char *id;
  char *body;
  int64_t refunded;
};

static int got_body(void *arg, const char *const *cols) {
  struct payment_get *g = arg;
  free(g->body);
  g->body = strdup(cols[0] ? cols[0] : "");
  g->refunded = cols[1] ? strtoll(cols[1], NULL, 10) : 0;
  return g->body ? IDEM_OK : IDEM_ENOMEM;
}

static int get_fn(void *arg, idem_tx_t *tx) {
  struct payment_get *g = arg;
  idemd_sql_param_t key[2] = {TEXT(g->id), NUM(g->tenant_id)};
  return idemd_sql_run(tx, IDEMD_SQL_PAYMENT_GET, get_payment, key, 2, got_body, g, NULL);
}

int idemd_payment_get(idem_store_t *store, int64_t tenant_id, const char *id, char **body,
                      int64_t *refunded) {
  struct payment_get g = {tenant_id, id, NULL, 0};
  idem_effect_t e = {get_fn, &g};
  int rc = idem_store_read(store, &e);

  *body = NULL;
  *refunded = 0;
  if (rc != IDEM_OK) {
    free(g.body);
    return rc;
  }
  if (g.body == NULL)
    return IDEM_ENOTFOUND;
  *body = g.body;
  *refunded = g.refunded;
  return IDEM_OK;
}

int idemd_refund_hold(idem_tx_t *tx, int64_t tenant_id, const char *payment_id,
                      int64_t want, int64_t *held, char *currency,
                      idemd_refund_refusal_t *why) {
  struct payment_row p = {0};
  idemd_sql_param_t key[2] = {TEXT(payment_id), NUM(tenant_id)};
  int sqlite = idemd_sql_is_sqlite(tx), changed = 0, rc;

  *held = 0;
  *why = IDEMD_REFUND_ALLOWED;
  rc = idemd_sql_run(tx, IDEMD_SQL_REFUND_READ, sqlite ? read_sqlite : read_pg, key, 2,
                     got_payment, &p, NULL);
  if (rc != IDEM_OK)
    return rc;
  if (!p.found)
    *why = IDEMD_REFUND_NO_PAYMENT;
  else if (!p.succeeded)
    *why = IDEMD_REFUND_NOT_REFUNDABLE;
  else if (p.amount - p.taken <= 0 || want > p.amount - p.taken)
    *why = IDEMD_REFUND_EXCEEDS;
  if (*why != IDEMD_REFUND_ALLOWED)
    return IDEM_EREFUSED;

  int64_t amount = want > 0 ? want : p.amount - p.taken;
  idemd_sql_param_t t[4] = {NUM(amount), NUM(idem_tx_now_ms(tx)), TEXT(payment_id),
                            NUM(tenant_id)};
  rc = idemd_sql_run(tx, IDEMD_SQL_REFUND_TAKE, sqlite ? take_sqlite : take_pg, t, 4, NULL,
                     NULL, &changed);
  if (rc != IDEM_OK)
    return rc;
  if (changed != 1) /* what was read has changed under us: never here */
    return IDEM_ESTORE;
  *held = amount;
  memcpy(currency, p.currency, sizeof p.currency);
  return IDEM_OK;
}

int idemd_refund_settled(void *arg, idem_tx_t *tx) {
  const idemd_refund_update_t *u = arg;
  const idemd_resource_update_t *r = &u->refund;
  idemd_sql_param_t p[4] = {NUM(u->amount), NUM(idem_tx_now_ms(tx)), TEXT(u->payment_id),
                            NUM(r->tenant_id)};
  int changed = 0, rc = idemd_resource_update((void *)r, tx);

  if (rc != IDEM_OK || r->state == IDEM_STATE_PENDING)
    return rc;
  if (r->state == IDEM_STATE_COMPLETED && r->status && strcmp(r->status, "succeeded") == 0)
    rc = idemd_sql_run(tx, IDEMD_SQL_REFUND_COUNT, count_refunded, p, 4, NULL, NULL,
                       &changed);
  else
    rc = idemd_sql_run(tx, IDEMD_SQL_REFUND_GIVE_BACK, give_back, p, 4, NULL, NULL,
                       &changed);
  /* The reservation took the amount, once: not finding it is a broken
   * store, never to be papered over. */
  return rc == IDEM_OK && changed != 1 ? IDEM_ESTORE : rc;
}
