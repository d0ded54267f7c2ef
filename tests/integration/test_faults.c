/* Store faults (docs/hardening.md): with IDEM_FAULT_FILE set, idemd's
 * every store call fails while that file exists, as if the database were
 * unreachable. Then every request that needs the store answers 503 with
 * only "error" and nothing from a library, /healthz is 503, the failures
 * are counted, and nothing is half-written; once the file is gone the same
 * process serves again, and a key first tried during the fault is free. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sqlite3.h>

#include "harness.h"

#define PAYMENT "{\"amount\": 15990, \"currency\": \"BRL\", \"order_id\": \"ord_1\"}"
#define ORDER                                                                            \
  "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":2,"                   \
  "\"unit_price\":1000}],\"currency\":\"BRL\"}"
#define COUNT_RECORDS "SELECT count(*) FROM idempotency_records"
#define COUNT_RESOURCES "SELECT count(*) FROM resources"

static double store_errors(h_server_t *s) {
  static const char name[] = "\nidem_store_errors_total ";
  h_resp_t r;
  const char *p;
  double v;
  h_get(s, "/metrics", NULL, &r);
  h_assert_status(&r, 200);
  p = r.body ? strstr(r.body, name) : NULL;
  if (p == NULL)
    fail_msg("no idem_store_errors_total in /metrics");
  v = strtod(p + sizeof name - 1, NULL);
  h_resp_free(&r);
  return v;
}

/* 503 with only a non-empty "error", no library text, and Retry-After. */
static void assert_unavailable(const h_resp_t *r) {
  h_assert_error(r, 503, NULL);
  if (r->retry_after[0] == '\0')
    fail_msg("503 for a store fault without Retry-After: %.300s", r->body);
}

