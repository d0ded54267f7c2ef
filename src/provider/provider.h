/* The payment provider seen from idemd: charge an amount, or refund part
 * of a charge, under a provider idempotency key, and learn the outcome.
 * The built-in sandbox implements it in process; an HTTP client can
 * implement the same table. */
#ifndef IDEM_PROVIDER_H
#define IDEM_PROVIDER_H

#include <stdint.h>

#include "idem/record.h"

typedef enum idem_charge_outcome {
  IDEM_CHARGE_SUCCEEDED = 1, /* the provider accepted the charge */
  IDEM_CHARGE_DECLINED,      /* the provider refused it; definite */
  IDEM_CHARGE_UNKNOWN,       /* sent, but no definite answer (timeout, 5xx) */
  IDEM_CHARGE_NOT_SENT,      /* nothing reached the provider; safe to retry */
  IDEM_CHARGE_NOT_FOUND      /* lookup: the provider never saw this key */
} idem_charge_outcome_t;

typedef struct idem_charge {
  const char *provider_key; /* stable for the payment: every retry reuses it */
  int64_t amount;
  const char *currency;
} idem_charge_t;

/* A refund of (part of) a charge. */
typedef struct idem_refund_req {
  const char *provider_key; /* stable for the refund (its id): every retry reuses it */
  const char *charge_key;   /* the provider key of the charge refunded (the payment's id) */
  int64_t amount;
  const char *currency;
} idem_refund_req_t;

/* What a call gave: for a charge or a refund alike. */
typedef struct idem_charge_result {
  idem_charge_outcome_t outcome;
  char reference[IDEM_REF_MAX + 1]; /* the provider's id for the charge or refund */
} idem_charge_result_t;

typedef struct idem_provider idem_provider_t;

/* 1 when a provider call of at most `call_ms` (--provider-timeout) that
 * starts at `now_ms` ends by `lease_expires_at`, the end of the lease
 * under which it is made (ms since the epoch, idem_now_ms()'s clock); else
 * 0, and the call must not start: once the lease has run out, the
 * reconciler may take the record over, or an operator settle it, and
 * call or settle under the same key meanwhile (docs/idempotency.md,
 * section 2.8). The reconciler checks the same before each call of its
 * claims (provider/reconciler.c); a request asks it before its own call,
 * which may have waited for a worker since the key was reserved. */
static inline int idem_provider_call_may_start(int64_t lease_expires_at, int64_t call_ms,
                                               int64_t now_ms) {
  return now_ms + call_ms <= lease_expires_at;
}

struct idem_provider {
  const char *name;
  /* 1 when charge() is cheap and returns at once, never waiting on a
   * network or a timer (the sandbox without --sandbox-delay). It may then
   * be called on the store's single writer thread (server/flow.c), so it
   * must not call the store either. */
  int never_waits;
  /* Charges `c` once per provider key, ever; fills `out`. Never fails
   * otherwise: a transport problem is an outcome. */
  void (*charge)(idem_provider_t *, const idem_charge_t *c,
                 idem_charge_result_t *out);
  /* Asks what became of the charge under c->provider_key (by that key,
   * or by it as the merchant reference for a provider that ignores keys):
   * SUCCEEDED or DECLINED (with its reference), NOT_FOUND, or UNKNOWN when
   * the provider could not tell (unreachable, 5xx). Never charges. */
  void (*lookup)(idem_provider_t *, const idem_charge_t *c,
                 idem_charge_result_t *out);
  /* Refunds r->amount of the charge under r->charge_key once per
   * r->provider_key, ever; fills `out` as charge() does: SUCCEEDED (the
   * refund's reference), DECLINED (the provider refused it: no such
   * charge, or more than is left of it), UNKNOWN or NOT_SENT. */
  void (*refund)(idem_provider_t *, const idem_refund_req_t *r,
                 idem_charge_result_t *out);
  /* Asks what became of the refund under r->provider_key, as lookup()
   * does for a charge. Never refunds. */
  void (*refund_lookup)(idem_provider_t *, const idem_refund_req_t *r,
                        idem_charge_result_t *out);
  void (*close)(idem_provider_t *);
};

/* Behaviour of the sandbox; amounts of 0 are never matched. */
typedef struct idem_sandbox_options {
  int64_t delay_ms;           /* added before every answer */
  int64_t decline_amount;     /* declined */
  int64_t uncertain_amount;   /* charged, but the answer is lost */
  int64_t unavailable_amount; /* never reaches the provider */
} idem_sandbox_options_t;

/* Creates the in-process sandbox: it accepts every charge and refund after
 * `opts->delay_ms` except the amounts `opts` names (a refund of such an
 * amount fares as a charge of it would). It keeps no state, so it cannot
 * tell a refund of more than is left of a charge: idemd's own check does
 * (docs/idempotency.md, section 4.5). Returns NULL when out of memory.
 * Free with provider->close(). */
idem_provider_t *idem_sandbox_new(const idem_sandbox_options_t *opts);

/* Creates a provider that talks HTTP to `base_url` ("http://host:port"):
 * POST /charges with an Idempotency-Key, GET /charges/{key}, and for
 * refunds POST /refunds ({"charge": charge_key, "amount": N}) and GET
 * /refunds/{key}. Each POST also sends the provider key as its
 * "reference". With `idempotent` 0 (a provider that ignores keys, where
 * every POST charges anew), lookups ask GET /charges?reference={key} and
 * GET /refunds?reference={key} instead: none listed is NOT_FOUND, one
 * succeeded SUCCEEDED, all declined DECLINED. Each call
 * gives up after `connect_timeout_ms` to connect and `timeout_ms` in all.
 * A call of which no byte went out (a refused or failed connection) is
 * NOT_SENT; a timeout, a 5xx or a lost connection once any of it went out
 * is UNKNOWN, even when libcurl's second try of a request that a kept-alive
 * connection dropped is then refused. Returns NULL for a URL
 * that is not http(s):// or when out of memory. */
idem_provider_t *idem_http_provider_new(const char *base_url,
                                        int64_t connect_timeout_ms,
                                        int64_t timeout_ms, int idempotent);

#endif
