/* An operator's tools for the gateway's pending keys (docs/gateway.md,
 * "Resolving a pending key"): `idemd gateway resolve` completes one
 * pending record with a status and body given by hand, audited, so that
 * the key's retries replay that answer; `idemd gateway audit` prints the
 * gateway's audit trail as JSON lines. The model is `idemd payments
 * resolve` (server/operator.c): the record is taken over under an owner
 * token of its own, as the resolver takes it (idem_tx_take_over()), so a
 * gateway or its resolver acting on the key at that moment is fenced off,
 * and then completed in one transaction with its kept request dropped and
 * the audit row of the change. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "data/audit.h"
#include "data/sql.h"
#include "gateway/answer.h"
#include "gateway/gateway.h"
#include "gateway/request.h"
#include "gateway/requests.h"
#include "idem/clock.h"
#include "server/auth.h"
#include "server/config.h"
#include "util/flags.h"

/* How long a resolution holds the record it took over: if the command
 * dies in between, a gateway's resolver takes the record back after
 * this (and, without --upstream-idempotent, leaves it pending). */
#define RESOLVE_LEASE_MS 10000
/* A gateway or its resolver at work on the key holds it for its call:
 * the command tries again for about this long before giving up. */
#define RESOLVE_TRIES 50
#define RESOLVE_PAUSE_MS 100
/* An answer given by hand: as large as the gateway keeps by default
 * (--max-answer). */
#define RESOLVE_BODY_MAX (1 << 20)
#define REASON_MAX 200
#define CONTENT_TYPE_MAX 255
/* Scopes named when a key is unsettled under several. */
#define MAX_SCOPES 8

static const char usage_text[] =
    "usage: idemd gateway resolve KEY --route 'METHOD /pattern' --status N\n"
    "         [--body TEXT | --body-file FILE] [--content-type TYPE]\n"
    "         --reason TEXT --operator NAME [--scope N | --scope-value TEXT]\n"
    "         [--key-ttl DURATION] [--db FILE|postgresql://...]\n";

typedef struct resolve_args {
  const char *key, *route, *status, *body, *body_file, *content_type, *reason,
      *operator_name, *scope, *scope_value, *key_ttl, *db;
} resolve_args_t;

/* ---- checking what was asked ------------------------------------------ */

/* The flags of `idemd gateway resolve` into `a`: each at most once, one
 * word (the key), nothing else. 0, or -1 (printed). */
static int parse_args(int argc, char **argv, resolve_args_t *a) {
  static const char *const names[] = {
      "--route",    "--status", "--body",    "--body-file", "--content-type", "--reason",
      "--operator", "--scope",  "--key-ttl", "--db",        "--scope-value",  NULL};
  const char *v[11], *key[1];
  idem__flags_t flags = {"idemd gateway", names, v, key, 1, 0, 0};
  _Static_assert(sizeof v / sizeof *v == sizeof names / sizeof *names - 1,
                 "a value per flag");

  memset(a, 0, sizeof *a);
  if (idem__flags_take(&flags, argc, argv) < 0)
    return -1;
  *a = (resolve_args_t){.key = flags.nwords ? key[0] : NULL,
                        .route = v[0],
                        .status = v[1],
                        .body = v[2],
                        .body_file = v[3],
                        .content_type = v[4],
                        .reason = v[5],
                        .operator_name = v[6],
                        .scope = v[7],
                        .key_ttl = v[8],
                        .db = v[9],
                        .scope_value = v[10]};
  return 0;
}

/* A Content-Type value: 1 to CONTENT_TYPE_MAX of visible ASCII, spaces
 * and tabs, with a '/': it is replayed as a header, so never a CR or LF. */
static int content_type_ok(const char *s) {
  size_t n = strlen(s);
  if (n == 0 || n > CONTENT_TYPE_MAX || strchr(s, '/') == NULL)
    return 0;
  for (; *s; s++)
    if (((unsigned char)*s < 0x20 && *s != '\t') || (unsigned char)*s >= 0x7f)
      return 0;
  return 1;
}

