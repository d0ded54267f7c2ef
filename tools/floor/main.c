/* idem-floor: what idemd's design costs on this machine before idemd does
 * any work of its own, so that bench/run.sh can say how much of the HTTP
 * ceiling (nginx) the design leaves and how much idemd's work takes.
 *
 * libmicrohttpd is set up as idemd sets it up (one event thread, epoll,
 * suspend and resume) and answers every POST with a fixed 201 the size of
 * a payment's. With --commits N, a request is first suspended and handed to
 * one writer thread that, as the SQLite store's writer does, takes every
 * request waiting, appends --commit-bytes to --file and fdatasyncs it, and
 * does so N times per request (a payment: its reservation's commit, then
 * its completion's), before the event thread answers it. --work-us U adds U
 * microseconds of the writer's CPU per request per commit, standing in for
 * the store's statements, and --event-work-us E adds E microseconds of the
 * event thread's per request, standing in for parsing, validation and the
 * fingerprint: together they size how much of idemd's own work a target
 * leaves room for. No database, no parsing, no fingerprint.
 *
 * Exit status: 0 after SIGTERM or SIGINT, 1 when it cannot start, 2 for bad
 * usage. Listens on 127.0.0.1 only; prints "listening on 127.0.0.1:PORT". */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The size and shape of idemd's answer to a new payment. */
static const char answer[] =
    "{\"id\":\"pay_01k8q6d3299f2nikphme47a4\",\"amount\":15990,\"currency\":\"BRL\","
    "\"order_id\":null,\"status\":\"succeeded\",\"created_at\":\"2026-12-02T01:37:45Z\"}";

/* The WAL starts again from its beginning after each checkpoint (1,000
 * pages by default): the file is rewritten in place within this size. */
#define FLOOR_FILE_WRAP (4096L * 1000)
#define FLOOR_MAX_COMMIT_BYTES (1L << 20)

typedef struct floor_req {
  struct MHD_Connection *conn;
  int commits_done;       /* written by the writer, read after the resume */
  bool answered_at_once;  /* the writer had stopped: answered without it */
  struct floor_req *next;
} floor_req_t;

typedef struct floor {
  int commits;
  long commit_bytes;
  long work_us;
  long event_work_us;
  int fd;
  char *page;
  off_t offset;
  pthread_mutex_t mu; /* guards the queue, stopping and closed */
  pthread_cond_t cv;
  floor_req_t *head, *tail;
  bool stopping; /* a signal came: finish what is queued, then close */
  bool closed;   /* the writer has gone; requests are answered at once */
  atomic_int open_requests; /* begun and not yet completed */
} floor_t;

static void usage(void) {
  fprintf(stderr, "usage: idem-floor --port P [--commits N --file PATH] [--commit-bytes B]"
                  " [--work-us U] [--event-work-us E]\n");
}

static bool parse_long(const char *s, long min, long max, long *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno != 0 || end == s || *end != '\0' || v < min || v > max) return false;
  *out = v;
  return true;
}

/* Spends us microseconds of this thread's CPU. */
static void work(long us) {
  struct timespec a, b;
  if (us <= 0 || clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a) != 0) return;
  do {
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b) != 0) return;
  } while ((b.tv_sec - a.tv_sec) * 1000000L + (b.tv_nsec - a.tv_nsec) / 1000 < us);
}

/* Puts r at the end of the writer's queue; f->mu held. */
static void append(floor_t *f, floor_req_t *r) {
  r->next = NULL;
  if (f->tail) f->tail->next = r;
  else f->head = r;
  f->tail = r;
}

/* Queues r for the writer. False when the writer has gone (stopping). */
static bool enqueue(floor_t *f, floor_req_t *r) {
  bool ok;
  pthread_mutex_lock(&f->mu);
  ok = !f->closed;
  if (ok) {
    append(f, r);
    pthread_cond_signal(&f->cv);
  }
  pthread_mutex_unlock(&f->mu);
  return ok;
}

