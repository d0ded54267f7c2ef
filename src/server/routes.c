/* idemd's routes: the table the HTTP layer matches paths and methods
 * against, and the handlers a whole request goes to (docs/api.md): the
 * reads, /healthz, /metrics, and the creating routes' checks that need the
 * body (docs/idempotency.md, section 3: 413, 415, the key's 400, the
 * body's 400) before payments.c or orders.c. */
#include "server/routes.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "data/refunds.h"
#include "data/resources.h"
#include "idem/clock.h"
#include "idem/engine.h"
#include "idem/key.h"
#include "provider/payment.h"
#include "server/auth.h"
#include "server/log.h"
#include "server/replay_cache.h"
#include "server/readiness.h"
#include "server/reply.h"
#include "server/suspend.h"
#include "server/body.h"

static const idemd_route_def_t routes[] = {
    {"/payments", "", IDEMD_ID_NONE, "POST", "POST", ROUTE_PAYMENTS, OP_CREATE_PAYMENT,
     1},
    {"/payments/", "", IDEMD_ID_PLAIN, "GET", "GET, HEAD", ROUTE_PAYMENT, OP_GET_PAYMENT,
     1},
    {"/payments/", "/refunds", IDEMD_ID_PLAIN, "POST", "POST", ROUTE_REFUNDS,
     OP_CREATE_REFUND, 1},
    {"/refunds/", "", IDEMD_ID_PLAIN, "GET", "GET, HEAD", ROUTE_REFUND, OP_GET_REFUND, 1},
    {"/orders", "", IDEMD_ID_NONE, "POST", "POST", ROUTE_ORDERS, OP_CREATE_ORDER, 1},
    {"/orders/", "", IDEMD_ID_ORDER, "GET", "GET, HEAD, PUT", ROUTE_ORDER, OP_GET_ORDER,
     1},
    {"/orders/", "", IDEMD_ID_ORDER, "PUT", "GET, HEAD, PUT", ROUTE_ORDER_PUT,
     OP_PUT_ORDER, 1},
    {"/orders/", "/cancel", IDEMD_ID_ORDER, "POST", "POST", ROUTE_ORDER_CANCEL,
     OP_CANCEL_ORDER, 1},
    {"/healthz", "", IDEMD_ID_NONE, "GET", "GET, HEAD", ROUTE_HEALTHZ, OP_HEALTHZ, 0},
    {"/metrics", "", IDEMD_ID_NONE, "GET", "GET, HEAD", ROUTE_METRICS, OP_METRICS, 0},
    {"/readyz", "", IDEMD_ID_NONE, "GET", "GET, HEAD", ROUTE_READYZ, OP_READYZ, 0},
    /* The provider's signature authenticates it (webhooks.c). */
    {"/webhooks/provider", "", IDEMD_ID_NONE, "POST", "POST", ROUTE_WEBHOOK,
     OP_PROVIDER_WEBHOOK, 0},
};

/* Whether the `len` bytes at `s` are an {id} under `rule`. */
static int id_fits(idemd_id_rule_t rule, const char *s, size_t len) {
  if (rule == IDEMD_ID_PLAIN)
    return len >= 1 && len <= 63 &&
           strspn(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                     "0123456789_") >= len;
  if (len < 1 || len > IDEMD_PATH_ID_MAX)
    return 0;
  for (size_t i = 0; i < len; i++)
    if ((unsigned char)s[i] < 0x21 || (unsigned char)s[i] > 0x7e || s[i] == '/')
      return 0;
  return 1;
}

/* Whether `url` is the path of `d`; its {id} goes to `id`. */
static int path_matches(const idemd_route_def_t *d, const char *url, char *id,
                        size_t idcap) {
  size_t n = strlen(d->prefix), len;

  if (d->id_rule == IDEMD_ID_NONE)
    return strcmp(url, d->prefix) == 0;
  if (strncmp(url, d->prefix, n) != 0)
    return 0;
  url += n;
  len = strcspn(url, "/"); /* the {id} is one segment */
  if (strcmp(url + len, d->suffix) != 0 || len >= idcap || !id_fits(d->id_rule, url, len))
    return 0;
  memcpy(id, url, len);
  id[len] = '\0';
  return 1;
}

