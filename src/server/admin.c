/* Tools for the people who run idem: tenants (create, rotate, disable,
 * enable, list), their API keys (add, revoke, list) and records (list a
 * tenant's, show one). They print to the
 * operator's terminal; API keys are printed once and only hashes stored. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "idem/clock.h"
#include "server/auth.h"
#include "server/commands.h"
#include "server/server.h"

#define MAX_LIST 1000

static void print_time(const char *label, int64_t ms) {
  char when[32];
  if (ms == 0) {
    printf("%-16s -\n", label);
    return;
  }
  idem_format_time(ms, when, sizeof when);
  printf("%-16s %s\n", label, when);
}

static int store_failed(const char *what, int rc) {
  fprintf(stderr, "idemd: %s failed: %s (%s)\n", what, idem_strerror(rc),
          idem_store_last_error());
  return 1;
}

#define USAGE                                                                 \
  "usage: idemd tenant create|rotate|disable|enable NAME | list\n"              \
  "       idemd tenant key add|revoke NAME KEYNAME | key list NAME   [--db ...]\n"

static int no_tenant(const char *name) {
  fprintf(stderr, "idemd: no tenant named '%s'\n", name);
  return 1;
}

static int bad_name(void) {
  fprintf(stderr, "idemd: a name is 1 to 64 of A-Z a-z 0-9 . _ -\n");
  return 2;
}

/* Prints a new key alone on stdout, the one time it is ever shown. */
static int print_key(const char *key) {
  printf("%s\n", key);
  return 0;
}

static int tenant_create(idemd_tenants_t *tenants, const char *name) {
  char key[IDEMD_API_KEY_MAX + 1];
  idemd_tenant_t t = {0};
  idemd_api_key_t k;
  int rc;

  if (!idemd_name_valid(name))
    return bad_name();
  if ((rc = idemd_api_key_new("default", &k, key)) != IDEM_OK)
    return store_failed("key generation", rc);
  idem_copy(t.name, sizeof t.name, name);
  t.created_at = k.created_at;
  rc = idemd_tenant_create(tenants, &t, &k);
  if (rc == IDEM_EEXIST) {
    fprintf(stderr, "idemd: tenant '%s' already exists\n", name);
    return 1;
  }
  return rc == IDEM_OK ? print_key(key) : store_failed("tenant create", rc);
}

/* rotate: every key in use replaced by one new key, at once. */
static int tenant_rotate(idemd_tenants_t *tenants, const char *name) {
  char key[IDEMD_API_KEY_MAX + 1];
  idemd_api_key_t k;
  int rc = idemd_api_key_new("default", &k, key);

  if (rc == IDEM_OK)
    rc = idemd_key_replace_all(tenants, name, &k);
  if (rc == IDEM_ENOTFOUND)
    return no_tenant(name);
  return rc == IDEM_OK ? print_key(key) : store_failed("tenant rotate", rc);
}

static int tenant_enable(idemd_tenants_t *tenants, const char *action, const char *name) {
  int rc = idemd_tenant_set_disabled(tenants, name, strcmp(action, "disable") == 0);

  if (rc == IDEM_ENOTFOUND)
    return no_tenant(name);
  if (rc != IDEM_OK)
    return store_failed("tenant update", rc);
  fprintf(stderr, "idemd: tenant '%s' %sd\n", name, action);
  return 0;
}

static int tenant_list(idemd_tenants_t *tenants) {
  idemd_tenant_t *list = calloc(MAX_LIST, sizeof *list);
  int n = 0, rc;

  if (list == NULL)
    return 1;
  rc = idemd_tenant_list(tenants, list, MAX_LIST, &n);
  if (rc == IDEM_OK) {
    printf("%-24s %-9s %-5s %s\n", "NAME", "STATUS", "KEYS", "CREATED");
    for (int i = 0; i < n; i++) {
      char when[32];
      idem_format_time(list[i].created_at, when, sizeof when);
      printf("%-24s %-9s %-5d %s\n", list[i].name,
             list[i].disabled ? "disabled" : "active", list[i].keys, when);
    }
  }
  free(list);
  return rc == IDEM_OK ? 0 : store_failed("tenant list", rc);
}

