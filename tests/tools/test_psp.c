/* Integration tests of idem-psp, the provider simulator: each test starts
 * the real binary (argv[1] or IDEM_TEST_PSP) on a fresh temp dir and a
 * free 127.0.0.1 port and talks HTTP to it with libcurl. Helpers that fail
 * the test are only called from the main thread; worker threads only do
 * HTTP. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <setjmp.h>

#include <cmocka.h>
#include <curl/curl.h>
#include <jansson.h>

#include "hook_receiver.h"
#include "provider/webhook.h"

extern char **environ;

#define MAX_PROCS 8
#define MAX_ARGS 24
#define START_TIMEOUT_S 30.0
#define STOP_TIMEOUT_S 20.0

/* ---- processes ---------------------------------------------------------- */

/* One idem-psp process and the temp dir it owns. */
typedef struct psp {
  char dir[256];
  char db[300];
  char log[300]; /* its stdout and stderr */
  int port;
  pid_t pid;
  int running;
  int exit_status; /* raw waitpid status once it has exited */
} psp_t;

static const char *psp_bin;
static psp_t *procs[MAX_PROCS];

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void nap_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
}

static char *read_file(const char *path) {
  FILE *f = fopen(path, "rb");
  char *buf = NULL;
  size_t n = 0, cap = 0, got;
  if (f == NULL)
    return NULL;
  do {
    if (n + 4097 > cap) {
      char *nb = realloc(buf, cap = cap ? cap * 2 : 8192);
      if (nb == NULL) {
        free(buf);
        fclose(f);
        return NULL;
      }
      buf = nb;
    }
    got = fread(buf + n, 1, cap - n - 1, f);
    n += got;
  } while (got > 0);
  fclose(f);
  buf[n] = '\0';
  return buf;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st;
  (void)flag;
  (void)ftw;
  return remove(path);
}

static void print_log_tail(const psp_t *p) {
  char *text = read_file(p->log);
  size_t len = text ? strlen(text) : 0;
  if (text)
    fprintf(stderr, "---- end of %s ----\n%s\n----\n", p->log,
            len > 3000 ? text + len - 3000 : text);
  free(text);
}

/* The environment without IDEM_PSP_* (a developer's settings must not
 * change a test), plus `extra` ("NAME=value", NULL-terminated, may be
 * NULL). Points into environ and extra. */
static char **test_env(const char *const *extra) {
  size_t n = 0, k = 0, nextra = 0;
  char **env;
  while (environ[n])
    n++;
  while (extra && extra[nextra])
    nextra++;
  env = calloc(n + nextra + 1, sizeof *env);
  assert_non_null(env);
  for (size_t i = 0; i < n; i++)
    if (strncmp(environ[i], "IDEM_PSP_", 9) != 0)
      env[k++] = environ[i];
  for (size_t i = 0; i < nextra; i++)
    env[k++] = (char *)extra[i];
  return env;
}

/* fork + execve of idem-psp with `args` after argv[0], output to out_fd. */
static pid_t spawn(const char *const *args, const char *const *env_extra, int out_fd) {
  char *argv[MAX_ARGS + 2];
  char **env = test_env(env_extra);
  pid_t parent = getpid(), pid;
  int argc = 0;

  argv[argc++] = (char *)psp_bin;
  for (int i = 0; args && args[i]; i++) {
    assert_true(argc < MAX_ARGS);
    argv[argc++] = (char *)args[i];
  }
  argv[argc] = NULL;
  pid = fork();
  if (pid == 0) {
    int devnull = open("/dev/null", O_RDONLY);
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* die with the test */
    if (getppid() != parent)
      _exit(127);
    if (devnull >= 0)
      dup2(devnull, 0);
    dup2(out_fd, 1);
    dup2(out_fd, 2);
    execve(argv[0], argv, env);
    _exit(127);
  }
  free(env);
  assert_true(pid > 0);
  return pid;
}

/* Waits up to timeout_s for `pid`; returns its raw status, or -1. */
static int wait_exit(pid_t pid, double timeout_s) {
  double deadline = now_s() + timeout_s;
  int status;
  for (;;) {
    pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid)
      return status;
    if ((w < 0 && errno != EINTR) || now_s() > deadline)
      return -1;
    nap_ms(5);
  }
}

static int free_port(void) {
  struct sockaddr_in a = {.sin_family = AF_INET};
  socklen_t len = sizeof a;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), port = -1;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
      getsockname(fd, (struct sockaddr *)&a, &len) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0)
    close(fd);
  return port;
}

static size_t discard(char *b, size_t size, size_t n, void *ud) {
  (void)b;
  (void)ud;
  return size * n;
}

static long healthz_status(int port) {
  CURL *c = curl_easy_init();
  char url[64];
  long status = 0;
  snprintf(url, sizeof url, "http://127.0.0.1:%d/healthz", port);
  curl_easy_setopt(c, CURLOPT_URL, url);
  curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 2000L);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, discard);
  if (curl_easy_perform(c) == CURLE_OK)
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
  curl_easy_cleanup(c);
  return status;
}

/* Starts idem-psp on p->dir with --listen and --db added to `flags`, and
 * waits for /healthz. Retries on another port if the one picked was taken. */
static void launch(psp_t *p, const char *const *flags, const char *const *env) {
  for (int attempt = 0; attempt < 5; attempt++) {
    const char *args[MAX_ARGS];
    char listen[64];
    int n = 0, fd, status;
    struct stat st;
    off_t log_start = stat(p->log, &st) == 0 ? st.st_size : 0;
    double deadline = now_s() + START_TIMEOUT_S;

    p->port = free_port();
    assert_true(p->port > 0);
    snprintf(listen, sizeof listen, "127.0.0.1:%d", p->port);
    args[n++] = "--listen";
    args[n++] = listen;
    args[n++] = "--db";
    args[n++] = p->db;
    for (int i = 0; flags && flags[i]; i++) {
      assert_true(n < MAX_ARGS - 1);
      args[n++] = flags[i];
    }
    args[n] = NULL;
    fd = open(p->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    assert_true(fd >= 0);
    p->pid = spawn(args, env, fd);
    close(fd);
    p->running = 1;
    for (;;) {
      if (waitpid(p->pid, &status, WNOHANG) == p->pid) {
        char *text = read_file(p->log);
        int taken = text && strstr(text + log_start, "cannot listen") != NULL;
        free(text);
        p->running = 0;
        if (taken)
          break;
        print_log_tail(p);
        fail_msg("idem-psp exited during start-up (status 0x%x)", status);
      }
      if (healthz_status(p->port) == 200)
        return;
      if (now_s() > deadline) {
        kill(p->pid, SIGKILL);
        waitpid(p->pid, &status, 0);
        p->running = 0;
        print_log_tail(p);
        fail_msg("idem-psp did not answer /healthz within %.0f s", START_TIMEOUT_S);
      }
      nap_ms(10);
    }
  }
  fail_msg("no free port in 5 attempts");
}

/* A new idem-psp on a new temp dir. */
static psp_t *psp_start_env(const char *const *flags, const char *const *env) {
  const char *tmp = getenv("TMPDIR");
  psp_t *p = calloc(1, sizeof *p);
  int slot = -1;

  assert_non_null(p);
  for (int i = 0; i < MAX_PROCS && slot < 0; i++)
    if (procs[i] == NULL)
      slot = i;
  assert_true(slot >= 0);
  procs[slot] = p;
  snprintf(p->dir, sizeof p->dir, "%s/idem-psp-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
  assert_non_null(mkdtemp(p->dir));
  snprintf(p->db, sizeof p->db, "%s/psp.db", p->dir);
  snprintf(p->log, sizeof p->log, "%s/psp.log", p->dir);
  launch(p, flags, env);
  return p;
}

static psp_t *psp_start(const char *const *flags) {
  return psp_start_env(flags, NULL);
}

/* Starts the (exited) process again on the same dir and database. */
static void psp_restart(psp_t *p, const char *const *flags) {
  assert_false(p->running);
  launch(p, flags, NULL);
}

static int sanitizer_report(const psp_t *p) {
  static const char *const needles[] = {"ERROR: AddressSanitizer", "ERROR: LeakSanitizer",
                                        "runtime error:", "WARNING: ThreadSanitizer"};
  char *text = read_file(p->log);
  int found = 0;
  for (size_t i = 0; text && i < sizeof needles / sizeof *needles; i++)
    found |= strstr(text, needles[i]) != NULL;
  free(text);
  return found;
}

/* Sends `sig` and waits for the exit; fails unless it is a clean exit 0. */
static void psp_stop_with(psp_t *p, int sig) {
  int status;
  assert_true(p->running);
  kill(p->pid, sig);
  status = wait_exit(p->pid, STOP_TIMEOUT_S);
  if (status == -1) {
    kill(p->pid, SIGKILL);
    waitpid(p->pid, &status, 0);
    p->running = 0;
    fail_msg("idem-psp did not exit within %.0f s of signal %d", STOP_TIMEOUT_S, sig);
  }
  p->running = 0;
  p->exit_status = status;
  if (sanitizer_report(p) || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    print_log_tail(p);
    fail_msg("idem-psp did not exit cleanly (status 0x%x, or a sanitizer report)",
             status);
  }
}

static void psp_stop(psp_t *p) {
  psp_stop_with(p, SIGTERM);
}

/* kill -9: a crash that leaves no chance to clean up. */
static void psp_kill9(psp_t *p) {
  kill(p->pid, SIGKILL);
  waitpid(p->pid, &p->exit_status, 0);
  p->running = 0;
}

/* The webhook receiver of the test running, if it started one. */
static hook_receiver_t receiver;
static int receiver_running;

static int teardown(void **state) {
  (void)state;
  for (int i = 0; i < MAX_PROCS; i++) {
    psp_t *p = procs[i];
    if (p == NULL)
      continue;
    procs[i] = NULL;
    if (p->running)
      psp_stop(p);
    if (getenv("IDEM_TEST_KEEP") == NULL)
      (void)nftw(p->dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    free(p);
  }
  if (receiver_running) {
    receiver_running = 0;
    hook_receiver_stop(&receiver);
  }
  memset(&receiver, 0, sizeof receiver);
  return 0;
}

/* ---- HTTP ----------------------------------------------------------------- */

typedef struct req {
  const char *method; /* "POST" when there is a body, else "GET" */
  const char *path;
  const char *key;   /* Idempotency-Key; NULL: none; "": empty */
  const char *fault; /* X-Psp-Fault; NULL: none */
  const char *body;
  long timeout_ms; /* 0: 10 s */
} req_t;

typedef struct resp {
  long status; /* 0: no answer */
  CURLcode err;
  char *body;
  size_t len;
  json_t *json;
  int replayed; /* Idempotent-Replayed: true */
  char allow[64];
  double seconds;
} resp_t;

static size_t on_body(char *b, size_t size, size_t n, void *ud) {
  resp_t *r = ud;
  char *nb = realloc(r->body, r->len + size * n + 1);
  if (nb == NULL)
    return 0;
  r->body = nb;
  memcpy(r->body + r->len, b, size * n);
  r->len += size * n;
  r->body[r->len] = '\0';
  return size * n;
}

static size_t on_header(char *b, size_t size, size_t n, void *ud) {
  resp_t *r = ud;
  size_t len = size * n;
  if (len >= 25 && strncasecmp(b, "Idempotent-Replayed: true", 25) == 0)
    r->replayed = 1;
  if (len > 7 && strncasecmp(b, "Allow: ", 7) == 0)
    snprintf(r->allow, sizeof r->allow, "%.*s", (int)strcspn(b + 7, "\r\n"), b + 7);
  return len;
}

static void http(const psp_t *p, const req_t *q, resp_t *out) {
  CURL *c = curl_easy_init();
  struct curl_slist *h = NULL;
  char url[1024], line[1100];
  const char *method = q->method ? q->method : q->body ? "POST" : "GET";
  double t0 = now_s();

  memset(out, 0, sizeof *out);
  snprintf(url, sizeof url, "http://127.0.0.1:%d%s", p->port,
           q->path ? q->path : "/charges");
  curl_easy_setopt(c, CURLOPT_URL, url);
  curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, q->timeout_ms ? q->timeout_ms : 10000L);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, out);
  curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(c, CURLOPT_HEADERDATA, out);
  h = curl_slist_append(h, "Expect:");
  h = curl_slist_append(h, "Content-Type: application/json");
  if (q->key) {
    if (q->key[0])
      snprintf(line, sizeof line, "Idempotency-Key: %s", q->key);
    else
      snprintf(line, sizeof line, "Idempotency-Key;"); /* curl: send it empty */
    h = curl_slist_append(h, line);
  }
  if (q->fault) {
    snprintf(line, sizeof line, "X-Psp-Fault: %s", q->fault);
    h = curl_slist_append(h, line);
  }
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
  if (strcmp(method, "HEAD") == 0)
    curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
  else
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
  if (q->body) {
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, q->body);
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, (long)strlen(q->body));
  }
  out->err = curl_easy_perform(c);
  if (out->err == CURLE_OK)
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &out->status);
  out->seconds = now_s() - t0;
  if (out->body)
    out->json = json_loads(out->body, 0, NULL);
  curl_slist_free_all(h);
  curl_easy_cleanup(c);
}

