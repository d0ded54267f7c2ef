/* The payment command: its validation (the 422 rules) and its canonical
 * form, whose fingerprint names the request. No HTTP here. */
#ifndef IDEMD_PAYMENT_CMD_H
#define IDEMD_PAYMENT_CMD_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

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
 * against the longest command in payment_cmd.c). */
#define IDEMD_PAYMENT_CANON_MAX 1664

/* Writes the canonical form of `cmd` to `out` (room for
 * IDEMD_PAYMENT_CANON_MAX bytes), NUL-terminated, and returns its length:
 * the same bytes as idem_canon_dump(idemd_payment_cmd_json(cmd)), without
 * building the JSON (tests/unit/test_validate.c, fuzz/fuzz_body.c), for
 * every command the validator gives (its strings are visible ASCII;
 * others would be written otherwise). */
size_t idemd_payment_canon(const idemd_payment_cmd_t *cmd, char *out);

#endif
