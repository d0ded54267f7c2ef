/* Canonical JSON (compact, sorted keys, ASCII) and the SHA-256 fingerprint
 * of a validated command. */
#include "idem/canon.h"

#include <stdlib.h>
#include <string.h>

#include "idem/crypto.h"

#define CANON_FLAGS (JSON_COMPACT | JSON_SORT_KEYS | JSON_ENSURE_ASCII | JSON_ENCODE_ANY | JSON_REAL_PRECISION(17))

char *idem_canon_dump(const json_t *value) {
  if (value == NULL)
    return NULL;
  return json_dumps(value, CANON_FLAGS);
}

int idem_fingerprint_text(const char *operation, const char *canon, size_t len,
                          char hex[IDEM_FINGERPRINT_LEN]) {
  unsigned char digest[IDEM_SHA256_LEN];
  char stack[2048], *buf = stack;
  size_t oplen;
  int rc;

  hex[0] = '\0';
  if (operation == NULL || canon == NULL)
    return IDEM_EINVAL;
  oplen = strlen(operation);
  /* A payment's command fits on the stack; an order's may not. */
  if (oplen + 1 + len > sizeof stack && (buf = malloc(oplen + 1 + len)) == NULL)
    return IDEM_ENOMEM;
  memcpy(buf, operation, oplen);
  buf[oplen] = '\n';
  memcpy(buf + oplen + 1, canon, len);
  rc = idem_sha256(buf, oplen + 1 + len, digest);
  if (buf != stack)
    free(buf);
  if (rc != IDEM_OK)
    return rc;
  idem_hex(digest, sizeof digest, hex);
  return IDEM_OK;
}

int idem_fingerprint(const char *operation, const json_t *command,
                     char hex[IDEM_FINGERPRINT_LEN]) {
  char *canon;
  int rc;

  hex[0] = '\0';
  if (operation == NULL || command == NULL)
    return IDEM_EINVAL;
  if ((canon = idem_canon_dump(command)) == NULL)
    return IDEM_ENOMEM;
  rc = idem_fingerprint_text(operation, canon, strlen(canon), hex);
  free(canon);
  return rc;
}
