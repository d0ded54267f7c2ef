/* idemd's HTTPS credentials (--tls-cert, --tls-key): the two PEM files
 * read and checked with GnuTLS before libmicrohttpd gets them, so that a
 * missing file, a file that is not PEM or a key of another certificate is
 * a start-up error naming the file (docs/operations.md, "TLS"). */
#ifndef IDEMD_TLS_H
#define IDEMD_TLS_H

/* The files' text, NUL-terminated, as libmicrohttpd takes it
 * (MHD_OPTION_HTTPS_MEM_CERT, MHD_OPTION_HTTPS_MEM_KEY). */
typedef struct idemd_tls {
  char *cert;
  char *key;
} idemd_tls_t;

/* Reads `cert_path` (a PEM certificate, optionally followed by its chain)
 * and `key_path` (its unencrypted PEM private key) into `out`, each at
 * most 1 MiB, and checks that GnuTLS takes them as a certificate and its
 * key. Returns 0; or -1 with a message naming the flag and the file on
 * stderr, `out` then left empty. Warns in the log (and still returns 0)
 * when the certificate has expired or is not valid yet. The caller frees
 * `out` with idemd_tls_free(). */
int idemd_tls_load(const char *cert_path, const char *key_path, idemd_tls_t *out);

/* Wipes the key's bytes and frees both texts; `t` is left empty. NULL
 * members are fine. */
void idemd_tls_free(idemd_tls_t *t);

#endif
