/* Prometheus metrics of idemd: atomics bumped per request, rendered on
 * GET /metrics with the process's own (CPU, memory, file descriptors). */
#include "server/metrics.h"

#include <dirent.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "idem_version.h"

/* Requests that match no route count as "other". */
static const char *const op_names[OP_COUNT_] = {
    "other",         "create_payment", "create_order",    "get_payment",  "get_order",
    "healthz",       "metrics",        "readyz",          "cancel_order", "put_order",
    "create_refund", "get_refund",     "provider_webhook", "gateway",       "proxy"};

static const char *const webhook_results[WEBHOOK_RESULT_COUNT_] = {
    "applied", "duplicate", "ignored",   "unsigned", "forged",
    "stale",   "malformed", "too_large", "busy",     "error", "amount_mismatch"};

const char *idemd_webhook_result_name(idemd_webhook_result_t r) {
  return (unsigned)r < WEBHOOK_RESULT_COUNT_ ? webhook_results[r] : "none";
}

static const char *const outcome_names[OUTCOME_COUNT_] = {
    "none", "new", "replay", "mismatch", "in_flight",
    "pending", "invalid", "read", "error"};

static const int64_t bucket_us[IDEMD_LATENCY_BUCKETS] = {
    500,    1000,   2500,    5000,    10000,   25000,   50000,   100000,
    250000, 500000, 1000000, 2500000, 5000000, 10000000, 30000000};

#define HOT_BIT ((uint_fast64_t)1 << 63)

int64_t idemd_latency_bound_us(int i) {
  return i >= 0 && i < IDEMD_LATENCY_BUCKETS ? bucket_us[i] : INT64_MAX;
}

const char *idemd_op_name(idemd_op_t op) {
  return (unsigned)op < OP_COUNT_ ? op_names[op] : "none";
}

const char *idemd_outcome_name(idemd_outcome_t o) {
  return (unsigned)o < OUTCOME_COUNT_ ? outcome_names[o] : "none";
}

static void observe(idemd_histogram_t *h, int64_t us) {
  /* Acquire: pairs with the reader's swap, after which it zeroed what is
   * now the hot half; the adds below come after those stores. */
  uint_fast64_t n = atomic_fetch_add_explicit(&h->started_hot, 1, memory_order_acquire);
  idemd_hist_half_t *hot = &h->half[n >> 63];
  int i = 0;

  while (i < IDEMD_LATENCY_BUCKETS && us > bucket_us[i])
    i++;
  atomic_fetch_add_explicit(&hot->buckets[i], 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&hot->sum_us, (uint_fast64_t)us, memory_order_relaxed);
  /* Release: a reader that sees this count sees the two adds above. */
  atomic_fetch_add_explicit(&hot->count, 1, memory_order_release);
}

void idemd_metrics_request(idemd_metrics_t *m, idemd_op_t op,
                           idemd_outcome_t outcome, int64_t latency_us) {
  if ((unsigned)op >= OP_COUNT_ || (unsigned)outcome >= OUTCOME_COUNT_)
    return;
  atomic_fetch_add_explicit(&m->requests[op][outcome], 1, memory_order_relaxed);
  observe(&m->latency[op], latency_us < 0 ? 0 : latency_us);
}

/* Moves `from` (its writers done) into `to` (being written) and zeroes it. */
static void fold(idemd_hist_half_t *from, idemd_hist_half_t *to, const idemd_hist_snapshot_t *v) {
  for (int i = 0; i <= IDEMD_LATENCY_BUCKETS; i++) {
    atomic_fetch_add_explicit(&to->buckets[i], v->buckets[i], memory_order_relaxed);
    atomic_store_explicit(&from->buckets[i], 0, memory_order_relaxed);
  }
  atomic_fetch_add_explicit(&to->sum_us, v->sum_us, memory_order_relaxed);
  atomic_store_explicit(&from->sum_us, 0, memory_order_relaxed);
  atomic_fetch_add_explicit(&to->count, v->count, memory_order_release);
  atomic_store_explicit(&from->count, 0, memory_order_relaxed);
}

