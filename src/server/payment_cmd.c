/* The payment command: validation of {"amount", "currency", "order_id"},
 * its canonical command with defaults applied, and that command's bytes. */
#include "server/payment_cmd.h"

#include <string.h>

#include "server/fields.h"
#include "util/json_text.h"

int idemd_validate_payment_cmd(const json_t *body, idemd_payment_cmd_t *cmd,
                               json_t **errors_out) {
  static const char *const allowed[] = {"amount", "currency", "order_id", NULL};
  json_t *errors = json_array();
  const json_t *v;
  const char *cur;
  int64_t amount = 0;
  int ok = 1;

  memset(cmd, 0, sizeof *cmd);
  v = json_object_get(body, "amount");
  if (v == NULL || json_is_null(v)) {
    idemd__add_error(errors, "amount", "required", "is required");
    ok = 0;
  } else if (idemd__positive_int(v, "amount", errors, &amount) != 0) {
    ok = 0;
  }
  cur = idemd__currency(body, errors);
  ok = ok && cur != NULL;
  v = json_object_get(body, "order_id");
  if (v != NULL && !json_is_null(v) &&
      idemd__identifier(v, "order_id", IDEMD_ORDER_ID_MAX, errors) != 0)
    ok = 0;
  idemd__unknown_fields(body, allowed, "", errors);

  if (!ok || json_array_size(errors) > 0) {
    *errors_out = errors;
    return -1;
  }
  json_decref(errors);
  cmd->amount = amount;
  memcpy(cmd->currency, cur, 3); /* currency() let three letters through */
  if (v != NULL && !json_is_null(v))
    memcpy(cmd->order_id, json_string_value(v), json_string_length(v));
  *errors_out = NULL;
  return 0;
}

json_t *idemd_payment_cmd_json(const idemd_payment_cmd_t *cmd) {
  json_t *out = json_pack("{s:I, s:s}", "amount", (json_int_t)cmd->amount,
                          "currency", cmd->currency);

  if (out && cmd->order_id[0] != '\0' &&
      json_object_set_new(out, "order_id", json_string(cmd->order_id)) != 0) {
    json_decref(out);
    out = NULL;
  }
  return out;
}

int idemd_validate_payment(const json_t *body, json_t **cmd_out,
                           json_t **errors_out) {
  idemd_payment_cmd_t cmd;

  *cmd_out = NULL;
  if (idemd_validate_payment_cmd(body, &cmd, errors_out) != 0)
    return -1;
  if ((*cmd_out = idemd_payment_cmd_json(&cmd)) == NULL) {
    *errors_out = json_array(); /* out of memory, as a failed json_pack() was */
    return -1;
  }
  return 0;
}

_Static_assert(IDEMD_PAYMENT_CANON_MAX >=
                   sizeof "{\"amount\":,\"currency\":,\"order_id\":}" + IDEM_JSON_INT_MAX +
                       IDEM_JSON_STRING_MAX(3) + IDEM_JSON_STRING_MAX(IDEMD_ORDER_ID_MAX),
               "IDEMD_PAYMENT_CANON_MAX holds the longest payment command");

size_t idemd_payment_canon(const idemd_payment_cmd_t *cmd, char *out) {
  size_t n = IDEM_JSON_LIT(out, "{\"amount\":");

  /* Keys in bytewise order, as idem_canon_dump() sorts them; the values
   * are what the validator let through: digits, three capital letters,
   * visible ASCII (which idem__json_string() writes as jansson does). */
  n += idem__json_int(out + n, (long long)cmd->amount);
  n += IDEM_JSON_LIT(out + n, ",\"currency\":");
  n += idem__json_string(out + n, cmd->currency);
  if (cmd->order_id[0] != '\0') {
    n += IDEM_JSON_LIT(out + n, ",\"order_id\":");
    n += idem__json_string(out + n, cmd->order_id);
  }
  out[n++] = '}';
  out[n] = '\0';
  return n;
}
