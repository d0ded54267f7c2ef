/* Tests provider/webhook.c: a provider event's signature (the window, the
 * HMAC, the header's forms) and its body. */
#include "support.h"

#include <stdio.h>
#include <string.h>

#include "provider/webhook.h"

#define SECRET "whsec_test"
#define NOW 1764770000

static const char EVENT[] =
    "{\"id\":\"evt_1\",\"type\":\"charge.succeeded\",\"created\":1764770000,"
    "\"data\":{\"key\":\"pay_abc\",\"id\":\"ch_1\",\"amount\":1000}}";

/* "t=<t>,v1=<hex HMAC of "<t>.<body>" under `secret`>" */
static void sign(const char *secret, long long t, const char *body, char *out,
                 size_t cap) {
  unsigned char mac[IDEM_SHA256_LEN];
  char text[4096], hex[2 * IDEM_SHA256_LEN + 1];
  int n = snprintf(text, sizeof text, "%lld.%s", t, body);
  assert_int_equal(idem_hmac_sha256(secret, strlen(secret), text, (size_t)n, mac), IDEM_OK);
  idem_hex(mac, sizeof mac, hex);
  snprintf(out, cap, "t=%lld,v1=%s", t, hex);
}

static idem_webhook_check_t check(const char *header, const char *body, int64_t now) {
  idem_hmac_t *h = idem_hmac_new(SECRET, strlen(SECRET));
  idem_webhook_check_t c;
  assert_non_null(h);
  c = idem_webhook_verify(h, header, body, strlen(body), now);
  idem_hmac_free(h);
  return c;
}

static void test_signed_event_passes(void **state) {
  char sig[256];
  (void)state;
  sign(SECRET, NOW, EVENT, sig, sizeof sig);
  assert_int_equal(check(sig, EVENT, NOW), IDEM_WEBHOOK_OK);
  /* within the window either way */
  assert_int_equal(check(sig, EVENT, NOW + IDEM_WEBHOOK_WINDOW_S), IDEM_WEBHOOK_OK);
  assert_int_equal(check(sig, EVENT, NOW - IDEM_WEBHOOK_WINDOW_S), IDEM_WEBHOOK_OK);
}

static void test_stale_or_future_is_refused(void **state) {
  char sig[256];
  (void)state;
  sign(SECRET, NOW, EVENT, sig, sizeof sig);
  assert_int_equal(check(sig, EVENT, NOW + IDEM_WEBHOOK_WINDOW_S + 1), IDEM_WEBHOOK_STALE);
  assert_int_equal(check(sig, EVENT, NOW - IDEM_WEBHOOK_WINDOW_S - 1), IDEM_WEBHOOK_STALE);
}

static void test_forgeries_are_refused(void **state) {
  char sig[256], other[256], both[600];
  char body[sizeof EVENT];
  (void)state;
  sign("another secret", NOW, EVENT, sig, sizeof sig);
  assert_int_equal(check(sig, EVENT, NOW), IDEM_WEBHOOK_FORGED);
  /* one byte of the body changed */
  sign(SECRET, NOW, EVENT, sig, sizeof sig);
  memcpy(body, EVENT, sizeof body);
  body[strlen(body) - 5] = '9';
  assert_int_equal(check(sig, body, NOW), IDEM_WEBHOOK_FORGED);
  /* the signature's t moved (the MAC covers it) */
  sign(SECRET, NOW, EVENT, sig, sizeof sig);
  sig[2 + 9] = sig[2 + 9] == '1' ? '2' : '1';
  assert_int_equal(check(sig, EVENT, NOW), IDEM_WEBHOOK_FORGED);
  /* a rotated secret: one of two v1 matches */
  sign("old secret", NOW, EVENT, other, sizeof other);
  sign(SECRET, NOW, EVENT, sig, sizeof sig);
  snprintf(both, sizeof both, "%s, %s", other, strchr(sig, ',') + 1);
  assert_int_equal(check(both, EVENT, NOW), IDEM_WEBHOOK_OK);
}

