/* The charges and refunds of idem-psp in their own SQLite file: WAL and
 * synchronous=FULL, so an answered charge or refund survives kill -9, and
 * UNIQUE(key) with INSERT ... ON CONFLICT DO NOTHING, so one key makes one
 * charge even under concurrent requests. A refund is decided and inserted
 * in one write transaction (BEGIN IMMEDIATE), so refunds racing under
 * different keys for the last of a charge never refund more than it.
 *
 * The request counters of GET /stats (all POST /charges and /refunds, and
 * per key) live in the same file, so they survive restarts too.
 *
 * One connection, serialised by a mutex held only for a statement or a
 * short transaction (never while a fault sleeps): SQLite admits one writer
 * at a time anyway, and a simulator needs no more. */
#include <pthread.h>
#include <sqlite3.h>
#include <stdlib.h>
#include <string.h>

#include "psp.h"

enum stmt_id {
  ST_BEGIN,
  ST_COMMIT,
  ST_ROLLBACK,
  ST_COUNT_ALL,
  ST_COUNT_KEY,
  ST_COUNT_REFUND_KEY,
  ST_INSERT,
  ST_GET,
  ST_INSERT_REFUND,
  ST_GET_REFUND,
  ST_REFUNDED,
  ST_TOTALS,
  ST_KEYS,
  ST_REFUND_KEYS,
  ST_LIST,
  ST_LIST_REFUNDS,
  ST_GET_BY_REFERENCE,
  ST_REFERENCES,
  ST_REFUND_REFERENCES,
  ST_COUNT_
};

static const char *const stmt_sql[ST_COUNT_] = {
    [ST_BEGIN] = "BEGIN IMMEDIATE",
    [ST_COMMIT] = "COMMIT",
    [ST_ROLLBACK] = "ROLLBACK",
    [ST_COUNT_ALL] = "INSERT INTO counters (name, value) VALUES (?1, 1) "
                     "ON CONFLICT (name) DO UPDATE SET value = value + 1",
    [ST_COUNT_KEY] = "INSERT INTO key_requests (key, requests) VALUES (?1, 1) "
                     "ON CONFLICT (key) DO UPDATE SET requests = requests + 1",
    [ST_COUNT_REFUND_KEY] = "INSERT INTO refund_key_requests (key, requests) "
                            "VALUES (?1, 1) "
                            "ON CONFLICT (key) DO UPDATE SET requests = requests + 1",
    [ST_INSERT] = "INSERT INTO charges "
                  "(key, id, amount, currency, status, created_at, reference) "
                  "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) ON CONFLICT (key) DO NOTHING",
    [ST_GET] = "SELECT id, key, amount, currency, status, created_at, '', reference "
               "FROM charges WHERE key = ?1",
    [ST_INSERT_REFUND] = "INSERT INTO refunds "
                         "(key, id, charge, amount, currency, status, created_at, "
                         "reference) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    [ST_GET_REFUND] = "SELECT id, key, amount, currency, status, created_at, charge, "
                      "reference FROM refunds WHERE key = ?1",
    [ST_LIST] = "SELECT id, key, amount, currency, status, created_at, '', reference "
                "FROM charges WHERE reference = ?1 ORDER BY rowid LIMIT ?2",
    [ST_LIST_REFUNDS] = "SELECT id, key, amount, currency, status, created_at, charge, "
                        "reference FROM refunds WHERE reference = ?1 "
                        "ORDER BY rowid LIMIT ?2",
    [ST_REFERENCES] = "SELECT reference, count(*), sum(status = 'succeeded') "
                      "FROM charges WHERE reference IS NOT NULL GROUP BY reference "
                      "ORDER BY reference",
    [ST_REFUND_REFERENCES] = "SELECT reference, count(*), sum(status = 'succeeded') "
                             "FROM refunds WHERE reference IS NOT NULL "
                             "GROUP BY reference ORDER BY reference",
    /* A charge named by its reference, as a refund may name it. */
    [ST_GET_BY_REFERENCE] = "SELECT id, key, amount, currency, status, created_at, '', "
                            "reference FROM charges WHERE reference = ?1 "
                            "ORDER BY status <> 'succeeded', rowid LIMIT 1",
    [ST_REFUNDED] = "SELECT coalesce(sum(amount), 0) FROM refunds "
                    "WHERE charge = ?1 AND status = 'succeeded'",
    [ST_TOTALS] = "SELECT (SELECT count(*) FROM charges WHERE status = 'succeeded'), "
                  "(SELECT count(*) FROM charges WHERE status = 'declined'), "
                  "(SELECT coalesce(sum(value), 0) FROM counters "
                  "WHERE name = 'requests'), "
                  "(SELECT count(*) FROM refunds WHERE status = 'succeeded'), "
                  "(SELECT count(*) FROM refunds WHERE status = 'declined'), "
                  "(SELECT coalesce(sum(value), 0) FROM counters "
                  "WHERE name = 'refund_requests')",
    [ST_KEYS] = "SELECT k.key, k.requests, coalesce(c.status, '') FROM key_requests k "
                "LEFT JOIN charges c ON c.key = k.key ORDER BY k.key",
    [ST_REFUND_KEYS] = "SELECT k.key, k.requests, coalesce(r.status, '') "
                       "FROM refund_key_requests k "
                       "LEFT JOIN refunds r ON r.key = k.key ORDER BY k.key",
};

