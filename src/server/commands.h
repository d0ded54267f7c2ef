/* The idemd command line (docs/idempotency.md, section 6): serve, migrate,
 * sweep, and the tools for tenants and records. Each command returns the
 * process exit status: 0 success, 1 failure, 2 bad usage. */
#ifndef IDEMD_COMMANDS_H
#define IDEMD_COMMANDS_H

#include <stdint.h>

#include "idem/store.h"
#include "server/config.h"

/* Serves HTTP until SIGTERM or SIGINT, then drains and stops (returns 0).
 * Returns 1 when it cannot start; exits the process (status 0) when
 * requests are still unfinished after --shutdown-timeout. */
int idemd_cmd_serve(const idemd_config_t *cfg);

/* `idemd tenant ARGS...` (`argv` holds the words after "tenant", flags
 * taken out): create NAME (prints the new API key, named "default", alone
 * on stdout), rotate NAME (prints a new key; every key in use until then
 * stops working), disable NAME, enable NAME, list; key add NAME KEYNAME
 * (prints the new key; the others keep working), key revoke NAME KEYNAME,
 * key list NAME. */
int idemd_cmd_tenant(const idemd_config_t *cfg, int argc, char *const *argv);

/* What `idemd records` was asked. */
typedef struct idemd_records_args {
  int show;               /* records show: one record */
  const char *tenant;     /* required */
  const char *state;      /* list: NULL for any */
  int64_t older_than_ms;  /* list: 0 for any */
  int limit;              /* list */
  const char *operation;  /* show */
  const char *key;        /* show */
} idemd_records_args_t;

/* `idemd records ...`: lists a tenant's records, or shows one, with state,
 * fingerprint, times, resource and provider reference. Only ever reads
 * the named tenant's records. */
int idemd_cmd_records(const idemd_config_t *cfg, const idemd_records_args_t *a);

/* `idemd payments resolve ID ...` (`refund` 0) or `idemd refunds resolve
 * ID ...` (`argv` holds the words after "payments" or "refunds", and the
 * flags): settles a pending payment or refund by hand as --as succeeded
 * or declined, with --reason and --operator NAME (the audit row's actor
 * "operator:NAME"), through the reconciler's path (provider/settle.h).
 * 0 settled; 1 unknown, not pending, held by idemd past the retries, or a
 * store error, with nothing changed; 2 bad usage. */
int idemd_cmd_resolve(idemd_config_t *cfg, int refund, int argc, char **argv);

/* `idemd audit --tenant NAME [--resource ID]`: the tenant's audit rows
 * as JSON lines, oldest first. 0, 1 (no such tenant, store error), 2. */
int idemd_cmd_audit(idemd_config_t *cfg, int argc, char **argv);

/* Creates or upgrades the schema. */
int idemd_cmd_migrate(const idemd_config_t *cfg);

/* Deletes every expired record now, in batches; prints the count. */
int idemd_cmd_sweep(const idemd_config_t *cfg);

#endif
