/* The request body's pre-scan and parse into a JSON object (the 400 rules
 * of docs/idempotency.md, section 3.2): nesting counted on the text before
 * jansson sees it, out-of-range numbers marked for the validators. */
#ifndef IDEMD_BODY_H
#define IDEMD_BODY_H

#include <jansson.h>
#include <stddef.h>

#define IDEMD_MAX_DEPTH 32

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

#endif
