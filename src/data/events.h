/* The provider's events idemd has applied (docs/payments.md, "Webhooks"):
 * an event's id goes into the table `processed_events`, under a unique
 * key, in the same transaction as what the event changes (or, for an
 * event of another amount than the pending one's, as its audit row), so
 * that a second delivery of it finds it there (idemd_settle_claim(),
 * provider/settle.h) and changes nothing. */
#ifndef IDEMD_EVENTS_H
#define IDEMD_EVENTS_H

#include <stdint.h>

#include "idem/store.h"

/* An applied event, as an effect writes it. Borrowed. */
typedef struct idemd_event {
  const char *id;   /* "evt_..." */
  const char *type; /* "charge.succeeded", ... */
  int64_t tenant_id;
  const char *resource_id;
} idemd_event_t;

/* An effect's function with `arg` an idemd_event_t: records the event as
 * applied. IDEM_EEXIST when it was already (the whole write then rolls
 * back); IDEM_ESTORE on any other failure. */
int idemd_event_record(void *arg, idem_tx_t *tx);

#endif
