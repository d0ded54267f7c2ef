/* The HTTP side of idem-psp on libmicrohttpd: routes, POST /charges and
 * POST /refunds with their faults in the order they act (one path for
 * both), and one JSON log line per request.
 *
 * A thread per connection, so a request sleeping in a fault never delays
 * another; sleeps wait on a condition variable that psp_server_stop()
 * signals, so a shutdown does not wait for them. */
#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <openssl/rand.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "psp.h"

/* Past the cap a body is read and dropped (so the client can read its
 * 413) up to this much; beyond it the connection is closed. */
#define DISCARD_LIMIT (1024 * 1024)
#define MAX_SAFE_INTEGER 9007199254740991LL

struct psp_server {
  struct MHD_Daemon *daemon;
  const psp_config_t *cfg;
  psp_store_t *store;
  psp_webhooks_t *webhooks; /* NULL: none */
  pthread_mutex_t sleep_lock;
  pthread_cond_t wake; /* on CLOCK_MONOTONIC */
  int stopping;
};

enum route { R_NONE, R_CREATE, R_GET, R_LIST, R_STATS, R_HEALTHZ };

struct route_def {
  const char *path;
  int is_prefix; /* "/charges/" + key */
  const char *method;
  const char *allow;
  enum route route;
  psp_kind_t kind; /* of R_CREATE and R_GET */
};

static const struct route_def routes[] = {
    {"/charges", 0, "POST", "GET, HEAD, POST", R_CREATE, PSP_KIND_CHARGE},
    {"/charges", 0, "GET", "GET, HEAD, POST", R_LIST, PSP_KIND_CHARGE},
    {"/charges/", 1, "GET", "GET, HEAD", R_GET, PSP_KIND_CHARGE},
    {"/refunds", 0, "POST", "GET, HEAD, POST", R_CREATE, PSP_KIND_REFUND},
    {"/refunds", 0, "GET", "GET, HEAD, POST", R_LIST, PSP_KIND_REFUND},
    {"/refunds/", 1, "GET", "GET, HEAD", R_GET, PSP_KIND_REFUND},
    {"/stats", 0, "GET", "GET, HEAD", R_STATS, PSP_KIND_CHARGE},
    {"/healthz", 0, "GET", "GET, HEAD", R_HEALTHZ, PSP_KIND_CHARGE},
};

/* What differs between a charge and a refund in their answers. */
static const struct kind_def {
  const char *id_prefix;
  const char *not_found;
  const char *fail_before;
  const char *fail_after;
  const char *mismatch;
} kinds[] = {
    [PSP_KIND_CHARGE] = {"ch_", "no charge", "simulated failure before the charge",
                         "simulated failure after the charge",
                         "Idempotency-Key was already used with a different amount or "
                         "currency"},
    [PSP_KIND_REFUND] = {"re_", "no refund", "simulated failure before the refund",
                         "simulated failure after the refund",
                         "Idempotency-Key was already used with a different charge, "
                         "amount or currency"},
};

/* One request, from its headers to the log line. */
struct request {
  psp_server_t *srv;
  struct MHD_Connection *conn;
  const struct route_def *route;
  const char *method;
  const char *url;
  char path[256];            /* for the log: visible ASCII only */
  char key[PSP_KEY_MAX + 1]; /* for the log, and the key when key_ok */
  int key_ok;
  int has_fault_header;
  int chaos;       /* the faults came from --chaos */
  char fault[160]; /* the faults applied, "" for other routes */
  int status;      /* 0 while (or when) nothing was answered */
  char *body;
  size_t body_len, body_seen;
  int too_large;
  int64_t start_ms;
  enum MHD_Result ret; /* of the reply sent by an ..._or_reply helper */
};

static int64_t mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void format_now(char *out, size_t outlen) {
  time_t now = time(NULL);
  struct tm tm;
  gmtime_r(&now, &tm);
  if (strftime(out, outlen, "%Y-%m-%dT%H:%M:%SZ", &tm) == 0)
    out[0] = '\0';
}

void psp_log(json_t *line) {
  char *text = line ? json_dumps(line, JSON_COMPACT) : NULL;
  json_decref(line);
  if (text == NULL)
    return;
  /* One stdio call: its lock keeps lines from different threads whole. */
  fprintf(stderr, "%s\n", text);
  free(text);
}

