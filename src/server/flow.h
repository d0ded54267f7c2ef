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
  const char *resource_id; /* stored with the record; may be NULL */
  /* The route's own rows (src/data/resources.h), written in the
   * transaction that wins the key, and only then. */
  idem_effect_t written;
  /* Optional: called once, before the first reservation, to fill in what
   * `resource_id`, `written` and `outcome` point at (a new id, a body). A
   * key that is
   * found finished (a replay) never pays for it. Returns IDEM_OK or the
   * error to answer with. */
  int (*prepare)(void *ctx);
  /* Single-step operations: the final outcome, written in the same
   * transaction as the reservation. */
  const idem_outcome_t *outcome;
  /* Multi-step operations: called once the key is won, outside any
   * transaction; fills `out`, and `then`, an effect written with the
   * completion (both zeroed before; `then` may stay so), whose strings
   * must stay valid until the request is freed. */
  void (*execute)(void *ctx, const idem_record_t *rec, idem_outcome_t *out,
                  idem_effect_t *then);
  /* 1 when execute() is cheap, never waits and never calls the store:
   * it is then called on the store's writer thread (flow.c). */
  int execute_never_waits;
  /* Optional: the answer of a request whose `written` effect refused it
   * (IDEM_EREFUSED: a rule of the route's own, checked in the transaction
   * that would have won the key). Nothing was written; the key is free. */
  enum MHD_Result (*refused)(idemd_request_t *r, void *ctx);
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
