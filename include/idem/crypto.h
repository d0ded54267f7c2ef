/* Small wrappers over OpenSSL libcrypto: hashes, HMAC, random tokens and
 * constant-time comparison, with the lengths idem uses. */
#ifndef IDEM_CRYPTO_H
#define IDEM_CRYPTO_H

#include <stddef.h>
#include <stdint.h>

#include "idem/error.h"

#ifdef __cplusplus
extern "C" {
#endif

#define IDEM_SHA256_LEN 32
#define IDEM_SHA256_HEX_LEN 65

/* Writes the SHA-256 of `len` bytes at `data` to `out` (32 bytes).
 * Returns IDEM_OK or IDEM_ECRYPTO. */
IDEM_WARN_UNUSED int idem_sha256(const void *data, size_t len,
                                 unsigned char out[IDEM_SHA256_LEN]);

/* Writes HMAC-SHA256(key, data) to `out` (32 bytes). Returns IDEM_OK or
 * IDEM_ECRYPTO. */
IDEM_WARN_UNUSED int idem_hmac_sha256(const void *key, size_t key_len,
                                      const void *data, size_t len,
                                      unsigned char out[IDEM_SHA256_LEN]);

/* A keyed HMAC-SHA256, prepared once and used from many threads. */
typedef struct idem_hmac idem_hmac_t;

/* Prepares HMAC-SHA256 under `key` (copied). Returns NULL on failure.
 * Free with idem_hmac_free(). */
idem_hmac_t *idem_hmac_new(const void *key, size_t key_len);

/* Writes HMAC(key, data) to `out` (32 bytes). Safe to call from many
 * threads at once on one `h`. Returns IDEM_OK or IDEM_ECRYPTO. */
IDEM_WARN_UNUSED int idem_hmac_compute(const idem_hmac_t *h, const void *data,
                                       size_t len, unsigned char out[IDEM_SHA256_LEN]);

/* Frees `h`; NULL is fine. */
void idem_hmac_free(idem_hmac_t *h);

/* Fills `buf` with `len` bytes from the CSPRNG. Returns IDEM_OK or
 * IDEM_ECRYPTO (the buffer must then not be used). */
IDEM_WARN_UNUSED int idem_random_bytes(void *buf, size_t len);

/* Writes `nchars` random characters from [0-9a-v] (32 of them, 5 bits of
 * entropy each) followed by a NUL to `out` (which holds nchars + 1 bytes).
 * Returns IDEM_OK, or IDEM_ECRYPTO with `out` empty. */
IDEM_WARN_UNUSED int idem_random_token(char *out, size_t nchars);

/* Like idem_random_token(), but the first 10 of the `nchars` (> 10)
 * characters spell `ms` (milliseconds since the epoch, below 2^50), so
 * tokens made later sort after earlier ones, byte for byte. Resource ids
 * use it: each new row then lands at the end of its index instead of on a
 * random page, which a group commit would otherwise write in full. The
 * other characters are random (5 bits each). Returns IDEM_OK,
 * IDEM_EINVAL when `nchars` is 10 or less, or IDEM_ECRYPTO. */
IDEM_WARN_UNUSED int idem_sortable_token(char *out, size_t nchars, int64_t ms);

/* Writes the lowercase hex of `len` bytes to `out` (2 * len + 1 bytes). */
void idem_hex(const unsigned char *bytes, size_t len, char *out);

/* Compares `len` bytes in time independent of their contents; returns 1
 * when equal, 0 otherwise. */
int idem_ct_equal(const void *a, const void *b, size_t len);

#ifdef __cplusplus
}
#endif
#endif
