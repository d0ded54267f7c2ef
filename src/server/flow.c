/* The idempotent request flow: libidem's engine decides (idem_decide(),
 * idem_engine_begin()); this file maps its decisions to HTTP answers, and
 * runs a request in an event thread without a waiting thread where the
 * store allows it. */
#include "server/flow.h"

#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "idem/clock.h"
#include "idem/engine.h"
#include "server/replay_cache.h"
#include "server/reply.h"
#include "server/suspend.h"
#include "server/workers.h"

static enum MHD_Result mismatch(idemd_request_t *r) {
  r->outcome = OUTCOME_MISMATCH;
  return idemd_reply_error(
      r, 422, "Idempotency-Key was already used with a different request", NULL);
}

/* Keeps the replay of a completed record in memory (body already marked). */
static void remember(idemd_request_t *r, const idem_scope_t *scope,
                     const char *fingerprint, int status, const char *marked,
                     const char *location, int64_t expires_at) {
  idemd_replay_cache_put(r->srv->replays, scope, fingerprint, status, marked,
                         location, expires_at);
}

/* Sends a stored response again, marked as a replay. */
static enum MHD_Result replay(idemd_request_t *r, const idem_scope_t *scope,
                              const idem_record_t *rec, idemd_outcome_t outcome) {
  idemd_reply_headers_t h = {.location = rec->location, .replayed = 1};
  char *body = idemd_mark_replayed(rec->response_body);
  enum MHD_Result ret;

  if (body == NULL)
    return idemd_reply_store_error(r, IDEM_ENOMEM);
  if (rec->state == IDEM_STATE_COMPLETED)
    remember(r, scope, rec->fingerprint, rec->response_status, body, rec->location,
             rec->expires_at);
  r->outcome = outcome;
  ret = idemd_reply(r, rec->response_status, body, strlen(body), &h);
  free(body);
  return ret;
}

/* Remembers the first answer of a key, when completed, for its replays. */
static void remember_new(idemd_request_t *r, const idem_scope_t *scope,
                         const char *fingerprint, int status, const char *body,
                         const char *location, idem_state_t state,
                         int64_t expires_at) {
  if (state == IDEM_STATE_COMPLETED && r->srv->replays) {
    char *marked = idemd_mark_replayed(body);
    remember(r, scope, fingerprint, status, marked, location, expires_at);
    free(marked);
  }
}

/* Sends the first answer of a request that won its key; a completed one
 * is also remembered for its replays. */
static enum MHD_Result answer_new(idemd_request_t *r, const idem_scope_t *scope,
                                  const char *fingerprint, int status,
                                  const char *body, const char *location,
                                  idem_state_t state, int64_t expires_at) {
  idemd_reply_headers_t h = {.location = location};
  if (status == 503)
    h.retry_after = 1;
  remember_new(r, scope, fingerprint, status, body, location, state, expires_at);
  r->outcome = state == IDEM_STATE_PENDING ? OUTCOME_PENDING : OUTCOME_NEW;
  return idemd_reply(r, status, body, strlen(body), &h);
}

/* Answers from the replay cache when it holds this key. Returns 1 when it
 * answered (`*ret` set), 0 to go to the store. */
static int answer_from_memory(idemd_request_t *r, const idem_scope_t *scope,
                              const char *fingerprint, enum MHD_Result *ret) {
  idemd_replay_t hit;
  if (!idemd_replay_cache_get(r->srv->replays, scope, idem_now_ms(), &hit))
    return 0;
  if (strcmp(hit.fingerprint, fingerprint) != 0) {
    *ret = mismatch(r);
  } else {
    idemd_reply_headers_t h = {.location = hit.location, .replayed = 1};
    r->outcome = OUTCOME_REPLAY;
    *ret = idemd_reply(r, hit.status, hit.body, strlen(hit.body), &h);
  }
  free(hit.body);
  return 1;
}

/* For tests, as store.c's IDEM_FAULT_FILE: while the file that
 * IDEM_HOLD_CALLS_FILE names exists, a request's provider call is held
 * before it starts, as behind a long worker queue, so that its lease can
 * run out first (tests/integration/test_late_call.c). The variable is
 * read once; unset, this costs nothing. */
