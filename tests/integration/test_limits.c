/* Resource limits (docs/hardening.md): a client that sends its request a
 * byte at a time is cut at --request-timeout while others are served; at
 * --max-connections the next connection gets 503 with Retry-After until
 * one is released; headers over --max-header-bytes get 431; bodies over
 * 64 KiB get 413, with Content-Length and chunked, and a stream of them (or
 * one 50 MiB body) does not grow idemd's memory. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

#define PAYMENT "{\"amount\": 15990, \"currency\": \"BRL\"}"
#define MAX_BODY (64 * 1024)

static void nap_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
}

/* Whether the server closed fd: waits up to `ms` for it to become
 * readable, then reads; 1 for end of stream or reset, 0 otherwise (still
 * open, or it sent bytes, which are dropped). */
static int closed_within(int fd, int ms) {
  struct pollfd p = {fd, POLLIN, 0};
  char buf[512];
  ssize_t n;
  if (poll(&p, 1, ms) <= 0)
    return 0;
  n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR);
}

/* The value of a counter or gauge in GET /metrics (fails if absent). */
static double metric(h_server_t *s, const char *name) {
  h_resp_t r;
  const char *p;
  double v;
  size_t n = strlen(name);

  h_get(s, "/metrics", NULL, &r);
  h_assert_status(&r, 200);
  for (p = r.body; p && (p = strstr(p, name)) != NULL; p += n)
    if ((p == r.body || p[-1] == '\n') && p[n] == ' ')
      break;
  if (p == NULL)
    fail_msg("no %s in /metrics", name);
  v = strtod(p + n + 1, NULL);
  h_resp_free(&r);
  return v;
}

/* VmRSS of a process, in KiB (fails if unreadable). */
static long rss_kib(pid_t pid) {
  char path[64], *text, *p;
  long kib;
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  text = h_read_file(path, NULL);
  assert_non_null(text);
  p = strstr(text, "VmRSS:");
  assert_non_null(p);
  kib = strtol(p + 6, NULL, 10);
  free(text);
  assert_true(kib > 0);
  return kib;
}

/* A slowloris client (one byte every 500 ms) is cut at the 2 s request
 * deadline, not before it and not much after; a normal request sent while
 * it dribbles is answered at once; the cut is counted. */
static void test_slow_client_is_cut(void **state) {
  static const char *const flags[] = {"--request-timeout", "2s", NULL};
  static const char slow[] = "POST /payments HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                             "Content-Type: application/json\r\n"
                             "Content-Length: 40\r\n\r\n{\"amount\": 1}";
  h_server_t *s = h_server_start(flags);
  const char *token = h_tenant(s, "shop");
  double cut0 = metric(s, "idem_connections_cut_total");
  double start, closed_at = 0, normal_done = 0;
  int fd = h_dial(s);
  (void)state;

  start = h_now();
  /* Bounded: the request is longer than the deadline lets through. */
  for (size_t i = 0; i < sizeof slow - 1 && h_now() - start < 10.0; i++) {
    if (send(fd, slow + i, 1, MSG_NOSIGNAL) != 1) {
      closed_at = h_now();
      break;
    }
    if (i == 2) {
      /* While the slow client holds its connection: a normal request. */
      h_resp_t r;
      h_post(s, "/payments", token, "normal-during-slowloris", PAYMENT, &r);
      h_assert_first(&r, 201);
      normal_done = h_now();
      h_resp_free(&r);
      if (normal_done - start > 1.5)
        fail_msg("a normal request took %.2f s while a slow client sent", normal_done - start);
    }
    if (closed_within(fd, 500)) {
      closed_at = h_now();
      break;
    }
  }
  close(fd);
  if (closed_at == 0)
    fail_msg("the slow client was still connected after %.1f s", h_now() - start);
  if (closed_at - start < 1.5 || closed_at - start > 2.0 + 1.5)
    fail_msg("the slow client was cut after %.2f s, want about 2 s", closed_at - start);
  assert_true(normal_done > 0 && normal_done < closed_at);
  assert_true(metric(s, "idem_connections_cut_total") >= cut0 + 1);
  h_assert_healthy(s);
  h_server_stop(s);
}

/* With --max-connections 4: three idle connections leave room for a
 * request; a fourth fills the cap and the next request gets 503 with
 * Retry-After and only "error"; once they are released, requests succeed. */
