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

int idem_fingerprint(const char *operation, const json_t *command,
                     char hex[IDEM_FINGERPRINT_LEN]) {
  unsigned char digest[IDEM_SHA256_LEN];
  char *canon;
  size_t oplen, clen;
  char *buf;
  int rc;

  hex[0] = '\0';
  if (operation == NULL || command == NULL)
    return IDEM_EINVAL;
  canon = idem_canon_dump(command);
  if (canon == NULL)
    return IDEM_ENOMEM;
  oplen = strlen(operation);
  clen = strlen(canon);
  buf = malloc(oplen + 1 + clen);
  if (buf == NULL) {
    free(canon);
    return IDEM_ENOMEM;
  }
  memcpy(buf, operation, oplen);
  buf[oplen] = '\n';
  memcpy(buf + oplen + 1, canon, clen);
  rc = idem_sha256(buf, oplen + 1 + clen, digest);
  free(buf);
  free(canon);
  if (rc != IDEM_OK)
    return rc;
  idem_hex(digest, sizeof digest, hex);
  return IDEM_OK;
}