static void test_store_fault_and_recovery(void **state) {
  const char *tmp = getenv("TMPDIR");
  char dir[256], fault[300], path[128];
  h_server_t *s;
  const char *token;
  h_resp_t first, r;
  double errors0;
  int64_t records0, resources0;
  int replayed;
  pid_t pid;
  int fd;
  (void)state;

  snprintf(dir, sizeof dir, "%s/idem-fault-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
  assert_non_null(mkdtemp(dir));
  snprintf(fault, sizeof fault, "%s/store-down", dir);
  /* idemd inherits the environment (less IDEMD_*): set it for the start. */
  assert_int_equal(setenv("IDEM_FAULT_FILE", fault, 1), 0);
  s = h_server_start(NULL);
  unsetenv("IDEM_FAULT_FILE");
  pid = s->pid;
  token = h_tenant(s, "shop");

  /* Before the fault: one payment, to read and replay during it. */
  h_post(s, "/payments", token, "before", PAYMENT, &first);
  h_assert_first(&first, 201);
  snprintf(path, sizeof path, "/payments/%s", h_id(&first));
  records0 = h_db_int(s, COUNT_RECORDS);
  resources0 = h_db_int(s, COUNT_RESOURCES);
  assert_int_equal(records0, 1);
  errors0 = store_errors(s);

  fd = open(fault, O_WRONLY | O_CREAT | O_EXCL, 0600);
  assert_true(fd >= 0);
  close(fd);

  h_post(s, "/payments", token, "during", PAYMENT, &r);
  assert_unavailable(&r);
  h_resp_free(&r);
  h_post(s, "/orders", token, "during-order", ORDER, &r);
  assert_unavailable(&r);
  h_resp_free(&r);
  /* A replay is answered from memory while its key's tenant and answer
   * are remembered (the key's tenant for at most a second), and needs the
   * store once they are not. Either way, never anything else. */
  h_post(s, "/payments", token, "before", PAYMENT, &r);
  replayed = r.status == 201;
  if (replayed)
    h_assert_replay_of(&r, &first);
  else
    assert_unavailable(&r);
  h_resp_free(&r);
  h_get(s, path, token, &r);
  assert_unavailable(&r);
  h_resp_free(&r);
  h_get(s, "/healthz", NULL, &r);
  h_assert_error(&r, 503, NULL);
  h_resp_free(&r);
  /* Four or five requests failed on the store, and /metrics itself counts. */
  if (store_errors(s) < errors0 + 5 - replayed)
    fail_msg("idem_store_errors_total went from %.0f to %.0f over %d store failures",
             errors0, store_errors(s), 5 - replayed);

  assert_int_equal(unlink(fault), 0);
  assert_int_equal(rmdir(dir), 0);

  /* The same process serves again, and nothing was half-written. */
  h_assert_healthy(s);
  assert_int_equal(s->pid, pid);
  h_assert_db(s, records0, COUNT_RECORDS);
  h_assert_db(s, resources0, COUNT_RESOURCES);
  h_assert_db(s, 0, "SELECT count(*) FROM idempotency_records WHERE key = ?1", "during");
  h_assert_db(s, 0, "SELECT count(*) FROM idempotency_records WHERE key = ?1",
              "during-order");

  /* Keys tried during the fault are still free: fresh answers. */
  h_post(s, "/payments", token, "during", PAYMENT, &r);
  h_assert_first(&r, 201);
  if (strcmp(h_id(&r), h_id(&first)) == 0)
    fail_msg("a new key answered with the earlier payment %s", h_id(&first));
  h_resp_free(&r);
  h_post(s, "/orders", token, "during-order", ORDER, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);
  h_post(s, "/payments", token, "before", PAYMENT, &r);
  h_assert_replay_of(&r, &first);
  h_resp_free(&r);
  h_get(s, path, token, &r);
  h_assert_status(&r, 200);
  h_resp_free(&r);
  h_assert_db(s, records0 + 2, COUNT_RECORDS);
  h_assert_db(s, resources0 + 2, COUNT_RESOURCES);
  h_resp_free(&first);
  h_server_stop(s);
}

/* Polls /readyz (every 50 ms, at most 15 s) until it answers `status`
 * (and, when `want` is not NULL, that error); returns that answer's
 * "error", or "" for a 200 (static storage). */
static const char *await_ready_with(h_server_t *s, long status, const char *want) {
  static char error[128];
  for (int i = 0; i < 300; i++) {
    h_resp_t r;
    h_get(s, "/readyz", NULL, &r);
    const char *e = r.json ? json_string_value(json_object_get(r.json, "error")) : NULL;
    if (r.status == status && (want == NULL || (e && strcmp(e, want) == 0))) {
      if (status == 200)
        assert_string_equal(r.body, "{\"status\":\"ready\"}");
      else
        h_assert_error(&r, status, NULL);
      snprintf(error, sizeof error, "%s", e ? e : "");
      h_resp_free(&r);
      return error;
    }
    h_resp_free(&r);
    usleep(50 * 1000);
  }
  fail_msg("/readyz never answered %ld %s", status, want ? want : "");
  return NULL;
}

static const char *await_ready(h_server_t *s, long status) {
  return await_ready_with(s, status, NULL);
}

/* /readyz tells a load balancer whether writes work: 503 while they fail
 * (the store down), even with no request writing (idemd's own probe
 * writes), and 200 again once they work; /healthz stays a liveness check
 * of the store's reads. */
static void test_readiness_follows_writes(void **state) {
  const char *tmp = getenv("TMPDIR");
  char dir[256], fault[300];
  h_server_t *s;
  int fd;
  (void)state;

  snprintf(dir, sizeof dir, "%s/idem-ready-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
  assert_non_null(mkdtemp(dir));
  snprintf(fault, sizeof fault, "%s/store-down", dir);
  assert_int_equal(setenv("IDEM_FAULT_FILE", fault, 1), 0);
  s = h_server_start(NULL);
  unsetenv("IDEM_FAULT_FILE");
  assert_string_equal(await_ready(s, 200), "");

  /* No request at all: the probe finds the fault. */
  fd = open(fault, O_WRONLY | O_CREAT | O_EXCL, 0600);
  assert_true(fd >= 0);
  close(fd);
  /* The reads fail too ("the store is unreachable") until the probe's
   * write has failed. */
  assert_string_equal(await_ready_with(s, 503, "writes are failing"), "writes are failing");
  assert_int_equal(unlink(fault), 0);
  assert_string_equal(await_ready(s, 200), "");
  assert_int_equal(rmdir(dir), 0);
  h_server_stop(s);
}

/* SQLite: another process holding the write lock (a backup, a person at
 * the sqlite3 prompt) keeps every write waiting; /readyz says so within
 * --ready-timeout, while /healthz (reads) stays 200, and is 200 again once
 * the lock is gone. */
static void test_readiness_when_writes_hang(void **state) {
  static const char *const flags[] = {"--ready-timeout", "300ms", NULL};
  h_server_t *s;
  sqlite3 *db;
  h_resp_t r;
  const char *why;
  (void)state;

  if (h_store_is_pg())
    skip(); /* a lock held by hand is SQLite's case; PostgreSQL's is issue 28's */
  s = h_server_start(flags);
  assert_string_equal(await_ready(s, 200), "");
  assert_int_equal(sqlite3_open(s->db, &db), SQLITE_OK);
  /* idemd's probe may hold the write lock for a moment: wait for it. */
  assert_int_equal(sqlite3_busy_timeout(db, 10000), SQLITE_OK);
  assert_int_equal(sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL), SQLITE_OK);
  why = await_ready(s, 503);
  if (strcmp(why, "writes are not finishing") != 0 && strcmp(why, "writes are failing") != 0)
    fail_msg("/readyz said '%s' while the write lock was held", why);
  h_get(s, "/healthz", NULL, &r);
  h_assert_status(&r, 200);
  h_resp_free(&r);
  assert_int_equal(sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL), SQLITE_OK);
  sqlite3_close(db);
  assert_string_equal(await_ready(s, 200), "");
  h_server_stop(s);
}

