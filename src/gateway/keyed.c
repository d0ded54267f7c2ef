/* A keyed route through the gateway (docs/gateway.md, "Keyed routes"):
 * the key is checked, the request fingerprinted, and libidem's engine
 * decides; a request that wins its key goes to the upstream once, and
 * what came back (or that nothing did) completes its record. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "gateway/answer.h"
#include "gateway/request.h"
#include "gateway/requests.h"
#include "idem/canon.h"
#include "idem/clock.h"
#include "idem/crypto.h"
#include "server/log.h"
#include "server/replay_cache.h"



/* 1 when `v` holds a real anywhere: idem_canon_dump() is for integers
 * and strings, so such a body is fingerprinted as its bytes. */
static int has_real(const json_t *v) {
  const char *k;
  json_t *e;
  size_t i;
  if (json_is_real(v))
    return 1;
  if (json_is_object(v)) {
    json_object_foreach((json_t *)v, k, e) if (has_real(e)) return 1;
  } else if (json_is_array(v)) {
    json_array_foreach(v, i, e) if (has_real(e)) return 1;
  }
  return 0;
}

static int is_json_type(const char *ct) {
  const char *semi;
  size_t n;
  if (ct == NULL)
    return 0;
  semi = strchr(ct, ';');
  n = semi ? (size_t)(semi - ct) : strlen(ct);
  while (n > 0 && (ct[n - 1] == ' ' || ct[n - 1] == '\t'))
    n--;
  return (n == 16 && strncasecmp(ct, "application/json", 16) == 0) ||
         (n > 5 && strncasecmp(ct + n - 5, "+json", 5) == 0);
}

/* The fingerprint: the route's operation over the method, the target
 * (path and query), Content-Type and the body, in canonical form when it
 * is JSON (key order and spacing do not count), else its bytes. */
static int fingerprint(const gw_req_t *r, const gw_route_t *route,
                       char fp[IDEM_FINGERPRINT_LEN]) {
  const char *ct = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, "Content-Type");
  char *canon = NULL, *text;
  const char *body = r->body ? r->body : "";
  size_t body_len = r->body_len, head, len;
  int rc;

  if (is_json_type(ct) && body_len > 0) {
    json_t *v = json_loadb(body, body_len, JSON_REJECT_DUPLICATES, NULL);
    if (v && !has_real(v) && (canon = idem_canon_dump(v)) != NULL) {
      body = canon;
      body_len = strlen(canon);
    }
    json_decref(v);
  }
  head = strlen(r->method) + strlen(r->target) + strlen(ct ? ct : "") + 3;
  len = head + body_len;
  if ((text = malloc(len + 1)) == NULL) {
    free(canon);
    return IDEM_ENOMEM;
  }
  snprintf(text, head + 1, "%s\n%s\n%s\n", r->method, r->target, ct ? ct : "");
  memcpy(text + head, body, body_len);
  rc = idem_fingerprint_text(route->operation, text, len, fp);
  free(text);
  free(canon);
  return rc;
}

int gw_scope_number(const idem_hmac_t *scope_mac, const char *value, int64_t *out) {
  unsigned char mac[IDEM_SHA256_LEN];
  uint64_t n = 0;
  /* Absent and empty are two scopes: an empty value is HMAC'd as one NUL
   * byte, which no value holds (a NUL in a header is refused). Absent
   * stays the HMAC of nothing, as before. */
  int rc = value == NULL      ? idem_hmac_compute(scope_mac, "", 0, mac)
           : value[0] == '\0' ? idem_hmac_compute(scope_mac, "\0", 1, mac)
                              : idem_hmac_compute(scope_mac, value, strlen(value), mac);
  if (rc != IDEM_OK)
    return rc;
  for (int i = 0; i < 8; i++)
    n = n << 8 | mac[i];
  *out = (int64_t)((n & ((UINT64_C(1) << 62) - 1)) | (UINT64_C(1) << 62));
  return IDEM_OK;
}

/* The request's scope number, from its --scope-header value. */
static int scope_id(const gw_req_t *r, int64_t *out) {
  const char *v = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND,
                                              r->gw->cfg.scope_header);
  return gw_scope_number(r->gw->scope_mac, v, out);
}

