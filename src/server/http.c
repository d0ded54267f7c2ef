/* The HTTP layer of idemd on libmicrohttpd: its callbacks. The checks
 * the headers decide (docs/idempotency.md, section 3.2: 503 beyond
 * --max-connections, 431, 404, 405, 401, and a declared 413), body
 * reading under a cap, the hand-over of a whole request to its route
 * (routes.c: 413, 415, the key's 400, the body's 400, then the route's
 * own 422) or to the step it was suspended at (suspend.c), and the log
 * line and metrics once each answer is sent. */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include <arpa/inet.h>
#include <sched.h>
#include <errno.h>
#include <netdb.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "idem/clock.h"
#include "idem/crypto.h"
#include "idem/key.h"
#include "server/auth.h"
#include "server/log.h"
#include "server/reply.h"
#include "server/routes.h"
#include "server/suspend.h"
#include "server/tls.h"
#include "util/ticker.h"

/* A body we will not use (past the 64 KiB cap, or refused from the headers)
 * is read and dropped up to this much before the answer, so the client can
 * read it; beyond it we close the connection. Memory does not grow either
 * way. */
#define DISCARD_LIMIT (8 * 1024 * 1024)

/* libmicrohttpd builds the answer's headers in the same per-connection
 * pool that held the request's, so the pool is --max-header-bytes plus
 * this, and what the request's headers take of it is checked against the
 * limit in headers_fit(). With the pool at the limit alone, headers a few
 * hundred bytes short of it were read and run (a payment made), and then
 * left no room for the answer: the connection closed unanswered, on every
 * retry too. */
#define ANSWER_ROOM 2048

/* libmicrohttpd's record of one header, argument or cookie in the pool:
 * its struct MHD_HTTP_Header (56 bytes) rounded to the pool's alignment. */
#define MHD_RECORD_BYTES 64

static void set_request_id(idemd_request_t *r) {
  const char *given = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, "X-Request-Id");
  if (given) {
    size_t n = strlen(given);
    if (n >= 1 && n <= 64 &&
        strspn(given, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                      "0123456789._:-") == n) {
      memcpy(r->request_id, given, n + 1);
      return;
    }
  }
  memcpy(r->request_id, "req_", 4);
  if (idem_random_token(r->request_id + 4, 20) != IDEM_OK)
    idem_copy(r->request_id, sizeof r->request_id, "req_unknown");
}

/* Copies the path for logs with anything but visible ASCII replaced. */
static void set_path(idemd_request_t *r, const char *url) {
  size_t i;
  for (i = 0; url[i] && i < sizeof r->path - 1; i++) {
    unsigned char c = (unsigned char)url[i];
    r->path[i] = c >= 0x21 && c <= 0x7e ? (char)c : '?';
  }
  r->path[i] = '\0';
}

/* Sends the refusal saved in `r` by refuse(). */
static enum MHD_Result send_refusal(idemd_request_t *r) {
  idemd_reply_headers_t h = {.allow = r->refusal_allow,
                             .www_authenticate = r->refusal == 401,
                             .close = r->refusal_close};
  r->outcome = OUTCOME_INVALID;
  return idemd_reply_error(r, r->refusal, r->refusal_msg, &h);
}

/* A refusal decided from the headers (404, 405, 401). With a body on its
 * way (r->drain) the answer waits until that body is read and dropped:
 * sent at once, the connection would close with the body unread, and the
 * reset the kernel sends then can reach the client while it is still
 * sending, before it reads the answer (curl reports a send error, not the
 * status). */
static enum MHD_Result refuse(idemd_request_t *r, int status, const char *msg,
                              const char *allow) {
  r->refusal = status;
  r->refusal_msg = msg;
  r->refusal_allow = allow;
  return r->drain ? MHD_YES : send_refusal(r);
}

/* Reads how the body is framed as libmicrohttpd does: by
 * Transfer-Encoding when there is one (then Content-Length is not looked
 * at), else by Content-Length. Sets *declared (0 when not declared) and
 * returns whether a body follows that the client sends without waiting
 * for our go-ahead (an HTTP/1.1 "Expect: 100-continue" waits for it) and
 * that is small enough to read and drop before answering: chunked, or
 * declared up to DISCARD_LIMIT. A body framed by anything but chunked
 * has no end we could wait for. */
