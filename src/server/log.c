/* JSON log lines for requests and events. */
#include "server/log.h"

#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "idem/clock.h"
#include "idem/crypto.h"
#include "util/json_text.h"
#include "util/ticker.h"

static int min_level = 1;

/* Request lines gathered into one write() (stderr is unbuffered: one line
 * was one system call, and appending it to a file a few microseconds of
 * the kernel's time). Into a file, a batch is up to 64 KiB, some 250
 * lines: new-key payments 1.2 % faster than with 4 KiB batches, four
 * alternating pairs, docs/performance.md. Into anything else at most
 * PIPE_BUF (4 KiB): a batch written to a pipe is then never interleaved
 * with another writer's, and a slow reader (a terminal, a socket) holds
 * the lock below for a short write only. Lines wait at most one flush
 * interval. Event lines empty the batch first, then go out at once, so the
 * order holds. LINE_MAX_BYTES bounds a request line. */
#define LINE_MAX_BYTES 1024
#define BATCH_MAX_BYTES 65536
static struct {
  pthread_mutex_t lock;
  int on;
  size_t len, cap; /* cap: the batch's size for this stderr */
  char buf[BATCH_MAX_BYTES];
  idem__ticker_t *ticker;
} batch = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* How many bytes a batch written to stderr may hold. */
static size_t batch_cap(void) {
  struct stat st;
  if (fstat(STDERR_FILENO, &st) == 0 && S_ISREG(st.st_mode))
    return sizeof batch.buf;
  return PIPE_BUF;
}
_Static_assert(PIPE_BUF <= BATCH_MAX_BYTES, "a pipe's batch fits in the buffer");

static void flush_locked(void) {
  if (batch.len > 0)
    fwrite(batch.buf, 1, batch.len, stderr);
  batch.len = 0;
}

static void flush_tick(void *ctx) {
  (void)ctx;
  pthread_mutex_lock(&batch.lock);
  flush_locked();
  pthread_mutex_unlock(&batch.lock);
}

int idemd_log_batch_start(int64_t every_ms) {
  idem__ticker_t *t = idem__ticker_start(every_ms, flush_tick, NULL);
  if (t == NULL)
    return -1;
  pthread_mutex_lock(&batch.lock);
  batch.cap = batch_cap();
  batch.ticker = t;
  batch.on = 1;
  pthread_mutex_unlock(&batch.lock);
  return 0;
}

void idemd_log_batch_stop(void) {
  idem__ticker_t *t;
  pthread_mutex_lock(&batch.lock);
  t = batch.ticker;
  batch.ticker = NULL;
  batch.on = 0;
  flush_locked();
  pthread_mutex_unlock(&batch.lock);
  idem__ticker_stop(t);
}


/* Writes `n` bytes of whole lines: into the batch when there is one. */
static void write_lines(const char *text, size_t n, int batched) {
  pthread_mutex_lock(&batch.lock);
  if (batch.on && batched && n <= LINE_MAX_BYTES) {
    if (batch.len + n > batch.cap)
      flush_locked();
    memcpy(batch.buf + batch.len, text, n);
    batch.len += n;
  } else {
    flush_locked();
    fwrite(text, 1, n, stderr);
  }
  pthread_mutex_unlock(&batch.lock);
}

void idemd_log_line(const char *line, size_t n) {
  if (min_level <= 1)
    write_lines(line, n, 1);
}

static int level_of(const char *name) {
  static const char *const names[] = {"debug", "info", "warn", "error"};
  for (int i = 0; i < 4; i++)
    if (strcmp(name, names[i]) == 0)
      return i;
  return 3;
}

void idemd_log_set_level(const char *level) { min_level = level_of(level); }

/* UTC with milliseconds; the date and time up to the second are made
 * once per second per thread. */
/* Writes ".ddd", `thousandths` (0-999) as three digits, and returns 4. */
static size_t put_fraction(char *out, int thousandths) {
  out[0] = '.';
  out[1] = (char)('0' + thousandths / 100);
  out[2] = (char)('0' + thousandths / 10 % 10);
  out[3] = (char)('0' + thousandths % 10);
  return 4;
}

