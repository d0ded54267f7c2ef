/* The store suite: tests the store interface (include/idem/store.h), and
 * idemd's rows written through it (tenants, payments, orders, the outbox:
 * src/data/), against the backend named by IDEM_TEST_STORE_URL, or against
 * a fresh SQLite file per test when it is unset. Only public interfaces
 * are used, and every test works in a tenant of its own, so a shared
 * database is fine. */
#include "support.h"

#include <libpq-fe.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "data/audit.h"
#include "data/resources.h"
#include "data/schema.h"
#include "data/tenants.h"
#include "idem/clock.h"
#include "idem/crypto.h"
#include "idem/store.h"

#define OP_PAY "create_payment"
#define OP_ORDER "create_order"
#define LEASE_MS 30000
#define TTL_MS 86400000
#define NTHREADS 32

typedef struct fixture {
  idem_store_t *store;
  idemd_tenants_t *tenants; /* over `store` */
  char dir[512];  /* our temporary directory; "" on a shared URL */
  char path[600]; /* the SQLite file in it */
  idemd_tenant_t tenant;
  idemd_api_key_t key; /* the tenant's */
  int64_t now;
} fixture_t;

/* ---- helpers ---------------------------------------------------------- */

/* Writes `prefix` and 16 random characters to `out`. */
static void random_name(char *out, size_t cap, const char *prefix) {
  char token[17];
  assert_int_equal(idem_random_token(token, 16), IDEM_OK);
  snprintf(out, cap, "%s%s", prefix, token);
}

/* A key named `name` with a random lookup and hash (as idemd_api_key_new()
 * makes, without the key itself). */
static void new_key(idemd_api_key_t *k, const char *name) {
  memset(k, 0, sizeof *k);
  snprintf(k->name, sizeof k->name, "%s", name);
  assert_int_equal(idem_random_token(k->lookup, sizeof k->lookup - 1), IDEM_OK);
  assert_int_equal(idem_random_bytes(k->hash, sizeof k->hash), IDEM_OK);
  k->created_at = idem_now_ms();
}

/* A tenant of a random name, with its key `k` named "default". */
static void new_tenant(idemd_tenants_t *tenants, idemd_tenant_t *t, idemd_api_key_t *k) {
  memset(t, 0, sizeof *t);
  random_name(t->name, sizeof t->name, "tenant-");
  t->created_at = idem_now_ms();
  new_key(k, "default");
  assert_int_equal(idemd_tenant_create(tenants, t, k), IDEM_OK);
  assert_true(t->id > 0);
  assert_true(k->id > 0);
  assert_int_equal(k->tenant_id, t->id);
}

/* The key in use with lookup `lookup`: IDEM_OK and its tenant's id, or
 * the error, with `*tenant_id` 0. */
static int find(idemd_tenants_t *tenants, const char *lookup, int64_t *tenant_id) {
  idemd_api_key_t k;
  idemd_tenant_t t;
  int rc = idemd_key_find(tenants, lookup, &k, &t);
  *tenant_id = rc == IDEM_OK ? t.id : 0;
  if (rc == IDEM_OK)
    assert_int_equal(k.tenant_id, t.id);
  return rc;
}

/* A fingerprint-shaped string (64 characters) that differs by `seed`. */
static void make_fp(char out[IDEM_FINGERPRINT_LEN], int seed) {
  snprintf(out, IDEM_FINGERPRINT_LEN, "%064d", seed);
}

static idem_reserve_t request(const fixture_t *fx, const char *operation,
                              const char *key, const char *fingerprint) {
  idem_reserve_t r = {
      .scope = {fx->tenant.id, operation, key},
      .fingerprint = fingerprint,
      .correlation_id = "req_test",
      .now_ms = fx->now,
      .lease_ms = LEASE_MS,
      .ttl_ms = TTL_MS,
  };
  return r;
}

/* Reserves, requiring IDEM_OK; returns WON or EXISTS. */
static idem_reserve_result_t reserve(fixture_t *fx, const idem_reserve_t *req,
                                     idem_record_t *rec) {
  idem_reserve_result_t result = 0;
  int rc = idem_store_reserve(fx->store, req, rec, &result);
  if (rc != IDEM_OK)
    fail_msg("reserve: %s (%s)", idem_err_name(rc), idem_store_last_error());
  assert_true(result == IDEM_RESERVE_WON || result == IDEM_RESERVE_EXISTS);
  return result;
}

static int complete(fixture_t *fx, const idem_scope_t *scope, const char *owner,
                    int64_t now, int64_t ttl, const idem_outcome_t *outcome) {
  idem_complete_t c = {.scope = *scope, .owner_token = owner, .now_ms = now,
                       .ttl_ms = ttl, .outcome = *outcome};
  return idem_store_complete(fx->store, &c);
}

/* Counts `what` in the fixture's tenant: records (idem_store_count()),
 * or idemd's payments, orders and outbox rows (idemd_resource_count()),
 * which the tests write as idemd does, through effects. */
static int64_t count(fixture_t *fx, const char *what) {
  int64_t n = -1;
  int rc = idemd_resource_count(fx->store, what, fx->tenant.id, &n);
  if (rc == IDEM_EINVAL)
    rc = idem_store_count(fx->store, what, fx->tenant.id, &n);
  assert_int_equal(rc, IDEM_OK);
  return n;
}

/* Stores may keep JSON as text or reformat it: compare values. */
static void assert_same_json(const char *got, const char *want) {
  json_t *g, *w;
  assert_non_null(got);
  g = load_json(got);
  w = load_json(want);
  if (!json_equal(g, w))
    fail_msg("JSON %s, want %s", got, want);
  json_decref(g);
  json_decref(w);
}

/* A payment with a fresh id, as POST /payments inserts it (its row, and
 * its outbox row once it is given a scope: with_payment()). */
struct payment {
  char id[40];
  char body[128];
  idemd_resource_t res;
  idemd_resource_update_t settle;
};

static void new_payment(struct payment *p) {
  random_name(p->id, sizeof p->id, "pay_");
  snprintf(p->body, sizeof p->body,
           "{\"id\":\"%s\",\"amount\":15990,\"status\":\"pending\"}", p->id);
  p->res = (idemd_resource_t){.kind = "payment", .id = p->id, .status = "pending",
                              .body = p->body};
}

/* Makes `req` write payment `p` (and, with `outbox`, its outbox row) when
 * it wins its key, as POST /payments does. */
static void with_payment(idem_reserve_t *req, struct payment *p, int outbox) {
  p->res.tenant_id = req->scope.tenant_id;
  p->res.operation = outbox ? req->scope.operation : NULL;
  p->res.key = req->scope.key;
  p->res.due_after_ms = req->lease_ms;
  req->resource_id = p->id;
  req->effect = (idem_effect_t){idemd_resource_insert, &p->res};
}

/* Completes `scope` as a payment's completion does: the record, and the
 * payment `p` updated to `status` (and `body` when not NULL), in one
 * transaction. */
static int complete_payment(fixture_t *fx, const idem_scope_t *scope, const char *owner,
                            int64_t now, int64_t ttl, const idem_outcome_t *outcome,
                            struct payment *p, const char *status, const char *body) {
  p->settle = (idemd_resource_update_t){.tenant_id = scope->tenant_id, .id = p->id,
                                        .status = status, .body = body,
                                        .provider_ref = outcome->provider_ref,
                                        .state = outcome->state};
  idem_complete_t c = {.scope = *scope, .owner_token = owner, .now_ms = now,
                       .ttl_ms = ttl, .outcome = *outcome,
                       .effect = {idemd_resource_update, &p->settle}};
  return idem_store_complete(fx->store, &c);
}

/* The record a reservation returned is the stored one, field by field
 * (the SQLite store builds it without reading it back). */
static void assert_as_stored(fixture_t *fx, const idem_record_t *got, int64_t now) {
  idem_scope_t sc = {got->tenant_id, got->operation, got->key};
  idem_record_t want = {0};

  assert_int_equal(idem_store_lookup(fx->store, &sc, now, &want), IDEM_OK);
  assert_int_equal(got->tenant_id, want.tenant_id);
  assert_string_equal(got->operation, want.operation);
  assert_string_equal(got->key, want.key);
  assert_string_equal(got->fingerprint, want.fingerprint);
  assert_int_equal(got->state, want.state);
  assert_int_equal(got->response_status, want.response_status);
  if (want.response_body == NULL)
    assert_null(got->response_body);
  else
    assert_string_equal(got->response_body, want.response_body);
  assert_string_equal(got->location, want.location);
  assert_string_equal(got->resource_id, want.resource_id);
  assert_string_equal(got->provider_ref, want.provider_ref);
  assert_string_equal(got->correlation_id, want.correlation_id);
  assert_string_equal(got->owner_token, want.owner_token);
  assert_int_equal(got->lease_expires_at, want.lease_expires_at);
  assert_int_equal(got->created_at, want.created_at);
  assert_int_equal(got->updated_at, want.updated_at);
  assert_int_equal(got->expires_at, want.expires_at);
  idem_record_reset(&want);
}

/* Reserves `key` for a new payment the way POST /payments does (payment
 * and outbox row written with the record) and requires the win. `p` gets
 * the payment, `token` the owner token; returns the request (its scope). */
static idem_reserve_t reserve_payment(fixture_t *fx, const char *key,
                                      int64_t lease_ms, struct payment *p,
                                      char token[IDEM_TOKEN_MAX + 1]) {
  static const char fp[] = "00000000000000000000000000000000000000000000000000000000000000aa";
  idem_record_t rec = {0};
  idem_reserve_t req = request(fx, OP_PAY, key, fp);

  new_payment(p);
  req.lease_ms = lease_ms;
  with_payment(&req, p, 1);
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
  assert_int_equal(rec.state, IDEM_STATE_PROCESSING);
  assert_string_equal(rec.resource_id, p->id);
  assert_as_stored(fx, &rec, req.now_ms);
  idem_copy(token, IDEM_TOKEN_MAX + 1, rec.owner_token);
  idem_record_reset(&rec);
  return req;
}

/* ---- fixture ---------------------------------------------------------- */

static int setup(void **state) {
  fixture_t *fx = calloc(1, sizeof *fx);
  const char *url = getenv("IDEM_TEST_STORE_URL");
  int rc;

  assert_non_null(fx);
  if (url == NULL || url[0] == '\0') {
    const char *tmp = getenv("TMPDIR");
    snprintf(fx->dir, sizeof fx->dir, "%s/idem-store-XXXXXX",
             tmp && tmp[0] ? tmp : "/tmp");
    if (mkdtemp(fx->dir) == NULL)
      fail_msg("mkdtemp %s failed", fx->dir);
    snprintf(fx->path, sizeof fx->path, "%s/idem.db", fx->dir);
    url = fx->path;
  }
  rc = idem_store_open(url, NULL, &fx->store);
  if (rc != IDEM_OK)
    fail_msg("open: %s (%s)", idem_err_name(rc), idem_store_last_error());
  rc = idem_store_migrate(fx->store);
  if (rc != IDEM_OK)
    fail_msg("migrate: %s (%s)", idem_err_name(rc), idem_store_last_error());
  fx->now = idem_now_ms();
  rc = idemd_schema_migrate(fx->store, NULL, 0);
  if (rc != IDEM_OK)
    fail_msg("idemd's schema: %s (%s)", idem_err_name(rc), idem_store_last_error());
  assert_int_equal(idemd_tenants_open(fx->store, &fx->tenants), IDEM_OK);
  new_tenant(fx->tenants, &fx->tenant, &fx->key);
  *state = fx;
  return 0;
}

static int teardown(void **state) {
  fixture_t *fx = *state;
  if (fx == NULL)
    return 0;
  idemd_tenants_close(fx->tenants);
  idem_store_close(fx->store);
  if (fx->dir[0]) {
    remove_sqlite_files(fx->path);
    rmdir(fx->dir);
  }
  free(fx);
  return 0;
}

/* ---- schema and tenants ----------------------------------------------- */

static void test_migrate_is_idempotent(void **state) {
  fixture_t *fx = *state;
  int64_t tenant_id;

  assert_int_equal(idem_store_migrate(fx->store), IDEM_OK);
  assert_int_equal(idem_store_migrate(fx->store), IDEM_OK);
  assert_int_equal(idem_store_ping(fx->store), IDEM_OK);
  assert_true(idem_store_backend(fx->store)[0] != '\0');
  if (fx->dir[0])
    assert_string_equal(idem_store_backend(fx->store), "sqlite");
  assert_int_equal(idemd_schema_migrate(fx->store, NULL, 0), IDEM_OK);
  /* Data written before a migration is still there after it. */
  assert_int_equal(find(fx->tenants, fx->key.lookup, &tenant_id), IDEM_OK);
  assert_int_equal(tenant_id, fx->tenant.id);
}

static void test_tenants(void **state) {
  fixture_t *fx = *state;
  idemd_tenant_t found, other, dup, *list;
  idemd_api_key_t key, other_key, dup_key;
  int64_t tenant_id;
  int n = 0, seen = 0;

  assert_int_equal(idemd_key_find(fx->tenants, fx->key.lookup, &key, &found), IDEM_OK);
  assert_int_equal(found.id, fx->tenant.id);
  assert_string_equal(found.name, fx->tenant.name);
  assert_int_equal(found.disabled, 0);
  assert_int_equal(found.created_at, fx->tenant.created_at);
  assert_int_equal(key.id, fx->key.id);
  assert_int_equal(key.tenant_id, fx->tenant.id);
  assert_string_equal(key.name, "default");
  assert_string_equal(key.lookup, fx->key.lookup);
  assert_memory_equal(key.hash, fx->key.hash, sizeof key.hash);
  assert_int_equal(key.created_at, fx->key.created_at);
  assert_int_equal(key.revoked_at, 0);
  assert_int_equal(idemd_tenant_by_name(fx->tenants, fx->tenant.name, &found), IDEM_OK);
  assert_int_equal(found.id, fx->tenant.id);

  new_tenant(fx->tenants, &other, &other_key);
  assert_true(other.id != fx->tenant.id);
  assert_int_equal(find(fx->tenants, other_key.lookup, &tenant_id), IDEM_OK);
  assert_int_equal(tenant_id, other.id);

  /* The name is taken, whatever the key: nothing is written. */
  dup = fx->tenant;
  dup.id = 0;
  new_key(&dup_key, "default");
  assert_int_equal(idemd_tenant_create(fx->tenants, &dup, &dup_key), IDEM_EEXIST);
  assert_int_equal(find(fx->tenants, dup_key.lookup, &tenant_id), IDEM_ENOTFOUND);
  assert_int_equal(find(fx->tenants, "no-such-lookup", &tenant_id), IDEM_ENOTFOUND);
  assert_int_equal(idemd_tenant_by_name(fx->tenants, "no-such-tenant", &found),
                   IDEM_ENOTFOUND);

  /* The listing counts each tenant's keys in use. */
  list = calloc(1000, sizeof *list);
  assert_non_null(list);
  assert_int_equal(idemd_tenant_list(fx->tenants, list, 1000, &n), IDEM_OK);
  for (int i = 0; i < n; i++)
    if (list[i].id == fx->tenant.id || list[i].id == other.id) {
      assert_int_equal(list[i].keys, 1);
      seen++;
    }
  assert_int_equal(seen, 2);
  free(list);
}

/* A tenant's keys: several at once, each by a name of its own among those
 * in use, revoked one by one (a revoked name may be used again), listed in
 * use first; with the last times they were used. */
