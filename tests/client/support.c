/* The client tests' fake server, proxy and process runner (support.h). */
#define _GNU_SOURCE
#include "support.h"

#include <arpa/inet.h>
#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sqlite3.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define REQ_MAX (64 * 1024)
#define RESP_MAX (1024 * 1024)
#define OUT_MAX (1024 * 1024)
#define IO_TIMEOUT_S 30
#define ACCEPT_POLL_MS 50
#define START_TIMEOUT_S 30.0
#define STOP_TIMEOUT_S 20.0
#define START_TRIES 3

const char *ct_cli_path(void) {
  return getenv("IDEM_TEST_CLI");
}

const char *ct_idemd_path(void) {
  return getenv("IDEM_TEST_IDEMD");
}

const char *ct_psp_path(void) {
  return getenv("IDEM_TEST_PSP");
}

double ct_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

void ct_nap_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
}

static int listen_loopback(int port, int *bound) {
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  socklen_t len = sizeof a;
  int one = 1;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -1;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 64) != 0 ||
      getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
    close(fd);
    return -1;
  }
  *bound = ntohs(a.sin_port);
  return fd;
}

int ct_free_port(void) {
  int port = -1;
  int fd = listen_loopback(0, &port);
  if (fd >= 0)
    close(fd);
  return port;
}

char *ct_tempdir(void) {
  char *dir = strdup("/tmp/idem-client-test-XXXXXX");
  if (dir == NULL || mkdtemp(dir) == NULL)
    fail_msg("cannot create a temp dir: %s", strerror(errno));
  return dir;
}

static int rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st;
  (void)flag;
  (void)ftw;
  return remove(path);
}

void ct_rmdir(char *dir) {
  if (dir == NULL)
    return;
  if (getenv("IDEM_TEST_KEEP") == NULL)
    nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
  else
    fprintf(stderr, "kept %s\n", dir);
  free(dir);
}

/* ---- sockets ---------------------------------------------------------- */

