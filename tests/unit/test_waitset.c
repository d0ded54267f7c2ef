/* Tests the parked waiters of the wait set (src/lib/waitset.c): requests
 * waiting for a key in flight without a thread. */
#include "support.h"

#include <stdio.h>

#include "lib/waitset.h"

struct probe {
  idem_store_waiter_t w; /* first: the wake-up gets it back */
  int woken, timed_out;
};

static void on_wake(idem_store_waiter_t *w, int timed_out) {
  struct probe *p = (struct probe *)w;
  p->woken++;
  p->timed_out = timed_out;
}

static void probe_init(struct probe *p, int64_t deadline) {
  *p = (struct probe){.w = {.wake = on_wake, .deadline_ms = deadline}};
}

/* A key whose stripe is the stripe of `base` (the ticket moves together),
 * found by trying: there are 64 stripes. */
static void same_stripe_key(idem__waitset_t *ws, const idem_scope_t *base, char *out,
                            size_t cap) {
  for (int i = 0; i < 100000; i++) {
    idem_scope_t sc = *base;
    uint64_t before, after;
    snprintf(out, cap, "other-%d", i);
    sc.key = out;
    before = idem__waitset_ticket(ws, base);
    idem__waitset_wake(ws, &sc);
    after = idem__waitset_ticket(ws, base);
    if (after != before)
      return;
  }
  fail_msg("no key shares a stripe with the first");
}

static void test_parked_wake_by_key(void **state) {
  idem__waitset_t *ws = idem__waitset_new();
  idem_scope_t a = {1, "create_payment", "key-a"};
  char other[32];
  idem_scope_t b = {1, "create_payment", other};
  struct probe pa, pb;
  (void)state;

  assert_non_null(ws);
  same_stripe_key(ws, &a, other, sizeof other);
  probe_init(&pa, 1000);
  probe_init(&pb, 1000);
  assert_int_equal(idem__waitset_park(ws, &a, idem__waitset_ticket(ws, &a), &pa.w), 0);
  assert_int_equal(idem__waitset_park(ws, &b, idem__waitset_ticket(ws, &b), &pb.w), 0);

  /* b's key changes: only b wakes, though a shares its stripe. */
  idem__waitset_wake(ws, &b);
  assert_int_equal(pb.woken, 1);
  assert_int_equal(pb.timed_out, 0);
  assert_int_equal(pa.woken, 0);
  idem__waitset_wake(ws, &a);
  assert_int_equal(pa.woken, 1);
  assert_int_equal(pb.woken, 1); /* once only */
  idem__waitset_free(ws);
}

/* A ticket taken before a change: parking reports it and parks nothing. */
static void test_park_after_a_change(void **state) {
  idem__waitset_t *ws = idem__waitset_new();
  idem_scope_t a = {1, "create_payment", "key-a"};
  struct probe p;
  uint64_t ticket;
  (void)state;

  ticket = idem__waitset_ticket(ws, &a);
  idem__waitset_wake(ws, &a);
  probe_init(&p, 1000);
  assert_int_equal(idem__waitset_park(ws, &a, ticket, &p.w), 1);
  idem__waitset_wake(ws, &a);
  assert_int_equal(idem__waitset_expire(ws, INT64_MAX), 0);
  assert_int_equal(p.woken, 0);
  idem__waitset_free(ws);
}

/* Expiry wakes, as timed out, exactly the waiters past their deadline;
 * INT64_MAX (a drain) wakes them all; wake_all wakes every one too. */
static void test_expire_and_wake_all(void **state) {
  idem__waitset_t *ws = idem__waitset_new();
  char keys[6][16];
  struct probe p[6];
  (void)state;

  for (int i = 0; i < 6; i++) {
    idem_scope_t sc = {1, "create_payment", keys[i]};
    snprintf(keys[i], sizeof keys[i], "k%d", i);
    probe_init(&p[i], 100 * (i + 1));
    assert_int_equal(idem__waitset_park(ws, &sc, idem__waitset_ticket(ws, &sc), &p[i].w), 0);
  }
  assert_int_equal(idem__waitset_expire(ws, 99), 0);
  assert_int_equal(idem__waitset_expire(ws, 200), 2);
  for (int i = 0; i < 6; i++) {
    assert_int_equal(p[i].woken, i < 2);
    assert_int_equal(p[i].timed_out, i < 2);
  }
  assert_int_equal(idem__waitset_expire(ws, 400), 2);
  idem__waitset_wake_all(ws);
  for (int i = 0; i < 6; i++)
    assert_int_equal(p[i].woken, 1);
  assert_int_equal(p[4].timed_out, 0);
  assert_int_equal(idem__waitset_expire(ws, INT64_MAX), 0);
  idem__waitset_free(ws);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parked_wake_by_key),
      cmocka_unit_test(test_park_after_a_change),
      cmocka_unit_test(test_expire_and_wake_all),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
