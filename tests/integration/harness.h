/* The integration harness: starts the real idemd on a fresh temp dir, a
 * fresh database and a free loopback port, creates tenants through its
 * command line, talks HTTP to it with libcurl (or raw bytes over a socket),
 * and reads its database directly.
 *
 * The store: a SQLite file in the server's temp dir by default; when the
 * environment variable IDEM_TEST_STORE_URL names a PostgreSQL cluster
 * (postgresql://... or postgres://..., as scripts/with-pg.sh sets it), each
 * server gets a database of its own on that cluster instead (created at
 * start, dropped at teardown), and the database helpers below run on libpq.
 *
 * Functions that fail the test (cmocka) are marked "fails"; only call those
 * from the main thread. */
#ifndef IDEM_TEST_HARNESS_H
#define IDEM_TEST_HARNESS_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <cmocka.h>
#include <curl/curl.h>
#include <jansson.h>

#define H_MAX_FLAGS 16
#define H_MAX_HEADERS 8

/* One idemd process (and the temp dir it owns). Owned by the harness:
 * h_teardown() stops it and removes the dir. */
typedef struct h_server {
  char dir[256];
  char db[512];      /* what idemd gets as --db: a SQLite file or a PostgreSQL URL */
  char log[300];     /* idemd's stderr and stdout */
  char cli_log[300]; /* stderr of `idemd tenant create` */
  int port;
  pid_t pid;
  int running;
  char *flags[H_MAX_FLAGS + 1];
  char pg_dbname[64]; /* PostgreSQL: the database this server created and
                         h_teardown() drops; "" when it shares another's */
  void *pg;           /* PostgreSQL: the harness's own connection (PGconn *)
                         for the database helpers; NULL until first used */
} h_server_t;

/* A request. Zero-initialise and set what matters. */
typedef struct h_req {
  const char *method; /* "GET" when NULL */
  const char *path;
  const char *token;        /* Authorization: Bearer TOKEN; NULL: none */
  const char *key;          /* Idempotency-Key; NULL: none; "": empty header */
  const char *content_type; /* NULL: application/json if there is a body;
                               H_NO_CONTENT_TYPE: no header at all */
  const char *body;         /* NULL: no body */
  size_t body_len;          /* 0: strlen(body) */
  const char *headers[H_MAX_HEADERS + 1]; /* extra "Name: value" lines */
} h_req_t;

extern const char H_NO_CONTENT_TYPE[];

/* An answer. h_resp_free() releases body and json. */
typedef struct h_resp {
  long status; /* 0 when the transport failed */
  int transport_error;
  char *body;
  size_t body_len;
  json_t *json; /* the body parsed, NULL when it is not JSON */
  char location[256];
  char replayed[64];
  char retry_after[64];
  char allow[64];
  char www_authenticate[128];
  char request_id[160];
  char content_type[128];
  double seconds; /* duration of the exchange */
  double t_end;   /* h_now() when the answer was complete */
} h_resp_t;

/* Call once from main() before the tests: libcurl and the idemd path
 * (env IDEM_TEST_IDEMD, else argv[1]). */
void h_init(int argc, char **argv);

/* Starts argv[0] (a path) with stdin from /dev/null, stdout and stderr on
 * the given descriptors, the environment minus the variables starting with
 * `drop_env`, and death when the test dies. Returns its pid, or -1. */
pid_t h_spawn(char *const argv[], int out_fd, int err_fd, const char *drop_env);

/* h_spawn() with stdout and stderr appended to the file `log`. Returns the
 * pid, or -1 with the reason in `why`. */
pid_t h_spawn_logged(char *const argv[], const char *log, const char *drop_env,
                     char *why, size_t whylen);

/* A loopback port free at the time of the call (bind to 0, read, close). */
int h_free_port(void);

/* Monotonic seconds. */
double h_now(void);
/* Wall-clock milliseconds since the epoch (the clock idemd stamps records with). */
int64_t h_wall_ms(void);

/* Starts `idemd serve` with `flags` (NULL-terminated, may be NULL) on a new
 * temp dir and a new database (see the top of this file) and waits for
 * GET /healthz 200. Fails. */
h_server_t *h_server_start(const char *const *flags);
/* Starts one more idemd, on a new temp dir and port, that shares the
 * database `db` (normally another server's ->db: several instances on one
 * PostgreSQL database). The database stays owned by the server that made
 * it. Fails. */
h_server_t *h_server_start_on(const char *db, const char *const *flags);
/* 1 when the servers run on PostgreSQL (IDEM_TEST_STORE_URL), else 0. */
int h_store_is_pg(void);
/* The cluster URL from IDEM_TEST_STORE_URL, or NULL on SQLite. */
const char *h_store_url(void);
/* Starts the same (stopped) server again on its dir and database, with new
 * flags, on a new port. Fails. */
void h_server_restart(h_server_t *s, const char *const *flags);
/* SIGTERM, waitpid; asserts exit status 0 and that neither the server's log
 * nor the CLI's has a sanitizer report. Fails. */
void h_server_stop(h_server_t *s);
/* cmocka teardown: stops every server still running (asserting as above),
 * removes their temp dirs and drops their PostgreSQL databases (both kept
 * when IDEM_TEST_KEEP is set). */
int h_teardown(void **state);

