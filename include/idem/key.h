/* Idempotency-Key header values: the rules of docs/idempotency.md, section 2.1. */
#ifndef IDEM_KEY_H
#define IDEM_KEY_H

#include <stddef.h>

#include "idem/error.h"

#ifdef __cplusplus
extern "C" {
#endif

#define IDEM_KEY_MAX 255

/* Parses the raw header value `raw` (`len` bytes; NULL means the header is
 * absent). Spaces and tabs around it are trimmed; a value written as a
 * structured-field string ("abc", with \" and \\ escapes) is unquoted. What
 * remains must be 1 to IDEM_KEY_MAX visible ASCII characters (0x21-0x7E).
 *
 * On success writes the NUL-terminated key to `out` (which must hold
 * IDEM_KEY_MAX + 1 bytes), its length to `*out_len`, and returns IDEM_OK.
 * Otherwise returns IDEM_EKEY_MISSING (absent, empty, blanks only),
 * IDEM_EKEY_TOO_LONG, IDEM_EKEY_BAD_CHAR or IDEM_EKEY_BAD_QUOTE, and `out`
 * holds an empty string. */
IDEM_WARN_UNUSED int idem_key_parse(const char *raw, size_t len,
                                    char out[IDEM_KEY_MAX + 1],
                                    size_t *out_len);

#ifdef __cplusplus
}
#endif
#endif
