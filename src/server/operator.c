/* An operator's tools for the ambiguous cases (docs/operations.md, "A
 * payment that stays pending" and "The audit trail"): `idemd payments
 * resolve` and `idemd refunds resolve` settle a pending payment or refund
 * by hand, through the one settling path the reconciler and the webhooks
 * take (provider/settle.h); `idemd audit` prints a tenant's audit trail
 * as JSON lines. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "data/audit.h"
#include "data/tenants.h"
#include "idem/clock.h"
#include "provider/refund.h"
#include "provider/settle.h"
#include "server/auth.h"
#include "server/commands.h"
#include "server/server.h"
#include "util/flags.h"

/* How long a resolution holds the record it took over: if the command
 * dies in between, the reconciler takes the record back after this. */
#define RESOLVE_LEASE_MS 10000
/* A worker or the reconciler at work on the payment holds it for its
 * call: the command tries again for about this long before giving up. */
#define RESOLVE_TRIES 50
#define RESOLVE_PAUSE_MS 100

/* The common flags left over (--db and the like). 0, or -1 (printed). */
static int common_flags(idemd_config_t *cfg, int argc, char **argv) {
  int used = idemd_config_parse(cfg, argc, argv, stderr);
  if (used < 0)
    return -1;
  if (used != argc) {
    fprintf(stderr, "idemd: unexpected argument '%s'\n", argv[used]);
    return -1;
  }
  return 0;
}

/* The tenant named `name` into `*id`. 0, or 1 (printed). */
static int tenant_id(idem_store_t *store, const char *name, int64_t *id) {
  idemd_tenants_t *tenants = NULL;
  idemd_tenant_t t;
  int rc = idemd_tenants_open(store, &tenants);

  if (rc == IDEM_OK)
    rc = idemd_tenant_by_name(tenants, name, &t);
  idemd_tenants_close(tenants);
  if (rc == IDEM_ENOTFOUND) {
    fprintf(stderr, "idemd: no tenant named '%s'\n", name);
    return 1;
  }
  if (rc != IDEM_OK) {
    fprintf(stderr, "idemd: reading the tenant failed: %s (%s)\n", idem_strerror(rc),
            idem_store_last_error());
    return 1;
  }
  *id = t.id;
  return 0;
}

static void pause_ms(int ms) {
  struct timespec ts = {0, (long)ms * 1000000L};
  nanosleep(&ts, NULL);
}

