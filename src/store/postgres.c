/* The PostgreSQL store: many idemd instances share one database. Short
 * transactions of prepared statements, written through a group commit (a
 * few writer threads, each running every write queued at that moment in
 * one transaction, statements pipelined where no answer is needed), a
 * pool of connections (re-opened after the server restarts), and a
 * listener connection that turns NOTIFY from any instance into in-process
 * wake-ups, so a duplicate waiting on another instance's key wakes when
 * it finishes.
 * A database that hangs does not hang the caller: every statement, lock
 * wait, connect and wait for a pooled connection is bounded, and a
 * watchdog cuts the socket of a call that outlives twice the bound (a
 * stopped server enforces no timeout of its own): docs/operations.md,
 * "When PostgreSQL hangs".
 *
 * The semantics are those of the SQLite store: the same atomic reservation
 * (INSERT ... ON CONFLICT), completion conditional on the owner token, and
 * resources written in the transaction of their record. */
#define _GNU_SOURCE /* pthread_setname_np */
#include "store_impl.h"

#include <errno.h>
#include <libpq-fe.h>
#include <poll.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "idem/clock.h"
#include "idem/crypto.h"

#define NOTIFY_CHANNEL "idem_records"

enum stmt_id {
  ST_RESERVE,
  ST_READ_RECORD,
  ST_COMPLETE,
  ST_META_PUT,
  ST_META_GET,
  ST_SWEEP,
  ST_PING,
  ST_RECORDS_LIST,
  ST_TAKE_OVER,
  ST_PROBE,
  ST_COUNT_
};

#define RECORD_COLUMNS                                                        \
  "tenant_id, operation, key, fingerprint, state, response_status, "          \
  "response_body, location, resource_id, provider_ref, correlation_id, "      \
  "owner_token, lease_expires_at, created_at, updated_at, expires_at"

#define SCOPE_MATCH "tenant_id = $1 AND operation = $2 AND key = $3"

static const char *const stmt_sql[ST_COUNT_] = {
    [ST_RESERVE] =
        "INSERT INTO idempotency_records AS r (tenant_id, operation, key, "
        "fingerprint, state, correlation_id, owner_token, lease_expires_at, "
        "created_at, updated_at, expires_at, resource_id) "
        "VALUES ($1, $2, $3, $4, 'processing', $5, $6, $7, $8, $8, NULL, $9) "
        "ON CONFLICT (tenant_id, operation, key) DO UPDATE SET "
        "fingerprint = excluded.fingerprint, state = 'processing', "
        "response_status = NULL, response_body = NULL, location = NULL, "
        "resource_id = excluded.resource_id, provider_ref = NULL, "
        "correlation_id = excluded.correlation_id, "
        "owner_token = excluded.owner_token, "
        "lease_expires_at = excluded.lease_expires_at, "
        "created_at = excluded.created_at, updated_at = excluded.updated_at, "
        "expires_at = NULL "
        "WHERE (r.state IN ('completed', 'failed') "
        "AND r.expires_at <= excluded.created_at) "
        "OR (r.state = 'failed' AND r.fingerprint = excluded.fingerprint) "
        "RETURNING 1",
    [ST_READ_RECORD] = "SELECT " RECORD_COLUMNS
                       " FROM idempotency_records WHERE " SCOPE_MATCH,
    /* The NOTIFY goes out only when the update changed the row (one per
     * row it returned), delivered to every instance at commit: a
     * completion that lost its lease sends nothing, and needs no rollback
     * that would undo the other writes of its batch. */
    [ST_COMPLETE] =
        "WITH u AS (UPDATE idempotency_records SET state = $4, response_status = $5, "
        "response_body = $6, location = $7, "
        "resource_id = COALESCE($8, resource_id), "
        "provider_ref = COALESCE($9, provider_ref), owner_token = NULL, "
        "lease_expires_at = NULL, updated_at = $10, expires_at = $11 "
        "WHERE " SCOPE_MATCH " AND state IN ('processing', 'pending') "
        "AND owner_token = $12 RETURNING 1) "
        "SELECT pg_notify('" NOTIFY_CHANNEL "', $13) FROM u",
    [ST_RECORDS_LIST] = "SELECT " RECORD_COLUMNS " FROM idempotency_records "
                        "WHERE tenant_id = $1 AND ($2::text IS NULL OR state = $2) "
                        "AND ($3::bigint = 0 OR updated_at < $3) "
                        "ORDER BY updated_at DESC LIMIT $4",
    [ST_META_PUT] = "INSERT INTO meta (name, value) VALUES ($1, $2) "
                    "ON CONFLICT (name) DO NOTHING",
    [ST_META_GET] = "SELECT value FROM meta WHERE name = $1",
    [ST_SWEEP] = "DELETE FROM idempotency_records WHERE (tenant_id, operation, "
                 "key) IN (SELECT tenant_id, operation, key FROM "
                 "idempotency_records WHERE expires_at <= $1 AND state IN "
                 "('completed', 'failed') LIMIT $2 FOR UPDATE SKIP LOCKED)",
    [ST_PING] = "SELECT 1",
    /* idem_store_probe(): a row of its own, changed each time. */
    [ST_PROBE] = "INSERT INTO meta (name, value) VALUES ('probe', $1) "
                 "ON CONFLICT (name) DO UPDATE SET value = excluded.value",
    /* idem_tx_take_over(): a record left behind, given a new owner. */
    [ST_TAKE_OVER] =
        "UPDATE idempotency_records SET owner_token = $4, lease_expires_at = $5, "
        "updated_at = $6 WHERE " SCOPE_MATCH " AND state IN ('pending', "
        "'processing') AND (lease_expires_at IS NULL OR lease_expires_at <= $6) "
        "RETURNING " RECORD_COLUMNS,
};

/* Schema versions, applied in order under an advisory lock so that
 * instances starting together do not race. Never edit a released entry. */
static const char *const migrations[] = {
    "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);"
    "CREATE TABLE tenants ("
    " id BIGSERIAL PRIMARY KEY,"
    " name TEXT NOT NULL UNIQUE,"
    " key_lookup TEXT NOT NULL UNIQUE,"
    " key_hash TEXT NOT NULL,"
    " disabled INTEGER NOT NULL DEFAULT 0,"
    " created_at BIGINT NOT NULL);"
    "CREATE TABLE idempotency_records ("
    " tenant_id BIGINT NOT NULL REFERENCES tenants (id),"
    " operation TEXT NOT NULL,"
    " key TEXT NOT NULL,"
    " fingerprint TEXT NOT NULL,"
    " state TEXT NOT NULL CHECK (state IN ('processing', 'completed', "
    "'failed', 'pending')),"
    " response_status INTEGER,"
    " response_body TEXT,"
    " location TEXT,"
    " resource_id TEXT,"
    " provider_ref TEXT,"
    " correlation_id TEXT NOT NULL,"
    " owner_token TEXT,"
    " lease_expires_at BIGINT,"
    " created_at BIGINT NOT NULL,"
    " updated_at BIGINT NOT NULL,"
    " expires_at BIGINT,"
    " UNIQUE (tenant_id, operation, key));"
    "CREATE INDEX records_expiry ON idempotency_records (expires_at) "
    "WHERE expires_at IS NOT NULL;"
    "CREATE INDEX records_open ON idempotency_records (state, updated_at) "
    "WHERE state IN ('processing', 'pending');"
    "CREATE TABLE resources ("
    " id TEXT PRIMARY KEY,"
    " tenant_id BIGINT NOT NULL REFERENCES tenants (id),"
    " kind TEXT NOT NULL,"
    " status TEXT NOT NULL,"
    " body TEXT NOT NULL,"
    " provider_ref TEXT,"
    " created_at BIGINT NOT NULL,"
    " updated_at BIGINT NOT NULL);"
    "CREATE INDEX resources_by_status ON resources (kind, status);"
    "CREATE TABLE outbox ("
    " resource_id TEXT PRIMARY KEY REFERENCES resources (id),"
    " tenant_id BIGINT NOT NULL,"
    " operation TEXT NOT NULL,"
    " key TEXT NOT NULL,"
    " created_at BIGINT NOT NULL,"
    " attempts INTEGER NOT NULL DEFAULT 0,"
    " next_attempt_at BIGINT NOT NULL);"
    "CREATE VIEW payments AS SELECT id, tenant_id, status,"
    " (body::jsonb ->> 'amount')::bigint AS amount,"
    " body::jsonb ->> 'currency' AS currency,"
    " body::jsonb ->> 'order_id' AS order_id,"
    " provider_ref, created_at, updated_at FROM resources"
    " WHERE kind = 'payment';"
    "CREATE VIEW orders AS SELECT id, tenant_id, status,"
    " body::jsonb ->> 'customer_id' AS customer_id,"
    " (body::jsonb ->> 'total')::bigint AS total,"
    " body::jsonb ->> 'currency' AS currency,"
    " created_at, updated_at FROM resources WHERE kind = 'order';",
    /* 2: no query reads resources by status, and keeping the index cost
     * every payment two more index writes (inserted pending, moved on
     * completion). */
    "DROP INDEX resources_by_status;",
    /* 3: a record's tenant_id is the caller's number, no longer a
     * reference to tenants: tenants are idemd's, and a program that embeds
     * libidem scopes its keys by a value of its own, with no tenant row to
     * make first. The constraint has the name PostgreSQL gave version 1's
     * REFERENCES. Nothing is rewritten, but both tables are locked
     * (ACCESS EXCLUSIVE) until the migration commits. resources keep their
     * reference (payments and orders are idemd's), and the outbox its
     * reference to resources. */
    ("ALTER TABLE idempotency_records DROP CONSTRAINT IF EXISTS "
     "idempotency_records_tenant_id_fkey;"),
    /* 4: from here tenants, resources, the outbox and the views over them
     * are idemd's, made and counted by idemd itself (its own idemd_schema
     * table); a database made at this version holds only meta and the
     * records (`fresh`, below). Nothing changes in one made before. */
    "SELECT 1",
};

#define SCHEMA_VERSION ((int)(sizeof migrations / sizeof *migrations))

/* A new database, made at SCHEMA_VERSION at once: what the versions above
 * leave of libidem's own tables. */
static const char fresh[] =
    "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);"
    "CREATE TABLE idempotency_records ("
    " tenant_id BIGINT NOT NULL,"
    " operation TEXT NOT NULL,"
    " key TEXT NOT NULL,"
    " fingerprint TEXT NOT NULL,"
    " state TEXT NOT NULL CHECK (state IN ('processing', 'completed', "
    "'failed', 'pending')),"
    " response_status INTEGER,"
    " response_body TEXT,"
    " location TEXT,"
    " resource_id TEXT,"
    " provider_ref TEXT,"
    " correlation_id TEXT NOT NULL,"
    " owner_token TEXT,"
    " lease_expires_at BIGINT,"
    " created_at BIGINT NOT NULL,"
    " updated_at BIGINT NOT NULL,"
    " expires_at BIGINT,"
    " UNIQUE (tenant_id, operation, key));"
    "CREATE INDEX records_expiry ON idempotency_records (expires_at) "
    "WHERE expires_at IS NOT NULL;"
    "CREATE INDEX records_open ON idempotency_records (state, updated_at) "
    "WHERE state IN ('processing', 'pending');";