static const char schema[] =
    "CREATE TABLE IF NOT EXISTS charges ("
    " key TEXT NOT NULL UNIQUE,"
    " id TEXT NOT NULL UNIQUE,"
    " amount INTEGER NOT NULL,"
    " currency TEXT NOT NULL,"
    " status TEXT NOT NULL CHECK (status IN ('succeeded', 'declined')),"
    " created_at TEXT NOT NULL,"
    " reference TEXT);"
    "CREATE TABLE IF NOT EXISTS key_requests ("
    " key TEXT PRIMARY KEY, requests INTEGER NOT NULL) WITHOUT ROWID;"
    "CREATE TABLE IF NOT EXISTS refunds ("
    " key TEXT NOT NULL UNIQUE,"
    " id TEXT NOT NULL UNIQUE,"
    " charge TEXT NOT NULL," /* the key of the charge refunded, which may not exist */
    " amount INTEGER NOT NULL,"
    " currency TEXT NOT NULL,"
    " status TEXT NOT NULL CHECK (status IN ('succeeded', 'declined')),"
    " created_at TEXT NOT NULL,"
    " reference TEXT);"
    "CREATE INDEX IF NOT EXISTS refunds_charge ON refunds (charge, status);"
    "CREATE TABLE IF NOT EXISTS refund_key_requests ("
    " key TEXT PRIMARY KEY, requests INTEGER NOT NULL) WITHOUT ROWID;"
    "CREATE TABLE IF NOT EXISTS counters ("
    " name TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;";

/* The merchant's reference of a charge or refund (NULL when none was
 * sent): a column that a database of an earlier idem-psp gains on open. */
static const char *const reference_tables[] = {"charges", "refunds"};
static const char reference_indexes[] =
    "CREATE INDEX IF NOT EXISTS charges_reference ON charges (reference);"
    "CREATE INDEX IF NOT EXISTS refunds_reference ON refunds (reference);";

/* Adds the reference column where it is missing; 0 or -1. */
static int add_reference_columns(sqlite3 *db) {
  char sql[96];
  for (size_t i = 0; i < sizeof reference_tables / sizeof *reference_tables; i++) {
    sqlite3_stmt *probe = NULL;
    snprintf(sql, sizeof sql, "SELECT reference FROM %s LIMIT 0", reference_tables[i]);
    if (sqlite3_prepare_v2(db, sql, -1, &probe, NULL) == SQLITE_OK) {
      sqlite3_finalize(probe);
      continue;
    }
    snprintf(sql, sizeof sql, "ALTER TABLE %s ADD COLUMN reference TEXT",
             reference_tables[i]);
    if (sqlite3_exec(db, sql, NULL, NULL, NULL) != SQLITE_OK)
      return -1;
  }
  return sqlite3_exec(db, reference_indexes, NULL, NULL, NULL) == SQLITE_OK ? 0 : -1;
}

struct psp_store {
  sqlite3 *db;
  sqlite3_stmt *st[ST_COUNT_];
  pthread_mutex_t lock;
};