/* The key id of the log line: as idemd's (server/log.h), never the key. */
static void key_id(gw_req_t *r, const idem_scope_t *s) {
  unsigned char mac[IDEM_SHA256_LEN];
  char hex[IDEM_SHA256_HEX_LEN];
  char msg[32 + IDEM_OPERATION_MAX + IDEM_KEY_MAX];
  int n = snprintf(msg, sizeof msg, "%lld\n%s\n%s", (long long)s->tenant_id, s->operation,
                   s->key);
  if (n < 0 || idem_hmac_compute(r->gw->key_id_mac, msg, (size_t)n, mac) != IDEM_OK)
    return;
  idem_hex(mac, 8, hex);
  memcpy(r->key_id, hex, 17);
}

static enum MHD_Result store_error(gw_req_t *r, int rc) {
  atomic_fetch_add(&r->gw->counters.store_errors, 1);
  atomic_fetch_add(&r->gw->metrics.store_errors, 1);
  r->outcome = OUTCOME_ERROR;
  (void)rc;
  return gw_send_error(r, 503, "the gateway cannot reach its store; retry with the same key");
}

/* The request reached the upstream but what came of it could not be
 * written: never 503 (SPEC section 9: that says nothing was sent). The
 * record stays processing under this gateway's lease; once it runs out a
 * resolver takes it over (docs/gateway.md, "Pending requests"), so the
 * client is told what its retries will see: pending, 202. */
static enum MHD_Result kept_not(gw_req_t *r, int rc) {
  static const char *const retry_later[] = {"Retry-After", "5", NULL};
  gw_answer_t own = {0};
  enum MHD_Result ret = MHD_NO;

  atomic_fetch_add(&r->gw->counters.store_errors, 1);
  atomic_fetch_add(&r->gw->metrics.store_errors, 1);
  idemd_log_event("warn", "gateway: cannot keep what the upstream answered", "error",
                  idem_strerror(rc), NULL);
  r->outcome = OUTCOME_PENDING;
  if (gw_answer_own(202, GW_PENDING_BODY, &own) == IDEM_OK)
    ret = gw_send(r, &own, retry_later);
  gw_answer_free(&own);
  return ret;
}

static void destroy_response(void *resp) { MHD_destroy_response(resp); }

int64_t gw_replay_keep_until(int64_t expires_at, int64_t now_ms, int local_clock) {
  if (local_clock || expires_at <= 0)
    return expires_at; /* 0: not kept (the cache keeps no entry without an expiry) */
  return expires_at < now_ms + GW_REPLAY_KEEP_MS ? expires_at : now_ms + GW_REPLAY_KEEP_MS;
}

/* Keeps a completed key's replay ready in memory (the replay cache, as
 * idemd's: a completed record does not change until it expires), so the
 * next replays of the key read neither the store nor the stored form
 * (docs/gateway.md, "Performance"). A response of its own, apart from
 * the one this request sends: libmicrohttpd counts a response's users,
 * so the kept one goes to many connections at once, on any store. */
static void keep_replay(gw_req_t *r, const idem_record_t *rec, const gw_answer_t *a,
                        const char *const *extra) {
  idem_scope_t scope = {rec->tenant_id, rec->operation, rec->key};
  struct MHD_Response *resp = gw_response(r, a, extra);
  if (resp)
    idemd_replay_cache_put_value(r->gw->replays, &scope, rec->fingerprint, a->status, resp,
                                 gw_answer_bytes(a, extra), destroy_response,
                                 gw_replay_keep_until(rec->expires_at, idem_now_ms(),
                                                      idem_store_local_reads(r->gw->store)));
}

/* Answers a stored answer again, marked as a replay. */
static enum MHD_Result replay(gw_req_t *r, const idem_record_t *rec, idemd_outcome_t outcome) {
  static const char *const replayed[] = {"Idempotent-Replayed", "true", NULL};
  static const char *const pending[] = {"Idempotent-Replayed", "true", "Retry-After", "5",
                                        NULL};
  gw_answer_t a;
  enum MHD_Result ret;

  if (gw_answer_decode(rec->response_body, &a) != IDEM_OK)
    return store_error(r, IDEM_EINVAL);
  r->outcome = outcome;
  if (outcome == OUTCOME_REPLAY && rec->state == IDEM_STATE_COMPLETED &&
      strcmp(r->method, "HEAD") != 0)
    keep_replay(r, rec, &a, replayed);
  ret = gw_send(r, &a, outcome == OUTCOME_PENDING ? pending : replayed);
  gw_answer_free(&a);
  return ret;
}

