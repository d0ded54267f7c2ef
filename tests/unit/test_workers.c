/* The worker pool: every job runs, at most `running` at once, a job in a
 * wait (a provider call, a duplicate in flight) lets another start, and
 * the latest idle worker takes the next job. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include <setjmp.h>
#include <stdarg.h>
#include <cmocka.h>

#include "server/workers.h"

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
}

/* Jobs that note how many of them run at the same moment. */
struct counted {
  idemd_work_t work;
  atomic_int *now, *most, *done;
};

static void counted_run(idemd_work_t *w) {
  struct counted *c = (struct counted *)w;
  int n = atomic_fetch_add(c->now, 1) + 1;
  int m = atomic_load(c->most);
  while (n > m && !atomic_compare_exchange_weak(c->most, &m, n))
    ;
  sleep_ms(3); /* long enough for the others to start, were they allowed */
  atomic_fetch_sub(c->now, 1);
  atomic_fetch_add(c->done, 1);
}

static void test_running_bound(void **state) {
  enum { JOBS = 24 };
  atomic_int now = 0, most = 0, done = 0;
  struct counted jobs[JOBS];
  idemd_workers_t *p = idemd_workers_start(8, 2);
  (void)state;

  assert_non_null(p);
  for (int i = 0; i < JOBS; i++) {
    jobs[i] = (struct counted){.work = {.run = counted_run}, .now = &now, .most = &most,
                               .done = &done};
    assert_int_equal(idemd_workers_submit(p, &jobs[i].work), 0);
  }
  idemd_workers_stop(p);
  assert_int_equal(atomic_load(&done), JOBS);
  assert_int_equal(atomic_load(&most), 2);
  idemd_workers_free(p);
}

/* With room for one job at a time, a job waiting for a later one must
 * let it run, once it says it waits: the later one is queued while the
 * first is at work, so only the wait's start can hand it a place. */
struct pair {
  idemd_work_t waiter, poster;
  sem_t started, queued, posted;
  int got; /* the waiter saw the post within 5 s */
};

static void waiter_run(idemd_work_t *w) {
  struct pair *pr = (struct pair *)((char *)w - offsetof(struct pair, waiter));
  struct timespec until;
  int rc;

  sem_post(&pr->started);
  sem_wait(&pr->queued);
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += 5;
  idemd_workers_wait_begin();
  while ((rc = sem_timedwait(&pr->posted, &until)) != 0 && errno == EINTR)
    ;
  idemd_workers_wait_end();
  pr->got = rc == 0;
}

static void poster_run(idemd_work_t *w) {
  struct pair *pr = (struct pair *)((char *)w - offsetof(struct pair, poster));
  sem_post(&pr->posted);
}

static void test_wait_lets_another_run(void **state) {
  struct pair pr = {.waiter = {.run = waiter_run}, .poster = {.run = poster_run}};
  idemd_workers_t *p = idemd_workers_start(2, 1);
  (void)state;

  assert_non_null(p);
  sem_init(&pr.started, 0, 0);
  sem_init(&pr.queued, 0, 0);
  sem_init(&pr.posted, 0, 0);
  assert_int_equal(idemd_workers_submit(p, &pr.waiter), 0);
  sem_wait(&pr.started);
  assert_int_equal(idemd_workers_submit(p, &pr.poster), 0); /* no place yet */
  sem_post(&pr.queued);
  idemd_workers_stop(p);
  assert_true(pr.got);
  sem_destroy(&pr.started);
  sem_destroy(&pr.queued);
  sem_destroy(&pr.posted);
  idemd_workers_free(p);
}

/* Once the wait is over the job counts again: with room for one, a job
 * back from its wait keeps the next one out until it ends. */
struct back {
  idemd_work_t first, second, third;
  sem_t first_waiting, second_ran, first_back;
  atomic_int first_done, third_saw_first_done;
};

