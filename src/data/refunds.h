/* A payment's refundable balance in the store (docs/idempotency.md,
 * section 4.5). A refund's reservation takes its amount from what is left
 * of the payment (its amount less what its refunds have taken: the
 * column refund_taken), in the transaction that wins the key, so refunds
 * racing under different keys never take more than the payment; its
 * completion counts the amount as refunded, or gives it back when the
 * provider declined it or never got it. The refund itself is a resource with an
 * outbox row, written as a payment's is (data/resources.h). */
#ifndef IDEMD_REFUNDS_H
#define IDEMD_REFUNDS_H

#include <stdint.h>

#include "data/resources.h"

/* Why a reservation was refused (IDEM_EREFUSED). */
typedef enum idemd_refund_refusal {
  IDEMD_REFUND_ALLOWED = 0,
  IDEMD_REFUND_NO_PAYMENT,     /* no such payment for the tenant: 404 */
  IDEMD_REFUND_NOT_REFUNDABLE, /* the payment is not succeeded: 409 */
  IDEMD_REFUND_EXCEEDS         /* more than is left of it: 409 */
} idemd_refund_refusal_t;

/* Before a reservation, outside any transaction: IDEM_OK when the
 * tenant's payment `payment_id` exists and is succeeded; IDEM_EREFUSED
 * with `*why` NO_PAYMENT or NOT_REFUNDABLE otherwise (neither can change
 * back, so a refund refused here would be refused in the transaction
 * too; what is left is only checked there); a store error otherwise. */
int idemd_refund_precheck(idem_store_t *store, int64_t tenant_id, const char *payment_id,
                          idemd_refund_refusal_t *why);

/* Reads the tenant's payment `id`: its stored text in `*body` (malloc'd,
 * the caller frees it) and what its succeeded refunds add up to in
 * `*refunded`. IDEM_ENOTFOUND when there is none; a store error
 * otherwise. */
int idemd_payment_get(idem_store_t *store, int64_t tenant_id, const char *id, char **body,
                      int64_t *refunded);

/* Inside a reservation's transaction: takes `want` (0: all that is left)
 * from what is left to refund of the tenant's payment `payment_id`, which
 * must be succeeded. On PostgreSQL the payment's row stays locked until
 * the transaction ends, so concurrent refunds of one payment take turns;
 * SQLite's single writer does the same. Returns IDEM_OK with `*held` the
 * amount taken and `currency` (room for 4) the payment's; IDEM_EREFUSED
 * with `*why` set when the payment is unknown, not succeeded, or has less
 * left than `want` (or nothing, for all that is left), having changed
 * nothing; a store error otherwise. */
int idemd_refund_hold(idem_tx_t *tx, int64_t tenant_id, const char *payment_id,
                      int64_t want, int64_t *held, char *currency,
                      idemd_refund_refusal_t *why);

/* What a refund's completion changes: the refund as a payment's update
 * does (its row, its outbox row), and its payment. Borrowed. */
typedef struct idemd_refund_update {
  idemd_resource_update_t refund; /* status "succeeded", "declined", ... */
  const char *payment_id;
  int64_t amount;
} idemd_refund_update_t;

/* An effect's function with `arg` an idemd_refund_update_t, run with the
 * completion: a refund completed as "succeeded" adds its amount to the
 * payment's refunded amount; one completed otherwise (declined) or failed
 * gives the amount back to what is left; a pending one leaves the payment
 * as it is. IDEM_ESTORE on failure, or when the payment does not hold
 * what the reservation took. */
int idemd_refund_settled(void *arg, idem_tx_t *tx);

#endif
