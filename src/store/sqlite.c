/* The SQLite store: one database file in WAL mode, durable commits
 * (synchronous=FULL), versioned migrations, and a pool of connections with
 * their statements prepared once.
 *
 * Concurrency: readers use their own pooled connection and never block.
 * Writers take `write_lock` around their (short) transaction: SQLite admits
 * one writer at a time anyway, and queueing on a mutex is fairer and far
 * cheaper than every thread spinning in SQLite's busy handler. Other
 * processes (idemd tenant create while a server runs) are handled by the
 * busy timeout plus a bounded retry. */
#define _GNU_SOURCE /* pthread_setname_np */
#include "store_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <semaphore.h>
#include <sys/stat.h>
#include <unistd.h>
#include <stdatomic.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "idem/clock.h"
#include "idem/crypto.h"
#include "sqlite_vfs.h"

enum stmt_id {
  ST_BEGIN,
  ST_COMMIT,
  ST_ROLLBACK,
  ST_RESERVE,
  ST_READ_RECORD,
  ST_INSERT_RESOURCE,
  ST_INSERT_OUTBOX,
  ST_COMPLETE,
  ST_COMPLETE_ROW,
  ST_UPDATE_RESOURCE,
  ST_DELETE_OUTBOX,
  ST_RESOURCE_GET,
  ST_TENANT_CREATE,
  ST_TENANT_FIND,
  ST_META_PUT,
  ST_META_GET,
  ST_SWEEP,
  ST_PING,
  ST_CLAIM_SELECT,
  ST_CLAIM_UPDATE,
  ST_CLAIM_OUTBOX,
  ST_SAVEPOINT,
  ST_ROLLBACK_TO,
  ST_RELEASE,
  ST_TENANT_BY_NAME,
  ST_TENANT_UPDATE,
  ST_TENANT_LIST,
  ST_RECORDS_LIST,
  ST_COUNT_
};

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
#define TENANT_COLUMNS "id, name, key_lookup, key_hash, disabled, created_at"

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
    [ST_INSERT_RESOURCE] =
        "INSERT INTO resources (id, tenant_id, kind, status, body, "
        "provider_ref, created_at, updated_at) "
        "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7)",
    [ST_INSERT_OUTBOX] =
        "INSERT INTO outbox (resource_id, tenant_id, operation, key, "
        "created_at, attempts, next_attempt_at) "
        "VALUES (?1, ?2, ?3, ?4, ?5, 0, ?5)",
    [ST_COMPLETE] = COMPLETE_SET SCOPE_MATCH " AND " COMPLETE_OWNED,
    /* The same, the record found by the rowid its reservation inserted
     * (?13) instead of through the key's index: 4,200 fewer instructions
     * per completion. The key and owner must still match. */
    [ST_COMPLETE_ROW] =
        COMPLETE_SET "rowid = ?13 AND " SCOPE_MATCH " AND " COMPLETE_OWNED,
    [ST_UPDATE_RESOURCE] =
        "UPDATE resources SET status = COALESCE(?4, status), "
        "body = COALESCE(?5, body), provider_ref = COALESCE(?6, provider_ref), "
        "updated_at = ?7 WHERE id = COALESCE(?8, (SELECT resource_id FROM "
        "idempotency_records WHERE " SCOPE_MATCH ")) AND tenant_id = ?1",
    /* ?4, like ?8 above, is the outcome's resource id when it names one:
     * ST_COMPLETE has just stored it in the record, so the lookup would
     * find the same id. */
    [ST_DELETE_OUTBOX] = "DELETE FROM outbox WHERE resource_id = COALESCE(?4, "
                         "(SELECT resource_id FROM idempotency_records WHERE "
                         SCOPE_MATCH ")) AND tenant_id = ?1",
    [ST_RESOURCE_GET] = "SELECT body FROM resources WHERE id = ?1 AND "
                        "tenant_id = ?2 AND kind = ?3",
    [ST_TENANT_CREATE] = "INSERT INTO tenants (name, key_lookup, key_hash, "
                         "disabled, created_at) VALUES (?1, ?2, ?3, 0, ?4)",
    [ST_TENANT_FIND] = "SELECT " TENANT_COLUMNS " FROM tenants WHERE key_lookup = ?1",
    [ST_TENANT_BY_NAME] = "SELECT " TENANT_COLUMNS " FROM tenants WHERE name = ?1",
    [ST_TENANT_UPDATE] = "UPDATE tenants SET key_lookup = ?2, key_hash = ?3, "
                         "disabled = ?4 WHERE name = ?1",
    [ST_TENANT_LIST] = "SELECT " TENANT_COLUMNS " FROM tenants ORDER BY name LIMIT ?1",
    [ST_RECORDS_LIST] = "SELECT " RECORD_COLUMNS " FROM idempotency_records "
                        "WHERE tenant_id = ?1 AND (?2 IS NULL OR state = ?2) "
                        "AND (?3 = 0 OR updated_at < ?3) "
                        "ORDER BY updated_at DESC LIMIT ?4",
    [ST_META_PUT] = "INSERT INTO meta (name, value) VALUES (?1, ?2) "
                    "ON CONFLICT (name) DO NOTHING",
    [ST_META_GET] = "SELECT value FROM meta WHERE name = ?1",
    [ST_SWEEP] = "DELETE FROM idempotency_records WHERE rowid IN (SELECT "
                 "rowid FROM idempotency_records WHERE expires_at <= ?1 AND "
                 "state IN ('completed', 'failed') LIMIT ?2)",
    [ST_PING] = "SELECT count(*) FROM meta",
    /* Records the reconciler must settle: unknown outcomes, and work whose
     * worker's lease ran out; only payments (they have an outbox row). */
    [ST_CLAIM_SELECT] =
        "SELECT r.tenant_id, r.operation, r.key FROM outbox o "
        "JOIN idempotency_records r ON r.tenant_id = o.tenant_id "
        "AND r.operation = o.operation AND r.key = o.key "
        "WHERE (r.state = 'pending' OR r.state = 'processing') "
        "AND (r.lease_expires_at IS NULL OR r.lease_expires_at <= ?1) "
        "ORDER BY o.next_attempt_at LIMIT ?2",
    [ST_CLAIM_UPDATE] =
        "UPDATE idempotency_records SET owner_token = ?4, "
        "lease_expires_at = ?5, updated_at = ?6 WHERE " SCOPE_MATCH,
    /* A claimed payment goes to the back of the queue: one the provider
     * cannot settle yet must not be claimed again before all the others,
     * which a full batch of them would otherwise keep out for good. */
    [ST_CLAIM_OUTBOX] = "UPDATE outbox SET attempts = attempts + 1, "
                        "next_attempt_at = ?3 WHERE resource_id = ?1 AND tenant_id = ?2",
};

/* Schema versions, applied in order; PRAGMA user_version is the count
 * applied. Never edit a released entry: add a new one. */
