/* Runs the real idem-psp for the provider integration tests, and reads its
 * /stats (see psp_harness.h). HTTP goes through harness.h's helpers. */
#define _GNU_SOURCE
#include "psp_harness.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>


#define MAX_PSPS 8
#define START_TIMEOUT_S 30.0
#define STOP_TIMEOUT_S 20.0
#define SAME_PORT_TIMEOUT_S 5.0

static const char *psp_path;
static p_psp_t *psps[MAX_PSPS];

void p_nap_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
}

void p_init(int argc, char **argv) {
  psp_path = getenv("IDEM_TEST_PSP");
  if ((psp_path == NULL || psp_path[0] == '\0') && argc > 2)
    psp_path = argv[2];
  if (psp_path == NULL || access(psp_path, X_OK) != 0) {
    fprintf(stderr, "set IDEM_TEST_PSP to the idem-psp binary (got '%s')\n",
            psp_path ? psp_path : "");
    exit(2);
  }
}

/* ---- processes ----------------------------------------------------- */

/* Does the log contain `needle` after offset `from`? */
static int logged_since(const char *path, off_t from, const char *needle) {
  size_t len;
  char *text = h_read_file(path, &len);
  int found = text && (size_t)from <= len && strstr(text + from, needle) != NULL;
  free(text);
  return found;
}

static void print_log_tail(const p_psp_t *p) {
  size_t len;
  char *text = h_read_file(p->log, &len);
  if (text == NULL)
    return;
  fprintf(stderr, "---- last lines of %s ----\n%s%s\n----\n", p->log,
          len > 3000 ? "..." : "", len > 3000 ? text + len - 3000 : text);
  free(text);
}

static int healthz_ok(p_psp_t *p) {
  h_req_t req = {.path = "/healthz"};
  h_resp_t r;
  int ok;
  h_http(&p->http, &req, &r);
  ok = r.status == 200;
  h_resp_free(&r);
  return ok;
}

/* One attempt to start idem-psp on p->port. Returns 0 when it serves, 1
 * when the port was taken, -1 with a reason in why. */
static int launch_once(p_psp_t *p, char *why, size_t whylen) {
  char listen[64];
  char *argv[6 + P_MAX_FLAGS + 1];
  int argc = 0, status;
  struct stat st;
  off_t log_start = stat(p->log, &st) == 0 ? st.st_size : 0;
  double deadline = h_now() + START_TIMEOUT_S;

  snprintf(listen, sizeof listen, "127.0.0.1:%d", p->port);
  snprintf(p->url, sizeof p->url, "http://127.0.0.1:%d", p->port);
  p->http.port = p->port;
  argv[argc++] = (char *)psp_path;
  argv[argc++] = "--listen";
  argv[argc++] = listen;
  argv[argc++] = "--db";
  argv[argc++] = p->db;
  for (int i = 0; p->flags[i]; i++)
    argv[argc++] = p->flags[i];
  argv[argc] = NULL;

  if ((p->pid = h_spawn_logged(argv, p->log, "IDEM_PSP_", why, whylen)) < 0)
    return -1;
  p->running = 1;
  p->paused = 0;
  for (;;) {
    if (waitpid(p->pid, &status, WNOHANG) == p->pid) {
      p->running = 0;
      if (logged_since(p->log, log_start, "cannot listen"))
        return 1;
      snprintf(why, whylen, "idem-psp exited during start-up (status 0x%x)", status);
      return -1;
    }
    /* Its own "listening" line first: a /healthz answer alone could come
     * from another process that took the port. */
    if (logged_since(p->log, log_start, "\"event\":\"listening\"") && healthz_ok(p))
      return 0;
    if (h_now() > deadline) {
      kill(p->pid, SIGKILL);
      waitpid(p->pid, &status, 0);
      p->running = 0;
      snprintf(why, whylen, "idem-psp did not answer /healthz within %.0f s",
               START_TIMEOUT_S);
      return -1;
    }
    p_nap_ms(10);
  }
}

