/* The PostgreSQL schema's migrations on a database that holds data: a
 * database of the schema deployed today, filled through the store, is
 * migrated to the current version with every row kept, and the store
 * works on it. Each test makes a database of its own in the cluster
 * IDEM_TEST_STORE_URL names (scripts/with-pg.sh starts one), and drops it
 * after; without the variable the suite is skipped (exit 77). */
#include "support.h"
#include "upgrade.h"

#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>

#include "store/store_impl.h"
#include "idem/store.h"

/* The schema version this program migrates to, and the one the current
 * release deployed. */
#define CURRENT_VERSION 4
#define RELEASED_VERSION 2

struct fixture {
  char name[40];  /* the database made for the test */
  char url[1024]; /* IDEM_TEST_STORE_URL, naming that database */
  PGconn *admin;  /* to the variable's own database, to make and drop it */
  PGconn *db;     /* to the test's database */
};

/* Runs `sql` on `pg`, which must succeed. */
static void run(PGconn *pg, const char *sql) {
  PGresult *res = PQexec(pg, sql);
  ExecStatusType st = PQresultStatus(res);
  if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK)
    fail_msg("%s: %s", sql, PQresultErrorMessage(res));
  PQclear(res);
}

/* The single value `query` returns, malloc'd ("" for NULL); the caller
 * frees it. */
static char *value(PGconn *pg, const char *query) {
  PGresult *res = PQexec(pg, query);
  char *v;
  if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1)
    fail_msg("%s: %s", query, PQresultErrorMessage(res));
  v = strdup(PQgetvalue(res, 0, 0));
  assert_non_null(v);
  PQclear(res);
  return v;
}

static long long number(PGconn *pg, const char *query) {
  char *v = value(pg, query);
  long long n = strtoll(v, NULL, 10);
  free(v);
  return n;
}

static PGconn *connect_to(const char *url) {
  PGconn *pg = PQconnectdb(url);
  if (PQstatus(pg) != CONNECTION_OK)
    fail_msg("connect: %s", PQerrorMessage(pg));
  return pg;
}

static int setup(void **state) {
  struct fixture *fx = calloc(1, sizeof *fx);
  const char *url = getenv("IDEM_TEST_STORE_URL");
  char token[17], sql[96];

  assert_non_null(fx);
  assert_non_null(url);
  assert_int_equal(idem_random_token(token, 16), IDEM_OK);
  for (char *p = token; *p; p++) /* an unquoted name is folded to lower case */
    if (*p >= 'A' && *p <= 'Z')
      *p = (char)(*p - 'A' + 'a');
  snprintf(fx->name, sizeof fx->name, "idem_upgrade_%s", token);
  fx->admin = connect_to(url);
  snprintf(sql, sizeof sql, "CREATE DATABASE %s", fx->name);
  run(fx->admin, sql);
  /* A later dbname in the query overrides the one in the path. */
  snprintf(fx->url, sizeof fx->url, "%s%cdbname=%s", url, strchr(url, '?') ? '&' : '?',
           fx->name);
  fx->db = connect_to(fx->url);
  *state = fx;
  return 0;
}

static int teardown(void **state) {
  struct fixture *fx = *state;
  char sql[96];

  PQfinish(fx->db);
  snprintf(sql, sizeof sql, "DROP DATABASE %s WITH (FORCE)", fx->name);
  run(fx->admin, sql);
  PQfinish(fx->admin);
  free(fx);
  return 0;
}

/* The constraints of `table` but its foreign keys, and its indexes. */
static char *shape(PGconn *pg, const char *table) {
  char q[512];
  snprintf(q, sizeof q,
           "SELECT (SELECT string_agg(conname || ' ' || pg_get_constraintdef(oid), '; ' "
           "ORDER BY conname) FROM pg_constraint WHERE conrelid = '%s'::regclass AND "
           "contype <> 'f') || ' | ' || (SELECT string_agg(indexdef, '; ' ORDER BY "
           "indexname) FROM pg_indexes WHERE tablename = '%s')",
           table, table);
  return value(pg, q);
}

/* Foreign keys from `table` to `to`. */
static long long references(PGconn *pg, const char *table, const char *to) {
  char q[256];
  snprintf(q, sizeof q,
           "SELECT count(*) FROM pg_constraint WHERE contype = 'f' AND conrelid = "
           "'%s'::regclass AND confrelid = '%s'::regclass",
           table, to);
  return number(pg, q);
}