static const char *const migrations[] = {
    /* 1: records, resources, outbox, tenants, meta. */
    "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL) "
    "WITHOUT ROWID;"
    "CREATE TABLE tenants ("
    " id INTEGER PRIMARY KEY,"
    " name TEXT NOT NULL UNIQUE,"
    " key_lookup TEXT NOT NULL UNIQUE,"
    " key_hash BLOB NOT NULL,"
    " disabled INTEGER NOT NULL DEFAULT 0,"
    " created_at INTEGER NOT NULL);"
    "CREATE TABLE idempotency_records ("
    " tenant_id INTEGER NOT NULL REFERENCES tenants (id),"
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
    " lease_expires_at INTEGER,"
    " created_at INTEGER NOT NULL,"
    " updated_at INTEGER NOT NULL,"
    " expires_at INTEGER,"
    " UNIQUE (tenant_id, operation, key));"
    "CREATE INDEX records_expiry ON idempotency_records (expires_at) "
    "WHERE expires_at IS NOT NULL;"
    "CREATE INDEX records_open ON idempotency_records (state, updated_at) "
    "WHERE state IN ('processing', 'pending');"
    "CREATE TABLE resources ("
    " id TEXT PRIMARY KEY,"
    " tenant_id INTEGER NOT NULL REFERENCES tenants (id),"
    " kind TEXT NOT NULL,"
    " status TEXT NOT NULL,"
    " body TEXT NOT NULL,"
    " provider_ref TEXT,"
    " created_at INTEGER NOT NULL,"
    " updated_at INTEGER NOT NULL);"
    "CREATE INDEX resources_by_status ON resources (kind, status);"
    "CREATE TABLE outbox ("
    " resource_id TEXT PRIMARY KEY REFERENCES resources (id),"
    " tenant_id INTEGER NOT NULL,"
    " operation TEXT NOT NULL,"
    " key TEXT NOT NULL,"
    " created_at INTEGER NOT NULL,"
    " attempts INTEGER NOT NULL DEFAULT 0,"
    " next_attempt_at INTEGER NOT NULL);"
    /* Read-only views for operators: the business tables by kind. */
    "CREATE VIEW payments AS SELECT id, tenant_id, status,"
    " json_extract(body, '$.amount') AS amount,"
    " json_extract(body, '$.currency') AS currency,"
    " json_extract(body, '$.order_id') AS order_id,"
    " provider_ref, created_at, updated_at FROM resources"
    " WHERE kind = 'payment';"
    "CREATE VIEW orders AS SELECT id, tenant_id, status,"
    " json_extract(body, '$.customer_id') AS customer_id,"
    " json_extract(body, '$.total') AS total,"
    " json_extract(body, '$.currency') AS currency,"
    " created_at, updated_at FROM resources WHERE kind = 'order';",
    /* 2: no query reads resources by status, and keeping the index cost
     * every payment two more index writes (inserted pending, moved on
     * completion). */
    "DROP INDEX resources_by_status;",
    /* 3: less work for every write.
     * - The records' CHECK on state was an IN list, which SQLite 3.40
     *   evaluates through a temporary b-tree built on each INSERT or
     *   UPDATE: some 100 KB allocated and freed per write. The table is
     *   copied into one whose CHECK compares with each state in turn.
     * - records_open is made again as records_unsettled, its condition
     *   written with OR: SQLite could not see that "state = 'pending'"
     *   falls within an IN list, so the counts of pending and processing
     *   records that /metrics reads scanned the whole table (0.16 s
     *   each at a million records).
     * - resources and outbox are kept in their primary key (WITHOUT
     *   ROWID): with a rowid each row was written twice, in the table
     *   and in the index on its id.
     * Each table is copied under a new name first, the outbox pointing at
     * the new resources, so that no foreign key is broken at any step;
     * RENAME carries that reference along. The views name resources and
     * are made again afterwards. */
    "DROP VIEW IF EXISTS payments;"
    "DROP VIEW IF EXISTS orders;"
    "CREATE TABLE records_v3 ("
    " tenant_id INTEGER NOT NULL REFERENCES tenants (id),"
    " operation TEXT NOT NULL,"
    " key TEXT NOT NULL,"
    " fingerprint TEXT NOT NULL,"
    " state TEXT NOT NULL CHECK (state = 'processing' OR state = 'completed'"
    " OR state = 'failed' OR state = 'pending'),"
    " response_status INTEGER,"
    " response_body TEXT,"
    " location TEXT,"
    " resource_id TEXT,"
    " provider_ref TEXT,"
    " correlation_id TEXT NOT NULL,"
    " owner_token TEXT,"
    " lease_expires_at INTEGER,"
    " created_at INTEGER NOT NULL,"
    " updated_at INTEGER NOT NULL,"
    " expires_at INTEGER,"
    " UNIQUE (tenant_id, operation, key));"
    "INSERT INTO records_v3 (rowid, tenant_id, operation, key, fingerprint,"
    " state, response_status, response_body, location, resource_id,"
    " provider_ref, correlation_id, owner_token, lease_expires_at,"
    " created_at, updated_at, expires_at) SELECT rowid, tenant_id,"
    " operation, key, fingerprint, state, response_status, response_body,"
    " location, resource_id, provider_ref, correlation_id, owner_token,"
    " lease_expires_at, created_at, updated_at, expires_at"
    " FROM idempotency_records;"
    "DROP TABLE idempotency_records;"
    "ALTER TABLE records_v3 RENAME TO idempotency_records;"
    "CREATE INDEX records_expiry ON idempotency_records (expires_at) "
    "WHERE expires_at IS NOT NULL;"
    "CREATE INDEX records_unsettled ON idempotency_records (state, created_at) "
    "WHERE state = 'processing' OR state = 'pending';"
    "CREATE TABLE resources_v3 ("
    " id TEXT PRIMARY KEY,"
    " tenant_id INTEGER NOT NULL REFERENCES tenants (id),"
    " kind TEXT NOT NULL,"
    " status TEXT NOT NULL,"
    " body TEXT NOT NULL,"
    " provider_ref TEXT,"
    " created_at INTEGER NOT NULL,"
    " updated_at INTEGER NOT NULL) WITHOUT ROWID;"
    "INSERT INTO resources_v3 (id, tenant_id, kind, status, body, provider_ref,"
    " created_at, updated_at) SELECT id, tenant_id, kind, status, body,"
    " provider_ref, created_at, updated_at FROM resources;"
    "CREATE TABLE outbox_v3 ("
    " resource_id TEXT PRIMARY KEY REFERENCES resources_v3 (id),"
    " tenant_id INTEGER NOT NULL,"
    " operation TEXT NOT NULL,"
    " key TEXT NOT NULL,"
    " created_at INTEGER NOT NULL,"
    " attempts INTEGER NOT NULL DEFAULT 0,"
    " next_attempt_at INTEGER NOT NULL) WITHOUT ROWID;"
    "INSERT INTO outbox_v3 (resource_id, tenant_id, operation, key, created_at,"
    " attempts, next_attempt_at) SELECT resource_id, tenant_id, operation, key,"
    " created_at, attempts, next_attempt_at FROM outbox;"
    "DROP TABLE outbox;"
    "DROP TABLE resources;"
    "ALTER TABLE resources_v3 RENAME TO resources;"
    "ALTER TABLE outbox_v3 RENAME TO outbox;"
    "CREATE VIEW payments AS SELECT id, tenant_id, status,"
    " json_extract(body, '$.amount') AS amount,"
    " json_extract(body, '$.currency') AS currency,"
    " json_extract(body, '$.order_id') AS order_id,"
    " provider_ref, created_at, updated_at FROM resources"
    " WHERE kind = 'payment';"
    "CREATE VIEW orders AS SELECT id, tenant_id, status,"
    " json_extract(body, '$.customer_id') AS customer_id,"
    " json_extract(body, '$.total') AS total,"
    " json_extract(body, '$.currency') AS currency,"
    " created_at, updated_at FROM resources WHERE kind = 'order';",
    /* 4: a record's tenant_id is the caller's number, no longer a
     * reference to tenants: tenants are idemd's, and a program that embeds
     * libidem scopes its keys by a value of its own, with no tenant row
     * to make first. SQLite cannot drop a constraint, so the table is
     * copied as in version 3, its rowids kept (a reservation's `row`,
     * which a completion may name, stays right), and its two indexes are
     * made again as version 3 has them. resources keep their reference to
     * tenants (payments and orders are idemd's) and the outbox its
     * reference to resources; none of idem's views reads the records. */
    "CREATE TABLE records_v4 ("
    " tenant_id INTEGER NOT NULL,"
    " operation TEXT NOT NULL,"
    " key TEXT NOT NULL,"
    " fingerprint TEXT NOT NULL,"
    " state TEXT NOT NULL CHECK (state = 'processing' OR state = 'completed'"
    " OR state = 'failed' OR state = 'pending'),"
    " response_status INTEGER,"
    " response_body TEXT,"
    " location TEXT,"
    " resource_id TEXT,"
    " provider_ref TEXT,"
    " correlation_id TEXT NOT NULL,"
    " owner_token TEXT,"
    " lease_expires_at INTEGER,"
    " created_at INTEGER NOT NULL,"
    " updated_at INTEGER NOT NULL,"
    " expires_at INTEGER,"
    " UNIQUE (tenant_id, operation, key));"
    "INSERT INTO records_v4 (rowid, tenant_id, operation, key, fingerprint,"
    " state, response_status, response_body, location, resource_id,"
    " provider_ref, correlation_id, owner_token, lease_expires_at,"
    " created_at, updated_at, expires_at) SELECT rowid, tenant_id,"
    " operation, key, fingerprint, state, response_status, response_body,"
    " location, resource_id, provider_ref, correlation_id, owner_token,"
    " lease_expires_at, created_at, updated_at, expires_at"
    " FROM idempotency_records;"
    "DROP TABLE idempotency_records;"
    "ALTER TABLE records_v4 RENAME TO idempotency_records;"
    "CREATE INDEX records_expiry ON idempotency_records (expires_at) "
    "WHERE expires_at IS NOT NULL;"
    "CREATE INDEX records_unsettled ON idempotency_records (state, created_at) "
    "WHERE state = 'processing' OR state = 'pending';",
};