static int method_fits(const idemd_route_def_t *d, const char *method) {
  if (strcmp(method, d->method) == 0)
    return 1;
  return strcmp(d->method, "GET") == 0 && strcmp(method, "HEAD") == 0;
}

const idemd_route_def_t *idemd_route_match(const char *url, const char *method, char *id,
                                           size_t idcap, int *allowed) {
  const idemd_route_def_t *first = NULL;

  *allowed = 0;
  for (size_t i = 0; i < sizeof routes / sizeof *routes; i++) {
    const idemd_route_def_t *d = &routes[i];
    if (!path_matches(d, url, id, idcap))
      continue;
    if (method_fits(d, method)) {
      *allowed = 1;
      return d;
    }
    if (first == NULL)
      first = d;
  }
  return first;
}

int idemd_order_id_valid(const char *id) {
  size_t len = strlen(id);
  return strncmp(id, "ord_", 4) == 0 && len >= 5 && len <= 4 + 64 &&
         strspn(id + 4, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                        "0123456789_-") == len - 4;
}

static int is_json_media_type(const char *ct) {
  size_t n = strlen("application/json");
  if (ct == NULL)
    return 0;
  while (*ct == ' ' || *ct == '\t')
    ct++;
  if (strncasecmp(ct, "application/json", n) != 0)
    return 0;
  ct += n;
  while (*ct == ' ' || *ct == '\t')
    ct++;
  return *ct == '\0' || *ct == ';';
}

static enum MHD_Result serve_healthz(idemd_request_t *r) {
  r->outcome = OUTCOME_READ;
  if (idem_store_ping(r->srv->store) != IDEM_OK) {
    atomic_fetch_add_explicit(&r->srv->metrics.store_errors, 1, memory_order_relaxed);
    r->outcome = OUTCOME_ERROR;
    return idemd_reply_error(r, 503, "the store is unreachable", NULL);
  }
  return idemd_reply(r, 200, "{\"status\":\"ok\"}", 15, NULL);
}

/* Whether writes work now (readiness.c), then whether the store answers. */
static enum MHD_Result serve_readyz(idemd_request_t *r) {
  const char *why = idemd_not_ready(r->srv);

  r->outcome = OUTCOME_READ;
  if (why == NULL && idem_store_ping(r->srv->store) != IDEM_OK)
    why = "the store is unreachable";
  if (why) {
    r->outcome = OUTCOME_ERROR;
    return idemd_reply_error(r, 503, why, NULL);
  }
  return idemd_reply(r, 200, "{\"status\":\"ready\"}", 18, NULL);
}

static enum MHD_Result serve_metrics(idemd_request_t *r) {
  idemd_reply_headers_t h = {.content_type = "text/plain; version=0.0.4; charset=utf-8"};
  idemd_store_gauges_t g = {.pending = -1,
                           .processing = -1,
                           .connections_cut = idemd_guard_cut(r->srv->guard),
                           .connections_refused = idemd_guard_refused(r->srv->guard),
                           .parked = idem_engine_parked(r->srv->engine),
                           .store_backend = idem_store_backend(r->srv->store)};
  int64_t oldest = 0;
  enum MHD_Result ret;
  char *text;

  if (idem_store_count(r->srv->store, "pending", 0, &g.pending) != IDEM_OK ||
      idem_store_count(r->srv->store, "processing", 0, &g.processing) != IDEM_OK ||
      idem_store_count(r->srv->store, "oldest_pending", 0, &oldest) != IDEM_OK)
    atomic_fetch_add_explicit(&r->srv->metrics.store_errors, 1, memory_order_relaxed);
  if (oldest > 0)
    g.oldest_pending_seconds = (double)(idem_now_ms() - oldest) / 1000.0;
  idem_store_stats_t st;
  idem_store_stats(r->srv->store, &st);
  g.store_commits = st.commits;
  g.store_writes = st.writes;
  g.store_batch_reruns = st.batch_reruns;
  g.replay_cache_hits = idemd_replay_cache_hits(r->srv->replays);
  text = idemd_metrics_render(&r->srv->metrics, &g);
  if (text == NULL)
    return idemd_reply_error(r, 500, "internal error", NULL);
  r->outcome = OUTCOME_READ;
  ret = idemd_reply(r, 200, text, strlen(text), &h);
  free(text);
  return ret;
}

