/* Test support for the client (tests/client): a scripted fake HTTP server
 * and a response-dropping proxy, each a thread on 127.0.0.1; running the
 * real `idem`, `idemd` and `idem-psp` binaries as child processes; reading
 * the one line `idem` prints on stderr. Self-contained, so that these tests
 * do not move with the integration harness.
 *
 * Functions marked "fails" end the test through cmocka when they cannot do
 * their job; call those from the main thread only. */
#ifndef IDEM_TEST_CLIENT_SUPPORT_H
#define IDEM_TEST_CLIENT_SUPPORT_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <cmocka.h>
#include <jansson.h>

#define CT_MAX_SEEN 64
#define CT_MAX_ARGS 32

/* Binaries, from the environment (IDEM_TEST_CLI, IDEM_TEST_IDEMD,
 * IDEM_TEST_PSP); NULL when unset. */
const char *ct_cli_path(void);
const char *ct_idemd_path(void);
const char *ct_psp_path(void);

/* Monotonic seconds. */
double ct_now(void);
void ct_nap_ms(int ms);
/* A loopback port that was free a moment ago. */
int ct_free_port(void);

/* A new temp dir (malloc'd path), removed by ct_rmdir() unless
 * IDEM_TEST_KEEP is set. Fails. */
char *ct_tempdir(void);
void ct_rmdir(char *dir); /* also frees `dir`; NULL is fine */

/* ---- the scripted fake server ---------------------------------------- */

/* One answer of the script. */
typedef struct ct_reply {
  int status;          /* 0: close the connection without answering */
  const char *headers; /* extra header lines, each ending in "\r\n"; NULL: none */
  const char *body;    /* NULL: empty */
  int delay_ms;        /* wait this long before answering */
} ct_reply_t;

/* One request the fake (or the proxy) received. */
typedef struct ct_seen {
  char method[16];
  char path[256];
  char key[300]; /* Idempotency-Key */
  int has_key;
  char auth[300];         /* Authorization */
  char content_type[128]; /* Content-Type */
  char body[1024];        /* its first 1023 bytes, then a NUL */
  size_t body_len;        /* all of it */
  char head[4096];        /* the request line and header lines, blank line included */
  double at;              /* ct_now() when it arrived */
} ct_seen_t;

/* How many header lines named `name` (any case) `s` had; the value of the
 * first one (spaces after the colon skipped) into `out` ("" when none;
 * `out` may be NULL). */
int ct_header_count(const ct_seen_t *s, const char *name, char *out, size_t cap);

typedef struct ct_fake ct_fake_t;

/* Starts a thread that answers request i (one per connection) with
 * script[i], and with a 500 once the script is used up. The script is
 * borrowed until ct_fake_stop(). Fails. */
ct_fake_t *ct_fake_start(const ct_reply_t *script, int n);
int ct_fake_port(const ct_fake_t *f);
/* Copies what the fake saw so far to `out` (up to CT_MAX_SEEN); returns
 * how many requests it saw. */
int ct_fake_seen(ct_fake_t *f, ct_seen_t *out);
/* Stops the thread and frees the fake. NULL is fine. */
void ct_fake_stop(ct_fake_t *f);

/* ---- the proxy -------------------------------------------------------- */

typedef struct ct_proxy ct_proxy_t;

/* Starts a thread that forwards each request (one per connection, with
 * Connection: close) to 127.0.0.1:upstream_port and relays the answer,
 * except for the first `drop_first` requests: those reach the upstream and
 * are fully answered there, but the answer is thrown away and the client's
 * connection closed, as when a response is lost on the way back. Fails. */
ct_proxy_t *ct_proxy_start(int upstream_port, int drop_first);
int ct_proxy_port(const ct_proxy_t *p);
/* As ct_fake_seen(). */
int ct_proxy_seen(ct_proxy_t *p, ct_seen_t *out);
void ct_proxy_stop(ct_proxy_t *p);

/* ---- child processes -------------------------------------------------- */

/* A child whose output is captured in memory. */
typedef struct ct_run {
  pid_t pid;
  int out_fd, err_fd;
  char *out, *err; /* NUL-terminated after ct_run_wait(); free with ct_run_free() */
  size_t out_len, err_len;
  int exit_code; /* -1 when killed by a signal or the timeout */
  int timed_out;
} ct_run_t;

/* Starts argv (argv[0] a path) with the test's environment minus
 * IDEM_TOKEN and IDEM_PSP_*, plus `env_add` ("NAME=value" strings,
 * NULL-terminated, may be NULL). Fails. */
void ct_run_start(ct_run_t *r, const char *const *argv, const char *const *env_add);
/* ct_run_start() with standard input read from the file `stdin_path`
 * (NULL: /dev/null). Fails. */
void ct_run_start_stdin(ct_run_t *r, const char *const *argv, const char *const *env_add,
                        const char *stdin_path);
/* Collects output until the child exits, killing it after `timeout_s`. */
void ct_run_wait(ct_run_t *r, double timeout_s);
/* Both in one. Fails. */
void ct_run(ct_run_t *r, const char *const *argv, const char *const *env_add,
            double timeout_s);
void ct_run_free(ct_run_t *r);

/* The line `idem` prints on stderr: "idem: STATUS key=KEY attempts=N
 * [polls=P] ...". Returns 0 when `err` has it, else -1. `key` holds 300. */
int ct_parse_line(const char *err, long *status, char *key, int *attempts, int *polls);

/* A server process (idemd or idem-psp) with its log in a file. */
typedef struct ct_proc {
  pid_t pid;
  int port;
  char log[512];
  int running;
} ct_proc_t;

/* Starts `idemd serve --listen 127.0.0.1:PORT --db DIR/idem.db FLAGS...`
 * (port 0: a free one) and waits for GET /healthz 200. Fails. */
void ct_idemd_start(ct_proc_t *p, const char *dir, int port, const char *const *flags);
/* Starts `idem-psp --listen 127.0.0.1:PORT --db DIR/psp.db FLAGS...` the
 * same way. Fails. */
void ct_psp_start(ct_proc_t *p, const char *dir, const char *const *flags);
/* SIGTERM and wait; asserts exit status 0 and no sanitizer report in its
 * log. Fails. No-op when not running. */
void ct_proc_stop(ct_proc_t *p);
/* Kills with SIGKILL without checks (cleanup after a failure). */
void ct_proc_kill(ct_proc_t *p);

/* `idemd tenant create NAME --db DIR/idem.db`: the API key (malloc'd). Fails. */
char *ct_tenant(const char *dir, const char *name);

/* GET http://127.0.0.1:PORT/PATH; the body parsed (caller decrefs) when the
 * status is 200 and it is JSON, else NULL. */
json_t *ct_get_json(int port, const char *path, const char *token);

/* Reads the integer in the first column of the first row of `sql` on the
 * SQLite file `db`. Fails. */
int64_t ct_db_int(const char *db, const char *sql);

#endif