#define MIGRATE_LOCK "7305818436" /* pg_advisory_xact_lock key for migrations */

/* How many writer threads (each with a connection of its own, besides
 * the pool's) run batches at once: while
 * one waits on its COMMIT's flush, another runs its statements
 * (docs/performance.md, "PostgreSQL: group commit"). */
#define WRITERS 4
/* At most this many writes in one transaction. */
#define MAX_BATCH 128
/* How long a whole batch waits for a row lock before it runs again write
 * by write (run_batch()): a batch waiting on another that waits on it
 * would otherwise wait for PostgreSQL's deadlock_timeout (1 s). */
#define WHOLE_LOCK_WAIT_MS 100

struct conn;

enum { TIMED_OUT = 1, LOCK_TIMED_OUT = 2, LOST = 4 }; /* conn.timed_out */

/* A write waiting for a writer. A synchronous caller sleeps on `done`
 * alone; an asynchronous one is called back (`cb`) by the writer, after
 * the COMMIT, and its job, first in a malloc'd block, is freed first. */
struct job {
  int (*fn)(struct conn *, void *);
  void *arg;
  int rc;
  sem_t done;
  idem_store_done_fn cb;
  void *cb_arg;
  /* Its caller answers a request once told (a completion, a single-step
   * reservation, a synchronous caller): told before the batch's others. */
  int answers;
  int64_t queued_ms; /* idem_mono_ms() when queued */
  /* queued_ms + the bound: past it the write fails, unrun if not run yet
   * (docs/operations.md, "When PostgreSQL hangs"). */
  int64_t deadline_ms;
  /* Set under q_lock when a writer takes it off the queue: until then a
   * synchronous caller at its deadline takes it back (write_job()). */
  int taken;
  /* Why it failed, for its caller's log: the writer's per-thread message
   * (idem_store_last_error()), set again in the caller's thread (a
   * synchronous caller after the wait, an asynchronous one before its
   * callback). */
  char err[256];
  struct job *next;
};

struct conn {
  PGconn *pg;
  unsigned prepared; /* bit i: stmt i is prepared on this connection */
  /* In a writer's batch: the transaction's BEGIN has not been sent, and
   * goes out with its first statement (run_piped()). */
  int begin_pending;
  /* Statements sent in pipeline mode whose results are not read yet (the
   * caller's idem_tx_send()); pipe_end() reads them. */
  int queued;
  /* When not 0, the transaction's BEGIN sets lock_timeout and
   * statement_timeout to these (SET LOCAL): a writer's transaction ends
   * by the deadline of its writes (run_batch()). */
  int lock_wait_ms, stmt_wait_ms;
  /* Since the writer cleared it, an error was a bound running out: a
   * statement timeout, the connection cut (TIMED_OUT), a lock timeout
   * (LOCK_TIMED_OUT); run again, such a write would only wait the time
   * out once more. Or the connection was lost (LOST: a server restart),
   * and a write runs again only on a fresh one. Set by fail(). */
  int timed_out;
  /* The last completion's UPDATE changed no row (its owner token lost:
   * IDEM_ELOST with nothing written). Set by apply_outcome(). */
  int lease_lost;
  /* The error of a statement queued (idem_tx_send()) met when
   * tx_statement() had to end the pipeline to prepare another, and
   * returned NULL: the next idem_tx_flush() returns it. */
  int queued_err;
  /* The caller's statements (idem_tx_statement()): bit i, slot i is
   * prepared, from caller_sql[i], as caller_name[i]. */
  uint32_t caller_prepared;
  const char *caller_sql[IDEM_TX_STATEMENTS];
  char caller_name[IDEM_TX_STATEMENTS][16];
  struct conn *next;
  /* While checked out (or the listener's, while it waits on a command):
   * on the store's `busy` list, under pool_lock, with the socket and the
   * time past which the watchdog cuts it. `cut` is set once it has. */
  int fd;
  int64_t deadline_ms;
  atomic_int cut;
  struct conn *busy_prev, *busy_next;
};
_Static_assert(ST_COUNT_ <= 32, "`prepared` has a bit per statement");
_Static_assert(IDEM_TX_STATEMENTS <= 32, "`caller_prepared` has a bit per slot");

typedef struct pg_store {
  struct idem_store base;
  char *url;
  int timeout_ms; /* idem_store_options_t.db_timeout_ms */
  /* libpq's parameters, before the URL's (which win): NULL-terminated. */
  const char *keywords[10];
  const char *values[10];
  char param_text[5][24];
  char pg_options[96];
  pthread_mutex_t pool_lock;
  pthread_cond_t conn_freed; /* a connection went back, or was dropped */
  pthread_cond_t stop_cond;  /* `stopping` set: the watchdog's sleep ends */
  struct conn *free_conns;
  struct conn *busy; /* checked out, watched */
  int open_conns;    /* free and busy; at most max_conns */
  int max_conns;
  pthread_t listener, watchdog;
  int listener_started, watchdog_started;
  /* idem_store_listen()'s: the listener calls watch_fn under watch_lock. */
  pthread_mutex_t watch_lock;
  char watch_channel[64]; /* "": none */
  void (*watch_fn)(void *arg, int listening);
  void *watch_arg;
  int watch_told; /* watch_fn was last called with 1 */
  atomic_int stopping;

  /* Group commit (the writers, below): callers queue their writes and
   * sleep; WRITERS threads, each on a connection of its own (outside
   * max_conns), take every
   * write queued at that moment, run them in one transaction with one
   * COMMIT, then tell each caller its own result. */
  pthread_mutex_t q_lock;
  pthread_cond_t q_ready; /* a writer waits for work */
  struct job *q_head, *q_tail;
  int q_stopping;
  pthread_t writers[WRITERS];
  int writers_started;
  atomic_uint_fast64_t commits, writes, batch_reruns;
} pg_store_t;

static const idem_store_methods_t pg_methods;

/* Maps a failed result to an idem error, keeping libpq's text for logs. */
static int fail(struct conn *c, PGresult *res, const char *what) {
  const char *state = res ? PQresultErrorField(res, PG_DIAG_SQLSTATE) : NULL;
  if (atomic_load_explicit(&c->cut, memory_order_relaxed) ||
      (state && strcmp(state, "57014") == 0))
    c->timed_out |= TIMED_OUT;
  else if (PQstatus(c->pg) != CONNECTION_OK)
    c->timed_out |= LOST;
  else if (state && strcmp(state, "55P03") == 0)
    c->timed_out |= LOCK_TIMED_OUT;
  if (atomic_load_explicit(&c->cut, memory_order_relaxed)) {
    idem__store_set_error("postgres %s: no answer within the bound "
                          "(--db-timeout, twice over): the connection was cut",
                          what);
    return IDEM_ESTORE;
  }
  idem__store_set_error("postgres %s: %s", what,
                        res && PQresultErrorMessage(res)[0]
                            ? PQresultErrorMessage(res)
                            : PQerrorMessage(c->pg));
  if (state && strcmp(state, "23505") == 0)
    return IDEM_EEXIST;
  return IDEM_ESTORE;
}

static void conn_free(struct conn *c) {
  if (c == NULL)
    return;
  PQfinish(c->pg);
  free(c);
}

/* Server notices ("relation already exists, skipping") are not errors;
 * keep them off stderr, which is the request log. */
static void quiet(void *arg, const char *message) {
  (void)arg;
  (void)message;
}

/* libpq's connection, with the bounds of s->timeout_ms (connect_timeout,
 * keepalives, tcp_user_timeout, statement_timeout and lock_timeout in
 * `options`) put before the URL, so that its own parameters win. */
static PGconn *pg_connect(pg_store_t *s) {
  return PQconnectdbParams(s->keywords, s->values, 1);
}

static int conn_new(pg_store_t *s, struct conn **out) {
  struct conn *c = calloc(1, sizeof *c);
  *out = NULL;
  if (c == NULL)
    return IDEM_ENOMEM;
  c->pg = pg_connect(s);
  if (c->pg == NULL || PQstatus(c->pg) != CONNECTION_OK) {
    idem__store_set_error("postgres connect: %s",
                          c->pg ? PQerrorMessage(c->pg) : "out of memory");
    conn_free(c);
    return IDEM_ESTORE;
  }
  PQsetNoticeProcessor(c->pg, quiet, NULL);
  *out = c;
  return IDEM_OK;
}

/* Whether an idle pooled connection has anything to read. It should not:
 * pooled connections never LISTEN. A server that shut down sent each of
 * them a FATAL message and closed it; reading that message alone left
 * libpq's status OK (the close shows only on the next read), and the
 * connection failed the request it was given (a 503). */
static int idle_conn_readable(PGconn *pg) {
  struct pollfd p = {.fd = PQsocket(pg), .events = POLLIN};
  return p.fd < 0 || poll(&p, 1, 0) > 0;
}

/* Puts `c` on the watched list with the watchdog's deadline (twice the
 * bound: the server's own statement_timeout, which keeps the connection,
 * fires first while it runs). Under pool_lock. */
static void watch_locked(pg_store_t *s, struct conn *c) {
  c->fd = PQsocket(c->pg);
  c->deadline_ms = idem_mono_ms() + 2 * (int64_t)s->timeout_ms;
  c->busy_prev = NULL;
  c->busy_next = s->busy;
  if (s->busy)
    s->busy->busy_prev = c;
  s->busy = c;
}

/* Takes `c` off the watched list; from here the watchdog never touches
 * its socket, which PQfinish() may close and the kernel give to another
 * file. Under pool_lock. */
static void unwatch_locked(pg_store_t *s, struct conn *c) {
  if (c->busy_prev)
    c->busy_prev->busy_next = c->busy_next;
  else
    s->busy = c->busy_next;
  if (c->busy_next)
    c->busy_next->busy_prev = c->busy_prev;
  c->busy_prev = c->busy_next = NULL;
}

/* Takes a pooled connection, or opens one while fewer than max_conns are
 * open, or waits (at most the bound) for one to come back: past it,
 * IDEM_ESTORE, never an unbounded wait. A server that restarted closed
 * our idle connections: a connection with anything to read (that close,
 * or the message before it) is dropped instead of failing a request. The
 * connection is watched until conn_put(). */
