/* The gateway's HTTP side (docs/gateway.md): libmicrohttpd's event
 * threads, which never wait (a keyed request goes on without a thread on
 * SQLite, gateway/keyed.c; on PostgreSQL, and for the proxy's call,
 * idemd's workers, server/workers.h, with the connection suspended), the
 * streaming proxy for requests outside the keyed routes, the admin
 * listener (GET /healthz, /metrics) on a port of its own, the log line of
 * each request, start-up and shutdown. */
#include <arpa/inet.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "gateway/answer.h"
#include "gateway/request.h"
#include "gateway/requests.h"
#include "gateway/resolver.h"
#include "idem/clock.h"
#include "server/log.h"
#include "server/replay_cache.h"
#include "util/ticker.h"

/* How long SIGTERM lets requests in flight finish. */
#define DRAIN_MS 10000
/* Threads for the steps that wait (store writes, the application, a
 * duplicate in flight); of them, eight per core at work at once, those
 * waiting on the application or a duplicate not counted: eight per core
 * measured best for new keys of 4, 8, 32 and 128 (docs/gateway.md). */
#define WORKERS 256
/* How often the resolver looks for unsettled keys that are due. */
#define RESOLVE_EVERY_MS 500
/* Bytes of ready replays kept in memory (keyed.c). */
#define REPLAY_CACHE_BYTES (64u << 20)
/* How often requests parked on a duplicate in flight are woken when their
 * wait ran out (idem_engine_expire()). */
#define EXPIRE_EVERY_MS 20

static atomic_int inflight;

/* ---- headers, both ways ---- */

struct gather_headers {
  char **lines;
  int n, cap;
  const char *connection; /* the request's Connection header */
  const char *key;        /* a keyed route's parsed key, or NULL */
  char *xff;              /* the client's X-Forwarded-For values, joined */
  int failed;
};

static int push_line(struct gather_headers *g, const char *name, const char *value) {
  size_t len = strlen(name) + strlen(value) + 3;
  char *line;
  if (g->n + 2 > g->cap) {
    int cap = g->cap ? g->cap * 2 : 32;
    char **l = realloc(g->lines, (size_t)cap * sizeof *l);
    if (l == NULL)
      return -1;
    g->lines = l;
    g->cap = cap;
  }
  if ((line = malloc(len)) == NULL)
    return -1;
  /* libcurl takes "Name:" as "remove the header"; "Name;" sends it empty. */
  if (value[0] == '\0')
    snprintf(line, len, "%s;", name);
  else
    snprintf(line, len, "%s: %s", name, value);
  g->lines[g->n++] = line;
  g->lines[g->n] = NULL;
  return 0;
}

static enum MHD_Result collect_header(void *arg, enum MHD_ValueKind kind, const char *name,
                                      const char *value) {
  struct gather_headers *g = arg;
  (void)kind;
  /* The body goes as curl frames it; an Expect is answered here. */
  if (gw_hop_by_hop(name, g->connection) || strcasecmp(name, "Content-Length") == 0 ||
      strcasecmp(name, "Expect") == 0)
    return MHD_YES;
  /* A keyed request's key goes as parsed, once (below): not as the client
   * spelled it, nor dropped when Connection names it. */
  if (g->key && strcasecmp(name, "Idempotency-Key") == 0)
    return MHD_YES;
  /* The client's address is appended to the X-Forwarded-For it sent. */
  if (strcasecmp(name, "X-Forwarded-For") == 0) {
    size_t have = g->xff ? strlen(g->xff) : 0, add = strlen(value ? value : "");
    char *x = add ? realloc(g->xff, have + add + 3) : g->xff;
    if (add && x == NULL) {
      g->failed = 1;
      return MHD_NO;
    }
    if (add) {
      snprintf(x + have, add + 3, "%s%s", have ? ", " : "", value);
      g->xff = x;
    }
    return MHD_YES;
  }
  if (push_line(g, name, value ? value : "") != 0) {
    g->failed = 1;
    return MHD_NO;
  }
  return MHD_YES;
}

char **gw_forward_headers(const gw_req_t *r, const char *key) {
  struct gather_headers g = {.key = key};
  const union MHD_ConnectionInfo *ci =
      MHD_get_connection_info(r->conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
  char ip[INET6_ADDRSTRLEN] = "unknown", fwd[INET6_ADDRSTRLEN + 32];

  g.connection = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, "Connection");
  MHD_get_connection_values(r->conn, MHD_HEADER_KIND, collect_header, &g);
  if (ci && ci->client_addr) {
    const struct sockaddr *sa = ci->client_addr;
    if (sa->sa_family == AF_INET)
      inet_ntop(AF_INET, &((const struct sockaddr_in *)sa)->sin_addr, ip, sizeof ip);
    else if (sa->sa_family == AF_INET6)
      inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)sa)->sin6_addr, ip, sizeof ip);
  }
  /* RFC 7239: an IPv6 address is quoted and bracketed. */
  if (strchr(ip, ':'))
    snprintf(fwd, sizeof fwd, "for=\"[%s]\";proto=http", ip);
  else
    snprintf(fwd, sizeof fwd, "for=%s;proto=http", ip);
  if (g.xff) {
    char *x = realloc(g.xff, strlen(g.xff) + strlen(ip) + 3);
    if (x == NULL) {
      g.failed = 1;
    } else {
      g.xff = x;
      strcat(strcat(g.xff, ", "), ip);
    }
  }
  if (g.failed || (key && push_line(&g, "Idempotency-Key", key) != 0) ||
      push_line(&g, "X-Forwarded-For", g.xff ? g.xff : ip) != 0 ||
      push_line(&g, "Forwarded", fwd) != 0) {
    free(g.xff);
    gw_free_lines(g.lines);
    return NULL;
  }
  free(g.xff);
  return g.lines;
}