static int body_to_drain(struct MHD_Connection *conn, const char *version,
                         uint64_t *declared) {
  const char *te = MHD_lookup_connection_value(conn, MHD_HEADER_KIND,
                                               MHD_HTTP_HEADER_TRANSFER_ENCODING);
  const char *len = MHD_lookup_connection_value(conn, MHD_HEADER_KIND,
                                                MHD_HTTP_HEADER_CONTENT_LENGTH);
  const char *expect = MHD_lookup_connection_value(conn, MHD_HEADER_KIND,
                                                   MHD_HTTP_HEADER_EXPECT);
  int unasked = !(expect && strcasecmp(expect, "100-continue") == 0 &&
                  strcmp(version, MHD_HTTP_VERSION_1_1) == 0);

  *declared = 0;
  if (te)
    return unasked && strcasecmp(te, "chunked") == 0;
  if (len)
    *declared = strtoull(len, NULL, 10);
  return unasked && *declared > 0 && *declared <= DISCARD_LIMIT;
}

/* What one pass over the request's headers finds: the headers that must
 * come at most once, and how the body is framed. */
struct header_scan {
  int lengths, codings; /* Content-Length, Transfer-Encoding headers */
  const char *length;   /* the first Content-Length */
  int lengths_differ;
  int keys, auths, types; /* Idempotency-Key, Authorization, Content-Type */
};

static enum MHD_Result scan_header(void *cls, enum MHD_ValueKind kind, const char *key,
                                   const char *value) {
  struct header_scan *h = cls;

  if (kind != MHD_HEADER_KIND || key == NULL)
    return MHD_YES;
  value = value ? value : "";
  switch (key[0] | 0x20) { /* most headers are told apart by this alone */
  case 'c':
    if (strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH) == 0) {
      if (h->lengths++ == 0)
        h->length = value;
      else if (strcmp(h->length, value) != 0)
        h->lengths_differ = 1;
    } else if (strcasecmp(key, MHD_HTTP_HEADER_CONTENT_TYPE) == 0) {
      h->types++;
    }
    break;
  case 't':
    h->codings += strcasecmp(key, MHD_HTTP_HEADER_TRANSFER_ENCODING) == 0;
    break;
  case 'i':
    h->keys += strcasecmp(key, "Idempotency-Key") == 0;
    break;
  case 'a':
    h->auths += strcasecmp(key, MHD_HTTP_HEADER_AUTHORIZATION) == 0;
    break;
  }
  return MHD_YES;
}

/* Whether the transfer codings `te` end in "chunked" somewhere before
 * their last (RFC 9112, section 6.1: then the message is malformed). */
static int chunked_not_last(const char *te) {
  const char *p = te;
  while ((p = strcasestr(p, "chunked")) != NULL) {
    const char *after = p + 7;
    while (*after == ' ' || *after == '\t')
      after++;
    if (*after == ',')
      return 1;
    p = after;
  }
  return 0;
}

/* The refusal of a request whose headers say two things at once, or frame
 * its body in a way libmicrohttpd cannot follow (RFC 9112, sections 6.1
 * and 6.3), or NULL; `*status` gets 400 or 501, `*close` whether the
 * connection must close after the answer: the bytes after a body framed
 * two ways could otherwise be read as another request. */
static const char *header_conflict(const idemd_request_t *r, const struct header_scan *h,
                                   int *status, int *close) {
  const char *te;

  *status = 400;
  *close = 1;
  if (h->codings > 0 && h->lengths > 0)
    return "Transfer-Encoding and Content-Length must not both be sent";
  if (h->lengths_differ)
    return "Content-Length headers disagree";
  te = h->codings == 0 ? NULL /* most requests: no second lookup */
                       : MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND,
                                                     MHD_HTTP_HEADER_TRANSFER_ENCODING);
  if (h->codings > 1 || (te && strcasecmp(te, "chunked") != 0)) {
    if (te && chunked_not_last(te))
      return "chunked must be the last transfer coding";
    *status = 501;
    return "only the chunked transfer coding is supported";
  }
  *close = 0;
  if (h->keys > 1)
    return "Idempotency-Key must be sent once";
  if (h->auths > 1)
    return "Authorization must be sent once";
  if (h->types > 1)
    return "Content-Type must be sent once";
  return NULL;
}

