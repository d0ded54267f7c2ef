/* Loading --tls-cert and --tls-key: each file read whole (bounded), then
 * parsed by GnuTLS, the library libmicrohttpd hands them to, so that what
 * passes here is what the listener will take, and a bad file is refused
 * with its name before anything listens. */
#define _DEFAULT_SOURCE /* explicit_bzero */
#include "server/tls.h"

#include <errno.h>
#include <gnutls/gnutls.h>
#include <gnutls/x509.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/log.h"

/* A certificate chain or a key is a few KiB; a bigger file is not one. */
#define TLS_FILE_MAX (1024 * 1024)

/* Reads the whole of `path` (what `flag` names) into a malloc'd,
 * NUL-terminated text; NULL with a message on stderr. */
static char *read_pem(const char *flag, const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  char *text = NULL;
  size_t n = 0;

  if (f == NULL) {
    fprintf(stderr, "idemd: cannot read %s %s: %s\n", flag, path, strerror(errno));
    return NULL;
  }
  if ((text = malloc(TLS_FILE_MAX + 1)) == NULL) {
    fprintf(stderr, "idemd: out of memory reading %s\n", flag);
    fclose(f);
    return NULL;
  }
  n = fread(text, 1, TLS_FILE_MAX + 1, f);
  if (ferror(f)) {
    fprintf(stderr, "idemd: cannot read %s %s: %s\n", flag, path, strerror(errno));
  } else if (n == 0) {
    fprintf(stderr, "idemd: %s %s is empty\n", flag, path);
  } else if (n > TLS_FILE_MAX) {
    fprintf(stderr, "idemd: %s %s is larger than 1 MiB: not a PEM file\n", flag, path);
  } else if (memchr(text, '\0', n) != NULL) {
    /* libmicrohttpd takes the text up to its first NUL. */
    fprintf(stderr, "idemd: %s %s holds a NUL byte: not a PEM file\n", flag, path);
  } else {
    fclose(f);
    text[n] = '\0';
    *len = n;
    return text;
  }
  fclose(f);
  explicit_bzero(text, n);
  free(text);
  return NULL;
}

/* Logs a warning when the first certificate of the chain is not valid
 * now: idemd still starts (clients decide), but the operator hears of
 * it. */
static void warn_validity(gnutls_x509_crt_t crt, const char *path) {
  time_t now = time(NULL);
  time_t from = gnutls_x509_crt_get_activation_time(crt);
  time_t until = gnutls_x509_crt_get_expiration_time(crt);

  if (until != (time_t)-1 && until < now)
    idemd_log_event("warn", "the TLS certificate has expired", "file", path, NULL);
  else if (from != (time_t)-1 && from > now)
    idemd_log_event("warn", "the TLS certificate is not valid yet", "file", path, NULL);
}

/* Whether GnuTLS takes `cert` as certificates, `key` as a private key,
 * and the two as a pair; a message on stderr when not. */
static int check_pair(const idemd_tls_t *t, size_t cert_len, size_t key_len,
                      const char *cert_path, const char *key_path) {
  gnutls_datum_t cert = {(unsigned char *)t->cert, (unsigned int)cert_len};
  gnutls_datum_t key = {(unsigned char *)t->key, (unsigned int)key_len};
  gnutls_x509_crt_t *crts = NULL;
  gnutls_x509_privkey_t pk = NULL;
  gnutls_certificate_credentials_t cred = NULL;
  unsigned int ncrts = 0;
  int rc, ok = 0;

  rc = gnutls_x509_crt_list_import2(&crts, &ncrts, &cert, GNUTLS_X509_FMT_PEM, 0);
  if (rc < 0 || ncrts == 0) {
    fprintf(stderr, "idemd: --tls-cert %s: no PEM certificate (%s)\n", cert_path,
            gnutls_strerror(rc < 0 ? rc : GNUTLS_E_NO_CERTIFICATE_FOUND));
    return 0;
  }
  warn_validity(crts[0], cert_path);
  if ((rc = gnutls_x509_privkey_init(&pk)) >= 0 &&
      (rc = gnutls_x509_privkey_import2(pk, &key, GNUTLS_X509_FMT_PEM, NULL, 0)) < 0)
    fprintf(stderr, "idemd: --tls-key %s: no unencrypted PEM private key (%s)\n",
            key_path, gnutls_strerror(rc));
  else if (rc >= 0 && (rc = gnutls_certificate_allocate_credentials(&cred)) >= 0 &&
           (rc = gnutls_certificate_set_x509_key_mem(cred, &cert, &key,
                                                     GNUTLS_X509_FMT_PEM)) < 0)
    fprintf(stderr, "idemd: --tls-key %s does not go with --tls-cert %s (%s)\n", key_path,
            cert_path, gnutls_strerror(rc));
  else if (rc < 0)
    fprintf(stderr, "idemd: cannot set up TLS: %s\n", gnutls_strerror(rc));
  else
    ok = 1;
  if (cred)
    gnutls_certificate_free_credentials(cred);
  if (pk)
    gnutls_x509_privkey_deinit(pk);
  for (unsigned int i = 0; i < ncrts; i++)
    gnutls_x509_crt_deinit(crts[i]);
  gnutls_free(crts);
  return ok;
}

int idemd_tls_load(const char *cert_path, const char *key_path, idemd_tls_t *out) {
  size_t cert_len = 0, key_len = 0;

  out->cert = out->key = NULL;
  if ((out->cert = read_pem("--tls-cert", cert_path, &cert_len)) == NULL ||
      (out->key = read_pem("--tls-key", key_path, &key_len)) == NULL ||
      !check_pair(out, cert_len, key_len, cert_path, key_path)) {
    idemd_tls_free(out);
    return -1;
  }
  return 0;
}

void idemd_tls_free(idemd_tls_t *t) {
  if (t->key) {
    explicit_bzero(t->key, strlen(t->key));
    free(t->key);
  }
  free(t->cert);
  t->cert = t->key = NULL;
}