static const char *hold_path;
static pthread_once_t hold_once = PTHREAD_ONCE_INIT;

static void read_hold_env(void) { hold_path = getenv("IDEM_HOLD_CALLS_FILE"); }

static void hold_calls(void) {
  struct timespec pause = {0, 5 * 1000000L};

  pthread_once(&hold_once, read_hold_env);
  while (hold_path && access(hold_path, F_OK) == 0)
    nanosleep(&pause, NULL);
}

/* Step 2 of a multi-step operation, once its key is won: the effect's
 * call, outside any transaction, with `out` the outcome it gives. */
static void execute(const idemd_effect_t *e, const idem_record_t *rec,
                    idem_outcome_t *out, idem_effect_t *then) {
  memset(out, 0, sizeof *out);
  memset(then, 0, sizeof *then);
  if (!e->execute_never_waits) { /* a provider call: a worker waits on it */
    idemd_workers_wait_begin();
    hold_calls();
  }
  e->execute(e->ctx, rec, out, then);
  if (!e->execute_never_waits)
    idemd_workers_wait_end();
}

/* The answer of a request refused because its original is still in
 * flight at the bound of its wait. */
static enum MHD_Result in_flight(idemd_request_t *r) {
  idemd_reply_headers_t h = {.retry_after = 1};
  atomic_fetch_add_explicit(&r->srv->metrics.inflight_timeouts, 1, memory_order_relaxed);
  r->outcome = OUTCOME_IN_FLIGHT;
  return idemd_reply_error(
      r, 409, "a request with this Idempotency-Key is still being processed", &h);
}

/* The engine's decision as an HTTP answer, for a decision that ends the
 * request: REPLAY and PENDING answer the stored response of `rec`,
 * EXECUTE the first answer a single step wrote with its reservation. */
static enum MHD_Result answer(idemd_request_t *r, const idem_scope_t *scope,
                              const idemd_effect_t *e, idem_decision_t d,
                              const idem_record_t *rec) {
  switch (d) {
  case IDEM_DECIDE_EXECUTE:
    return answer_new(r, scope, e->fingerprint, rec->response_status, rec->response_body,
                      rec->location, rec->state, rec->expires_at);
  case IDEM_DECIDE_REPLAY:
    return replay(r, scope, rec, OUTCOME_REPLAY);
  case IDEM_DECIDE_PENDING:
    return replay(r, scope, rec, OUTCOME_PENDING);
  case IDEM_DECIDE_MISMATCH:
    return mismatch(r);
  case IDEM_DECIDE_IN_FLIGHT:
    return in_flight(r);
  case IDEM_DECIDE_RESERVE:
    break;
  }
  return idemd_reply_store_error(r, IDEM_ETIMEDOUT);
}

/* What the log says of a request whose reservation found the key's record
 * (`d` decided on it), when the client left before its answer. */
static idemd_outcome_t outcome_of(idem_decision_t d) {
  switch (d) {
  case IDEM_DECIDE_EXECUTE:
    return OUTCOME_NEW;
  case IDEM_DECIDE_REPLAY:
    return OUTCOME_REPLAY;
  case IDEM_DECIDE_PENDING:
    return OUTCOME_PENDING;
  case IDEM_DECIDE_MISMATCH:
    return OUTCOME_MISMATCH;
  case IDEM_DECIDE_IN_FLIGHT:
    return OUTCOME_IN_FLIGHT;
  case IDEM_DECIDE_RESERVE:
    break;
  }
  return OUTCOME_NONE;
}

/* The flow without a thread waiting on it, for stores with local reads
 * and asynchronous writes (SQLite): the engine's asynchronous form
 * (idem_engine_begin_async()) decides, suspending the request while a
 * write is queued or a wait for a duplicate is parked, and wakes it
 * (woken()). A won payment goes on to its provider call from there, the
 * connection still suspended: made on the store's writer for a provider
 * that never waits, by a worker otherwise, and its completion queued the
 * same way (idem_engine_complete_async()); the request is resumed once
 * that is written. Anything else is resumed, and its event thread goes on
 * at the step recorded on it (resumed()): the engine's next step, or the
 * answer of its decision. */