void gw_free_lines(char **lines) {
  for (char **l = lines; l && *l; l++)
    free(*l);
  free(lines);
}

/* An answer to HEAD has no body; its Content-Length is the one the
 * application sent, or -1. */
static long long head_length(const gw_req_t *r, const gw_answer_t *a) {
  if (r->method == NULL || strcmp(r->method, "HEAD") != 0)
    return -1;
  for (int i = 0; i < a->nheaders; i++)
    if (strcasecmp(a->headers[i].name, "Content-Length") == 0) {
      char *end;
      long long n = strtoll(a->headers[i].value, &end, 10);
      return *end == '\0' && n >= 0 && end != a->headers[i].value ? n : -1;
    }
  return -1;
}

/* Never called: libmicrohttpd sends no body for HEAD, only the size. */
static ssize_t no_body(void *cls, uint64_t pos, char *buf, size_t max) {
  (void)cls;
  (void)pos;
  (void)buf;
  (void)max;
  return MHD_CONTENT_READER_END_OF_STREAM;
}

struct MHD_Response *gw_response(const gw_req_t *r, const gw_answer_t *a,
                                 const char *const *extra) {
  long long head = head_length(r, a);
  struct MHD_Response *resp =
      head >= 0 ? MHD_create_response_from_callback((uint64_t)head, 4096, no_body, NULL, NULL)
                : MHD_create_response_from_buffer(a->len, a->body ? a->body : (void *)"",
                                                  MHD_RESPMEM_MUST_COPY);
  const char *connection = NULL;

  if (resp == NULL)
    return NULL;
  for (int i = 0; i < a->nheaders; i++)
    if (strcasecmp(a->headers[i].name, "Connection") == 0)
      connection = a->headers[i].value;
  for (int i = 0; i < a->nheaders; i++) {
    const char *name = a->headers[i].name;
    if (gw_hop_by_hop(name, connection))
      continue;
    if (strcasecmp(name, "Content-Length") == 0)
      continue; /* libmicrohttpd frames the body (for HEAD: head_length()) */
    MHD_add_response_header(resp, name, a->headers[i].value);
  }
  for (const char *const *e = extra; e && e[0] && e[1]; e += 2)
    MHD_add_response_header(resp, e[0], e[1]);
  return resp;
}

enum MHD_Result gw_send(gw_req_t *r, const gw_answer_t *a, const char *const *extra) {
  struct MHD_Response *resp = gw_response(r, a, extra);
  enum MHD_Result ret;

  if (resp == NULL)
    return MHD_NO;
  r->status = a->status;
  if (r->in_worker) { /* queued once the connection is resumed */
    r->response = resp;
    return MHD_YES;
  }
  ret = MHD_queue_response(r->conn, (unsigned)a->status, resp);
  MHD_destroy_response(resp);
  return ret;
}

#define GW_REQ_OF(w) ((gw_req_t *)((char *)(w) - offsetof(gw_req_t, work)))

static void run_step(idemd_work_t *w) {
  gw_req_t *r = GW_REQ_OF(w);
  enum MHD_Result (*step)(gw_req_t *) = r->step;

  r->step = NULL;
  r->in_worker = 1;
  if (step(r) != MHD_YES || r->response == NULL) {
    /* No answer could be made (out of memory): the connection is cut. */
    if (r->response)
      MHD_destroy_response(r->response);
    r->response = NULL;
    r->status = -1;
  }
  r->in_worker = 0;
  MHD_resume_connection(r->conn);
}

enum MHD_Result gw_defer(gw_req_t *r, enum MHD_Result (*step)(gw_req_t *r)) {
  r->step = step;
  r->work.run = run_step;
  MHD_suspend_connection(r->conn);
  if (idemd_workers_submit(r->gw->workers, &r->work) == 0)
    return MHD_YES;
  /* Shutting down: no worker takes it. */
  r->step = NULL;
  r->in_worker = 1;
  r->outcome = OUTCOME_ERROR;
  (void)gw_send_error(r, 503, "the gateway is stopping; retry");
  r->in_worker = 0;
  MHD_resume_connection(r->conn);
  return MHD_YES;
}

enum MHD_Result gw_send_error(gw_req_t *r, int status, const char *msg) {
  static const char *const retry[] = {"Retry-After", "1", NULL};
  json_t *doc = json_pack("{s:s}", "error", msg);
  char *body = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
  gw_answer_t a = {0};
  enum MHD_Result ret = MHD_NO;

  json_decref(doc);
  if (body && gw_answer_own(status, body, &a) == IDEM_OK)
    ret = gw_send(r, &a, status == 409 || status == 503 ? retry : NULL);
  gw_answer_free(&a);
  free(body);
  return ret;
}

/* ---- the proxy ---- */

/* RFC 9110, section 9.2.2: a request with such a method may be sent
 * again after a connection failed. */
static int idempotent_method(const char *m) {
  static const char *const ok[] = {"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"};
  for (size_t i = 0; i < sizeof ok / sizeof *ok; i++)
    if (strcmp(m, ok[i]) == 0)
      return 1;
  return 0;
}

