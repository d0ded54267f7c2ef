/* idemd's commands: opening the store the same way for each, serving with
 * a clean shutdown on SIGTERM/SIGINT, and the administrative commands. */
#include "server/commands.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "idem/clock.h"
#include "idem/crypto.h"
#include "server/log.h"
#include "server/server.h"
#include "server/sweeper.h"

/* Opens and migrates the store named by the configuration. Store messages
 * go to stderr here: this is the operator's terminal, not an HTTP body. */
idem_store_t *idemd_open_store(const idemd_config_t *cfg) {
  idem_store_t *store = NULL;
  int rc = idem_store_open(cfg->db, NULL, &store);
  if (rc != IDEM_OK) {
    fprintf(stderr, "idemd: cannot open database: %s (%s)\n", idem_strerror(rc),
            idem_store_last_error());
    return NULL;
  }
  rc = idem_store_migrate(store);
  if (rc != IDEM_OK) {
    fprintf(stderr, "idemd: cannot migrate database: %s (%s)\n",
            idem_strerror(rc), idem_store_last_error());
    idem_store_close(store);
    return NULL;
  }
  return store;
}

/* The HMAC key for key ids in logs: from --log-key-secret, or generated on
 * first start and kept in the database, so every instance and restart
 * derives the same ids. */
static int load_log_secret(idemd_server_t *srv) {
  unsigned char raw[32];
  char hex[65];
  char *secret = NULL;
  int rc;

  if (srv->cfg.log_key_secret[0])
    return idem_sha256(srv->cfg.log_key_secret, strlen(srv->cfg.log_key_secret),
                       srv->log_secret);
  if (idem_random_bytes(raw, sizeof raw) != IDEM_OK)
    return IDEM_ECRYPTO;
  idem_hex(raw, sizeof raw, hex);
  rc = idem_store_meta_get_or_put(srv->store, "log_key_secret", hex, &secret);
  if (rc != IDEM_OK)
    return rc;
  rc = idem_sha256(secret, strlen(secret), srv->log_secret);
  free(secret);
  return rc;
}

static idem_provider_t *open_provider(const idemd_config_t *cfg) {
  idem_sandbox_options_t sandbox = {
      .delay_ms = cfg->sandbox_delay_ms,
      .decline_amount = cfg->sandbox_decline_amount,
      .uncertain_amount = cfg->sandbox_uncertain_amount,
      .unavailable_amount = cfg->sandbox_unavailable_amount,
  };
  if (strcmp(cfg->provider, "sandbox") == 0)
    return idem_sandbox_new(&sandbox);
  return idem_http_provider_new(cfg->provider, cfg->provider_connect_timeout_ms,
                                cfg->provider_timeout_ms);
}

static void on_reconcile_event(void *ctx, idem_reconcile_event_t ev,
                               const idem_record_t *rec, int status) {
  idemd_server_t *srv = ctx;
  char num[16];
  snprintf(num, sizeof num, "%d", status);
  if (ev == IDEM_RECONCILE_SETTLED)
    atomic_fetch_add_explicit(&srv->metrics.reconcile_settled, 1, memory_order_relaxed);
  if (ev == IDEM_RECONCILE_ERROR)
    atomic_fetch_add_explicit(&srv->metrics.store_errors, 1, memory_order_relaxed);
  idemd_log_event(ev == IDEM_RECONCILE_ERROR ? "error" : "info",
                  ev == IDEM_RECONCILE_SETTLED     ? "payment settled"
                  : ev == IDEM_RECONCILE_UNRESOLVED ? "payment still pending"
                                                    : "reconcile failed",
                  "payment", rec->resource_id, "operation", rec->operation,
                  "status", num, "detail",
                  ev == IDEM_RECONCILE_ERROR ? idem_store_last_error() : NULL, NULL);
}

static void on_reconcile_pass(void *ctx, int settled, int unresolved) {
  idemd_server_t *srv = ctx;
  (void)settled;
  atomic_store_explicit(&srv->metrics.reconcile_unresolved, unresolved,
                        memory_order_relaxed);
}