static void test_malformed_headers(void **state) {
  static const char *const bad[] = {
      "", "t=", "v1=00", "t=1764770000", "t=abc,v1=" /* no hex */,
      "t=1764770000,v1=zz", "t=1764770000,t=1764770000,v1=" /* two t */,
      "t=12345678901234,v1=0000000000000000000000000000000000000000000000000000000000000000",
  };
  char sig[256];
  (void)state;
  assert_int_equal(check(NULL, EVENT, NOW), IDEM_WEBHOOK_UNSIGNED);
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
    assert_int_equal(check(bad[i], EVENT, NOW), IDEM_WEBHOOK_UNSIGNED);
  /* upper-case hex and an unknown scheme beside v1 are fine */
  sign(SECRET, NOW, EVENT, sig, sizeof sig);
  for (char *c = sig; *c; c++)
    if (*c >= 'a' && *c <= 'f')
      *c = (char)(*c - 'a' + 'A');
  assert_int_equal(check(sig, EVENT, NOW), IDEM_WEBHOOK_OK);
  sign(SECRET, NOW, EVENT, sig, sizeof sig);
  {
    char with_v0[300];
    snprintf(with_v0, sizeof with_v0, "v0=whatever,%s", sig);
    assert_int_equal(check(with_v0, EVENT, NOW), IDEM_WEBHOOK_OK);
  }
}

static void test_parse_event(void **state) {
  idem_webhook_event_t ev;
  const char *why;
  static const char refund[] =
      "{\"id\":\"evt_2\",\"type\":\"refund.declined\",\"created\":5,"
      "\"data\":{\"key\":\"re_x\",\"id\":\"rf_9\",\"amount\":3}}";
  (void)state;
  assert_int_equal(idem_webhook_parse(EVENT, strlen(EVENT), &ev, &why), 0);
  assert_string_equal(ev.id, "evt_1");
  assert_int_equal(ev.refund, 0);
  assert_int_equal(ev.succeeded, 1);
  assert_string_equal(ev.key, "pay_abc");
  assert_string_equal(ev.provider_ref, "ch_1");
  assert_int_equal(ev.amount, 1000);
  assert_string_equal(idem_webhook_type(&ev), "charge.succeeded");
  assert_int_equal(idem_webhook_parse(refund, strlen(refund), &ev, &why), 0);
  assert_int_equal(ev.refund, 1);
  assert_int_equal(ev.succeeded, 0);
  assert_string_equal(idem_webhook_type(&ev), "refund.declined");
}

static void test_parse_refuses(void **state) {
  static const char *const bad[] = {
      "", "[]", "{", "null",
      "{\"id\":\"evt_1\",\"type\":\"charge.refunded\",\"created\":1,"
      "\"data\":{\"key\":\"pay_a\",\"id\":\"c\",\"amount\":1}}",
      "{\"id\":\"ev_1\",\"type\":\"charge.succeeded\",\"created\":1,"
      "\"data\":{\"key\":\"pay_a\",\"id\":\"c\",\"amount\":1}}",
      "{\"id\":\"evt_1\",\"type\":\"charge.succeeded\",\"created\":1,"
      "\"data\":{\"key\":\"re_a\",\"id\":\"c\",\"amount\":1}}",
      "{\"id\":\"evt_1\",\"type\":\"charge.succeeded\",\"created\":1,"
      "\"data\":{\"key\":\"pay_a\",\"id\":\"c\",\"amount\":0}}",
      "{\"id\":\"evt_1\",\"type\":\"charge.succeeded\",\"created\":\"1\","
      "\"data\":{\"key\":\"pay_a\",\"id\":\"c\",\"amount\":1}}",
      "{\"id\":\"evt_1\",\"type\":\"charge.succeeded\",\"created\":1,"
      "\"data\":{\"key\":\"pay_a/../x\",\"id\":\"c\",\"amount\":1}}",
      "{\"id\":\"evt_1\",\"type\":\"charge.succeeded\",\"created\":1,\"data\":[]}",
      "{\"id\":\"evt_1\",\"id\":\"evt_2\",\"type\":\"charge.succeeded\",\"created\":1,"
      "\"data\":{\"key\":\"pay_a\",\"id\":\"c\",\"amount\":1}}",
  };
  idem_webhook_event_t ev;
  const char *why;
  (void)state;
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    assert_int_equal(idem_webhook_parse(bad[i], strlen(bad[i]), &ev, &why), -1);
    assert_non_null(why);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_signed_event_passes),
      cmocka_unit_test(test_stale_or_future_is_refused),
      cmocka_unit_test(test_forgeries_are_refused),
      cmocka_unit_test(test_malformed_headers),
      cmocka_unit_test(test_parse_event),
      cmocka_unit_test(test_parse_refuses),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