static void io_timeout(int fd) {
  struct timeval tv = {IO_TIMEOUT_S, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

static int send_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

/* The value of header `name` in the head `req` (up to the blank line), or
 * "" when absent. Returns 1 when present. */
static int header_value(const char *req, const char *name, char *out, size_t cap) {
  size_t n = strlen(name);
  const char *end = strstr(req, "\r\n\r\n");
  const char *line = strstr(req, "\r\n");

  out[0] = '\0';
  while (line != NULL && end != NULL && line < end) {
    const char *next;
    line += 2;
    next = strstr(line, "\r\n");
    if (next == NULL)
      break;
    if ((size_t)(next - line) > n && strncasecmp(line, name, n) == 0 && line[n] == ':') {
      const char *v = line + n + 1;
      size_t len;
      while (*v == ' ' || *v == '\t')
        v++;
      len = (size_t)(next - v);
      if (len >= cap)
        len = cap - 1;
      memcpy(out, v, len);
      out[len] = '\0';
      return 1;
    }
    line = next;
  }
  return 0;
}

/* Reads one whole request (head and Content-Length body) into buf
 * (NUL-terminated). Returns its length, or -1. */
static ssize_t read_request(int fd, char *buf, size_t cap) {
  size_t len = 0, need = 0;
  char cl[32];

  for (;;) {
    ssize_t r;
    char *head_end;
    if (len + 1 >= cap)
      return -1;
    r = recv(fd, buf + len, cap - 1 - len, 0);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      return -1;
    len += (size_t)r;
    buf[len] = '\0';
    if (need == 0 && (head_end = strstr(buf, "\r\n\r\n")) != NULL) {
      need = (size_t)(head_end - buf) + 4;
      if (header_value(buf, "Content-Length", cl, sizeof cl))
        need += strtoul(cl, NULL, 10);
    }
    if (need > 0 && len >= need)
      return (ssize_t)len;
  }
}

static void record(ct_seen_t *s, const char *req, size_t len) {
  const char *sp = strchr(req, ' ');
  const char *sp2 = sp ? strchr(sp + 1, ' ') : NULL;
  const char *body = strstr(req, "\r\n\r\n");

  memset(s, 0, sizeof *s);
  s->at = ct_now();
  if (sp && sp2) {
    snprintf(s->method, sizeof s->method, "%.*s", (int)(sp - req), req);
    snprintf(s->path, sizeof s->path, "%.*s", (int)(sp2 - sp - 1), sp + 1);
  }
  s->has_key = header_value(req, "Idempotency-Key", s->key, sizeof s->key);
  header_value(req, "Authorization", s->auth, sizeof s->auth);
  header_value(req, "Content-Type", s->content_type, sizeof s->content_type);
  if (body) {
    size_t head = (size_t)(body - req) + 4;
    snprintf(s->head, sizeof s->head, "%.*s", (int)head, req);
    s->body_len = len - head;
    memcpy(s->body, body + 4,
           s->body_len < sizeof s->body ? s->body_len : sizeof s->body - 1);
  }
}

int ct_header_count(const ct_seen_t *s, const char *name, char *out, size_t cap) {
  const char *line = strstr(s->head, "\r\n");
  size_t n = strlen(name);
  int count = 0;

  if (out && cap)
    out[0] = '\0';
  while (line != NULL) {
    const char *next;
    line += 2;
    next = strstr(line, "\r\n");
    if (next == NULL || next == line)
      break;
    if ((size_t)(next - line) > n && strncasecmp(line, name, n) == 0 && line[n] == ':') {
      const char *v = line + n + 1;
      while (*v == ' ' || *v == '\t')
        v++;
      if (count++ == 0 && out && cap)
        snprintf(out, cap, "%.*s", (int)(next - v), v);
    }
    line = next;
  }
  return count;
}

/* Waits for a connection on `lfd` while *stop is 0. Returns it or -1. */
static int accept_until(int lfd, atomic_int *stop) {
  while (!atomic_load(stop)) {
    struct pollfd pfd = {.fd = lfd, .events = POLLIN};
    int fd;
    if (poll(&pfd, 1, ACCEPT_POLL_MS) <= 0)
      continue;
    fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd >= 0) {
      io_timeout(fd);
      return fd;
    }
  }
  return -1;
}

/* What the fake and the proxy share: the listener, the thread, the log. */
typedef struct server_base {
  int lfd, port;
  pthread_t thread;
  atomic_int stop;
  pthread_mutex_t lock;
  ct_seen_t seen[CT_MAX_SEEN];
  int nseen; /* requests received, also past CT_MAX_SEEN */
} server_base_t;

static void base_start(server_base_t *b, void *(*fn)(void *), void *arg) {
  b->lfd = listen_loopback(0, &b->port);
  if (b->lfd < 0)
    fail_msg("cannot listen on 127.0.0.1: %s", strerror(errno));
  pthread_mutex_init(&b->lock, NULL);
  atomic_store(&b->stop, 0);
  if (pthread_create(&b->thread, NULL, fn, arg) != 0)
    fail_msg("cannot start a thread");
}

/* Logs the request; returns its index. */
static int base_record(server_base_t *b, const char *req, size_t len) {
  int i;
  pthread_mutex_lock(&b->lock);
  i = b->nseen++;
  if (i < CT_MAX_SEEN)
    record(&b->seen[i], req, len);
  pthread_mutex_unlock(&b->lock);
  return i;
}

static int base_seen(server_base_t *b, ct_seen_t *out) {
  int n;
  pthread_mutex_lock(&b->lock);
  n = b->nseen;
  memcpy(out, b->seen, sizeof b->seen);
  pthread_mutex_unlock(&b->lock);
  return n;
}

static void base_stop(server_base_t *b) {
  atomic_store(&b->stop, 1);
  pthread_join(b->thread, NULL);
  close(b->lfd);
  pthread_mutex_destroy(&b->lock);
}

/* Naps `ms` in slices, returning early when the server is stopped. */
static void nap_unless_stopped(server_base_t *b, int ms) {
  for (int waited = 0; waited < ms && !atomic_load(&b->stop); waited += 10)
    ct_nap_ms(10);
}

/* ---- the fake server ---------------------------------------------------- */

#define FAKE_MAX_CONNS 128

struct ct_fake {
  server_base_t base;
  const ct_reply_t *script;
  int n;
  pthread_t conns[FAKE_MAX_CONNS]; /* one thread per connection */
  int nconns;
};

struct fake_conn {
  ct_fake_t *f;
  int fd;
};

static const char *reason(int status) {
  switch (status) {
  case 200:
    return "OK";
  case 201:
    return "Created";
  case 202:
    return "Accepted";
  case 402:
    return "Payment Required";
  case 409:
    return "Conflict";
  case 422:
    return "Unprocessable Content";
  case 503:
    return "Service Unavailable";
  default:
    return "Status";
  }
}

static void fake_answer(ct_fake_t *f, int fd, int i) {
  static const ct_reply_t exhausted = {500, NULL, "{\"error\":\"script exhausted\"}", 0};
  const ct_reply_t *r = i < f->n ? &f->script[i] : &exhausted;
  const char *body = r->body ? r->body : "";
  char head[2048];
  int len;

  nap_unless_stopped(&f->base, r->delay_ms);
  if (r->status == 0)
    return; /* the caller closes without a word */
  len =
      snprintf(head, sizeof head,
               "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n"
               "Content-Length: %zu\r\nConnection: close\r\n%s\r\n",
               r->status, reason(r->status), strlen(body), r->headers ? r->headers : "");
  if (len > 0 && (size_t)len < sizeof head && send_all(fd, head, (size_t)len) == 0)
    send_all(fd, body, strlen(body));
}

/* One connection, one request, one scripted answer. A slow answer (delay)
 * does not hold up the next connection. */
static void *fake_conn_main(void *arg) {
  struct fake_conn *c = arg;
  char *buf = malloc(REQ_MAX);

  ssize_t len;

  if (buf != NULL && (len = read_request(c->fd, buf, REQ_MAX)) > 0)
    fake_answer(c->f, c->fd, base_record(&c->f->base, buf, (size_t)len));
  close(c->fd);
  free(buf);
  free(c);
  return NULL;
}

static void *fake_main(void *arg) {
  ct_fake_t *f = arg;
  int fd;

  while ((fd = accept_until(f->base.lfd, &f->base.stop)) >= 0) {
    struct fake_conn *c = malloc(sizeof *c);
    if (c == NULL || f->nconns >= FAKE_MAX_CONNS) {
      free(c);
      close(fd); /* over the bound: refused, the test will see it */
      continue;
    }
    *c = (struct fake_conn){f, fd};
    if (pthread_create(&f->conns[f->nconns], NULL, fake_conn_main, c) == 0)
      f->nconns++;
    else
      fake_conn_main(c);
  }
  return NULL;
}

ct_fake_t *ct_fake_start(const ct_reply_t *script, int n) {
  ct_fake_t *f = calloc(1, sizeof *f);
  if (f == NULL)
    fail_msg("out of memory");
  f->script = script;
  f->n = n;
  base_start(&f->base, fake_main, f);
  return f;
}

int ct_fake_port(const ct_fake_t *f) {
  return f->base.port;
}

int ct_fake_seen(ct_fake_t *f, ct_seen_t *out) {
  return base_seen(&f->base, out);
}

void ct_fake_stop(ct_fake_t *f) {
  if (f == NULL)
    return;
  atomic_store(&f->base.stop, 1);
  pthread_join(f->base.thread, NULL); /* no new connection threads after this */
  for (int i = 0; i < f->nconns; i++)
    pthread_join(f->conns[i], NULL);
  close(f->base.lfd);
  pthread_mutex_destroy(&f->base.lock);
  free(f);
}

/* ---- the proxy ------------------------------------------------------------ */

struct ct_proxy {
  server_base_t base;
  int upstream, drop_first;
};

static int connect_loopback(int port) {
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -1;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    close(fd);
    return -1;
  }
  io_timeout(fd);
  return fd;
}