/* The schema deployed today (version 2) -> current, on a database the
 * current release filled: every record keeps every field, the records
 * keep every constraint and index but the reference to tenants, and
 * afterwards a key of a tenant with no row is reserved and completed,
 * which version 2 refused. */
static void test_from_released_version(void **state) {
  struct fixture *fx = *state;
  idem_store_t *store;
  struct old_data d;
  char *before, *after;

  if (idem_store_open(fx->url, NULL, &store) != IDEM_OK)
    fail_msg("open: %s", idem_store_last_error());
  assert_string_equal(idem_store_backend(store), "postgresql");
  assert_int_equal(idem__postgres_migrate_to(store, RELEASED_VERSION), IDEM_OK);
  assert_int_equal(number(fx->db, "SELECT version FROM idem_schema"), RELEASED_VERSION);
  old_fill(store, &d);
  /* The released schema holds each record to a tenant row. */
  assert_int_not_equal(reserve_tenantless(store, d.tenant.id + 1000, "key-free", d.now),
                       IDEM_OK);
  assert_int_equal(references(fx->db, "idempotency_records", "tenants"), 1);
  before = shape(fx->db, "idempotency_records");
  assert_contains(before, "records_expiry");

  if (idem_store_migrate(store) != IDEM_OK)
    fail_msg("migrate: %s", idem_store_last_error());
  assert_int_equal(number(fx->db, "SELECT version FROM idem_schema"), CURRENT_VERSION);
  assert_int_equal(number(fx->db, "SELECT count(*) FROM idem_schema"), 1);
  /* idemd's tables are there already: its first version leaves them. */
  assert_int_equal(idemd_schema_migrate(store, NULL, 0), IDEM_OK);
  assert_int_equal(number(fx->db, "SELECT version FROM idemd_schema"), IDEMD_SCHEMA_VERSION);

  old_check_kept(store, &d);
  after = shape(fx->db, "idempotency_records");
  assert_string_equal(after, before);
  assert_int_equal(references(fx->db, "idempotency_records", "tenants"), 0);
  assert_int_equal(number(fx->db, "SELECT count(*) FROM pg_constraint WHERE contype = "
                                  "'f' AND conrelid = 'idempotency_records'::regclass"),
                   0);
  assert_int_equal(references(fx->db, "resources", "tenants"), 1);
  assert_int_equal(references(fx->db, "outbox", "resources"), 1);
  /* idemd's version 3: a resource's id is its tenant's, and the outbox
   * names a resource by both. */
  {
    char *key = value(fx->db, "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE "
                              "conname = 'resources_pkey'");
    char *ref = value(fx->db, "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE "
                              "conname = 'outbox_resource_id_fkey'");
    assert_string_equal(key, "PRIMARY KEY (tenant_id, id)");
    assert_string_equal(ref,
                        "FOREIGN KEY (tenant_id, resource_id) REFERENCES resources(tenant_id, id)");
    free(key);
    free(ref);
  }
  assert_int_equal(number(fx->db, "SELECT amount FROM payments WHERE id = 'pay_3'"),
                   1003);
  /* idemd's version 4: no refund has taken anything of a payment yet. */
  assert_int_equal(
      number(fx->db, "SELECT refund_taken + refunded FROM resources WHERE id = 'pay_3'"), 0);
  assert_int_equal(number(fx->db, "SELECT total FROM orders WHERE id = 'ord_4'"), 1004);

  old_check_usable(store, &d);
  assert_int_equal(number(fx->db, "SELECT count(*) FROM tenants"), 1);
  assert_int_equal(number(fx->db, "SELECT count(*) FROM idempotency_records WHERE "
                                  "tenant_id NOT IN (SELECT id FROM tenants)"),
                   1);

  /* Migrating again changes nothing. */
  assert_int_equal(idem_store_migrate(store), IDEM_OK);
  assert_int_equal(number(fx->db, "SELECT version FROM idem_schema"), CURRENT_VERSION);
  free(before);
  free(after);
  old_free(&d);
  idem_store_close(store);
}

int main(void) {
  const char *url = getenv("IDEM_TEST_STORE_URL");
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_from_released_version, setup, teardown),
  };

  if (url == NULL || url[0] == '\0') {
    fprintf(stderr, "IDEM_TEST_STORE_URL is not set: skipped\n");
    return 77;
  }
  return cmocka_run_group_tests_name("postgresql schema migrations", tests, NULL, NULL);
}