static void resp_free(resp_t *r) {
  free(r->body);
  json_decref(r->json);
  memset(r, 0, sizeof *r);
}

static void post(const psp_t *p, const char *key, const char *fault, const char *body,
                 resp_t *out) {
  req_t q = {.key = key, .fault = fault, .body = body};
  http(p, &q, out);
}

static void get(const psp_t *p, const char *path, resp_t *out) {
  req_t q = {.path = path};
  http(p, &q, out);
}

/* ---- assertions ------------------------------------------------------------ */

static void assert_status(const resp_t *r, long status) {
  if (r->status != status)
    fail_msg("expected HTTP %ld, got %ld (curl: %s) body: %s", status, r->status,
             curl_easy_strerror(r->err), r->body ? r->body : "(none)");
}

/* `{"error": "<non-empty>"}` and nothing else. */
static void assert_error(const resp_t *r, long status) {
  json_t *e;
  assert_status(r, status);
  if (!json_is_object(r->json) || json_object_size(r->json) != 1 ||
      !json_is_string(e = json_object_get(r->json, "error")) ||
      json_string_length(e) == 0)
    fail_msg("HTTP %ld: expected {\"error\": \"...\"}, got %s", status,
             r->body ? r->body : "(none)");
}

static const char *str_field(const resp_t *r, const char *name) {
  const char *v = json_string_value(json_object_get(r->json, name));
  if (v == NULL)
    fail_msg("no string \"%s\" in %s", name, r->body ? r->body : "(none)");
  return v;
}

/* A charge body (or, with `charge`, a refund's): every field, with these
 * values. */
static void assert_made(const resp_t *r, long status, const char *key, const char *charge,
                        long long amount, const char *currency, const char *made_status) {
  const char *id, *created;
  assert_status(r, status);
  assert_int_equal(json_object_size(r->json), charge ? 7 : 6);
  id = str_field(r, "id");
  assert_true(strncmp(id, charge ? "re_" : "ch_", 3) == 0 && strlen(id) > 10);
  assert_string_equal(str_field(r, "key"), key);
  if (charge)
    assert_string_equal(str_field(r, "charge"), charge);
  assert_true(json_is_integer(json_object_get(r->json, "amount")));
  assert_int_equal(json_integer_value(json_object_get(r->json, "amount")), amount);
  assert_string_equal(str_field(r, "currency"), currency);
  assert_string_equal(str_field(r, "status"), made_status);
  created = str_field(r, "created_at");
  /* RFC 3339 UTC: 2026-11-30T08:13:19Z */
  assert_int_equal(strlen(created), 20);
  assert_true(created[4] == '-' && created[10] == 'T' && created[19] == 'Z');
}

static void assert_charge(const resp_t *r, long status, const char *key, long long amount,
                          const char *currency, const char *charge_status) {
  assert_made(r, status, key, NULL, amount, currency, charge_status);
}

/* Transport failure: the connection closed (or timed out) with no answer. */
static void assert_no_answer(const resp_t *r) {
  if (r->status != 0 || r->err == CURLE_OK)
    fail_msg("expected no answer, got HTTP %ld: %s", r->status, r->body ? r->body : "");
}

static json_t *stats(const psp_t *p) {
  resp_t r;
  json_t *s;
  get(p, "/stats", &r);
  assert_status(&r, 200);
  s = json_incref(r.json);
  resp_free(&r);
  assert_true(json_is_object(s));
  return s;
}

/* stats field; with `key`, stats[keys][key][field] (-1 if the key is
 * absent). */
static long long stat_in(const psp_t *p, const char *keys, const char *key,
                         const char *field) {
  json_t *s = stats(p), *v;
  long long n;
  if (key) {
    json_t *k = json_object_get(json_object_get(s, keys), key);
    v = k ? json_object_get(k, field) : NULL;
    if (k == NULL) {
      json_decref(s);
      return -1;
    }
  } else {
    v = json_object_get(s, field);
  }
  assert_true(json_is_integer(v));
  n = json_integer_value(v);
  json_decref(s);
  return n;
}

/* stats field; with `key`, keys[key][field] (-1 if the key is absent). */
static long long stat_of(const psp_t *p, const char *key, const char *field) {
  return stat_in(p, "keys", key, field);
}

/* With `key`, refund_keys[key][field] (-1 if the key is absent); else
 * the stats field. */
static long long refund_stat(const psp_t *p, const char *key, const char *field) {
  return stat_in(p, "refund_keys", key, field);
}

/* GET /charges/{key} (key already URL-safe). */
static void get_charge(const psp_t *p, const char *key, resp_t *out) {
  char path[600];
  snprintf(path, sizeof path, "/charges/%s", key);
  get(p, path, out);
}

/* The charge id made under `key` (malloc'd), failing unless it exists. */
static char *charge_id(const psp_t *p, const char *key) {
  resp_t r;
  char *id;
  get_charge(p, key, &r);
  assert_status(&r, 200);
  id = strdup(str_field(&r, "id"));
  resp_free(&r);
  return id;
}

/* The request log lines of `p` but those of GET /healthz (the start-up
 * probes), as a JSON array. Fails if any line of the log is not a JSON
 * object. */
static json_t *log_lines(const psp_t *p) {
  char *text = read_file(p->log), *line, *save = NULL;
  json_t *all = json_array();
  assert_non_null(text);
  for (line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
    json_t *j = json_loads(line, 0, NULL);
    if (!json_is_object(j))
      fail_msg("log line is not a JSON object: %s", line);
    if (json_object_get(j, "method") &&
        strcmp(json_string_value(json_object_get(j, "path")), "/healthz") != 0)
      json_array_append(all, j);
    json_decref(j);
  }
  free(text);
  return all;
}

/* The log line of the POST /charges under `key` (the n-th, from 0). */
static json_t *post_log(json_t *lines, const char *key, int nth) {
  size_t i;
  json_t *j;
  json_array_foreach(lines, i, j) {
    const char *k = json_string_value(json_object_get(j, "key"));
    if (k && strcmp(k, key) == 0 &&
        strcmp(json_string_value(json_object_get(j, "method")), "POST") == 0 &&
        nth-- == 0)
      return j;
  }
  fail_msg("no log line for POST /charges with key %s", key);
  return NULL;
}

/* ---- the command line ----------------------------------------------------- */

/* Runs idem-psp to completion; returns its exit code, output in *out. */
static int run_cli(const char *const *args, const char *const *env, char **out) {
  char path[] = "/tmp/idem-psp-cli-XXXXXX";
  int fd = mkstemp(path), status;
  pid_t pid;

  assert_true(fd >= 0);
  pid = spawn(args, env, fd);
  close(fd);
  status = wait_exit(pid, 10);
  if (status == -1) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    unlink(path);
    fail_msg("idem-psp did not exit within 10 s");
  }
  *out = read_file(path);
  unlink(path);
  assert_true(WIFEXITED(status));
  return WEXITSTATUS(status);
}

static void test_usage(void **state) {
  static const struct {
    const char *args[5];
    const char *env;
    const char *mention; /* the error names it */
  } bad[] = {
      {{"--latency", "abc"}, NULL, "--latency"},
      {{"--latency", "-1s"}, NULL, "--latency"},
      {{"--latency", "5m"}, NULL, "--latency"},
      {{"--delay-after-charge", "7200s"}, NULL, "--delay-after-charge"},
      {{"--chaos", "1.5"}, NULL, "--chaos"},
      {{"--chaos", "x"}, NULL, "--chaos"},
      {{"--seed", "-3"}, NULL, "--seed"},
      {{"--decline-amount", "0"}, NULL, "--decline-amount"},
      {{"--decline-amount", "12x"}, NULL, "--decline-amount"},
      {{"--listen", "127.0.0.1"}, NULL, "--listen"},
      {{"--listen", "127.0.0.1:70000"}, NULL, "--listen"},
      {{"--listen", "::1:9090"}, NULL, "--listen"},
      {{"--fail-after=maybe"}, NULL, "--fail-after"},
      {{"--latency"}, NULL, "--latency"},
      {{"--bogus"}, NULL, "--bogus"},
      {{"serve"}, NULL, "serve"},
      {{NULL}, "IDEM_PSP_FAIL_BEFORE=maybe", "IDEM_PSP_FAIL_BEFORE"},
      {{NULL}, "IDEM_PSP_LATENCY=soon", "IDEM_PSP_LATENCY"},
      {{NULL}, "IDEM_PSP_CHAOS=-0.1", "IDEM_PSP_CHAOS"},
      {{"--ignore-idempotency-key=sometimes"}, NULL, "--ignore-idempotency-key"},
      {{"--webhook-url", "http://127.0.0.1:9/hook"}, NULL, "--webhook-secret"},
      {{"--webhook-secret", "s3cret"}, NULL, "--webhook-url"},
      {{"--webhook-duplicates", "0.5"}, NULL, "--webhook-url"},
      {{"--webhook-url", "ftp://127.0.0.1/hook", "--webhook-secret", "s"},
       NULL,
       "--webhook-url"},
      {{"--webhook-url", "http://127.0.0.1:9/hook", "--webhook-secret", ""},
       NULL,
       "--webhook-secret"},
      {{"--webhook-url", "http://127.0.0.1:9/hook", "--webhook-duplicates", "1.5"},
       NULL,
       "--webhook-duplicates"},
      {{"--webhook-url", "http://127.0.0.1:9/hook"},
       "IDEM_PSP_WEBHOOK_DUPLICATES=x",
       "IDEM_PSP_WEBHOOK_DUPLICATES"},
  };
  const char *help[] = {"--help", NULL};
  char *out;
  (void)state;

  assert_int_equal(run_cli(help, NULL, &out), 0);
  assert_non_null(strstr(out, "usage: idem-psp"));
  assert_non_null(strstr(out, "--decline-amount"));
  assert_non_null(strstr(out, "IDEM_PSP_LISTEN"));
  assert_non_null(strstr(out, "POST /refunds"));
  assert_non_null(strstr(out, "GET /refunds/{key}"));
  assert_non_null(strstr(out, "--webhook-duplicates"));
  assert_non_null(strstr(out, "--ignore-idempotency-key"));
  assert_non_null(strstr(out, "GET /charges?reference=R"));
  free(out);

  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    const char *env[] = {bad[i].env, NULL};
    int rc = run_cli(bad[i].args, env, &out);
    if (rc != 2 || strstr(out, "idem-psp: ") == NULL ||
        strstr(out, bad[i].mention) == NULL)
      fail_msg("case %zu (%s %s): exit %d, output: %s", i,
               bad[i].args[0] ? bad[i].args[0] : bad[i].env,
               bad[i].args[1] ? bad[i].args[1] : "", rc, out);
    free(out);
  }
}

/* ---- routes ---------------------------------------------------------------- */

static void test_routes(void **state) {
  psp_t *p = psp_start(NULL);
  req_t put = {.method = "PUT", .path = "/charges", .body = "{}"};
  req_t post_stats = {.method = "POST", .path = "/stats", .body = "{}"};
  req_t head = {.method = "HEAD", .path = "/healthz"};
  req_t del_refunds = {.method = "DELETE", .path = "/refunds"};
  resp_t r;
  (void)state;

  get(p, "/healthz", &r);
  assert_status(&r, 200);
  assert_non_null(r.json);
  assert_string_equal(str_field(&r, "status"), "ok");
  resp_free(&r);

  get(p, "/nope", &r);
  assert_error(&r, 404);
  resp_free(&r);

  http(p, &put, &r);
  assert_error(&r, 405);
  assert_string_equal(r.allow, "GET, HEAD, POST");
  resp_free(&r);

  http(p, &post_stats, &r);
  assert_error(&r, 405);
  resp_free(&r);

  http(p, &del_refunds, &r);
  assert_error(&r, 405);
  assert_string_equal(r.allow, "GET, HEAD, POST");
  resp_free(&r);

  /* GET /charges and /refunds list by ?reference=, which they need. */
  get(p, "/charges", &r);
  assert_error(&r, 400);
  resp_free(&r);

  get(p, "/refunds", &r);
  assert_error(&r, 400);
  resp_free(&r);

  http(p, &head, &r);
  assert_status(&r, 200);
  assert_int_equal(r.len, 0);
  resp_free(&r);

  get(p, "/stats", &r);
  assert_status(&r, 200);
  assert_int_equal(json_integer_value(json_object_get(r.json, "charges")), 0);
  assert_int_equal(json_integer_value(json_object_get(r.json, "declines")), 0);
  assert_int_equal(json_integer_value(json_object_get(r.json, "requests")), 0);
  assert_true(json_is_object(json_object_get(r.json, "keys")));
  assert_int_equal(json_object_size(json_object_get(r.json, "keys")), 0);
  for (size_t i = 0; i < 3; i++) {
    static const char *const zero[] = {"refunds", "refund_declines", "refund_requests"};
    json_t *v = json_object_get(r.json, zero[i]);
    assert_true(json_is_integer(v));
    assert_int_equal(json_integer_value(v), 0);
  }
  assert_true(json_is_object(json_object_get(r.json, "refund_keys")));
  assert_int_equal(json_object_size(json_object_get(r.json, "refund_keys")), 0);
  resp_free(&r);
}

