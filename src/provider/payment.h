/* A payment as idemd stores it, and what a provider's answer makes of it:
 * the record's outcome, the response clients get (and replays), and the
 * payment's new status. Shared by POST /payments and the reconciler, so a
 * payment settles the same way whoever settles it. */
#ifndef IDEM_PAYMENT_H
#define IDEM_PAYMENT_H

#include <stdint.h>

#include "idem/store.h"
#include "provider/provider.h"

typedef struct idem_payment {
  char id[32];
  int64_t amount;
  int64_t amount_refunded; /* what its succeeded refunds add up to */
  char currency[4];
  char order_id[256]; /* empty when not given */
  char created_at[32];
} idem_payment_t;

/* What settling a payment produced. `outcome` points into this struct;
 * release it with idem_settlement_free(). */
typedef struct idem_settlement {
  idem_outcome_t outcome;
  const char *status;  /* the payment's new status: "succeeded", ... */
  char *resource_body; /* the payment with its new status */
  char *response_body; /* what the client gets */
  char location[64];
  char provider_ref[IDEM_REF_MAX + 1];
} idem_settlement_t;

/* Reads a stored payment (its resource body). Returns IDEM_OK or
 * IDEM_EJSON when the body is not a payment. */
int idem_payment_parse(const char *body, idem_payment_t *p);

/* The payment as a JSON object text in `status` (malloc'd; NULL when out
 * of memory). `error`, when not NULL, adds that field (402 answers).
 * "amount_refunded" is 0, as at a payment's creation; a read shows what
 * its refunds made it since (idem_payment_with_refunded()). */
char *idem_payment_json(const idem_payment_t *p, const char *status,
                        const char *error);

/* The stored payment `body` as GET answers it: with "amount_refunded"
 * set to `refunded`, what its succeeded refunds add up to (a payment
 * written before refunds existed gains the field). Malloc'd; NULL when
 * `body` is not a JSON object or out of memory. */
char *idem_payment_with_refunded(const char *body, int64_t refunded);

/* The body of a 503 for a call of which nothing reached the provider. */
#define IDEM_PROVIDER_UNREACHABLE                                                        \
  "{\"error\":\"the payment provider could not be reached; retry with the same "          \
  "Idempotency-Key\"}"

/* The record's state and HTTP status a provider answer `r` makes (in
 * `o`; nothing else of it is set), and the resource's new status, for a
 * charge or a refund alike: SUCCEEDED -> completed 201 "succeeded";
 * DECLINED -> completed 402 "declined"; NOT_SENT -> failed 503 "failed"
 * with `may_fail`, else as UNKNOWN and NOT_FOUND: pending 202 "pending". */
const char *idem_settle_outcome(const idem_charge_result_t *r, int may_fail,
                                idem_outcome_t *o);

/* Turns a provider answer for `p` into a settlement: SUCCEEDED -> completed
 * 201 "succeeded"; DECLINED -> completed 402 "declined"; UNKNOWN and
 * NOT_FOUND -> pending 202; NOT_SENT -> failed 503 with `may_fail`
 * (nothing happened, the key may run again), else pending 202.
 * Returns IDEM_OK, or IDEM_ENOMEM (then `s` holds nothing to free). */
int idem_payment_settle(const idem_payment_t *p, const idem_charge_result_t *r,
                        int may_fail, idem_settlement_t *s);

/* The rest of a settlement whose s->outcome idem_settle_outcome() set:
 * takes `resource_body` (the resource in `status`) and `declined_body`
 * (a 402's answer; NULL otherwise), both malloc'd and owned by `s` from
 * here even on failure; the answer is the resource, that 402 body, or a
 * failed call's 503; its Location is `path` and `id` (borrowed: it must
 * outlive `s`). Returns IDEM_OK, or IDEM_ENOMEM (a body was NULL; then
 * `s` holds nothing to free). */
int idem_settlement_fill(idem_settlement_t *s, const idem_charge_result_t *r,
                         const char *status, const char *path, const char *id,
                         char *resource_body, char *declined_body);

/* Frees what a settlement owns. */
void idem_settlement_free(idem_settlement_t *s);

#endif