static int conn_get(pg_store_t *s, struct conn **out) {
  int64_t deadline = idem_mono_ms() + s->timeout_ms;
  struct conn *c;
  int rc;

  pthread_mutex_lock(&s->pool_lock);
  for (;;) {
    if ((c = s->free_conns) != NULL) {
      s->free_conns = c->next;
      pthread_mutex_unlock(&s->pool_lock);
      if (PQstatus(c->pg) == CONNECTION_OK && !idle_conn_readable(c->pg))
        break;
      conn_free(c);
      pthread_mutex_lock(&s->pool_lock);
      s->open_conns--;
      continue;
    }
    if (s->open_conns < s->max_conns) {
      s->open_conns++;
      pthread_mutex_unlock(&s->pool_lock);
      if ((rc = conn_new(s, &c)) == IDEM_OK)
        break;
      pthread_mutex_lock(&s->pool_lock);
      s->open_conns--;
      pthread_cond_signal(&s->conn_freed);
      pthread_mutex_unlock(&s->pool_lock);
      return rc;
    }
    int64_t left = deadline - idem_mono_ms();
    if (left <= 0) {
      pthread_mutex_unlock(&s->pool_lock);
      idem__store_set_error("postgres: no connection of the pool (%d) came free "
                            "within %d ms",
                            s->max_conns, s->timeout_ms);
      return IDEM_ESTORE;
    }
    struct timespec ts;
    idem__deadline_after(left, &ts);
    (void)pthread_cond_timedwait(&s->conn_freed, &s->pool_lock, &ts);
  }
  pthread_mutex_lock(&s->pool_lock);
  watch_locked(s, c);
  pthread_mutex_unlock(&s->pool_lock);
  *out = c;
  return IDEM_OK;
}

/* Returns a connection to the pool, or drops it if it broke or the
 * watchdog cut it (the next caller then opens a fresh one: that is how we
 * survive a restart, or a server that hung). */
static void conn_put(pg_store_t *s, struct conn *c) {
  int keep = !atomic_load_explicit(&c->cut, memory_order_relaxed) &&
             PQstatus(c->pg) == CONNECTION_OK &&
             PQpipelineStatus(c->pg) == PQ_PIPELINE_OFF &&
             PQtransactionStatus(c->pg) == PQTRANS_IDLE;
  pthread_mutex_lock(&s->pool_lock);
  unwatch_locked(s, c);
  if (keep) {
    c->next = s->free_conns;
    s->free_conns = c;
  } else {
    s->open_conns--;
  }
  pthread_cond_signal(&s->conn_freed);
  pthread_mutex_unlock(&s->pool_lock);
  if (!keep)
    conn_free(c);
}

/* The watchdog: a connection watched past its deadline waits on a server
 * that no longer answers (stopped, or its host gone with no RST); its
 * socket is shut down, which makes the call blocked on it fail at once.
 * Only while the connection is still on the list, under pool_lock, so
 * the descriptor is still that connection's. */
static void *watchdog_loop(void *arg) {
  pg_store_t *s = arg;
  long step_ms = s->timeout_ms / 10 < 10 ? 10 : s->timeout_ms / 10 > 250 ? 250 : s->timeout_ms / 10;

  pthread_mutex_lock(&s->pool_lock);
  while (!atomic_load(&s->stopping)) {
    struct timespec ts;
    idem__deadline_after(step_ms, &ts);
    (void)pthread_cond_timedwait(&s->stop_cond, &s->pool_lock, &ts);
    int64_t now = idem_mono_ms();
    for (struct conn *c = s->busy; c; c = c->busy_next)
      if (c->deadline_ms <= now && c->fd >= 0 &&
          !atomic_load_explicit(&c->cut, memory_order_relaxed)) {
        atomic_store_explicit(&c->cut, 1, memory_order_relaxed);
        (void)shutdown(c->fd, SHUT_RDWR);
      }
  }
  pthread_mutex_unlock(&s->pool_lock);
  return NULL;
}

/* Ends the pipeline that idem_tx_send() began, if any: a Sync, then the
 * results of every statement queued, read. IDEM_OK, or the first of their
 * errors (the transaction is then failed). Leaves pipeline mode, so that
 * the connection runs statements as usual again. */
static int pipe_end(struct conn *c) {
  int err = IDEM_OK, q = 0, synced = 0;
  PGresult *res;

  if (PQpipelineStatus(c->pg) == PQ_PIPELINE_OFF)
    return IDEM_OK;
  if (!PQpipelineSync(c->pg))
    err = fail(c, NULL, "send");
  /* Each statement's results end with a NULL, the Sync's result ends the
   * pipeline; a connection that broke gives NULLs only. */
  while (!synced && q <= c->queued) {
    ExecStatusType st;
    if ((res = PQgetResult(c->pg)) == NULL) {
      q++;
      continue;
    }
    st = PQresultStatus(res);
    if (st == PGRES_PIPELINE_SYNC)
      synced = 1;
    else if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK &&
             st != PGRES_PIPELINE_ABORTED && err == IDEM_OK)
      err = fail(c, res, "queued statement");
    PQclear(res);
  }
  c->queued = 0;
  if (!PQexitPipelineMode(c->pg) && err == IDEM_OK)
    err = fail(c, NULL, "pipeline");
  if (err == IDEM_OK && !synced)
    err = fail(c, NULL, "queued statement");
  return err;
}

/* Prepares statement `id` on this connection on its first use; its name
 * goes in `name` (16 bytes). IDEM_OK, or the error recorded. */
static int prepare(struct conn *c, enum stmt_id id, char *name) {
  PGresult *res;
  int rc;

  snprintf(name, 16, "idem_%d", (int)id);
  if (c->prepared & (1u << id))
    return IDEM_OK;
  if ((rc = pipe_end(c)) != IDEM_OK)
    return rc;
  res = PQprepare(c->pg, name, stmt_sql[id], 0, NULL);
  if (PQresultStatus(res) != PGRES_COMMAND_OK) {
    int err = fail(c, res, "prepare");
    PQclear(res);
    return err;
  }
  PQclear(res);
  c->prepared |= 1u << id;
  return IDEM_OK;
}

/* The statement that sets the transaction's own bounds (SET LOCAL, in one
 * statement: a pipeline's queries are one statement each). */
static void set_local(const struct conn *c, char *sql, size_t len) {
  snprintf(sql, len,
           "SELECT set_config('lock_timeout', '%d', true), "
           "set_config('statement_timeout', '%d', true)",
           c->lock_wait_ms > 0 ? c->lock_wait_ms : c->stmt_wait_ms,
           c->stmt_wait_ms > 0 ? c->stmt_wait_ms : c->lock_wait_ms);
}

/* Sends, in one round trip (libpq's pipeline mode), the transaction's
 * BEGIN when it is pending, and statement `id`, after the statements
 * idem_tx_send() queued (whose results it reads first: their errors are
 * this call's). Returns `id`'s result, which the caller clears, or NULL
 * with the first error recorded: a statement after a failed one is not
 * run, and the transaction is left failed, for the writer to roll back.
 * docs/performance.md, "PostgreSQL: fewer round trips". */
static PGresult *run_piped(struct conn *c, enum stmt_id id, int n,
                           const char *const *params, int *err) {
  char name[16], set[128];
  int begin, skip, queries, q = 0, synced = 0;
  PGresult *res, *kept = NULL;

  *err = IDEM_OK;
  if ((*err = prepare(c, id, name)) != IDEM_OK) /* may end the pipeline */
    return NULL;
  /* BEGIN, and the SET LOCAL of a whole batch's lock waits: `begin`
   * statements before ours. */
  begin = c->begin_pending ? 1 + (c->lock_wait_ms > 0 || c->stmt_wait_ms > 0) : 0;
  skip = c->queued;
  c->begin_pending = 0;
  c->queued = 0;
  if (begin > 1)
    set_local(c, set, sizeof set);
  if (PQpipelineStatus(c->pg) == PQ_PIPELINE_OFF && !PQenterPipelineMode(c->pg)) {
    *err = fail(c, NULL, "pipeline");
    return NULL;
  }
  if (!(begin ? PQsendQueryParams(c->pg, "BEGIN", 0, NULL, NULL, NULL, NULL, 0) : 1) ||
      !(begin > 1 ? PQsendQueryParams(c->pg, set, 0, NULL, NULL, NULL, NULL, 0) : 1) ||
      !PQsendQueryPrepared(c->pg, name, n, params, NULL, NULL, 0) ||
      !PQpipelineSync(c->pg))
    *err = fail(c, NULL, "send");
  /* Each query's results end with a NULL; the sync's result ends the
   * pipeline. A connection that broke gives NULLs only. */
  queries = skip + begin + 1;
  while (!synced && q <= queries) {
    ExecStatusType st;
    if ((res = PQgetResult(c->pg)) == NULL) {
      q++;
      continue;
    }
    st = PQresultStatus(res);
    if (st == PGRES_PIPELINE_SYNC) {
      synced = 1;
    } else if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK) {
      if (q == skip + begin && kept == NULL) {
        kept = res;
        continue;
      }
    } else if (st != PGRES_PIPELINE_ABORTED && *err == IDEM_OK) {
      *err = fail(c, res, q < skip ? "queued statement" : q < skip + begin ? "BEGIN" : "query");
    }
    PQclear(res);
  }
  if (!PQexitPipelineMode(c->pg) && *err == IDEM_OK)
    *err = fail(c, NULL, "pipeline");
  if (*err == IDEM_OK && (!synced || kept == NULL))
    *err = fail(c, NULL, "query");
  if (*err != IDEM_OK) {
    PQclear(kept);
    return NULL;
  }
  return kept;
}

/* Runs prepared statement `id` (preparing it on first use on this
 * connection), with the transaction's BEGIN when that is pending. Returns
 * the result, which the caller clears, or NULL with the error recorded. */
static PGresult *run(struct conn *c, enum stmt_id id, int n,
                     const char *const *params, int *err) {
  char name[16];
  PGresult *res;
  ExecStatusType st;

  if (c->begin_pending || PQpipelineStatus(c->pg) != PQ_PIPELINE_OFF)
    return run_piped(c, id, n, params, err);
  if ((*err = prepare(c, id, name)) != IDEM_OK)
    return NULL;
  res = PQexecPrepared(c->pg, name, n, params, NULL, NULL, 0);
  st = PQresultStatus(res);
  if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
    *err = fail(c, res, "query");
    PQclear(res);
    return NULL;
  }
  *err = IDEM_OK;
  return res;
}

/* Runs a statement whose rows we do not need; `*changed` gets the row count
 * it affected when not NULL. */
static int run_cmd(struct conn *c, enum stmt_id id, int n,
                   const char *const *params, int *changed) {
  int err;
  PGresult *res = run(c, id, n, params, &err);
  if (res == NULL)
    return err;
  if (changed) {
    const char *t = PQcmdTuples(res);
    *changed = t && *t ? atoi(t) : PQntuples(res);
  }
  PQclear(res);
  return IDEM_OK;
}

static int simple(struct conn *c, const char *sql) {
  PGresult *res;
  int rc = pipe_end(c);

  if (rc != IDEM_OK)
    return rc;
  res = PQexec(c->pg, sql);
  if (PQresultStatus(res) != PGRES_COMMAND_OK && PQresultStatus(res) != PGRES_TUPLES_OK)
    rc = fail(c, res, sql);
  PQclear(res);
  return rc;
}

/* Sends the transaction's BEGIN when it is still pending: before a
 * statement that does not go through run(). */
static int begin_now(struct conn *c) {
  if (!c->begin_pending)
    return IDEM_OK;
  c->begin_pending = 0;
  if (c->lock_wait_ms > 0 || c->stmt_wait_ms > 0) { /* one round trip (simple protocol) */
    char sql[160];
    memcpy(sql, "BEGIN; ", 7);
    set_local(c, sql + 7, sizeof sql - 7);
    return simple(c, sql);
  }
  return simple(c, "BEGIN");
}