/* ---- POST /charges ----------------------------------------------------------- */

static void test_charge_and_replay(void **state) {
  psp_t *p = psp_start(NULL);
  resp_t first, again, other;
  char *id;
  (void)state;

  post(p, "k-1", NULL, "{\"amount\": 15990, \"currency\": \"BRL\"}", &first);
  assert_charge(&first, 201, "k-1", 15990, "BRL", "succeeded");
  assert_false(first.replayed);

  /* Key order and whitespace do not matter; the charge is the same. */
  post(p, "k-1", NULL, "{\"currency\":\"BRL\",\"amount\":15990}", &again);
  assert_charge(&again, 201, "k-1", 15990, "BRL", "succeeded");
  assert_true(again.replayed);
  assert_string_equal(again.body, first.body);

  /* Another key is another charge; currency defaults to BRL. */
  post(p, "k-2", NULL, "{\"amount\": 15990, \"note\": \"ignored\"}", &other);
  assert_charge(&other, 201, "k-2", 15990, "BRL", "succeeded");
  assert_false(other.replayed);
  assert_string_not_equal(str_field(&other, "id"), str_field(&first, "id"));

  id = charge_id(p, "k-1");
  assert_string_equal(id, str_field(&first, "id"));
  free(id);
  assert_int_equal(stat_of(p, NULL, "charges"), 2);
  assert_int_equal(stat_of(p, NULL, "requests"), 3);
  resp_free(&first);
  resp_free(&again);
  resp_free(&other);
}

static void test_key_validation(void **state) {
  psp_t *p = psp_start(NULL);
  char long_key[300];
  const char *bad[] = {"", "caf\xc3\xa9", NULL /* filled: 256 chars */};
  resp_t r;
  (void)state;

  memset(long_key, 'k', 256);
  long_key[256] = '\0';
  bad[2] = long_key;

  post(p, NULL, NULL, "{\"amount\": 100}", &r);
  assert_error(&r, 400);
  assert_non_null(strstr(r.body, "required"));
  resp_free(&r);
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    post(p, bad[i], NULL, "{\"amount\": 100}", &r);
    assert_error(&r, 400);
    resp_free(&r);
  }
  /* 255 is the longest key. */
  long_key[255] = '\0';
  post(p, long_key, NULL, "{\"amount\": 100}", &r);
  assert_charge(&r, 201, long_key, 100, "BRL", "succeeded");
  resp_free(&r);

  assert_int_equal(stat_of(p, NULL, "charges"), 1);
  assert_int_equal(stat_of(p, NULL, "requests"), 5);
}

static void test_body_validation(void **state) {
  static const char *const bad[] = {
      "",
      "not json",
      "[1, 2]",
      "{}",
      "{\"amount\": 0}",
      "{\"amount\": -5}",
      "{\"amount\": 1.5}",
      "{\"amount\": 1.0}",
      "{\"amount\": \"100\"}",
      "{\"amount\": 9007199254740992}",
      "{\"amount\": 100, \"currency\": \"brl\"}",
      "{\"amount\": 100, \"currency\": \"REAL\"}",
      "{\"amount\": 100, \"currency\": 986}",
      "{\"amount\": 100, \"amount\": 200}",
      "{\"amount\": 100",
  };
  psp_t *p = psp_start(NULL);
  char *big;
  resp_t r;
  (void)state;

  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    post(p, "k-body", NULL, bad[i], &r);
    if (r.status != 422)
      fail_msg("body %s: expected 422, got %ld", bad[i], r.status);
    assert_error(&r, 422);
    resp_free(&r);
  }
  big = malloc(70 * 1024 + 32);
  assert_non_null(big);
  memset(big, ' ', 70 * 1024);
  strcpy(big + 70 * 1024, "{\"amount\": 100}");
  post(p, "k-body", NULL, big, &r);
  assert_error(&r, 413);
  resp_free(&r);
  free(big);

  /* Nothing was charged: the key is still free. */
  get_charge(p, "k-body", &r);
  assert_error(&r, 404);
  resp_free(&r);
  assert_int_equal(stat_of(p, NULL, "charges"), 0);
  assert_int_equal(stat_of(p, "k-body", "requests"),
                   (long long)(sizeof bad / sizeof *bad) + 1);
  post(p, "k-body", NULL, "{\"amount\": 100, \"currency\": \"USD\"}", &r);
  assert_charge(&r, 201, "k-body", 100, "USD", "succeeded");
  assert_false(r.replayed);
  resp_free(&r);
}

static void test_mismatch(void **state) {
  psp_t *p = psp_start(NULL);
  resp_t r;
  (void)state;

  post(p, "k-m", NULL, "{\"amount\": 500, \"currency\": \"BRL\"}", &r);
  assert_status(&r, 201);
  resp_free(&r);
  post(p, "k-m", NULL, "{\"amount\": 501, \"currency\": \"BRL\"}", &r);
  assert_error(&r, 409);
  resp_free(&r);
  post(p, "k-m", NULL, "{\"amount\": 500, \"currency\": \"USD\"}", &r);
  assert_error(&r, 409);
  resp_free(&r);

  get_charge(p, "k-m", &r);
  assert_charge(&r, 200, "k-m", 500, "BRL", "succeeded");
  resp_free(&r);
  assert_int_equal(stat_of(p, NULL, "charges"), 1);
  assert_int_equal(stat_of(p, "k-m", "requests"), 3);
}

static void test_get_charge(void **state) {
  psp_t *p = psp_start(NULL);
  const char *key = "a/b?c#d%e+f";
  resp_t r, c;
  (void)state;

  post(p, key, NULL, "{\"amount\": 42}", &c);
  assert_status(&c, 201);

  get_charge(p, "a%2Fb%3Fc%23d%25e+f", &r);
  assert_charge(&r, 200, key, 42, "BRL", "succeeded");
  assert_string_equal(str_field(&r, "id"), str_field(&c, "id"));
  assert_false(r.replayed);
  resp_free(&r);

  /* A NUL cannot cut the key short; other keys are not found. */
  get_charge(p, "a%2Fb%3Fc%23d%25e+f%00", &r);
  assert_error(&r, 404);
  resp_free(&r);
  get_charge(p, "a%2Fb", &r);
  assert_error(&r, 404);
  assert_string_equal(str_field(&r, "error"), "no charge");
  resp_free(&r);
  get_charge(p, "", &r);
  assert_error(&r, 404);
  resp_free(&r);
  resp_free(&c);
}

/* ---- concurrency -------------------------------------------------------------- */

#define TOGETHER 20

struct worker {
  const psp_t *p;
  req_t q;
  resp_t r;
  pthread_barrier_t *barrier;
};

static void *worker_main(void *arg) {
  struct worker *w = arg;
  if (w->barrier)
    pthread_barrier_wait(w->barrier);
  http(w->p, &w->q, &w->r);
  return NULL;
}

/* Sends the requests of w[0..n) (their .p and .q set) from n threads
 * released together, and waits for every answer. */
static void run_together(struct worker *w, int n) {
  pthread_t t[TOGETHER];
  pthread_barrier_t barrier;

  assert_true(n <= TOGETHER);
  pthread_barrier_init(&barrier, NULL, (unsigned)n);
  for (int i = 0; i < n; i++) {
    w[i].barrier = &barrier;
    assert_int_equal(pthread_create(&t[i], NULL, worker_main, &w[i]), 0);
  }
  for (int i = 0; i < n; i++)
    pthread_join(t[i], NULL);
  pthread_barrier_destroy(&barrier);
}

static void test_one_charge_per_key(void **state) {
  psp_t *p = psp_start(NULL);
  struct worker w[TOGETHER];
  int fresh = 0;
  (void)state;

  for (int i = 0; i < TOGETHER; i++)
    w[i] = (struct worker){.p = p, .q = {.key = "k-race", .body = "{\"amount\": 777}"}};
  run_together(w, TOGETHER);

  for (int i = 0; i < TOGETHER; i++) {
    assert_charge(&w[i].r, 201, "k-race", 777, "BRL", "succeeded");
    assert_string_equal(str_field(&w[i].r, "id"), str_field(&w[0].r, "id"));
    fresh += !w[i].r.replayed;
  }
  assert_int_equal(fresh, 1); /* one request made it, nineteen replayed it */
  assert_int_equal(stat_of(p, NULL, "charges"), 1);
  assert_int_equal(stat_of(p, NULL, "requests"), TOGETHER);
  assert_int_equal(stat_of(p, "k-race", "requests"), TOGETHER);
  assert_int_equal(stat_of(p, "k-race", "charges"), 1);
  for (int i = 0; i < TOGETHER; i++)
    resp_free(&w[i].r);
}

/* A request sleeping in a fault does not hold up the others. */
static void test_latency_does_not_block(void **state) {
  psp_t *p = psp_start(NULL);
  struct worker slow = {
      .p = p,
      .q = {.key = "k-slow", .fault = "latency=1500ms", .body = "{\"amount\": 1}"}};
  pthread_t t;
  resp_t r;
  (void)state;

  assert_int_equal(pthread_create(&t, NULL, worker_main, &slow), 0);
  nap_ms(200);
  get(p, "/healthz", &r);
  assert_status(&r, 200);
  assert_true(r.seconds < 1.0);
  resp_free(&r);
  post(p, "k-fast", NULL, "{\"amount\": 1}", &r);
  assert_status(&r, 201);
  assert_true(r.seconds < 1.0);
  resp_free(&r);
  /* The slow one has not been charged yet: latency acts before anything. */
  get_charge(p, "k-slow", &r);
  assert_error(&r, 404);
  resp_free(&r);

  pthread_join(t, NULL);
  assert_charge(&slow.r, 201, "k-slow", 1, "BRL", "succeeded");
  assert_true(slow.r.seconds >= 1.45);
  resp_free(&slow.r);
}

/* ---- faults --------------------------------------------------------------------- */

static void test_fail_before(void **state) {
  psp_t *p = psp_start(NULL);
  resp_t r;
  (void)state;

  post(p, "k-fb", "fail-before", "{\"amount\": 300}", &r);
  assert_error(&r, 500);
  resp_free(&r);
  get_charge(p, "k-fb", &r);
  assert_error(&r, 404);
  resp_free(&r);
  assert_int_equal(stat_of(p, NULL, "charges"), 0);
  assert_int_equal(stat_of(p, "k-fb", "requests"), 1);
  assert_int_equal(stat_of(p, "k-fb", "charges"), 0);

  /* The retry is the first charge. */
  post(p, "k-fb", NULL, "{\"amount\": 300}", &r);
  assert_charge(&r, 201, "k-fb", 300, "BRL", "succeeded");
  assert_false(r.replayed);
  resp_free(&r);
  assert_int_equal(stat_of(p, NULL, "charges"), 1);
}

/* After a fault that made the charge (or, with `charge`, the refund of
 * that charge) but gave no good answer, it is visible by key and a retry
 * replays it. */
static void assert_made_once(const psp_t *p, const char *key, const char *charge,
                             long long amount) {
  char path[600], body[400], *id;
  req_t q = {.path = charge ? "/refunds" : "/charges", .key = key, .body = body};
  resp_t r;

  snprintf(path, sizeof path, "%s/%s", q.path, key);
  get(p, path, &r);
  assert_made(&r, 200, key, charge, amount, "BRL", "succeeded");
  id = strdup(str_field(&r, "id"));
  resp_free(&r);
  if (charge)
    snprintf(body, sizeof body, "{\"charge\": \"%s\", \"amount\": %lld}", charge, amount);
  else
    snprintf(body, sizeof body, "{\"amount\": %lld}", amount);
  http(p, &q, &r);
  assert_made(&r, 201, key, charge, amount, "BRL", "succeeded");
  assert_true(r.replayed);
  assert_string_equal(str_field(&r, "id"), id);
  resp_free(&r);
  assert_int_equal(stat_in(p, charge ? "refund_keys" : "keys", key,
                           charge ? "refunds" : "charges"),
                   1);
  free(id);
}

static void assert_charged_once(const psp_t *p, const char *key, long long amount) {
  assert_made_once(p, key, NULL, amount);
}

static void test_fail_after(void **state) {
  psp_t *p = psp_start(NULL);
  resp_t r;
  (void)state;

  post(p, "k-fa", "fail-after", "{\"amount\": 301}", &r);
  assert_error(&r, 500);
  resp_free(&r);
  assert_charged_once(p, "k-fa", 301);
  assert_int_equal(stat_of(p, NULL, "charges"), 1);
}

