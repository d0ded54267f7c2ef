/* The gateway's upstream client (gateway/upstream.h): a pool of libcurl
 * handles, each keeping its connections alive, taken by one call at a
 * time; and one I/O thread running many calls at once on libcurl's multi
 * interface, for callers that must not wait; answers gathered within
 * caps. */
#include "gateway/upstream.h"

#include <curl/curl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "idem/clock.h"
#include "provider/provider.h"
#include "util/curl_sent.h"

/* Idle handles kept; beyond, a returned handle is closed. */
#define POOL_MAX 256
/* Bytes of an answer's header lines. */
#define MAX_HEADER_BYTES (64 * 1024)

struct gw_up_loop;
static void loop_free(gw_upstream_t *u);

struct gw_upstream {
  char *base_url;
  long connect_timeout_ms;
  long timeout_ms;
  size_t max_answer;
  pthread_mutex_t lock;
  CURL *idle[POOL_MAX];
  int nidle;
  struct gw_up_loop *loop; /* gw_upstream_loop_start()'s, or NULL */
};

gw_upstream_t *gw_upstream_new(const char *base_url, int64_t connect_timeout_ms,
                               int64_t timeout_ms, size_t max_answer) {
  gw_upstream_t *u = calloc(1, sizeof *u);
  if (u == NULL || (u->base_url = strdup(base_url)) == NULL) {
    free(u);
    return NULL;
  }
  pthread_mutex_init(&u->lock, NULL);
  u->connect_timeout_ms = (long)connect_timeout_ms;
  u->timeout_ms = (long)timeout_ms;
  u->max_answer = max_answer;
  return u;
}

void gw_upstream_free(gw_upstream_t *u) {
  if (u == NULL)
    return;
  loop_free(u);
  for (int i = 0; i < u->nidle; i++)
    curl_easy_cleanup(u->idle[i]);
  pthread_mutex_destroy(&u->lock);
  free(u->base_url);
  free(u);
}

static CURL *take(gw_upstream_t *u) {
  CURL *c = NULL;
  pthread_mutex_lock(&u->lock);
  if (u->nidle > 0)
    c = u->idle[--u->nidle];
  pthread_mutex_unlock(&u->lock);
  if (c == NULL)
    return curl_easy_init();
  curl_easy_reset(c); /* its connections stay */
  return c;
}

static void give_back(gw_upstream_t *u, CURL *c) {
  pthread_mutex_lock(&u->lock);
  if (u->nidle < POOL_MAX) {
    u->idle[u->nidle++] = c;
    c = NULL;
  }
  pthread_mutex_unlock(&u->lock);
  if (c)
    curl_easy_cleanup(c);
}

void gw_answer_free(gw_answer_t *a) {
  for (int i = 0; i < a->nheaders; i++) {
    free(a->headers[i].name);
    free(a->headers[i].value);
  }
  free(a->headers);
  free(a->body);
  memset(a, 0, sizeof *a);
}

static int has_token(const char *list, const char *name) {
  size_t n = strlen(name);
  const char *p = list;
  while (p && *p) {
    while (*p == ' ' || *p == '\t' || *p == ',')
      p++;
    const char *end = p;
    while (*end && *end != ',' && *end != ' ' && *end != '\t')
      end++;
    if ((size_t)(end - p) == n && strncasecmp(p, name, n) == 0)
      return 1;
    p = end;
  }
  return 0;
}

int gw_hop_by_hop(const char *name, const char *connection) {
  static const char *const hop[] = {"Connection", "Proxy-Connection", "Keep-Alive",
                                    "TE", "Transfer-Encoding", "Upgrade"};
  for (size_t i = 0; i < sizeof hop / sizeof *hop; i++)
    if (strcasecmp(name, hop[i]) == 0)
      return 1;
  return connection != NULL && has_token(connection, name);
}

int gw_header_ok(const char *name, const char *value) {
  if (name == NULL || *name == '\0')
    return 0;
  for (const char *s = name; *s; s++)
    if (!(*s >= '0' && *s <= '9') && !((*s | 0x20) >= 'a' && (*s | 0x20) <= 'z') &&
        strchr("!#$%&'*+-.^_`|~", *s) == NULL)
      return 0;
  for (const unsigned char *v = (const unsigned char *)(value ? value : ""); *v; v++)
    if ((*v < 0x20 && *v != '\t') || *v == 0x7f)
      return 0;
  return 1;
}

