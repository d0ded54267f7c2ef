/* Payments, orders and the outbox on either store (see resources.h). Each
 * statement is written once, with $N parameters that first appear in the
 * order $1, $2, ...: SQLite, which numbers them as they appear, then
 * binds them where PostgreSQL does (checked in builds with assertions);
 * only the claim differs
 * (PostgreSQL skips the rows another instance is claiming). Statements
 * are kept per connection (idem_tx_statement()), so a payment's writes
 * cost no parsing. */
#include "data/resources.h"

#include <assert.h>
#include <libpq-fe.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* idemd's statement slots (idem_tx_statement()). */
enum slot {
  SLOT_INSERT_RESOURCE,
  SLOT_INSERT_OUTBOX,
  SLOT_UPDATE_RESOURCE,
  SLOT_DELETE_OUTBOX,
  SLOT_OUTBOX_DUE,
  SLOT_GET,
  SLOT_CLAIM,
  SLOT_COUNT,
};

static const char insert_resource[] =
    "INSERT INTO resources (id, tenant_id, kind, status, body, provider_ref, "
    "created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $7)";
static const char insert_outbox[] =
    "INSERT INTO outbox (resource_id, tenant_id, operation, key, created_at, "
    "attempts, next_attempt_at) VALUES ($1, $2, $3, $4, $5, 0, $6)";
static const char update_resource[] =
    "UPDATE resources SET status = COALESCE($1, status), body = COALESCE($2, body), "
    "provider_ref = COALESCE($3, provider_ref), updated_at = $4 "
    "WHERE id = $5 AND tenant_id = $6";
static const char delete_outbox[] =
    "DELETE FROM outbox WHERE resource_id = $1 AND tenant_id = $2";
static const char outbox_due[] =
    "UPDATE outbox SET next_attempt_at = $1 WHERE resource_id = $2 AND tenant_id = $3";
static const char get_resource[] =
    "SELECT body FROM resources WHERE id = $1 AND tenant_id = $2 AND kind = $3";
/* The due rows, oldest turn first, each sent to the back of the queue. */
#define CLAIM_SQL(lock)                                                       \
  "UPDATE outbox SET attempts = attempts + 1, next_attempt_at = $1 "          \
  "WHERE resource_id IN (SELECT resource_id FROM outbox "                     \
  "WHERE next_attempt_at <= $1 ORDER BY next_attempt_at LIMIT $2" lock ") "   \
  "RETURNING tenant_id, operation, key, resource_id"
static const char claim_sqlite[] = CLAIM_SQL("");
static const char claim_pg[] = CLAIM_SQL(" FOR UPDATE SKIP LOCKED");

/* A statement's parameter: text (NULL is SQL NULL) or a number. */
typedef struct param {
  const char *text;
  long long num;
  int is_num;
} param_t;

#define TEXT(s) ((param_t){.text = (s)})
#define NUM(v) ((param_t){.num = (v), .is_num = 1})
#define MAX_PARAMS 8
#define MAX_COLS 4

/* Called with each row's columns as text (NULL for SQL NULL). Returns
 * IDEM_OK to go on, or an error to stop with. */
typedef int (*row_fn)(void *arg, const char *const *cols);

static int is_sqlite(const idem_tx_t *tx) { return idem_tx_backend(tx)[0] == 's'; }

static int run_sqlite(idem_tx_t *tx, sqlite3_stmt *st, const param_t *p, int n,
                      row_fn row, void *arg, int *changes) {
  int rc;

  assert(sqlite3_bind_parameter_count(st) == n);
  for (int i = 0; i < n; i++) {
    assert(sqlite3_bind_parameter_name(st, i + 1)[0] == '$' &&
           atoi(sqlite3_bind_parameter_name(st, i + 1) + 1) == i + 1);
    if (p[i].is_num)
      sqlite3_bind_int64(st, i + 1, p[i].num);
    else if (p[i].text)
      sqlite3_bind_text(st, i + 1, p[i].text, -1, SQLITE_STATIC);
    else
      sqlite3_bind_null(st, i + 1);
  }
  while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
    const char *cols[MAX_COLS] = {0};
    int ncols = sqlite3_column_count(st);
    for (int i = 0; i < ncols && i < MAX_COLS; i++)
      cols[i] = (const char *)sqlite3_column_text(st, i);
    if (row && (rc = row(arg, cols)) != IDEM_OK) {
      sqlite3_reset(st);
      return rc;
    }
  }
  if (changes)
    *changes = sqlite3_changes(idem_tx_handle(tx));
  sqlite3_reset(st); /* ends a read, and gives the result code of a failed step */
  if (rc == SQLITE_DONE)
    return IDEM_OK;
  return (sqlite3_extended_errcode(idem_tx_handle(tx)) & 0xff) == SQLITE_CONSTRAINT
             ? IDEM_EEXIST
             : IDEM_ESTORE;
}

