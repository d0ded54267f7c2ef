/* A payment's refundable balance on either store (see refunds.h). */
#include "data/refunds.h"

#include <stdlib.h>
#include <string.h>

#include "data/sql.h"
#include "idem/clock.h"

/* The payment's state, balance and currency. PostgreSQL locks its row for
 * the rest of the transaction (another instance's refund of it waits
 * here, then reads what this one left); SQLite has one writer. */
#define READ_PAYMENT(currency, lock)                                                     \
  "SELECT status, refundable, " currency " FROM resources "                              \
  "WHERE id = $1 AND tenant_id = $2 AND kind = 'payment'" lock
static const char read_sqlite[] = READ_PAYMENT("json_extract(body, '$.currency')", "");
static const char read_pg[] = READ_PAYMENT("body::jsonb ->> 'currency'", " FOR UPDATE");

/* The condition repeats what was read: the balance never goes below 0,
 * whatever a caller got wrong. */
static const char take[] =
    "UPDATE resources SET refundable = refundable - $1, updated_at = $2 "
    "WHERE id = $3 AND tenant_id = $4 AND kind = 'payment' AND status = 'succeeded' "
    "AND refundable >= $1";
static const char give_back[] =
    "UPDATE resources SET refundable = refundable + $1, updated_at = $2 "
    "WHERE id = $3 AND tenant_id = $4 AND kind = 'payment'";
/* The body's "amount_refunded":N, is rewritten from the column's value
 * before the change: the pattern starts with a quote, which inside one
 * of the body's strings is escaped, so it is matched only as the field
 * (provider/payment.h). */
static const char count_refunded[] =
    "UPDATE resources SET refunded = refunded + $1, "
    "body = replace(body, '\"amount_refunded\":' || CAST(refunded AS TEXT) || ',', "
    "'\"amount_refunded\":' || CAST(refunded + $1 AS TEXT) || ','), updated_at = $2 "
    "WHERE id = $3 AND tenant_id = $4 AND kind = 'payment'";

#define TEXT IDEMD_SQL_TEXT
#define NUM IDEMD_SQL_NUM

struct payment_row {
  int found, succeeded;
  int64_t refundable;
  char currency[4];
};

static int got_payment(void *arg, const char *const *cols) {
  struct payment_row *p = arg;

  p->found = 1;
  p->succeeded = cols[0] && strcmp(cols[0], "succeeded") == 0;
  p->refundable = cols[1] ? strtoll(cols[1], NULL, 10) : 0;
  snprintf(p->currency, sizeof p->currency, "%s", cols[2] ? cols[2] : "");
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
  else if (p.refundable <= 0 || want > p.refundable)
    *why = IDEMD_REFUND_EXCEEDS;
  if (*why != IDEMD_REFUND_ALLOWED)
    return IDEM_EREFUSED;

  int64_t amount = want > 0 ? want : p.refundable;
  idemd_sql_param_t t[4] = {NUM(amount), NUM(idem_tx_now_ms(tx)), TEXT(payment_id),
                            NUM(tenant_id)};
  rc = idemd_sql_run(tx, IDEMD_SQL_REFUND_TAKE, take, t, 4, NULL, NULL, &changed);
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
  int rc = idemd_resource_update((void *)r, tx);

  if (rc != IDEM_OK || r->state == IDEM_STATE_PENDING)
    return rc;
  if (r->state == IDEM_STATE_COMPLETED && r->status && strcmp(r->status, "succeeded") == 0)
    return idemd_sql_run(tx, IDEMD_SQL_REFUND_COUNT, count_refunded, p, 4, NULL, NULL,
                         NULL);
  return idemd_sql_run(tx, IDEMD_SQL_REFUND_GIVE_BACK, give_back, p, 4, NULL, NULL, NULL);
}
