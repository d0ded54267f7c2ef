/* The probe thread and the readiness decision (see readiness.h). */
#include "server/readiness.h"

#include "idem/clock.h"
#include "server/log.h"
#include "util/ticker.h"

#define PROBE_INTERVAL_MS 1000

const char *idemd_not_ready(idemd_server_t *srv) {
  idem_store_health_t h;
  int64_t now = idem_mono_ms();

  if (atomic_load(&srv->draining))
    return "shutting down";
  idem_store_health(srv->store, &h);
  if (h.writing > 0 && now - h.progress_ms > srv->cfg.ready_timeout_ms)
    return "writes are not finishing";
  if (h.failing)
    return "writes are failing";
  return NULL;
}

/* Each second without a write of records ending: one of the store's own
 * (idem_store_health() does not count the reconciler's writes, which a
 * lock on the records table lets through: docs/operations.md, "When
 * PostgreSQL hangs"). A write under way already tells (it ends, or it
 * does not). */
static void probe(void *arg) {
  idemd_server_t *srv = arg;
  idem_store_health_t h;
  int rc;

  idem_store_health(srv->store, &h);
  if (h.writing > 0 || (h.progress_ms != 0 && idem_mono_ms() - h.progress_ms < PROBE_INTERVAL_MS))
    return;
  if ((rc = idem_store_probe(srv->store)) != IDEM_OK && rc != IDEM_ENOTSUP)
    idemd_log_event("warn", "store probe failed", "error", idem_err_name(rc), "detail",
                    idem_store_last_error(), NULL);
}

int idemd_readiness_start(idemd_server_t *srv) {
  srv->prober = idem__ticker_start(PROBE_INTERVAL_MS, probe, srv);
  return srv->prober ? 0 : -1;
}

void idemd_readiness_stop(idemd_server_t *srv) {
  idem__ticker_stop(srv->prober);
  srv->prober = NULL;
}
