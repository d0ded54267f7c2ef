/* Striped condition variables that wake requests waiting on a key. */
#include "waitset.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "idem/error.h"

void idem__deadline_after(int64_t ms, struct timespec *out) {
  clock_gettime(CLOCK_MONOTONIC, out);
  out->tv_sec += ms / 1000;
  out->tv_nsec += (ms % 1000) * 1000000L;
  if (out->tv_nsec >= 1000000000L) {
    out->tv_sec++;
    out->tv_nsec -= 1000000000L;
  }
}

#define STRIPES 64

struct stripe {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  uint64_t gen;
  idem_store_waiter_t *parked; /* all wait for the next generation */
};

struct idem__waitset {
  struct stripe s[STRIPES];
};

/* FNV-1a over the scope: picks its stripe, and tells parked waiters of
 * different keys on one stripe apart. */
static uint64_t hash_of(const idem_scope_t *sc) {
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
  return h;
}

static struct stripe *stripe_of(idem__waitset_t *ws, const idem_scope_t *sc) {
  return &ws->s[hash_of(sc) % STRIPES];
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
  idem__deadline_after(timeout_ms, &deadline);
  pthread_mutex_lock(&st->lock);
  while (st->gen == ticket && rc != ETIMEDOUT)
    rc = pthread_cond_timedwait(&st->cond, &st->lock, &deadline);
  rc = st->gen != ticket ? IDEM_OK : IDEM_ETIMEDOUT;
  pthread_mutex_unlock(&st->lock);
  return rc;
}

int idem__waitset_park(idem__waitset_t *ws, const idem_scope_t *scope,
                       uint64_t ticket, idem_store_waiter_t *w) {
  struct stripe *st = stripe_of(ws, scope);
  int moved;
  w->hash = hash_of(scope);
  pthread_mutex_lock(&st->lock);
  moved = st->gen != ticket;
  if (!moved) {
    w->next = st->parked;
    st->parked = w;
  }
  pthread_mutex_unlock(&st->lock);
  return moved;
}

/* Calls each waiter of a detached list (no lock held: a wake-up may park
 * again, or free the waiter). */
static int wake_list(idem_store_waiter_t *w, int timed_out) {
  int n = 0;
  while (w) {
    idem_store_waiter_t *next = w->next;
    w->next = NULL;
    w->wake(w, timed_out);
    w = next;
    n++;
  }
  return n;
}

int idem__waitset_expire(idem__waitset_t *ws, int64_t now_ms) {
  int n = 0;
  for (int i = 0; i < STRIPES; i++) {
    struct stripe *st = &ws->s[i];
    idem_store_waiter_t *due = NULL, **pp;
    pthread_mutex_lock(&st->lock);
    for (pp = &st->parked; *pp;) {
      idem_store_waiter_t *w = *pp;
      if (w->deadline_ms <= now_ms) {
        *pp = w->next;
        w->next = due;
        due = w;
      } else {
        pp = &w->next;
      }
    }
    pthread_mutex_unlock(&st->lock);
    n += wake_list(due, 1);
  }
  return n;
}

void idem__waitset_wake(idem__waitset_t *ws, const idem_scope_t *scope) {
  uint64_t h = hash_of(scope);
  struct stripe *st = &ws->s[h % STRIPES];
  idem_store_waiter_t *woken = NULL, **pp;
  pthread_mutex_lock(&st->lock);
  st->gen++;
  /* Parked waiters of other keys on this stripe stay parked: each would
   * otherwise run its whole request again for nothing. */
  for (pp = &st->parked; *pp;) {
    idem_store_waiter_t *w = *pp;
    if (w->hash == h) {
      *pp = w->next;
      w->next = woken;
      woken = w;
    } else {
      pp = &w->next;
    }
  }
  pthread_cond_broadcast(&st->cond);
  pthread_mutex_unlock(&st->lock);
  wake_list(woken, 0);
}

void idem__waitset_wake_all(idem__waitset_t *ws) {
  for (int i = 0; i < STRIPES; i++) {
    idem_store_waiter_t *parked;
    pthread_mutex_lock(&ws->s[i].lock);
    ws->s[i].gen++;
    parked = ws->s[i].parked;
    ws->s[i].parked = NULL;
    pthread_cond_broadcast(&ws->s[i].cond);
    pthread_mutex_unlock(&ws->s[i].lock);
    wake_list(parked, 0);
  }
}
