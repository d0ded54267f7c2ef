/* A refund as idemd stores it, and what a provider's answer makes of it,
 * as provider/payment.h does for a payment: shared by POST
 * /payments/{id}/refunds and the reconciler (docs/idempotency.md, section
 * 4.5). */
#ifndef IDEM_REFUND_H
#define IDEM_REFUND_H

#include <stdint.h>

#include "provider/payment.h"

/* The longest reason, in characters (UTF-8 code points), and in bytes. */
#define IDEM_REFUND_REASON_MAX 200
#define IDEM_REFUND_REASON_BYTES (4 * IDEM_REFUND_REASON_MAX)

typedef struct idem_refund {
  char id[32];         /* "re_..." */
  char payment_id[32]; /* the payment refunded */
  int64_t amount;
  char currency[4];
  int has_reason; /* 0: "reason" is null */
  char reason[IDEM_REFUND_REASON_BYTES + 1];
  char created_at[32];
} idem_refund_t;

/* The refund as a JSON object text in `status`, its fields in the order
 * id, payment_id, amount, currency, status, reason, created_at (and
 * `error` when not NULL, for 402 answers); malloc'd, NULL when out of
 * memory. */
char *idem_refund_json(const idem_refund_t *r, const char *status, const char *error);

/* Reads a stored refund (its resource body). Returns IDEM_OK or IDEM_EJSON
 * when the body is not a refund. */
int idem_refund_parse(const char *body, idem_refund_t *r);

/* Turns a provider answer for `r` into a settlement, as
 * idem_payment_settle() does for a payment (402 with "error":"the refund
 * was declined"); its Location is /refunds/{id}. Returns IDEM_OK, or
 * IDEM_ENOMEM (then `s` holds nothing to free). */
int idem_refund_settle(const idem_refund_t *r, const idem_charge_result_t *res,
                       int may_fail, idem_settlement_t *s);

#endif
