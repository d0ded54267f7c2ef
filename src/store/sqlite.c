/* The SQLite store: one database file in WAL mode, durable commits
 * (synchronous=FULL), versioned migrations (sqlite_schema.c), and a pool of
 * connections with their statements prepared once. This file opens and
 * closes the store and holds the pool, the statements and the store's
 * methods: reservations, completions, lookups, sweeps, counts
 * and stats.
 *
 * Concurrency: readers use their own pooled connection and never block.
 * Every write goes through the group-commit writer (sqlite_writer.c): its
 * caller queues it and sleeps, or is called back, and one writer thread
 * runs each batch of queued writes in one transaction, a write that fails
 * undone alone in its savepoint, and tells their callers once the batch's
 * one COMMIT is on disk. SQLite admits one writer at a time anyway, and one
 * fsync for many writes costs far less than one each. Migrations run their
 * transaction from the caller's thread, under the same write_lock as the
 * writer's. Other processes (an idemd command while a server runs) are
 * handled by the busy timeout plus a bounded retry. */
#include "sqlite_impl.h"

#include <pthread.h>
#include <stdatomic.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "idem/clock.h"
#include "idem/crypto.h"
#include "sqlite_vfs.h"

#define RECORD_COLUMNS                                                        \
  "tenant_id, operation, key, fingerprint, state, response_status, "          \
  "response_body, location, resource_id, provider_ref, correlation_id, "      \
  "owner_token, lease_expires_at, created_at, updated_at, expires_at"

#define SCOPE_MATCH "tenant_id = ?1 AND operation = ?2 AND key = ?3"

/* A completion's changes, and the state and owner it requires. */
#define COMPLETE_SET                                                          \
  "UPDATE idempotency_records SET state = ?4, response_status = ?5, "         \
  "response_body = ?6, location = ?7, "                                       \
  "resource_id = COALESCE(?8, resource_id), "                                 \
  "provider_ref = COALESCE(?9, provider_ref), owner_token = NULL, "           \
  "lease_expires_at = NULL, updated_at = ?10, expires_at = ?11 WHERE "
#define COMPLETE_OWNED "(state = 'processing' OR state = 'pending') AND owner_token = ?12"

static const char *const stmt_sql[ST_COUNT_] = {
    [ST_BEGIN] = "BEGIN IMMEDIATE",
    [ST_COMMIT] = "COMMIT",
    [ST_ROLLBACK] = "ROLLBACK",
    [ST_SAVEPOINT] = "SAVEPOINT one_write",
    [ST_ROLLBACK_TO] = "ROLLBACK TO one_write",
    [ST_RELEASE] = "RELEASE one_write",
    /* The one atomic reservation: the unique constraint picks the owner. An
     * expired record, or a failed one retried with the same request, is
     * taken over in the same statement. */
    [ST_RESERVE] =
        "INSERT INTO idempotency_records (tenant_id, operation, key, "
        "fingerprint, state, correlation_id, owner_token, lease_expires_at, "
        "created_at, updated_at, expires_at, resource_id) "
        "VALUES (?1, ?2, ?3, ?4, 'processing', ?5, ?6, ?7, ?8, ?8, NULL, ?9) "
        "ON CONFLICT (tenant_id, operation, key) DO UPDATE SET "
        "fingerprint = excluded.fingerprint, state = 'processing', "
        "response_status = NULL, response_body = NULL, location = NULL, "
        "resource_id = excluded.resource_id, provider_ref = NULL, "
        "correlation_id = excluded.correlation_id, "
        "owner_token = excluded.owner_token, "
        "lease_expires_at = excluded.lease_expires_at, "
        "created_at = excluded.created_at, updated_at = excluded.updated_at, "
        "expires_at = NULL "
        "WHERE ((idempotency_records.state = 'completed' "
        "OR idempotency_records.state = 'failed') "
        "AND idempotency_records.expires_at <= excluded.created_at) "
        "OR (idempotency_records.state = 'failed' "
        "AND idempotency_records.fingerprint = excluded.fingerprint)",
    [ST_READ_RECORD] = "SELECT " RECORD_COLUMNS
                       " FROM idempotency_records WHERE " SCOPE_MATCH,
    [ST_COMPLETE] = COMPLETE_SET SCOPE_MATCH " AND " COMPLETE_OWNED,
    /* The same, the record found by the rowid its reservation inserted
     * (?13) instead of through the key's index: 4,200 fewer instructions
     * per completion. The key and owner must still match. */
    [ST_COMPLETE_ROW] =
        COMPLETE_SET "rowid = ?13 AND " SCOPE_MATCH " AND " COMPLETE_OWNED,
    /* idem_tx_take_over(): a record left behind, given a new owner. */
    [ST_TAKE_OVER] =
        "UPDATE idempotency_records SET owner_token = ?4, lease_expires_at = ?5, "
        "updated_at = ?6 WHERE " SCOPE_MATCH " AND (state = 'pending' OR "
        "state = 'processing') AND (lease_expires_at IS NULL OR "
        "lease_expires_at <= ?6) RETURNING " RECORD_COLUMNS,
    [ST_RECORDS_LIST] = "SELECT " RECORD_COLUMNS " FROM idempotency_records "
                        "WHERE tenant_id = ?1 AND (?2 IS NULL OR state = ?2) "
                        "AND (?3 = 0 OR updated_at < ?3) "
                        "ORDER BY updated_at DESC LIMIT ?4",
    [ST_META_PUT] = "INSERT INTO meta (name, value) VALUES (?1, ?2) "
                    "ON CONFLICT (name) DO NOTHING",
    /* idem_store_probe(): a row of its own, changed each time. */
    [ST_PROBE] = "INSERT INTO meta (name, value) VALUES ('probe', ?1) "
                 "ON CONFLICT (name) DO UPDATE SET value = excluded.value",
    [ST_META_GET] = "SELECT value FROM meta WHERE name = ?1",
    [ST_SWEEP] = "DELETE FROM idempotency_records WHERE rowid IN (SELECT "
                 "rowid FROM idempotency_records WHERE expires_at <= ?1 AND "
                 "state IN ('completed', 'failed') LIMIT ?2)",
    [ST_PING] = "SELECT count(*) FROM meta",
};