static void test_keys(void **state) {
  fixture_t *fx = *state;
  idemd_api_key_t ci, again, taken, list[8];
  int64_t tenant_id;
  int n = 0;

  new_key(&ci, "ci");
  assert_int_equal(idemd_key_add(fx->tenants, fx->tenant.name, &ci), IDEM_OK);
  assert_int_equal(ci.tenant_id, fx->tenant.id);
  /* Both keys work: the overlap of a rotation. */
  assert_int_equal(find(fx->tenants, ci.lookup, &tenant_id), IDEM_OK);
  assert_int_equal(tenant_id, fx->tenant.id);
  assert_int_equal(find(fx->tenants, fx->key.lookup, &tenant_id), IDEM_OK);

  new_key(&taken, "ci");
  assert_int_equal(idemd_key_add(fx->tenants, fx->tenant.name, &taken), IDEM_EEXIST);
  assert_int_equal(find(fx->tenants, taken.lookup, &tenant_id), IDEM_ENOTFOUND);
  assert_int_equal(idemd_key_add(fx->tenants, "no-such-tenant", &taken), IDEM_ENOTFOUND);
  assert_int_equal(find(fx->tenants, taken.lookup, &tenant_id), IDEM_ENOTFOUND);

  /* The old key revoked: it is refused, the new one is not. */
  assert_int_equal(idemd_key_revoke(fx->tenants, fx->tenant.name, "default"), IDEM_OK);
  assert_int_equal(find(fx->tenants, fx->key.lookup, &tenant_id), IDEM_ENOTFOUND);
  assert_int_equal(find(fx->tenants, ci.lookup, &tenant_id), IDEM_OK);
  assert_int_equal(idemd_key_revoke(fx->tenants, fx->tenant.name, "default"),
                   IDEM_ENOTFOUND);
  assert_int_equal(idemd_key_revoke(fx->tenants, "no-such-tenant", "ci"), IDEM_ENOTFOUND);

  /* The name is free again. */
  new_key(&again, "default");
  assert_int_equal(idemd_key_add(fx->tenants, fx->tenant.name, &again), IDEM_OK);
  assert_int_equal(find(fx->tenants, again.lookup, &tenant_id), IDEM_OK);

  /* Uses noted, written, and listed; an earlier time does not undo a
   * later one. */
  idemd_key_used(fx->tenants, ci.id, fx->now + 5000);
  idemd_key_used(fx->tenants, ci.id, fx->now + 4000);
  assert_int_equal(idemd_keys_flush(fx->tenants), IDEM_OK);
  idemd_key_used(fx->tenants, ci.id, fx->now + 3000);
  assert_int_equal(idemd_keys_flush(fx->tenants), IDEM_OK);

  assert_int_equal(idemd_key_list(fx->tenants, fx->tenant.name, list, 8, &n), IDEM_OK);
  assert_int_equal(n, 3);
  assert_string_equal(list[0].name, "ci");
  assert_int_equal(list[0].revoked_at, 0);
  assert_int_equal(list[0].last_used_at, fx->now + 5000);
  assert_string_equal(list[0].lookup, ci.lookup);
  assert_string_equal(list[1].name, "default");
  assert_string_equal(list[1].lookup, again.lookup);
  assert_int_equal(list[1].revoked_at, 0);
  assert_int_equal(list[1].last_used_at, 0);
  assert_string_equal(list[2].name, "default");
  assert_string_equal(list[2].lookup, fx->key.lookup);
  assert_true(list[2].revoked_at > 0);
  assert_int_equal(idemd_key_list(fx->tenants, "no-such-tenant", list, 8, &n), IDEM_OK);
  assert_int_equal(n, 0);

  /* All replaced at once: only the new one works. */
  new_key(&taken, "default");
  assert_int_equal(idemd_key_replace_all(fx->tenants, fx->tenant.name, &taken), IDEM_OK);
  assert_int_equal(find(fx->tenants, ci.lookup, &tenant_id), IDEM_ENOTFOUND);
  assert_int_equal(find(fx->tenants, again.lookup, &tenant_id), IDEM_ENOTFOUND);
  assert_int_equal(find(fx->tenants, taken.lookup, &tenant_id), IDEM_OK);
  assert_int_equal(idemd_key_replace_all(fx->tenants, "no-such-tenant", &ci), IDEM_ENOTFOUND);
}

/* Whether a lookup of `lookup` gives `want_rc` (and, when found, a tenant
 * `want_disabled`): at once on SQLite; on PostgreSQL once the change's
 * NOTIFY has reached this handle's listener (docs/scaling.md, "API keys
 * on PostgreSQL"), polled for up to 10 s. */
static int seen(fixture_t *fx, const char *lookup, int want_rc, int want_disabled) {
  idemd_api_key_t key;
  idemd_tenant_t found;
  struct timespec pause = {0, 10 * 1000000L};

  for (int i = 0;; i++) {
    int rc = idemd_key_find(fx->tenants, lookup, &key, &found);
    if (rc == want_rc && (rc != IDEM_OK || found.disabled == want_disabled))
      return 1;
    if (fx->dir[0] || i >= 1000)
      return 0;
    nanosleep(&pause, NULL);
  }
}

/* A change made through another handle on the same database (another
 * process: `idemd tenant key revoke` while a server runs) is seen by the
 * next lookup at once on SQLite, and as soon as its notification arrives
 * on PostgreSQL, though lookups are remembered. */
static void test_tenant_change_seen_at_once(void **state) {
  fixture_t *fx = *state;
  idem_store_t *cli = NULL;
  idemd_tenants_t *cli_tenants = NULL;
  idemd_api_key_t key, fresh, old = fx->key;
  idemd_tenant_t found;
  const char *url = fx->dir[0] ? fx->path : getenv("IDEM_TEST_STORE_URL");
  char name[16];

  assert_int_equal(idem_store_open(url, NULL, &cli), IDEM_OK);
  assert_int_equal(idemd_tenants_open(cli, &cli_tenants), IDEM_OK);
  for (int round = 0; round < 3; round++) {
    /* Remembered here, then disabled there: refused at once. */
    assert_int_equal(idemd_key_find(fx->tenants, old.lookup, &key, &found), IDEM_OK);
    assert_int_equal(found.disabled, 0);
    assert_int_equal(idemd_tenant_set_disabled(cli_tenants, fx->tenant.name, 1), IDEM_OK);
    assert_true(seen(fx, old.lookup, IDEM_OK, 1));
    assert_int_equal(idemd_tenant_set_disabled(cli_tenants, fx->tenant.name, 0), IDEM_OK);
    /* A new key there, the old one revoked: unknown here at once. */
    assert_true(seen(fx, old.lookup, IDEM_OK, 0));
    snprintf(name, sizeof name, "key-%d", round);
    new_key(&fresh, name);
    assert_int_equal(idemd_key_add(cli_tenants, fx->tenant.name, &fresh), IDEM_OK);
    assert_int_equal(idemd_key_find(fx->tenants, fresh.lookup, &key, &found), IDEM_OK);
    assert_int_equal(idemd_key_revoke(cli_tenants, fx->tenant.name, old.name), IDEM_OK);
    assert_true(seen(fx, old.lookup, IDEM_ENOTFOUND, 0));
    assert_int_equal(idemd_key_find(fx->tenants, fresh.lookup, &key, &found), IDEM_OK);
    assert_int_equal(found.id, fx->tenant.id);
    old = fresh;
  }
  idemd_tenants_close(cli_tenants);
  idem_store_close(cli);
}

/* ---- reservations ----------------------------------------------------- */

/* A scope's tenant is a number the caller gives: a program that embeds
 * libidem reserves, completes and replays keys under a tenant that has no
 * row in tenants (those are idemd's). The number is far above any tenant
 * id the store hands out, and random, so a shared database is fine. */
static void test_tenant_is_the_callers(void **state) {
  static const char body[] = "{\"ok\":true}";
  fixture_t *fx = *state;
  char fp[IDEM_FINGERPRINT_LEN], token[IDEM_TOKEN_MAX + 1];
  idem_record_t rec = {0};
  idem_reserve_t req;
  idem_outcome_t out = {.state = IDEM_STATE_COMPLETED, .status = 200, .body = body};
  uint64_t bits;
  int64_t tenant, n = -1;
  idem_complete_t c;

  assert_int_equal(idem_random_bytes(&bits, sizeof bits), IDEM_OK);
  tenant = (int64_t)((bits >> 2) | ((uint64_t)1 << 61));
  make_fp(fp, 1);
  req = request(fx, OP_PAY, "key-1", fp);
  req.scope.tenant_id = tenant;
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
  assert_int_equal(rec.tenant_id, tenant);
  assert_int_equal(rec.state, IDEM_STATE_PROCESSING);
  idem_copy(token, sizeof token, rec.owner_token);
  c = (idem_complete_t){.scope = req.scope,
                        .owner_token = token,
                        .now_ms = fx->now,
                        .ttl_ms = TTL_MS,
                        .outcome = out,
                        .row = rec.row};
  idem_record_reset(&rec);
  assert_int_equal(idem_store_complete(fx->store, &c), IDEM_OK);

  assert_int_equal(idem_store_lookup(fx->store, &req.scope, fx->now, &rec), IDEM_OK);
  assert_int_equal(rec.tenant_id, tenant);
  assert_int_equal(rec.state, IDEM_STATE_COMPLETED);
  assert_int_equal(rec.response_status, 200);
  assert_same_json(rec.response_body, body);
  idem_record_reset(&rec);
  /* A replay, and the same key under the fixture's tenant is another. */
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_EXISTS);
  assert_int_equal(rec.state, IDEM_STATE_COMPLETED);
  idem_record_reset(&rec);
  assert_int_equal(idem_store_count(fx->store, "records", tenant, &n), IDEM_OK);
  assert_int_equal(n, 1);
  assert_int_equal(count(fx, "records"), 0);
}

static void test_reserve_won_then_exists(void **state) {
  fixture_t *fx = *state;
  char fp_a[IDEM_FINGERPRINT_LEN], fp_b[IDEM_FINGERPRINT_LEN];
  idem_record_t rec = {0};
  idem_reserve_t req;

  make_fp(fp_a, 1);
  make_fp(fp_b, 2);
  req = request(fx, OP_PAY, "key-1", fp_a);
  req.correlation_id = "req_first";
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
  assert_int_equal(rec.state, IDEM_STATE_PROCESSING);
  assert_true(rec.owner_token[0] != '\0');
  assert_int_equal(rec.tenant_id, fx->tenant.id);
  assert_string_equal(rec.operation, OP_PAY);
  assert_string_equal(rec.key, "key-1");
  assert_string_equal(rec.fingerprint, fp_a);
  assert_string_equal(rec.correlation_id, "req_first");
  assert_int_equal(rec.created_at, fx->now);
  assert_int_equal(rec.lease_expires_at, fx->now + LEASE_MS);
  assert_int_equal(rec.expires_at, 0);
  assert_int_equal(rec.response_status, 0);
  assert_null(rec.response_body);
  assert_as_stored(fx, &rec, fx->now);
  idem_record_reset(&rec);

  /* The same scope again, with the same or another request: the holder's
   * record comes back and nothing is written. */
  for (int i = 0; i < 2; i++) {
    req = request(fx, OP_PAY, "key-1", i == 0 ? fp_a : fp_b);
    req.correlation_id = "req_second";
    req.now_ms = fx->now + 10;
    assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_EXISTS);
    assert_int_equal(rec.state, IDEM_STATE_PROCESSING);
    assert_string_equal(rec.fingerprint, fp_a);
    assert_string_equal(rec.correlation_id, "req_first");
    assert_int_equal(rec.created_at, fx->now);
    idem_record_reset(&rec);
  }
  assert_int_equal(idem_store_lookup(fx->store, &req.scope, fx->now, &rec), IDEM_OK);
  assert_string_equal(rec.fingerprint, fp_a);
  idem_record_reset(&rec);
  assert_int_equal(count(fx, "records"), 1);
  assert_int_equal(count(fx, "processing"), 1);
}

static void test_scope_isolation(void **state) {
  fixture_t *fx = *state;
  char fp[IDEM_FINGERPRINT_LEN];
  idem_record_t rec = {0};
  idemd_tenant_t other;
  idemd_api_key_t other_key;
  idem_reserve_t req;

  make_fp(fp, 1);
  new_tenant(fx->tenants, &other, &other_key);
  req = request(fx, OP_PAY, "shared-key", fp);
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
  idem_record_reset(&rec);
  /* Another operation, another tenant, another case: other keys. */
  req = request(fx, OP_ORDER, "shared-key", fp);
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
  idem_record_reset(&rec);
  req = request(fx, OP_PAY, "shared-key", fp);
  req.scope.tenant_id = other.id;
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
  assert_int_equal(rec.tenant_id, other.id);
  idem_record_reset(&rec);
  req = request(fx, OP_PAY, "Shared-Key", fp);
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
  idem_record_reset(&rec);

  req = request(fx, OP_PAY, "shared-key", fp);
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_EXISTS);
  idem_record_reset(&rec);
  assert_int_equal(count(fx, "records"), 3);
  assert_int_equal(idem_store_lookup(fx->store, &(idem_scope_t){other.id, OP_ORDER,
                                                                "shared-key"},
                                     fx->now, &rec),
                   IDEM_ENOTFOUND);
}

/* Keys are opaque: quotes, backslashes and SQL travel as plain data. */
static void test_key_bytes_round_trip(void **state) {
  static const char *const keys[] = {
      "';DROP/**/TABLE/**/idempotency_records;--", "\"quoted\"", "back\\slash",
      "%s%n%x", "a'b''c", "~!@#$%^&*()_+{}|:<>?[];,./`",
  };
  fixture_t *fx = *state;
  char fp[IDEM_FINGERPRINT_LEN], longest[IDEM_KEY_MAX + 1];
  idem_record_t rec = {0};

  make_fp(fp, 7);
  for (size_t i = 0; i <= ARRAY_LEN(keys); i++) {
    const char *key = keys[i % ARRAY_LEN(keys)];
    idem_reserve_t req;
    if (i == ARRAY_LEN(keys)) {
      memset(longest, 'k', IDEM_KEY_MAX);
      longest[IDEM_KEY_MAX] = '\0';
      key = longest;
    }
    req = request(fx, OP_PAY, key, fp);
    assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
    assert_string_equal(rec.key, key);
    idem_record_reset(&rec);
    assert_int_equal(idem_store_lookup(fx->store, &req.scope, fx->now, &rec), IDEM_OK);
    assert_string_equal(rec.key, key);
    idem_record_reset(&rec);
  }
  assert_int_equal(count(fx, "records"), (int64_t)ARRAY_LEN(keys) + 1);
}

static void test_resource_outbox_and_complete(void **state) {
  static const char response[] = "{\"id\":\"x\",\"status\":\"succeeded\"}";
  static const char done[] = "{\"amount\":15990,\"status\":\"succeeded\"}";
  fixture_t *fx = *state;
  char location[64], token[IDEM_TOKEN_MAX + 1];
  idem_record_t rec = {0};
  idemd_tenant_t other;
  idemd_api_key_t other_key;
  struct payment p;
  idem_reserve_t req;
  char *body = NULL;

  new_tenant(fx->tenants, &other, &other_key);
  assert_int_equal(count(fx, "payments"), 0);
  assert_int_equal(count(fx, "outbox"), 0);
  req = reserve_payment(fx, "key-1", LEASE_MS, &p, token);
  assert_int_equal(count(fx, "payments"), 1);
  assert_int_equal(count(fx, "outbox"), 1);
  assert_int_equal(count(fx, "orders"), 0);
  assert_int_equal(idemd_resource_get(fx->store, fx->tenant.id, "payment", p.id,
                                           &body),
                   IDEM_OK);
  assert_same_json(body, p.body);
  free(body);

  snprintf(location, sizeof location, "/payments/%s", p.id);
  idem_outcome_t out = {.state = IDEM_STATE_COMPLETED, .status = 201,
                        .body = response, .location = location,
                        .provider_ref = "ch_123"};
  assert_int_equal(complete_payment(fx, &req.scope, token, fx->now + 5, TTL_MS, &out, &p,
                                    "succeeded", done),
                   IDEM_OK);
  assert_int_equal(count(fx, "outbox"), 0);
  assert_int_equal(count(fx, "payments"), 1);

  assert_int_equal(idem_store_lookup(fx->store, &req.scope, fx->now + 6, &rec), IDEM_OK);
  assert_int_equal(rec.state, IDEM_STATE_COMPLETED);
  assert_int_equal(rec.response_status, 201);
  assert_same_json(rec.response_body, response);
  assert_string_equal(rec.location, location);
  assert_string_equal(rec.resource_id, p.id);
  assert_string_equal(rec.provider_ref, "ch_123");
  assert_string_equal(rec.owner_token, "");
  assert_int_equal(rec.created_at, fx->now);
  assert_int_equal(rec.updated_at, fx->now + 5);
  assert_int_equal(rec.expires_at, fx->now + 5 + TTL_MS);
  idem_record_reset(&rec);

  assert_int_equal(idemd_resource_get(fx->store, fx->tenant.id, "payment", p.id,
                                           &body),
                   IDEM_OK);
  assert_same_json(body, done);
  free(body);
  /* Another tenant, another kind, an unknown id: not found. */
  assert_int_equal(idemd_resource_get(fx->store, other.id, "payment", p.id, &body),
                   IDEM_ENOTFOUND);
  assert_null(body);
  assert_int_equal(idemd_resource_get(fx->store, fx->tenant.id, "order", p.id,
                                           &body),
                   IDEM_ENOTFOUND);
  assert_int_equal(idemd_resource_get(fx->store, fx->tenant.id, "payment",
                                           "pay_unknown", &body),
                   IDEM_ENOTFOUND);
  int64_t n = -1;
  assert_int_equal(idemd_resource_count(fx->store, "widgets", fx->tenant.id, &n), IDEM_EINVAL);
}

/* An asynchronous write's callback: records its result, once. */
struct async_result {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  int calls, rc;
};

static void async_done(void *arg, int rc) {
  struct async_result *a = arg;
  pthread_mutex_lock(&a->lock);
  a->calls++;
  a->rc = rc;
  pthread_cond_signal(&a->cond);
  pthread_mutex_unlock(&a->lock);
}

/* Waits for the callback; returns its rc. */
static int async_wait(struct async_result *a) {
  int rc;
  pthread_mutex_lock(&a->lock);
  while (a->calls == 0)
    pthread_cond_wait(&a->cond, &a->lock);
  rc = a->rc;
  a->calls = 0;
  pthread_mutex_unlock(&a->lock);
  return rc;
}

/* The asynchronous forms (both stores): the same results as the
 * synchronous ones (won, then exists without the owner token; a
 * completion by its owner, IDEM_ELOST for anyone else), each callback
 * called once. On a store without them: IDEM_ENOTSUP and no callback. */