static void test_drop_after(void **state) {
  psp_t *p = psp_start(NULL);
  resp_t r;
  (void)state;

  post(p, "k-da", "drop-after", "{\"amount\": 302}", &r);
  assert_no_answer(&r);
  assert_true(r.err == CURLE_GOT_NOTHING || r.err == CURLE_RECV_ERROR);
  resp_free(&r);
  assert_charged_once(p, "k-da", 302);
  assert_int_equal(stat_of(p, NULL, "charges"), 1);
}

static void test_delay_after_charge(void **state) {
  psp_t *p = psp_start(NULL);
  req_t q = {.key = "k-dac",
             .fault = "delay-after-charge=1500ms",
             .body = "{\"amount\": 303}",
             .timeout_ms = 300};
  resp_t r;
  (void)state;

  /* The caller's deadline passes... */
  http(p, &q, &r);
  assert_no_answer(&r);
  assert_int_equal(r.err, CURLE_OPERATION_TIMEDOUT);
  resp_free(&r);
  /* ...although the charge already exists (the delay is still running). */
  get_charge(p, "k-dac", &r);
  assert_charge(&r, 200, "k-dac", 303, "BRL", "succeeded");
  resp_free(&r);
  assert_charged_once(p, "k-dac", 303);

  /* Without a deadline, the answer comes after the delay. */
  q.key = "k-dac2";
  q.fault = "delay-after-charge=400ms";
  q.timeout_ms = 0;
  http(p, &q, &r);
  assert_charge(&r, 201, "k-dac2", 303, "BRL", "succeeded");
  assert_true(r.seconds >= 0.39);
  resp_free(&r);
}

static void test_crash_after(void **state) {
  psp_t *p = psp_start(NULL);
  resp_t r;
  int status;
  (void)state;

  post(p, "k-ca", "crash-after", "{\"amount\": 304}", &r);
  assert_no_answer(&r);
  resp_free(&r);
  status = wait_exit(p->pid, 10);
  assert_true(status != -1);
  p->running = 0;
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 3);

  psp_restart(p, NULL);
  assert_charged_once(p, "k-ca", 304);
  assert_int_equal(stat_of(p, NULL, "charges"), 1);
  assert_int_equal(stat_of(p, "k-ca", "requests"), 2);
}

static void test_decline(void **state) {
  const char *flags[] = {"--decline-amount", "402", "--decline-amount=777", NULL};
  psp_t *p = psp_start(flags);
  resp_t first, again, r;
  (void)state;

  post(p, "k-d1", NULL, "{\"amount\": 402}", &first);
  assert_charge(&first, 402, "k-d1", 402, "BRL", "declined");
  assert_false(first.replayed);
  post(p, "k-d1", NULL, "{\"amount\": 402}", &again);
  assert_charge(&again, 402, "k-d1", 402, "BRL", "declined");
  assert_true(again.replayed);
  assert_string_equal(again.body, first.body);
  get_charge(p, "k-d1", &r);
  assert_charge(&r, 200, "k-d1", 402, "BRL", "declined");
  resp_free(&r);

  post(p, "k-d2", NULL, "{\"amount\": 777}", &r);
  assert_charge(&r, 402, "k-d2", 777, "BRL", "declined");
  resp_free(&r);
  post(p, "k-ok", NULL, "{\"amount\": 403}", &r);
  assert_charge(&r, 201, "k-ok", 403, "BRL", "succeeded");
  resp_free(&r);
  /* The header declines any amount... */
  post(p, "k-d3", "decline", "{\"amount\": 1234}", &r);
  assert_charge(&r, 402, "k-d3", 1234, "BRL", "declined");
  resp_free(&r);
  /* ...and replaces the flags: a listed amount goes through. */
  post(p, "k-d4", "none", "{\"amount\": 402}", &r);
  assert_charge(&r, 201, "k-d4", 402, "BRL", "succeeded");
  resp_free(&r);
  /* A declined key stays declined, even when the retry would pass. */
  post(p, "k-d3", "none", "{\"amount\": 1234}", &r);
  assert_charge(&r, 402, "k-d3", 1234, "BRL", "declined");
  assert_true(r.replayed);
  resp_free(&r);

  assert_int_equal(stat_of(p, NULL, "declines"), 3);
  assert_int_equal(stat_of(p, NULL, "charges"), 2);
  assert_int_equal(stat_of(p, "k-d1", "charges"), 0);
  assert_int_equal(stat_of(p, "k-d1", "declines"), 1);
  assert_int_equal(stat_of(p, "k-d1", "requests"), 2);
  resp_free(&first);
  resp_free(&again);
}

/* Flags (and their environment variables) are every request's default;
 * the header replaces them. */
static void test_flag_defaults(void **state) {
  const char *fail_before[] = {"--fail-before", NULL};
  const char *latency[] = {"--latency", "400ms", NULL};
  const char *env[] = {"IDEM_PSP_FAIL_AFTER=true", "IDEM_PSP_DECLINE_AMOUNT=55,66", NULL};
  psp_t *p = psp_start(fail_before);
  resp_t r;
  (void)state;

  post(p, "k-f1", NULL, "{\"amount\": 10}", &r);
  assert_error(&r, 500);
  resp_free(&r);
  get_charge(p, "k-f1", &r);
  assert_error(&r, 404);
  resp_free(&r);
  post(p, "k-f1", "none", "{\"amount\": 10}", &r);
  assert_charge(&r, 201, "k-f1", 10, "BRL", "succeeded");
  resp_free(&r);
  psp_stop(p);

  p = psp_start(latency);
  post(p, "k-f2", NULL, "{\"amount\": 10}", &r);
  assert_status(&r, 201);
  assert_true(r.seconds >= 0.39);
  resp_free(&r);
  psp_stop(p);

  p = psp_start_env(NULL, env);
  post(p, "k-f3", NULL, "{\"amount\": 10}", &r);
  assert_error(&r, 500);
  resp_free(&r);
  get_charge(p, "k-f3", &r);
  assert_charge(&r, 200, "k-f3", 10, "BRL", "succeeded");
  resp_free(&r);
  post(p, "k-f3", "none", "{\"amount\": 10}", &r);
  assert_charge(&r, 201, "k-f3", 10, "BRL", "succeeded");
  assert_true(r.replayed);
  resp_free(&r);
  post(p, "k-f4", NULL, "{\"amount\": 66}", &r);
  assert_error(&r, 500); /* declined, then fail-after */
  resp_free(&r);
  get_charge(p, "k-f4", &r);
  assert_charge(&r, 200, "k-f4", 66, "BRL", "declined");
  resp_free(&r);
}

static void test_bad_fault_header(void **state) {
  static const char *const bad[] = {
      "bogus", "latency",   "latency=", "latency=5m", "fail-before,,fail-after",
      ",",     "latency=-1"};
  psp_t *p = psp_start(NULL);
  resp_t r;
  (void)state;

  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    post(p, "k-bad", bad[i], "{\"amount\": 10}", &r);
    if (r.status != 400)
      fail_msg("X-Psp-Fault: %s: expected 400, got %ld", bad[i], r.status);
    assert_error(&r, 400);
    resp_free(&r);
  }
  assert_int_equal(stat_of(p, NULL, "charges"), 0);
  /* Spaces around tokens are fine. */
  post(p, "k-ok", " latency=10ms ,  fail-after ", "{\"amount\": 10}", &r);
  assert_error(&r, 500);
  resp_free(&r);
  assert_int_equal(stat_of(p, "k-ok", "charges"), 1);
}

/* ---- persistence ---------------------------------------------------------------- */

static void test_restart_keeps_charges(void **state) {
  psp_t *p = psp_start(NULL);
  char key[16], *ids[5];
  resp_t r;
  (void)state;

  for (int i = 0; i < 5; i++) {
    snprintf(key, sizeof key, "k-p%d", i);
    post(p, key, NULL, "{\"amount\": 900}", &r);
    assert_status(&r, 201);
    ids[i] = strdup(str_field(&r, "id"));
    resp_free(&r);
  }
  post(p, "k-pd", "decline", "{\"amount\": 901}", &r);
  assert_status(&r, 402);
  resp_free(&r);

  psp_kill9(p);
  assert_true(WIFSIGNALED(p->exit_status));
  psp_restart(p, NULL);

  for (int i = 0; i < 5; i++) {
    snprintf(key, sizeof key, "k-p%d", i);
    post(p, key, NULL, "{\"amount\": 900}", &r);
    assert_charge(&r, 201, key, 900, "BRL", "succeeded");
    assert_true(r.replayed);
    assert_string_equal(str_field(&r, "id"), ids[i]);
    resp_free(&r);
    free(ids[i]);
  }
  post(p, "k-pd", NULL, "{\"amount\": 901}", &r);
  assert_charge(&r, 402, "k-pd", 901, "BRL", "declined");
  resp_free(&r);
  assert_int_equal(stat_of(p, NULL, "charges"), 5);
  assert_int_equal(stat_of(p, NULL, "declines"), 1);
  assert_int_equal(stat_of(p, NULL, "requests"), 12);
  assert_int_equal(stat_of(p, "k-p0", "requests"), 2);

  /* And a clean stop and start, too. */
  psp_stop(p);
  psp_restart(p, NULL);
  assert_int_equal(stat_of(p, NULL, "charges"), 5);
}

/* ---- chaos --------------------------------------------------------------------- */

#define CHAOS_N 50

struct chaos_run {
  const psp_t *p;
  resp_t r[CHAOS_N];
};

static void *chaos_main(void *arg) {
  struct chaos_run *run = arg;
  for (int i = 0; i < CHAOS_N; i++) {
    char key[16];
    req_t q = {.key = key, .body = "{\"amount\": 1000}"};
    snprintf(key, sizeof key, "chaos-%02d", i);
    http(run->p, &q, &run->r[i]);
  }
  return NULL;
}

static void test_chaos(void **state) {
  const char *flags[] = {"--chaos", "0.5", "--seed", "42", NULL};
  const char *other_seed[] = {"--chaos", "0.5", "--seed", "43", NULL};
  struct chaos_run a = {0}, b = {0}, c = {0};
  pthread_t ta, tb, tc;
  psp_t *pa = psp_start(flags), *pb = psp_start(flags), *pc = psp_start(other_seed);
  json_t *la, *lb, *lc;
  int ok = 0, failed = 0, dropped = 0, chaos = 0, differs = 0;
  (void)state;

  /* Two servers with one seed, and one with another, driven side by side. */
  a.p = pa;
  b.p = pb;
  c.p = pc;
  assert_int_equal(pthread_create(&ta, NULL, chaos_main, &a), 0);
  assert_int_equal(pthread_create(&tb, NULL, chaos_main, &b), 0);
  assert_int_equal(pthread_create(&tc, NULL, chaos_main, &c), 0);
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
  pthread_join(tc, NULL);

  /* A request with the header is never touched by chaos. */
  for (int i = 0; i < 5; i++) {
    resp_t r;
    char key[16];
    snprintf(key, sizeof key, "plain-%d", i);
    post(pa, key, "none", "{\"amount\": 1}", &r);
    assert_status(&r, 201);
    resp_free(&r);
  }
  psp_stop(pa);
  psp_stop(pb);
  psp_stop(pc);
  la = log_lines(pa);
  lb = log_lines(pb);
  lc = log_lines(pc);
  psp_restart(pa, NULL);

  for (int i = 0; i < CHAOS_N; i++) {
    char key[16];
    json_t *ja, *jb;
    const char *fault;
    resp_t g;

    snprintf(key, sizeof key, "chaos-%02d", i);
    ja = post_log(la, key, 0);
    jb = post_log(lb, key, 0);
    fault = json_string_value(json_object_get(ja, "fault"));
    assert_non_null(fault);
    /* The same seed makes the same faults, to the millisecond. */
    assert_string_equal(fault, json_string_value(json_object_get(jb, "fault")));
    differs +=
        strcmp(fault,
               json_string_value(json_object_get(post_log(lc, key, 0), "fault"))) != 0;
    chaos += json_is_true(json_object_get(ja, "chaos"));
    assert_int_equal(json_is_true(json_object_get(ja, "chaos")),
                     strcmp(fault, "none") != 0);

    /* Each answer is what its fault says, and only fail-before charged nothing. */
    get_charge(pa, key, &g);
    if (strcmp(fault, "fail-before") == 0) {
      assert_error(&a.r[i], 500);
      assert_error(&g, 404);
      failed++;
    } else if (strcmp(fault, "fail-after") == 0) {
      assert_error(&a.r[i], 500);
      assert_status(&g, 200);
      failed++;
    } else if (strcmp(fault, "drop-after") == 0) {
      assert_no_answer(&a.r[i]);
      assert_status(&g, 200);
      dropped++;
    } else {
      int64_t ms = 0;
      if (strcmp(fault, "none") != 0) {
        assert_int_equal(sscanf(fault, "delay-after-charge=%" SCNd64 "ms", &ms), 1);
        assert_true(ms >= 100 && ms <= 1500);
        assert_true(a.r[i].seconds >= (double)ms / 1000 - 0.01);
      }
      assert_charge(&a.r[i], 201, key, 1000, "BRL", "succeeded");
      assert_status(&g, 200);
      ok++;
    }
    assert_int_equal(a.r[i].status, b.r[i].status);
    resp_free(&g);
    resp_free(&a.r[i]);
    resp_free(&b.r[i]);
    resp_free(&c.r[i]);
  }
  for (int i = 0; i < 5; i++) {
    char key[16];
    snprintf(key, sizeof key, "plain-%d", i);
    assert_false(json_is_true(json_object_get(post_log(la, key, 0), "chaos")));
  }
  assert_true(ok >= 1 && failed >= 1 && dropped >= 1);
  assert_true(chaos >= 10 && chaos <= 40);
  assert_true(differs >= 1);
  json_decref(la);
  json_decref(lb);
  json_decref(lc);
}

