/* The reconciler: a background thread that settles payments and refunds
 * whose outcome is unknown (pending) and takes over those whose worker
 * died (a processing record with an expired lease). It looks each up at
 * the provider by its provider key, sends it again under that same key
 * when the provider never saw it, and completes the record so that replays answer
 * 201 or 402. It acts on a record only through the owner token its claim
 * gave it, so a slow original worker and the reconciler never both write. */
#ifndef IDEM_RECONCILER_H
#define IDEM_RECONCILER_H

#include <stdint.h>

#include "idem/store.h"
#include "provider/provider.h"

typedef struct idem_reconciler idem_reconciler_t;

/* What one pass did; passed to the event callback after each record. */
typedef enum idem_reconcile_event {
  IDEM_RECONCILE_SETTLED = 1, /* completed as succeeded or declined */
  IDEM_RECONCILE_UNRESOLVED,  /* still unknown; stays pending */
  IDEM_RECONCILE_ERROR        /* the store failed or the payment is unreadable */
} idem_reconcile_event_t;

typedef struct idem_reconciler_options {
  int64_t interval_ms; /* between passes */
  int64_t lease_ms;    /* how long a claim keeps a record */
  /* The longest one provider call may take (--provider-timeout): a call is
   * started only while the claim's lease outlives it, so that no call of
   * the reconciler is still under way once another owner (an operator,
   * a webhook, the next pass) can take the record over. 0: lease_ms. */
  int64_t call_ms;
  int64_t ttl_ms;      /* lifetime of records it completes */
  int batch;           /* records per pass at most */
  /* Optional: told about each record handled (for logs and metrics);
   * `status` is the HTTP status replays will get. */
  void (*on_event)(void *ctx, idem_reconcile_event_t ev,
                   const idem_record_t *rec, int status);
  /* Optional: told at the end of each pass how many records it left
   * unresolved. */
  void (*on_pass)(void *ctx, int settled, int unresolved);
  void *ctx;
} idem_reconciler_options_t;

/* Runs one pass now, in the calling thread. Returns IDEM_OK or the store
 * error that stopped the pass; `*settled` and `*unresolved` (may be NULL)
 * get the counts. */
int idem_reconcile_once(idem_store_t *store, idem_provider_t *provider,
                        const idem_reconciler_options_t *opts, int *settled,
                        int *unresolved);

/* Starts the thread; returns NULL when it cannot. The store and provider
 * must outlive it. */
idem_reconciler_t *idem_reconciler_start(idem_store_t *store,
                                         idem_provider_t *provider,
                                         const idem_reconciler_options_t *opts);

/* Stops the thread (finishing the record in hand) and frees it. */
void idem_reconciler_stop(idem_reconciler_t *r);

#endif
