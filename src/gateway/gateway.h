/* `idemd gateway` (docs/gateway.md): the idempotency rules of
 * docs/idempotency.md, section 2, in front of an existing HTTP application.
 * Requests on the configured routes are decided by libidem's engine and
 * reach the upstream once per key; every other request is proxied
 * unchanged. This header holds what the gateway's files share: its
 * configuration, its routes and its running state. */
#ifndef IDEM_GATEWAY_H
#define IDEM_GATEWAY_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "idem/crypto.h"
#include "idem/engine.h"
#include "idem/record.h"
#include "idem/store.h"
#include "server/config.h"
#include "server/metrics.h"

#define GW_MAX_ROUTES 64
#define GW_MAX_REPLAY_HEADERS 16
#define GW_PATTERN_MAX 255

/* One keyed route: 'METHOD /pattern/{param}'. */
typedef struct gw_route {
  char method[16];
  char pattern[GW_PATTERN_MAX + 1];
  /* The record's operation: "METHOD /pattern" when it fits, else its
   * start and a hash of the whole (stable across restarts). */
  char operation[IDEM_OPERATION_MAX + 1];
} gw_route_t;

typedef struct gw_config {
  idemd_addr_t listen;       /* where clients connect */
  idemd_addr_t admin_listen; /* GET /healthz and /metrics of the gateway */
  char upstream[512];        /* http://HOST:PORT of the application */
  char db[1024];
  char scope_header[128];    /* its value's HMAC scopes the keys */
  char log_key_secret[256];  /* "" : generated once, kept in the db */
  int upstream_idempotent;   /* the upstream dedupes keys itself */
  int64_t upstream_timeout_ms;
  int64_t upstream_connect_timeout_ms;
  int64_t inflight_wait_ms;
  int64_t key_ttl_ms;
  int64_t lease_ms;
  int64_t db_timeout_ms;
  int64_t max_body;   /* bytes of a request body; beyond: 413 */
  int64_t max_answer; /* bytes of an upstream answer's body kept */
  int max_connections;
  gw_route_t routes[GW_MAX_ROUTES];
  int nroutes;
  char replay_headers[GW_MAX_REPLAY_HEADERS][64];
  int nreplay_headers;
} gw_config_t;

/* Fills `cfg` with the defaults (docs/gateway.md, "Flags"). */
void gw_config_defaults(gw_config_t *cfg);

/* Reads the IDEMD_GATEWAY_* variables, then the flags in argv[0..argc),
 * into `cfg` (flags win), and checks the whole (gw_config_check()).
 * Returns 0, or -1 with a message naming the flag or variable on `err`. */
int gw_config_parse(gw_config_t *cfg, int argc, char **argv, FILE *err);

/* Checks what no single flag can: --upstream given, --lease longer than
 * --upstream-timeout, --admin-listen apart from --listen. Returns 0, or
 * -1 with a message on `err`. */
int gw_config_check(const gw_config_t *cfg, FILE *err);

/* Prints the gateway's usage. */
void gw_config_usage(FILE *out);

/* Parses the route spec `spec` ('METHOD /pattern', segments either
 * literal or {name}) into `out`. Returns 0, or -1 when it is not one. */
int gw_route_parse(const char *spec, gw_route_t *out);

/* The keyed route among `cfg`'s that `method` and `path` (no query)
 * match, or NULL. */
const gw_route_t *gw_route_match(const gw_config_t *cfg, const char *method,
                                 const char *path);

/* The name of the secret, kept in the database, under which the
 * --scope-header value's HMAC gives a key's scope (docs/gateway.md,
 * "Scope"). */
#define GW_SCOPE_SECRET "gateway_scope_secret"

/* An HMAC keyed by the secret `name` kept in `store`'s database (made
 * there once, at random, and shared by every gateway on it), or by
 * `given` when it is not NULL or empty, into `*out` (free with
 * idem_hmac_free()). Returns IDEM_OK, or a store error or IDEM_ENOMEM. */
int gw_secret_mac(idem_store_t *store, const char *name, const char *given,
                  idem_hmac_t **out);

