/* Tests of idem-floor (tools/floor), the benchmark's second baseline: it
 * starts the real binary (its path is the first argument) on a port the
 * kernel picks, and checks that it answers, that with --commits every
 * answer waits for its commits, that SIGTERM with requests queued lets
 * them finish, exits 0 and leaves no file, and that bad usage exits 2. */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <curl/curl.h>

static const char *floor_bin;

typedef struct floor_proc {
  pid_t pid;
  int port;
  char dir[64];
  char file[96]; /* --file */
  char err[96];  /* its stderr */
} floor_proc_t;

static void nap_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Waits up to timeout_ms for pid; its raw status, or -1. */
static int wait_exit(pid_t pid, int timeout_ms) {
  int status;
  for (int waited = 0; waited <= timeout_ms; waited += 5) {
    pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid) return status;
    if (w < 0 && errno != EINTR) return -1;
    nap_ms(5);
  }
  return -1;
}

/* Runs idem-floor with args (NULL-terminated, after argv[0]); its stdout to
 * a pipe returned in *out_fd (or /dev/null when out_fd is NULL), its stderr
 * to err_path. */
static pid_t spawn(const char *const *args, int *out_fd, const char *err_path) {
  char *argv[16];
  int argc = 0, fds[2] = {-1, -1};
  pid_t parent = getpid();
  argv[argc++] = (char *)floor_bin;
  for (int i = 0; args[i]; i++) {
    assert_true(argc < 15);
    argv[argc++] = (char *)args[i];
  }
  argv[argc] = NULL;
  if (out_fd) assert_int_equal(pipe(fds), 0);
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* die with the test */
    if (getppid() != parent) _exit(127);
    int out = out_fd ? fds[1] : open("/dev/null", O_WRONLY);
    int err = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (out < 0 || err < 0) _exit(127);
    dup2(out, 1);
    dup2(err, 2);
    execv(argv[0], argv);
    _exit(127);
  }
  assert_true(pid > 0);
  if (out_fd) {
    close(fds[1]);
    *out_fd = fds[0];
  }
  return pid;
}

/* Starts idem-floor with the extra args (an arg "@FILE" becomes a path in
 * p's own directory); fails the test unless it says where it listens
 * within 5 s. */
static void start(floor_proc_t *p, const char *const *extra) {
  const char *args[12] = {"--port", "0"};
  int n = 2, fd;
  char line[128] = "";
  size_t got = 0;

  snprintf(p->dir, sizeof p->dir, "/tmp/idem-floor-test.XXXXXX");
  assert_non_null(mkdtemp(p->dir));
  snprintf(p->file, sizeof p->file, "%s/commits", p->dir);
  snprintf(p->err, sizeof p->err, "%s/stderr", p->dir);
  for (int i = 0; extra && extra[i]; i++)
    args[n++] = strcmp(extra[i], "@FILE") == 0 ? p->file : extra[i];
  args[n] = NULL;
  p->pid = spawn(args, &fd, p->err);
  fcntl(fd, F_SETFL, O_NONBLOCK);
  for (int waited = 0; waited < 5000 && !strchr(line, '\n'); waited += 5) {
    ssize_t r = read(fd, line + got, sizeof line - 1 - got);
    if (r > 0) got += (size_t)r;
    else if (r == 0) break;
    else nap_ms(5);
    line[got] = '\0';
  }
  close(fd);
  assert_int_equal(sscanf(line, "listening on 127.0.0.1:%d", &p->port), 1);
  assert_true(p->port > 0);
}

/* p, sent SIGTERM already, must exit 0 within 5 s, write nothing to
 * stderr (a sanitizer's report would be there), and leave no file. */
static void expect_clean_exit(floor_proc_t *p) {
  struct stat st;
  int status = wait_exit(p->pid, 5000);
  char text[4096] = "";
  FILE *f = fopen(p->err, "r");

  if (f) { /* shown when the checks below fail: a sanitizer's report */
    size_t n = fread(text, 1, sizeof text - 1, f);
    text[n] = '\0';
    fclose(f);
  }
  if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
    fail_msg("idem-floor did not exit 0 (status %d); its stderr: %s", status, text);
  assert_int_equal(stat(p->err, &st), 0);
  if (st.st_size != 0)
    fail_msg("idem-floor wrote to stderr: %s", text);
  assert_int_not_equal(access(p->file, F_OK), 0);
  unlink(p->err);
  rmdir(p->dir);
}

/* Stops p with SIGTERM, and expects it to exit cleanly. */
static void stop(floor_proc_t *p) {
  assert_int_equal(kill(p->pid, SIGTERM), 0);
  expect_clean_exit(p);
}

static size_t sink(char *data, size_t size, size_t n, void *user) {
  (void)data;
  (void)user;
  return size * n;
}

/* n POSTs at once on n connections; the number answered 201 with a body.
 * With `term` > 0, that process is sent SIGTERM once they are all sent
 * and `term_after_ms` has passed. */
