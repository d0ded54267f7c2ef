/* idemd's schema (see schema.h): its versions, per backend, applied in
 * order in one write. Never edit a released entry: add a new one. */
#include "data/schema.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/sql.h"

/* 1: the tables and views libidem's schema versions 1 to 4 made for idemd,
 * in their latest form; on a database that has them already (one that
 * every idemd before made), nothing changes. */
static const char *const sqlite_versions[] = {
    "CREATE TABLE IF NOT EXISTS tenants ("
    " id INTEGER PRIMARY KEY,"
    " name TEXT NOT NULL UNIQUE,"
    " key_lookup TEXT NOT NULL UNIQUE,"
    " key_hash BLOB NOT NULL,"
    " disabled INTEGER NOT NULL DEFAULT 0,"
    " created_at INTEGER NOT NULL);"
    "CREATE TABLE IF NOT EXISTS resources ("
    " id TEXT PRIMARY KEY,"
    " tenant_id INTEGER NOT NULL REFERENCES tenants (id),"
    " kind TEXT NOT NULL,"
    " status TEXT NOT NULL,"
    " body TEXT NOT NULL,"
    " provider_ref TEXT,"
    " created_at INTEGER NOT NULL,"
    " updated_at INTEGER NOT NULL) WITHOUT ROWID;"
    "CREATE TABLE IF NOT EXISTS outbox ("
    " resource_id TEXT PRIMARY KEY REFERENCES resources (id),"
    " tenant_id INTEGER NOT NULL,"
    " operation TEXT NOT NULL,"
    " key TEXT NOT NULL,"
    " created_at INTEGER NOT NULL,"
    " attempts INTEGER NOT NULL DEFAULT 0,"
    " next_attempt_at INTEGER NOT NULL) WITHOUT ROWID;"
    /* Read-only views for operators: the resources by kind. */
    "CREATE VIEW IF NOT EXISTS payments AS SELECT id, tenant_id, status,"
    " json_extract(body, '$.amount') AS amount,"
    " json_extract(body, '$.currency') AS currency,"
    " json_extract(body, '$.order_id') AS order_id,"
    " provider_ref, created_at, updated_at FROM resources"
    " WHERE kind = 'payment';"
    "CREATE VIEW IF NOT EXISTS orders AS SELECT id, tenant_id, status,"
    " json_extract(body, '$.customer_id') AS customer_id,"
    " json_extract(body, '$.total') AS total,"
    " json_extract(body, '$.currency') AS currency,"
    " created_at, updated_at FROM resources WHERE kind = 'order';",
    /* 2: a tenant has API keys, each with a name, the time it was last
     * used and, once revoked, when; its one key until now becomes the key
     * named "default". A key's name is its tenant's own among its keys
     * not revoked. The tenants table loses its key columns: SQLite cannot
     * drop a UNIQUE column, so the table is made again. Its rows wait in
     * a temporary copy; with the foreign keys deferred, the resources
     * that refer to them count as violations from the DROP until the same
     * ids are back (SQLite counts them down as the parent rows come
     * back), so nothing is left to fail at COMMIT. */
    "PRAGMA defer_foreign_keys = ON;"
    "CREATE TEMP TABLE tenants_v1 AS SELECT * FROM main.tenants;"
    "DROP TABLE main.tenants;"
    "CREATE TABLE main.tenants ("
    " id INTEGER PRIMARY KEY,"
    " name TEXT NOT NULL UNIQUE,"
    " disabled INTEGER NOT NULL DEFAULT 0,"
    " created_at INTEGER NOT NULL);"
    "INSERT INTO main.tenants (id, name, disabled, created_at)"
    " SELECT id, name, disabled, created_at FROM temp.tenants_v1;"
    "CREATE TABLE main.api_keys ("
    " id INTEGER PRIMARY KEY,"
    " tenant_id INTEGER NOT NULL REFERENCES tenants (id),"
    " name TEXT NOT NULL,"
    " key_lookup TEXT NOT NULL UNIQUE,"
    " key_hash BLOB NOT NULL,"
    " created_at INTEGER NOT NULL,"
    " last_used_at INTEGER,"
    " revoked_at INTEGER);"
    "CREATE UNIQUE INDEX main.api_keys_name ON api_keys (tenant_id, name)"
    " WHERE revoked_at IS NULL;"
    "INSERT INTO main.api_keys (tenant_id, name, key_lookup, key_hash, created_at)"
    " SELECT id, 'default', key_lookup, key_hash, created_at FROM temp.tenants_v1"
    " ORDER BY id;"
    "DROP TABLE temp.tenants_v1;",
    /* 3: a resource's id is its tenant's (PUT /orders/{id} takes the id a
     * client chose, and two tenants may choose the same): the key of
     * resources is (tenant_id, id), and the outbox refers to a resource by
     * both. SQLite changes no key in place: both tables are made again
     * with every row, and the views over resources (idemd's, dropped to
     * let the tables go) come back as they were. */
    "DROP VIEW IF EXISTS payments;"
    "DROP VIEW IF EXISTS orders;"
    "CREATE TABLE resources_v2 ("
    " id TEXT NOT NULL,"
    " tenant_id INTEGER NOT NULL REFERENCES tenants (id),"
    " kind TEXT NOT NULL,"
    " status TEXT NOT NULL,"
    " body TEXT NOT NULL,"
    " provider_ref TEXT,"
    " created_at INTEGER NOT NULL,"
    " updated_at INTEGER NOT NULL,"
    " PRIMARY KEY (tenant_id, id)) WITHOUT ROWID;"
    "INSERT INTO resources_v2 (id, tenant_id, kind, status, body, provider_ref,"
    " created_at, updated_at) SELECT id, tenant_id, kind, status, body, provider_ref,"
    " created_at, updated_at FROM resources;"
    "CREATE TABLE outbox_v2 ("
    " resource_id TEXT NOT NULL,"
    " tenant_id INTEGER NOT NULL,"
    " operation TEXT NOT NULL,"
    " key TEXT NOT NULL,"
    " created_at INTEGER NOT NULL,"
    " attempts INTEGER NOT NULL DEFAULT 0,"
    " next_attempt_at INTEGER NOT NULL,"
    " PRIMARY KEY (tenant_id, resource_id),"
    " FOREIGN KEY (tenant_id, resource_id) REFERENCES resources_v2 (tenant_id, id))"
    " WITHOUT ROWID;"
    "INSERT INTO outbox_v2 (resource_id, tenant_id, operation, key, created_at, attempts,"
    " next_attempt_at) SELECT resource_id, tenant_id, operation, key, created_at,"
    " attempts, next_attempt_at FROM outbox;"
    "DROP TABLE outbox;"
    "DROP TABLE resources;"
    "ALTER TABLE resources_v2 RENAME TO resources;" /* the outbox's reference follows */
    "ALTER TABLE outbox_v2 RENAME TO outbox;"
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
    /* 4: refunds (docs/idempotency.md, section 4.5). A refund is a
     * resource of kind "refund" with an outbox row, as a payment is. A
     * payment keeps what its refunds have taken of it (succeeded and
     * pending: what the refunds' reservations check and add to) and what
     * its succeeded refunds add up to. Both start at 0, which is right
     * for every payment, whichever idemd wrote it: instances upgraded one
     * at a time need nothing rewritten. */
    "ALTER TABLE resources ADD COLUMN refund_taken INTEGER NOT NULL DEFAULT 0;"
    "ALTER TABLE resources ADD COLUMN refunded INTEGER NOT NULL DEFAULT 0;"
    "CREATE VIEW IF NOT EXISTS refunds AS SELECT id, tenant_id, status,"
    " json_extract(body, '$.payment_id') AS payment_id,"
    " json_extract(body, '$.amount') AS amount,"
    " json_extract(body, '$.currency') AS currency,"
    " json_extract(body, '$.reason') AS reason,"
    " provider_ref, created_at, updated_at FROM resources WHERE kind = 'refund';",
    /* 5: the audit trail (data/audit.h), one row per state change of a
     * payment, refund or order, appended in the change's transaction;
     * `seq` keeps the order of rows of one millisecond. A new table:
     * nothing else changes. */
    "CREATE TABLE audit ("
    " seq INTEGER PRIMARY KEY,"
    " created_at INTEGER NOT NULL,"
    " tenant_id INTEGER NOT NULL,"
    " resource_id TEXT NOT NULL,"
    " from_status TEXT,"
    " to_status TEXT NOT NULL,"
    " actor TEXT NOT NULL,"
    " reason TEXT);"
    "CREATE INDEX audit_resource ON audit (tenant_id, resource_id);",
    /* 6: the provider's events applied (data/events.h): an event's id is
     * written in the transaction that applies it, under this key, so a
     * second delivery finds it and changes nothing. */
    "CREATE TABLE processed_events ("
    " event_id TEXT PRIMARY KEY,"
    " type TEXT NOT NULL,"
    " tenant_id INTEGER NOT NULL,"
    " resource_id TEXT NOT NULL,"
    " received_at INTEGER NOT NULL) WITHOUT ROWID;",
};