static int key_add(idemd_tenants_t *tenants, const char *tenant, const char *name) {
  char key[IDEMD_API_KEY_MAX + 1];
  idemd_api_key_t k;
  int rc = idemd_api_key_new(name, &k, key);

  if (rc == IDEM_EINVAL)
    return bad_name();
  if (rc == IDEM_OK)
    rc = idemd_key_add(tenants, tenant, &k);
  if (rc == IDEM_ENOTFOUND)
    return no_tenant(tenant);
  if (rc == IDEM_EEXIST) {
    fprintf(stderr, "idemd: tenant '%s' has a key named '%s' in use already\n", tenant,
            name);
    return 1;
  }
  return rc == IDEM_OK ? print_key(key) : store_failed("key add", rc);
}

static int key_revoke(idemd_tenants_t *tenants, const char *tenant, const char *name) {
  idemd_tenant_t t;
  int rc = idemd_tenant_by_name(tenants, tenant, &t);

  if (rc == IDEM_ENOTFOUND)
    return no_tenant(tenant);
  if (rc == IDEM_OK)
    rc = idemd_key_revoke(tenants, tenant, name);
  if (rc == IDEM_ENOTFOUND) {
    fprintf(stderr, "idemd: tenant '%s' has no key named '%s' in use\n", tenant, name);
    return 1;
  }
  if (rc != IDEM_OK)
    return store_failed("key revoke", rc);
  fprintf(stderr, "idemd: key '%s' of tenant '%s' revoked\n", name, tenant);
  return 0;
}

static int key_list(idemd_tenants_t *tenants, const char *tenant) {
  idemd_api_key_t *list = calloc(MAX_LIST, sizeof *list);
  idemd_tenant_t t;
  int n = 0, rc;

  if (list == NULL)
    return 1;
  rc = idemd_tenant_by_name(tenants, tenant, &t);
  if (rc == IDEM_OK)
    rc = idemd_key_list(tenants, tenant, list, MAX_LIST, &n);
  if (rc == IDEM_OK) {
    printf("%-24s %-8s %-21s %-20s %-20s %s\n", "NAME", "STATUS", "KEY", "CREATED",
           "LAST USED", "REVOKED");
    for (int i = 0; i < n; i++) {
      char prefix[48], created[32], used[32] = "-", revoked[32] = "-";
      snprintf(prefix, sizeof prefix, "idem_%s_...", list[i].lookup);
      idem_format_time(list[i].created_at, created, sizeof created);
      if (list[i].last_used_at)
        idem_format_time(list[i].last_used_at, used, sizeof used);
      if (list[i].revoked_at)
        idem_format_time(list[i].revoked_at, revoked, sizeof revoked);
      printf("%-24s %-8s %-21s %-20s %-20s %s\n", list[i].name,
             list[i].revoked_at ? "revoked" : "active", prefix, created, used, revoked);
    }
  }
  free(list);
  if (rc == IDEM_ENOTFOUND)
    return no_tenant(tenant);
  return rc == IDEM_OK ? 0 : store_failed("key list", rc);
}

int idemd_cmd_tenant(const idemd_config_t *cfg, int argc, char *const *argv) {
  const char *action = argc > 0 ? argv[0] : "";
  const int key = strcmp(action, "key") == 0;
  const char *sub = key && argc > 1 ? argv[1] : "";
  idemd_tenants_t *tenants = NULL;
  idem_store_t *store;
  int rc, ok;

  if (key)
    ok = ((strcmp(sub, "add") == 0 || strcmp(sub, "revoke") == 0) && argc == 4) ||
         (strcmp(sub, "list") == 0 && argc == 3);
  else if (strcmp(action, "list") == 0)
    ok = argc == 1;
  else
    ok = argc == 2 && (strcmp(action, "create") == 0 || strcmp(action, "rotate") == 0 ||
                       strcmp(action, "disable") == 0 || strcmp(action, "enable") == 0);
  if (!ok) {
    fputs(USAGE, stderr);
    return 2;
  }
  if ((store = idemd_open_store(cfg)) == NULL)
    return 1;
  if (idemd_tenants_open(store, &tenants) != IDEM_OK)
    rc = store_failed("tenants", IDEM_ENOMEM);
  else if (key && strcmp(sub, "add") == 0)
    rc = key_add(tenants, argv[2], argv[3]);
  else if (key && strcmp(sub, "revoke") == 0)
    rc = key_revoke(tenants, argv[2], argv[3]);
  else if (key)
    rc = key_list(tenants, argv[2]);
  else if (strcmp(action, "list") == 0)
    rc = tenant_list(tenants);
  else if (strcmp(action, "create") == 0)
    rc = tenant_create(tenants, argv[1]);
  else if (strcmp(action, "rotate") == 0)
    rc = tenant_rotate(tenants, argv[1]);
  else
    rc = tenant_enable(tenants, action, argv[1]);
  idemd_tenants_close(tenants);
  idem_store_close(store);
  return rc;
}