static void test_async_reserve_and_complete(void **state) {
  fixture_t *fx = *state;
  struct async_result a = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0};
  char fp[IDEM_FINGERPRINT_LEN];
  idem_record_t won = {0}, again = {0}, rec = {0};
  idem_reserve_result_t result = 0;
  idem_reserve_t req;
  idem_complete_t c;
  idem_outcome_t out = {.state = IDEM_STATE_COMPLETED, .status = 201, .body = "{}"};
  int rc;

  make_fp(fp, 1);
  req = request(fx, "create_order", "async-1", fp);
  rc = idem_store_reserve_async(fx->store, &req, &won, &result, async_done, &a);
  if (!idem_store_async_writes(fx->store)) {
    assert_int_equal(rc, IDEM_ENOTSUP);
    assert_int_equal(a.calls, 0);
    return;
  }
  assert_int_equal(rc, IDEM_OK);
  assert_int_equal(async_wait(&a), IDEM_OK);
  assert_int_equal(result, IDEM_RESERVE_WON);
  assert_int_equal(won.state, IDEM_STATE_PROCESSING);
  assert_true(won.owner_token[0] != '\0');

  assert_int_equal(idem_store_reserve_async(fx->store, &req, &again, &result, async_done, &a),
                   IDEM_OK);
  assert_int_equal(async_wait(&a), IDEM_OK);
  assert_int_equal(result, IDEM_RESERVE_EXISTS);
  assert_string_equal(again.owner_token, "");

  c = (idem_complete_t){.scope = req.scope, .owner_token = "not-the-owner",
                        .now_ms = fx->now + 1, .ttl_ms = TTL_MS, .outcome = out};
  assert_int_equal(idem_store_complete_async(fx->store, &c, async_done, &a), IDEM_OK);
  assert_int_equal(async_wait(&a), IDEM_ELOST);
  c.owner_token = won.owner_token;
  assert_int_equal(idem_store_complete_async(fx->store, &c, async_done, &a), IDEM_OK);
  assert_int_equal(async_wait(&a), IDEM_OK);
  assert_int_equal(idem_store_lookup(fx->store, &req.scope, fx->now + 2, &rec), IDEM_OK);
  assert_int_equal(rec.state, IDEM_STATE_COMPLETED);
  assert_int_equal(rec.response_status, 201);
  /* Arguments are checked before anything is queued. */
  c.owner_token = "";
  assert_int_equal(idem_store_complete_async(fx->store, &c, async_done, &a), IDEM_EINVAL);
  assert_int_equal(a.calls, 0);
  idem_record_reset(&won);
  idem_record_reset(&again);
  idem_record_reset(&rec);
}

/* A done callback that writes synchronously: forbidden by store.h (it
 * runs on the writer, which would wait on itself). */
struct sync_from_callback {
  struct async_result a;
  idem_store_t *store;
  idem_complete_t c;
  int sync_rc;
};

static void write_from_callback(void *arg, int rc) {
  struct sync_from_callback *sc = arg;
  sc->sync_rc = idem_store_complete(sc->store, &sc->c);
  async_done(&sc->a, rc);
}

/* The forbidden write fails at once with IDEM_EINVAL, instead of hanging
 * the writer (and with it every write of the store); the store goes on. */
static void test_sync_write_from_callback_fails(void **state) {
  fixture_t *fx = *state;
  struct sync_from_callback sc = {
      .a = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0},
      .store = fx->store};
  char fp[IDEM_FINGERPRINT_LEN];
  idem_record_t won = {0}, rec = {0};
  idem_reserve_result_t result = 0;
  idem_reserve_t req;
  idem_outcome_t out = {.state = IDEM_STATE_COMPLETED, .status = 201, .body = "{}"};

  if (!idem_store_async_writes(fx->store))
    skip();
  make_fp(fp, 1);
  req = request(fx, "create_order", "from-callback", fp);
  assert_int_equal(idem_store_reserve(fx->store, &req, &won, &result), IDEM_OK);
  sc.c = (idem_complete_t){.scope = req.scope, .owner_token = won.owner_token,
                           .now_ms = fx->now + 1, .ttl_ms = TTL_MS, .outcome = out};
  assert_int_equal(idem_store_complete_async(fx->store, &sc.c, write_from_callback, &sc),
                   IDEM_OK);
  assert_int_equal(async_wait(&sc.a), IDEM_OK);
  assert_int_equal(sc.sync_rc, IDEM_EINVAL);
  /* The writer still writes. */
  req = request(fx, "create_order", "after-callback", fp);
  assert_int_equal(idem_store_reserve(fx->store, &req, &rec, &result), IDEM_OK);
  assert_int_equal(result, IDEM_RESERVE_WON);
  idem_record_reset(&won);
  idem_record_reset(&rec);
}

/* Counts the callbacks of many asynchronous writes. */
struct async_many {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  int calls;
  int rc[64];
};

struct async_slot {
  struct async_many *m;
  int i;
};

static void async_many_done(void *arg, int rc) {
  struct async_slot *sl = arg;
  pthread_mutex_lock(&sl->m->lock);
  sl->m->rc[sl->i] = rc;
  sl->m->calls++;
  pthread_cond_signal(&sl->m->cond);
  pthread_mutex_unlock(&sl->m->lock);
}

/* A write that fails among others queued with it: it alone fails and
 * leaves nothing behind (here a reservation whose payment id is taken,
 * after its record was inserted), and every other write of its batch is
 * kept. On both stores the writes of a batch first run without
 * savepoints, so the failure rolls the batch back and runs it again write
 * by write (on PostgreSQL the failed INSERT aborted the transaction). */
static void test_failed_write_among_others(void **state) {
  enum { N = 41, BAD = 20 };
  fixture_t *fx = *state;
  struct async_many m = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, {0}};
  struct async_slot slots[N];
  struct payment pays[N], taken;
  idem_reserve_t reqs[N];
  idem_record_t recs[N], rec = {0};
  idem_reserve_result_t results[N];
  char fp[IDEM_FINGERPRINT_LEN], keys[N][32];
  idem_store_stats_t before, after;

  if (!idem_store_async_writes(fx->store))
    skip();
  make_fp(fp, 1);
  new_payment(&taken);
  {
    idem_reserve_t first = request(fx, OP_PAY, "holds-the-id", fp);
    with_payment(&first, &taken, 0);
    assert_int_equal(reserve(fx, &first, &rec), IDEM_RESERVE_WON);
    idem_record_reset(&rec);
  }
  idem_store_stats(fx->store, &before);
  memset(recs, 0, sizeof recs);
  for (int i = 0; i < N; i++) {
    snprintf(keys[i], sizeof keys[i], "batch-%d", i);
    new_payment(&pays[i]);
    reqs[i] = request(fx, OP_PAY, keys[i], fp);
    if (i == BAD) /* the id `taken` has: the effect fails */
      pays[i].res.id = taken.id;
    with_payment(&reqs[i], &pays[i], 1);
    slots[i] = (struct async_slot){&m, i};
  }
  /* Queued back to back: most land in one batch with the bad one. */
  for (int i = 0; i < N; i++)
    assert_int_equal(idem_store_reserve_async(fx->store, &reqs[i], &recs[i], &results[i],
                                              async_many_done, &slots[i]),
                     IDEM_OK);
  pthread_mutex_lock(&m.lock);
  while (m.calls < N)
    pthread_cond_wait(&m.cond, &m.lock);
  pthread_mutex_unlock(&m.lock);

  for (int i = 0; i < N; i++) {
    idem_scope_t sc = {fx->tenant.id, OP_PAY, keys[i]};
    if (i == BAD) {
      assert_int_not_equal(m.rc[i], IDEM_OK);
      assert_int_equal(idem_store_lookup(fx->store, &sc, fx->now, &rec), IDEM_ENOTFOUND);
      continue;
    }
    assert_int_equal(m.rc[i], IDEM_OK);
    assert_int_equal(results[i], IDEM_RESERVE_WON);
    assert_string_equal(recs[i].resource_id, pays[i].id);
    assert_as_stored(fx, &recs[i], fx->now);
    idem_record_reset(&recs[i]);
  }
  /* N - 1 payments and their outbox rows, plus the first one's. */
  assert_int_equal(count(fx, "payments"), N);
  assert_int_equal(count(fx, "outbox"), N - 1);
  idem_store_stats(fx->store, &after);
  assert_true(after.batch_reruns > before.batch_reruns);
}

/* A session of its own that holds the lock every write of a record needs
 * (SQLite: BEGIN IMMEDIATE; PostgreSQL: the records table in SHARE
 * mode), until lock_release(). */
struct write_lock {
  sqlite3 *db;
  PGconn *pg;
};

static void lock_hold(fixture_t *fx, struct write_lock *l) {
  memset(l, 0, sizeof *l);
  if (fx->dir[0]) {
    assert_int_equal(sqlite3_open(fx->path, &l->db), SQLITE_OK);
    assert_int_equal(sqlite3_exec(l->db, "BEGIN IMMEDIATE", NULL, NULL, NULL), SQLITE_OK);
  } else {
    PGresult *res;
    l->pg = PQconnectdb(getenv("IDEM_TEST_STORE_URL"));
    assert_int_equal(PQstatus(l->pg), CONNECTION_OK);
    res = PQexec(l->pg, "BEGIN; LOCK TABLE idempotency_records IN SHARE MODE");
    assert_int_equal(PQresultStatus(res), PGRES_COMMAND_OK);
    PQclear(res);
  }
}

static void lock_release(struct write_lock *l) {
  if (l->db) {
    assert_int_equal(sqlite3_exec(l->db, "COMMIT", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(l->db);
  } else {
    PQclear(PQexec(l->pg, "COMMIT"));
    PQfinish(l->pg);
  }
}

/* The group commit batches: N reservations queued while another session
 * holds the write lock are committed in fewer transactions than writes.
 * Not a timing assertion: while the lock is held no transaction can
 * commit, so each writer (one on SQLite, a few on PostgreSQL) holds at
 * most one batch stuck on it, and all else queued by the time it is
 * released is taken at once by the first writer that comes free. */
static void test_group_commit_batches(void **state) {
  enum { N = 40 };
  fixture_t *fx = *state;
  struct async_many m = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, {0}};
  struct async_slot slots[N];
  idem_reserve_t reqs[N];
  idem_record_t recs[N];
  idem_reserve_result_t results[N];
  char fp[IDEM_FINGERPRINT_LEN], keys[N][32];
  idem_store_stats_t before, after;
  struct write_lock lock;

  if (!idem_store_async_writes(fx->store))
    skip();
  make_fp(fp, 1);
  memset(recs, 0, sizeof recs);
  idem_store_stats(fx->store, &before);
  lock_hold(fx, &lock);
  for (int i = 0; i < N; i++) {
    snprintf(keys[i], sizeof keys[i], "grouped-%d", i);
    reqs[i] = request(fx, "create_order", keys[i], fp);
    slots[i] = (struct async_slot){&m, i};
    assert_int_equal(idem_store_reserve_async(fx->store, &reqs[i], &recs[i], &results[i],
                                              async_many_done, &slots[i]),
                     IDEM_OK);
  }
  lock_release(&lock);
  pthread_mutex_lock(&m.lock);
  while (m.calls < N)
    pthread_cond_wait(&m.cond, &m.lock);
  pthread_mutex_unlock(&m.lock);
  for (int i = 0; i < N; i++) {
    assert_int_equal(m.rc[i], IDEM_OK);
    assert_int_equal(results[i], IDEM_RESERVE_WON);
    idem_record_reset(&recs[i]);
  }
  idem_store_stats(fx->store, &after);
  assert_int_equal(after.writes - before.writes, N);
  /* At most a stuck batch per writer (4 on PostgreSQL), then the rest. */
  assert_true(after.commits - before.commits <= N / 4);
  assert_int_equal(count(fx, "processing"), N);
}

/* An effect that, on its first run only, ends its own connection
 * (PostgreSQL's pg_terminate_backend(), as a server restart would) and
 * fails. */
static int kill_connection_once(void *arg, idem_tx_t *tx) {
  int *runs = arg;
  if ((*runs)++ > 0)
    return IDEM_OK;
  PQclear(PQexec(idem_tx_handle(tx), "SELECT pg_terminate_backend(pg_backend_pid())"));
  return IDEM_ESTORE;
}

/* A batch whose connection is lost before its COMMIT (a server restart)
 * committed nothing, and runs again on a fresh connection: every write of
 * it is kept, the one whose first run lost the connection too (on the
 * dead connection, each would fail). The four writers are held on a
 * locked table by a write each, so that the writes queued after are
 * taken in one batch once the lock is released. */
static void test_batch_connection_lost_runs_again(void **state) {
  enum { HELD = 4, N = 8 };
  fixture_t *fx = *state;
  struct async_many m = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, {0}};
  struct async_slot slots[HELD + N];
  idem_reserve_t reqs[HELD + N];
  idem_record_t recs[HELD + N];
  idem_reserve_result_t results[HELD + N];
  char fp[IDEM_FINGERPRINT_LEN], keys[HELD + N][32];
  struct write_lock lock;
  int runs = 0;

  if (fx->dir[0])
    skip(); /* PostgreSQL's connections */
  make_fp(fp, 1);
  memset(recs, 0, sizeof recs);
  lock_hold(fx, &lock);
  for (int i = 0; i < HELD + N; i++) {
    snprintf(keys[i], sizeof keys[i], "%s-%d", i < HELD ? "held" : "lost", i);
    reqs[i] = request(fx, "create_order", keys[i], fp);
    if (i == HELD)
      reqs[i].effect = (idem_effect_t){kill_connection_once, &runs};
    slots[i] = (struct async_slot){&m, i};
    assert_int_equal(idem_store_reserve_async(fx->store, &reqs[i], &recs[i], &results[i],
                                              async_many_done, &slots[i]),
                     IDEM_OK);
    if (i < HELD)
      usleep(50 * 1000); /* taken by an idle writer, which the lock holds */
  }
  usleep(50 * 1000);
  lock_release(&lock);
  pthread_mutex_lock(&m.lock);
  while (m.calls < HELD + N)
    pthread_cond_wait(&m.cond, &m.lock);
  pthread_mutex_unlock(&m.lock);
  for (int i = 0; i < HELD + N; i++) {
    if (m.rc[i] != IDEM_OK)
      fail_msg("%s: %s", keys[i], idem_err_name(m.rc[i]));
    assert_int_equal(results[i], IDEM_RESERVE_WON);
    idem_record_reset(&recs[i]);
  }
  assert_int_equal(runs, 2);
  assert_int_equal(count(fx, "processing"), HELD + N);
}

/* An effect that fails with IDEM_ENOTFOUND, its message set on the thread
 * it runs on (a writer's). */
static int fail_not_found(void *arg, idem_tx_t *tx) {
  (void)arg;
  (void)tx;
  return IDEM_ENOTFOUND;
}

struct error_seen {
  struct async_many *m;
  char text[256];
};

static void keep_error(void *arg, int rc) {
  struct error_seen *e = arg;
  snprintf(e->text, sizeof e->text, "%s", idem_store_last_error());
  pthread_mutex_lock(&e->m->lock);
  e->m->rc[0] = rc;
  e->m->calls++;
  pthread_cond_signal(&e->m->cond);
  pthread_mutex_unlock(&e->m->lock);
}

/* The message of a write that failed on a writer thread reaches its
 * caller's thread (for its log line): after a synchronous write, and in
 * an asynchronous one's callback. PostgreSQL's writers (SQLite's writer
 * does not pass it on yet). */
static void test_write_error_reaches_caller(void **state) {
  fixture_t *fx = *state;
  struct async_many m = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, {0}};
  struct error_seen seen = {&m, ""};
  idem_effect_t e = {fail_not_found, NULL};
  char fp[IDEM_FINGERPRINT_LEN];
  idem_reserve_t req;
  idem_record_t rec = {0};
  idem_reserve_result_t result;

  if (fx->dir[0])
    skip();
  assert_int_equal(idem_store_write(fx->store, &e), IDEM_ENOTFOUND);
  if (strstr(idem_store_last_error(), "ENOTFOUND") == NULL)
    fail_msg("after a synchronous write: \"%s\"", idem_store_last_error());
  make_fp(fp, 1);
  req = request(fx, OP_ORDER, "error-text", fp);
  req.effect = e;
  assert_int_equal(idem_store_reserve_async(fx->store, &req, &rec, &result, keep_error, &seen),
                   IDEM_OK);
  pthread_mutex_lock(&m.lock);
  while (m.calls < 1)
    pthread_cond_wait(&m.cond, &m.lock);
  pthread_mutex_unlock(&m.lock);
  assert_int_equal(m.rc[0], IDEM_ENOTFOUND);
  if (strstr(seen.text, "ENOTFOUND") == NULL)
    fail_msg("in an asynchronous write's callback: \"%s\"", seen.text);
  idem_record_reset(&rec);
}

/* Readers that hold a pooled connection each until released. */
struct held_reads {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  int inside, released;
  idem_store_t *store;
};

static int hold_connection(void *arg, idem_tx_t *tx) {
  struct held_reads *h = arg;
  (void)tx;
  pthread_mutex_lock(&h->lock);
  h->inside++;
  pthread_cond_broadcast(&h->cond);
  while (!h->released)
    pthread_cond_wait(&h->cond, &h->lock);
  pthread_mutex_unlock(&h->lock);
  return IDEM_OK;
}

static void *read_and_hold(void *arg) {
  struct held_reads *h = arg;
  idem_effect_t e = {hold_connection, h};
  return (void *)(intptr_t)idem_store_read(h->store, &e);
}

/* Reads that hold every connection of the pool do not starve the writes
 * (PostgreSQL): each writer has a connection of its own, outside the
 * pool's limit. Without, the reservation waits the bound for a pooled
 * connection and fails. */