/* ---- stats, logs, signals, garbage ------------------------------------------------ */

static void test_stats_per_key(void **state) {
  psp_t *p = psp_start(NULL);
  json_t *s, *keys, *a;
  resp_t r;
  (void)state;

  for (int i = 0; i < 3; i++) {
    post(p, "A", NULL, "{\"amount\": 5}", &r);
    assert_status(&r, 201);
    resp_free(&r);
  }
  post(p, "B", "fail-before", "{\"amount\": 5}", &r);
  assert_status(&r, 500);
  resp_free(&r);
  post(p, "C", NULL, "{\"amount\": 0}", &r);
  assert_status(&r, 422);
  resp_free(&r);
  post(p, NULL, NULL, "{\"amount\": 5}", &r);
  assert_status(&r, 400);
  resp_free(&r);

  s = stats(p);
  assert_int_equal(json_integer_value(json_object_get(s, "charges")), 1);
  assert_int_equal(json_integer_value(json_object_get(s, "declines")), 0);
  assert_int_equal(json_integer_value(json_object_get(s, "requests")), 6);
  keys = json_object_get(s, "keys");
  assert_int_equal(json_object_size(keys), 3);
  a = json_object_get(keys, "A");
  assert_int_equal(json_integer_value(json_object_get(a, "requests")), 3);
  assert_int_equal(json_integer_value(json_object_get(a, "charges")), 1);
  assert_int_equal(
      json_integer_value(json_object_get(json_object_get(keys, "B"), "requests")), 1);
  assert_int_equal(
      json_integer_value(json_object_get(json_object_get(keys, "B"), "charges")), 0);
  assert_int_equal(
      json_integer_value(json_object_get(json_object_get(keys, "C"), "requests")), 1);
  assert_int_equal(
      json_integer_value(json_object_get(json_object_get(keys, "C"), "charges")), 0);
  json_decref(s);
}

static void test_log_lines(void **state) {
  psp_t *p = psp_start(NULL);
  json_t *lines, *j;
  resp_t r;
  (void)state;

  post(p, "log-1", "fail-before", "{\"amount\": 5}", &r);
  resp_free(&r);
  post(p, "log-2", "drop-after", "{\"amount\": 5}", &r);
  resp_free(&r);
  post(p, "log-2", NULL, "{\"amount\": 5}", &r);
  resp_free(&r);
  get_charge(p, "log-2", &r);
  resp_free(&r);
  psp_stop(p);

  lines = log_lines(p);
  assert_int_equal(json_array_size(lines), 4);
  j = post_log(lines, "log-1", 0);
  assert_string_equal(json_string_value(json_object_get(j, "path")), "/charges");
  assert_string_equal(json_string_value(json_object_get(j, "fault")), "fail-before");
  assert_int_equal(json_integer_value(json_object_get(j, "status")), 500);
  j = post_log(lines, "log-2", 0);
  assert_string_equal(json_string_value(json_object_get(j, "fault")), "drop-after");
  assert_true(json_is_null(json_object_get(j, "status")));
  j = post_log(lines, "log-2", 1);
  assert_string_equal(json_string_value(json_object_get(j, "fault")), "none");
  assert_int_equal(json_integer_value(json_object_get(j, "status")), 201);
  j = json_array_get(lines, 3);
  assert_string_equal(json_string_value(json_object_get(j, "method")), "GET");
  assert_string_equal(json_string_value(json_object_get(j, "path")), "/charges/log-2");
  assert_int_equal(json_integer_value(json_object_get(j, "status")), 200);
  json_decref(lines);
}

static void test_signals(void **state) {
  psp_t *p = psp_start(NULL);
  struct worker slow;
  pthread_t t;
  double t0;
  (void)state;

  psp_stop_with(p, SIGINT);

  /* SIGTERM does not wait for a long fault to run out. */
  psp_restart(p, NULL);
  slow = (struct worker){.p = p,
                         .q = {.key = "k-long",
                               .fault = "latency=60s",
                               .body = "{\"amount\": 1}",
                               .timeout_ms = 30000}};
  assert_int_equal(pthread_create(&t, NULL, worker_main, &slow), 0);
  nap_ms(300);
  t0 = now_s();
  psp_stop(p);
  assert_true(now_s() - t0 < 10.0);
  pthread_join(t, NULL);
  assert_true(slow.r.status == 503 || slow.r.status == 0);
  resp_free(&slow.r);

  /* The request it cut short made no charge. */
  psp_restart(p, NULL);
  assert_int_equal(stat_of(p, NULL, "charges"), 0);
}

/* Sends raw bytes and reads until the server closes or 2 s pass. */
static void raw_exchange(const psp_t *p, const char *bytes, size_t len) {
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)p->port)};
  struct timeval tv = {2, 0};
  char buf[4096];
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

  assert_true(fd >= 0);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  (void)send(fd, bytes, len, MSG_NOSIGNAL);
  shutdown(fd, SHUT_WR);
  while (recv(fd, buf, sizeof buf, 0) > 0)
    ;
  close(fd);
}

static void test_garbage(void **state) {
  static const char *const inputs[] = {
      "\x00\x01\x02garbage\r\n\r\n",
      "GET /charges/%zz%2 HTTP/1.1\r\nHost: x\r\n\r\n",
      "POST /charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: g1\r\n"
      "Content-Length: 5\r\n\r\n{\"amo",
      "POST /charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: g2\r\n"
      "Transfer-Encoding: chunked\r\n\r\nzz\r\n",
      "POST /charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: g3\r\n"
      "Content-Length: 99999999999\r\n\r\n{}",
      "POST /charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: g4\r\n"
      "Content-Length: 19\r\n\r\n{\"amount\":\"\\u0000\"}",
      "GET / HTTP/1.1\r\nHost: x\r\nX-Psp-Fault: \xff\xfe\r\n\r\n",
  };
  psp_t *p = psp_start(NULL);
  char *huge = malloc(200000);
  resp_t r;
  (void)state;

  for (size_t i = 0; i < sizeof inputs / sizeof *inputs; i++)
    raw_exchange(p, inputs[i], i == 0 ? 14 : strlen(inputs[i]));
  assert_non_null(huge);
  memset(huge, 'a', 200000);
  memcpy(huge, "GET /", 5);
  raw_exchange(p, huge, 200000);
  free(huge);

  get(p, "/healthz", &r);
  assert_status(&r, 200);
  resp_free(&r);
  assert_int_equal(stat_of(p, NULL, "charges"), 0);
}

/* ---- POST /refunds --------------------------------------------------------------- */

static void post_refund(const psp_t *p, const char *key, const char *fault,
                        const char *body, resp_t *out) {
  req_t q = {.path = "/refunds", .key = key, .fault = fault, .body = body};
  http(p, &q, out);
}

/* GET /refunds/{key} (key already URL-safe). */
static void get_refund(const psp_t *p, const char *key, resp_t *out) {
  char path[600];
  snprintf(path, sizeof path, "/refunds/%s", key);
  get(p, path, out);
}

static void assert_refund(const resp_t *r, long status, const char *key, const char *charge,
                          long long amount, const char *currency,
                          const char *refund_status) {
  assert_made(r, status, key, charge, amount, currency, refund_status);
}

/* Makes a charge of `amount` under `key` (201), for refunds to refund. */
static void make_charge(const psp_t *p, const char *key, long long amount,
                        const char *fault) {
  char body[64];
  resp_t r;
  snprintf(body, sizeof body, "{\"amount\": %lld}", amount);
  post(p, key, fault, body, &r);
  assert_status(&r, fault && strcmp(fault, "decline") == 0 ? 402 : 201);
  resp_free(&r);
}

/* {"charge": charge, "amount": amount}, in `out`. */
static const char *refund_body(char *out, size_t outlen, const char *charge,
                               long long amount) {
  snprintf(out, outlen, "{\"charge\": \"%s\", \"amount\": %lld}", charge, amount);
  return out;
}

static void test_refund_and_replay(void **state) {
  psp_t *p = psp_start(NULL);
  req_t head = {.method = "HEAD", .path = "/refunds/r-1"};
  resp_t first, again, r;
  (void)state;

  make_charge(p, "c-1", 10000, NULL);
  post_refund(p, "r-1", NULL, "{\"charge\": \"c-1\", \"amount\": 3000}", &first);
  assert_refund(&first, 201, "r-1", "c-1", 3000, "BRL", "succeeded");
  assert_false(first.replayed);

  /* Key order, whitespace and the charge's own currency do not matter. */
  post_refund(p, "r-1", NULL, "{\"currency\":\"BRL\",\"amount\":3000,\"charge\":\"c-1\"}",
              &again);
  assert_refund(&again, 201, "r-1", "c-1", 3000, "BRL", "succeeded");
  assert_true(again.replayed);
  assert_string_equal(again.body, first.body);
  resp_free(&again);

  /* Another amount, charge or currency under the key is 409 and changes
   * nothing. */
  post_refund(p, "r-1", NULL, "{\"charge\": \"c-1\", \"amount\": 3001}", &r);
  assert_error(&r, 409);
  resp_free(&r);
  make_charge(p, "c-2", 10000, NULL);
  post_refund(p, "r-1", NULL, "{\"charge\": \"c-2\", \"amount\": 3000}", &r);
  assert_error(&r, 409);
  resp_free(&r);
  post_refund(p, "r-1", NULL, "{\"charge\": \"c-1\", \"amount\": 3000, \"currency\": \"USD\"}",
              &r);
  assert_error(&r, 409);
  resp_free(&r);

  /* GET and HEAD by key; other keys, and a charge's key, are not refunds. */
  get_refund(p, "r-1", &r);
  assert_refund(&r, 200, "r-1", "c-1", 3000, "BRL", "succeeded");
  assert_string_equal(str_field(&r, "id"), str_field(&first, "id"));
  assert_false(r.replayed);
  resp_free(&r);
  http(p, &head, &r);
  assert_status(&r, 200);
  assert_int_equal(r.len, 0);
  resp_free(&r);
  get_refund(p, "r-2", &r);
  assert_error(&r, 404);
  assert_string_equal(str_field(&r, "error"), "no refund");
  resp_free(&r);
  get_refund(p, "c-1", &r);
  assert_error(&r, 404);
  resp_free(&r);
  get_refund(p, "", &r);
  assert_error(&r, 404);
  resp_free(&r);

  /* A refund key is not a charge key: "r-1" can still be charged. */
  make_charge(p, "r-1", 5, NULL);

  assert_int_equal(refund_stat(p, NULL, "refunds"), 1);
  assert_int_equal(refund_stat(p, NULL, "refund_declines"), 0);
  assert_int_equal(refund_stat(p, NULL, "refund_requests"), 5);
  assert_int_equal(refund_stat(p, "r-1", "requests"), 5);
  assert_int_equal(refund_stat(p, "r-1", "refunds"), 1);
  assert_int_equal(refund_stat(p, "r-1", "declines"), 0);
  assert_int_equal(stat_of(p, NULL, "charges"), 3);
  assert_int_equal(stat_of(p, NULL, "requests"), 3);
  resp_free(&first);
}