/* The VFS connections open with (configure_sqlite()); NULL: the default. */
static const char *vfs_name;

static const idem_store_methods_t sqlite_methods;

/* Maps a SQLite result code to an idem error, keeping the message. */
int idem__sqlite_fail(sqlite3 *db, int rc, const char *what) {
  idem__store_set_error("sqlite %s: %s (%d)", what,
                        db ? sqlite3_errmsg(db) : sqlite3_errstr(rc), rc);
  switch (rc & 0xff) {
  case SQLITE_NOMEM:
    return IDEM_ENOMEM;
  case SQLITE_CONSTRAINT:
    return IDEM_EEXIST;
  default:
    return IDEM_ESTORE;
  }
}

static void conn_free(struct conn *c) {
  if (c == NULL)
    return;
  for (int i = 0; i < ST_COUNT_; i++)
    sqlite3_finalize(c->st[i]);
  for (int i = 0; i < IDEM_TX_STATEMENTS; i++)
    sqlite3_finalize(c->caller_st[i]);
  sqlite3_close_v2(c->db);
  free(c);
}

int idem__sqlite_exec(sqlite3 *db, const char *sql) {
  char *msg = NULL;
  int rc = sqlite3_exec(db, sql, NULL, NULL, &msg);
  if (rc != SQLITE_OK) {
    idem__store_set_error("sqlite exec: %s (%d)", msg ? msg : sqlite3_errstr(rc), rc);
    sqlite3_free(msg);
    return rc;
  }
  return SQLITE_OK;
}

/* Puts db in WAL mode. SQLite answers a journal_mode it cannot set with
 * the mode it kept, not an error: checked here, because the store counts
 * on WAL (readers beside the writer, idem_store_local_reads()). */
static int use_wal(sqlite3 *db) {
  sqlite3_stmt *st = NULL;
  int rc = sqlite3_prepare_v2(db, "PRAGMA journal_mode = WAL", -1, &st, NULL);
  const char *mode;

  if (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_ROW) {
    mode = (const char *)sqlite3_column_text(st, 0);
    rc = mode != NULL && sqlite3_stricmp(mode, "wal") == 0 ? SQLITE_OK : SQLITE_ERROR;
    if (rc != SQLITE_OK)
      idem__store_set_error("sqlite: the database stays in journal mode '%s', not WAL",
                            mode ? mode : "?");
  } else {
    idem__store_set_error("sqlite journal_mode: %s (%d)", sqlite3_errmsg(db), rc);
    rc = rc == SQLITE_OK || rc == SQLITE_DONE ? SQLITE_ERROR : rc;
  }
  sqlite3_finalize(st);
  return rc;
}