#define SCHEMA_VERSION ((int)(sizeof migrations / sizeof *migrations))

/* Schema objects of idem's own that versions 3 and 4 may drop and make
 * again. */
#define OWN_OBJECTS                                                           \
  "'payments', 'orders', 'records_expiry', 'records_open', "                  \
  "'records_unsettled'"

#define BUSY_RETRIES 50

/* The VFS connections open with (configure_sqlite()); NULL: the default. */
static const char *vfs_name;

struct conn {
  sqlite3 *db;
  sqlite3_stmt *st[ST_COUNT_];
  struct conn *next;
};

/* A write waiting for the group-commit writer. A synchronous caller
 * sleeps on `done` alone, so a commit wakes exactly the callers of its
 * batch; an asynchronous one is called back (`cb`) by the writer. */
struct job {
  int (*fn)(struct conn *, void *);
  void *arg;
  int rc;
  /* fn may run again after a rollback: it sets every output it has and
   * holds nothing from an earlier run (reservations and completions). */
  int rerunnable;
  sem_t done;
  /* Asynchronous: called after the commit; the job was malloc'd, first in
   * its block, and the writer frees the block before calling. */
  idem_store_done_fn cb;
  void *cb_arg;
  /* Its caller answers a request once told (a completion, a single-step
   * reservation, a synchronous caller): told before the batch's other
   * writes, whose callbacks go on to slower work (a provider call). */
  int answers;
  struct job *next;
};

#define MAX_BATCH 256

typedef struct sqlite_store {
  struct idem_store base;
  char *path;
  int busy_timeout_ms;
  pthread_mutex_t pool_lock;
  struct conn *free_conns;
  pthread_mutex_t write_lock; /* one write transaction at a time */

  /* Group commit: callers queue their writes and sleep; one writer thread
   * runs every queued write in one transaction (each in a savepoint) and
   * one fsync, then wakes each of their callers. */
  pthread_mutex_t q_lock;
  pthread_cond_t q_ready; /* the writer waits for work */
  struct job *q_head, *q_tail;
  int stopping;
  int writer_running;
  pthread_t writer;
  atomic_uint_fast64_t commits, writes, batch_reruns;

  /* API keys, remembered (see "Tenant cache" below). */
  int tenants_fd;       /* the change file; -1: no cache */
  int tenants_writable; /* 0: this process only reads it */
  int tenants_exists;   /* the file exists, whether this process can use it */
  pthread_mutex_t tc_lock;
  struct tenant_entry *tc; /* TENANT_CACHE entries */
  uint64_t serial;         /* tells stores apart in per-thread state */
} sqlite_store_t;

static const idem_store_methods_t sqlite_methods;
static atomic_uint_fast64_t store_serials;

/* Maps a SQLite result code to an idem error, keeping the message. */
static int fail(sqlite3 *db, int rc, const char *what) {
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
  sqlite3_close_v2(c->db);
  free(c);
}

static int exec(sqlite3 *db, const char *sql) {
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
    rc = fail(c->db, rc, "open");
    conn_free(c);
    return rc;
  }
  sqlite3_extended_result_codes(c->db, 1);
  sqlite3_busy_timeout(c->db, s->busy_timeout_ms);
  /* WAL lets readers run beside the writer; FULL syncs the WAL on every
   * commit, so an acknowledged write survives power loss. */
  if (use_wal(c->db) != SQLITE_OK ||
      exec(c->db, "PRAGMA synchronous = FULL") != SQLITE_OK ||
      exec(c->db, "PRAGMA foreign_keys = ON") != SQLITE_OK) {
    conn_free(c);
    return IDEM_ESTORE;
  }
  *out = c;
  return IDEM_OK;
}

static int conn_get(sqlite_store_t *s, struct conn **out) {
  pthread_mutex_lock(&s->pool_lock);
  *out = s->free_conns;
  if (*out)
    s->free_conns = (*out)->next;
  pthread_mutex_unlock(&s->pool_lock);
  if (*out)
    return IDEM_OK;
  return conn_new(s, out);
}

static void conn_put(sqlite_store_t *s, struct conn *c) {
  pthread_mutex_lock(&s->pool_lock);
  c->next = s->free_conns;
  s->free_conns = c;
  pthread_mutex_unlock(&s->pool_lock);
}