/* 1 when the segment [s, end) is "." or "..", spelled with "%2e" or not. */
static int dot_segment(const char *s, const char *end) {
  int dots = 0;
  while (s < end) {
    if (*s == '.') {
      s++;
    } else if (end - s >= 3 && s[0] == '%' && s[1] == '2' && (s[2] | 0x20) == 'e') {
      s += 3;
    } else {
      return 0;
    }
    dots++;
  }
  return dots == 1 || dots == 2;
}

int gw_target_ok(const char *target) {
  const char *q, *seg;
  if (target == NULL || target[0] != '/')
    return 0;
  for (const unsigned char *t = (const unsigned char *)target; *t; t++)
    if (*t < 0x21 || *t > 0x7e || *t == '#')
      return 0;
  q = strchr(target, '?');
  if (q == NULL)
    q = target + strlen(target);
  for (seg = target + 1; seg <= q;) {
    const char *end = memchr(seg, '/', (size_t)(q - seg));
    if (end == NULL)
      end = q;
    if (dot_segment(seg, end))
      return 0;
    seg = end + 1;
  }
  return 1;
}

/* What one call gathers. */
struct gather {
  gw_upstream_t *u;
  gw_answer_t *a;
  size_t cap; /* bytes allocated at a->body */
  size_t header_bytes;
  int too_large;
  int once;     /* the request may not be sent a second time */
  int attempts; /* times libcurl was about to send it */
  /* gw_upstream_stream()'s: where the body goes instead of a->body, and
   * whether its head was passed on (at the first byte of the body). */
  const gw_up_stream_t *sink;
  CURL *easy;
  int head_sent;
  int aborted; /* the sink refused: the client is gone */
};

/* Called by libcurl each time it is about to send the request on a
 * connection. libcurl sends a request again on a new connection when a
 * reused one closed without an answer: the upstream may have acted on the
 * first (it got the request, then died or closed). For a request that
 * must not run twice, that second send is refused here; the transfer
 * fails, having sent bytes, so it counts as sent with no answer. */
static int on_prereq(void *arg, char *ip, char *local_ip, int port, int local_port) {
  struct gather *g = arg;
  (void)ip;
  (void)local_ip;
  (void)port;
  (void)local_port;
  return ++g->attempts > 1 && g->once ? CURL_PREREQFUNC_ABORT : CURL_PREREQFUNC_OK;
}

/* libcurl's progress callback of a streamed answer: the sink may cut it. */
static int on_progress(void *arg, curl_off_t dltotal, curl_off_t dlnow, curl_off_t ultotal,
                       curl_off_t ulnow) {
  struct gather *g = arg;
  (void)dltotal;
  (void)dlnow;
  (void)ultotal;
  (void)ulnow;
  if (g->sink->cut(g->sink->arg) == 0)
    return 0;
  g->aborted = 1;
  return 1; /* ends the transfer: CURLE_ABORTED_BY_CALLBACK */
}

/* The head of a streamed answer, passed on once: its status and headers. */
static int send_head(struct gather *g) {
  long code = 0;
  curl_easy_getinfo(g->easy, CURLINFO_RESPONSE_CODE, &code);
  g->a->status = (int)code;
  g->head_sent = 1;
  return g->sink->on_head(g->sink->arg, g->a);
}

static size_t on_body(char *data, size_t size, size_t n, void *arg) {
  struct gather *g = arg;
  gw_answer_t *a = g->a;
  size_t len = size * n;

  if (g->sink) {
    if ((!g->head_sent && send_head(g) != 0) || g->sink->on_data(g->sink->arg, data, len) != 0) {
      g->aborted = 1;
      return 0; /* ends the transfer */
    }
    return len;
  }
  if (a->len + len > g->u->max_answer) {
    g->too_large = 1;
    return 0; /* ends the transfer: CURLE_WRITE_ERROR */
  }
  if (a->len + len + 1 > g->cap) {
    size_t cap = g->cap ? g->cap : 4096;
    char *b;
    while (cap < a->len + len + 1)
      cap *= 2;
    if ((b = realloc(a->body, cap)) == NULL)
      return 0;
    a->body = b;
    g->cap = cap;
  }
  memcpy(a->body + a->len, data, len);
  a->len += len;
  a->body[a->len] = '\0';
  return len;
}