/* Copies `in` with anything but visible ASCII replaced, for logs. */
static void copy_visible(char *out, size_t outlen, const char *in) {
  size_t i;
  for (i = 0; in[i] && i < outlen - 1; i++) {
    unsigned char c = (unsigned char)in[i];
    out[i] = c >= 0x21 && c <= 0x7e ? (char)c : '?';
  }
  out[i] = '\0';
}

/* 1 to 255 visible ASCII characters. */
static int key_valid(const char *k) {
  size_t n = strlen(k);
  if (n < 1 || n > PSP_KEY_MAX)
    return 0;
  for (size_t i = 0; i < n; i++)
    if ((unsigned char)k[i] < 0x21 || (unsigned char)k[i] > 0x7e)
      return 0;
  return 1;
}

/* Sleeps `ms`, or less when the server stops. Returns 0 when it slept it
 * all, -1 when the server is stopping. Holds no lock while it waits. */
static int nap(psp_server_t *srv, int64_t ms) {
  struct timespec until;
  int stopping;

  clock_gettime(CLOCK_MONOTONIC, &until);
  until.tv_sec += (time_t)(ms / 1000);
  until.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec++;
    until.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&srv->sleep_lock);
  while (!srv->stopping &&
         pthread_cond_timedwait(&srv->wake, &srv->sleep_lock, &until) != ETIMEDOUT)
    ;
  stopping = srv->stopping;
  pthread_mutex_unlock(&srv->sleep_lock);
  return stopping ? -1 : 0;
}

/* ---- answers ---------------------------------------------------------- */

/* Sends `body` (stolen) as JSON. */
static enum MHD_Result reply(struct request *r, int status, json_t *body, int replayed,
                             const char *allow) {
  char *text = body ? json_dumps(body, JSON_COMPACT) : NULL;
  struct MHD_Response *resp;
  enum MHD_Result ret;

  json_decref(body);
  if (text == NULL) {
    status = 500;
    text = strdup("{\"error\":\"internal error\"}");
    if (text == NULL)
      return MHD_NO;
  }
  resp = MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
  if (resp == NULL) {
    free(text);
    return MHD_NO;
  }
  MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
  if (replayed)
    MHD_add_response_header(resp, "Idempotent-Replayed", "true");
  if (allow)
    MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, allow);
  ret = MHD_queue_response(r->conn, (unsigned)status, resp);
  MHD_destroy_response(resp);
  r->status = status;
  return ret;
}

static enum MHD_Result reply_error(struct request *r, int status, const char *message) {
  return reply(r, status, json_pack("{s:s}", "error", message), 0,
               status == 405 ? r->route->allow : NULL);
}

/* A charge's JSON; a refund's has "charge" too, after "key". "key" is
 * null for one made with the key ignored (stored under its own id), and
 * "reference" is there when one was sent. */
static json_t *charge_json(psp_kind_t kind, const psp_charge_t *c) {
  json_t *j = json_pack("{s:s, s:o, s:s*, s:I, s:s, s:s, s:s}", "id", c->id, "key",
                        strcmp(c->key, c->id) == 0 ? json_null() : json_string(c->key),
                        "charge", kind == PSP_KIND_REFUND ? c->charge : NULL, "amount",
                        (json_int_t)c->amount, "currency", c->currency, "status",
                        c->status, "created_at", c->created_at);
  if (j && c->reference[0])
    json_object_set_new(j, "reference", json_string(c->reference));
  return j;
}

static enum MHD_Result reply_charge(struct request *r, int status, const psp_charge_t *c,
                                    int replayed) {
  return reply(r, status, charge_json(r->route->kind, c), replayed, NULL);
}

static int charge_status(const psp_charge_t *c) {
  return strcmp(c->status, "declined") == 0 ? 402 : 201;
}

/* ---- POST /charges and POST /refunds, step by step --------------------
 * Each ..._or_reply helper returns 0 to go on, or -1 after answering (its
 * MHD result in r->ret). */

/* The X-Psp-Fault header, or else the flags plus a --chaos draw. */
static int faults_or_reply(struct request *r, psp_faults_t *f) {
  const psp_config_t *cfg = r->srv->cfg;
  const char *h = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, "X-Psp-Fault");

  r->has_fault_header = h != NULL;
  if (h) {
    if (psp_faults_parse(h, f) != 0) {
      snprintf(r->fault, sizeof r->fault, "invalid");
      r->ret = reply_error(r, 400,
                           "X-Psp-Fault must be a comma-separated list of: "
                           "latency=DUR, delay-after-charge=DUR, fail-before, "
                           "fail-after, drop-after, crash-after, decline, none");
      return -1;
    }
  } else {
    *f = cfg->faults;
    r->chaos = psp_chaos_pick(cfg->chaos, f);
  }
  psp_faults_describe(f, r->fault, sizeof r->fault);
  return 0;
}