static int conn_new(sqlite_store_t *s, struct conn **out) {
  struct conn *c = calloc(1, sizeof *c);
  int rc;

  *out = NULL;
  if (c == NULL)
    return IDEM_ENOMEM;
  rc = sqlite3_open_v2(s->path, &c->db,
                       SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE |
                           SQLITE_OPEN_NOMUTEX,
                       vfs_name);
  if (rc != SQLITE_OK) {
    rc = idem__sqlite_fail(c->db, rc, "open");
    conn_free(c);
    return rc;
  }
  sqlite3_extended_result_codes(c->db, 1);
  sqlite3_busy_timeout(c->db, s->busy_timeout_ms);
  /* WAL lets readers run beside the writer; FULL syncs the WAL on every
   * commit, so an acknowledged write survives power loss. */
  if (use_wal(c->db) != SQLITE_OK ||
      idem__sqlite_exec(c->db, "PRAGMA synchronous = FULL") != SQLITE_OK ||
      idem__sqlite_exec(c->db, "PRAGMA foreign_keys = ON") != SQLITE_OK) {
    conn_free(c);
    return IDEM_ESTORE;
  }
  *out = c;
  return IDEM_OK;
}

int idem__sqlite_conn_get(sqlite_store_t *s, struct conn **out) {
  pthread_mutex_lock(&s->pool_lock);
  *out = s->free_conns;
  if (*out)
    s->free_conns = (*out)->next;
  pthread_mutex_unlock(&s->pool_lock);
  if (*out)
    return IDEM_OK;
  return conn_new(s, out);
}

void idem__sqlite_conn_put(sqlite_store_t *s, struct conn *c) {
  pthread_mutex_lock(&s->pool_lock);
  c->next = s->free_conns;
  s->free_conns = c;
  pthread_mutex_unlock(&s->pool_lock);
}

/* Returns the prepared statement `id` of `c`, reset and unbound. */
sqlite3_stmt *idem__sqlite_stmt(struct conn *c, enum stmt_id id) {
  if (c->st[id] == NULL) {
    int rc = sqlite3_prepare_v3(c->db, stmt_sql[id], -1,
                                SQLITE_PREPARE_PERSISTENT, &c->st[id], NULL);
    if (rc != SQLITE_OK) {
      idem__sqlite_fail(c->db, rc, "prepare");
      c->st[id] = NULL;
      return NULL;
    }
  } else {
    sqlite3_reset(c->st[id]);
    sqlite3_clear_bindings(c->st[id]);
  }
  return c->st[id];
}

/* Steps a statement that returns no rows to completion, then resets it. */
int idem__sqlite_run(struct conn *c, sqlite3_stmt *st, const char *what) {
  int rc = sqlite3_step(st);
  sqlite3_reset(st);
  if (rc != SQLITE_DONE && rc != SQLITE_ROW)
    return idem__sqlite_fail(c->db, rc, what);
  return IDEM_OK;
}

static void bind_text(sqlite3_stmt *st, int i, const char *v) {
  if (v)
    sqlite3_bind_text(st, i, v, -1, SQLITE_STATIC);
  else
    sqlite3_bind_null(st, i);
}

static void bind_scope(sqlite3_stmt *st, const idem_scope_t *sc) {
  sqlite3_bind_int64(st, 1, sc->tenant_id);
  bind_text(st, 2, sc->operation);
  bind_text(st, 3, sc->key);
}

static const char *col_text(sqlite3_stmt *st, int i) {
  const unsigned char *t = sqlite3_column_text(st, i);
  return t ? (const char *)t : "";
}

/* Copies the current row of a statement selecting RECORD_COLUMNS. */
static int row_to_record(sqlite3_stmt *st, idem_record_t *out) {
  idem_record_reset(out);
  out->tenant_id = sqlite3_column_int64(st, 0);
  idem_copy(out->operation, sizeof out->operation, col_text(st, 1));
  idem_copy(out->key, sizeof out->key, col_text(st, 2));
  idem_copy(out->fingerprint, sizeof out->fingerprint, col_text(st, 3));
  out->state = idem_state_parse(col_text(st, 4));
  out->response_status = sqlite3_column_int(st, 5);
  if (sqlite3_column_type(st, 6) != SQLITE_NULL &&
      (out->response_body = strdup(col_text(st, 6))) == NULL)
    return IDEM_ENOMEM;
  idem_copy(out->location, sizeof out->location, col_text(st, 7));
  idem_copy(out->resource_id, sizeof out->resource_id, col_text(st, 8));
  idem_copy(out->provider_ref, sizeof out->provider_ref, col_text(st, 9));
  idem_copy(out->correlation_id, sizeof out->correlation_id, col_text(st, 10));
  idem_copy(out->owner_token, sizeof out->owner_token, col_text(st, 11));
  out->lease_expires_at = sqlite3_column_int64(st, 12);
  out->created_at = sqlite3_column_int64(st, 13);
  out->updated_at = sqlite3_column_int64(st, 14);
  out->expires_at = sqlite3_column_int64(st, 15);
  return IDEM_OK;
}

