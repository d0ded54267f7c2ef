/* Internal: wake-ups for requests waiting on an in-flight key. Keys hash to
 * one of a fixed number of stripes; each stripe has a generation counter,
 * a condition variable for threads that sleep and a list of parked
 * waiters (requests that hold no thread), so a completion wakes its
 * waiters at once without a global lock (a collision only costs a
 * spurious re-read). */
#ifndef IDEM_LIB_WAITSET_H
#define IDEM_LIB_WAITSET_H

#include <stdint.h>
#include <time.h>

#include "idem/record.h"
#include "idem/store.h"

typedef struct idem__waitset idem__waitset_t;

/* Returns a new wait set, or NULL when out of memory. */
idem__waitset_t *idem__waitset_new(void);

/* Frees the set. No thread may be waiting and no waiter parked. */
void idem__waitset_free(idem__waitset_t *ws);

/* The current generation of `scope`'s stripe. */
uint64_t idem__waitset_ticket(idem__waitset_t *ws, const idem_scope_t *scope);

/* Waits until the stripe's generation differs from `ticket` or `timeout_ms`
 * passed; returns IDEM_OK or IDEM_ETIMEDOUT. */
int idem__waitset_wait(idem__waitset_t *ws, const idem_scope_t *scope,
                       uint64_t ticket, int64_t timeout_ms);

/* Parks `w` on `scope`'s stripe until its generation moves past `ticket`
 * or idem__waitset_expire() times it out. Returns 0 when parked, 1 when
 * the generation moved already (not parked). */
int idem__waitset_park(idem__waitset_t *ws, const idem_scope_t *scope,
                       uint64_t ticket, idem_store_waiter_t *w);

/* Wakes, as timed out, the parked waiters whose deadline is at or before
 * `now_ms`; returns how many. */
int idem__waitset_expire(idem__waitset_t *ws, int64_t now_ms);

/* Advances `scope`'s stripe and wakes the threads asleep on it and the
 * waiters parked on `scope` (by hash). */
void idem__waitset_wake(idem__waitset_t *ws, const idem_scope_t *scope);

/* Wakes every waiter of every stripe (after lost notifications). */
void idem__waitset_wake_all(idem__waitset_t *ws);

/* `*out` = `ms` from now on CLOCK_MONOTONIC, for pthread_cond_timedwait()
 * on a condition made with that clock. */
void idem__deadline_after(int64_t ms, struct timespec *out);

#endif
