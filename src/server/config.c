/* Flags and IDEMD_* variables for idemd, with validation at start-up so a
 * bad value is a clear error rather than a crash later. */
#include "server/config.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "idem/record.h"

enum kind { K_LISTEN, K_TEXT, K_INT, K_DURATION };

struct option {
  const char *flag;
  const char *env;
  enum kind kind;
  size_t offset;
  size_t size;
  long long min, max; /* for K_INT and K_DURATION (ms) */
  const char *def;
  const char *help;
};

#define OFF(f) offsetof(idemd_config_t, f), sizeof(((idemd_config_t *)0)->f)

static const struct option options[] = {
    {"--listen", "IDEMD_LISTEN", K_LISTEN, OFF(listen), 0, 0, "127.0.0.1:8080",
     "address and port to listen on"},
    {"--metrics-listen", "IDEMD_METRICS_LISTEN", K_LISTEN, OFF(metrics_listen), 0, 0,
     "(off)",
     "address and port for GET /metrics (then not on --listen), "
     "/healthz and /readyz; plain HTTP"},
    {"--tls-cert", "IDEMD_TLS_CERT", K_TEXT, OFF(tls_cert), 0, 0, "(none)",
     "PEM certificate (chain) file: HTTPS on --listen, with --tls-key"},
    {"--tls-key", "IDEMD_TLS_KEY", K_TEXT, OFF(tls_key), 0, 0, "(none)",
     "PEM private key file of --tls-cert"},
    {"--db", "IDEMD_DB", K_TEXT, OFF(db), 0, 0, "./idem.db",
     "SQLite file (or postgresql:// URL)"},
    {"--provider", "IDEMD_PROVIDER", K_TEXT, OFF(provider), 0, 0, "sandbox",
     "payment provider: sandbox, or http://HOST:PORT"},
    {"--provider-idempotency", "IDEMD_PROVIDER_IDEMPOTENCY", K_TEXT,
     OFF(provider_idempotency), 0, 0, "on",
     "off: the provider ignores Idempotency-Key; look up by reference before "
     "any second send"},
    {"--provider-connect-timeout", "IDEMD_PROVIDER_CONNECT_TIMEOUT", K_DURATION,
     OFF(provider_connect_timeout_ms), 1, 600000, "2s",
     "deadline to connect to the provider"},
    {"--provider-timeout", "IDEMD_PROVIDER_TIMEOUT", K_DURATION, OFF(provider_timeout_ms),
     1, 600000, "10s",
     "deadline of a whole provider call; past it the payment is pending"},
    {"--reconcile-interval", "IDEMD_RECONCILE_INTERVAL", K_DURATION,
     OFF(reconcile_interval_ms), 10, 3600000, "2s",
     "how often the reconciler settles pending payments"},
    {"--threads", "IDEMD_THREADS", K_INT, OFF(threads), 0, 1024, "0",
     "HTTP event threads; 0: one fewer than the cores (at least one)"},
    {"--workers", "IDEMD_WORKERS", K_INT, OFF(workers), 1, 4096, "128",
     "threads for requests that wait (commits, provider calls, duplicates)"},
    {"--active-workers", "IDEMD_ACTIVE_WORKERS", K_INT, OFF(active_workers), 0, 4096, "0",
     "workers at work at once, those waiting on a provider or a duplicate "
     "not counted; 0: four per core"},
    {"--max-connections", "IDEMD_MAX_CONNECTIONS", K_INT, OFF(max_connections), 1, 100000,
     "1000", "connections served at once; beyond it, 503"},
    {"--max-header-bytes", "IDEMD_MAX_HEADER_BYTES", K_INT, OFF(max_header_bytes), 4096,
     1048576, "8192", "memory for one request's line and headers (else 431)"},
    {"--request-timeout", "IDEMD_REQUEST_TIMEOUT", K_DURATION, OFF(request_timeout_ms),
     100, 3600000, "10s", "time a client has to send a whole request"},
    {"--inflight-wait", "IDEMD_INFLIGHT_WAIT", K_DURATION, OFF(inflight_wait_ms), 0,
     600000, "5s", "how long a duplicate waits for its in-flight original"},
    {"--key-ttl", "IDEMD_KEY_TTL", K_DURATION, OFF(key_ttl_ms), 1,
     (long long)365 * 86400 * 1000, "24h",
     "how long completed and failed keys are remembered"},
    {"--lease", "IDEMD_LEASE", K_DURATION, OFF(lease_ms), 100, 86400000, "30s",
     "how long a worker owns a processing record"},
    {"--db-timeout", "IDEMD_DB_TIMEOUT", K_DURATION, OFF(db_timeout_ms), 100, 600000,
     "5s",
     "PostgreSQL: bound on each statement, lock wait, connect and pool wait; "
     "a call with no answer in twice it fails (503)"},
    {"--ready-timeout", "IDEMD_READY_TIMEOUT", K_DURATION, OFF(ready_timeout_ms), 100,
     600000, "2s", "/readyz: how long a write may go unfinished before 503"},
    {"--shutdown-timeout", "IDEMD_SHUTDOWN_TIMEOUT", K_DURATION, OFF(shutdown_timeout_ms),
     0, 3600000, "10s", "on SIGTERM, how long requests in flight may take to finish"},
    {"--replay-cache-bytes", "IDEMD_REPLAY_CACHE_BYTES", K_INT, OFF(replay_cache_bytes),
     0, (long long)1 << 40, "16777216",
     "memory for answering replays without the store (0: off)"},
    {"--sweep-interval", "IDEMD_SWEEP_INTERVAL", K_DURATION, OFF(sweep_interval_ms), 100,
     86400000, "1m", "how often expired records are deleted"},
    {"--sweep-batch", "IDEMD_SWEEP_BATCH", K_INT, OFF(sweep_batch), 1, 100000, "500",
     "expired records deleted per transaction"},
    {"--log-level", "IDEMD_LOG_LEVEL", K_TEXT, OFF(log_level), 0, 0, "info",
     "debug, info (one line per request), warn or error"},
    {"--log-key-secret", "IDEMD_LOG_KEY_SECRET", K_TEXT, OFF(log_key_secret), 0, 0,
     "(kept in the db)", "secret for the key ids in logs; default: generated once"},
    {"--provider-webhook-secret", "IDEMD_PROVIDER_WEBHOOK_SECRET", K_TEXT,
     OFF(provider_webhook_secret), 0, 0, "(off)",
     "secret the provider signs its events with; without it POST /webhooks/provider "
     "is 404"},
    {"--sandbox-delay", "IDEMD_SANDBOX_DELAY", K_DURATION, OFF(sandbox_delay_ms), 0,
     600000, "0", "added latency of the sandbox provider"},
    {"--sandbox-decline-amount", "IDEMD_SANDBOX_DECLINE_AMOUNT", K_INT,
     OFF(sandbox_decline_amount), 0, 9007199254740991LL, "0",
     "the sandbox declines payments of this amount (0: none)"},
    {"--sandbox-uncertain-amount", "IDEMD_SANDBOX_UNCERTAIN_AMOUNT", K_INT,
     OFF(sandbox_uncertain_amount), 0, 9007199254740991LL, "0",
     "the sandbox charges this amount but its answer is lost (0: none)"},
    {"--sandbox-unavailable-amount", "IDEMD_SANDBOX_UNAVAILABLE_AMOUNT", K_INT,
     OFF(sandbox_unavailable_amount), 0, 9007199254740991LL, "0",
     "the sandbox is unreachable for this amount (0: none)"},
};