static int is_json_type(const char *ct) {
  const char *semi = strchr(ct, ';');
  size_t n = semi ? (size_t)(semi - ct) : strlen(ct);
  while (n > 0 && (ct[n - 1] == ' ' || ct[n - 1] == '\t'))
    n--;
  return (n == 16 && strncasecmp(ct, "application/json", 16) == 0) ||
         (n > 5 && strncasecmp(ct + n - 5, "+json", 5) == 0);
}

/* Reads at most RESOLVE_BODY_MAX bytes of `path` into `*out` (malloc'd)
 * and `*len`. 0, or -1 (printed). */
static int read_body_file(const char *path, char **out, size_t *len) {
  FILE *f = fopen(path, "rb");
  char *buf;
  size_t n;

  if (f == NULL) {
    fprintf(stderr, "idemd gateway: cannot read --body-file %s: %s\n", path,
            strerror(errno));
    return -1;
  }
  if ((buf = malloc(RESOLVE_BODY_MAX + 2)) == NULL) {
    fclose(f);
    fprintf(stderr, "idemd gateway: out of memory\n");
    return -1;
  }
  n = fread(buf, 1, RESOLVE_BODY_MAX + 1, f);
  if (ferror(f) || n > RESOLVE_BODY_MAX) {
    fprintf(stderr, "idemd gateway: --body-file %s: %s\n", path,
            ferror(f) ? strerror(errno) : "larger than 1 MiB");
    fclose(f);
    free(buf);
    return -1;
  }
  fclose(f);
  buf[n] = '\0';
  *out = buf;
  *len = n;
  return 0;
}

/* What a resolution writes, checked. */
typedef struct resolution {
  idem_scope_t scope; /* tenant_id: --scope, or 0 for any */
  char key[IDEM_KEY_MAX + 1];
  char ops[2][IDEM_OPERATION_MAX + 1]; /* the route as parsed, and as given */
  int status;
  char *body;
  size_t body_len;
  char actor[80];
  int64_t ttl_ms;
} resolution_t;