enum async_stage { DECIDING, EXECUTING, COMPLETING };

/* What the engine is given of request `r` running `e` under `scope`, in
 * either form; the wait goes on from where an earlier turn left it. */
static idem_begin_t begin_of(const idemd_request_t *r, const idemd_effect_t *e,
                             const idem_scope_t *scope) {
  return (idem_begin_t){.scope = *scope,
                        .fingerprint = e->fingerprint,
                        .correlation_id = r->request_id,
                        .resource_id = e->resource_id,
                        .effect = e->written,
                        .outcome = e->outcome,
                        .prepare = e->prepare,
                        .arg = e->ctx,
                        .wait_until_ms = r->inflight_deadline};
}

/* The key of request `r` running `e`: its pointers are into `r` and `e`,
 * which outlive the flow. */
static idem_scope_t scope_of(const idemd_request_t *r, const idemd_effect_t *e) {
  return (idem_scope_t){r->tenant.id, e->operation, r->key};
}

struct idemd_async_flow {
  idemd_request_t *r;
  const idemd_effect_t *e;
  enum async_stage stage;
  /* The store's message for a failed write, taken on the thread that saw
   * it (idem_store_last_error() is per thread); for the log only. */
  char *detail;
  idem_outcome_t out;  /* the execution's, from EXECUTING on */
  idem_effect_t then;  /* its rows, written with the completion */
  int64_t expires_at;  /* of a completed `out` */
  idem_async_t a;      /* the engine's request */
};

/* Ends the asynchronous part (the request is answered, or about to be run
 * by a worker). */
static void async_end(struct idemd_async_flow *af) {
  idemd_request_t *r = af->r;
  idemd_server_t *srv = r->srv;

  r->inflight_deadline = af->a.begin.wait_until_ms; /* for a worker's turn */
  idem_record_reset(&af->a.rec);
  free(af->detail);
  r->async = NULL;
  r->resume = NULL;
  r->on_close = NULL;
  free(af);
  idemd_pending_leave(srv);
}

/* The first answer of a won key whose last write is over: what a
 * single step wrote with its reservation, or what the completion wrote. */
struct first_answer {
  int status;
  const char *body, *location;
  idem_state_t state;
  int64_t expires_at;
};

static struct first_answer written_answer(const struct idemd_async_flow *af) {
  const idem_record_t *rec = &af->a.rec;
  if (af->stage != COMPLETING)
    return (struct first_answer){rec->response_status, rec->response_body, rec->location,
                                 rec->state, rec->expires_at};
  return (struct first_answer){af->out.status, af->out.body, af->out.location,
                               af->out.state, af->expires_at};
}

static void execute_then_complete(struct idemd_async_flow *af);
static void async_execute(idemd_work_t *w);
static enum MHD_Result resumed(idemd_request_t *r);

/* a->suspend: the engine hands the request to another thread. */
static void async_suspend(idem_async_t *a) {
  struct idemd_async_flow *af = a->arg;
  af->r->resume = resumed; /* its event thread goes on there */
  idemd_suspend(af->r);
}

/* a->wake, on the writer (a reservation or completion written), or on
 * whichever thread changed the key or expired the wait: give the request
 * back to its event thread. A reservation won for a provider call goes on
 * to that call instead, the connection still suspended: a provider that
 * never waits (the sandbox) is called here, and its completion joins the
 * writer's next batch; any other is handed to a worker. Either way the
 * event thread is not woken between the two writes: a payment costs it
 * one suspend and resume, not two (docs/performance.md). When the
 * workers are stopping, the request goes back to its event thread, which
 * answers it (resumed()). */
static void woken(idem_async_t *a) {
  struct idemd_async_flow *af = a->arg;
  idemd_request_t *r = af->r;

  if (a->rc != IDEM_OK && a->rc != IDEM_ELOST && af->detail == NULL)
    af->detail = strdup(idem_store_last_error()); /* NULL: logged without */
  if (af->stage == DECIDING && a->decision == IDEM_DECIDE_EXECUTE && af->e->execute) {
    af->stage = EXECUTING;
    if (af->e->execute_never_waits) {
      execute_then_complete(af);
      return;
    }
    r->work.run = async_execute;
    if (idemd_workers_submit(r->srv->workers, &r->work) == 0)
      return;
    af->stage = DECIDING;
  }
  idemd_resume(r); /* the event thread reads `af` from here on */
}