static int key_or_reply(struct request *r) {
  if (r->key_ok || r->srv->cfg->ignore_key)
    return 0;
  r->ret = reply_error(r, 400,
                       r->key[0] ? "Idempotency-Key must be 1 to 255 visible "
                                   "ASCII characters"
                                 : "Idempotency-Key header is required");
  return -1;
}

/* A JSON string of 1 to 255 visible ASCII characters (no NUL inside). */
static int string_valid(json_t *v) {
  return json_is_string(v) && key_valid(json_string_value(v)) &&
         strlen(json_string_value(v)) == json_string_length(v);
}

/* Three upper-case letters (NULL: not a string). */
static int is_currency(const char *s) {
  return s && strlen(s) == 3 && strspn(s, "ABCDEFGHIJKLMNOPQRSTUVWXYZ") == 3;
}

/* {"amount": positive integer, "currency": "XYZ" (default "BRL")}; a
 * refund's also has "charge", the key of the charge refunded, and its
 * currency defaults to that charge's. Other fields are ignored. Fills
 * want->amount, want->currency ("" for a refund without one) and
 * want->charge. */
static int body_or_reply(struct request *r, psp_charge_t *want) {
  int refund = r->route->kind == PSP_KIND_REFUND;
  json_t *body = NULL, *amount, *currency, *charge, *reference;
  const char *msg = NULL;

  if (r->too_large) {
    r->ret = reply_error(r, 413, "request body is larger than 64 KiB");
    return -1;
  }
  if (r->body)
    body = json_loadb(r->body, r->body_len, JSON_REJECT_DUPLICATES, NULL);
  amount = json_object_get(body, "amount"); /* NULL when body is not an object */
  currency = json_object_get(body, "currency");
  charge = json_object_get(body, "charge");
  reference = json_object_get(body, "reference");
  if (!json_is_object(body))
    msg = "the body must be a JSON object";
  else if (!json_is_integer(amount) || json_integer_value(amount) < 1 ||
           json_integer_value(amount) > MAX_SAFE_INTEGER)
    msg = "amount must be a positive integer (minor units)";
  else if (refund && !string_valid(charge))
    msg = "charge must be the Idempotency-Key of a charge (1 to 255 visible "
          "ASCII characters)";
  else if (currency && !is_currency(json_string_value(currency)))
    msg = "currency must be three upper-case letters";
  else if (reference && !string_valid(reference))
    msg = "reference must be 1 to 255 visible ASCII characters";
  if (msg == NULL) {
    want->amount = json_integer_value(amount);
    snprintf(want->currency, sizeof want->currency, "%s",
             currency ? json_string_value(currency) : refund ? "" : "BRL");
    snprintf(want->charge, sizeof want->charge, "%s",
             refund ? json_string_value(charge) : "");
    snprintf(want->reference, sizeof want->reference, "%s",
             reference ? json_string_value(reference) : "");
  }
  json_decref(body);
  if (msg) {
    r->ret = reply_error(r, 422, msg);
    return -1;
  }
  return 0;
}

/* Makes the charge (or refund) of r->key, or finds the one made before: 0
 * with `got` and *created set, or -1 after answering 409 (another amount,
 * currency or charge under this key) or 500. */
