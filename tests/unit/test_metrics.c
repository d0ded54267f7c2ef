/* idemd's metrics (src/server/metrics.c): which latency bucket a request
 * falls in, histograms by operation read as one snapshot while writers
 * add to them, and the rendered text (histograms, idem_build_info, the
 * process's own metrics). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <setjmp.h>
#include <stdarg.h>
#include <cmocka.h>

#include "server/metrics.h"

static idemd_metrics_t metrics; /* big: not on the stack */

/* The value of the line "NAME VALUE" in `text`; -1 when there is none. */
static double value_of(const char *text, const char *name) {
  size_t n = strlen(name);
  for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
    if (strncmp(p, name, n) == 0 && p[n] == ' ')
      return strtod(p + n + 1, NULL);
  return -1;
}

static char *render(void) {
  idemd_store_gauges_t g = {.store_backend = "sqlite"};
  char *text = idemd_metrics_render(&metrics, &g);
  assert_non_null(text);
  return text;
}

/* A latency on a bucket's bound is in that bucket; one past it in the
 * next; a negative one counts as 0; past 30 s only in +Inf. */
static void test_buckets(void **state) {
  static const struct {
    int64_t us;
    int bucket; /* IDEMD_LATENCY_BUCKETS: +Inf only */
  } rows[] = {
      {-5, 0},          {0, 0},           {500, 0},          {501, 1},
      {2500000, 11},    {2500001, 12},    {5000000, 12},     {9999999, 13},
      {10000000, 13},   {10000001, 14},   {30000000, 14},    {30000001, 15},
      {INT64_MAX / 2, 15},
  };
  (void)state;

  assert_int_equal(idemd_latency_bound_us(0), 500);
  assert_int_equal(idemd_latency_bound_us(IDEMD_LATENCY_BUCKETS - 1), 30000000);
  assert_int_equal(idemd_latency_bound_us(IDEMD_LATENCY_BUCKETS), INT64_MAX);
  assert_int_equal(idemd_latency_bound_us(-1), INT64_MAX);
  for (size_t i = 0; i < sizeof rows / sizeof *rows; i++) {
    idemd_hist_snapshot_t before, after;
    idemd_metrics_latency(&metrics, OP_GET_ORDER, &before);
    idemd_metrics_request(&metrics, OP_GET_ORDER, OUTCOME_READ, rows[i].us);
    idemd_metrics_latency(&metrics, OP_GET_ORDER, &after);
    for (int b = 0; b <= IDEMD_LATENCY_BUCKETS; b++)
      if (after.buckets[b] - before.buckets[b] != (b == rows[i].bucket))
        fail_msg("%lld us: bucket %d moved by %llu, want bucket %d", (long long)rows[i].us,
                 b, (unsigned long long)(after.buckets[b] - before.buckets[b]),
                 rows[i].bucket);
    assert_int_equal(after.count - before.count, 1);
    assert_int_equal(after.sum_us - before.sum_us, rows[i].us < 0 ? 0 : rows[i].us);
  }
  /* Out of range: not counted, and no crash. */
  {
    idemd_hist_snapshot_t s;
    idemd_metrics_request(&metrics, OP_COUNT_, OUTCOME_READ, 1);
    idemd_metrics_request(&metrics, OP_GET_ORDER, OUTCOME_COUNT_, 1);
    idemd_metrics_request(&metrics, (idemd_op_t)-1, OUTCOME_READ, 1);
    idemd_metrics_latency(&metrics, OP_GET_ORDER, &s);
    assert_int_equal(s.count, sizeof rows / sizeof *rows);
    idemd_metrics_latency(&metrics, OP_COUNT_, &s);
    assert_int_equal(s.count, 0);
  }
}

enum { WRITERS = 3, PER_WRITER = 200000 };

/* Each operation's requests all take the same time, so that any snapshot
 * of it has sum == count * that time and one bucket holding them all. */
static int64_t latency_of(idemd_op_t op) {
  return 700 + 1000 * (int64_t)op;
}

static atomic_int writers_done;

static void *writer(void *arg) {
  unsigned seed = (unsigned)(uintptr_t)arg;
  for (int i = 0; i < PER_WRITER; i++) {
    idemd_op_t op = (idemd_op_t)(rand_r(&seed) % OP_COUNT_);
    idemd_metrics_request(&metrics, op, OUTCOME_NEW, latency_of(op));
  }
  atomic_fetch_add(&writers_done, 1);
  return NULL;
}

/* Snapshots taken while three threads write are each whole: their count,
 * sum and buckets describe the same requests; counts never go back; and
 * at the end every request is there. */
