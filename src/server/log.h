/* idemd's logs: one JSON line per request on stderr (SPEC section 5), plus
 * event lines for start-up, shutdown and failures. A line is written with
 * one call, so lines from many threads never interleave. */
#ifndef IDEMD_LOG_H
#define IDEMD_LOG_H

#include "server/server.h"

/* Sets the lowest level written: "debug", "info", "warn" or "error".
 * Request lines are "info". Call once at start-up, before threads. */
void idemd_log_set_level(const char *level);

/* Writes the request line of `r`: time, request id, tenant, operation,
 * key id (never the raw key), outcome, status, latency. */
void idemd_log_request(const idemd_request_t *r);

/* Writes {"ts","level","msg", k1: v1, ...}: a NULL-terminated list of
 * string pairs. */
void idemd_log_event(const char *level, const char *msg, ...)
    __attribute__((sentinel));

/* Sets r->key_id to the first 16 hex digits of HMAC(secret, tenant id,
 * operation, key): stable for a key, useless to recover it. */
void idemd_key_id(const idemd_request_t *r, const char *operation);

#endif