/* One snapshot of `h`; the caller holds m->reading. */
static void snapshot(idemd_histogram_t *h, idemd_hist_snapshot_t *out) {
  /* The swap: writers from now on add to the other half. Every
   * observation begun before it is counted in `begun`. */
  uint_fast64_t n = atomic_fetch_add_explicit(&h->started_hot, HOT_BIT, memory_order_acq_rel);
  uint_fast64_t begun = n & ~HOT_BIT;
  idemd_hist_half_t *cold = &h->half[n >> 63], *hot = &h->half[(n >> 63) ^ 1];

  /* The cold half holds all earlier observations (folded into it by the
   * previous read), less those of writers still at work in it: a few
   * instructions each. */
  while (atomic_load_explicit(&cold->count, memory_order_acquire) != begun)
    sched_yield();
  for (int i = 0; i <= IDEMD_LATENCY_BUCKETS; i++)
    out->buckets[i] = atomic_load_explicit(&cold->buckets[i], memory_order_relaxed);
  out->sum_us = atomic_load_explicit(&cold->sum_us, memory_order_relaxed);
  out->count = begun;
  fold(cold, hot, out);
}

static void lock_reading(idemd_metrics_t *m) {
  int expected = 0;
  while (!atomic_compare_exchange_weak_explicit(&m->reading, &expected, 1,
                                                memory_order_acquire, memory_order_relaxed)) {
    expected = 0;
    sched_yield();
  }
}

static void unlock_reading(idemd_metrics_t *m) {
  atomic_store_explicit(&m->reading, 0, memory_order_release);
}

void idemd_metrics_latency(idemd_metrics_t *m, idemd_op_t op, idemd_hist_snapshot_t *out) {
  memset(out, 0, sizeof *out);
  if ((unsigned)op >= OP_COUNT_)
    return;
  lock_reading(m);
  snapshot(&m->latency[op], out);
  unlock_reading(m);
}

/* ---- the process, from /proc/self ------------------------------------- */

typedef struct process_stats {
  int have_stat; /* /proc/self/stat read */
  double cpu_seconds;
  uint64_t rss_bytes, vsize_bytes;
  long open_fds; /* -1: /proc/self/fd not readable */
  long max_fds;  /* -1: no limit */
} process_stats_t;

/* Fields 14, 15 (utime, stime, in clock ticks), 23 (vsize, bytes) and 24
 * (rss, pages) of /proc/self/stat (proc(5)); field 2, the command, is in
 * parentheses and may hold spaces and parentheses itself. */
static int read_stat(process_stats_t *ps) {
  char buf[1024];
  unsigned long long utime, stime, vsize;
  long long rss;
  long tick = sysconf(_SC_CLK_TCK), page = sysconf(_SC_PAGESIZE);
  FILE *f = fopen("/proc/self/stat", "re");
  size_t n;
  char *p;

  if (f == NULL)
    return -1;
  n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  p = strrchr(buf, ')');
  if (p == NULL || tick <= 0 || page <= 0 ||
      sscanf(p + 1,
             " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %*d %*d %*d %*d %*d "
             "%*d %*u %llu %lld",
             &utime, &stime, &vsize, &rss) != 4)
    return -1;
  ps->cpu_seconds = (double)(utime + stime) / (double)tick;
  ps->vsize_bytes = vsize;
  ps->rss_bytes = rss > 0 ? (uint64_t)rss * (uint64_t)page : 0;
  return 0;
}

/* The entries of /proc/self/fd, less the one reading it. */
static long count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  long n = 0;
  struct dirent *e;

  if (d == NULL)
    return -1;
  while ((e = readdir(d)) != NULL)
    n += e->d_name[0] != '.';
  closedir(d);
  return n > 0 ? n - 1 : 0;
}

static void read_process(process_stats_t *ps) {
  struct rlimit rl;
  memset(ps, 0, sizeof *ps);
  ps->have_stat = read_stat(ps) == 0;
  ps->open_fds = count_fds();
  ps->max_fds = getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY
                    ? (long)rl.rlim_cur
                    : -1;
}

