/* `idemd gateway pending` (docs/gateway.md, "Pending requests"): the
 * gateway's unsettled keys for an operator, from its table of kept
 * requests and their records: which are pending, which a gateway holds
 * (processing), how often each was sent again and when it is next due. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gateway/gateway.h"
#include "gateway/requests.h"
#include "idem/clock.h"

#define MAX_LIST 1000

static void when(int64_t ms, char *out, size_t len) {
  time_t s = (time_t)(ms / 1000);
  struct tm tm;
  if (ms <= 0 || ms == GW_NEVER) {
    snprintf(out, len, "%s", ms == GW_NEVER ? "never" : "-");
    return;
  }
  gmtime_r(&s, &tm);
  strftime(out, len, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

int gw_cmd_pending(int argc, char **argv) {
  const char *db = "./idem-gateway.db";
  idem_store_t *store = NULL;
  gw_saved_t *list;
  char why[256];
  int n = 0, rc;

  for (int i = 0; i < argc; i++) {
    if (strcmp(argv[i], "--db") == 0 && i + 1 < argc) {
      db = argv[++i];
    } else {
      fprintf(stderr, "usage: idemd gateway pending [--db FILE|postgresql://...]\n");
      return 2;
    }
  }
  if ((rc = idem_store_open(db, NULL, &store)) != IDEM_OK ||
      (rc = idem_store_migrate(store)) != IDEM_OK ||
      (rc = gw_schema_migrate(store, why, sizeof why)) != IDEM_OK) {
    fprintf(stderr, "idemd gateway: cannot open database: %s (%s)\n", idem_strerror(rc),
            idem_store_last_error());
    if (store)
      idem_store_close(store);
    return 1;
  }
  if ((list = calloc(MAX_LIST, sizeof *list)) == NULL ||
      (rc = gw_due_list(store, GW_NEVER, list, MAX_LIST, &n)) != IDEM_OK) {
    fprintf(stderr, "idemd gateway: cannot list: %s\n", idem_strerror(list ? rc : IDEM_ENOMEM));
    free(list);
    idem_store_close(store);
    return 1;
  }
  printf("%-10s %-32s %-24s %-8s %-20s %-20s %s\n", "STATE", "ROUTE", "KEY", "ATTEMPTS",
         "CREATED", "NEXT", "SCOPE");
  for (int i = 0; i < n; i++) {
    idem_record_t rec = {0};
    char created[32], next[32];
    int64_t due = 0;
    const char *state = "none";

    if (idem_store_lookup(store, &list[i].scope, idem_now_ms(), &rec) == IDEM_OK)
      state = idem_state_name(rec.state);
    due = list[i].next_attempt_at;
    when(rec.created_at, created, sizeof created);
    when(due, next, sizeof next);
    printf("%-10s %-32s %-24s %-8d %-20s %-20s %lld\n", state, list[i].operation, list[i].key,
           list[i].attempts, created, next, (long long)list[i].scope.tenant_id);
    idem_record_reset(&rec);
    free(list[i].request);
  }
  free(list);
  idem_store_close(store);
  return 0;
}
