/* Internal: a background thread that calls a function every interval until
 * stopped. idemd's reconciler, sweeper, connection watchdog, parked-request
 * timer and log flusher each run on one. */
#ifndef IDEM_UTIL_TICKER_H
#define IDEM_UTIL_TICKER_H

#include <stdint.h>

typedef struct idem__ticker idem__ticker_t;

/* Starts a thread that calls fn(ctx) at once and then every `interval_ms`
 * after the previous call returned. Returns NULL when it cannot. */
idem__ticker_t *idem__ticker_start(int64_t interval_ms, void (*fn)(void *ctx),
                                   void *ctx);

/* Wakes the thread, waits for a call in progress to return, and frees the
 * ticker. NULL is fine. */
void idem__ticker_stop(idem__ticker_t *t);

#endif
