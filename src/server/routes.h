/* idemd's route table and the handlers of whole requests (routes.c). */
#ifndef IDEMD_ROUTES_H
#define IDEMD_ROUTES_H

#include <stddef.h>

#include "server/server.h"

/* How a route's {id} is spelled. */
typedef enum idemd_id_rule {
  IDEMD_ID_NONE = 0, /* an exact path */
  IDEMD_ID_PLAIN,    /* 1 to 63 of [A-Za-z0-9_] */
  IDEMD_ID_ORDER,    /* 1 to IDEMD_PATH_ID_MAX visible ASCII but '/': the
                        route's handler says what is wrong with it */
} idemd_id_rule_t;

/* One route: a path (or a prefix, an {id} and a suffix) and one method.
 * Routes of one path follow each other and share their `allow`. */
typedef struct idemd_route_def {
  const char *prefix; /* exact path, or what comes before "{id}" */
  const char *suffix; /* what follows "{id}" ("" for none) */
  idemd_id_rule_t id_rule;
  const char *method;
  const char *allow;
  idemd_route_t route;
  idemd_op_t op;
  int needs_auth;
} idemd_route_def_t;

/* The route `url` and `method` name, with its {id} copied to `id` (idcap
 * at least IDEMD_PATH_ID_MAX + 1), and `*allowed` 1; when the path is
 * known but not for `method`, its first route (for its `allow` and its
 * operation) and `*allowed` 0; NULL for an unknown path. HEAD goes
 * wherever GET does. */
const idemd_route_def_t *idemd_route_match(const char *url, const char *method, char *id,
                                           size_t idcap, int *allowed);

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