/* Sends `req` upstream with Connection: close after the request line and
 * reads the whole answer into `resp`. Returns its length, or -1. */
static ssize_t forward(int port, const char *req, size_t len, char *resp, size_t cap) {
  static const char close_hdr[] = "Connection: close\r\n";
  const char *line_end = strstr(req, "\r\n");
  size_t n = 0;
  int fd;

  if (line_end == NULL || (fd = connect_loopback(port)) < 0)
    return -1;
  line_end += 2;
  if (send_all(fd, req, (size_t)(line_end - req)) != 0 ||
      send_all(fd, close_hdr, sizeof close_hdr - 1) != 0 ||
      send_all(fd, line_end, len - (size_t)(line_end - req)) != 0) {
    close(fd);
    return -1;
  }
  for (;;) {
    ssize_t r = recv(fd, resp + n, cap - n, 0);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0 || (n += (size_t)r) >= cap)
      break;
  }
  close(fd);
  return n > 0 ? (ssize_t)n : -1;
}

static void *proxy_main(void *arg) {
  ct_proxy_t *p = arg;
  char *req = malloc(REQ_MAX), *resp = malloc(RESP_MAX);
  int fd;

  while (req && resp && (fd = accept_until(p->base.lfd, &p->base.stop)) >= 0) {
    ssize_t len = read_request(fd, req, REQ_MAX);
    if (len > 0) {
      int i = base_record(&p->base, req, (size_t)len);
      ssize_t got = forward(p->upstream, req, (size_t)len, resp, RESP_MAX);
      /* The upstream did the work; the answer is lost on the way back. */
      if (got > 0 && i >= p->drop_first)
        send_all(fd, resp, (size_t)got);
    }
    close(fd);
  }
  free(req);
  free(resp);
  return NULL;
}