static void render_process(FILE *f) {
  process_stats_t ps;
  read_process(&ps);
  if (ps.have_stat)
    fprintf(f, "# HELP process_cpu_seconds_total Total user and system CPU time spent in "
               "seconds.\n# TYPE process_cpu_seconds_total counter\n"
               "process_cpu_seconds_total %.2f\n"
               "# HELP process_resident_memory_bytes Resident memory size in bytes.\n"
               "# TYPE process_resident_memory_bytes gauge\n"
               "process_resident_memory_bytes %llu\n"
               "# HELP process_virtual_memory_bytes Virtual memory size in bytes.\n"
               "# TYPE process_virtual_memory_bytes gauge\n"
               "process_virtual_memory_bytes %llu\n",
            ps.cpu_seconds, (unsigned long long)ps.rss_bytes,
            (unsigned long long)ps.vsize_bytes);
  if (ps.open_fds >= 0)
    fprintf(f, "# HELP process_open_fds Number of open file descriptors.\n"
               "# TYPE process_open_fds gauge\nprocess_open_fds %ld\n",
            ps.open_fds);
  if (ps.max_fds >= 0)
    fprintf(f, "# HELP process_max_fds Maximum number of open file descriptors.\n"
               "# TYPE process_max_fds gauge\nprocess_max_fds %ld\n",
            ps.max_fds);
}

#define LOAD(x) ((unsigned long long)atomic_load_explicit(&(x), memory_order_relaxed))

char *idemd_metrics_render(idemd_metrics_t *m, const idemd_store_gauges_t *g) {
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);

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
  fprintf(f, "# HELP idem_request_duration_seconds Time from request to answer, by "
             "operation.\n# TYPE idem_request_duration_seconds histogram\n");
  lock_reading(m);
  for (int op = 0; op < OP_COUNT_; op++) {
    idemd_hist_snapshot_t h;
    unsigned long long cumulative = 0;
    snapshot(&m->latency[op], &h);
    for (int i = 0; i < IDEMD_LATENCY_BUCKETS; i++) {
      cumulative += h.buckets[i];
      fprintf(f, "idem_request_duration_seconds_bucket{operation=\"%s\",le=\"%g\"} %llu\n",
              op_names[op], (double)bucket_us[i] / 1e6, cumulative);
    }
    fprintf(f,
            "idem_request_duration_seconds_bucket{operation=\"%s\",le=\"+Inf\"} %llu\n"
            "idem_request_duration_seconds_sum{operation=\"%s\"} %.6f\n"
            "idem_request_duration_seconds_count{operation=\"%s\"} %llu\n",
            op_names[op], (unsigned long long)h.count, op_names[op],
            (double)h.sum_us / 1e6, op_names[op], (unsigned long long)h.count);
  }
  unlock_reading(m);
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
  fprintf(f, "# HELP idem_reconcile_settled_total Payments and refunds the reconciler "
             "settled.\n"
             "# TYPE idem_reconcile_settled_total counter\n"
             "idem_reconcile_settled_total %llu\n",
          LOAD(m->reconcile_settled));
  fprintf(f, "# HELP idem_reconcile_unresolved Payments and refunds the last "
             "reconciler pass could not settle.\n# TYPE idem_reconcile_unresolved gauge\n"
             "idem_reconcile_unresolved %lld\n",
          (long long)atomic_load_explicit(&m->reconcile_unresolved, memory_order_relaxed));
  fprintf(f, "# HELP idem_webhooks_total The provider's events received at POST "
             "/webhooks/provider, by what became of them.\n"
             "# TYPE idem_webhooks_total counter\n");
  for (int i = 0; i < WEBHOOK_RESULT_COUNT_; i++)
    fprintf(f, "idem_webhooks_total{result=\"%s\"} %llu\n", webhook_results[i],
            LOAD(m->webhooks[i]));
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
  fprintf(f, "# HELP idem_oldest_pending_seconds Age of the oldest payment or refund "
             "whose provider outcome is unknown (0 when none).\n"
             "# TYPE idem_oldest_pending_seconds gauge\nidem_oldest_pending_seconds %.3f\n",
          g->oldest_pending_seconds);
  fprintf(f, "# HELP idem_records_processing Records being processed now.\n"
             "# TYPE idem_records_processing gauge\nidem_records_processing %lld\n",
          (long long)g->processing);
  render_process(f);
  if (fclose(f) != 0) {
    free(buf);
    return NULL;
  }
  return buf;
}