/* Logs a database failure; the message never reaches an HTTP body. */
static void log_db_error(psp_store_t *s, const char *what) {
  psp_log(json_pack("{s:s, s:s, s:s}", "event", "store_error", "during", what, "detail",
                    sqlite3_errmsg(s->db)));
}

psp_store_t *psp_store_open(const char *path, char *err, size_t errlen) {
  psp_store_t *s = calloc(1, sizeof *s);
  sqlite3_stmt *st = NULL;
  int ok = 0;

  if (s == NULL) {
    snprintf(err, errlen, "out of memory");
    return NULL;
  }
  pthread_mutex_init(&s->lock, NULL);
  if (sqlite3_open_v2(path, &s->db,
                      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX,
                      NULL) != SQLITE_OK)
    goto out;
  sqlite3_busy_timeout(s->db, 5000);
  /* journal_mode answers with the mode in force: check it is really WAL. */
  if (sqlite3_prepare_v2(s->db, "PRAGMA journal_mode=WAL", -1, &st, NULL) != SQLITE_OK ||
      sqlite3_step(st) != SQLITE_ROW ||
      sqlite3_stricmp((const char *)sqlite3_column_text(st, 0), "wal") != 0)
    goto out;
  if (sqlite3_exec(s->db, "PRAGMA synchronous=FULL", NULL, NULL, NULL) != SQLITE_OK ||
      sqlite3_exec(s->db, schema, NULL, NULL, NULL) != SQLITE_OK ||
      add_reference_columns(s->db) != 0)
    goto out;
  for (int i = 0; i < ST_COUNT_; i++)
    if (sqlite3_prepare_v3(s->db, stmt_sql[i], -1, SQLITE_PREPARE_PERSISTENT, &s->st[i],
                           NULL) != SQLITE_OK)
      goto out;
  ok = 1;
out:
  sqlite3_finalize(st);
  if (!ok) {
    snprintf(err, errlen, "cannot open the database '%s': %s", path,
             s->db ? sqlite3_errmsg(s->db) : "out of memory");
    psp_store_close(s);
    return NULL;
  }
  return s;
}

void psp_store_close(psp_store_t *s) {
  if (s == NULL)
    return;
  for (int i = 0; i < ST_COUNT_; i++)
    sqlite3_finalize(s->st[i]);
  sqlite3_close(s->db);
  pthread_mutex_destroy(&s->lock);
  free(s);
}

/* Runs a statement that returns no row; leaves it reset. */
static int exec_stmt(psp_store_t *s, enum stmt_id id) {
  int rc = sqlite3_step(s->st[id]);
  sqlite3_reset(s->st[id]);
  sqlite3_clear_bindings(s->st[id]);
  return rc == SQLITE_DONE ? 0 : -1;
}

int psp_store_count_request(psp_store_t *s, psp_kind_t kind, const char *key) {
  enum stmt_id count_key = kind == PSP_KIND_REFUND ? ST_COUNT_REFUND_KEY : ST_COUNT_KEY;
  int rc = -1;

  pthread_mutex_lock(&s->lock);
  if (exec_stmt(s, ST_BEGIN) == 0) {
    sqlite3_bind_text(s->st[ST_COUNT_ALL], 1,
                      kind == PSP_KIND_REFUND ? "refund_requests" : "requests", -1,
                      SQLITE_STATIC);
    if (key)
      sqlite3_bind_text(s->st[count_key], 1, key, -1, SQLITE_STATIC);
    if (exec_stmt(s, ST_COUNT_ALL) == 0 &&
        (key == NULL || exec_stmt(s, count_key) == 0))
      rc = exec_stmt(s, ST_COMMIT);
    if (rc != 0) {
      log_db_error(s, "count_request");
      (void)exec_stmt(s, ST_ROLLBACK);
    }
  } else {
    log_db_error(s, "count_request");
  }
  pthread_mutex_unlock(&s->lock);
  return rc == 0 ? 0 : PSP_STORE_ERROR;
}

static void copy_column(sqlite3_stmt *st, int col, char *out, size_t outlen) {
  const char *v = (const char *)sqlite3_column_text(st, col);
  snprintf(out, outlen, "%s", v ? v : "");
}

