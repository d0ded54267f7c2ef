/* idemd's route table and the handlers of whole requests (routes.c). */
#ifndef IDEMD_ROUTES_H
#define IDEMD_ROUTES_H

#include <stddef.h>

#include "server/server.h"

/* One route: a path (or a prefix followed by "{id}") and its method. */
typedef struct idemd_route_def {
  const char *prefix; /* exact path, or prefix of "/{id}" routes */
  int has_id;
  const char *method;
  const char *allow;
  idemd_route_t route;
  idemd_op_t op;
  int needs_auth;
} idemd_route_def_t;

/* The route `url` names, with its {id} copied to `id` (at most idcap - 1
 * characters of [A-Za-z0-9_]); NULL when it names none. */
const idemd_route_def_t *idemd_route_match(const char *url, char *id, size_t idcap);

/* Whether the route takes `method` (HEAD wherever GET is taken). */
int idemd_route_allows(const idemd_route_def_t *d, const char *method);

/* Checks the API key against the store: IDEM_OK (and r->authenticated),
 * IDEM_ENOTFOUND when it names no tenant, or the store's error. Answers
 * nothing. */
int idemd_check_key(idemd_request_t *r);

/* The answer to a failed idemd_check_key(): 401, or 503 when the store
 * failed. */
enum MHD_Result idemd_reply_key_failure(idemd_request_t *r, int rc);

/* The request is all here: its credentials, then its route's handler,
 * which answers it now or once it is resumed. In an event thread first;
 * on a store whose reads may block, all of it is handed to a worker,
 * which calls this again. */
enum MHD_Result idemd_dispatch(idemd_request_t *r);

#endif
