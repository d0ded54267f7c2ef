/* The idempotent request flow shared by every creating route: libidem's
 * engine decides (include/idem/engine.h: execute once, replay, mismatch,
 * wait for an in-flight original, pending) and this maps each decision
 * to its HTTP answer. The rows of the table live in idem_decide() and
 * nowhere else. */
#ifndef IDEMD_FLOW_H
#define IDEMD_FLOW_H

#include "idem/engine.h"
#include "server/server.h"

typedef struct idemd_effect {
  const char *operation;   /* "create_payment" */
  const char *fingerprint; /* of the validated command */
  const idem_resource_t *resource; /* written when the key is won */
  /* Optional: called once, before the first reservation, to fill in what
   * `resource` and `outcome` point at (a new id, a body). A key that is
   * found finished (a replay) never pays for it. Returns IDEM_OK or the
   * error to answer with. */
  int (*prepare)(void *ctx);
  int enqueue_outbox;
  /* Single-step operations: the final outcome, written in the same
   * transaction as the reservation. */
  const idem_outcome_t *outcome;
  /* Multi-step operations: called once the key is won, outside any
   * transaction; fills `out`, whose strings must stay valid until
   * idemd_flow_run() returns. */
  void (*execute)(void *ctx, const idem_record_t *rec, idem_outcome_t *out);
  /* 1 when execute() is cheap, never waits and never calls the store:
   * it is then called on the store's writer thread (flow.c). */
  int execute_never_waits;
  void *ctx;
} idemd_effect_t;

/* The engine idemd's workers decide with, over srv->store with srv->cfg's
 * lease, TTL and in-flight wait. NULL when out of memory. */
idem_engine_t *idemd_flow_engine(idemd_server_t *srv);

/* Runs `e` for request `r` (authenticated, key parsed) and sends the
 * answer, now or after the request is suspended: its later steps are
 * recorded on it (r->resume, r->on_close), and `e` must stay valid until
 * `r` is freed (the route's call state). Exactly one of `e->outcome` and
 * `e->execute` is set. */
enum MHD_Result idemd_flow_run(idemd_request_t *r, const idemd_effect_t *e);

#endif
