/* idemd's logs: one JSON line per request on stderr (docs/idempotency.md,
 * section 5.1), plus event lines for start-up, shutdown and failures. Lines
 * from many threads never interleave. While batching is on (idemd serve),
 * request lines are written together, at most one interval after they were
 * made. */
#ifndef IDEMD_LOG_H
#define IDEMD_LOG_H

#include <stddef.h>

#include "server/server.h"

/* Sets the lowest level written: "debug", "info", "warn" or "error".
 * Request lines are "info". Call once at start-up, before threads. */
void idemd_log_set_level(const char *level);

/* Writes the request line of `r`: time, request id, tenant, operation,
 * key id (never the raw key), outcome, status, latency. */
void idemd_log_request(const idemd_request_t *r);

/* Writes `n` bytes of one whole request line (JSON and its newline, made
 * by the caller: idemd gateway's) at level info, batched as
 * idemd_log_request()'s are. */
void idemd_log_line(const char *line, size_t n);

/* What idemd gateway's request line holds (gateway/server.c); borrowed. */
typedef struct idemd_gateway_line {
  const char *request_id, *method, *path;
  const char *route;  /* NULL: not a keyed route */
  const char *key_id; /* NULL or "": none */
  idemd_op_t op;
  idemd_outcome_t outcome;
  int status;
  int64_t start_us; /* idem_mono_us() when the request came */
} idemd_gateway_line_t;

/* Writes the request line of idemd gateway, as idemd_log_request()
 * formats its own (no JSON tree: the hot path of a replay), batched. */
void idemd_log_gateway_request(const idemd_gateway_line_t *g);

/* Starts batching request lines, flushed every `every_ms` and whenever
 * the next line would not fit: in 64 KiB when stderr is a regular file,
 * in 4 KiB (PIPE_BUF) otherwise (looked at here, once). Event lines are
 * never held: each first writes the lines before it. Returns -1 (and
 * nothing changes) when no thread can be started. */
int idemd_log_batch_start(int64_t every_ms);

/* Writes what is waiting and stops batching: later lines go out at once
 * (call it before _exit, too). */
void idemd_log_batch_stop(void);

/* Writes {"ts","level","msg", k1: v1, ...}: a NULL-terminated list of
 * string pairs. */
void idemd_log_event(const char *level, const char *msg, ...)
    __attribute__((sentinel));

/* Sets r->key_id to the first 16 hex digits of HMAC(secret, tenant id,
 * operation, key): stable for a key, useless to recover it. */
void idemd_key_id(idemd_request_t *r, const char *operation);

#endif
