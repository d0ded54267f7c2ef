/* A database of the schema deployed today, filled through the store's own
 * calls and idemd's rows through their effects (what the current release
 * writes, src/data/resources.h), and the checks that a
 * migration kept every row and field of it and that the store still works
 * on it. Shared by test_sqlite_schema and test_pg_schema; each adds the
 * checks of its backend's schema. */
#ifndef IDEM_TEST_UPGRADE_H
#define IDEM_TEST_UPGRADE_H

#include "support.h"

#include <libpq-fe.h>
#include <sqlite3.h>
#include <stdlib.h>
#include <unistd.h>

#include "idem/clock.h"
#include "idem/crypto.h"
#include "data/resources.h"
#include "data/schema.h"
#include "data/sql.h"
#include "data/tenants.h"
#include "idem/store.h"

/* One record in each state, the order completed with its reservation,
 * reserved in this order. The failed one comes first: on SQLite the first
 * record's row is unknown (its rowid equals the tenant's, the connection's
 * previous insert), and the processing one's is wanted. */
enum { OLD_FAILED, OLD_PROCESSING, OLD_PENDING, OLD_COMPLETED, OLD_ORDER, OLD_N };

static const char *const old_keys[OLD_N] = {"key-failed", "key-processing", "key-pending",
                                            "key-completed", "key-order"};

/* The counts read for the tenant: the records' by idem_store_count(),
 * idemd's rows' by idemd_resource_count(). */
static const char *const old_counted[] = {"records", "processing", "pending",
                                          "outbox",  "payments",   "orders"};

static int old_count(idem_store_t *store, const char *what, int64_t tenant_id, int64_t *n) {
  if (idemd_resource_count(store, what, tenant_id, n) == IDEM_EINVAL)
    return idem_store_count(store, what, tenant_id, n);
  return IDEM_OK;
}

#define OLD_LEASE_MS 60000
#define OLD_TTL_MS 86400000

/* The released schema's tenant: its one key in the row. */
struct old_tenant {
  int64_t id;
  char name[65];
  char key_lookup[33];
  unsigned char key_hash[32];
  int64_t created_at;
};

/* Inserts `t` as the released idemd did, into the tenants table of the
 * released schema, and sets its id. */
static int old_tenant_insert(void *arg, idem_tx_t *tx) {
  struct old_tenant *t = arg;
  char hash[65], created[24];
  int ok;

  idem_hex(t->key_hash, sizeof t->key_hash, hash);
  snprintf(created, sizeof created, "%lld", (long long)t->created_at);
  if (idem_tx_backend(tx)[0] == 's') {
    sqlite3 *db = idem_tx_handle(tx);
    sqlite3_stmt *st = NULL;
    ok = sqlite3_prepare_v2(db,
                            "INSERT INTO tenants (name, key_lookup, key_hash, created_at) "
                            "VALUES (?1, ?2, ?3, ?4)",
                            -1, &st, NULL) == SQLITE_OK;
    if (ok) {
      sqlite3_bind_text(st, 1, t->name, -1, SQLITE_STATIC);
      sqlite3_bind_text(st, 2, t->key_lookup, -1, SQLITE_STATIC);
      sqlite3_bind_blob(st, 3, t->key_hash, sizeof t->key_hash, SQLITE_STATIC);
      sqlite3_bind_int64(st, 4, t->created_at);
      ok = sqlite3_step(st) == SQLITE_DONE;
      t->id = sqlite3_last_insert_rowid(db);
    }
    sqlite3_finalize(st);
  } else {
    const char *p[4] = {t->name, t->key_lookup, hash, created};
    PGresult *res = PQexecParams(idem_tx_handle(tx),
                                 "INSERT INTO tenants (name, key_lookup, key_hash, "
                                 "created_at) VALUES ($1, $2, $3, $4) RETURNING id",
                                 4, NULL, p, NULL, NULL, 0);
    ok = PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1;
    if (ok)
      t->id = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
    PQclear(res);
  }
  return ok ? IDEM_OK : IDEM_ESTORE;
}

/* Inserts a resource and its outbox row as the released idemd did, into
 * the released schema's tables (without the columns later versions
 * add). */