/* GET /orders/{id}, /refunds/{id}: the tenant's own resource. */
static enum MHD_Result serve_resource(idemd_request_t *r, const char *kind,
                                      const char *not_found) {
  char *body = NULL;
  enum MHD_Result ret;
  int rc = idemd_resource_get(r->srv->store, r->tenant.id, kind, r->resource_id, &body);
  if (rc == IDEM_ENOTFOUND) {
    r->outcome = OUTCOME_INVALID;
    return idemd_reply_error(r, 404, not_found, NULL);
  }
  if (rc != IDEM_OK)
    return idemd_reply_store_error(r, rc);
  r->outcome = OUTCOME_READ;
  ret = idemd_reply(r, 200, body, strlen(body), NULL);
  free(body);
  return ret;
}

/* GET /payments/{id}: the payment with what its refunds made of it. */
static enum MHD_Result serve_payment(idemd_request_t *r) {
  char *stored = NULL, *body;
  int64_t refunded = 0;
  enum MHD_Result ret;
  int rc = idemd_payment_get(r->srv->store, r->tenant.id, r->resource_id, &stored, &refunded);

  if (rc == IDEM_ENOTFOUND) {
    r->outcome = OUTCOME_INVALID;
    return idemd_reply_error(r, 404, "payment not found", NULL);
  }
  if (rc != IDEM_OK)
    return idemd_reply_store_error(r, rc);
  body = idem_payment_with_refunded(stored, refunded);
  free(stored);
  if (body == NULL)
    return idemd_reply_error(r, 500, "internal error", NULL);
  r->outcome = OUTCOME_READ;
  ret = idemd_reply(r, 200, body, strlen(body), NULL);
  free(body);
  return ret;
}

/* The checks that need the whole body (docs/idempotency.md, section 3.2),
 * then the route's handler. A creating POST needs its Idempotency-Key; a
 * PUT's {id} is checked where the key would be, and a cancellation takes
 * neither a key nor a field, its body empty or {}: the routes that are
 * idempotent by design ignore an Idempotency-Key (docs/idempotency.md,
 * section 3.5). */
static enum MHD_Result serve_body(idemd_request_t *r) {
  const char *ct, *raw;
  json_t *body = NULL;
  const char *msg = NULL;
  int out_of_range = 0, rc;
  enum MHD_Result ret;

  r->outcome = OUTCOME_INVALID;
  if (r->body_too_large)
    return idemd_reply_error(r, 413, "request body is larger than 64 KiB", NULL);
  ct = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE);
  if (!is_json_media_type(ct))
    return idemd_reply_error(r, 415, "Content-Type must be application/json", NULL);
  if (r->route == ROUTE_PAYMENTS || r->route == ROUTE_ORDERS || r->route == ROUTE_REFUNDS) {
    raw = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, "Idempotency-Key");
    rc = idem_key_parse(raw, raw ? strlen(raw) : 0, r->key, NULL);
    if (rc != IDEM_OK)
      return idemd_reply_error(r, 400, idem_strerror(rc), NULL);
    idemd_key_id(r, idemd_op_name(r->op));
  } else if (r->route == ROUTE_ORDER_PUT && !idemd_order_id_valid(r->resource_id)) {
    return idemd_reply_error(
        r, 400, "order id must be ord_ followed by 1 to 64 of A-Z a-z 0-9 _ -", NULL);
  }
  if (r->route == ROUTE_ORDER_CANCEL && r->body_len == 0)
    return idemd_orders_cancel(r, NULL);
  if (idemd_parse_body(r->body, r->body_len, &body, &out_of_range, &msg) != 0)
    return idemd_reply_error(r, 400, msg, NULL);
  switch (r->route) {
  case ROUTE_PAYMENTS:
    ret = idemd_payments_create(r, body);
    break;
  case ROUTE_ORDERS:
    ret = idemd_orders_create(r, body);
    break;
  case ROUTE_REFUNDS:
    ret = idemd_refunds_create(r, body);
    break;
  case ROUTE_ORDER_PUT:
    ret = idemd_orders_put(r, body);
    break;
  default: /* ROUTE_ORDER_CANCEL */
    ret = idemd_orders_cancel(r, body);
  }
  json_decref(body);
  return ret;
}

