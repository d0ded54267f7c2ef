/* Request lines in batches: whole lines, in order, held up to 64 KiB when
 * stderr is a file and written at most PIPE_BUF at a time into a pipe. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <setjmp.h>
#include <stdarg.h>
#include <cmocka.h>

#include <jansson.h>

#include "idem/clock.h"
#include "server/log.h"

/* About 44 KB of request lines: ten times PIPE_BUF, and less than the
 * 64 KiB of a file's batch (and of a pipe's buffer). */
#define LINES 200

static int saved_stderr = -1;

static void point_stderr_at(int fd) {
  fflush(stderr);
  saved_stderr = dup(STDERR_FILENO);
  assert_true(saved_stderr >= 0);
  assert_int_equal(dup2(fd, STDERR_FILENO), STDERR_FILENO);
}

static void restore_stderr(void) {
  fflush(stderr);
  assert_int_equal(dup2(saved_stderr, STDERR_FILENO), STDERR_FILENO);
  close(saved_stderr);
  saved_stderr = -1;
}

/* Logs request lines 0 .. LINES-1, each naming its number in request_id,
 * and notes in `sizes` the bytes that reached `fd` (as `written` tells)
 * while each line was logged, when any did: the writes that went out.
 * Returns how many it noted. The flush thread writes once at once when
 * batching starts, which may be one of them (or add to one); its next
 * flush is an hour later. */
static int log_lines(int fd, long (*written)(int fd), long sizes[LINES]) {
  static idemd_request_t r; /* large: not on the stack */
  long before = written(fd);
  int writes = 0;
  for (int i = 0; i < LINES; i++) {
    memset(&r, 0, sizeof r);
    snprintf(r.request_id, sizeof r.request_id, "req_%04d_padding_to_a_usual_length", i);
    r.method = "POST";
    snprintf(r.path, sizeof r.path, "/payments");
    r.status = 201;
    r.start_us = idem_mono_us();
    idemd_log_request(&r);
    long now = written(fd);
    if (now != before)
      sizes[writes++] = now - before;
    before = now;
  }
  return writes;
}

static long file_size(int fd) {
  struct stat st;
  return fstat(fd, &st) == 0 ? (long)st.st_size : -1;
}

static long pipe_bytes(int fd) {
  int n = -1;
  return ioctl(fd, FIONREAD, &n) == 0 ? n : -1;
}

/* Checks `text` is LINES request lines, whole and in order, then `tail`. */
static void check_lines(const char *text, const char *tail) {
  const char *p = text;
  for (int i = 0; i < LINES; i++) {
    char id[32];
    const char *nl = strchr(p, '\n');
    assert_non_null(nl);
    snprintf(id, sizeof id, "\"req_%04d_", i);
    assert_true(p[0] == '{' && nl[-1] == '}');
    assert_non_null(memmem(p, (size_t)(nl - p), id, strlen(id)));
    p = nl + 1;
  }
  assert_non_null(strstr(p, tail));
}

static char *read_all(int fd) {
  size_t cap = 1 << 20, len = 0;
  char *buf = calloc(1, cap);
  ssize_t n;
  assert_non_null(buf);
  while ((n = read(fd, buf + len, cap - 1 - len)) > 0)
    len += (size_t)n;
  buf[len] = '\0';
  return buf;
}

/* Into a file, a batch holds more than PIPE_BUF: the lines (more than
 * PIPE_BUF in all) wait for the event line, but for what the flush thread
 * wrote when it started. (Assertions wait until stderr is back, so that a
 * failure is seen.) */
static void test_file_batches_beyond_pipe_buf(void **state) {
  char path[] = "/tmp/idem-test-log-XXXXXX";
  int fd = mkstemp(path);
  char *text;
  (void)state;

  assert_true(fd >= 0);
  unlink(path);
  point_stderr_at(fd);
  int started = idemd_log_batch_start(3600 * 1000);
  long sizes[LINES];
  int writes = log_lines(fd, file_size, sizes);
  idemd_log_event("warn", "after the batch", NULL);
  idemd_log_batch_stop();
  restore_stderr();

  assert_int_equal(started, 0);
  assert_true(writes <= 1);
  assert_int_equal(lseek(fd, 0, SEEK_SET), 0);
  text = read_all(fd);
  check_lines(text, "\"msg\":\"after the batch\"");
  assert_true(strlen(text) > PIPE_BUF);
  free(text);
  close(fd);
}

/* Into a pipe, batches are written as they reach PIPE_BUF: the lines go
 * out in writes of nearly PIPE_BUF each, and in whole lines. */
