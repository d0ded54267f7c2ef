/* The gateway's own table, beside libidem's records: the request of each
 * key whose outcome is not settled yet (processing or pending), so that a
 * gateway can send it again or take it over when the one that began it
 * died (docs/gateway.md, "Pending requests"). A row is written in the
 * transaction that wins the key and deleted in the one that completes
 * it; its versions are counted in the table `gateway_schema`, apart from
 * libidem's and idemd's. Version 2 adds the gateway's audit trail,
 * `gateway_audit` (data/audit.h). */
#ifndef IDEM_GATEWAY_REQUESTS_H
#define IDEM_GATEWAY_REQUESTS_H

#include <stdint.h>

#include "gateway/gateway.h"

#define GW_SCHEMA_VERSION 2
/* next_attempt_at of a request no gateway sends again. */
#define GW_NEVER INT64_MAX

/* Creates or upgrades the gateway's tables. Returns IDEM_OK, IDEM_ESCHEMA
 * when the database is newer than this program, or a store error; `err`
 * gets why. */
int gw_schema_migrate(idem_store_t *store, char *err, size_t errlen);

/* A request as kept: what goes to the upstream again. */
typedef struct gw_saved {
  idem_scope_t scope; /* points into `operation` and `key` */
  char operation[IDEM_OPERATION_MAX + 1];
  char key[IDEM_KEY_MAX + 1];
  char *request; /* gw_request_encode()'s text; malloc'd */
  int attempts;
  int64_t next_attempt_at;
} gw_saved_t;

/* The effect that keeps a won key's request: `text` under `scope`, due
 * (for a take-over) at the transaction's time plus `due_in_ms`. */
typedef struct gw_save {
  const idem_scope_t *scope;
  const char *text;
  int64_t due_in_ms;
} gw_save_t;
int gw_save_fn(void *arg, idem_tx_t *tx);

/* The effect that drops the request of `scope` (idem_scope_t *): its
 * record is completed or released. */
int gw_drop_fn(void *arg, idem_tx_t *tx);

/* The effect that drops the row `s` (gw_saved_t *) as gw_due_list() read
 * it, only if it is still that row: not one a request that won the key
 * since wrote. */
int gw_drop_listed_fn(void *arg, idem_tx_t *tx);

/* The effect that sets when the request of `scope` is next due, and its
 * attempts. */
typedef struct gw_due {
  const idem_scope_t *scope;
  int attempts;
  int64_t next_attempt_at; /* GW_NEVER: never */
} gw_due_t;
int gw_due_fn(void *arg, idem_tx_t *tx);

/* Reads up to `cap` requests due at `now_ms` (GW_NEVER: all of them),
 * the soonest due first, into `out` (`*n` of them; free each one's
 * `request`). Returns IDEM_OK or a store error. */
int gw_due_list(idem_store_t *store, int64_t now_ms, gw_saved_t *out, int cap, int *n);

/* Encodes a request to send again: method, target, the header lines sent
 * and the body, as JSON text (malloc'd), or NULL when out of memory. */
char *gw_request_encode(const char *method, const char *target, char *const *headers,
                        const char *body, size_t body_len);

/* Decodes gw_request_encode()'s `text`. On IDEM_OK the caller frees
 * `*method`, `*target`, `*body` and the lines of `*headers` (with
 * gw_free_lines()). */
int gw_request_decode(const char *text, char **method, char **target, char ***headers,
                      char **body, size_t *body_len);

#endif