int idemd_cmd_serve(const idemd_config_t *cfg) {
  static idemd_server_t srv; /* big (metrics), lives for the process */
  char listen[128], port[16];
  sigset_t stop;
  int sig = 0, rc;

  srv.cfg = *cfg;
  idemd_log_set_level(cfg->log_level);
  if ((srv.store = idemd_open_store(cfg)) == NULL)
    return 1;
  if ((rc = load_log_secret(&srv)) != IDEM_OK) {
    fprintf(stderr, "idemd: cannot load the log secret: %s\n", idem_strerror(rc));
    idem_store_close(srv.store);
    return 1;
  }
  if ((srv.provider = open_provider(cfg)) == NULL) {
    fprintf(stderr, "idemd: cannot set up the provider '%s'\n", cfg->provider);
    idem_store_close(srv.store);
    return 1;
  }

  /* Block the stop signals before MHD starts its threads, so they inherit
   * the mask and only this thread receives them (in sigwait). */
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, NULL);
  signal(SIGPIPE, SIG_IGN);

  if (idemd_http_start(&srv) != 0) {
    srv.provider->close(srv.provider);
    idem_store_close(srv.store);
    return 1;
  }
  idem_reconciler_options_t ropts = {
      .interval_ms = cfg->reconcile_interval_ms,
      .lease_ms = cfg->lease_ms,
      .ttl_ms = cfg->key_ttl_ms,
      .batch = 64,
      .on_event = on_reconcile_event,
      .on_pass = on_reconcile_pass,
      .ctx = &srv,
  };
  if ((srv.reconciler = idem_reconciler_start(srv.store, srv.provider, &ropts)) == NULL) {
    fprintf(stderr, "idemd: cannot start the reconciler\n");
    idemd_http_stop(&srv, 0);
    srv.provider->close(srv.provider);
    idem_store_close(srv.store);
    return 1;
  }
  if (idemd_sweeper_start(&srv) != 0) {
    fprintf(stderr, "idemd: cannot start the sweeper\n");
    idem_reconciler_stop(srv.reconciler);
    idemd_http_stop(&srv, 0);
    srv.provider->close(srv.provider);
    idem_store_close(srv.store);
    return 1;
  }
  snprintf(listen, sizeof listen, "%s:%d", cfg->listen_host, cfg->listen_port);
  snprintf(port, sizeof port, "%d", cfg->threads);
  idemd_log_event("info", "listening", "listen", listen, "store",
                  idem_store_backend(srv.store), "provider", srv.provider->name,
                  "threads", port, NULL);

  sigwait(&stop, &sig);
  idemd_log_event("info", "shutting down", "signal",
                  sig == SIGTERM ? "SIGTERM" : "SIGINT", NULL);
  int cut = idemd_http_stop(&srv, cfg->shutdown_timeout_ms);
  if (cut > 0) {
    char n[16];
    snprintf(n, sizeof n, "%d", cut);
    idemd_log_event("warn", "requests cut off at the shutdown bound", "requests", n, NULL);
  }
  idemd_sweeper_stop(&srv);
  idem_reconciler_stop(srv.reconciler);
  srv.provider->close(srv.provider);
  idem_store_close(srv.store);
  idemd_log_event("info", "stopped", NULL);
  return 0;
}

int idemd_cmd_migrate(const idemd_config_t *cfg) {
  idem_store_t *store = idemd_open_store(cfg);
  if (store == NULL)
    return 1;
  idem_store_close(store);
  fprintf(stderr, "idemd: schema is up to date\n");
  return 0;
}

int idemd_cmd_sweep(const idemd_config_t *cfg) {
  idem_store_t *store = idemd_open_store(cfg);
  long long total = 0;
  int rc;

  if (store == NULL)
    return 1;
  rc = idemd_sweep_now(store, cfg->sweep_batch, 1 << 30, &total);
  idem_store_close(store);
  if (rc != IDEM_OK) {
    fprintf(stderr, "idemd: sweep failed: %s (%s)\n", idem_strerror(rc),
            idem_store_last_error());
    return 1;
  }
  printf("%lld\n", total);
  return 0;
}
