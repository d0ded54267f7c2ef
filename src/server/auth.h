/* Tenants' API keys: "idem_<lookup>_<secret>". The lookup part finds the
 * tenant; only the SHA-256 of the whole key is stored, and it is compared
 * in constant time. */
#ifndef IDEMD_AUTH_H
#define IDEMD_AUTH_H

#include "data/tenants.h"

#define IDEMD_API_KEY_MAX 80

/* Generates a new API key for a tenant named `name`: fills `key` (at least
 * IDEMD_API_KEY_MAX + 1 bytes) and t->name, t->key_lookup, t->key_hash.
 * Returns IDEM_OK, IDEM_EINVAL for a bad name (1 to 64 of [A-Za-z0-9._-]),
 * or IDEM_ECRYPTO. */
int idemd_api_key_new(const char *name, idemd_tenant_t *t, char *key);

/* Authenticates the value of an Authorization header ("Bearer <key>").
 * Returns IDEM_OK and fills `out` for an enabled tenant whose key matches;
 * IDEM_ENOTFOUND for a missing, malformed, unknown, wrong or disabled key;
 * or a store error. */
int idemd_authenticate(idemd_tenants_t *tenants, const char *authorization,
                       idemd_tenant_t *out);

#endif