static void test_reads_do_not_starve_writes(void **state) {
  enum { POOL = 2 };
  fixture_t *fx = *state;
  idem_store_options_t opts = {.pool_size = POOL, .db_timeout_ms = 1000};
  struct held_reads h = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, NULL};
  pthread_t readers[POOL];
  char fp[IDEM_FINGERPRINT_LEN];
  idem_reserve_t req;
  idem_record_t rec = {0};
  idem_reserve_result_t result;
  int rc;

  if (fx->dir[0])
    skip();
  assert_int_equal(idem_store_open(getenv("IDEM_TEST_STORE_URL"), &opts, &h.store), IDEM_OK);
  for (int i = 0; i < POOL; i++)
    assert_int_equal(pthread_create(&readers[i], NULL, read_and_hold, &h), 0);
  pthread_mutex_lock(&h.lock);
  while (h.inside < POOL)
    pthread_cond_wait(&h.cond, &h.lock);
  pthread_mutex_unlock(&h.lock);
  make_fp(fp, 1);
  req = request(fx, OP_ORDER, "not-starved", fp);
  rc = idem_store_reserve(h.store, &req, &rec, &result);
  pthread_mutex_lock(&h.lock);
  h.released = 1;
  pthread_cond_broadcast(&h.cond);
  pthread_mutex_unlock(&h.lock);
  for (int i = 0; i < POOL; i++) {
    void *read_rc;
    pthread_join(readers[i], &read_rc);
    assert_int_equal((int)(intptr_t)read_rc, IDEM_OK);
  }
  if (rc != IDEM_OK)
    fail_msg("reserve while reads hold the pool: %s (%s)", idem_err_name(rc),
             idem_store_last_error());
  assert_int_equal(result, IDEM_RESERVE_WON);
  idem_record_reset(&rec);
  idem_store_close(h.store);
}

/* NOTIFY after a batched commit (PostgreSQL): completions committed
 * together by one store wake the waiters of another store on the same
 * database, as another instance's would be. The second store's listener
 * is known to listen before the tickets are taken, so a wake-up can come
 * only from the completions' NOTIFYs. */
/* What idem_store_listen()'s function was told, for the test below. */
struct heard {
  pthread_mutex_t lock;
  int listening, notes;
};

static void heard_fn(void *arg, int listening) {
  struct heard *h = arg;

  pthread_mutex_lock(&h->lock);
  if (listening && h->listening)
    h->notes++; /* a notification after the LISTEN */
  h->listening = listening;
  pthread_mutex_unlock(&h->lock);
}

static int heard_get(struct heard *h, int notes) {
  int v;

  pthread_mutex_lock(&h->lock);
  v = notes ? h->notes : h->listening;
  pthread_mutex_unlock(&h->lock);
  return v;
}

/* A channel named like a keyword ("user") is listened to (its LISTEN
 * quoted) and its notifications arrive; before, its LISTEN failed and
 * the listener reconnected at once, forever. */
static void test_listen_keyword_channel(void **state) {
  fixture_t *fx = *state;
  const char *url = getenv("IDEM_TEST_STORE_URL");
  struct heard h = {PTHREAD_MUTEX_INITIALIZER, 0, 0};
  idem_store_t *other = NULL;
  PGconn *pg;
  PGresult *res;

  if (fx->dir[0])
    skip(); /* SQLite has no listener */
  assert_int_equal(idem_store_open(url, NULL, &other), IDEM_OK);
  assert_int_equal(idem_store_listen(other, "user", heard_fn, &h), IDEM_OK);
  for (int tries = 0; tries < 1000 && !heard_get(&h, 0); tries++)
    usleep(10 * 1000);
  assert_true(heard_get(&h, 0));
  pg = PQconnectdb(url);
  assert_int_equal(PQstatus(pg), CONNECTION_OK);
  res = PQexec(pg, "SELECT pg_notify('user', '')");
  assert_int_equal(PQresultStatus(res), PGRES_TUPLES_OK);
  PQclear(res);
  PQfinish(pg);
  for (int tries = 0; tries < 1000 && heard_get(&h, 1) == 0; tries++)
    usleep(10 * 1000);
  assert_true(heard_get(&h, 1) >= 1);
  assert_int_equal(idem_store_listen(other, NULL, heard_fn, &h), IDEM_OK);
  idem_store_close(other);
}

static void test_batched_commit_notifies_other_store(void **state) {
  enum { N = 6 };
  fixture_t *fx = *state;
  const char *url = getenv("IDEM_TEST_STORE_URL");
  struct async_many m = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, {0}};
  struct async_slot slots[N];
  idem_complete_t cs[N];
  idem_reserve_t reqs[N];
  idem_record_t recs[N];
  uint64_t tickets[N];
  char fp[IDEM_FINGERPRINT_LEN], keys[N][32];
  idem_outcome_t out = {.state = IDEM_STATE_COMPLETED, .status = 201, .body = "{}"};
  idem_store_t *other = NULL;
  PGconn *pg;
  int listening = 0;

  if (fx->dir[0])
    skip(); /* one process per SQLite file: nothing to notify */
  assert_int_equal(idem_store_open(url, NULL, &other), IDEM_OK);
  /* Both stores' listeners (fx->store's and other's) idle after LISTEN. */
  pg = PQconnectdb(url);
  assert_int_equal(PQstatus(pg), CONNECTION_OK);
  for (int tries = 0; tries < 500 && listening < 2; tries++) {
    PGresult *res = PQexec(pg, "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle' "
                               "AND query LIKE 'LISTEN %'");
    assert_int_equal(PQresultStatus(res), PGRES_TUPLES_OK);
    listening = atoi(PQgetvalue(res, 0, 0));
    PQclear(res);
    if (listening < 2)
      usleep(10 * 1000);
  }
  PQfinish(pg);
  assert_true(listening >= 2);

  make_fp(fp, 1);
  memset(recs, 0, sizeof recs);
  for (int i = 0; i < N; i++) {
    snprintf(keys[i], sizeof keys[i], "notified-%d", i);
    reqs[i] = request(fx, "create_order", keys[i], fp);
    assert_int_equal(reserve(fx, &reqs[i], &recs[i]), IDEM_RESERVE_WON);
    tickets[i] = idem_store_watch(other, &reqs[i].scope);
  }
  for (int i = 0; i < N; i++) {
    cs[i] = (idem_complete_t){.scope = reqs[i].scope, .owner_token = recs[i].owner_token,
                              .now_ms = fx->now + 1, .ttl_ms = TTL_MS, .outcome = out};
    slots[i] = (struct async_slot){&m, i};
    assert_int_equal(idem_store_complete_async(fx->store, &cs[i], async_many_done, &slots[i]),
                     IDEM_OK);
  }
  for (int i = 0; i < N; i++)
    assert_int_equal(idem_store_wait(other, &reqs[i].scope, tickets[i], 10000), IDEM_OK);
  pthread_mutex_lock(&m.lock);
  while (m.calls < N)
    pthread_cond_wait(&m.cond, &m.lock);
  pthread_mutex_unlock(&m.lock);
  for (int i = 0; i < N; i++) {
    assert_int_equal(m.rc[i], IDEM_OK);
    idem_record_reset(&recs[i]);
  }
  idem_store_close(other);
}

static void test_complete_needs_the_owner(void **state) {
  static const char first[] = "{\"n\":1}", second[] = "{\"n\":2}";
  fixture_t *fx = *state;
  char token[IDEM_TOKEN_MAX + 1];
  idem_record_t rec = {0};
  struct payment p;
  char *body = NULL;
  idem_outcome_t out = {.state = IDEM_STATE_COMPLETED, .status = 201, .body = first};
  idem_reserve_t req = reserve_payment(fx, "key-1", LEASE_MS, &p, token);
  const char *row = first; /* the payment's body a completion writes */

  assert_int_equal(complete_payment(fx, &req.scope, "not-the-owner", fx->now, TTL_MS, &out,
                                    &p, "succeeded", row),
                   IDEM_ELOST);
  /* Nothing changed: record, outbox and resource are as reserved. */
  assert_int_equal(idem_store_lookup(fx->store, &req.scope, fx->now, &rec), IDEM_OK);
  assert_int_equal(rec.state, IDEM_STATE_PROCESSING);
  assert_string_equal(rec.owner_token, token);
  assert_int_equal(rec.response_status, 0);
  assert_null(rec.response_body);
  idem_record_reset(&rec);
  assert_int_equal(count(fx, "outbox"), 1);
  assert_int_equal(idemd_resource_get(fx->store, fx->tenant.id, "payment", p.id,
                                           &body),
                   IDEM_OK);
  assert_same_json(body, p.body);
  free(body);

  assert_int_equal(complete_payment(fx, &req.scope, token, fx->now, TTL_MS, &out, &p,
                                    "succeeded", row),
                   IDEM_OK);
  /* A second completion, even by the owner, finds the record done. */
  out.status = 500;
  out.body = second;
  row = second;
  assert_int_equal(complete_payment(fx, &req.scope, token, fx->now, TTL_MS, &out, &p,
                                    "succeeded", row),
                   IDEM_ELOST);
  assert_int_equal(complete_payment(fx, &req.scope, "not-the-owner", fx->now, TTL_MS, &out,
                                    &p, "succeeded", row),
                   IDEM_ELOST);
  assert_int_equal(idem_store_lookup(fx->store, &req.scope, fx->now, &rec), IDEM_OK);
  assert_int_equal(rec.state, IDEM_STATE_COMPLETED);
  assert_int_equal(rec.response_status, 201);
  assert_same_json(rec.response_body, first);
  idem_record_reset(&rec);
  assert_int_equal(idemd_resource_get(fx->store, fx->tenant.id, "payment", p.id,
                                           &body),
                   IDEM_OK);
  assert_same_json(body, first);
  free(body);

  /* A scope that was never reserved has no owner at all. */
  req.scope.key = "never-reserved";
  assert_int_equal(complete(fx, &req.scope, token, fx->now, TTL_MS, &out), IDEM_ELOST);
}

/* idem_complete_t.row is a hint: a row that holds another record, even
 * one in flight, or no record at all, still completes the record of the
 * scope and owner, and only that one; the right row with the wrong owner
 * or scope completes nothing. On SQLite a new key's reservation returns
 * its rowid; a store that has none returns 0. */
static void test_complete_row_is_a_hint(void **state) {
  static const char body[] = "{\"n\":1}";
  static const char fp_c[] = "00000000000000000000000000000000000000000000000000000000000000bb";
  fixture_t *fx = *state;
  char token_a[IDEM_TOKEN_MAX + 1], token_b[IDEM_TOKEN_MAX + 1];
  char token_c[IDEM_TOKEN_MAX + 1];
  idem_record_t rec = {0};
  struct payment pa, pb;
  idem_outcome_t out = {.state = IDEM_STATE_COMPLETED, .status = 201, .body = body};
  idem_reserve_t req_a = reserve_payment(fx, "key-a", LEASE_MS, &pa, token_a);
  idem_reserve_t req_b = reserve_payment(fx, "key-b", LEASE_MS, &pb, token_b);
  idem_reserve_t req_c = request(fx, OP_PAY, "key-c", fp_c);
  idem_complete_t c = {.now_ms = fx->now, .ttl_ms = TTL_MS, .outcome = out};
  int64_t row_c;

  assert_int_equal(reserve(fx, &req_c, &rec), IDEM_RESERVE_WON);
  row_c = rec.row;
  idem_copy(token_c, sizeof token_c, rec.owner_token);
  idem_record_reset(&rec);
  if (strcmp(idem_store_backend(fx->store), "sqlite") == 0)
    assert_true(row_c > 0);
  else
    assert_int_equal(row_c, 0);

  /* key-c's own row, with another owner, or with key-a's scope: nothing. */
  c.scope = req_c.scope;
  c.owner_token = token_a;
  c.row = row_c;
  assert_int_equal(idem_store_complete(fx->store, &c), IDEM_ELOST);
  c.scope = req_a.scope;
  c.owner_token = token_c;
  assert_int_equal(idem_store_complete(fx->store, &c), IDEM_ELOST);
  assert_int_equal(idem_store_lookup(fx->store, &req_c.scope, fx->now, &rec), IDEM_OK);
  assert_int_equal(rec.state, IDEM_STATE_PROCESSING);
  idem_record_reset(&rec);
  assert_int_equal(idem_store_lookup(fx->store, &req_a.scope, fx->now, &rec), IDEM_OK);
  assert_int_equal(rec.state, IDEM_STATE_PROCESSING);
  idem_record_reset(&rec);

  /* key-a completed with key-c's row, key-b with a row that holds nothing. */
  c.owner_token = token_a;
  assert_int_equal(idem_store_complete(fx->store, &c), IDEM_OK);
  c.scope = req_b.scope;
  c.owner_token = token_b;
  c.row = INT64_MAX;
  assert_int_equal(idem_store_complete(fx->store, &c), IDEM_OK);
  assert_int_equal(idem_store_lookup(fx->store, &req_a.scope, fx->now, &rec), IDEM_OK);
  assert_int_equal(rec.state, IDEM_STATE_COMPLETED);
  assert_same_json(rec.response_body, body);
  idem_record_reset(&rec);
  assert_int_equal(idem_store_lookup(fx->store, &req_b.scope, fx->now, &rec), IDEM_OK);
  assert_int_equal(rec.state, IDEM_STATE_COMPLETED);
  idem_record_reset(&rec);
  /* key-c, whose row the first of them named, is still in flight. */
  assert_int_equal(idem_store_lookup(fx->store, &req_c.scope, fx->now, &rec), IDEM_OK);
  assert_int_equal(rec.state, IDEM_STATE_PROCESSING);
  assert_int_equal(rec.response_status, 0);
  idem_record_reset(&rec);
  assert_int_equal(count(fx, "processing"), 1);

  /* And key-c, with its own row and owner. */
  c.scope = req_c.scope;
  c.owner_token = token_c;
  c.row = row_c;
  assert_int_equal(idem_store_complete(fx->store, &c), IDEM_OK);
  assert_int_equal(count(fx, "processing"), 0);
}

/* Orders reserve, insert and complete in one call. */
static void test_single_step_reserve(void **state) {
  static const char order[] = "{\"id\":\"ord_1\",\"total\":2000,\"status\":\"created\"}";
  fixture_t *fx = *state;
  char fp[IDEM_FINGERPRINT_LEN], id[40], location[64];
  idem_record_t rec = {0};
  idem_reserve_t req;

  make_fp(fp, 3);
  random_name(id, sizeof id, "ord_");
  snprintf(location, sizeof location, "/orders/%s", id);
  idemd_resource_t res = {.tenant_id = fx->tenant.id, .kind = "order", .id = id,
                          .status = "created", .body = order};
  idem_outcome_t out = {.state = IDEM_STATE_COMPLETED, .status = 201, .body = order,
                        .location = location};
  req = request(fx, OP_ORDER, "key-1", fp);
  req.resource_id = id;
  req.effect = (idem_effect_t){idemd_resource_insert, &res};
  req.outcome = &out;
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
  assert_int_equal(rec.state, IDEM_STATE_COMPLETED);
  assert_int_equal(rec.response_status, 201);
  assert_same_json(rec.response_body, order);
  assert_string_equal(rec.location, location);
  assert_string_equal(rec.resource_id, id);
  assert_string_equal(rec.owner_token, "");
  assert_int_equal(rec.expires_at, fx->now + TTL_MS);
  /* Built from what was written on SQLite; the same as a read. */
  assert_as_stored(fx, &rec, fx->now);
  idem_record_reset(&rec);
  assert_int_equal(count(fx, "orders"), 1);
  assert_int_equal(count(fx, "outbox"), 0);
  assert_int_equal(count(fx, "processing"), 0);
  {
    /* A pending outcome that names its resource and provider reference,
     * with no body. */
    char id2[40];
    idemd_resource_t res2 = {.tenant_id = fx->tenant.id, .kind = "order",
                             .status = "created", .body = order};
    idem_outcome_t pending = {.state = IDEM_STATE_PENDING, .status = 202,
                              .resource_id = id2, .provider_ref = "ref-9"};
    idem_reserve_t req2 = request(fx, OP_ORDER, "key-pending", fp);
    random_name(id2, sizeof id2, "ord_");
    res2.id = id2;
    req2.effect = (idem_effect_t){idemd_resource_insert, &res2};
    req2.outcome = &pending;
    assert_int_equal(reserve(fx, &req2, &rec), IDEM_RESERVE_WON);
    assert_int_equal(rec.state, IDEM_STATE_PENDING);
    assert_int_equal(rec.expires_at, 0);
    assert_string_equal(rec.provider_ref, "ref-9");
    assert_null(rec.response_body);
    assert_as_stored(fx, &rec, fx->now);
    idem_record_reset(&rec);
  }

  req.now_ms = fx->now + 1000;
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_EXISTS);
  assert_int_equal(rec.state, IDEM_STATE_COMPLETED);
  assert_same_json(rec.response_body, order);
  idem_record_reset(&rec);
  assert_int_equal(count(fx, "orders"), 2);
}

