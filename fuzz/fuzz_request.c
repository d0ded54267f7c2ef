/* Fuzz target for the whole request pipeline of idemd, in process: a real
 * server (idemd_server_start on 127.0.0.1:0, a temp SQLite database, one
 * tenant) answers each input sent as raw HTTP over a loopback socket.
 *
 * An input is text. Its first line is "METHOD PATH" (no space: the line is
 * the path and the method GET). Header lines follow until an empty line;
 * the rest is the body. Three pseudo-headers steer the framing: "@token"
 * adds the tenant's valid Authorization header, "@chunked" sends the body
 * chunked instead of with Content-Length, "@big" pads the body with spaces
 * past the 64 KiB cap. The target owns the framing (request line, Host,
 * Connection: close, Content-Length or Transfer-Encoding), so every input
 * is a well-formed HTTP/1.1 request: header names are cut to token
 * characters, values to visible characters, blanks and obs-text, the path
 * is percent-encoded where it must be, and framing headers from the input
 * are dropped.
 *
 * Properties: an answer always arrives, whole; its status is one the API
 * documents; every body but /metrics is a JSON object, and a 4xx/5xx body
 * holds only "error" (a non-empty string) or "errors" (field, message,
 * code), but for 402, which is the declined payment plus "error"; 401
 * carries WWW-Authenticate and 405 Allow; no body holds a path
 * ("/tmp", "/work"), SQL of our schema, or a library's name (but /metrics,
 * whose help text may name the store), unless the request itself sent that
 * text (resources echo their fields). */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fuzz_util.h"
#include "idem/clock.h"
#include "idem/crypto.h"
#include "server/auth.h"
#include "server/server.h"

#define MAX_PATH_OUT 2048
#define MAX_HEADER_BYTES 4096
#define MAX_HEADERS 32
/* libmicrohttpd keeps a 64-byte record of each query argument in the
 * connection's memory while it parses the request line, before idemd sees
 * the request: thousands of them (a query of "&&&...") exhaust it and get
 * the library's own 431 (docs/api.md, "Answers from the HTTP layer"),
 * which is not what this target tests. Further '&' are sent as %26. */
#define MAX_QUERY_ARGS 16
#define ANSWER_TIMEOUT_MS 10000
#define MAX_ANSWER (1024 * 1024)

static idemd_server_t srv; /* big (metrics); lives for the process */
static int srv_running;
static char dir[256], db[320];
static char token[IDEMD_API_KEY_MAX + 1];

/* ---- a growable buffer ------------------------------------------------ */

typedef struct buf {
  char *p;
  size_t n, cap;
} buf_t;

static void put(buf_t *b, const void *data, size_t len) {
  if (b->n + len + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 1024;
    while (cap < b->n + len + 1)
      cap *= 2;
    b->p = realloc(b->p, cap);
    FUZZ_CHECK(b->p != NULL, "out of memory");
    b->cap = cap;
  }
  memcpy(b->p + b->n, data, len);
  b->n += len;
  b->p[b->n] = '\0';
}

static void puts_(buf_t *b, const char *s) { put(b, s, strlen(s)); }