static int read_record(struct conn *c, const idem_scope_t *sc, idem_record_t *out) {
  sqlite3_stmt *st = idem__sqlite_stmt(c, ST_READ_RECORD);
  int rc;
  if (st == NULL)
    return IDEM_ESTORE;
  bind_scope(st, sc);
  rc = sqlite3_step(st);
  if (rc == SQLITE_ROW)
    rc = row_to_record(st, out);
  else if (rc == SQLITE_DONE)
    rc = IDEM_ENOTFOUND;
  else
    rc = idem__sqlite_fail(c->db, rc, "read record");
  sqlite3_reset(st);
  return rc;
}

/* idem_tx_statement(): kept on the connection, made again for other SQL. */
static void *tx_statement(idem_tx_t *tx, unsigned slot, const char *sql) {
  struct conn *c = tx->conn;
  sqlite3_stmt **st = &c->caller_st[slot];

  if (*st && c->caller_sql[slot] != sql && strcmp(c->caller_sql[slot], sql) != 0) {
    sqlite3_finalize(*st);
    *st = NULL;
  }
  if (*st == NULL) {
    int rc = sqlite3_prepare_v3(c->db, sql, -1, SQLITE_PREPARE_PERSISTENT, st, NULL);
    if (rc != SQLITE_OK) {
      (void)idem__sqlite_fail(c->db, rc, "prepare the caller's statement");
      sqlite3_finalize(*st);
      *st = NULL;
      return NULL;
    }
    c->caller_sql[slot] = sql;
  }
  sqlite3_reset(*st);
  sqlite3_clear_bindings(*st);
  return *st;
}

static int tx_take_over(idem_tx_t *tx, const idem_scope_t *sc, const char *owner,
                        int64_t lease_expires_at, idem_record_t *out) {
  struct conn *c = tx->conn;
  sqlite3_stmt *st = idem__sqlite_stmt(c, ST_TAKE_OVER);
  int rc;

  if (st == NULL)
    return IDEM_ESTORE;
  bind_scope(st, sc);
  bind_text(st, 4, owner);
  sqlite3_bind_int64(st, 5, lease_expires_at);
  sqlite3_bind_int64(st, 6, tx->now_ms);
  rc = sqlite3_step(st);
  if (rc == SQLITE_ROW) {
    rc = row_to_record(st, out);
    if (rc == IDEM_OK && (rc = sqlite3_step(st)) == SQLITE_DONE)
      rc = IDEM_OK;
    else if (rc != IDEM_OK && rc != IDEM_ENOMEM)
      rc = idem__sqlite_fail(c->db, rc, "take over");
  } else if (rc == SQLITE_DONE) {
    rc = IDEM_ENOTFOUND;
  } else {
    rc = idem__sqlite_fail(c->db, rc, "take over");
  }
  sqlite3_reset(st);
  return rc;
}

static const idem__tx_ops_t tx_ops = {tx_statement, tx_take_over, NULL, NULL};

/* Runs the caller's effect `e` on connection `c`. */
static int run_effect(struct conn *c, const idem_effect_t *e, int64_t now_ms,
                      int writable) {
  idem_tx_t tx = {"sqlite", c->db, now_ms, &tx_ops, c, writable};
  if (e == NULL || e->fn == NULL)
    return IDEM_OK;
  return idem__effect_run(e, &tx);
}

/* Writes an outcome into the record of `sc` owned by `owner`: first at
 * `row` when it is known, then through the key if that found nothing (a
 * row the record no longer has). IDEM_OK when the record was changed,
 * IDEM_ELOST when no such record is owned by `owner`, or the error. */
static int complete_record(struct conn *c, const idem_scope_t *sc,
                           const char *owner, const idem_outcome_t *o,
                           int64_t now_ms, int64_t ttl_ms, int64_t row) {
  for (;; row = 0) {
    sqlite3_stmt *st = idem__sqlite_stmt(c, row ? ST_COMPLETE_ROW : ST_COMPLETE);
    int rc;

    if (st == NULL)
      return IDEM_ESTORE;
    bind_scope(st, sc);
    bind_text(st, 4, idem_state_name(o->state));
    sqlite3_bind_int(st, 5, o->status);
    bind_text(st, 6, o->body);
    bind_text(st, 7, o->location);
    bind_text(st, 8, o->resource_id);
    bind_text(st, 9, o->provider_ref);
    sqlite3_bind_int64(st, 10, now_ms);
    if (o->state == IDEM_STATE_PENDING)
      sqlite3_bind_null(st, 11); /* unknown outcomes never expire */
    else
      sqlite3_bind_int64(st, 11, now_ms + ttl_ms);
    bind_text(st, 12, owner);
    if (row)
      sqlite3_bind_int64(st, 13, row);
    if ((rc = idem__sqlite_run(c, st, "complete")) != IDEM_OK)
      return rc;
    if (sqlite3_changes(c->db) == 1)
      return IDEM_OK;
    if (row == 0)
      return IDEM_ELOST;
  }
}

