/* What only the SQLite store does, seen through the database file: the row
 * a reservation returns (idem_record_t.row) is the record's rowid, and a
 * completion whose statement fails says so, whether it found the record
 * by that row or by its key. The store suite (test_store.c) covers the
 * public behaviour on every backend. */
#include "support.h"

#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "idem/clock.h"
#include "idem/crypto.h"
#include "idem/store.h"

struct fixture {
  char dir[256], path[300];
  idem_store_t *store;
  sqlite3 *db; /* the same file, for what the interface does not show */
  idem_tenant_t tenant;
};

static int setup(void **state) {
  struct fixture *fx = calloc(1, sizeof *fx);
  const char *tmp = getenv("TMPDIR");

  assert_non_null(fx);
  snprintf(fx->dir, sizeof fx->dir, "%s/idem-sqlite-store-XXXXXX",
           tmp && tmp[0] ? tmp : "/tmp");
  if (mkdtemp(fx->dir) == NULL)
    fail_msg("mkdtemp %s failed", fx->dir);
  snprintf(fx->path, sizeof fx->path, "%s/idem.db", fx->dir);
  assert_int_equal(idem_store_open(fx->path, NULL, &fx->store), IDEM_OK);
  assert_int_equal(idem_store_migrate(fx->store), IDEM_OK);
  snprintf(fx->tenant.name, sizeof fx->tenant.name, "acme");
  assert_int_equal(idem_random_token(fx->tenant.key_lookup, sizeof fx->tenant.key_lookup - 1),
                   IDEM_OK);
  fx->tenant.created_at = idem_now_ms();
  assert_int_equal(idem_store_tenant_create(fx->store, &fx->tenant), IDEM_OK);
  assert_int_equal(sqlite3_open(fx->path, &fx->db), SQLITE_OK);
  *state = fx;
  return 0;
}

static int teardown(void **state) {
  struct fixture *fx = *state;
  sqlite3_close(fx->db);
  idem_store_close(fx->store);
  remove_sqlite_files(fx->path);
  rmdir(fx->dir);
  free(fx);
  return 0;
}

/* The single integer `query` returns, `key` bound to ?1. */
static long long number(sqlite3 *db, const char *query, const char *key) {
  sqlite3_stmt *st;
  long long v;
  assert_int_equal(sqlite3_prepare_v2(db, query, -1, &st, NULL), SQLITE_OK);
  sqlite3_bind_text(st, 1, key, -1, SQLITE_STATIC);
  assert_int_equal(sqlite3_step(st), SQLITE_ROW);
  v = sqlite3_column_int64(st, 0);
  sqlite3_finalize(st);
  return v;
}

/* Reserves `key`, which must be new; `rec` gets the record. */
static void reserve_new(struct fixture *fx, const char *key, idem_record_t *rec) {
  idem_reserve_t req = {.scope = {fx->tenant.id, "create_payment", key},
                        .fingerprint = "fp",
                        .correlation_id = "req_test",
                        .now_ms = idem_now_ms(),
                        .lease_ms = 30000,
                        .ttl_ms = 86400000};
  idem_reserve_result_t result = 0;

  assert_int_equal(idem_store_reserve(fx->store, &req, rec, &result), IDEM_OK);
  assert_int_equal(result, IDEM_RESERVE_WON);
}

static void test_reservation_returns_its_rowid(void **state) {
  struct fixture *fx = *state;
  idem_record_t rec = {0};
  static const char *const keys[] = {"key-1", "key-2", "key-3"};

  for (size_t i = 0; i < ARRAY_LEN(keys); i++) {
    reserve_new(fx, keys[i], &rec);
    /* The first record may share its rowid with the tenant inserted just
     * before it: the store cannot tell that insert from its own, and
     * returns 0 (see reserve_tx). Every later one is known. */
    if (i > 0 || rec.row != 0)
      assert_int_equal(rec.row, number(fx->db, "SELECT rowid FROM idempotency_records "
                                               "WHERE key = ?1",
                                       keys[i]));
    idem_record_reset(&rec);
  }
}

/* A trigger makes the completion's UPDATE fail for one status: the
 * completion reports that failure, by row or by key, and changes nothing;
 * a completion that the trigger lets through then succeeds. */
static void test_failed_completion_is_reported(void **state) {
  static const char body[] = "{\"n\":1}";
  struct fixture *fx = *state;
  idem_record_t rec = {0};
  char token[IDEM_TOKEN_MAX + 1];
  idem_complete_t c = {.now_ms = idem_now_ms(),
                       .ttl_ms = 86400000,
                       .outcome = {.state = IDEM_STATE_COMPLETED, .status = 599, .body = body}};
  int rc;

  assert_int_equal(sqlite3_exec(fx->db,
                                "CREATE TRIGGER refuse_599 BEFORE UPDATE ON "
                                "idempotency_records WHEN NEW.response_status = 599 "
                                "BEGIN SELECT RAISE(ABORT, 'refused'); END",
                                NULL, NULL, NULL),
                   SQLITE_OK);
  reserve_new(fx, "warm-up", &rec); /* so the next one's row is known */
  idem_record_reset(&rec);
  reserve_new(fx, "key-1", &rec);
  assert_true(rec.row > 0);
  idem_copy(token, sizeof token, rec.owner_token);
  c.scope = (idem_scope_t){fx->tenant.id, "create_payment", "key-1"};
  c.owner_token = token;

  for (int by_row = 1; by_row >= 0; by_row--) {
    c.row = by_row ? rec.row : 0;
    rc = idem_store_complete(fx->store, &c);
    if (rc == IDEM_OK || rc == IDEM_ELOST)
      fail_msg("a failed completion (by %s) returned %s", by_row ? "row" : "key",
               idem_err_name(rc));
    assert_int_equal(number(fx->db, "SELECT count(*) FROM idempotency_records WHERE "
                                    "key = ?1 AND state = 'processing' AND "
                                    "response_status IS NULL",
                            "key-1"),
                     1);
  }
  c.outcome.status = 201;
  c.row = rec.row;
  assert_int_equal(idem_store_complete(fx->store, &c), IDEM_OK);
  assert_int_equal(number(fx->db, "SELECT count(*) FROM idempotency_records WHERE "
                                  "key = ?1 AND state = 'completed' AND response_status = 201",
                          "key-1"),
                   1);
  idem_record_reset(&rec);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_reservation_returns_its_rowid, setup, teardown),
      cmocka_unit_test_setup_teardown(test_failed_completion_is_reported, setup, teardown),
  };
  return cmocka_run_group_tests_name("sqlite store", tests, NULL, NULL);
}
