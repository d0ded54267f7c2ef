/* Retention: a background thread that deletes expired completed and failed
 * records in small batches (never pending or processing ones), so the
 * database stays the size of the retry window. */
#ifndef IDEMD_SWEEPER_H
#define IDEMD_SWEEPER_H

#include "server/server.h"

/* Deletes expired records now, batch by batch, until none is left or
 * `max_batches` ran. Returns IDEM_OK or the store error that stopped it;
 * `*deleted` gets the number deleted. */
int idemd_sweep_now(idem_store_t *store, int batch, int max_batches,
                    long long *deleted);

/* Starts the sweeper of `srv` (interval and batch from its configuration).
 * Returns 0, or -1 when the thread cannot start. */
int idemd_sweeper_start(idemd_server_t *srv);

/* Stops it, waiting for a batch in progress. */
void idemd_sweeper_stop(idemd_server_t *srv);

#endif
