/* Request counters and latency histogram, as relaxed atomics: no lock on
 * the request path. Rendered in the Prometheus text format. */
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

#define IDEMD_LATENCY_BUCKETS 12

typedef struct idemd_metrics {
  atomic_uint_fast64_t requests[OP_COUNT_][OUTCOME_COUNT_];
  atomic_uint_fast64_t latency_buckets[IDEMD_LATENCY_BUCKETS]; /* cumulative on render */
  atomic_uint_fast64_t latency_count;
  atomic_uint_fast64_t latency_sum_us;
  atomic_uint_fast64_t store_errors;
  atomic_uint_fast64_t inflight_timeouts;
  atomic_uint_fast64_t reconcile_settled;
  atomic_uint_fast64_t records_swept;
  atomic_int_fast64_t reconcile_unresolved; /* left by the last pass */
} idemd_metrics_t;

/* "create_payment", ... ; "other" for OP_NONE (no route matched). */
const char *idemd_op_name(idemd_op_t op);

/* "new", "replay", ... ; "none" for OUTCOME_NONE. */
const char *idemd_outcome_name(idemd_outcome_t outcome);

/* Counts one finished request. */
void idemd_metrics_request(idemd_metrics_t *m, idemd_op_t op,
                           idemd_outcome_t outcome, int64_t latency_us);

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

/* Renders all metrics. Returns a malloc'd text the caller frees, or NULL
 * when out of memory. */
char *idemd_metrics_render(idemd_metrics_t *m, const idemd_store_gauges_t *g);

#endif
