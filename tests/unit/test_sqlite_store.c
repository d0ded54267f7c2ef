/* What only the SQLite store does, seen through the database file: the row
 * a reservation returns (idem_record_t.row) is the record's rowid; a
 * completion whose statement fails says so, whether it found the record
 * by that row or by its key; and idem's VFS, which holds WAL writes until
 * the sync, never lets a reader see less than what was committed; and a
 * committed batch tells the callers that answer a request first. The
 * store suite (test_store.c) covers the public behaviour on every
 * backend. */
#include "support.h"

#include <errno.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "idem/clock.h"
#include "idem/crypto.h"
#include "idem/store.h"

struct fixture {
  char dir[256], path[300];
  idem_store_t *store;
  sqlite3 *db; /* the same file, for what the interface does not show */
  int64_t tenant_id; /* the scopes' */
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
  fx->tenant_id = 7;
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

/* The integrity check's verdict: 0 when the file is sound. */
static long long broken(sqlite3 *db) {
  return number(db, "SELECT count(*) FROM pragma_integrity_check "
                    "WHERE integrity_check <> 'ok' AND ?1 IS NULL",
                NULL);
}

/* Reserves `key`, which must be new; `rec` gets the record. */
static void reserve_new(struct fixture *fx, const char *key, idem_record_t *rec) {
  idem_reserve_t req = {.scope = {fx->tenant_id, "create_payment", key},
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
    /* Nothing else was inserted on the connection, so every row is known
     * (a record whose rowid equals the connection's previous insert's is
     * returned as 0: see reserve_tx). */
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
  c.scope = (idem_scope_t){fx->tenant_id, "create_payment", "key-1"};
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

/* Runs `sql` on `db`; fails the test on an error. */
static void exec_ok(sqlite3 *db, const char *sql) {
  char *err = NULL;
  if (sqlite3_exec(db, sql, NULL, NULL, &err) != SQLITE_OK)
    fail_msg("%s: %s", sql, err ? err : "?");
}

/* Opens `path` through the VFS the store registered (IDEM_SQLITE_VFS in
 * src/store/sqlite_vfs.h), or through the default one. */
static sqlite3 *open_with(const char *path, const char *vfs) {
  sqlite3 *db = NULL;
  assert_int_equal(sqlite3_open_v2(path, &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE,
                                   vfs),
                   SQLITE_OK);
  exec_ok(db, "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL");
  return db;
}

/* idem's VFS holds a commit's WAL writes until SQLite syncs the WAL. A
 * connection of the default VFS, reading the file through its own handle,
 * must see every commit whole right after it: with the writes held past
 * the sync, its WAL index would point at frames not in the file yet. The
 * commits vary from one frame to over 124 KiB (written in pieces), and
 * together pass the checkpoint threshold a few times, so the WAL is
 * checkpointed and written again from its start. The store commits with
 * synchronous=FULL; under NORMAL, which publishes commits without a sync,
 * the VFS gathers nothing, and must be as safe. */
static void test_vfs_commits_reach_the_file(void **state) {
  static const char *const sync_modes[] = {"PRAGMA synchronous = FULL",
                                           "PRAGMA synchronous = NORMAL"};
  struct fixture *fx = *state;

  assert_non_null(sqlite3_vfs_find("idem-gather")); /* the store registered it */
  for (size_t m = 0; m < ARRAY_LEN(sync_modes); m++) {
    char path[320];
    sqlite3 *w, *r;
    long long rows = 0, bytes = 0;

    snprintf(path, sizeof path, "%s/gather-%zu.db", fx->dir, m);
    w = open_with(path, "idem-gather");
    r = open_with(path, NULL);
    exec_ok(w, sync_modes[m]);
    exec_ok(w, "CREATE TABLE t (id INTEGER PRIMARY KEY, b BLOB NOT NULL)");
    for (int i = 0; i < 300; i++) {
      int n = i % 10 == 0 ? 80 : 1 + i % 7, size = 300 + (i * 37) % 3000;
      char sql[160];

      exec_ok(w, "BEGIN");
      snprintf(sql, sizeof sql, "INSERT INTO t (b) VALUES (randomblob(%d))", size);
      for (int k = 0; k < n; k++)
        exec_ok(w, sql);
      exec_ok(w, "COMMIT");
      rows += n;
      bytes += (long long)n * size;
      assert_int_equal(number(r, "SELECT count(*) FROM t WHERE ?1 IS NULL", NULL), rows);
      assert_int_equal(number(r, "SELECT sum(length(b)) FROM t WHERE ?1 IS NULL", NULL),
                       bytes);
    }
    assert_int_equal(broken(r), 0);
    sqlite3_close(r);
    sqlite3_close(w);
    remove_sqlite_files(path);
  }
}

/* A transaction larger than its connection's page cache spills pages to
 * the WAL before it commits, and reads them back from there: through
 * idem's VFS the read must see the writes still held. */
static void test_vfs_reads_its_own_writes(void **state) {
  struct fixture *fx = *state;
  char path[320];
  sqlite3 *w, *r;

  snprintf(path, sizeof path, "%s/spill.db", fx->dir);
  w = open_with(path, "idem-gather");
  exec_ok(w, "PRAGMA cache_size = 10; CREATE TABLE t (id INTEGER PRIMARY KEY, b BLOB NOT NULL)");
  exec_ok(w, "BEGIN");
  for (int i = 0; i < 400; i++)
    exec_ok(w, "INSERT INTO t (b) VALUES (zeroblob(1500))");
  assert_int_equal(number(w, "SELECT count(*) FROM t WHERE length(b) = 1500 AND ?1 IS NULL",
                          NULL),
                   400);
  exec_ok(w, "COMMIT");
  r = open_with(path, NULL);
  assert_int_equal(number(r, "SELECT count(*) FROM t WHERE length(b) = 1500 AND ?1 IS NULL",
                          NULL),
                   400);
  sqlite3_close(r);
  sqlite3_close(w);
  remove_sqlite_files(path);
}

/* A rolled-back transaction's frames may still be held by idem's VFS when
 * its connection gives up its locks. Another connection (another
 * process, in production) then commits frames at the same offsets: the
 * held ones must reach the file before that, as the default VFS's would,
 * not be written over those later. Once with the WAL's write lock in
 * shared memory, once in exclusive locking mode, left inside the
 * transaction (its locks then go at the rollback). */
static void test_vfs_drops_rolled_back_writes(void **state) {
  static const char *const modes[] = {"PRAGMA locking_mode = NORMAL",
                                      "PRAGMA locking_mode = EXCLUSIVE"};
  struct fixture *fx = *state;

  for (size_t m = 0; m < ARRAY_LEN(modes); m++) {
    char path[320];
    sqlite3 *a, *b, *c;

    snprintf(path, sizeof path, "%s/rollback-%zu.db", fx->dir, m);
    a = open_with(path, "idem-gather");
    exec_ok(a, "CREATE TABLE t (id INTEGER PRIMARY KEY, tag TEXT NOT NULL, b BLOB NOT NULL);"
               "PRAGMA cache_size = 10; PRAGMA wal_checkpoint(TRUNCATE)");
    exec_ok(a, modes[m]);
    exec_ok(a, "BEGIN");
    for (int i = 0; i < 200; i++) /* spills pages into the WAL, held */
      exec_ok(a, "INSERT INTO t (tag, b) VALUES ('rolled back', randomblob(1500))");
    exec_ok(a, "PRAGMA locking_mode = NORMAL");
    exec_ok(a, "ROLLBACK");
    b = open_with(path, NULL); /* only now: it would stop `a`'s exclusive lock */
    exec_ok(b, "BEGIN");
    for (int i = 0; i < 300; i++)
      exec_ok(b, "INSERT INTO t (tag, b) VALUES ('committed', randomblob(1500))");
    exec_ok(b, "COMMIT");
    /* `a` reads: anything it still held would reach the file now. */
    assert_int_equal(number(a, "SELECT count(*) FROM t WHERE tag = ?1", "committed"), 300);
    sqlite3_close(a);
    c = open_with(path, NULL);
    assert_int_equal(number(c, "SELECT count(*) FROM t WHERE tag = ?1", "committed"), 300);
    assert_int_equal(number(c, "SELECT count(*) FROM t WHERE tag = ?1", "rolled back"), 0);
    assert_int_equal(broken(c), 0);
    sqlite3_close(c);
    sqlite3_close(b);
    remove_sqlite_files(path);
  }
}

/* The unix VFS's writes, watched from intercept_writes() until
 * release_writes(): failed (a full disk) while `writes_fail`, and
 * counted in `writes_seen`. */
static int writes_fail, writes_seen;
static off_t writes_limit; /* > 0: writes that reach past it fail too */
static sqlite3_syscall_ptr real_pwrite, real_pwrite64;

typedef ssize_t (*pwrite_fn)(int, const void *, size_t, off_t);

static ssize_t watched(pwrite_fn real, int fd, const void *p, size_t n, off_t at) {
  writes_seen++;
  if (writes_fail || (writes_limit > 0 && at + (off_t)n > writes_limit)) {
    errno = ENOSPC;
    return -1;
  }
  return real(fd, p, n, at);
}

static ssize_t watched_pwrite(int fd, const void *p, size_t n, off_t at) {
  return watched((pwrite_fn)real_pwrite, fd, p, n, at);
}

static ssize_t watched_pwrite64(int fd, const void *p, size_t n, off_t at) {
  return watched((pwrite_fn)real_pwrite64, fd, p, n, at);
}

static void intercept_writes(int fail) {
  sqlite3_vfs *unix_vfs = sqlite3_vfs_find("unix");

  assert_non_null(unix_vfs);
  real_pwrite = unix_vfs->xGetSystemCall(unix_vfs, "pwrite");
  real_pwrite64 = unix_vfs->xGetSystemCall(unix_vfs, "pwrite64");
  assert_int_equal(unix_vfs->xSetSystemCall(unix_vfs, "pwrite", (sqlite3_syscall_ptr)watched_pwrite),
                   SQLITE_OK);
  assert_int_equal(unix_vfs->xSetSystemCall(unix_vfs, "pwrite64",
                                            (sqlite3_syscall_ptr)watched_pwrite64),
                   SQLITE_OK);
  writes_fail = fail;
  writes_seen = 0;
}

static void release_writes(void) {
  sqlite3_vfs *unix_vfs = sqlite3_vfs_find("unix");

  writes_fail = 0;
  writes_limit = 0;
  unix_vfs->xSetSystemCall(unix_vfs, "pwrite", NULL);
  unix_vfs->xSetSystemCall(unix_vfs, "pwrite64", NULL);
}

/* Held WAL bytes whose write fails (a full disk, for a moment) fail the
 * read that tried to write them; SQLite undoes that statement only, and
 * the transaction goes on. Its commit must then write those bytes, or
 * fail: committing without them would corrupt the file. */
static void test_vfs_failed_write_is_not_lost(void **state) {
  struct fixture *fx = *state;
  char path[320];
  sqlite3 *w, *r;
  int rc;

  snprintf(path, sizeof path, "%s/full.db", fx->dir);
  w = open_with(path, "idem-gather");
  exec_ok(w, "CREATE TABLE t (id INTEGER PRIMARY KEY, b BLOB NOT NULL);"
             "CREATE TABLE u (id INTEGER PRIMARY KEY, v TEXT UNIQUE);"
             "PRAGMA cache_size = 10; BEGIN");
  for (int i = 0; i < 300; i++) /* spills pages into the WAL, held */
    exec_ok(w, "INSERT INTO t (b) VALUES (randomblob(1500))");
  intercept_writes(1);
  /* Reads the spilled pages back: the held bytes must be written first. */
  rc = sqlite3_exec(w, "INSERT INTO u (v) SELECT hex(b) FROM t", NULL, NULL, NULL);
  release_writes();
  assert_int_not_equal(rc, SQLITE_OK);
  if (!sqlite3_get_autocommit(w)) { /* the transaction lives on */
    exec_ok(w, "INSERT INTO t (b) VALUES (randomblob(100))");
    if (sqlite3_exec(w, "COMMIT", NULL, NULL, NULL) != SQLITE_OK)
      exec_ok(w, "ROLLBACK");
  }
  r = open_with(path, NULL);
  assert_int_equal(broken(r), 0);
  rc = (int)number(r, "SELECT count(*) FROM t WHERE ?1 IS NULL", NULL);
  if (rc != 0 && rc != 301)
    fail_msg("%d rows: the commit kept part of its transaction", rc);
  sqlite3_close(r);
  sqlite3_close(w);
  remove_sqlite_files(path);
}

/* Without powersafe overwrite (a "psow=0" URI) SQLite pads a commit to a
 * sector boundary: it syncs the WAL in the middle of the commit's last
 * frame, writes the rest of that frame, and then publishes the commit.
 * That last write must reach the file before the commit returns, and its
 * failure fail the commit. Held until the write lock was given up (as
 * once), its failure was dropped after the commit had returned OK: the
 * row read back as NULL, and a checkpoint then corrupted the database. */
static void test_vfs_write_after_sync(void **state) {
  struct fixture *fx = *state;
  char path[320], uri[400];
  sqlite3 *w, *r;
  int rc;

  snprintf(path, sizeof path, "%s/psow.db", fx->dir);
  snprintf(uri, sizeof uri, "file:%s?psow=0", path);
  w = open_with(uri, "idem-gather");
  exec_ok(w, "CREATE TABLE t (x TEXT NOT NULL); PRAGMA wal_checkpoint(TRUNCATE)");
  /* The WAL starts again: its header and one frame end at 4,152 bytes; the
   * commit syncs at 8,192, in its padding frame, and writes on to 8,272. */
  intercept_writes(0);
  writes_limit = 8192;
  rc = sqlite3_exec(w, "INSERT INTO t VALUES ('committed')", NULL, NULL, NULL);
  release_writes();
  r = open_with(path, NULL);
  assert_int_equal(broken(r), 0);
  assert_int_equal(number(r, "SELECT count(*) FROM t WHERE x = 'committed'", NULL),
                   rc == SQLITE_OK ? 1 : 0);
  sqlite3_close(r);
  if (rc == SQLITE_OK)
    fail_msg("the commit succeeded although its last write failed");
  exec_ok(w, "INSERT INTO t VALUES ('after'); PRAGMA wal_checkpoint(TRUNCATE)");
  r = open_with(path, NULL);
  assert_int_equal(broken(r), 0);
  assert_int_equal(number(r, "SELECT count(*) FROM t WHERE x = 'after'", NULL), 1);
  sqlite3_close(r);
  sqlite3_close(w);
  remove_sqlite_files(path);
}

/* A database that cannot be put in WAL mode (here an in-memory one, named
 * by a URI) is refused when opened: SQLite answers such a journal_mode
 * with the mode it kept, and the store would have run in it, its reads
 * then waiting on the writer's locks. */
static void test_wal_or_nothing(void **state) {
  struct fixture *fx = *state;
  char uri[400];
  idem_store_t *store = NULL;

  snprintf(uri, sizeof uri, "file:%s/mem.db?mode=memory&cache=shared", fx->dir);
  assert_int_equal(idem_store_open(uri, NULL, &store), IDEM_ESTORE);
  assert_null(store);
  assert_non_null(strstr(idem_store_last_error(), "not WAL"));
}

/* The write calls of a commit of about 30 pages. */
static int commit_writes(sqlite3 *db) {
  int n;

  exec_ok(db, "BEGIN");
  for (int i = 0; i < 30; i++)
    exec_ok(db, "INSERT INTO t (b) VALUES (randomblob(3000))");
  intercept_writes(0);
  exec_ok(db, "COMMIT");
  n = writes_seen;
  release_writes();
  return n;
}

/* What the VFS is for: with synchronous=FULL, as the store opens its
 * connections, a commit's 30-odd frames reach the WAL in a write or two
 * (the default VFS makes two per frame). Below FULL it gathers nothing
 * (see sqlite_vfs.c). */
static void test_vfs_gathers_a_commit(void **state) {
  struct fixture *fx = *state;
  char path[320];
  sqlite3 *db;
  int n;

  snprintf(path, sizeof path, "%s/count.db", fx->dir);
  db = open_with(path, "idem-gather");
  exec_ok(db, "CREATE TABLE t (id INTEGER PRIMARY KEY, b BLOB NOT NULL)");
  n = commit_writes(db);
  if (n < 1 || n > 3)
    fail_msg("a commit of about 30 frames took %d writes with synchronous=FULL", n);
  exec_ok(db, "PRAGMA synchronous = NORMAL");
  n = commit_writes(db);
  if (n < 30)
    fail_msg("a commit of about 30 frames took %d writes with synchronous=NORMAL", n);
  sqlite3_close(db);
  remove_sqlite_files(path);
}

/* The order in which a batch's callers are told. */
struct told {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  int n;
  const char *names[3];
  int rcs[3];
};

struct teller {
  struct told *told;
  const char *name;
};

static void note_told(void *arg, int rc) {
  struct teller *t = arg;
  pthread_mutex_lock(&t->told->lock);
  t->told->rcs[t->told->n] = rc;
  t->told->names[t->told->n++] = t->name;
  pthread_cond_signal(&t->told->cond);
  pthread_mutex_unlock(&t->told->lock);
}

static int told_at(const struct told *t, const char *name) {
  for (int i = 0; i < t->n; i++)
    if (strcmp(t->names[i], name) == 0)
      return i;
  return -1;
}

/* A committed batch tells first the callers that answer a request (here
 * a completion), then those whose callbacks go on to a provider call (a
 * payment's reservation), whatever their order in the batch. Another
 * connection holds the write lock while the writer is on a first write,
 * so the reservation and then the completion queue up behind it and go
 * into one batch. */
static void test_answers_are_told_first(void **state) {
  struct fixture *fx = *state;
  struct told told = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, {0}, {0}};
  struct teller first = {&told, "first"}, reservation = {&told, "reservation"},
                completion = {&told, "completion"};
  idem_record_t rec = {0}, first_rec = {0}, res_rec = {0};
  idem_reserve_result_t first_result = 0, res_result = 0;
  char token[IDEM_TOKEN_MAX + 1];
  idem_reserve_t first_req = {.scope = {fx->tenant_id, "create_payment", "first"},
                              .fingerprint = "fp", .correlation_id = "req_test",
                              .now_ms = idem_now_ms(), .lease_ms = 30000,
                              .ttl_ms = 86400000};
  idem_reserve_t res_req = first_req;
  idem_complete_t c = {.now_ms = idem_now_ms(), .ttl_ms = 86400000,
                       .outcome = {.state = IDEM_STATE_COMPLETED, .status = 201, .body = "{}"}};
  struct timespec pause = {0, 50 * 1000 * 1000};

  reserve_new(fx, "to-complete", &rec);
  idem_copy(token, sizeof token, rec.owner_token);
  c.scope = (idem_scope_t){fx->tenant_id, "create_payment", "to-complete"};
  c.owner_token = token;
  res_req.scope.key = "reservation";

  exec_ok(fx->db, "BEGIN IMMEDIATE");
  assert_int_equal(idem_store_reserve_async(fx->store, &first_req, &first_rec, &first_result,
                                            note_told, &first),
                   IDEM_OK);
  /* Most often the writer has taken the first write by now and waits on
   * the lock; if not, all three share a batch, which tests the same. */
  nanosleep(&pause, NULL);
  assert_int_equal(idem_store_reserve_async(fx->store, &res_req, &res_rec, &res_result,
                                            note_told, &reservation),
                   IDEM_OK);
  assert_int_equal(idem_store_complete_async(fx->store, &c, note_told, &completion), IDEM_OK);
  exec_ok(fx->db, "COMMIT");

  pthread_mutex_lock(&told.lock);
  while (told.n < 3)
    pthread_cond_wait(&told.cond, &told.lock);
  pthread_mutex_unlock(&told.lock);
  for (int i = 0; i < 3; i++)
    assert_int_equal(told.rcs[i], IDEM_OK);
  assert_int_equal(res_result, IDEM_RESERVE_WON);
  if (told_at(&told, "completion") > told_at(&told, "reservation"))
    fail_msg("the reservation queued before the completion was told first");
  idem_record_reset(&rec);
  idem_record_reset(&first_rec);
  idem_record_reset(&res_rec);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_reservation_returns_its_rowid, setup, teardown),
      cmocka_unit_test_setup_teardown(test_failed_completion_is_reported, setup, teardown),
      cmocka_unit_test_setup_teardown(test_vfs_commits_reach_the_file, setup, teardown),
      cmocka_unit_test_setup_teardown(test_vfs_reads_its_own_writes, setup, teardown),
      cmocka_unit_test_setup_teardown(test_vfs_drops_rolled_back_writes, setup, teardown),
      cmocka_unit_test_setup_teardown(test_vfs_failed_write_is_not_lost, setup, teardown),
      cmocka_unit_test_setup_teardown(test_vfs_write_after_sync, setup, teardown),
      cmocka_unit_test_setup_teardown(test_wal_or_nothing, setup, teardown),
      cmocka_unit_test_setup_teardown(test_vfs_gathers_a_commit, setup, teardown),
      cmocka_unit_test_setup_teardown(test_answers_are_told_first, setup, teardown),
  };
  return cmocka_run_group_tests_name("sqlite store", tests, NULL, NULL);
}
