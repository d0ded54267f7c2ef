/* idemd's configuration: every setting has a flag, an IDEMD_* environment
 * variable and a default that runs with no flags at all. */
#ifndef IDEMD_CONFIG_H
#define IDEMD_CONFIG_H

#include <stdint.h>
#include <stdio.h>

/* A host (a name or an address, as getaddrinfo() takes it) and a port. */
typedef struct idemd_addr {
  char host[64];
  int port; /* 0: the kernel picks one */
} idemd_addr_t;

typedef struct idemd_config {
  idemd_addr_t listen;
  idemd_addr_t metrics_listen; /* host "": off (GET /metrics on `listen`) */
  char tls_cert[1024];         /* PEM files; both "" or both set */
  char tls_key[1024];
  char db[1024];
  char provider[256];
  char provider_idempotency[4]; /* "on": the provider dedupes keys; "off" */
  int threads;                /* event threads; 0: one fewer than the cores */
  int workers;                /* threads for requests that wait */
  int active_workers;         /* of them, at work at once; 0: 4 per core */
  int max_connections;        /* served at once; beyond: 503 */
  int max_header_bytes;       /* request line and headers, per connection */
  int64_t request_timeout_ms; /* to receive a whole request */
  int64_t inflight_wait_ms; /* bound on waiting for an in-flight duplicate */
  int64_t key_ttl_ms;       /* lifetime of completed and failed records */
  int64_t lease_ms;         /* how long a processing owner holds its record */
  int64_t ready_timeout_ms; /* /readyz: how long writes may hang */
  int64_t db_timeout_ms;    /* PostgreSQL: bound on a database that hangs */
  int64_t provider_connect_timeout_ms;
  int64_t provider_timeout_ms; /* total deadline of one provider call */
  int64_t reconcile_interval_ms;
  int64_t shutdown_timeout_ms; /* bound on finishing requests at SIGTERM */
  int64_t replay_cache_bytes;  /* memory for replays of completed records; 0: none */
  int64_t sweep_interval_ms;   /* how often expired records are deleted */
  int sweep_batch;             /* records per delete transaction */
  char log_level[8];           /* debug, info, warn, error */
  char log_key_secret[256];    /* HMAC key for key ids; empty: kept in the db */
  char provider_webhook_secret[256]; /* the provider's events' key; empty: no
                                        POST /webhooks/provider */
  int64_t sandbox_delay_ms; /* the sandbox provider's added latency */
  int64_t sandbox_decline_amount;     /* declined (402); 0: none */
  int64_t sandbox_uncertain_amount;   /* charged, answer lost (pending) */
  int64_t sandbox_unavailable_amount; /* provider unreachable (failed) */
} idemd_config_t;

/* Fills `cfg` with the defaults. */
void idemd_config_defaults(idemd_config_t *cfg);

/* Applies IDEMD_* environment variables, then the flags in argv[0..argc)
 * (flags win). Unknown flags and invalid values are errors: a message
 * naming the flag goes to `err` and the result is -1. Returns the number of
 * arguments consumed (positional arguments stop the scan) on success. */
int idemd_config_parse(idemd_config_t *cfg, int argc, char **argv, FILE *err);

/* Parses a duration: a number with an optional unit ms, s, m or h (no unit
 * means seconds). Returns 0 and sets `*ms`, or -1. */
int idemd_parse_duration(const char *s, int64_t *ms);

/* Parses HOST:PORT (a port from 0 to 65535) into `a`. Returns 0, or -1
 * and `a` unchanged. */
int idemd_parse_listen(const char *v, idemd_addr_t *a);

/* Prints the flags, their variables and defaults. */
void idemd_config_usage(FILE *out);

#endif
