/* Tenants' API keys: "idem_<lookup>_<secret>". The lookup part finds the
 * key; only the SHA-256 of the whole key is stored, and it is compared
 * in constant time. */
#ifndef IDEMD_AUTH_H
#define IDEMD_AUTH_H

#include "data/tenants.h"

#define IDEMD_API_KEY_MAX 80

/* 1 when `name` is a valid name of a tenant or a key: 1 to 64 of
 * [A-Za-z0-9._-]. */
int idemd_name_valid(const char *name);

/* Generates a new API key named `name`: fills `key` (at least
 * IDEMD_API_KEY_MAX + 1 bytes) and k->name, k->lookup, k->hash and
 * k->created_at. Returns IDEM_OK, IDEM_EINVAL for a bad name, or
 * IDEM_ECRYPTO. */
int idemd_api_key_new(const char *name, idemd_api_key_t *k, char *key);

/* Authenticates the value of an Authorization header ("Bearer <key>").
 * Returns IDEM_OK and fills `out` with the tenant of a key in use that
 * matches, whose tenant is enabled (and notes the key's use:
 * idemd_key_used()); IDEM_ENOTFOUND for a missing, malformed, unknown,
 * wrong or revoked key, or a disabled tenant; or a store error. */
int idemd_authenticate(idemd_tenants_t *tenants, const char *authorization,
                       idemd_tenant_t *out);

/* idemd_authenticate() without waiting on the store, for an event thread:
 * the same answers for a key whose tenant is remembered
 * (idemd_key_remembered()), IDEM_EAGAIN when it is not (or the header is
 * well-formed but its key unknown here): the caller then authenticates
 * where it may wait. */
int idemd_authenticate_remembered(idemd_tenants_t *tenants, const char *authorization,
                                  idemd_tenant_t *out);

#endif