/* The provider call, outside any transaction, then the completion,
 * queued (the request is suspended). */
static void execute_then_complete(struct idemd_async_flow *af) {
  idemd_server_t *srv = af->r->srv;
  int rc;

  execute(af->e, &af->a.rec, &af->out, &af->then);
  /* Not later than the store's: memory must not replay a record the
   * store has let expire. */
  af->expires_at = idem_now_ms() + srv->cfg.key_ttl_ms;
  af->stage = COMPLETING;
  rc = idem_engine_complete_async(srv->engine, &af->a, &af->out, &af->then);
  if (rc != IDEM_EAGAIN) { /* not queued: as a failed write */
    af->a.rc = rc;
    woken(&af->a);
  }
}

static void async_execute(idemd_work_t *w) {
  idemd_request_t *r = (idemd_request_t *)((char *)w - offsetof(idemd_request_t, work));
  execute_then_complete(r->async);
}

static enum MHD_Result go_on(idemd_request_t *r);

/* The engine's next step, on the event thread: an answer when it decides,
 * or nothing yet (the request is suspended until woken()). */
static enum MHD_Result decide(struct idemd_async_flow *af) {
  idemd_request_t *r = af->r;
  const idemd_effect_t *e = af->e;
  idem_scope_t scope = scope_of(r, e);
  enum MHD_Result ret;
  int rc = idem_engine_begin_async(r->srv->engine, &af->a);

  if (rc == IDEM_EAGAIN)
    return MHD_YES;
  if (rc == IDEM_ENOTSUP) { /* no asynchronous writes: all of it in a worker */
    async_end(af);
    return idemd_defer(r, go_on);
  }
  if (rc == IDEM_EREFUSED && e->refused) {
    ret = e->refused(r, e->ctx);
  } else if (rc != IDEM_OK) {
    ret = af->a.rc != IDEM_OK ? idemd_reply_store_failure(r, rc, af->detail)
                              : idemd_reply_store_error(r, rc);
  } else if (af->a.decision == IDEM_DECIDE_EXECUTE && e->execute) {
    /* Only when the workers refused the call in woken() (idemd is
     * stopping): one more try, which answers 503 if they refuse again.
     * The record then stays processing and the reconciler takes it over
     * when its lease ends, as after a crash. */
    af->stage = EXECUTING;
    r->resume = resumed;
    idemd_suspend(r);
    if (idemd_run_in_worker(r, async_execute) != 0)
      async_end(af);
    return MHD_YES;
  } else {
    ret = answer(r, &scope, e, af->a.decision, &af->a.rec);
  }
  async_end(af);
  return ret;
}

/* The step after a wake-up, on the event thread, once the request is
 * resumed (r->resume). */
static enum MHD_Result resumed(idemd_request_t *r) {
  struct idemd_async_flow *af = r->async;
  const idemd_effect_t *e = af->e;
  idem_scope_t scope = scope_of(r, e);
  enum MHD_Result ret;

  if (af->stage == COMPLETING) {
    int rc = af->a.rc;
    if (rc == IDEM_ELOST) { /* our lease ran out and another owner took over */
      af->stage = DECIDING;
      return decide(af);
    }
    if (rc != IDEM_OK) {
      ret = idemd_reply_store_failure(r, rc, af->detail);
    } else {
      struct first_answer a = written_answer(af);
      ret = answer_new(r, &scope, e->fingerprint, a.status, a.body, a.location, a.state,
                       a.expires_at);
    }
    async_end(af);
    return ret;
  }
  if (af->a.rc == IDEM_OK && af->a.decision == 0 &&
      answer_from_memory(r, &scope, e->fingerprint, &ret)) {
    /* Woken by its original's completion, which memory now holds. */
    async_end(af);
    return ret;
  }
  if (atomic_load(&r->srv->draining))
    af->a.begin.wait_until_ms = -1; /* a duplicate in flight answers now */
  return decide(af);
}

