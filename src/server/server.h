/* idemd's shared state: the server (configuration, store, provider,
 * secrets, metrics) and the per-request context the HTTP layer hands to
 * route handlers. */
#ifndef IDEMD_SERVER_H
#define IDEMD_SERVER_H

#include <jansson.h>
#include <microhttpd.h>
#include <stdint.h>

#include "idem/crypto.h"
#include "idem/store.h"
#include "provider/provider.h"
#include "provider/reconciler.h"
#include "data/tenants.h"
#include "server/config.h"
#include "server/guard.h"
#include "server/metrics.h"
#include "server/workers.h"

#define IDEMD_MAX_BODY (64 * 1024)
/* The longest {id} a path may carry (routes.c): room for a client's order
 * id (ord_ and 64) and for telling a longer one apart (400, not 404). */
#define IDEMD_PATH_ID_MAX 95

typedef struct idemd_server {
  idemd_config_t cfg;
  idem_store_t *store;
  idemd_tenants_t *tenants;   /* who may call, by API key, over `store` */
  struct idem_engine *engine; /* decides keyed requests over `store` */
  idem_provider_t *provider;
  unsigned char log_secret[32]; /* HMAC key for key ids in logs */
  idem_hmac_t *key_id_mac;      /* that key, prepared */
  idem_hmac_t *webhook_mac;     /* the provider's events' secret; NULL: no webhooks */
  struct idemd_replay_cache *replays; /* completed records' replays; may be NULL */
  struct MHD_Daemon *daemon;
  int port; /* the port bound */
  struct MHD_Daemon *metrics_daemon; /* --metrics-listen's; NULL when off */
  int metrics_port;                  /* the port it bound */
  idemd_guard_t *guard;
  idemd_workers_t *workers; /* run the requests that wait */
  idem_reconciler_t *reconciler;
  struct idem__ticker *sweeper;
  struct idem__ticker *prober; /* a small write while none is made (readiness.c) */
  struct idem__ticker *key_uses; /* writes the API keys' last uses (server.c) */
  struct idem__ticker *wait_timer; /* times out parked duplicates */
  atomic_int inflight; /* requests started and not yet answered */
  atomic_int async_pending; /* requests in the engine's asynchronous form
                               (flow.c): a write queued, or parked */
  atomic_int draining; /* shutting down: answers close their connection */
  atomic_int stopping; /* the daemon stops once async_pending is 0: no
                          request may be suspended any more */
  idemd_metrics_t metrics;
} idemd_server_t;

typedef enum idemd_route {
  ROUTE_NONE = 0,
  ROUTE_PAYMENTS,     /* POST /payments */
  ROUTE_PAYMENT,      /* GET /payments/{id} */
  ROUTE_ORDERS,       /* POST /orders */
  ROUTE_ORDER,        /* GET /orders/{id} */
  ROUTE_ORDER_PUT,    /* PUT /orders/{id} */
  ROUTE_ORDER_CANCEL, /* POST /orders/{id}/cancel */
  ROUTE_REFUNDS,      /* POST /payments/{id}/refunds */
  ROUTE_REFUND,       /* GET /refunds/{id} */
  ROUTE_HEALTHZ,
  ROUTE_METRICS,
  ROUTE_READYZ,
  ROUTE_WEBHOOK /* POST /webhooks/provider */
} idemd_route_t;

/* One HTTP request, from its headers to the log line after its answer. */
typedef struct idemd_request {
  idemd_server_t *srv;
  struct MHD_Connection *conn;
  void *conn_guard; /* the guard's record of this connection */
  idemd_route_t route;
  const char *method;
  char path[128]; /* for the log line (longer paths are cut there) */
  char resource_id[IDEMD_PATH_ID_MAX + 1]; /* {id} of the path */
  char request_id[65];
  int64_t start_us;

  char *body; /* at most IDEMD_MAX_BODY bytes, NUL-terminated */
  size_t body_len;
  size_t body_cap; /* bytes allocated at `body` */
  size_t body_seen; /* all upload bytes, kept or not */
  int body_too_large;
  int drain; /* a body follows that the client sends unasked: read it first */
  /* An answer decided from the headers (404, 405, 401): sent at once, or
   * once the body is read and dropped when one follows. 0 when none. */
  int refusal;
  const char *refusal_msg;
  const char *refusal_allow; /* Allow, for 405 */
  int refusal_close;         /* the body's framing is in doubt: close after */

  idemd_tenant_t tenant;
  int authenticated;
  char key[IDEM_KEY_MAX + 1];
  char key_id[17]; /* HMAC-derived id of the key, for logs */

  /* Where it runs: first in an event thread, which must not wait
   * (may_block 0); from the first step that would wait on, in a worker
   * (may_block 1), which leaves its answer in `response` and resumes the
   * connection. */
  int may_block;
  int deferred; /* suspended; answered on resume */
  int stash;    /* answering off the event thread: leave it in `response` */
  int needs_auth;
  struct MHD_Response *response; /* an answer to queue on resume */
  idemd_work_t work;
  /* The route's working state, on the heap because it outlives the event
   * thread's call when the request goes on elsewhere; freed with `r`. */
  void *call;
  void (*call_free)(void *call);
  /* The step a suspended request goes on with, as nginx's phase handlers
   * do: set by whoever suspended it, and cleared before it runs. Once the
   * request is resumed without an answer left in `response`, its event
   * thread runs it; a request handed to a worker (idemd_defer) has the
   * worker run it. */
  enum MHD_Result (*resume)(struct idemd_request *r);
  /* Set by a module with work under way on the request (the flow, while
   * a write is queued): called once when the connection closes, before
   * the log line, to end that work. Returns what the request did when
   * its client left before the answer (OUTCOME_NONE: it cannot say). */
  int (*on_close)(struct idemd_request *r);
  void *async; /* the flow's state, in the engine's asynchronous form */
  const struct idemd_effect *effect; /* the flow's, for its later steps */
  /* When its wait for a duplicate in flight ends (idem_begin_t's
   * wait_until_ms), kept across a hand-over to a worker. */
  int64_t inflight_deadline;

  /* What the log line and metrics report. */
  idemd_op_t op;
  idemd_outcome_t outcome;
  int status;
  int responded;
  int aborted; /* the answer did not reach the client in full */
  int metrics_listener; /* came in on --metrics-listen */
} idemd_request_t;
/* calloc'd for every request: past 1,032 bytes glibc serves it from its
 * slow path instead of the thread's cache (measured, see docs). */
