/* One statement of idemd's own, run inside a store's transaction (an
 * effect, idem_store_write() or idem_store_read()) on either backend. Each
 * statement is written once, with $N parameters that first appear in the
 * order $1, $2, ...: SQLite, which numbers them as they appear, then binds
 * them where PostgreSQL does (checked in builds with assertions). The
 * statement is kept per connection in its slot (idem_tx_statement()), so
 * running it again costs no parsing. */
#ifndef IDEMD_SQL_H
#define IDEMD_SQL_H

#include <stddef.h>

#include "idem/store.h"

/* idemd's statement slots: one per statement, across all of idemd. */
enum idemd_sql_slot {
  IDEMD_SQL_INSERT_RESOURCE,
  IDEMD_SQL_INSERT_OUTBOX,
  IDEMD_SQL_UPDATE_RESOURCE,
  IDEMD_SQL_DELETE_OUTBOX,
  IDEMD_SQL_OUTBOX_DUE,
  IDEMD_SQL_GET_RESOURCE,
  IDEMD_SQL_CLAIM,
  IDEMD_SQL_PUT_ORDER,
  IDEMD_SQL_CANCEL_ORDER,
  IDEMD_SQL_REFUND_READ,
  IDEMD_SQL_REFUND_TAKE,
  IDEMD_SQL_REFUND_GIVE_BACK,
  IDEMD_SQL_REFUND_COUNT,
  IDEMD_SQL_REFUND_PEEK,
  IDEMD_SQL_PAYMENT_GET,
  IDEMD_SQL_COUNT, /* any count or other rare statement of a tool's: made again
                    * whenever its SQL changes */
  IDEMD_SQL_TENANT_INSERT,
  IDEMD_SQL_TENANT_BY_NAME,
  IDEMD_SQL_TENANT_SET_DISABLED,
  IDEMD_SQL_TENANT_LIST,
  IDEMD_SQL_KEY_INSERT,
  IDEMD_SQL_KEY_FIND,
  IDEMD_SQL_KEY_LIST,
  IDEMD_SQL_KEY_REVOKE,
  IDEMD_SQL_KEY_REVOKE_ALL,
  IDEMD_SQL_KEY_USED,
  IDEMD_SQL_AUDIT_APPEND,
  IDEMD_SQL_AUDIT_CHANGE,
  IDEMD_SQL_OUTBOX_FIND,
  IDEMD_SQL_EVENT_INSERT,
  IDEMD_SQL_SCHEMA, /* the migrations' statements, each used once */
  IDEMD_SQL_SCHEMA_CHECK,
  IDEMD_SQL_SLOTS_
};

/* A statement's parameter: text (NULL is SQL NULL), a number, or bytes
 * (a BLOB on SQLite, lower-case hex text on PostgreSQL). Borrowed. */
typedef struct idemd_sql_param {
  const char *text;
  long long num;
  const unsigned char *bytes;
  size_t len;
  int kind; /* 0 text, 1 number, 2 bytes */
} idemd_sql_param_t;

#define IDEMD_SQL_TEXT(s) ((idemd_sql_param_t){.text = (s)})
#define IDEMD_SQL_NUM(v) ((idemd_sql_param_t){.num = (v), .kind = 1})
#define IDEMD_SQL_BYTES(p, n) ((idemd_sql_param_t){.bytes = (p), .len = (n), .kind = 2})
#define IDEMD_SQL_MAX_PARAMS 8
#define IDEMD_SQL_MAX_COLS 12

/* Called with each row's columns as text (NULL for SQL NULL). Returns
 * IDEM_OK to go on, or an error to stop with. */
typedef int (*idemd_sql_row_fn)(void *arg, const char *const *cols);

/* 1 when `tx` runs on SQLite, 0 on PostgreSQL. */
int idemd_sql_is_sqlite(const idem_tx_t *tx);

/* Runs statement `slot` (`sql`) with `n` (at most IDEMD_SQL_MAX_PARAMS)
 * parameters in `tx`, giving each row's first IDEMD_SQL_MAX_COLS columns
 * to `row` (may be NULL) and the count of rows changed to `*changes` (may
 * be NULL). Returns IDEM_OK, IDEM_EEXIST for a unique violation, `row`'s
 * error, or IDEM_ESTORE. */
int idemd_sql_run(idem_tx_t *tx, enum idemd_sql_slot slot, const char *sql,
                  const idemd_sql_param_t *p, int n, idemd_sql_row_fn row, void *arg,
                  int *changes);

/* Runs `sql` (several statements, no parameters, no rows) in `tx`, as
 * migrations do. IDEM_OK or IDEM_ESTORE, with the database's message in
 * idem_store_last_error()'s place: printed by the caller. */
int idemd_sql_exec(idem_tx_t *tx, const char *sql, char *err, size_t errlen);

#endif