/* Reads a row of (id, key, amount, currency, status, created_at, charge,
 * reference) into `out`. */
static void read_row(sqlite3_stmt *st, psp_charge_t *out) {
  copy_column(st, 0, out->id, sizeof out->id);
  copy_column(st, 1, out->key, sizeof out->key);
  out->amount = sqlite3_column_int64(st, 2);
  copy_column(st, 3, out->currency, sizeof out->currency);
  copy_column(st, 4, out->status, sizeof out->status);
  copy_column(st, 5, out->created_at, sizeof out->created_at);
  copy_column(st, 6, out->charge, sizeof out->charge);
  copy_column(st, 7, out->reference, sizeof out->reference);
}

/* Reads the charge (or refund) of `key` (with ST_GET_BY_REFERENCE, the
 * charge of that reference); the caller holds the lock. */
static int get_with(psp_store_t *s, enum stmt_id id, const char *key, psp_charge_t *out) {
  sqlite3_stmt *st = s->st[id];
  int rc;

  sqlite3_bind_text(st, 1, key, -1, SQLITE_STATIC);
  rc = sqlite3_step(st);
  if (rc == SQLITE_ROW) {
    read_row(st, out);
  } else if (rc != SQLITE_DONE) {
    log_db_error(s, "get");
  }
  sqlite3_reset(st);
  sqlite3_clear_bindings(st);
  return rc == SQLITE_ROW    ? PSP_FOUND
         : rc == SQLITE_DONE ? PSP_NOT_FOUND
                             : PSP_STORE_ERROR;
}

static int get_locked(psp_store_t *s, psp_kind_t kind, const char *key,
                      psp_charge_t *out) {
  return get_with(s, kind == PSP_KIND_REFUND ? ST_GET_REFUND : ST_GET, key, out);
}

/* Binds `v` at `col`, or NULL when it is "". */
static void bind_optional(sqlite3_stmt *st, int col, const char *v) {
  if (v[0])
    sqlite3_bind_text(st, col, v, -1, SQLITE_STATIC);
  else
    sqlite3_bind_null(st, col);
}

int psp_store_charge(psp_store_t *s, const psp_charge_t *want, int ignore_key,
                     psp_charge_t *out) {
  sqlite3_stmt *st = s->st[ST_INSERT];
  /* A charge whose key is ignored is stored under its own id: a new row. */
  const char *key = ignore_key ? want->id : want->key;
  int rc, created;

  pthread_mutex_lock(&s->lock);
  sqlite3_bind_text(st, 1, key, -1, SQLITE_STATIC);
  sqlite3_bind_text(st, 2, want->id, -1, SQLITE_STATIC);
  sqlite3_bind_int64(st, 3, want->amount);
  sqlite3_bind_text(st, 4, want->currency, -1, SQLITE_STATIC);
  sqlite3_bind_text(st, 5, want->status, -1, SQLITE_STATIC);
  sqlite3_bind_text(st, 6, want->created_at, -1, SQLITE_STATIC);
  bind_optional(st, 7, want->reference);
  rc = exec_stmt(s, ST_INSERT);
  created = rc == 0 && sqlite3_changes(s->db) == 1;
  if (rc != 0) {
    log_db_error(s, "charge");
    rc = PSP_STORE_ERROR;
  } else {
    rc = get_locked(s, PSP_KIND_CHARGE, key, out);
    /* The insert committed or found a row: not finding one now is a fault. */
    if (rc == PSP_NOT_FOUND)
      rc = PSP_STORE_ERROR;
    else if (rc == PSP_FOUND && created)
      rc = PSP_CREATED;
  }
  pthread_mutex_unlock(&s->lock);
  return rc;
}

/* The sum of the succeeded refunds of the charge under `charge` into
 * *refunded; 0 or -1. The caller holds the lock. */
static int refunded_locked(psp_store_t *s, const char *charge, int64_t *refunded) {
  sqlite3_stmt *st = s->st[ST_REFUNDED];
  int rc;

  sqlite3_bind_text(st, 1, charge, -1, SQLITE_STATIC);
  rc = sqlite3_step(st);
  if (rc == SQLITE_ROW)
    *refunded = sqlite3_column_int64(st, 0);
  sqlite3_reset(st);
  sqlite3_clear_bindings(st);
  return rc == SQLITE_ROW ? 0 : -1;
}