/* Whether what the request's line and headers take of libmicrohttpd's
 * pool fits --max-header-bytes: their text, a record for each header,
 * argument and cookie, and the copy it makes of a Cookie header. `h`
 * gets what the headers hold (scan_header()). */
static int headers_fit(const idemd_request_t *r, struct header_scan *h) {
  const union MHD_ConnectionInfo *info =
      MHD_get_connection_info(r->conn, MHD_CONNECTION_INFO_REQUEST_HEADER_SIZE);
  int records = MHD_get_connection_values(
      r->conn, MHD_HEADER_KIND | MHD_GET_ARGUMENT_KIND | MHD_COOKIE_KIND, scan_header, h);
  const char *cookie = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, "Cookie");
  size_t used;

  if (info == NULL)
    return 1; /* asked before the headers were in: cannot happen here */
  used = info->header_size + (size_t)(records > 0 ? records : 0) * MHD_RECORD_BYTES +
         (cookie ? strlen(cookie) + 1 : 0);
  return used <= (size_t)r->srv->cfg.max_header_bytes;
}

/* Whether the listener `r` came in on serves route `d`. With
 * --metrics-listen, GET /metrics is served there and not on --listen,
 * where it is an unknown path (404, counted as one), and that listener
 * serves /metrics, /healthz and /readyz only (docs/operations.md,
 * "Metrics listener"). */
static int served_here(const idemd_request_t *r, const idemd_route_def_t *d) {
  if (r->metrics_listener)
    return d->route == ROUTE_METRICS || d->route == ROUTE_HEALTHZ ||
           d->route == ROUTE_READYZ;
  if (d->route == ROUTE_WEBHOOK)
    return r->srv->webhook_mac != NULL; /* without a secret, no such route */
  return d->route != ROUTE_METRICS || r->srv->cfg.metrics_listen.host[0] == '\0';
}

/* First call for a request: headers only. Decides at once when the path,
 * method, credentials or declared length already do; the answer goes out
 * now, or after the body when one follows (refuse()). */
static enum MHD_Result on_headers(idemd_request_t *r, const char *url,
                                  const char *version) {
  const idemd_route_def_t *d;
  struct header_scan scan = {0};
  const char *conflict;
  uint64_t declared;
  int too_large, rc, status, allowed;

  set_path(r, url);
  set_request_id(r);
  if (idemd_guard_over_limit(r->conn_guard)) {
    idemd_reply_headers_t h = {.retry_after = 1, .close = 1};
    idemd_guard_count_refusal(r->srv->guard);
    r->outcome = OUTCOME_ERROR;
    return idemd_reply_error(r, 503, "too many connections, retry later", &h);
  }
  r->drain = body_to_drain(r->conn, version, &declared);
  if (!headers_fit(r, &scan))
    return refuse(r, 431, "request headers are too large", NULL);
  if ((conflict = header_conflict(r, &scan, &status, &r->refusal_close)) != NULL)
    return refuse(r, status, conflict, NULL);
  d = idemd_route_match(url, r->method, r->resource_id, sizeof r->resource_id, &allowed);
  if (d == NULL || !served_here(r, d))
    return refuse(r, 404, "not found", NULL);
  r->route = d->route;
  r->op = d->op;
  if (!allowed)
    return refuse(r, 405, "method not allowed", d->allow);
  r->needs_auth = d->needs_auth;
  too_large = declared > IDEMD_MAX_BODY && strcmp(d->method, "GET") != 0; /* takes a body */
  if (too_large && r->drain) {
    /* Dropped as it comes; 401 or 413 once it is all here. */
    r->body_too_large = 1;
    return MHD_YES;
  }
  /* The key is checked now when that cannot wait on a network; else with
   * the body, in a worker. A declared length over the cap that we will not
   * read first (beyond DISCARD_LIMIT, or after "Expect: 100-continue") is
   * answered now either way (401 first): a rare error path may take one
   * store read in the event thread. A store failure here, with a body
   * following, is left to the check after the body, which answers it. */
  if (d->needs_auth && (idem_store_local_reads(r->srv->store) || too_large) &&
      (rc = idemd_check_key(r)) != IDEM_OK) {
    if (rc == IDEM_ENOTFOUND)
      return refuse(r, 401, "missing or invalid API key", NULL);
    if (!r->drain)
      return idemd_reply_key_failure(r, rc);
  }
  if (too_large) {
    r->outcome = OUTCOME_INVALID;
    if (d->route == ROUTE_WEBHOOK) { /* its own cap (webhooks.c) */
      r->body_too_large = 1;
      return idemd_webhook_receive(r);
    }
    return idemd_reply_error(r, 413, "request body is larger than 64 KiB", NULL);
  }
  return MHD_YES;
}

