/* Prometheus metrics of idemd: atomics bumped per request, rendered on
 * GET /metrics. */
#include "server/metrics.h"

#include "idem_version.h"

#include <stdio.h>
#include <stdlib.h>

/* Requests that match no route count as "other". */
static const char *const op_names[OP_COUNT_] = {
    "other", "create_payment", "create_order", "get_payment",
    "get_order", "healthz", "metrics"};

static const char *const outcome_names[OUTCOME_COUNT_] = {
    "none", "new", "replay", "mismatch", "in_flight",
    "pending", "invalid", "read", "error"};

static const int64_t bucket_us[IDEMD_LATENCY_BUCKETS] = {
    500, 1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000, 500000,
    1000000, 2500000};

const char *idemd_op_name(idemd_op_t op) {
  return (unsigned)op < OP_COUNT_ ? op_names[op] : "none";
}

const char *idemd_outcome_name(idemd_outcome_t o) {
  return (unsigned)o < OUTCOME_COUNT_ ? outcome_names[o] : "none";
}

void idemd_metrics_request(idemd_metrics_t *m, idemd_op_t op,
                           idemd_outcome_t outcome, int64_t latency_us) {
  if ((unsigned)op >= OP_COUNT_ || (unsigned)outcome >= OUTCOME_COUNT_)
    return;
  atomic_fetch_add_explicit(&m->requests[op][outcome], 1, memory_order_relaxed);
  if (latency_us < 0)
    latency_us = 0;
  for (int i = 0; i < IDEMD_LATENCY_BUCKETS; i++) {
    if (latency_us <= bucket_us[i]) {
      atomic_fetch_add_explicit(&m->latency_buckets[i], 1, memory_order_relaxed);
      break;
    }
  }
  atomic_fetch_add_explicit(&m->latency_count, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&m->latency_sum_us, (uint_fast64_t)latency_us,
                            memory_order_relaxed);
}

#define LOAD(x) ((unsigned long long)atomic_load_explicit(&(x), memory_order_relaxed))