static int old_resource_insert(void *arg, idem_tx_t *tx) {
  const idemd_resource_t *res = arg;
  int64_t now = idem_tx_now_ms(tx);
  idemd_sql_param_t p[7] = {IDEMD_SQL_TEXT(res->id),   IDEMD_SQL_NUM(res->tenant_id),
                            IDEMD_SQL_TEXT(res->kind), IDEMD_SQL_TEXT(res->status),
                            IDEMD_SQL_TEXT(res->body), IDEMD_SQL_TEXT(res->provider_ref),
                            IDEMD_SQL_NUM(now)};
  idemd_sql_param_t o[6] = {IDEMD_SQL_TEXT(res->id),        IDEMD_SQL_NUM(res->tenant_id),
                            IDEMD_SQL_TEXT(res->operation), IDEMD_SQL_TEXT(res->key),
                            IDEMD_SQL_NUM(now),             IDEMD_SQL_NUM(now + res->due_after_ms)};
  int rc = idemd_sql_run(tx, IDEMD_SQL_SCHEMA,
                         "INSERT INTO resources (id, tenant_id, kind, status, body, "
                         "provider_ref, created_at, updated_at) VALUES ($1, $2, $3, $4, $5, "
                         "$6, $7, $7)",
                         p, 7, NULL, NULL, NULL);
  if (rc != IDEM_OK || res->operation == NULL)
    return rc;
  return idemd_sql_run(tx, IDEMD_SQL_SCHEMA_CHECK,
                       "INSERT INTO outbox (resource_id, tenant_id, operation, key, "
                       "created_at, attempts, next_attempt_at) VALUES ($1, $2, $3, $4, $5, "
                       "0, $6)",
                       o, 6, NULL, NULL, NULL);
}

/* Completes a payment as the released idemd did: its row and its outbox
 * row, in the released schema's tables (which have no audit trail). */
static int old_resource_update(void *arg, idem_tx_t *tx) {
  const idemd_resource_update_t *u = arg;
  int64_t now = idem_tx_now_ms(tx);
  idemd_sql_param_t p[6] = {IDEMD_SQL_TEXT(u->status), IDEMD_SQL_TEXT(u->body),
                            IDEMD_SQL_TEXT(u->provider_ref), IDEMD_SQL_NUM(now),
                            IDEMD_SQL_TEXT(u->id), IDEMD_SQL_NUM(u->tenant_id)};
  int rc = idemd_sql_run(tx, IDEMD_SQL_SCHEMA,
                         "UPDATE resources SET status = COALESCE($1, status), "
                         "body = COALESCE($2, body), provider_ref = COALESCE($3, "
                         "provider_ref), updated_at = $4 WHERE id = $5 AND tenant_id = $6",
                         p, 6, NULL, NULL, NULL);
  if (rc != IDEM_OK)
    return rc;
  if (u->state == IDEM_STATE_PENDING)
    return idemd_sql_run(tx, IDEMD_SQL_SCHEMA_CHECK,
                         "UPDATE outbox SET next_attempt_at = $1 WHERE resource_id = $2 "
                         "AND tenant_id = $3",
                         p + 3, 3, NULL, NULL, NULL);
  return idemd_sql_run(tx, IDEMD_SQL_SCHEMA_CHECK,
                       "DELETE FROM outbox WHERE resource_id = $1 AND tenant_id = $2",
                       p + 4, 2, NULL, NULL, NULL);
}

/* What old_fill() wrote, as the store read it back before the migration. */
struct old_data {
  struct old_tenant tenant;
  int64_t now;
  idem_scope_t scopes[OLD_N];
  idem_record_t before[OLD_N];
  int64_t rows[OLD_N];            /* each reservation's `row` */
  char token[IDEM_TOKEN_MAX + 1]; /* the processing record's owner */
  char ids[OLD_N][40];            /* resource ids; "" for none */
  char *bodies[OLD_N];            /* the resources' bodies, as read */
  int64_t counts[ARRAY_LEN(old_counted)];
};

/* Writes, in a tenant of its own: a payment in flight (resource and
 * outbox row, a lease), one whose outcome is unknown (pending, its outbox
 * row kept), one completed (resource settled, provider reference), a
 * failed request, and an order completed in its reservation. */
