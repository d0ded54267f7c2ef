/* The gateway's table of unsettled requests (gateway/requests.h), on
 * SQLite and PostgreSQL alike through data/sql.h. */
#include "gateway/requests.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "data/sql.h"
#include "gateway/answer.h"
#include "gateway/request.h"

/* The gateway runs in a process of its own, where idemd's statements are
 * never made: its statements take the slots from 0 up. */
enum gw_sql_slot { GW_SQL_SAVE, GW_SQL_DROP, GW_SQL_DUE_SET, GW_SQL_DUE_LIST, GW_SQL_SCHEMA,
                   GW_SQL_DROP_LISTED };
#define SLOT(s) ((enum idemd_sql_slot)(s))

/* Another number than idemd's: a gateway and idemd may migrate one
 * database at once. */
#define MIGRATE_LOCK "5216104432"

/* The gateway's versions; each entry is { SQLite, PostgreSQL }. */
static const char *const versions[GW_SCHEMA_VERSION][2] = {
    /* 1: the requests of unsettled keys. Their types read the same on
     * both backends (SQLite takes BIGINT as INTEGER). */
    {"CREATE TABLE gateway_requests ("
     " tenant_id BIGINT NOT NULL,"
     " operation TEXT NOT NULL,"
     " key TEXT NOT NULL,"
     " request TEXT NOT NULL,"
     " attempts INTEGER NOT NULL DEFAULT 0,"
     " next_attempt_at BIGINT NOT NULL,"
     " PRIMARY KEY (tenant_id, operation, key));"
     "CREATE INDEX gateway_requests_due ON gateway_requests (next_attempt_at);",
     NULL},
    /* 2: the gateway's audit trail (data/audit.h): a row per change an
     * operator makes to a key's record (`idemd gateway resolve`), in the
     * change's transaction; `seq` keeps the order of rows of one
     * millisecond. A new table: nothing else changes. */
    {"CREATE TABLE gateway_audit ("
     " seq INTEGER PRIMARY KEY,"
     " created_at INTEGER NOT NULL,"
     " scope INTEGER NOT NULL,"
     " route TEXT NOT NULL,"
     " key TEXT NOT NULL,"
     " from_status TEXT,"
     " to_status TEXT NOT NULL,"
     " actor TEXT NOT NULL,"
     " reason TEXT);"
     "CREATE INDEX gateway_audit_key ON gateway_audit (key);",
     "CREATE TABLE gateway_audit ("
     " seq BIGSERIAL PRIMARY KEY,"
     " created_at BIGINT NOT NULL,"
     " scope BIGINT NOT NULL,"
     " route TEXT NOT NULL,"
     " key TEXT NOT NULL,"
     " from_status TEXT,"
     " to_status TEXT NOT NULL,"
     " actor TEXT NOT NULL,"
     " reason TEXT);"
     "CREATE INDEX gateway_audit_key ON gateway_audit (key);"},
};

struct migration {
  int version;
  char *err;
  size_t errlen;
};

static int got_version(void *arg, const char *const *cols) {
  *(int *)arg = cols[0] ? atoi(cols[0]) : 0;
  return IDEM_OK;
}

static int migrate_fn(void *arg, idem_tx_t *tx) {
  struct migration *m = arg;
  int rc;

  if ((!idemd_sql_is_sqlite(tx) &&
       (rc = idemd_sql_exec(tx, "SELECT pg_advisory_xact_lock(" MIGRATE_LOCK ")", m->err,
                            m->errlen)) != IDEM_OK) ||
      (rc = idemd_sql_exec(tx, "CREATE TABLE IF NOT EXISTS gateway_schema "
                               "(version INTEGER NOT NULL)",
                           m->err, m->errlen)) != IDEM_OK)
    return rc;
  m->version = 0;
  if ((rc = idemd_sql_run(tx, SLOT(GW_SQL_SCHEMA),
                          "SELECT coalesce(max(version), 0) FROM gateway_schema", NULL, 0,
                          got_version, &m->version, NULL)) != IDEM_OK) {
    snprintf(m->err, m->errlen, "cannot read the gateway's schema version");
    return rc;
  }
  if (m->version > GW_SCHEMA_VERSION) {
    snprintf(m->err, m->errlen, "the gateway's schema version %d is newer than this "
             "program's %d", m->version, GW_SCHEMA_VERSION);
    return IDEM_ESCHEMA;
  }
  for (int v = m->version; v < GW_SCHEMA_VERSION; v++) {
    char set[96];
    snprintf(set, sizeof set,
             "DELETE FROM gateway_schema; INSERT INTO gateway_schema VALUES (%d)", v + 1);
    const char *sql = versions[v][idemd_sql_is_sqlite(tx) ? 0 : 1];
    if (sql == NULL)
      sql = versions[v][0];
    if ((rc = idemd_sql_exec(tx, sql, m->err, m->errlen)) != IDEM_OK ||
        (rc = idemd_sql_exec(tx, set, m->err, m->errlen)) != IDEM_OK)
      return rc;
  }
  return IDEM_OK;
}

