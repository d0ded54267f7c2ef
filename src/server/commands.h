/* The idemd command line (SPEC section 6): serve, tenant create, migrate,
 * sweep. Each returns the process exit status. */
#ifndef IDEMD_COMMANDS_H
#define IDEMD_COMMANDS_H

#include "server/config.h"

/* Serves HTTP until SIGTERM or SIGINT, then shuts down cleanly (0). */
int idemd_cmd_serve(const idemd_config_t *cfg);

/* Creates tenant `name` and prints its new API key alone on stdout. */
int idemd_cmd_tenant_create(const idemd_config_t *cfg, const char *name);

/* Creates or upgrades the schema. */
int idemd_cmd_migrate(const idemd_config_t *cfg);

/* Deletes every expired record now, in batches; prints the count. */
int idemd_cmd_sweep(const idemd_config_t *cfg);

#endif
