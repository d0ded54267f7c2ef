/* A periodic background thread with a prompt, clean stop. */
#include "ticker.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

struct idem__ticker {
  int64_t interval_ms;
  void (*fn)(void *);
  void *ctx;
  pthread_t thread;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  int stopping;
};

static void *loop(void *arg) {
  idem__ticker_t *t = arg;
  pthread_mutex_lock(&t->lock);
  while (!t->stopping) {
    struct timespec deadline;
    pthread_mutex_unlock(&t->lock);
    t->fn(t->ctx);
    pthread_mutex_lock(&t->lock);
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += t->interval_ms / 1000;
    deadline.tv_nsec += (t->interval_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
      deadline.tv_sec++;
      deadline.tv_nsec -= 1000000000L;
    }
    while (!t->stopping &&
           pthread_cond_timedwait(&t->cond, &t->lock, &deadline) != ETIMEDOUT)
      ;
  }
  pthread_mutex_unlock(&t->lock);
  return NULL;
}

idem__ticker_t *idem__ticker_start(int64_t interval_ms, void (*fn)(void *ctx),
                                   void *ctx) {
  idem__ticker_t *t = calloc(1, sizeof *t);
  pthread_condattr_t attr;

  if (t == NULL)
    return NULL;
  t->interval_ms = interval_ms > 0 ? interval_ms : 1;
  t->fn = fn;
  t->ctx = ctx;
  pthread_mutex_init(&t->lock, NULL);
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(&t->cond, &attr);
  pthread_condattr_destroy(&attr);
  if (pthread_create(&t->thread, NULL, loop, t) != 0) {
    pthread_cond_destroy(&t->cond);
    pthread_mutex_destroy(&t->lock);
    free(t);
    return NULL;
  }
  return t;
}

void idem__ticker_stop(idem__ticker_t *t) {
  if (t == NULL)
    return;
  pthread_mutex_lock(&t->lock);
  t->stopping = 1;
  pthread_cond_signal(&t->cond);
  pthread_mutex_unlock(&t->lock);
  pthread_join(t->thread, NULL);
  pthread_cond_destroy(&t->cond);
  pthread_mutex_destroy(&t->lock);
  free(t);
}