static void test_pending_outcome(void **state) {
  static const char accepted[] = "{\"status\":\"pending\"}";
  fixture_t *fx = *state;
  char token[IDEM_TOKEN_MAX + 1];
  const int64_t decade = (int64_t)10 * 365 * 86400 * 1000;
  idem_record_t rec = {0};
  struct payment p;
  idem_outcome_t out = {.state = IDEM_STATE_PENDING, .status = 202, .body = accepted,
                        .location = "/payments/x"};
  idem_reserve_t req = reserve_payment(fx, "key-1", LEASE_MS, &p, token);

  assert_int_equal(complete_payment(fx, &req.scope, token, fx->now, 1, &out, &p, "pending",
                                    NULL),
                   IDEM_OK);

  assert_int_equal(idem_store_lookup(fx->store, &req.scope, fx->now, &rec), IDEM_OK);
  assert_int_equal(rec.state, IDEM_STATE_PENDING);
  assert_int_equal(rec.response_status, 202);
  assert_same_json(rec.response_body, accepted);
  assert_int_equal(rec.expires_at, 0);
  idem_record_reset(&rec);
  /* The outbox row stays: the reconciler needs it. */
  assert_int_equal(count(fx, "outbox"), 1);
  assert_int_equal(count(fx, "pending"), 1);

  /* Never expires, is never taken over, and is no longer processing. */
  assert_int_equal(idem_store_lookup(fx->store, &req.scope, fx->now + decade, &rec),
                   IDEM_OK);
  assert_int_equal(rec.state, IDEM_STATE_PENDING);
  idem_record_reset(&rec);
  req.now_ms = fx->now + decade;
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_EXISTS);
  assert_int_equal(rec.state, IDEM_STATE_PENDING);
  idem_record_reset(&rec);
  out.state = IDEM_STATE_COMPLETED;
  assert_int_equal(complete(fx, &req.scope, token, fx->now, TTL_MS, &out), IDEM_ELOST);
}

static void test_expired_record_is_taken_over(void **state) {
  fixture_t *fx = *state;
  char fp_a[IDEM_FINGERPRINT_LEN], fp_b[IDEM_FINGERPRINT_LEN];
  char first[IDEM_TOKEN_MAX + 1];
  const int64_t later = fx->now + 3600 * 1000;
  idem_record_t rec = {0};
  idem_reserve_t req;
  idem_outcome_t out = {.state = IDEM_STATE_COMPLETED, .status = 201,
                        .body = "{\"n\":1}", .location = "/payments/x"};

  make_fp(fp_a, 1);
  make_fp(fp_b, 2);
  req = request(fx, OP_PAY, "key-1", fp_a);
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
  idem_copy(first, sizeof first, rec.owner_token);
  idem_record_reset(&rec);
  assert_int_equal(complete(fx, &req.scope, first, fx->now, 1, &out), IDEM_OK);
  assert_int_equal(idem_store_lookup(fx->store, &req.scope, fx->now, &rec), IDEM_OK);
  assert_int_equal(rec.expires_at, fx->now + 1);
  idem_record_reset(&rec);

  /* Expired: as if never seen. */
  assert_int_equal(idem_store_lookup(fx->store, &req.scope, later, &rec), IDEM_ENOTFOUND);
  req = request(fx, OP_PAY, "key-1", fp_b);
  req.now_ms = later;
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
  assert_int_equal(rec.state, IDEM_STATE_PROCESSING);
  assert_true(rec.owner_token[0] != '\0');
  assert_string_not_equal(rec.owner_token, first);
  assert_string_equal(rec.fingerprint, fp_b);
  assert_int_equal(rec.created_at, later);
  assert_int_equal(rec.expires_at, 0);
  assert_int_equal(rec.response_status, 0);
  assert_null(rec.response_body);
  assert_string_equal(rec.location, "");
  assert_as_stored(fx, &rec, later);
  idem_record_reset(&rec);
  assert_int_equal(idem_store_lookup(fx->store, &req.scope, later, &rec), IDEM_OK);
  assert_int_equal(rec.state, IDEM_STATE_PROCESSING);
  assert_string_equal(rec.fingerprint, fp_b);
  idem_record_reset(&rec);
  assert_int_equal(complete(fx, &req.scope, first, later, TTL_MS, &out), IDEM_ELOST);
  assert_int_equal(count(fx, "records"), 1);
}

static void test_failed_record(void **state) {
  fixture_t *fx = *state;
  char fp_a[IDEM_FINGERPRINT_LEN], fp_b[IDEM_FINGERPRINT_LEN];
  char first[IDEM_TOKEN_MAX + 1];
  idem_record_t rec = {0};
  idem_reserve_t req;
  idem_outcome_t out = {.state = IDEM_STATE_FAILED, .status = 503,
                        .body = "{\"error\":\"provider unavailable\"}"};

  make_fp(fp_a, 1);
  make_fp(fp_b, 2);
  req = request(fx, OP_PAY, "key-1", fp_a);
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
  idem_copy(first, sizeof first, rec.owner_token);
  idem_record_reset(&rec);
  assert_int_equal(complete(fx, &req.scope, first, fx->now, TTL_MS, &out), IDEM_OK);
  assert_int_equal(idem_store_lookup(fx->store, &req.scope, fx->now, &rec), IDEM_OK);
  assert_int_equal(rec.state, IDEM_STATE_FAILED);
  assert_int_equal(rec.expires_at, fx->now + TTL_MS);
  idem_record_reset(&rec);

  /* Another request under the key: still the failed record's key. */
  req = request(fx, OP_PAY, "key-1", fp_b);
  req.now_ms = fx->now + 10;
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_EXISTS);
  assert_int_equal(rec.state, IDEM_STATE_FAILED);
  assert_string_equal(rec.fingerprint, fp_a);
  idem_record_reset(&rec);

  /* The same request again: it runs again under the same key. */
  req = request(fx, OP_PAY, "key-1", fp_a);
  req.now_ms = fx->now + 20;
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
  assert_int_equal(rec.state, IDEM_STATE_PROCESSING);
  assert_true(rec.owner_token[0] != '\0');
  assert_string_not_equal(rec.owner_token, first);
  assert_int_equal(rec.expires_at, 0);
  idem_record_reset(&rec);
}

/* ---- the caller's own rows (effects) ----------------------------------- */

/* A caller's table, written only through effects; one schema for both
 * backends ($1 is a parameter in SQLite as in PostgreSQL). */
#define APP_TABLE                                                              \
  "CREATE TABLE IF NOT EXISTS app_rows (tenant BIGINT NOT NULL, k TEXT NOT NULL, " \
  "note TEXT NOT NULL, UNIQUE (tenant, k))"

/* Runs `sql` with text parameters on the effect's connection. */
static int tx_exec(idem_tx_t *tx, const char *sql, int n, const char *const *params,
                   long long *count) {
  if (strcmp(idem_tx_backend(tx), "sqlite") == 0) {
    sqlite3 *db = idem_tx_handle(tx);
    sqlite3_stmt *st = NULL;
    int rc;
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK)
      return IDEM_ESTORE;
    for (int i = 0; i < n; i++)
      sqlite3_bind_text(st, i + 1, params[i], -1, SQLITE_TRANSIENT);
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW && count)
      *count = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    return rc == SQLITE_DONE || rc == SQLITE_ROW ? IDEM_OK : IDEM_ESTORE;
  }
  assert_string_equal(idem_tx_backend(tx), "postgresql");
  PGresult *res = PQexecParams(idem_tx_handle(tx), sql, n, NULL, params, NULL, NULL, 0);
  ExecStatusType st = PQresultStatus(res);
  int ok = st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK;
  if (ok && count && PQntuples(res) == 1)
    *count = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
  PQclear(res);
  return ok ? IDEM_OK : IDEM_ESTORE;
}

struct app_row {
  int64_t tenant;
  const char *key, *note;
  int fail;   /* return this instead of writing */
  int runs;   /* how many times the effect ran */
  int64_t now; /* idem_tx_now_ms() seen */
};

static int insert_row(void *arg, idem_tx_t *tx) {
  struct app_row *a = arg;
  char t[24];
  const char *p[3] = {t, a->key, a->note};

  __atomic_add_fetch(&a->runs, 1, __ATOMIC_RELAXED);
  a->now = idem_tx_now_ms(tx);
  if (a->fail)
    return a->fail;
  snprintf(t, sizeof t, "%lld", (long long)a->tenant);
  return tx_exec(tx, "INSERT INTO app_rows (tenant, k, note) VALUES ($1, $2, $3)", 3, p,
                 NULL);
}

static int create_app_table(void *arg, idem_tx_t *tx) {
  (void)arg;
  return tx_exec(tx, APP_TABLE, 0, NULL, NULL);
}

struct app_count {
  int64_t tenant;
  const char *key; /* NULL: any */
  long long n;
};

static int count_rows(void *arg, idem_tx_t *tx) {
  struct app_count *c = arg;
  char t[24];
  const char *p[2] = {t, c->key ? c->key : ""};
  snprintf(t, sizeof t, "%lld", (long long)c->tenant);
  c->n = -1;
  return tx_exec(tx, "SELECT count(*) FROM app_rows WHERE tenant = $1 AND ($2 = '' OR k = $2)",
                 2, p, &c->n);
}

static long long app_rows(fixture_t *fx, const char *key) {
  struct app_count c = {fx->tenant.id, key, -1};
  idem_effect_t e = {count_rows, &c};
  assert_int_equal(idem_store_read(fx->store, &e), IDEM_OK);
  return c.n;
}

static void app_table(fixture_t *fx) {
  idem_effect_t e = {create_app_table, NULL};
  assert_int_equal(idem_store_write(fx->store, &e), IDEM_OK);
}

/* Statements an effect queues (idem_tx_send(), PostgreSQL's pipeline):
 * `n` rows of app_rows under keys `key`-0...; with `dup`, the last one's
 * key is the first's again, and with `flush` the effect asks for the
 * results itself and returns what idem_tx_flush() said. */
struct queued_rows {
  int64_t tenant;
  const char *key;
  int n, dup, flush;
  int sent_rc, flush_rc;
};

static int send_rows(void *arg, idem_tx_t *tx) {
  struct queued_rows *q = arg;
  const char *name = idem_tx_statement(tx, 5, "INSERT INTO app_rows (tenant, k, note) "
                                              "VALUES ($1, $2, 'queued')");
  char t[24], k[64];
  const char *p[2] = {t, k};

  if (name == NULL)
    return IDEM_ESTORE;
  snprintf(t, sizeof t, "%lld", (long long)q->tenant);
  q->sent_rc = IDEM_OK;
  for (int i = 0; i < q->n && q->sent_rc == IDEM_OK; i++) {
    snprintf(k, sizeof k, "%s-%d", q->key, q->dup && i == q->n - 1 ? 0 : i);
    q->sent_rc = idem_tx_send(tx, name, 2, p);
  }
  if (q->sent_rc != IDEM_OK)
    return q->sent_rc;
  if (q->flush)
    return q->flush_rc = idem_tx_flush(tx);
  return IDEM_OK;
}

/* Sends a duplicate row (queued), then asks for a statement not yet
 * prepared on the connection, which ends the pipeline: NULL, and the
 * queued statement's error is idem_tx_flush()'s. */
static int send_dup_then_prepare(void *arg, idem_tx_t *tx) {
  struct queued_rows *q = arg;
  int rc = send_rows(q, tx);

  if (rc != IDEM_OK)
    return rc;
  if (idem_tx_statement(tx, 7, "SELECT count(*) FROM app_rows") != NULL)
    return IDEM_OK; /* the failure was not met: the write fails at COMMIT */
  return q->flush_rc = idem_tx_flush(tx);
}

/* A queued statement that failed (a unique violation) is still told as
 * IDEM_EEXIST when the effect next asks for a statement the connection
 * has not prepared yet (idemd's effects then said IDEM_ESTORE: a retry
 * answered 503 instead of 409). PostgreSQL. */
static void test_queued_error_before_prepare(void **state) {
  fixture_t *fx = *state;
  struct queued_rows q = {fx->tenant.id, "q-prep", 3, 1, 0, 0, 0};
  idem_effect_t e = {send_dup_then_prepare, &q};

  if (fx->dir[0])
    skip();
  app_table(fx);
  assert_int_equal(idem_store_write(fx->store, &e), IDEM_EEXIST);
  assert_int_equal(q.flush_rc, IDEM_EEXIST);
  assert_int_equal(app_rows(fx, NULL), 0);
}

/* idem_tx_send() (PostgreSQL): queued statements are written with their
 * write, more of them than are ever queued at once; one that fails
 * (a unique violation) fails its write, whether the effect flushes or
 * leaves them to the COMMIT, and leaves nothing of it; SQLite says
 * IDEM_ENOTSUP. */
static void test_queued_statements(void **state) {
  fixture_t *fx = *state;
  struct queued_rows q = {fx->tenant.id, "q-ok", 100, 0, 0, 0, 0};
  idem_effect_t e = {send_rows, &q};

  app_table(fx);
  if (strcmp(idem_store_backend(fx->store), "sqlite") == 0) {
    assert_int_equal(idem_store_write(fx->store, &e), IDEM_ENOTSUP);
    assert_int_equal(q.sent_rc, IDEM_ENOTSUP);
    return;
  }
  assert_int_equal(idem_store_write(fx->store, &e), IDEM_OK);
  assert_int_equal(app_rows(fx, NULL), 100);

  q = (struct queued_rows){fx->tenant.id, "q-dup", 5, 1, 0, 0, 0};
  assert_int_equal(idem_store_write(fx->store, &e), IDEM_EEXIST);
  assert_int_equal(q.sent_rc, IDEM_OK); /* only queued */
  assert_int_equal(app_rows(fx, NULL), 100);

  q = (struct queued_rows){fx->tenant.id, "q-flush", 5, 1, 1, 0, 0};
  assert_int_equal(idem_store_write(fx->store, &e), IDEM_EEXIST);
  assert_int_equal(q.flush_rc, IDEM_EEXIST);
  assert_int_equal(app_rows(fx, NULL), 100);

  q = (struct queued_rows){fx->tenant.id, "q-flushed", 3, 0, 1, 0, 0};
  assert_int_equal(idem_store_write(fx->store, &e), IDEM_OK);
  assert_int_equal(q.flush_rc, IDEM_OK);
  assert_int_equal(app_rows(fx, NULL), 103);
}

/* An effect is written with the reservation that wins the key, once; a
 * reservation that finds the key held runs none. */
static void test_effect_with_reservation(void **state) {
  fixture_t *fx = *state;
  char fp[IDEM_FINGERPRINT_LEN];
  struct app_row row = {fx->tenant.id, "eff-1", "first", 0, 0, 0};
  idem_record_t rec = {0};
  idem_reserve_t req;

  app_table(fx);
  make_fp(fp, 1);
  req = request(fx, "create_note", "eff-1", fp);
  req.effect = (idem_effect_t){insert_row, &row};
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
  assert_true(row.runs >= 1);
  assert_int_equal(row.now, req.now_ms);
  assert_int_equal(app_rows(fx, "eff-1"), 1);

  row.runs = 0;
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_EXISTS);
  assert_int_equal(row.runs, 0);
  assert_int_equal(app_rows(fx, "eff-1"), 1);
  idem_record_reset(&rec);
}

/* An effect that fails undoes the whole reservation: no record, no row,
 * the key still free; its error is the reservation's. */
static void test_effect_failure_undoes_reservation(void **state) {
  fixture_t *fx = *state;
  char fp[IDEM_FINGERPRINT_LEN];
  struct payment pay;
  struct app_row row = {fx->tenant.id, "eff-2", "x", IDEM_EEXIST, 0, 0};
  idem_record_t rec = {0};
  idem_reserve_result_t result;
  idem_reserve_t req;

  app_table(fx);
  make_fp(fp, 2);
  new_payment(&pay);
  req = request(fx, OP_PAY, "eff-2", fp);
  req.resource_id = pay.id;
  req.effect = (idem_effect_t){insert_row, &row};
  assert_int_equal(idem_store_reserve(fx->store, &req, &rec, &result), IDEM_EEXIST);
  assert_int_equal(idem_store_lookup(fx->store, &req.scope, fx->now, &rec), IDEM_ENOTFOUND);
  assert_int_equal(count(fx, "records"), 0);

  /* A statement of the effect's own that fails (a duplicate row) is the
   * same: here the row is there already, from a write of its own. */
  row.fail = 0;
  idem_effect_t pre = {insert_row, &row};
  assert_int_equal(idem_store_write(fx->store, &pre), IDEM_OK);
  assert_int_equal(idem_store_reserve(fx->store, &req, &rec, &result), IDEM_ESTORE);
  assert_int_equal(count(fx, "records"), 0);
  assert_int_equal(app_rows(fx, "eff-2"), 1);
  idem_record_reset(&rec);
}

