/* JSON text written directly (see json_text.h). */
#include "json_text.h"

#include <string.h>

size_t idem__json_string(char *out, const char *s) {
  static const char hex[] = "0123456789abcdef";
  size_t n = 0;

  out[n++] = '"';
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') {
      out[n++] = '\\';
      out[n++] = (char)c;
    } else if (c < 0x20) {
      memcpy(out + n, "\\u00", 4);
      out[n + 4] = hex[c >> 4];
      out[n + 5] = hex[c & 15];
      n += 6;
    } else {
      out[n++] = (char)c;
    }
  }
  out[n++] = '"';
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
