/* The refund command: validation of {"amount", "reason"} (the 422 rules of
 * docs/idempotency.md, section 4.5). No HTTP here. */
#ifndef IDEMD_REFUND_CMD_H
#define IDEMD_REFUND_CMD_H

#include <jansson.h>

#include "provider/refund.h" /* IDEM_REFUND_REASON_MAX */

/* Validates a refund command: `amount` absent or null (all that is left)
 * or a positive integer (as for a payment); `reason` absent or null, or a
 * string of at most IDEM_REFUND_REASON_MAX characters; nothing else. On
 * success returns 0 and `*cmd` owns the command with what was given,
 * {"amount": N, "reason": "..."}, the amount as an integer. On failure
 * returns -1, `*cmd` is NULL and `*errors` owns a JSON array of
 * {"field","message","code"} (empty, or NULL, when out of memory). */
int idemd_validate_refund(const json_t *body, json_t **cmd, json_t **errors);

#endif