/* libmicrohttpd's request callback, for either listener: `metrics` is
 * whether it is --metrics-listen's. */
static enum MHD_Result handle(idemd_server_t *srv, int metrics, struct MHD_Connection *conn,
                              const char *url, const char *method, const char *version,
                              const char *upload_data, size_t *upload_data_size,
                              void **con_cls) {
  idemd_request_t *r = *con_cls;

  if (r == NULL) {
    r = calloc(1, sizeof *r);
    if (r == NULL)
      return MHD_NO;
    r->srv = srv;
    r->conn = conn;
    r->method = method;
    r->start_us = idem_mono_us();
    r->conn_guard = idemd_guard_of(conn); /* NULL on the metrics listener */
    r->metrics_listener = metrics;
    *con_cls = r;
    atomic_fetch_add(&srv->inflight, 1);
    return on_headers(r, url, version);
  }
  if (r->deferred) {
    /* Resumed: go on at the step recorded on it (after a parked wait, or
     * an asynchronous write), or queue the answer a worker left (none:
     * it failed, hang up). */
    struct MHD_Response *resp = r->response;
    enum MHD_Result (*step)(idemd_request_t *) = r->resume;
    enum MHD_Result ret = MHD_NO;
    r->deferred = 0;
    if (step && resp == NULL) {
      r->resume = NULL;
      return step(r);
    }
    r->response = NULL;
    if (resp) {
      ret = MHD_queue_response(conn, (unsigned)r->status, resp);
      MHD_destroy_response(resp);
    }
    return ret;
  }
  if (*upload_data_size > 0) {
    size_t n = *upload_data_size;
    *upload_data_size = 0;
    r->body_seen += n;
    if (r->responded)
      return MHD_YES;
    if (!r->refusal && !r->body_too_large && r->body_len + n > IDEMD_MAX_BODY) {
      r->body_too_large = 1;
      free(r->body);
      r->body = NULL;
      r->body_len = r->body_cap = 0;
    }
    if (r->refusal || r->body_too_large) /* drop it; past the discard limit, hang up */
      return r->body_seen > DISCARD_LIMIT ? MHD_NO : MHD_YES;
    if (r->body_len + n + 1 > r->body_cap) {
      /* Grow to what the upload needs (at least 1 KiB, doubling), not to the
       * cap at once: a 64 KiB block per request makes malloc trim and the
       * kernel flush TLBs on every core. */
      size_t cap = r->body_cap ? r->body_cap : 1024;
      char *nb;
      while (cap < r->body_len + n + 1)
        cap *= 2;
      if (cap > IDEMD_MAX_BODY + 1)
        cap = IDEMD_MAX_BODY + 1;
      if ((nb = realloc(r->body, cap)) == NULL)
        return MHD_NO;
      r->body = nb;
      r->body_cap = cap;
    }
    memcpy(r->body + r->body_len, upload_data, n);
    r->body_len += n;
    r->body[r->body_len] = '\0';
    return MHD_YES;
  }
  if (r->responded)
    return MHD_YES;
  if (r->refusal)
    return send_refusal(r);
  /* The request is all here: from now on it may take as long as its work
   * takes (a provider call, a wait for a duplicate) without being cut. */
  idemd_guard_busy(r->srv->guard, r->conn_guard, 1);
  return idemd_dispatch(r);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn,
                                  const char *url, const char *method,
                                  const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **con_cls) {
  return handle(cls, 0, conn, url, method, version, upload_data, upload_data_size,
                con_cls);
}