static void test_connection_cap(void **state) {
  static const char *const flags[] = {"--max-connections", "4", NULL};
  static const char get[] = "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                            "Connection: close\r\n\r\n";
  h_server_t *s = h_server_start(flags);
  const char *token = h_tenant(s, "shop");
  double refused0 = metric(s, "idem_connections_refused_total");
  int idle[4];
  h_resp_t r;
  (void)state;

  for (int i = 0; i < 3; i++)
    idle[i] = h_dial(s);
  nap_ms(300); /* let the server accept them */
  h_raw(s, get, sizeof get - 1, &r);
  h_assert_status(&r, 200); /* the 4th connection: within the cap */
  h_resp_free(&r);

  idle[3] = h_dial(s);
  nap_ms(300);
  h_raw(s, get, sizeof get - 1, &r);
  h_assert_error(&r, 503, NULL);
  if (r.retry_after[0] == '\0' || atoi(r.retry_after) < 1)
    fail_msg("503 at the connection cap without Retry-After ('%s')", r.retry_after);
  h_resp_free(&r);
  h_post(s, "/payments", token, "over-the-cap", PAYMENT, &r);
  h_assert_error(&r, 503, NULL);
  h_resp_free(&r);
  h_assert_db(s, 0, "SELECT count(*) FROM idempotency_records");

  for (int i = 0; i < 4; i++)
    close(idle[i]);
  /* The server notices the closes asynchronously: bounded wait. */
  for (int tries = 0; tries < 100; tries++) {
    h_raw(s, get, sizeof get - 1, &r);
    long status = r.status;
    h_resp_free(&r);
    if (status == 200)
      break;
    nap_ms(20);
  }
  for (int i = 0; i < 5; i++)
    h_assert_healthy(s);
  h_post(s, "/payments", token, "over-the-cap", PAYMENT, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);
  assert_true(metric(s, "idem_connections_refused_total") >= refused0 + 2);
  h_server_stop(s);
}

/* A request whose headers pass --max-header-bytes gets 431; one of half
 * that size is served; the server stays healthy. */
static void test_header_limit(void **state) {
  static const char *const flags[] = {"--max-header-bytes", "4096", NULL};
  h_server_t *s = h_server_start(flags);
  char *req = malloc(16384), pad[8193];
  h_resp_t r;
  (void)state;

  assert_non_null(req);
  memset(pad, 'a', sizeof pad - 1);
  pad[sizeof pad - 1] = '\0';
  snprintf(req, 16384, "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: %.1500s\r\n"
                       "Connection: close\r\n\r\n", pad);
  h_raw(s, req, strlen(req), &r);
  h_assert_status(&r, 200);
  h_resp_free(&r);

  snprintf(req, 16384, "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: %s\r\n"
                       "Connection: close\r\n\r\n", pad);
  h_raw(s, req, strlen(req), &r);
  h_assert_status(&r, 431);
  h_resp_free(&r);
  /* Many small headers, the same total. */
  {
    size_t n = (size_t)snprintf(req, 16384, "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n");
    for (int i = 0; i < 400; i++)
      n += (size_t)snprintf(req + n, 16384 - n, "X-H%d: %d\r\n", i, i);
    n += (size_t)snprintf(req + n, 16384 - n, "Connection: close\r\n\r\n");
    assert_true(n < 16000);
    h_raw(s, req, n, &r);
    h_assert_status(&r, 431);
    h_resp_free(&r);
  }
  free(req);
  h_assert_healthy(s);
  h_server_stop(s);
}

/* Builds a payment with `extra` short headers and an X-Pad of `padlen`
 * bytes into req; returns the length of its line and headers (blank line
 * included). */
static int padded_payment(char *req, size_t cap, const char *tok, const char *key, int extra,
                          int padlen) {
  static const char body[] = "{\"amount\": 100, \"currency\": \"BRL\"}";
  char pad[4097];
  int n;

  assert_true(padlen >= 0 && padlen < (int)sizeof pad);
  memset(pad, 'a', (size_t)padlen);
  pad[padlen] = '\0';
  n = snprintf(req, cap,
               "POST /payments HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
               "Authorization: Bearer %s\r\nIdempotency-Key: %s\r\n"
               "Content-Type: application/json\r\nX-Pad: %s\r\nContent-Length: %zu\r\n",
               tok, key, pad, sizeof body - 1);
  for (int i = 0; i < extra; i++)
    n += snprintf(req + n, cap - (size_t)n, "X-%d: v\r\n", i);
  n += snprintf(req + n, cap - (size_t)n, "\r\n");
  assert_true(n > 0 && (size_t)n + sizeof body < cap);
  memcpy(req + n, body, sizeof body);
  return n;
}