/* ---- the proxy's answers, streamed (docs/gateway.md, "Everything else") ----
 *
 * A worker makes the call (gw_upstream_stream()); at the first byte of
 * the answer's body its head goes to the client (the connection resumed
 * with a response read from `struct stream`), and the body follows
 * through a bounded buffer: the worker waits while it is full (the
 * client's pace holds the upstream back), and the event thread, finding
 * it empty, suspends the connection until the worker resumes it. The
 * stream is shared by the worker and the response, freed by the last. */

/* Bytes of an answer held at once between the upstream and the client. */
#define STREAM_BUF (256 * 1024)
/* How long a full buffer waits for the client before the call is cut. */
#define STREAM_STALL_MS 60000
/* Proxied requests at once, each holding a worker for its whole answer:
 * beyond, 503 with Retry-After, so that slow streams never take every
 * worker from the keyed requests (docs/gateway.md, "Everything else"). */
#define MAX_STREAMS (WORKERS / 2)

static atomic_int streams; /* proxied requests under way */

struct stream {
  pthread_mutex_t lock;
  pthread_cond_t room; /* signalled when the client took bytes, or left */
  struct MHD_Connection *conn;
  char *buf;
  size_t start, len; /* the bytes waiting, as a ring in buf[STREAM_BUF] */
  int refs;          /* the worker's and, once made, the response's */
  int done;          /* 1: the upstream's answer is over; -1: cut short */
  int gone;          /* the response is freed: the client is gone or served */
  int suspended;     /* the event thread found it empty and suspended */
  gw_req_t *r;       /* until the head is sent; not touched after */
  int head_sent;
  atomic_int *draining; /* the gateway's: the stream is cut once it is set */
};

static void stream_unref(struct stream *st) {
  int last;
  pthread_mutex_lock(&st->lock);
  last = --st->refs == 0;
  pthread_mutex_unlock(&st->lock);
  if (!last)
    return;
  pthread_mutex_destroy(&st->lock);
  pthread_cond_destroy(&st->room);
  free(st->buf);
  free(st);
}

/* The response's end: the client has all of it, or is gone. */
static void stream_freed(void *cls) {
  struct stream *st = cls;
  pthread_mutex_lock(&st->lock);
  st->gone = 1;
  pthread_cond_broadcast(&st->room);
  pthread_mutex_unlock(&st->lock);
  stream_unref(st);
}

/* Gives the connection back to its event thread if it waits for bytes;
 * `st->lock` held. A suspended connection is alive: it is not closed
 * while suspended. */
static void stream_wake(struct stream *st) {
  if (st->suspended) {
    st->suspended = 0;
    MHD_resume_connection(st->conn);
  }
}

/* libmicrohttpd's reader, on the event thread. */
static ssize_t stream_read(void *cls, uint64_t pos, char *out, size_t max) {
  struct stream *st = cls;
  ssize_t n;
  (void)pos;
  pthread_mutex_lock(&st->lock);
  if (st->len > 0) {
    size_t take = st->len < max ? st->len : max;
    size_t first = STREAM_BUF - st->start < take ? STREAM_BUF - st->start : take;
    memcpy(out, st->buf + st->start, first);
    memcpy(out + first, st->buf, take - first);
    st->start = (st->start + take) % STREAM_BUF;
    st->len -= take;
    pthread_cond_broadcast(&st->room);
    n = (ssize_t)take;
  } else if (st->done != 0) {
    n = st->done > 0 ? MHD_CONTENT_READER_END_OF_STREAM : MHD_CONTENT_READER_END_WITH_ERROR;
  } else {
    /* Nothing yet: no busy loop; the worker resumes it (stream_wake()). */
    st->suspended = 1;
    MHD_suspend_connection(st->conn);
    n = 0;
  }
  pthread_mutex_unlock(&st->lock);
  return n;
}

/* The value of `name` in `a`, or NULL. */
static const char *answer_header(const gw_answer_t *a, const char *name) {
  for (int i = 0; i < a->nheaders; i++)
    if (strcasecmp(a->headers[i].name, name) == 0)
      return a->headers[i].value;
  return NULL;
}

/* The sink's on_head, on the worker: the response made and the
 * connection resumed, which queues it (handle()). */
static int stream_head(void *arg, const gw_answer_t *a) {
  struct stream *st = arg;
  gw_req_t *r = st->r;
  const char *cl = answer_header(a, "Content-Length");
  uint64_t size = MHD_SIZE_UNKNOWN; /* chunked to the client, as the upstream's was */
  struct MHD_Response *resp;
  const char *connection = answer_header(a, "Connection");

  if (cl && answer_header(a, "Transfer-Encoding") == NULL) {
    char *end;
    unsigned long long v = strtoull(cl, &end, 10);
    if (*cl >= '0' && *cl <= '9' && *end == '\0')
      size = v;
  }
  resp = MHD_create_response_from_callback(size, 32 * 1024, stream_read, st, stream_freed);
  if (resp == NULL)
    return -1;
  for (int i = 0; i < a->nheaders; i++) {
    const char *name = a->headers[i].name;
    if (gw_hop_by_hop(name, connection) || strcasecmp(name, "Content-Length") == 0)
      continue;
    MHD_add_response_header(resp, name, a->headers[i].value);
  }
  pthread_mutex_lock(&st->lock);
  st->refs++; /* the response's */
  st->head_sent = 1;
  pthread_mutex_unlock(&st->lock);
  r->status = a->status;
  r->response = resp;
  r->in_worker = 0;
  st->r = NULL;
  MHD_resume_connection(r->conn); /* `r` is the event thread's from here */
  return 0;
}

