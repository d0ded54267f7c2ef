/* Sending answers: JSON bodies with the headers every idemd response carries
 * (Content-Type, X-Request-Id), and the error shapes of docs/idempotency.md,
 * section 3.4 ({"error": ...} and {"errors": [...]}). Each call records the
 * status for the log line and marks the request answered. */
#ifndef IDEMD_REPLY_H
#define IDEMD_REPLY_H

#include <jansson.h>

#include "server/server.h"

typedef struct idemd_reply_headers {
  const char *location;    /* Location, or NULL */
  int replayed;            /* adds Idempotent-Replayed: true */
  int retry_after;         /* seconds; 0: none */
  const char *allow;       /* Allow, for 405 */
  int www_authenticate;    /* WWW-Authenticate: Bearer, for 401 */
  const char *content_type;/* default application/json */
  int close;               /* adds Connection: close */
} idemd_reply_headers_t;

/* Sends `status` with `len` bytes of `body` (copied) and the headers in `h`
 * (may be NULL). */
enum MHD_Result idemd_reply(idemd_request_t *r, int status, const char *body,
                            size_t len, const idemd_reply_headers_t *h);

/* Sends {"error": message}. `message` must be a fixed text of ours: never
 * a library message, SQL or a path. */
enum MHD_Result idemd_reply_error(idemd_request_t *r, int status,
                                  const char *message,
                                  const idemd_reply_headers_t *h);

/* Sends 422 {"errors": errors}; takes ownership of `errors`. */
enum MHD_Result idemd_reply_errors(idemd_request_t *r, json_t *errors);

/* Sends `value` serialised compactly; takes ownership of `value`. */
enum MHD_Result idemd_reply_json(idemd_request_t *r, int status, json_t *value,
                                 const idemd_reply_headers_t *h);

/* Sends 503 {"error": ...} after a store failure, counting it and logging
 * the store's own message (which never reaches the body). */
enum MHD_Result idemd_reply_store_error(idemd_request_t *r, int err);

/* The same, logging `detail` (may be NULL) instead: the store's message
 * as the thread that saw the failure had it, for a write that failed on
 * another thread than the one answering. */
enum MHD_Result idemd_reply_store_failure(idemd_request_t *r, int err,
                                          const char *detail);

/* Returns a malloc'd copy of the JSON object text `body` with
 * "replayed": true added, or NULL when out of memory or not an object. */
char *idemd_mark_replayed(const char *body);

#endif
