/* Payments, orders and the outbox on either store (see resources.h), each
 * statement written once for both (data/sql.h); only the claim differs
 * (PostgreSQL skips the rows another instance is claiming). */
#include "data/resources.h"

#include "data/sql.h"
#include "idem/clock.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
static const char put_order[] =
    "INSERT INTO resources (id, tenant_id, kind, status, body, provider_ref, "
    "created_at, updated_at) VALUES ($1, $2, $3, $4, $5, NULL, $6, $6) "
    "ON CONFLICT (tenant_id, id) DO NOTHING";
/* The order's text ends in "status":"created","created_at":"..."}
 * (server/order_cmd.c): the status is rewritten and cancelled_at added
 * before the brace, the same bytes on both stores. `"status":"created"`
 * cannot occur inside one of its strings, whose quotes are escaped. The
 * status condition makes the first cancellation the only one. */
static const char cancel_order[] =
    "UPDATE resources SET status = 'cancelled', updated_at = $1, "
    "body = replace(substr(body, 1, length(body) - 1), '\"status\":\"created\"', "
    "'\"status\":\"cancelled\"') || ',\"cancelled_at\":\"' || $2 || '\"}' "
    "WHERE id = $3 AND tenant_id = $4 AND kind = 'order' AND status = 'created'";
/* The due rows, oldest turn first, each sent to the back of the queue. */
#define CLAIM_SQL(lock)                                                                  \
  "UPDATE outbox SET attempts = attempts + 1, next_attempt_at = $1 "                     \
  "WHERE (tenant_id, resource_id) IN (SELECT tenant_id, resource_id FROM outbox "        \
  "WHERE next_attempt_at <= $1 ORDER BY next_attempt_at LIMIT $2" lock ") "              \
  "RETURNING tenant_id, operation, key, resource_id"
static const char claim_sqlite[] = CLAIM_SQL("");
static const char claim_pg[] = CLAIM_SQL(" FOR UPDATE SKIP LOCKED");

#define TEXT IDEMD_SQL_TEXT
#define NUM IDEMD_SQL_NUM

int idemd_resource_insert(void *arg, idem_tx_t *tx) {
  const idemd_resource_t *res = arg;
  int64_t now = idem_tx_now_ms(tx);
  idemd_sql_param_t p[7] = {
      TEXT(res->id),   NUM(res->tenant_id),     TEXT(res->kind), TEXT(res->status),
      TEXT(res->body), TEXT(res->provider_ref), NUM(now)};
  int rc = idemd_sql_run(tx, IDEMD_SQL_INSERT_RESOURCE, insert_resource, p, 7, NULL, NULL,
                         NULL);

  if (rc == IDEM_OK)
    rc = idemd_audit_append(tx, res->tenant_id, res->id, NULL, res->status, &res->who);
  if (rc != IDEM_OK || res->operation == NULL)
    return rc;
  idemd_sql_param_t o[6] = {
      TEXT(res->id), NUM(res->tenant_id),         TEXT(res->operation), TEXT(res->key),
      NUM(now),      NUM(now + res->due_after_ms)};
  return idemd_sql_run(tx, IDEMD_SQL_INSERT_OUTBOX, insert_outbox, o, 6, NULL, NULL,
                       NULL);
}

