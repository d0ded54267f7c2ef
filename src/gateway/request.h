/* One request through the gateway, from its headers to its log line, and
 * the two ways it goes: a keyed route decided by the engine
 * (gateway/keyed.c), or proxied as it is (gateway/server.c). */
#ifndef IDEM_GATEWAY_REQUEST_H
#define IDEM_GATEWAY_REQUEST_H

#include <microhttpd.h>

#include "gateway/gateway.h"
#include "gateway/upstream.h"
#include "server/workers.h"

typedef struct gw_req {
  gw_t *gw;
  struct MHD_Connection *conn;
  char *target;  /* the request-target as sent: path and query */
  char *path;    /* its path */
  const char *method;
  char request_id[17];
  int64_t start_us;
  char *body;
  size_t body_len, body_cap;
  int body_too_large;
  /* What the log line and metrics report. */
  const char *route;      /* the keyed route's operation, or NULL */
  idemd_op_t op;
  idemd_outcome_t outcome;
  int status;
  char key_id[17];
  /* Steps that wait (a write, the upstream) run on a worker, the
   * connection suspended: `step` is what the worker runs, `in_worker` set
   * while it does, and the answer it makes waits in `response` (with its
   * status in `status`) until the connection is resumed. */
  idemd_work_t work;
  enum MHD_Result (*step)(struct gw_req *r);
  int in_worker;
  struct MHD_Response *response;
  /* Set while the keyed flow is off its event thread without a worker
   * (keyed.c): where the event thread goes on once resumed. */
  enum MHD_Result (*resume)(struct gw_req *r);
  void *keyed; /* the keyed flow's state (keyed.c), freed with the request */
} gw_req_t;

/* Suspends `r`'s connection and has a worker run `step` (which answers
 * with gw_send() or gw_send_error()). Returns MHD_YES, or an answer of
 * 503 when no worker will take it (shutting down). */
enum MHD_Result gw_defer(gw_req_t *r, enum MHD_Result (*step)(gw_req_t *r));

/* The request's headers as they go to the upstream: hop-by-hop ones and
 * Content-Length left out, X-Forwarded-For and Forwarded added; with
 * `key` (a keyed route's parsed key), the client's Idempotency-Key lines
 * replaced by one "Idempotency-Key: <key>"; the client's address
 * appended to its X-Forwarded-For; an empty value as "Name;" (libcurl's
 * spelling: "Name:" would remove it). A NULL-terminated list to
 * free with gw_free_lines(); NULL when out of memory. */
char **gw_forward_headers(const gw_req_t *r, const char *key);
void gw_free_lines(char **lines);

/* Sends `a` to the client: its status, its headers (hop-by-hop ones and
 * Content-Length left out), `extra` ("Name", "value" pairs,
 * NULL-terminated; may be NULL) and its body. */
enum MHD_Result gw_send(gw_req_t *r, const gw_answer_t *a, const char *const *extra);

/* The answer gw_send() would send of `a` and `extra`, not queued: the
 * caller owns it (MHD_destroy_response()). NULL when out of memory. */
struct MHD_Response *gw_response(const gw_req_t *r, const gw_answer_t *a,
                                 const char *const *extra);

/* Sends {"error": msg} with `status` (Retry-After: 1 for 409 and 503). */
enum MHD_Result gw_send_error(gw_req_t *r, int status, const char *msg);

/* Completes `rec`, which this gateway owns, with `a` (state COMPLETED or
 * PENDING), in one transaction with its kept request: dropped
 * (COMPLETED), or due again at `next_attempt_at` after `attempts`
 * (PENDING; GW_NEVER: never). Returns IDEM_OK or the engine's error
 * (IDEM_ELOST: another gateway took the record over). */
int gw_keep(gw_t *gw, const idem_record_t *rec, idem_state_t state, const gw_answer_t *a,
            int attempts, int64_t next_attempt_at);

/* Releases `rec` as failed before any effect (the key is free), its kept
 * request dropped. */
int gw_release(gw_t *gw, const idem_record_t *rec);

/* The first resend of a pending request (--upstream-idempotent), and the
 * bounds on the rest: doubling up to GW_RETRY_MAX_MS, at most
 * GW_RETRY_ATTEMPTS in all (docs/gateway.md, "Pending requests"). */
#define GW_RETRY_FIRST_MS 1000
#define GW_RETRY_MAX_MS 60000
#define GW_RETRY_ATTEMPTS 10

/* The body of a pending record's answer (202). */
#define GW_PENDING_BODY "{\"status\":\"pending\"}"

/* A keyed route's request (docs/gateway.md, "Keyed routes"): checked and
 * fingerprinted on the event thread, where a replay or a mismatch is
 * also answered when the store's reads are local. On such a store
 * (SQLite) the rest holds no thread while it waits: the engine's
 * asynchronous form, the upstream's I/O thread (gw_upstream_submit()),
 * the connection suspended meanwhile; on another (PostgreSQL) it goes on
 * in a worker (gw_defer()). */
enum MHD_Result gw_keyed(gw_req_t *r, const gw_route_t *route);

/* Where a keyed request decided without a waiting thread goes on, on its
 * event thread, once its connection is resumed: the engine's next step,
 * or the answer of a won key whose completion is written. */
enum MHD_Result gw_keyed_resumed(gw_req_t *r);

/* Frees what gw_keyed() left on `r`. */
void gw_keyed_free(gw_req_t *r);

#endif