/* Checks `a` into `r`. 0, or -1 (printed: bad usage). */
static int check_args(const resolve_args_t *a, resolution_t *r) {
  gw_route_t route;
  size_t key_len;
  char *end;
  long status;

  if (!a->key || !a->route || !a->status || !a->reason || !a->operator_name) {
    fputs(usage_text, stderr);
    return -1;
  }
  if (idem_key_parse(a->key, strlen(a->key), r->key, &key_len) != IDEM_OK ||
      strcmp(r->key, a->key) != 0) {
    fprintf(stderr,
            "idemd gateway: KEY is the key as `idemd gateway pending` lists it: 1 "
            "to %d visible ASCII characters\n",
            IDEM_KEY_MAX);
    return -1;
  }
  /* The route as given to the gateway ('POST /orders'), or its ROUTE as
   * `idemd gateway pending` lists it (a long one is cut, with a hash). */
  if (gw_route_parse(a->route, &route) == 0)
    snprintf(r->ops[0], sizeof r->ops[0], "%s", route.operation);
  if (strlen(a->route) <= IDEM_OPERATION_MAX && strchr(a->route, ' ') != NULL)
    snprintf(r->ops[1], sizeof r->ops[1], "%s", a->route);
  if (r->ops[0][0] == '\0' && r->ops[1][0] == '\0') {
    fprintf(stderr,
            "idemd gateway: --route is 'METHOD /pattern' as the gateway was given "
            "it, or the ROUTE `idemd gateway pending` lists\n");
    return -1;
  }
  if (r->ops[0][0] == '\0')
    memcpy(r->ops[0], r->ops[1], sizeof r->ops[0]);
  if (r->ops[1][0] == '\0')
    memcpy(r->ops[1], r->ops[0], sizeof r->ops[1]);
  errno = 0;
  status = strtol(a->status, &end, 10);
  if (errno || end == a->status || *end || a->status[0] == '+' || a->status[0] == '-' ||
      status < 100 || status > 599) {
    fprintf(stderr, "idemd gateway: --status is an HTTP status, 100 to 599\n");
    return -1;
  }
  if (status < 200) {
    fprintf(stderr,
            "idemd gateway: --status %ld is interim (1xx), not an answer a request "
            "ends with; give 200 to 599\n",
            status);
    return -1;
  }
  r->status = (int)status;
  if (a->body && a->body_file) {
    fprintf(stderr, "idemd gateway: --body and --body-file: give one\n");
    return -1;
  }
  if (a->body) {
    json_t *j = json_string(a->body); /* NULL unless UTF-8 */
    json_decref(j);
    if (j == NULL || strlen(a->body) > RESOLVE_BODY_MAX) {
      fprintf(stderr, "idemd gateway: --body is UTF-8 text of at most 1 MiB (any bytes: "
                      "--body-file)\n");
      return -1;
    }
    if ((r->body = strdup(a->body)) == NULL)
      return -1;
    r->body_len = strlen(a->body);
  } else if (a->body_file && read_body_file(a->body_file, &r->body, &r->body_len) != 0) {
    return -1;
  }
  if (a->content_type && !content_type_ok(a->content_type)) {
    fprintf(stderr,
            "idemd gateway: --content-type is a media type such as "
            "application/json: 1 to %d characters of visible ASCII and spaces\n",
            CONTENT_TYPE_MAX);
    return -1;
  }
  if (r->body_len > 0 && (r->status == 204 || r->status == 304)) {
    fprintf(stderr, "idemd gateway: a %d answer has no body\n", r->status);
    return -1;
  }
  /* A body without --content-type is JSON, as the gateway's own answers
   * are: it must then parse as JSON, as must any body said to be JSON. */
  if (r->body_len > 0 && (!a->content_type || is_json_type(a->content_type))) {
    json_t *j = json_loadb(r->body, r->body_len, 0, NULL);
    json_decref(j);
    if (j == NULL) {
      fprintf(stderr, "idemd gateway: the body is not JSON; give its --content-type "
                      "(application/json unless given)\n");
      return -1;
    }
  }
  if (!idemd_audit_text_valid(a->reason, REASON_MAX)) {
    fprintf(stderr,
            "idemd gateway: --reason is 1 to %d characters of UTF-8, none a "
            "control\n",
            REASON_MAX);
    return -1;
  }
  if (!idemd_name_valid(a->operator_name)) {
    fprintf(stderr, "idemd gateway: --operator is 1 to 64 of A-Z a-z 0-9 . _ -\n");
    return -1;
  }
  snprintf(r->actor, sizeof r->actor, "operator:%s", a->operator_name);
  if (a->scope && a->scope_value) {
    fprintf(stderr, "idemd gateway: --scope and --scope-value: give one\n");
    return -1;
  }
  if (a->scope) {
    long long n;
    errno = 0;
    n = strtoll(a->scope, &end, 10);
    if (errno || end == a->scope || *end || n <= 0 || a->scope[0] == '+') {
      fprintf(stderr,
              "idemd gateway: --scope is the SCOPE number `idemd gateway pending` "
              "lists\n");
      return -1;
    }
    r->scope.tenant_id = n;
  }
  r->ttl_ms = 24LL * 3600 * 1000; /* the gateway's --key-ttl default */
  if (a->key_ttl &&
      (idemd_parse_duration(a->key_ttl, &r->ttl_ms) != 0 || r->ttl_ms <= 0)) {
    fprintf(stderr, "idemd gateway: --key-ttl is a duration such as 24h\n");
    return -1;
  }
  return 0;
}

/* ---- the store ---------------------------------------------------------- */

/* Opens the gateway's database `db` (its tables made or upgraded). NULL
 * when it cannot (printed). */
static idem_store_t *open_db(const char *db) {
  idem_store_t *store = NULL;
  char why[256] = "";
  int rc;

  if ((rc = idem_store_open(db ? db : "./idem-gateway.db", NULL, &store)) != IDEM_OK ||
      (rc = idem_store_migrate(store)) != IDEM_OK ||
      (rc = gw_schema_migrate(store, why, sizeof why)) != IDEM_OK) {
    fprintf(stderr, "idemd gateway: cannot open database: %s (%s)\n", idem_strerror(rc),
            why[0] ? why : idem_store_last_error());
    if (store)
      idem_store_close(store);
    return NULL;
  }
  return store;
}