/* idemd_replay_cache_use()'s: the kept replay sent when the request's
 * fingerprint is the key's; else the key is a completed record's with
 * another request (the decision table's MISMATCH), answered after. */
struct kept_hit {
  gw_req_t *r;
  const char *fp;
  int mismatch;
  enum MHD_Result ret;
};

static int send_kept(void *value, int status, const char *fingerprint, void *arg) {
  struct kept_hit *h = arg;
  if (strcmp(fingerprint, h->fp) != 0) {
    h->mismatch = 1;
    return 1;
  }
  h->r->outcome = OUTCOME_REPLAY;
  h->r->status = status;
  h->ret = MHD_queue_response(h->r->conn, (unsigned)status, value);
  return 1;
}

static int printable(const char *s) {
  for (; *s; s++)
    if ((unsigned char)*s < 0x20 || (unsigned char)*s > 0x7e)
      return 0;
  return 1;
}

/* Completes the record with `a` (state COMPLETED or PENDING) and, in the
 * same transaction, drops its kept request (COMPLETED) or sets when it is
 * next sent (PENDING: soon with --upstream-idempotent, else never).
 * Returns IDEM_OK or the engine's error. */
int gw_keep(gw_t *gw, const idem_record_t *rec, idem_state_t state, const gw_answer_t *a,
            int attempts, int64_t next_attempt_at) {
  idem_scope_t scope = {rec->tenant_id, rec->operation, rec->key};
  gw_due_t due = {&scope, attempts, next_attempt_at};
  idem_effect_t drop = {gw_drop_fn, &scope}, later = {gw_due_fn, &due};
  char *stored = NULL;
  int rc = gw_answer_encode(a, &gw->cfg, &stored);
  const char *location = NULL;

  /* The record's own location column is text: only a printable ASCII
   * one goes there (the kept headers hold any, losslessly). */
  for (int i = 0; i < a->nheaders && rc == IDEM_OK; i++)
    if (strcasecmp(a->headers[i].name, "Location") == 0 &&
        strlen(a->headers[i].value) <= IDEM_LOCATION_MAX && printable(a->headers[i].value))
      location = a->headers[i].value;
  if (rc == IDEM_OK) {
    idem_outcome_t out = {.state = state, .status = a->status, .body = stored,
                          .location = location};
    rc = idem_engine_complete(gw->engine, rec, &out,
                              state == IDEM_STATE_COMPLETED ? &drop : &later);
  }
  free(stored);
  return rc;
}

int gw_release(gw_t *gw, const idem_record_t *rec) {
  idem_scope_t scope = {rec->tenant_id, rec->operation, rec->key};
  idem_effect_t drop = {gw_drop_fn, &scope};
  idem_outcome_t failed = {.state = IDEM_STATE_FAILED};
  return idem_engine_complete(gw->engine, rec, &failed, &drop);
}

/* When a pending request is first sent again. */
static int64_t first_retry(const gw_t *gw) {
  return gw->cfg.upstream_idempotent ? idem_now_ms() + GW_RETRY_FIRST_MS : GW_NEVER;
}

/* The request won its key: one call to the upstream, and its record
 * completed with what became of it. */
static enum MHD_Result execute(gw_req_t *r, const idem_record_t *rec, char **headers) {
  static const char *const retry_later[] = {"Retry-After", "5", NULL};
  gw_up_request_t up = {.method = r->method, .target = r->target,
                        .headers = (const char *const *)headers, .body = r->body,
                        .body_len = r->body_len, .once = 1,
                        .lease_expires_at = rec->lease_expires_at};
  gw_answer_t a = {0}, own = {0};
  gw_up_result_t res;
  enum MHD_Result ret;
  int rc;