/* The sink's on_data, on the worker: into the buffer, waiting for room. */
static int stream_data(void *arg, const char *data, size_t n) {
  struct stream *st = arg;
  int rc = 0, stalled = 0;
  pthread_mutex_lock(&st->lock);
  while (n > 0 && !st->gone) {
    size_t room = STREAM_BUF - st->len, put, at, first;
    if (atomic_load(st->draining))
      break; /* the gateway stops: cut */
    if (room == 0) {
      /* Waits a second at a time, to see the gateway stop. */
      struct timespec until;
      clock_gettime(CLOCK_REALTIME, &until);
      until.tv_sec += 1;
      if (pthread_cond_timedwait(&st->room, &st->lock, &until) != 0 && st->len == STREAM_BUF &&
          ++stalled >= STREAM_STALL_MS / 1000)
        break; /* the client reads nothing: cut */
      continue;
    }
    stalled = 0;
    put = n < room ? n : room;
    at = (st->start + st->len) % STREAM_BUF;
    first = STREAM_BUF - at < put ? STREAM_BUF - at : put;
    memcpy(st->buf + at, data, first);
    memcpy(st->buf, data + first, put - first);
    st->len += put;
    data += put;
    n -= put;
    stream_wake(st);
  }
  if (n > 0)
    rc = -1;
  pthread_mutex_unlock(&st->lock);
  return rc;
}

/* The sink's cut: once the gateway drains, a stream ends, cut short, so
 * that shutdown does not wait on a slow upstream or client. */
static int stream_cut(void *arg) {
  struct stream *st = arg;
  return atomic_load(st->draining);
}

/* Any request outside the keyed routes, on a worker: sent on as it came,
 * its answer streamed back as it comes (docs/gateway.md, "Everything
 * else"). HEAD's answer has no body: as gw_send() sends it. */
static void proxy_work(idemd_work_t *w) {
  gw_req_t *r = GW_REQ_OF(w);
  struct stream *st = calloc(1, sizeof *st);
  char **headers = gw_forward_headers(r, NULL);
  /* What the call borrows is its own: the client may leave, and `r` be
   * freed, while the call still goes on. */
  char *method = strdup(r->method), *target = strdup(r->target), *body = r->body;
  size_t body_len = r->body_len;
  gw_up_result_t res;
  gw_answer_t a;
  gw_up_stream_t sink = {stream_head, stream_data, stream_cut, st};
  gw_up_request_t up;
  int head_sent = 0;

  r->body = NULL;
  r->in_worker = 1;
  if (st == NULL || headers == NULL || method == NULL || target == NULL ||
      (st->buf = malloc(STREAM_BUF)) == NULL) {
    if (st)
      free(st->buf);
    free(st);
    st = NULL;
    (void)gw_send_error(r, 500, "internal error");
    goto out;
  }
  pthread_mutex_init(&st->lock, NULL);
  pthread_cond_init(&st->room, NULL);
  st->conn = r->conn;
  st->r = r;
  st->refs = 1;
  st->draining = &r->gw->draining;
  up = (gw_up_request_t){.method = method, .target = target,
                         .headers = (const char *const *)headers, .body = body,
                         .body_len = body_len, .once = !idempotent_method(method)};
  idemd_workers_wait_begin(); /* on the application, not the store */
  res = strcmp(method, "HEAD") == 0 ? gw_upstream_call(r->gw->upstream, &up, &a)
                                    : gw_upstream_stream(r->gw->upstream, &up, &sink, &a);
  idemd_workers_wait_end();
  pthread_mutex_lock(&st->lock);
  head_sent = st->head_sent;
  if (head_sent) {
    st->done = res == GW_UP_ANSWERED ? 1 : -1;
    stream_wake(st);
  }
  pthread_mutex_unlock(&st->lock);
  if (!head_sent) {
    if (res == GW_UP_ANSWERED)
      (void)gw_send(r, &a, NULL);
    else if (res == GW_UP_TOO_LARGE)
      (void)gw_send_error(r, 502, "the upstream's answer was too large");
    else if (res == GW_UP_NOT_SENT)
      (void)gw_send_error(r, 502, "the upstream cannot be reached");
    else
      (void)gw_send_error(r, 504, "the upstream did not answer");
  }
  gw_answer_free(&a);
  stream_unref(st);
out:
  gw_free_lines(headers);
  free(method);
  free(target);
  free(body);
  if (st == NULL || !head_sent) {
    /* Not resumed yet: the answer made here, or none (cut). */
    if (r->response == NULL)
      r->status = -1;
    r->in_worker = 0;
    MHD_resume_connection(r->conn);
  }
  atomic_fetch_sub(&streams, 1);
}

static enum MHD_Result proxy(gw_req_t *r) {
  r->op = OP_PROXY;
  r->outcome = OUTCOME_NONE;
  if (r->body_too_large)
    return gw_send_error(r, 413, "request body too large");
  if (atomic_load(&r->gw->draining)) {
    r->outcome = OUTCOME_ERROR;
    return gw_send_error(r, 503, "the gateway is stopping; retry");
  }
  if (atomic_fetch_add(&streams, 1) >= MAX_STREAMS) {
    atomic_fetch_sub(&streams, 1);
    r->outcome = OUTCOME_ERROR;
    return gw_send_error(r, 503, "too many pass-through requests at once; retry");
  }
  r->work.run = proxy_work;
  MHD_suspend_connection(r->conn);
  if (idemd_workers_submit(r->gw->workers, &r->work) == 0)
    return MHD_YES;
  /* Shutting down: no worker takes it. */
  atomic_fetch_sub(&streams, 1);
  r->in_worker = 1;
  r->outcome = OUTCOME_ERROR;
  (void)gw_send_error(r, 503, "the gateway is stopping; retry");
  r->in_worker = 0;
  MHD_resume_connection(r->conn);
  return MHD_YES;
}