static void drop_headers(gw_answer_t *a) {
  for (int i = 0; i < a->nheaders; i++) {
    free(a->headers[i].name);
    free(a->headers[i].value);
  }
  a->nheaders = 0;
}

/* One header line of the answer; a status line starts the headers anew
 * (an interim 1xx answer's are dropped). */
static size_t on_header(char *data, size_t size, size_t n, void *arg) {
  struct gather *g = arg;
  gw_answer_t *a = g->a;
  size_t len = size * n;
  const char *colon;
  gw_header_t *h;

  g->header_bytes += len;
  if (g->header_bytes > MAX_HEADER_BYTES) {
    g->too_large = 1;
    return 0;
  }
  if (len >= 5 && strncmp(data, "HTTP/", 5) == 0) {
    drop_headers(a);
    return len;
  }
  while (len > 0 && (data[len - 1] == '\n' || data[len - 1] == '\r'))
    len--;
  if (len == 0 || (colon = memchr(data, ':', len)) == NULL || colon == data)
    return size * n;
  h = realloc(a->headers, (size_t)(a->nheaders + 1) * sizeof *h);
  if (h == NULL)
    return 0;
  a->headers = h;
  h = &a->headers[a->nheaders];
  const char *v = colon + 1;
  const char *end = data + len;
  while (v < end && (*v == ' ' || *v == '\t'))
    v++;
  while (end > v && (end[-1] == ' ' || end[-1] == '\t'))
    end--;
  h->name = strndup(data, (size_t)(colon - data));
  h->value = strndup(v, (size_t)(end - v));
  if (h->name == NULL || h->value == NULL) {
    free(h->name);
    free(h->value);
    return 0;
  }
  a->nheaders++;
  return size * n;
}

/* The header list of `req`, with the ones curl would add on its own
 * blanked ("Name:" removes it) unless the client sent them. */
static struct curl_slist *header_list(const gw_up_request_t *req) {
  static const char *const curl_adds[] = {"Accept", "Content-Type", "Expect"};
  struct curl_slist *l = NULL, *t;

  for (const char *const *h = req->headers; h && *h; h++) {
    if ((t = curl_slist_append(l, *h)) == NULL)
      goto fail;
    l = t;
  }
  for (size_t i = 0; i < sizeof curl_adds / sizeof *curl_adds; i++) {
    size_t n = strlen(curl_adds[i]);
    int sent = 0;
    char blank[32];
    for (const char *const *h = req->headers; h && *h && !sent; h++)
      sent = strncasecmp(*h, curl_adds[i], n) == 0 && ((*h)[n] == ':' || (*h)[n] == ';') &&
             strcasecmp(curl_adds[i], "Expect") != 0;
    if (sent)
      continue;
    snprintf(blank, sizeof blank, "%s:", curl_adds[i]);
    if ((t = curl_slist_append(l, blank)) == NULL)
      goto fail;
    l = t;
  }
  return l;
fail:
  curl_slist_free_all(l);
  return NULL;
}

int64_t gw_upstream_deadline(int64_t timeout_ms, int64_t lease_expires_at, int64_t now_ms) {
  int64_t left;
  if (lease_expires_at <= 0)
    return timeout_ms;
  if (!idem_provider_call_may_start(lease_expires_at, timeout_ms + GW_LEASE_SLACK_MS, now_ms))
    return -1;
  left = lease_expires_at - now_ms - GW_LEASE_SLACK_MS;
  return left < timeout_ms ? left : timeout_ms;
}

/* The easy handle `c` set up for `req`, gathering into `g`: `*url` and
 * `*hdrs` are what it borrows (the caller frees them after the transfer).
 * Returns 0, or -1 when out of memory or too late for the key's lease
 * (nothing went out). */