static const char *const pg_versions[] = {
    "CREATE TABLE IF NOT EXISTS tenants ("
    " id BIGSERIAL PRIMARY KEY,"
    " name TEXT NOT NULL UNIQUE,"
    " key_lookup TEXT NOT NULL UNIQUE,"
    " key_hash TEXT NOT NULL,"
    " disabled INTEGER NOT NULL DEFAULT 0,"
    " created_at BIGINT NOT NULL);"
    "CREATE TABLE IF NOT EXISTS resources ("
    " id TEXT PRIMARY KEY,"
    " tenant_id BIGINT NOT NULL REFERENCES tenants (id),"
    " kind TEXT NOT NULL,"
    " status TEXT NOT NULL,"
    " body TEXT NOT NULL,"
    " provider_ref TEXT,"
    " created_at BIGINT NOT NULL,"
    " updated_at BIGINT NOT NULL);"
    "CREATE TABLE IF NOT EXISTS outbox ("
    " resource_id TEXT PRIMARY KEY REFERENCES resources (id),"
    " tenant_id BIGINT NOT NULL,"
    " operation TEXT NOT NULL,"
    " key TEXT NOT NULL,"
    " created_at BIGINT NOT NULL,"
    " attempts INTEGER NOT NULL DEFAULT 0,"
    " next_attempt_at BIGINT NOT NULL);"
    /* PostgreSQL has no CREATE VIEW IF NOT EXISTS; OR REPLACE would
     * replace an operator's own view of that name. */
    "DO $$ BEGIN"
    " IF to_regclass('payments') IS NULL THEN"
    "  CREATE VIEW payments AS SELECT id, tenant_id, status,"
    "  (body::jsonb ->> 'amount')::bigint AS amount,"
    "  body::jsonb ->> 'currency' AS currency,"
    "  body::jsonb ->> 'order_id' AS order_id,"
    "  provider_ref, created_at, updated_at FROM resources"
    "  WHERE kind = 'payment';"
    " END IF;"
    " IF to_regclass('orders') IS NULL THEN"
    "  CREATE VIEW orders AS SELECT id, tenant_id, status,"
    "  body::jsonb ->> 'customer_id' AS customer_id,"
    "  (body::jsonb ->> 'total')::bigint AS total,"
    "  body::jsonb ->> 'currency' AS currency,"
    "  created_at, updated_at FROM resources WHERE kind = 'order';"
    " END IF;"
    " END $$;",
    /* 2: as SQLite's version 2, the key columns dropped in place. */
    "CREATE TABLE api_keys ("
    " id BIGSERIAL PRIMARY KEY,"
    " tenant_id BIGINT NOT NULL REFERENCES tenants (id),"
    " name TEXT NOT NULL,"
    " key_lookup TEXT NOT NULL UNIQUE,"
    " key_hash TEXT NOT NULL,"
    " created_at BIGINT NOT NULL,"
    " last_used_at BIGINT,"
    " revoked_at BIGINT);"
    "CREATE UNIQUE INDEX api_keys_name ON api_keys (tenant_id, name)"
    " WHERE revoked_at IS NULL;"
    "INSERT INTO api_keys (tenant_id, name, key_lookup, key_hash, created_at)"
    " SELECT id, 'default', key_lookup, key_hash, created_at FROM tenants ORDER BY id;"
    "ALTER TABLE tenants DROP COLUMN key_lookup, DROP COLUMN key_hash;",
    /* 3: as SQLite's 3, the key of resources is (tenant_id, id) and the
     * outbox refers to a resource by both; the constraints keep the names
     * PostgreSQL gave version 1's (and libidem's) keys. Nothing is
     * rewritten; the keys' indexes are built again, with both tables
     * locked until the migration commits. */
    "ALTER TABLE outbox DROP CONSTRAINT outbox_resource_id_fkey;"
    "ALTER TABLE outbox DROP CONSTRAINT outbox_pkey;"
    "ALTER TABLE resources DROP CONSTRAINT resources_pkey;"
    "ALTER TABLE resources ADD CONSTRAINT resources_pkey PRIMARY KEY (tenant_id, id);"
    "ALTER TABLE outbox ADD CONSTRAINT outbox_pkey PRIMARY KEY (tenant_id, resource_id);"
    "ALTER TABLE outbox ADD CONSTRAINT outbox_resource_id_fkey FOREIGN KEY"
    " (tenant_id, resource_id) REFERENCES resources (tenant_id, id);",
    /* 4: as SQLite's 4; adding columns with a constant default rewrites
     * nothing. */
    "ALTER TABLE resources ADD COLUMN refund_taken BIGINT NOT NULL DEFAULT 0,"
    " ADD COLUMN refunded BIGINT NOT NULL DEFAULT 0;"
    "DO $$ BEGIN"
    " IF to_regclass('refunds') IS NULL THEN"
    "  CREATE VIEW refunds AS SELECT id, tenant_id, status,"
    "  body::jsonb ->> 'payment_id' AS payment_id,"
    "  (body::jsonb ->> 'amount')::bigint AS amount,"
    "  body::jsonb ->> 'currency' AS currency,"
    "  body::jsonb ->> 'reason' AS reason,"
    "  provider_ref, created_at, updated_at FROM resources WHERE kind = 'refund';"
    " END IF;"
    " END $$;",
    /* 5: as SQLite's 5. */
    "CREATE TABLE audit ("
    " seq BIGSERIAL PRIMARY KEY,"
    " created_at BIGINT NOT NULL,"
    " tenant_id BIGINT NOT NULL,"
    " resource_id TEXT NOT NULL,"
    " from_status TEXT,"
    " to_status TEXT NOT NULL,"
    " actor TEXT NOT NULL,"
    " reason TEXT);"
    "CREATE INDEX audit_resource ON audit (tenant_id, resource_id);",
    /* 6: as SQLite's 6. */
    "CREATE TABLE processed_events ("
    " event_id TEXT PRIMARY KEY,"
    " type TEXT NOT NULL,"
    " tenant_id BIGINT NOT NULL,"
    " resource_id TEXT NOT NULL,"
    " received_at BIGINT NOT NULL);",
};

