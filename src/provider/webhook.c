/* Provider events: the signature and the body (see webhook.h). */
#include "provider/webhook.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#define SIG_MAX_V1 4 /* signatures looked at in one header */

static int hexval(char c) {
  if (c >= '0' && c <= '9')
    return c - '0';
  if (c >= 'a' && c <= 'f')
    return c - 'a' + 10;
  if (c >= 'A' && c <= 'F')
    return c - 'A' + 10;
  return -1;
}

/* The parts of a signature header. */
struct sig {
  char t[16]; /* as written: the signed text starts with it */
  int64_t t_s;
  unsigned char v1[SIG_MAX_V1][IDEM_SHA256_LEN];
  int nv1;
};

/* Reads "t=<digits>,v1=<64 hex>[,v1=...]"; other schemes (v0=...) are
 * skipped, as a provider adding one must not break us. Returns 0, or -1
 * when there is no t or no v1. */
static int sig_parse(const char *h, struct sig *s) {
  memset(s, 0, sizeof *s);
  while (*h) {
    const char *end = h + strcspn(h, ",");
    while (*h == ' ')
      h++;
    if (strncmp(h, "t=", 2) == 0) {
      size_t n = (size_t)(end - h - 2);
      if (s->t[0] || n == 0 || n >= 12 || strspn(h + 2, "0123456789") < n)
        return -1;
      memcpy(s->t, h + 2, n);
      s->t[n] = '\0';
      s->t_s = strtoll(s->t, NULL, 10);
    } else if (strncmp(h, "v1=", 3) == 0) {
      if (end - h - 3 != 2 * IDEM_SHA256_LEN)
        return -1;
      if (s->nv1 < SIG_MAX_V1) {
        for (int i = 0; i < IDEM_SHA256_LEN; i++) {
          int hi = hexval(h[3 + 2 * i]), lo = hexval(h[4 + 2 * i]);
          if (hi < 0 || lo < 0)
            return -1;
          s->v1[s->nv1][i] = (unsigned char)(hi << 4 | lo);
        }
        s->nv1++;
      }
    }
    h = *end ? end + 1 : end;
  }
  return s->t[0] && s->nv1 > 0 ? 0 : -1;
}

idem_webhook_check_t idem_webhook_verify(const idem_hmac_t *secret, const char *header,
                                         const char *body, size_t len, int64_t now_s) {
  unsigned char mac[IDEM_SHA256_LEN];
  struct sig s;
  size_t tn;
  char *signed_text;
  int ok = 0, rc;

  if (header == NULL || strlen(header) > 512 || sig_parse(header, &s) != 0)
    return IDEM_WEBHOOK_UNSIGNED;
  if (s.t_s > now_s + IDEM_WEBHOOK_WINDOW_S || s.t_s < now_s - IDEM_WEBHOOK_WINDOW_S)
    return IDEM_WEBHOOK_STALE;
  tn = strlen(s.t);
  if ((signed_text = malloc(tn + 1 + len)) == NULL)
    return IDEM_WEBHOOK_FORGED; /* cannot tell: refused, the provider retries */
  memcpy(signed_text, s.t, tn);
  signed_text[tn] = '.';
  memcpy(signed_text + tn + 1, body, len);
  rc = idem_hmac_compute(secret, signed_text, tn + 1 + len, mac);
  free(signed_text);
  if (rc != IDEM_OK)
    return IDEM_WEBHOOK_FORGED;
  for (int i = 0; i < s.nv1; i++)
    ok |= idem_ct_equal(mac, s.v1[i], IDEM_SHA256_LEN);
  return ok ? IDEM_WEBHOOK_OK : IDEM_WEBHOOK_FORGED;
}

/* Copies the string member `name` of `obj` to `out` when it is 1 to
 * cap - 1 bytes of `charset` (NULL: any printable ASCII). */
static int take_string(json_t *obj, const char *name, const char *charset, char *out,
                       size_t cap) {
  json_t *v = json_object_get(obj, name);
  const char *s;
  size_t n;

  if (!json_is_string(v))
    return -1;
  s = json_string_value(v);
  n = json_string_length(v);
  if (n == 0 || n >= cap || strlen(s) != n)
    return -1;
  if (charset ? strspn(s, charset) != n : 0)
    return -1;
  for (size_t i = 0; charset == NULL && i < n; i++)
    if ((unsigned char)s[i] < 0x20 || (unsigned char)s[i] > 0x7e)
      return -1;
  memcpy(out, s, n + 1);
  return 0;
}

static const char ID_CHARS[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-";

static const struct {
  const char *name;
  int refund, succeeded;
} TYPES[] = {
    {"charge.succeeded", 0, 1},
    {"charge.declined", 0, 0},
    {"refund.succeeded", 1, 1},
    {"refund.declined", 1, 0},
};

int idem_webhook_parse(const char *body, size_t len, idem_webhook_event_t *ev,
                       const char **why) {
  json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, NULL);
  json_t *data, *v;
  const char *type;
  int known = 0;

  memset(ev, 0, sizeof *ev);
  *why = NULL;
  if (!json_is_object(root)) {
    *why = "the event is not a JSON object";
    goto out;
  }
  if (take_string(root, "id", ID_CHARS, ev->id, sizeof ev->id) != 0 ||
      strncmp(ev->id, "evt_", 4) != 0 || strlen(ev->id) < 5) {
    *why = "the event's id must be evt_ followed by 1 to 60 of A-Z a-z 0-9 _ -";
    goto out;
  }
  type = json_string_value(json_object_get(root, "type"));
  for (size_t i = 0; type && i < sizeof TYPES / sizeof *TYPES; i++)
    if (strcmp(type, TYPES[i].name) == 0) {
      ev->refund = TYPES[i].refund;
      ev->succeeded = TYPES[i].succeeded;
      known = 1;
    }
  if (!known) {
    *why = "the event's type must be charge.succeeded, charge.declined, "
           "refund.succeeded or refund.declined";
    goto out;
  }
  v = json_object_get(root, "created");
  if (!json_is_integer(v) || json_integer_value(v) <= 0) {
    *why = "the event's created must be a positive integer";
    goto out;
  }
  ev->created = json_integer_value(v);
  data = json_object_get(root, "data");
  if (!json_is_object(data) ||
      take_string(data, "key", ID_CHARS, ev->key, sizeof ev->key) != 0 ||
      take_string(data, "id", NULL, ev->provider_ref, sizeof ev->provider_ref) != 0) {
    *why = "the event's data must hold a key and an id";
    goto out;
  }
  if (strncmp(ev->key, ev->refund ? "re_" : "pay_", ev->refund ? 3 : 4) != 0) {
    *why = ev->refund ? "a refund's event must name a refund (re_...) as its key"
                      : "a charge's event must name a payment (pay_...) as its key";
    goto out;
  }
  v = json_object_get(data, "amount");
  if (!json_is_integer(v) || json_integer_value(v) <= 0) {
    *why = "the event's data.amount must be a positive integer";
    goto out;
  }
  ev->amount = json_integer_value(v);
out:
  json_decref(root);
  return *why ? -1 : 0;
}

const char *idem_webhook_type(const idem_webhook_event_t *ev) {
  for (size_t i = 0; i < sizeof TYPES / sizeof *TYPES; i++)
    if (TYPES[i].refund == ev->refund && TYPES[i].succeeded == ev->succeeded)
      return TYPES[i].name;
  return "";
}