/* Runs idemd with `args` (NULL-terminated, after the binary) and `--db` of
 * the server, stdout captured into `out` (malloc'd; free it), stderr
 * appended to the server's CLI log (checked for sanitizer reports at
 * stop). Returns the exit status, or -1 if it did not exit normally. */
int h_cli(h_server_t *s, const char *const *args, char **out);

/* Runs `idemd tenant create NAME --db DB`; returns its API key (malloc'd,
 * freed by h_teardown with the server). Fails. */
const char *h_tenant(h_server_t *s, const char *name);

/* HTTP over a new connection. Never fails the test; check ->status. */
void h_http(h_server_t *s, const h_req_t *req, h_resp_t *out);
/* Same, on a caller's handle (keeps its connection alive between calls). */
void h_http_on(CURL *c, h_server_t *s, const h_req_t *req, h_resp_t *out);
/* Shorthands. */
void h_post(h_server_t *s, const char *path, const char *token, const char *key,
            const char *body, h_resp_t *out);
void h_get(h_server_t *s, const char *path, const char *token, h_resp_t *out);
/* A POST by a client that gives up after `timeout_ms` (its connection
 * then closes), the answer ignored. Returns libcurl's result. Never fails
 * the test, so threads may call it. */
CURLcode h_post_timeout(h_server_t *s, const char *path, const char *token,
                        const char *key, const char *body, long timeout_ms);
/* A socket connected to `s` over loopback, for bytes sent and read by
 * hand; the caller closes it. Fails. */
int h_dial(h_server_t *s);
/* Sends `len` raw bytes (a whole request, normally with Connection: close)
 * and parses the answer. Never fails the test. */
void h_raw(h_server_t *s, const char *bytes, size_t len, h_resp_t *out);
/* A POST built by hand, for headers libcurl will not send as given:
 * `key_value` is put verbatim after "Idempotency-Key:" (NULL: no header). */
void h_raw_post(h_server_t *s, const char *path, const char *token, const char *key_value,
                const char *body, h_resp_t *out);
/* `n` threads, each with its own handle and connection, wait on a barrier
 * and then send reqs[i]; out[i] gets its answer. Fails only if threads
 * cannot be created. */
void h_together(h_server_t *s, const h_req_t *reqs, int n, h_resp_t *out);
/* Same, but reqs[i] goes to servers[i] (several instances at once). */
void h_together_on(h_server_t *const *servers, const h_req_t *reqs, int n, h_resp_t *out);
void h_resp_free(h_resp_t *r);

/* Reads the database (read-only) and returns the integer in the first
 * column of the first row. Parameters are text, bound as ?1, ?2, ... (on
 * PostgreSQL they become $1, $2, ..., outside quoted literals; the schema
 * has the same tables and the views payments and orders on both stores,
 * but functions and catalogs differ: see h_store_is_pg()). Fails. */
int64_t h__db_int(h_server_t *s, const char *sql, ...);
#define h_db_int(s, ...) h__db_int((s), __VA_ARGS__, (const char *)NULL)
/* Same, as text (malloc'd; NULL for no row or a NULL value). Fails. */
char *h__db_text(h_server_t *s, const char *sql, ...);
#define h_db_text(s, ...) h__db_text((s), __VA_ARGS__, (const char *)NULL)
/* Polls the query (every 5 ms, at most timeout_ms) until it returns >= 1.
 * Returns 1 when it did, 0 on timeout. Fails on a database error. */
int h__db_wait(h_server_t *s, int timeout_ms, const char *sql, ...);
#define h_db_wait(s, ms, ...) h__db_wait((s), (ms), __VA_ARGS__, (const char *)NULL)

/* Reads a whole file (malloc'd, NUL-terminated). NULL if it cannot. */
char *h_read_file(const char *path, size_t *len);

/* Names the case under test; the assertions below print it on failure
 * (table-driven tests set it per row); h_context_clear() forgets it. */
void h_context(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void h_context_clear(void);

/* Asserts that the query (text parameters) returns `want`. */
void h__assert_db(h_server_t *s, int64_t want, const char *sql, ...);
#define h_assert_db(s, want, ...)                                                        \
  h__assert_db((s), (want), __VA_ARGS__, (const char *)NULL)

/* Assertions (fail, with the answer's body in the message). */
void h_assert_status(const h_resp_t *r, long status);
/* `{"error": "<non-empty>"}` and nothing else; `message` checked if given. */
void h_assert_error(const h_resp_t *r, long status, const char *message);
/* 422 `{"errors":[{"field","message","code"}...]}`, one naming `field`. */
void h_assert_field_error(const h_resp_t *r, const char *field);
/* A first answer: `status`, a JSON object without "replayed", no
 * Idempotent-Replayed header. */
void h_assert_first(const h_resp_t *r, long status);
/* A replay of `first`: same status, same body plus "replayed": true, the
 * Idempotent-Replayed: true header and the same Location. */
void h_assert_replay_of(const h_resp_t *r, const h_resp_t *first);
/* GET /healthz answers 200 {"status":"ok"}. */
void h_assert_healthy(h_server_t *s);
/* The value of the sample `name` (with its labels, as printed) in the
 * Prometheus text `text`, or -1 when it is not there. */
double h_metric(const char *text, const char *name);
/* The "id" string of a JSON answer (fails if absent). Borrowed. */
const char *h_id(const h_resp_t *r);

#endif