/* Whether the flow's last write was a first answer of its key: the
 * completion, or a reservation that was all there was to do. */
static int wrote_first_answer(const struct idemd_async_flow *af) {
  return af->a.rc == IDEM_OK &&
         (af->stage == COMPLETING ||
          (af->a.decision == IDEM_DECIDE_EXECUTE && !af->e->execute));
}

/* What a request whose client left before its answer did: OUTCOME_NEW
 * or OUTCOME_PENDING when its flow wrote the first answer of its key
 * (the effect happened); what it would have answered when the engine
 * had decided (replay, pending, mismatch) or was waiting on a duplicate
 * (in flight); OUTCOME_ERROR when its last write failed. */
static int outcome_so_far(const struct idemd_async_flow *af) {
  if (af->a.rc == IDEM_EREFUSED && af->e->refused)
    return OUTCOME_INVALID; /* a rule of the route's: nothing was written */
  if (af->a.rc != IDEM_OK)
    return OUTCOME_ERROR;
  if (wrote_first_answer(af))
    return written_answer(af).state == IDEM_STATE_PENDING ? OUTCOME_PENDING : OUTCOME_NEW;
  if (af->stage == DECIDING && af->a.decision != 0 &&
      af->a.decision != IDEM_DECIDE_EXECUTE)
    return outcome_of(af->a.decision);
  if (af->a.decision == 0 && af->a.begin.wait_until_ms != 0)
    return OUTCOME_IN_FLIGHT;
  return OUTCOME_NONE;
}

/* r->on_close, for a request whose connection closed while its flow was
 * between two steps (resumed, before its event thread went on: the client
 * left). A payment's connection stays suspended from its reservation to
 * its completion (woken()), so a closed connection is only seen after the
 * last write, or after a reservation whose call no worker would take
 * (idemd is stopping: the reconciler takes the record over when its lease
 * ends). What was written stays; a completed first answer is still
 * remembered, for the client's retry. */
static int closed(idemd_request_t *r) {
  struct idemd_async_flow *af = r->async;
  int outcome;

  if (af == NULL)
    return OUTCOME_NONE;
  outcome = outcome_so_far(af);
  if (wrote_first_answer(af)) {
    struct first_answer a = written_answer(af);
    idem_scope_t scope = scope_of(r, af->e);
    remember_new(r, &scope, af->e->fingerprint, a.status, a.body, a.location,
                 a.state, a.expires_at);
  }
  async_end(af);
  return outcome;
}

/* In an event thread, which must not wait: the engine's asynchronous form,
 * on a store whose reads are local (else all of it in a worker). A key
 * that memory does not know, seen here for the first time, is most
 * likely new: its reservation is queued without a read (skip_read: the
 * read cost a new key 13 us of CPU, docs/performance.md, "No read before
 * a new key's reservation (SQLite)"). A duplicate in flight is parked on
 * its key, holding no thread. */
static enum MHD_Result run_in_event_thread(idemd_request_t *r, const idemd_effect_t *e,
                                           const idem_scope_t *scope) {
  idemd_server_t *srv = r->srv;
  struct idemd_async_flow *af;

  if (!idem_store_local_reads(srv->store) || idemd_pending_enter(srv) != 0)
    return idemd_defer(r, go_on); /* a worker, or 503 when stopping */
  if ((af = calloc(1, sizeof *af)) == NULL) {
    idemd_pending_leave(srv);
    return idemd_defer(r, go_on);
  }
  af->r = r;
  af->e = e;
  af->stage = DECIDING;
  af->a.begin = begin_of(r, e, scope);
  af->a.begin.skip_read = 1;
  af->a.wake = woken;
  af->a.suspend = async_suspend;
  af->a.arg = af;
  r->async = af;
  r->on_close = closed;
  return decide(af);
}

static void on_wait(void *arg, int waiting) {
  (void)arg;
  if (waiting)
    idemd_workers_wait_begin();
  else
    idemd_workers_wait_end();
}