static enum MHD_Result on_metrics_request(void *cls, struct MHD_Connection *conn,
                                          const char *url, const char *method,
                                          const char *version, const char *upload_data,
                                          size_t *upload_data_size, void **con_cls) {
  return handle(cls, 1, conn, url, method, version, upload_data, upload_data_size,
                con_cls);
}

void idemd_request_own(idemd_request_t *r, void *call, void (*free_fn)(void *call)) {
  if (r->call_free)
    r->call_free(r->call);
  r->call = call;
  r->call_free = free_fn;
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
  idemd_server_t *srv = cls;
  idemd_request_t *r = *con_cls;
  (void)conn;
  if (r == NULL)
    return;
  /* Ends the work under way (the flow's), which says what the request
   * did if its client left first. */
  int done = r->on_close ? r->on_close(r) : OUTCOME_NONE;
  if (!r->responded) {
    if (done != OUTCOME_NONE)
      r->outcome = done;
    else if (r->inflight_deadline != 0)
      r->outcome = OUTCOME_IN_FLIGHT;
    else if (r->outcome == OUTCOME_NONE)
      r->outcome = OUTCOME_ERROR;
  }
  /* The client left (or we closed) before the whole answer went out. */
  r->aborted = toe != MHD_REQUEST_TERMINATED_COMPLETED_OK;
  if (r->response) { /* resumed, then closed before it was sent */
    MHD_destroy_response(r->response);
    r->response = NULL;
  }
  idemd_guard_busy(srv->guard, r->conn_guard, 0);
  r->conn_guard = NULL; /* the connection's, gone with it */
  idemd_metrics_request(&srv->metrics, r->op, r->outcome, idem_mono_us() - r->start_us);
  idemd_log_request(r);
  *con_cls = NULL;
  atomic_fetch_sub(&srv->inflight, 1);
  idemd_request_free(r);
}

void idemd_request_free(idemd_request_t *r) {
  if (r->call_free)
    r->call_free(r->call);
  free(r->body);
  free(r);
}

/* The cores this process may run on. */
static unsigned int cores(void) {
  cpu_set_t cpus; /* the cores this process may run on, if fewer */
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  if (sched_getaffinity(0, sizeof cpus, &cpus) == 0 && CPU_COUNT(&cpus) > 0 &&
      CPU_COUNT(&cpus) < n)
    n = CPU_COUNT(&cpus);
  return n > 1 ? (unsigned int)n : 1u;
}

/* The default number of event threads: one fewer than the cores, at least
 * one. The store's writer (SQLite's group-commit thread, or PostgreSQL's
 * server processes) keeps a core busy under a write load too: with one
 * event thread per core on two cores, the event threads, the writer and a
 * local client took turns on both, and replays' p99 under wrk was 4.6-5.6
 * ms against 2.0-3.5 ms with one event thread (docs/performance.md). */
static unsigned int default_event_threads(void) {
  unsigned int n = cores();
  return n > 1 ? n - 1 : 1u;
}

/* Workers at work at once (see idemd_workers_start()): enough to keep the
 * store busy. More only queue up in the kernel's scheduler: on 2 cores,
 * 64 workers each with a PostgreSQL server process stalled some requests
 * for seconds (docs/performance.md, "PostgreSQL's tail"). */
static int default_active_workers(void) {
  unsigned int n = cores();
  return n > 1024 ? 4096 : (int)(4 * n);
}

/* Decodes a request's path as libmicrohttpd does, but leaves a path that
 * holds "%00" as it came: a NUL would cut it short for every string
 * function after this one, so that /orders/ord_a%00b named ord_a. Left
 * encoded, such a path names no resource (404). */
