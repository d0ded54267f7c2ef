/* idemd's own rows beside the idempotency records: payments, orders and
 * refunds (the `resources` table) and the outbox, which orders each
 * charge or refund until its outcome is known (docs/idempotency.md,
 * section 4).
 * They are written through the engine's effects, in the transaction that
 * reserves or completes a key, and read with idem_store_read(): libidem
 * keeps the records, idemd its own rows, on SQLite and PostgreSQL alike. */
#ifndef IDEMD_RESOURCES_H
#define IDEMD_RESOURCES_H

#include <stdint.h>

#include "data/audit.h"
#include "idem/record.h"
#include "idem/store.h"

/* A payment or an order, as a reservation writes it. Borrowed. */
typedef struct idemd_resource {
  int64_t tenant_id;
  const char *kind;         /* "payment", "order", "refund" */
  const char *id;           /* "pay_...", "ord_...", "re_...": a tenant's, unique
                               across kinds */
  const char *status;       /* "pending", "created", ... */
  const char *body;         /* the resource as a JSON object */
  const char *provider_ref; /* may be NULL */
  /* A payment's or refund's outbox row, when `operation` is set: the record's scope
   * (operation, key) whose charge it orders, first due `due_after_ms`
   * after the write (the record's lease: before that its owner is at
   * work on it). */
  const char *operation, *key;
  int64_t due_after_ms;
  idemd_actor_t who; /* the creation's audit row: the request's id */
} idemd_resource_t;

/* An effect's function (idem_effect_t.fn) with `arg` an idemd_resource_t:
 * inserts the resource, its outbox row and the audit row of its creation.
 * IDEM_EEXIST when the id is taken; IDEM_ESTORE on any other failure. */
int idemd_resource_insert(void *arg, idem_tx_t *tx);

/* Writes a tenant's order under the id its client chose (`row`, kind
 * "order", no outbox row) unless the tenant has a resource of that id:
 * one statement decides, by the unique key (tenant, id), never a read
 * first (docs/idempotency.md, section 3.5), with the audit row of its
 * creation. IDEM_OK when this call made it
 * (`*existing` NULL); IDEM_EEXIST when the id was taken, `*existing` then
 * the order stored under it, malloc'd for the caller to free (NULL when
 * the id holds no order); a store error otherwise. */
int idemd_order_put(idem_store_t *store, const idemd_resource_t *row, char **existing);

/* Sets a tenant's order cancelled, stamped with the write's time, unless
 * it is cancelled already, in one statement (with the audit row of the
 * change, by `who`, when it made one), and reads it back in the
 * same write: `*body` (malloc'd, the caller frees it) is the order as it
 * then stands, so every cancellation of an order answers the first one's
 * cancelled_at; `*changed` is 1 when this call cancelled it.
 * IDEM_ENOTFOUND when the tenant has no order `id`; a store error
 * otherwise. */
int idemd_order_cancel(idem_store_t *store, int64_t tenant_id, const char *id,
                       const idemd_actor_t *who, char **body, int *changed);

/* What a completion changes in a payment. Borrowed. */
typedef struct idemd_resource_update {
  int64_t tenant_id;
  const char *id;
  const char *status, *body, *provider_ref; /* NULL: keep */
  /* The record's new state: its outbox row is removed, unless PENDING,
   * which makes it due at once for the reconciler. */
  idem_state_t state;
  idemd_actor_t who; /* the audit row's, when the status changes */
} idemd_resource_update_t;

/* An effect's function with `arg` an idemd_resource_update_t, run with the
 * completion: the audit row of a change of status (none when it stays),
 * the resource, its outbox row. IDEM_ESTORE on failure. */
int idemd_resource_update(void *arg, idem_tx_t *tx);

/* Reads a tenant's resource of `kind` by id; `*body` gets a malloc'd JSON
 * document the caller frees. IDEM_ENOTFOUND for an unknown id, one of
 * another kind or of another tenant; a store error otherwise. */
int idemd_resource_get(idem_store_t *store, int64_t tenant_id, const char *kind,
                       const char *id, char **body);

/* Claims up to `max` payments for the reconciler: the records of the
 * outbox rows that are due, each taken over (idem_tx_take_over()) under a
 * new owner token and a lease of `lease_ms`, so that a worker that died or
 * a charge left pending is settled once. Rows whose record is held under a
 * live lease are skipped. Every row looked at goes to the back of the
 * queue, so that one the provider cannot settle yet does not keep the
 * others out. `out` (an array of `max`, zeroed) gets the records, each
 * with its payment's id in resource_id; `*n` their number. Reset each
 * record after use. Several idemd instances may claim at once
 * (PostgreSQL): each row goes to one of them. */
int idemd_outbox_claim(idem_store_t *store, int64_t lease_ms, int max, idem_record_t *out,
                       int *n);

/* Counts, for tests and tools, a tenant's (0: all tenants') "payments",
 * "orders", "refunds" or "outbox" rows. IDEM_EINVAL for anything else. */
int idemd_resource_count(idem_store_t *store, const char *what, int64_t tenant_id,
                         int64_t *n);

#endif