/* Every request near the header limit gets an answer: 201 when its line
 * and headers, with libmicrohttpd's 64-byte record of each header, fit
 * --max-header-bytes, else 431 with nothing written. The library builds
 * the answer in the pool that held the headers: when the pool was the
 * limit alone, headers a few hundred bytes short of it made their payment,
 * and the connection then closed with no answer, on every retry too. With
 * few long headers and with many short ones (whose records take the most
 * room), at every size from 120 bytes under the limit to 40 over. */
static void test_header_limit_boundary(void **state) {
  static const char *const flags[] = {"--max-header-bytes", "4096", NULL};
  static const int extras[] = {0, 20, 40};
  h_server_t *s = h_server_start(flags);
  const char *tok = h_tenant(s, "acme");
  char req[8192], key[32];
  int made = 0;
  h_resp_t r;
  (void)state;

  for (size_t e = 0; e < sizeof extras / sizeof extras[0]; e++) {
    int records = 7 + extras[e], base, fitted = 0, refused = 0;
    base = padded_payment(req, sizeof req, tok, "probe", extras[e], 0);
    for (int over = -120; over <= 40; over++) {
      int pad = 4096 - records * 64 - base + over, head;
      snprintf(key, sizeof key, "hdr-%d-%d", extras[e], over + 200);
      head = padded_payment(req, sizeof req, tok, key, extras[e], pad);
      h_context("%d headers, %d bytes of them (limit 4096)", records, head);
      h_raw(s, req, strlen(req), &r);
      if (head + records * 64 <= 4096) {
        h_assert_first(&r, 201);
        made++, fitted++;
      } else {
        h_assert_error(&r, 431, NULL);
        h_assert_db(s, 0, "SELECT count(*) FROM idempotency_records WHERE key = ?1", key);
        refused++;
      }
      h_resp_free(&r);
    }
    assert_true(fitted > 100 && refused > 30);
  }
  h_context_clear();
  h_assert_db(s, made, "SELECT count(*) FROM payments");
  h_assert_healthy(s);
  h_server_stop(s);
}

/* A POST of `len` body bytes with Content-Length or chunked (in chunks of
 * at most 16 KiB), built whole. Caller frees. */
static char *big_post(h_server_t *s, const char *token, const char *key, size_t len,
                      int chunked, size_t *out_len) {
  size_t cap = len + len / 1024 * 16 + 4096, n;
  char *req = malloc(cap);
  assert_non_null(req);
  n = (size_t)snprintf(req, cap,
                       "POST /payments HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: close\r\n"
                       "Authorization: Bearer %s\r\nIdempotency-Key: %s\r\n"
                       "Content-Type: application/json\r\n",
                       s->port, token, key);
  if (!chunked) {
    n += (size_t)snprintf(req + n, cap - n, "Content-Length: %zu\r\n\r\n", len);
    memset(req + n, ' ', len);
    n += len;
  } else {
    n += (size_t)snprintf(req + n, cap - n, "Transfer-Encoding: chunked\r\n\r\n");
    for (size_t off = 0; off < len;) {
      size_t k = len - off < 16384 ? len - off : 16384;
      n += (size_t)snprintf(req + n, cap - n, "%zx\r\n", k);
      memset(req + n, ' ', k);
      n += k;
      memcpy(req + n, "\r\n", 2);
      n += 2;
      off += k;
    }
    n += (size_t)snprintf(req + n, cap - n, "0\r\n\r\n");
  }
  assert_true(n < cap);
  *out_len = n;
  return req;
}

/* Sends a chunked body of `total` bytes in 64 KiB chunks until done or the
 * server stops reading; returns the body bytes it could send and sets
 * *status to the answer's status (0: closed without one). */
static size_t stream_chunked(h_server_t *s, const char *token, size_t total, long *status) {
  static char chunk[65536 + 16];
  char head[512], answer[1024];
  size_t sent = 0, got = 0;
  int fd = h_dial(s), n, ok = 1;
  struct timeval tv = {10, 0};

  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  n = snprintf(head, sizeof head,
               "POST /payments HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
               "Authorization: Bearer %s\r\nIdempotency-Key: huge\r\n"
               "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
               token);
  assert_int_equal(send(fd, head, (size_t)n, MSG_NOSIGNAL), n);
  n = snprintf(chunk, sizeof chunk, "10000\r\n");
  memset(chunk + n, ' ', 65536);
  memcpy(chunk + n + 65536, "\r\n", 2);
  while (ok && sent < total) {
    size_t len = (size_t)n + 65536 + 2, off = 0;
    while (off < len) {
      ssize_t w = send(fd, chunk + off, len - off, MSG_NOSIGNAL);
      if (w <= 0) {
        ok = 0;
        break;
      }
      off += (size_t)w;
    }
    if (ok)
      sent += 65536;
  }
  if (ok)
    (void)send(fd, "0\r\n\r\n", 5, MSG_NOSIGNAL);
  for (;;) {
    ssize_t r = recv(fd, answer + got, sizeof answer - 1 - got, 0);
    if (r <= 0)
      break;
    got += (size_t)r;
    if (got == sizeof answer - 1)
      break;
  }
  answer[got] = '\0';
  *status = got > 12 && strncmp(answer, "HTTP/1.1 ", 9) == 0 ? strtol(answer + 9, NULL, 10) : 0;
  close(fd);
  return sent;
}

