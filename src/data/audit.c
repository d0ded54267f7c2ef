/* The audit trail on either store (see audit.h). */
#include "data/audit.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

/* The gateway's trail (gateway/requests.c makes the table). */
static const char key_append_sql[] =
    "INSERT INTO gateway_audit (created_at, scope, route, key, from_status, to_status, "
    "actor, reason) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)";
static const char key_list_sql[] =
    "SELECT created_at, key, from_status, to_status, actor, reason, scope, route "
    "FROM gateway_audit WHERE (CAST($1 AS TEXT) IS NULL OR key = $1) "
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

int idemd_audit_append_key(idem_tx_t *tx, const idem_scope_t *scope, const char *from,
                           const char *to, const idemd_actor_t *who) {
  idemd_sql_param_t p[8] = {NUM(idem_tx_now_ms(tx)),  NUM(scope->tenant_id),
                            TEXT(scope->operation),   TEXT(scope->key),
                            TEXT(from),               TEXT(to),
                            TEXT(actor_of(who)),      TEXT(who ? who->reason : NULL)};
  /* An operator's tool writes these, in a process of its own: the slot
   * of rare statements (data/sql.h), apart from the gateway's. */
  return idemd_sql_run(tx, IDEMD_SQL_COUNT, key_append_sql, p, 8, NULL, NULL, NULL);
}

struct list {
  int keys; /* the gateway's trail */
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
                           cols[5],
                           0,
                           NULL};
  if (l->keys) {
    row.scope = cols[6] ? strtoll(cols[6], NULL, 10) : 0;
    row.route = cols[7] ? cols[7] : "";
  }
  return l->fn(l->arg, &row);
}

static int list_fn(void *arg, idem_tx_t *tx) {
  struct list *l = arg;
  idemd_sql_param_t p[2] = {NUM(l->tenant_id), TEXT(l->id)};
  /* A tool's: made each time rather than kept in a slot of its own. */
  if (l->keys)
    return idemd_sql_run(tx, IDEMD_SQL_COUNT, key_list_sql, p + 1, 1, got_row, l, NULL);
  return idemd_sql_run(tx, IDEMD_SQL_COUNT, list_sql, p, 2, got_row, l, NULL);
}

int idemd_audit_list(idem_store_t *store, int64_t tenant_id, const char *id,
                     int (*fn)(void *arg, const idemd_audit_row_t *row), void *arg) {
  struct list l = {0, tenant_id, id, fn, arg};
  idem_effect_t e = {list_fn, &l};
  return idem_store_read(store, &e);
}

int idemd_audit_list_keys(idem_store_t *store, const char *key,
                          int (*fn)(void *arg, const idemd_audit_row_t *row), void *arg) {
  struct list l = {1, 0, key, fn, arg};
  idem_effect_t e = {list_fn, &l};
  return idem_store_read(store, &e);
}

/* `s` as a JSON string (null for NULL). A text that is not UTF-8 (a row
 * written by hand, or by another program, on SQLite, which does not check)
 * is printed with its bytes above 0x7f as \xNN, rather than stopping the
 * listing. */
static json_t *text_or_null(const char *s) {
  json_t *j;
  char *esc, *o;

  if (s == NULL)
    return json_null();
  if ((j = json_string(s)) != NULL || (esc = malloc(4 * strlen(s) + 1)) == NULL)
    return j;
  for (o = esc; *s; s++)
    o += (unsigned char)*s < 0x80 ? sprintf(o, "%c", *s)
                                  : sprintf(o, "\\x%02x", (unsigned char)*s);
  j = json_string(esc);
  free(esc);
  return j;
}

/* `ms` as UTC to the millisecond, "2026-12-06T01:22:51.412Z": rows of one
 * second keep their order when read. */
static void format_ms(int64_t ms, char *out, size_t cap) {
  time_t secs = (time_t)(ms / 1000);
  struct tm tm;
  char base[24];

  gmtime_r(&secs, &tm);
  strftime(base, sizeof base, "%Y-%m-%dT%H:%M:%S", &tm);
  snprintf(out, cap, "%s.%03dZ", base, (int)(ms % 1000));
}

char *idemd_audit_json(const idemd_audit_row_t *row, const char *tenant) {
  char at[40], scope[24], *line;
  json_t *o;

  format_ms(row->at_ms, at, sizeof at);
  if (row->route == NULL) {
    o = json_pack("{s:s, s:o, s:o, s:o, s:o, s:o, s:o}", "at", at, "tenant",
                  text_or_null(tenant ? tenant : ""), "resource",
                  text_or_null(row->resource_id), "from", text_or_null(row->from), "to",
                  text_or_null(row->to), "actor", text_or_null(row->actor), "reason",
                  text_or_null(row->reason));
  } else {
    snprintf(scope, sizeof scope, "%lld", (long long)row->scope);
    o = json_pack("{s:s, s:s, s:o, s:o, s:o, s:o, s:o, s:o}", "at", at, "scope", scope,
                  "route", text_or_null(row->route), "key", text_or_null(row->resource_id),
                  "from", text_or_null(row->from), "to", text_or_null(row->to), "actor",
                  text_or_null(row->actor), "reason", text_or_null(row->reason));
  }
  line = o ? json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
  json_decref(o);
  return line;
}

int idemd_audit_text_valid(const char *s, int max_chars) {
  json_t *j = json_string(s); /* NULL for invalid UTF-8 */
  int n = 0;

  json_decref(j);
  if (j == NULL || *s == '\0')
    return 0;
  for (; *s; s++) {
    if ((unsigned char)*s < 0x20 || *s == 0x7f)
      return 0;
    n += ((unsigned char)*s & 0xc0) != 0x80;
  }
  return n <= max_chars;
}