#define NOPTIONS (sizeof options / sizeof *options)

int idemd_parse_duration(const char *s, int64_t *ms) {
  char *end;
  long long v;
  long long mult = 1000;

  if (s == NULL || *s < '0' || *s > '9')
    return -1;
  errno = 0;
  v = strtoll(s, &end, 10);
  if (errno != 0 || v < 0)
    return -1;
  if (*end == '\0' || strcmp(end, "s") == 0)
    mult = 1000;
  else if (strcmp(end, "ms") == 0)
    mult = 1;
  else if (strcmp(end, "m") == 0)
    mult = 60000;
  else if (strcmp(end, "h") == 0)
    mult = 3600000;
  else
    return -1;
  if (v > LLONG_MAX / mult)
    return -1;
  *ms = v * mult;
  return 0;
}

/* HOST:PORT, for --listen and --metrics-listen. */
static int set_listen(idemd_addr_t *a, const char *v) {
  const char *colon = strrchr(v, ':');
  char *end;
  long port;
  size_t hostlen;

  if (colon == NULL || colon == v)
    return -1;
  hostlen = (size_t)(colon - v);
  if (hostlen >= sizeof a->host)
    return -1;
  errno = 0;
  port = strtol(colon + 1, &end, 10);
  if (errno || *end || colon[1] == '\0' || port < 0 || port > 65535)
    return -1;
  memcpy(a->host, v, hostlen);
  a->host[hostlen] = '\0';
  a->port = (int)port;
  return 0;
}

int idemd_parse_listen(const char *v, idemd_addr_t *a) { return set_listen(a, v); }

static int set_option(idemd_config_t *cfg, const struct option *o, const char *v) {
  char *field = (char *)cfg + o->offset;
  switch (o->kind) {
  case K_LISTEN:
    return set_listen((idemd_addr_t *)field, v);
  case K_TEXT:
    if (v[0] == '\0')
      return -1;
    return idem_copy(field, o->size, v);
  case K_INT: {
    char *end;
    long long n;
    errno = 0;
    n = strtoll(v, &end, 10);
    if (errno || *end || v[0] == '\0' || n < o->min || n > o->max)
      return -1;
    if (o->size == sizeof(int))
      *(int *)field = (int)n;
    else
      *(int64_t *)field = n;
    return 0;
  }
  case K_DURATION: {
    int64_t ms;
    if (idemd_parse_duration(v, &ms) != 0 || ms < o->min || ms > o->max)
      return -1;
    *(int64_t *)field = ms;
    return 0;
  }
  }
  return -1;
}