/* Decides the refund `want` against its charge and inserts it; 0 or -1.
 * The caller holds the lock and the write transaction, so no other
 * refund of the charge comes between the sum and the insert. */
static int insert_refund_locked(psp_store_t *s, const psp_charge_t *want, const char *key,
                                int decline) {
  sqlite3_stmt *st = s->st[ST_INSERT_REFUND];
  const char *currency = want->currency[0] ? want->currency : "BRL";
  psp_charge_t charge;
  int64_t refunded = 0;
  int found, ok;

  found = get_locked(s, PSP_KIND_CHARGE, want->charge, &charge);
  if (found == PSP_NOT_FOUND)
    found = get_with(s, ST_GET_BY_REFERENCE, want->charge, &charge);
  if (found == PSP_STORE_ERROR)
    return -1;
  if (found == PSP_FOUND) {
    if (want->currency[0] == '\0')
      currency = charge.currency;
    if (refunded_locked(s, want->charge, &refunded) != 0)
      return -1;
  }
  /* refunded <= charge.amount, so the difference cannot overflow. */
  ok = !decline && found == PSP_FOUND && strcmp(charge.status, "succeeded") == 0 &&
       strcmp(currency, charge.currency) == 0 && want->amount <= charge.amount - refunded;
  sqlite3_bind_text(st, 1, key, -1, SQLITE_STATIC);
  sqlite3_bind_text(st, 2, want->id, -1, SQLITE_STATIC);
  sqlite3_bind_text(st, 3, want->charge, -1, SQLITE_STATIC);
  sqlite3_bind_int64(st, 4, want->amount);
  sqlite3_bind_text(st, 5, currency, -1, SQLITE_STATIC);
  sqlite3_bind_text(st, 6, ok ? "succeeded" : "declined", -1, SQLITE_STATIC);
  sqlite3_bind_text(st, 7, want->created_at, -1, SQLITE_STATIC);
  bind_optional(st, 8, want->reference);
  return exec_stmt(s, ST_INSERT_REFUND);
}

int psp_store_refund(psp_store_t *s, const psp_charge_t *want, int decline,
                     int ignore_key, psp_charge_t *out) {
  const char *key = ignore_key ? want->id : want->key;
  int rc;

  pthread_mutex_lock(&s->lock);
  if (exec_stmt(s, ST_BEGIN) != 0) {
    log_db_error(s, "refund");
    pthread_mutex_unlock(&s->lock);
    return PSP_STORE_ERROR;
  }
  rc = get_locked(s, PSP_KIND_REFUND, key, out);
  if (rc == PSP_NOT_FOUND) {
    rc = insert_refund_locked(s, want, key, decline) == 0
             ? get_locked(s, PSP_KIND_REFUND, key, out)
             : PSP_STORE_ERROR;
    /* Inserted in this transaction: not finding it now is a fault. */
    rc = rc == PSP_FOUND ? PSP_CREATED : PSP_STORE_ERROR;
  }
  if (rc != PSP_STORE_ERROR && exec_stmt(s, ST_COMMIT) != 0)
    rc = PSP_STORE_ERROR;
  if (rc == PSP_STORE_ERROR) {
    log_db_error(s, "refund");
    (void)exec_stmt(s, ST_ROLLBACK);
  }
  pthread_mutex_unlock(&s->lock);
  return rc;
}

int psp_store_get(psp_store_t *s, psp_kind_t kind, const char *key, psp_charge_t *out) {
  int rc;
  pthread_mutex_lock(&s->lock);
  rc = get_locked(s, kind, key, out);
  pthread_mutex_unlock(&s->lock);
  return rc;
}