/* A completion's effect runs only for the owner, with the completion. */
static void test_effect_with_completion(void **state) {
  fixture_t *fx = *state;
  char fp[IDEM_FINGERPRINT_LEN];
  struct app_row row = {fx->tenant.id, "eff-3", "done", 0, 0, 0};
  idem_outcome_t out = {.state = IDEM_STATE_COMPLETED, .status = 201, .body = "{}"};
  idem_record_t rec = {0};
  idem_reserve_t req;
  idem_complete_t c;

  app_table(fx);
  make_fp(fp, 3);
  req = request(fx, "create_note", "eff-3", fp);
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
  c = (idem_complete_t){.scope = req.scope, .owner_token = "not-the-owner",
                        .now_ms = fx->now + 1, .ttl_ms = TTL_MS, .outcome = out,
                        .effect = {insert_row, &row}};
  assert_int_equal(idem_store_complete(fx->store, &c), IDEM_ELOST);
  assert_int_equal(row.runs, 0);
  assert_int_equal(app_rows(fx, "eff-3"), 0);

  row.fail = IDEM_ENOMEM; /* the owner's, failing: nothing completes */
  c.owner_token = rec.owner_token;
  assert_int_equal(idem_store_complete(fx->store, &c), IDEM_ENOMEM);
  idem_record_reset(&rec);
  assert_int_equal(idem_store_lookup(fx->store, &req.scope, fx->now + 1, &rec), IDEM_OK);
  assert_int_equal(rec.state, IDEM_STATE_PROCESSING);

  row.fail = 0;
  assert_int_equal(idem_store_complete(fx->store, &c), IDEM_OK);
  assert_int_equal(row.now, fx->now + 1);
  assert_int_equal(app_rows(fx, "eff-3"), 1);
  idem_record_reset(&rec);
  assert_int_equal(idem_store_lookup(fx->store, &req.scope, fx->now + 2, &rec), IDEM_OK);
  assert_int_equal(rec.state, IDEM_STATE_COMPLETED);
  idem_record_reset(&rec);
}

/* An effect that writes its row, then says IDEM_ELOST. */
static int insert_row_then_lost(void *arg, idem_tx_t *tx) {
  int rc = insert_row(arg, tx);
  return rc == IDEM_OK ? IDEM_ELOST : rc;
}

/* An effect's IDEM_ELOST, after it wrote, is a failure like any other:
 * the completion and the effect's row are rolled back, and the caller
 * told IDEM_ELOST finds its record still processing. Only the
 * completion's own IDEM_ELOST (its owner token lost, nothing written) is
 * kept as a result. PostgreSQL (SQLite's writer still treats every
 * IDEM_ELOST as nothing written). */
static void test_effect_lost_after_writing_is_undone(void **state) {
  fixture_t *fx = *state;
  char fp[IDEM_FINGERPRINT_LEN];
  struct app_row row = {fx->tenant.id, "eff-lost", "x", 0, 0, 0};
  idem_outcome_t out = {.state = IDEM_STATE_COMPLETED, .status = 201, .body = "{}"};
  idem_record_t rec = {0};
  idem_reserve_t req;
  idem_complete_t c;

  if (fx->dir[0])
    skip();
  app_table(fx);
  make_fp(fp, 3);
  req = request(fx, "create_note", "eff-lost", fp);
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
  c = (idem_complete_t){.scope = req.scope, .owner_token = rec.owner_token,
                        .now_ms = fx->now + 1, .ttl_ms = TTL_MS, .outcome = out,
                        .effect = {insert_row_then_lost, &row}};
  assert_int_equal(idem_store_complete(fx->store, &c), IDEM_ELOST);
  assert_true(row.runs >= 1);
  assert_int_equal(app_rows(fx, "eff-lost"), 0);
  idem_record_reset(&rec);
  assert_int_equal(idem_store_lookup(fx->store, &req.scope, fx->now + 1, &rec), IDEM_OK);
  assert_int_equal(rec.state, IDEM_STATE_PROCESSING);
  idem_record_reset(&rec);
}

/* Reservations in one batch of the group commit, one of which fails: the
 * batch runs again write by write, and each effect that committed left
 * its row once. */
static void test_effects_in_a_failed_batch(void **state) {
  fixture_t *fx = *state;
  enum { N = 8 };
  struct async_result a = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0};
  char fps[N][IDEM_FINGERPRINT_LEN], keys[N][16];
  struct app_row rows[N];
  idem_record_t recs[N];
  idem_reserve_result_t results[N];
  idem_reserve_t reqs[N];

  app_table(fx);
  memset(recs, 0, sizeof recs);
  for (int i = 0; i < N; i++) {
    make_fp(fps[i], 10 + i);
    snprintf(keys[i], sizeof keys[i], "batch-%d", i);
    rows[i] = (struct app_row){fx->tenant.id, keys[i], "n", i == N / 2 ? IDEM_ESTORE : 0, 0, 0};
    reqs[i] = request(fx, "create_note", keys[i], fps[i]);
    reqs[i].effect = (idem_effect_t){insert_row, &rows[i]};
  }
  if (!idem_store_async_writes(fx->store)) {
    /* No group commit: each reservation is its own transaction. */
    for (int i = 0; i < N; i++) {
      int rc = idem_store_reserve(fx->store, &reqs[i], &recs[i], &results[i]);
      assert_int_equal(rc, i == N / 2 ? IDEM_ESTORE : IDEM_OK);
    }
  } else {
    struct async_result done[N];
    for (int i = 0; i < N; i++) {
      done[i] = a;
      pthread_mutex_init(&done[i].lock, NULL);
      pthread_cond_init(&done[i].cond, NULL);
    }
    /* Queued at once, so the writer takes several in one batch. */
    for (int i = 0; i < N; i++)
      assert_int_equal(idem_store_reserve_async(fx->store, &reqs[i], &recs[i], &results[i],
                                                async_done, &done[i]),
                       IDEM_OK);
    for (int i = 0; i < N; i++) {
      assert_int_equal(async_wait(&done[i]), i == N / 2 ? IDEM_ESTORE : IDEM_OK);
      pthread_mutex_destroy(&done[i].lock);
      pthread_cond_destroy(&done[i].cond);
    }
  }
  for (int i = 0; i < N; i++) {
    idem_record_t rec = {0};
    int want = i == N / 2 ? 0 : 1;
    assert_int_equal(app_rows(fx, keys[i]), want);
    assert_int_equal(idem_store_lookup(fx->store, &reqs[i].scope, fx->now, &rec),
                     want ? IDEM_OK : IDEM_ENOTFOUND);
    idem_record_reset(&rec);
    idem_record_reset(&recs[i]);
  }
  assert_int_equal(app_rows(fx, NULL), N - 1);
}

/* A write of the caller's own, and a read, around a function; a failed
 * write leaves nothing. */
static void test_caller_write_and_read(void **state) {
  fixture_t *fx = *state;
  struct app_row row = {fx->tenant.id, "w-1", "alone", 0, 0, 0};
  idem_effect_t e = {insert_row, &row}, none = {NULL, NULL};

  app_table(fx);
  assert_int_equal(idem_store_write(fx->store, &e), IDEM_OK);
  assert_int_equal(app_rows(fx, "w-1"), 1);
  row.key = "w-2";
  row.fail = IDEM_EINVAL;
  assert_int_equal(idem_store_write(fx->store, &e), IDEM_EINVAL);
  assert_int_equal(app_rows(fx, "w-2"), 0);
  assert_int_equal(idem_store_write(fx->store, &none), IDEM_EINVAL);
  assert_int_equal(idem_store_read(fx->store, NULL), IDEM_EINVAL);
}

/* Inserts (tenant, key, note) with the statement kept in `slot`. */
struct kept_insert {
  int64_t tenant;
  const char *key, *sql;
  unsigned slot;
  void *got; /* what idem_tx_statement() gave */
};

static int insert_kept(void *arg, idem_tx_t *tx) {
  struct kept_insert *a = arg;
  char t[24];
  const char *p[3] = {t, a->key, "kept"};

  snprintf(t, sizeof t, "%lld", (long long)a->tenant);
  if ((a->got = idem_tx_statement(tx, a->slot, a->sql)) == NULL)
    return IDEM_ESTORE;
  if (strcmp(idem_tx_backend(tx), "sqlite") == 0) {
    sqlite3_stmt *st = a->got;
    for (int i = 0; i < 3; i++)
      sqlite3_bind_text(st, i + 1, p[i], -1, SQLITE_TRANSIENT);
    return sqlite3_step(st) == SQLITE_DONE ? IDEM_OK : IDEM_ESTORE;
  }
  PGresult *res = PQexecPrepared(idem_tx_handle(tx), a->got, 3, p, NULL, NULL, 0);
  int ok = PQresultStatus(res) == PGRES_COMMAND_OK;
  PQclear(res);
  return ok ? IDEM_OK : IDEM_ESTORE;
}

/* A caller's statement is made once per connection and kept: the same
 * one comes back for its slot (SQLite's writer has one connection); other
 * SQL in a slot makes it again; a slot out of range or bad SQL is an
 * error, with nothing written. */
static void test_caller_statements_kept(void **state) {
  fixture_t *fx = *state;
  static const char ins[] = "INSERT INTO app_rows (tenant, k, note) VALUES ($1, $2, $3)";
  static const char upsert[] = "INSERT INTO app_rows (tenant, k, note) VALUES ($1, $2, $3) "
                               "ON CONFLICT (tenant, k) DO NOTHING";
  struct kept_insert a = {fx->tenant.id, "s-1", ins, 3, NULL};
  idem_effect_t e = {insert_kept, &a};
  void *first;

  app_table(fx);
  assert_int_equal(idem_store_write(fx->store, &e), IDEM_OK);
  first = a.got;
  a.key = "s-2";
  assert_int_equal(idem_store_write(fx->store, &e), IDEM_OK);
  if (strcmp(idem_store_backend(fx->store), "sqlite") == 0)
    assert_ptr_equal(a.got, first);
  else
    assert_string_equal(a.got, "idem_caller_3");
  assert_int_equal(app_rows(fx, NULL), 2);

  a.sql = upsert; /* s-2 again: no second row, no error */
  assert_int_equal(idem_store_write(fx->store, &e), IDEM_OK);
  assert_int_equal(app_rows(fx, NULL), 2);
  a.sql = ins;
  a.key = "s-3";
  assert_int_equal(idem_store_write(fx->store, &e), IDEM_OK);
  assert_int_equal(app_rows(fx, "s-3"), 1);

  a.key = "s-4";
  a.slot = IDEM_TX_STATEMENTS;
  assert_int_equal(idem_store_write(fx->store, &e), IDEM_ESTORE);
  a.slot = 4;
  a.sql = "INSERT INTO no_such_table VALUES ($1, $2, $3)";
  assert_int_equal(idem_store_write(fx->store, &e), IDEM_ESTORE);
  assert_int_equal(app_rows(fx, "s-4"), 0);
}

/* Takes over `scope` in a write of its own: the result and the record. */
struct take_over {
  idem_scope_t scope;
  int64_t lease_ms;
  int rc;
  idem_record_t rec;
};

static int take_over_fn(void *arg, idem_tx_t *tx) {
  struct take_over *t = arg;
  idem_record_reset(&t->rec);
  t->rc = idem_tx_take_over(tx, &t->scope, t->lease_ms, &t->rec);
  return IDEM_OK;
}

static int take_over(fixture_t *fx, struct take_over *t) {
  idem_effect_t e = {take_over_fn, t};
  assert_int_equal(idem_store_write(fx->store, &e), IDEM_OK);
  return t->rc;
}

/* The audit rows idemd_audit_list() gave, as "resource from>to actor reason"
 * lines ("-" for NULL). */
struct audit_lines {
  char text[2048];
  int n;
  int64_t last_at;
  int ordered; /* each row at or after the one before */
};

static int got_audit(void *arg, const idemd_audit_row_t *row) {
  struct audit_lines *l = arg;
  size_t used = strlen(l->text);
  snprintf(l->text + used, sizeof l->text - used, "%s %s>%s %s %s\n", row->resource_id,
           row->from ? row->from : "-", row->to, row->actor,
           row->reason ? row->reason : "-");
  if (row->at_ms < l->last_at)
    l->ordered = 0;
  l->last_at = row->at_ms;
  l->n++;
  return IDEM_OK;
}

static struct audit_lines audit_of(fixture_t *fx, const char *id) {
  struct audit_lines l = {.ordered = 1};
  assert_int_equal(idemd_audit_list(fx->store, fx->tenant.id, id, got_audit, &l), IDEM_OK);
  assert_true(l.ordered);
  return l;
}

/* Each state change writes one audit row in its own transaction: a
 * creation (from NULL), a completion that changes the status (none for a
 * payment left pending again), an order's first cancellation (none for
 * the second); a write that rolls back leaves no row; a tenant sees only
 * its own rows, oldest first. */
static void test_audit_trail(void **state) {
  fixture_t *fx = *state;
  char token[IDEM_TOKEN_MAX + 1], want[512], *body = NULL;
  struct payment p, dup;
  idem_reserve_t req;
  idem_record_t rec = {0};
  idem_outcome_t unknown = {.state = IDEM_STATE_PENDING, .status = 202, .body = "{}"};
  idem_outcome_t ok = {.state = IDEM_STATE_COMPLETED, .status = 201, .body = "{}"};
  idemd_actor_t canceller = {"req_cancel", "POST /orders/{id}/cancel"};
  int changed = -1;

  req = reserve_payment(fx, "audited", LEASE_MS, &p, token);
  struct audit_lines l = audit_of(fx, p.id);
  snprintf(want, sizeof want, "%s ->pending idemd -\n", p.id);
  assert_string_equal(l.text, want);

  /* Left pending: the status stays, no row. */
  assert_int_equal(complete_payment(fx, &req.scope, token, fx->now + 1, TTL_MS, &unknown, &p,
                                    "pending", NULL),
                   IDEM_OK);
  assert_int_equal(audit_of(fx, p.id).n, 1);

  /* Taken over and settled by the reconciler: one row, with its actor
   * and reason. */
  struct take_over t = {.scope = req.scope, .lease_ms = 60000};
  assert_int_equal(take_over(fx, &t), IDEM_OK);
  p.settle = (idemd_resource_update_t){.tenant_id = fx->tenant.id, .id = p.id,
                                       .status = "succeeded", .state = IDEM_STATE_COMPLETED,
                                       .who = {"reconciler", "looked up at the provider"}};
  idem_complete_t c = {.scope = req.scope, .owner_token = t.rec.owner_token,
                       .now_ms = idem_now_ms(), .ttl_ms = TTL_MS, .outcome = ok,
                       .effect = {idemd_resource_update, &p.settle}};
  assert_int_equal(idem_store_complete(fx->store, &c), IDEM_OK);
  idem_record_reset(&t.rec);
  l = audit_of(fx, p.id);
  snprintf(want, sizeof want,
           "%s ->pending idemd -\n%s pending>succeeded reconciler looked up at the provider\n",
           p.id, p.id);
  assert_string_equal(l.text, want);

  /* A creation that rolls back (the id is taken) leaves no row. */
  new_payment(&dup);
  memcpy(dup.id, p.id, sizeof dup.id);
  req = request(fx, OP_PAY, "dup-id", "00000000000000000000000000000000000000000000000000000000000000bb");
  with_payment(&req, &dup, 1);
  dup.res.who = (idemd_actor_t){"req_dup", NULL};
  assert_int_equal(idem_store_reserve(fx->store, &req, &rec, &(idem_reserve_result_t){0}),
                   IDEM_EEXIST);
  idem_record_reset(&rec);
  assert_int_equal(audit_of(fx, p.id).n, 2);

  /* An order put, then cancelled twice: a creation and one change. */
  idemd_resource_t order = {.tenant_id = fx->tenant.id, .kind = "order", .id = "ord_audited",
                            .status = "created",
                            .body = "{\"id\":\"ord_audited\",\"status\":\"created\","
                                    "\"created_at\":\"2026-01-01T00:00:00.000Z\"}",
                            .who = {"req_put", "PUT /orders/{id}"}};
  assert_int_equal(idemd_order_put(fx->store, &order, &body), IDEM_OK);
  assert_int_equal(idemd_order_cancel(fx->store, fx->tenant.id, "ord_audited", &canceller,
                                      &body, &changed),
                   IDEM_OK);
  assert_int_equal(changed, 1);
  free(body);
  assert_int_equal(idemd_order_cancel(fx->store, fx->tenant.id, "ord_audited", &canceller,
                                      &body, &changed),
                   IDEM_OK);
  assert_int_equal(changed, 0);
  free(body);
  assert_string_equal(audit_of(fx, "ord_audited").text,
                      "ord_audited ->created req_put PUT /orders/{id}\n"
                      "ord_audited created>cancelled req_cancel POST /orders/{id}/cancel\n");
  /* All of the tenant's: both resources, oldest first; another tenant's: none. */
  assert_int_equal(audit_of(fx, NULL).n, 4);
  idemd_tenant_t other;
  idemd_api_key_t other_key;
  new_tenant(fx->tenants, &other, &other_key);
  struct audit_lines none = {.ordered = 1};
  assert_int_equal(idemd_audit_list(fx->store, other.id, NULL, got_audit, &none), IDEM_OK);
  assert_int_equal(none.n, 0);
}

/* A processing record whose lease ran out, or a pending one, is taken
 * over under a new owner token (the old owner is then refused); one held
 * under a live lease, a finished one or none is not; nor in a read. */
