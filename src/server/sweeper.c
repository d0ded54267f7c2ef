/* The sweeper thread (see sweeper.h). */
#include "server/sweeper.h"

#include <stdio.h>

#include "idem/clock.h"
#include "server/log.h"
#include "util/ticker.h"

int idemd_sweep_now(idem_store_t *store, int batch, int max_batches,
                    long long *deleted) {
  int n = 0, rc = IDEM_OK;
  *deleted = 0;
  for (int i = 0; i < max_batches; i++) {
    rc = idem_store_sweep(store, idem_now_ms(), batch, &n);
    if (rc != IDEM_OK)
      break;
    *deleted += n;
    if (n < batch)
      break;
  }
  return rc;
}

static void pass(void *arg) {
  idemd_server_t *srv = arg;
  long long deleted = 0;
  char num[24];
  /* A bounded pass: a huge backlog is cleared over several intervals
   * rather than in one long burst of write transactions. */
  int rc = idemd_sweep_now(srv->store, srv->cfg.sweep_batch, 100, &deleted);

  atomic_fetch_add_explicit(&srv->metrics.records_swept, (uint_fast64_t)deleted,
                            memory_order_relaxed);
  if (rc != IDEM_OK) {
    atomic_fetch_add_explicit(&srv->metrics.store_errors, 1, memory_order_relaxed);
    idemd_log_event("error", "sweep failed", "error", idem_err_name(rc), "detail",
                    idem_store_last_error(), NULL);
  } else if (deleted > 0) {
    snprintf(num, sizeof num, "%lld", deleted);
    idemd_log_event("info", "expired records deleted", "records", num, NULL);
  }
}

int idemd_sweeper_start(idemd_server_t *srv) {
  srv->sweeper = idem__ticker_start(srv->cfg.sweep_interval_ms, pass, srv);
  return srv->sweeper ? 0 : -1;
}

void idemd_sweeper_stop(idemd_server_t *srv) {
  idem__ticker_stop(srv->sweeper);
  srv->sweeper = NULL;
}
