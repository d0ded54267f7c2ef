/* idemd's tenants and their API keys (server/auth.h makes and checks the
 * keys). A tenant's id is the tenant_id of its requests' scopes in the
 * engine, and of its payments and orders. A tenant has any number of keys,
 * each with a name of its own among the tenant's keys in use, so a key is
 * replaced with an overlap: add the new one, move the clients, revoke the
 * old. The rows live in idemd's `tenants` and `api_keys` tables
 * (data/schema.h) on either store; on SQLite the keys found are
 * remembered, and forgotten as soon as any process changes a tenant or a
 * key (tenants.c says how). */
#ifndef IDEMD_TENANTS_H
#define IDEMD_TENANTS_H

#include <stdint.h>

#include "idem/store.h"

typedef struct idemd_tenant {
  int64_t id;
  char name[65];
  int disabled;
  int64_t created_at;
  int keys; /* keys in use (idemd_tenant_list() only) */
} idemd_tenant_t;

typedef struct idemd_api_key {
  int64_t id;
  int64_t tenant_id;
  char name[65];
  char lookup[33];        /* the key's public part, which finds it */
  unsigned char hash[32]; /* SHA-256 of the whole key */
  int64_t created_at;
  int64_t last_used_at; /* 0: never (as last written: see idemd_key_used()) */
  int64_t revoked_at;   /* 0: in use */
} idemd_api_key_t;

/* The tenants of one store, with what is remembered of them. */
typedef struct idemd_tenants idemd_tenants_t;

/* Opens the tenants of `store`, which is borrowed and must outlive them.
 * IDEM_OK and `*out` (close with idemd_tenants_close()), or IDEM_ENOMEM.
 * Without a change file beside a SQLite database (a read-only directory)
 * nothing is remembered, and every key is read from the database. */
int idemd_tenants_open(idem_store_t *store, idemd_tenants_t **out);

/* Writes what idemd_key_used() noted (idemd_keys_flush()), then frees `t`;
 * NULL is fine. */
void idemd_tenants_close(idemd_tenants_t *t);

/* Inserts the tenant tenant->name (created_at) with its first key `key`
 * (name, lookup, hash, created_at), in one write; sets their ids.
 * IDEM_EEXIST when the name or the lookup is taken. */
int idemd_tenant_create(idemd_tenants_t *t, idemd_tenant_t *tenant, idemd_api_key_t *key);

/* Finds a tenant by name. IDEM_ENOTFOUND when none. */
int idemd_tenant_by_name(idemd_tenants_t *t, const char *name, idemd_tenant_t *out);

/* Disables (1) or enables (0) the tenant named `name`: a disabled tenant's
 * keys are refused. IDEM_ENOTFOUND when there is no such tenant. */
int idemd_tenant_set_disabled(idemd_tenants_t *t, const char *name, int disabled);

/* Lists up to `max` tenants by name into `out`, with their keys in use;
 * `*n` gets the count. */
int idemd_tenant_list(idemd_tenants_t *t, idemd_tenant_t *out, int max, int *n);

/* Finds the key in use with lookup part `lookup`, and its tenant
 * (remembered, or read). IDEM_ENOTFOUND when there is none (or it was
 * revoked); a store error otherwise. The caller checks the hash and
 * whether the tenant is disabled. */
int idemd_key_find(idemd_tenants_t *t, const char *lookup, idemd_api_key_t *key,
                   idemd_tenant_t *tenant);

/* idemd_key_find() from memory only, never waiting on the store: IDEM_OK
 * when the key and its tenant are remembered and still trusted,
 * IDEM_EAGAIN otherwise (unknown, not remembered, or a cache not trusted
 * now): the caller then uses idemd_key_find() where it may wait. */
int idemd_key_remembered(idemd_tenants_t *t, const char *lookup, idemd_api_key_t *key,
                         idemd_tenant_t *tenant);

/* Adds `key` (name, lookup, hash, created_at) to the tenant named
 * `tenant`, and sets key->id and key->tenant_id. IDEM_ENOTFOUND when
 * there is no such tenant; IDEM_EEXIST when the tenant has a key in use of
 * that name (or, never in practice, the lookup is taken). */
int idemd_key_add(idemd_tenants_t *t, const char *tenant, idemd_api_key_t *key);

/* Revokes the key in use named `name` of the tenant named `tenant`: once
 * this returns, no process accepts it. IDEM_ENOTFOUND when there is no
 * such key in use. */
int idemd_key_revoke(idemd_tenants_t *t, const char *tenant, const char *name);

/* Revokes every key in use of the tenant named `tenant` and adds `key` in
 * their place, in one write (a rotation with no overlap, for a key that
 * leaked). IDEM_ENOTFOUND when there is no such tenant. */
int idemd_key_replace_all(idemd_tenants_t *t, const char *tenant, idemd_api_key_t *key);

/* Lists up to `max` keys of the tenant named `tenant`, those in use first,
 * each group oldest first; `*n` gets the count (0 for an unknown tenant). */
int idemd_key_list(idemd_tenants_t *t, const char *tenant, idemd_api_key_t *out, int max,
                   int *n);

/* Notes that key `key_id` authenticated a request at `now_ms`. Kept in
 * memory, and written by idemd_keys_flush(): the time a listing shows is
 * at most one flush late. Cheap enough for every request (a lock and a
 * slot); when more keys are in use between two flushes than it has slots
 * for, the others' times wait for a later use. */
void idemd_key_used(idemd_tenants_t *t, int64_t key_id, int64_t now_ms);

/* Writes the last-used times noted since the last flush, in one write.
 * IDEM_OK, or a store error (they are kept for the next flush). */
int idemd_keys_flush(idemd_tenants_t *t);

#endif
