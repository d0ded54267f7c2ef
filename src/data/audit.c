/* The audit trail on either store (see audit.h). */
#include "data/audit.h"

#include <stdlib.h>

#include "data/sql.h"

static const char append_sql[] = "INSERT INTO audit (created_at, tenant_id, resource_id, "
                                 "from_status, to_status, actor, "
                                 "reason) VALUES ($1, $2, $3, $4, $5, $6, $7)";
/* The status the resource has before the change, read by the insert
 * itself: one statement, and no row when nothing changes. */
static const char change_sql[] =
    "INSERT INTO audit (created_at, tenant_id, resource_id, from_status, to_status, "
    "actor, "
    "reason) SELECT CAST($1 AS BIGINT), tenant_id, id, status, CAST($2 AS TEXT), "
    "CAST($3 AS TEXT), CAST($4 AS TEXT) FROM resources "
    "WHERE id = $5 AND tenant_id = $6 AND status <> $2";
static const char list_sql[] =
    "SELECT created_at, resource_id, from_status, to_status, actor, reason FROM audit "
    "WHERE tenant_id = $1 AND (CAST($2 AS TEXT) IS NULL OR resource_id = $2) "
    "ORDER BY created_at, seq";

#define TEXT IDEMD_SQL_TEXT
#define NUM IDEMD_SQL_NUM

static const char *actor_of(const idemd_actor_t *who) {
  return who && who->actor ? who->actor : "idemd";
}

int idemd_audit_append(idem_tx_t *tx, int64_t tenant_id, const char *id, const char *from,
                       const char *to, const idemd_actor_t *who) {
  idemd_sql_param_t p[7] = {NUM(idem_tx_now_ms(tx)),
                            NUM(tenant_id),
                            TEXT(id),
                            TEXT(from),
                            TEXT(to),
                            TEXT(actor_of(who)),
                            TEXT(who ? who->reason : NULL)};
  return idemd_sql_run(tx, IDEMD_SQL_AUDIT_APPEND, append_sql, p, 7, NULL, NULL, NULL);
}

int idemd_audit_change(idem_tx_t *tx, int64_t tenant_id, const char *id, const char *to,
                       const idemd_actor_t *who) {
  idemd_sql_param_t p[6] = {NUM(idem_tx_now_ms(tx)),        TEXT(to), TEXT(actor_of(who)),
                            TEXT(who ? who->reason : NULL), TEXT(id), NUM(tenant_id)};
  return idemd_sql_run(tx, IDEMD_SQL_AUDIT_CHANGE, change_sql, p, 6, NULL, NULL, NULL);
}

struct list {
  int64_t tenant_id;
  const char *id;
  int (*fn)(void *arg, const idemd_audit_row_t *row);
  void *arg;
};

static int got_row(void *arg, const char *const *cols) {
  const struct list *l = arg;
  idemd_audit_row_t row = {cols[0] ? strtoll(cols[0], NULL, 10) : 0,
                           cols[1] ? cols[1] : "",
                           cols[2],
                           cols[3] ? cols[3] : "",
                           cols[4] ? cols[4] : "",
                           cols[5]};
  return l->fn(l->arg, &row);
}

static int list_fn(void *arg, idem_tx_t *tx) {
  struct list *l = arg;
  idemd_sql_param_t p[2] = {NUM(l->tenant_id), TEXT(l->id)};
  /* A tool's: made each time rather than kept in a slot of its own. */
  return idemd_sql_run(tx, IDEMD_SQL_COUNT, list_sql, p, 2, got_row, l, NULL);
}

int idemd_audit_list(idem_store_t *store, int64_t tenant_id, const char *id,
                     int (*fn)(void *arg, const idemd_audit_row_t *row), void *arg) {
  struct list l = {tenant_id, id, fn, arg};
  idem_effect_t e = {list_fn, &l};
  return idem_store_read(store, &e);
}