/* The scope number of the --scope-header value `value` (NULL: no such
 * header) under `scope_mac` (the GW_SCOPE_SECRET's): an HMAC of it, in
 * [2^62, 2^63) so it never meets a tenant id of idemd's, into `*out`.
 * Returns IDEM_OK or IDEM_ENOMEM. */
int gw_scope_number(const idem_hmac_t *scope_mac, const char *value, int64_t *out);

struct gw_upstream;

/* Counters of the gateway's own, beside idemd's request metrics. */
typedef struct gw_counters {
  atomic_uint_fast64_t upstream_not_sent;  /* refused before a byte went out */
  atomic_uint_fast64_t upstream_no_answer; /* sent, no answer: pending */
  atomic_uint_fast64_t answers_too_large;  /* answered, too large to keep */
  atomic_uint_fast64_t store_errors;
  atomic_uint_fast64_t resolved; /* pending records the resolver completed */
} gw_counters_t;

/* The running gateway. */
typedef struct gw {
  gw_config_t cfg;
  idem_store_t *store;
  idem_engine_t *engine;
  struct gw_upstream *upstream;
  struct idemd_workers *workers; /* run the steps that wait (PostgreSQL, the proxy) */
  int upstream_loop;             /* the upstream's I/O thread runs (keyed.c) */
  atomic_int handed_off;         /* connections suspended off their event thread */
  atomic_int draining;           /* stopping: a duplicate in flight waits no more */
  /* Set at SIGTERM: a keyed request not decided yet is answered 503 with
   * Retry-After before any reservation (gw_keyed()), so nothing new is
   * handed off while shutdown waits for `handed_off` to reach 0. */
  atomic_int stopping;
  atomic_int deciding; /* event threads inside the keyed flow right now */
  struct idemd_replay_cache *replays; /* ready replays of completed keys, or NULL */
  idem_hmac_t *scope_mac;  /* scopes keys by the --scope-header value */
  idem_hmac_t *key_id_mac; /* key ids in logs */
  idemd_metrics_t metrics;
  gw_counters_t counters;
} gw_t;

/* `idemd gateway FLAGS...`: serves until SIGTERM or SIGINT. Returns the
 * exit status: 0 after a clean stop, 1 when it cannot start, 2 for bad
 * flags. */
int gw_cmd_gateway(int argc, char **argv);

/* `idemd gateway pending [--db ...]`: prints the unsettled keys (pending,
 * or held by a gateway) with their route, key, attempts, creation, next
 * attempt and scope number. Returns 0, 1 when the store fails, 2 for bad
 * usage. */
int gw_cmd_pending(int argc, char **argv);

/* `idemd gateway resolve KEY --route R --status N [--body TEXT |
 * --body-file F] [--content-type T] --reason TEXT --operator NAME
 * [--scope N] [--key-ttl D] [--db ...]` (docs/gateway.md, "Resolving a
 * pending key"): completes the one unsettled record of KEY on route R
 * (in scope N) with that answer, audited. Returns 0 when it did; 1, with
 * nothing changed, when there is no such record, it is not pending, a
 * gateway holds it, or the store fails; 2 for bad usage. */
int gw_cmd_resolve(int argc, char **argv);

/* `idemd gateway audit [--key K] [--db ...]`: prints the gateway's audit
 * rows (of key K only), oldest first, as JSON lines. Returns 0, 1 when
 * the store fails, 2 for bad usage. */
int gw_cmd_audit(int argc, char **argv);

/* How long a completed key's replay stays in the replay cache (keyed.c):
 * until its record's `expires_at`, and where that is not this process's
 * clock (`local_clock` 0: PostgreSQL, set by another gateway or the
 * database) at most GW_REPLAY_KEEP_MS past `now_ms`, which bounds what a
 * skewed clock changes (docs/gateway.md, "Performance"). */
#define GW_REPLAY_KEEP_MS 60000
int64_t gw_replay_keep_until(int64_t expires_at, int64_t now_ms, int local_clock);

#endif