static int run_pg(idem_tx_t *tx, const char *name, const param_t *p, int n, row_fn row,
                  void *arg, int *changes) {
  char nums[MAX_PARAMS][24];
  const char *values[MAX_PARAMS];
  PGresult *res;
  ExecStatusType st;
  int rc = IDEM_OK;

  for (int i = 0; i < n; i++) {
    if (p[i].is_num) {
      snprintf(nums[i], sizeof nums[i], "%lld", p[i].num);
      values[i] = nums[i];
    } else {
      values[i] = p[i].text;
    }
  }
  res = PQexecPrepared(idem_tx_handle(tx), name, n, values, NULL, NULL, 0);
  st = PQresultStatus(res);
  if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
    const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);
    rc = state && strcmp(state, "23505") == 0 ? IDEM_EEXIST : IDEM_ESTORE;
  }
  for (int r = 0; rc == IDEM_OK && row && r < PQntuples(res); r++) {
    const char *cols[MAX_COLS] = {0};
    for (int i = 0; i < PQnfields(res) && i < MAX_COLS; i++)
      cols[i] = PQgetisnull(res, r, i) ? NULL : PQgetvalue(res, r, i);
    rc = row(arg, cols);
  }
  if (rc == IDEM_OK && changes)
    *changes = atoi(PQcmdTuples(res));
  PQclear(res);
  return rc;
}

/* Runs statement `slot` (`sql`) with `n` parameters in `tx`, giving each
 * row to `row` (may be NULL) and the count of rows changed to `*changes`
 * (may be NULL). Returns IDEM_OK, IDEM_EEXIST for a unique violation,
 * `row`'s error, or IDEM_ESTORE. */
static int run(idem_tx_t *tx, enum slot slot, const char *sql, const param_t *p, int n,
               row_fn row, void *arg, int *changes) {
  void *st = idem_tx_statement(tx, slot, sql);

  if (st == NULL)
    return IDEM_ESTORE;
  return is_sqlite(tx) ? run_sqlite(tx, st, p, n, row, arg, changes)
                       : run_pg(tx, st, p, n, row, arg, changes);
}

int idemd_resource_insert(void *arg, idem_tx_t *tx) {
  const idemd_resource_t *res = arg;
  int64_t now = idem_tx_now_ms(tx);
  param_t p[7] = {TEXT(res->id),     NUM(res->tenant_id), TEXT(res->kind),
                  TEXT(res->status), TEXT(res->body),     TEXT(res->provider_ref),
                  NUM(now)};
  int rc = run(tx, SLOT_INSERT_RESOURCE, insert_resource, p, 7, NULL, NULL, NULL);

  if (rc != IDEM_OK || res->operation == NULL)
    return rc;
  param_t o[6] = {TEXT(res->id),  NUM(res->tenant_id), TEXT(res->operation),
                  TEXT(res->key), NUM(now),            NUM(now + res->due_after_ms)};
  return run(tx, SLOT_INSERT_OUTBOX, insert_outbox, o, 6, NULL, NULL, NULL);
}

int idemd_resource_update(void *arg, idem_tx_t *tx) {
  const idemd_resource_update_t *u = arg;
  int64_t now = idem_tx_now_ms(tx);
  param_t p[6] = {TEXT(u->status), TEXT(u->body), TEXT(u->provider_ref),
                  NUM(now),        TEXT(u->id),   NUM(u->tenant_id)};
  param_t row[3] = {NUM(now), TEXT(u->id), NUM(u->tenant_id)};
  int rc = run(tx, SLOT_UPDATE_RESOURCE, update_resource, p, 6, NULL, NULL, NULL);

  if (rc != IDEM_OK)
    return rc;
  if (u->state == IDEM_STATE_PENDING)
    return run(tx, SLOT_OUTBOX_DUE, outbox_due, row, 3, NULL, NULL, NULL);
  return run(tx, SLOT_DELETE_OUTBOX, delete_outbox, row + 1, 2, NULL, NULL, NULL);
}

/* ---- reads -------------------------------------------------------------- */

struct get {
  int64_t tenant_id;
  const char *kind, *id;
  char *body;
};

static int got_body(void *arg, const char *const *cols) {
  struct get *g = arg;
  free(g->body);
  g->body = strdup(cols[0] ? cols[0] : "");
  return g->body ? IDEM_OK : IDEM_ENOMEM;
}

static int get_fn(void *arg, idem_tx_t *tx) {
  struct get *g = arg;
  param_t p[3] = {TEXT(g->id), NUM(g->tenant_id), TEXT(g->kind)};
  return run(tx, SLOT_GET, get_resource, p, 3, got_body, g, NULL);
}

int idemd_resource_get(idem_store_t *store, int64_t tenant_id, const char *kind,
                       const char *id, char **body) {
  struct get g = {tenant_id, kind, id, NULL};
  idem_effect_t e = {get_fn, &g};
  int rc = idem_store_read(store, &e);

  *body = NULL;
  if (rc != IDEM_OK) {
    free(g.body);
    return rc;
  }
  if (g.body == NULL)
    return IDEM_ENOTFOUND;
  *body = g.body;
  return IDEM_OK;
}

struct count {
  int64_t n;
};