/* One commit: the batch's bytes appended (in place past the wrap) and
 * synced. False on a write or sync error. */
static bool commit(floor_t *f) {
  if (f->offset + f->commit_bytes > FLOOR_FILE_WRAP) f->offset = 0;
  for (long done = 0; done < f->commit_bytes;) {
    ssize_t n = pwrite(f->fd, f->page + done, (size_t)(f->commit_bytes - done), f->offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += n;
  }
  f->offset += f->commit_bytes;
  return fdatasync(f->fd) == 0;
}

static void *writer_main(void *arg) {
  floor_t *f = arg;
  for (;;) {
    pthread_mutex_lock(&f->mu);
    while (f->head == NULL && !f->stopping) pthread_cond_wait(&f->cv, &f->mu);
    floor_req_t *batch = f->head;
    f->head = f->tail = NULL;
    if (batch == NULL) { /* stopping, and nothing left */
      f->closed = true;
      pthread_mutex_unlock(&f->mu);
      return NULL;
    }
    pthread_mutex_unlock(&f->mu);

    for (floor_req_t *r = batch; r; r = r->next) work(f->work_us);
    if (!commit(f)) {
      perror("idem-floor: write");
      exit(1);
    }
    while (batch) {
      floor_req_t *r = batch;
      batch = r->next;
      if (++r->commits_done < f->commits) {
        /* Its next commit: the one after this (as a payment's completion
         * joins the commit after its reservation's). */
        pthread_mutex_lock(&f->mu);
        append(f, r);
        pthread_mutex_unlock(&f->mu);
      } else {
        MHD_resume_connection(r->conn);
      }
    }
  }
}

static enum MHD_Result reply(struct MHD_Connection *conn, unsigned int status, const char *body,
                             size_t len) {
  struct MHD_Response *resp =
      MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_PERSISTENT);
  if (resp == NULL) return MHD_NO;
  enum MHD_Result ret = MHD_add_response_header(resp, "Content-Type", "application/json");
  if (ret == MHD_YES && status == 201)
    ret = MHD_add_response_header(resp, "Location", "/payments/pay_01k8q6d3299f2nikphme47a4");
  if (ret == MHD_YES) ret = MHD_add_response_header(resp, "X-Request-Id", "req_gvfg3mo2qlrbk904gquf");
  if (ret == MHD_YES) ret = MHD_queue_response(conn, status, resp);
  MHD_destroy_response(resp);
  return ret;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **ctx) {
  floor_t *f = cls;
  floor_req_t *r = *ctx;
  (void)url;
  (void)version;
  (void)upload;
  if (strcmp(method, "POST") != 0) {
    static const char ok[] = "{\"status\":\"ok\"}";
    return reply(conn, 200, ok, sizeof ok - 1);
  }
  if (r == NULL) {
    if ((r = calloc(1, sizeof *r)) == NULL) return MHD_NO;
    r->conn = conn;
    *ctx = r;
    atomic_fetch_add(&f->open_requests, 1);
    work(f->event_work_us);
    return MHD_YES;
  }
  if (*upload_size > 0) { /* the body is not read: only its cost counts */
    *upload_size = 0;
    return MHD_YES;
  }
  if (f->commits > 0 && r->commits_done == 0 && !r->answered_at_once) {
    MHD_suspend_connection(conn);
    if (enqueue(f, r)) return MHD_YES;
    MHD_resume_connection(conn);
    r->answered_at_once = true;
    return MHD_YES; /* called again once resumed */
  }
  return reply(conn, 201, answer, sizeof answer - 1);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **ctx,
                         enum MHD_RequestTerminationCode toe) {
  floor_t *f = cls;
  (void)conn;
  (void)toe;
  if (*ctx != NULL)
    atomic_fetch_sub(&f->open_requests, 1);
  free(*ctx);
  *ctx = NULL;
}