_Static_assert(sizeof sqlite_versions / sizeof *sqlite_versions == IDEMD_SCHEMA_VERSION,
               "a SQLite entry per version");
_Static_assert(sizeof pg_versions / sizeof *pg_versions == IDEMD_SCHEMA_VERSION,
               "a PostgreSQL entry per version");

/* Several instances migrating at once on PostgreSQL take turns on this
 * key (pg_advisory_xact_lock), held until the migration commits. */
#define MIGRATE_LOCK "5216104431"

static const char version_sql[] = "SELECT coalesce(max(version), 0) FROM idemd_schema";

struct migration {
  int version; /* found */
  char *err;
  size_t errlen;
};

static int got_version(void *arg, const char *const *cols) {
  *(int *)arg = cols[0] ? atoi(cols[0]) : 0;
  return IDEM_OK;
}

/* SQLite's version 2 makes tenants again: an index or trigger of an
 * operator's on it would silently go with the old table, and a view or
 * trigger that names it would read the new one, without the key columns.
 * Version 3 makes resources and outbox again, with the same risks (idemd's
 * own views are dropped and made again by the version itself). Such
 * objects stop the migration, by name, before anything changes.
 * (PostgreSQL refuses to drop a column or key that a view or another
 * table depends on, by itself.) */
static const struct {
  int version;
  const char *tables; /* as the message names them */
  const char *sql;
} sqlite_checks[] = {
    {2, "the table tenants",
     "SELECT group_concat(type || ' ' || name, ', ') FROM sqlite_schema "
     "WHERE type IN ('view', 'trigger', 'index') AND name NOT LIKE 'sqlite_autoindex_%' "
     "AND (tbl_name = 'tenants' OR (type <> 'index' AND sql LIKE '%tenants%'))"},
    {3, "the tables resources and outbox",
     "SELECT group_concat(type || ' ' || name, ', ') FROM sqlite_schema "
     "WHERE type IN ('view', 'trigger', 'index') AND name NOT LIKE 'sqlite_autoindex_%' "
     "AND name NOT IN ('payments', 'orders') AND (tbl_name IN ('resources', 'outbox') "
     "OR (type <> 'index' AND (sql LIKE '%resources%' OR sql LIKE '%outbox%')))"},
};