idem_engine_t *idemd_flow_engine(idemd_server_t *srv) {
  idem_engine_config_t cfg = {.lease_ms = srv->cfg.lease_ms,
                              .ttl_ms = srv->cfg.key_ttl_ms,
                              .inflight_wait_ms = srv->cfg.inflight_wait_ms > 0
                                                      ? srv->cfg.inflight_wait_ms
                                                      : -1,
                              .on_wait = on_wait};
  idem_engine_t *engine = NULL;
  return idem_engine_new(srv->store, &cfg, &engine) == IDEM_OK ? engine : NULL;
}

/* In a worker, which may wait: the engine decides, waiting for a
 * duplicate in flight; a won key is executed and completed here. As in an
 * event thread, a key that memory does not know is taken for a new one:
 * reserved without a read first (a round trip fewer on PostgreSQL,
 * docs/performance.md, "PostgreSQL: fewer round trips"). */
static enum MHD_Result run_in_worker(idemd_request_t *r, const idemd_effect_t *e,
                                     const idem_scope_t *scope) {
  idemd_server_t *srv = r->srv;
  idem_begin_t b = begin_of(r, e, scope);
  idem_record_t rec = {0};
  enum MHD_Result ret;

  b.skip_read = 1;

  /* Bounded: a completion loses its lease only when the execution outlived
   * it and another owner took the record over; decided again, it is
   * answered from that owner's work. */
  for (int pass = 0; pass < 1000; pass++) {
    idem_decision_t d;
    idem_outcome_t out;
    idem_effect_t then;
    int64_t expires_at;
    int rc;

    /* Its reservation, and the completion below, wait on the store's
     * group commit, not at work: another worker may take a request
     * meanwhile, and the batches grow (docs/performance.md, "PostgreSQL:
     * group commit"). A wait for a duplicate in flight inside is the
     * same wait (on_wait). */
    idemd_workers_wait_begin();
    rc = idem_engine_begin(srv->engine, &b, &rec, &d);
    idemd_workers_wait_end();

    r->inflight_deadline = b.wait_until_ms;
    if (rc != IDEM_OK) {
      idem_record_reset(&rec);
      return rc == IDEM_EREFUSED && e->refused ? e->refused(r, e->ctx)
                                               : idemd_reply_store_error(r, rc);
    }
    b.prepare = NULL; /* prepared once, whatever follows */
    if (d != IDEM_DECIDE_EXECUTE || !e->execute) {
      ret = answer(r, scope, e, d, &rec);
      idem_record_reset(&rec);
      return ret;
    }
    execute(e, &rec, &out, &then);
    /* Not later than the store's: memory must not replay a record the
     * store has let expire. */
    expires_at = idem_now_ms() + srv->cfg.key_ttl_ms;
    idemd_workers_wait_begin();
    rc = idem_engine_complete(srv->engine, &rec, &out, &then);
    idemd_workers_wait_end();
    idem_record_reset(&rec);
    if (rc == IDEM_ELOST) /* our lease ran out and another owner took over */
      continue;
    if (rc != IDEM_OK)
      return idemd_reply_store_error(r, rc);
    return answer_new(r, scope, e->fingerprint, out.status, out.body, out.location,
                      out.state, expires_at);
  }
  return idemd_reply_store_error(r, IDEM_ETIMEDOUT);
}

/* The flow from memory on: where idemd_flow_run() starts, and where a
 * request parked on a duplicate, or handed to a worker, goes on
 * (r->resume), with no second parse, validation or fingerprint. */
static enum MHD_Result go_on(idemd_request_t *r) {
  const idemd_effect_t *e = r->effect;
  idem_scope_t scope = {r->tenant.id, e->operation, r->key};
  enum MHD_Result ret;

  if (answer_from_memory(r, &scope, e->fingerprint, &ret))
    return ret;
  return r->may_block ? run_in_worker(r, e, &scope) : run_in_event_thread(r, e, &scope);
}

enum MHD_Result idemd_flow_run(idemd_request_t *r, const idemd_effect_t *e) {
  /* Past the checks: from here the flow says what the request did
   * (serve_create presumed "invalid" until now). */
  r->outcome = OUTCOME_NONE;
  r->effect = e;
  return go_on(r);
}