static int charge_or_reply(struct request *r, psp_charge_t *want, int decline,
                           psp_charge_t *got, int *created) {
  const struct kind_def *k = &kinds[r->route->kind];
  unsigned char raw[12];
  time_t now = time(NULL);
  struct tm tm;
  int rc;

  if (RAND_bytes(raw, sizeof raw) != 1) {
    r->ret = reply_error(r, 500, "internal error");
    return -1;
  }
  memcpy(want->id, k->id_prefix, 3);
  for (size_t i = 0; i < sizeof raw; i++)
    snprintf(want->id + 3 + 2 * i, 3, "%02x", raw[i]);
  memcpy(want->key, r->key, sizeof want->key);
  snprintf(want->status, sizeof want->status, "%s", decline ? "declined" : "succeeded");
  gmtime_r(&now, &tm);
  strftime(want->created_at, sizeof want->created_at, "%Y-%m-%dT%H:%M:%SZ", &tm);

  rc = r->route->kind == PSP_KIND_REFUND
           ? psp_store_refund(r->srv->store, want, decline, r->srv->cfg->ignore_key, got)
           : psp_store_charge(r->srv->store, want, r->srv->cfg->ignore_key, got);
  if (rc == PSP_STORE_ERROR) {
    r->ret = reply_error(r, 500, "internal error");
    return -1;
  }
  /* A refund without a currency takes its charge's: any matches. */
  if (got->amount != want->amount || strcmp(got->charge, want->charge) != 0 ||
      (want->currency[0] && strcmp(got->currency, want->currency) != 0)) {
    r->ret = reply_error(r, 409, k->mismatch);
    return -1;
  }
  *created = rc == PSP_CREATED;
  return 0;
}

/* Logs the request now and exits as a crash would: no answer, no cleanup. */
__attribute__((noreturn)) static void crash(struct request *r);

static enum MHD_Result serve_create(struct request *r) {
  psp_server_t *srv = r->srv;
  psp_charge_t want = {0}, got;
  psp_faults_t f;
  int created;

  if (faults_or_reply(r, &f) != 0)
    return r->ret;
  if (f.latency_ms > 0 && nap(srv, f.latency_ms) != 0)
    return reply_error(r, 503, "shutting down");
  if (key_or_reply(r) != 0 || body_or_reply(r, &want) != 0)
    return r->ret;
  if (!r->has_fault_header && psp_config_declines(srv->cfg, want.amount)) {
    f.decline = 1;
    psp_faults_describe(&f, r->fault, sizeof r->fault);
  }
  if (f.fail_before)
    return reply_error(r, 500, kinds[r->route->kind].fail_before);
  if (charge_or_reply(r, &want, f.decline, &got, &created) != 0)
    return r->ret;
  if (created)
    psp_webhooks_emit(srv->webhooks, r->route->kind, &got);
  /* The charge (or refund) is committed: from here on it exists whatever
   * we answer. */
  if (f.delay_ms > 0)
    (void)nap(srv, f.delay_ms);
  if (f.crash_after)
    crash(r);
  if (f.drop_after)
    return MHD_NO;
  if (f.fail_after)
    return reply_error(r, 500, kinds[r->route->kind].fail_after);
  return reply_charge(r, charge_status(&got), &got, !created);
}

/* ---- the other routes ----------------------------------------------------- */

/* GET /charges/{key} and GET /refunds/{key}. */
static enum MHD_Result serve_get(struct request *r) {
  const char *key = r->url + strlen(r->route->path);
  const char *not_found = kinds[r->route->kind].not_found;
  psp_charge_t c;
  int rc;

  copy_visible(r->key, sizeof r->key, key);
  if (!key_valid(key))
    return reply_error(r, 404, not_found);
  rc = psp_store_get(r->srv->store, r->route->kind, key, &c);
  if (rc == PSP_STORE_ERROR)
    return reply_error(r, 500, "internal error");
  if (rc == PSP_NOT_FOUND)
    return reply_error(r, 404, not_found);
  return reply_charge(r, 200, &c, 0);
}

/* GET /charges?reference=R and GET /refunds?reference=R: what was made
 * under the merchant's reference R, oldest first. */
static enum MHD_Result serve_list(struct request *r) {
  const char *ref =
      MHD_lookup_connection_value(r->conn, MHD_GET_ARGUMENT_KIND, "reference");
  int refund = r->route->kind == PSP_KIND_REFUND, n = 0;
  psp_charge_t *found;
  json_t *list;

  if (ref == NULL || !key_valid(ref))
    return reply_error(r, 400,
                       "the query must be ?reference= 1 to 255 visible ASCII characters");
  copy_visible(r->key, sizeof r->key, ref);
  if ((found = calloc(PSP_LIST_MAX, sizeof *found)) == NULL)
    return reply_error(r, 500, "internal error");
  if (psp_store_list(r->srv->store, r->route->kind, ref, found, PSP_LIST_MAX, &n) != 0) {
    free(found);
    return reply_error(r, 500, "internal error");
  }
  list = json_array();
  for (int i = 0; i < n; i++)
    json_array_append_new(list, charge_json(r->route->kind, &found[i]));
  free(found);
  return reply(r, 200, json_pack("{s:o}", refund ? "refunds" : "charges", list), 0, NULL);
}

