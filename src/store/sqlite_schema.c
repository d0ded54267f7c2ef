/* The SQLite store's schema: its versions, applied in order by
 * migrate_to() in one write transaction (a new database is made at the
 * latest at once), PRAGMA user_version counting those applied, and the check that stops a version that rebuilds tables an
 * operator's own views, triggers or indexes depend on. */
#include "sqlite_impl.h"

#include <stdio.h>

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
    /* 5: from here tenants, resources, the outbox and the views over them
     * are idemd's, made and counted by idemd itself (its own idemd_schema
     * table); a database made at this version holds only meta and the
     * records (`fresh`, below). Nothing changes in one made before. */
    "",
};

#define SCHEMA_VERSION ((int)(sizeof migrations / sizeof *migrations))

/* A new database, made at SCHEMA_VERSION at once: what the versions above
 * leave of libidem's own tables. test_sqlite_schema checks that it is what
 * they leave. */
static const char fresh[] =
    "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL) "
    "WITHOUT ROWID;"
    "CREATE TABLE idempotency_records ("
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
    "CREATE INDEX records_expiry ON idempotency_records (expires_at) "
    "WHERE expires_at IS NOT NULL;"
    "CREATE INDEX records_unsettled ON idempotency_records (state, created_at) "
    "WHERE state = 'processing' OR state = 'pending';";

/* Schema objects of idem's own that versions 3 and 4 may drop and make
 * again. */
#define OWN_OBJECTS                                                           \
  "'payments', 'orders', 'records_expiry', 'records_open', "                  \
  "'records_unsettled'"

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
    rc = idem__sqlite_fail(db, sqlite3_errcode(db), "read schema");
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

  if ((rc = idem__sqlite_conn_get(s, &c)) != IDEM_OK)
    return rc;
  if ((rc = idem__sqlite_write_begin(s, c)) != IDEM_OK) {
    idem__sqlite_conn_put(s, c);
    return rc;
  }
  if (sqlite3_prepare_v2(c->db, "PRAGMA user_version", -1, &st, NULL) == SQLITE_OK &&
      sqlite3_step(st) == SQLITE_ROW)
    version = sqlite3_column_int(st, 0);
  else
    rc = idem__sqlite_fail(c->db, sqlite3_errcode(c->db), "read schema version");
  sqlite3_finalize(st);

  if (rc == IDEM_OK && version > SCHEMA_VERSION) {
    idem__store_set_error("schema version %d is newer than this program's %d",
                          version, SCHEMA_VERSION);
    rc = IDEM_ESCHEMA;
  }
  if (rc == IDEM_OK && version == 0 && target == SCHEMA_VERSION) {
    char pragma[64];
    snprintf(pragma, sizeof pragma, "PRAGMA user_version = %d", SCHEMA_VERSION);
    if (idem__sqlite_exec(c->db, fresh) != SQLITE_OK ||
        idem__sqlite_exec(c->db, pragma) != SQLITE_OK)
      rc = IDEM_ESTORE;
    version = target;
  }
  for (int v = version; rc == IDEM_OK && v < target; v++) {
    char pragma[64];
    snprintf(pragma, sizeof pragma, "PRAGMA user_version = %d", v + 1);
    if ((rc = check_foreign_objects(c->db, v + 1)) != IDEM_OK)
      break;
    if (idem__sqlite_exec(c->db, migrations[v]) != SQLITE_OK ||
        idem__sqlite_exec(c->db, pragma) != SQLITE_OK)
      rc = IDEM_ESTORE;
  }
  int end = idem__sqlite_write_end(s, c, rc == IDEM_OK);
  if (rc == IDEM_OK)
    rc = end;
  /* Statements prepared before the schema existed are stale: drop them. */
  for (int i = 0; i < ST_COUNT_; i++) {
    sqlite3_finalize(c->st[i]);
    c->st[i] = NULL;
  }
  idem__sqlite_conn_put(s, c);
  return rc;
}

int idem__sqlite_migrate(idem_store_t *base) {
  return migrate_to((sqlite_store_t *)base, SCHEMA_VERSION);
}

int idem__sqlite_migrate_to(idem_store_t *store, int version) {
  if (version < 0 || version > SCHEMA_VERSION)
    return IDEM_EINVAL;
  return migrate_to((sqlite_store_t *)store, version);
}
