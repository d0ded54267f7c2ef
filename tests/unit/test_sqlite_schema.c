/* The SQLite schema's migrations on a database that holds data: each
 * step keeps every row, and what the store reads and enforces afterwards
 * still holds. The rows are written with SQL as an older idemd wrote
 * them, or through the store at the version deployed today, then the
 * store migrates to the current version. */
#include "support.h"
#include "upgrade.h"

#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "idem/store.h"
#include "store/store_impl.h"

/* The schema version this program migrates to, and the one the current
 * release deployed. */
#define CURRENT_VERSION 5
#define RELEASED_VERSION 3

struct fixture {
  char dir[256], path[300];
};

static int setup(void **state) {
  struct fixture *fx = calloc(1, sizeof *fx);
  const char *tmp = getenv("TMPDIR");

  assert_non_null(fx);
  snprintf(fx->dir, sizeof fx->dir, "%s/idem-schema-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
  if (mkdtemp(fx->dir) == NULL)
    fail_msg("mkdtemp %s failed", fx->dir);
  snprintf(fx->path, sizeof fx->path, "%s/idem.db", fx->dir);
  *state = fx;
  return 0;
}

static int teardown(void **state) {
  struct fixture *fx = *state;
  remove_sqlite_files(fx->path);
  rmdir(fx->dir);
  free(fx);
  return 0;
}

static void sql(sqlite3 *db, const char *text) {
  char *err = NULL;
  if (sqlite3_exec(db, text, NULL, NULL, &err) != SQLITE_OK) {
    char msg[512]; /* the SQL is cut to fit: a message, not a record */
    snprintf(msg, sizeof msg, "%.100s: %.400s", err ? err : "?", text);
    sqlite3_free(err);
    fail_msg("%s", msg);
  }
}

/* The single integer `query` returns. */
static long long number(sqlite3 *db, const char *query) {
  sqlite3_stmt *st;
  long long v;
  assert_int_equal(sqlite3_prepare_v2(db, query, -1, &st, NULL), SQLITE_OK);
  assert_int_equal(sqlite3_step(st), SQLITE_ROW);
  v = sqlite3_column_int64(st, 0);
  sqlite3_finalize(st);
  return v;
}

/* The single text `query` returns, malloc'd ("" for NULL); the caller
 * frees it. */
static char *text(sqlite3 *db, const char *query) {
  sqlite3_stmt *st;
  char *v;
  assert_int_equal(sqlite3_prepare_v2(db, query, -1, &st, NULL), SQLITE_OK);
  assert_int_equal(sqlite3_step(st), SQLITE_ROW);
  v = strdup(sqlite3_column_text(st, 0) ? (const char *)sqlite3_column_text(st, 0) : "");
  assert_non_null(v);
  sqlite3_finalize(st);
  return v;
}

/* `s` with the first `cut` taken out, in place; returns `s`. */
static char *without(char *s, const char *cut) {
  char *at = strstr(s, cut);
  if (at)
    memmove(at, at + strlen(cut), strlen(at + strlen(cut)) + 1);
  return s;
}

/* The statements behind idem_store_count("pending" | "processing" |
 * "oldest_pending"), as src/store/sqlite.c has them. */
static const char *const unsettled_queries[] = {
    "SELECT count(*) FROM idempotency_records WHERE state = 'processing' "
    "AND (?1 = 0 OR tenant_id = ?1)",
    "SELECT count(*) FROM idempotency_records WHERE state = 'pending' "
    "AND (?1 = 0 OR tenant_id = ?1)",
    "SELECT coalesce(min(created_at), 0) FROM idempotency_records WHERE "
    "state = 'pending' AND (?1 = 0 OR tenant_id = ?1)",
};

/* EXPLAIN QUERY PLAN of `query`, its details joined by "; ". */
static void query_plan(sqlite3 *db, const char *query, char *out, size_t len) {
  sqlite3_stmt *st;
  char sql[512];
  size_t used = 0;

  snprintf(sql, sizeof sql, "EXPLAIN QUERY PLAN %s", query);
  assert_int_equal(sqlite3_prepare_v2(db, sql, -1, &st, NULL), SQLITE_OK);
  out[0] = '\0';
  while (sqlite3_step(st) == SQLITE_ROW && used < len) {
    int n = snprintf(out + used, len - used, "%s; ",
                     (const char *)sqlite3_column_text(st, 3));
    used += n > 0 ? (size_t)n : 0;
  }
  sqlite3_finalize(st);
}

/* Version 2 -> current: the records table is copied (rowids and every
 * column kept), resources and outbox move into their primary keys, the
 * views come back, and constraints still hold (but the records' tenant,
 * which no longer references tenants, version 4). */
static void test_from_version_2(void **state) {
  struct fixture *fx = *state;
  idem_store_t *store;
  sqlite3 *db;
  idem_scope_t scope = {1, "create_payment", "key-pending"};
  idem_record_t rec = {0}, claimed[4] = {{0}};
  int n = 0;
  char *body = NULL;

  assert_int_equal(idem_store_open(fx->path, NULL, &store), IDEM_OK);
  assert_int_equal(idem__sqlite_migrate_to(store, 2), IDEM_OK);
  assert_int_equal(sqlite3_open(fx->path, &db), SQLITE_OK);
  sql(db, "PRAGMA foreign_keys = ON");
  assert_int_equal(number(db, "PRAGMA user_version"), 2);
  sql(db,
      "INSERT INTO tenants (id, name, key_lookup, key_hash, created_at) "
      "VALUES (1, 'acme', 'lookup', x'00', 1);"
      "INSERT INTO resources VALUES ('pay_1', 1, 'payment', 'pending', "
      "'{\"id\":\"pay_1\",\"amount\":10}', NULL, 5, 5);"
      "INSERT INTO resources VALUES ('ord_1', 1, 'order', 'created', "
      "'{\"id\":\"ord_1\",\"total\":7}', NULL, 6, 6);"
      "INSERT INTO outbox VALUES ('pay_1', 1, 'create_payment', 'key-pending', 5, 2, 9);"
      "INSERT INTO idempotency_records (rowid, tenant_id, operation, key, "
      "fingerprint, state, response_status, response_body, location, "
      "resource_id, provider_ref, correlation_id, owner_token, "
      "lease_expires_at, created_at, updated_at, expires_at) VALUES "
      "(41, 1, 'create_payment', 'key-pending', 'fp1', 'pending', 202, "
      "'{\"status\":\"pending\"}', '/payments/pay_1', 'pay_1', 'ref', 'req_1', "
      "NULL, NULL, 5, 5, NULL),"
      "(42, 1, 'create_order', 'key-done', 'fp2', 'completed', 201, "
      "'{\"id\":\"ord_1\"}', '/orders/ord_1', 'ord_1', NULL, 'req_2', NULL, "
      "NULL, 6, 6, 4102444800000);");

  assert_int_equal(idem_store_migrate(store), IDEM_OK);
  assert_int_equal(number(db, "PRAGMA user_version"), CURRENT_VERSION);

  /* Every row, as it was. */
  assert_int_equal(number(db, "SELECT count(*) FROM idempotency_records"), 2);
  assert_int_equal(number(db, "SELECT rowid FROM idempotency_records WHERE key = 'key-done'"),
                   42);
  assert_int_equal(number(db, "SELECT count(*) FROM idempotency_records WHERE rowid = 41 "
                              "AND state = 'pending' AND response_status = 202 AND "
                              "provider_ref = 'ref' AND resource_id = 'pay_1' AND "
                              "correlation_id = 'req_1' AND expires_at IS NULL"),
                   1);
  assert_int_equal(number(db, "SELECT count(*) FROM resources"), 2);
  assert_int_equal(number(db, "SELECT count(*) FROM outbox WHERE resource_id = 'pay_1' "
                              "AND attempts = 2 AND next_attempt_at = 9"),
                   1);
  assert_int_equal(number(db, "SELECT amount FROM payments WHERE id = 'pay_1'"), 10);
  assert_int_equal(number(db, "SELECT total FROM orders WHERE id = 'ord_1'"), 7);
  assert_int_equal(number(db, "SELECT count(*) FROM pragma_foreign_key_check"), 0);
  assert_int_equal(number(db, "SELECT count(*) FROM sqlite_schema WHERE name = "
                              "'records_open'"),
                   0);
  assert_int_equal(number(db, "SELECT count(*) FROM sqlite_schema WHERE name IN "
                              "('resources', 'outbox') AND sql LIKE '%WITHOUT ROWID'"),
                   2);
  assert_int_equal(number(db, "SELECT count(*) FROM sqlite_schema WHERE name = "
                              "'records_expiry'"),
                   1);
  /* Foreign keys: resources to tenants, outbox to resources; records to
   * nothing (version 4). */
  assert_int_equal(number(db, "SELECT count(*) FROM pragma_foreign_key_list("
                              "'idempotency_records')"),
                   0);
  assert_int_equal(number(db, "SELECT count(*) FROM pragma_foreign_key_list('resources') "
                              "WHERE \"table\" = 'tenants'"),
                   1);
  assert_int_equal(number(db, "SELECT count(*) FROM pragma_foreign_key_list('outbox') "
                              "WHERE \"table\" = 'resources'"),
                   1);
  /* The counts /metrics reads go through the index of unsettled records,
   * not through every record. */
  for (size_t i = 0; i < ARRAY_LEN(unsettled_queries); i++) {
    char plan[512];
    query_plan(db, unsettled_queries[i], plan, sizeof plan);
    if (strstr(plan, "records_unsettled") == NULL)
      fail_msg("%s: plan %s", unsettled_queries[i], plan);
  }

  /* Constraints: a state outside the four, an outbox row without its
   * payment, a second record for a key. */
  assert_int_not_equal(sqlite3_exec(db,
                                    "UPDATE idempotency_records SET state = 'bogus' "
                                    "WHERE rowid = 42",
                                    NULL, NULL, NULL),
                       SQLITE_OK);
  assert_int_not_equal(sqlite3_exec(db, "DELETE FROM resources WHERE id = 'pay_1'", NULL,
                                    NULL, NULL),
                       SQLITE_OK);
  assert_int_not_equal(sqlite3_exec(db,
                                    "INSERT INTO idempotency_records (tenant_id, "
                                    "operation, key, fingerprint, state, "
                                    "correlation_id, created_at, updated_at) VALUES "
                                    "(1, 'create_order', 'key-done', 'x', "
                                    "'processing', 'r', 1, 1)",
                                    NULL, NULL, NULL),
                       SQLITE_OK);

  /* What the store reads: the record, the resource, and the pending
   * payment the reconciler must settle. */
  assert_int_equal(idem_store_lookup(store, &scope, 10, &rec), IDEM_OK);
  assert_int_equal(rec.state, IDEM_STATE_PENDING);
  assert_string_equal(rec.resource_id, "pay_1");
  idem_record_reset(&rec);
  assert_int_equal(idemd_resource_get(store, 1, "order", "ord_1", &body), IDEM_OK);
  assert_string_equal(body, "{\"id\":\"ord_1\",\"total\":7}");
  free(body);
  assert_int_equal(idemd_outbox_claim(store, 1000, 4, claimed, &n), IDEM_OK);
  assert_int_equal(n, 1);
  assert_string_equal(claimed[0].key, "key-pending");
  idem_record_reset(&claimed[0]);

  /* Migrating again changes nothing. */
  assert_int_equal(idem_store_migrate(store), IDEM_OK);
  assert_int_equal(number(db, "PRAGMA user_version"), CURRENT_VERSION);
  sqlite3_close(db);
  idem_store_close(store);
}

/* The schema deployed today (version 3) -> current, on a database the
 * current release filled: every record keeps every field and its rowid
 * (the row its reservation returned, which a completion may name), the
 * table and its indexes keep every constraint but the reference to
 * tenants, and afterwards a key of a tenant with no row is reserved and
 * completed, which version 3 refused. */
static void test_from_released_version(void **state) {
  struct fixture *fx = *state;
  idem_store_t *store;
  sqlite3 *db;
  struct old_data d;
  long long rowids[OLD_N];
  char *table, *indexes, *after, why[512];

  assert_int_equal(idem_store_open(fx->path, NULL, &store), IDEM_OK);
  assert_int_equal(idem__sqlite_migrate_to(store, RELEASED_VERSION), IDEM_OK);
  assert_int_equal(sqlite3_open(fx->path, &db), SQLITE_OK);
  assert_int_equal(number(db, "PRAGMA user_version"), RELEASED_VERSION);
  old_fill(store, &d);
  /* The released schema holds each record to a tenant row. */
  assert_int_not_equal(reserve_tenantless(store, d.tenant.id + 1000, "key-free", d.now),
                       IDEM_OK);
  for (int i = 0; i < OLD_N; i++) {
    char q[160];
    snprintf(q, sizeof q, "SELECT rowid FROM idempotency_records WHERE key = '%s'",
             old_keys[i]);
    rowids[i] = number(db, q);
  }
  /* The rows the reservations returned are the rowids (0: unknown). */
  assert_true(d.rows[OLD_PROCESSING] > 0);
  for (int i = 0; i < OLD_N; i++)
    if (d.rows[i] != 0)
      assert_int_equal(d.rows[i], rowids[i]);
  table = text(db, "SELECT sql FROM sqlite_schema WHERE name = 'idempotency_records'");
  indexes = text(db, "SELECT group_concat(sql, '; ') FROM (SELECT sql FROM sqlite_schema "
                     "WHERE type = 'index' AND tbl_name = 'idempotency_records' "
                     "ORDER BY name)");
  assert_contains(table, " REFERENCES tenants (id)");
  assert_contains(indexes, "records_unsettled");

  assert_int_equal(idem_store_migrate(store), IDEM_OK);
  assert_int_equal(number(db, "PRAGMA user_version"), CURRENT_VERSION);
  /* idemd's tables are there already: its first version leaves them. */
  if (idemd_schema_migrate(store, why, sizeof why) != IDEM_OK)
    fail_msg("idemd's schema: %s", why);
  assert_int_equal(number(db, "SELECT version FROM idemd_schema"), IDEMD_SCHEMA_VERSION);

  old_check_kept(store, &d);
  for (int i = 0; i < OLD_N; i++) {
    char q[160];
    snprintf(q, sizeof q, "SELECT rowid FROM idempotency_records WHERE key = '%s'",
             old_keys[i]);
    assert_int_equal(number(db, q), rowids[i]);
  }
  /* The same table but for the reference, the same indexes (the unique
   * constraint's among them), nothing left of the copy. */
  after = text(db, "SELECT sql FROM sqlite_schema WHERE name = 'idempotency_records'");
  assert_string_equal(after, without(table, " REFERENCES tenants (id)"));
  free(after);
  after = text(db, "SELECT group_concat(sql, '; ') FROM (SELECT sql FROM sqlite_schema "
                   "WHERE type = 'index' AND tbl_name = 'idempotency_records' "
                   "ORDER BY name)");
  assert_string_equal(after, indexes);
  free(after);
  assert_int_equal(number(db, "SELECT count(*) FROM sqlite_schema WHERE type = 'index' "
                              "AND tbl_name = 'idempotency_records' AND name LIKE "
                              "'sqlite_autoindex_%'"),
                   1);
  assert_int_equal(number(db, "SELECT count(*) FROM sqlite_schema WHERE name LIKE "
                              "'%_v4%'"),
                   0);
  /* References: records to nothing, resources to tenants, outbox to
   * resources; the views still read the resources. */
  assert_int_equal(number(db, "SELECT count(*) FROM pragma_foreign_key_list("
                              "'idempotency_records')"),
                   0);
  assert_int_equal(number(db, "SELECT count(*) FROM pragma_foreign_key_list('resources') "
                              "WHERE \"table\" = 'tenants'"),
                   1);
  assert_int_equal(number(db, "SELECT count(DISTINCT id) FROM pragma_foreign_key_list("
                              "'outbox') WHERE \"table\" = 'resources'"),
                   1);
  /* idemd's version 3: a resource's id is its tenant's, and the outbox
   * names a resource by both. */
  {
    char *key = text(db, "SELECT group_concat(name, ',') FROM (SELECT name FROM "
                         "pragma_table_info('resources') WHERE pk > 0 ORDER BY pk)");
    char *ref = text(db, "SELECT group_concat(\"from\" || '>' || \"to\", ',') FROM (SELECT "
                         "* FROM pragma_foreign_key_list('outbox') ORDER BY seq)");
    assert_string_equal(key, "tenant_id,id");
    assert_string_equal(ref, "tenant_id>tenant_id,resource_id>id");
    free(key);
    free(ref);
  }
  assert_int_equal(number(db, "SELECT count(*) FROM pragma_foreign_key_check"), 0);
  assert_int_equal(number(db, "SELECT count(*) FROM pragma_integrity_check WHERE "
                              "integrity_check <> 'ok'"),
                   0);
  assert_int_equal(number(db, "SELECT amount FROM payments WHERE id = 'pay_3'"), 1003);
  /* idemd's version 4: no refund has taken anything of a payment yet. */
  assert_int_equal(number(db, "SELECT refund_taken + refunded FROM resources WHERE id = "
                              "'pay_3'"),
                   0);
  assert_int_equal(number(db, "SELECT total FROM orders WHERE id = 'ord_4'"), 1004);
  for (size_t i = 0; i < ARRAY_LEN(unsettled_queries); i++) {
    char plan[512];
    query_plan(db, unsettled_queries[i], plan, sizeof plan);
    if (strstr(plan, "records_unsettled") == NULL)
      fail_msg("%s: plan %s", unsettled_queries[i], plan);
  }

  old_check_usable(store, &d);
  /* The key of a tenant with no row made none. */
  assert_int_equal(number(db, "SELECT count(*) FROM tenants"), 1);
  assert_int_equal(number(db, "SELECT count(*) FROM idempotency_records WHERE "
                              "tenant_id NOT IN (SELECT id FROM tenants)"),
                   1);

  free(table);
  free(indexes);
  old_free(&d);
  sqlite3_close(db);
  idem_store_close(store);
}

/* An operator's own view or index on the tables version 3 rebuilds stops
 * the migration before anything changes, naming them; once they are
 * dropped it goes through. */
static void test_version_3_refuses_foreign_objects(void **state) {
  struct fixture *fx = *state;
  idem_store_t *store;
  sqlite3 *db;

  assert_int_equal(idem_store_open(fx->path, NULL, &store), IDEM_OK);
  assert_int_equal(idem__sqlite_migrate_to(store, 2), IDEM_OK);
  assert_int_equal(sqlite3_open(fx->path, &db), SQLITE_OK);
  sql(db, "INSERT INTO tenants (id, name, key_lookup, key_hash, created_at) "
          "VALUES (1, 'acme', 'lookup', x'00', 1);"
          "CREATE VIEW my_open AS SELECT key FROM idempotency_records "
          "WHERE state = 'pending';"
          "CREATE INDEX my_by_kind ON resources (kind);"
          "CREATE INDEX my_tenant_names ON tenants (created_at);");

  assert_int_equal(idem_store_migrate(store), IDEM_ESCHEMA);
  assert_contains(idem_store_last_error(), "view my_open");
  assert_contains(idem_store_last_error(), "index my_by_kind");
  /* An index on a table version 3 leaves alone is not in the way. */
  assert_null(strstr(idem_store_last_error(), "my_tenant_names"));
  assert_int_equal(number(db, "PRAGMA user_version"), 2);
  assert_int_equal(number(db, "SELECT count(*) FROM tenants"), 1);

  sql(db, "DROP VIEW my_open; DROP INDEX my_by_kind;");
  assert_int_equal(idem_store_migrate(store), IDEM_OK);
  assert_int_equal(number(db, "PRAGMA user_version"), CURRENT_VERSION);
  assert_int_equal(number(db, "SELECT count(*) FROM sqlite_schema WHERE name = "
                              "'my_tenant_names'"),
                   1);
  sqlite3_close(db);
  idem_store_close(store);
}

/* Version 4 rebuilds the records alone: an operator's index or trigger on
 * them, and a view or trigger elsewhere that names them, stop it before
 * anything changes, by name; an index on a table it leaves alone does not.
 * Once they are dropped it goes through. */
static void test_version_4_refuses_foreign_objects(void **state) {
  struct fixture *fx = *state;
  idem_store_t *store;
  sqlite3 *db;

  assert_int_equal(idem_store_open(fx->path, NULL, &store), IDEM_OK);
  assert_int_equal(idem__sqlite_migrate_to(store, 3), IDEM_OK);
  assert_int_equal(sqlite3_open(fx->path, &db), SQLITE_OK);
  sql(db, "INSERT INTO tenants (id, name, key_lookup, key_hash, created_at) "
          "VALUES (1, 'acme', 'lookup', x'00', 1);"
          "CREATE VIEW my_open AS SELECT key FROM idempotency_records "
          "WHERE state = 'pending';"
          "CREATE INDEX my_by_state ON idempotency_records (state);"
          "CREATE TRIGGER my_stamp AFTER UPDATE ON idempotency_records "
          "BEGIN SELECT 1; END;"
          "CREATE TRIGGER my_cleanup AFTER DELETE ON tenants BEGIN "
          "DELETE FROM idempotency_records WHERE tenant_id = old.id; END;"
          "CREATE INDEX my_by_kind ON resources (kind);");

  assert_int_equal(idem_store_migrate(store), IDEM_ESCHEMA);
  assert_contains(idem_store_last_error(), "schema version 4");
  assert_contains(idem_store_last_error(), "view my_open");
  assert_contains(idem_store_last_error(), "index my_by_state");
  assert_contains(idem_store_last_error(), "trigger my_stamp");
  assert_contains(idem_store_last_error(), "trigger my_cleanup");
  assert_null(strstr(idem_store_last_error(), "my_by_kind"));
  assert_int_equal(number(db, "PRAGMA user_version"), 3);
  assert_int_equal(number(db, "SELECT count(*) FROM pragma_foreign_key_list("
                              "'idempotency_records')"),
                   1);

  sql(db, "DROP VIEW my_open; DROP INDEX my_by_state; DROP TRIGGER my_stamp;"
          "DROP TRIGGER my_cleanup;");
  assert_int_equal(idem_store_migrate(store), IDEM_OK);
  assert_int_equal(number(db, "PRAGMA user_version"), CURRENT_VERSION);
  assert_int_equal(number(db, "SELECT count(*) FROM sqlite_schema WHERE name = "
                              "'my_by_kind'"),
                   1);
  sqlite3_close(db);
  idem_store_close(store);
}

/* Everything about table `name` a program could tell apart: its columns
 * (name, type, NOT NULL, default, key), foreign keys, indexes (unique,
 * origin, columns, condition), whether it has a rowid, and its CHECKs (the
 * text of its CREATE after the column list's opening, quotes taken out).
 * Not its indexes' automatic names, which keep the name of the table a
 * copy was made as. */
static char *table_shape(sqlite3 *db, const char *name) {
  char q[2048], *out;
  snprintf(q, sizeof q,
           "SELECT (SELECT group_concat(name || ' ' || type || ' ' || \"notnull\" || ' ' || "
           "coalesce(dflt_value, '-') || ' ' || pk, ', ') FROM pragma_table_xinfo('%s')) "
           "|| ' | ' || coalesce((SELECT group_concat(\"table\" || '.' || \"to\" || ' ' || "
           "\"from\", ', ') FROM pragma_foreign_key_list('%s')), '') "
           "|| ' | ' || coalesce((SELECT group_concat(l.\"unique\" || ' ' || l.origin || ' ' "
           "|| l.partial || ' ' || (SELECT group_concat(i.name, ',') FROM "
           "pragma_index_info(l.name) AS i) || ' ' || coalesce((SELECT sql FROM "
           "sqlite_schema WHERE type = 'index' AND name = l.name), '-'), '; ') FROM "
           "(SELECT * FROM pragma_index_list('%s') ORDER BY origin, name) AS l), '') "
           "|| ' | ' || (SELECT wr FROM pragma_table_list('%s')) "
           "|| ' | ' || substr((SELECT sql FROM sqlite_schema WHERE type = 'table' AND "
           "name = '%s'), instr((SELECT sql FROM sqlite_schema WHERE type = 'table' AND "
           "name = '%s'), '('))",
           name, name, name, name, name, name);
  out = text(db, q);
  /* A RENAME quotes the names it rewrites: "resources" is resources. */
  for (char *r = out, *w = out;; r++)
    if (*r != '"' && (*w++ = *r) == '\0')
      break;
  return out;
}

/* A new database is made at the latest version at once; libidem's part
 * holds only meta and the records, idemd's part is made by idemd, and
 * together they are, table by table, what a database made by the first
 * version and migrated through every one holds. */
static void test_fresh_is_what_migrations_leave(void **state) {
  static const char *const libidem_tables[] = {"meta", "idempotency_records"};
  static const char *const idemd_tables[] = {"tenants", "api_keys", "resources", "outbox"};
  struct fixture *fx = *state;
  char old_path[320];
  idem_store_t *store, *old;
  sqlite3 *db, *old_db;

  snprintf(old_path, sizeof old_path, "%s/old.db", fx->dir);
  assert_int_equal(idem_store_open(fx->path, NULL, &store), IDEM_OK);
  assert_int_equal(idem_store_migrate(store), IDEM_OK);
  assert_int_equal(sqlite3_open(fx->path, &db), SQLITE_OK);
  assert_int_equal(number(db, "PRAGMA user_version"), CURRENT_VERSION);
  assert_int_equal(number(db, "SELECT count(*) FROM sqlite_schema WHERE name IN "
                              "('tenants', 'resources', 'outbox', 'payments', 'orders', "
                              "'idemd_schema')"),
                   0);
  assert_int_equal(number(db, "SELECT count(*) FROM sqlite_schema WHERE type = 'table'"),
                   2);
  assert_int_equal(idemd_schema_migrate(store, NULL, 0), IDEM_OK);
  assert_int_equal(idemd_schema_migrate(store, NULL, 0), IDEM_OK);
  assert_int_equal(number(db, "SELECT version FROM idemd_schema"), IDEMD_SCHEMA_VERSION);

  assert_int_equal(idem_store_open(old_path, NULL, &old), IDEM_OK);
  assert_int_equal(idem__sqlite_migrate_to(old, 1), IDEM_OK);
  assert_int_equal(idem_store_migrate(old), IDEM_OK);
  assert_int_equal(idemd_schema_migrate(old, NULL, 0), IDEM_OK);
  assert_int_equal(sqlite3_open(old_path, &old_db), SQLITE_OK);
  assert_int_equal(number(old_db, "PRAGMA user_version"), CURRENT_VERSION);

  for (int part = 0; part < 2; part++) {
    const char *const *tables = part ? idemd_tables : libidem_tables;
    size_t n = part ? ARRAY_LEN(idemd_tables) : ARRAY_LEN(libidem_tables);
    for (size_t i = 0; i < n; i++) {
      char *made = table_shape(db, tables[i]), *migrated = table_shape(old_db, tables[i]);
      if (strcmp(made, migrated) != 0)
        fail_msg("%s made new:\n%s\nmigrated:\n%s", tables[i], made, migrated);
      free(made);
      free(migrated);
    }
  }
  /* The same views, and nothing else of idem's. */
  {
    static const char objects[] =
        "SELECT group_concat(type || ' ' || name || ' ' || coalesce(sql, ''), '; ') FROM "
        "(SELECT * FROM sqlite_schema WHERE type IN ('view', 'trigger') OR (type = 'table' "
        "AND name NOT LIKE 'sqlite_%') ORDER BY type, name)";
    char *made = text(db, objects), *migrated = text(old_db, objects);
    char *made_names = text(db, "SELECT group_concat(name, ' ') FROM (SELECT name FROM "
                                "sqlite_schema WHERE name NOT LIKE 'sqlite_%' ORDER BY name)");
    char *migrated_names =
        text(old_db, "SELECT group_concat(name, ' ') FROM (SELECT name FROM sqlite_schema "
                     "WHERE name NOT LIKE 'sqlite_%' ORDER BY name)");
    assert_string_equal(made_names, migrated_names);
    assert_contains(made, "view payments");
    assert_contains(made, "view orders");
    free(made);
    free(migrated);
    free(made_names);
    free(migrated_names);
  }
  sqlite3_close(old_db);
  idem_store_close(old);
  remove_sqlite_files(old_path);
  sqlite3_close(db);
  idem_store_close(store);
}

/* idemd's version 3 makes resources and outbox again: an operator's index
 * or trigger on them, or a view that names them, stops it before anything
 * changes, by name; once they are dropped it goes through, rows kept. */
static void test_idemd_v3_refuses_foreign_objects(void **state) {
  struct fixture *fx = *state;
  idem_store_t *store;
  sqlite3 *db;
  char why[512];

  /* libidem's version 4 made idemd's tables as idemd's version 1 has them. */
  assert_int_equal(idem_store_open(fx->path, NULL, &store), IDEM_OK);
  assert_int_equal(idem__sqlite_migrate_to(store, 4), IDEM_OK);
  assert_int_equal(idem_store_migrate(store), IDEM_OK);
  assert_int_equal(sqlite3_open(fx->path, &db), SQLITE_OK);
  sql(db, "INSERT INTO tenants (id, name, key_lookup, key_hash, created_at) "
          "VALUES (1, 'acme', 'lookup', x'00', 1);"
          "INSERT INTO resources (id, tenant_id, kind, status, body, provider_ref, "
          "created_at, updated_at) VALUES ('ord_1', 1, 'order', 'created', '{}', NULL, 1, 1);"
          "INSERT INTO resources (id, tenant_id, kind, status, body, provider_ref, "
          "created_at, updated_at) VALUES ('pay_1', 1, 'payment', 'succeeded', "
          "'{\"id\":\"pay_1\",\"amount\":500,\"currency\":\"BRL\",\"order_id\":\"a,\\\"currency\\\":\","
          "\"status\":\"succeeded\",\"created_at\":\"t\"}', 'ch_1', 1, 1);"
          "CREATE VIEW my_orders AS SELECT id FROM resources;"
          "CREATE INDEX my_by_kind ON resources (kind);"
          "CREATE TRIGGER my_stamp AFTER INSERT ON outbox BEGIN SELECT 1; END;"
          "CREATE INDEX my_record_times ON idempotency_records (created_at);");
  assert_int_equal(idemd_schema_migrate(store, why, sizeof why), IDEM_ESCHEMA);
  assert_contains(why, "view my_orders");
  assert_contains(why, "index my_by_kind");
  assert_contains(why, "trigger my_stamp");
  if (strstr(why, "my_record_times") != NULL)
    fail_msg("an index on the records was named: %s", why);
  assert_int_equal(number(db, "SELECT count(*) FROM sqlite_schema WHERE name = "
                              "'idemd_schema'"),
                   0);
  assert_int_equal(number(db, "SELECT count(*) FROM pragma_table_info('resources') "
                              "WHERE pk > 0"),
                   1);

  sql(db, "DROP VIEW my_orders; DROP INDEX my_by_kind; DROP TRIGGER my_stamp;");
  assert_int_equal(idemd_schema_migrate(store, why, sizeof why), IDEM_OK);
  assert_int_equal(number(db, "SELECT version FROM idemd_schema"), IDEMD_SCHEMA_VERSION);
  assert_int_equal(number(db, "SELECT count(*) FROM orders WHERE id = 'ord_1' AND "
                              "tenant_id = 1"),
                   1);
  /* Version 4: nothing is taken of the payment yet, and its text is
   * left as it was. */
  assert_int_equal(number(db, "SELECT refund_taken FROM resources WHERE id = 'pay_1'"), 0);
  {
    char *body = text(db, "SELECT body FROM resources WHERE id = 'pay_1'");
    assert_string_equal(body, "{\"id\":\"pay_1\",\"amount\":500,"
                              "\"currency\":\"BRL\",\"order_id\":\"a,\\\"currency\\\":\","
                              "\"status\":\"succeeded\",\"created_at\":\"t\"}");
    free(body);
  }
  assert_int_equal(number(db, "SELECT count(*) FROM sqlite_schema WHERE name = "
                              "'my_record_times'"),
                   1);
  sqlite3_close(db);
  idem_store_close(store);
}

/* idemd's schema at a version newer than this program's is refused, and
 * nothing is changed. */
static void test_newer_idemd_schema_refused(void **state) {
  struct fixture *fx = *state;
  idem_store_t *store;
  sqlite3 *db;
  char why[256];

  assert_int_equal(idem_store_open(fx->path, NULL, &store), IDEM_OK);
  assert_int_equal(idem_store_migrate(store), IDEM_OK);
  assert_int_equal(sqlite3_open(fx->path, &db), SQLITE_OK);
  sql(db, "CREATE TABLE idemd_schema (version INTEGER NOT NULL);"
          "INSERT INTO idemd_schema VALUES (99);");
  assert_int_equal(idemd_schema_migrate(store, why, sizeof why), IDEM_ESCHEMA);
  assert_contains(why, "99");
  assert_int_equal(number(db, "SELECT count(*) FROM sqlite_schema WHERE name = 'tenants'"),
                   0);
  sqlite3_close(db);
  idem_store_close(store);
}

/* idemd's version 2 makes tenants again: an operator's index or trigger
 * on it, or a view that names it, stops the migration before anything
 * changes, by name; once they are dropped it goes through, and every
 * tenant's key is its key named "default". */
static void test_idemd_v2_refuses_foreign_objects(void **state) {
  struct fixture *fx = *state;
  idem_store_t *store;
  sqlite3 *db;
  char why[512];

  assert_int_equal(idem_store_open(fx->path, NULL, &store), IDEM_OK);
  assert_int_equal(idem__sqlite_migrate_to(store, 4), IDEM_OK);
  assert_int_equal(sqlite3_open(fx->path, &db), SQLITE_OK);
  sql(db, "INSERT INTO tenants (id, name, key_lookup, key_hash, created_at) "
          "VALUES (1, 'acme', 'lookup', x'00', 1);"
          "INSERT INTO resources (id, tenant_id, kind, status, body, created_at, updated_at) "
          "VALUES ('ord_1', 1, 'order', 'created', '{}', 1, 1);"
          "CREATE VIEW my_tenants AS SELECT name FROM tenants;"
          "CREATE INDEX my_by_created ON tenants (created_at);"
          "CREATE TABLE my_notes (kind TEXT);"
          "CREATE INDEX my_by_kind ON my_notes (kind);");
  assert_int_equal(idem_store_migrate(store), IDEM_OK);

  assert_int_equal(idemd_schema_migrate(store, why, sizeof why), IDEM_ESCHEMA);
  assert_contains(why, "view my_tenants");
  assert_contains(why, "index my_by_created");
  assert_null(strstr(why, "my_by_kind"));
  assert_int_equal(number(db, "SELECT count(*) FROM sqlite_schema WHERE name = 'api_keys'"),
                   0);
  assert_int_equal(number(db, "SELECT count(*) FROM pragma_table_info('tenants') WHERE "
                              "name = 'key_lookup'"),
                   1);

  sql(db, "DROP VIEW my_tenants; DROP INDEX my_by_created;");
  if (idemd_schema_migrate(store, why, sizeof why) != IDEM_OK)
    fail_msg("idemd's schema: %s", why);
  assert_int_equal(number(db, "SELECT count(*) FROM pragma_table_info('tenants') WHERE "
                              "name = 'key_lookup'"),
                   0);
  assert_int_equal(number(db, "SELECT count(*) FROM api_keys WHERE tenant_id = 1 AND "
                              "name = 'default' AND key_lookup = 'lookup' AND key_hash = x'00'"),
                   1);
  assert_int_equal(number(db, "SELECT count(*) FROM pragma_foreign_key_check"), 0);
  assert_int_equal(number(db, "SELECT count(*) FROM sqlite_schema WHERE name = 'my_by_kind'"),
                   1);
  /* The resources' reference still holds: a row of no tenant is refused. */
  assert_int_not_equal(sqlite3_exec(db,
                                    "PRAGMA foreign_keys = ON; INSERT INTO resources (id, "
                                    "tenant_id, kind, status, body, created_at, updated_at) "
                                    "VALUES ('ord_2', 2, 'order', 'created', '{}', 1, 1)",
                                    NULL, NULL, NULL),
                       SQLITE_OK);
  sqlite3_close(db);
  idem_store_close(store);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_from_version_2, setup, teardown),
      cmocka_unit_test_setup_teardown(test_version_3_refuses_foreign_objects, setup,
                                      teardown),
      cmocka_unit_test_setup_teardown(test_from_released_version, setup, teardown),
      cmocka_unit_test_setup_teardown(test_version_4_refuses_foreign_objects, setup,
                                      teardown),
      cmocka_unit_test_setup_teardown(test_fresh_is_what_migrations_leave, setup, teardown),
      cmocka_unit_test_setup_teardown(test_idemd_v3_refuses_foreign_objects, setup,
                                      teardown),
      cmocka_unit_test_setup_teardown(test_newer_idemd_schema_refused, setup, teardown),
      cmocka_unit_test_setup_teardown(test_idemd_v2_refuses_foreign_objects, setup,
                                      teardown),
  };
  return cmocka_run_group_tests_name("sqlite schema migrations", tests, NULL, NULL);
}