static void test_snapshot_consistent(void **state) {
  pthread_t t[WRITERS];
  uint64_t last[OP_COUNT_] = {0}, total = 0;
  long reads = 0;
  (void)state;

  memset(&metrics, 0, sizeof metrics);
  atomic_store(&writers_done, 0);
  for (int i = 0; i < WRITERS; i++)
    assert_int_equal(pthread_create(&t[i], NULL, writer, (void *)(uintptr_t)(i + 1)), 0);
  for (int done = 0; !done;) {
    done = atomic_load(&writers_done) == WRITERS; /* one last round after */
    for (int op = 0; op < OP_COUNT_; op++) {
      idemd_hist_snapshot_t s;
      uint64_t in_buckets = 0;
      idemd_metrics_latency(&metrics, (idemd_op_t)op, &s);
      for (int b = 0; b <= IDEMD_LATENCY_BUCKETS; b++)
        in_buckets += s.buckets[b];
      if (s.sum_us != s.count * (uint64_t)latency_of((idemd_op_t)op) || in_buckets != s.count)
        fail_msg("%s: a mixed snapshot: count %llu, sum %llu us (want %llu), buckets %llu",
                 idemd_op_name((idemd_op_t)op), (unsigned long long)s.count,
                 (unsigned long long)s.sum_us,
                 (unsigned long long)(s.count * (uint64_t)latency_of((idemd_op_t)op)),
                 (unsigned long long)in_buckets);
      assert_true(s.count >= last[op]);
      last[op] = s.count;
      reads++;
    }
  }
  for (int i = 0; i < WRITERS; i++)
    pthread_join(t[i], NULL);
  for (int op = 0; op < OP_COUNT_; op++)
    total += last[op];
  assert_int_equal(total, (uint64_t)WRITERS * PER_WRITER);
  print_message("%ld snapshots taken while writing\n", reads);

  /* And the text shows each operation's histogram as the snapshot has it. */
  {
    char *text = render();
    for (int op = 0; op < OP_COUNT_; op++) {
      char name[160];
      const char *o = idemd_op_name((idemd_op_t)op);
      snprintf(name, sizeof name, "idem_request_duration_seconds_count{operation=\"%s\"}", o);
      assert_true(value_of(text, name) == (double)last[op]);
      snprintf(name, sizeof name,
               "idem_request_duration_seconds_bucket{operation=\"%s\",le=\"+Inf\"}", o);
      assert_true(value_of(text, name) == (double)last[op]);
      snprintf(name, sizeof name,
               "idem_request_duration_seconds_bucket{operation=\"%s\",le=\"30\"}", o);
      assert_true(value_of(text, name) == (double)last[op]);
    }
    free(text);
  }
}

/* The rendered text: a histogram per operation with cumulative buckets up
 * to 30 s, idem_build_info, and the process's own metrics, which follow
 * what the process does (file descriptors opened). */
static void test_render(void **state) {
  char *text;
  int fds[5];
  double open_before, cpu, rss;
  (void)state;

  memset(&metrics, 0, sizeof metrics);
  idemd_metrics_request(&metrics, OP_CREATE_PAYMENT, OUTCOME_NEW, 4000);     /* <= 5 ms */
  idemd_metrics_request(&metrics, OP_CREATE_PAYMENT, OUTCOME_PENDING, 9000000); /* <= 10 s */
  idemd_metrics_request(&metrics, OP_CREATE_PAYMENT, OUTCOME_NEW, 31000000); /* +Inf */
  idemd_metrics_request(&metrics, OP_NONE, OUTCOME_INVALID, 100);
  text = render();
  {
    static const struct {
      const char *name;
      double want;
    } rows[] = {
        {"idem_request_duration_seconds_bucket{operation=\"create_payment\",le=\"0.0025\"}", 0},
        {"idem_request_duration_seconds_bucket{operation=\"create_payment\",le=\"0.005\"}", 1},
        {"idem_request_duration_seconds_bucket{operation=\"create_payment\",le=\"5\"}", 1},
        {"idem_request_duration_seconds_bucket{operation=\"create_payment\",le=\"10\"}", 2},
        {"idem_request_duration_seconds_bucket{operation=\"create_payment\",le=\"30\"}", 2},
        {"idem_request_duration_seconds_bucket{operation=\"create_payment\",le=\"+Inf\"}", 3},
        {"idem_request_duration_seconds_count{operation=\"create_payment\"}", 3},
        {"idem_request_duration_seconds_sum{operation=\"create_payment\"}", 40.004},
        {"idem_request_duration_seconds_count{operation=\"other\"}", 1},
        {"idem_request_duration_seconds_bucket{operation=\"other\",le=\"0.0005\"}", 1},
        {"idem_request_duration_seconds_count{operation=\"create_order\"}", 0},
        {"idem_requests_total{operation=\"other\",outcome=\"invalid\"}", 1},
        {"idem_requests_total{operation=\"create_payment\",outcome=\"pending\"}", 1},
    };
    for (size_t i = 0; i < sizeof rows / sizeof *rows; i++)
      if (value_of(text, rows[i].name) != rows[i].want)
        fail_msg("%s is %g, want %g", rows[i].name, value_of(text, rows[i].name),
                 rows[i].want);
  }
  assert_non_null(strstr(text, "# TYPE idem_request_duration_seconds histogram\n"));
  assert_non_null(strstr(text, "\nidem_build_info{version=\""));
  assert_non_null(strstr(text, "\",store=\"sqlite\"} 1\n"));
  assert_non_null(strstr(text, "# TYPE process_cpu_seconds_total counter\n"));
  open_before = value_of(text, "process_open_fds");
  cpu = value_of(text, "process_cpu_seconds_total");
  rss = value_of(text, "process_resident_memory_bytes");
  assert_true(open_before >= 3); /* stdin, stdout, stderr at least */
  assert_true(cpu >= 0);
  assert_true(rss > 1e5 && rss < 1e11);
  assert_true(value_of(text, "process_virtual_memory_bytes") >= rss);
  free(text);

  for (size_t i = 0; i < sizeof fds / sizeof *fds; i++)
    assert_true((fds[i] = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0);
  text = render();
  assert_true(value_of(text, "process_open_fds") == open_before + 5);
  assert_true(value_of(text, "process_max_fds") >= value_of(text, "process_open_fds"));
  free(text);
  for (size_t i = 0; i < sizeof fds / sizeof *fds; i++)
    close(fds[i]);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_buckets),
      cmocka_unit_test(test_snapshot_consistent),
      cmocka_unit_test(test_render),
  };
  return cmocka_run_group_tests_name("unit: metrics", tests, NULL, NULL);
}