ct_proxy_t *ct_proxy_start(int upstream_port, int drop_first) {
  ct_proxy_t *p = calloc(1, sizeof *p);
  if (p == NULL)
    fail_msg("out of memory");
  p->upstream = upstream_port;
  p->drop_first = drop_first;
  base_start(&p->base, proxy_main, p);
  return p;
}

int ct_proxy_port(const ct_proxy_t *p) {
  return p->base.port;
}

int ct_proxy_seen(ct_proxy_t *p, ct_seen_t *out) {
  return base_seen(&p->base, out);
}

void ct_proxy_stop(ct_proxy_t *p) {
  if (p == NULL)
    return;
  base_stop(&p->base);
  free(p);
}

/* ---- child processes ----------------------------------------------------- */

/* environ minus IDEM_TOKEN and IDEM_PSP_*, plus `add`. */
static char **child_env(const char *const *add) {
  size_t n = 0, k = 0, nadd = 0;
  char **env;
  while (environ[n])
    n++;
  while (add && add[nadd])
    nadd++;
  if ((env = calloc(n + nadd + 1, sizeof *env)) == NULL)
    return NULL;
  for (size_t i = 0; i < n; i++)
    if (strncmp(environ[i], "IDEM_TOKEN=", 11) != 0 &&
        strncmp(environ[i], "IDEM_PSP_", 9) != 0)
      env[k++] = environ[i];
  for (size_t i = 0; i < nadd; i++)
    env[k++] = (char *)add[i];
  env[k] = NULL;
  return env;
}

/* fork + execve; the child's stdout and stderr go to out_fd and err_fd and
 * it dies with the test. Returns the pid or -1. */
