/* A small webhook receiver for tests: an HTTP/1.1 server on 127.0.0.1
 * and a port of its own, in one thread, that records each POST it gets
 * (its body and Idem-Psp-Signature) and answers as the test told it. One
 * request per connection (it answers with Connection: close). */
#ifndef IDEM_TEST_HOOK_RECEIVER_H
#define IDEM_TEST_HOOK_RECEIVER_H

#include <pthread.h>
#include <stddef.h>

#define HOOK_MAX_DELIVERIES 256

typedef struct hook_delivery {
  char *body;          /* NUL-terminated */
  char signature[256]; /* the Idem-Psp-Signature value, "" when absent */
  char path[128];
  long status; /* what the receiver answered; 0: nothing (hang) */
} hook_delivery_t;

typedef struct hook_receiver {
  int port;
  /* Set before hook_receiver_start(): */
  int fail_first; /* answer 500 to this many deliveries, then 200 */
  int hang;       /* read each request and never answer (until stopped) */
  /* Private: */
  int fd;
  int stop;
  pthread_t thread;
  pthread_mutex_t lock;
  int n;
  hook_delivery_t got[HOOK_MAX_DELIVERIES];
} hook_receiver_t;

/* Binds 127.0.0.1 on a free port (rx->port) and starts serving. Returns 0,
 * or -1 when the socket or the thread cannot be had. */
int hook_receiver_start(hook_receiver_t *rx);
/* Waits up to `timeout_s` until `n` deliveries are recorded; returns how
 * many there are then. */
int hook_receiver_wait(hook_receiver_t *rx, int n, double timeout_s);
/* A copy of delivery `i` (0 <= i < count); free its body with free(). */
hook_delivery_t hook_receiver_get(hook_receiver_t *rx, int i);
/* Stops the thread, closes the socket and frees what was recorded. */
void hook_receiver_stop(hook_receiver_t *rx);

#endif