static void old_fill(idem_store_t *store, struct old_data *d) {
  idem_effect_t insert = {old_tenant_insert, &d->tenant};

  memset(d, 0, sizeof *d);
  d->now = idem_now_ms();
  snprintf(d->tenant.name, sizeof d->tenant.name, "acme");
  assert_int_equal(
      idem_random_token(d->tenant.key_lookup, sizeof d->tenant.key_lookup - 1), IDEM_OK);
  assert_int_equal(idem_random_bytes(d->tenant.key_hash, sizeof d->tenant.key_hash),
                   IDEM_OK);
  d->tenant.created_at = d->now;
  assert_int_equal(idem_store_write(store, &insert), IDEM_OK);

  for (int i = 0; i < OLD_N; i++) {
    const int order = i == OLD_ORDER;
    char fp[IDEM_FINGERPRINT_LEN], body[160], done[160], reply[160], location[160];
    char correlation[16];
    idem_record_t rec = {0};
    idem_reserve_result_t result = 0;
    idemd_resource_t res;
    idemd_resource_update_t settle = {0};
    idem_outcome_t out = {0};
    idem_reserve_t req = {
        .scope = {d->tenant.id, order ? "create_order" : "create_payment", old_keys[i]},
        .fingerprint = fp,
        .correlation_id = correlation,
        .now_ms = d->now + i,
        .lease_ms = OLD_LEASE_MS,
        .ttl_ms = OLD_TTL_MS,
    };

    d->scopes[i] = req.scope;
    snprintf(fp, sizeof fp, "%064d", 100 + i);
    snprintf(correlation, sizeof correlation, "req_%d", i);
    if (i != OLD_FAILED)
      snprintf(d->ids[i], sizeof d->ids[i], "%s_%d", order ? "ord" : "pay", i);
    snprintf(body, sizeof body, "{\"id\":\"%s\",\"%s\":%d,\"status\":\"%s\"}", d->ids[i],
             order ? "total" : "amount", 1000 + i, order ? "created" : "pending");
    snprintf(done, sizeof done, "{\"id\":\"%s\",\"amount\":%d,\"status\":\"succeeded\"}",
             d->ids[i], 1000 + i);
    snprintf(reply, sizeof reply, "{\"id\":\"%s\",\"n\":%d}", d->ids[i], i);
    snprintf(location, sizeof location, "/%s/%s", order ? "orders" : "payments",
             d->ids[i]);
    res = (idemd_resource_t){.tenant_id = d->tenant.id,
                             .kind = order ? "order" : "payment",
                             .id = d->ids[i],
                             .status = order ? "created" : "pending",
                             .body = body,
                             .operation = order ? NULL : req.scope.operation,
                             .key = req.scope.key,
                             .due_after_ms = OLD_LEASE_MS};
    settle = (idemd_resource_update_t){.tenant_id = d->tenant.id, .id = d->ids[i]};
    if (i != OLD_FAILED) {
      req.resource_id = d->ids[i];
      req.effect = (idem_effect_t){old_resource_insert, &res};
    }
    switch (i) {
    case OLD_PENDING:
      out = (idem_outcome_t){.state = IDEM_STATE_PENDING,
                             .status = 202,
                             .body = reply,
                             .location = location,
                             .provider_ref = "ref_pending"};
      settle.status = "pending";
      settle.provider_ref = "ref_pending";
      settle.state = IDEM_STATE_PENDING;
      break;
    case OLD_COMPLETED:
      out = (idem_outcome_t){.state = IDEM_STATE_COMPLETED,
                             .status = 201,
                             .body = reply,
                             .location = location,
                             .provider_ref = "ch_completed"};
      settle.status = "succeeded";
      settle.body = done;
      settle.provider_ref = "ch_completed";
      settle.state = IDEM_STATE_COMPLETED;
      break;
    case OLD_FAILED:
      out = (idem_outcome_t){.state = IDEM_STATE_FAILED,
                             .status = 503,
                             .body = "{\"error\":\"provider unavailable\"}"};
      break;
    case OLD_ORDER:
      out = (idem_outcome_t){.state = IDEM_STATE_COMPLETED,
                             .status = 201,
                             .body = body,
                             .location = location};
      req.outcome = &out;
      break;
    }
    if (idem_store_reserve(store, &req, &rec, &result) != IDEM_OK)
      fail_msg("reserve %s: %s", old_keys[i], idem_store_last_error());
    assert_int_equal(result, IDEM_RESERVE_WON);
    d->rows[i] = rec.row;
    if (i == OLD_PROCESSING)
      idem_copy(d->token, sizeof d->token, rec.owner_token);
    if (i != OLD_PROCESSING && i != OLD_ORDER) {
      idem_complete_t c = {.scope = req.scope,
                           .owner_token = rec.owner_token,
                           .now_ms = d->now + 10 + i,
                           .ttl_ms = OLD_TTL_MS,
                           .outcome = out,
                           .row = rec.row};
      if (i != OLD_FAILED)
        c.effect = (idem_effect_t){old_resource_update, &settle};
      assert_int_equal(idem_store_complete(store, &c), IDEM_OK);
    }
    idem_record_reset(&rec);
  }

  for (int i = 0; i < OLD_N; i++) {
    assert_int_equal(idem_store_lookup(store, &d->scopes[i], d->now + 20, &d->before[i]),
                     IDEM_OK);
    if (d->ids[i][0])
      assert_int_equal(idemd_resource_get(store, d->tenant.id,
                                          i == OLD_ORDER ? "order" : "payment",
                                          d->ids[i], &d->bodies[i]),
                       IDEM_OK);
  }
  for (size_t i = 0; i < ARRAY_LEN(old_counted); i++)
    assert_int_equal(old_count(store, old_counted[i], d->tenant.id, &d->counts[i]),
                     IDEM_OK);
  /* What was written is what each state looks like. */
  assert_int_equal(d->before[OLD_PROCESSING].state, IDEM_STATE_PROCESSING);
  assert_int_equal(d->before[OLD_PENDING].state, IDEM_STATE_PENDING);
  assert_int_equal(d->before[OLD_COMPLETED].state, IDEM_STATE_COMPLETED);
  assert_int_equal(d->before[OLD_FAILED].state, IDEM_STATE_FAILED);
  assert_int_equal(d->before[OLD_ORDER].state, IDEM_STATE_COMPLETED);
  assert_int_equal(d->counts[3], 2); /* outbox: the processing and pending payments */
}