static size_t unescape_path(void *cls, struct MHD_Connection *c, char *s) {
  (void)cls;
  (void)c;
  for (const char *p = s; (p = strchr(p, '%')) != NULL; p++)
    if (p[1] == '0' && p[2] == '0')
      return strlen(s);
  return MHD_http_unescape(s);
}

/* The port a daemon's listening socket is bound to, or `fallback`. */
static int bound_port(struct MHD_Daemon *d, int fallback) {
  const union MHD_DaemonInfo *info = MHD_get_daemon_info(d, MHD_DAEMON_INFO_LISTEN_FD);
  struct sockaddr_storage bound;
  socklen_t blen = sizeof bound;

  if (info == NULL || getsockname(info->listen_fd, (struct sockaddr *)&bound, &blen) != 0)
    return fallback;
  return ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                           : ((struct sockaddr_in *)&bound)->sin_port);
}

/* The listener of --metrics-listen: GET /metrics, /healthz and /readyz
 * (served_here()) on a daemon of one event thread, with the same request
 * callbacks as the public listener, so a scrape is counted and logged as
 * one there is, and takes no lock the public one does not; it is meant for
 * a private address, in plain HTTP. Not under the guard: its connections
 * count neither against --max-connections nor toward the public
 * listener's deadline; libmicrohttpd's own limit and inactivity timeout
 * bound them. The socket is made here so that a bind failure says why.
 * Returns 0, or -1 with a message on stderr. */
static int start_metrics(idemd_server_t *srv) {
  const idemd_addr_t *a = &srv->cfg.metrics_listen;
  struct addrinfo hints = {0}, *ai = NULL;
  char port[8];
  int fd, one = 1, rc;

  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | AI_PASSIVE;
  snprintf(port, sizeof port, "%d", a->port);
  if ((rc = getaddrinfo(a->host, port, &hints, &ai)) != 0 || ai == NULL) {
    fprintf(stderr, "idemd: cannot resolve --metrics-listen address '%s': %s\n", a->host,
            rc != 0 ? gai_strerror(rc) : "no address");
    if (ai)
      freeaddrinfo(ai);
    return -1;
  }
  fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
      bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 64) != 0) {
    fprintf(stderr, "idemd: --metrics-listen: cannot listen on %s:%d: %s\n", a->host,
            a->port, strerror(errno));
    if (fd >= 0)
      close(fd);
    freeaddrinfo(ai);
    return -1;
  }
  freeaddrinfo(ai);
  srv->metrics_daemon = MHD_start_daemon(
      MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_USE_ITC |
          MHD_ALLOW_SUSPEND_RESUME,
      0, NULL, NULL, on_metrics_request, srv,
      MHD_OPTION_LISTEN_SOCKET, fd,
      MHD_OPTION_THREAD_STACK_SIZE, (size_t)(1024 * 1024),
      MHD_OPTION_NOTIFY_COMPLETED, on_completed, srv,
      MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)10,
      MHD_OPTION_CONNECTION_LIMIT, (unsigned int)64,
      MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)srv->cfg.max_header_bytes + ANSWER_ROOM,
      MHD_OPTION_UNESCAPE_CALLBACK, unescape_path, NULL,
      MHD_OPTION_END);
  if (srv->metrics_daemon == NULL) {
    /* The socket is not closed here: libmicrohttpd closes it on some of
     * its failure paths and not on others, and closing a descriptor twice
     * could close another thread's. idemd exits at once. */
    fprintf(stderr, "idemd: cannot serve --metrics-listen %s:%d\n", a->host, a->port);
    return -1;
  }
  srv->metrics_port = bound_port(srv->metrics_daemon, a->port);
  return 0;
}

/* TLS 1.2 and 1.3 only (RFC 8996 deprecates the older versions), from
 * GnuTLS's NORMAL set of ciphers. */
#define TLS_PRIORITIES "NORMAL:-VERS-ALL:+VERS-TLS1.3:+VERS-TLS1.2"