static int got_text(void *arg, const char *const *cols) {
  char **out = arg;
  free(*out);
  *out = cols[0] ? strdup(cols[0]) : NULL;
  return IDEM_OK;
}

/* IDEM_OK when nothing of an operator's stands in the way of version `v`. */
static int check_foreign_objects(struct migration *m, idem_tx_t *tx, int v) {
  for (size_t i = 0; idemd_sql_is_sqlite(tx) && i < sizeof sqlite_checks / sizeof *sqlite_checks; i++) {
    char *found = NULL;
    int rc;

    if (sqlite_checks[i].version != v)
      continue;
    rc = idemd_sql_run(tx, IDEMD_SQL_SCHEMA_CHECK, sqlite_checks[i].sql, NULL, 0, got_text,
                       &found, NULL);
    if (rc == IDEM_OK && found) {
      snprintf(m->err, m->errlen,
               "idemd's schema version %d copies %s; drop these objects first "
               "and make them again after the migration: %s",
               v, sqlite_checks[i].tables, found);
      rc = IDEM_ESCHEMA;
    } else if (rc != IDEM_OK) {
      snprintf(m->err, m->errlen, "cannot read the schema");
    }
    free(found);
    if (rc != IDEM_OK)
      return rc;
  }
  return IDEM_OK;
}