static void old_free(struct old_data *d) {
  for (int i = 0; i < OLD_N; i++) {
    idem_record_reset(&d->before[i]);
    free(d->bodies[i]);
    d->bodies[i] = NULL;
  }
}

static void assert_same_record(const idem_record_t *got, const idem_record_t *want) {
  assert_int_equal(got->tenant_id, want->tenant_id);
  assert_string_equal(got->operation, want->operation);
  assert_string_equal(got->key, want->key);
  assert_string_equal(got->fingerprint, want->fingerprint);
  assert_int_equal(got->state, want->state);
  assert_int_equal(got->response_status, want->response_status);
  if (want->response_body == NULL)
    assert_null(got->response_body);
  else
    assert_string_equal(got->response_body, want->response_body);
  assert_string_equal(got->location, want->location);
  assert_string_equal(got->resource_id, want->resource_id);
  assert_string_equal(got->provider_ref, want->provider_ref);
  assert_string_equal(got->correlation_id, want->correlation_id);
  assert_string_equal(got->owner_token, want->owner_token);
  assert_int_equal(got->lease_expires_at, want->lease_expires_at);
  assert_int_equal(got->created_at, want->created_at);
  assert_int_equal(got->updated_at, want->updated_at);
  assert_int_equal(got->expires_at, want->expires_at);
}

/* After the migration: every record, field by field, every resource and
 * count, and the tenant are as they were. */
static void old_check_kept(idem_store_t *store, const struct old_data *d) {
  idemd_tenants_t *tenants = NULL;
  idemd_tenant_t found;
  idemd_api_key_t key;

  for (int i = 0; i < OLD_N; i++) {
    idem_record_t rec = {0};
    char *body = NULL;
    assert_int_equal(idem_store_lookup(store, &d->scopes[i], d->now + 20, &rec), IDEM_OK);
    assert_same_record(&rec, &d->before[i]);
    idem_record_reset(&rec);
    if (d->ids[i][0] == '\0')
      continue;
    assert_int_equal(idemd_resource_get(store, d->tenant.id,
                                        i == OLD_ORDER ? "order" : "payment", d->ids[i],
                                        &body),
                     IDEM_OK);
    assert_string_equal(body, d->bodies[i]);
    free(body);
  }
  for (size_t i = 0; i < ARRAY_LEN(old_counted); i++) {
    int64_t n = -1;
    assert_int_equal(old_count(store, old_counted[i], d->tenant.id, &n), IDEM_OK);
    if (n != d->counts[i])
      fail_msg("%s: %lld after the migration, %lld before", old_counted[i], (long long)n,
               (long long)d->counts[i]);
  }
  /* The tenant's key is its key named "default" (idemd's version 2). */
  assert_int_equal(idemd_tenants_open(store, &tenants), IDEM_OK);
  assert_int_equal(idemd_key_find(tenants, d->tenant.key_lookup, &key, &found), IDEM_OK);
  idemd_tenants_close(tenants);
  assert_int_equal(found.id, d->tenant.id);
  assert_string_equal(found.name, d->tenant.name);
  assert_int_equal(found.created_at, d->tenant.created_at);
  assert_int_equal(found.disabled, 0);
  assert_int_equal(key.tenant_id, d->tenant.id);
  assert_string_equal(key.name, "default");
  assert_int_equal(key.created_at, d->tenant.created_at);
  assert_int_equal(key.revoked_at, 0);
  assert_memory_equal(key.hash, d->tenant.key_hash, sizeof key.hash);
}