int main(int argc, char **argv) {
  floor_t f = {.commits = 0, .commit_bytes = 81920, .work_us = 0, .fd = -1};
  long port = -1;
  const char *file = NULL;
  for (int i = 1; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    long n;
    bool ok = v != NULL;
    if (ok && strcmp(argv[i], "--port") == 0) ok = parse_long(v, 0, 65535, &port);
    else if (ok && strcmp(argv[i], "--commits") == 0) {
      ok = parse_long(v, 0, 16, &n);
      f.commits = (int)n;
    } else if (ok && strcmp(argv[i], "--commit-bytes") == 0)
      ok = parse_long(v, 1, FLOOR_MAX_COMMIT_BYTES, &f.commit_bytes);
    else if (ok && strcmp(argv[i], "--work-us") == 0) ok = parse_long(v, 0, 1000000, &f.work_us);
    else if (ok && strcmp(argv[i], "--event-work-us") == 0)
      ok = parse_long(v, 0, 1000000, &f.event_work_us);
    else if (ok && strcmp(argv[i], "--file") == 0) file = v;
    else ok = false;
    if (!ok) {
      usage();
      return 2;
    }
    i++;
  }
  if (port < 0 || (f.commits > 0 && file == NULL)) {
    usage();
    return 2;
  }

  /* Signals are taken by sigwait() below; every thread inherits the mask. */
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, NULL);

  pthread_mutex_init(&f.mu, NULL);
  pthread_cond_init(&f.cv, NULL);
  pthread_t writer;
  if (f.commits > 0) {
    f.fd = open(file, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    f.page = calloc(1, (size_t)f.commit_bytes);
    if (f.fd < 0 || f.page == NULL) {
      fprintf(stderr, "idem-floor: cannot open %s\n", file);
      return 1;
    }
    if (pthread_create(&writer, NULL, writer_main, &f) != 0) {
      fprintf(stderr, "idem-floor: cannot start the writer\n");
      return 1;
    }
    pthread_setname_np(writer, "idem-writer");
  }

  struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  struct MHD_Daemon *d = MHD_start_daemon(
      MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_USE_ITC | MHD_ALLOW_SUSPEND_RESUME, 0,
      NULL, NULL, on_request, &f, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&addr,
      MHD_OPTION_THREAD_POOL_SIZE, 1u, MHD_OPTION_NOTIFY_COMPLETED, on_completed, &f,
      MHD_OPTION_CONNECTION_TIMEOUT, 30u,
      /* idemd's: --max-header-bytes (8 KiB) plus 2 KiB for the answer. */
      MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)(8192 + 2048),
      MHD_OPTION_END);
  if (d == NULL) {
    fprintf(stderr, "idem-floor: cannot listen on 127.0.0.1:%ld\n", port);
    return 1;
  }
  const union MHD_DaemonInfo *info = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
  printf("listening on 127.0.0.1:%u\n", info ? (unsigned)info->port : (unsigned)port);
  fflush(stdout);

  int sig;
  sigwait(&sigs, &sig);
  /* Stop taking connections, let the writer finish what is queued (a
   * request may not stay suspended when the daemon stops), then stop. */
  /* Closed only once the daemon has stopped: its event thread may still be
   * taking the socket out of its epoll set (a race ThreadSanitizer saw). */
  MHD_socket lfd = MHD_quiesce_daemon(d);
  if (f.commits > 0) {
    pthread_mutex_lock(&f.mu);
    f.stopping = true;
    pthread_cond_signal(&f.cv);
    pthread_mutex_unlock(&f.mu);
    pthread_join(writer, NULL);
  }
  /* The requests the writer resumed are answered by the event thread:
   * stopping the daemon now would close their connections first. */
  for (int waited = 0; atomic_load(&f.open_requests) > 0 && waited < 5000; waited++)
    usleep(1000);
  MHD_stop_daemon(d);
  if (lfd != MHD_INVALID_SOCKET)
    close(lfd);
  if (f.fd >= 0) {
    close(f.fd);
    unlink(file);
  }
  free(f.page);
  pthread_cond_destroy(&f.cv);
  pthread_mutex_destroy(&f.mu);
  return 0;
}