static void test_refund_validation(void **state) {
  static const char *const bad[] = {
      "",
      "not json",
      "[1, 2]",
      "{}",
      "{\"amount\": 100}",
      "{\"charge\": \"c-v\"}",
      "{\"charge\": \"\", \"amount\": 100}",
      "{\"charge\": 42, \"amount\": 100}",
      "{\"charge\": null, \"amount\": 100}",
      "{\"charge\": [\"c-v\"], \"amount\": 100}",
      "{\"charge\": \"c v\", \"amount\": 100}",
      "{\"charge\": \"caf\xc3\xa9\", \"amount\": 100}",
      "{\"charge\": \"c-v\", \"amount\": 0}",
      "{\"charge\": \"c-v\", \"amount\": -5}",
      "{\"charge\": \"c-v\", \"amount\": 1.5}",
      "{\"charge\": \"c-v\", \"amount\": \"100\"}",
      "{\"charge\": \"c-v\", \"amount\": 9007199254740992}",
      "{\"charge\": \"c-v\", \"amount\": 100, \"currency\": \"brl\"}",
      "{\"charge\": \"c-v\", \"amount\": 100, \"currency\": 986}",
      "{\"charge\": \"c-v\", \"charge\": \"c-w\", \"amount\": 100}",
      "{\"charge\": \"c-v\", \"amount\": 100",
  };
  psp_t *p = psp_start(NULL);
  char long_charge[400], body[512], *big;
  resp_t r;
  int n = 0;
  (void)state;

  make_charge(p, "c-v", 1000, NULL);
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++, n++) {
    post_refund(p, "r-v", NULL, bad[i], &r);
    if (r.status != 422)
      fail_msg("body %s: expected 422, got %ld", bad[i], r.status);
    assert_error(&r, 422);
    resp_free(&r);
  }
  memset(long_charge, 'c', 256);
  long_charge[256] = '\0';
  post_refund(p, "r-v", NULL, refund_body(body, sizeof body, long_charge, 100), &r);
  assert_error(&r, 422);
  resp_free(&r);
  n++;
  big = malloc(70 * 1024 + 64);
  assert_non_null(big);
  memset(big, ' ', 70 * 1024);
  strcpy(big + 70 * 1024, "{\"charge\": \"c-v\", \"amount\": 100}");
  post_refund(p, "r-v", NULL, big, &r);
  assert_error(&r, 413);
  resp_free(&r);
  free(big);
  n++;

  /* The key: as for charges. */
  post_refund(p, NULL, NULL, "{\"charge\": \"c-v\", \"amount\": 100}", &r);
  assert_error(&r, 400);
  assert_non_null(strstr(r.body, "required"));
  resp_free(&r);
  post_refund(p, "", NULL, "{\"charge\": \"c-v\", \"amount\": 100}", &r);
  assert_error(&r, 400);
  resp_free(&r);
  post_refund(p, "caf\xc3\xa9", NULL, "{\"charge\": \"c-v\", \"amount\": 100}", &r);
  assert_error(&r, 400);
  resp_free(&r);
  /* A malformed X-Psp-Fault, as for charges. */
  post_refund(p, "r-v", "bogus", "{\"charge\": \"c-v\", \"amount\": 100}", &r);
  assert_error(&r, 400);
  resp_free(&r);
  n++;

  /* Nothing was refunded or declined: the key is still free. */
  get_refund(p, "r-v", &r);
  assert_error(&r, 404);
  resp_free(&r);
  assert_int_equal(refund_stat(p, NULL, "refunds"), 0);
  assert_int_equal(refund_stat(p, NULL, "refund_declines"), 0);
  assert_int_equal(refund_stat(p, "r-v", "requests"), n);
  assert_int_equal(refund_stat(p, NULL, "refund_requests"), n + 3);
  /* The longest charge key is fine; other fields are ignored. */
  long_charge[255] = '\0';
  post_refund(p, "r-long", NULL, refund_body(body, sizeof body, long_charge, 100), &r);
  assert_refund(&r, 402, "r-long", long_charge, 100, "BRL", "declined");
  resp_free(&r);
  post_refund(p, "r-v", NULL, "{\"charge\": \"c-v\", \"amount\": 100, \"note\": \"x\"}", &r);
  assert_refund(&r, 201, "r-v", "c-v", 100, "BRL", "succeeded");
  assert_false(r.replayed);
  resp_free(&r);
}

static void test_one_refund_per_key(void **state) {
  psp_t *p = psp_start(NULL);
  struct worker w[TOGETHER];
  int fresh = 0;
  (void)state;

  make_charge(p, "c-race", 1000, NULL);
  for (int i = 0; i < TOGETHER; i++)
    w[i] = (struct worker){.p = p,
                           .q = {.path = "/refunds",
                                 .key = "r-race",
                                 .body = "{\"charge\": \"c-race\", \"amount\": 700}"}};
  run_together(w, TOGETHER);

  for (int i = 0; i < TOGETHER; i++) {
    assert_refund(&w[i].r, 201, "r-race", "c-race", 700, "BRL", "succeeded");
    assert_string_equal(str_field(&w[i].r, "id"), str_field(&w[0].r, "id"));
    fresh += !w[i].r.replayed;
  }
  assert_int_equal(fresh, 1);
  assert_int_equal(refund_stat(p, NULL, "refunds"), 1);
  assert_int_equal(refund_stat(p, NULL, "refund_declines"), 0);
  assert_int_equal(refund_stat(p, "r-race", "requests"), TOGETHER);
  assert_int_equal(refund_stat(p, "r-race", "refunds"), 1);
  for (int i = 0; i < TOGETHER; i++)
    resp_free(&w[i].r);
}

/* Twenty refunds of a tenth of a charge, under twenty keys at once: ten
 * refund it all, ten are declined, and nothing is left. */
static void test_refunds_never_exceed_the_charge(void **state) {
  psp_t *p = psp_start(NULL);
  struct worker w[TOGETHER];
  char keys[TOGETHER][16], body[64];
  int succeeded = 0, declined = 0;
  resp_t r;
  (void)state;

  make_charge(p, "c-split", 10000, NULL);
  for (int i = 0; i < TOGETHER; i++) {
    snprintf(keys[i], sizeof keys[i], "r-split-%02d", i);
    w[i] = (struct worker){.p = p,
                           .q = {.path = "/refunds",
                                 .key = keys[i],
                                 .body = "{\"charge\": \"c-split\", \"amount\": 1000}"}};
  }
  run_together(w, TOGETHER);

  for (int i = 0; i < TOGETHER; i++) {
    const char *status = w[i].r.status == 201 ? "succeeded" : "declined";
    assert_refund(&w[i].r, w[i].r.status == 201 ? 201 : 402, keys[i], "c-split", 1000,
                  "BRL", status);
    assert_false(w[i].r.replayed);
    succeeded += w[i].r.status == 201;
    declined += w[i].r.status == 402;
    /* What each was answered is what was stored. */
    get_refund(p, keys[i], &r);
    assert_refund(&r, 200, keys[i], "c-split", 1000, "BRL", status);
    resp_free(&r);
    resp_free(&w[i].r);
  }
  assert_int_equal(succeeded, 10);
  assert_int_equal(declined, 10);
  assert_int_equal(refund_stat(p, NULL, "refunds"), 10);
  assert_int_equal(refund_stat(p, NULL, "refund_declines"), 10);
  post_refund(p, "r-split-last", NULL, refund_body(body, sizeof body, "c-split", 1), &r);
  assert_refund(&r, 402, "r-split-last", "c-split", 1, "BRL", "declined");
  resp_free(&r);
}

static void test_refund_declines(void **state) {
  const char *flags[] = {"--decline-amount", "402", NULL};
  psp_t *p = psp_start(flags);
  char body[128];
  resp_t first, r;
  (void)state;

  make_charge(p, "c-ok", 1000, NULL);
  make_charge(p, "c-declined", 1000, "decline");

  /* No such charge: declined, stored and replayed... */
  post_refund(p, "r-d1", NULL, refund_body(body, sizeof body, "c-later", 100), &first);
  assert_refund(&first, 402, "r-d1", "c-later", 100, "BRL", "declined");
  assert_false(first.replayed);
  /* ...even once the charge exists: one decision per key, ever. */
  make_charge(p, "c-later", 1000, NULL);
  post_refund(p, "r-d1", NULL, refund_body(body, sizeof body, "c-later", 100), &r);
  assert_refund(&r, 402, "r-d1", "c-later", 100, "BRL", "declined");
  assert_true(r.replayed);
  assert_string_equal(r.body, first.body);
  resp_free(&r);
  get_refund(p, "r-d1", &r);
  assert_refund(&r, 200, "r-d1", "c-later", 100, "BRL", "declined");
  resp_free(&r);

  /* A declined charge, more than the charge, another currency. */
  post_refund(p, "r-d2", NULL, refund_body(body, sizeof body, "c-declined", 100), &r);
  assert_refund(&r, 402, "r-d2", "c-declined", 100, "BRL", "declined");
  resp_free(&r);
  post_refund(p, "r-d3", NULL, refund_body(body, sizeof body, "c-ok", 1001), &r);
  assert_refund(&r, 402, "r-d3", "c-ok", 1001, "BRL", "declined");
  resp_free(&r);
  post_refund(p, "r-d4", NULL,
              "{\"charge\": \"c-ok\", \"amount\": 100, \"currency\": \"USD\"}", &r);
  assert_refund(&r, 402, "r-d4", "c-ok", 100, "USD", "declined");
  resp_free(&r);
  /* --decline-amount and the decline fault, as for charges; the header
   * replaces the flag. */
  post_refund(p, "r-d5", NULL, refund_body(body, sizeof body, "c-ok", 402), &r);
  assert_refund(&r, 402, "r-d5", "c-ok", 402, "BRL", "declined");
  resp_free(&r);
  post_refund(p, "r-d6", "decline", refund_body(body, sizeof body, "c-ok", 10), &r);
  assert_refund(&r, 402, "r-d6", "c-ok", 10, "BRL", "declined");
  resp_free(&r);

  /* Declined refunds took nothing: the whole charge is still there. */
  post_refund(p, "r-ok", "none", refund_body(body, sizeof body, "c-ok", 1000), &r);
  assert_refund(&r, 201, "r-ok", "c-ok", 1000, "BRL", "succeeded");
  resp_free(&r);
  post_refund(p, "r-none-left", NULL, refund_body(body, sizeof body, "c-ok", 1), &r);
  assert_refund(&r, 402, "r-none-left", "c-ok", 1, "BRL", "declined");
  resp_free(&r);

  assert_int_equal(refund_stat(p, NULL, "refunds"), 1);
  assert_int_equal(refund_stat(p, NULL, "refund_declines"), 7);
  assert_int_equal(refund_stat(p, "r-d1", "declines"), 1);
  assert_int_equal(refund_stat(p, "r-d1", "refunds"), 0);
  assert_int_equal(refund_stat(p, "r-d1", "requests"), 2);
  /* Refunds never change their charge. */
  get_charge(p, "c-ok", &r);
  assert_charge(&r, 200, "c-ok", 1000, "BRL", "succeeded");
  resp_free(&r);
  resp_free(&first);
}

/* Each fault of POST /charges on POST /refunds: the same effect, the same
 * log line. */
static void test_refund_faults(void **state) {
  psp_t *p = psp_start(NULL);
  req_t late = {.path = "/refunds",
                .key = "r-dac",
                .fault = "delay-after-charge=1500ms",
                .body = "{\"charge\": \"c-f\", \"amount\": 4}",
                .timeout_ms = 300};
  char body[128];
  json_t *lines, *j;
  resp_t r;
  int status;
  (void)state;

  make_charge(p, "c-f", 100, NULL);

  /* fail-before: 500 and nothing stored; the retry is the first refund. */
  post_refund(p, "r-fb", "fail-before", refund_body(body, sizeof body, "c-f", 1), &r);
  assert_error(&r, 500);
  resp_free(&r);
  get_refund(p, "r-fb", &r);
  assert_error(&r, 404);
  resp_free(&r);
  assert_int_equal(refund_stat(p, "r-fb", "refunds"), 0);
  assert_int_equal(refund_stat(p, "r-fb", "declines"), 0);
  post_refund(p, "r-fb", NULL, body, &r);
  assert_refund(&r, 201, "r-fb", "c-f", 1, "BRL", "succeeded");
  assert_false(r.replayed);
  resp_free(&r);

  /* fail-after and drop-after: refunded, the answer lost. */
  post_refund(p, "r-fa", "fail-after", refund_body(body, sizeof body, "c-f", 2), &r);
  assert_error(&r, 500);
  resp_free(&r);
  assert_made_once(p, "r-fa", "c-f", 2);
  post_refund(p, "r-da", "drop-after", refund_body(body, sizeof body, "c-f", 3), &r);
  assert_no_answer(&r);
  resp_free(&r);
  assert_made_once(p, "r-da", "c-f", 3);

  /* delay-after-charge: refunded before the caller's deadline passed. */
  http(p, &late, &r);
  assert_no_answer(&r);
  assert_int_equal(r.err, CURLE_OPERATION_TIMEDOUT);
  resp_free(&r);
  get_refund(p, "r-dac", &r);
  assert_refund(&r, 200, "r-dac", "c-f", 4, "BRL", "succeeded");
  resp_free(&r);

  /* crash-after: refunded, exit 3, there after the restart. */
  post_refund(p, "r-ca", "crash-after", refund_body(body, sizeof body, "c-f", 5), &r);
  assert_no_answer(&r);
  resp_free(&r);
  status = wait_exit(p->pid, 10);
  assert_true(status != -1);
  p->running = 0;
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 3);
  lines = log_lines(p);
  psp_restart(p, NULL);
  assert_made_once(p, "r-ca", "c-f", 5);
  assert_made_once(p, "r-dac", "c-f", 4);
  assert_int_equal(refund_stat(p, NULL, "refunds"), 5);
  assert_int_equal(refund_stat(p, "r-ca", "requests"), 2);

  /* Logged as for charges: the path, the fault, and no status when
   * nothing was answered. */
  j = post_log(lines, "r-fb", 0);
  assert_string_equal(json_string_value(json_object_get(j, "path")), "/refunds");
  assert_string_equal(json_string_value(json_object_get(j, "fault")), "fail-before");
  assert_int_equal(json_integer_value(json_object_get(j, "status")), 500);
  j = post_log(lines, "r-da", 0);
  assert_string_equal(json_string_value(json_object_get(j, "fault")), "drop-after");
  assert_true(json_is_null(json_object_get(j, "status")));
  j = post_log(lines, "r-ca", 0);
  assert_string_equal(json_string_value(json_object_get(j, "fault")), "crash-after");
  assert_true(json_is_null(json_object_get(j, "status")));
  json_decref(lines);
}

