/* Requests that leave their event thread and come back (suspend.c): to a
 * worker, parked on a duplicate in flight, or suspended while a write is
 * queued. Whoever suspends a request records the step it goes on with
 * (r->resume). */
#ifndef IDEMD_SUSPEND_H
#define IDEMD_SUSPEND_H

#include "server/server.h"

/* How often parked requests are checked for their deadline: a wait may
 * last this much longer than --inflight-wait. */
#define IDEMD_PARK_TICK_MS 20

/* Called by a handler in an event thread whose next step would wait (a
 * write, a provider call, a wait for a duplicate, or a read of a store
 * whose reads may block): suspends the connection and has a worker go on
 * with `step` (idemd_dispatch: the whole request), with may_block set. Nothing must have been answered yet. Returns MHD_YES,
 * and the caller must not touch `r` (nor its call state) afterwards: a
 * worker owns it. When idemd is stopping it answers 503 at once instead
 * (nothing suspended) and returns the result of queueing that. */
enum MHD_Result idemd_defer(idemd_request_t *r, enum MHD_Result (*step)(idemd_request_t *r));

/* Suspends `r`'s connection (from its event thread's handler): whoever
 * answers it next leaves the answer (r->stash) and calls idemd_resume(). */
void idemd_suspend(idemd_request_t *r);

/* For a suspended request: a worker runs `run` (0), or, when the workers
 * are stopping, the request is answered 503 and resumed (-1). */
int idemd_run_in_worker(idemd_request_t *r, void (*run)(idemd_work_t *w));

/* Counts a request about to be suspended for an asynchronous step (a
 * queued write, a parked wait) in srv->async_pending, which idemd's stop
 * waits to see at 0 before it stops the daemon. Returns 0, or -1 when
 * idemd is stopping (nothing counted: answer the request instead). */
int idemd_pending_enter(idemd_server_t *srv);

/* Ends what idemd_pending_enter() counted. */
void idemd_pending_leave(idemd_server_t *srv);

/* Gives a suspended request, answered (or not: the connection is then
 * closed), back to its event thread. `r` must not be touched afterwards. */
void idemd_resume(idemd_request_t *r);

/* Times out parked requests (a ticker's function, `ctx` the server):
 * those past their deadline, or all of them once idemd drains (each then
 * answers 409 and closes). */
void idemd_expire_parked(void *ctx);

#endif