  idemd_workers_wait_begin(); /* on the application, not the store */
  res = gw_upstream_call(r->gw->upstream, &up, &a);
  idemd_workers_wait_end();
  r->outcome = OUTCOME_NEW;
  switch (res) {
  case GW_UP_ANSWERED:
    if (r->gw->cfg.upstream_idempotent && a.status >= 500) {
      /* The upstream dedupes the key itself: its 5xx frees ours. */
      rc = gw_release(r->gw, rec);
    } else {
      rc = gw_keep(r->gw, rec, IDEM_STATE_COMPLETED, &a, 0, 0);
    }
    ret = rc == IDEM_OK ? gw_send(r, &a, NULL) : kept_not(r, rc);
    break;
  case GW_UP_TOO_LARGE:
    /* Executed, and not kept: its replays say so, and it never runs
     * again under the key. */
    atomic_fetch_add(&r->gw->counters.answers_too_large, 1);
    rc = gw_answer_own(502,
                       "{\"error\":\"the upstream's answer was too large to keep; "
                       "it is not replayed and the request is not sent again\"}",
                       &own);
    if (rc == IDEM_OK)
      rc = gw_keep(r->gw, rec, IDEM_STATE_COMPLETED, &own, 0, 0);
    ret = rc == IDEM_OK ? gw_send(r, &own, NULL) : kept_not(r, rc);
    break;
  case GW_UP_NOT_SENT:
    atomic_fetch_add(&r->gw->counters.upstream_not_sent, 1);
    rc = gw_release(r->gw, rec);
    r->outcome = OUTCOME_ERROR;
    ret = rc == IDEM_OK ? gw_send_error(r, 503, "the upstream cannot be reached; nothing "
                                               "was sent, retry with the same key")
                        : store_error(r, rc);
    break;
  case GW_UP_NO_ANSWER:
  default:
    /* Sent, no answer: whether it took effect is unknown. */
    atomic_fetch_add(&r->gw->counters.upstream_no_answer, 1);
    r->outcome = OUTCOME_PENDING;
    rc = gw_answer_own(202, GW_PENDING_BODY, &own);
    if (rc == IDEM_OK)
      rc = gw_keep(r->gw, rec, IDEM_STATE_PENDING, &own, 0, first_retry(r->gw));
    ret = rc == IDEM_OK ? gw_send(r, &own, retry_later) : kept_not(r, rc);
    break;
  }
  gw_answer_free(&a);
  gw_answer_free(&own);
  return ret;
}

/* What a request that wins its key sends and keeps for a take-over: made
 * only then (the engine's prepare), so a replay never pays for it. */
struct to_save {
  gw_req_t *r;
  const char *key; /* the parsed key, sent as the Idempotency-Key */
  char **headers;
  char *text;
  gw_save_t save;
};

static int encode_request(void *arg) {
  struct to_save *ts = arg;
  if (ts->headers == NULL && (ts->headers = gw_forward_headers(ts->r, ts->key)) == NULL)
    return IDEM_ENOMEM;
  free(ts->text);
  ts->text = gw_request_encode(ts->r->method, ts->r->target, ts->headers, ts->r->body,
                               ts->r->body_len);
  ts->save.text = ts->text;
  return ts->text ? IDEM_OK : IDEM_ENOMEM;
}

struct counts {
  const char *scope_header;
  int keys, scopes;
};

static enum MHD_Result count_keys(void *arg, enum MHD_ValueKind kind, const char *name,
                                  const char *value) {
  struct counts *c = arg;
  (void)kind;
  (void)value;
  if (strcasecmp(name, "Idempotency-Key") == 0)
    c->keys++;
  if (strcasecmp(name, c->scope_header) == 0)
    c->scopes++;
  return MHD_YES;
}

/* Where a request decided without a waiting thread is (async_decide()). */
enum async_stage { DECIDING = 1, EXECUTING, COMPLETING };

/* The keyed flow's state, kept on the request across the hand-over to
 * a worker, or, decided without a waiting thread, across its turns on
 * the store's writer and the upstream's I/O thread. */
typedef struct keyed {
  const gw_route_t *route;
  char key[IDEM_KEY_MAX + 1];
  char fp[IDEM_FINGERPRINT_LEN];
  idem_scope_t scope;
  struct to_save ts;
  /* Without a waiting thread (SQLite): the engine's request, the upstream
   * call, and the completion written with what came of it. */
  enum async_stage stage;
  int async;               /* the engine's asynchronous form holds `a` */
  idem_async_t a;
  gw_up_call_t call;
  gw_answer_t own;         /* the gateway's own answer (502, 202) */
  const gw_answer_t *sent; /* the answer kept: call.answer or own */
  char *stored;            /* its encoded form, the record's body */
  idem_outcome_t out;
  idem_effect_t then;
  idem_scope_t then_scope;
  gw_due_t due;
} keyed_t;