/* SQLite on a disk that fills up (a 600 KiB tmpfs, mounted when the test
 * may: root; else skipped): payments answer 503 once it is full, and
 * /readyz says "writes are failing"; once there is room again, writes work
 * and /readyz is 200 with no request made (the probe). */
static void test_readiness_disk_full(void **state) {
  const char *tmp = getenv("TMPDIR");
  char dir[256], db[320], cmd[400];
  h_server_t *s;
  const char *token;
  h_resp_t r;
  int full = 0;
  (void)state;

  if (h_store_is_pg())
    skip();
  snprintf(dir, sizeof dir, "%s/idem-full-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
  assert_non_null(mkdtemp(dir));
  snprintf(cmd, sizeof cmd, "mount -t tmpfs -o size=600k tmpfs '%s' 2>/dev/null", dir);
  if (system(cmd) != 0) {
    rmdir(dir);
    skip(); /* not allowed to mount here */
  }
  snprintf(db, sizeof db, "%s/idem.db", dir);
  s = h_server_start_on(db, NULL);
  token = h_tenant(s, "shop");
  for (int i = 0; i < 2000 && !full; i++) {
    char key[32];
    snprintf(key, sizeof key, "fill-%d", i);
    h_post(s, "/payments", token, key, PAYMENT, &r);
    if (r.status != 201) {
      assert_unavailable(&r);
      full = 1;
    }
    h_resp_free(&r);
  }
  assert_true(full);
  assert_string_equal(await_ready_with(s, 503, "writes are failing"), "writes are failing");
  snprintf(cmd, sizeof cmd, "mount -o remount,size=8m '%s'", dir);
  assert_int_equal(system(cmd), 0);
  assert_string_equal(await_ready(s, 200), "");
  h_post(s, "/payments", token, "after-room", PAYMENT, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);
  h_server_stop(s);
  snprintf(cmd, sizeof cmd, "umount '%s'", dir);
  assert_int_equal(system(cmd), 0);
  rmdir(dir);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_store_fault_and_recovery, h_teardown),
      cmocka_unit_test_teardown(test_readiness_follows_writes, h_teardown),
      cmocka_unit_test_teardown(test_readiness_when_writes_hang, h_teardown),
      cmocka_unit_test_teardown(test_readiness_disk_full, h_teardown),
  };
  int rc;
  h_init(argc, argv);
  rc = cmocka_run_group_tests_name("integration: store faults", tests, NULL, NULL);
  curl_global_cleanup();
  return rc;
}
