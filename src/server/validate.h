/* Request bodies of idemd: parsing into a JSON object (the 400 rules of
 * docs/idempotency.md, section 3.2) and validation of each command (the 422
 * rules of section 3.3), producing the canonical command whose fingerprint
 * names the request. No HTTP here. */
#ifndef IDEMD_VALIDATE_H
#define IDEMD_VALIDATE_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#define IDEMD_MAX_DEPTH 32
#define IDEMD_MAX_SAFE_INT 9007199254740991LL /* 2^53 - 1 */
#define IDEMD_MAX_ITEMS 100

/* Marks a number too large for any field: a number in the body that the
 * parser cannot hold (beyond 64-bit integers or doubles) is replaced by
 * this string before parsing, so validators can name its field in a 422
 * instead of the whole body failing as "not JSON". */
#define IDEMD_OUT_OF_RANGE "\x01out of range"
#define IDEMD_OUT_OF_RANGE_NEG "\x01-out of range"

/* Parses `len` bytes at `body` as one JSON object: no duplicate keys,
 * valid UTF-8, nesting at most IDEMD_MAX_DEPTH (checked on the text
 * first, so a deeper body is refused as such even when it is not valid
 * JSON, and the parser never recurses deeper). On success returns 0,
 * `*out` owns the object (json_decref it) and `*out_of_range` tells
 * whether some number was replaced by IDEMD_OUT_OF_RANGE(_NEG). On failure
 * returns -1, `*out` is NULL and `*msg` is a static text fit for a 400
 * body. */
int idemd_parse_body(const char *body, size_t len, json_t **out,
                     int *out_of_range, const char **msg);

/* The longest order_id a payment may name. */
#define IDEMD_ORDER_ID_MAX 255

/* A validated payment command. */
typedef struct idemd_payment_cmd {
  int64_t amount;                      /* 1 to 2^53 - 1 */
  char currency[4];                    /* three capital letters; "BRL" by default */
  char order_id[IDEMD_ORDER_ID_MAX + 1]; /* visible ASCII; "" when not given */
} idemd_payment_cmd_t;

/* Validates a payment command `{"amount", "currency", "order_id"}`. On
 * success returns 0 and fills `*cmd` (amount as an integer, currency
 * defaulted to "BRL", order_id empty unless given). On failure returns -1,
 * `*cmd` is zeroed and `*errors` owns a JSON array of
 * {"field","message","code"} in field order. */
int idemd_validate_payment_cmd(const json_t *body, idemd_payment_cmd_t *cmd,
                               json_t **errors);

/* The same, giving the canonical command as JSON: `*cmd` owns
 * {"amount", "currency"[, "order_id" when given]}, NULL on failure (then
 * `*errors` owns the errors: an empty array, or NULL, when out of
 * memory). */
int idemd_validate_payment(const json_t *body, json_t **cmd, json_t **errors);

/* The command `cmd` as JSON, as idemd_validate_payment() gives it; NULL
 * when out of memory. */
json_t *idemd_payment_cmd_json(const idemd_payment_cmd_t *cmd);

/* Room for what idemd_payment_canon() writes, its NUL included (checked
 * against the longest command in validate.c). */
#define IDEMD_PAYMENT_CANON_MAX 1664

/* Writes the canonical form of `cmd` to `out` (room for
 * IDEMD_PAYMENT_CANON_MAX bytes), NUL-terminated, and returns its length:
 * the same bytes as idem_canon_dump(idemd_payment_cmd_json(cmd)), without
 * building the JSON (tests/unit/test_validate.c, fuzz/fuzz_body.c), for
 * every command the validator gives (its strings are visible ASCII;
 * others would be written otherwise). */
size_t idemd_payment_canon(const idemd_payment_cmd_t *cmd, char *out);

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