static int got_count(void *arg, const char *const *cols) {
  ((struct count *)arg)->n = cols[0] ? strtoll(cols[0], NULL, 10) : 0;
  return IDEM_OK;
}

struct count_query {
  const char *sql;
  int64_t tenant_id;
  struct count c;
};

static int count_fn(void *arg, idem_tx_t *tx) {
  struct count_query *q = arg;
  param_t p[1] = {NUM(q->tenant_id)};
  /* Rare (tests and tools): made each time rather than kept in a slot. */
  return run(tx, SLOT_COUNT, q->sql, p, 1, got_count, &q->c, NULL);
}

int idemd_resource_count(idem_store_t *store, const char *what, int64_t tenant_id,
                         int64_t *n) {
  static const struct {
    const char *what, *sql;
  } queries[] = {
      {"payments", "SELECT count(*) FROM resources WHERE kind = 'payment' AND "
                   "(CAST($1 AS BIGINT) = 0 OR tenant_id = $1)"},
      {"orders", "SELECT count(*) FROM resources WHERE kind = 'order' AND "
                 "(CAST($1 AS BIGINT) = 0 OR tenant_id = $1)"},
      {"outbox", "SELECT count(*) FROM outbox WHERE (CAST($1 AS BIGINT) = 0 OR tenant_id = $1)"},
  };
  struct count_query q = {NULL, tenant_id, {0}};
  idem_effect_t e = {count_fn, &q};
  int rc;

  *n = 0;
  for (size_t i = 0; i < sizeof queries / sizeof *queries; i++)
    if (strcmp(queries[i].what, what) == 0)
      q.sql = queries[i].sql;
  if (q.sql == NULL)
    return IDEM_EINVAL;
  if ((rc = idem_store_read(store, &e)) == IDEM_OK)
    *n = q.c.n;
  return rc;
}

/* ---- the reconciler's claim --------------------------------------------- */

#define MAX_CLAIM 256

struct claim {
  int64_t lease_ms;
  int max, n, due;
  idem_record_t *out;
  /* The due rows' scopes and payments, as the claim returned them. */
  struct due_row {
    int64_t tenant_id;
    char operation[IDEM_OPERATION_MAX + 1];
    char key[IDEM_KEY_MAX + 1];
    char resource_id[IDEM_ID_MAX + 1];
  } rows[MAX_CLAIM];
};

static int got_due(void *arg, const char *const *cols) {
  struct claim *c = arg;
  struct due_row *d;

  if (c->due >= c->max || !cols[0] || !cols[1] || !cols[2] || !cols[3])
    return IDEM_OK;
  d = &c->rows[c->due++];
  d->tenant_id = strtoll(cols[0], NULL, 10);
  snprintf(d->operation, sizeof d->operation, "%s", cols[1]);
  snprintf(d->key, sizeof d->key, "%s", cols[2]);
  snprintf(d->resource_id, sizeof d->resource_id, "%s", cols[3]);
  return IDEM_OK;
}

static void claim_reset(struct claim *c) {
  for (int i = 0; i < c->n; i++)
    idem_record_reset(&c->out[i]);
  c->n = 0;
  c->due = 0;
}

/* In one write: the due rows sent back, their records taken over. It may
 * run again (SQLite's batches): it starts afresh each time. */
static int claim_fn(void *arg, idem_tx_t *tx) {
  struct claim *c = arg;
  param_t p[2] = {NUM(idem_tx_now_ms(tx)), NUM(c->max)};
  int rc;

  claim_reset(c);
  rc = run(tx, SLOT_CLAIM, is_sqlite(tx) ? claim_sqlite : claim_pg, p, 2, got_due, c,
           NULL);
  for (int i = 0; rc == IDEM_OK && i < c->due; i++) {
    struct due_row *d = &c->rows[i];
    idem_scope_t scope = {d->tenant_id, d->operation, d->key};
    idem_record_t *rec = &c->out[c->n];

    rc = idem_tx_take_over(tx, &scope, c->lease_ms, rec);
    if (rc == IDEM_ENOTFOUND) { /* held under a live lease, or settled */
      rc = IDEM_OK;
      continue;
    }
    if (rc == IDEM_OK) {
      if (rec->resource_id[0] == '\0')
        snprintf(rec->resource_id, sizeof rec->resource_id, "%s", d->resource_id);
      c->n++;
    }
  }
  return rc;
}

int idemd_outbox_claim(idem_store_t *store, int64_t lease_ms, int max, idem_record_t *out,
                       int *n) {
  struct claim *c;
  idem_effect_t e;
  int rc;

  *n = 0;
  if (max <= 0 || lease_ms <= 0)
    return IDEM_EINVAL;
  if ((c = calloc(1, sizeof *c)) == NULL)
    return IDEM_ENOMEM;
  c->lease_ms = lease_ms;
  c->max = max < MAX_CLAIM ? max : MAX_CLAIM;
  c->out = out;
  e = (idem_effect_t){claim_fn, c};
  rc = idem_store_write(store, &e);
  if (rc == IDEM_OK)
    *n = c->n;
  else
    claim_reset(c);
  free(c);
  return rc;
}