static pid_t spawn(const char *const *argv, const char *const *env_add, int out_fd,
                   int err_fd, const char *stdin_path) {
  pid_t parent = getpid(), pid;
  char **env = child_env(env_add);

  if (env == NULL)
    return -1;
  pid = fork();
  if (pid == 0) {
    int devnull = open(stdin_path ? stdin_path : "/dev/null", O_RDONLY);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent)
      _exit(127);
    if (devnull >= 0)
      dup2(devnull, 0);
    dup2(out_fd, 1);
    dup2(err_fd, 2);
    execve(argv[0], (char *const *)argv, env);
    _exit(127);
  }
  free(env);
  return pid;
}

void ct_run_start(ct_run_t *r, const char *const *argv, const char *const *env_add) {
  ct_run_start_stdin(r, argv, env_add, NULL);
}

void ct_run_start_stdin(ct_run_t *r, const char *const *argv, const char *const *env_add,
                        const char *stdin_path) {
  int out[2], err[2];

  memset(r, 0, sizeof *r);
  r->exit_code = -1;
  if (argv[0] == NULL || pipe2(out, O_CLOEXEC) != 0)
    fail_msg("cannot run %s", argv[0] ? argv[0] : "(null)");
  if (pipe2(err, O_CLOEXEC) != 0)
    fail_msg("pipe: %s", strerror(errno));
  r->pid = spawn(argv, env_add, out[1], err[1], stdin_path);
  close(out[1]);
  close(err[1]);
  r->out_fd = out[0];
  r->err_fd = err[0];
  if (r->pid < 0)
    fail_msg("fork: %s", strerror(errno));
}

/* Appends what `fd` has to *buf. Returns 0 at end of file, else 1. */
static int drain(int fd, char **buf, size_t *len) {
  char chunk[4096];
  ssize_t n = read(fd, chunk, sizeof chunk);
  char *nb;
  if (n < 0 && errno == EINTR)
    return 1;
  if (n <= 0)
    return 0;
  if (*len + (size_t)n > OUT_MAX)
    return 1; /* keep reading, keep nothing more */
  if ((nb = realloc(*buf, *len + (size_t)n + 1)) == NULL)
    return 1;
  memcpy(nb + *len, chunk, (size_t)n);
  *len += (size_t)n;
  nb[*len] = '\0';
  *buf = nb;
  return 1;
}

void ct_run_wait(ct_run_t *r, double timeout_s) {
  double deadline = ct_now() + timeout_s;
  int open_out = 1, open_err = 1, status;

  while (open_out || open_err) {
    struct pollfd pfd[2] = {{.fd = open_out ? r->out_fd : -1, .events = POLLIN},
                            {.fd = open_err ? r->err_fd : -1, .events = POLLIN}};
    if (ct_now() > deadline) {
      r->timed_out = 1;
      kill(r->pid, SIGKILL);
      break;
    }
    if (poll(pfd, 2, 100) <= 0)
      continue;
    if (pfd[0].revents && !drain(r->out_fd, &r->out, &r->out_len))
      open_out = 0;
    if (pfd[1].revents && !drain(r->err_fd, &r->err, &r->err_len))
      open_err = 0;
  }
  close(r->out_fd);
  close(r->err_fd);
  while (waitpid(r->pid, &status, 0) < 0 && errno == EINTR)
    ;
  if (!r->timed_out && WIFEXITED(status))
    r->exit_code = WEXITSTATUS(status);
  if (r->out == NULL)
    r->out = strdup("");
  if (r->err == NULL)
    r->err = strdup("");
}

void ct_run(ct_run_t *r, const char *const *argv, const char *const *env_add,
            double timeout_s) {
  ct_run_start(r, argv, env_add);
  ct_run_wait(r, timeout_s);
}

void ct_run_free(ct_run_t *r) {
  free(r->out);
  free(r->err);
  r->out = r->err = NULL;
}

int ct_parse_line(const char *err, long *status, char *key, int *attempts, int *polls) {
  const char *line = err;
  const char *p;

  /* The last "idem: " line that starts a line. */
  for (p = err; (p = strstr(p, "idem: ")) != NULL; p++)
    if (p == err || p[-1] == '\n')
      line = p;
  if (strncmp(line, "idem: ", 6) != 0 ||
      sscanf(line, "idem: %ld key=%299s attempts=%d", status, key, attempts) != 3)
    return -1;
  p = strstr(line, " polls=");
  *polls = p && p < line + strcspn(line, "\n") ? atoi(p + 7) : 0;
  return 0;
}