/* Reserves `key` under `tenant_id` (a tenant with no row anywhere), then
 * completes it; returns the reservation's result, having completed and
 * looked the record up only when it was IDEM_OK. */
static int reserve_tenantless(idem_store_t *store, int64_t tenant_id, const char *key,
                              int64_t now) {
  static const char fp[] =
      "00000000000000000000000000000000000000000000000000000000000000ee";
  static const char reply[] = "{\"ok\":true}";
  idem_record_t rec = {0};
  idem_reserve_result_t result = 0;
  idem_reserve_t req = {.scope = {tenant_id, "embedded_op", key},
                        .fingerprint = fp,
                        .correlation_id = "req_free",
                        .now_ms = now,
                        .lease_ms = OLD_LEASE_MS,
                        .ttl_ms = OLD_TTL_MS};
  int rc = idem_store_reserve(store, &req, &rec, &result);

  if (rc != IDEM_OK) {
    assert_int_equal(idem_store_lookup(store, &req.scope, now, &rec), IDEM_ENOTFOUND);
    return rc;
  }
  assert_int_equal(result, IDEM_RESERVE_WON);
  idem_complete_t c = {
      .scope = req.scope,
      .owner_token = rec.owner_token,
      .now_ms = now,
      .ttl_ms = OLD_TTL_MS,
      .row = rec.row,
      .outcome = {.state = IDEM_STATE_COMPLETED, .status = 200, .body = reply}};
  assert_int_equal(idem_store_complete(store, &c), IDEM_OK);
  idem_record_reset(&rec);
  assert_int_equal(idem_store_lookup(store, &req.scope, now, &rec), IDEM_OK);
  assert_int_equal(rec.tenant_id, tenant_id);
  assert_int_equal(rec.state, IDEM_STATE_COMPLETED);
  assert_int_equal(rec.response_status, 200);
  assert_string_equal(rec.response_body, reply);
  idem_record_reset(&rec);
  return IDEM_OK;
}

/* After the migration the records are used as before: the payment in
 * flight is completed by its owner (with its reservation's row), the
 * pending one is claimed and settled, and a key of a tenant that has no
 * row is reserved and completed. */
static void old_check_usable(idem_store_t *store, const struct old_data *d) {
  const int64_t t = d->now + 100;
  idem_record_t claimed[4] = {{0}}, rec = {0};
  idemd_resource_update_t settle = {.tenant_id = d->tenant.id,
                                    .id = d->ids[OLD_PROCESSING],
                                    .status = "succeeded",
                                    .state = IDEM_STATE_COMPLETED};
  idem_complete_t c = {.now_ms = t,
                       .ttl_ms = OLD_TTL_MS,
                       .outcome = {.state = IDEM_STATE_COMPLETED,
                                   .status = 201,
                                   .body = "{\"n\":1}"},
                       .effect = {idemd_resource_update, &settle}};
  int n = -1;
  int64_t left = -1;

  c.scope = d->scopes[OLD_PROCESSING];
  c.owner_token = d->token;
  c.row = d->rows[OLD_PROCESSING];
  assert_int_equal(idem_store_complete(store, &c), IDEM_OK);
  assert_int_equal(idem_store_lookup(store, &c.scope, t, &rec), IDEM_OK);
  assert_int_equal(rec.state, IDEM_STATE_COMPLETED);
  assert_string_equal(rec.fingerprint, d->before[OLD_PROCESSING].fingerprint);
  idem_record_reset(&rec);

  /* The claim runs at the clock's time: let it pass the times written. */
  while (idem_now_ms() <= t)
    usleep(1000);
  assert_int_equal(idemd_outbox_claim(store, 5000, (int)ARRAY_LEN(claimed), claimed, &n),
                   IDEM_OK);
  assert_int_equal(n, 1);
  assert_string_equal(claimed[0].key, old_keys[OLD_PENDING]);
  assert_string_equal(claimed[0].resource_id, d->ids[OLD_PENDING]);
  settle.id = d->ids[OLD_PENDING];
  c.scope = d->scopes[OLD_PENDING];
  c.owner_token = claimed[0].owner_token;
  c.row = 0;
  assert_int_equal(idem_store_complete(store, &c), IDEM_OK);
  idem_record_reset(&claimed[0]);
  assert_int_equal(idemd_resource_count(store, "outbox", d->tenant.id, &left), IDEM_OK);
  assert_int_equal(left, 0);

  assert_int_equal(reserve_tenantless(store, d->tenant.id + 1000, "key-free", t),
                   IDEM_OK);
}

#endif
