/* The provider's events applied, on either store (see events.h). */
#include "data/events.h"

#include "data/sql.h"

static const char record_sql[] =
    "INSERT INTO processed_events (event_id, type, tenant_id, resource_id, received_at) "
    "VALUES ($1, $2, $3, $4, $5)";

int idemd_event_record(void *arg, idem_tx_t *tx) {
  const idemd_event_t *e = arg;
  idemd_sql_param_t p[5] = {IDEMD_SQL_TEXT(e->id), IDEMD_SQL_TEXT(e->type),
                            IDEMD_SQL_NUM(e->tenant_id), IDEMD_SQL_TEXT(e->resource_id),
                            IDEMD_SQL_NUM(idem_tx_now_ms(tx))};
  return idemd_sql_run(tx, IDEMD_SQL_EVENT_INSERT, record_sql, p, 5, NULL, NULL, NULL);
}
