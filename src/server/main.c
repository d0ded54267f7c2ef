/* idemd's entry point: picks the command and parses its flags. */
#include <curl/curl.h>
#include <stdio.h>
#include <string.h>

#include "server/commands.h"

#ifndef IDEM_VERSION
#define IDEM_VERSION "dev"
#endif

static int parse_flags(idemd_config_t *cfg, int argc, char **argv) {
  int used = idemd_config_parse(cfg, argc, argv, stderr);
  if (used < 0)
    return -1;
  if (used != argc) {
    fprintf(stderr, "idemd: unexpected argument '%s' (see idemd --help)\n", argv[used]);
    return -1;
  }
  return 0;
}

int main(int argc, char **argv) {
  idemd_config_t cfg;
  const char *cmd = argc > 1 ? argv[1] : "serve";

  idemd_config_defaults(&cfg);
  /* Before any thread starts: libcurl's global state (provider client). */
  curl_global_init(CURL_GLOBAL_DEFAULT);
  if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
    idemd_config_usage(stdout);
    return 0;
  }
  if (strcmp(cmd, "--version") == 0) {
    printf("idemd %s\n", IDEM_VERSION);
    return 0;
  }
  if (strncmp(cmd, "--", 2) == 0) /* "idemd --listen ..." means serve */
    return parse_flags(&cfg, argc - 1, argv + 1) ? 2 : idemd_cmd_serve(&cfg);
  if (strcmp(cmd, "serve") == 0)
    return parse_flags(&cfg, argc - 2, argv + 2) ? 2 : idemd_cmd_serve(&cfg);
  if (strcmp(cmd, "migrate") == 0)
    return parse_flags(&cfg, argc - 2, argv + 2) ? 2 : idemd_cmd_migrate(&cfg);
  if (strcmp(cmd, "sweep") == 0)
    return parse_flags(&cfg, argc - 2, argv + 2) ? 2 : idemd_cmd_sweep(&cfg);
  if (strcmp(cmd, "tenant") == 0) {
    if (argc < 4 || strcmp(argv[2], "create") != 0) {
      fprintf(stderr, "usage: idemd tenant create NAME [--db ...]\n");
      return 2;
    }
    return parse_flags(&cfg, argc - 4, argv + 4) ? 2
                                                 : idemd_cmd_tenant_create(&cfg, argv[3]);
  }
  fprintf(stderr, "idemd: unknown command '%s' (see idemd --help)\n", cmd);
  return 2;
}
