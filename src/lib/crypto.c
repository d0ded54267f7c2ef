/* libcrypto wrappers: SHA-256, HMAC-SHA256, random bytes and tokens,
 * constant-time comparison. */
#include "idem/crypto.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/core_names.h>
#include <openssl/params.h>
#include <openssl/rand.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* Each thread keeps one digest context and one HMAC context and resets
 * them per use: creating and freeing contexts was a third of a request's
 * hashing (OpenSSL 3 allocates several objects per context). A thread's
 * contexts are freed when it exits (the key's destructor); the variables
 * also keep them reachable for LeakSanitizer while it runs. */
struct thread_ctx {
  EVP_MD_CTX *md;
  EVP_MAC_CTX *mac;
  uint64_t mac_of; /* the idem_hmac_t (by serial) `mac` is a copy of */
};
static _Thread_local struct thread_ctx tctx;
static pthread_key_t tctx_key;
static int tctx_key_ok;
static pthread_once_t tctx_once = PTHREAD_ONCE_INIT;

static void tctx_free(void *arg) {
  struct thread_ctx *t = arg;
  EVP_MD_CTX_free(t->md);
  EVP_MAC_CTX_free(t->mac);
  memset(t, 0, sizeof *t);
}

static void tctx_init(void) { tctx_key_ok = pthread_key_create(&tctx_key, tctx_free) == 0; }

/* Registers this thread's contexts for freeing at exit (once per thread).
 * Without a key (none left) they are only freed with the process. */
static void tctx_register(void) {
  pthread_once(&tctx_once, tctx_init);
  if (tctx_key_ok)
    (void)pthread_setspecific(tctx_key, &tctx);
}

int idem_sha256(const void *data, size_t len, unsigned char out[IDEM_SHA256_LEN]) {
  unsigned int n = 0;
  if (tctx.md == NULL) {
    if ((tctx.md = EVP_MD_CTX_new()) == NULL)
      return IDEM_ECRYPTO;
    tctx_register();
  }
  if (EVP_DigestInit_ex2(tctx.md, sha256(), NULL) != 1 ||
      EVP_DigestUpdate(tctx.md, data, len) != 1 ||
      EVP_DigestFinal_ex(tctx.md, out, &n) != 1 || n != IDEM_SHA256_LEN)
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

struct idem_hmac {
  EVP_MAC_CTX *keyed; /* initialised with the key; copied once per thread */
  uint64_t serial;    /* never reused, unlike the address */
};

static atomic_uint_fast64_t hmac_serials;

idem_hmac_t *idem_hmac_new(const void *key, size_t key_len) {
  idem_hmac_t *h = calloc(1, sizeof *h);
  EVP_MAC *mac = EVP_MAC_fetch(NULL, "HMAC", NULL);
  OSSL_PARAM params[] = {
      OSSL_PARAM_construct_utf8_string("digest", (char *)"SHA256", 0),
      OSSL_PARAM_construct_end()};

  if (h == NULL || mac == NULL || (h->keyed = EVP_MAC_CTX_new(mac)) == NULL ||
      EVP_MAC_init(h->keyed, key, key_len, params) != 1) {
    EVP_MAC_free(mac);
    idem_hmac_free(h);
    return NULL;
  }
  EVP_MAC_free(mac); /* the context keeps its own reference */
  h->serial = atomic_fetch_add(&hmac_serials, 1) + 1;
  return h;
}

int idem_hmac_compute(const idem_hmac_t *h, const void *data, size_t len,
                      unsigned char out[IDEM_SHA256_LEN]) {
  size_t n = 0;

  if (tctx.mac_of != h->serial) {
    /* Copying only reads the keyed context, so threads may share it. */
    EVP_MAC_CTX *c = EVP_MAC_CTX_dup(h->keyed);
    if (c == NULL)
      return IDEM_ECRYPTO;
    EVP_MAC_CTX_free(tctx.mac);
    tctx.mac = c;
    tctx.mac_of = h->serial;
    tctx_register();
  } else if (EVP_MAC_init(tctx.mac, NULL, 0, NULL) != 1) { /* same key */
    return IDEM_ECRYPTO;
  }
  if (EVP_MAC_update(tctx.mac, data, len) != 1 ||
      EVP_MAC_final(tctx.mac, out, &n, IDEM_SHA256_LEN) != 1 || n != IDEM_SHA256_LEN) {
    tctx.mac_of = 0; /* start from a fresh copy next time */
    return IDEM_ECRYPTO;
  }
  return IDEM_OK;
}

void idem_hmac_free(idem_hmac_t *h) {
  if (h == NULL)
    return;
  EVP_MAC_CTX_free(h->keyed);
  free(h);
}

int idem_random_bytes(void *buf, size_t len) {
  if (len > 0x7fffffff || RAND_bytes(buf, (int)len) != 1)
    return IDEM_ECRYPTO;
  return IDEM_OK;
}

/* Tokens draw on a per-thread buffer of CSPRNG output: one RAND_bytes()
 * costs about 7,000 instructions whatever its size (OpenSSL looks up the
 * thread's generator and locks it), and a request draws several tokens
 * (request id, owner token, payment id). Bytes are used once and wiped. */
#define TOKEN_POOL 1024
static _Thread_local unsigned char token_pool[TOKEN_POOL];
static _Thread_local size_t token_left;

/* In ascending byte order, so that idem_sortable_token() sorts. */
static const char alphabet[] = "0123456789abcdefghijklmnopqrstuv";

int idem_random_token(char *out, size_t nchars) {
  size_t done = 0;

  while (done < nchars) {
    size_t chunk;
    unsigned char *raw;
    if (token_left == 0) {
      if (idem_random_bytes(token_pool, sizeof token_pool) != IDEM_OK) {
        out[0] = '\0';
        return IDEM_ECRYPTO;
      }
      token_left = sizeof token_pool;
    }
    chunk = nchars - done < token_left ? nchars - done : token_left;
    raw = token_pool + sizeof token_pool - token_left;
    for (size_t i = 0; i < chunk; i++)
      out[done + i] = alphabet[raw[i] & 31];
    OPENSSL_cleanse(raw, chunk);
    token_left -= chunk;
    done += chunk;
  }
  out[nchars] = '\0';
  return IDEM_OK;
}

int idem_sortable_token(char *out, size_t nchars, int64_t ms) {
  enum { TIME_CHARS = 10 };
  uint64_t t = ms < 0 ? 0 : (uint64_t)ms;

  if (nchars <= TIME_CHARS) {
    out[0] = '\0';
    return IDEM_EINVAL;
  }
  for (int i = TIME_CHARS - 1; i >= 0; i--) {
    out[i] = alphabet[t & 31];
    t >>= 5;
  }
  return idem_random_token(out + TIME_CHARS, nchars - TIME_CHARS);
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