static enum MHD_Result serve_stats(struct request *r) {
  json_t *stats = psp_store_stats(r->srv->store);
  if (stats == NULL)
    return reply_error(r, 500, "internal error");
  return reply(r, 200, stats, 0, NULL);
}

static enum MHD_Result dispatch(struct request *r) {
  switch (r->route->route) {
  case R_CREATE:
    if (psp_store_count_request(r->srv->store, r->route->kind,
                                r->key_ok ? r->key : NULL) != 0)
      return reply_error(r, 500, "internal error");
    return serve_create(r);
  case R_GET:
    return serve_get(r);
  case R_LIST:
    return serve_list(r);
  case R_STATS:
    return serve_stats(r);
  case R_HEALTHZ:
    return reply(r, 200, json_pack("{s:s}", "status", "ok"), 0, NULL);
  default:
    return reply_error(r, 404, "not found");
  }
}

/* ---- libmicrohttpd callbacks ---------------------------------------------- */

static void log_request(struct request *r) {
  char now[32];
  format_now(now, sizeof now);
  psp_log(json_pack("{s:s, s:s, s:s, s:s?, s:s?, s:b, s:o, s:I}", "time", now, "method",
                    r->method, "path", r->path, "key", r->key[0] ? r->key : NULL, "fault",
                    r->fault[0] ? r->fault : NULL, "chaos", r->chaos, "status",
                    r->status ? json_integer(r->status) : json_null(), "ms",
                    (json_int_t)(mono_ms() - r->start_ms)));
}

static void crash(struct request *r) {
  r->status = 0;
  log_request(r);
  _exit(3);
}

/* The route of the path and method (HEAD as GET); else the first of the
 * path, whose method then answers 405; NULL for an unknown path. */
static const struct route_def *match_route(const char *url, const char *method) {
  const struct route_def *first = NULL;
  if (strcmp(method, "HEAD") == 0)
    method = "GET";
  for (size_t i = 0; i < sizeof routes / sizeof *routes; i++) {
    const struct route_def *d = &routes[i];
    if (!(d->is_prefix ? strncmp(url, d->path, strlen(d->path)) == 0
                       : strcmp(url, d->path) == 0))
      continue;
    if (strcmp(method, d->method) == 0)
      return d;
    if (first == NULL)
      first = d;
  }
  return first;
}

/* First call: headers only. Answers at once for an unknown path or a
 * method the path does not take. */
static enum MHD_Result on_headers(struct request *r) {
  const char *key;

  copy_visible(r->path, sizeof r->path, r->url);
  r->route = match_route(r->url, r->method);
  if (r->route == NULL)
    return reply_error(r, 404, "not found");
  if (strcmp(r->method, r->route->method) != 0 &&
      !(strcmp(r->route->method, "GET") == 0 && strcmp(r->method, "HEAD") == 0))
    return reply_error(r, 405, "method not allowed");
  if (r->route->route == R_CREATE) {
    key = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, "Idempotency-Key");
    if (key) {
      copy_visible(r->key, sizeof r->key, key);
      r->key_ok = key_valid(key);
    }
  }
  return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version,
                                  const char *upload_data, size_t *upload_data_size,
                                  void **con_cls) {
  struct request *r = *con_cls;
  size_t n = *upload_data_size;

  (void)version;
  if (r == NULL) {
    r = calloc(1, sizeof *r);
    if (r == NULL)
      return MHD_NO;
    r->srv = cls;
    r->conn = conn;
    r->method = method;
    r->url = url;
    r->start_ms = mono_ms();
    *con_cls = r;
    return on_headers(r);
  }
  if (n > 0) {
    *upload_data_size = 0;
    r->body_seen += n;
    if (r->status == 0 && r->body_len + n > PSP_MAX_BODY)
      r->too_large = 1;
    if (r->status || r->too_large)
      return r->body_seen > DISCARD_LIMIT ? MHD_NO : MHD_YES;
    if (r->body == NULL && (r->body = malloc(PSP_MAX_BODY)) == NULL)
      return MHD_NO;
    memcpy(r->body + r->body_len, upload_data, n);
    r->body_len += n;
    return MHD_YES;
  }
  if (r->status)
    return MHD_YES;
  return dispatch(r);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
  struct request *r = *con_cls;
  (void)cls;
  (void)conn;
  (void)toe;
  if (r == NULL)
    return;
  log_request(r);
  free(r->body);
  free(r);
  *con_cls = NULL;
}

