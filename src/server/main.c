/* idemd's entry point: picks the command and parses its flags. */
#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "idem_version.h"
#include "gateway/gateway.h"
#include "server/commands.h"

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

/* Takes the flags of `idemd records` out of argv (the rest are the common
 * flags such as --db). Returns the number of arguments left, or -1. */
static int records_flags(int argc, char **argv, idemd_records_args_t *a) {
  int kept = 0;
  for (int i = 0; i < argc; i++) {
    const char **slot = NULL;
    const char *flag = argv[i];
    if (strcmp(flag, "--tenant") == 0)
      slot = &a->tenant;
    else if (strcmp(flag, "--state") == 0)
      slot = &a->state;
    else if (strcmp(flag, "--operation") == 0)
      slot = &a->operation;
    else if (strcmp(flag, "--key") == 0)
      slot = &a->key;
    else if (strcmp(flag, "--older-than") != 0 && strcmp(flag, "--limit") != 0) {
      argv[kept++] = argv[i];
      continue;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "idemd: option %s needs a value\n", flag);
      return -1;
    }
    const char *v = argv[++i];
    if (slot) {
      *slot = v;
    } else if (strcmp(flag, "--older-than") == 0) {
      if (idemd_parse_duration(v, &a->older_than_ms) != 0) {
        fprintf(stderr, "idemd: invalid value for --older-than: '%s'\n", v);
        return -1;
      }
    } else {
      char *end;
      long n = strtol(v, &end, 10);
      if (*end || n < 1 || n > 1000) {
        fprintf(stderr, "idemd: --limit takes a number from 1 to 1000\n");
        return -1;
      }
      a->limit = (int)n;
    }
  }
  return kept;
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
    printf("idemd %s\n", IDEM_VERSION_STRING);
    return 0;
  }
  if (strncmp(cmd, "--", 2) == 0) /* "idemd --listen ..." means serve */
    return parse_flags(&cfg, argc - 1, argv + 1) ? 2 : idemd_cmd_serve(&cfg);
  if (strcmp(cmd, "serve") == 0) /* also plain "idemd": argc is 1 then */
    return parse_flags(&cfg, argc > 2 ? argc - 2 : 0, argv + (argc > 2 ? 2 : argc)) ? 2
                                                                        : idemd_cmd_serve(&cfg);
  if (strcmp(cmd, "migrate") == 0)
    return parse_flags(&cfg, argc - 2, argv + 2) ? 2 : idemd_cmd_migrate(&cfg);
  if (strcmp(cmd, "sweep") == 0)
    return parse_flags(&cfg, argc - 2, argv + 2) ? 2 : idemd_cmd_sweep(&cfg);
  if (strcmp(cmd, "tenant") == 0) {
    /* The words, then the flags. */
    int words = 0;
    while (2 + words < argc && strncmp(argv[2 + words], "--", 2) != 0)
      words++;
    if (parse_flags(&cfg, argc - 2 - words, argv + 2 + words))
      return 2;
    return idemd_cmd_tenant(&cfg, words, argv + 2);
  }
  if (strcmp(cmd, "gateway") == 0) /* docs/gateway.md */
    return gw_cmd_gateway(argc - 2, argv + 2);
  if (strcmp(cmd, "records") == 0) {
    idemd_records_args_t a = {0};
    int first = 2, left;
    if (argc > 2 && strcmp(argv[2], "show") == 0) {
      a.show = 1;
      first = 3;
    }
    left = records_flags(argc - first, argv + first, &a);
    if (left < 0 || parse_flags(&cfg, left, argv + first))
      return 2;
    return idemd_cmd_records(&cfg, &a);
  }
  if (strcmp(cmd, "payments") == 0 || strcmp(cmd, "refunds") == 0)
    return idemd_cmd_resolve(&cfg, cmd[0] == 'r', argc - 2, argv + 2);
  if (strcmp(cmd, "audit") == 0)
    return idemd_cmd_audit(&cfg, argc - 2, argv + 2);
  fprintf(stderr, "idemd: unknown command '%s' (see idemd --help)\n", cmd);
  return 2;
}