/* ---- requests ---- */

/* Before the headers are parsed: the request-target exactly as sent. */
static void *on_uri(void *cls, const char *uri, struct MHD_Connection *conn) {
  gw_req_t *r = calloc(1, sizeof *r);
  const char *q;
  if (r == NULL)
    return NULL;
  r->gw = cls;
  r->conn = conn;
  r->start_us = idem_mono_us();
  r->target = strdup(uri ? uri : "/");
  q = r->target ? strchr(r->target, '?') : NULL;
  r->path = r->target ? strndup(r->target, q ? (size_t)(q - r->target) : strlen(r->target))
                      : NULL;
  if (idem_random_token(r->request_id, 16) != IDEM_OK)
    snprintf(r->request_id, sizeof r->request_id, "0");
  atomic_fetch_add(&inflight, 1);
  return r;
}

static int append_body(gw_req_t *r, const char *data, size_t n) {
  if (r->body_too_large || r->body_len + n > (size_t)r->gw->cfg.max_body) {
    r->body_too_large = 1;
    return 0;
  }
  if (r->body_len + n + 1 > r->body_cap) {
    size_t cap = r->body_cap ? r->body_cap : 1024;
    char *b;
    while (cap < r->body_len + n + 1)
      cap *= 2;
    if ((b = realloc(r->body, cap)) == NULL)
      return -1;
    r->body = b;
    r->body_cap = cap;
  }
  memcpy(r->body + r->body_len, data, n);
  r->body_len += n;
  r->body[r->body_len] = '\0';
  return 0;
}

/* 1 when the header was folded over lines (obs-fold, RFC 9112 section
 * 5.2). libmicrohttpd 0.9.75 keeps a header's name and value where they
 * were read, "Name\0 value" with the colon made NUL, but appends the
 * folded part to the name, copied elsewhere: "X-F: a\r\n b" comes as
 * "X-Fb: a". So a value not right after its name, past the colon and
 * blanks, is the sign of a folded line. */
static int folded(const char *name, const char *value) {
  uintptr_t at = (uintptr_t)(name + strlen(name) + 1), v = (uintptr_t)value;
  if (value == NULL)
    return 0;
  if (v < at || v - at > 4096)
    return 1;
  for (const char *p = name + strlen(name) + 1; p < value; p++)
    if (*p != ' ' && *p != '\t')
      return 1;
  return 0;
}

struct header_check {
  int bad_line; /* a name not a token, a value with a control byte */
  int hosts, types;
};

static enum MHD_Result check_header(void *arg, enum MHD_ValueKind kind, const char *name,
                                    const char *value) {
  struct header_check *c = arg;
  (void)kind;
  if (!gw_header_ok(name, value) || folded(name, value)) {
    c->bad_line = 1;
    return MHD_NO;
  }
  if (strcasecmp(name, "Host") == 0)
    c->hosts++;
  if (strcasecmp(name, "Content-Type") == 0)
    c->types++;
  return MHD_YES;
}

/* What the gateway refuses before routing (docs/gateway.md, "What the
 * gateway refuses"): a request-target or a header the upstream could read
 * otherwise than the gateway does. NULL when `r` may go on, else why. */
static const char *refused(gw_req_t *r) {
  struct header_check c = {0};
  const char *why = NULL;

  MHD_get_connection_values(r->conn, MHD_HEADER_KIND, check_header, &c);
  if (!gw_target_ok(r->target))
    why = "the request-target must be a path starting with '/', of the bytes 0x21-0x7E "
          "without '#', and without '.' or '..' segments";
  else if (c.bad_line)
    why = "a header name is not a token, or a header value holds a control byte";
  else if (c.hosts > 1)
    why = "Host must be sent once";
  else if (c.types > 1) /* the fingerprint and the application might read two */
    why = "Content-Type must be sent at most once";
  return why;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *upload,
                              size_t *upload_size, void **con_cls) {
  gw_req_t *r = *con_cls;
  const gw_route_t *route;
  const char *why;
  (void)cls;
  (void)url;
  (void)version;

  if (r == NULL || r->target == NULL || r->path == NULL)
    return MHD_NO;
  /* The first call has the headers only. */
  if (r->method == NULL) {
    r->method = method;
    return MHD_YES;
  }
  if (*upload_size > 0) {
    if (append_body(r, upload, *upload_size) != 0)
      return MHD_NO;
    *upload_size = 0;
    return MHD_YES;
  }
  if (r->resume) /* resumed, the keyed flow going on here */
    return r->resume(r);
  if (r->response || r->status < 0) { /* resumed, with a worker's answer */
    enum MHD_Result ret = MHD_NO;
    if (r->response) {
      ret = MHD_queue_response(conn, (unsigned)r->status, r->response);
      MHD_destroy_response(r->response);
      r->response = NULL;
    }
    return ret;
  }
  if ((why = refused(r)) != NULL) {
    r->outcome = OUTCOME_INVALID;
    return gw_send_error(r, 400, why);
  }
  route = gw_route_match(&r->gw->cfg, method, r->path);
  return route ? gw_keyed(r, route) : proxy(r);
}

