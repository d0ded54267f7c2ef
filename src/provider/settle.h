/* Settling a pending payment or refund once its outcome is known, by
 * whoever learnt it: the reconciler (the provider's answer to a lookup),
 * an operator (`idemd payments resolve`, docs/operations.md, "A payment
 * that stays pending") or the provider's own event (POST
 * /webhooks/provider, docs/payments.md, "Webhooks"). One path for all
 * three: the record is taken over under an owner token of its own
 * (idem_tx_take_over()), so a worker or another settler acting on it at
 * the same moment is fenced off, and then completed in one transaction
 * with the resource's new state, its outbox row gone and the audit row of
 * the change, as the request that made it would have completed it. */
#ifndef IDEMD_SETTLE_H
#define IDEMD_SETTLE_H

#include <stdint.h>

#include "data/audit.h"
#include "idem/store.h"
#include "provider/provider.h"
#include "provider/webhook.h"

/* What idemd_settle_claim() found. */
typedef enum idemd_claim {
  IDEMD_CLAIM_TAKEN = 0, /* pending, and now ours: settle it */
  IDEMD_CLAIM_UNKNOWN,   /* no such payment or refund (or not pending and
                          * the caller did not ask to tell) */
  IDEMD_CLAIM_SETTLED,   /* it exists and is not pending: `status` says */
  IDEMD_CLAIM_BUSY,      /* pending, but a worker or settler holds its record
                          * under a live lease: try again later */
  IDEMD_CLAIM_DUPLICATE, /* the event was applied before (nothing taken) */
  IDEMD_CLAIM_MISMATCH   /* pending, but the event's amount is not its: nothing
                          * taken, the event recorded with an audit row */
} idemd_claim_t;

/* A pending payment or refund claimed for settling. Reset it with
 * idemd_settle_reset(). */
typedef struct idemd_pending {
  idem_record_t rec; /* its record, under our owner token */
  char *body;        /* the resource as stored (malloc'd) */
  char status[16];   /* its status (IDEMD_CLAIM_SETTLED: what it is) */
  int64_t amount;    /* its amount (TAKEN and MISMATCH of an event) */
} idemd_pending_t;

/* Claims the pending payment (`refund` 0) or refund `id`: in one write,
 * finds it (of tenant `tenant_id`, or of any tenant when 0: ids are made
 * unique by idemd, and an id found under several tenants is UNKNOWN) by
 * its outbox row, which only a pending one has, and takes its record over
 * for `lease_ms`. With a provider's event `ev` (may be NULL): one already
 * in the processed-events table (data/events.h) is DUPLICATE; one whose
 * amount is not the resource's is MISMATCH (docs/idempotency.md, section
 * 4.6): nothing is taken and nothing a client sees changes, but the event
 * is recorded as processed with an audit row of the resource, pending to
 * pending, the event's id as actor and both amounts in the reason, in
 * the same write. `tell` 1 also reads one that is not pending, to tell
 * SETTLED from UNKNOWN (without `tenant_id`, a scan of the resources: for
 * tools); with 0 both are UNKNOWN. Returns IDEM_OK with `*found` set (`p`
 * filled for TAKEN, its status for SETTLED, its amount for MISMATCH), or
 * a store error. */
int idemd_settle_claim(idem_store_t *store, int refund, int64_t tenant_id, const char *id,
                       const idem_webhook_event_t *ev, int tell, int64_t lease_ms,
                       idemd_pending_t *p, idemd_claim_t *found);

/* Completes the record `rec` that a claim gave (its owner token ours), of
 * the resource stored as `body`, with the provider's answer `res`
 * (SUCCEEDED or DECLINED; anything else leaves it pending for the
 * reconciler): the record, so that replays answer 201 or 402; the
 * resource with what that answer makes of it (a refund also counts on its
 * payment, or gives its amount back); its outbox row removed; and the
 * audit row of the change by `who`. `also` (NULL, or fn NULL: none) runs
 * first in the same transaction, and its error undoes everything
 * (IDEM_EEXIST from a unique constraint). Completed records live
 * `ttl_ms`. Returns IDEM_OK with `*status` what replays get (202: still
 * pending); IDEM_ELOST when another owner took the record over since the
 * claim (nothing written); IDEM_EJSON when `body` cannot be read; a store
 * error. */
int idemd_settle(idem_store_t *store, const idem_record_t *rec, const char *body,
                 const idem_charge_result_t *res, const idemd_actor_t *who,
                 const idem_effect_t *also, int64_t ttl_ms, int *status);

/* Frees what a claim holds. */
void idemd_settle_reset(idemd_pending_t *p);

#endif