typedef enum found {
  FOUND_TAKEN,     /* unsettled, and now ours */
  FOUND_NONE,      /* no unsettled key by that name */
  FOUND_AMBIGUOUS, /* unsettled under several scopes (or routes) */
  FOUND_HELD       /* unsettled, its record not to be taken: settled since, or held */
} found_t;

struct claim {
  const resolution_t *r;
  int rows;
  int64_t scopes[MAX_SCOPES];
  char ops[MAX_SCOPES][IDEM_OPERATION_MAX + 1];
  int attempts;
  int64_t next_attempt_at;
  idem_record_t rec;
  char from[16];
  found_t found;
};

static int got_request(void *arg, const char *const *cols) {
  struct claim *c = arg;
  if (cols[0] && cols[1] && c->rows < MAX_SCOPES) {
    c->scopes[c->rows] = strtoll(cols[0], NULL, 10);
    snprintf(c->ops[c->rows], sizeof c->ops[0], "%s", cols[1]);
    if (c->rows == 0) {
      c->attempts = cols[2] ? atoi(cols[2]) : 0;
      c->next_attempt_at = cols[3] ? strtoll(cols[3], NULL, 10) : 0;
    }
  }
  c->rows++;
  return IDEM_OK;
}

/* In one write (it may run again: it starts afresh): the one unsettled
 * key the operator named, taken over for RESOLVE_LEASE_MS, and its kept
 * request not due before that ends (one never sent again stays so), so
 * that no resolver sends it meanwhile. */
static int claim_fn(void *arg, idem_tx_t *tx) {
  struct claim *c = arg;
  const resolution_t *r = c->r;
  idemd_sql_param_t p[] = {IDEMD_SQL_TEXT(r->key), IDEMD_SQL_TEXT(r->ops[0]),
                           IDEMD_SQL_TEXT(r->ops[1]), IDEMD_SQL_NUM(r->scope.tenant_id)};
  int rc;

  idem_record_reset(&c->rec);
  memset(&c->rec, 0, sizeof c->rec);
  c->rows = 0;
  c->found = FOUND_NONE;
  /* A tool's question: the slot of rare statements (data/sql.h). */
  rc = idemd_sql_run(
      tx, IDEMD_SQL_COUNT,
      "SELECT tenant_id, operation, attempts, next_attempt_at FROM gateway_requests "
      "WHERE key = $1 AND (operation = $2 OR operation = $3) "
      "AND (CAST($4 AS BIGINT) = 0 OR tenant_id = $4) "
      "ORDER BY tenant_id, operation",
      p, 4, got_request, c, NULL);
  if (rc != IDEM_OK || c->rows == 0)
    return rc;
  if (c->rows > 1) {
    c->found = FOUND_AMBIGUOUS;
    return IDEM_OK;
  }
  idem_scope_t scope = {c->scopes[0], c->ops[0], r->key};
  rc = idem_tx_take_over(tx, &scope, RESOLVE_LEASE_MS, &c->rec);
  if (rc == IDEM_ENOTFOUND) {
    c->found = FOUND_HELD;
    return IDEM_OK;
  }
  if (rc != IDEM_OK)
    return rc;
  snprintf(c->from, sizeof c->from, "%s", idem_state_name(c->rec.state));
  int64_t until = idem_tx_now_ms(tx) + RESOLVE_LEASE_MS;
  gw_due_t due = {&scope, c->attempts,
                  c->next_attempt_at > until ? c->next_attempt_at : until};
  if ((rc = gw_due_fn(&due, tx)) != IDEM_OK)
    return rc;
  c->found = FOUND_TAKEN;
  return IDEM_OK;
}

/* What the completion writes beside the record. */
struct resolved {
  idem_scope_t scope;
  const char *from;
  idemd_actor_t who;
};

/* The kept request dropped, and the audit row of the change. */
static int resolved_fn(void *arg, idem_tx_t *tx) {
  struct resolved *d = arg;
  int rc = gw_drop_fn(&d->scope, tx);
  return rc == IDEM_OK
             ? idemd_audit_append_key(tx, &d->scope, d->from, "completed", &d->who)
             : rc;
}