/* The fault flags (and --chaos) act on refunds as on charges. */
static void test_refund_fault_flags(void **state) {
  const char *fail_before[] = {"--fail-before", NULL};
  const char *chaos[] = {"--chaos", "1", "--seed", "7", NULL};
  psp_t *p = psp_start(fail_before);
  char body[128], key[16];
  json_t *lines;
  resp_t r;
  (void)state;

  make_charge(p, "c-flags", 1000, "none");
  post_refund(p, "r-flag", NULL, refund_body(body, sizeof body, "c-flags", 1), &r);
  assert_error(&r, 500);
  resp_free(&r);
  get_refund(p, "r-flag", &r);
  assert_error(&r, 404);
  resp_free(&r);
  psp_stop(p);

  psp_restart(p, chaos);
  for (int i = 0; i < 8; i++) {
    snprintf(key, sizeof key, "r-chaos-%d", i);
    post_refund(p, key, NULL, refund_body(body, sizeof body, "c-flags", 1), &r);
    resp_free(&r);
  }
  psp_stop(p);
  lines = log_lines(p);
  psp_restart(p, NULL);
  for (int i = 0; i < 8; i++) {
    json_t *j;
    const char *fault;
    snprintf(key, sizeof key, "r-chaos-%d", i);
    j = post_log(lines, key, 0);
    fault = json_string_value(json_object_get(j, "fault"));
    /* Every request drew a fault; only fail-before refunded nothing. */
    assert_true(json_is_true(json_object_get(j, "chaos")));
    assert_non_null(fault);
    assert_string_not_equal(fault, "none");
    get_refund(p, key, &r);
    assert_status(&r, strcmp(fault, "fail-before") == 0 ? 404 : 200);
    resp_free(&r);
  }
  json_decref(lines);
}

static void test_restart_keeps_refunds(void **state) {
  psp_t *p = psp_start(NULL);
  char body[128], *id;
  resp_t r;
  (void)state;

  make_charge(p, "c-p", 1000, NULL);
  post_refund(p, "r-p1", NULL, refund_body(body, sizeof body, "c-p", 600), &r);
  assert_status(&r, 201);
  id = strdup(str_field(&r, "id"));
  resp_free(&r);
  post_refund(p, "r-pd", NULL, refund_body(body, sizeof body, "c-none", 1), &r);
  assert_status(&r, 402);
  resp_free(&r);

  psp_kill9(p);
  assert_true(WIFSIGNALED(p->exit_status));
  psp_restart(p, NULL);

  post_refund(p, "r-p1", NULL, refund_body(body, sizeof body, "c-p", 600), &r);
  assert_refund(&r, 201, "r-p1", "c-p", 600, "BRL", "succeeded");
  assert_true(r.replayed);
  assert_string_equal(str_field(&r, "id"), id);
  resp_free(&r);
  free(id);
  post_refund(p, "r-pd", NULL, refund_body(body, sizeof body, "c-none", 1), &r);
  assert_refund(&r, 402, "r-pd", "c-none", 1, "BRL", "declined");
  assert_true(r.replayed);
  resp_free(&r);
  /* What was refunded before the crash still counts against the charge. */
  post_refund(p, "r-p2", NULL, refund_body(body, sizeof body, "c-p", 401), &r);
  assert_refund(&r, 402, "r-p2", "c-p", 401, "BRL", "declined");
  resp_free(&r);
  post_refund(p, "r-p3", NULL, refund_body(body, sizeof body, "c-p", 400), &r);
  assert_refund(&r, 201, "r-p3", "c-p", 400, "BRL", "succeeded");
  resp_free(&r);
  assert_int_equal(refund_stat(p, NULL, "refunds"), 2);
  assert_int_equal(refund_stat(p, NULL, "refund_declines"), 2);
  assert_int_equal(refund_stat(p, NULL, "refund_requests"), 6);
  assert_int_equal(refund_stat(p, "r-p1", "requests"), 2);
}

/* ---- webhooks ------------------------------------------------------------------ */

#define HOOK_SECRET "whsec_test_0123"
#define HOOK_WAIT_S 30.0

/* Starts the receiver, then idem-psp sending to it with `extra` flags. */
static psp_t *psp_start_hooked(const char *const *extra) {
  static char url[64];
  const char *flags[MAX_ARGS];
  int n = 0;

  assert_int_equal(hook_receiver_start(&receiver), 0);
  receiver_running = 1;
  snprintf(url, sizeof url, "http://127.0.0.1:%d/hook", receiver.port);
  flags[n++] = "--webhook-url";
  flags[n++] = url;
  flags[n++] = "--webhook-secret";
  flags[n++] = HOOK_SECRET;
  for (int i = 0; extra && extra[i]; i++)
    flags[n++] = extra[i];
  flags[n] = NULL;
  return psp_start(flags);
}

/* Waits for `n` deliveries, failing unless they all came. */
static void wait_deliveries(int n) {
  int got = hook_receiver_wait(&receiver, n, HOOK_WAIT_S);
  if (got < n)
    fail_msg("%d webhook deliveries after %.0f s, expected %d", got, HOOK_WAIT_S, n);
}

/* Delivery `i`, checked as idemd checks it: the signature verifies under
 * the shared secret (and not under another), the body is an event idemd
 * reads, with exactly the fields of docs/payments.md. */
static void delivery_event(int i, idem_webhook_event_t *ev, hook_delivery_t *out) {
  hook_delivery_t d = hook_receiver_get(&receiver, i);
  idem_hmac_t *good = idem_hmac_new(HOOK_SECRET, strlen(HOOK_SECRET));
  idem_hmac_t *bad = idem_hmac_new("another secret", 14);
  const char *why = NULL;
  json_t *j = json_loads(d.body, 0, NULL), *data = json_object_get(j, "data");
  int64_t now = (int64_t)time(NULL);

  assert_non_null(good);
  assert_non_null(bad);
  assert_non_null(strstr(d.path, "POST /hook "));
  if (idem_webhook_verify(good, d.signature, d.body, strlen(d.body), now) !=
      IDEM_WEBHOOK_OK)
    fail_msg("delivery %d: signature '%s' does not verify for %s", i, d.signature, d.body);
  assert_int_equal(idem_webhook_verify(bad, d.signature, d.body, strlen(d.body), now),
                   IDEM_WEBHOOK_FORGED);
  if (idem_webhook_parse(d.body, strlen(d.body), ev, &why) != 0)
    fail_msg("delivery %d: %s: %s", i, why, d.body);
  assert_int_equal(json_object_size(j), 4);
  assert_int_equal(json_object_size(data), 3);
  idem_hmac_free(good);
  idem_hmac_free(bad);
  json_decref(j);
  if (out)
    *out = d;
  else
    free(d.body);
}

/* The id of what a POST made (malloc'd). */
static char *made_id(const psp_t *p, const char *path, const char *key, const char *fault,
                     const char *body, long status) {
  req_t q = {.path = path, .key = key, .fault = fault, .body = body};
  resp_t r;
  char *id;
  http(p, &q, &r);
  assert_status(&r, status);
  id = strdup(str_field(&r, "id"));
  resp_free(&r);
  return id;
}

static void test_webhook_events(void **state) {
  psp_t *p = psp_start_hooked(NULL);
  char body[128];
  struct {
    const char *key;
    int refund, succeeded;
    long long amount;
    char *id;
  } made[] = {
      {"pay_wh1", 0, 1, 1000, NULL},
      {"pay_wh2", 0, 0, 500, NULL},
      {"re_wh1", 1, 1, 400, NULL},
      {"re_wh2", 1, 0, 100, NULL},
      {"pay_wh3", 0, 1, 700, NULL},
  };
  const size_t nmade = sizeof made / sizeof *made;
  char ids[8][65];
  resp_t r;
  (void)state;

  made[0].id = made_id(p, "/charges", "pay_wh1", NULL, "{\"amount\": 1000}", 201);
  made[1].id = made_id(p, "/charges", "pay_wh2", "decline", "{\"amount\": 500}", 402);
  made[2].id = made_id(p, "/refunds", "re_wh1", NULL,
                       refund_body(body, sizeof body, "pay_wh1", 400), 201);
  /* Declined: the charge refunded was declined. */
  made[3].id = made_id(p, "/refunds", "re_wh2", NULL,
                       refund_body(body, sizeof body, "pay_wh2", 100), 402);
  wait_deliveries(4);
  /* Replays make no event: the next charge's event comes next. */
  post(p, "pay_wh1", NULL, "{\"amount\": 1000}", &r);
  assert_status(&r, 201);
  assert_true(r.replayed);
  resp_free(&r);
  post_refund(p, "re_wh1", NULL, refund_body(body, sizeof body, "pay_wh1", 400), &r);
  assert_status(&r, 201);
  resp_free(&r);
  made[4].id = made_id(p, "/charges", "pay_wh3", NULL, "{\"amount\": 700}", 201);
  wait_deliveries(5);

  /* In order, once each: no chaos, no failures. */
  for (size_t i = 0; i < nmade; i++) {
    idem_webhook_event_t ev;
    delivery_event((int)i, &ev, NULL);
    assert_string_equal(ev.key, made[i].key);
    assert_int_equal(ev.refund, made[i].refund);
    assert_int_equal(ev.succeeded, made[i].succeeded);
    assert_string_equal(ev.provider_ref, made[i].id);
    assert_int_equal(ev.amount, made[i].amount);
    assert_true(ev.created > 0);
    snprintf(ids[i], sizeof ids[i], "%s", ev.id);
    for (size_t k = 0; k < i; k++)
      assert_string_not_equal(ids[k], ids[i]);
  }
  assert_int_equal(hook_receiver_wait(&receiver, 6, 0), 5);
  for (size_t i = 0; i < nmade; i++)
    free(made[i].id);
}

static void test_webhook_retries(void **state) {
  psp_t *p;
  hook_delivery_t first, d;
  idem_webhook_event_t ev;
  (void)state;

  receiver.fail_first = 3;
  p = psp_start_hooked(NULL);
  make_charge(p, "pay_retry1", 1200, NULL);
  wait_deliveries(4);
  delivery_event(0, &ev, &first);
  assert_string_equal(ev.key, "pay_retry1");
  for (int i = 0; i < 4; i++) {
    delivery_event(i, &ev, &d);
    /* The same event each time, signed again. */
    assert_string_equal(d.body, first.body);
    assert_int_equal(d.status, i < 3 ? 500 : 200);
    free(d.body);
  }
  free(first.body);
  /* Answered 2xx: never sent again; the next event is the next charge's. */
  make_charge(p, "pay_retry2", 1300, NULL);
  wait_deliveries(5);
  delivery_event(4, &ev, NULL);
  assert_string_equal(ev.key, "pay_retry2");
  assert_int_equal(hook_receiver_wait(&receiver, 6, 0), 5);
}

static void test_webhook_duplicates(void **state) {
  const char *flags[] = {"--webhook-duplicates", "1", NULL};
  psp_t *p = psp_start_hooked(flags);
  const char *keys[] = {"pay_dup1", "pay_dup2", "pay_dup3"};
  (void)state;

  for (int k = 0; k < 3; k++)
    make_charge(p, keys[k], 100 + k, NULL);
  wait_deliveries(6);
  /* Each event twice, the copies alike, one event per charge. */
  for (int k = 0; k < 3; k++) {
    hook_delivery_t a, b;
    idem_webhook_event_t ea, eb;
    delivery_event(2 * k, &ea, &a);
    delivery_event(2 * k + 1, &eb, &b);
    assert_string_equal(ea.key, keys[k]);
    assert_string_equal(ea.id, eb.id);
    assert_string_equal(a.body, b.body);
    free(a.body);
    free(b.body);
  }
  make_charge(p, "pay_dup4", 104, NULL);
  wait_deliveries(8);
  assert_int_equal(hook_receiver_wait(&receiver, 9, 0), 8);
}

