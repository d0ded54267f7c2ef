/* Field rules shared by the payment and order commands (fields.c). Each
 * adds {"field","message","code"} to `errors` when it rejects a value. */
#ifndef IDEMD_FIELDS_H
#define IDEMD_FIELDS_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#define IDEMD_MAX_SAFE_INT 9007199254740991LL /* 2^53 - 1 */

void idemd__add_error(json_t *errors, const char *field, const char *code,
                      const char *message);

/* A positive integer in minor units: a JSON integer or a string of digits,
 * from 1 to 2^53 - 1. Returns 0 and sets `*out`, or adds an error. */
int idemd__positive_int(const json_t *v, const char *field, json_t *errors,
                        int64_t *out);

/* An identifier: a string of 1 to `max` visible ASCII characters. */
int idemd__identifier(const json_t *v, const char *field, size_t max,
                      json_t *errors);

/* `currency`: three upper-case letters; absent or null means BRL. */
const char *idemd__currency(const json_t *obj, json_t *errors);

/* Adds an error for each key of `obj` that is not in `allowed`. */
void idemd__unknown_fields(const json_t *obj, const char *const *allowed,
                           const char *prefix, json_t *errors);

#endif
