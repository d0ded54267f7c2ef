/* Readiness: whether idemd's writes work now, for a load balancer
 * (GET /readyz, docs/operations.md). The store says how its writes are
 * doing (idem_store_health()); while none are made, a thread of ours
 * makes a small one every second (idem_store_probe()), so that a full
 * disk or a lock another process holds shows without traffic. */
#ifndef IDEMD_READINESS_H
#define IDEMD_READINESS_H

#include "server/server.h"

/* Why idemd is not ready, or NULL when it is: draining, writes that fail
 * (the last one failed), or writes under way that have not moved for
 * --ready-timeout. Never blocks. */
const char *idemd_not_ready(idemd_server_t *srv);

/* Starts the probe thread of `srv`. Returns 0, or -1 when it cannot start. */
int idemd_readiness_start(idemd_server_t *srv);

/* Stops it, waiting for a probe under way. */
void idemd_readiness_stop(idemd_server_t *srv);

#endif
