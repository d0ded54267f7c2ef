/* The refund command (see refund_cmd.h). */
#include "server/refund_cmd.h"

#include <stddef.h>

#include "server/fields.h"

/* The number of UTF-8 characters of `s` (jansson gives valid UTF-8). */
static size_t characters(const char *s) {
  size_t n = 0;
  for (; *s; s++)
    n += ((unsigned char)*s & 0xc0) != 0x80;
  return n;
}

int idemd_validate_refund(const json_t *body, json_t **cmd_out, json_t **errors_out) {
  static const char *const allowed[] = {"amount", "reason", NULL};
  json_t *errors = json_array(), *cmd = json_object();
  const json_t *amount = json_object_get(body, "amount");
  const json_t *reason = json_object_get(body, "reason");
  int64_t want = 0;

  *cmd_out = NULL;
  if (amount && !json_is_null(amount) &&
      idemd__positive_int(amount, "amount", errors, &want) == 0)
    json_object_set_new(cmd, "amount", json_integer(want));
  if (reason && !json_is_null(reason)) {
    if (!json_is_string(reason))
      idemd__add_error(errors, "reason", "invalid_type", "must be a string");
    else if (characters(json_string_value(reason)) > IDEM_REFUND_REASON_MAX)
      idemd__add_error(errors, "reason", "too_long", "must be at most 200 characters");
    else
      json_object_set(cmd, "reason", (json_t *)reason);
  }
  idemd__unknown_fields(body, allowed, "", errors);
  if (errors == NULL || cmd == NULL || json_array_size(errors) > 0) {
    json_decref(cmd);
    *errors_out = errors;
    return -1;
  }
  json_decref(errors);
  *errors_out = NULL;
  *cmd_out = cmd;
  return 0;
}
