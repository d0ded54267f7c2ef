/* Request counters and latency histograms by operation, as atomics: no
 * lock on the request path. Rendered in the Prometheus text format. */
#ifndef IDEMD_METRICS_H
#define IDEMD_METRICS_H

#include <stdatomic.h>
#include <stdint.h>

typedef enum idemd_op {
  OP_NONE = 0,
  OP_CREATE_PAYMENT,
  OP_CREATE_ORDER,
  OP_GET_PAYMENT,
  OP_GET_ORDER,
  OP_HEALTHZ,
  OP_METRICS,
  OP_READYZ,
  OP_CANCEL_ORDER,     /* POST /orders/{id}/cancel */
  OP_PUT_ORDER,        /* PUT /orders/{id} */
  OP_CREATE_REFUND,    /* POST /payments/{id}/refunds */
  OP_GET_REFUND,       /* GET /refunds/{id} */
  OP_PROVIDER_WEBHOOK, /* POST /webhooks/provider */
  OP_GATEWAY,          /* idemd gateway: a keyed route (docs/gateway.md) */
  OP_PROXY,            /* idemd gateway: any other request, proxied */
  OP_COUNT_
} idemd_op_t;

typedef enum idemd_outcome {
  OUTCOME_NONE = 0,
  OUTCOME_NEW,       /* executed for the first time */
  OUTCOME_REPLAY,    /* answered from the stored response */
  OUTCOME_MISMATCH,  /* key reused with a different request */
  OUTCOME_IN_FLIGHT, /* original still processing at the wait bound */
  OUTCOME_PENDING,   /* the provider's answer is not known yet */
  OUTCOME_INVALID,   /* rejected before anything was stored */
  OUTCOME_READ,      /* a read (GET) */
  OUTCOME_ERROR,     /* the server or its store failed */
  OUTCOME_COUNT_
} idemd_outcome_t;

/* What became of a provider's event (idem_webhooks_total{result}). */
typedef enum idemd_webhook_result {
  WEBHOOK_APPLIED = 0, /* settled a pending payment or refund */
  WEBHOOK_DUPLICATE,   /* applied before */
  WEBHOOK_IGNORED,     /* for nothing pending: settled already, or unknown */
  WEBHOOK_UNSIGNED,    /* no or malformed Idem-Psp-Signature */
  WEBHOOK_FORGED,      /* the signature does not match */
  WEBHOOK_STALE,       /* signed more than 5 minutes away from now */
  WEBHOOK_MALFORMED,   /* signed, but not an event idemd knows */
  WEBHOOK_TOO_LARGE,   /* body over the cap */
  WEBHOOK_BUSY,        /* being settled by idemd right now: retried later */
  WEBHOOK_ERROR,       /* the store failed */
  WEBHOOK_AMOUNT_MISMATCH, /* pending, but of another amount: audited, nothing
                            * changed (docs/idempotency.md, 4.6) */
  WEBHOOK_RESULT_COUNT_
} idemd_webhook_result_t;

/* "applied", "duplicate", ... */
const char *idemd_webhook_result_name(idemd_webhook_result_t r);

/* The latency histogram's upper bounds: 0.5 ms to 30 s (above the 10 s
 * provider deadline and the 5 s in-flight wait), then +Inf. */
#define IDEMD_LATENCY_BUCKETS 15

/* Half of a histogram: what the observations made in it add up to. The
 * buckets are not cumulative; the last one holds what is above the
 * largest bound. */
typedef struct idemd_hist_half {
  atomic_uint_fast64_t count; /* observations finished in this half */
  atomic_uint_fast64_t sum_us;
  atomic_uint_fast64_t buckets[IDEMD_LATENCY_BUCKETS + 1];
} idemd_hist_half_t;

/* One operation's latency histogram, written without a lock and read as
 * one snapshot (count, sum and buckets of the same observations), as
 * Prometheus' Go client does it: writers count themselves in
 * `started_hot` and add to its hot half; a reader makes the other half
 * hot, waits until the writers still in the old one are done, reads it,
 * then folds it into the new hot half. */
typedef struct idemd_histogram {
  atomic_uint_fast64_t started_hot; /* bit 63: the hot half; the rest: observations begun */
  idemd_hist_half_t half[2];
} idemd_histogram_t;

/* A histogram as read: buckets not cumulative; count is their total. */
typedef struct idemd_hist_snapshot {
  uint64_t count;
  uint64_t sum_us;
  uint64_t buckets[IDEMD_LATENCY_BUCKETS + 1];
} idemd_hist_snapshot_t;

/* All of idemd's own metrics. A zeroed struct is ready (idemd's is static). */
typedef struct idemd_metrics {
  atomic_uint_fast64_t requests[OP_COUNT_][OUTCOME_COUNT_];
  idemd_histogram_t latency[OP_COUNT_]; /* by operation, OP_NONE as "other" */
  atomic_int reading;                   /* one reader of the histograms at a time */
  atomic_uint_fast64_t store_errors;
  atomic_uint_fast64_t inflight_timeouts;
  atomic_uint_fast64_t reconcile_settled;
  atomic_uint_fast64_t records_swept;
  atomic_int_fast64_t reconcile_unresolved; /* left by the last pass */
  atomic_uint_fast64_t webhooks[WEBHOOK_RESULT_COUNT_];
} idemd_metrics_t;

/* The upper bound of latency bucket `i` (0 .. IDEMD_LATENCY_BUCKETS-1), in
 * microseconds. */
int64_t idemd_latency_bound_us(int i);

/* "create_payment", ... ; "other" for OP_NONE (no route matched). */
const char *idemd_op_name(idemd_op_t op);

/* "new", "replay", ... ; "none" for OUTCOME_NONE. */
const char *idemd_outcome_name(idemd_outcome_t outcome);

/* Counts one finished request, and its latency under its operation (a
 * negative latency counts as 0). Lock-free; any thread. An op or outcome
 * out of range is ignored. */
void idemd_metrics_request(idemd_metrics_t *m, idemd_op_t op,
                           idemd_outcome_t outcome, int64_t latency_us);

/* Reads the latency histogram of `op` as one snapshot into `out` (zeros
 * for an op out of range). Readers take turns (a spin lock, briefly
 * waiting for writers in flight); writers never wait. Any thread. */
void idemd_metrics_latency(idemd_metrics_t *m, idemd_op_t op, idemd_hist_snapshot_t *out);

/* Values read at scrape time from the store (-1 when it could not say)
 * and from the connection guard. */
typedef struct idemd_store_gauges {
  int64_t pending;
  int64_t processing;
  double oldest_pending_seconds; /* 0 when nothing is pending */
  uint64_t connections_cut;      /* counter: missed the request deadline */
  uint64_t connections_refused;  /* counter: beyond --max-connections */
  uint64_t store_commits;        /* counter: write transactions (syncs) */
  uint64_t store_writes;         /* counter: writes they carried */
  uint64_t store_batch_reruns;   /* counter: batches run again write by write */
  uint64_t replay_cache_hits;    /* counter: replays answered from memory */
  int64_t parked;                /* duplicates waiting without a thread */
  const char *store_backend;     /* idem_store_backend(): "sqlite", "postgresql" */
} idemd_store_gauges_t;

/* Renders all metrics, with the process's own (process_*, read from
 * /proc/self; left out where it cannot be read). Returns a malloc'd text
 * the caller frees, or NULL when out of memory. */
char *idemd_metrics_render(idemd_metrics_t *m, const idemd_store_gauges_t *g);

#endif
