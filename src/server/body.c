/* The request body's pre-scan (nesting, out-of-range numbers) and its parse
 * into one JSON object, before any command is validated. */
#include "server/body.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Whether the number token `tok` (`len` bytes) is beyond what the parser
 * holds: an integer outside 64 bits, or a real that overflows a double. */
static int number_out_of_range(const char *tok, size_t len) {
  char small[64], *buf = small;
  int integer = memchr(tok, '.', len) == NULL && memchr(tok, 'e', len) == NULL &&
                memchr(tok, 'E', len) == NULL;
  size_t digits = len - (tok[0] == '-');
  int out;

  if (integer && digits > 40)
    return 1;
  /* A long real (a thousand digits before its point overflow a double
   * too) is read whole: the parser would call it invalid JSON (400). */
  if (len >= sizeof small && (buf = malloc(len + 1)) == NULL)
    return 0; /* the parser decides */
  memcpy(buf, tok, len);
  buf[len] = '\0';
  errno = 0;
  if (integer) {
    (void)strtoll(buf, NULL, 10);
    out = errno == ERANGE;
  } else {
    out = isinf(strtod(buf, NULL));
  }
  if (buf != small)
    free(buf);
  return out;
}

/* One pass over the body's text, outside its strings. Sets *too_deep when
 * an object or array opens deeper than IDEMD_MAX_DEPTH (the body itself is
 * depth 1), and then returns NULL at once: the parser, which recurses once
 * per level up to its own limit (2,048 in jansson), never sees such a body,
 * so a worker's stack holds at most 32 of its levels. Otherwise returns a
 * copy of the body with out-of-range numbers replaced by the
 * IDEMD_OUT_OF_RANGE markers (malloc'd, `*out_len` set), or NULL when
 * there are none (or no memory: the parser then reports the body). */
static char *scan_body(const char *body, size_t len, size_t *out_len, int *too_deep) {
  char *out = NULL;
  size_t n = 0, copied = 0;
  int in_string = 0, depth = 0;

  *too_deep = 0;

  for (size_t i = 0; i < len; i++) {
    char c = body[i];
    size_t j;
    if (in_string) {
      if (c == '\\')
        i++;
      else if (c == '"')
        in_string = 0;
      continue;
    }
    if (c == '"') {
      in_string = 1;
      continue;
    }
    if (c == '{' || c == '[') {
      if (++depth > IDEMD_MAX_DEPTH) {
        free(out);
        *too_deep = 1;
        return NULL;
      }
      continue;
    }
    if (c == '}' || c == ']') {
      depth--;
      continue;
    }
    if (c != '-' && (c < '0' || c > '9'))
      continue;
    for (j = i; j < len && body[j] && strchr("0123456789+-.eE", body[j]); j++)
      ;
    if (number_out_of_range(body + i, j - i)) {
      const char *mark = c == '-' ? "\"\\u0001-out of range\"" : "\"\\u0001out of range\"";
      size_t mlen = strlen(mark);
      char *grown = realloc(out, n + (i - copied) + mlen + (len - j) + 1);
      if (grown == NULL) {
        free(out);
        return NULL;
      }
      out = grown;
      memcpy(out + n, body + copied, i - copied);
      n += i - copied;
      memcpy(out + n, mark, mlen);
      n += mlen;
      copied = j;
    }
    i = j - 1;
  }
  if (out == NULL)
    return NULL;
  memcpy(out + n, body + copied, len - copied);
  n += len - copied;
  out[n] = '\0';
  *out_len = n;
  return out;
}

int idemd_parse_body(const char *body, size_t len, json_t **out,
                     int *out_of_range, const char **msg) {
  json_error_t err;
  json_t *v;
  size_t marked_len = 0;
  int too_deep;
  char *marked;

  *out = NULL;
  *out_of_range = 0;
  if (len == 0) {
    *msg = "request body must be a JSON object";
    return -1;
  }
  marked = scan_body(body, len, &marked_len, &too_deep);
  if (too_deep) {
    *msg = "request body nests deeper than 32 levels";
    return -1;
  }
  if (marked) {
    *out_of_range = 1;
    body = marked;
    len = marked_len;
  }
  v = json_loadb(body, len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &err);
  free(marked);
  if (v == NULL) {
    switch (json_error_code(&err)) {
    case json_error_duplicate_key:
      *msg = "request body has a duplicate key";
      break;
    case json_error_invalid_utf8:
      *msg = "request body is not valid UTF-8";
      break;
    case json_error_null_character:
    case json_error_null_byte_in_key:
      *msg = "request body contains a NUL character";
      break;
    case json_error_stack_overflow: /* scan_body() stops these first */
      *msg = "request body nests deeper than 32 levels";
      break;
    default:
      *msg = "request body is not valid JSON";
    }
    return -1;
  }
  if (!json_is_object(v)) {
    json_decref(v);
    *msg = "request body must be a JSON object";
    return -1;
  }
  *out = v;
  return 0;
}
