/* idemd's own tables beside libidem's records: tenants and their API keys,
 * resources (payments, orders and refunds), the outbox, the audit trail
 * of their state changes, the provider's events applied, and the
 * operators' views over them (payments,
 * orders, refunds). Their versions are counted in idemd's table
 * `idemd_schema`, apart from libidem's, on SQLite and PostgreSQL alike. */
#ifndef IDEMD_SCHEMA_H
#define IDEMD_SCHEMA_H

#include <stddef.h>

#include "idem/store.h"

/* The version idemd_schema_migrate() brings a database to. */
#define IDEMD_SCHEMA_VERSION 6

/* Creates or upgrades idemd's tables to IDEMD_SCHEMA_VERSION, in one write
 * (several idemd starting at once on PostgreSQL take turns). Idempotent.
 * A database whose tables libidem's versions 1 to 4 made (every idemd
 * before these were its own) keeps them as they are, rows and all. Returns
 * IDEM_OK; IDEM_ESCHEMA when the database is newer than this program;
 * IDEM_ESTORE or another store error; `err` (may be NULL) gets why. */
int idemd_schema_migrate(idem_store_t *store, char *err, size_t errlen);

#endif