static void putf(buf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void putf(buf_t *b, const char *fmt, ...) {
  char tmp[512];
  va_list ap;
  int n;
  va_start(ap, fmt);
  n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  FUZZ_CHECK(n >= 0 && (size_t)n < sizeof tmp, "putf overflow");
  put(b, tmp, (size_t)n);
}

/* ---- the server ------------------------------------------------------- */

static void cleanup(void) {
  static const char *const suffixes[] = {"", "-wal", "-shm", "-journal"};
  char path[400];
  if (srv_running) {
    idemd_server_stop(&srv);
    srv_running = 0;
  }
  for (size_t i = 0; i < sizeof suffixes / sizeof *suffixes; i++) {
    snprintf(path, sizeof path, "%s%s", db, suffixes[i]);
    unlink(path);
  }
  if (dir[0])
    rmdir(dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  const char *tmp = getenv("TMPDIR");
  char *flags[] = {"--listen", "127.0.0.1:0", "--db", db, "--threads", "4", "--workers", "8",
                   "--log-level", "error", "--inflight-wait", "1s",
                   "--sandbox-decline-amount", "402", "--sandbox-uncertain-amount", "202",
                   "--reconcile-interval", "1s", NULL};
  int nflags = (int)(sizeof flags / sizeof *flags) - 1;
  idemd_config_t cfg;
  unsigned char seed[8];
  idemd_tenant_t t = {0};
  idemd_api_key_t k;
  int rc;

  (void)argc;
  (void)argv;
  signal(SIGPIPE, SIG_IGN);
  snprintf(dir, sizeof dir, "%s/idem-fuzz-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
  FUZZ_CHECK(mkdtemp(dir) != NULL, "mkdtemp %s: %s", dir, strerror(errno));
  snprintf(db, sizeof db, "%s/idem.db", dir);
  /* OpenSSL registers its own exit handler when first used; use it before
   * ours, so ours (which joins the server's threads) runs first and those
   * threads still free their OpenSSL state as they end. */
  FUZZ_CHECK(idem_random_bytes(seed, sizeof seed) == IDEM_OK, "no randomness");
  atexit(cleanup);

  idemd_config_defaults(&cfg);
  FUZZ_CHECK(idemd_config_parse(&cfg, nflags, flags, stderr) == nflags, "bad flags");
  FUZZ_CHECK(idemd_server_start(&srv, &cfg) == 0, "idemd_server_start failed");
  srv_running = 1;
  FUZZ_CHECK(srv.port > 0, "no port bound");

  /* As `idemd tenant create fuzz` does. */
  rc = idemd_api_key_new("default", &k, token);
  FUZZ_CHECK(rc == IDEM_OK, "idemd_api_key_new: %d", rc);
  snprintf(t.name, sizeof t.name, "fuzz");
  t.created_at = k.created_at;
  rc = idemd_tenant_create(srv.tenants, &t, &k);
  FUZZ_CHECK(rc == IDEM_OK, "idemd_tenant_create: %d", rc);
  return 0;
}

/* ---- decoding an input into a request --------------------------------- */

static int is_tchar(unsigned char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
         (c && strchr("!#$%&'*+-.^_`|~", c) != NULL);
}

/* Headers whose framing role the target keeps for itself. */
static int is_framing(const char *name) {
  static const char *const names[] = {"content-length", "transfer-encoding", "connection",
                                      "host", "expect", "upgrade", "te", "trailer",
                                      "keep-alive", "proxy-connection"};
  for (size_t i = 0; i < sizeof names / sizeof *names; i++)
    if (strcasecmp(name, names[i]) == 0)
      return 1;
  return 0;
}

/* The next line of [*p, end): its bytes without '\n' (and without a final
 * '\r'); advances *p past the '\n'. */
static size_t next_line(const char **p, const char *end, const char **line) {
  const char *nl = memchr(*p, '\n', (size_t)(end - *p));
  size_t len = nl ? (size_t)(nl - *p) : (size_t)(end - *p);
  *line = *p;
  *p = nl ? nl + 1 : end;
  if (len > 0 && (*line)[len - 1] == '\r')
    len--;
  return len;
}

static int hex_digit(char c) {
  return c >= '0' && c <= '9' ? c - '0'
         : c >= 'a' && c <= 'f' ? c - 'a' + 10
         : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                : -1;
}

/* Whether the server will see `path` as /metrics: the query goes, the rest
 * is percent-decoded, and an encoded NUL ends it ("/metrics%00x" is
 * /metrics). */
static int is_metrics(const char *path) {
  char decoded[16];
  size_t n = 0;
  for (const char *c = path; *c && *c != '?' && n < sizeof decoded - 1; c++) {
    char ch = *c;
    if (ch == '%' && hex_digit(c[1]) >= 0 && hex_digit(c[2]) >= 0) {
      ch = (char)(hex_digit(c[1]) * 16 + hex_digit(c[2]));
      c += 2;
    }
    if (ch == '\0')
      break;
    decoded[n++] = ch;
  }
  decoded[n] = '\0';
  return strcmp(decoded, "/metrics") == 0;
}

typedef struct request {
  buf_t bytes; /* what goes on the wire */
  char *body;  /* the body before framing */
  size_t body_len;
  int head;    /* HEAD: no body in the answer */
  int metrics; /* the path is /metrics */
} request_t;

static void build(const uint8_t *data, size_t size, request_t *rq) {
  const char *p = (const char *)data, *end = p + size, *line, *sp;
  char method[17];
  size_t len, m = 0, header_bytes = 0;
  int chunked = 0, big = 0, nheaders = 0;
  buf_t path = {0}, headers = {0};

  memset(rq, 0, sizeof *rq);
  len = next_line(&p, end, &line);
  sp = memchr(line, ' ', len);
  if (sp) {
    for (const char *c = line; c < sp && m < sizeof method - 1; c++)
      if (is_tchar((unsigned char)*c))
        method[m++] = *c;
    len -= (size_t)(sp + 1 - line);
    line = sp + 1;
  }
  if (m == 0)
    memcpy(method, "GET", m = 3);
  method[m] = '\0';
  rq->head = strcmp(method, "HEAD") == 0;

  if (len == 0 || line[0] != '/')
    puts_(&path, "/");
  for (size_t i = 0, query = 0, args = 1; i < len && path.n < MAX_PATH_OUT; i++) {
    unsigned char c = (unsigned char)line[i];
    query |= c == '?';
    if (c == '&' && query && ++args > MAX_QUERY_ARGS)
      puts_(&path, "%26");
    else if (c >= 0x21 && c <= 0x7e)
      put(&path, &line[i], 1);
    else
      putf(&path, "%%%02X", c);
  }
  rq->metrics = is_metrics(path.p);

  while (p < end) {
    char name[64], value[1024];
    size_t n = 0, v = 0;
    const char *colon;

    len = next_line(&p, end, &line);
    if (len == 0)
      break; /* the body follows */
    if (len == 6 && memcmp(line, "@token", 6) == 0) {
      snprintf(value, sizeof value, "Authorization: Bearer %s\r\n", token);
      puts_(&headers, value);
      continue;
    }
    if (len == 8 && memcmp(line, "@chunked", 8) == 0) {
      chunked = 1;
      continue;
    }
    if (len == 4 && memcmp(line, "@big", 4) == 0) {
      big = 1;
      continue;
    }
    colon = memchr(line, ':', len);
    if (colon == NULL || nheaders >= MAX_HEADERS)
      continue;
    for (const char *c = line; c < colon && n < sizeof name - 1; c++)
      if (is_tchar((unsigned char)*c))
        name[n++] = *c;
    name[n] = '\0';
    if (n == 0 || is_framing(name))
      continue;
    for (const char *c = colon + 1; c < line + len && v < sizeof value - 1; c++) {
      unsigned char ch = (unsigned char)*c;
      if (ch == '\t' || (ch >= 0x20 && ch != 0x7f))
        value[v++] = *c;
    }
    value[v] = '\0';
    if (header_bytes + n + v + 4 > MAX_HEADER_BYTES)
      continue;
    header_bytes += n + v + 4;
    nheaders++;
    putf(&headers, "%s:", name);
    put(&headers, value, v);
    puts_(&headers, "\r\n");
  }

  /* The body: the rest of the input, padded past the cap for @big. */
  {
    size_t blen = (size_t)(end - p);
    size_t total = big && blen <= IDEMD_MAX_BODY ? IDEMD_MAX_BODY + 1 + blen % 64 : blen;
    char *body = malloc(total + 1);
    FUZZ_CHECK(body != NULL, "out of memory");
    memcpy(body, p, blen);
    memset(body + blen, ' ', total - blen);

    puts_(&rq->bytes, method);
    puts_(&rq->bytes, " ");
    put(&rq->bytes, path.p, path.n);
    putf(&rq->bytes, " HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: close\r\n", srv.port);
    if (headers.n)
      put(&rq->bytes, headers.p, headers.n);
    if (chunked) {
      size_t step = total / 3 + 1;
      puts_(&rq->bytes, "Transfer-Encoding: chunked\r\n\r\n");
      for (size_t off = 0; off < total; off += step) {
        size_t k = total - off < step ? total - off : step;
        putf(&rq->bytes, "%zx\r\n", k);
        put(&rq->bytes, body + off, k);
        puts_(&rq->bytes, "\r\n");
      }
      puts_(&rq->bytes, "0\r\n\r\n");
    } else {
      putf(&rq->bytes, "Content-Length: %zu\r\n\r\n", total);
      put(&rq->bytes, body, total);
    }
    rq->body = body;
    rq->body_len = total;
  }
  free(path.p);
  free(headers.p);
}

/* ---- exchanging it ---------------------------------------------------- */

/* Sends the request and reads until the server closes. Returns 0, or -1
 * when no byte came back within ANSWER_TIMEOUT_MS. */
static int exchange(const buf_t *req, buf_t *answer) {
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)srv.port)};
  int64_t deadline = idem_mono_ms() + ANSWER_TIMEOUT_MS;
  /* Reset on close: hundreds of thousands of exchanges would otherwise
   * leave as many TIME_WAIT sockets and run out of loopback ports. */
  struct linger reset = {1, 0};
  size_t sent = 0;
  int fd = -1, rc = -1;

  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  /* A new socket per try: libFuzzer's timer signal can interrupt connect,
   * and ports in TIME_WAIT from elsewhere can run out for a moment. */
  for (int tries = 0; rc != 0 && tries < 100; tries++) {
    if (fd >= 0) {
      close(fd);
      usleep(10000);
    }
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    FUZZ_CHECK(fd >= 0, "socket: %s", strerror(errno));
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof reset);
    rc = connect(fd, (struct sockaddr *)&a, sizeof a);
    FUZZ_CHECK(rc == 0 || errno == EINTR || errno == EADDRNOTAVAIL, "connect: %s",
               strerror(errno));
  }
  FUZZ_CHECK(rc == 0, "connect: %s (100 tries)", strerror(errno));
  for (;;) {
    struct pollfd pfd = {fd, POLLIN | (sent < req->n ? POLLOUT : 0), 0};
    int64_t left = deadline - idem_mono_ms();
    char chunk[16384];
    ssize_t got;
    int ready;

    if (left <= 0) {
      close(fd);
      return -1;
    }
    ready = poll(&pfd, 1, (int)left);
    if (ready < 0 && errno == EINTR)
      continue;
    if (ready <= 0) {
      close(fd);
      return -1;
    }
    if ((pfd.revents & POLLOUT) && sent < req->n) {
      ssize_t w = send(fd, req->p + sent, req->n - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w > 0)
        sent += (size_t)w;
      else if (w < 0 && errno != EAGAIN && errno != EINTR)
        sent = req->n; /* the server stopped reading: it may have answered */
    }
    if (pfd.revents & (POLLIN | POLLHUP | POLLERR)) {
      got = recv(fd, chunk, sizeof chunk, MSG_DONTWAIT);
      if (got < 0 && (errno == EAGAIN || errno == EINTR))
        continue;
      if (got <= 0)
        break; /* closed (or reset) */
      FUZZ_CHECK(answer->n + (size_t)got <= MAX_ANSWER, "answer larger than %d bytes",
                 MAX_ANSWER);
      put(answer, chunk, (size_t)got);
    }
  }
  close(fd);
  return 0;
}