int psp_store_list(psp_store_t *s, psp_kind_t kind, const char *reference,
                   psp_charge_t *out, int max, int *n) {
  sqlite3_stmt *st = s->st[kind == PSP_KIND_REFUND ? ST_LIST_REFUNDS : ST_LIST];
  int rc;

  *n = 0;
  pthread_mutex_lock(&s->lock);
  sqlite3_bind_text(st, 1, reference, -1, SQLITE_STATIC);
  sqlite3_bind_int(st, 2, max);
  while ((rc = sqlite3_step(st)) == SQLITE_ROW && *n < max)
    read_row(st, &out[(*n)++]);
  if (rc != SQLITE_ROW && rc != SQLITE_DONE)
    log_db_error(s, "list");
  sqlite3_reset(st);
  sqlite3_clear_bindings(st);
  pthread_mutex_unlock(&s->lock);
  return rc == SQLITE_ROW || rc == SQLITE_DONE ? 0 : PSP_STORE_ERROR;
}

/* Sets stats[field] to {"<key>": {"requests", made: 0|1, "declines": 0|1}}
 * from the rows of `id` (key, requests, status); the caller holds the
 * lock. 0 or -1. */
static int keys_locked(psp_store_t *s, enum stmt_id id, const char *made, json_t *stats,
                       const char *field) {
  sqlite3_stmt *st = s->st[id];
  json_t *keys = json_object();
  int rc;

  while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
    const char *status = (const char *)sqlite3_column_text(st, 2);
    json_object_set_new(keys, (const char *)sqlite3_column_text(st, 0),
                        json_pack("{s:I, s:i, s:i}", "requests",
                                  (json_int_t)sqlite3_column_int64(st, 1), made,
                                  strcmp(status, "succeeded") == 0, "declines",
                                  strcmp(status, "declined") == 0));
  }
  sqlite3_reset(st);
  json_object_set_new(stats, field, keys);
  return rc == SQLITE_DONE ? 0 : -1;
}

/* Sets stats[field] to {"<reference>": {made: n, "declines": n}} from the
 * rows of `id` (reference, all, succeeded): what was made under each
 * merchant reference, several when the key was ignored. The caller holds
 * the lock. 0 or -1. */
static int references_locked(psp_store_t *s, enum stmt_id id, const char *made,
                             json_t *stats, const char *field) {
  sqlite3_stmt *st = s->st[id];
  json_t *refs = json_object();
  int rc;

  while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
    int64_t all = sqlite3_column_int64(st, 1), ok = sqlite3_column_int64(st, 2);
    json_object_set_new(refs, (const char *)sqlite3_column_text(st, 0),
                        json_pack("{s:I, s:I}", made, (json_int_t)ok, "declines",
                                  (json_int_t)(all - ok)));
  }
  sqlite3_reset(st);
  json_object_set_new(stats, field, refs);
  return rc == SQLITE_DONE ? 0 : -1;
}

/* Fills the stats object; the caller holds the lock. */
static int stats_locked(psp_store_t *s, json_t *stats) {
  static const char *const totals[] = {"charges", "declines", "requests",
                                       "refunds", "refund_declines", "refund_requests"};
  sqlite3_stmt *st = s->st[ST_TOTALS];

  if (sqlite3_step(st) != SQLITE_ROW) {
    sqlite3_reset(st);
    return -1;
  }
  for (int i = 0; i < (int)(sizeof totals / sizeof *totals); i++)
    json_object_set_new(stats, totals[i], json_integer(sqlite3_column_int64(st, i)));
  sqlite3_reset(st);
  if (keys_locked(s, ST_KEYS, "charges", stats, "keys") != 0 ||
      keys_locked(s, ST_REFUND_KEYS, "refunds", stats, "refund_keys") != 0 ||
      references_locked(s, ST_REFERENCES, "charges", stats, "references") != 0)
    return -1;
  return references_locked(s, ST_REFUND_REFERENCES, "refunds", stats,
                           "refund_references");
}

json_t *psp_store_stats(psp_store_t *s) {
  json_t *stats = json_object();
  int rc;

  if (stats == NULL)
    return NULL;
  pthread_mutex_lock(&s->lock);
  /* One read transaction, so the totals and the keys agree. */
  rc = sqlite3_exec(s->db, "BEGIN", NULL, NULL, NULL) == SQLITE_OK
           ? stats_locked(s, stats)
           : -1;
  if (rc != 0)
    log_db_error(s, "stats");
  (void)sqlite3_exec(s->db, "COMMIT", NULL, NULL, NULL);
  pthread_mutex_unlock(&s->lock);
  if (rc != 0) {
    json_decref(stats);
    return NULL;
  }
  return stats;
}
