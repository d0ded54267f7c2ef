/* The audit trail (docs/operations.md, "The audit trail"): one row per
 * state change of a payment, refund or order, written in the transaction
 * that makes the change, so that a change and its row commit or roll back
 * together. A row holds the time, the tenant, the resource id, its state
 * before (NULL for a creation) and after, who made the change (a request
 * id, "reconciler", a provider event's id, "operator:NAME") and why.
 *
 * The gateway keeps a trail of the same rows in its own table,
 * `gateway_audit` (docs/gateway.md, "Resolving a pending key"), where the
 * resource is a key's record: its scope number, route and key. */
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

/* Inside a write: appends the gateway's row (table gateway_audit, made by
 * the gateway's schema, gateway/requests.h) of the change of the record of
 * `scope` (its scope number, route and key) from `from` to `to`. IDEM_OK
 * or IDEM_ESTORE. */
int idemd_audit_append_key(idem_tx_t *tx, const idem_scope_t *scope, const char *from,
                           const char *to, const idemd_actor_t *who);

/* One row as idemd_audit_list() or idemd_audit_list_keys() gives it.
 * Borrowed for the call. */
typedef struct idemd_audit_row {
  int64_t at_ms;
  const char *resource_id, *from, *to, *actor, *reason; /* from, reason may be NULL */
  /* The gateway's rows: the record's scope number and route (NULL in
   * idemd's); `resource_id` is then its key. */
  int64_t scope;
  const char *route;
} idemd_audit_row_t;

/* Gives `fn` each of tenant `tenant_id`'s rows (of resource `id` only,
 * unless NULL), oldest first, in one read; stops at the first error `fn`
 * returns, which this returns. IDEM_OK, or a store error. */
int idemd_audit_list(idem_store_t *store, int64_t tenant_id, const char *id,
                     int (*fn)(void *arg, const idemd_audit_row_t *row), void *arg);

/* Gives `fn` each of the gateway's rows (of key `key` only, under any
 * scope and route, unless NULL), oldest first, in one read; as
 * idemd_audit_list(). */
int idemd_audit_list_keys(idem_store_t *store, const char *key,
                          int (*fn)(void *arg, const idemd_audit_row_t *row), void *arg);

/* `row` as the one JSON line `idemd audit` and `idemd gateway audit`
 * print (without its newline): "at" (UTC, to the millisecond), then
 * "tenant" (`tenant`) and "resource" for idemd's rows, or "scope" (a
 * string: the number passes 2^53), "route" and "key" for the gateway's,
 * then "from" (null for a creation), "to", "actor" and "reason". Text
 * that is not UTF-8 is written with its bytes above 0x7f as \xNN.
 * Malloc'd (the caller frees it), or NULL when out of memory. */
char *idemd_audit_json(const idemd_audit_row_t *row, const char *tenant);

/* 1 when `s` may be written as an audit row's reason: 1 to `max_chars`
 * characters of UTF-8, none a control character (a row is printed back
 * as JSON, and SQLite would keep any bytes); else 0. */
int idemd_audit_text_valid(const char *s, int max_chars);

#endif