static void test_take_over(void **state) {
  static const char fp[] = "00000000000000000000000000000000000000000000000000000000000000ab";
  fixture_t *fx = *state;
  idem_reserve_t req = request(fx, OP_PAY, "t-1", fp);
  idem_outcome_t pending = {.state = IDEM_STATE_PENDING, .status = 202, .body = "{}"};
  idem_outcome_t done = {.state = IDEM_STATE_COMPLETED, .status = 201, .body = "{}"};
  idem_record_t rec = {0};
  struct take_over t = {.scope = req.scope, .lease_ms = 60000};
  char first[IDEM_TOKEN_MAX + 1], second[IDEM_TOKEN_MAX + 1];
  idem_effect_t in_read = {take_over_fn, &t};

  req.now_ms = idem_now_ms() - 1000;
  req.lease_ms = 1; /* ran out a second ago */
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
  idem_copy(first, sizeof first, rec.owner_token);
  idem_record_reset(&rec);

  assert_int_equal(take_over(fx, &t), IDEM_OK);
  assert_int_equal(t.rec.state, IDEM_STATE_PROCESSING);
  assert_string_equal(t.rec.key, "t-1");
  assert_string_equal(t.rec.fingerprint, fp);
  assert_string_not_equal(t.rec.owner_token, first);
  assert_true(t.rec.lease_expires_at > idem_now_ms() + 30000);
  idem_copy(second, sizeof second, t.rec.owner_token);
  assert_int_equal(take_over(fx, &t), IDEM_ENOTFOUND); /* its lease holds it */
  assert_int_equal(complete(fx, &req.scope, first, idem_now_ms(), TTL_MS, &done), IDEM_ELOST);

  /* Left pending by its new owner: taken over again at once. */
  assert_int_equal(complete(fx, &req.scope, second, idem_now_ms(), TTL_MS, &pending), IDEM_OK);
  assert_int_equal(take_over(fx, &t), IDEM_OK);
  assert_int_equal(t.rec.state, IDEM_STATE_PENDING);
  assert_string_not_equal(t.rec.owner_token, second);
  assert_int_equal(complete(fx, &req.scope, t.rec.owner_token, idem_now_ms(), TTL_MS, &done),
                   IDEM_OK);
  assert_int_equal(take_over(fx, &t), IDEM_ENOTFOUND); /* completed */

  t.scope.key = "t-none";
  assert_int_equal(take_over(fx, &t), IDEM_ENOTFOUND);
  t.rc = -1;
  assert_int_equal(idem_store_read(fx->store, &in_read), IDEM_OK);
  assert_int_equal(t.rc, IDEM_EINVAL);
  t.lease_ms = 0;
  assert_int_equal(take_over(fx, &t), IDEM_EINVAL);
  idem_record_reset(&t.rec);
}

/* ---- claims by the reconciler (idemd's outbox, libidem's take-over) --- */

#define MAX_OURS 8

/* Claims until nothing claimable is left, keeping this tenant's records
 * in `ours` and releasing the rest; returns how many are ours. On a
 * shared database other tenants' records get claimed too, which only
 * delays their reconciliation by `lease_ms`. */
static int claim_ours(fixture_t *fx, int64_t lease_ms, idem_record_t ours[MAX_OURS]) {
  int mine = 0;
  for (int round = 0; round < 100000; round++) {
    idem_record_t batch[16];
    int n = -1;
    memset(batch, 0, sizeof batch);
    assert_int_equal(
        idemd_outbox_claim(fx->store, lease_ms, (int)ARRAY_LEN(batch), batch, &n), IDEM_OK);
    assert_in_range(n, 0, ARRAY_LEN(batch));
    if (n == 0)
      return mine;
    for (int i = 0; i < n; i++) {
      if (batch[i].tenant_id != fx->tenant.id) {
        idem_record_reset(&batch[i]);
        continue;
      }
      assert_true(mine < MAX_OURS);
      ours[mine++] = batch[i]; /* takes over its response body */
    }
  }
  fail_msg("claims never ran dry");
  return -1;
}

static void release_all(idem_record_t *recs, int n) {
  for (int i = 0; i < n; i++)
    idem_record_reset(&recs[i]);
}


/* The reconciler's claim of a payment whose request died with its call
 * (processing, its lease run out) writes a row of the take-over, though
 * the payment stays pending; a claim of one left pending writes none. */
static void test_audit_take_over(void **state) {
  fixture_t *fx = *state;
  char dead_token[IDEM_TOKEN_MAX + 1], left_token[IDEM_TOKEN_MAX + 1], want[256];
  struct payment dead, left;
  idem_record_t ours[MAX_OURS] = {{0}};
  idem_outcome_t unknown = {.state = IDEM_STATE_PENDING, .status = 202, .body = "{}"};
  int n;

  fx->now = idem_now_ms() - 10000;
  reserve_payment(fx, "died", 1000, &dead, dead_token);
  idem_reserve_t l = reserve_payment(fx, "left", 1000, &left, left_token);
  assert_int_equal(complete_payment(fx, &l.scope, left_token, fx->now, TTL_MS, &unknown, &left,
                                    "pending", NULL),
                   IDEM_OK);
  n = claim_ours(fx, 60000, ours);
  assert_int_equal(n, 2);
  release_all(ours, n);
  snprintf(want, sizeof want,
           "%s ->pending idemd -\n"
           "%s pending>pending reconciler taken over: the request's lease ran out\n",
           dead.id, dead.id);
  assert_string_equal(audit_of(fx, dead.id).text, want);
  assert_int_equal(audit_of(fx, left.id).n, 1);
}
/* Pending payments and payments whose worker's lease ran out are claimed,
 * each under a new owner token, with its payment's id; nothing else is,
 * and the old owner loses the record. Written ten seconds in the past, so
 * that the leases of a second ran out long ago. */
static void test_claim(void **state) {
  fixture_t *fx = *state;
  const int64_t claim_lease = 300;
  char pending_token[IDEM_TOKEN_MAX + 1], dead_token[IDEM_TOKEN_MAX + 1];
  char live_token[IDEM_TOKEN_MAX + 1], done_token[IDEM_TOKEN_MAX + 1];
  char first_claim[IDEM_TOKEN_MAX + 1];
  struct payment pending, dead, live, done;
  idem_record_t ours[MAX_OURS] = {{0}}, rec = {0};
  idem_record_t *claimed_pending, *claimed_dead;
  idem_reserve_t req;
  idem_outcome_t unknown = {.state = IDEM_STATE_PENDING, .status = 202, .body = "{}"};
  idem_outcome_t ok = {.state = IDEM_STATE_COMPLETED, .status = 201, .body = "{}"};
  int64_t t1;
  int n;

  fx->now = idem_now_ms() - 10000;
  idem_reserve_t pend = reserve_payment(fx, "pending", LEASE_MS, &pending, pending_token);
  assert_int_equal(complete_payment(fx, &pend.scope, pending_token, fx->now, TTL_MS,
                                    &unknown, &pending, "pending", NULL),
                   IDEM_OK);
  idem_reserve_t died = reserve_payment(fx, "dead-worker", 1000, &dead, dead_token);
  idem_reserve_t alive = reserve_payment(fx, "live-worker", 60000, &live, live_token);
  idem_reserve_t fin = reserve_payment(fx, "completed", 1000, &done, done_token);
  assert_int_equal(complete_payment(fx, &fin.scope, done_token, fx->now, TTL_MS, &ok, &done,
                                    "succeeded", NULL),
                   IDEM_OK);
  /* Processing with an expired lease but no outbox row: not a payment. */
  req = request(fx, OP_ORDER, "no-outbox", "f");
  req.lease_ms = 1000;
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
  idem_record_reset(&rec);

  t1 = idem_now_ms();
  n = claim_ours(fx, claim_lease, ours);
  assert_int_equal(n, 2);
  claimed_pending = strcmp(ours[0].key, "pending") == 0 ? &ours[0] : &ours[1];
  claimed_dead = claimed_pending == &ours[0] ? &ours[1] : &ours[0];
  assert_string_equal(claimed_pending->key, "pending");
  assert_int_equal(claimed_pending->state, IDEM_STATE_PENDING);
  assert_string_equal(claimed_pending->resource_id, pending.id);
  assert_string_equal(claimed_dead->key, "dead-worker");
  assert_int_equal(claimed_dead->state, IDEM_STATE_PROCESSING);
  assert_string_equal(claimed_dead->resource_id, dead.id);
  for (int i = 0; i < n; i++) {
    assert_true(ours[i].owner_token[0] != '\0');
    assert_in_range(ours[i].lease_expires_at, t1 + claim_lease, idem_now_ms() + claim_lease);
  }
  assert_string_not_equal(claimed_dead->owner_token, dead_token);
  idem_copy(first_claim, sizeof first_claim, claimed_pending->owner_token);

  /* The dead worker, back to life, can no longer complete; the claim can. */
  assert_int_equal(complete_payment(fx, &died.scope, dead_token, t1, TTL_MS, &ok, &dead,
                                    "succeeded", NULL),
                   IDEM_ELOST);
  assert_int_equal(complete_payment(fx, &died.scope, claimed_dead->owner_token, t1, TTL_MS,
                                    &ok, &dead, "succeeded", NULL),
                   IDEM_OK);
  release_all(ours, n);

  /* While the claim's lease runs, nobody else gets the pending record. */
  assert_int_equal(claim_ours(fx, claim_lease, ours), 0);

  /* Once it ran out, it is claimed again, under yet another token. */
  usleep((useconds_t)(claim_lease + 100) * 1000);
  n = claim_ours(fx, claim_lease, ours);
  assert_int_equal(n, 1);
  assert_string_equal(ours[0].key, "pending");
  assert_string_not_equal(ours[0].owner_token, first_claim);
  assert_int_equal(complete_payment(fx, &pend.scope, first_claim, t1, TTL_MS, &ok, &pending,
                                    "succeeded", NULL),
                   IDEM_ELOST);
  assert_int_equal(complete_payment(fx, &pend.scope, ours[0].owner_token, t1, TTL_MS, &ok,
                                    &pending, "succeeded", NULL),
                   IDEM_OK);
  release_all(ours, n);

  assert_int_equal(count(fx, "pending"), 0);
  assert_int_equal(count(fx, "outbox"), 1); /* the live worker's */
  assert_int_equal(idem_store_lookup(fx->store, &alive.scope, t1, &rec), IDEM_OK);
  assert_int_equal(rec.state, IDEM_STATE_PROCESSING);
  assert_string_equal(rec.owner_token, live_token);
  idem_record_reset(&rec);
  assert_int_equal(idemd_outbox_claim(fx->store, claim_lease, 0, ours, &n), IDEM_EINVAL);
}

/* Payments the provider cannot settle yet take turns: a claim puts each
 * at the back of the queue, so a full batch of unsettled ones cannot keep
 * a newer one (or a dead worker's) from ever being claimed. Three pending
 * payments, claims of two at a time, each of ours put back unsettled: no
 * claim takes one a second time before a claim has taken all three. */
static void test_claim_takes_turns(void **state) {
  fixture_t *fx = *state;
  static const char *const keys[] = {"turn-0", "turn-1", "turn-2"};
  idem_outcome_t unknown = {.state = IDEM_STATE_PENDING, .status = 202, .body = "{}"};
  char tokens[3][IDEM_TOKEN_MAX + 1];
  struct payment pays[3];
  int seen[3] = {0}, distinct = 0;

  fx->now = idem_now_ms() - 10000;
  for (int i = 0; i < 3; i++) {
    idem_reserve_t r = reserve_payment(fx, keys[i], LEASE_MS, &pays[i], tokens[i]);
    assert_int_equal(complete_payment(fx, &r.scope, tokens[i], fx->now, TTL_MS, &unknown,
                                      &pays[i], "pending", NULL),
                     IDEM_OK);
  }
  for (int round = 0; round < 1000 && distinct < 3; round++) {
    idem_record_t batch[2];
    int n = -1;
    memset(batch, 0, sizeof batch);
    assert_int_equal(idemd_outbox_claim(fx->store, 5000, 2, batch, &n), IDEM_OK);
    if (n == 0)
      break;
    for (int i = 0; i < n; i++) {
      if (batch[i].tenant_id == fx->tenant.id) {
        idem_scope_t sc = {batch[i].tenant_id, batch[i].operation, batch[i].key};
        for (int k = 0; k < 3; k++) {
          if (strcmp(batch[i].key, keys[k]) != 0)
            continue;
          if (seen[k]++ == 0)
            distinct++;
          /* Unsettled: back to pending, claimable again at once. */
          assert_int_equal(complete_payment(fx, &sc, batch[i].owner_token, idem_now_ms(),
                                            TTL_MS, &unknown, &pays[k], "pending", NULL),
                           IDEM_OK);
        }
      }
      idem_record_reset(&batch[i]);
    }
    for (int k = 0; k < 3 && distinct < 3; k++)
      if (seen[k] > 1)
        fail_msg("%s was claimed again before all three had a turn", keys[k]);
  }
  assert_int_equal(distinct, 3);
}

/* ---- concurrency ------------------------------------------------------ */

struct racer {
  fixture_t *fx;
  pthread_barrier_t *start;
  char key[32];
  char fp[IDEM_FINGERPRINT_LEN];
  struct payment payment;
  /* results, checked by the main thread (cmocka is not thread-safe) */
  int rc;
  idem_reserve_result_t result;
  idem_record_t rec;
};

static void *race(void *arg) {
  struct racer *r = arg;
  idem_reserve_t req = request(r->fx, OP_PAY, r->key, r->fp);
  with_payment(&req, &r->payment, 1);
  pthread_barrier_wait(r->start);
  r->rc = idem_store_reserve(r->fx->store, &req, &r->rec, &r->result);
  return NULL;
}

/* Runs NTHREADS reservations released together; `same_key` chooses one
 * key for all or one key each. Every racer has its own fingerprint and
 * payment. */
static void run_race(fixture_t *fx, struct racer *racers, int same_key) {
  pthread_t threads[NTHREADS];
  pthread_barrier_t start;

  assert_int_equal(pthread_barrier_init(&start, NULL, NTHREADS), 0);
  for (int i = 0; i < NTHREADS; i++) {
    struct racer *r = &racers[i];
    memset(r, 0, sizeof *r);
    r->fx = fx;
    r->start = &start;
    snprintf(r->key, sizeof r->key, "race-%d", same_key ? 0 : i);
    make_fp(r->fp, 100 + i);
    new_payment(&r->payment);
    assert_int_equal(pthread_create(&threads[i], NULL, race, r), 0);
  }
  for (int i = 0; i < NTHREADS; i++)
    assert_int_equal(pthread_join(threads[i], NULL), 0);
  pthread_barrier_destroy(&start);
  for (int i = 0; i < NTHREADS; i++)
    if (racers[i].rc != IDEM_OK)
      fail_msg("racer %d: %s", i, idem_err_name(racers[i].rc));
}

/* A write that fails half-way is undone alone, whatever else shares its
 * transaction: racers with distinct keys are released together, and two
 * of them carry the same payment id, so the second to write inserts its
 * record and then fails on the payment. Its record must not stay; every
 * other racer's must. (SQLite commits racers together, and reruns a batch
 * with a savepoint per write when one fails.) */
static void test_failed_write_is_undone_alone(void **state) {
  fixture_t *fx = *state;
  int64_t before = 0;

  for (int round = 0; round < 4; round++) {
    struct racer racers[NTHREADS];
    pthread_t threads[NTHREADS];
    pthread_barrier_t start;
    int failed = -1;

    assert_int_equal(pthread_barrier_init(&start, NULL, NTHREADS), 0);
    for (int i = 0; i < NTHREADS; i++) {
      struct racer *r = &racers[i];
      memset(r, 0, sizeof *r);
      r->fx = fx;
      r->start = &start;
      snprintf(r->key, sizeof r->key, "undo-%d-%d", round, i);
      make_fp(r->fp, 200 + i);
      new_payment(&r->payment);
    }
    /* Racer 1 takes racer 0's payment id. */
    memcpy(racers[1].payment.id, racers[0].payment.id, sizeof racers[1].payment.id);
    for (int i = 0; i < NTHREADS; i++)
      assert_int_equal(pthread_create(&threads[i], NULL, race, &racers[i]), 0);
    for (int i = 0; i < NTHREADS; i++)
      assert_int_equal(pthread_join(threads[i], NULL), 0);
    pthread_barrier_destroy(&start);

    for (int i = 0; i < NTHREADS; i++) {
      idem_record_t rec = {0};
      int found = idem_store_lookup(fx->store, &(idem_scope_t){fx->tenant.id, OP_PAY,
                                                               racers[i].key},
                                    fx->now, &rec);
      if (racers[i].rc != IDEM_OK) {
        if (i > 1 || failed >= 0)
          fail_msg("round %d: racer %d failed: %s", round, i, idem_err_name(racers[i].rc));
        failed = i;
        if (found != IDEM_ENOTFOUND)
          fail_msg("round %d: the failed racer's record stayed (%s)", round,
                   idem_err_name(found));
      } else {
        assert_int_equal(racers[i].result, IDEM_RESERVE_WON);
        if (found != IDEM_OK)
          fail_msg("round %d: racer %d won, but its record is %s", round, i,
                   idem_err_name(found));
      }
      idem_record_reset(&rec);
      idem_record_reset(&racers[i].rec);
    }
    if (failed < 0)
      fail_msg("round %d: both racers with one payment id succeeded", round);
    assert_int_equal(count(fx, "records"), before + NTHREADS - 1);
    assert_int_equal(count(fx, "payments"), before + NTHREADS - 1);
    assert_int_equal(count(fx, "outbox"), before + NTHREADS - 1);
    before += NTHREADS - 1;
  }
}