char *idemd_metrics_render(idemd_metrics_t *m, const idemd_store_gauges_t *g) {
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  unsigned long long cumulative = 0;

  if (f == NULL)
    return NULL;
  /* The version as --version prints it, split as Prometheus' own
   * build_info metrics are: the release, and the git revision ("" when
   * not built from a git checkout). */
  fprintf(f, "# HELP idem_build_info idemd's version, git revision and store backend; "
             "always 1.\n# TYPE idem_build_info gauge\n"
             "idem_build_info{version=\"%s\",revision=\"%s\",store=\"%s\"} 1\n",
          IDEM_VERSION, IDEM_REVISION, g->store_backend ? g->store_backend : "");
  fprintf(f, "# HELP idem_requests_total Requests answered, by operation and "
             "idempotency outcome.\n# TYPE idem_requests_total counter\n");
  for (int op = 0; op < OP_COUNT_; op++)
    for (int o = 1; o < OUTCOME_COUNT_; o++) {
      unsigned long long n = LOAD(m->requests[op][o]);
      if (n > 0 || op == OP_CREATE_PAYMENT || op == OP_CREATE_ORDER)
        fprintf(f, "idem_requests_total{operation=\"%s\",outcome=\"%s\"} %llu\n",
                op_names[op], outcome_names[o], n);
    }
  fprintf(f, "# HELP idem_request_duration_seconds Time from request to answer.\n"
             "# TYPE idem_request_duration_seconds histogram\n");
  for (int i = 0; i < IDEMD_LATENCY_BUCKETS; i++) {
    cumulative += LOAD(m->latency_buckets[i]);
    fprintf(f, "idem_request_duration_seconds_bucket{le=\"%g\"} %llu\n",
            (double)bucket_us[i] / 1e6, cumulative);
  }
  fprintf(f, "idem_request_duration_seconds_bucket{le=\"+Inf\"} %llu\n",
          LOAD(m->latency_count));
  fprintf(f, "idem_request_duration_seconds_sum %.6f\n",
          (double)LOAD(m->latency_sum_us) / 1e6);
  fprintf(f, "idem_request_duration_seconds_count %llu\n", LOAD(m->latency_count));
  fprintf(f, "# HELP idem_store_errors_total Store operations that failed.\n"
             "# TYPE idem_store_errors_total counter\nidem_store_errors_total %llu\n",
          LOAD(m->store_errors));
  fprintf(f, "# HELP idem_inflight_timeouts_total Duplicates that reached the wait "
             "bound while their original was processing (answered 409).\n"
             "# TYPE idem_inflight_timeouts_total counter\n"
             "idem_inflight_timeouts_total %llu\n",
          LOAD(m->inflight_timeouts));
  fprintf(f, "# HELP idem_inflight_parked Duplicates waiting for their original "
             "without holding a thread.\n# TYPE idem_inflight_parked gauge\n"
             "idem_inflight_parked %lld\n",
          (long long)g->parked);
  fprintf(f, "# HELP idem_reconcile_settled_total Payments the reconciler settled.\n"
             "# TYPE idem_reconcile_settled_total counter\n"
             "idem_reconcile_settled_total %llu\n",
          LOAD(m->reconcile_settled));
  fprintf(f, "# HELP idem_reconcile_unresolved Payments the last reconciler pass "
             "could not settle.\n# TYPE idem_reconcile_unresolved gauge\n"
             "idem_reconcile_unresolved %lld\n",
          (long long)atomic_load_explicit(&m->reconcile_unresolved, memory_order_relaxed));
  fprintf(f, "# HELP idem_records_swept_total Expired records deleted by the sweeper.\n"
             "# TYPE idem_records_swept_total counter\nidem_records_swept_total %llu\n",
          LOAD(m->records_swept));
  fprintf(f, "# HELP idem_connections_cut_total Connections closed because their "
             "request did not arrive within --request-timeout.\n"
             "# TYPE idem_connections_cut_total counter\nidem_connections_cut_total %llu\n",
          (unsigned long long)g->connections_cut);
  fprintf(f, "# HELP idem_connections_refused_total Requests answered 503 because "
             "--max-connections was reached.\n"
             "# TYPE idem_connections_refused_total counter\n"
             "idem_connections_refused_total %llu\n",
          (unsigned long long)g->connections_refused);
  fprintf(f, "# HELP idem_store_commits_total Write transactions committed, each "
             "one sync to disk (SQLite group commit).\n"
             "# TYPE idem_store_commits_total counter\nidem_store_commits_total %llu\n",
          (unsigned long long)g->store_commits);
  fprintf(f, "# HELP idem_store_writes_total Writes carried by those transactions; "
             "writes / commits is the mean group-commit batch.\n"
             "# TYPE idem_store_writes_total counter\nidem_store_writes_total %llu\n",
          (unsigned long long)g->store_writes);
  fprintf(f, "# HELP idem_store_batch_reruns_total Batches rolled back because one "
             "write failed, then run again with each write on its own.\n"
             "# TYPE idem_store_batch_reruns_total counter\n"
             "idem_store_batch_reruns_total %llu\n",
          (unsigned long long)g->store_batch_reruns);
  fprintf(f, "# HELP idem_replay_cache_hits_total Replays (and mismatches) answered "
             "from memory, without the store.\n"
             "# TYPE idem_replay_cache_hits_total counter\nidem_replay_cache_hits_total %llu\n",
          (unsigned long long)g->replay_cache_hits);
  fprintf(f, "# HELP idem_records_pending Records whose provider outcome is unknown.\n"
             "# TYPE idem_records_pending gauge\nidem_records_pending %lld\n",
          (long long)g->pending);
  fprintf(f, "# HELP idem_oldest_pending_seconds Age of the oldest payment whose "
             "provider outcome is unknown (0 when none).\n"
             "# TYPE idem_oldest_pending_seconds gauge\nidem_oldest_pending_seconds %.3f\n",
          g->oldest_pending_seconds);
  fprintf(f, "# HELP idem_records_processing Records being processed now.\n"
             "# TYPE idem_records_processing gauge\nidem_records_processing %lld\n",
          (long long)g->processing);
  if (fclose(f) != 0) {
    free(buf);
    return NULL;
  }
  return buf;
}