static int run_versions(struct migration *m, idem_tx_t *tx, const char *const *versions) {
  const int sqlite = idemd_sql_is_sqlite(tx);
  int rc;

  m->version = 0;
  if ((!sqlite &&
       (rc = idemd_sql_exec(tx, "SELECT pg_advisory_xact_lock(" MIGRATE_LOCK ")", m->err,
                            m->errlen)) != IDEM_OK) ||
      (rc = idemd_sql_exec(tx,
                           "CREATE TABLE IF NOT EXISTS idemd_schema "
                           "(version INTEGER NOT NULL)",
                           m->err, m->errlen)) != IDEM_OK)
    return rc;
  if ((rc = idemd_sql_run(tx, IDEMD_SQL_SCHEMA, version_sql, NULL, 0, got_version,
                          &m->version, NULL)) != IDEM_OK) {
    snprintf(m->err, m->errlen, "cannot read idemd's schema version");
    return rc;
  }
  if (m->version > IDEMD_SCHEMA_VERSION) {
    snprintf(m->err, m->errlen,
             "idemd's schema version %d is newer than this program's %d", m->version,
             IDEMD_SCHEMA_VERSION);
    return IDEM_ESCHEMA;
  }
  for (int v = m->version; v < IDEMD_SCHEMA_VERSION; v++) {
    char set[96];
    snprintf(set, sizeof set,
             "DELETE FROM idemd_schema; INSERT INTO idemd_schema VALUES (%d)", v + 1);
    if ((rc = check_foreign_objects(m, tx, v + 1)) != IDEM_OK ||
        (rc = idemd_sql_exec(tx, versions[v], m->err, m->errlen)) != IDEM_OK ||
        (rc = idemd_sql_exec(tx, set, m->err, m->errlen)) != IDEM_OK)
      return rc;
  }
  return IDEM_OK;
}

static int migrate_fn(void *arg, idem_tx_t *tx) {
  return run_versions(arg, tx, idemd_sql_is_sqlite(tx) ? sqlite_versions : pg_versions);
}

int idemd_schema_migrate(idem_store_t *store, char *err, size_t errlen) {
  char spare[256];
  struct migration m = {0, err ? err : spare, err ? errlen : sizeof spare};
  idem_effect_t e = {migrate_fn, &m};
  int rc;

  m.err[0] = '\0';
  rc = idem_store_write(store, &e);
  if (rc != IDEM_OK && m.err[0] == '\0')
    snprintf(m.err, m.errlen, "%s", idem_store_last_error());
  return rc;
}
