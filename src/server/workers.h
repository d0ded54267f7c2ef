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

/* Starts `threads` (>= 1) workers. Returns NULL if none could start. */
idemd_workers_t *idemd_workers_start(int threads);

/* Queues `w`; a free worker calls w->run(w) soon, in submission order.
 * `w` must stay valid until its run begins. Returns 0, or -1 once
 * idemd_workers_stop() has begun (then `w` will never run). */
int idemd_workers_submit(idemd_workers_t *p, idemd_work_t *w);

/* Refuses new work, runs what is queued, and joins the workers. The pool
 * stays valid (submissions return -1) until idemd_workers_free(). NULL is
 * a no-op. */
void idemd_workers_stop(idemd_workers_t *p);

/* Frees a stopped pool. NULL is a no-op. */
void idemd_workers_free(idemd_workers_t *p);

#endif