/* Returns the prepared statement `id` of `c`, reset and unbound. */
static sqlite3_stmt *stmt(struct conn *c, enum stmt_id id) {
  if (c->st[id] == NULL) {
    int rc = sqlite3_prepare_v3(c->db, stmt_sql[id], -1,
                                SQLITE_PREPARE_PERSISTENT, &c->st[id], NULL);
    if (rc != SQLITE_OK) {
      fail(c->db, rc, "prepare");
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
static int run(struct conn *c, sqlite3_stmt *st, const char *what) {
  int rc = sqlite3_step(st);
  sqlite3_reset(st);
  if (rc != SQLITE_DONE && rc != SQLITE_ROW)
    return fail(c->db, rc, what);
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

/* Begins a write transaction: the process's write lock, then SQLite's.
 * BEGIN IMMEDIATE can still meet another process's writer; the busy
 * timeout waits for it and we retry a bounded number of times. */
static int write_begin(sqlite_store_t *s, struct conn *c) {
  int rc = SQLITE_BUSY;
  pthread_mutex_lock(&s->write_lock);
  for (int i = 0; i < BUSY_RETRIES; i++) {
    sqlite3_stmt *st = stmt(c, ST_BEGIN);
    if (st == NULL)
      break;
    rc = sqlite3_step(st);
    sqlite3_reset(st);
    if (rc == SQLITE_DONE)
      return IDEM_OK;
    if ((rc & 0xff) != SQLITE_BUSY && (rc & 0xff) != SQLITE_LOCKED)
      break;
  }
  pthread_mutex_unlock(&s->write_lock);
  return fail(c->db, rc, "begin");
}

static int write_end(sqlite_store_t *s, struct conn *c, int ok) {
  int rc = IDEM_OK;
  if (ok) {
    sqlite3_stmt *st = stmt(c, ST_COMMIT);
    int src = st ? sqlite3_step(st) : SQLITE_ERROR;
    if (st)
      sqlite3_reset(st);
    if (src != SQLITE_DONE) {
      rc = fail(c->db, src, "commit");
      ok = 0;
    }
  }
  if (!ok && sqlite3_get_autocommit(c->db) == 0) {
    sqlite3_stmt *st = stmt(c, ST_ROLLBACK);
    if (st) {
      sqlite3_step(st);
      sqlite3_reset(st);
    }
  }
  pthread_mutex_unlock(&s->write_lock);
  return rc;
}

/* Runs one statement of the savepoint family on the writer's connection. */
static int savepoint(struct conn *c, enum stmt_id id) {
  sqlite3_stmt *st = stmt(c, id);
  return st ? run(c, st, "savepoint") : IDEM_ESTORE;
}

/* Runs the batch's writes one after the other, with nothing to undo one
 * alone. Returns 1 when all succeeded (the transaction stays open for the
 * COMMIT), 0 when one failed (the transaction is rolled back, and the
 * batch must run again write by write). */
static int run_batch_whole(sqlite_store_t *s, struct conn *c, struct job *jobs) {
  for (struct job *j = jobs; j; j = j->next) {
    j->rc = j->fn(c, j->arg);
    /* IDEM_ELOST (a lease lost) is returned with nothing written: it is
     * that write's result, not a failure to undo. */
    if (j->rc != IDEM_OK && j->rc != IDEM_ELOST) {
      (void)write_end(s, c, 0);
      return 0;
    }
  }
  return 1;
}

/* Runs a batch of writes in one transaction, with one COMMIT (one fsync)
 * for all; a failed COMMIT fails every write of the batch. A write that
 * fails is undone alone: each runs in its own savepoint. Savepoints cost
 * every write two statements and a copy of each page it changes again
 * (the statement journal), and a write almost never fails, so a batch of
 * writes that may run twice runs without them first; only if one of its
 * writes fails is the whole transaction rolled back and the batch run
 * again with savepoints. */
static void run_batch(sqlite_store_t *s, struct conn *c, struct job *jobs) {
  int rc = write_begin(s, c);
  int whole = 1;

  for (struct job *j = jobs; j && whole; j = j->next)
    whole = j->rerunnable;
  if (rc == IDEM_OK && whole) {
    if (run_batch_whole(s, c, jobs))
      goto commit;
    atomic_fetch_add(&s->batch_reruns, 1);
    rc = write_begin(s, c);
  }
  if (rc != IDEM_OK) {
    for (struct job *j = jobs; j; j = j->next)
      j->rc = rc;
    return;
  }
  for (struct job *j = jobs; j; j = j->next) {
    /* Some errors (a full disk, I/O, memory) make SQLite roll back the
     * whole transaction. A SAVEPOINT would then start a new one, which
     * its RELEASE would commit: the rest fail unrun instead (and the
     * writes before, undone with it, fail at the COMMIT). */
    if (sqlite3_get_autocommit(c->db)) {
      j->rc = IDEM_ESTORE;
      continue;
    }
    if ((j->rc = savepoint(c, ST_SAVEPOINT)) != IDEM_OK)
      continue;
    j->rc = j->fn(c, j->arg);
    if (j->rc != IDEM_OK && savepoint(c, ST_ROLLBACK_TO) != IDEM_OK)
      j->rc = IDEM_ESTORE;
    if (savepoint(c, ST_RELEASE) != IDEM_OK && j->rc == IDEM_OK)
      j->rc = IDEM_ESTORE;
  }
commit:
  rc = write_end(s, c, 1);
  for (struct job *j = jobs; j; j = j->next)
    if (rc != IDEM_OK && j->rc == IDEM_OK)
      j->rc = rc;
}

/* The writer's connection. Its transactions never spill changed pages
 * into the WAL before their COMMIT (cache_spill off): SQLite 3.40.1
 * (Debian 12's) can lose committed transactions in a crash after a
 * ROLLBACK TO in a transaction whose spilled frames were then rewritten
 * in place (the WAL's checksum chain breaks, and recovery stops there).
 * A batch rolls back to a savepoint whenever one of its writes fails, so
 * it must not spill. A standalone reproduction with SQLite alone kept 1
 * of 101 committed rows after a simulated crash; with cache_spill off,
 * all of them. The cost is memory: a transaction's changed pages stay in
 * memory until its COMMIT, and a batch holds at most MAX_BATCH writes,
 * each bounded by the request size limits (a sweep by its batch size). */
static int writer_conn(sqlite_store_t *s, struct conn **out) {
  int rc = conn_get(s, out);
  if (rc == IDEM_OK && exec((*out)->db, "PRAGMA cache_spill = OFF") != SQLITE_OK) {
    conn_put(s, *out);
    *out = NULL;
    rc = IDEM_ESTORE;
  }
  return rc;
}

/* Tells one write's caller its result. The job may be gone once told. */
static void tell(struct job *j) {
  if (j->cb) {
    idem_store_done_fn cb = j->cb;
    void *cb_arg = j->cb_arg;
    int rc = j->rc;
    free(j);
    cb(cb_arg, rc); /* may queue more writes: q_lock is not held */
  } else {
    sem_post(&j->done);
  }
}

/* Tells a committed batch's callers, those that answer a request first:
 * their answers go out while the writer makes the rest's provider calls
 * (three alternating pairs: 2.7-3.1 % more payments/s, a completion 40 us
 * sooner on average; docs/performance.md). */
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

static void *writer_loop(void *arg) {
  sqlite_store_t *s = arg;
  struct conn *c = NULL;

  pthread_setname_np(pthread_self(), "idem-writer"); /* for top -H, perf */

  pthread_mutex_lock(&s->q_lock);
  for (;;) {
    struct job *batch, *last;
    int n = 1, rc;

    while (s->q_head == NULL && !s->stopping)
      pthread_cond_wait(&s->q_ready, &s->q_lock);
    if (s->q_head == NULL)
      break; /* stopping, and every queued write has run */
    /* Take what is queued now: while this batch syncs, the next forms. */
    batch = last = s->q_head;
    while (last->next && n < MAX_BATCH) {
      last = last->next;
      n++;
    }
    s->q_head = last->next;
    if (s->q_head == NULL)
      s->q_tail = NULL;
    last->next = NULL;
    pthread_mutex_unlock(&s->q_lock);

    if (c == NULL && (rc = writer_conn(s, &c)) != IDEM_OK) {
      for (struct job *j = batch; j; j = j->next)
        j->rc = rc;
    } else {
      run_batch(s, c, batch);
      atomic_fetch_add(&s->commits, 1);
      atomic_fetch_add(&s->writes, (uint_fast64_t)n);
    }

    tell_callers(batch);
    pthread_mutex_lock(&s->q_lock);
  }
  pthread_mutex_unlock(&s->q_lock);
  if (c)
    conn_put(s, c);
  return NULL;
}

/* Runs `fn` in a write transaction and returns once it is durable: IDEM_OK
 * when it returned IDEM_OK and the commit reached the disk; otherwise its
 * error, and nothing it did is kept. Every write of the store goes through
 * here, and through the writer thread, which commits many at a time. */
static void enqueue(sqlite_store_t *s, struct job *j) {
  int idle;

  j->next = NULL;
  pthread_mutex_lock(&s->q_lock);
  idle = s->q_head == NULL; /* else the writer will find it queued */
  if (s->q_tail)
    s->q_tail->next = j;
  else
    s->q_head = j;
  s->q_tail = j;
  pthread_mutex_unlock(&s->q_lock);
  if (idle)
    pthread_cond_signal(&s->q_ready);
}

static int write_job(sqlite_store_t *s, int (*fn)(struct conn *, void *), void *arg,
                     int rerunnable) {
  struct job j = {.fn = fn, .arg = arg, .rc = IDEM_OK, .rerunnable = rerunnable,
                  .answers = 1};

  if (s->writer_running && pthread_equal(pthread_self(), s->writer)) {
    /* A done callback that writes synchronously would wait on itself
     * forever (store.h forbids it): fail loudly instead. */
    idem__store_set_error("synchronous write from the writer thread");
    return IDEM_EINVAL;
  }
  sem_init(&j.done, 0, 0);
  enqueue(s, &j);
  while (sem_wait(&j.done) != 0) /* EINTR only */
    ;
  sem_destroy(&j.done);
  return j.rc;
}

static int write_tx(sqlite_store_t *s, int (*fn)(struct conn *, void *), void *arg) {
  return write_job(s, fn, arg, 0);
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
  sqlite3_stmt *st = stmt(c, ST_READ_RECORD);
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
    rc = fail(c->db, rc, "read record");
  sqlite3_reset(st);
  return rc;
}

/* Writes an outcome into the record of `sc` owned by `owner`: first at
 * `row` when it is known, then through the key if that found nothing (a
 * row the record no longer has). IDEM_OK when the record was changed,
 * IDEM_ELOST when no such record is owned by `owner`, or the error. */
static int complete_record(struct conn *c, const idem_scope_t *sc,
                           const char *owner, const idem_outcome_t *o,
                           int64_t now_ms, int64_t ttl_ms, int64_t row) {
  for (;; row = 0) {
    sqlite3_stmt *st = stmt(c, row ? ST_COMPLETE_ROW : ST_COMPLETE);
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
    if ((rc = run(c, st, "complete")) != IDEM_OK)
      return rc;
    if (sqlite3_changes(c->db) == 1)
      return IDEM_OK;
    if (row == 0)
      return IDEM_ELOST;
  }
}

/* Applies an outcome to a record owned by `owner` (inside a write
 * transaction). IDEM_ELOST, with nothing written, when the owner no
 * longer holds it (its first statement finds that out). `outbox`:
 * the record may have an outbox row to remove (0 when the caller knows it
 * has none: a single-step reservation that enqueued none). `row`: where
 * the record is, if known (idem_complete_t.row). */
static int apply_outcome(struct conn *c, const idem_scope_t *sc,
                         const char *owner, const idem_outcome_t *o,
                         int64_t now_ms, int64_t ttl_ms, int outbox, int64_t row) {
  sqlite3_stmt *st;
  int rc = complete_record(c, sc, owner, o, now_ms, ttl_ms, row);

  if (rc != IDEM_OK)
    return rc;

  if (o->resource_status || o->resource_body || o->provider_ref) {
    st = stmt(c, ST_UPDATE_RESOURCE);
    if (st == NULL)
      return IDEM_ESTORE;
    bind_scope(st, sc);
    bind_text(st, 4, o->resource_status);
    bind_text(st, 5, o->resource_body);
    bind_text(st, 6, o->provider_ref);
    sqlite3_bind_int64(st, 7, now_ms);
    bind_text(st, 8, o->resource_id);
    if ((rc = run(c, st, "update resource")) != IDEM_OK)
      return rc;
  }
  if (outbox && o->state != IDEM_STATE_PENDING) {
    st = stmt(c, ST_DELETE_OUTBOX);
    if (st == NULL)
      return IDEM_ESTORE;
    bind_scope(st, sc);
    bind_text(st, 4, o->resource_id);
    if ((rc = run(c, st, "delete outbox")) != IDEM_OK)
      return rc;
  }
  return IDEM_OK;
}

/* The record a won reservation left, without reading it back: ST_RESERVE
 * writes these values whether it inserted the row or took an old one
 * over (its DO UPDATE sets every column, to the same values). */
static int won_record(const idem_reserve_t *req, const char *owner, int64_t row,
                      idem_record_t *out) {
  const idem_resource_t *res = req->resource;

  /* Copied as row_to_record() copies what it reads. */
  idem_record_reset(out);
  out->tenant_id = req->scope.tenant_id;
  idem_copy(out->operation, sizeof out->operation, req->scope.operation);
  idem_copy(out->key, sizeof out->key, req->scope.key);
  idem_copy(out->fingerprint, sizeof out->fingerprint, req->fingerprint);
  idem_copy(out->resource_id, sizeof out->resource_id, res ? res->id : NULL);
  idem_copy(out->correlation_id, sizeof out->correlation_id, req->correlation_id);
  idem_copy(out->owner_token, sizeof out->owner_token, owner);
  out->state = IDEM_STATE_PROCESSING;
  out->lease_expires_at = req->now_ms + req->lease_ms;
  out->created_at = req->now_ms;
  out->updated_at = req->now_ms;
  out->row = row;
  return IDEM_OK;
}

/* The record a single-step reservation left once apply_outcome() wrote
 * req->outcome over the won one: as ST_COMPLETE sets it. */
static int settled_record(const idem_reserve_t *req, const char *owner, int64_t row,
                          idem_record_t *out) {
  const idem_outcome_t *o = req->outcome;
  int rc = won_record(req, owner, row, out);

  if (rc != IDEM_OK)
    return rc;
  out->state = o->state;
  out->response_status = o->status;
  if (o->body && (out->response_body = strdup(o->body)) == NULL)
    return IDEM_ENOMEM;
  idem_copy(out->location, sizeof out->location, o->location);
  if (o->resource_id)
    idem_copy(out->resource_id, sizeof out->resource_id, o->resource_id);
  idem_copy(out->provider_ref, sizeof out->provider_ref, o->provider_ref);
  out->owner_token[0] = '\0';
  out->lease_expires_at = 0;
  out->expires_at = o->state == IDEM_STATE_PENDING ? 0 : req->now_ms + req->ttl_ms;
  return IDEM_OK;
}

/* The body of a reservation, inside a write transaction. */
static int reserve_tx(struct conn *c, const idem_reserve_t *req,
                      const char *owner, idem_record_t *out,
                      idem_reserve_result_t *result) {
  const idem_resource_t *res = req->resource;
  sqlite3_stmt *st = stmt(c, ST_RESERVE);
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
  bind_text(st, 9, res ? res->id : NULL);
  if ((rc = run(c, st, "reserve")) != IDEM_OK)
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

  if (res) {
    st = stmt(c, ST_INSERT_RESOURCE);
    if (st == NULL)
      return IDEM_ESTORE;
    bind_text(st, 1, res->id);
    sqlite3_bind_int64(st, 2, req->scope.tenant_id);
    bind_text(st, 3, res->kind);
    bind_text(st, 4, res->status);
    bind_text(st, 5, res->body);
    bind_text(st, 6, res->provider_ref);
    sqlite3_bind_int64(st, 7, req->now_ms);
    if ((rc = run(c, st, "insert resource")) != IDEM_OK)
      return rc == IDEM_EEXIST ? IDEM_ESTORE : rc;
    if (req->enqueue_outbox) {
      st = stmt(c, ST_INSERT_OUTBOX);
      if (st == NULL)
        return IDEM_ESTORE;
      bind_text(st, 1, res->id);
      sqlite3_bind_int64(st, 2, req->scope.tenant_id);
      bind_text(st, 3, req->scope.operation);
      bind_text(st, 4, req->scope.key);
      sqlite3_bind_int64(st, 5, req->now_ms);
      if ((rc = run(c, st, "insert outbox")) != IDEM_OK)
        return rc == IDEM_EEXIST ? IDEM_ESTORE : rc;
    }
  }
  if ((rc = idem__effect_run(&req->effect, "sqlite", c->db, req->now_ms)) != IDEM_OK)
    return rc;
  if (req->outcome) {
    rc = apply_outcome(c, &req->scope, owner, req->outcome, req->now_ms,
                       req->ttl_ms, req->enqueue_outbox, row);
    if (rc != IDEM_OK)
      return rc == IDEM_ELOST ? IDEM_ESTORE : rc;
    return settled_record(req, owner, row, out);
  }
  return won_record(req, owner, row, out);
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
  rc = write_job((sqlite_store_t *)base, reserve_fn, &a, 1);
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
  enqueue((sqlite_store_t *)base, &ar->job);
  return IDEM_OK;
}

static int complete_fn(struct conn *c, void *arg) {
  const idem_complete_t *cp = arg;
  int rc = apply_outcome(c, &cp->scope, cp->owner_token, &cp->outcome, cp->now_ms,
                         cp->ttl_ms, 1, cp->row);
  if (rc != IDEM_OK)
    return rc;
  return idem__effect_run(&cp->effect, "sqlite", c->db, cp->now_ms);
}

static int sq_complete(idem_store_t *base, const idem_complete_t *cp) {
  return write_job((sqlite_store_t *)base, complete_fn, (void *)cp, 1);
}

static int sq_complete_async(idem_store_t *base, const idem_complete_t *cp,
                             idem_store_done_fn done, void *arg) {
  struct job *j = calloc(1, sizeof *j);

  if (j == NULL)
    return IDEM_ENOMEM;
  *j = (struct job){.fn = complete_fn, .arg = (void *)cp, .rerunnable = 1, .cb = done,
                    .cb_arg = arg, .answers = 1};
  enqueue((sqlite_store_t *)base, j);
  return IDEM_OK;
}

/* A caller's own write, in a transaction of the group commit; it may run
 * again after a rollback, as the caller was told (store.h). */
static int caller_write_fn(struct conn *c, void *arg) {
  return idem__effect_run(arg, "sqlite", c->db, idem_now_ms());
}

static int sq_write(idem_store_t *base, const idem_effect_t *e) {
  return write_job((sqlite_store_t *)base, caller_write_fn, (void *)e, 1);
}

static int sq_read(idem_store_t *base, const idem_effect_t *e) {
  sqlite_store_t *s = (sqlite_store_t *)base;
  struct conn *c;
  int rc = conn_get(s, &c);

  if (rc != IDEM_OK)
    return rc;
  rc = idem__effect_run(e, "sqlite", c->db, idem_now_ms());
  if (sqlite3_get_autocommit(c->db) == 0) /* left open: not ours to keep */
    (void)exec(c->db, "ROLLBACK");
  conn_put(s, c);
  return rc;
}

static int sq_lookup(idem_store_t *base, const idem_scope_t *sc, int64_t now_ms,
                     idem_record_t *out) {
  sqlite_store_t *s = (sqlite_store_t *)base;
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

static int sq_resource_get(idem_store_t *base, int64_t tenant_id,
                           const char *kind, const char *id, char **body) {
  sqlite_store_t *s = (sqlite_store_t *)base;
  struct conn *c;
  sqlite3_stmt *st;
  int rc;

  if ((rc = conn_get(s, &c)) != IDEM_OK)
    return rc;
  if ((st = stmt(c, ST_RESOURCE_GET)) == NULL) {
    conn_put(s, c);
    return IDEM_ESTORE;
  }
  bind_text(st, 1, id);
  sqlite3_bind_int64(st, 2, tenant_id);
  bind_text(st, 3, kind);
  rc = sqlite3_step(st);
  if (rc == SQLITE_ROW) {
    *body = strdup(col_text(st, 0));
    rc = *body ? IDEM_OK : IDEM_ENOMEM;
  } else if (rc == SQLITE_DONE) {
    rc = IDEM_ENOTFOUND;
  } else {
    rc = fail(c->db, rc, "resource get");
  }
  sqlite3_reset(st);
  conn_put(s, c);
  return rc;
}

/* ---- Tenant cache -------------------------------------------------------
 *
 * Every request checks its API key, and reading the key's tenant was a
 * quarter of a replay's CPU (a read transaction: file locks, a statement).
 * Tenants found are remembered, and forgotten as soon as any tenant
 * changes, in any process: every change made through this store (idemd
 * tenant create, rotate-key, disable, enable) appends one byte to a file
 * beside the database (`<db>-tenants`, opened O_APPEND by every process
 * that uses the database), and an entry counts only while that file's
 * size is what it was before the entry was read. The byte is written
 * after the change commits, so by the time the command returns, no process
 * answers with the old key. Each thread reads the file's size at most once
 * every TENANT_RECHECK_US (an fstat() per lookup was 4 % of a replay's
 * CPU), and a change's command returns only after waiting that long past
 * its byte: whatever a thread remembers of the size was read before, so
 * by then every lookup reads it again. An entry also lasts at most
 * TENANT_TTL_MS, which bounds staleness after a change made another way (SQL on the file by hand, a
 * replaced file) or a command killed between its commit and its byte.
 * Without the file (say, a read-only directory), every key is read from
 * the database as before. */
#define TENANT_CACHE 64 /* entries, direct-mapped by key lookup */
#define TENANT_TTL_MS 1000
#define TENANT_RECHECK_US 2000

struct tenant_entry {
  idem_tenant_t t;
  int64_t changed;  /* the file's size when `t` was read */
  int64_t until_ms; /* idem_mono_ms() */
  int used;
};

/* The change count: the file's size; -1 when it cannot be read. */
static int64_t tenants_changed(const sqlite_store_t *s) {
  struct stat st;
  return fstat(s->tenants_fd, &st) == 0 ? (int64_t)st.st_size : -1;
}

/* The change count as this thread last read it, read again when that was
 * TENANT_RECHECK_US ago or more (or for another store). The time is taken
 * before the read, so a size is never trusted longer than that after it
 * was read. */
static int64_t tenants_changed_lately(const sqlite_store_t *s) {
  static __thread uint64_t store;  /* the serial of the store last read */
  static __thread int64_t read_us; /* idem_mono_us() before that read */
  static __thread int64_t count;
  int64_t now = idem_mono_us();

  if (store != s->serial || count < 0 || now - read_us >= TENANT_RECHECK_US) {
    count = tenants_changed(s);
    read_us = now;
    store = s->serial;
  }
  return count;
}

/* Sleeps `us` microseconds, through signals. */
static void sleep_us(long long us) {
  struct timespec left = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000L};
  while (nanosleep(&left, &left) != 0 && errno == EINTR)
    ;
}

/* After a change to a tenant (committed, or maybe: an extra count only
 * empties the caches). When this process cannot count it in the file the
 * servers read (not writable by this user, or not there), it waits until
 * every entry remembered before the change has expired, so the change
 * still holds for everyone once the command returns. */
static void tenants_bump(sqlite_store_t *s) {
  if (s->tenants_fd >= 0 && s->tenants_writable && write(s->tenants_fd, "+", 1) == 1) {
    /* Until every thread that read the size before this byte reads it
     * again (tenants_changed_lately). */
    sleep_us(TENANT_RECHECK_US + 1000);
    return;
  }
  if (!s->tenants_exists)
    return; /* no file, so no server remembers keys */
  fprintf(stderr, "idem: cannot count a tenant change in %s-tenants; waiting %d ms "
                  "for servers to forget the old key\n", s->path, TENANT_TTL_MS + 100);
  sleep_us((TENANT_TTL_MS + 100) * 1000LL);
}

/* Opens the change file of the database `db` (named as SQLite resolved it,
 * symbolic links and all, as its -wal and -shm are), creating it with the
 * database's mode and owner as SQLite does for those. Read-only when this
 * user may not write it (its changes then wait instead); no cache at all
 * when it cannot be opened. */
static void tenants_open(sqlite_store_t *s, sqlite3 *db) {
  const char *name = sqlite3_db_filename(db, "main");
  char path[4096];
  struct stat st;
  int fd;

  if (name == NULL || name[0] == '\0' || stat(name, &st) != 0 ||
      snprintf(path, sizeof path, "%s-tenants", name) >= (int)sizeof path)
    return;
  if ((s->tc = calloc(TENANT_CACHE, sizeof *s->tc)) == NULL) {
    s->tenants_exists = access(path, F_OK) == 0;
    return;
  }
  fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
            st.st_mode & 0777);
  if (fd >= 0) {
    (void)fchmod(fd, st.st_mode & 0777); /* not narrowed by the umask */
    if (geteuid() == 0)
      (void)fchown(fd, st.st_uid, st.st_gid);
    s->tenants_writable = 1;
  } else if (errno == EEXIST) {
    fd = open(path, O_WRONLY | O_APPEND | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0)
      s->tenants_writable = 1;
    else if (errno == EACCES)
      fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  }
  if (fd >= 0 && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))) {
    close(fd);
    fd = -1;
    s->tenants_writable = 0;
  }
  s->tenants_fd = fd;
  s->tenants_exists = fd >= 0 || access(path, F_OK) == 0;
}

static struct tenant_entry *tenant_slot(sqlite_store_t *s, const char *lookup) {
  uint32_t h = 2166136261u;
  for (const unsigned char *p = (const unsigned char *)lookup; *p; p++)
    h = (h ^ *p) * 16777619u;
  return &s->tc[h % TENANT_CACHE];
}

static int tenant_create_fn(struct conn *c, void *arg) {
  idem_tenant_t *t = arg;
  sqlite3_stmt *st = stmt(c, ST_TENANT_CREATE);
  int rc;

  if (st == NULL)
    return IDEM_ESTORE;
  bind_text(st, 1, t->name);
  bind_text(st, 2, t->key_lookup);
  sqlite3_bind_blob(st, 3, t->key_hash, sizeof t->key_hash, SQLITE_STATIC);
  sqlite3_bind_int64(st, 4, t->created_at);
  if ((rc = run(c, st, "tenant create")) == IDEM_OK)
    t->id = sqlite3_last_insert_rowid(c->db);
  return rc;
}

static int sq_tenant_create(idem_store_t *base, idem_tenant_t *t) {
  int rc = write_tx((sqlite_store_t *)base, tenant_create_fn, t);
  if (rc != IDEM_EEXIST) /* it may have committed: count it */
    tenants_bump((sqlite_store_t *)base);
  return rc;
}

/* Copies the current row of a statement selecting TENANT_COLUMNS. */
static void row_to_tenant(sqlite3_stmt *st, idem_tenant_t *out) {
  memset(out, 0, sizeof *out);
  out->id = sqlite3_column_int64(st, 0);
  idem_copy(out->name, sizeof out->name, col_text(st, 1));
  idem_copy(out->key_lookup, sizeof out->key_lookup, col_text(st, 2));
  if (sqlite3_column_bytes(st, 3) == (int)sizeof out->key_hash)
    memcpy(out->key_hash, sqlite3_column_blob(st, 3), sizeof out->key_hash);
  out->disabled = sqlite3_column_int(st, 4);
  out->created_at = sqlite3_column_int64(st, 5);
}

/* Runs a one-parameter tenant query expected to return one row. */
static int tenant_query(sqlite_store_t *s, enum stmt_id id, const char *arg,
                        idem_tenant_t *out) {
  struct conn *c;
  sqlite3_stmt *st;
  int rc;

  memset(out, 0, sizeof *out);
  if ((rc = conn_get(s, &c)) != IDEM_OK)
    return rc;
  if ((st = stmt(c, id)) == NULL) {
    conn_put(s, c);
    return IDEM_ESTORE;
  }
  bind_text(st, 1, arg);
  rc = sqlite3_step(st);
  if (rc == SQLITE_ROW) {
    row_to_tenant(st, out);
    rc = IDEM_OK;
  } else if (rc == SQLITE_DONE) {
    rc = IDEM_ENOTFOUND;
  } else {
    rc = fail(c->db, rc, "tenant query");
  }
  sqlite3_reset(st);
  conn_put(s, c);
  return rc;
}

static int sq_tenant_find(idem_store_t *base, const char *lookup,
                          idem_tenant_t *out) {
  sqlite_store_t *s = (sqlite_store_t *)base;
  struct tenant_entry *e;
  int64_t changed, now;
  int rc;

  if (s->tenants_fd < 0 || (changed = tenants_changed_lately(s)) < 0)
    return tenant_query(s, ST_TENANT_FIND, lookup, out);
  /* `changed` is read before the tenant: a change after it makes the
   * entry stale at once. */
  now = idem_mono_ms();
  e = tenant_slot(s, lookup);
  pthread_mutex_lock(&s->tc_lock);
  if (e->used && e->changed == changed && e->until_ms > now &&
      strcmp(e->t.key_lookup, lookup) == 0) {
    *out = e->t;
    pthread_mutex_unlock(&s->tc_lock);
    return IDEM_OK;
  }
  pthread_mutex_unlock(&s->tc_lock);
  rc = tenant_query(s, ST_TENANT_FIND, lookup, out);
  if (rc == IDEM_OK) { /* unknown keys are not remembered */
    pthread_mutex_lock(&s->tc_lock);
    *e = (struct tenant_entry){*out, changed, now + TENANT_TTL_MS, 1};
    pthread_mutex_unlock(&s->tc_lock);
  }
  return rc;
}

static int sq_tenant_by_name(idem_store_t *base, const char *name,
                             idem_tenant_t *out) {
  return tenant_query((sqlite_store_t *)base, ST_TENANT_BY_NAME, name, out);
}

static int tenant_update_fn(struct conn *c, void *arg) {
  const idem_tenant_t *t = arg;
  sqlite3_stmt *st = stmt(c, ST_TENANT_UPDATE);
  int rc;

  if (st == NULL)
    return IDEM_ESTORE;
  bind_text(st, 1, t->name);
  bind_text(st, 2, t->key_lookup);
  sqlite3_bind_blob(st, 3, t->key_hash, sizeof t->key_hash, SQLITE_STATIC);
  sqlite3_bind_int(st, 4, t->disabled);
  rc = run(c, st, "tenant update");
  if (rc == IDEM_OK && sqlite3_changes(c->db) == 0)
    rc = IDEM_ENOTFOUND;
  return rc;
}

static int sq_tenant_update(idem_store_t *base, const idem_tenant_t *t) {
  int rc = write_tx((sqlite_store_t *)base, tenant_update_fn, (void *)t);
  if (rc != IDEM_ENOTFOUND) /* it may have committed: count it */
    tenants_bump((sqlite_store_t *)base);
  return rc;
}

static int sq_tenant_list(idem_store_t *base, idem_tenant_t *out, int max, int *n) {
  sqlite_store_t *s = (sqlite_store_t *)base;
  struct conn *c;
  sqlite3_stmt *st;
  int rc, found = 0;

  if ((rc = conn_get(s, &c)) != IDEM_OK)
    return rc;
  if ((st = stmt(c, ST_TENANT_LIST)) == NULL) {
    conn_put(s, c);
    return IDEM_ESTORE;
  }
  sqlite3_bind_int(st, 1, max);
  while (found < max && (rc = sqlite3_step(st)) == SQLITE_ROW)
    row_to_tenant(st, &out[found++]);
  rc = rc == SQLITE_ROW || rc == SQLITE_DONE ? IDEM_OK : fail(c->db, rc, "tenant list");
  sqlite3_reset(st);
  conn_put(s, c);
  *n = found;
  return rc;
}

static int sq_records_list(idem_store_t *base, const idem_records_query_t *q,
                           idem_record_t *out, int *n) {
  sqlite_store_t *s = (sqlite_store_t *)base;
  struct conn *c;
  sqlite3_stmt *st;
  int rc, found = 0;

  if ((rc = conn_get(s, &c)) != IDEM_OK)
    return rc;
  if ((st = stmt(c, ST_RECORDS_LIST)) == NULL) {
    conn_put(s, c);
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
  rc = rc == SQLITE_ROW || rc == SQLITE_DONE ? IDEM_OK : fail(c->db, rc, "records list");
  sqlite3_reset(st);
  conn_put(s, c);
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
  sqlite3_stmt *st = stmt(c, ST_META_PUT);
  int rc;

  if (st == NULL)
    return IDEM_ESTORE;
  bind_text(st, 1, a->name);
  bind_text(st, 2, a->value);
  if ((rc = run(c, st, "meta put")) != IDEM_OK)
    return rc;
  if ((st = stmt(c, ST_META_GET)) == NULL)
    return IDEM_ESTORE;
  bind_text(st, 1, a->name);
  rc = sqlite3_step(st);
  if (rc == SQLITE_ROW) {
    *a->out = strdup(col_text(st, 0));
    rc = *a->out ? IDEM_OK : IDEM_ENOMEM;
  } else {
    rc = fail(c->db, rc, "meta get");
  }
  sqlite3_reset(st);
  return rc;
}

static int sq_meta_get_or_put(idem_store_t *base, const char *name,
                              const char *value, char **out) {
  struct meta_args a = {name, value, out};
  int rc = write_tx((sqlite_store_t *)base, meta_fn, &a);
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
  sqlite3_stmt *st = stmt(c, ST_SWEEP);
  int rc;

  if (st == NULL)
    return IDEM_ESTORE;
  sqlite3_bind_int64(st, 1, a->now_ms);
  sqlite3_bind_int(st, 2, a->batch);
  if ((rc = run(c, st, "sweep")) == IDEM_OK)
    *a->deleted = sqlite3_changes(c->db);
  return rc;
}

static int sq_sweep(idem_store_t *base, int64_t now_ms, int batch, int *deleted) {
  struct sweep_args a = {now_ms, batch, deleted};
  return write_tx((sqlite_store_t *)base, sweep_fn, &a);
}

static int sq_count(idem_store_t *base, const char *what, int64_t tenant_id,
                    int64_t *n) {
  static const struct {
    const char *what, *sql;
  } queries[] = {
      {"records", "SELECT count(*) FROM idempotency_records WHERE (?1 = 0 OR tenant_id = ?1)"},
      {"processing", "SELECT count(*) FROM idempotency_records WHERE state = 'processing' AND (?1 = 0 OR tenant_id = ?1)"},
      {"pending", "SELECT count(*) FROM idempotency_records WHERE state = 'pending' AND (?1 = 0 OR tenant_id = ?1)"},
      {"outbox", "SELECT count(*) FROM outbox WHERE (?1 = 0 OR tenant_id = ?1)"},
      {"payments", "SELECT count(*) FROM resources WHERE kind = 'payment' AND (?1 = 0 OR tenant_id = ?1)"},
      {"orders", "SELECT count(*) FROM resources WHERE kind = 'order' AND (?1 = 0 OR tenant_id = ?1)"},
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
  if ((rc = conn_get(s, &c)) != IDEM_OK)
    return rc;
  rc = sqlite3_prepare_v2(c->db, sql, -1, &st, NULL);
  if (rc == SQLITE_OK) {
    sqlite3_bind_int64(st, 1, tenant_id);
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW) {
      *n = sqlite3_column_int64(st, 0);
      rc = IDEM_OK;
    } else {
      rc = fail(c->db, rc, "count");
    }
  } else {
    rc = fail(c->db, rc, "count");
  }
  sqlite3_finalize(st);
  conn_put(s, c);
  return rc;
}

static int sq_ping(idem_store_t *base) {
  sqlite_store_t *s = (sqlite_store_t *)base;
  struct conn *c;
  sqlite3_stmt *st;
  int rc;

  if ((rc = conn_get(s, &c)) != IDEM_OK)
    return rc;
  if ((st = stmt(c, ST_PING)) == NULL) {
    conn_put(s, c);
    return IDEM_ESTORE;
  }
  rc = sqlite3_step(st);
  rc = rc == SQLITE_ROW ? IDEM_OK : fail(c->db, rc, "ping");
  sqlite3_reset(st);
  conn_put(s, c);
  return rc;
}

/* Versions 3 and 4 copy tables into new ones (3: idempotency_records,
 * resources and outbox; 4: idempotency_records): an index or trigger of
 * an operator's on them would silently go, and a view or trigger of theirs
 * that names them would make the renames fail. Such objects stop the
 * migration to `version` here, by name, before anything changes (IDEM_OK
 * at once for a version that copies nothing). */
static int check_foreign_objects(sqlite3 *db, int version) {
  static const struct {
    int version;
    const char *tables; /* for the message */
    const char *sql;
  } checks[] = {
      {3, "the tables idempotency_records, resources and outbox",
       "SELECT group_concat(type || ' ' || name, ', ') FROM sqlite_schema "
       "WHERE type IN ('view', 'trigger', 'index') "
       "AND name NOT LIKE 'sqlite_autoindex_%' AND name NOT IN (" OWN_OBJECTS ") "
       "AND (type <> 'index' OR tbl_name IN ('idempotency_records', "
       "'resources', 'outbox'))"},
      /* Any view, and a trigger on any table, that names the records:
       * the rename checks them all. */
      {4, "the table idempotency_records",
       "SELECT group_concat(type || ' ' || name, ', ') FROM sqlite_schema "
       "WHERE type IN ('view', 'trigger', 'index') "
       "AND name NOT LIKE 'sqlite_autoindex_%' AND name NOT IN (" OWN_OBJECTS ") "
       "AND (tbl_name = 'idempotency_records' OR (type <> 'index' "
       "AND sql LIKE '%idempotency_records%'))"},
  };
  sqlite3_stmt *st = NULL;
  int rc = IDEM_OK;
  size_t i = 0;

  while (i < sizeof checks / sizeof *checks && checks[i].version != version)
    i++;
  if (i == sizeof checks / sizeof *checks)
    return IDEM_OK;
  if (sqlite3_prepare_v2(db, checks[i].sql, -1, &st, NULL) != SQLITE_OK ||
      sqlite3_step(st) != SQLITE_ROW) {
    rc = fail(db, sqlite3_errcode(db), "read schema");
  } else if (sqlite3_column_type(st, 0) != SQLITE_NULL) {
    idem__store_set_error(
        "schema version %d rebuilds %s; drop these objects first and make "
        "them again after the migration: %s",
        version, checks[i].tables, (const char *)sqlite3_column_text(st, 0));
    rc = IDEM_ESCHEMA;
  }
  sqlite3_finalize(st);
  return rc;
}

static int migrate_to(sqlite_store_t *s, int target) {
  struct conn *c;
  sqlite3_stmt *st = NULL;
  int rc, version = 0;

  if ((rc = conn_get(s, &c)) != IDEM_OK)
    return rc;
  if ((rc = write_begin(s, c)) != IDEM_OK) {
    conn_put(s, c);
    return rc;
  }
  if (sqlite3_prepare_v2(c->db, "PRAGMA user_version", -1, &st, NULL) == SQLITE_OK &&
      sqlite3_step(st) == SQLITE_ROW)
    version = sqlite3_column_int(st, 0);
  else
    rc = fail(c->db, sqlite3_errcode(c->db), "read schema version");
  sqlite3_finalize(st);

  if (rc == IDEM_OK && version > SCHEMA_VERSION) {
    idem__store_set_error("schema version %d is newer than this program's %d",
                          version, SCHEMA_VERSION);
    rc = IDEM_ESCHEMA;
  }
  for (int v = version; rc == IDEM_OK && v < target; v++) {
    char pragma[64];
    snprintf(pragma, sizeof pragma, "PRAGMA user_version = %d", v + 1);
    if ((rc = check_foreign_objects(c->db, v + 1)) != IDEM_OK)
      break;
    if (exec(c->db, migrations[v]) != SQLITE_OK || exec(c->db, pragma) != SQLITE_OK)
      rc = IDEM_ESTORE;
  }
  int end = write_end(s, c, rc == IDEM_OK);
  if (rc == IDEM_OK)
    rc = end;
  /* Statements prepared before the schema existed are stale: drop them. */
  for (int i = 0; i < ST_COUNT_; i++) {
    sqlite3_finalize(c->st[i]);
    c->st[i] = NULL;
  }
  conn_put(s, c);
  return rc;
}

static int sq_migrate(idem_store_t *base) {
  return migrate_to((sqlite_store_t *)base, SCHEMA_VERSION);
}

int idem__sqlite_migrate_to(idem_store_t *store, int version) {
  if (version < 0 || version > SCHEMA_VERSION)
    return IDEM_EINVAL;
  return migrate_to((sqlite_store_t *)store, version);
}

static void sq_close(idem_store_t *base) {
  sqlite_store_t *s = (sqlite_store_t *)base;
  struct conn *c;

  if (s->writer_running) {
    pthread_mutex_lock(&s->q_lock);
    s->stopping = 1;
    pthread_cond_signal(&s->q_ready);
    pthread_mutex_unlock(&s->q_lock);
    pthread_join(s->writer, NULL);
  }
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
  pthread_mutex_destroy(&s->tc_lock);
  if (s->tenants_fd >= 0)
    close(s->tenants_fd);
  free(s->tc);
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
  s->serial = atomic_fetch_add(&store_serials, 1) + 1;
  s->tenants_fd = -1; /* until tenants_open() */
  s->busy_timeout_ms = opts->busy_timeout_ms > 0 ? opts->busy_timeout_ms : 5000;
  pthread_mutex_init(&s->pool_lock, NULL);
  pthread_mutex_init(&s->write_lock, NULL);
  pthread_mutex_init(&s->q_lock, NULL);
  pthread_cond_init(&s->q_ready, NULL);
  pthread_mutex_init(&s->tc_lock, NULL);
  /* Open one connection now so a bad path fails here, not on a request. */
  if ((rc = conn_new(s, &c)) != IDEM_OK) {
    sq_close(&s->base);
    return rc;
  }
  tenants_open(s, c->db);
  conn_put(s, c);
  if (pthread_create(&s->writer, NULL, writer_loop, s) != 0) {
    sq_close(&s->base);
    return IDEM_ENOMEM;
  }
  s->writer_running = 1;
  *out = &s->base;
  return IDEM_OK;
}

struct claim_args {
  int64_t now_ms, lease_ms;
  int max;
  idem_record_t *out;
  int found;
};

static int claim_fn(struct conn *c, void *arg) {
  struct claim_args *a = arg;
  sqlite3_stmt *st = stmt(c, ST_CLAIM_SELECT);
  int rc;

  /* Inside the write transaction nobody else can change these rows, so
   * selecting and then updating them is one atomic step. */
  if (st == NULL)
    return IDEM_ESTORE;
  sqlite3_bind_int64(st, 1, a->now_ms);
  sqlite3_bind_int(st, 2, a->max);
  while (a->found < a->max && (rc = sqlite3_step(st)) == SQLITE_ROW) {
    idem_record_t *r = &a->out[a->found++];
    r->tenant_id = sqlite3_column_int64(st, 0);
    idem_copy(r->operation, sizeof r->operation, col_text(st, 1));
    idem_copy(r->key, sizeof r->key, col_text(st, 2));
  }
  rc = rc == SQLITE_ROW || rc == SQLITE_DONE ? IDEM_OK : fail(c->db, rc, "claim");
  sqlite3_reset(st);
  for (int i = 0; rc == IDEM_OK && i < a->found; i++) {
    char op[IDEM_OPERATION_MAX + 1], key[IDEM_KEY_MAX + 1];
    char token[IDEM_TOKEN_MAX + 1];
    idem_scope_t sc = {a->out[i].tenant_id, op, key};

    memcpy(op, a->out[i].operation, sizeof op);
    memcpy(key, a->out[i].key, sizeof key);
    if (idem_random_token(token, IDEM_TOKEN_MAX) != IDEM_OK)
      return IDEM_ECRYPTO;
    if ((st = stmt(c, ST_CLAIM_UPDATE)) == NULL)
      return IDEM_ESTORE;
    bind_scope(st, &sc);
    bind_text(st, 4, token);
    sqlite3_bind_int64(st, 5, a->now_ms + a->lease_ms);
    sqlite3_bind_int64(st, 6, a->now_ms);
    if ((rc = run(c, st, "claim update")) == IDEM_OK)
      rc = read_record(c, &sc, &a->out[i]);
    if (rc == IDEM_OK && a->out[i].resource_id[0] != '\0') {
      if ((st = stmt(c, ST_CLAIM_OUTBOX)) == NULL)
        return IDEM_ESTORE;
      bind_text(st, 1, a->out[i].resource_id);
      sqlite3_bind_int64(st, 2, a->out[i].tenant_id);
      sqlite3_bind_int64(st, 3, a->now_ms);
      rc = run(c, st, "claim outbox");
    }
  }
  return rc;
}

static int sq_claim(idem_store_t *base, int64_t now_ms, int64_t lease_ms,
                    int max, idem_record_t *out, int *n) {
  struct claim_args a = {now_ms, lease_ms, max, out, 0};
  int rc = write_tx((sqlite_store_t *)base, claim_fn, &a);
  if (rc == IDEM_OK) {
    *n = a.found;
  } else {
    for (int i = 0; i < a.found; i++)
      idem_record_reset(&out[i]);
  }
  return rc;
}

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
    .migrate = sq_migrate,
    .ping = sq_ping,
    .reserve = sq_reserve,
    .complete = sq_complete,
    .lookup = sq_lookup,
    .resource_get = sq_resource_get,
    .tenant_create = sq_tenant_create,
    .tenant_find = sq_tenant_find,
    .meta_get_or_put = sq_meta_get_or_put,
    .sweep = sq_sweep,
    .count = sq_count,
    .claim = sq_claim,
    .tenant_by_name = sq_tenant_by_name,
    .tenant_update = sq_tenant_update,
    .tenant_list = sq_tenant_list,
    .records_list = sq_records_list,
    .stats = sq_stats,
    .write = sq_write,
    .read = sq_read,
};
