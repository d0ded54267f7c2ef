/* Field rules shared by the payment and order commands: each rejection
 * names the field and a stable code in the 422's error array. */
#include "server/fields.h"

#include <stdio.h>
#include <string.h>

#include "server/body.h"

void idemd__add_error(json_t *errors, const char *field, const char *code,
                      const char *message) {
  json_array_append_new(errors, json_pack("{s:s, s:s, s:s}", "field", field,
                                          "message", message, "code", code));
}

static int visible_ascii(const char *s, size_t len) {
  for (size_t i = 0; i < len; i++)
    if ((unsigned char)s[i] < 0x21 || (unsigned char)s[i] > 0x7e)
      return 0;
  return 1;
}

/* A positive integer in minor units: a JSON integer or a string of digits,
 * from 1 to 2^53 - 1. Returns 0 and sets `*out`, or adds an error. */
int idemd__positive_int(const json_t *v, const char *field, json_t *errors,
                        int64_t *out) {
  if (json_is_integer(v)) {
    json_int_t n = json_integer_value(v);
    if (n <= 0) {
      idemd__add_error(errors, field, "not_positive", "must be a positive integer");
      return -1;
    }
    if (n > IDEMD_MAX_SAFE_INT) {
      idemd__add_error(errors, field, "too_large", "must be at most 9007199254740991");
      return -1;
    }
    *out = n;
    return 0;
  }
  if (json_is_string(v)) {
    const char *s = json_string_value(v);
    size_t len = json_string_length(v);
    int64_t n = 0;
    if (strcmp(s, IDEMD_OUT_OF_RANGE) == 0) {
      idemd__add_error(errors, field, "too_large", "must be at most 9007199254740991");
      return -1;
    }
    if (strcmp(s, IDEMD_OUT_OF_RANGE_NEG) == 0) {
      idemd__add_error(errors, field, "not_positive", "must be a positive integer");
      return -1;
    }
    if (len == 0 || strspn(s, "0123456789") != len) {
      idemd__add_error(errors, field, "not_integer",
                "must be a positive integer or a string of digits");
      return -1;
    }
    for (size_t i = 0; i < len; i++) {
      n = n * 10 + (s[i] - '0');
      if (n > IDEMD_MAX_SAFE_INT) {
        idemd__add_error(errors, field, "too_large", "must be at most 9007199254740991");
        return -1;
      }
    }
    if (n == 0) {
      idemd__add_error(errors, field, "not_positive", "must be a positive integer");
      return -1;
    }
    *out = n;
    return 0;
  }
  if (json_is_real(v)) {
    idemd__add_error(errors, field, "not_integer",
              "must be an integer, without a fraction or exponent");
    return -1;
  }
  idemd__add_error(errors, field, "invalid_type",
            "must be a positive integer or a string of digits");
  return -1;
}

/* An identifier: a string of 1 to `max` visible ASCII characters. */
int idemd__identifier(const json_t *v, const char *field, size_t max,
                      json_t *errors) {
  char message[80];
  if (!json_is_string(v)) {
    idemd__add_error(errors, field, "invalid_type", "must be a string");
    return -1;
  }
  if (json_string_length(v) == 0) {
    idemd__add_error(errors, field, "empty", "must not be empty");
    return -1;
  }
  if (json_string_length(v) > max) {
    snprintf(message, sizeof message, "must be at most %zu characters", max);
    idemd__add_error(errors, field, "too_long", message);
    return -1;
  }
  if (!visible_ascii(json_string_value(v), json_string_length(v))) {
    idemd__add_error(errors, field, "invalid_format",
              "must be visible ASCII characters, without spaces");
    return -1;
  }
  return 0;
}

/* `currency`: three upper-case letters; absent or null means BRL. */
const char *idemd__currency(const json_t *obj, json_t *errors) {
  const json_t *v = json_object_get(obj, "currency");
  const char *s;
  if (v == NULL || json_is_null(v))
    return "BRL";
  if (!json_is_string(v)) {
    idemd__add_error(errors, "currency", "invalid_type", "must be a string");
    return NULL;
  }
  s = json_string_value(v);
  if (json_string_length(v) != 3 || strspn(s, "ABCDEFGHIJKLMNOPQRSTUVWXYZ") != 3) {
    idemd__add_error(errors, "currency", "invalid_format",
              "must be three upper-case letters (ISO 4217)");
    return NULL;
  }
  return s;
}

/* Adds an error for each key of `obj` that is not in `allowed`. */
void idemd__unknown_fields(const json_t *obj, const char *const *allowed,
                           const char *prefix, json_t *errors) {
  const char *k;
  json_t *v;
  json_object_foreach((json_t *)obj, k, v) {
    int known = 0;
    char field[300];
    for (const char *const *a = allowed; *a && !known; a++)
      known = strcmp(*a, k) == 0;
    if (known)
      continue;
    snprintf(field, sizeof field, "%s%.256s", prefix, k);
    idemd__add_error(errors, field, "unknown_field", "is not a known field");
  }
}