static void log_request(const gw_req_t *r) {
  char path[260];
  size_t plen = 0;
  idemd_gateway_line_t line = {.request_id = r->request_id, .method = r->method,
                               .path = path, .route = r->route, .key_id = r->key_id,
                               .op = r->op, .outcome = r->outcome, .status = r->status,
                               .start_us = r->start_us};
  /* A path is the client's bytes: any that is not printable ASCII is
   * written %XX, so the line packs whatever it held. */
  for (const unsigned char *p = (const unsigned char *)(r->path ? r->path : "");
       *p && plen < sizeof path - 4; p++) {
    if (*p < 0x20 || *p > 0x7e)
      plen += (size_t)snprintf(path + plen, sizeof path - plen, "%%%02X", *p);
    else
      path[plen++] = (char)*p;
  }
  path[plen] = '\0';
  idemd_log_gateway_request(&line);
}

static void on_done(void *cls, struct MHD_Connection *conn, void **con_cls,
                    enum MHD_RequestTerminationCode code) {
  gw_req_t *r = *con_cls;
  (void)cls;
  (void)conn;
  if (r == NULL)
    return;
  if (r->method && r->status > 0) {
    idemd_metrics_request(&r->gw->metrics, r->op, r->outcome, idem_mono_us() - r->start_us);
    log_request(r);
  }
  (void)code;
  if (r->response)
    MHD_destroy_response(r->response);
  gw_keyed_free(r);
  free(r->body);
  free(r->target);
  free(r->path);
  free(r);
  *con_cls = NULL;
  atomic_fetch_sub(&inflight, 1);
}

/* ---- the admin listener ---- */

static char *render_metrics(gw_t *gw) {
  idemd_store_gauges_t g = {.pending = -1, .processing = -1,
                            .store_backend = idem_store_backend(gw->store)};
  idem_store_stats_t st;
  int64_t oldest = 0;
  char *base, *out;
  size_t len;

  if (idem_store_count(gw->store, "pending", 0, &g.pending) != IDEM_OK)
    g.pending = -1;
  if (idem_store_count(gw->store, "processing", 0, &g.processing) != IDEM_OK)
    g.processing = -1;
  if (idem_store_count(gw->store, "oldest_pending", 0, &oldest) == IDEM_OK && oldest > 0)
    g.oldest_pending_seconds = (double)(idem_now_ms() - oldest) / 1000.0;
  idem_store_stats(gw->store, &st);
  g.store_commits = st.commits;
  g.store_writes = st.writes;
  g.store_batch_reruns = st.batch_reruns;
  g.replay_cache_hits = idemd_replay_cache_hits(gw->replays);
  if ((base = idemd_metrics_render(&gw->metrics, &g)) == NULL)
    return NULL;
  len = strlen(base) + 1024;
  if ((out = malloc(len)) == NULL) {
    free(base);
    return NULL;
  }
  snprintf(out, len,
           "%s# HELP idem_gateway_upstream_not_sent_total Keyed requests the upstream "
           "refused before anything was sent (503, key free).\n"
           "# TYPE idem_gateway_upstream_not_sent_total counter\n"
           "idem_gateway_upstream_not_sent_total %llu\n"
           "# HELP idem_gateway_upstream_no_answer_total Keyed requests sent with no "
           "answer (pending).\n# TYPE idem_gateway_upstream_no_answer_total counter\n"
           "idem_gateway_upstream_no_answer_total %llu\n"
           "# HELP idem_gateway_answers_too_large_total Keyed answers over --max-answer "
           "(kept as 502).\n# TYPE idem_gateway_answers_too_large_total counter\n"
           "idem_gateway_answers_too_large_total %llu\n"
           "# HELP idem_gateway_resolved_total Pending records the resolver completed "
           "with the upstream's answer.\n# TYPE idem_gateway_resolved_total counter\n"
           "idem_gateway_resolved_total %llu\n",
           base, (unsigned long long)atomic_load(&gw->counters.upstream_not_sent),
           (unsigned long long)atomic_load(&gw->counters.upstream_no_answer),
           (unsigned long long)atomic_load(&gw->counters.answers_too_large),
           (unsigned long long)atomic_load(&gw->counters.resolved));
  free(base);
  return out;
}

static enum MHD_Result admin_reply(struct MHD_Connection *conn, unsigned status,
                                   const char *type, char *body) {
  struct MHD_Response *resp =
      MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
  enum MHD_Result ret;
  if (resp == NULL) {
    free(body);
    return MHD_NO;
  }
  MHD_add_response_header(resp, "Content-Type", type);
  ret = MHD_queue_response(conn, status, resp);
  MHD_destroy_response(resp);
  return ret;
}

static enum MHD_Result admin(void *cls, struct MHD_Connection *conn, const char *url,
                             const char *method, const char *version, const char *upload,
                             size_t *upload_size, void **con_cls) {
  gw_t *gw = cls;
  char *body;
  (void)version;
  (void)upload;
  if (*con_cls == NULL) {
    *con_cls = (void *)1;
    return MHD_YES;
  }
  if (*upload_size > 0) {
    *upload_size = 0;
    return MHD_YES;
  }
  if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
    return admin_reply(conn, 405, "application/json",
                       strdup("{\"error\":\"method not allowed\"}"));
  if (strcmp(url, "/healthz") == 0) {
    int ok = idem_store_ping(gw->store) == IDEM_OK;
    return admin_reply(conn, ok ? 200 : 503, "application/json",
                       strdup(ok ? "{\"status\":\"ok\"}" : "{\"status\":\"unavailable\"}"));
  }
  if (strcmp(url, "/metrics") == 0 && (body = render_metrics(gw)) != NULL)
    return admin_reply(conn, 200, "text/plain; version=0.0.4", body);
  return admin_reply(conn, 404, "application/json", strdup("{\"error\":\"not found\"}"));
}