static int set_up(gw_upstream_t *u, CURL *c, const gw_up_request_t *req, struct gather *g,
                  char **url, struct curl_slist **hdrs) {
  size_t ulen = strlen(u->base_url) + strlen(req->target) + 1;
  /* Checked as it is about to go: a keyed request may have waited in
   * queues since its reservation. */
  int64_t deadline = gw_upstream_deadline(u->timeout_ms, req->lease_expires_at, idem_now_ms());

  *url = NULL;
  *hdrs = NULL;
  if (deadline < 0)
    return -1;
  *url = malloc(ulen);
  *hdrs = header_list(req);
  if (*url == NULL || *hdrs == NULL) {
    curl_slist_free_all(*hdrs);
    free(*url);
    *hdrs = NULL;
    *url = NULL;
    return -1;
  }
  snprintf(*url, ulen, "%s%s", u->base_url, req->target);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_URL, *url);
  /* The path goes as the client sent it (gw_target_ok() passed it): libcurl
   * would otherwise resolve dot segments the routes did not see. */
  curl_easy_setopt(c, CURLOPT_PATH_AS_IS, 1L);
  curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 0L);
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, u->connect_timeout_ms);
  if (g->sink) {
    /* A streamed answer may take any time in all: the deadline is on
     * silence instead, no byte for as long as a call may take. */
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, u->timeout_ms < 1000 ? 1L : u->timeout_ms / 1000);
    if (g->sink->cut) {
      curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, on_progress);
      curl_easy_setopt(c, CURLOPT_XFERINFODATA, g);
      curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    }
  } else {
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)deadline);
  }
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, *hdrs);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, g);
  curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(c, CURLOPT_HEADERDATA, g);
  curl_easy_setopt(c, CURLOPT_PREREQFUNCTION, on_prereq);
  curl_easy_setopt(c, CURLOPT_PREREQDATA, g);
  /* A connection idle for longer is not reused: fewer of the races where
   * the upstream closes it as a request goes out (which, for a request
   * sent once, leaves its outcome unknown). Most servers keep an idle
   * connection 5 s or more. */
  curl_easy_setopt(c, CURLOPT_MAXAGE_CONN, 2L);
  /* Bodies and their encodings pass as they are. */
  curl_easy_setopt(c, CURLOPT_HTTP_CONTENT_DECODING, 0L);
  if (strcmp(req->method, "HEAD") == 0) {
    curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
  } else if (strcmp(req->method, "GET") == 0 && req->body_len == 0) {
    curl_easy_setopt(c, CURLOPT_HTTPGET, 1L);
  } else {
    if (req->body_len > 0 || strcmp(req->method, "POST") == 0 ||
        strcmp(req->method, "PUT") == 0 || strcmp(req->method, "PATCH") == 0) {
      curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)req->body_len);
      curl_easy_setopt(c, CURLOPT_POSTFIELDS, req->body_len ? req->body : "");
    }
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, req->method);
  }
  return 0;
}

/* What became of the transfer on `c` that ended with `rc`; `out` keeps
 * the status alone unless answered. */
static gw_up_result_t classify(CURL *c, CURLcode rc, const struct gather *g,
                               gw_answer_t *out) {
  gw_up_result_t result;
  long code = 0;

  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
  if (rc == CURLE_OK && code >= 100) {
    result = GW_UP_ANSWERED;
  } else if (g->too_large && code >= 100) {
    result = GW_UP_TOO_LARGE;
  } else {
    result = idem__curl_nothing_sent(c) ? GW_UP_NOT_SENT : GW_UP_NO_ANSWER;
  }
  out->status = (int)code;
  if (result != GW_UP_ANSWERED) {
    int status = out->status;
    gw_answer_free(out);
    out->status = status;
  }
  return result;
}