void gw_keyed_free(gw_req_t *r) {
  keyed_t *k = r->keyed;
  if (k == NULL)
    return;
  gw_free_lines(k->ts.headers);
  free(k->ts.text);
  if (k->async)
    idem_record_reset(&k->a.rec);
  gw_answer_free(&k->call.answer);
  gw_answer_free(&k->own);
  free(k->stored);
  free(k);
  r->keyed = NULL;
}

/* Where the request may wait: the engine decides, and a request that
 * wins its key goes to the upstream. */
static enum MHD_Result decide(gw_req_t *r) {
  keyed_t *k = r->keyed;
  idem_record_t rec = {0};
  idem_decision_t d;
  enum MHD_Result ret;
  idem_begin_t b = {.scope = k->scope,
                    .fingerprint = k->fp,
                    .correlation_id = r->request_id,
                    .effect = {gw_save_fn, &k->ts.save},
                    .prepare = encode_request,
                    .arg = &k->ts};
  int rc;

  k->ts.save.scope = &k->scope;
  k->ts.save.due_in_ms = r->gw->cfg.lease_ms; /* taken over once the lease ran out */
  rc = idem_engine_begin(r->gw->engine, &b, &rec, &d); /* may wait for a duplicate */
  if (rc != IDEM_OK) {
    ret = store_error(r, rc);
  } else if (d == IDEM_DECIDE_EXECUTE) {
    ret = execute(r, &rec, k->ts.headers);
  } else if (d == IDEM_DECIDE_REPLAY) {
    ret = replay(r, &rec, OUTCOME_REPLAY);
  } else if (d == IDEM_DECIDE_PENDING) {
    ret = replay(r, &rec, OUTCOME_PENDING);
  } else if (d == IDEM_DECIDE_MISMATCH) {
    r->outcome = OUTCOME_MISMATCH;
    ret = gw_send_error(r, 422, "Idempotency-Key was already used with a different request");
  } else {
    r->outcome = OUTCOME_IN_FLIGHT;
    atomic_fetch_add(&r->gw->metrics.inflight_timeouts, 1);
    ret = gw_send_error(r, 409, "a request with this Idempotency-Key is still in flight");
  }
  idem_record_reset(&rec);
  return ret;
}


/* ---- without a waiting thread (docs/gateway.md, "Performance") ----
 *
 * On a store whose reads are local and whose writes have asynchronous
 * forms (SQLite), a keyed request holds no thread while it waits: the
 * engine's asynchronous form (idem_engine_begin_async()) queues its
 * reservation to the store's writer, the connection suspended; a won key
 * goes from the writer straight to the upstream's I/O thread
 * (gw_upstream_submit()), and from there its completion is queued to the
 * writer (idem_engine_complete_async()), which resumes the connection
 * once it is written. The event thread answers then (async_resumed()),
 * as it does a decision after a wait for a duplicate in flight. */

static void upstream_done(gw_up_call_t *call);

/* a->suspend, on the event thread: the engine hands the request on. */
static void async_suspend(idem_async_t *a) {
  gw_req_t *r = a->arg;
  atomic_fetch_add(&r->gw->handed_off, 1);
  r->resume = gw_keyed_resumed;
  MHD_suspend_connection(r->conn);
}

/* Gives the request back to its event thread, which goes on at
 * gw_keyed_resumed(). */
static void async_resume(gw_req_t *r) {
  gw_t *gw = r->gw;
  MHD_resume_connection(r->conn); /* `r` may be gone from here on */
  atomic_fetch_sub(&gw->handed_off, 1);
}

/* The won key's upstream call, handed to the I/O thread; when it will not
 * take it (stopping), nothing was sent: the key is released. */
static void start_upstream(gw_req_t *r) {
  keyed_t *k = r->keyed;
  k->stage = EXECUTING;
  k->call = (gw_up_call_t){.req = {.method = r->method, .target = r->target,
                                   .headers = (const char *const *)k->ts.headers,
                                   .body = r->body, .body_len = r->body_len, .once = 1,
                                   .lease_expires_at = k->a.rec.lease_expires_at},
                           .done = upstream_done, .arg = r};
  if (gw_upstream_submit(r->gw->upstream, &k->call) != 0) {
    k->call.result = GW_UP_NOT_SENT;
    upstream_done(&k->call);
  }
}