/* ---- start and stop ---- */

/* libmicrohttpd's event threads: one per core. They never wait on the
 * store's writes or the application: those steps go to the workers. */
static unsigned event_threads(void) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n < 1 ? 1u : n > 64 ? 64u : (unsigned)n;
}

static struct MHD_Daemon *listen_on(const idemd_addr_t *a, unsigned flags,
                                    MHD_AccessHandlerCallback fn, gw_t *gw, int extra,
                                    int *port) {
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_PASSIVE};
  struct addrinfo *ai = NULL;
  struct MHD_Daemon *d;
  const union MHD_DaemonInfo *info;
  char portstr[8];

  snprintf(portstr, sizeof portstr, "%d", a->port);
  if (getaddrinfo(a->host, portstr, &hints, &ai) != 0 || ai == NULL)
    return NULL;
  if (ai->ai_family == AF_INET6)
    flags |= MHD_USE_IPv6;
  if (extra)
    d = MHD_start_daemon(flags, 0, NULL, NULL, fn, gw, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                         MHD_OPTION_THREAD_POOL_SIZE, event_threads(),
                         MHD_OPTION_CONNECTION_LIMIT, (unsigned)gw->cfg.max_connections,
                         MHD_OPTION_CONNECTION_TIMEOUT, 60u, MHD_OPTION_STRICT_FOR_CLIENT,
                         1, MHD_OPTION_URI_LOG_CALLBACK,
                         on_uri, gw, MHD_OPTION_NOTIFY_COMPLETED, on_done, gw,
                         MHD_OPTION_END);
  else
    d = MHD_start_daemon(flags, 0, NULL, NULL, fn, gw, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                         MHD_OPTION_CONNECTION_TIMEOUT, 10u, MHD_OPTION_END);
  freeaddrinfo(ai);
  if (d && (info = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT)) != NULL)
    *port = info->port;
  return d;
}

int gw_secret_mac(idem_store_t *store, const char *name, const char *given,
                  idem_hmac_t **out) {
  unsigned char raw[32], key[IDEM_SHA256_LEN];
  char hex[65];
  char *secret = NULL;
  int rc;

  if (given && given[0]) {
    rc = idem_sha256(given, strlen(given), key);
  } else {
    if ((rc = idem_random_bytes(raw, sizeof raw)) != IDEM_OK)
      return rc;
    idem_hex(raw, sizeof raw, hex);
    if ((rc = idem_store_meta_get_or_put(store, name, hex, &secret)) != IDEM_OK)
      return rc;
    rc = idem_sha256(secret, strlen(secret), key);
    free(secret);
  }
  if (rc == IDEM_OK && (*out = idem_hmac_new(key, sizeof key)) == NULL)
    rc = IDEM_ENOMEM;
  return rc;
}

/* A worker waiting on a duplicate in flight does not count as at work. */
static void on_wait(void *arg, int waiting) {
  (void)arg;
  if (waiting)
    idemd_workers_wait_begin();
  else
    idemd_workers_wait_end();
}

static int open_store(gw_t *gw) {
  idem_store_options_t opts = {.db_timeout_ms = (int)gw->cfg.db_timeout_ms};
  idem_engine_config_t ecfg = {.on_wait = on_wait,
                               .lease_ms = gw->cfg.lease_ms,
                               .ttl_ms = gw->cfg.key_ttl_ms,
                               .inflight_wait_ms = gw->cfg.inflight_wait_ms > 0
                                                       ? gw->cfg.inflight_wait_ms
                                                       : -1};
  char why[256] = "";
  int rc = idem_store_open(gw->cfg.db, &opts, &gw->store);

  if (rc != IDEM_OK) {
    fprintf(stderr, "idemd gateway: cannot open database: %s (%s)\n", idem_strerror(rc),
            idem_store_last_error());
    return -1;
  }
  if ((rc = idem_store_migrate(gw->store)) != IDEM_OK ||
      (rc = gw_schema_migrate(gw->store, why, sizeof why)) != IDEM_OK ||
      (rc = gw_secret_mac(gw->store, GW_SCOPE_SECRET, NULL, &gw->scope_mac)) != IDEM_OK ||
      (rc = gw_secret_mac(gw->store, "log_key_secret", gw->cfg.log_key_secret, &gw->key_id_mac)) !=
          IDEM_OK ||
      (rc = idem_engine_new(gw->store, &ecfg, &gw->engine)) != IDEM_OK) {
    fprintf(stderr, "idemd gateway: cannot set up the database: %s (%s)\n",
            idem_strerror(rc), why[0] ? why : idem_store_last_error());
    return -1;
  }
  return 0;
}

/* The engine's parked requests whose wait ran out, woken (all of them
 * once the gateway drains). */
static void expire_parked(void *ctx) {
  gw_t *gw = ctx;
  (void)idem_engine_expire(gw->engine, atomic_load(&gw->draining) ? INT64_MAX : idem_mono_ms());
}

/* Before the event threads stop: every connection off its event thread
 * without a worker is given back, however long it takes, since nothing
 * can hold one forever: no keyed request is handed off once `stopping`
 * is set (keyed.c), parked duplicates are woken, the upstream's calls
 * under way end within their deadline and no more are taken (the I/O
 * thread joined; a won key's call refused is released, nothing sent),
 * and the store's writer writes their completions, which resume them.
 * libmicrohttpd must not meet a suspended connection when it stops. */