int gw_schema_migrate(idem_store_t *store, char *err, size_t errlen) {
  struct migration m = {0, err, errlen};
  idem_effect_t e = {migrate_fn, &m};
  int rc;

  err[0] = '\0';
  rc = idem_store_write(store, &e);
  if (rc != IDEM_OK && err[0] == '\0')
    snprintf(err, errlen, "%s", idem_store_last_error());
  return rc;
}

int gw_save_fn(void *arg, idem_tx_t *tx) {
  const gw_save_t *s = arg;
  idemd_sql_param_t p[] = {IDEMD_SQL_NUM(s->scope->tenant_id),
                           IDEMD_SQL_TEXT(s->scope->operation), IDEMD_SQL_TEXT(s->scope->key),
                           IDEMD_SQL_TEXT(s->text),
                           IDEMD_SQL_NUM(idem_tx_now_ms(tx) + s->due_in_ms)};
  /* A failed record won again keeps the row of its earlier try. */
  return idemd_sql_run(tx, SLOT(GW_SQL_SAVE),
                       "INSERT INTO gateway_requests (tenant_id, operation, key, request, "
                       "attempts, next_attempt_at) VALUES ($1, $2, $3, $4, 0, $5) "
                       "ON CONFLICT (tenant_id, operation, key) DO UPDATE SET "
                       "request = excluded.request, attempts = 0, "
                       "next_attempt_at = excluded.next_attempt_at",
                       p, 5, NULL, NULL, NULL);
}

int gw_drop_fn(void *arg, idem_tx_t *tx) {
  const idem_scope_t *s = arg;
  idemd_sql_param_t p[] = {IDEMD_SQL_NUM(s->tenant_id), IDEMD_SQL_TEXT(s->operation),
                           IDEMD_SQL_TEXT(s->key)};
  return idemd_sql_run(tx, SLOT(GW_SQL_DROP),
                       "DELETE FROM gateway_requests WHERE tenant_id = $1 AND "
                       "operation = $2 AND key = $3",
                       p, 3, NULL, NULL, NULL);
}

int gw_drop_listed_fn(void *arg, idem_tx_t *tx) {
  const gw_saved_t *s = arg;
  /* A request that won the key since rewrote the row (gw_save_fn()): its
   * due time, attempts or request differ, and the row stays. */
  idemd_sql_param_t p[] = {IDEMD_SQL_NUM(s->scope.tenant_id), IDEMD_SQL_TEXT(s->scope.operation),
                           IDEMD_SQL_TEXT(s->scope.key), IDEMD_SQL_NUM(s->attempts),
                           IDEMD_SQL_NUM(s->next_attempt_at), IDEMD_SQL_TEXT(s->request)};
  return idemd_sql_run(tx, SLOT(GW_SQL_DROP_LISTED),
                       "DELETE FROM gateway_requests WHERE tenant_id = $1 AND "
                       "operation = $2 AND key = $3 AND attempts = $4 AND "
                       "next_attempt_at = $5 AND request = $6",
                       p, 6, NULL, NULL, NULL);
}

int gw_due_fn(void *arg, idem_tx_t *tx) {
  const gw_due_t *d = arg;
  /* Parameters first appear in their order (data/sql.h). */
  idemd_sql_param_t p[] = {IDEMD_SQL_NUM(d->attempts), IDEMD_SQL_NUM(d->next_attempt_at),
                           IDEMD_SQL_NUM(d->scope->tenant_id),
                           IDEMD_SQL_TEXT(d->scope->operation), IDEMD_SQL_TEXT(d->scope->key)};
  return idemd_sql_run(tx, SLOT(GW_SQL_DUE_SET),
                       "UPDATE gateway_requests SET attempts = $1, next_attempt_at = $2 "
                       "WHERE tenant_id = $3 AND operation = $4 AND key = $5",
                       p, 5, NULL, NULL, NULL);
}

struct due_list {
  int64_t now_ms;
  gw_saved_t *out;
  int cap, n;
};