/* a->wake: on the writer (a reservation or completion written), or on the
 * thread that changed the key or expired a wait. A won key goes on to the
 * upstream, the connection still suspended: its event thread is woken
 * once, when its answer is written, not between the two writes. */
static void async_woken(idem_async_t *a) {
  gw_req_t *r = a->arg;
  keyed_t *k = r->keyed;

  if (k->stage == DECIDING && a->rc == IDEM_OK && a->decision == IDEM_DECIDE_EXECUTE) {
    start_upstream(r);
    return;
  }
  async_resume(r);
}

/* On the I/O thread: what became of the call, written as the blocking
 * form's execute() writes it, with the completion queued. */
static void upstream_done(gw_up_call_t *call) {
  gw_req_t *r = call->arg;
  keyed_t *k = r->keyed;
  gw_t *gw = r->gw;
  idem_state_t state = IDEM_STATE_COMPLETED;
  const char *location = NULL;
  int rc = IDEM_OK;

  k->stage = COMPLETING;
  k->then_scope = (idem_scope_t){k->a.rec.tenant_id, k->a.rec.operation, k->a.rec.key};
  k->then = (idem_effect_t){gw_drop_fn, &k->then_scope};
  k->sent = &call->answer;
  switch (call->result) {
  case GW_UP_ANSWERED:
    /* With --upstream-idempotent, the upstream dedupes the key itself:
     * its 5xx frees ours. */
    if (gw->cfg.upstream_idempotent && call->answer.status >= 500)
      state = IDEM_STATE_FAILED;
    break;
  case GW_UP_TOO_LARGE:
    /* Executed, and not kept: its replays say so, and it never runs
     * again under the key. */
    atomic_fetch_add(&gw->counters.answers_too_large, 1);
    rc = gw_answer_own(502,
                       "{\"error\":\"the upstream's answer was too large to keep; "
                       "it is not replayed and the request is not sent again\"}",
                       &k->own);
    k->sent = &k->own;
    break;
  case GW_UP_NOT_SENT:
    atomic_fetch_add(&gw->counters.upstream_not_sent, 1);
    state = IDEM_STATE_FAILED;
    break;
  case GW_UP_NO_ANSWER:
  default:
    /* Sent, no answer: whether it took effect is unknown. */
    atomic_fetch_add(&gw->counters.upstream_no_answer, 1);
    state = IDEM_STATE_PENDING;
    rc = gw_answer_own(202, GW_PENDING_BODY, &k->own);
    k->sent = &k->own;
    k->due = (gw_due_t){&k->then_scope, 0, first_retry(gw)};
    k->then = (idem_effect_t){gw_due_fn, &k->due};
    break;
  }
  if (rc == IDEM_OK && state != IDEM_STATE_FAILED)
    rc = gw_answer_encode(k->sent, &gw->cfg, &k->stored);
  /* The record's own location column is text: only a printable ASCII
   * one goes there (the kept headers hold any, losslessly). */
  for (int i = 0; rc == IDEM_OK && state != IDEM_STATE_FAILED && i < k->sent->nheaders; i++)
    if (strcasecmp(k->sent->headers[i].name, "Location") == 0 &&
        strlen(k->sent->headers[i].value) <= IDEM_LOCATION_MAX &&
        printable(k->sent->headers[i].value))
      location = k->sent->headers[i].value;
  k->out = (idem_outcome_t){.state = state,
                            .status = state == IDEM_STATE_FAILED ? 0 : k->sent->status,
                            .body = k->stored, .location = location};
  if (rc == IDEM_OK)
    rc = idem_engine_complete_async(gw->engine, &k->a, &k->out, &k->then);
  if (rc != IDEM_EAGAIN) { /* not queued: as a failed write */
    k->a.rc = rc;
    async_resume(r);
  }
}

/* On the event thread: the answer of a won key once its completion is
 * written, or why it could not be. */
static enum MHD_Result answer_completed(gw_req_t *r) {
  keyed_t *k = r->keyed;
  int rc = k->a.rc;

