/* A fixed pool of threads over one FIFO queue, with a bound on how many
 * of them work at once. Idle workers are woken last-in first-out, so that
 * a steady load keeps the same few threads busy. */
#define _GNU_SOURCE /* pthread_setname_np */
#include "server/workers.h"

#include <pthread.h>
#include <stdlib.h>

/* A worker waiting for work, on the pool's stack of idle workers. */
struct idle {
  pthread_cond_t wake;
  int woken; /* taken off the stack by whoever woke it */
  struct idle *next;
};

struct idemd_workers {
  pthread_mutex_t lock;
  struct idle *idle;   /* idle workers, the latest first */
  idemd_work_t *head, *tail;
  int running;     /* workers in a job, less those in a wait */
  int waking;      /* workers woken for a job, not yet back at the queue */
  int max_running; /* what `running` may reach before a job is taken */
  int stopping;
  int joined;
  int n;
  pthread_t *threads;
};

/* The pool of the worker running this thread; NULL on other threads. */
static _Thread_local idemd_workers_t *this_pool;
/* This worker is between idemd_workers_wait_begin() and _end(): a second
 * begin, or an end without one, changes nothing. */
static _Thread_local int in_wait;

/* Whether a worker should take the next job now. Called locked. */
static int can_take(const idemd_workers_t *p) {
  return p->head != NULL && p->running < p->max_running;
}

/* Takes the latest idle worker off the stack and wakes it. Called locked,
 * with p->idle not NULL. */
static void wake_latest(idemd_workers_t *p) {
  struct idle *w = p->idle;
  p->idle = w->next;
  w->woken = 1;
  p->waking++;
  pthread_cond_signal(&w->wake);
}

/* Wakes the latest idle worker if a job can start, counting those woken
 * already: a burst of submissions wakes no more workers than may work.
 * Called locked. */
static void wake_one(idemd_workers_t *p) {
  if (p->idle != NULL && p->head != NULL && p->running + p->waking < p->max_running)
    wake_latest(p);
}

/* Wakes every idle worker (stopping). Called locked. */
static void wake_all(idemd_workers_t *p) {
  while (p->idle != NULL)
    wake_latest(p);
}

static void *worker_main(void *arg) {
  idemd_workers_t *p = arg;
  struct idle me = {.woken = 0};

  pthread_setname_np(pthread_self(), "idemd-worker"); /* for top -H, perf */
  this_pool = p;
  pthread_cond_init(&me.wake, NULL);

  pthread_mutex_lock(&p->lock);
  for (;;) {
    idemd_work_t *w;
    while (!can_take(p) && !(p->stopping && p->head == NULL)) {
      me.woken = 0;
      me.next = p->idle;
      p->idle = &me;
      while (!me.woken)
        pthread_cond_wait(&me.wake, &p->lock);
      p->waking--; /* back at the queue */
    }
    if (p->head == NULL)
      break; /* stopping, and the queue is empty */
    w = p->head;
    p->head = w->next;
    if (p->head == NULL)
      p->tail = NULL;
    p->running++;
    pthread_mutex_unlock(&p->lock);
    w->run(w); /* may free `w`: not touched after this */
    pthread_mutex_lock(&p->lock);
    p->running--;
    /* This worker takes the next job itself, if there is one: a place
     * freed here needs no other thread woken. Once stopping, the last
     * job taken lets the idle workers end. */
    if (p->stopping && p->head == NULL)
      wake_all(p);
  }
  pthread_mutex_unlock(&p->lock);
  pthread_cond_destroy(&me.wake);
  return NULL;
}

idemd_workers_t *idemd_workers_start(int threads, int running) {
  idemd_workers_t *p = calloc(1, sizeof *p);
  pthread_attr_t attr;

  if (p == NULL || threads < 1 || running < 1 ||
      (p->threads = calloc((size_t)threads, sizeof *p->threads)) == NULL) {
    free(p);
    return NULL;
  }
  p->max_running = running;
  pthread_mutex_init(&p->lock, NULL);
  pthread_attr_init(&attr);
  /* Request handling needs little stack; many workers should cost little. */
  pthread_attr_setstacksize(&attr, 512 * 1024);
  for (; p->n < threads; p->n++)
    if (pthread_create(&p->threads[p->n], &attr, worker_main, p) != 0)
      break;
  pthread_attr_destroy(&attr);
  if (p->n == 0) {
    idemd_workers_stop(p);
    idemd_workers_free(p);
    return NULL;
  }
  return p;
}

int idemd_workers_submit(idemd_workers_t *p, idemd_work_t *w) {
  w->next = NULL;
  pthread_mutex_lock(&p->lock);
  if (p->stopping) {
    pthread_mutex_unlock(&p->lock);
    return -1;
  }
  if (p->tail)
    p->tail->next = w;
  else
    p->head = w;
  p->tail = w;
  wake_one(p);
  pthread_mutex_unlock(&p->lock);
  return 0;
}

void idemd_workers_wait_begin(void) {
  idemd_workers_t *p = this_pool;

  if (p == NULL || in_wait)
    return;
  in_wait = 1;
  pthread_mutex_lock(&p->lock);
  p->running--;
  wake_one(p);
  pthread_mutex_unlock(&p->lock);
}

void idemd_workers_wait_end(void) {
  idemd_workers_t *p = this_pool;

  if (p == NULL || !in_wait)
    return;
  in_wait = 0;
  pthread_mutex_lock(&p->lock);
  p->running++; /* past the bound for a moment, rather than wait again */
  pthread_mutex_unlock(&p->lock);
}

void idemd_workers_stop(idemd_workers_t *p) {
  if (p == NULL || p->joined)
    return;
  pthread_mutex_lock(&p->lock);
  p->stopping = 1;
  if (p->head == NULL)
    wake_all(p); /* else the workers at work end it (worker_main) */
  pthread_mutex_unlock(&p->lock);
  for (int i = 0; i < p->n; i++)
    pthread_join(p->threads[i], NULL);
  p->joined = 1;
}

void idemd_workers_free(idemd_workers_t *p) {
  if (p == NULL)
    return;
  idemd_workers_stop(p);
  pthread_mutex_destroy(&p->lock);
  free(p->threads);
  free(p);
}
