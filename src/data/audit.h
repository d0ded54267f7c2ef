/* The audit trail (docs/operations.md, "The audit trail"): one row per
 * state change of a payment, refund or order, written in the transaction
 * that makes the change, so that a change and its row commit or roll back
 * together. A row holds the time, the tenant, the resource id, its state
 * before (NULL for a creation) and after, who made the change (a request
 * id, "reconciler", a provider event's id, "operator:NAME") and why. */
#ifndef IDEMD_AUDIT_H
#define IDEMD_AUDIT_H

#include <stdint.h>

#include "idem/store.h"

/* Who made a change and why. Borrowed. `actor` NULL is written as
 * "idemd"; `reason` may be NULL. */
typedef struct idemd_actor {
  const char *actor;
  const char *reason;
} idemd_actor_t;

/* Inside a write: appends the row of resource `id`'s change from `from`
 * (NULL: its creation) to `to`. IDEM_OK or IDEM_ESTORE. */
int idemd_audit_append(idem_tx_t *tx, int64_t tenant_id, const char *id, const char *from,
                       const char *to, const idemd_actor_t *who);

/* Inside a write, before the statement that sets resource `id`'s status to
 * `to`: appends the row of that change, from the status it has now, when
 * it is another (a payment left pending again changes nothing, and writes
 * nothing). IDEM_OK or IDEM_ESTORE. */
int idemd_audit_change(idem_tx_t *tx, int64_t tenant_id, const char *id, const char *to,
                       const idemd_actor_t *who);

/* One row as idemd_audit_list() gives it. Borrowed for the call. */
typedef struct idemd_audit_row {
  int64_t at_ms;
  const char *resource_id, *from, *to, *actor, *reason; /* from, reason may be NULL */
} idemd_audit_row_t;

/* Gives `fn` each of tenant `tenant_id`'s rows (of resource `id` only,
 * unless NULL), oldest first, in one read; stops at the first error `fn`
 * returns, which this returns. IDEM_OK, or a store error. */
int idemd_audit_list(idem_store_t *store, int64_t tenant_id, const char *id,
                     int (*fn)(void *arg, const idemd_audit_row_t *row), void *arg);

#endif