/* 64 KiB + 1 is refused with 413, with Content-Length and chunked, and
 * exactly 64 KiB is not (it gets the next check, 400 for not JSON); 200
 * refusals and one 50 MiB chunked body leave idemd's memory where it was. */
static void test_body_limit(void **state) {
  /* Few threads, so a warm-up reaches every thread's allocator (a worker's
   * first requests grow its stack and malloc caches once). */
  static const char *const flags[] = {"--threads", "2", "--workers", "2", NULL};
  const char *asan = getenv("ASAN_OPTIONS");
  char env[1024];
  h_server_t *s;
  const char *token;
  size_t len, sent;
  long before, after, status;
  char *req;
  h_resp_t r;
  (void)state;

  /* ASan keeps freed memory in quarantine (256 MiB): keep it small for
   * this server, or its RSS would grow with every freed buffer. */
  snprintf(env, sizeof env, "%s%squarantine_size_mb=1", asan ? asan : "",
           asan && asan[0] ? ":" : "");
  setenv("ASAN_OPTIONS", env, 1);
  s = h_server_start(flags);
  if (asan)
    setenv("ASAN_OPTIONS", asan, 1);
  else
    unsetenv("ASAN_OPTIONS");
  token = h_tenant(s, "shop");

  for (int chunked = 0; chunked < 2; chunked++) {
    h_context("%s", chunked ? "chunked" : "Content-Length");
    req = big_post(s, token, "exactly-64k", MAX_BODY, chunked, &len);
    h_raw(s, req, len, &r);
    h_assert_error(&r, 400, NULL);
    h_resp_free(&r);
    free(req);
    req = big_post(s, token, "too-big", MAX_BODY + 1, chunked, &len);
    h_raw(s, req, len, &r);
    h_assert_error(&r, 413, NULL);
    h_resp_free(&r);
    free(req);
  }
  h_context_clear();

  /* Warm up every thread's allocator, then measure. */
  for (int i = 0; i < 32; i++) {
    req = big_post(s, token, "warm-up", MAX_BODY + 1, i % 2, &len);
    h_raw(s, req, len, &r);
    h_assert_status(&r, 413);
    h_resp_free(&r);
    free(req);
  }
  before = rss_kib(s->pid);
  for (int i = 0; i < 200; i++) {
    req = big_post(s, token, "many", MAX_BODY + 1 + (size_t)i, i % 2, &len);
    h_raw(s, req, len, &r);
    h_context("refusal %d", i);
    h_assert_status(&r, 413);
    h_resp_free(&r);
    free(req);
  }
  h_context_clear();
  sent = stream_chunked(s, token, (size_t)50 << 20, &status);
  after = rss_kib(s->pid);
  if (after - before > 4 * 1024)
    fail_msg("idemd's RSS grew from %ld KiB to %ld KiB over 200 refused bodies and a "
             "50 MiB one",
             before, after);
  if (status != 0 && status != 413)
    fail_msg("a 50 MiB chunked body got %ld, want 413 or a closed connection", status);
  /* Past the cap idemd drops what it reads, and stops reading after 8 MiB
   * (DISCARD_LIMIT in src/server/http.c); socket buffers hold some more. */
  if (sent >= (size_t)32 << 20)
    fail_msg("idemd read %zu MiB of a refused chunked body (answered %ld) instead of "
             "closing the connection after about 8 MiB",
             sent >> 20, status);
  h_assert_db(s, 0, "SELECT count(*) FROM idempotency_records");
  h_assert_healthy(s);
  h_server_stop(s);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_slow_client_is_cut, h_teardown),
      cmocka_unit_test_teardown(test_connection_cap, h_teardown),
      cmocka_unit_test_teardown(test_header_limit, h_teardown),
      cmocka_unit_test_teardown(test_header_limit_boundary, h_teardown),
      cmocka_unit_test_teardown(test_body_limit, h_teardown),
  };
  int rc;
  h_init(argc, argv);
  rc = cmocka_run_group_tests_name("integration: resource limits", tests, NULL, NULL);
  curl_global_cleanup();
  return rc;
}
