/* API keys: generation, hashing and constant-time checks. */
#include "server/auth.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "idem/clock.h"
#include "idem/crypto.h"

#define LOOKUP_LEN 12
#define SECRET_LEN 40 /* 200 bits */

int idemd_name_valid(const char *name) {
  size_t n = strlen(name);
  return n >= 1 && n <= 64 &&
         strspn(name, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                      "0123456789._-") == n;
}

int idemd_api_key_new(const char *name, idemd_api_key_t *k, char *key) {
  char lookup[LOOKUP_LEN + 1], secret[SECRET_LEN + 1];

  memset(k, 0, sizeof *k);
  if (!idemd_name_valid(name))
    return IDEM_EINVAL;
  if (idem_random_token(lookup, LOOKUP_LEN) != IDEM_OK ||
      idem_random_token(secret, SECRET_LEN) != IDEM_OK)
    return IDEM_ECRYPTO;
  snprintf(key, IDEMD_API_KEY_MAX + 1, "idem_%s_%s", lookup, secret);
  idem_copy(k->name, sizeof k->name, name);
  idem_copy(k->lookup, sizeof k->lookup, lookup);
  k->created_at = idem_now_ms();
  return idem_sha256(key, strlen(key), k->hash);
}

static int authenticate(idemd_tenants_t *tenants, const char *authorization,
                        idemd_tenant_t *out, int memory_only) {
  char lookup[LOOKUP_LEN + 1];
  idemd_api_key_t k;
  unsigned char hash[IDEM_SHA256_LEN];
  const char *key;
  size_t len;
  int rc;

  memset(out, 0, sizeof *out);
  if (authorization == NULL || strncasecmp(authorization, "Bearer ", 7) != 0)
    return IDEM_ENOTFOUND;
  key = authorization + 7;
  while (*key == ' ')
    key++;
  len = strlen(key);
  while (len > 0 && key[len - 1] == ' ')
    len--;
  if (len != 5 + LOOKUP_LEN + 1 + SECRET_LEN || strncmp(key, "idem_", 5) != 0 ||
      key[5 + LOOKUP_LEN] != '_')
    return IDEM_ENOTFOUND;
  memcpy(lookup, key + 5, LOOKUP_LEN);
  lookup[LOOKUP_LEN] = '\0';
  if (strspn(lookup, "0123456789abcdefghijklmnopqrstuv") != LOOKUP_LEN)
    return IDEM_ENOTFOUND;
  if (idem_sha256(key, len, hash) != IDEM_OK)
    return IDEM_ECRYPTO;
  rc = memory_only ? idemd_key_remembered(tenants, lookup, &k, out)
                   : idemd_key_find(tenants, lookup, &k, out);
  if (rc != IDEM_OK)
    return rc;
  if (!idem_ct_equal(hash, k.hash, sizeof hash) || out->disabled) {
    memset(out, 0, sizeof *out);
    return IDEM_ENOTFOUND;
  }
  idemd_key_used(tenants, k.id, idem_now_ms());
  return IDEM_OK;
}

int idemd_authenticate(idemd_tenants_t *tenants, const char *authorization,
                       idemd_tenant_t *out) {
  return authenticate(tenants, authorization, out, 0);
}

int idemd_authenticate_remembered(idemd_tenants_t *tenants, const char *authorization,
                                  idemd_tenant_t *out) {
  return authenticate(tenants, authorization, out, 1);
}
