/* The order command: its validation (the 422 rules), its canonical form and
 * the order it creates as JSON. No HTTP here. */
#ifndef IDEMD_ORDER_CMD_H
#define IDEMD_ORDER_CMD_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#define IDEMD_MAX_ITEMS 100


/* Validates an order command `{"customer_id", "items", "currency"}` the same
 * way; on success also sets `*total` (sum of quantity * unit_price). */
int idemd_validate_order(const json_t *body, json_t **cmd, json_t **errors,
                         int64_t *total);

/* Writes the order that a command from idemd_validate_order() makes, as
 * JSON text: {"id", "customer_id", "items", "currency", "total", "status":
 * "created", "created_at"}, the same bytes as json_dumps(JSON_COMPACT) of
 * that object (tests/unit/test_validate.c), without building it.
 * Returns a string to free(), or NULL when out of memory or when `cmd` is
 * not such a command. */
char *idemd_order_json(const json_t *cmd, const char *id, int64_t total,
                       const char *created_at);

/* Writes the canonical form of an order command from
 * idemd_validate_order(): the same bytes as idem_canon_dump(cmd), without
 * sorting and dumping it (tests/unit/test_validate.c, fuzz/fuzz_body.c;
 * its strings are visible ASCII, others would be written otherwise).
 * Returns a string to free() and sets `*len` to its length, or NULL when
 * out of memory or when `cmd` is not shaped as such a command. */
char *idemd_order_canon(const json_t *cmd, size_t *len);

#endif