/* ---- idemd and idem-psp --------------------------------------------------- */

static long http_status(int port, const char *path) {
  char url[128];
  long status = 0;
  CURL *c = curl_easy_init();
  if (c == NULL)
    return 0;
  snprintf(url, sizeof url, "http://127.0.0.1:%d%s", port, path);
  curl_easy_setopt(c, CURLOPT_URL, url);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 2000L);
  curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
  if (curl_easy_perform(c) == CURLE_OK)
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
  curl_easy_cleanup(c);
  return status;
}

/* One start on p->port: 0 when /healthz answers 200, -1 when the process
 * exited (the port may have been taken), -2 on timeout. */
static int launch(ct_proc_t *p, const char *const *argv) {
  double deadline = ct_now() + START_TIMEOUT_S;
  int fd = open(p->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600), status;

  if (fd < 0)
    fail_msg("cannot open %s: %s", p->log, strerror(errno));
  p->pid = spawn(argv, NULL, fd, fd, NULL);
  close(fd);
  if (p->pid < 0)
    fail_msg("fork: %s", strerror(errno));
  p->running = 1;
  while (ct_now() < deadline) {
    if (waitpid(p->pid, &status, WNOHANG) == p->pid) {
      p->running = 0;
      return -1;
    }
    if (http_status(p->port, "/healthz") == 200)
      return 0;
    ct_nap_ms(20);
  }
  ct_proc_kill(p);
  return -2;
}

static void start_server(ct_proc_t *p, const char *bin, const char *sub, const char *dir,
                         const char *db_name, int port, const char *const *flags) {
  char listen[64], db[512];
  const char *argv[CT_MAX_ARGS + 1];
  int rc = -1;

  if (bin == NULL)
    fail_msg("the binary is not set (IDEM_TEST_IDEMD / IDEM_TEST_PSP)");
  memset(p, 0, sizeof *p);
  snprintf(db, sizeof db, "%s/%s", dir, db_name);
  snprintf(p->log, sizeof p->log, "%s/%s.log", dir, db_name);
  for (int tries = 0; tries < (port ? 1 : START_TRIES) && rc == -1; tries++) {
    int argc = 0;
    p->port = port ? port : ct_free_port();
    snprintf(listen, sizeof listen, "127.0.0.1:%d", p->port);
    argv[argc++] = bin;
    if (sub)
      argv[argc++] = sub;
    argv[argc++] = "--listen";
    argv[argc++] = listen;
    argv[argc++] = "--db";
    argv[argc++] = db;
    for (int i = 0; flags && flags[i] && argc < CT_MAX_ARGS; i++)
      argv[argc++] = flags[i];
    argv[argc] = NULL;
    rc = launch(p, argv);
  }
  if (rc != 0)
    fail_msg("%s did not start (see %s)", bin, p->log);
}

void ct_idemd_start(ct_proc_t *p, const char *dir, int port, const char *const *flags) {
  start_server(p, ct_idemd_path(), "serve", dir, "idem.db", port, flags);
}

void ct_psp_start(ct_proc_t *p, const char *dir, const char *const *flags) {
  start_server(p, ct_psp_path(), NULL, dir, "psp.db", 0, flags);
}

static char *read_file(const char *path) {
  FILE *f = fopen(path, "rb");
  char *buf = NULL;
  size_t len = 0;
  if (f == NULL)
    return NULL;
  while (!feof(f) && len < 16 * OUT_MAX) {
    char *nb = realloc(buf, len + 65536 + 1);
    if (nb == NULL)
      break;
    buf = nb;
    len += fread(buf + len, 1, 65536, f);
    buf[len] = '\0';
  }
  fclose(f);
  return buf;
}