static void show_record(const idem_record_t *r, const char *tenant) {
  printf("%-16s %s\n%-16s %s\n%-16s %s\n%-16s %s\n", "tenant", tenant, "operation",
         r->operation, "key", r->key, "state", idem_state_name(r->state));
  printf("%-16s %s\n", "fingerprint", r->fingerprint);
  if (r->response_status)
    printf("%-16s %d\n", "response status", r->response_status);
  printf("%-16s %s\n", "resource", r->resource_id[0] ? r->resource_id : "-");
  printf("%-16s %s\n", "provider ref", r->provider_ref[0] ? r->provider_ref : "-");
  printf("%-16s %s\n", "correlation id", r->correlation_id);
  print_time("created", r->created_at);
  print_time("updated", r->updated_at);
  print_time("expires", r->expires_at);
  if (r->state == IDEM_STATE_PROCESSING || r->owner_token[0])
    print_time("lease until", r->lease_expires_at);
  if (r->response_body)
    printf("%-16s %s\n", "response", r->response_body);
}

int idemd_cmd_records(const idemd_config_t *cfg, const idemd_records_args_t *a) {
  idem_records_query_t q = {0};
  idem_record_t *list = NULL;
  idem_store_t *store;
  idemd_tenants_t *tenants = NULL;
  idemd_tenant_t t;
  int n = 0, rc;

  if (a->tenant == NULL || (a->show && (a->operation == NULL || a->key == NULL))) {
    fprintf(stderr, "usage: idemd records --tenant NAME [--state S] [--older-than D] [--limit N]\n"
                    "       idemd records show --tenant NAME --operation OP --key KEY\n");
    return 2;
  }
  if (a->state && idem_state_parse(a->state) == IDEM_STATE_NONE) {
    fprintf(stderr, "idemd: --state is one of processing, completed, failed, pending\n");
    return 2;
  }
  if ((store = idemd_open_store(cfg)) == NULL)
    return 1;
  rc = idemd_tenants_open(store, &tenants);
  if (rc == IDEM_OK)
    rc = idemd_tenant_by_name(tenants, a->tenant, &t);
  idemd_tenants_close(tenants);
  if (rc == IDEM_ENOTFOUND) {
    fprintf(stderr, "idemd: no tenant named '%s'\n", a->tenant);
    idem_store_close(store);
    return 1;
  }
  if (rc == IDEM_OK && a->show) {
    idem_scope_t scope = {t.id, a->operation, a->key};
    idem_record_t rec = {0};
    /* now = 0: show the record even when it has expired */
    rc = idem_store_lookup(store, &scope, 0, &rec);
    if (rc == IDEM_OK)
      show_record(&rec, t.name);
    else if (rc == IDEM_ENOTFOUND)
      fprintf(stderr, "idemd: no record for that tenant, operation and key\n");
    idem_record_reset(&rec);
    idem_store_close(store);
    return rc == IDEM_OK ? 0 : rc == IDEM_ENOTFOUND ? 1 : store_failed("lookup", rc);
  }
  if (rc == IDEM_OK) {
    q.tenant_id = t.id;
    q.state = a->state ? idem_state_parse(a->state) : IDEM_STATE_NONE;
    q.updated_before = a->older_than_ms ? idem_now_ms() - a->older_than_ms : 0;
    q.limit = a->limit > 0 && a->limit < MAX_LIST ? a->limit : 100;
    if ((list = calloc((size_t)q.limit, sizeof *list)) == NULL)
      rc = IDEM_ENOMEM;
    else
      rc = idem_store_records_list(store, &q, list, &n);
  }
  if (rc == IDEM_OK) {
    printf("%-10s %-15s %-6s %-28s %-20s %s\n", "STATE", "OPERATION", "STATUS",
           "RESOURCE", "UPDATED", "KEY");
    for (int i = 0; i < n; i++) {
      char when[32];
      idem_format_time(list[i].updated_at, when, sizeof when);
      printf("%-10s %-15s %-6d %-28s %-20s %s\n", idem_state_name(list[i].state),
             list[i].operation, list[i].response_status,
             list[i].resource_id[0] ? list[i].resource_id : "-", when, list[i].key);
      idem_record_reset(&list[i]);
    }
  }
  free(list);
  idem_store_close(store);
  return rc == IDEM_OK ? 0 : store_failed("records", rc);
}
