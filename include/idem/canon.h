/* Canonical JSON and request fingerprints (docs/idempotency.md, section 2.3).
 * The canonical form is compact, keys sorted bytewise, non-ASCII escaped:
 * two commands that mean the same serialise to the same bytes. */
#ifndef IDEM_CANON_H
#define IDEM_CANON_H

#include <jansson.h>

#include "idem/error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 64 hex digits and a NUL. */
#define IDEM_FINGERPRINT_LEN 65

/* Returns the canonical serialisation of `value` as a NUL-terminated string
 * that the caller frees with free(), or NULL when out of memory. `value`
 * should hold no reals (validated commands use integers and strings). */
char *idem_canon_dump(const json_t *value);

/* Computes the fingerprint of a validated command: the lowercase hex
 * SHA-256 of `operation`, a newline, and idem_canon_dump(command).
 * Writes it to `hex` and returns IDEM_OK, or IDEM_EINVAL (`operation` or
 * `command` NULL), IDEM_ENOMEM or IDEM_ECRYPTO (then `hex` is an empty
 * string). */
IDEM_WARN_UNUSED int idem_fingerprint(const char *operation,
                                      const json_t *command,
                                      char hex[IDEM_FINGERPRINT_LEN]);

/* The same fingerprint from a command already in canonical form: the
 * `len` bytes at `canon` (no NUL needed; only those are read) stand for
 * idem_canon_dump(command). Returns IDEM_OK, IDEM_EINVAL (`operation` or
 * `canon` NULL), IDEM_ENOMEM or IDEM_ECRYPTO (then `hex` is an empty
 * string). */
IDEM_WARN_UNUSED int idem_fingerprint_text(const char *operation,
                                           const char *canon, size_t len,
                                           char hex[IDEM_FINGERPRINT_LEN]);

#ifdef __cplusplus
}
#endif
#endif