static int tx_end(struct conn *c, int ok) {
  if (c->begin_pending) { /* nothing was sent: nothing to end */
    c->begin_pending = 0;
    return IDEM_OK;
  }
  if (ok) {
    /* The COMMIT goes out with what idem_tx_send() queued: one round
     * trip; if one of those failed, the COMMIT is not run. */
    int rc = IDEM_OK;
    if (PQpipelineStatus(c->pg) == PQ_PIPELINE_OFF) {
      /* COMMIT of a transaction the server aborted answers ROLLBACK, not
       * an error: it must not pass for durable. */
      if (PQtransactionStatus(c->pg) != PQTRANS_INTRANS) {
        idem__store_set_error("postgres: COMMIT of a failed transaction");
        return IDEM_ESTORE;
      }
      return simple(c, "COMMIT");
    }
    if (!PQsendQueryParams(c->pg, "COMMIT", 0, NULL, NULL, NULL, NULL, 0))
      rc = fail(c, NULL, "send");
    else
      c->queued++;
    int end = pipe_end(c);
    if (rc == IDEM_OK)
      rc = end;
    if (rc == IDEM_OK && PQtransactionStatus(c->pg) != PQTRANS_IDLE)
      rc = fail(c, NULL, "COMMIT");
    return rc;
  }
  (void)pipe_end(c); /* its errors are the rollback's reason */
  if (PQtransactionStatus(c->pg) != PQTRANS_IDLE)
    (void)simple(c, "ROLLBACK");
  return IDEM_OK;
}

/* Decimal text of a number, in a caller-provided buffer. */
static const char *num(char *buf, size_t len, long long v) {
  snprintf(buf, len, "%lld", v);
  return buf;
}

/* Copies row `i` of a result with the RECORD_COLUMNS into `out`. */
static int row_to_record(PGresult *res, int i, idem_record_t *out) {
  idem_record_reset(out);
  out->tenant_id = strtoll(PQgetvalue(res, i, 0), NULL, 10);
  idem_copy(out->operation, sizeof out->operation, PQgetvalue(res, i, 1));
  idem_copy(out->key, sizeof out->key, PQgetvalue(res, i, 2));
  idem_copy(out->fingerprint, sizeof out->fingerprint, PQgetvalue(res, i, 3));
  out->state = idem_state_parse(PQgetvalue(res, i, 4));
  out->response_status = atoi(PQgetvalue(res, i, 5));
  if (!PQgetisnull(res, i, 6) &&
      (out->response_body = strdup(PQgetvalue(res, i, 6))) == NULL)
    return IDEM_ENOMEM;
  idem_copy(out->location, sizeof out->location, PQgetvalue(res, i, 7));
  idem_copy(out->resource_id, sizeof out->resource_id, PQgetvalue(res, i, 8));
  idem_copy(out->provider_ref, sizeof out->provider_ref, PQgetvalue(res, i, 9));
  idem_copy(out->correlation_id, sizeof out->correlation_id, PQgetvalue(res, i, 10));
  idem_copy(out->owner_token, sizeof out->owner_token, PQgetvalue(res, i, 11));
  out->lease_expires_at = strtoll(PQgetvalue(res, i, 12), NULL, 10);
  out->created_at = strtoll(PQgetvalue(res, i, 13), NULL, 10);
  out->updated_at = strtoll(PQgetvalue(res, i, 14), NULL, 10);
  out->expires_at = strtoll(PQgetvalue(res, i, 15), NULL, 10);
  return IDEM_OK;
}

static int read_record(struct conn *c, const idem_scope_t *sc, idem_record_t *out) {
  char t[24];
  const char *p[3] = {num(t, sizeof t, sc->tenant_id), sc->operation, sc->key};
  PGresult *res;
  int err;

  if ((res = run(c, ST_READ_RECORD, 3, p, &err)) == NULL)
    return err;
  err = PQntuples(res) == 0 ? IDEM_ENOTFOUND : row_to_record(res, 0, out);
  PQclear(res);
  return err;
}

/* idem_tx_statement(): prepared once per connection, again for other SQL. */
static void *tx_statement(idem_tx_t *tx, unsigned slot, const char *sql) {
  struct conn *c = tx->conn;
  char *name = c->caller_name[slot];
  PGresult *res;

  if (begin_now(c) != IDEM_OK)
    return NULL;
  if ((c->caller_prepared & (1u << slot)) &&
      (c->caller_sql[slot] == sql || strcmp(c->caller_sql[slot], sql) == 0))
    return name;
  if ((c->queued_err = pipe_end(c)) != IDEM_OK) /* PQprepare() needs no pipeline */
    return NULL;
  if ((c->caller_prepared & (1u << slot)) && c->caller_sql[slot] != sql &&
      strcmp(c->caller_sql[slot], sql) != 0) {
    char drop[48];
    snprintf(drop, sizeof drop, "DEALLOCATE %s", name);
    PQclear(PQexec(c->pg, drop));
    c->caller_prepared &= ~(1u << slot);
  }
  if (!(c->caller_prepared & (1u << slot))) {
    snprintf(name, sizeof c->caller_name[slot], "idem_caller_%u", slot);
    res = PQprepare(c->pg, name, sql, 0, NULL);
    if (PQresultStatus(res) != PGRES_COMMAND_OK) {
      (void)fail(c, res, "prepare the caller's statement");
      PQclear(res);
      return NULL;
    }
    PQclear(res);
    c->caller_sql[slot] = sql;
    c->caller_prepared |= 1u << slot;
  }
  return name;
}

static int tx_take_over(idem_tx_t *tx, const idem_scope_t *sc, const char *owner,
                        int64_t lease_expires_at, idem_record_t *out) {
  struct conn *c = tx->conn;
  char t[24], lease[24], now[24];
  const char *p[6] = {num(t, sizeof t, sc->tenant_id), sc->operation, sc->key, owner,
                      num(lease, sizeof lease, lease_expires_at),
                      num(now, sizeof now, tx->now_ms)};
  PGresult *res;
  int err;

  if ((res = run(c, ST_TAKE_OVER, 6, p, &err)) == NULL)
    return err;
  err = PQntuples(res) == 0 ? IDEM_ENOTFOUND : row_to_record(res, 0, out);
  PQclear(res);
  return err;
}

/* At most this many statements queued before they are sent and their
 * results read: libpq writes while the server's answers pile up unread,
 * and both would wait on the other once the sockets' buffers are full. */
#define MAX_QUEUED 64

/* idem_tx_send(): the statement joins the pipeline (entered on the
 * first), its results read by the next statement that needs an answer. */
static int tx_send(idem_tx_t *tx, const char *name, int n, const char *const *values) {
  struct conn *c = tx->conn;
  int rc;

  if ((rc = begin_now(c)) != IDEM_OK)
    return rc;
  if (c->queued >= MAX_QUEUED && (rc = pipe_end(c)) != IDEM_OK)
    return rc;
  if (PQpipelineStatus(c->pg) == PQ_PIPELINE_OFF && !PQenterPipelineMode(c->pg))
    return fail(c, NULL, "pipeline");
  if (!PQsendQueryPrepared(c->pg, name, n, values, NULL, NULL, 0))
    return fail(c, NULL, "send");
  c->queued++;
  return IDEM_OK;
}

static int tx_flush(idem_tx_t *tx) {
  struct conn *c = tx->conn;
  int rc = pipe_end(c);
  if (rc == IDEM_OK)
    rc = c->queued_err;
  c->queued_err = IDEM_OK;
  return rc;
}

static const idem__tx_ops_t tx_ops = {tx_statement, tx_take_over, tx_send, tx_flush};

/* Runs the caller's effect `e` on connection `c`. */
static int run_effect(struct conn *c, const idem_effect_t *e, int64_t now_ms,
                      int writable) {
  idem_tx_t tx = {"postgresql", c->pg, now_ms, &tx_ops, c, writable};
  int rc;
  if (e == NULL || e->fn == NULL)
    return IDEM_OK;
  /* The effect may run statements on idem_tx_handle() itself: not in a
   * pipeline. What it queues itself (idem_tx_send()) goes out with the
   * next statement that needs an answer, or the COMMIT. */
  if ((rc = pipe_end(c)) != IDEM_OK || (rc = begin_now(c)) != IDEM_OK)
    return rc;
  return idem__effect_run(e, &tx);
}

/* The NOTIFY payload that names a scope: "tenant\noperation\nkey". */
static void notify_payload(char *payload, size_t len, const idem_scope_t *sc) {
  snprintf(payload, len, "%lld\n%s\n%s", (long long)sc->tenant_id, sc->operation,
           sc->key);
}

static int apply_outcome(struct conn *c, const idem_scope_t *sc,
                         const char *owner, const idem_outcome_t *o,
                         int64_t now_ms, int64_t ttl_ms) {
  char t[24], status[16], now[24], exp[24];
  char payload[32 + IDEM_OPERATION_MAX + IDEM_KEY_MAX];
  const char *p[13] = {num(t, sizeof t, sc->tenant_id), sc->operation, sc->key,
                       idem_state_name(o->state),
                       num(status, sizeof status, o->status), o->body,
                       o->location, o->resource_id, o->provider_ref,
                       num(now, sizeof now, now_ms),
                       o->state == IDEM_STATE_PENDING
                           ? NULL
                           : num(exp, sizeof exp, now_ms + ttl_ms),
                       owner, payload};
  PGresult *res;
  int rc;

  /* The update and its NOTIFY are one statement (ST_COMPLETE), sent with
   * the transaction's BEGIN when that is pending. */
  notify_payload(payload, sizeof payload, sc);
  if ((res = run(c, ST_COMPLETE, 13, p, &rc)) == NULL)
    return rc;
  rc = PQntuples(res) == 1 ? IDEM_OK : IDEM_ELOST;
  c->lease_lost = rc == IDEM_ELOST;
  PQclear(res);
  return rc;
}

static int reserve_tx(struct conn *c, const idem_reserve_t *req,
                      const char *owner, idem_record_t *out,
                      idem_reserve_result_t *result) {
  char t[24], lease[24], now[24];
  const char *p[9] = {num(t, sizeof t, req->scope.tenant_id), req->scope.operation,
                      req->scope.key, req->fingerprint, req->correlation_id, owner,
                      num(lease, sizeof lease, req->now_ms + req->lease_ms),
                      num(now, sizeof now, req->now_ms), req->resource_id};
  int rc, won = 0;

  if ((rc = run_cmd(c, ST_RESERVE, 9, p, &won)) != IDEM_OK)
    return rc;
  if (won == 0) {
    *result = IDEM_RESERVE_EXISTS;
    return read_record(c, &req->scope, out);
  }
  *result = IDEM_RESERVE_WON;
  if ((rc = run_effect(c, &req->effect, req->now_ms, 1)) != IDEM_OK)
    return rc;
  if (req->outcome) {
    rc = apply_outcome(c, &req->scope, owner, req->outcome, req->now_ms,
                       req->ttl_ms);
    if (rc != IDEM_OK)
      return rc == IDEM_ELOST ? IDEM_ESTORE : rc;
    return idem__settled_record(req, owner, 0, out);
  }
  return idem__won_record(req, owner, 0, out);
}

