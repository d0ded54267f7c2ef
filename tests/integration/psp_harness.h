/* The provider side of the integration tests: runs idem-psp (the provider
 * simulator, tools/psp) on its own temp dir, database and free loopback
 * port, reads its /stats and charges, and adds the process controls the
 * provider tests need on top of harness.h (kill -9 of idemd, pausing the
 * provider). Functions that fail the test (cmocka) are marked "fails"; call
 * those from the main thread only. */
#ifndef IDEM_TEST_PSP_HARNESS_H
#define IDEM_TEST_PSP_HARNESS_H

#include "harness.h"

#define P_MAX_FLAGS 16

/* One idem-psp process and the temp dir it owns. Owned by the harness:
 * p_teardown() stops it and removes the dir. */
typedef struct p_psp {
  char dir[256];
  char db[300];
  char log[300]; /* its stdout and stderr */
  char url[64];  /* http://127.0.0.1:PORT, for idemd --provider */
  int port;      /* kept across p_restart(), so idemd's --provider holds */
  pid_t pid;
  int running;
  int paused; /* SIGSTOPped by p_pause() */
  char *flags[P_MAX_FLAGS + 1];
  h_server_t http; /* only .port is set: lets h_get() and friends talk to it */
} p_psp_t;

/* Call once from main() after h_init(): the idem-psp path (env
 * IDEM_TEST_PSP, else argv[2]). Exits 2 when there is none. */
void p_init(int argc, char **argv);

/* Starts idem-psp with `flags` (NULL-terminated, may be NULL) on a new temp
 * dir and a free port, and waits until it serves GET /healthz. Fails. */
p_psp_t *p_start(const char *const *flags);
/* Starts a stopped or killed idem-psp again on its dir, database and port,
 * with new flags. Fails (also when the port was taken meanwhile). */
void p_restart(p_psp_t *p, const char *const *flags);
/* SIGTERM, waits; asserts exit status 0 and no sanitizer report. Fails. */
void p_stop(p_psp_t *p);
/* kill -9 and reap. */
void p_kill(p_psp_t *p);
/* SIGSTOP / SIGCONT: a provider that hangs. The kernel still accepts
 * connections and buffers requests; they are served after p_resume().
 * p_pause() returns once every thread of idem-psp has stopped. */
void p_pause(p_psp_t *p);
void p_resume(p_psp_t *p);

/* GET /stats (fails unless 200 with a JSON object). Caller decrefs. */
json_t *p_stats(p_psp_t *p);
/* stats["charges"], ["declines"], ["requests"] (fails when absent). */
int64_t p_total(const json_t *stats, const char *field);
/* stats["keys"][key][field]; 0 when the key is absent. */
int64_t p_key(const json_t *stats, const char *key, const char *field);
/* Number of keys in stats["keys"]. */
size_t p_nkeys(const json_t *stats);
/* Polls /stats (every 20 ms, at most timeout_ms) until stats["keys"][key]
 * [field] >= want. Returns 1 when it did, 0 on timeout. Fails on a bad
 * /stats answer. */
int p_wait_key(p_psp_t *p, const char *key, const char *field, int64_t want,
               int timeout_ms);
/* GET /charges/{key}. Never fails the test. */
void p_charge(p_psp_t *p, const char *key, h_resp_t *out);

/* kill -9 of idemd, reaped, so that h_server_restart() can start it again
 * on the same database. */
void p_kill_idemd(h_server_t *s);

/* cmocka teardown: stops every idem-psp still running (asserting a clean
 * exit), removes their dirs (kept with IDEM_TEST_KEEP), then runs
 * h_teardown(). */
int p_teardown(void **state);

/* Sleeps `ms` milliseconds. */
void p_nap_ms(int ms);

#endif