static void set_flags(p_psp_t *p, const char *const *flags) {
  for (int i = 0; p->flags[i]; i++) {
    free(p->flags[i]);
    p->flags[i] = NULL;
  }
  for (int i = 0; flags && flags[i]; i++) {
    if (i >= P_MAX_FLAGS)
      fail_msg("too many idem-psp flags");
    p->flags[i] = strdup(flags[i]);
    assert_non_null(p->flags[i]);
  }
}

p_psp_t *p_start(const char *const *flags) {
  const char *tmp = getenv("TMPDIR");
  p_psp_t *p = calloc(1, sizeof *p);
  char why[512] = "no free port in 5 attempts";
  int slot = -1, rc = 1;

  assert_non_null(p);
  for (int i = 0; i < MAX_PSPS && slot < 0; i++)
    if (psps[i] == NULL)
      slot = i;
  if (slot < 0)
    fail_msg("more than %d idem-psp processes in one test", MAX_PSPS);
  psps[slot] = p;
  snprintf(p->dir, sizeof p->dir, "%s/idem-psp-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
  if (mkdtemp(p->dir) == NULL)
    fail_msg("mkdtemp: %s", strerror(errno));
  snprintf(p->db, sizeof p->db, "%s/psp.db", p->dir);
  snprintf(p->log, sizeof p->log, "%s/psp.log", p->dir);
  set_flags(p, flags);
  for (int attempt = 0; attempt < 5 && rc == 1; attempt++) {
    if ((p->port = h_free_port()) <= 0)
      fail_msg("no free port");
    rc = launch_once(p, why, sizeof why);
  }
  if (rc != 0) {
    print_log_tail(p);
    fail_msg("idem-psp did not start: %s", why);
  }
  return p;
}

void p_restart(p_psp_t *p, const char *const *flags) {
  double deadline = h_now() + SAME_PORT_TIMEOUT_S;
  char why[512];
  int rc;

  assert_false(p->running);
  set_flags(p, flags);
  /* The same port, so that idemd's --provider still points at it. */
  while ((rc = launch_once(p, why, sizeof why)) == 1 && h_now() < deadline)
    p_nap_ms(100);
  if (rc == 1)
    snprintf(why, sizeof why, "port %d was taken meanwhile", p->port);
  if (rc != 0) {
    print_log_tail(p);
    fail_msg("idem-psp did not start again: %s", why);
  }
}

static int sanitizer_report(const p_psp_t *p, char *why, size_t whylen) {
  static const char *const needles[] = {"ERROR: AddressSanitizer", "ERROR: LeakSanitizer",
                                        "runtime error:", "WARNING: ThreadSanitizer"};
  char *text = h_read_file(p->log, NULL);
  int found = 0;
  for (size_t i = 0; text && i < sizeof needles / sizeof *needles && !found; i++)
    if (strstr(text, needles[i])) {
      snprintf(why, whylen, "%s: %s", p->log, needles[i]);
      found = 1;
    }
  free(text);
  return found;
}

/* SIGTERM and wait; returns 0 or -1 with a reason. */
static int stop(p_psp_t *p, char *why, size_t whylen) {
  double deadline = h_now() + STOP_TIMEOUT_S;
  int status = 0;

  why[0] = '\0';
  if (!p->running)
    return 0;
  if (p->paused)
    p_resume(p);
  kill(p->pid, SIGTERM);
  for (;;) {
    pid_t w = waitpid(p->pid, &status, WNOHANG);
    if (w == p->pid)
      break;
    if ((w < 0 && errno != EINTR) || h_now() > deadline) {
      kill(p->pid, SIGKILL);
      waitpid(p->pid, &status, 0);
      p->running = 0;
      snprintf(why, whylen, "idem-psp did not exit within %.0f s of SIGTERM",
               STOP_TIMEOUT_S);
      return -1;
    }
    p_nap_ms(5);
  }
  p->running = 0;
  if (sanitizer_report(p, why, whylen))
    return -1;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    snprintf(why, whylen, "idem-psp exited with status 0x%x after SIGTERM", status);
    return -1;
  }
  return 0;
}

void p_stop(p_psp_t *p) {
  char why[600];
  if (stop(p, why, sizeof why) != 0) {
    print_log_tail(p);
    fail_msg("%s", why);
  }
}