/* The group-commit writers (docs/performance.md, "PostgreSQL: group
 * commit"). Each takes every write queued at that moment (up to
 * MAX_BATCH) and runs them on a connection of its own (writer_conn()) in
 * one transaction: one COMMIT, one flush of the WAL and one wake-up of
 * the waiters on other instances (the NOTIFYs go out at that COMMIT) for
 * all. A write that
 * fails is undone alone: the batch runs first with nothing between its
 * writes; if one fails (its error aborts the transaction), the
 * transaction is rolled back and the batch runs again, each write in a
 * transaction of its own (run_batch(); the SQLite writer, which has no
 * row locks to meet, uses savepoints).
 * Every write of the store may run twice (store.h says so of effects and
 * idem_store_write(); reservations and completions set all their outputs
 * on each run). The unique constraint still decides between writers and
 * instances: a reservation of a key another batch holds waits for that
 * batch's COMMIT, within lock_timeout (WHOLE_LOCK_WAIT_MS for a whole
 * batch). */

static __thread int on_writer; /* this thread is one of the writers */

/* Keeps the message of a write that failed (the writer's last error)
 * for its caller. */
static void note(struct job *j) {
  if (j->rc != IDEM_OK)
    snprintf(j->err, sizeof j->err, "%s", idem_store_last_error());
}

/* Sets the watchdog's deadline of a writer's connection: the bound past
 * `deadline_ms` (the last deadline of its batch's writes), by when the
 * server's own timeouts, set to the time left (SET LOCAL), have fired. Once
 * per batch, not per write: a batch of a hundred writes on a server that
 * hangs is cut as one call is. */
static void watch_until(pg_store_t *s, struct conn *c, int64_t deadline_ms) {
  pthread_mutex_lock(&s->pool_lock);
  c->deadline_ms = deadline_ms + s->timeout_ms;
  pthread_mutex_unlock(&s->pool_lock);
}

/* The milliseconds left before `deadline_ms`, at least 1 (0 would turn
 * the server's timeout off). */
static int ms_left(int64_t deadline_ms) {
  int64_t left = deadline_ms - idem_mono_ms();
  return left < 1 ? 1 : left > INT32_MAX ? INT32_MAX : (int)left;
}

/* Runs one write of a batch. */
static int run_job(struct conn *c, struct job *j) {
  c->lease_lost = 0;
  c->queued_err = IDEM_OK;
  return j->fn(c, j->arg);
}

/* Whether what the write just run did is kept (committed with its
 * transaction): when it succeeded, or when it is a completion whose owner
 * token was lost (IDEM_ELOST from its own UPDATE, which changed nothing,
 * the transaction intact: that write's result, not a failure to undo).
 * An IDEM_ELOST of an effect, which may have written, is rolled back as
 * any failure. */
static int kept(const struct conn *c, const struct job *j) {
  return j->rc == IDEM_OK || (j->rc == IDEM_ELOST && c->lease_lost);
}

/* Runs the batch's writes one after the other in one transaction, with
 * its BEGIN sent with the first statement, its lock waits at most
 * WHOLE_LOCK_WAIT_MS and its statements bounded by the first deadline of
 * its writes. Returns 1 when all succeeded (the transaction stays open for
 * the COMMIT), 0 when one failed (the transaction is rolled back). */
static int run_batch_whole(pg_store_t *s, struct conn *c, struct job *jobs) {
  int64_t first = jobs->deadline_ms;
  for (struct job *j = jobs; j; j = j->next)
    first = j->deadline_ms < first ? j->deadline_ms : first;
  c->begin_pending = 1;
  c->stmt_wait_ms = ms_left(first);
  c->lock_wait_ms = c->stmt_wait_ms < WHOLE_LOCK_WAIT_MS ? c->stmt_wait_ms : WHOLE_LOCK_WAIT_MS;
  for (struct job *j = jobs; j; j = j->next) {
    j->rc = run_job(c, j);
    note(j);
    if (!kept(c, j)) {
      (void)tx_end(c, 0);
      return 0;
    }
  }
  return 1;
}

/* A writer's own connection, outside the pool and its limit (as the
 * SQLite writer keeps its own): readers that take every pooled connection
 * never starve the writes. *cp is the writer's connection, kept between
 * batches; one that broke, was cut, or was left in a transaction is
 * replaced by a fresh one. The connection is watched until
 * writer_conn_done(). IDEM_OK, or the error recorded and *cp NULL. */
static int writer_conn(pg_store_t *s, struct conn **cp) {
  struct conn *c = *cp;
  int rc;

  if (c && (atomic_load_explicit(&c->cut, memory_order_relaxed) ||
            PQstatus(c->pg) != CONNECTION_OK ||
            PQpipelineStatus(c->pg) != PQ_PIPELINE_OFF ||
            PQtransactionStatus(c->pg) != PQTRANS_IDLE || idle_conn_readable(c->pg))) {
    conn_free(c);
    *cp = c = NULL;
  }
  if (c == NULL && (rc = conn_new(s, cp)) != IDEM_OK)
    return rc;
  c = *cp;
  c->timed_out = 0;
  pthread_mutex_lock(&s->pool_lock);
  watch_locked(s, c);
  pthread_mutex_unlock(&s->pool_lock);
  return IDEM_OK;
}

/* The end of a writer's batch: its connection is watched no more (and is
 * checked again at the next). */
static void writer_conn_done(pg_store_t *s, struct conn *c) {
  c->lock_wait_ms = c->stmt_wait_ms = 0;
  pthread_mutex_lock(&s->pool_lock);
  unwatch_locked(s, c);
  pthread_mutex_unlock(&s->pool_lock);
}

/* A writer's connection lost (a server restart): replaced by a fresh one,
 * watched to the bound past `last`. IDEM_OK, or the error recorded and
 * *cp NULL. */
static int renew(pg_store_t *s, struct conn **cp, int64_t last) {
  int rc;

  writer_conn_done(s, *cp);
  if ((rc = writer_conn(s, cp)) != IDEM_OK) /* drops the broken one */
    return rc;
  watch_until(s, *cp, last);
  return IDEM_OK;
}

/* Fails the writes from `j` on, unrun, with IDEM_ESTORE: nothing of
 * theirs is committed. */
static void fail_rest(struct job *j, const char *why) {
  if (j)
    idem__store_set_error("postgres: %s; the batch's writes left were not run", why);
  for (; j; j = j->next) {
    j->rc = IDEM_ESTORE;
    note(j);
  }
}

/* What a batch's statements queued (idem_tx_send()) is known to have
 * run only at its COMMIT, which goes out with them: a COMMIT that fails
 * after a batch whose writes all returned IDEM_OK makes it run again.
 *
 * A batch that failed runs again write by write, each write in a
 * transaction of its own (not in savepoints of one): a transaction holds
 * the row locks of all its writes until its COMMIT, and two batches that
 * lock rows the other holds (refunds of the same payments, in another
 * order) wait on each other until PostgreSQL breaks the deadlock, a
 * second later; savepoints would keep the locks and meet again. A write
 * alone locks what one request did before the group commit.
 *
 * The batch stays within its writes' deadlines (queued + the bound):
 * each write's transaction waits for a lock or a statement at most the
 * time left to its deadline (SET LOCAL), a write past its deadline fails
 * unrun, and a failure that is a bound running out (55P03 past the whole
 * batch's short lock wait, 57014, a connection cut) fails the writes left
 * unrun instead of waiting the time out again for each: while the
 * database hangs, a batch of N takes about the bound, not N times it
 * (docs/operations.md, "When PostgreSQL hangs"). A connection lost (a
 * server restart) before a COMMIT went out committed nothing: the writes
 * run again on a fresh connection. One lost after its COMMIT went out
 * fails the writes of that transaction: nothing runs twice on a COMMIT
 * that may have been done. *cp is the connection in use at the end (NULL
 * when none could be had). Returns how many transactions committed. */
static int run_batch(pg_store_t *s, struct conn **cp, struct job *jobs) {
  struct conn *c = *cp;
  int64_t last = jobs->deadline_ms;
  int commits = 0;

  for (struct job *j = jobs; j; j = j->next)
    last = j->deadline_ms > last ? j->deadline_ms : last;
  watch_until(s, c, last);
  c->timed_out = 0;
  if (run_batch_whole(s, c, jobs)) {
    if (c->begin_pending) { /* nothing was sent: nothing to commit */
      c->begin_pending = 0;
      return 0;
    }
    if (tx_end(c, 1) == IDEM_OK)
      return 1;
    (void)tx_end(c, 0);
    if (c->timed_out & (LOST | TIMED_OUT)) {
      /* The COMMIT went out, its answer did not come: it may have been
       * done, and nothing may run twice (docs/operations.md, "When
       * PostgreSQL hangs"). */
      fail_rest(jobs, "the batch's COMMIT got no answer (the connection was lost)");
      return 0;
    }
  }
  /* The whole batch's lock wait is shorter than the bound on purpose:
   * that 55P03 alone is worth a rerun, when time is left. */
  if ((c->timed_out & TIMED_OUT) ||
      ((c->timed_out & LOCK_TIMED_OUT) && c->lock_wait_ms >= c->stmt_wait_ms)) {
    fail_rest(jobs, "the batch ran out of its bound");
    return 0;
  }
  atomic_fetch_add(&s->batch_reruns, 1);
  for (struct job *j = jobs; j; j = j->next) {
    if (atomic_load_explicit(&c->cut, memory_order_relaxed)) {
      fail_rest(j, "the batch's connection was cut");
      break;
    }
    /* A connection lost (a server restart) before a COMMIT went out left
     * nothing committed: the writes left run on a fresh one. */
    if (PQstatus(c->pg) != CONNECTION_OK && renew(s, cp, last) != IDEM_OK) {
      fail_rest(j, "the batch lost its connection, and got no other");
      break;
    }
    c = *cp;
    if (j->deadline_ms <= idem_mono_ms()) {
      idem__store_set_error("postgres: the write was not run within the bound (%d ms)",
                            s->timeout_ms);
      j->rc = IDEM_ESTORE;
      note(j);
      continue;
    }
    c->begin_pending = 1;
    c->timed_out = 0;
    c->stmt_wait_ms = c->lock_wait_ms = ms_left(j->deadline_ms);
    j->rc = run_job(c, j);
    if (!kept(c, j)) {
      (void)tx_end(c, 0);
    } else if (c->begin_pending) {
      c->begin_pending = 0; /* nothing sent */
    } else {
      int rc = tx_end(c, 1);
      if (rc != IDEM_OK) {
        (void)tx_end(c, 0);
        j->rc = rc;
      } else {
        commits++;
      }
    }
    note(j);
    if (j->rc != IDEM_OK && (c->timed_out & (TIMED_OUT | LOCK_TIMED_OUT))) {
      fail_rest(j->next, "a write of the batch ran out of its bound");
      break;
    }
  }
  return commits;
}

