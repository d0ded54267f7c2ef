/* Fuzz target for provider events (provider/webhook.c). The input is a
 * signature header, a newline, and a body. Properties: the header parser
 * never accepts a signature that is not the body's HMAC (an accepted
 * header holds the true MAC's hex); the true signature of any body is
 * accepted, at the window's edges and not beyond them; the event parser
 * returns exactly one of an event or a message, and an event's fields keep
 * their contracts (prefixes, lengths, positive amount, a known type). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ctype.h>

#include "fuzz_util.h"
#include "provider/webhook.h"

#define SECRET "fuzz secret"
#define NOW 1764770000

static idem_hmac_t *secret;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  secret = idem_hmac_new(SECRET, strlen(SECRET));
  FUZZ_CHECK(secret != NULL, "out of memory");
  return 0;
}

/* The hex MAC of "<t>.<body>". */
static void true_mac(long long t, const char *body, size_t len, char hex[65]) {
  unsigned char mac[IDEM_SHA256_LEN];
  char prefix[32];
  int n = snprintf(prefix, sizeof prefix, "%lld.", t);
  char *text = malloc((size_t)n + len + 1);
  FUZZ_CHECK(text != NULL, "out of memory");
  memcpy(text, prefix, (size_t)n);
  memcpy(text + n, body, len);
  FUZZ_CHECK(idem_hmac_compute(secret, text, (size_t)n + len, mac) == IDEM_OK, "hmac");
  free(text);
  idem_hex(mac, sizeof mac, hex);
}

/* The header's t field: "t=" at its start or after a comma and spaces. */
static const char *field_t(const char *h) {
  for (const char *p = strstr(h, "t="); p; p = strstr(p + 1, "t=")) {
    const char *q = p;
    while (q > h && q[-1] == ' ')
      q--;
    if (q == h || q[-1] == ',')
      return p;
  }
  return NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const char *nl = memchr(data, '\n', size);
  size_t hlen = nl ? (size_t)(nl - (const char *)data) : size;
  char *header = malloc(hlen + 1), *body;
  size_t blen = nl ? size - hlen - 1 : 0;
  idem_webhook_event_t ev;
  const char *why = NULL;
  char hex[65], good[128];

  FUZZ_CHECK(header != NULL, "out of memory");
  memcpy(header, data, hlen);
  header[hlen] = '\0';
  body = malloc(blen + 1);
  FUZZ_CHECK(body != NULL, "out of memory");
  if (blen)
    memcpy(body, nl + 1, blen);
  body[blen] = '\0';

  if (strlen(header) == hlen &&
      idem_webhook_verify(secret, header, body, blen, NOW) == IDEM_WEBHOOK_OK) {
    /* accepted: one of its v1 values is the MAC under some t in the window */
    const char *t = field_t(header);
    FUZZ_CHECK(t != NULL, "accepted without t: %s", header);
    true_mac(strtoll(t + 2, NULL, 10), body, blen, hex);
    for (char *c = header; *c; c++)
      *c = (char)tolower((unsigned char)*c);
    FUZZ_CHECK(strstr(header, hex) != NULL, "accepted a forged signature: %s", header);
  }
  true_mac(NOW, body, blen, hex);
  snprintf(good, sizeof good, "t=%d,v1=%s", NOW, hex);
  FUZZ_CHECK(idem_webhook_verify(secret, good, body, blen, NOW) == IDEM_WEBHOOK_OK,
             "refused its true signature");
  FUZZ_CHECK(idem_webhook_verify(secret, good, body, blen, NOW + IDEM_WEBHOOK_WINDOW_S) ==
                 IDEM_WEBHOOK_OK,
             "refused at the window's edge");
  FUZZ_CHECK(idem_webhook_verify(secret, good, body, blen, NOW + IDEM_WEBHOOK_WINDOW_S + 1) ==
                 IDEM_WEBHOOK_STALE,
             "accepted past the window");

  if (idem_webhook_parse(body, blen, &ev, &why) == 0) {
    FUZZ_CHECK(why == NULL, "an event and a message");
    FUZZ_CHECK(strncmp(ev.id, "evt_", 4) == 0 && strlen(ev.id) > 4, "id %s", ev.id);
    FUZZ_CHECK(strncmp(ev.key, ev.refund ? "re_" : "pay_", ev.refund ? 3 : 4) == 0,
               "key %s", ev.key);
    FUZZ_CHECK(ev.provider_ref[0] != '\0' && ev.amount > 0 && ev.created > 0, "fields");
    FUZZ_CHECK(idem_webhook_type(&ev)[0] != '\0', "type");
  } else {
    FUZZ_CHECK(why != NULL && why[0] != '\0', "refused without a message");
  }
  free(header);
  free(body);
  return 0;
}