_Static_assert(sizeof(idemd_request_t) <= 1032,
               "keep idemd_request_t within malloc's per-thread cache");

/* Route handlers. Each answers `r` exactly once, now or after the request
 * is resumed, and returns the result of queueing the answer, or MHD_YES
 * when the request was handed on (suspended). `body` is the
 * validated-as-object request body. */
/* Gives `r` a creating route's call state `call`, freed with `free_fn`
 * when `r` is, or when a later run of the route (a worker's, after the
 * event thread's) gives it another: the flow may go on after the route's
 * handler returns. */
void idemd_request_own(idemd_request_t *r, void *call, void (*free_fn)(void *call));

enum MHD_Result idemd_payments_create(idemd_request_t *r, const json_t *body);
enum MHD_Result idemd_orders_create(idemd_request_t *r, const json_t *body);
/* POST /payments/{id}/refunds (refunds.c), as idemd_payments_create() with
 * the payment's id in r->resource_id. */
enum MHD_Result idemd_refunds_create(idemd_request_t *r, const json_t *body);
/* PUT /orders/{id} (r->resource_id, already checked by
 * idemd_order_id_valid()): creates the order under the client's id, or
 * answers the one there (200, or 409 when its command differs). Runs
 * where it may block (a worker). */
enum MHD_Result idemd_orders_put(idemd_request_t *r, const json_t *body);
/* POST /orders/{id}/cancel: sets the order cancelled (once) and answers
 * it. `body` (NULL when the request had none) must have no field: each
 * is a 422. Runs where it may block (a worker). */
enum MHD_Result idemd_orders_cancel(idemd_request_t *r, const json_t *body);

/* POST /webhooks/provider (webhooks.c): a provider's event, checked in
 * the event thread (signature, time, body), applied by a worker. */
enum MHD_Result idemd_webhook_receive(idemd_request_t *r);

/* 1 when `id` is an order id a client may choose: "ord_" then 1 to 64 of
 * A-Z a-z 0-9 _ - (the ids idemd makes are such ids too), else 0. */
int idemd_order_id_valid(const char *id);

/* Frees a request and what it owns. */
void idemd_request_free(idemd_request_t *r);

/* Opens the configured store and migrates its tables, libidem's and then
 * idemd's (data/schema.h), or prints why not (to stderr) and returns NULL. The caller owns the store; close it with
 * idem_store_close(). Every command that uses the store opens it here. */
idem_store_t *idemd_open_store(const idemd_config_t *cfg);

/* Brings up a whole idemd from `cfg` into `srv` (zeroed): opens and
 * migrates the store, loads the log secret, sets up the provider, starts
 * HTTP (srv->port is the port bound, useful with port 0), the reconciler
 * and the sweeper. Returns 0, or -1 with a message on stderr and nothing
 * left running. */
int idemd_server_start(idemd_server_t *srv, const idemd_config_t *cfg);

/* Stops accepting and lets requests in flight finish, waiting at most
 * cfg.shutdown_timeout_ms. Returns how many are still unfinished. */
int idemd_server_drain(idemd_server_t *srv);

/* Stops what idemd_server_start() started (after idemd_server_drain()):
 * HTTP workers, reconciler, sweeper, provider, store. */
void idemd_server_stop(idemd_server_t *srv);

/* Starts serving `srv` (whose store and provider are open): on
 * cfg.listen, over HTTPS with cfg.tls_cert and cfg.tls_key when set, and
 * GET /metrics, /healthz and /readyz on cfg.metrics_listen when set
 * (srv->metrics_port the port bound). Returns 0, or -1 with a message on
 * stderr and nothing left listening. */
int idemd_http_start(idemd_server_t *srv);

/* Stops accepting new connections and lets requests in flight be answered,
 * waiting at most `timeout_ms`. Returns how many are still unfinished. */
int idemd_http_drain(idemd_server_t *srv, int64_t timeout_ms);

/* Stops the workers and closes every connection, on both listeners. It
 * waits for handlers still running, however long they take: drain
 * first. */
void idemd_http_stop(idemd_server_t *srv);

#endif