/* The body of a reservation, inside a write transaction. */
static int reserve_tx(struct conn *c, const idem_reserve_t *req,
                      const char *owner, idem_record_t *out,
                      idem_reserve_result_t *result) {
  sqlite3_stmt *st = idem__sqlite_stmt(c, ST_RESERVE);
  int64_t last = sqlite3_last_insert_rowid(c->db), row;
  int rc;

  if (st == NULL)
    return IDEM_ESTORE;
  bind_scope(st, &req->scope);
  bind_text(st, 4, req->fingerprint);
  bind_text(st, 5, req->correlation_id);
  bind_text(st, 6, owner);
  sqlite3_bind_int64(st, 7, req->now_ms + req->lease_ms);
  sqlite3_bind_int64(st, 8, req->now_ms);
  bind_text(st, 9, req->resource_id);
  if ((rc = idem__sqlite_run(c, st, "reserve")) != IDEM_OK)
    return rc;

  if (sqlite3_changes(c->db) == 0) {
    *result = IDEM_RESERVE_EXISTS;
    return read_record(c, &req->scope, out);
  }
  *result = IDEM_RESERVE_WON;
  /* A new row sets the last rowid; an old record taken over (the DO
   * UPDATE) leaves it, and its row stays unknown. So does a new row whose
   * rowid happens to equal the connection's previous insert (a record
   * freed since, or the first record after a tenant of the same id):
   * then the completion looks the key up, as it always did. */
  row = sqlite3_last_insert_rowid(c->db);
  if (row == last)
    row = 0;

  if ((rc = run_effect(c, &req->effect, req->now_ms, 1)) != IDEM_OK)
    return rc;
  if (req->outcome) {
    rc = complete_record(c, &req->scope, owner, req->outcome, req->now_ms,
                         req->ttl_ms, row);
    if (rc != IDEM_OK)
      return rc == IDEM_ELOST ? IDEM_ESTORE : rc;
    return idem__settled_record(req, owner, row, out);
  }
  return idem__won_record(req, owner, row, out);
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

static int sq_reserve(idem_store_t *base, const idem_reserve_t *req,
                      idem_record_t *out, idem_reserve_result_t *result) {
  char owner[IDEM_TOKEN_MAX + 1];
  struct reserve_args a = {req, owner, out, result};
  int rc;

  if (idem_random_token(owner, IDEM_TOKEN_MAX) != IDEM_OK)
    return IDEM_ECRYPTO;
  rc = idem__sqlite_write_job((sqlite_store_t *)base, reserve_fn, &a, 1);
  if (rc != IDEM_OK)
    idem_record_reset(out);
  return rc;
}

/* An asynchronous reservation: the job, its arguments and the owner
 * token in one block, until the writer calls back. */
struct async_reserve {
  struct job job; /* first: the writer frees the block through it */
  struct reserve_args a;
  char owner[IDEM_TOKEN_MAX + 1];
};

static int sq_reserve_async(idem_store_t *base, const idem_reserve_t *req,
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
  ar->job = (struct job){.fn = reserve_fn, .arg = &ar->a, .rerunnable = 1, .cb = done,
                         .cb_arg = arg, .answers = req->outcome != NULL};
  idem__sqlite_enqueue((sqlite_store_t *)base, &ar->job);
  return IDEM_OK;
}

static int complete_fn(struct conn *c, void *arg) {
  const idem_complete_t *cp = arg;
  int rc = complete_record(c, &cp->scope, cp->owner_token, &cp->outcome, cp->now_ms,
                           cp->ttl_ms, cp->row);
  if (rc != IDEM_OK)
    return rc;
  return run_effect(c, &cp->effect, cp->now_ms, 1);
}

static int sq_complete(idem_store_t *base, const idem_complete_t *cp) {
  return idem__sqlite_write_job((sqlite_store_t *)base, complete_fn, (void *)cp, 1);
}

static int sq_complete_async(idem_store_t *base, const idem_complete_t *cp,
                             idem_store_done_fn done, void *arg) {
  struct job *j = calloc(1, sizeof *j);

  if (j == NULL)
    return IDEM_ENOMEM;
  *j = (struct job){.fn = complete_fn, .arg = (void *)cp, .rerunnable = 1, .cb = done,
                    .cb_arg = arg, .answers = 1};
  idem__sqlite_enqueue((sqlite_store_t *)base, j);
  return IDEM_OK;
}

/* A caller's own write, in a transaction of the group commit; it may run
 * again after a rollback, as the caller was told (store.h). */
static int caller_write_fn(struct conn *c, void *arg) {
  return run_effect(c, arg, idem_now_ms(), 1);
}

static int sq_write(idem_store_t *base, const idem_effect_t *e) {
  return idem__sqlite_write_job((sqlite_store_t *)base, caller_write_fn, (void *)e, 1);
}

static int sq_read(idem_store_t *base, const idem_effect_t *e) {
  sqlite_store_t *s = (sqlite_store_t *)base;
  struct conn *c;
  int rc = idem__sqlite_conn_get(s, &c);

  if (rc != IDEM_OK)
    return rc;
  rc = run_effect(c, e, idem_now_ms(), 0);
  if (sqlite3_get_autocommit(c->db) == 0) /* left open: not ours to keep */
    (void)idem__sqlite_exec(c->db, "ROLLBACK");
  idem__sqlite_conn_put(s, c);
  return rc;
}

static int sq_lookup(idem_store_t *base, const idem_scope_t *sc, int64_t now_ms,
                     idem_record_t *out) {
  sqlite_store_t *s = (sqlite_store_t *)base;
  struct conn *c;
  int rc;

  if ((rc = idem__sqlite_conn_get(s, &c)) != IDEM_OK)
    return rc;
  rc = read_record(c, sc, out);
  idem__sqlite_conn_put(s, c);
  if (rc == IDEM_OK && out->expires_at != 0 && out->expires_at <= now_ms &&
      (out->state == IDEM_STATE_COMPLETED || out->state == IDEM_STATE_FAILED)) {
    idem_record_reset(out);
    rc = IDEM_ENOTFOUND;
  }
  return rc;
}

static int sq_records_list(idem_store_t *base, const idem_records_query_t *q,
                           idem_record_t *out, int *n) {
  sqlite_store_t *s = (sqlite_store_t *)base;
  struct conn *c;
  sqlite3_stmt *st;
  int rc, found = 0;

  if ((rc = idem__sqlite_conn_get(s, &c)) != IDEM_OK)
    return rc;
  if ((st = idem__sqlite_stmt(c, ST_RECORDS_LIST)) == NULL) {
    idem__sqlite_conn_put(s, c);
    return IDEM_ESTORE;
  }
  sqlite3_bind_int64(st, 1, q->tenant_id);
  bind_text(st, 2, q->state == IDEM_STATE_NONE ? NULL : idem_state_name(q->state));
  sqlite3_bind_int64(st, 3, q->updated_before);
  sqlite3_bind_int(st, 4, q->limit);
  while (found < q->limit && (rc = sqlite3_step(st)) == SQLITE_ROW) {
    if (row_to_record(st, &out[found++]) != IDEM_OK) {
      rc = SQLITE_NOMEM;
      break;
    }
  }
  rc = rc == SQLITE_ROW || rc == SQLITE_DONE
           ? IDEM_OK
           : idem__sqlite_fail(c->db, rc, "records list");
  sqlite3_reset(st);
  idem__sqlite_conn_put(s, c);
  if (rc != IDEM_OK) {
    for (int i = 0; i < found; i++)
      idem_record_reset(&out[i]);
    found = 0;
  }
  *n = found;
  return rc;
}

struct meta_args {
  const char *name, *value;
  char **out;
};

static int meta_fn(struct conn *c, void *arg) {
  struct meta_args *a = arg;
  sqlite3_stmt *st = idem__sqlite_stmt(c, ST_META_PUT);
  int rc;

  if (st == NULL)
    return IDEM_ESTORE;
  bind_text(st, 1, a->name);
  bind_text(st, 2, a->value);
  if ((rc = idem__sqlite_run(c, st, "meta put")) != IDEM_OK)
    return rc;
  if ((st = idem__sqlite_stmt(c, ST_META_GET)) == NULL)
    return IDEM_ESTORE;
  bind_text(st, 1, a->name);
  rc = sqlite3_step(st);
  if (rc == SQLITE_ROW) {
    *a->out = strdup(col_text(st, 0));
    rc = *a->out ? IDEM_OK : IDEM_ENOMEM;
  } else {
    rc = idem__sqlite_fail(c->db, rc, "meta get");
  }
  sqlite3_reset(st);
  return rc;
}

static int probe_fn(struct conn *c, void *arg) {
  sqlite3_stmt *st = idem__sqlite_stmt(c, ST_PROBE);
  (void)arg;
  if (st == NULL)
    return IDEM_ESTORE;
  sqlite3_bind_int64(st, 1, idem_now_ms());
  return idem__sqlite_run(c, st, "probe");
}

static int sq_probe(idem_store_t *base) {
  return idem__sqlite_write_job((sqlite_store_t *)base, probe_fn, NULL, 1);
}

static int sq_meta_get_or_put(idem_store_t *base, const char *name,
                              const char *value, char **out) {
  struct meta_args a = {name, value, out};
  int rc = idem__sqlite_write_tx((sqlite_store_t *)base, meta_fn, &a);
  if (rc != IDEM_OK) {
    free(*out);
    *out = NULL;
  }
  return rc;
}

struct sweep_args {
  int64_t now_ms;
  int batch;
  int *deleted;
};

static int sweep_fn(struct conn *c, void *arg) {
  struct sweep_args *a = arg;
  sqlite3_stmt *st = idem__sqlite_stmt(c, ST_SWEEP);
  int rc;

  if (st == NULL)
    return IDEM_ESTORE;
  sqlite3_bind_int64(st, 1, a->now_ms);
  sqlite3_bind_int(st, 2, a->batch);
  if ((rc = idem__sqlite_run(c, st, "sweep")) == IDEM_OK)
    *a->deleted = sqlite3_changes(c->db);
  return rc;
}

static int sq_sweep(idem_store_t *base, int64_t now_ms, int batch, int *deleted) {
  struct sweep_args a = {now_ms, batch, deleted};
  return idem__sqlite_write_tx((sqlite_store_t *)base, sweep_fn, &a);
}

static int sq_count(idem_store_t *base, const char *what, int64_t tenant_id,
                    int64_t *n) {
  static const struct {
    const char *what, *sql;
  } queries[] = {
      {"records", "SELECT count(*) FROM idempotency_records WHERE (?1 = 0 OR tenant_id = ?1)"},
      {"processing", "SELECT count(*) FROM idempotency_records WHERE state = 'processing' AND (?1 = 0 OR tenant_id = ?1)"},
      {"pending", "SELECT count(*) FROM idempotency_records WHERE state = 'pending' AND (?1 = 0 OR tenant_id = ?1)"},
      {"oldest_pending", "SELECT coalesce(min(created_at), 0) FROM idempotency_records WHERE state = 'pending' AND (?1 = 0 OR tenant_id = ?1)"},
  };
  sqlite_store_t *s = (sqlite_store_t *)base;
  const char *sql = NULL;
  sqlite3_stmt *st = NULL;
  struct conn *c;
  int rc;

  for (size_t i = 0; i < sizeof queries / sizeof *queries; i++)
    if (strcmp(queries[i].what, what) == 0)
      sql = queries[i].sql;
  if (sql == NULL)
    return IDEM_EINVAL;
  if ((rc = idem__sqlite_conn_get(s, &c)) != IDEM_OK)
    return rc;
  rc = sqlite3_prepare_v2(c->db, sql, -1, &st, NULL);
  if (rc == SQLITE_OK) {
    sqlite3_bind_int64(st, 1, tenant_id);
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW) {
      *n = sqlite3_column_int64(st, 0);
      rc = IDEM_OK;
    } else {
      rc = idem__sqlite_fail(c->db, rc, "count");
    }
  } else {
    rc = idem__sqlite_fail(c->db, rc, "count");
  }
  sqlite3_finalize(st);
  idem__sqlite_conn_put(s, c);
  return rc;
}