/* Tells one write's caller its result. The job may be gone once told. */
static void tell(struct job *j) {
  if (j->cb) {
    idem_store_done_fn cb = j->cb;
    void *cb_arg = j->cb_arg;
    int rc = j->rc;
    if (rc != IDEM_OK) /* the callback runs here: its log line's message */
      idem__store_set_error("%s", j->err);
    free(j);
    cb(cb_arg, rc); /* may queue more writes: q_lock is not held */
  } else {
    sem_post(&j->done);
  }
}

/* Tells a committed batch's callers, those that answer a request first
 * (as sqlite_writer.c does, for the same reason). */
static void tell_callers(struct job *batch) {
  struct job *rest = NULL, **tail = &rest;

  for (struct job *j = batch, *next; j; j = next) {
    next = j->next;
    if (j->answers) {
      tell(j);
    } else {
      *tail = j;
      tail = &j->next;
    }
  }
  *tail = NULL;
  for (struct job *j = rest, *next; j; j = next) {
    next = j->next;
    tell(j);
  }
}

/* Takes the batch's writes that waited past the bound out of it, failed
 * unrun: with every writer stuck on a database that hangs, a write must
 * not wait for a writer longer than it would for a pooled connection
 * (conn_get()). Returns what is left to run. */
static struct job *drop_late(struct job *batch, struct job **late, int *n) {
  int64_t now = idem_mono_ms();
  struct job *keep = NULL, **kt = &keep, **lt = late;

  for (struct job *j = batch, *next; j; j = next) {
    next = j->next;
    if (j->deadline_ms <= now) {
      (*n)--;
      j->rc = IDEM_ESTORE;
      note(j);
      *lt = j;
      lt = &j->next;
    } else {
      *kt = j;
      kt = &j->next;
    }
  }
  *kt = NULL;
  *lt = NULL;
  return keep;
}

static void *writer_loop(void *arg) {
  pg_store_t *s = arg;
  struct conn *own = NULL; /* this writer's connection (writer_conn()) */

  on_writer = 1;
  pthread_setname_np(pthread_self(), "idem-pg-writer"); /* for top -H, perf */
  pthread_mutex_lock(&s->q_lock);
  for (;;) {
    struct job *batch, *last, *late = NULL;
    int n = 1, rc;

    while (s->q_head == NULL && !s->q_stopping)
      pthread_cond_wait(&s->q_ready, &s->q_lock);
    if (s->q_head == NULL)
      break; /* stopping, and every queued write has run */
    /* Take what is queued now: while this batch commits, the next forms
     * (and another writer may take it). */
    batch = last = s->q_head;
    batch->taken = 1;
    while (last->next && n < MAX_BATCH) {
      last = last->next;
      last->taken = 1;
      n++;
    }
    s->q_head = last->next;
    if (s->q_head == NULL)
      s->q_tail = NULL;
    else
      pthread_cond_signal(&s->q_ready); /* more queued: another writer */
    last->next = NULL;
    pthread_mutex_unlock(&s->q_lock);

    idem__store_set_error("postgres: no writer came free within %d ms", s->timeout_ms);
    batch = drop_late(batch, &late, &n);
    if (late)
      tell_callers(late);
    if (batch != NULL) {
      if ((rc = writer_conn(s, &own)) != IDEM_OK) {
        for (struct job *j = batch; j; j = j->next) {
          j->rc = rc;
          note(j);
        }
      } else {
        int commits = run_batch(s, &own, batch);
        if (own)
          writer_conn_done(s, own);
        atomic_fetch_add(&s->commits, (uint_fast64_t)commits);
        atomic_fetch_add(&s->writes, (uint_fast64_t)n);
      }
      tell_callers(batch);
    }
    pthread_mutex_lock(&s->q_lock);
  }
  pthread_mutex_unlock(&s->q_lock);
  conn_free(own);
  return NULL;
}

static void enqueue(pg_store_t *s, struct job *j) {
  int idle;

  j->next = NULL;
  j->taken = 0;
  j->queued_ms = idem_mono_ms();
  j->deadline_ms = j->queued_ms + s->timeout_ms;
  pthread_mutex_lock(&s->q_lock);
  idle = s->q_head == NULL; /* else a writer will find it queued */
  if (s->q_tail)
    s->q_tail->next = j;
  else
    s->q_head = j;
  s->q_tail = j;
  pthread_mutex_unlock(&s->q_lock);
  if (idle)
    pthread_cond_signal(&s->q_ready);
}

/* Waits on `sem` until the monotonic `deadline_ms`: 1 when posted, 0 at
 * the deadline. */
static int wait_until(sem_t *sem, int64_t deadline_ms) {
  struct timespec ts;
  int64_t left;

  for (;;) {
    if (sem_trywait(sem) == 0)
      return 1;
    if ((left = deadline_ms - idem_mono_ms()) <= 0)
      return 0;
    /* sem_timedwait() takes CLOCK_REALTIME, which may jump: the wait is
     * cut in steps, and the monotonic deadline decides. */
    clock_gettime(CLOCK_REALTIME, &ts);
    left = left > 100 ? 100 : left;
    ts.tv_sec += left / 1000;
    ts.tv_nsec += (long)(left % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000L;
    }
    if (sem_timedwait(sem, &ts) == 0)
      return 1;
  }
}

/* A synchronous write at its deadline: still queued, it is taken off the
 * queue (0: fail it, unrun); taken by a writer, it is waited for to the
 * end (1), the writer being bounded by the same deadline (run_batch()). */
static int take_back(pg_store_t *s, struct job *j) {
  struct job **p, *prev = NULL;

  pthread_mutex_lock(&s->q_lock);
  if (!j->taken) {
    for (p = &s->q_head; *p != j; p = &(*p)->next)
      prev = *p;
    *p = j->next;
    if (s->q_tail == j)
      s->q_tail = prev;
    pthread_mutex_unlock(&s->q_lock);
    return 0;
  }
  pthread_mutex_unlock(&s->q_lock);
  while (sem_wait(&j->done) != 0) /* EINTR only */
    ;
  return 1;
}

/* Runs `fn` in a transaction of a writer's batch and returns once it is
 * committed: IDEM_OK only when it is durable, else its error, and nothing
 * it did is kept. `fn` may run twice (a batch run again). */
static int write_job(pg_store_t *s, int (*fn)(struct conn *, void *), void *arg) {
  struct job j = {.fn = fn, .arg = arg, .rc = IDEM_OK, .answers = 1};

  if (on_writer) {
    /* A done callback that writes synchronously would wait on its own
     * writer (store.h forbids it): fail loudly instead. */
    idem__store_set_error("synchronous write from a writer thread");
    return IDEM_EINVAL;
  }
  sem_init(&j.done, 0, 0);
  enqueue(s, &j);
  if (!wait_until(&j.done, j.deadline_ms) && !take_back(s, &j)) {
    sem_destroy(&j.done);
    idem__store_set_error("postgres: no writer came free within %d ms", s->timeout_ms);
    return IDEM_ESTORE;
  }
  sem_destroy(&j.done);
  if (j.rc != IDEM_OK)
    idem__store_set_error("%s", j.err);
  return j.rc;
}

struct reserve_args {
  const idem_reserve_t *req;
  const char *owner;
  idem_record_t *out;
  idem_reserve_result_t *result;
};

static int reserve_fn(struct conn *c, void *arg) {
  struct reserve_args *a = arg;
  return reserve_tx(c, a->req, a->owner, a->out, a->result);
}

static int pg_reserve(idem_store_t *base, const idem_reserve_t *req,
                      idem_record_t *out, idem_reserve_result_t *result) {
  char owner[IDEM_TOKEN_MAX + 1];
  struct reserve_args a = {req, owner, out, result};
  int rc;

  if (idem_random_token(owner, IDEM_TOKEN_MAX) != IDEM_OK)
    return IDEM_ECRYPTO;
  if ((rc = write_job((pg_store_t *)base, reserve_fn, &a)) != IDEM_OK)
    idem_record_reset(out);
  return rc;
}

/* An asynchronous reservation: the job, its arguments and the owner
 * token in one block, until a writer calls back. */
struct async_reserve {
  struct job job; /* first: the writer frees the block through it */
  struct reserve_args a;
  char owner[IDEM_TOKEN_MAX + 1];
};

static int pg_reserve_async(idem_store_t *base, const idem_reserve_t *req,
                            idem_record_t *out, idem_reserve_result_t *result,
                            idem_store_done_fn done, void *arg) {
  struct async_reserve *ar = calloc(1, sizeof *ar);

  if (ar == NULL)
    return IDEM_ENOMEM;
  if (idem_random_token(ar->owner, IDEM_TOKEN_MAX) != IDEM_OK) {
    free(ar);
    return IDEM_ECRYPTO;
  }
  ar->a = (struct reserve_args){req, ar->owner, out, result};
  ar->job = (struct job){.fn = reserve_fn, .arg = &ar->a, .cb = done, .cb_arg = arg,
                         .answers = req->outcome != NULL};
  enqueue((pg_store_t *)base, &ar->job);
  return IDEM_OK;
}

static int complete_fn(struct conn *c, void *arg) {
  const idem_complete_t *cp = arg;
  int rc = apply_outcome(c, &cp->scope, cp->owner_token, &cp->outcome, cp->now_ms,
                         cp->ttl_ms);
  if (rc != IDEM_OK)
    return rc;
  return run_effect(c, &cp->effect, cp->now_ms, 1);
}

static int pg_complete(idem_store_t *base, const idem_complete_t *cp) {
  return write_job((pg_store_t *)base, complete_fn, (void *)cp);
}

static int pg_complete_async(idem_store_t *base, const idem_complete_t *cp,
                             idem_store_done_fn done, void *arg) {
  struct job *j = calloc(1, sizeof *j);

  if (j == NULL)
    return IDEM_ENOMEM;
  *j = (struct job){.fn = complete_fn, .arg = (void *)cp, .cb = done, .cb_arg = arg,
                    .answers = 1};
  enqueue((pg_store_t *)base, j);
  return IDEM_OK;
}

static int caller_write_fn(struct conn *c, void *arg) {
  return run_effect(c, arg, idem_now_ms(), 1);
}

static int pg_write(idem_store_t *base, const idem_effect_t *e) {
  return write_job((pg_store_t *)base, caller_write_fn, (void *)e);
}

static void pg_stats(idem_store_t *base, idem_store_stats_t *out) {
  pg_store_t *s = (pg_store_t *)base;
  out->commits = atomic_load_explicit(&s->commits, memory_order_relaxed);
  out->writes = atomic_load_explicit(&s->writes, memory_order_relaxed);
  out->batch_reruns = atomic_load_explicit(&s->batch_reruns, memory_order_relaxed);
}

static int pg_read(idem_store_t *base, const idem_effect_t *e) {
  pg_store_t *s = (pg_store_t *)base;
  struct conn *c;
  int rc;

  if ((rc = conn_get(s, &c)) != IDEM_OK)
    return rc;
  rc = run_effect(c, e, idem_now_ms(), 0);
  if (rc == IDEM_OK)
    rc = pipe_end(c);
  (void)tx_end(c, 0); /* a transaction left open is not kept */
  conn_put(s, c);
  return rc;
}

