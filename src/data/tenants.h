/* idemd's tenants: who may call the API, by API key (server/auth.h makes
 * and checks the keys). A tenant's id is the tenant_id of its keys' scopes
 * in the engine, and of its payments and orders. The rows live in idemd's
 * `tenants` table (data/schema.h) on either store; on SQLite the tenants
 * found by key are remembered, and forgotten as soon as any process
 * changes a tenant (tenants.c says how). */
#ifndef IDEMD_TENANTS_H
#define IDEMD_TENANTS_H

#include <stdint.h>

#include "idem/store.h"

typedef struct idemd_tenant {
  int64_t id;
  char name[65];
  char key_lookup[33];
  unsigned char key_hash[32]; /* SHA-256 of the whole API key */
  int disabled;
  int64_t created_at;
} idemd_tenant_t;

/* The tenants of one store, with what is remembered of them. */
typedef struct idemd_tenants idemd_tenants_t;

/* Opens the tenants of `store`, which is borrowed and must outlive them.
 * IDEM_OK and `*out` (close with idemd_tenants_close()), or IDEM_ENOMEM.
 * Without a change file beside a SQLite database (a read-only directory)
 * nothing is remembered, and every key is read from the database. */
int idemd_tenants_open(idem_store_t *store, idemd_tenants_t **out);

/* Frees `t`; NULL is fine. */
void idemd_tenants_close(idemd_tenants_t *t);

/* Inserts a tenant from `t` (name, key_lookup, key_hash, created_at) and
 * sets t->id. IDEM_EEXIST when the name or the lookup is taken. Returns
 * once no process answers with what it remembered before. */
int idemd_tenant_create(idemd_tenants_t *t, idemd_tenant_t *tenant);

/* Finds the tenant whose API key has lookup part `key_lookup` (remembered
 * or read). IDEM_ENOTFOUND when none; a store error otherwise. */
int idemd_tenant_find(idemd_tenants_t *t, const char *key_lookup, idemd_tenant_t *out);

/* Finds a tenant by name. IDEM_ENOTFOUND when none. */
int idemd_tenant_by_name(idemd_tenants_t *t, const char *name, idemd_tenant_t *out);

/* Writes tenant->key_lookup, key_hash and disabled to the tenant named
 * tenant->name. The old key stops working for every process before this
 * returns. IDEM_ENOTFOUND when there is no such tenant; IDEM_EEXIST when
 * the new lookup is another tenant's. */
int idemd_tenant_update(idemd_tenants_t *t, const idemd_tenant_t *tenant);

/* Lists up to `max` tenants by name into `out`; `*n` gets the count. */
int idemd_tenant_list(idemd_tenants_t *t, idemd_tenant_t *out, int max, int *n);

#endif