gw_up_result_t gw_upstream_call(gw_upstream_t *u, const gw_up_request_t *req,
                                gw_answer_t *out) {
  struct gather g = {.u = u, .a = out, .once = req->once};
  struct curl_slist *hdrs = NULL;
  gw_up_result_t result;
  char *url = NULL;
  CURL *c = take(u);

  memset(out, 0, sizeof *out);
  if (c == NULL || set_up(u, c, req, &g, &url, &hdrs) != 0) {
    if (c)
      give_back(u, c); /* nothing went out */
    return GW_UP_NOT_SENT;
  }
  result = classify(c, curl_easy_perform(c), &g, out);
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, NULL);
  curl_slist_free_all(hdrs);
  free(url);
  give_back(u, c);
  return result;
}

gw_up_result_t gw_upstream_stream(gw_upstream_t *u, const gw_up_request_t *req,
                                  const gw_up_stream_t *sink, gw_answer_t *out) {
  struct gather g = {.u = u, .a = out, .once = req->once, .sink = sink};
  struct curl_slist *hdrs = NULL;
  gw_up_result_t result;
  char *url = NULL;
  CURL *c = take(u);
  CURLcode rc;

  memset(out, 0, sizeof *out);
  g.easy = c;
  if (c == NULL || set_up(u, c, req, &g, &url, &hdrs) != 0) {
    if (c)
      give_back(u, c); /* nothing went out */
    return GW_UP_NOT_SENT;
  }
  rc = curl_easy_perform(c);
  if (g.head_sent) {
    /* Passed on as it came: whole, or cut (the client gone, or the
     * upstream silent or gone midway). */
    result = rc == CURLE_OK ? GW_UP_ANSWERED : GW_UP_NO_ANSWER;
  } else {
    result = classify(c, rc, &g, out); /* no body: the answer is whole in `out` */
  }
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, NULL);
  curl_slist_free_all(hdrs);
  free(url);
  give_back(u, c);
  return result;
}

/* ---- calls without a waiting thread: libcurl's multi interface ---- */

/* What the I/O thread keeps of a call under way. */
struct gw_up_call_priv {
  CURL *easy;
  char *url;
  struct curl_slist *hdrs;
  struct gather g;
};

struct gw_up_loop {
  gw_upstream_t *u;
  CURLM *multi;
  pthread_t thread;
  pthread_mutex_t lock;
  gw_up_call_t *queue, *queue_tail; /* handed over, not yet added */
  int stopping; /* under `lock`: 1 stopping, 2 its thread joined */
  CURL *idle[POOL_MAX];             /* the I/O thread's own */
  int nidle;
};

/* On the I/O thread: ends `call` with `result` and hands it back. */
static void finish(struct gw_up_loop *l, gw_up_call_t *call, gw_up_result_t result) {
  struct gw_up_call_priv *p = call->priv_;
  if (p) {
    if (p->easy) {
      curl_easy_setopt(p->easy, CURLOPT_HTTPHEADER, NULL);
      if (l->nidle < POOL_MAX) {
        curl_easy_reset(p->easy); /* its connections stay in the multi's cache */
        l->idle[l->nidle++] = p->easy;
      } else {
        curl_easy_cleanup(p->easy);
      }
    }
    curl_slist_free_all(p->hdrs);
    free(p->url);
    free(p);
    call->priv_ = NULL;
  }
  call->result = result;
  call->done(call); /* `call` is the caller's from here */
}

/* On the I/O thread: `call` set up and added to the multi, or finished
 * as not sent. */
static void start(struct gw_up_loop *l, gw_up_call_t *call) {
  struct gw_up_call_priv *p = calloc(1, sizeof *p);
  memset(&call->answer, 0, sizeof call->answer);
  call->priv_ = p;
  if (p == NULL) {
    finish(l, call, GW_UP_NOT_SENT);
    return;
  }
  p->easy = l->nidle > 0 ? l->idle[--l->nidle] : curl_easy_init();
  p->g = (struct gather){.u = l->u, .a = &call->answer, .once = call->req.once};
  if (p->easy == NULL || set_up(l->u, p->easy, &call->req, &p->g, &p->url, &p->hdrs) != 0) {
    finish(l, call, GW_UP_NOT_SENT);
    return;
  }
  curl_easy_setopt(p->easy, CURLOPT_PRIVATE, call);
  if (curl_multi_add_handle(l->multi, p->easy) != CURLM_OK)
    finish(l, call, GW_UP_NOT_SENT);
}

