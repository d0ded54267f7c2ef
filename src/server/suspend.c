/* Requests that leave their event thread and come back: handed to a
 * worker, parked on a duplicate's key, or suspended while a write is
 * queued, each going on at the step recorded on it (r->resume); and the
 * count of them that idemd's stop waits for. */
#include "server/suspend.h"

#include <stddef.h>

#include "idem/clock.h"
#include "idem/engine.h"
#include "server/reply.h"

/* A worker's turn at a deferred request: its recorded step, allowed to
 * wait this time, then the connection back to its event thread. */
static void run_deferred(idemd_work_t *w) {
  idemd_request_t *r = (idemd_request_t *)((char *)w - offsetof(idemd_request_t, work));
  enum MHD_Result (*step)(idemd_request_t *) = r->resume;

  r->may_block = 1;
  r->resume = NULL;
  if (step(r) != MHD_YES && r->response) {
    MHD_destroy_response(r->response);
    r->response = NULL; /* the event thread hangs up */
  }
  idemd_resume(r);
}

void idemd_suspend(idemd_request_t *r) {
  MHD_suspend_connection(r->conn);
  r->deferred = 1;
}

void idemd_resume(idemd_request_t *r) {
  MHD_resume_connection(r->conn); /* `r` may be gone from here on */
}

/* The answer to a request idemd is stopping too soon to handle. */
static enum MHD_Result reply_stopping(idemd_request_t *r) {
  idemd_reply_headers_t h = {.retry_after = 1, .close = 1};
  r->outcome = OUTCOME_ERROR;
  return idemd_reply_error(r, 503, "shutting down, retry later", &h);
}

int idemd_run_in_worker(idemd_request_t *r, void (*run)(idemd_work_t *w)) {
  r->work.run = run;
  if (idemd_workers_submit(r->srv->workers, &r->work) == 0)
    return 0;
  /* Stopping: no worker will take it. Answer 503 from here instead. */
  r->stash = 1; /* so the answer waits for the resume below */
  (void)reply_stopping(r);
  idemd_resume(r);
  return -1;
}

int idemd_pending_enter(idemd_server_t *srv) {
  /* Counted first, then checked: idemd_http_stop() sets `stopping` first,
   * then reads the count, so one of the two sees the other. */
  atomic_fetch_add(&srv->async_pending, 1);
  if (atomic_load(&srv->stopping)) {
    atomic_fetch_sub(&srv->async_pending, 1);
    return -1;
  }
  return 0;
}

void idemd_pending_leave(idemd_server_t *srv) {
  atomic_fetch_sub(&srv->async_pending, 1);
}

void idemd_expire_parked(void *ctx) {
  idemd_server_t *srv = ctx;
  int draining = atomic_load(&srv->draining);
  (void)idem_engine_expire(srv->engine, draining ? INT64_MAX : idem_mono_ms());
}

enum MHD_Result idemd_defer(idemd_request_t *r, enum MHD_Result (*step)(idemd_request_t *r)) {
  if (atomic_load(&r->srv->stopping))
    return reply_stopping(r); /* no worker would take it: not suspended */
  r->resume = step;
  idemd_suspend(r);
  (void)idemd_run_in_worker(r, run_deferred);
  return MHD_YES;
}