int idemd_check_key(idemd_request_t *r) {
  int rc = idemd_authenticate(r->srv->tenants,
                              MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND,
                                                          MHD_HTTP_HEADER_AUTHORIZATION),
                              &r->tenant);
  if (rc == IDEM_OK)
    r->authenticated = 1;
  return rc;
}

enum MHD_Result idemd_reply_key_failure(idemd_request_t *r, int rc) {
  idemd_reply_headers_t h = {.www_authenticate = 1};
  if (rc != IDEM_ENOTFOUND)
    return idemd_reply_store_error(r, rc);
  r->outcome = OUTCOME_INVALID;
  return idemd_reply_error(r, 401, "missing or invalid API key", &h);
}

enum MHD_Result idemd_dispatch(idemd_request_t *r) {
  int local = idem_store_local_reads(r->srv->store);
  int rc;

  /* Checked in the event thread whatever the store: only a valid event
   * goes on to a worker. */
  if (r->route == ROUTE_WEBHOOK)
    return idemd_webhook_receive(r);
  /* Where reads may block (PostgreSQL), a key that memory does not hold
   * waits on the network: then all of it runs in a worker. A keyed POST
   * with a key remembered goes on here, for its replay from memory, as on
   * SQLite (flow.c, go_on(); docs/performance.md, "PostgreSQL: API keys
   * and replays from memory"); anything else defers there. */
  if (!r->may_block && !local) {
    if (!r->needs_auth || r->authenticated ||
        (r->route != ROUTE_PAYMENTS && r->route != ROUTE_ORDERS &&
         r->route != ROUTE_REFUNDS))
      return idemd_defer(r, idemd_dispatch);
    rc = idemd_authenticate_remembered(
        r->srv->tenants,
        MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND,
                                    MHD_HTTP_HEADER_AUTHORIZATION),
        &r->tenant);
    if (rc == IDEM_EAGAIN)
      return idemd_defer(r, idemd_dispatch);
    if (rc != IDEM_OK)
      return idemd_reply_key_failure(r, rc);
    r->authenticated = 1;
  }
  if (r->needs_auth && !r->authenticated && (rc = idemd_check_key(r)) != IDEM_OK)
    return idemd_reply_key_failure(r, rc);
  switch (r->route) {
  case ROUTE_HEALTHZ:
    return serve_healthz(r);
  case ROUTE_METRICS:
    return serve_metrics(r);
  case ROUTE_READYZ:
    return serve_readyz(r);
  case ROUTE_PAYMENT:
    return serve_payment(r);
  case ROUTE_ORDER:
    return serve_resource(r, "order", "order not found");
  case ROUTE_REFUND:
    return serve_resource(r, "refund", "refund not found");
  case ROUTE_PAYMENTS:
  case ROUTE_ORDERS:
  case ROUTE_REFUNDS:
    return serve_body(r);
  case ROUTE_ORDER_PUT:
  case ROUTE_ORDER_CANCEL:
    /* A write of their own, with no key: it waits on the store. */
    if (!r->may_block)
      return idemd_defer(r, idemd_dispatch);
    return serve_body(r);
  default:
    return idemd_reply_error(r, 404, "not found", NULL);
  }
}