static int pg_lookup(idem_store_t *base, const idem_scope_t *sc, int64_t now_ms,
                     idem_record_t *out) {
  pg_store_t *s = (pg_store_t *)base;
  struct conn *c;
  int rc;

  if ((rc = conn_get(s, &c)) != IDEM_OK)
    return rc;
  rc = read_record(c, sc, out);
  conn_put(s, c);
  if (rc == IDEM_OK && out->expires_at != 0 && out->expires_at <= now_ms &&
      (out->state == IDEM_STATE_COMPLETED || out->state == IDEM_STATE_FAILED)) {
    idem_record_reset(out);
    rc = IDEM_ENOTFOUND;
  }
  return rc;
}

/* Runs one prepared statement, outside any transaction, on a pooled
 * connection. Returns the result (the caller clears it) or NULL with the
 * error in `*err`. */
static PGresult *pooled_run(pg_store_t *s, enum stmt_id id, int n,
                            const char *const *params, int *err) {
  struct conn *c;
  PGresult *res;

  if ((*err = conn_get(s, &c)) != IDEM_OK)
    return NULL;
  res = run(c, id, n, params, err);
  conn_put(s, c);
  return res;
}

/* The same for a statement whose rows we do not need; `*changed` (may be
 * NULL) gets the number of rows it affected. */
static int pooled_cmd(pg_store_t *s, enum stmt_id id, int n,
                      const char *const *params, int *changed) {
  struct conn *c;
  int rc;

  if ((rc = conn_get(s, &c)) != IDEM_OK)
    return rc;
  rc = run_cmd(c, id, n, params, changed);
  conn_put(s, c);
  return rc;
}

/* Runs a one-row query outside a transaction; `*res` gets the result when
 * it has a row (IDEM_OK), IDEM_ENOTFOUND when it has none. */
static int query_row(pg_store_t *s, enum stmt_id id, int n,
                     const char *const *params, PGresult **res) {
  int rc;
  if ((*res = pooled_run(s, id, n, params, &rc)) == NULL)
    return rc;
  if (PQntuples(*res) == 0) {
    PQclear(*res);
    *res = NULL;
    return IDEM_ENOTFOUND;
  }
  return IDEM_OK;
}

static int pg_records_list(idem_store_t *base, const idem_records_query_t *q,
                           idem_record_t *out, int *n) {
  pg_store_t *s = (pg_store_t *)base;
  char t[24], before[24], lim[16];
  const char *p[4] = {num(t, sizeof t, q->tenant_id),
                      q->state == IDEM_STATE_NONE ? NULL : idem_state_name(q->state),
                      num(before, sizeof before, q->updated_before),
                      num(lim, sizeof lim, q->limit)};
  PGresult *res;
  int rc, rows;

  if ((res = pooled_run(s, ST_RECORDS_LIST, 4, p, &rc)) == NULL)
    return rc;
  rows = PQntuples(res) < q->limit ? PQntuples(res) : q->limit;
  for (int i = 0; rc == IDEM_OK && i < rows; i++)
    rc = row_to_record(res, i, &out[i]);
  PQclear(res);
  if (rc != IDEM_OK) {
    for (int i = 0; i < rows; i++)
      idem_record_reset(&out[i]);
    return rc;
  }
  *n = rows;
  return IDEM_OK;
}

/* The probe takes the lock every write of a record takes (ROW EXCLUSIVE
 * on the records table, held to its commit: it writes no record) before
 * its own row, so that a session holding a lock that stops the writes
 * (LOCK TABLE, a migration of another instance) fails it within
 * lock_timeout, and /readyz says so while no request writes. */
static int probe_fn(struct conn *c, void *arg) {
  const char *p[1] = {arg};
  int rc = begin_now(c);
  if (rc == IDEM_OK)
    rc = simple(c, "LOCK TABLE idempotency_records IN ROW EXCLUSIVE MODE");
  return rc == IDEM_OK ? run_cmd(c, ST_PROBE, 1, p, NULL) : rc;
}

static int pg_probe(idem_store_t *base) {
  char now[24];
  return write_job((pg_store_t *)base, probe_fn, (void *)num(now, sizeof now, idem_now_ms()));
}

static int pg_meta_get_or_put(idem_store_t *base, const char *name,
                              const char *value, char **out) {
  pg_store_t *s = (pg_store_t *)base;
  const char *p[2] = {name, value};
  PGresult *res;
  int rc;

  if ((rc = pooled_cmd(s, ST_META_PUT, 2, p, NULL)) != IDEM_OK)
    return rc;
  rc = query_row(s, ST_META_GET, 1, p, &res);
  if (rc != IDEM_OK)
    return rc == IDEM_ENOTFOUND ? IDEM_ESTORE : rc;
  *out = strdup(PQgetvalue(res, 0, 0));
  PQclear(res);
  return *out ? IDEM_OK : IDEM_ENOMEM;
}

static int pg_sweep(idem_store_t *base, int64_t now_ms, int batch, int *deleted) {
  pg_store_t *s = (pg_store_t *)base;
  char now[24], b[16];
  const char *p[2] = {num(now, sizeof now, now_ms), num(b, sizeof b, batch)};
  return pooled_cmd(s, ST_SWEEP, 2, p, deleted);
}

static int pg_count(idem_store_t *base, const char *what, int64_t tenant_id,
                    int64_t *n) {
  static const struct {
    const char *what, *sql;
  } queries[] = {
      {"records", "SELECT count(*) FROM idempotency_records WHERE ($1::bigint = 0 OR tenant_id = $1)"},
      {"processing", "SELECT count(*) FROM idempotency_records WHERE state = 'processing' AND ($1::bigint = 0 OR tenant_id = $1)"},
      {"pending", "SELECT count(*) FROM idempotency_records WHERE state = 'pending' AND ($1::bigint = 0 OR tenant_id = $1)"},
      {"oldest_pending", "SELECT coalesce(min(created_at), 0) FROM idempotency_records WHERE state = 'pending' AND ($1::bigint = 0 OR tenant_id = $1)"},
  };
  pg_store_t *s = (pg_store_t *)base;
  const char *sql = NULL;
  char t[24];
  const char *p[1] = {num(t, sizeof t, tenant_id)};
  struct conn *c;
  PGresult *res;
  int rc;

  for (size_t i = 0; i < sizeof queries / sizeof *queries; i++)
    if (strcmp(queries[i].what, what) == 0)
      sql = queries[i].sql;
  if (sql == NULL)
    return IDEM_EINVAL;
  if ((rc = conn_get(s, &c)) != IDEM_OK)
    return rc;
  res = PQexecParams(c->pg, sql, 1, NULL, p, NULL, NULL, 0);
  if (PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1) {
    *n = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
    rc = IDEM_OK;
  } else {
    rc = fail(c, res, "count");
  }
  PQclear(res);
  conn_put(s, c);
  return rc;
}

static int pg_ping(idem_store_t *base) {
  PGresult *res;
  int rc = query_row((pg_store_t *)base, ST_PING, 0, NULL, &res);
  PQclear(res);
  return rc;
}

static int migrate_to(pg_store_t *s, int target) {
  struct conn *c;
  PGresult *res;
  int rc, version = 0;

  if ((rc = conn_get(s, &c)) != IDEM_OK)
    return rc;
  rc = simple(c, "BEGIN");
  if (rc == IDEM_OK)
    rc = simple(c, "SELECT pg_advisory_xact_lock(" MIGRATE_LOCK ")");
  if (rc == IDEM_OK)
    rc = simple(c, "CREATE TABLE IF NOT EXISTS idem_schema (version INTEGER NOT NULL)");
  if (rc == IDEM_OK) {
    res = PQexec(c->pg, "SELECT coalesce(max(version), 0) FROM idem_schema");
    if (PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1)
      version = atoi(PQgetvalue(res, 0, 0));
    else
      rc = fail(c, res, "read schema version");
    PQclear(res);
  }
  if (rc == IDEM_OK && version > SCHEMA_VERSION) {
    idem__store_set_error("schema version %d is newer than this program's %d",
                          version, SCHEMA_VERSION);
    rc = IDEM_ESCHEMA;
  }
  if (rc == IDEM_OK && version == 0 && target == SCHEMA_VERSION) {
    char sql[96];
    snprintf(sql, sizeof sql, "INSERT INTO idem_schema VALUES (%d)", SCHEMA_VERSION);
    if ((rc = simple(c, fresh)) == IDEM_OK)
      rc = simple(c, sql);
    version = target;
  }
  for (int v = version; rc == IDEM_OK && v < target; v++) {
    char sql[96];
    rc = simple(c, migrations[v]);
    snprintf(sql, sizeof sql, "DELETE FROM idem_schema; INSERT INTO idem_schema VALUES (%d)", v + 1);
    if (rc == IDEM_OK)
      rc = simple(c, sql);
  }
  int end = tx_end(c, rc == IDEM_OK);
  if (rc == IDEM_OK)
    rc = end;
  conn_put(s, c);
  return rc;
}

static int pg_migrate(idem_store_t *base) {
  return migrate_to((pg_store_t *)base, SCHEMA_VERSION);
}

int idem__postgres_migrate_to(idem_store_t *store, int version) {
  if (version < 0 || version > SCHEMA_VERSION)
    return IDEM_EINVAL;
  return migrate_to((pg_store_t *)store, version);
}

/* Parses a NOTIFY payload back into a scope and wakes its waiters. */
static void wake_from_payload(pg_store_t *s, char *payload) {
  char *op = strchr(payload, '\n'), *key;
  idem_scope_t sc;
  if (op == NULL || (key = strchr(op + 1, '\n')) == NULL)
    return;
  *op++ = '\0';
  *key++ = '\0';
  sc.tenant_id = strtoll(payload, NULL, 10);
  sc.operation = op;
  sc.key = key;
  idem__store_notify(&s->base, &sc);
}

/* The listener: LISTEN on its own connection and relay notifications.
 * After losing the connection it reconnects with backoff and wakes every
 * waiter, since notifications sent meanwhile were lost. */
/* Closes a listening connection that failed, and waits before the next
 * try (doubling up to 2 s), waking early when the store stops. */
static void listen_retry_later(pg_store_t *s, PGconn *pg, int *backoff_ms) {
  PQfinish(pg);
  for (int waited = 0; waited < *backoff_ms && !atomic_load(&s->stopping); waited += 50) {
    struct timespec ts = {0, 50 * 1000000L};
    nanosleep(&ts, NULL);
  }
  *backoff_ms = *backoff_ms < 2000 ? *backoff_ms * 2 : 2000;
}

/* Runs `sql` (a LISTEN) on the listener's connection, watched like a
 * pooled call, so that a server that hangs does not hang the listener
 * (nor pg_close(), which joins it). 0 when it succeeded. */