static void *loop_main(void *arg) {
  struct gw_up_loop *l = arg;
  int running = 0;

  for (;;) {
    gw_up_call_t *q;
    CURLMsg *msg;
    int left, stopping;

    pthread_mutex_lock(&l->lock);
    q = l->queue;
    l->queue = l->queue_tail = NULL;
    stopping = l->stopping;
    pthread_mutex_unlock(&l->lock);
    while (q) {
      gw_up_call_t *next = q->next_;
      start(l, q);
      q = next;
    }
    curl_multi_perform(l->multi, &running);
    while ((msg = curl_multi_info_read(l->multi, &left)) != NULL) {
      gw_up_call_t *call = NULL;
      struct gw_up_call_priv *p;
      gw_up_result_t result;
      if (msg->msg != CURLMSG_DONE)
        continue;
      curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&call);
      p = call->priv_;
      result = classify(p->easy, msg->data.result, &p->g, &call->answer);
      curl_multi_remove_handle(l->multi, p->easy);
      finish(l, call, result);
    }
    /* Stopping: the calls under way end (each within its deadline) and
     * nothing more is handed over (gw_upstream_submit() refuses). */
    if (stopping && running == 0)
      break;
    curl_multi_poll(l->multi, NULL, 0, 1000, NULL);
  }
  return NULL;
}

int gw_upstream_loop_start(gw_upstream_t *u) {
  struct gw_up_loop *l = calloc(1, sizeof *l);
  if (l == NULL || (l->multi = curl_multi_init()) == NULL) {
    free(l);
    return -1;
  }
  l->u = u;
  /* Connections kept alive across calls: as many as calls at once. */
  curl_multi_setopt(l->multi, CURLMOPT_MAXCONNECTS, (long)POOL_MAX);
  pthread_mutex_init(&l->lock, NULL);
  if (pthread_create(&l->thread, NULL, loop_main, l) != 0) {
    pthread_mutex_destroy(&l->lock);
    curl_multi_cleanup(l->multi);
    free(l);
    return -1;
  }
  u->loop = l;
  return 0;
}

int gw_upstream_submit(gw_upstream_t *u, gw_up_call_t *call) {
  /* Set before any caller can submit and freed only by gw_upstream_free():
   * a stopped loop refuses under its lock (gw_upstream_loop_stop()). */
  struct gw_up_loop *l = u->loop;
  int ok;
  if (l == NULL)
    return -1;
  call->next_ = NULL;
  call->priv_ = NULL;
  pthread_mutex_lock(&l->lock);
  ok = !l->stopping;
  if (ok) {
    if (l->queue_tail)
      l->queue_tail->next_ = call;
    else
      l->queue = call;
    l->queue_tail = call;
  }
  pthread_mutex_unlock(&l->lock);
  if (ok)
    curl_multi_wakeup(l->multi);
  return ok ? 0 : -1;
}

void gw_upstream_loop_stop(gw_upstream_t *u) {
  struct gw_up_loop *l = u ? u->loop : NULL;
  int joined;
  if (l == NULL)
    return;
  pthread_mutex_lock(&l->lock);
  joined = l->stopping == 2;
  if (!joined)
    l->stopping = 1;
  pthread_mutex_unlock(&l->lock);
  if (joined)
    return;
  curl_multi_wakeup(l->multi);
  pthread_join(l->thread, NULL);
  pthread_mutex_lock(&l->lock);
  l->stopping = 2; /* joined: the loop itself stays until gw_upstream_free() */
  pthread_mutex_unlock(&l->lock);
}

/* The loop's memory, once its thread is joined: only when no one can
 * hand it a call any more (gw_upstream_free(), after the event threads
 * and the store's writer stopped). */
static void loop_free(gw_upstream_t *u) {
  struct gw_up_loop *l = u->loop;
  if (l == NULL)
    return;
  gw_upstream_loop_stop(u);
  for (int i = 0; i < l->nidle; i++)
    curl_easy_cleanup(l->idle[i]);
  curl_multi_cleanup(l->multi);
  pthread_mutex_destroy(&l->lock);
  free(l);
  u->loop = NULL;
}
