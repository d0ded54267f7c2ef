/* Running idemd's statements on either store (see sql.h). */
#include "data/sql.h"

#include <assert.h>
#include <libpq-fe.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "idem/crypto.h"

_Static_assert(IDEMD_SQL_SLOTS_ <= IDEM_TX_STATEMENTS,
               "a store keeps every slot of idemd's");

int idemd_sql_is_sqlite(const idem_tx_t *tx) {
  return idem_tx_backend(tx)[0] == 's';
}

static int run_sqlite(idem_tx_t *tx, sqlite3_stmt *st, const idemd_sql_param_t *p, int n,
                      idemd_sql_row_fn row, void *arg, int *changes) {
  int rc;

  assert(sqlite3_bind_parameter_count(st) == n);
  for (int i = 0; i < n; i++) {
    assert(sqlite3_bind_parameter_name(st, i + 1)[0] == '$' &&
           atoi(sqlite3_bind_parameter_name(st, i + 1) + 1) == i + 1);
    if (p[i].kind == 1)
      sqlite3_bind_int64(st, i + 1, p[i].num);
    else if (p[i].kind == 2)
      sqlite3_bind_blob(st, i + 1, p[i].bytes, (int)p[i].len, SQLITE_STATIC);
    else if (p[i].text)
      sqlite3_bind_text(st, i + 1, p[i].text, -1, SQLITE_STATIC);
    else
      sqlite3_bind_null(st, i + 1);
  }
  while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
    const char *cols[IDEMD_SQL_MAX_COLS] = {0};
    int ncols = sqlite3_column_count(st);
    for (int i = 0; i < ncols && i < IDEMD_SQL_MAX_COLS; i++)
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

/* Room for one parameter as text: a number, or bytes in hex. */
#define PARAM_TEXT 72

static int run_pg(idem_tx_t *tx, const char *name, const idemd_sql_param_t *p, int n,
                  idemd_sql_row_fn row, void *arg, int *changes) {
  char texts[IDEMD_SQL_MAX_PARAMS][PARAM_TEXT];
  const char *values[IDEMD_SQL_MAX_PARAMS];
  PGresult *res;
  ExecStatusType st;
  int rc = IDEM_OK;

  for (int i = 0; i < n; i++) {
    if (p[i].kind == 1) {
      snprintf(texts[i], sizeof texts[i], "%lld", p[i].num);
      values[i] = texts[i];
    } else if (p[i].kind == 2) {
      if (2 * p[i].len + 1 > sizeof texts[i])
        return IDEM_EINVAL;
      idem_hex(p[i].bytes, p[i].len, texts[i]);
      values[i] = texts[i];
    } else {
      values[i] = p[i].text;
    }
  }
  /* A statement whose rows and count nobody reads joins the batch's
   * pipeline: it costs no round trip of its own (docs/performance.md,
   * "PostgreSQL: group commit"). Its error, if any, is the write's. */
  if (row == NULL && changes == NULL)
    return idem_tx_send(tx, name, n, values);
  if ((rc = idem_tx_flush(tx)) != IDEM_OK)
    return rc;
  res = PQexecPrepared(idem_tx_handle(tx), name, n, values, NULL, NULL, 0);
  st = PQresultStatus(res);
  if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
    const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);
    rc = state && strcmp(state, "23505") == 0 ? IDEM_EEXIST : IDEM_ESTORE;
  }
  for (int r = 0; rc == IDEM_OK && row && r < PQntuples(res); r++) {
    const char *cols[IDEMD_SQL_MAX_COLS] = {0};
    for (int i = 0; i < PQnfields(res) && i < IDEMD_SQL_MAX_COLS; i++)
      cols[i] = PQgetisnull(res, r, i) ? NULL : PQgetvalue(res, r, i);
    rc = row(arg, cols);
  }
  if (rc == IDEM_OK && changes)
    *changes = atoi(PQcmdTuples(res));
  PQclear(res);
  return rc;
}

int idemd_sql_run(idem_tx_t *tx, enum idemd_sql_slot slot, const char *sql,
                  const idemd_sql_param_t *p, int n, idemd_sql_row_fn row, void *arg,
                  int *changes) {
  void *st;

  if (n > IDEMD_SQL_MAX_PARAMS)
    return IDEM_ESTORE;
  if ((st = idem_tx_statement(tx, slot, sql)) == NULL) {
    /* A statement queued before failed (a duplicate id: IDEM_EEXIST). */
    int rc = idem_tx_flush(tx);
    return rc != IDEM_OK ? rc : IDEM_ESTORE;
  }
  return idemd_sql_is_sqlite(tx) ? run_sqlite(tx, st, p, n, row, arg, changes)
                                 : run_pg(tx, st, p, n, row, arg, changes);
}

int idemd_sql_exec(idem_tx_t *tx, const char *sql, char *err, size_t errlen) {
  int rc = IDEM_OK;

  if (idemd_sql_is_sqlite(tx)) {
    char *msg = NULL;
    if (sqlite3_exec(idem_tx_handle(tx), sql, NULL, NULL, &msg) != SQLITE_OK) {
      snprintf(err, errlen, "%s", msg ? msg : "unknown error");
      rc = IDEM_ESTORE;
    }
    sqlite3_free(msg);
  } else if ((rc = idem_tx_flush(tx)) != IDEM_OK) {
    snprintf(err, errlen, "%s", idem_store_last_error());
  } else {
    PGresult *res = PQexec(idem_tx_handle(tx), sql);
    ExecStatusType st = PQresultStatus(res);
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
      snprintf(err, errlen, "%s", PQresultErrorMessage(res));
      rc = IDEM_ESTORE;
    }
    PQclear(res);
  }
  return rc;
}