int idemd_http_start(idemd_server_t *srv) {
  struct addrinfo hints = {0}, *ai = NULL;
  idemd_tls_t tls = {0};
  char port[8];
  int rc;

  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | AI_PASSIVE;
  snprintf(port, sizeof port, "%d", srv->cfg.listen.port);
  if (srv->cfg.tls_cert[0] && idemd_tls_load(srv->cfg.tls_cert, srv->cfg.tls_key, &tls) != 0)
    return -1;
  /* The credentials, when there are any, are handed to libmicrohttpd in
   * MHD_OPTION_ARRAY (an empty array when not: it refuses HTTPS options
   * on a daemon without MHD_USE_TLS). */
  struct MHD_OptionItem tls_opts[] = {
      {tls.cert ? MHD_OPTION_HTTPS_MEM_CERT : MHD_OPTION_END, 0, tls.cert},
      {MHD_OPTION_HTTPS_MEM_KEY, 0, tls.key},
      {MHD_OPTION_HTTPS_PRIORITIES, 0, (void *)TLS_PRIORITIES},
      {MHD_OPTION_END, 0, NULL},
  };
  if ((srv->guard = idemd_guard_new(srv->cfg.request_timeout_ms,
                                    srv->cfg.max_connections)) == NULL) {
    fprintf(stderr, "idemd: cannot start the connection watchdog\n");
    idemd_tls_free(&tls);
    return -1;
  }
  rc = getaddrinfo(srv->cfg.listen.host, port, &hints, &ai);
  if (rc != 0 || ai == NULL) {
    fprintf(stderr, "idemd: cannot resolve listen address '%s'\n", srv->cfg.listen.host);
    idemd_guard_free(srv->guard);
    srv->guard = NULL;
    idemd_tls_free(&tls);
    return -1;
  }
  /* A few event threads (one fewer than the cores by default) do all the
   * socket work and answer what needs no waiting (replays from memory,
   * errors, local reads). A request whose next step waits is suspended
   * and handed to the workers, so no connection holds up another. */
  unsigned int flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL |
                       MHD_USE_ITC | MHD_ALLOW_SUSPEND_RESUME |
                       (ai->ai_family == AF_INET6 ? MHD_USE_IPv6 : 0) |
                       (tls.cert ? MHD_USE_TLS : 0);
  unsigned int pool =
      srv->cfg.threads > 0 ? (unsigned int)srv->cfg.threads : default_event_threads();
  int active = srv->cfg.active_workers > 0 ? srv->cfg.active_workers
                                             : default_active_workers();
  if ((srv->workers = idemd_workers_start(srv->cfg.workers, active)) == NULL ||
      (srv->wait_timer = idem__ticker_start(IDEMD_PARK_TICK_MS, idemd_expire_parked, srv)) == NULL) {
    fprintf(stderr, "idemd: cannot start worker threads\n");
    freeaddrinfo(ai);
    idemd_tls_free(&tls);
    if (srv->workers) {
      idemd_workers_stop(srv->workers);
      idemd_workers_free(srv->workers);
      srv->workers = NULL;
    }
    idemd_guard_free(srv->guard);
    srv->guard = NULL;
    return -1;
  }
  srv->daemon = MHD_start_daemon(
      flags, 0, NULL, NULL, on_request, srv,
      MHD_OPTION_SOCK_ADDR, ai->ai_addr,
      MHD_OPTION_THREAD_POOL_SIZE, pool,
      MHD_OPTION_THREAD_STACK_SIZE, (size_t)(1024 * 1024),
      MHD_OPTION_NOTIFY_COMPLETED, on_completed, srv,
      MHD_OPTION_NOTIFY_CONNECTION, idemd_guard_notify, srv->guard,
      /* Inactivity only; the guard enforces the whole-request deadline. */
      MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)30,
      /* Room above the cap to tell the extra clients 503. */
      MHD_OPTION_CONNECTION_LIMIT, (unsigned int)(srv->cfg.max_connections + 64),
      MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)srv->cfg.max_header_bytes + ANSWER_ROOM,
      MHD_OPTION_UNESCAPE_CALLBACK, unescape_path, NULL,
      MHD_OPTION_ARRAY, tls_opts,
      MHD_OPTION_END);
  freeaddrinfo(ai);
  /* GnuTLS has its own copy of the credentials by now (libmicrohttpd loads
   * them while it starts). */
  idemd_tls_free(&tls);
  if (srv->daemon == NULL) {
    fprintf(stderr, "idemd: cannot listen on %s:%d\n", srv->cfg.listen.host,
            srv->cfg.listen.port);
    idem__ticker_stop(srv->wait_timer);
    srv->wait_timer = NULL;
    idemd_workers_stop(srv->workers);
    idemd_workers_free(srv->workers);
    srv->workers = NULL;
    idemd_guard_free(srv->guard);
    srv->guard = NULL;
    return -1;
  }
  /* The port actually bound (the configured one, or the kernel's pick for
   * port 0). */
  srv->port = bound_port(srv->daemon, srv->cfg.listen.port);
  if (srv->cfg.metrics_listen.host[0] && start_metrics(srv) != 0) {
    idemd_http_drain(srv, 0);
    idemd_http_stop(srv);
    return -1;
  }
  return 0;
}

