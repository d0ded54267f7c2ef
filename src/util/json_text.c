/* JSON text written directly (see json_text.h). */
#include "json_text.h"

#include <string.h>

/* Writes to `out` (room for 6 bytes) the escape of `c`, a byte that is
 * not written as itself, and returns its length. */
static size_t escape(char *out, unsigned char c) {
  static const char hex[] = "0123456789abcdef";

  if (c == '"' || c == '\\') {
    out[0] = '\\';
    out[1] = (char)c;
    return 2;
  }
  memcpy(out, "\\u00", 4);
  out[4] = hex[c >> 4];
  out[5] = hex[c & 15];
  return 6;
}

size_t idem__json_string(char *out, const char *s) {
  size_t n = 0;

  out[n++] = '"';
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\' || c < 0x20)
      n += escape(out + n, c);
    else
      out[n++] = (char)c;
  }
  out[n++] = '"';
  return n;
}

size_t idem__json_escape_ascii(char *out, size_t cap, const char *s) {
  size_t n = 0;

  for (; *s && n < cap; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\' || c < 0x20 || c > 0x7e) {
      char esc[6];
      size_t k = escape(esc, c);
      if (k > cap - n)
        k = cap - n;
      memcpy(out + n, esc, k);
      n += k;
    } else {
      out[n++] = (char)c;
    }
  }
  return n;
}

size_t idem__json_int(char *out, long long v) {
  char digits[IDEM_JSON_INT_MAX];
  size_t n = 0, len = 0;
  /* The magnitude in unsigned arithmetic, where -LLONG_MIN fits. */
  unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;

  do {
    digits[n++] = (char)('0' + u % 10);
    u /= 10;
  } while (u > 0);
  if (v < 0)
    out[len++] = '-';
  while (n > 0)
    out[len++] = digits[--n];
  return len;
}