void p_kill(p_psp_t *p) {
  if (!p->running)
    return;
  kill(p->pid, SIGKILL);
  waitpid(p->pid, NULL, 0);
  p->running = 0;
  p->paused = 0;
}

void p_pause(p_psp_t *p) {
  int status = 0;
  pid_t w;

  assert_true(p->running);
  assert_int_equal(kill(p->pid, SIGSTOP), 0);
  /* kill() returns before the stop: the kernel wakes one thread to take
   * SIGSTOP, and another thread scheduled first may still serve a request
   * (seen in CI under load). waitpid reports the stop once every thread
   * has stopped. */
  do
    w = waitpid(p->pid, &status, WUNTRACED);
  while (w < 0 && errno == EINTR);
  if (w != p->pid || !WIFSTOPPED(status)) {
    p->running = w == p->pid ? 0 : p->running;
    fail_msg("idem-psp did not stop on SIGSTOP (waitpid %d, status 0x%x)", (int)w,
             status);
  }
  p->paused = 1;
}

void p_resume(p_psp_t *p) {
  if (p->running && p->paused)
    kill(p->pid, SIGCONT);
  p->paused = 0;
}

void p_kill_idemd(h_server_t *s) {
  assert_true(s->running);
  assert_int_equal(kill(s->pid, SIGKILL), 0);
  assert_int_equal(waitpid(s->pid, NULL, 0), s->pid);
  s->running = 0;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st;
  (void)flag;
  (void)ftw;
  return remove(path);
}

int p_teardown(void **state) {
  char why[600], first[600] = "";
  for (int i = 0; i < MAX_PSPS; i++) {
    p_psp_t *p = psps[i];
    if (p == NULL)
      continue;
    if (stop(p, why, sizeof why) != 0 && first[0] == '\0') {
      print_log_tail(p);
      snprintf(first, sizeof first, "%s", why);
    }
    if (getenv("IDEM_TEST_KEEP") == NULL)
      (void)nftw(p->dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    else
      fprintf(stderr, "kept %s\n", p->dir);
    for (int k = 0; p->flags[k]; k++)
      free(p->flags[k]);
    free(p);
    psps[i] = NULL;
  }
  h_teardown(state); /* fails on its own if idemd did not stop cleanly */
  if (first[0])
    fail_msg("%s", first);
  return 0;
}

/* ---- reading the provider ------------------------------------------ */

json_t *p_stats(p_psp_t *p) {
  h_req_t req = {.path = "/stats"};
  h_resp_t r;
  json_t *stats;

  h_http(&p->http, &req, &r);
  if (r.status != 200 || !json_is_object(r.json) ||
      !json_is_object(json_object_get(r.json, "keys")))
    fail_msg("idem-psp GET /stats: status %ld (transport error %d): %.300s", r.status,
             r.transport_error, r.body ? r.body : "");
  stats = json_incref(r.json);
  h_resp_free(&r);
  return stats;
}

int64_t p_total(const json_t *stats, const char *field) {
  json_t *v = json_object_get(stats, field);
  if (!json_is_integer(v))
    fail_msg("idem-psp /stats has no integer \"%s\"", field);
  return json_integer_value(v);
}

int64_t p_key(const json_t *stats, const char *key, const char *field) {
  json_t *k = json_object_get(json_object_get(stats, "keys"), key);
  return json_integer_value(json_object_get(k, field)); /* 0 when absent */
}

size_t p_nkeys(const json_t *stats) {
  return json_object_size(json_object_get(stats, "keys"));
}

int p_wait_key(p_psp_t *p, const char *key, const char *field, int64_t want,
               int timeout_ms) {
  double deadline = h_now() + timeout_ms / 1000.0;
  for (;;) {
    json_t *stats = p_stats(p);
    int64_t v = p_key(stats, key, field);
    json_decref(stats);
    if (v >= want)
      return 1;
    if (h_now() > deadline)
      return 0;
    p_nap_ms(20);
  }
}

void p_charge(p_psp_t *p, const char *key, h_resp_t *out) {
  char path[400];
  snprintf(path, sizeof path, "/charges/%s", key);
  h_get(&p->http, path, NULL, out);
}