static int sq_ping(idem_store_t *base) {
  sqlite_store_t *s = (sqlite_store_t *)base;
  struct conn *c;
  sqlite3_stmt *st;
  int rc;

  if ((rc = idem__sqlite_conn_get(s, &c)) != IDEM_OK)
    return rc;
  if ((st = idem__sqlite_stmt(c, ST_PING)) == NULL) {
    idem__sqlite_conn_put(s, c);
    return IDEM_ESTORE;
  }
  rc = sqlite3_step(st);
  rc = rc == SQLITE_ROW ? IDEM_OK : idem__sqlite_fail(c->db, rc, "ping");
  sqlite3_reset(st);
  idem__sqlite_conn_put(s, c);
  return rc;
}

static void sq_close(idem_store_t *base) {
  sqlite_store_t *s = (sqlite_store_t *)base;
  struct conn *c;

  idem__sqlite_writer_stop(s);
  c = s->free_conns;
  while (c) {
    struct conn *next = c->next;
    conn_free(c);
    c = next;
  }
  pthread_mutex_destroy(&s->pool_lock);
  pthread_mutex_destroy(&s->write_lock);
  pthread_mutex_destroy(&s->q_lock);
  pthread_cond_destroy(&s->q_ready);
  free(s->path);
  free(s);
}