static void timestamp(char *out, size_t len) {
  static __thread time_t last_sec = -1;
  static __thread char base[24];
  struct timeval tv;
  gettimeofday(&tv, NULL);
  if (tv.tv_sec != last_sec) {
    struct tm tm;
    gmtime_r(&tv.tv_sec, &tm);
    strftime(base, sizeof base, "%Y-%m-%dT%H:%M:%S", &tm);
    last_sec = tv.tv_sec;
  }
  int ms = (int)(tv.tv_usec / 1000) % 1000;
  size_t n = strnlen(base, 20);
  if (len < n + 6) { /* ".mmmZ" and the NUL */
    if (len > 0)
      out[0] = '\0';
    return;
  }
  memcpy(out, base, n);
  n += put_fraction(out + n, ms);
  out[n++] = 'Z';
  out[n] = '\0';
}

static void emit(json_t *line) {
  char *text = json_dumps(line, JSON_COMPACT | JSON_REAL_PRECISION(6));
  if (text) {
    size_t n = strlen(text);
    text[n] = '\n'; /* json_dumps leaves room for the NUL we replace */
    write_lines(text, n + 1, 0);
    free(text);
  }
  json_decref(line);
}

void idemd_log_event(const char *level, const char *msg, ...) {
  char ts[40];
  json_t *line;
  va_list ap;
  const char *k;

  if (level_of(level) < min_level)
    return;
  timestamp(ts, sizeof ts);
  line = json_pack("{s:s, s:s, s:s}", "ts", ts, "level", level, "msg", msg);
  if (line == NULL)
    return;
  va_start(ap, msg);
  while ((k = va_arg(ap, const char *)) != NULL) {
    const char *v = va_arg(ap, const char *);
    if (v != NULL)
      json_object_set_new(line, k, json_string(v));
  }
  va_end(ap);
  emit(line);
}

void idemd_key_id(idemd_request_t *r, const char *operation) {
  unsigned char mac[IDEM_SHA256_LEN];
  char hex[IDEM_SHA256_HEX_LEN];
  char msg[32 + IDEM_OPERATION_MAX + IDEM_KEY_MAX];
  int n = snprintf(msg, sizeof msg, "%lld\n%s\n%s", (long long)r->tenant.id,
                   operation, r->key);

  r->key_id[0] = '\0';
  if (n < 0 || idem_hmac_compute(r->srv->key_id_mac, msg, (size_t)n, mac) != IDEM_OK)
    return;
  idem_hex(mac, 8, hex);
  memcpy(r->key_id, hex, 17);
}

/* A small bounded writer for the request line: the hot path of logging,
 * formatted straight into a buffer rather than through a JSON tree. */
struct line {
  char buf[LINE_MAX_BYTES];
  size_t len;
};

/* The bytes `l` has left for text, keeping room for '}' and '\n'. */
static size_t room(const struct line *l) { return sizeof l->buf - 2 - l->len; }

static void put(struct line *l, const char *s, size_t n) {
  if (n > room(l))
    n = room(l);
  memcpy(l->buf + l->len, s, n);
  l->len += n;
}

#define PUT_LIT(l, lit) put((l), (lit), sizeof(lit) - 1)

/* Escapes at most `raw_max` bytes of `v` into `out` (idem__json_escape_ascii()),
 * at most `cap` bytes of it, never cutting an escape short. */
static size_t escape_whole(char *out, size_t cap, const char *v, size_t raw_max) {
  size_t n = 0;
  if (strnlen(v, raw_max + 1) <= raw_max) {
    n = idem__json_escape_ascii(out, cap, v);
    if (n < cap)
      return n; /* all of it fitted (the usual case) */
  }
  n = 0;
  for (size_t i = 0; i < raw_max && v[i]; i++) {
    char one[2] = {v[i], '\0'}, esc[8];
    size_t k = idem__json_escape_ascii(esc, sizeof esc, one);
    if (k > cap - n)
      break;
    memcpy(out + n, esc, k);
    n += k;
  }
  return n;
}

