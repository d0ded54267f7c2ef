/* Connection guard: limits that keep slow or numerous clients from
 * starving the rest. libmicrohttpd's own timeout only fires on inactivity,
 * so a client sending a byte a second would hold its connection forever;
 * the guard gives each request a deadline to arrive in full, and a
 * watchdog cuts connections that miss it. It also counts connections so
 * that those beyond the cap get a clear 503 instead of a silent drop. */
#ifndef IDEMD_GUARD_H
#define IDEMD_GUARD_H

#include <microhttpd.h>
#include <stdint.h>

typedef struct idemd_guard idemd_guard_t;

/* Creates a guard: a request must arrive within `request_timeout_ms` of the
 * connection opening (or of the previous answer on it); at most
 * `max_connections` are served at once. Starts the watchdog thread.
 * Returns NULL when out of memory or the watchdog thread cannot start. */
idemd_guard_t *idemd_guard_new(int64_t request_timeout_ms, int max_connections);

/* Stops the watchdog and frees the guard; MHD must be stopped first. */
void idemd_guard_free(idemd_guard_t *g);

/* The MHD_OPTION_NOTIFY_CONNECTION callback (cls is the guard). */
void idemd_guard_notify(void *cls, struct MHD_Connection *c, void **socket_context,
                        enum MHD_ConnectionNotificationCode code);

/* The guard's record of connection `c` (NULL if it has none). */
void *idemd_guard_of(struct MHD_Connection *c);

/* Whether connection `conn` (from idemd_guard_of) came beyond the cap. */
int idemd_guard_over_limit(void *conn);

/* Marks `conn` as answering (exempt from the deadline) or, with busy = 0,
 * done answering: the deadline for its next request starts now. */
void idemd_guard_busy(idemd_guard_t *g, void *conn, int busy);

/* Connections cut at the deadline, and refused beyond the cap, so far. */
uint64_t idemd_guard_cut(const idemd_guard_t *g);
uint64_t idemd_guard_refused(const idemd_guard_t *g);

/* Counts a refusal (the caller answered 503). */
void idemd_guard_count_refusal(idemd_guard_t *g);

#endif