/* ---- judging the answer ----------------------------------------------- */

static const int documented[] = {200, 201, 202, 400, 401, 402, 404, 405,
                                 409, 413, 415, 422, 431, 503};

static void collect_strings(const json_t *v, buf_t *out) {
  const char *k;
  json_t *child;
  size_t i;
  if (json_is_string(v)) {
    put(out, json_string_value(v), json_string_length(v));
    puts_(out, "\n");
  } else if (json_is_object(v)) {
    json_object_foreach((json_t *)v, k, child) {
      puts_(out, k);
      puts_(out, "\n");
      collect_strings(child, out);
    }
  } else if (json_is_array(v)) {
    json_array_foreach(v, i, child) collect_strings(child, out);
  }
}

/* The header `name` of the answer's head (NUL-terminated), or NULL. */
static const char *header(const char *head, const char *name, char *value, size_t cap) {
  size_t n = strlen(name);
  for (const char *l = strstr(head, "\r\n"); l; l = strstr(l + 2, "\r\n")) {
    if (strncasecmp(l + 2, name, n) == 0 && l[2 + n] == ':') {
      const char *v = l + 3 + n, *e = strstr(v, "\r\n");
      size_t len = e ? (size_t)(e - v) : strlen(v);
      while (len && (*v == ' ' || *v == '\t'))
        v++, len--;
      if (len >= cap)
        len = cap - 1;
      memcpy(value, v, len);
      value[len] = '\0';
      return value;
    }
  }
  return NULL;
}

