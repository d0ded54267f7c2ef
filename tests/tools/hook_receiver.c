/* The test webhook receiver (hook_receiver.h): accept, read one request,
 * record it, answer, close. Every wait is a poll of at most 100 ms that
 * looks at `stop`, so stopping never waits on a client. */
#define _GNU_SOURCE
#include "hook_receiver.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define HEAD_MAX (16 * 1024)
#define BODY_MAX (64 * 1024)
#define CONN_TIMEOUT_S 5.0

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int stopping(hook_receiver_t *rx) {
  int s;
  pthread_mutex_lock(&rx->lock);
  s = rx->stop;
  pthread_mutex_unlock(&rx->lock);
  return s;
}

/* Waits for `fd` to be readable: 1, or 0 when stopping or past `deadline`. */
static int readable(hook_receiver_t *rx, int fd, double deadline) {
  while (!stopping(rx) && now_s() < deadline) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 100) > 0)
      return 1;
  }
  return 0;
}

/* The value of header `name` in the head `h` (case-insensitive), copied
 * into `out` ("" when absent). */
static void header_value(const char *h, const char *name, char *out, size_t outlen) {
  size_t n = strlen(name);
  out[0] = '\0';
  for (const char *line = strstr(h, "\r\n"); line && line[2];
       line = strstr(line + 2, "\r\n")) {
    const char *l = line + 2;
    if (strncasecmp(l, name, n) == 0 && l[n] == ':') {
      const char *v = l + n + 1;
      while (*v == ' ')
        v++;
      snprintf(out, outlen, "%.*s", (int)strcspn(v, "\r\n"), v);
      return;
    }
  }
}

/* Reads one request from `fd` into `d` (body malloc'd); 0 or -1. */
static int read_request(hook_receiver_t *rx, int fd, hook_delivery_t *d) {
  char *buf = malloc(HEAD_MAX + BODY_MAX + 1), *end = NULL, clen[24];
  size_t len = 0, head, want;
  double deadline = now_s() + CONN_TIMEOUT_S;

  if (buf == NULL)
    return -1;
  while (end == NULL) {
    ssize_t got;
    if (len >= HEAD_MAX || !readable(rx, fd, deadline))
      goto fail;
    if ((got = read(fd, buf + len, HEAD_MAX - len)) <= 0)
      goto fail;
    len += (size_t)got;
    buf[len] = '\0';
    end = strstr(buf, "\r\n\r\n");
  }
  head = (size_t)(end - buf) + 4;
  buf[head - 2] = '\0'; /* the head ends at its last \r\n */
  header_value(buf, "Content-Length", clen, sizeof clen);
  header_value(buf, "Idem-Psp-Signature", d->signature, sizeof d->signature);
  snprintf(d->path, sizeof d->path, "%.*s", (int)strcspn(buf, "\r\n"), buf);
  want = (size_t)strtoul(clen, NULL, 10);
  if (want > BODY_MAX)
    goto fail;
  while (len < head + want) {
    ssize_t got;
    if (!readable(rx, fd, deadline))
      goto fail;
    if ((got = read(fd, buf + len, head + want - len)) <= 0)
      goto fail;
    len += (size_t)got;
  }
  if ((d->body = malloc(want + 1)) == NULL)
    goto fail;
  memcpy(d->body, buf + head, want);
  d->body[want] = '\0';
  free(buf);
  return 0;
fail:
  free(buf);
  return -1;
}

static void answer(int fd, long status) {
  char text[128];
  int n = snprintf(text, sizeof text,
                   "HTTP/1.1 %ld %s\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                   status, status == 200 ? "OK" : "Internal Server Error");
  (void)!write(fd, text, (size_t)n);
}

static void serve(hook_receiver_t *rx, int fd) {
  hook_delivery_t d = {0};
  long status;

  if (read_request(rx, fd, &d) != 0)
    return;
  pthread_mutex_lock(&rx->lock);
  status = rx->hang ? 0 : rx->n < rx->fail_first ? 500 : 200;
  d.status = status;
  if (rx->n < HOOK_MAX_DELIVERIES)
    rx->got[rx->n++] = d;
  else
    free(d.body);
  pthread_mutex_unlock(&rx->lock);
  if (status)
    answer(fd, status);
  else
    while (!stopping(rx))
      (void)readable(rx, fd, now_s() + 0.1);
}

static void *receiver_main(void *arg) {
  hook_receiver_t *rx = arg;
  while (!stopping(rx)) {
    int fd;
    if (!readable(rx, rx->fd, now_s() + 0.1))
      continue;
    fd = accept4(rx->fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0)
      continue;
    serve(rx, fd);
    close(fd);
  }
  return NULL;
}

int hook_receiver_start(hook_receiver_t *rx) {
  struct sockaddr_in a = {.sin_family = AF_INET};
  socklen_t alen = sizeof a;

  rx->n = 0;
  rx->stop = 0;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  rx->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (rx->fd < 0)
    return -1;
  if (bind(rx->fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(rx->fd, 64) != 0 ||
      getsockname(rx->fd, (struct sockaddr *)&a, &alen) != 0) {
    close(rx->fd);
    return -1;
  }
  rx->port = ntohs(a.sin_port);
  pthread_mutex_init(&rx->lock, NULL);
  if (pthread_create(&rx->thread, NULL, receiver_main, rx) != 0) {
    pthread_mutex_destroy(&rx->lock);
    close(rx->fd);
    return -1;
  }
  return 0;
}

int hook_receiver_wait(hook_receiver_t *rx, int n, double timeout_s) {
  double deadline = now_s() + timeout_s;
  struct timespec nap = {0, 10 * 1000000L};
  int have;
  for (;;) {
    pthread_mutex_lock(&rx->lock);
    have = rx->n;
    pthread_mutex_unlock(&rx->lock);
    if (have >= n || now_s() > deadline)
      return have;
    nanosleep(&nap, NULL);
  }
}

hook_delivery_t hook_receiver_get(hook_receiver_t *rx, int i) {
  hook_delivery_t d;
  pthread_mutex_lock(&rx->lock);
  d = rx->got[i];
  d.body = strdup(d.body ? d.body : "");
  pthread_mutex_unlock(&rx->lock);
  return d;
}

void hook_receiver_stop(hook_receiver_t *rx) {
  pthread_mutex_lock(&rx->lock);
  rx->stop = 1;
  pthread_mutex_unlock(&rx->lock);
  pthread_join(rx->thread, NULL);
  close(rx->fd);
  for (int i = 0; i < rx->n; i++)
    free(rx->got[i].body);
  rx->n = 0;
  pthread_mutex_destroy(&rx->lock);
}
