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

/* What the sandbox does with `c`, and the reference it gives it. */
static void decide(const sandbox_t *sb, const idem_charge_t *c,
                   idem_charge_result_t *out) {
  unsigned char digest[IDEM_SHA256_LEN];
  char hex[IDEM_SHA256_HEX_LEN];

  out->reference[0] = '\0';
  if (c->amount == sb->opts.unavailable_amount) {
    out->outcome = IDEM_CHARGE_NOT_SENT;
    return;
  }
  if (idem_sha256(c->provider_key, strlen(c->provider_key), digest) != IDEM_OK) {
    out->outcome = IDEM_CHARGE_NOT_SENT;
    return;
  }
  idem_hex(digest, 12, hex);
  _Static_assert(sizeof out->reference >= 11 + 24 + 1,
                 "a reference holds ch_sandbox_ and 24 hex digits");
  memcpy(out->reference, "ch_sandbox_", 11);
  idem_copy(out->reference + 11, sizeof out->reference - 11, hex);
  if (c->amount == sb->opts.uncertain_amount)
    out->outcome = IDEM_CHARGE_UNKNOWN;
  else if (c->amount == sb->opts.decline_amount)
    out->outcome = IDEM_CHARGE_DECLINED;
  else
    out->outcome = IDEM_CHARGE_SUCCEEDED;
}

static void sandbox_charge(idem_provider_t *p, const idem_charge_t *c,
                           idem_charge_result_t *out) {
  sandbox_t *sb = (sandbox_t *)p;
  int64_t delay = sb->opts.delay_ms;

  if (delay > 0 && c->amount != sb->opts.unavailable_amount) {
    struct timespec ts = {delay / 1000, (delay % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0)
      ;
  }
  decide(sb, c, out);
}

static void sandbox_lookup(idem_provider_t *p, const idem_charge_t *c,
                           idem_charge_result_t *out) {
  decide((sandbox_t *)p, c, out);
  if (out->outcome == IDEM_CHARGE_NOT_SENT)
    out->outcome = IDEM_CHARGE_NOT_FOUND;
  else if (out->outcome == IDEM_CHARGE_UNKNOWN)
    out->outcome = IDEM_CHARGE_SUCCEEDED; /* made; only its answer was lost */
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
  sb->base.close = sandbox_close;
  sb->opts = *opts;
  return &sb->base;
}
