/* The threads that run requests which wait: for a commit, a provider call
 * or an in-flight duplicate. libmicrohttpd's few event threads never wait;
 * a request whose next step would is suspended and handed to this pool,
 * which answers it and resumes its connection. */
#ifndef IDEMD_WORKERS_H
#define IDEMD_WORKERS_H

/* One piece of work, embedded in what it works on (no allocation). */
typedef struct idemd_work {
  void (*run)(struct idemd_work *w);
  struct idemd_work *next;
} idemd_work_t;

typedef struct idemd_workers idemd_workers_t;

/* Starts `threads` (>= 1) workers, of which at most `running` (>= 1) take
 * jobs at once; a job in a wait (idemd_workers_wait_begin) does not
 * count. Work that only needs the store (PostgreSQL's round trips, above
 * all) thus keeps few threads busy, however many requests are in flight,
 * while many may wait on providers. Returns NULL if none could start. */
idemd_workers_t *idemd_workers_start(int threads, int running);

/* Queues `w`; a free worker calls w->run(w) soon, in submission order.
 * `w` must stay valid until its run begins. Returns 0, or -1 once
 * idemd_workers_stop() has begun (then `w` will never run). */
int idemd_workers_submit(idemd_workers_t *p, idemd_work_t *w);

/* Called by a job before it waits on something slower than the store (a
 * provider call, a duplicate in flight): until idemd_workers_wait_end(),
 * its worker does not count against the pool's `running` bound, so
 * another job may start. A no-op on a thread that is not a worker, and
 * in a wait already begun. */
void idemd_workers_wait_begin(void);

/* Ends that wait: the worker counts again at once, even if that puts the
 * pool past its bound for a moment (it never waits for a place; when a
 * key completes, every duplicate that waited on it comes back at once).
 * A no-op without a wait begun. */
void idemd_workers_wait_end(void);

/* Refuses new work, runs what is queued, and joins the workers. The pool
 * stays valid (submissions return -1) until idemd_workers_free(). NULL is
 * a no-op. */
void idemd_workers_stop(idemd_workers_t *p);

/* Frees a stopped pool. NULL is a no-op. */
void idemd_workers_free(idemd_workers_t *p);

#endif