int idemd_cmd_resolve(idemd_config_t *cfg, int refund, int argc, char **argv) {
  static const char *const names[] = {"--as", "--reason", "--operator", "--tenant", NULL};
  const char *v[4] = {0}, *words[2] = {0};
  const char *what = refund ? "refund" : "payment";
  idem__flags_t flags = {"idemd", names, v, words, 2, 0, 1};
  char actor[80];
  int left, rc, status = 0;
  int64_t tenant = 0;
  idemd_pending_t p;
  idemd_claim_t found = IDEMD_CLAIM_UNKNOWN;
  idem_store_t *store;

  left = idem__flags_take(&flags, argc, argv);
  if (left < 0 || common_flags(cfg, left, argv) != 0)
    return 2;
  if (flags.nwords != 2 || strcmp(words[0], "resolve") != 0 || !v[0] || !v[1] || !v[2]) {
    fprintf(stderr,
            "usage: idemd %ss resolve ID --as succeeded|declined --reason TEXT "
            "--operator NAME [--tenant NAME] [--db ...]\n",
            what);
    return 2;
  }
  if (strcmp(v[0], "succeeded") != 0 && strcmp(v[0], "declined") != 0) {
    fprintf(stderr, "idemd: --as is succeeded or declined\n");
    return 2;
  }
  if (!idemd_audit_text_valid(v[1], IDEM_REFUND_REASON_MAX)) {
    fprintf(stderr, "idemd: --reason is 1 to %d characters of UTF-8, none a control\n",
            IDEM_REFUND_REASON_MAX);
    return 2;
  }
  if (!idemd_name_valid(v[2])) {
    fprintf(stderr, "idemd: --operator is 1 to 64 of A-Z a-z 0-9 . _ -\n");
    return 2;
  }
  snprintf(actor, sizeof actor, "operator:%s", v[2]);
  if ((store = idemd_open_store(cfg)) == NULL)
    return 1;
  if (v[3] && tenant_id(store, v[3], &tenant) != 0) {
    idem_store_close(store);
    return 1;
  }
  for (int i = 0; i < RESOLVE_TRIES; i++) {
    rc = idemd_settle_claim(store, refund, tenant, words[1], NULL, 1, RESOLVE_LEASE_MS,
                            &p, &found);
    if (rc != IDEM_OK || found != IDEMD_CLAIM_BUSY)
      break;
    pause_ms(RESOLVE_PAUSE_MS);
  }
  if (rc == IDEM_OK && found == IDEMD_CLAIM_TAKEN) {
    idem_charge_result_t res = {.outcome = strcmp(v[0], "succeeded") == 0
                                               ? IDEM_CHARGE_SUCCEEDED
                                               : IDEM_CHARGE_DECLINED};
    idemd_actor_t who = {actor, v[1]};
    rc = idemd_settle(store, &p.rec, p.body, &res, &who, NULL, cfg->key_ttl_ms, &status);
    if (rc == IDEM_ELOST)
      found = IDEMD_CLAIM_BUSY; /* taken from us meanwhile: nothing written */
  }
  if (rc != IDEM_OK && rc != IDEM_ELOST)
    fprintf(stderr, "idemd: resolving failed, nothing changed: %s (%s)\n",
            idem_strerror(rc), idem_store_last_error());
  else if (found == IDEMD_CLAIM_UNKNOWN)
    fprintf(stderr, "idemd: no %s '%s'%s\n", what, words[1],
            v[3] ? " for that tenant" : "");
  else if (found == IDEMD_CLAIM_SETTLED)
    fprintf(stderr, "idemd: %s '%s' is %s, not pending; nothing changed\n", what,
            words[1], p.status);
  else if (found == IDEMD_CLAIM_BUSY)
    fprintf(stderr,
            "idemd: %s '%s' is being settled by idemd right now (a request or the "
            "reconciler holds it); nothing changed: try again\n",
            what, words[1]);
  else
    printf("%s %s\n", words[1], v[0]);
  idemd_settle_reset(&p);
  idem_store_close(store);
  return rc == IDEM_OK && found == IDEMD_CLAIM_TAKEN && status != 202 ? 0 : 1;
}

/* ---- idemd audit --------------------------------------------------------- */

struct printing {
  const char *tenant;
  int failed;
};

static int print_row(void *arg, const idemd_audit_row_t *row) {
  struct printing *pr = arg;
  char *line = idemd_audit_json(row, pr->tenant);

  if (line == NULL) {
    pr->failed = 1;
    return IDEM_ENOMEM;
  }
  printf("%s\n", line);
  free(line);
  return IDEM_OK;
}

int idemd_cmd_audit(idemd_config_t *cfg, int argc, char **argv) {
  static const char *const names[] = {"--tenant", "--resource", NULL};
  const char *v[2] = {0};
  idem__flags_t flags = {"idemd", names, v, NULL, 0, 0, 1};
  int left, rc;
  int64_t tenant = 0;
  idem_store_t *store;
  struct printing pr = {0};

  left = idem__flags_take(&flags, argc, argv);
  if (left < 0 || common_flags(cfg, left, argv) != 0)
    return 2;
  if (v[0] == NULL) {
    fprintf(stderr, "usage: idemd audit --tenant NAME [--resource ID] [--db ...]\n");
    return 2;
  }
  if ((store = idemd_open_store(cfg)) == NULL)
    return 1;
  if (tenant_id(store, v[0], &tenant) != 0) {
    idem_store_close(store);
    return 1;
  }
  pr.tenant = v[0];
  rc = idemd_audit_list(store, tenant, v[1], print_row, &pr);
  idem_store_close(store);
  if (rc != IDEM_OK) {
    fprintf(stderr, "idemd: reading the audit failed: %s (%s)\n", idem_strerror(rc),
            idem_store_last_error());
    return 1;
  }
  return 0;
}