static int post_many_term(int port, int n, pid_t term, int term_after_ms) {
  char url[64];
  CURLM *multi = curl_multi_init();
  CURL *easy[64];
  int running, ok = 0;
  assert_true(n <= 64);
  snprintf(url, sizeof url, "http://127.0.0.1:%d/payments", port);
  for (int i = 0; i < n; i++) {
    easy[i] = curl_easy_init();
    curl_easy_setopt(easy[i], CURLOPT_URL, url);
    curl_easy_setopt(easy[i], CURLOPT_POSTFIELDS, "{\"amount\": 15990, \"currency\": \"BRL\"}");
    curl_easy_setopt(easy[i], CURLOPT_WRITEFUNCTION, sink);
    curl_easy_setopt(easy[i], CURLOPT_TIMEOUT, 10L);
    curl_multi_add_handle(multi, easy[i]);
  }
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  do {
    struct timespec t;
    curl_multi_perform(multi, &running);
    clock_gettime(CLOCK_MONOTONIC, &t);
    if (term > 0 && (t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000 >=
                        term_after_ms) {
      assert_int_equal(kill(term, SIGTERM), 0);
      term = 0;
    }
    if (running) curl_multi_poll(multi, NULL, 0, 10, NULL);
  } while (running);
  for (int i = 0; i < n; i++) {
    long status = 0;
    curl_off_t len = 0;
    curl_easy_getinfo(easy[i], CURLINFO_RESPONSE_CODE, &status);
    curl_easy_getinfo(easy[i], CURLINFO_SIZE_DOWNLOAD_T, &len);
    if (status == 201 && len > 100) ok++;
    curl_multi_remove_handle(multi, easy[i]);
    curl_easy_cleanup(easy[i]);
  }
  curl_multi_cleanup(multi);
  return ok;
}

static int post_many(int port, int n) { return post_many_term(port, n, 0, 0); }

static long get_status(int port, const char *path) {
  char url[96];
  long status = 0;
  CURL *c = curl_easy_init();
  snprintf(url, sizeof url, "http://127.0.0.1:%d%s", port, path);
  curl_easy_setopt(c, CURLOPT_URL, url);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, sink);
  curl_easy_setopt(c, CURLOPT_TIMEOUT, 10L);
  if (curl_easy_perform(c) == CURLE_OK) curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
  curl_easy_cleanup(c);
  return status;
}

static void test_answers_at_once(void **state) {
  floor_proc_t p;
  (void)state;
  start(&p, NULL);
  assert_int_equal(post_many(p.port, 8), 8);
  assert_int_equal(get_status(p.port, "/healthz"), 200);
  stop(&p);
}

/* Every answer waits for its two commits: an answer takes at least the
 * writer's work of two commits (a lower bound: the work is CPU time, which
 * the wall clock cannot undercut), and the file holds whole commits. */
static void test_answers_after_commits(void **state) {
  floor_proc_t p;
  struct stat st;
  struct timespec a, b;
  const char *extra[] = {"--commits", "2", "--commit-bytes", "4096", "--work-us", "20000",
                         "--file", "@FILE", NULL};
  (void)state;
  start(&p, extra);
  clock_gettime(CLOCK_MONOTONIC, &a);
  assert_int_equal(post_many(p.port, 1), 1);
  clock_gettime(CLOCK_MONOTONIC, &b);
  assert_true((b.tv_sec - a.tv_sec) * 1000 + (b.tv_nsec - a.tv_nsec) / 1000000 >= 40);
  assert_int_equal(stat(p.file, &st), 0);
  assert_true(st.st_size >= 2 * 4096);
  assert_int_equal(st.st_size % 4096, 0);
  stop(&p);
}

/* SIGTERM with requests queued for the writer: it finishes them (a
 * suspended request may not outlive the daemon), every one is answered
 * 201, and it exits 0 with nothing on stderr. */
static void test_stops_under_load(void **state) {
  floor_proc_t p;
  const char *extra[] = {"--commits", "2", "--commit-bytes", "4096", "--work-us", "10000",
                         "--file", "@FILE", NULL};
  (void)state;
  start(&p, extra);
  /* 32 requests take the writer at least 640 ms of work; the signal comes
   * 200 ms in, once every connection has long been accepted. */
  assert_int_equal(post_many_term(p.port, 32, p.pid, 200), 32);
  expect_clean_exit(&p);
}

static void test_bad_usage(void **state) {
  static const char *const cases[][6] = {
      {NULL},
      {"--port", NULL},
      {"--port", "70000", NULL},
      {"--port", "0", "--commits", "2", NULL}, /* no --file */
      {"--port", "0", "--commit-bytes", "0", NULL},
      {"--port", "0", "--work-us", "-1", NULL},
      {"--port", "0", "--fast", "1", NULL},
  };
  (void)state;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    pid_t pid = spawn(cases[i], NULL, "/dev/null");
    int status = wait_exit(pid, 5000);
    assert_true(status != -1 && WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 2);
  }
}

int main(int argc, char **argv) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_answers_at_once),
      cmocka_unit_test(test_answers_after_commits),
      cmocka_unit_test(test_stops_under_load),
      cmocka_unit_test(test_bad_usage),
  };
  floor_bin = argc > 1 ? argv[1] : NULL;
  if (floor_bin == NULL || access(floor_bin, X_OK) != 0) {
    fprintf(stderr, "usage: test_floor PATH-TO-idem-floor\n");
    return 2;
  }
  curl_global_init(CURL_GLOBAL_DEFAULT);
  signal(SIGPIPE, SIG_IGN);
  return cmocka_run_group_tests(tests, NULL, NULL);
}