/* Appends ,"name":"value" with the value escaped as JSON (bytes outside
 * printable ASCII as \u00XX), its first `raw_max` bytes and at most
 * `esc_max` bytes escaped, cut at a whole escape: the line stays valid
 * JSON whatever came in. When not even the name fits, nothing. */
static void put_str_max(struct line *l, const char *name, const char *v, size_t raw_max,
                        size_t esc_max) {
  size_t cap;
  if (strlen(name) + 6 > room(l)) /* ,"":"" */
    return;
  PUT_LIT(l, ",\"");
  put(l, name, strlen(name));
  PUT_LIT(l, "\":\"");
  cap = room(l) - 1; /* the closing quote's */
  l->len += escape_whole(l->buf + l->len, cap < esc_max ? cap : esc_max, v, raw_max);
  PUT_LIT(l, "\"");
}

/* Bounds of the fields of a request line (before and after escaping): the
 * line holds them all, but for a client's path escaped beyond. */
#define FIELD_MAX 128
#define METHOD_MAX 32
#define LOG_PATH_RAW 512
#define LOG_PATH_ESCAPED 400

static void put_str(struct line *l, const char *name, const char *v) {
  put_str_max(l, name, v, FIELD_MAX, 6 * FIELD_MAX);
}

/* Appends ,"name":N, whole or not at all. */
static void put_num(struct line *l, const char *name, const char *num, size_t n) {
  if (strlen(name) + 4 + n > room(l))
    return;
  PUT_LIT(l, ",\"");
  put(l, name, strlen(name));
  PUT_LIT(l, "\":");
  put(l, num, n);
}

/* The fields idemd's and the gateway's request lines share, from "ts" to
 * "path", into `l`. */
static void put_request_head(struct line *l, const char *request_id, const char *method,
                             idemd_op_t op, idemd_outcome_t outcome, int status,
                             int64_t start_us, const char *path) {
  char ts[40], num[64];
  size_t n;
  int64_t us;

  timestamp(ts, sizeof ts);
  PUT_LIT(l, "{\"ts\":\"");
  put(l, ts, strlen(ts));
  PUT_LIT(l, "\",\"level\":\"info\",\"msg\":\"request\"");
  put_str(l, "request_id", request_id);
  put_str_max(l, "method", method ? method : "", METHOD_MAX, 6 * METHOD_MAX);
  put_str(l, "operation", idemd_op_name(op));
  put_str(l, "outcome", idemd_outcome_name(outcome));
  put_num(l, "status", num, idem__json_int(num, status));
  /* latency_ms with three decimals, as %.3f would print it */
  us = idem_mono_us() - start_us;
  if (us < 0)
    us = 0;
  n = idem__json_int(num, us / 1000);
  n += put_fraction(num + n, (int)(us % 1000));
  put_num(l, "latency_ms", num, n);
  put_str_max(l, "path", path ? path : "", LOG_PATH_RAW, LOG_PATH_ESCAPED);
}

void idemd_log_request(const idemd_request_t *r) {
  struct line l = {.len = 0};

  if (min_level > 1)
    return;
  put_request_head(&l, r->request_id, r->method, r->op, r->outcome, r->status, r->start_us,
                   r->path);
  if (r->authenticated)
    put_str(&l, "tenant", r->tenant.name);
  if (r->key_id[0])
    put_str(&l, "key_id", r->key_id);
  if (r->aborted)
    put_num(&l, "aborted", "true", 4);
  l.buf[l.len++] = '}';
  l.buf[l.len++] = '\n';
  write_lines(l.buf, l.len, 1);
}

void idemd_log_gateway_request(const idemd_gateway_line_t *g) {
  struct line l = {.len = 0};

  if (min_level > 1)
    return;
  put_request_head(&l, g->request_id, g->method, g->op, g->outcome, g->status, g->start_us,
                   g->path);
  if (g->route)
    put_str(&l, "route", g->route);
  if (g->key_id && g->key_id[0])
    put_str(&l, "key_id", g->key_id);
  l.buf[l.len++] = '}';
  l.buf[l.len++] = '\n';
  write_lines(l.buf, l.len, 1);
}