int idemd_http_drain(idemd_server_t *srv, int64_t timeout_ms) {
  int64_t deadline = idem_mono_ms() + timeout_ms;
  const union MHD_DaemonInfo *info;
  int left, fd;

  if (srv->daemon == NULL)
    return 0;
  atomic_store(&srv->draining, 1);
  /* No new connections from here: the listening socket is swapped, under
   * the same descriptor, for an unbound one, so the kernel refuses new
   * connections at once (a proxy sends them to another instance), while
   * libmicrohttpd keeps a valid descriptor, which it closes when it stops
   * (an event thread that still tries to accept on it gets EINVAL, which
   * it ignores). MHD_quiesce_daemon() is not used: in libmicrohttpd
   * 0.9.75 it races its own event threads (each takes the socket out of
   * its epoll set once it sees the daemon quiesced; quiesce does it too,
   * and aborts when it finds it gone, as seen in CI). Closing the socket
   * outright would free the descriptor's number for reuse; shutdown()
   * left it readable, waking the event threads for ever. ThreadSanitizer
   * reports the swap as a race with an event thread's use of the
   * descriptor (tests/tsan.supp). */
  info = MHD_get_daemon_info(srv->daemon, MHD_DAEMON_INFO_LISTEN_FD);
  if (info != NULL && info->listen_fd != MHD_INVALID_SOCKET &&
      (fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) >= 0) {
    if (dup2(fd, info->listen_fd) < 0)
      fprintf(stderr, "idemd: cannot close the listening socket: %s\n", strerror(errno));
    close(fd);
  }
  while ((left = atomic_load(&srv->inflight)) > 0 && idem_mono_ms() < deadline) {
    struct timespec ts = {0, 10 * 1000000L};
    nanosleep(&ts, NULL);
  }
  return left;
}

void idemd_http_stop(idemd_server_t *srv) {
  if (srv->daemon == NULL)
    return;
  /* Workers first: each finishes its request and resumes the connection;
   * later deferrals are answered 503. Then the writes still queued with a
   * continuation (quick: a commit). Then the daemon closes everything. */
  atomic_store(&srv->draining, 1); /* parked requests answer now */
  atomic_store(&srv->stopping, 1);  /* and none is suspended any more */
  idemd_workers_stop(srv->workers);
  while (atomic_load(&srv->async_pending) > 0) {
    struct timespec ts = {0, 1000000L};
    nanosleep(&ts, NULL);
  }
  /* No connection of either listener is suspended now: libmicrohttpd
   * aborts the process when a daemon stops with one. */
  if (srv->metrics_daemon) {
    MHD_stop_daemon(srv->metrics_daemon);
    srv->metrics_daemon = NULL;
  }
  MHD_stop_daemon(srv->daemon);
  srv->daemon = NULL;
  idem__ticker_stop(srv->wait_timer);
  srv->wait_timer = NULL;
  idemd_workers_free(srv->workers);
  srv->workers = NULL;
  idemd_guard_free(srv->guard);
  srv->guard = NULL;
}