static void stop_handed_off(gw_t *gw, struct idem__ticker *expirer) {
  atomic_store(&gw->stopping, 1);
  idem__ticker_stop(expirer);
  if (gw->engine)
    (void)idem_engine_expire(gw->engine, INT64_MAX);
  if (gw->upstream)
    gw_upstream_loop_stop(gw->upstream);
  /* `deciding` first: see gw_keyed(). */
  while (atomic_load(&gw->deciding) > 0 || atomic_load(&gw->handed_off) > 0) {
    if (gw->engine)
      (void)idem_engine_expire(gw->engine, INT64_MAX);
    usleep(1000);
  }
}

static void close_all(gw_t *gw) {
  idemd_replay_cache_free(gw->replays);
  idemd_workers_free(gw->workers);
  idem_engine_free(gw->engine);
  if (gw->store)
    idem_store_close(gw->store);
  idem_hmac_free(gw->scope_mac);
  idem_hmac_free(gw->key_id_mac);
  gw_upstream_free(gw->upstream);
}

int gw_cmd_gateway(int argc, char **argv) {
  static gw_t gw; /* its metrics are large; one per process */
  struct MHD_Daemon *d = NULL, *ad = NULL;
  struct idem__ticker *resolver = NULL, *expirer = NULL;
  int port = 0, aport = 0, sig = 0;
  char lport[16], aportstr[16];
  sigset_t set;

  if (argc > 0 && strcmp(argv[0], "pending") == 0)
    return gw_cmd_pending(argc - 1, argv + 1);
  if (argc > 0 && strcmp(argv[0], "resolve") == 0)
    return gw_cmd_resolve(argc - 1, argv + 1);
  if (argc > 0 && strcmp(argv[0], "audit") == 0)
    return gw_cmd_audit(argc - 1, argv + 1);
  for (int i = 0; i < argc; i++)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      gw_config_usage(stdout);
      return 0;
    }
  gw_config_defaults(&gw.cfg);
  if (gw_config_parse(&gw.cfg, argc, argv, stderr) != 0)
    return 2;
  /* Signals are taken by sigwait() below; every thread inherits the mask. */
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, NULL);
  signal(SIGPIPE, SIG_IGN);
  if (open_store(&gw) != 0)
    goto fail;
  gw.replays = idemd_replay_cache_new(REPLAY_CACHE_BYTES); /* NULL: none */
  if ((gw.workers = idemd_workers_start(WORKERS, (int)event_threads() * 8)) == NULL)
    goto fail;
  gw.upstream = gw_upstream_new(gw.cfg.upstream, gw.cfg.upstream_connect_timeout_ms,
                                gw.cfg.upstream_timeout_ms, (size_t)gw.cfg.max_answer);
  if (gw.upstream == NULL)
    goto fail;
  /* Keyed requests without a waiting thread where the store has local
   * reads and asynchronous writes (SQLite; keyed.c). */
  if (idem_store_local_reads(gw.store)) {
    if (gw_upstream_loop_start(gw.upstream) != 0 ||
        (expirer = idem__ticker_start(EXPIRE_EVERY_MS, expire_parked, &gw)) == NULL)
      goto fail;
    gw.upstream_loop = 1;
  }
  d = listen_on(&gw.cfg.listen,
                MHD_USE_EPOLL_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME,
                handle, &gw, 1, &port);
  ad = d ? listen_on(&gw.cfg.admin_listen, MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL,
                     admin, &gw, 0, &aport)
         : NULL;
  if (d == NULL || ad == NULL) {
    fprintf(stderr, "idemd gateway: cannot listen on %s:%d and %s:%d\n", gw.cfg.listen.host,
            gw.cfg.listen.port, gw.cfg.admin_listen.host, gw.cfg.admin_listen.port);
    goto fail;
  }
  if ((resolver = gw_resolver_start(&gw, RESOLVE_EVERY_MS)) == NULL) {
    fprintf(stderr, "idemd gateway: cannot start the resolver\n");
    goto fail;
  }
  snprintf(lport, sizeof lport, "%d", port);
  snprintf(aportstr, sizeof aportstr, "%d", aport);
  /* Request lines written together, as idemd's (server/log.h). */
  if (idemd_log_batch_start(50) != 0)
    goto fail;
  idemd_log_event("info", "gateway started", "listen_port", lport, "admin_port", aportstr,
                  "upstream", gw.cfg.upstream, "store", idem_store_backend(gw.store), NULL);
  sigwait(&set, &sig);
  /* New connections are refused from here; requests in flight finish. */
  MHD_quiesce_daemon(d);
  atomic_store(&gw.draining, 1);
  /* Kept-alive connections still send requests: a keyed one not decided
   * yet is answered 503 from here (keyed.c). */
  atomic_store(&gw.stopping, 1);
  for (int64_t until = idem_mono_ms() + DRAIN_MS;
       atomic_load(&inflight) > 0 && idem_mono_ms() < until;)
    usleep(10000);
  idem__ticker_stop(resolver);
  idemd_workers_stop(gw.workers); /* what was handed on is answered */
  stop_handed_off(&gw, expirer);
  MHD_stop_daemon(d);
  MHD_stop_daemon(ad);
  idemd_log_event("info", "gateway stopped", NULL);
  idemd_log_batch_stop();
  close_all(&gw);
  return 0;
fail:
  idem__ticker_stop(resolver);
  idemd_workers_stop(gw.workers);
  stop_handed_off(&gw, expirer);
  if (d)
    MHD_stop_daemon(d);
  if (ad)
    MHD_stop_daemon(ad);
  close_all(&gw);
  return 1;
}
