/* libcrypto wrappers: SHA-256, HMAC-SHA256, random bytes and tokens,
 * constant-time comparison. */
#include "idem/crypto.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <pthread.h>

/* OpenSSL 3 looks an algorithm up in its providers on every implicit use
 * (EVP_sha256() in a one-shot call); fetching it once saves that work on
 * every request. */
static EVP_MD *sha256_md;
static pthread_once_t sha256_once = PTHREAD_ONCE_INIT;

static void fetch_sha256(void) { sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL); }

static const EVP_MD *sha256(void) {
  pthread_once(&sha256_once, fetch_sha256);
  return sha256_md ? sha256_md : EVP_sha256();
}

int idem_sha256(const void *data, size_t len, unsigned char out[IDEM_SHA256_LEN]) {
  unsigned int n = 0;
  if (EVP_Digest(data, len, out, &n, sha256(), NULL) != 1 || n != IDEM_SHA256_LEN)
    return IDEM_ECRYPTO;
  return IDEM_OK;
}

int idem_hmac_sha256(const void *key, size_t key_len, const void *data, size_t len,
                     unsigned char out[IDEM_SHA256_LEN]) {
  unsigned int n = 0;
  if (HMAC(sha256(), key, (int)key_len, data, len, out, &n) == NULL ||
      n != IDEM_SHA256_LEN)
    return IDEM_ECRYPTO;
  return IDEM_OK;
}

int idem_random_bytes(void *buf, size_t len) {
  if (len > 0x7fffffff || RAND_bytes(buf, (int)len) != 1)
    return IDEM_ECRYPTO;
  return IDEM_OK;
}

int idem_random_token(char *out, size_t nchars) {
  static const char alphabet[] = "0123456789abcdefghijklmnopqrstuv";
  unsigned char raw[128];
  size_t done = 0;

  while (done < nchars) {
    size_t chunk = nchars - done < sizeof raw ? nchars - done : sizeof raw;
    if (idem_random_bytes(raw, chunk) != IDEM_OK) {
      out[0] = '\0';
      return IDEM_ECRYPTO;
    }
    for (size_t i = 0; i < chunk; i++)
      out[done + i] = alphabet[raw[i] & 31];
    done += chunk;
  }
  out[nchars] = '\0';
  return IDEM_OK;
}

void idem_hex(const unsigned char *bytes, size_t len, char *out) {
  static const char digits[] = "0123456789abcdef";
  for (size_t i = 0; i < len; i++) {
    out[2 * i] = digits[bytes[i] >> 4];
    out[2 * i + 1] = digits[bytes[i] & 15];
  }
  out[2 * len] = '\0';
}

int idem_ct_equal(const void *a, const void *b, size_t len) {
  return CRYPTO_memcmp(a, b, len) == 0;
}
