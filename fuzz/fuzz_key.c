/* Fuzz target for idem_key_parse (the Idempotency-Key header rules of
 * docs/idempotency.md, section 2.1). Properties: an accepted key is 1 to 255
 * visible ASCII characters; written as a structured-field string it parses back
 * to itself; an unquoted key is the trimmed input unchanged; blanks around the
 * value never change the outcome; a rejected value leaves an empty key and one
 * of the documented error codes. */
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "idem/key.h"

static int is_blank(char c) { return c == ' ' || c == '\t'; }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const char *raw = (const char *)data;
  char key[IDEM_KEY_MAX + 1], again[IDEM_KEY_MAX + 1];
  char quoted[2 * IDEM_KEY_MAX + 3];
  size_t len = 99, len2 = 99, q = 0;
  char *padded;
  int rc, rc2;

  memset(key, 'x', sizeof key);
  rc = idem_key_parse(raw, size, key, &len);

  /* Blanks around the value are trimmed: adding more changes nothing. */
  padded = malloc(size + 4);
  FUZZ_CHECK(padded != NULL, "out of memory");
  memcpy(padded, " \t", 2);
  if (size)
    memcpy(padded + 2, raw, size);
  memcpy(padded + 2 + size, "\t ", 2);
  memset(again, 'y', sizeof again);
  rc2 = idem_key_parse(padded, size + 4, again, &len2);
  free(padded);
  FUZZ_CHECK(rc2 == rc, "padding with blanks changed the result: %d -> %d", rc, rc2);

  if (rc != IDEM_OK) {
    FUZZ_CHECK(rc == IDEM_EKEY_MISSING || rc == IDEM_EKEY_TOO_LONG ||
                   rc == IDEM_EKEY_BAD_CHAR || rc == IDEM_EKEY_BAD_QUOTE,
               "undocumented error code %d", rc);
    FUZZ_CHECK(key[0] == '\0', "a rejected key left \"%.40s\" in out", key);
    FUZZ_CHECK(len == 0, "a rejected key has length %zu", len);
    return 0;
  }

  FUZZ_CHECK(len >= 1 && len <= IDEM_KEY_MAX, "accepted key of length %zu", len);
  FUZZ_CHECK(key[len] == '\0' && strlen(key) == len, "length %zu, strlen %zu", len,
             strlen(key));
  for (size_t i = 0; i < len; i++)
    FUZZ_CHECK((unsigned char)key[i] >= 0x21 && (unsigned char)key[i] <= 0x7e,
               "byte 0x%02x at %zu of an accepted key", (unsigned char)key[i], i);
  FUZZ_CHECK(len2 == len && memcmp(again, key, len + 1) == 0,
             "padding with blanks changed the key");

  /* An unquoted value is the key itself, once trimmed. */
  {
    size_t b = 0, e = size;
    while (b < e && is_blank(raw[b]))
      b++;
    while (e > b && is_blank(raw[e - 1]))
      e--;
    if (raw[b] != '"')
      FUZZ_CHECK(e - b == len && memcmp(raw + b, key, len) == 0,
                 "unquoted value changed: \"%.*s\" -> \"%s\"", (int)(e - b), raw + b, key);
  }

  /* Quoting the key as a structured-field string gives it back. */
  quoted[q++] = '"';
  for (size_t i = 0; i < len; i++) {
    if (key[i] == '"' || key[i] == '\\')
      quoted[q++] = '\\';
    quoted[q++] = key[i];
  }
  quoted[q++] = '"';
  memset(again, 'z', sizeof again);
  rc2 = idem_key_parse(quoted, q, again, &len2);
  FUZZ_CHECK(rc2 == IDEM_OK, "quoted key %.*s rejected: %d", (int)q, quoted, rc2);
  FUZZ_CHECK(len2 == len && memcmp(again, key, len + 1) == 0,
             "quoted key %.*s parsed as \"%s\", want \"%s\"", (int)q, quoted, again, key);
  return 0;
}
