/* A fixed pool of threads over one FIFO queue. */
#define _GNU_SOURCE /* pthread_setname_np */
#include "server/workers.h"

#include <pthread.h>
#include <stdlib.h>

struct idemd_workers {
  pthread_mutex_t lock;
  pthread_cond_t ready; /* work queued, or stopping */
  idemd_work_t *head, *tail;
  int idle; /* workers waiting on `ready` */
  int stopping;
  int joined;
  int n;
  pthread_t *threads;
};

static void *worker_main(void *arg) {
  idemd_workers_t *p = arg;

  pthread_setname_np(pthread_self(), "idemd-worker"); /* for top -H, perf */

  pthread_mutex_lock(&p->lock);
  for (;;) {
    idemd_work_t *w;
    while (p->head == NULL && !p->stopping) {
      p->idle++;
      pthread_cond_wait(&p->ready, &p->lock);
      p->idle--;
    }
    if (p->head == NULL)
      break; /* stopping, and the queue is empty */
    w = p->head;
    p->head = w->next;
    if (p->head == NULL)
      p->tail = NULL;
    pthread_mutex_unlock(&p->lock);
    w->run(w); /* may free `w`: not touched after this */
    pthread_mutex_lock(&p->lock);
  }
  pthread_mutex_unlock(&p->lock);
  return NULL;
}

idemd_workers_t *idemd_workers_start(int threads) {
  idemd_workers_t *p = calloc(1, sizeof *p);
  pthread_attr_t attr;

  if (p == NULL || threads < 1 ||
      (p->threads = calloc((size_t)threads, sizeof *p->threads)) == NULL) {
    free(p);
    return NULL;
  }
  pthread_mutex_init(&p->lock, NULL);
  pthread_cond_init(&p->ready, NULL);
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
  int wake;

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
  wake = p->idle > 0;
  pthread_mutex_unlock(&p->lock);
  if (wake)
    pthread_cond_signal(&p->ready);
  return 0;
}

void idemd_workers_stop(idemd_workers_t *p) {
  if (p == NULL || p->joined)
    return;
  pthread_mutex_lock(&p->lock);
  p->stopping = 1;
  pthread_cond_broadcast(&p->ready);
  pthread_mutex_unlock(&p->lock);
  for (int i = 0; i < p->n; i++)
    pthread_join(p->threads[i], NULL);
  p->joined = 1;
}

void idemd_workers_free(idemd_workers_t *p) {
  if (p == NULL)
    return;
  idemd_workers_stop(p);
  pthread_cond_destroy(&p->ready);
  pthread_mutex_destroy(&p->lock);
  free(p->threads);
  free(p);
}
