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