/* Set once, before SQLite initialises (later calls fail with
 * SQLITE_MISUSE and change nothing):
 * - SQLite counts its memory use under one global mutex by default, which
 *   every connection's allocations (the writer's and each reader's) then
 *   contend for; idemd never asks for those counts.
 * - A page already changed in a transaction is copied to the statement
 *   journal when a later statement (or write of a batch, in its own
 *   savepoint) changes it again, so that statement alone can be undone.
 *   The journal spills to a temporary file past a threshold; at SQLite's
 *   64 KiB most batches under load spilled: a dozen page writes per
 *   commit to a file that is never read unless a write fails. The
 *   threshold is now 120 KiB, as high as it can go: the journal spills
 *   its first block (the threshold's size) in one write, and the unix
 *   file layer writes at most 128 KiB per call, so a larger threshold
 *   makes every spill fail with SQLITE_FULL (512 KiB did: a sweep of 500
 *   large records failed, test_sweep_large_batch). Never spilling (-1)
 *   is no better: this SQLite is built with SECURE_DELETE, so a DELETE
 *   or DROP TABLE journals every page it frees, and the schema 3
 *   migration of 250,000 records held 148 MB in memory (7.8 MB with a
 *   threshold). */
static void configure_sqlite(void) {
  (void)sqlite3_config(SQLITE_CONFIG_MEMSTATUS, 0);
  (void)sqlite3_config(SQLITE_CONFIG_STMTJRNL_SPILL, 120 * 1024);
  /* Connections open through idem's VFS, which writes a commit's WAL
   * frames in one call (sqlite_vfs.c); the default one if it could not be
   * registered, which is as correct. */
  if (idem_sqlite_vfs_register() == SQLITE_OK)
    vfs_name = IDEM_SQLITE_VFS;
}

