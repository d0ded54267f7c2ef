/* The sandbox provider: instant (or delayed) in-process charges, so idemd
 * runs with no external service. It keeps no state: what a charge does
 * follows from its amount, and references are derived from the provider
 * key, so a repeated key names the same charge, as a real provider would. */
#include "provider/provider.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "idem/crypto.h"

typedef struct sandbox {
  idem_provider_t base;
  idem_sandbox_options_t opts;
} sandbox_t;

/* What the sandbox does with a charge or refund of `amount` under
 * `provider_key`, and the reference it gives it (`prefix` and a digest of
 * the key). */
static void decide(const sandbox_t *sb, const char *prefix, const char *provider_key,
                   int64_t amount, idem_charge_result_t *out) {
  unsigned char digest[IDEM_SHA256_LEN];
  char hex[IDEM_SHA256_HEX_LEN];
  size_t n = strlen(prefix);

  out->reference[0] = '\0';
  if (amount == sb->opts.unavailable_amount) {
    out->outcome = IDEM_CHARGE_NOT_SENT;
    return;
  }
  if (idem_sha256(provider_key, strlen(provider_key), digest) != IDEM_OK) {
    out->outcome = IDEM_CHARGE_NOT_SENT;
    return;
  }
  idem_hex(digest, 12, hex);
  _Static_assert(sizeof out->reference >= 11 + 24 + 1,
                 "a reference holds ch_sandbox_ or re_sandbox_ and 24 hex digits");
  memcpy(out->reference, prefix, n);
  idem_copy(out->reference + n, sizeof out->reference - n, hex);
  if (amount == sb->opts.uncertain_amount)
    out->outcome = IDEM_CHARGE_UNKNOWN;
  else if (amount == sb->opts.decline_amount)
    out->outcome = IDEM_CHARGE_DECLINED;
  else
    out->outcome = IDEM_CHARGE_SUCCEEDED;
}

/* The --sandbox-delay before an answer (none for what is never sent). */
static void wait_delay(const sandbox_t *sb, int64_t amount) {
  int64_t delay = sb->opts.delay_ms;

  if (delay > 0 && amount != sb->opts.unavailable_amount) {
    struct timespec ts = {delay / 1000, (delay % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0)
      ;
  }
}

/* A lookup finds what the call did: nothing when it was never sent, and
 * made when only its answer was lost. */
static void as_looked_up(idem_charge_result_t *out) {
  if (out->outcome == IDEM_CHARGE_NOT_SENT)
    out->outcome = IDEM_CHARGE_NOT_FOUND;
  else if (out->outcome == IDEM_CHARGE_UNKNOWN)
    out->outcome = IDEM_CHARGE_SUCCEEDED;
}

static void sandbox_charge(idem_provider_t *p, const idem_charge_t *c,
                           idem_charge_result_t *out) {
  sandbox_t *sb = (sandbox_t *)p;
  wait_delay(sb, c->amount);
  decide(sb, "ch_sandbox_", c->provider_key, c->amount, out);
}

static void sandbox_lookup(idem_provider_t *p, const idem_charge_t *c,
                           idem_charge_result_t *out) {
  decide((sandbox_t *)p, "ch_sandbox_", c->provider_key, c->amount, out);
  as_looked_up(out);
}

static void sandbox_refund(idem_provider_t *p, const idem_refund_req_t *r,
                           idem_charge_result_t *out) {
  sandbox_t *sb = (sandbox_t *)p;
  wait_delay(sb, r->amount);
  decide(sb, "re_sandbox_", r->provider_key, r->amount, out);
}

static void sandbox_refund_lookup(idem_provider_t *p, const idem_refund_req_t *r,
                                  idem_charge_result_t *out) {
  decide((sandbox_t *)p, "re_sandbox_", r->provider_key, r->amount, out);
  as_looked_up(out);
}

static void sandbox_close(idem_provider_t *p) { free(p); }

idem_provider_t *idem_sandbox_new(const idem_sandbox_options_t *opts) {
  sandbox_t *sb = calloc(1, sizeof *sb);
  if (sb == NULL)
    return NULL;
  sb->base.name = "sandbox";
  sb->base.never_waits = opts->delay_ms <= 0;
  sb->base.charge = sandbox_charge;
  sb->base.lookup = sandbox_lookup;
  sb->base.refund = sandbox_refund;
  sb->base.refund_lookup = sandbox_refund_lookup;
  sb->base.close = sandbox_close;
  sb->opts = *opts;
  return &sb->base;
}
