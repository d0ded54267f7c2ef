/* Striped condition variables that wake requests waiting on a key. */
#include "waitset.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "idem/error.h"

#define STRIPES 64

struct stripe {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  uint64_t gen;
};

struct idem__waitset {
  struct stripe s[STRIPES];
};

/* FNV-1a over the scope; only spreads keys across stripes. */
static struct stripe *stripe_of(idem__waitset_t *ws, const idem_scope_t *sc) {
  uint64_t h = 1469598103934665603ULL;
  const unsigned char *p;
  for (int i = 0; i < 8; i++) {
    h ^= (uint64_t)((sc->tenant_id >> (8 * i)) & 0xff);
    h *= 1099511628211ULL;
  }
  for (p = (const unsigned char *)sc->operation; p && *p; p++) {
    h ^= *p;
    h *= 1099511628211ULL;
  }
  for (p = (const unsigned char *)sc->key; p && *p; p++) {
    h ^= *p;
    h *= 1099511628211ULL;
  }
  return &ws->s[h % STRIPES];
}

idem__waitset_t *idem__waitset_new(void) {
  idem__waitset_t *ws = calloc(1, sizeof *ws);
  pthread_condattr_t attr;
  if (ws == NULL)
    return NULL;
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  for (int i = 0; i < STRIPES; i++) {
    pthread_mutex_init(&ws->s[i].lock, NULL);
    pthread_cond_init(&ws->s[i].cond, &attr);
  }
  pthread_condattr_destroy(&attr);
  return ws;
}

void idem__waitset_free(idem__waitset_t *ws) {
  if (ws == NULL)
    return;
  for (int i = 0; i < STRIPES; i++) {
    pthread_mutex_destroy(&ws->s[i].lock);
    pthread_cond_destroy(&ws->s[i].cond);
  }
  free(ws);
}

uint64_t idem__waitset_ticket(idem__waitset_t *ws, const idem_scope_t *scope) {
  struct stripe *st = stripe_of(ws, scope);
  uint64_t gen;
  pthread_mutex_lock(&st->lock);
  gen = st->gen;
  pthread_mutex_unlock(&st->lock);
  return gen;
}

int idem__waitset_wait(idem__waitset_t *ws, const idem_scope_t *scope,
                       uint64_t ticket, int64_t timeout_ms) {
  struct stripe *st = stripe_of(ws, scope);
  struct timespec deadline;
  int rc = 0;

  if (timeout_ms < 0)
    timeout_ms = 0;
  clock_gettime(CLOCK_MONOTONIC, &deadline);
  deadline.tv_sec += timeout_ms / 1000;
  deadline.tv_nsec += (timeout_ms % 1000) * 1000000L;
  if (deadline.tv_nsec >= 1000000000L) {
    deadline.tv_sec++;
    deadline.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&st->lock);
  while (st->gen == ticket && rc != ETIMEDOUT)
    rc = pthread_cond_timedwait(&st->cond, &st->lock, &deadline);
  rc = st->gen != ticket ? IDEM_OK : IDEM_ETIMEDOUT;
  pthread_mutex_unlock(&st->lock);
  return rc;
}

void idem__waitset_wake(idem__waitset_t *ws, const idem_scope_t *scope) {
  struct stripe *st = stripe_of(ws, scope);
  pthread_mutex_lock(&st->lock);
  st->gen++;
  pthread_cond_broadcast(&st->cond);
  pthread_mutex_unlock(&st->lock);
}

void idem__waitset_wake_all(idem__waitset_t *ws) {
  for (int i = 0; i < STRIPES; i++) {
    pthread_mutex_lock(&ws->s[i].lock);
    ws->s[i].gen++;
    pthread_cond_broadcast(&ws->s[i].cond);
    pthread_mutex_unlock(&ws->s[i].lock);
  }
}