int idem__sqlite_open(const char *path, const idem_store_options_t *opts,
                      idem_store_t **out) {
  static pthread_once_t configured = PTHREAD_ONCE_INIT;
  sqlite_store_t *s;
  struct conn *c;
  int rc;

  pthread_once(&configured, configure_sqlite);
  s = calloc(1, sizeof *s);

  *out = NULL;
  if (s == NULL || (s->path = strdup(path)) == NULL) {
    free(s);
    return IDEM_ENOMEM;
  }
  s->base.methods = &sqlite_methods;
  s->busy_timeout_ms = opts->busy_timeout_ms > 0 ? opts->busy_timeout_ms : 5000;
  pthread_mutex_init(&s->pool_lock, NULL);
  pthread_mutex_init(&s->write_lock, NULL);
  pthread_mutex_init(&s->q_lock, NULL);
  pthread_cond_init(&s->q_ready, NULL);
  /* Open one connection now so a bad path fails here, not on a request. */
  if ((rc = conn_new(s, &c)) != IDEM_OK) {
    sq_close(&s->base);
    return rc;
  }
  idem__sqlite_conn_put(s, c);
  if ((rc = idem__sqlite_writer_start(s)) != IDEM_OK) {
    sq_close(&s->base);
    return rc;
  }
  *out = &s->base;
  return IDEM_OK;
}

struct claim_args {
  int64_t now_ms, lease_ms;
  int max;
  idem_record_t *out;
  int found;
};

static void sq_stats(idem_store_t *base, idem_store_stats_t *out) {
  sqlite_store_t *s = (sqlite_store_t *)base;
  out->commits = atomic_load(&s->commits);
  out->writes = atomic_load(&s->writes);
  out->batch_reruns = atomic_load(&s->batch_reruns);
}

static const idem_store_methods_t sqlite_methods = {
    .version = 1,
    .name = "sqlite",
    .local_reads = 1,
    .reserve_async = sq_reserve_async,
    .complete_async = sq_complete_async,
    .close = sq_close,
    .migrate = idem__sqlite_migrate,
    .ping = sq_ping,
    .reserve = sq_reserve,
    .complete = sq_complete,
    .lookup = sq_lookup,
    .meta_get_or_put = sq_meta_get_or_put,
    .sweep = sq_sweep,
    .count = sq_count,
    .records_list = sq_records_list,
    .stats = sq_stats,
    .probe = sq_probe,
    .write = sq_write,
    .read = sq_read,
};