  r->outcome = OUTCOME_NEW;
  switch (k->call.result) {
  case GW_UP_NOT_SENT:
    r->outcome = OUTCOME_ERROR;
    return rc == IDEM_OK ? gw_send_error(r, 503, "the upstream cannot be reached; nothing "
                                                 "was sent, retry with the same key")
                         : store_error(r, rc);
  case GW_UP_NO_ANSWER: {
    static const char *const retry_later[] = {"Retry-After", "5", NULL};
    r->outcome = OUTCOME_PENDING;
    return rc == IDEM_OK ? gw_send(r, k->sent, retry_later) : kept_not(r, rc);
  }
  default:
    return rc == IDEM_OK ? gw_send(r, k->sent, NULL) : kept_not(r, rc);
  }
}

/* The engine's next step, on the event thread: an answer when it
 * decides, or nothing yet (suspended until async_woken()). */
static enum MHD_Result async_decide(gw_req_t *r) {
  keyed_t *k = r->keyed;
  int rc = idem_engine_begin_async(r->gw->engine, &k->a);

  if (rc == IDEM_EAGAIN)
    return MHD_YES;
  if (rc == IDEM_ENOTSUP) { /* no asynchronous writes: all of it in a worker */
    k->stage = 0;
    return gw_defer(r, decide);
  }
  if (rc != IDEM_OK)
    return store_error(r, rc);
  switch (k->a.decision) {
  case IDEM_DECIDE_EXECUTE:
    /* Decided without a write of this turn's (not with a reservation of
     * its own): the call goes on as after a wake. */
    atomic_fetch_add(&r->gw->handed_off, 1);
    r->resume = gw_keyed_resumed;
    MHD_suspend_connection(r->conn);
    start_upstream(r);
    return MHD_YES;
  case IDEM_DECIDE_REPLAY:
    return replay(r, &k->a.rec, OUTCOME_REPLAY);
  case IDEM_DECIDE_PENDING:
    return replay(r, &k->a.rec, OUTCOME_PENDING);
  case IDEM_DECIDE_MISMATCH:
    r->outcome = OUTCOME_MISMATCH;
    return gw_send_error(r, 422, "Idempotency-Key was already used with a different request");
  default:
    r->outcome = OUTCOME_IN_FLIGHT;
    atomic_fetch_add(&r->gw->metrics.inflight_timeouts, 1);
    return gw_send_error(r, 409, "a request with this Idempotency-Key is still in flight");
  }
}

/* The gateway stops (docs/gateway.md, "Stopping"): a keyed request not
 * decided yet is answered at once, before any reservation, so that
 * nothing is handed off any more while shutdown waits for what was. */
static enum MHD_Result refuse_stopping(gw_req_t *r) {
  /* The connection closes after it: the client's retry connects anew, to
   * another gateway (this one's listening socket is closed). */
  static const char *const extra[] = {"Retry-After", "1", "Connection", "close", NULL};
  gw_answer_t a = {0};
  enum MHD_Result ret = MHD_NO;

  r->outcome = OUTCOME_ERROR;
  if (gw_answer_own(503, "{\"error\":\"the gateway is stopping; nothing was sent, retry "
                         "with the same key\"}", &a) == IDEM_OK)
    ret = gw_send(r, &a, extra);
  gw_answer_free(&a);
  return ret;
}

static enum MHD_Result keyed_resumed(gw_req_t *r) {
  keyed_t *k = r->keyed;
  r->resume = NULL;
  if (k->stage == DECIDING && atomic_load(&r->gw->stopping))
    return refuse_stopping(r); /* no reservation of this request's holds the key */
  if (k->stage == COMPLETING) {
    if (k->a.rc == IDEM_ELOST) {
      /* The lease ran out and another gateway took the record over: what
       * this one got is not kept; the record's owner settles it. */
      return kept_not(r, IDEM_ELOST);
    }
    return answer_completed(r);
  }
  if (atomic_load(&r->gw->draining))
    k->a.begin.wait_until_ms = -1; /* a duplicate in flight answers now */
  return async_decide(r);
}

/* Starts the asynchronous form for `r` (SQLite); on a store without it,
 * all of it in a worker. */
static enum MHD_Result run_in_event_thread(gw_req_t *r) {
  keyed_t *k = r->keyed;