void idemd_config_defaults(idemd_config_t *cfg) {
  memset(cfg, 0, sizeof *cfg);
  for (size_t i = 0; i < NOPTIONS; i++)
    if (options[i].def[0] != '(') /* "(...)" describes a computed default */
      (void)set_option(cfg, &options[i], options[i].def);
}

static int bad_value(FILE *err, const char *name, const char *v) {
  fprintf(err, "idemd: invalid value for %s: '%s' (see idemd --help)\n", name, v);
  return -1;
}

int idemd_config_parse(idemd_config_t *cfg, int argc, char **argv, FILE *err) {
  int i;

  for (size_t k = 0; k < NOPTIONS; k++) {
    const char *v = getenv(options[k].env);
    if (v && set_option(cfg, &options[k], v) != 0)
      return bad_value(err, options[k].env, v);
  }
  for (i = 0; i < argc; i++) {
    const char *arg = argv[i];
    const struct option *o = NULL;
    const char *v = NULL;
    size_t n;

    if (strncmp(arg, "--", 2) != 0)
      break;
    for (size_t k = 0; k < NOPTIONS && !o; k++) {
      n = strlen(options[k].flag);
      if (strncmp(arg, options[k].flag, n) == 0 && (arg[n] == '\0' || arg[n] == '=')) {
        o = &options[k];
        v = arg[n] == '=' ? arg + n + 1 : NULL;
      }
    }
    if (o == NULL) {
      fprintf(err, "idemd: unknown option '%s' (see idemd --help)\n", arg);
      return -1;
    }
    if (v == NULL) {
      if (i + 1 >= argc) {
        fprintf(err, "idemd: option %s needs a value\n", o->flag);
        return -1;
      }
      v = argv[++i];
    }
    if (set_option(cfg, o, v) != 0)
      return bad_value(err, o->flag, v);
  }
  if (strcmp(cfg->log_level, "debug") != 0 && strcmp(cfg->log_level, "info") != 0 &&
      strcmp(cfg->log_level, "warn") != 0 && strcmp(cfg->log_level, "error") != 0)
    return bad_value(err, "--log-level", cfg->log_level);
  if (strcmp(cfg->provider, "sandbox") != 0 &&
      strncmp(cfg->provider, "http://", 7) != 0 &&
      strncmp(cfg->provider, "https://", 8) != 0)
    return bad_value(err, "--provider", cfg->provider);
  if (strcmp(cfg->provider_idempotency, "on") != 0 &&
      strcmp(cfg->provider_idempotency, "off") != 0)
    return bad_value(err, "--provider-idempotency", cfg->provider_idempotency);
  if ((cfg->tls_cert[0] == '\0') != (cfg->tls_key[0] == '\0')) {
    fprintf(err, "idemd: --tls-cert and --tls-key go together: %s was given alone\n",
            cfg->tls_cert[0] ? "--tls-cert" : "--tls-key");
    return -1;
  }
  if (cfg->metrics_listen.host[0] && cfg->metrics_listen.port != 0 &&
      cfg->metrics_listen.port == cfg->listen.port &&
      strcmp(cfg->metrics_listen.host, cfg->listen.host) == 0) {
    fprintf(err, "idemd: --metrics-listen must differ from --listen (%s:%d)\n",
            cfg->listen.host, cfg->listen.port);
    return -1;
  }
  if (cfg->lease_ms <= cfg->provider_timeout_ms) {
    /* Otherwise the reconciler could take over a worker still waiting for
     * the provider: harmless (same provider key) but wasteful. */
    fprintf(err, "idemd: --lease (%lldms) must be longer than --provider-timeout (%lldms)\n",
            (long long)cfg->lease_ms, (long long)cfg->provider_timeout_ms);
    return -1;
  }
  return i;
}

void idemd_config_usage(FILE *out) {
  fprintf(out,
          "usage: idemd [serve] [options]\n"
          "       idemd tenant create|rotate|disable|enable NAME [--db ...]\n"
          "       idemd tenant list [--db ...]\n"
          "       idemd tenant key add|revoke NAME KEYNAME [--db ...]\n"
          "       idemd tenant key list NAME [--db ...]\n"
          "       idemd records --tenant NAME [--state pending|processing|completed|failed]\n"
          "                     [--older-than DURATION] [--limit N] [--db ...]\n"
          "       idemd records show --tenant NAME --operation OP --key KEY [--db ...]\n"
          "       idemd payments|refunds resolve ID --as succeeded|declined --reason TEXT\n"
          "             --operator NAME [--tenant NAME] [--db ...]\n"
          "       idemd audit --tenant NAME [--resource ID] [--db ...]\n"
          "       idemd migrate [--db ...]\n"
          "       idemd sweep [--db ...]\n"
          "       idemd gateway --upstream URL --route 'METHOD /pattern' ... (idemd gateway --help)\n"
          "       idemd --help | --version\n\n"
          "options (each also read from its environment variable):\n");
  for (size_t i = 0; i < NOPTIONS; i++)
    fprintf(out, "  %-26s %-30s %s (default: %s)\n", options[i].flag,
            options[i].env, options[i].help, options[i].def);
  fprintf(out, "\nDurations take a unit: 500ms, 5s, 10m, 24h (no unit: seconds).\n");
}
