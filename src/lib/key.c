/* Idempotency-Key parsing: trim, unquote a structured-field string, check
 * the alphabet and the length. */
#include "idem/key.h"

static int is_blank(char c) { return c == ' ' || c == '\t'; }
static int is_visible(unsigned char c) { return c >= 0x21 && c <= 0x7e; }

int idem_key_parse(const char *raw, size_t len, char out[IDEM_KEY_MAX + 1],
                   size_t *out_len) {
  size_t n = 0;

  out[0] = '\0';
  if (out_len)
    *out_len = 0;
  if (raw == NULL)
    return IDEM_EKEY_MISSING;
  while (len > 0 && is_blank(raw[0])) {
    raw++;
    len--;
  }
  while (len > 0 && is_blank(raw[len - 1]))
    len--;
  if (len == 0)
    return IDEM_EKEY_MISSING;

  if (raw[0] == '"') {
    /* RFC 8941 sf-string: DQUOTE *( %x20-21 / %x23-5B / %x5D-7E / "\" ( DQUOTE / "\" ) ) DQUOTE */
    if (len < 2 || raw[len - 1] != '"')
      return IDEM_EKEY_BAD_QUOTE;
    /* Every error below empties `out`, as the contract says. */
    for (size_t i = 1; i < len - 1; i++) {
      unsigned char c = (unsigned char)raw[i];
      if (c == '\\') {
        if (i + 1 >= len - 1 || (raw[i + 1] != '"' && raw[i + 1] != '\\')) {
          out[0] = '\0';
          return IDEM_EKEY_BAD_QUOTE;
        }
        c = (unsigned char)raw[++i];
      } else if (c == '"') {
        out[0] = '\0';
        return IDEM_EKEY_BAD_QUOTE;
      } else if (c < 0x20 || c > 0x7e) {
        out[0] = '\0';
        return IDEM_EKEY_BAD_CHAR;
      }
      if (!is_visible(c)) {
        out[0] = '\0';
        return IDEM_EKEY_BAD_CHAR;
      }
      if (n == IDEM_KEY_MAX) {
        out[0] = '\0';
        return IDEM_EKEY_TOO_LONG;
      }
      out[n++] = (char)c;
    }
  } else {
    for (size_t i = 0; i < len; i++) {
      unsigned char c = (unsigned char)raw[i];
      if (!is_visible(c)) {
        out[0] = '\0';
        return IDEM_EKEY_BAD_CHAR;
      }
      if (n == IDEM_KEY_MAX) {
        out[0] = '\0';
        return IDEM_EKEY_TOO_LONG;
      }
      out[n++] = (char)c;
    }
  }
  if (n == 0)
    return IDEM_EKEY_MISSING;
  out[n] = '\0';
  if (out_len)
    *out_len = n;
  return IDEM_OK;
}
