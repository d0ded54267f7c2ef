/* A provider's event as idemd receives it at POST /webhooks/provider
 * (docs/payments.md, "Webhooks"): its signature, checked against the
 * shared secret and the clock, and its JSON read into what settles a
 * payment or a refund. Pure functions: no store, no HTTP. */
#ifndef IDEM_WEBHOOK_H
#define IDEM_WEBHOOK_H

#include <stddef.h>
#include <stdint.h>

#include "idem/crypto.h"

/* How far an event's signed time may be from ours, either way. */
#define IDEM_WEBHOOK_WINDOW_S 300
/* The largest event body taken; beyond it, 413. */
#define IDEM_WEBHOOK_MAX_BODY 8192

/* What a signature check found. */
typedef enum idem_webhook_check {
  IDEM_WEBHOOK_OK = 0,
  IDEM_WEBHOOK_UNSIGNED, /* no Idem-Psp-Signature, or not t=...,v1=... */
  IDEM_WEBHOOK_STALE,    /* t further than the window from now */
  IDEM_WEBHOOK_FORGED    /* no v1 is the HMAC of "<t>.<body>" */
} idem_webhook_check_t;

/* One event. `key` is what idemd sent as the idempotency key: the
 * payment's or refund's id. */
typedef struct idem_webhook_event {
  char id[65];           /* "evt_..." */
  int refund;            /* 0: a charge's event, 1: a refund's */
  int succeeded;         /* 0: declined */
  int64_t created;       /* unix seconds, as the provider says */
  char key[32];          /* pay_... or re_... */
  char provider_ref[65]; /* the provider's charge or refund id */
  int64_t amount;
} idem_webhook_event_t;

/* Checks `header` (the Idem-Psp-Signature value, NULL when absent:
 * "t=<unix s>,v1=<64 hex>", more than one v1 allowed while a secret is
 * rotated) against HMAC-SHA256 under the shared secret `secret` (prepared
 * with idem_hmac_new()) of "<t>.<body>", with t within
 * IDEM_WEBHOOK_WINDOW_S of `now_s`. The comparison takes the same time
 * whatever the bytes. */
idem_webhook_check_t idem_webhook_verify(const idem_hmac_t *secret, const char *header,
                                         const char *body, size_t len, int64_t now_s);

/* Reads a verified event body: {"id","type","created","data":{"key","id",
 * "amount"}} with type charge.succeeded, charge.declined,
 * refund.succeeded or refund.declined. Returns 0, or -1 with `*why` set
 * to a message for a 400 (the event is malformed or not one idemd
 * knows). */
int idem_webhook_parse(const char *body, size_t len, idem_webhook_event_t *ev,
                       const char **why);

/* A text the reason column of the audit can hold: "charge.succeeded"
 * and so on. */
const char *idem_webhook_type(const idem_webhook_event_t *ev);

#endif