void ct_proc_stop(ct_proc_t *p) {
  double deadline = ct_now() + STOP_TIMEOUT_S;
  int status = 0, reaped = 0;
  char *log;

  if (!p->running)
    return;
  kill(p->pid, SIGTERM);
  while (!reaped && ct_now() < deadline) {
    reaped = waitpid(p->pid, &status, WNOHANG) == p->pid;
    if (!reaped)
      ct_nap_ms(20);
  }
  if (!reaped)
    ct_proc_kill(p);
  p->running = 0;
  log = read_file(p->log);
  if (log && (strstr(log, "Sanitizer") || strstr(log, "runtime error:"))) {
    fprintf(stderr, "%s\n", log);
    free(log);
    fail_msg("sanitizer report in %s", p->log);
  }
  free(log);
  if (!reaped || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
    fail_msg("server %d did not exit 0 on SIGTERM (status 0x%x, see %s)", (int)p->pid,
             status, p->log);
}

void ct_proc_kill(ct_proc_t *p) {
  if (!p->running)
    return;
  kill(p->pid, SIGKILL);
  waitpid(p->pid, NULL, 0);
  p->running = 0;
}

char *ct_tenant(const char *dir, const char *name) {
  char db[512];
  const char *argv[] = {ct_idemd_path(), "tenant", "create", name, "--db", db, NULL};
  ct_run_t r;
  char *key;

  snprintf(db, sizeof db, "%s/idem.db", dir);
  ct_run(&r, argv, NULL, START_TIMEOUT_S);
  if (r.exit_code != 0 || r.out_len == 0) {
    fprintf(stderr, "%s\n", r.err);
    ct_run_free(&r);
    fail_msg("idemd tenant create failed");
  }
  r.out[strcspn(r.out, "\r\n")] = '\0';
  key = strdup(r.out);
  ct_run_free(&r);
  return key;
}

static size_t on_body(char *ptr, size_t size, size_t n, void *ctx) {
  char **buf = ctx;
  size_t len = *buf ? strlen(*buf) : 0, add = size * n;
  char *nb;
  if (len + add > OUT_MAX || (nb = realloc(*buf, len + add + 1)) == NULL)
    return 0;
  memcpy(nb + len, ptr, add);
  nb[len + add] = '\0';
  *buf = nb;
  return add;
}

json_t *ct_get_json(int port, const char *path, const char *token) {
  char url[512], auth[512];
  char *body = NULL;
  long status = 0;
  struct curl_slist *h = NULL;
  json_t *doc = NULL;
  CURL *c = curl_easy_init();

  if (c == NULL)
    return NULL;
  snprintf(url, sizeof url, "http://127.0.0.1:%d%s", port, path);
  if (token) {
    snprintf(auth, sizeof auth, "Authorization: Bearer %s", token);
    h = curl_slist_append(h, auth);
  }
  curl_easy_setopt(c, CURLOPT_URL, url);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 10000L);
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &body);
  if (curl_easy_perform(c) == CURLE_OK)
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
  if (status == 200 && body)
    doc = json_loads(body, 0, NULL);
  free(body);
  curl_slist_free_all(h);
  curl_easy_cleanup(c);
  return doc;
}

int64_t ct_db_int(const char *db, const char *sql) {
  sqlite3 *h = NULL;
  sqlite3_stmt *st = NULL;
  int64_t v = 0;
  int ok = sqlite3_open_v2(db, &h, SQLITE_OPEN_READONLY, NULL) == SQLITE_OK &&
           sqlite3_busy_timeout(h, 5000) == SQLITE_OK &&
           sqlite3_prepare_v2(h, sql, -1, &st, NULL) == SQLITE_OK &&
           sqlite3_step(st) == SQLITE_ROW;
  if (ok)
    v = sqlite3_column_int64(st, 0);
  sqlite3_finalize(st);
  sqlite3_close(h);
  if (!ok)
    fail_msg("cannot read %s: %s", db, sql);
  return v;
}
