/* The connection guard (see guard.h). */
#include "server/guard.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/socket.h>

#include "idem/clock.h"
#include "util/ticker.h"

struct tracked {
  int fd;
  int64_t since_ms; /* when the current request may have started */
  int busy;         /* answering: exempt from the deadline */
  int over_limit;
  int cut;
  struct tracked *prev, *next;
};

struct idemd_guard {
  int64_t timeout_ms;
  int max;
  pthread_mutex_t lock; /* the list and the fields of its entries */
  struct tracked *head;
  int count;
  idem__ticker_t *watchdog;
  atomic_uint_fast64_t cut;
  atomic_uint_fast64_t refused;
};

/* Cuts connections whose request has not arrived by the deadline. The
 * socket is only shut down, not closed: libmicrohttpd sees the error and
 * closes it itself, and the entry is removed (under the same lock) before
 * the descriptor can be reused. */
static void watch(void *arg) {
  idemd_guard_t *g = arg;
  int64_t now = idem_mono_ms();
  pthread_mutex_lock(&g->lock);
  for (struct tracked *t = g->head; t; t = t->next) {
    if (!t->busy && !t->cut && now - t->since_ms > g->timeout_ms) {
      shutdown(t->fd, SHUT_RDWR);
      t->cut = 1;
      atomic_fetch_add(&g->cut, 1);
    }
  }
  pthread_mutex_unlock(&g->lock);
}

idemd_guard_t *idemd_guard_new(int64_t request_timeout_ms, int max_connections) {
  idemd_guard_t *g = calloc(1, sizeof *g);
  if (g == NULL)
    return NULL;
  g->timeout_ms = request_timeout_ms;
  g->max = max_connections;
  pthread_mutex_init(&g->lock, NULL);
  /* Check a few times per deadline, so a cut comes at most ~1/4 late. */
  int64_t every = request_timeout_ms / 4 > 1000 ? 1000 : request_timeout_ms / 4;
  if ((g->watchdog = idem__ticker_start(every > 10 ? every : 10, watch, g)) == NULL) {
    pthread_mutex_destroy(&g->lock);
    free(g);
    return NULL;
  }
  return g;
}

void idemd_guard_free(idemd_guard_t *g) {
  if (g == NULL)
    return;
  idem__ticker_stop(g->watchdog);
  while (g->head) {
    struct tracked *t = g->head;
    g->head = t->next;
    free(t);
  }
  pthread_mutex_destroy(&g->lock);
  free(g);
}

void idemd_guard_notify(void *cls, struct MHD_Connection *c, void **socket_context,
                        enum MHD_ConnectionNotificationCode code) {
  idemd_guard_t *g = cls;
  struct tracked *t;

  if (code == MHD_CONNECTION_NOTIFY_STARTED) {
    const union MHD_ConnectionInfo *info =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if ((t = calloc(1, sizeof *t)) == NULL)
      return; /* untracked: served, just without the deadline */
    t->fd = info ? info->connect_fd : -1;
    t->since_ms = idem_mono_ms();
    pthread_mutex_lock(&g->lock);
    t->over_limit = ++g->count > g->max;
    t->next = g->head;
    if (g->head)
      g->head->prev = t;
    g->head = t;
    pthread_mutex_unlock(&g->lock);
    *socket_context = t;
    return;
  }
  if ((t = *socket_context) == NULL)
    return;
  pthread_mutex_lock(&g->lock);
  g->count--;
  if (t->prev)
    t->prev->next = t->next;
  else
    g->head = t->next;
  if (t->next)
    t->next->prev = t->prev;
  pthread_mutex_unlock(&g->lock);
  free(t);
  *socket_context = NULL;
}

void *idemd_guard_of(struct MHD_Connection *c) {
  const union MHD_ConnectionInfo *info =
      MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
  return info ? info->socket_context : NULL;
}

int idemd_guard_over_limit(void *conn) {
  struct tracked *t = conn;
  return t != NULL && t->over_limit;
}

void idemd_guard_busy(idemd_guard_t *g, void *conn, int busy) {
  struct tracked *t = conn;
  if (g == NULL || t == NULL)
    return;
  pthread_mutex_lock(&g->lock);
  t->busy = busy;
  if (!busy)
    t->since_ms = idem_mono_ms();
  pthread_mutex_unlock(&g->lock);
}

uint64_t idemd_guard_cut(const idemd_guard_t *g) {
  return atomic_load(&((idemd_guard_t *)g)->cut);
}

uint64_t idemd_guard_refused(const idemd_guard_t *g) {
  return atomic_load(&((idemd_guard_t *)g)->refused);
}

void idemd_guard_count_refusal(idemd_guard_t *g) { atomic_fetch_add(&g->refused, 1); }
