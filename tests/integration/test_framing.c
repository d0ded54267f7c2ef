/* How a request's body is framed, and headers that must come once, sent
 * over raw sockets (libcurl would not send these): every such request is
 * answered at once with a 4xx or 501, changes nothing, and where the
 * framing is in doubt the connection closes after the answer, so that the
 * bytes after the body are never read as a request of their own (RFC
 * 9112, sections 6.1 and 6.3; docs/api.md). And a client that closes its
 * sending side after a whole request still gets its answer
 * (scripts/mhd-half-close.patch). */
#include "harness.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define PAYMENT "{\"amount\": 100}"

/* Sends `len` bytes on a fresh connection and reads until the server
 * closes it (or 30 s pass); returns the bytes read (free them) and their
 * count in `*n`. */
static char *exchange(h_server_t *s, const char *bytes, size_t len, size_t *n) {
  struct timeval tv = {30, 0};
  size_t cap = 65536, sent = 0;
  char *buf = malloc(cap);
  int fd = h_dial(s);

  assert_non_null(buf);
  *n = 0;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  while (sent < len) {
    ssize_t w = send(fd, bytes + sent, len - sent, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      break; /* answered before it read everything */
    sent += (size_t)w;
  }
  for (;;) {
    ssize_t got = recv(fd, buf + *n, cap - 1 - *n, 0);
    if (got < 0 && errno == EINTR)
      continue;
    if (got <= 0 || (*n += (size_t)got) == cap - 1)
      break;
  }
  buf[*n] = '\0';
  close(fd);
  return buf;
}

/* How many answers `text` holds: its status lines. */
static int answers(const char *text) {
  int count = 0;
  for (const char *p = text; (p = strstr(p, "HTTP/1.1 ")) != NULL; p += 9)
    count++;
  return count;
}

/* The status of the first answer in `text`, 0 if none. */
static long first_status(const char *text) {
  return strncmp(text, "HTTP/1.1 ", 9) == 0 ? strtol(text + 9, NULL, 10) : 0;
}

/* A POST /payments under `key` with the extra `headers` (each ending in
 * CRLF) and `body` as given (already framed). Returns its length. */
static size_t request(char *out, size_t cap, const char *token, const char *key,
                      const char *headers, const char *body) {
  int n = snprintf(out, cap,
                   "POST /payments HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                   "Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
                   "Idempotency-Key: %s\r\n%s\r\n%s",
                   token, key, headers, body);
  assert_true(n > 0 && (size_t)n < cap);
  return (size_t)n;
}

/* The body of PAYMENT, chunked. */
static const char *chunked_payment(void) {
  static char body[128];
  snprintf(body, sizeof body, "%zx\r\n%s\r\n0\r\n\r\n", strlen(PAYMENT), PAYMENT);
  return body;
}

/* After a refused request its key is still free: the same request, sent
 * properly, is the first of its key. */
static void assert_key_free(h_server_t *s, const char *token, const char *key) {
  h_resp_t r;
  h_post(s, "/payments", token, key, PAYMENT, &r);
  h_assert_first(&r, 201);
  h_resp_free(&r);
}

/* Transfer codings libmicrohttpd cannot decode: 501 at once, or 400 when
 * chunked is not the last; the connection closes (the body's end is
 * unknown). Plain chunked works. */
static void test_transfer_codings(void **state) {
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  static const struct {
    const char *coding;
    long status;
  } rows[] = {
      {"identity", 501},      {"xchunked", 501},      {"gzip, chunked", 501},
      {"chunked, gzip", 400}, {"chunked , gzip", 400}, {" chunked ", 501},
      {"gzip", 501},
  };
  char req[2048], headers[128], key[64];
  size_t n, len;
  char *got;

  *state = s;
  for (size_t i = 0; i < sizeof rows / sizeof *rows; i++) {
    snprintf(key, sizeof key, "coding-%zu", i);
    snprintf(headers, sizeof headers, "Transfer-Encoding: %s\r\n", rows[i].coding);
    len = request(req, sizeof req, tok, key, headers, chunked_payment());
    h_context("Transfer-Encoding: '%s'", rows[i].coding);
    got = exchange(s, req, len, &n);
    assert_int_equal(first_status(got), rows[i].status);
    assert_non_null(strstr(got, "Connection: close"));
    assert_non_null(strstr(got, rows[i].status == 501
                                    ? "{\"error\":\"only the chunked transfer coding is "
                                      "supported\"}"
                                    : "{\"error\":\"chunked must be the last transfer "
                                      "coding\"}"));
    free(got);
    assert_key_free(s, tok, key);
  }
  h_context("Transfer-Encoding: chunked");
  len = request(req, sizeof req, tok, "coding-plain", "Transfer-Encoding: chunked\r\n"
                                                      "Connection: close\r\n",
                chunked_payment());
  got = exchange(s, req, len, &n);
  assert_int_equal(first_status(got), 201);
  free(got);
  h_context_clear();
  h_assert_healthy(s);
}

/* A body framed two ways (chunked and a Content-Length, or two lengths
 * that disagree): 400, the connection closed, and the request hidden
 * after the body never answered. The payment is not made. */
static void test_framed_two_ways(void **state) {
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  static const char smuggled[] = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  char req[4096], headers[128], body[512];
  size_t n, len;
  char *got;

  *state = s;
  /* Chunked, with a Content-Length that covers the chunks and the
   * smuggled request too. */
  snprintf(body, sizeof body, "%s%s", chunked_payment(), smuggled);
  snprintf(headers, sizeof headers, "Transfer-Encoding: chunked\r\nContent-Length: %zu\r\n",
           strlen(body));
  len = request(req, sizeof req, tok, "two-ways-1", headers, body);
  h_context("Transfer-Encoding and Content-Length");
  got = exchange(s, req, len, &n);
  assert_int_equal(first_status(got), 400);
  assert_int_equal(answers(got), 1);
  assert_non_null(strstr(got, "Connection: close"));
  assert_non_null(strstr(
      got, "{\"error\":\"Transfer-Encoding and Content-Length must not both be sent\"}"));
  free(got);
  assert_key_free(s, tok, "two-ways-1");

  /* Two lengths: the first the payment's, the second what follows it. */
  snprintf(body, sizeof body, "%s%s", PAYMENT, smuggled);
  snprintf(headers, sizeof headers, "Content-Length: %zu\r\nContent-Length: %zu\r\n",
           strlen(PAYMENT), strlen(body));
  len = request(req, sizeof req, tok, "two-ways-2", headers, body);
  h_context("two Content-Length headers");
  got = exchange(s, req, len, &n);
  assert_int_equal(first_status(got), 400);
  assert_int_equal(answers(got), 1);
  assert_non_null(strstr(got, "Connection: close"));
  assert_non_null(strstr(got, "{\"error\":\"Content-Length headers disagree\"}"));
  free(got);
  assert_key_free(s, tok, "two-ways-2");

  /* Two that agree are one length. */
  snprintf(headers, sizeof headers, "Content-Length: %zu\r\nContent-Length: %zu\r\n"
                                    "Connection: close\r\n",
           strlen(PAYMENT), strlen(PAYMENT));
  len = request(req, sizeof req, tok, "two-ways-3", headers, PAYMENT);
  h_context("two equal Content-Length headers");
  got = exchange(s, req, len, &n);
  assert_int_equal(first_status(got), 201);
  free(got);
  h_context_clear();
  h_assert_healthy(s);
}

/* Idempotency-Key, Authorization or Content-Type twice: 400 naming the
 * header, whether the two agree or not; nothing stored, neither key
 * taken. */
static void test_headers_sent_twice(void **state) {
  h_server_t *s = h_server_start(NULL);
  const char *tok = h_tenant(s, "acme");
  char req[2048], headers[256];
  size_t n, len;
  char *got;
  struct {
    const char *header, *error;
  } rows[3];

  *state = s;
  rows[0].header = "Idempotency-Key: twice-b\r\n";
  rows[0].error = "{\"error\":\"Idempotency-Key must be sent once\"}";
  snprintf(headers, sizeof headers, "Authorization: Bearer %s\r\n", tok);
  rows[1].header = strdup(headers);
  rows[1].error = "{\"error\":\"Authorization must be sent once\"}";
  rows[2].header = "Content-Type: application/json\r\n";
  rows[2].error = "{\"error\":\"Content-Type must be sent once\"}";
  for (size_t i = 0; i < 3; i++) {
    snprintf(headers, sizeof headers, "%sContent-Length: %zu\r\nConnection: close\r\n",
             rows[i].header, strlen(PAYMENT));
    len = request(req, sizeof req, tok, "twice-a", headers, PAYMENT);
    h_context("%s", rows[i].header);
    got = exchange(s, req, len, &n);
    assert_int_equal(first_status(got), 400);
    assert_non_null(strstr(got, rows[i].error));
    free(got);
  }
  free((char *)rows[1].header);
  h_context_clear();
  h_assert_db(s, 0, "SELECT count(*) FROM idempotency_records");
  assert_key_free(s, tok, "twice-a");
  assert_key_free(s, tok, "twice-b");
}

/* Sends a whole request, closes the sending side (shutdown(SHUT_WR)) and
 * reads the answer until the server closes the connection. Returns the
 * bytes read (free them), or NULL when the connection did not close within
 * 5 s of the last byte (the server's request timeout is far longer).
 * Thread-safe: fails no test itself. */
static char *half_closed(int port, const char *bytes, size_t len) {
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  struct timeval tv = {5, 0};
  size_t cap = 16384, n = 0, sent = 0;
  char *buf = malloc(cap);
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (buf == NULL || fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0)
    goto fail;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  while (sent < len) {
    ssize_t w = send(fd, bytes + sent, len - sent, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      goto fail;
    sent += (size_t)w;
  }
  shutdown(fd, SHUT_WR);
  for (;;) {
    ssize_t got = recv(fd, buf + n, cap - 1 - n, 0);
    if (got < 0 && errno == EINTR)
      continue;
    if (got < 0) /* not closed in time */
      goto fail;
    if (got == 0 || (n += (size_t)got) == cap - 1)
      break;
  }
  buf[n] = '\0';
  close(fd);
  return buf;
fail:
  if (fd >= 0)
    close(fd);
  free(buf);
  return NULL;
}

#define HALF_THREADS 16
#define HALF_EACH 25

struct half_racer {
  int port, id;
  const char *token;
  int answered, closed; /* 201s, and answers followed by the close */
};

static void *half_race(void *arg) {
  struct half_racer *h = arg;
  char req[2048], key[64], headers[64];
  for (int i = 0; i < HALF_EACH; i++) {
    char *got;
    size_t len;
    snprintf(key, sizeof key, "half-%d-%d", h->id, i);
    snprintf(headers, sizeof headers, "Content-Length: %zu\r\n", strlen(PAYMENT));
    len = request(req, sizeof req, h->token, key, headers, PAYMENT);
    if ((got = half_closed(h->port, req, len)) == NULL)
      continue;
    h->closed++;
    h->answered += first_status(got) == 201 && answers(got) == 1;
    free(got);
  }
  return NULL;
}

/* A client that sends its whole request and closes its side still gets
 * the answer, and the connection then closes (no keep-alive is possible):
 * payments (their answer waits on the provider and two writes, the
 * connection suspended meanwhile) one after another and from sixteen
 * threads at once, and /healthz. Every answered payment is stored once. */
static void test_half_closed_clients(void **state) {
  static const char *const flags[] = {"--request-timeout", "60s", NULL};
  h_server_t *s = h_server_start(flags);
  const char *tok = h_tenant(s, "acme");
  static const char healthz[] = "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  struct half_racer racers[HALF_THREADS];
  pthread_t threads[HALF_THREADS];
  char req[2048], key[64], headers[64];
  int answered = 0;

  *state = s;
  for (int i = 0; i < 100; i++) {
    char *got;
    size_t len;
    snprintf(key, sizeof key, "half-seq-%d", i);
    snprintf(headers, sizeof headers, "Content-Length: %zu\r\n", strlen(PAYMENT));
    len = request(req, sizeof req, tok, key, headers, PAYMENT);
    h_context("payment %d, half-closed", i);
    got = half_closed(s->port, req, len);
    if (got == NULL)
      fail_msg("no answer and close after a half-close");
    assert_int_equal(first_status(got), 201);
    assert_int_equal(answers(got), 1);
    free(got);
    h_context("/healthz %d, half-closed", i);
    got = half_closed(s->port, healthz, sizeof healthz - 1);
    if (got == NULL)
      fail_msg("no answer and close after a half-close");
    assert_int_equal(first_status(got), 200);
    free(got);
  }
  h_context_clear();
  for (int i = 0; i < HALF_THREADS; i++) {
    racers[i] = (struct half_racer){.port = s->port, .id = i, .token = tok};
    assert_int_equal(pthread_create(&threads[i], NULL, half_race, &racers[i]), 0);
  }
  for (int i = 0; i < HALF_THREADS; i++) {
    pthread_join(threads[i], NULL);
    if (racers[i].closed != HALF_EACH || racers[i].answered != HALF_EACH)
      fail_msg("thread %d: %d of %d answered 201, %d closed after the answer", i,
               racers[i].answered, HALF_EACH, racers[i].closed);
    answered += racers[i].answered;
  }
  h_assert_db(s, 100 + answered, "SELECT count(*) FROM resources WHERE kind = 'payment'");
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_transfer_codings, h_teardown),
      cmocka_unit_test_teardown(test_framed_two_ways, h_teardown),
      cmocka_unit_test_teardown(test_headers_sent_twice, h_teardown),
      cmocka_unit_test_teardown(test_half_closed_clients, h_teardown),
  };
  int failed;

  h_init(argc, argv);
  failed = cmocka_run_group_tests_name("integration: framing and headers sent once", tests,
                                       NULL, NULL);
  curl_global_cleanup();
  return failed ? 1 : 0;
}