/* Completes the taken record `rec` with the answer of `r`, in one
 * transaction with resolved_fn(). IDEM_OK, IDEM_ELOST (taken from us
 * since: nothing written) or a store error. */
static int complete(idem_store_t *store, const resolution_t *r, const idem_record_t *rec,
                    const char *from, const char *content_type, const char *reason) {
  gw_header_t ct = {"Content-Type",
                    (char *)(content_type ? content_type : "application/json")};
  gw_answer_t a = {.status = r->status, .body = r->body, .len = r->body_len};
  gw_config_t cfg;
  struct resolved d = {
      {rec->tenant_id, rec->operation, rec->key}, from, {r->actor, reason}};
  char *stored = NULL;
  int rc;

  if (r->body_len > 0 || content_type) {
    a.headers = &ct;
    a.nheaders = 1;
  }
  gw_config_defaults(&cfg); /* Content-Type is kept whatever the flags */
  if ((rc = gw_answer_encode(&a, &cfg, &stored)) != IDEM_OK)
    return rc;
  idem_complete_t c = {
      .scope = d.scope,
      .owner_token = rec->owner_token,
      .now_ms = idem_now_ms(),
      .ttl_ms = r->ttl_ms,
      .outcome = {.state = IDEM_STATE_COMPLETED, .status = r->status, .body = stored},
      .row = rec->row,
      .effect = {resolved_fn, &d}};
  rc = idem_store_complete(store, &c);
  free(stored);
  return rc;
}

/* The scope number of the --scope-header value `value`, as the gateways
 * on `store` make it (under the secret they share). 0, or -1 (printed). */
static int scope_of_value(idem_store_t *store, const char *value, int64_t *out) {
  idem_hmac_t *mac = NULL;
  int rc = gw_secret_mac(store, GW_SCOPE_SECRET, NULL, &mac);

  if (rc == IDEM_OK)
    rc = gw_scope_number(mac, value, out);
  idem_hmac_free(mac);
  if (rc != IDEM_OK) {
    fprintf(stderr, "idemd gateway: cannot read the scope secret: %s (%s)\n",
            idem_strerror(rc), idem_store_last_error());
    return -1;
  }
  return 0;
}

static void pause_ms(int ms) {
  struct timespec ts = {0, (long)ms * 1000000L};
  nanosleep(&ts, NULL);
}

/* The state of the record of (`scope`, `op`, `key`) now: "none" when
 * there is none (or it cannot be read). */
static const char *state_now(idem_store_t *store, int64_t scope, const char *op,
                             const char *key) {
  idem_scope_t s = {scope, op, key};
  idem_record_t rec = {0};
  const char *name = "none";
  if (idem_store_lookup(store, &s, idem_now_ms(), &rec) == IDEM_OK)
    name = idem_state_name(rec.state);
  idem_record_reset(&rec);
  return name;
}