/* A provider that ignores keys names what it made by the merchant's
 * reference. */
static void test_webhook_ignored_key(void **state) {
  const char *flags[] = {"--ignore-idempotency-key", NULL};
  psp_t *p = psp_start_hooked(flags);
  char body[160], *id;
  idem_webhook_event_t ev;
  (void)state;

  id = made_id(p, "/charges", "pay_ign_hook", NULL,
               "{\"amount\": 900, \"reference\": \"pay_ign_hook\"}", 201);
  wait_deliveries(1);
  delivery_event(0, &ev, NULL);
  assert_string_equal(ev.key, "pay_ign_hook");
  assert_string_equal(ev.provider_ref, id);
  free(id);
  snprintf(body, sizeof body,
           "{\"charge\": \"pay_ign_hook\", \"amount\": 400, \"reference\": \"re_ign_hook\"}");
  id = made_id(p, "/refunds", "re_ign_hook", NULL, body, 201);
  wait_deliveries(2);
  delivery_event(1, &ev, NULL);
  assert_string_equal(ev.key, "re_ign_hook");
  assert_true(ev.refund && ev.succeeded);
  assert_string_equal(ev.provider_ref, id);
  free(id);
}

/* --chaos delays deliveries at random: all arrive, in another order. */
static void test_webhook_chaos(void **state) {
  const char *flags[] = {"--chaos", "1", "--seed", "42", NULL};
  enum { N = 12 };
  psp_t *p = psp_start_hooked(flags);
  int seen[N] = {0}, inversions = 0, prev = -1;
  char key[32];
  (void)state;

  for (int i = 0; i < N; i++) {
    snprintf(key, sizeof key, "pay_chaos%02d", i);
    /* The header keeps --chaos off the charge itself, not off its event. */
    make_charge(p, key, 100 + i, "none");
  }
  wait_deliveries(N);
  for (int i = 0; i < N; i++) {
    idem_webhook_event_t ev;
    int k;
    delivery_event(i, &ev, NULL);
    assert_int_equal(sscanf(ev.key, "pay_chaos%d", &k), 1);
    assert_true(k >= 0 && k < N);
    seen[k]++;
    inversions += k < prev;
    prev = k;
  }
  for (int k = 0; k < N; k++)
    assert_int_equal(seen[k], 1);
  if (inversions == 0)
    fail_msg("%d events under --chaos 1 arrived in the order they were made", N);
}

/* A receiver that never answers: SIGTERM still stops idem-psp at once and
 * cleanly, the delivery in flight counted unsent. */
static void test_webhook_stop(void **state) {
  psp_t *p;
  char *text;
  (void)state;

  receiver.hang = 1;
  p = psp_start_hooked(NULL);
  make_charge(p, "pay_hang1", 100, NULL);
  wait_deliveries(1);
  psp_stop(p);
  text = read_file(p->log);
  assert_non_null(text);
  assert_non_null(strstr(text, "{\"event\":\"webhooks_stopped\",\"unsent\":1}"));
  assert_null(strstr(text, HOOK_SECRET));
  free(text);
}

/* ---- merchant references and --ignore-idempotency-key ----------------------------- */

/* GET /charges?reference=R (or /refunds): the array, failing unless 200. */
static json_t *listed(const psp_t *p, const char *what, const char *reference) {
  char path[600];
  resp_t r;
  json_t *list;
  snprintf(path, sizeof path, "/%s?reference=%s", what, reference);
  get(p, path, &r);
  assert_status(&r, 200);
  assert_int_equal(json_object_size(r.json), 1);
  list = json_incref(json_object_get(r.json, what));
  resp_free(&r);
  assert_true(json_is_array(list));
  return list;
}

static const char *item_str(json_t *list, size_t i, const char *name) {
  const char *v = json_string_value(json_object_get(json_array_get(list, i), name));
  if (v == NULL)
    fail_msg("no string \"%s\" in item %zu of the list", name, i);
  return v;
}

static void test_reference(void **state) {
  psp_t *p = psp_start(NULL);
  const char *bad_bodies[] = {
      "{\"amount\": 100, \"reference\": 5}",
      "{\"amount\": 100, \"reference\": \"\"}",
      "{\"amount\": 100, \"reference\": \"a b\"}",
      "{\"amount\": 100, \"reference\": \"a\\u0000b\"}",
  };
  const char *bad_queries[] = {"/charges?reference=", "/charges?other=x",
                               "/refunds?reference=", "/charges?reference=%01"};
  char *id;
  json_t *list;
  resp_t r;
  (void)state;

  id = made_id(p, "/charges", "pay_ref1", NULL,
               "{\"amount\": 1000, \"reference\": \"pay_ref1\"}", 201);
  post(p, "pay_ref1", NULL, "{\"amount\": 1000, \"reference\": \"pay_ref1\"}", &r);
  assert_status(&r, 201);
  assert_true(r.replayed);
  assert_string_equal(str_field(&r, "reference"), "pay_ref1");
  assert_string_equal(str_field(&r, "key"), "pay_ref1");
  resp_free(&r);
  list = listed(p, "charges", "pay_ref1");
  assert_int_equal(json_array_size(list), 1);
  assert_string_equal(item_str(list, 0, "id"), id);
  assert_string_equal(item_str(list, 0, "status"), "succeeded");
  json_decref(list);
  free(id);

  id = made_id(p, "/refunds", "re_ref1", NULL,
               "{\"charge\": \"pay_ref1\", \"amount\": 300, \"reference\": \"re_ref1\"}",
               201);
  list = listed(p, "refunds", "re_ref1");
  assert_int_equal(json_array_size(list), 1);
  assert_string_equal(item_str(list, 0, "id"), id);
  assert_string_equal(item_str(list, 0, "charge"), "pay_ref1");
  json_decref(list);
  free(id);

  /* Nothing under another reference, and a charge's is not a refund's. */
  list = listed(p, "charges", "pay_nothing");
  assert_int_equal(json_array_size(list), 0);
  json_decref(list);
  list = listed(p, "refunds", "pay_ref1");
  assert_int_equal(json_array_size(list), 0);
  json_decref(list);

  for (size_t i = 0; i < sizeof bad_bodies / sizeof *bad_bodies; i++) {
    post(p, "pay_ref_bad", NULL, bad_bodies[i], &r);
    assert_error(&r, 422);
    resp_free(&r);
  }
  for (size_t i = 0; i < sizeof bad_queries / sizeof *bad_queries; i++) {
    get(p, bad_queries[i], &r);
    assert_error(&r, 400);
    resp_free(&r);
  }
  assert_int_equal(stat_of(p, NULL, "charges"), 1);
  assert_int_equal(stat_in(p, "references", "pay_ref1", "charges"), 1);
  assert_int_equal(stat_in(p, "references", "pay_nothing", "charges"), -1);
  assert_int_equal(stat_in(p, "refund_references", "re_ref1", "refunds"), 1);
}

/* A provider that ignores keys: every POST makes a new charge or refund,
 * found only by its reference. */
static void test_ignore_idempotency_key(void **state) {
  const char *flags[] = {"--ignore-idempotency-key", NULL};
  psp_t *p = psp_start(flags);
  const char *charge = "{\"amount\": 1000, \"reference\": \"pay_ign1\"}";
  const char *refund =
      "{\"charge\": \"pay_ign1\", \"amount\": 300, \"reference\": \"re_ign1\"}";
  char *first, *second;
  json_t *list;
  resp_t r;
  (void)state;

  first = made_id(p, "/charges", "pay_ign1", NULL, charge, 201);
  post(p, "pay_ign1", NULL, charge, &r);
  assert_status(&r, 201);
  assert_false(r.replayed);
  assert_true(json_is_null(json_object_get(r.json, "key")));
  assert_string_equal(str_field(&r, "reference"), "pay_ign1");
  second = strdup(str_field(&r, "id"));
  resp_free(&r);
  assert_string_not_equal(first, second);
  /* No key needed, and a lost answer still charged. */
  post(p, NULL, NULL, charge, &r);
  assert_status(&r, 201);
  resp_free(&r);
  post(p, "pay_ign1", "drop-after", charge, &r);
  assert_no_answer(&r);
  resp_free(&r);

  list = listed(p, "charges", "pay_ign1");
  assert_int_equal(json_array_size(list), 4);
  assert_string_equal(item_str(list, 0, "id"), first);
  assert_string_equal(item_str(list, 1, "id"), second);
  json_decref(list);
  get_charge(p, "pay_ign1", &r);
  assert_error(&r, 404);
  resp_free(&r);
  assert_int_equal(stat_of(p, NULL, "charges"), 4);
  assert_int_equal(stat_in(p, "references", "pay_ign1", "charges"), 4);
  assert_int_equal(stat_in(p, "references", "pay_ign1", "declines"), 0);

  /* Refunds of the charge named by its reference, each a new one, never
   * more than the charge refunded. */
  for (int i = 0; i < 4; i++) {
    post_refund(p, "re_ign1", NULL, refund, &r);
    assert_status(&r, i < 3 ? 201 : 402);
    assert_string_equal(str_field(&r, "charge"), "pay_ign1");
    resp_free(&r);
  }
  list = listed(p, "refunds", "re_ign1");
  assert_int_equal(json_array_size(list), 4);
  assert_string_equal(item_str(list, 3, "status"), "declined");
  json_decref(list);
  assert_int_equal(stat_in(p, "refund_references", "re_ign1", "refunds"), 3);
  assert_int_equal(stat_in(p, "refund_references", "re_ign1", "declines"), 1);
  free(first);
  free(second);
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_usage, teardown),
      cmocka_unit_test_teardown(test_routes, teardown),
      cmocka_unit_test_teardown(test_charge_and_replay, teardown),
      cmocka_unit_test_teardown(test_key_validation, teardown),
      cmocka_unit_test_teardown(test_body_validation, teardown),
      cmocka_unit_test_teardown(test_mismatch, teardown),
      cmocka_unit_test_teardown(test_get_charge, teardown),
      cmocka_unit_test_teardown(test_one_charge_per_key, teardown),
      cmocka_unit_test_teardown(test_latency_does_not_block, teardown),
      cmocka_unit_test_teardown(test_fail_before, teardown),
      cmocka_unit_test_teardown(test_fail_after, teardown),
      cmocka_unit_test_teardown(test_drop_after, teardown),
      cmocka_unit_test_teardown(test_delay_after_charge, teardown),
      cmocka_unit_test_teardown(test_crash_after, teardown),
      cmocka_unit_test_teardown(test_decline, teardown),
      cmocka_unit_test_teardown(test_flag_defaults, teardown),
      cmocka_unit_test_teardown(test_bad_fault_header, teardown),
      cmocka_unit_test_teardown(test_restart_keeps_charges, teardown),
      cmocka_unit_test_teardown(test_chaos, teardown),
      cmocka_unit_test_teardown(test_stats_per_key, teardown),
      cmocka_unit_test_teardown(test_log_lines, teardown),
      cmocka_unit_test_teardown(test_signals, teardown),
      cmocka_unit_test_teardown(test_garbage, teardown),
      cmocka_unit_test_teardown(test_refund_and_replay, teardown),
      cmocka_unit_test_teardown(test_refund_validation, teardown),
      cmocka_unit_test_teardown(test_one_refund_per_key, teardown),
      cmocka_unit_test_teardown(test_refunds_never_exceed_the_charge, teardown),
      cmocka_unit_test_teardown(test_refund_declines, teardown),
      cmocka_unit_test_teardown(test_refund_faults, teardown),
      cmocka_unit_test_teardown(test_refund_fault_flags, teardown),
      cmocka_unit_test_teardown(test_restart_keeps_refunds, teardown),
      cmocka_unit_test_teardown(test_webhook_events, teardown),
      cmocka_unit_test_teardown(test_webhook_retries, teardown),
      cmocka_unit_test_teardown(test_webhook_duplicates, teardown),
      cmocka_unit_test_teardown(test_webhook_ignored_key, teardown),
      cmocka_unit_test_teardown(test_webhook_chaos, teardown),
      cmocka_unit_test_teardown(test_webhook_stop, teardown),
      cmocka_unit_test_teardown(test_reference, teardown),
      cmocka_unit_test_teardown(test_ignore_idempotency_key, teardown),
  };

  psp_bin = getenv("IDEM_TEST_PSP");
  if ((psp_bin == NULL || psp_bin[0] == '\0') && argc > 1)
    psp_bin = argv[1];
  if (psp_bin == NULL || access(psp_bin, X_OK) != 0) {
    fprintf(stderr, "usage: test_psp PATH-TO-idem-psp (or set IDEM_TEST_PSP)\n");
    return 2;
  }
  curl_global_init(CURL_GLOBAL_DEFAULT);
  signal(SIGPIPE, SIG_IGN);
  return cmocka_run_group_tests(tests, NULL, NULL);
}