int idemd_resource_update(void *arg, idem_tx_t *tx) {
  const idemd_resource_update_t *u = arg;
  int64_t now = idem_tx_now_ms(tx);
  idemd_sql_param_t p[6] = {TEXT(u->status), TEXT(u->body), TEXT(u->provider_ref),
                            NUM(now),        TEXT(u->id),   NUM(u->tenant_id)};
  idemd_sql_param_t row[3] = {NUM(now), TEXT(u->id), NUM(u->tenant_id)};
  int rc = u->status ? idemd_audit_change(tx, u->tenant_id, u->id, u->status, &u->who)
                     : IDEM_OK;

  if (rc == IDEM_OK)
    rc = idemd_sql_run(tx, IDEMD_SQL_UPDATE_RESOURCE, update_resource, p, 6, NULL, NULL,
                       NULL);

  if (rc != IDEM_OK)
    return rc;
  if (u->state == IDEM_STATE_PENDING)
    return idemd_sql_run(tx, IDEMD_SQL_OUTBOX_DUE, outbox_due, row, 3, NULL, NULL, NULL);
  return idemd_sql_run(tx, IDEMD_SQL_DELETE_OUTBOX, delete_outbox, row + 1, 2, NULL, NULL,
                       NULL);
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
  idemd_sql_param_t p[3] = {TEXT(g->id), NUM(g->tenant_id), TEXT(g->kind)};
  return idemd_sql_run(tx, IDEMD_SQL_GET_RESOURCE, get_resource, p, 3, got_body, g, NULL);
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

/* ---- orders written without a key --------------------------------------- */

struct order_write {
  const idemd_resource_t *row; /* a PUT's order, or NULL for a cancellation */
  int64_t tenant_id;
  const char *id;
  const idemd_actor_t *who; /* a cancellation's */
  int changed; /* rows the statement changed */
  struct get got; /* the order after it */
};

/* Runs again from the start when SQLite runs its batch again. */
static int order_write_fn(void *arg, idem_tx_t *tx) {
  struct order_write *w = arg;
  int64_t now = idem_tx_now_ms(tx);
  idemd_sql_param_t get[3] = {TEXT(w->id), NUM(w->tenant_id), TEXT("order")};
  int rc;

  w->changed = 0;
  free(w->got.body);
  w->got.body = NULL;
  if (w->row) {
    const idemd_resource_t *res = w->row;
    idemd_sql_param_t p[6] = {TEXT(res->id),     NUM(res->tenant_id), TEXT("order"),
                              TEXT(res->status), TEXT(res->body),     NUM(now)};
    rc = idemd_sql_run(tx, IDEMD_SQL_PUT_ORDER, put_order, p, 6, NULL, NULL, &w->changed);
    if (rc == IDEM_OK && w->changed > 0)
      rc = idemd_audit_append(tx, res->tenant_id, res->id, NULL, res->status, &res->who);
    if (rc != IDEM_OK || w->changed > 0)
      return rc;
  } else {
    char at[32];
    idem_format_time(now, at, sizeof at);
    idemd_sql_param_t p[4] = {NUM(now), TEXT(at), TEXT(w->id), NUM(w->tenant_id)};
    rc = idemd_sql_run(tx, IDEMD_SQL_CANCEL_ORDER, cancel_order, p, 4, NULL, NULL,
                       &w->changed);
    if (rc == IDEM_OK && w->changed > 0)
      rc = idemd_audit_append(tx, w->tenant_id, w->id, "created", "cancelled", w->who);
    if (rc != IDEM_OK)
      return rc;
  }
  return idemd_sql_run(tx, IDEMD_SQL_GET_RESOURCE, get_resource, get, 3, got_body, &w->got,
                       NULL);
}

/* Runs `w` in a write of its own; its order's text goes to `*body`. */
static int order_write(idem_store_t *store, struct order_write *w, char **body) {
  idem_effect_t e = {order_write_fn, w};
  int rc = idem_store_write(store, &e);

  *body = NULL;
  if (rc != IDEM_OK) {
    free(w->got.body);
    return rc;
  }
  *body = w->got.body;
  return IDEM_OK;
}

int idemd_order_put(idem_store_t *store, const idemd_resource_t *row, char **existing) {
  struct order_write w = {.row = row, .tenant_id = row->tenant_id, .id = row->id};
  int rc = order_write(store, &w, existing);

  if (rc != IDEM_OK)
    return rc;
  return w.changed > 0 ? IDEM_OK : IDEM_EEXIST;
}

int idemd_order_cancel(idem_store_t *store, int64_t tenant_id, const char *id,
                       const idemd_actor_t *who, char **body, int *changed) {
  struct order_write w = {.tenant_id = tenant_id, .id = id, .who = who};
  int rc = order_write(store, &w, body);

  *changed = w.changed > 0;
  if (rc == IDEM_OK && *body == NULL)
    return IDEM_ENOTFOUND;
  return rc;
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
  idemd_sql_param_t p[1] = {NUM(q->tenant_id)};
  /* Rare (tests and tools): made each time rather than kept in a slot. */
  return idemd_sql_run(tx, IDEMD_SQL_COUNT, q->sql, p, 1, got_count, &q->c, NULL);
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
      {"refunds", "SELECT count(*) FROM resources WHERE kind = 'refund' AND "
                  "(CAST($1 AS BIGINT) = 0 OR tenant_id = $1)"},
      {"outbox",
       "SELECT count(*) FROM outbox WHERE (CAST($1 AS BIGINT) = 0 OR tenant_id = $1)"},
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
  idemd_sql_param_t p[2] = {NUM(idem_tx_now_ms(tx)), NUM(c->max)};
  int rc;

  claim_reset(c);
  rc = idemd_sql_run(tx, IDEMD_SQL_CLAIM,
                     idemd_sql_is_sqlite(tx) ? claim_sqlite : claim_pg, p, 2, got_due, c,
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
      /* A request that died with its call (its lease ran out): the
       * take-over is worth a row, though the status stays pending. */
      if (rec->state == IDEM_STATE_PROCESSING)
        rc =
            idemd_audit_append(tx, d->tenant_id, d->resource_id, "pending", "pending",
                               &(idemd_actor_t){"reconciler", "taken over: the request's "
                                                              "lease ran out"});
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