int gw_cmd_resolve(int argc, char **argv) {
  resolve_args_t a;
  resolution_t r;
  struct claim c;
  idem_store_t *store;
  int rc = IDEM_OK, ok = 0;

  memset(&r, 0, sizeof r);
  memset(&c, 0, sizeof c);
  for (int i = 0; i < argc; i++)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      fputs(usage_text, stdout);
      return 0;
    }
  if (parse_args(argc, argv, &a) != 0 || check_args(&a, &r) != 0) {
    free(r.body);
    return 2;
  }
  if ((store = open_db(a.db)) == NULL) {
    free(r.body);
    return 1;
  }
  if (a.scope_value && scope_of_value(store, a.scope_value, &r.scope.tenant_id) != 0) {
    idem_store_close(store);
    free(r.body);
    return 1;
  }
  c.r = &r;
  for (int i = 0; i < RESOLVE_TRIES; i++) {
    idem_effect_t e = {claim_fn, &c};
    if ((rc = idem_store_write(store, &e)) != IDEM_OK || c.found != FOUND_HELD)
      break;
    /* Settled since its row was read, or held under a live lease by a
     * gateway or its resolver: held ones are waited for. */
    const char *state = state_now(store, c.scopes[0], c.ops[0], r.key);
    if (strcmp(state, "processing") != 0 && strcmp(state, "pending") != 0)
      break;
    pause_ms(RESOLVE_PAUSE_MS);
  }
  if (rc == IDEM_OK && c.found == FOUND_TAKEN) {
    rc = complete(store, &r, &c.rec, c.from, a.content_type, a.reason);
    if (rc == IDEM_ELOST)
      c.found = FOUND_HELD; /* taken from us meanwhile: nothing written */
  }
  if (rc != IDEM_OK && rc != IDEM_ELOST) {
    fprintf(stderr, "idemd gateway: resolving failed, nothing changed: %s (%s)\n",
            idem_strerror(rc), idem_store_last_error());
  } else if (c.found == FOUND_NONE) {
    const char *state =
        r.scope.tenant_id ? state_now(store, r.scope.tenant_id, r.ops[0], r.key) : "none";
    if (strcmp(state, "none") == 0 && r.scope.tenant_id &&
        strcmp(r.ops[0], r.ops[1]) != 0)
      state = state_now(store, r.scope.tenant_id, r.ops[1], r.key);
    if (strcmp(state, "none") != 0)
      fprintf(stderr,
              "idemd gateway: key '%s' on '%s' is %s, not pending; nothing changed\n",
              r.key, a.route, state);
    else
      fprintf(stderr,
              "idemd gateway: no pending key '%s' on '%s'%s; nothing changed "
              "(`idemd gateway pending` lists them)\n",
              r.key, a.route, r.scope.tenant_id ? " in that scope" : "");
  } else if (c.found == FOUND_AMBIGUOUS) {
    fprintf(stderr,
            "idemd gateway: key '%s' on '%s' is unsettled in %d scopes or routes; "
            "nothing changed: name one with --scope N or --scope-value (and --route):",
            r.key, a.route, c.rows);
    for (int i = 0; i < c.rows && i < MAX_SCOPES; i++)
      fprintf(stderr, " %lld (%s)", (long long)c.scopes[i], c.ops[i]);
    fputc('\n', stderr);
  } else if (c.found == FOUND_HELD) {
    const char *state = state_now(store, c.scopes[0], c.ops[0], r.key);
    if (strcmp(state, "processing") == 0 || strcmp(state, "pending") == 0)
      fprintf(stderr,
              "idemd gateway: key '%s' on '%s' is held right now (a gateway's "
              "request or resolver is at the upstream with it, or another operator "
              "is resolving it); nothing changed: try again\n",
              r.key, a.route);
    else
      fprintf(stderr,
              "idemd gateway: key '%s' on '%s' is %s, not pending (a gateway "
              "settled it); nothing changed\n",
              r.key, a.route, state);
  } else {
    printf("%s %s %lld completed with %d\n", c.rec.operation, r.key,
           (long long)c.rec.tenant_id, r.status);
    ok = 1;
  }
  idem_record_reset(&c.rec);
  idem_store_close(store);
  free(r.body);
  return ok ? 0 : 1;
}

/* ---- idemd gateway audit ---------------------------------------------- */

static int print_row(void *arg, const idemd_audit_row_t *row) {
  char *line = idemd_audit_json(row, NULL);
  (void)arg;
  if (line == NULL)
    return IDEM_ENOMEM;
  printf("%s\n", line);
  free(line);
  return IDEM_OK;
}

int gw_cmd_audit(int argc, char **argv) {
  static const char *const names[] = {"--db", "--key", NULL};
  const char *v[2];
  idem__flags_t flags = {"idemd gateway", names, v, NULL, 0, 0, 0};
  idem_store_t *store;
  int rc;

  if (idem__flags_take(&flags, argc, argv) < 0) {
    fprintf(stderr,
            "usage: idemd gateway audit [--key KEY] [--db FILE|postgresql://...]\n");
    return 2;
  }
  if ((store = open_db(v[0])) == NULL)
    return 1;
  rc = idemd_audit_list_keys(store, v[1], print_row, NULL);
  idem_store_close(store);
  if (rc != IDEM_OK) {
    fprintf(stderr, "idemd gateway: reading the audit failed: %s (%s)\n",
            idem_strerror(rc), idem_store_last_error());
    return 1;
  }
  return 0;
}