static void check_error_body(const json_t *j, int status, const char *body) {
  json_t *e = json_object_get(j, "error"), *errors = json_object_get(j, "errors"), *item;
  size_t i;
  FUZZ_CHECK(json_object_size(j) == 1 && (e || errors),
             "%d body holds more than \"error\" or \"errors\": %.300s", status, body);
  if (e) {
    FUZZ_CHECK(json_is_string(e) && json_string_length(e) > 0,
               "%d \"error\" is not a non-empty string: %.300s", status, body);
    return;
  }
  FUZZ_CHECK(status == 422 && json_is_array(errors) && json_array_size(errors) > 0,
             "%d \"errors\" is not a non-empty array in a 422: %.300s", status, body);
  json_array_foreach(errors, i, item) {
    FUZZ_CHECK(json_is_object(item) && json_object_size(item) == 3 &&
                   json_is_string(json_object_get(item, "field")) &&
                   json_is_string(json_object_get(item, "message")) &&
                   json_is_string(json_object_get(item, "code")),
               "errors[%zu] is not {field, message, code}: %.300s", i, body);
  }
}

/* Whether `word` occurs in the `len` bytes at `s`, ignoring ASCII case. */
static int contains_ci(const char *s, size_t len, const char *word) {
  size_t n = strlen(word);
  for (size_t i = 0; i + n <= len; i++)
    if (strncasecmp(s + i, word, n) == 0)
      return 1;
  return 0;
}