static int listen_to(pg_store_t *s, struct conn *lc, const char *sql) {
  PGresult *res;
  int ok;

  pthread_mutex_lock(&s->pool_lock);
  watch_locked(s, lc);
  pthread_mutex_unlock(&s->pool_lock);
  res = PQexec(lc->pg, sql);
  pthread_mutex_lock(&s->pool_lock);
  unwatch_locked(s, lc);
  pthread_mutex_unlock(&s->pool_lock);
  ok = PQresultStatus(res) == PGRES_COMMAND_OK;
  PQclear(res);
  return ok ? 0 : -1;
}

/* Tells idem_store_listen()'s function, if any, that its channel had a
 * notification or may have missed one (`listening` 0). */
static void tell_watch(pg_store_t *s, int listening) {
  pthread_mutex_lock(&s->watch_lock);
  if (s->watch_fn) {
    s->watch_fn(s->watch_arg, listening);
    s->watch_told = listening;
  }
  pthread_mutex_unlock(&s->watch_lock);
}

/* LISTENs on idem_store_listen()'s channel once there is one and this
 * connection does not yet (`watching`, its name), and tells a function
 * set since that it is listening. 0, or -1 when the LISTEN failed. */
static int listen_to_watch(pg_store_t *s, struct conn *lc, char *watching, size_t cap) {
  char channel[sizeof s->watch_channel], sql[sizeof channel + 16];
  int untold;

  pthread_mutex_lock(&s->watch_lock);
  snprintf(channel, sizeof channel, "%s", s->watch_channel);
  untold = s->watch_fn != NULL && !s->watch_told;
  pthread_mutex_unlock(&s->watch_lock);
  if (channel[0] == '\0')
    return 0;
  if (strcmp(channel, watching) == 0) {
    if (untold)
      tell_watch(s, 1);
    return 0;
  }
  /* Quoted: a name of digits and letters may still be a keyword. */
  snprintf(sql, sizeof sql, "LISTEN \"%s\"", channel);
  if (listen_to(s, lc, sql) != 0)
    return -1;
  snprintf(watching, cap, "%s", channel);
  tell_watch(s, 1); /* trusted from here on */
  return 0;
}

static void *listen_loop(void *arg) {
  pg_store_t *s = arg;
  int backoff_ms = 100;

  while (!atomic_load(&s->stopping)) {
    PGconn *pg = pg_connect(s);
    struct conn lc = {.pg = pg};
    char watching[sizeof s->watch_channel] = "";
    int watch_failed = 0;
    if (PQstatus(pg) != CONNECTION_OK) {
      listen_retry_later(s, pg, &backoff_ms);
      continue;
    }
    /* The server's messages (a FATAL at its shutdown) stay off stderr,
     * which is the request log, as for the pool's connections. */
    PQsetNoticeProcessor(pg, quiet, NULL);
    /* Between notifications it only polls. */
    if (listen_to(s, &lc, "LISTEN " NOTIFY_CHANNEL) != 0) { /* no wake-ups: try again */
      listen_retry_later(s, pg, &backoff_ms);
      continue;
    }
    idem__waitset_wake_all(s->base.waits);
    while (!atomic_load(&s->stopping)) {
      struct pollfd pfd = {.fd = PQsocket(pg), .events = POLLIN};
      PGnotify *n;
      if (listen_to_watch(s, &lc, watching, sizeof watching) != 0) {
        watch_failed = 1; /* waits as a failed connect does, below */
        break;
      }
      backoff_ms = 100; /* every LISTEN asked for holds */
      if (pfd.fd < 0)
        break;
      if (poll(&pfd, 1, 200) < 0 && errno != EINTR)
        break;
      if (!PQconsumeInput(pg))
        break;
      while ((n = PQnotifies(pg)) != NULL) {
        if (watching[0] != '\0' && strcmp(n->relname, watching) == 0)
          tell_watch(s, 1);
        else
          wake_from_payload(s, n->extra);
        PQfreemem(n);
      }
    }
    if (watching[0] != '\0')
      tell_watch(s, 0); /* notifications may be missed until the next LISTEN */
    idem__waitset_wake_all(s->base.waits);
    if (watch_failed)
      listen_retry_later(s, pg, &backoff_ms); /* not at once, nor forever fast */
    else
      PQfinish(pg);
  }
  return NULL;
}

int idem__postgres_listen(idem_store_t *base, const char *channel,
                          void (*fn)(void *arg, int listening), void *arg) {
  pg_store_t *s = (pg_store_t *)base;

  if (channel != NULL &&
      (channel[0] == '\0' || strlen(channel) >= sizeof s->watch_channel ||
       strspn(channel, "abcdefghijklmnopqrstuvwxyz0123456789_") != strlen(channel)))
    return IDEM_EINVAL;
  pthread_mutex_lock(&s->watch_lock);
  if (channel == NULL) { /* removes `arg`'s, and only that */
    if (s->watch_fn == fn && s->watch_arg == arg)
      s->watch_fn = NULL, s->watch_arg = NULL;
    pthread_mutex_unlock(&s->watch_lock);
    return IDEM_OK;
  }
  if (s->watch_fn != NULL ||
      (s->watch_channel[0] != '\0' && strcmp(channel, s->watch_channel) != 0)) {
    pthread_mutex_unlock(&s->watch_lock);
    return IDEM_EEXIST; /* one function, and a connection LISTENs on one channel */
  }
  snprintf(s->watch_channel, sizeof s->watch_channel, "%s", channel);
  s->watch_told = 0;
  s->watch_fn = fn;
  s->watch_arg = arg;
  pthread_mutex_unlock(&s->watch_lock);
  return IDEM_OK;
}

static void pg_close(idem_store_t *base) {
  pg_store_t *s = (pg_store_t *)base;
  struct conn *c;

  /* The writers first: every queued write runs, on a pool still open. */
  pthread_mutex_lock(&s->q_lock);
  s->q_stopping = 1;
  pthread_cond_broadcast(&s->q_ready);
  pthread_mutex_unlock(&s->q_lock);
  for (int i = 0; i < s->writers_started; i++)
    pthread_join(s->writers[i], NULL);
  pthread_mutex_lock(&s->pool_lock);
  atomic_store(&s->stopping, 1);
  pthread_cond_broadcast(&s->stop_cond);
  pthread_mutex_unlock(&s->pool_lock);
  if (s->listener_started)
    pthread_join(s->listener, NULL);
  if (s->watchdog_started)
    pthread_join(s->watchdog, NULL);
  c = s->free_conns;
  while (c) {
    struct conn *next = c->next;
    conn_free(c);
    c = next;
  }
  pthread_cond_destroy(&s->conn_freed);
  pthread_cond_destroy(&s->stop_cond);
  pthread_mutex_destroy(&s->pool_lock);
  pthread_mutex_destroy(&s->watch_lock);
  pthread_cond_destroy(&s->q_ready);
  pthread_mutex_destroy(&s->q_lock);
  free(s->url);
  free(s);
}

static int pg_start(idem_store_t *base) {
  pg_store_t *s = (pg_store_t *)base;
  if (s->listener_started)
    return IDEM_OK;
  if (pthread_create(&s->listener, NULL, listen_loop, s) != 0)
    return IDEM_ENOMEM;
  s->listener_started = 1;
  return IDEM_OK;
}

/* libpq's parameters from s->timeout_ms (T): statement_timeout and
 * lock_timeout T; connect_timeout T in whole seconds (libpq takes no less
 * than 2); keepalives after T idle, every T/3, 3 lost; tcp_user_timeout
 * 2T for data sent and not acknowledged. All before "dbname", the URL,
 * which PQconnectdbParams() expands and whose parameters win. */
static void set_params(pg_store_t *s) {
  int t = s->timeout_ms, t_s = (t + 999) / 1000, i = 0;
  char(*v)[24] = s->param_text;

  snprintf(v[0], sizeof v[0], "%d", t_s < 2 ? 2 : t_s);
  snprintf(v[1], sizeof v[1], "%d", t_s);
  snprintf(v[2], sizeof v[2], "%d", t_s / 3 < 1 ? 1 : t_s / 3);
  snprintf(v[3], sizeof v[3], "%d", 2 * t);
  snprintf(s->pg_options, sizeof s->pg_options,
           "-c statement_timeout=%d -c lock_timeout=%d", t, t);
  s->keywords[i] = "connect_timeout", s->values[i++] = v[0];
  s->keywords[i] = "keepalives", s->values[i++] = "1";
  s->keywords[i] = "keepalives_idle", s->values[i++] = v[1];
  s->keywords[i] = "keepalives_interval", s->values[i++] = v[2];
  s->keywords[i] = "keepalives_count", s->values[i++] = "3";
  s->keywords[i] = "tcp_user_timeout", s->values[i++] = v[3];
  s->keywords[i] = "options", s->values[i++] = s->pg_options;
  s->keywords[i] = "dbname", s->values[i++] = s->url;
  s->keywords[i] = NULL, s->values[i] = NULL;
}

int idem__postgres_open(const char *url, const idem_store_options_t *opts,
                        idem_store_t **out) {
  pg_store_t *s = calloc(1, sizeof *s);
  struct conn *c;
  int rc;

  *out = NULL;
  if (s == NULL || (s->url = strdup(url)) == NULL) {
    free(s);
    return IDEM_ENOMEM;
  }
  s->base.methods = &pg_methods;
  s->timeout_ms = opts->db_timeout_ms > 0 ? opts->db_timeout_ms : 5000;
  s->max_conns = opts->pool_size > 0 ? opts->pool_size : 64;
  set_params(s);
  pthread_mutex_init(&s->pool_lock, NULL);
  pthread_mutex_init(&s->watch_lock, NULL);
  pthread_mutex_init(&s->q_lock, NULL);
  pthread_cond_init(&s->q_ready, NULL);
  {
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->conn_freed, &ca);
    pthread_cond_init(&s->stop_cond, &ca);
    pthread_condattr_destroy(&ca);
  }
  if (pthread_create(&s->watchdog, NULL, watchdog_loop, s) != 0) {
    pg_close(&s->base);
    return IDEM_ENOMEM;
  }
  s->watchdog_started = 1;
  for (int i = 0; i < WRITERS; i++) {
    if (pthread_create(&s->writers[i], NULL, writer_loop, s) != 0) {
      pg_close(&s->base);
      return IDEM_ENOMEM;
    }
    s->writers_started++;
  }
  /* Connect once now so a wrong URL or a stopped server fails here. */
  if ((rc = conn_get(s, &c)) != IDEM_OK) {
    pg_close(&s->base);
    return rc;
  }
  conn_put(s, c);
  *out = &s->base;
  return IDEM_OK;
}

static const idem_store_methods_t pg_methods = {
    .version = 1,
    .name = "postgresql",
    .close = pg_close,
    .start = pg_start,
    .migrate = pg_migrate,
    .ping = pg_ping,
    .reserve = pg_reserve,
    .complete = pg_complete,
    .lookup = pg_lookup,
    .meta_get_or_put = pg_meta_get_or_put,
    .sweep = pg_sweep,
    .count = pg_count,
    .records_list = pg_records_list,
    .write = pg_write,
    .read = pg_read,
    .probe = pg_probe,
    .stats = pg_stats,
    .reserve_async = pg_reserve_async,
    .complete_async = pg_complete_async,
};