static void first_run(idemd_work_t *w) {
  struct back *b = (struct back *)((char *)w - offsetof(struct back, first));
  idemd_workers_wait_begin();
  sem_post(&b->first_waiting);
  sem_wait(&b->second_ran); /* the second runs meanwhile */
  idemd_workers_wait_end();
  sem_post(&b->first_back);
  sleep_ms(30); /* counted again: nothing else may start now */
  atomic_store(&b->first_done, 1);
}

static void second_run(idemd_work_t *w) {
  struct back *b = (struct back *)((char *)w - offsetof(struct back, second));
  sem_post(&b->second_ran);
}

static void third_run(idemd_work_t *w) {
  struct back *b = (struct back *)((char *)w - offsetof(struct back, third));
  atomic_store(&b->third_saw_first_done, atomic_load(&b->first_done));
}

static void test_wait_end_counts_again(void **state) {
  struct back b = {.first = {.run = first_run}, .second = {.run = second_run},
                   .third = {.run = third_run}};
  idemd_workers_t *p = idemd_workers_start(3, 1);
  (void)state;

  assert_non_null(p);
  sem_init(&b.first_waiting, 0, 0);
  sem_init(&b.second_ran, 0, 0);
  sem_init(&b.first_back, 0, 0);
  assert_int_equal(idemd_workers_submit(p, &b.first), 0);
  sem_wait(&b.first_waiting);
  assert_int_equal(idemd_workers_submit(p, &b.second), 0);
  sem_wait(&b.first_back);
  assert_int_equal(idemd_workers_submit(p, &b.third), 0);
  idemd_workers_stop(p);
  assert_true(atomic_load(&b.first_done));
  assert_true(atomic_load(&b.third_saw_first_done));
  sem_destroy(&b.first_waiting);
  sem_destroy(&b.second_ran);
  sem_destroy(&b.first_back);
  idemd_workers_free(p);
}

/* One job at a time, each submitted once the one before has ended: the
 * worker that ran the last is the latest idle, and runs the next too.
 * (Woken oldest first, the eight would take turns: each ran 1 or 2.) A
 * worker descheduled before it is idle again may miss one: 8 of 10. */
struct whom {
  idemd_work_t work;
  pthread_t ran_on;
  sem_t *done;
};

static void whom_run(idemd_work_t *w) {
  struct whom *j = (struct whom *)w;
  j->ran_on = pthread_self();
  sem_post(j->done);
}

static void test_latest_idle_worker_first(void **state) {
  enum { JOBS = 10 };
  struct whom jobs[JOBS];
  sem_t done;
  idemd_workers_t *p = idemd_workers_start(8, 8);
  (void)state;

  assert_non_null(p);
  sem_init(&done, 0, 0);
  sleep_ms(20); /* every worker idle */
  for (int i = 0; i < JOBS; i++) {
    jobs[i] = (struct whom){.work = {.run = whom_run}, .done = &done};
    assert_int_equal(idemd_workers_submit(p, &jobs[i].work), 0);
    sem_wait(&done);
    sleep_ms(10); /* its worker is idle again */
  }
  idemd_workers_stop(p);
  int most = 0; /* jobs run by the worker that ran the most */
  for (int i = 0; i < JOBS; i++) {
    int same = 0;
    for (int k = 0; k < JOBS; k++)
      same += pthread_equal(jobs[k].ran_on, jobs[i].ran_on) != 0;
    most = same > most ? same : most;
  }
  assert_true(most >= 8);
  sem_destroy(&done);
  idemd_workers_free(p);
}

static void test_wait_outside_a_worker(void **state) {
  (void)state;
  /* Not a worker: nothing to count, nothing happens. */
  idemd_workers_wait_begin();
  idemd_workers_wait_end();
  assert_null(idemd_workers_start(0, 1));
  assert_null(idemd_workers_start(1, 0));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_running_bound),
      cmocka_unit_test(test_wait_lets_another_run),
      cmocka_unit_test(test_wait_end_counts_again),
      cmocka_unit_test(test_latest_idle_worker_first),
      cmocka_unit_test(test_wait_outside_a_worker),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