static void judge(const request_t *rq, const buf_t *answer) {
  static const char *const forbidden[] = {"/tmp",   "/work",  "idempotency_records",
                                          "INSERT", "SELECT", "sqlite", "jansson", "libpq"};
  enum { FIRST_LIBRARY_NAME = 5 };
  char value[256], *head;
  const char *sep, *body;
  size_t head_len, body_len;
  long status, clen;
  int known = 0;
  json_t *j;
  json_error_t err;

  FUZZ_CHECK(answer->n > 0, "the connection closed without an answer");
  sep = memmem(answer->p, answer->n, "\r\n\r\n", 4);
  FUZZ_CHECK(sep != NULL, "no end of headers in the answer: %.300s", answer->p);
  FUZZ_CHECK(answer->n >= 12 && memcmp(answer->p, "HTTP/1.1 ", 9) == 0,
             "not an HTTP/1.1 answer: %.300s", answer->p);
  head_len = (size_t)(sep - answer->p);
  head = strndup(answer->p, head_len);
  FUZZ_CHECK(head != NULL, "out of memory");
  status = strtol(answer->p + 9, NULL, 10);
  for (size_t i = 0; i < sizeof documented / sizeof *documented; i++)
    known |= documented[i] == status;
  FUZZ_CHECK(known, "undocumented status %ld:\n%.600s", status, answer->p);

  body = sep + 4;
  body_len = answer->n - head_len - 4;
  if (rq->head) {
    free(head);
    return;
  }
  FUZZ_CHECK(header(head, "Content-Length", value, sizeof value) != NULL,
             "%ld answer without Content-Length", status);
  clen = strtol(value, NULL, 10);
  FUZZ_CHECK(clen >= 0 && (size_t)clen == body_len,
             "%ld answer cut short: Content-Length %ld, %zu bytes came", status, clen, body_len);
  if (status == 401)
    FUZZ_CHECK(header(head, "WWW-Authenticate", value, sizeof value) != NULL,
               "401 without WWW-Authenticate");
  if (status == 405)
    FUZZ_CHECK(header(head, "Allow", value, sizeof value) != NULL, "405 without Allow");

  /* No internals, unless the client sent that very text itself. */
  {
    buf_t sent = {0};
    json_t *rb = json_loadb(rq->body, rq->body_len, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
    put(&sent, rq->bytes.p, rq->bytes.n);
    collect_strings(rb, &sent);
    json_decref(rb);
    for (size_t i = 0; i < sizeof forbidden / sizeof *forbidden; i++)
      /* /metrics is for operators, and its help text may name the store
       * ("SQLite group commit"); paths and SQL are still out of place. */
      FUZZ_CHECK((rq->metrics && status == 200 && i >= FIRST_LIBRARY_NAME) ||
                     !contains_ci(body, body_len, forbidden[i]) ||
                     contains_ci(sent.p, sent.n, forbidden[i]),
                 "%ld body shows internals ('%s') the request did not send: %.600s", status,
                 forbidden[i], body);
    free(sent.p);
  }

  if (rq->metrics && status == 200) {
    free(head);
    return;
  }
  FUZZ_CHECK(header(head, "Content-Type", value, sizeof value) != NULL &&
                 strncmp(value, "application/json", 16) == 0,
             "%ld answer is not application/json:\n%.600s", status, answer->p);
  j = json_loadb(body, body_len, 0, &err);
  FUZZ_CHECK(json_is_object(j), "%ld body is not a JSON object (%s): %.600s", status, err.text,
             body);
  if (status == 402) /* docs/api.md: the declined payment, plus "error" */
    FUZZ_CHECK(json_is_string(json_object_get(j, "id")) &&
                   json_is_string(json_object_get(j, "error")) &&
                   json_is_string(json_object_get(j, "status")) &&
                   strcmp(json_string_value(json_object_get(j, "status")), "declined") == 0,
               "402 body is not a declined payment: %.600s", body);
  else if (status >= 400)
    check_error_body(j, (int)status, body);
  json_decref(j);
  free(head);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  request_t rq;
  buf_t answer = {0};

  build(data, size, &rq);
  FUZZ_CHECK(exchange(&rq.bytes, &answer) == 0, "no answer within %d ms to:\n%.600s",
             ANSWER_TIMEOUT_MS, rq.bytes.p);
  judge(&rq, &answer);
  free(answer.p);
  free(rq.body);
  free(rq.bytes.p);
  return 0;
}