static int due_row(void *arg, const char *const *cols) {
  struct due_list *l = arg;
  gw_saved_t *s;

  if (l->n >= l->cap || !cols[0] || !cols[1] || !cols[2] || !cols[3])
    return IDEM_OK;
  s = &l->out[l->n];
  memset(s, 0, sizeof *s);
  s->scope.tenant_id = strtoll(cols[0], NULL, 10);
  if (idem_copy(s->operation, sizeof s->operation, cols[1]) != 0 ||
      idem_copy(s->key, sizeof s->key, cols[2]) != 0)
    return IDEM_OK;
  if ((s->request = strdup(cols[3])) == NULL)
    return IDEM_ENOMEM;
  s->attempts = cols[4] ? atoi(cols[4]) : 0;
  s->next_attempt_at = cols[5] ? strtoll(cols[5], NULL, 10) : 0;
  s->scope.operation = s->operation;
  s->scope.key = s->key;
  l->n++;
  return IDEM_OK;
}

static int due_list_fn(void *arg, idem_tx_t *tx) {
  struct due_list *l = arg;
  idemd_sql_param_t p[] = {IDEMD_SQL_NUM(l->now_ms), IDEMD_SQL_NUM(l->cap)};
  for (int i = 0; i < l->n; i++)
    free(l->out[i].request);
  l->n = 0;
  return idemd_sql_run(tx, SLOT(GW_SQL_DUE_LIST),
                       "SELECT tenant_id, operation, key, request, attempts, next_attempt_at FROM "
                       "gateway_requests WHERE next_attempt_at <= $1 "
                       "ORDER BY next_attempt_at LIMIT $2",
                       p, 2, due_row, l, NULL);
}

int gw_due_list(idem_store_t *store, int64_t now_ms, gw_saved_t *out, int cap, int *n) {
  struct due_list l = {now_ms, out, cap, 0};
  idem_effect_t e = {due_list_fn, &l};
  int rc = idem_store_read(store, &e);
  if (rc != IDEM_OK) {
    for (int i = 0; i < l.n; i++)
      free(out[i].request);
    l.n = 0;
  }
  *n = l.n;
  return rc;
}

char *gw_request_encode(const char *method, const char *target, char *const *headers,
                        const char *body, size_t body_len) {
  json_t *doc = json_object(), *hs = json_array();
  char *text = NULL;
  int ok = doc && hs && json_object_set_new(doc, "method", json_string(method)) == 0 &&
           json_object_set_new(doc, "target", json_string(target)) == 0;

  /* A line that is not UTF-8 (obs-text in a value) is kept as a body is:
   * {"body_b64": ...}. */
  for (char *const *h = headers; ok && h && *h; h++) {
    json_t *line = json_string(*h);
    if (line == NULL && (line = json_object()) != NULL &&
        gw_body_put(line, *h, strlen(*h)) != IDEM_OK) {
      json_decref(line);
      line = NULL;
    }
    ok = json_array_append_new(hs, line) == 0;
  }
  if (ok && json_object_set(doc, "headers", hs) == 0 &&
      gw_body_put(doc, body ? body : "", body_len) == IDEM_OK)
    text = json_dumps(doc, JSON_COMPACT);
  json_decref(hs);
  json_decref(doc);
  return text;
}

int gw_request_decode(const char *text, char **method, char **target, char ***headers,
                      char **body, size_t *body_len) {
  json_t *doc = json_loads(text, 0, NULL);
  json_t *hs = json_object_get(doc, "headers"), *h;
  const char *m = json_string_value(json_object_get(doc, "method"));
  const char *t = json_string_value(json_object_get(doc, "target"));
  size_t i, n = json_array_size(hs);
  int rc = IDEM_OK;

  *method = *target = *body = NULL;
  *headers = NULL;
  if (m == NULL || t == NULL || !json_is_array(hs)) {
    json_decref(doc);
    return IDEM_EINVAL;
  }
  if ((*headers = calloc(n + 1, sizeof **headers)) == NULL ||
      (*method = strdup(m)) == NULL || (*target = strdup(t)) == NULL)
    rc = IDEM_ENOMEM;
  json_array_foreach(hs, i, h) {
    size_t len;
    if (rc == IDEM_OK && json_is_object(h))
      rc = gw_body_get(h, &(*headers)[i], &len);
    else if (rc == IDEM_OK && ((*headers)[i] = strdup(json_string_value(h) ? json_string_value(h)
                                                                           : "")) == NULL)
      rc = IDEM_ENOMEM;
  }
  if (rc == IDEM_OK)
    rc = gw_body_get(doc, body, body_len);
  json_decref(doc);
  if (rc != IDEM_OK) {
    gw_free_lines(*headers);
    free(*method);
    free(*target);
    free(*body);
    *method = *target = *body = NULL;
    *headers = NULL;
  }
  return rc;
}
