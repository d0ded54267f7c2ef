/* Bringing a whole idemd up and down: store, log secret, provider, HTTP,
 * reconciler and sweeper, in that order, and back in reverse. Used by
 * `idemd serve` and by anything that runs idemd in process (fuzzers); the
 * store is opened here for every other command too. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/schema.h"
#include "idem/crypto.h"
#include "server/flow.h"
#include "server/log.h"
#include "server/replay_cache.h"
#include "server/server.h"
#include "server/readiness.h"
#include "server/sweeper.h"
#include "util/ticker.h"

/* Opens the store named by the configuration and migrates libidem's
 * tables, then idemd's. Store messages
 * go to stderr here: this is the operator's terminal, not an HTTP body. */
idem_store_t *idemd_open_store(const idemd_config_t *cfg) {
  idem_store_t *store = NULL;
  char why[512];
  /* A database that hangs answers 503 within the bound
   * (docs/operations.md, "When PostgreSQL hangs"). */
  idem_store_options_t opts = {.db_timeout_ms = (int)cfg->db_timeout_ms};
  int rc = idem_store_open(cfg->db, &opts, &store);
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
  rc = idemd_schema_migrate(store, why, sizeof why);
  if (rc != IDEM_OK) {
    fprintf(stderr, "idemd: cannot migrate idemd's tables: %s (%s)\n",
            idem_strerror(rc), why);
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

/* How often the API keys' last uses are written (data/tenants.h): the
 * delay `idemd tenant key list` may show them with. */
#define KEY_USES_MS 10000

static void flush_key_uses(void *arg) {
  idemd_server_t *srv = arg;
  (void)idemd_keys_flush(srv->tenants);
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
                                cfg->provider_timeout_ms,
                                strcmp(cfg->provider_idempotency, "off") != 0);
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
  int refund = strcmp(rec->operation, "create_refund") == 0;
  idemd_log_event(ev == IDEM_RECONCILE_ERROR ? "error" : "info",
                  ev == IDEM_RECONCILE_SETTLED
                      ? (refund ? "refund settled" : "payment settled")
                  : ev == IDEM_RECONCILE_UNRESOLVED
                      ? (refund ? "refund still pending" : "payment still pending")
                      : "reconcile failed",
                  refund ? "refund" : "payment", rec->resource_id, "operation", rec->operation,
                  "status", num, "detail",
                  ev == IDEM_RECONCILE_ERROR ? idem_store_last_error() : NULL, NULL);
}

static void on_reconcile_pass(void *ctx, int settled, int unresolved) {
  idemd_server_t *srv = ctx;
  (void)settled;
  atomic_store_explicit(&srv->metrics.reconcile_unresolved, unresolved,
                        memory_order_relaxed);
}

int idemd_server_start(idemd_server_t *srv, const idemd_config_t *cfg) {
  char listen[128], metrics[128], threads[16], workers[16], active[16];
  int rc;

  srv->cfg = *cfg;
  idemd_log_set_level(cfg->log_level);
  if ((srv->store = idemd_open_store(cfg)) == NULL)
    return -1;
  if (idemd_tenants_open(srv->store, &srv->tenants) != IDEM_OK) {
    fprintf(stderr, "idemd: out of memory\n");
    goto close_store;
  }
  if ((rc = load_log_secret(srv)) != IDEM_OK) {
    fprintf(stderr, "idemd: cannot load the log secret: %s\n", idem_strerror(rc));
    goto close_store;
  }
  if ((srv->key_id_mac = idem_hmac_new(srv->log_secret, sizeof srv->log_secret)) == NULL) {
    fprintf(stderr, "idemd: cannot prepare the key-id HMAC\n");
    goto close_store;
  }
  if (cfg->provider_webhook_secret[0] &&
      (srv->webhook_mac = idem_hmac_new(cfg->provider_webhook_secret,
                                        strlen(cfg->provider_webhook_secret))) == NULL) {
    fprintf(stderr, "idemd: cannot prepare the webhook secret\n");
    goto close_store;
  }
  if ((srv->engine = idemd_flow_engine(srv)) == NULL) {
    fprintf(stderr, "idemd: out of memory\n");
    goto close_store;
  }
  /* NULL when sized 0: every replay then reads the store. */
  srv->replays = idemd_replay_cache_new((size_t)cfg->replay_cache_bytes);
  if ((srv->provider = open_provider(cfg)) == NULL) {
    fprintf(stderr, "idemd: cannot set up the provider '%s'\n", cfg->provider);
    goto close_store;
  }
  if (idemd_http_start(srv) != 0)
    goto close_provider;
  idem_reconciler_options_t ropts = {
      .interval_ms = cfg->reconcile_interval_ms,
      .lease_ms = cfg->lease_ms,
      .call_ms = cfg->provider_timeout_ms,
      .ttl_ms = cfg->key_ttl_ms,
      .batch = 64,
      .on_event = on_reconcile_event,
      .on_pass = on_reconcile_pass,
      .ctx = srv,
  };
  if ((srv->reconciler = idem_reconciler_start(srv->store, srv->provider, &ropts)) == NULL) {
    fprintf(stderr, "idemd: cannot start the reconciler\n");
    goto stop_http;
  }
  if (idemd_sweeper_start(srv) != 0) {
    fprintf(stderr, "idemd: cannot start the sweeper\n");
    goto stop_reconciler;
  }
  if (idemd_readiness_start(srv) != 0) {
    fprintf(stderr, "idemd: cannot start the store probe\n");
    idemd_sweeper_stop(srv);
    goto stop_reconciler;
  }
  if ((srv->key_uses = idem__ticker_start(KEY_USES_MS, flush_key_uses, srv)) == NULL) {
    fprintf(stderr, "idemd: cannot start the API keys' writer\n");
    idemd_readiness_stop(srv);
    idemd_sweeper_stop(srv);
    goto stop_reconciler;
  }
  snprintf(listen, sizeof listen, "%s:%d", cfg->listen.host, srv->port);
  snprintf(metrics, sizeof metrics, "%s:%d", cfg->metrics_listen.host, srv->metrics_port);
  snprintf(threads, sizeof threads, "%d", cfg->threads);
  snprintf(workers, sizeof workers, "%d", cfg->workers);
  snprintf(active, sizeof active, "%d", cfg->active_workers);
  idemd_log_event("info", "listening", "listen", listen, "store",
                  idem_store_backend(srv->store), "provider", srv->provider->name,
                  "threads", threads, "workers", workers, "active_workers", active,
                  "tls", cfg->tls_cert[0] ? "on" : "off", "metrics_listen",
                  cfg->metrics_listen.host[0] ? metrics : NULL, NULL);
  return 0;

stop_reconciler:
  idem_reconciler_stop(srv->reconciler);
stop_http:
  idemd_http_drain(srv, 0);
  idemd_http_stop(srv);
close_provider:
  srv->provider->close(srv->provider);
close_store:
  idem_engine_free(srv->engine);
  idemd_replay_cache_free(srv->replays);
  idem_hmac_free(srv->key_id_mac);
  idem_hmac_free(srv->webhook_mac);
  idemd_tenants_close(srv->tenants);
  idem_store_close(srv->store);
  return -1;
}

int idemd_server_drain(idemd_server_t *srv) {
  return idemd_http_drain(srv, srv->cfg.shutdown_timeout_ms);
}

void idemd_server_stop(idemd_server_t *srv) {
  idemd_http_stop(srv);
  idem__ticker_stop(srv->key_uses);
  idemd_readiness_stop(srv);
  idemd_sweeper_stop(srv);
  idem_reconciler_stop(srv->reconciler);
  srv->provider->close(srv->provider);
  idem_engine_free(srv->engine);
  idemd_replay_cache_free(srv->replays);
  idem_hmac_free(srv->key_id_mac);
  idem_hmac_free(srv->webhook_mac);
  idemd_tenants_close(srv->tenants); /* the keys' last uses written */
  idem_store_close(srv->store);
  idemd_log_event("info", "stopped", NULL);
}