static void test_pipe_batches_at_pipe_buf(void **state) {
  int p[2];
  char *before, *rest;
  ssize_t n;
  (void)state;

  assert_int_equal(pipe(p), 0); /* 64 KiB: room for all the lines (about 9 KB) */
  assert_int_equal(fcntl(p[0], F_SETFL, O_NONBLOCK), 0);
  point_stderr_at(p[1]);
  int started = idemd_log_batch_start(3600 * 1000);
  long sizes[LINES];
  int writes = log_lines(p[0], pipe_bytes, sizes);

  before = calloc(1, 1 << 20);
  n = before ? read(p[0], before, (1 << 20) - 1) : -1;
  idemd_log_event("warn", "after the batch", NULL);
  idemd_log_batch_stop();
  restore_stderr();
  close(p[1]);

  assert_int_equal(started, 0);
  /* Full batches: each write within a line of PIPE_BUF, but for one
   * (the flush thread's, alone or added to another) at most. */
  int odd = 0;
  for (int i = 0; i < writes; i++)
    odd += sizes[i] > PIPE_BUF || sizes[i] <= PIPE_BUF - 1024;
  assert_true(writes >= 9);
  assert_true(odd <= 1);
  assert_true(n > 0);
  assert_int_equal(before[n - 1], '\n'); /* whole lines only */
  assert_int_equal(fcntl(p[0], F_SETFL, 0), 0);
  rest = read_all(p[0]);
  close(p[0]);
  before = realloc(before, (size_t)n + strlen(rest) + 1);
  assert_non_null(before);
  strcpy(before + n, rest);
  check_lines(before, "\"msg\":\"after the batch\"");
  free(rest);
  free(before);
}

/* A request line with a huge method and path (quotes, control bytes,
 * bytes above 0x7E: each escaped to up to six bytes) is cut at whole
 * escapes, each field bounded, and parses as JSON with its fields; both
 * idemd's line and the gateway's. */
static void test_huge_fields_stay_json(void **state) {
  static idemd_request_t r;
  char tmpl[] = "/tmp/idem-test-log-XXXXXX";
  int fd = mkstemp(tmpl);
  size_t big = 100000;
  char *method = malloc(big + 1), *path = malloc(big + 1), *text;
  idemd_gateway_line_t g = {.request_id = "gw_req", .route = "charges", .key_id = "abcdef0123456789",
                            .status = 201};
  const char *p;
  int lines = 0;
  (void)state;
  assert_true(fd >= 0 && method && path);
  unlink(tmpl);
  for (size_t i = 0; i < big; i++) {
    method[i] = "\"\\\x01\xff"[i % 4];
    path[i] = "/\"\x7f\\a"[i % 5];
  }
  method[big] = path[big] = '\0';
  memset(&r, 0, sizeof r);
  snprintf(r.request_id, sizeof r.request_id, "req_huge");
  r.method = method;
  memcpy(r.path, path, sizeof r.path - 1);
  r.path[sizeof r.path - 1] = '\0';
  r.status = 400;
  r.start_us = idem_mono_us();
  g.method = method;
  g.path = path;
  g.start_us = idem_mono_us();
  point_stderr_at(fd);
  idemd_log_request(&r);
  idemd_log_gateway_request(&g);
  restore_stderr();
  lseek(fd, 0, SEEK_SET);
  text = read_all(fd);
  close(fd);
  for (p = text; *p; lines++) {
    const char *nl = strchr(p, '\n');
    json_error_t err;
    json_t *line;
    assert_non_null(nl);
    assert_true(nl - p <= 1024);
    line = json_loadb(p, (size_t)(nl - p), 0, &err);
    if (line == NULL)
      fail_msg("not JSON (%s): %.*s", err.text, (int)(nl - p), p);
    assert_int_equal(json_integer_value(json_object_get(line, "status")), lines ? 201 : 400);
    assert_non_null(json_string_value(json_object_get(line, "method")));
    assert_non_null(json_string_value(json_object_get(line, "path")));
    assert_true(json_is_number(json_object_get(line, "latency_ms")));
    if (lines)
      assert_string_equal(json_string_value(json_object_get(line, "key_id")), "abcdef0123456789");
    json_decref(line);
    p = nl + 1;
  }
  assert_int_equal(lines, 2);
  free(text);
  free(method);
  free(path);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_file_batches_beyond_pipe_buf),
      cmocka_unit_test(test_pipe_batches_at_pipe_buf),
      cmocka_unit_test(test_huge_fields_stay_json),
  };
  idemd_log_set_level("info");
  return cmocka_run_group_tests(tests, NULL, NULL);
}
