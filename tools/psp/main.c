/* idem-psp: a payment-provider simulator with fault injection, standing in for
 * a real provider in the tests of idem (docs/idempotency.md, sections 4 and 6).
 * Parses the configuration, opens the store, serves until SIGTERM or SIGINT.
 *
 * Exit status: 0 after a signal, 1 when the database or the socket cannot
 * be opened, 2 for bad usage, 3 for a simulated crash (--crash-after). */
#include <curl/curl.h>
#include <openssl/rand.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "idem_version.h"
#include "psp.h"

/* A seed for --chaos when none was given; logged, so a run can be replayed. */
static uint64_t fresh_seed(void) {
  uint64_t seed;
  if (RAND_bytes((unsigned char *)&seed, sizeof seed) != 1)
    seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
  return seed;
}

static void log_start(const psp_config_t *cfg) {
  char faults[160], listen[300], seed[24];
  json_t *declines = json_array();

  psp_faults_describe(&cfg->faults, faults, sizeof faults);
  snprintf(listen, sizeof listen, strchr(cfg->listen_host, ':') ? "[%s]:%d" : "%s:%d",
           cfg->listen_host, cfg->listen_port);
  /* The seed as a string: JSON readers lose 64-bit integers. */
  snprintf(seed, sizeof seed, "%llu", (unsigned long long)cfg->seed);
  for (int i = 0; i < cfg->ndecline; i++)
    json_array_append_new(declines, json_integer(cfg->decline_amounts[i]));
  /* The webhook secret is never logged. */
  psp_log(json_pack("{s:s, s:s, s:s, s:s, s:o, s:f, s:s, s:b, s:s?, s:f}", "event",
                    "listening", "listen", listen, "db", cfg->db, "faults", faults,
                    "decline_amounts", declines, "chaos", cfg->chaos, "seed", seed,
                    "ignore_idempotency_key", cfg->ignore_key,
                    "webhook_url", cfg->webhook_url[0] ? cfg->webhook_url : NULL,
                    "webhook_duplicates", cfg->webhook_duplicates));
}

int main(int argc, char **argv) {
  psp_config_t cfg;
  psp_store_t *store;
  psp_server_t *srv = NULL;
  psp_webhooks_t *webhooks = NULL;
  sigset_t stop_signals;
  char err[512];
  int rc, sig;

  rc = psp_config_load(&cfg, argc, argv, err, sizeof err);
  if (rc == PSP_HELP) {
    psp_usage(stdout);
    return 0;
  }
  if (rc == PSP_VERSION) {
    printf("idem-psp %s\n", IDEM_VERSION_STRING);
    return 0;
  }
  if (rc != PSP_RUN) {
    fprintf(stderr, "idem-psp: %s\n", err);
    return 2;
  }
  if (!cfg.seed_set)
    cfg.seed = fresh_seed();
  psp_chaos_seed(cfg.seed);

  /* Block the stop signals before any thread starts, so that all of them
   * inherit the mask and only sigwait() below sees the signals. */
  signal(SIGPIPE, SIG_IGN);
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, NULL);

  if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
    fprintf(stderr, "idem-psp: cannot initialise libcurl\n");
    return 1;
  }
  store = psp_store_open(cfg.db, err, sizeof err);
  if (store == NULL) {
    fprintf(stderr, "idem-psp: %s\n", err);
    return 1;
  }
  if (cfg.webhook_url[0] &&
      (webhooks = psp_webhooks_start(&cfg, err, sizeof err)) == NULL) {
    fprintf(stderr, "idem-psp: %s\n", err);
    psp_store_close(store);
    return 1;
  }
  rc = psp_server_start(&cfg, store, webhooks, &srv, err, sizeof err);
  if (rc != 0) {
    fprintf(stderr, "idem-psp: %s\n", err);
    psp_webhooks_stop(webhooks);
    psp_store_close(store);
    return rc == PSP_START_BAD_ADDRESS ? 2 : 1;
  }
  log_start(&cfg);
  while (sigwait(&stop_signals, &sig) != 0)
    ;
  psp_log(json_pack("{s:s, s:s}", "event", "stopping", "signal",
                    sig == SIGTERM ? "SIGTERM" : "SIGINT"));
  /* The server first: no charge is made, so no event queued, after it. */
  psp_server_stop(srv);
  psp_webhooks_stop(webhooks);
  psp_store_close(store);
  curl_global_cleanup();
  return 0;
}