static int hex_value(char c) {
  if (c >= '0' && c <= '9')
    return c - '0';
  if (c >= 'a' && c <= 'f')
    return c - 'a' + 10;
  if (c >= 'A' && c <= 'F')
    return c - 'A' + 10;
  return -1;
}

/* Percent-decodes the path in place, except %00, which stays as written
 * so that a NUL can never cut a key short. */
static size_t unescape(void *cls, struct MHD_Connection *conn, char *s) {
  char *w = s;
  (void)cls;
  (void)conn;
  for (const char *p = s; *p; p++) {
    int hi = p[0] == '%' ? hex_value(p[1]) : -1;
    int lo = hi >= 0 ? hex_value(p[2]) : -1;
    if (lo >= 0 && (hi | lo) != 0) {
      *w++ = (char)(hi * 16 + lo);
      p += 2;
    } else {
      *w++ = *p;
    }
  }
  *w = '\0';
  return (size_t)(w - s);
}

/* libmicrohttpd's own complaints, as log lines. */
static void mhd_logger(void *cls, const char *fmt, va_list ap) {
  char msg[512];
  size_t n;
  (void)cls;
  vsnprintf(msg, sizeof msg, fmt, ap);
  n = strlen(msg);
  while (n > 0 && msg[n - 1] == '\n')
    msg[--n] = '\0';
  for (size_t i = 0; i < n; i++)
    if ((unsigned char)msg[i] < 0x20 || (unsigned char)msg[i] > 0x7e)
      msg[i] = '?';
  psp_log(json_pack("{s:s, s:s}", "event", "httpd", "message", msg));
}

int psp_server_start(const psp_config_t *cfg, psp_store_t *store,
                     psp_webhooks_t *webhooks, psp_server_t **out, char *err,
                     size_t errlen) {
  struct addrinfo hints = {0}, *ai = NULL;
  psp_server_t *srv;
  pthread_condattr_t attr;
  char port[8];

  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | AI_PASSIVE;
  snprintf(port, sizeof port, "%d", cfg->listen_port);
  if (getaddrinfo(cfg->listen_host, port, &hints, &ai) != 0 || ai == NULL) {
    snprintf(err, errlen, "cannot resolve the listen address '%s'", cfg->listen_host);
    return PSP_START_BAD_ADDRESS;
  }
  srv = calloc(1, sizeof *srv);
  if (srv == NULL) {
    freeaddrinfo(ai);
    snprintf(err, errlen, "out of memory");
    return PSP_START_FAILED;
  }
  srv->cfg = cfg;
  srv->store = store;
  srv->webhooks = webhooks;
  pthread_mutex_init(&srv->sleep_lock, NULL);
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(&srv->wake, &attr);
  pthread_condattr_destroy(&attr);
  srv->daemon = MHD_start_daemon(
      MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
          MHD_USE_ERROR_LOG | (ai->ai_family == AF_INET6 ? MHD_USE_IPv6 : 0),
      0, NULL, NULL, on_request, srv, MHD_OPTION_EXTERNAL_LOGGER, mhd_logger, NULL,
      MHD_OPTION_SOCK_ADDR, ai->ai_addr, MHD_OPTION_NOTIFY_COMPLETED, on_completed, srv,
      MHD_OPTION_UNESCAPE_CALLBACK, unescape, NULL, MHD_OPTION_CONNECTION_TIMEOUT,
      (unsigned int)30, MHD_OPTION_CONNECTION_LIMIT, (unsigned int)1000, MHD_OPTION_END);
  freeaddrinfo(ai);
  if (srv->daemon == NULL) {
    snprintf(err, errlen, "cannot listen on %s:%d", cfg->listen_host, cfg->listen_port);
    psp_server_stop(srv);
    return PSP_START_FAILED;
  }
  *out = srv;
  return 0;
}

void psp_server_stop(psp_server_t *srv) {
  pthread_mutex_lock(&srv->sleep_lock);
  srv->stopping = 1;
  pthread_cond_broadcast(&srv->wake);
  pthread_mutex_unlock(&srv->sleep_lock);
  if (srv->daemon)
    MHD_stop_daemon(srv->daemon);
  pthread_cond_destroy(&srv->wake);
  pthread_mutex_destroy(&srv->sleep_lock);
  free(srv);
}