  k->ts.save.scope = &k->scope;
  k->ts.save.due_in_ms = r->gw->cfg.lease_ms; /* taken over once the lease ran out */
  k->a.begin = (idem_begin_t){.scope = k->scope,
                              .fingerprint = k->fp,
                              .correlation_id = r->request_id,
                              .effect = {gw_save_fn, &k->ts.save},
                              .prepare = encode_request,
                              .arg = &k->ts,
                              .skip_read = 1};
  k->a.wake = async_woken;
  k->a.suspend = async_suspend;
  k->a.arg = r;
  k->stage = DECIDING;
  k->async = 1;
  return async_decide(r);
}

static enum MHD_Result keyed(gw_req_t *r, const gw_route_t *route) {
  keyed_t *k;
  const char *raw;
  size_t key_len;
  struct counts counts = {r->gw->cfg.scope_header, 0, 0};
  int rc;

  r->op = OP_GATEWAY;
  r->route = route->operation;
  r->outcome = OUTCOME_INVALID;
  if (r->body_too_large)
    return gw_send_error(r, 413, "request body too large");
  MHD_get_connection_values(r->conn, MHD_HEADER_KIND, count_keys, &counts);
  if (counts.keys > 1)
    return gw_send_error(r, 400, "Idempotency-Key must be sent once");
  /* Which of two values would scope the key is anyone's guess. */
  if (counts.scopes > 1)
    return gw_send_error(r, 400, "the scope header must be sent at most once");
  if ((k = calloc(1, sizeof *k)) == NULL)
    return MHD_NO;
  r->keyed = k;
  k->route = route;
  k->ts.r = r;
  k->ts.key = k->key;
  raw = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, "Idempotency-Key");
  rc = idem_key_parse(raw, raw ? strlen(raw) : 0, k->key, &key_len);
  if (rc != IDEM_OK)
    return gw_send_error(r, 400, idem_strerror(rc));
  k->scope = (idem_scope_t){.operation = route->operation, .key = k->key};
  if ((rc = scope_id(r, &k->scope.tenant_id)) != IDEM_OK ||
      (rc = fingerprint(r, route, k->fp)) != IDEM_OK) {
    r->outcome = OUTCOME_ERROR;
    return gw_send_error(r, 500, "internal error");
  }
  key_id(r, &k->scope);
  if (strcmp(r->method, "HEAD") != 0) {
    struct kept_hit hit = {r, k->fp, 0, MHD_NO};
    if (idemd_replay_cache_use(r->gw->replays, &k->scope, idem_now_ms(), send_kept, &hit)) {
      if (!hit.mismatch)
        return hit.ret;
      r->outcome = OUTCOME_MISMATCH;
      return gw_send_error(r, 422, "Idempotency-Key was already used with a different request");
    }
  }
  if (atomic_load(&r->gw->stopping))
    return refuse_stopping(r);
  /* Not in memory: most likely a new key. Where the store's reads are
   * local and its writes asynchronous (SQLite), its reservation is
   * queued at once, without a read first: the reservation reports any
   * record there is, changing nothing, and the engine decides on it (a
   * read cost a new key 13 us of CPU in idemd, docs/performance.md, "No
   * read before a new key's reservation (SQLite)"). */
  if (r->gw->upstream_loop)
    return run_in_event_thread(r);
  return gw_defer(r, decide);
}

/* gw_keyed() and gw_keyed_resumed() count themselves in `deciding`
 * before they look at `stopping`: shutdown sets `stopping`, then waits
 * for `deciding` and `handed_off` to be 0, so a request that saw
 * `stopping` unset has counted itself in `handed_off` by then. */
enum MHD_Result gw_keyed(gw_req_t *r, const gw_route_t *route) {
  enum MHD_Result ret;
  atomic_fetch_add(&r->gw->deciding, 1);
  ret = keyed(r, route);
  atomic_fetch_sub(&r->gw->deciding, 1);
  return ret;
}

enum MHD_Result gw_keyed_resumed(gw_req_t *r) {
  gw_t *gw = r->gw;
  enum MHD_Result ret;
  atomic_fetch_add(&gw->deciding, 1);
  ret = keyed_resumed(r);
  atomic_fetch_sub(&gw->deciding, 1);
  return ret;
}