static void test_concurrent_same_key(void **state) {
  fixture_t *fx = *state;
  struct racer racers[NTHREADS];
  const struct racer *winner = NULL;
  int won = 0;

  run_race(fx, racers, 1);
  for (int i = 0; i < NTHREADS; i++)
    if (racers[i].result == IDEM_RESERVE_WON) {
      won++;
      winner = &racers[i];
    }
  assert_int_equal(won, 1);
  for (int i = 0; i < NTHREADS; i++) {
    struct racer *r = &racers[i];
    if (r != winner) {
      assert_int_equal(r->result, IDEM_RESERVE_EXISTS);
      assert_string_equal(r->rec.fingerprint, winner->fp);
      assert_string_equal(r->rec.resource_id, winner->payment.id);
    }
    idem_record_reset(&r->rec);
  }
  /* One key, one resource, one outbox row. */
  assert_int_equal(count(fx, "records"), 1);
  assert_int_equal(count(fx, "payments"), 1);
  assert_int_equal(count(fx, "outbox"), 1);
}

/* Many writers at once: busy database states are handled inside the
 * store, never surfaced to callers. */
static void test_concurrent_distinct_keys(void **state) {
  fixture_t *fx = *state;
  struct racer racers[NTHREADS];

  run_race(fx, racers, 0);
  for (int i = 0; i < NTHREADS; i++) {
    assert_int_equal(racers[i].result, IDEM_RESERVE_WON);
    for (int j = 0; j < i; j++)
      assert_string_not_equal(racers[i].rec.owner_token, racers[j].rec.owner_token);
  }
  for (int i = 0; i < NTHREADS; i++)
    idem_record_reset(&racers[i].rec);
  assert_int_equal(count(fx, "records"), NTHREADS);
  assert_int_equal(count(fx, "processing"), NTHREADS);
  assert_int_equal(count(fx, "payments"), NTHREADS);
  assert_int_equal(count(fx, "outbox"), NTHREADS);
}

/* ---- waiting for an in-flight record ---------------------------------- */

/* A wait may end without a change ("re-read the record; it may be
 * unchanged"): a stripe shared with another key, or a PostgreSQL store's
 * listener (re)connecting. So waiters here loop as a caller does:
 * ticket, read, wait, until the record changes or the deadline passes. */

struct waiter {
  fixture_t *fx;
  idem_scope_t scope;
  pthread_barrier_t ready;
  idem_state_t first, last; /* states read before the first and last waits */
  int64_t elapsed_ms;       /* from the barrier to seeing the change */
};

static idem_state_t state_of(fixture_t *fx, const idem_scope_t *scope) {
  idem_record_t rec = {0};
  idem_state_t st = IDEM_STATE_NONE;
  if (idem_store_lookup(fx->store, scope, fx->now, &rec) == IDEM_OK)
    st = rec.state;
  idem_record_reset(&rec);
  return st;
}

static void *wait_for_record(void *arg) {
  struct waiter *w = arg;
  int64_t start = 0, left = 1;

  for (int pass = 0; left > 0; pass++) {
    uint64_t ticket = idem_store_watch(w->fx->store, &w->scope);
    w->last = state_of(w->fx, &w->scope);
    if (pass == 0) {
      w->first = w->last;
      pthread_barrier_wait(&w->ready);
      start = idem_mono_ms();
    }
    if (w->last != IDEM_STATE_PROCESSING)
      break;
    left = start + 5000 - idem_mono_ms();
    (void)idem_store_wait(w->fx->store, &w->scope, ticket, left);
  }
  w->elapsed_ms = idem_mono_ms() - start;
  return NULL;
}

static void test_wait_wakes_on_completion(void **state) {
  fixture_t *fx = *state;
  char token[IDEM_TOKEN_MAX + 1];
  struct payment p;
  struct waiter w = {.fx = fx};
  pthread_t thread;
  idem_outcome_t out = {.state = IDEM_STATE_COMPLETED, .status = 201,
                        .body = "{\"n\":1}"};
  idem_reserve_t req = reserve_payment(fx, "key-1", LEASE_MS, &p, token);

  w.scope = req.scope;
  assert_int_equal(pthread_barrier_init(&w.ready, NULL, 2), 0);
  assert_int_equal(pthread_create(&thread, NULL, wait_for_record, &w), 0);
  pthread_barrier_wait(&w.ready);
  usleep(20 * 1000); /* most likely asleep in the wait by now */
  assert_int_equal(complete(fx, &req.scope, token, fx->now, TTL_MS, &out), IDEM_OK);
  assert_int_equal(pthread_join(thread, NULL), 0);
  pthread_barrier_destroy(&w.ready);

  assert_int_equal(w.first, IDEM_STATE_PROCESSING);
  assert_int_equal(w.last, IDEM_STATE_COMPLETED);
  /* A liveness check, not a benchmark: woken, not timed out. */
  if (w.elapsed_ms >= 4000)
    fail_msg("the waiter slept %lld ms: not woken by the completion",
             (long long)w.elapsed_ms);
}

static void test_wait_times_out(void **state) {
  fixture_t *fx = *state;
  char token[IDEM_TOKEN_MAX + 1];
  struct payment p;
  uint64_t ticket;
  int64_t start, elapsed = 0;
  int rc = IDEM_OK;
  idem_outcome_t out = {.state = IDEM_STATE_COMPLETED, .status = 201,
                        .body = "{\"n\":1}"};
  idem_reserve_t req = reserve_payment(fx, "key-1", LEASE_MS, &p, token);

  /* Nothing completes: the wait ends at its timeout (a few spurious
   * wake-ups are tolerated, see above). */
  for (int attempt = 0; attempt < 20 && rc != IDEM_ETIMEDOUT; attempt++) {
    ticket = idem_store_watch(fx->store, &req.scope);
    start = idem_mono_ms();
    rc = idem_store_wait(fx->store, &req.scope, ticket, 50);
    elapsed = idem_mono_ms() - start;
  }
  assert_int_equal(rc, IDEM_ETIMEDOUT);
  assert_in_range(elapsed, 45, 3999);
  assert_int_equal(state_of(fx, &req.scope), IDEM_STATE_PROCESSING);

  /* A completion between the ticket and the wait is not missed. */
  ticket = idem_store_watch(fx->store, &req.scope);
  assert_int_equal(complete(fx, &req.scope, token, fx->now, TTL_MS, &out), IDEM_OK);
  start = idem_mono_ms();
  assert_int_equal(idem_store_wait(fx->store, &req.scope, ticket, 5000), IDEM_OK);
  assert_in_range(idem_mono_ms() - start, 0, 3999);
}

/* ---- sweeping and meta ------------------------------------------------ */

static void test_sweep(void **state) {
  fixture_t *fx = *state;
  const int64_t ttl = 1000, at = fx->now + 2 * ttl;
  char fp[IDEM_FINGERPRINT_LEN], key[32];
  idem_record_t rec = {0};
  idem_reserve_t req;
  int deleted = -1, expired = 5;
  static const char *const survivors[] = {"pending", "processing", "long-ttl",
                                          "taken-over"};

  make_fp(fp, 1);
  /* Five records that expire at now + ttl: three completed, two failed. */
  for (int i = 0; i < expired; i++) {
    idem_outcome_t out = {.state = i < 3 ? IDEM_STATE_COMPLETED : IDEM_STATE_FAILED,
                          .status = i < 3 ? 201 : 503, .body = "{}"};
    snprintf(key, sizeof key, "expiring-%d", i);
    req = request(fx, OP_PAY, key, fp);
    req.ttl_ms = ttl;
    req.outcome = &out;
    assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
    idem_record_reset(&rec);
  }
  /* Records that must survive the sweep. */
  for (size_t i = 0; i < ARRAY_LEN(survivors); i++) {
    idem_outcome_t out = {.state = IDEM_STATE_COMPLETED, .status = 201, .body = "{}"};
    req = request(fx, OP_PAY, survivors[i], fp);
    req.ttl_ms = ttl;
    if (strcmp(survivors[i], "pending") == 0) {
      out.state = IDEM_STATE_PENDING;
      req.outcome = &out;
    } else if (strcmp(survivors[i], "long-ttl") == 0) {
      req.ttl_ms = TTL_MS;
      req.outcome = &out;
    } else if (strcmp(survivors[i], "taken-over") == 0) {
      /* Expired, then reserved again: processing now. */
      req.outcome = &out;
      assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
      idem_record_reset(&rec);
      req.outcome = NULL;
      req.now_ms = fx->now + ttl + 1;
    }
    assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
    idem_record_reset(&rec);
  }
  assert_int_equal(count(fx, "records"), expired + (int)ARRAY_LEN(survivors));

  /* Before the expiry nothing of ours goes. */
  assert_int_equal(idem_store_sweep(fx->store, fx->now + ttl - 1, 100, &deleted), IDEM_OK);
  assert_int_equal(count(fx, "records"), expired + (int)ARRAY_LEN(survivors));

  /* After it, at most `batch` per call (other tenants' expired records,
   * on a shared database, may be swept too). */
  assert_int_equal(idem_store_sweep(fx->store, at, 2, &deleted), IDEM_OK);
  assert_int_equal(deleted, 2);
  for (int calls = 0; deleted == 2; calls++) {
    assert_true(calls < 10000);
    assert_int_equal(idem_store_sweep(fx->store, at, 2, &deleted), IDEM_OK);
    assert_in_range(deleted, 0, 2);
  }
  assert_int_equal(count(fx, "records"), (int)ARRAY_LEN(survivors));
  assert_int_equal(count(fx, "pending"), 1);
  assert_int_equal(count(fx, "processing"), 2);
  for (size_t i = 0; i < ARRAY_LEN(survivors); i++) {
    idem_scope_t scope = {fx->tenant.id, OP_PAY, survivors[i]};
    assert_int_equal(idem_store_lookup(fx->store, &scope, at, &rec), IDEM_OK);
    idem_record_reset(&rec);
  }
  assert_int_equal(idem_store_sweep(fx->store, at, 0, &deleted), IDEM_EINVAL);
}

/* A sweep larger than any request's write: deleting 600 records of 2 KiB,
 * each beside one that stays, changes far more pages than one payment
 * does, and each changed page is kept to undo that one statement
 * (SQLite's statement journal). That journal once failed past a size
 * (SQLITE_FULL when it spilled to a file with a threshold over 128 KiB)
 * and the sweep with it. */
static void test_sweep_large_batch(void **state) {
  enum { RECORDS = 600, BODY = 2048 };
  fixture_t *fx = *state;
  const int64_t ttl = 1000;
  char fp[IDEM_FINGERPRINT_LEN], key[32];
  char *body = malloc(BODY + 1);
  idem_record_t rec = {0};
  int deleted = -1;

  assert_non_null(body);
  memset(body, 'x', BODY);
  body[0] = '"';
  body[BODY - 1] = '"';
  body[BODY] = '\0';
  make_fp(fp, 1);
  for (int i = 0; i < 2 * RECORDS; i++) {
    idem_outcome_t out = {.state = IDEM_STATE_COMPLETED, .status = 201, .body = body};
    idem_reserve_t req;
    snprintf(key, sizeof key, "bulk-%d", i);
    req = request(fx, OP_PAY, key, fp);
    req.ttl_ms = i % 2 ? TTL_MS : ttl; /* every other one stays */
    req.outcome = &out;
    assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
    idem_record_reset(&rec);
  }
  free(body);
  assert_int_equal(idem_store_sweep(fx->store, fx->now + 2 * ttl, 2 * RECORDS, &deleted),
                   IDEM_OK);
  assert_true(deleted > 0);
  /* Other tenants' expired records, on a shared database, go too. */
  for (int calls = 0; deleted > 0; calls++) {
    assert_true(calls < 1000);
    assert_int_equal(idem_store_sweep(fx->store, fx->now + 2 * ttl, 2 * RECORDS, &deleted),
                     IDEM_OK);
  }
  assert_int_equal(count(fx, "records"), RECORDS);
}

static void test_meta_first_value_wins(void **state) {
  fixture_t *fx = *state;
  char name[40];
  char *value = NULL;

  random_name(name, sizeof name, "test-meta-");
  assert_int_equal(idem_store_meta_get_or_put(fx->store, name, "first", &value), IDEM_OK);
  assert_string_equal(value, "first");
  free(value);
  assert_int_equal(idem_store_meta_get_or_put(fx->store, name, "second", &value), IDEM_OK);
  assert_string_equal(value, "first");
  free(value);
}

/* ---- argument checks -------------------------------------------------- */

static void test_argument_checks(void **state) {
  fixture_t *fx = *state;
  char fp[IDEM_FINGERPRINT_LEN], long_key[IDEM_KEY_MAX + 2];
  char long_op[IDEM_OPERATION_MAX + 2];
  idem_record_t rec = {0};
  idem_reserve_result_t result;
  idem_reserve_t req;
  int64_t n;
  idem_outcome_t out = {.state = IDEM_STATE_COMPLETED, .status = 201, .body = "{}"};

  make_fp(fp, 1);
  memset(long_key, 'k', sizeof long_key - 1);
  long_key[sizeof long_key - 1] = '\0';
  memset(long_op, 'o', sizeof long_op - 1);
  long_op[sizeof long_op - 1] = '\0';

  req = request(fx, OP_PAY, long_key, fp);
  assert_int_equal(idem_store_reserve(fx->store, &req, &rec, &result), IDEM_EINVAL);
  req = request(fx, long_op, "key-1", fp);
  assert_int_equal(idem_store_reserve(fx->store, &req, &rec, &result), IDEM_EINVAL);
  req = request(fx, OP_PAY, "key-1", NULL);
  assert_int_equal(idem_store_reserve(fx->store, &req, &rec, &result), IDEM_EINVAL);
  assert_int_equal(count(fx, "records"), 0);

  req = request(fx, OP_PAY, "key-1", fp);
  assert_int_equal(reserve(fx, &req, &rec), IDEM_RESERVE_WON);
  assert_int_equal(complete(fx, &req.scope, "", fx->now, TTL_MS, &out), IDEM_EINVAL);
  out.state = IDEM_STATE_PROCESSING;
  assert_int_equal(complete(fx, &req.scope, rec.owner_token, fx->now, TTL_MS, &out),
                   IDEM_EINVAL);
  idem_record_reset(&rec);
  assert_int_equal(count(fx, "processing"), 1);
  assert_int_equal(idem_store_count(fx->store, "bogus", fx->tenant.id, &n), IDEM_EINVAL);
}

/* With --require-url, the suite is skipped (exit 77, see CMakeLists.txt)
 * unless IDEM_TEST_STORE_URL names a store. */
int main(int argc, char **argv) {
  const char *url = getenv("IDEM_TEST_STORE_URL");
  if (url == NULL || url[0] == '\0') {
    if (argc > 1 && strcmp(argv[1], "--require-url") == 0) {
      fprintf(stderr, "IDEM_TEST_STORE_URL is not set: skipped\n");
      return 77;
    }
    url = "a fresh SQLite file per test";
  }
  fprintf(stderr, "store suite on %s\n", url);
#define STORE_TEST(f) cmocka_unit_test_setup_teardown(f, setup, teardown)
  const struct CMUnitTest tests[] = {
      STORE_TEST(test_migrate_is_idempotent),
      STORE_TEST(test_tenant_change_seen_at_once),
      STORE_TEST(test_tenants),
      STORE_TEST(test_keys),
      STORE_TEST(test_tenant_is_the_callers),
      STORE_TEST(test_reserve_won_then_exists),
      STORE_TEST(test_scope_isolation),
      STORE_TEST(test_key_bytes_round_trip),
      STORE_TEST(test_resource_outbox_and_complete),
      STORE_TEST(test_audit_trail),
      STORE_TEST(test_complete_needs_the_owner),
      STORE_TEST(test_complete_row_is_a_hint),
      STORE_TEST(test_async_reserve_and_complete),
      STORE_TEST(test_sync_write_from_callback_fails),
      STORE_TEST(test_single_step_reserve),
      STORE_TEST(test_pending_outcome),
      STORE_TEST(test_expired_record_is_taken_over),
      STORE_TEST(test_failed_record),
      STORE_TEST(test_effect_with_reservation),
      STORE_TEST(test_effect_failure_undoes_reservation),
      STORE_TEST(test_effect_with_completion),
      STORE_TEST(test_effect_lost_after_writing_is_undone),
      STORE_TEST(test_effects_in_a_failed_batch),
      STORE_TEST(test_caller_write_and_read),
      STORE_TEST(test_queued_statements),
      STORE_TEST(test_queued_error_before_prepare),
      STORE_TEST(test_caller_statements_kept),
      STORE_TEST(test_take_over),
      STORE_TEST(test_claim),
      STORE_TEST(test_audit_take_over),
      STORE_TEST(test_claim_takes_turns),
      STORE_TEST(test_concurrent_same_key),
      STORE_TEST(test_failed_write_is_undone_alone),
      STORE_TEST(test_concurrent_distinct_keys),
      STORE_TEST(test_wait_wakes_on_completion),
      STORE_TEST(test_wait_times_out),
      STORE_TEST(test_failed_write_among_others),
      STORE_TEST(test_group_commit_batches),
      STORE_TEST(test_batched_commit_notifies_other_store),
      STORE_TEST(test_listen_keyword_channel),
      STORE_TEST(test_batch_connection_lost_runs_again),
      STORE_TEST(test_write_error_reaches_caller),
      STORE_TEST(test_reads_do_not_starve_writes),
      STORE_TEST(test_sweep),
      STORE_TEST(test_sweep_large_batch),
      STORE_TEST(test_meta_first_value_wins),
      STORE_TEST(test_argument_checks),
  };
#undef STORE_TEST
  return cmocka_run_group_tests_name("store", tests, NULL, NULL);
}
