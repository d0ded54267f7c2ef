/* The gateway's flags (docs/gateway.md, "Flags") and its keyed routes:
 * parsed and checked at start-up, so a bad value is a clear error. */
#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/gateway.h"
#include "gateway/upstream.h"
#include "idem/crypto.h"

void gw_config_defaults(gw_config_t *cfg) {
  memset(cfg, 0, sizeof *cfg);
  (void)idemd_parse_listen("127.0.0.1:8080", &cfg->listen);
  (void)idemd_parse_listen("127.0.0.1:8081", &cfg->admin_listen);
  snprintf(cfg->db, sizeof cfg->db, "%s", "./idem-gateway.db");
  snprintf(cfg->scope_header, sizeof cfg->scope_header, "%s", "Authorization");
  cfg->upstream_timeout_ms = 10000;
  cfg->upstream_connect_timeout_ms = 2000;
  cfg->inflight_wait_ms = 5000;
  cfg->key_ttl_ms = 24LL * 3600 * 1000;
  cfg->lease_ms = 30000;
  cfg->db_timeout_ms = 5000;
  cfg->max_body = 1 << 20;
  cfg->max_answer = 1 << 20;
  cfg->max_connections = 1000;
}

/* A header name: RFC 9110's token characters. */
static int is_token(const char *s) {
  if (*s == '\0')
    return 0;
  for (; *s; s++)
    if (!isalnum((unsigned char)*s) && strchr("!#$%&'*+-.^_`|~", *s) == NULL)
      return 0;
  return 1;
}

int gw_route_parse(const char *spec, gw_route_t *out) {
  const char *sp = strchr(spec, ' ');
  const char *p;
  size_t mlen;

  memset(out, 0, sizeof *out);
  if (sp == NULL || (mlen = (size_t)(sp - spec)) == 0 || mlen >= sizeof out->method)
    return -1;
  memcpy(out->method, spec, mlen);
  for (size_t i = 0; i < mlen; i++)
    if (!isupper((unsigned char)out->method[i]))
      return -1;
  p = sp + 1;
  if (p[0] != '/' || strlen(p) > GW_PATTERN_MAX || strpbrk(p, " ?#") != NULL)
    return -1;
  /* No empty segment: gw_route_match() does not count them in a path. */
  if (strstr(p, "//") != NULL || (p[1] != '\0' && p[strlen(p) - 1] == '/'))
    return -1;
  /* Each {name} is a whole segment. */
  for (const char *s = p; *s; s++) {
    if (*s == '{') {
      const char *close = strchr(s, '}');
      if (s[-1] != '/' || close == NULL || close == s + 1 ||
          (close[1] != '\0' && close[1] != '/') || memchr(s + 1, '/', (size_t)(close - s)))
        return -1;
      s = close;
    } else if (*s == '}') {
      return -1;
    }
  }
  snprintf(out->pattern, sizeof out->pattern, "%s", p);
  if (strlen(spec) <= IDEM_OPERATION_MAX) {
    snprintf(out->operation, sizeof out->operation, "%s", spec);
  } else {
    unsigned char h[IDEM_SHA256_LEN];
    char hex[IDEM_SHA256_HEX_LEN];
    if (idem_sha256(spec, strlen(spec), h) != IDEM_OK)
      return -1;
    idem_hex(h, 4, hex);
    snprintf(out->operation, sizeof out->operation, "%.23s~%.8s", spec, hex);
  }
  return 0;
}

/* Whether `path` matches `pattern`: literal segments equal, each {name}
 * one non-empty segment. */
static int pattern_match(const char *pattern, const char *path) {
  const char *p = pattern, *s = path;
  while (*p && *s) {
    if (*p == '{') {
      const char *seg_end = strchr(s, '/');
      size_t n = seg_end ? (size_t)(seg_end - s) : strlen(s);
      if (n == 0)
        return 0;
      s += n;
      p = strchr(p, '}') + 1;
    } else if (*p == *s) {
      p++;
      s++;
    } else {
      return 0;
    }
  }
  return *p == '\0' && *s == '\0';
}

const gw_route_t *gw_route_match(const gw_config_t *cfg, const char *method,
                                 const char *path) {
  /* Empty segments do not count ("//orders", "/orders/" are /orders):
   * many applications route them as the path without them, and a keyed
   * route must not be bypassed by spelling its path so. */
  size_t len = strlen(path), n = 0;
  char *flat = malloc(len + 2);
  const gw_route_t *found = NULL;

  if (flat == NULL)
    return NULL;
  for (const char *p = path; *p; p++)
    if (*p != '/' || n == 0 || flat[n - 1] != '/')
      flat[n++] = *p;
  if (n > 1 && flat[n - 1] == '/')
    n--;
  flat[n] = '\0';
  for (int i = 0; i < cfg->nroutes && found == NULL; i++)
    if (strcmp(cfg->routes[i].method, method) == 0 &&
        pattern_match(cfg->routes[i].pattern, flat))
      found = &cfg->routes[i];
  free(flat);
  return found;
}

static int bad(FILE *err, const char *flag, const char *v) {
  fprintf(err, "idemd gateway: invalid value for %s: '%s' (see idemd gateway --help)\n",
          flag, v);
  return -1;
}

static int size_value(const char *v, int64_t min, int64_t max, int64_t *out) {
  char *end;
  long long n;
  errno = 0;
  n = strtoll(v, &end, 10);
  if (errno || *end || v[0] == '\0' || n < min || n > max)
    return -1;
  *out = n;
  return 0;
}

static int duration_value(const char *v, int64_t min, int64_t max, int64_t *out) {
  int64_t ms;
  if (idemd_parse_duration(v, &ms) != 0 || ms < min || ms > max)
    return -1;
  *out = ms;
  return 0;
}

static int text_value(char *dst, size_t cap, const char *v) {
  return v[0] == '\0' ? -1 : idem_copy(dst, cap, v);
}

/* The flags that take a value, each also read from IDEMD_GATEWAY_ and its
 * name in capitals with '_' for '-' (IDEMD_GATEWAY_UPSTREAM_TIMEOUT). */
static const char *const value_flags[] = {
    "--upstream", "--route", "--replay-header", "--listen", "--admin-listen", "--db",
    "--scope-header", "--log-key-secret", "--upstream-timeout",
    "--upstream-connect-timeout", "--inflight-wait", "--key-ttl", "--lease", "--db-timeout",
    "--max-body", "--max-answer", "--max-connections"};

static int parse_args(gw_config_t *cfg, int argc, char **argv, FILE *err);

/* Applies the IDEMD_GATEWAY_* variables as if they were flags given
 * first; --route and --replay-header take several, separated by ';'
 * (IDEMD_GATEWAY_ROUTE='POST /orders;POST /carts/{id}/checkout'), and
 * IDEMD_GATEWAY_UPSTREAM_IDEMPOTENT=1 sets --upstream-idempotent. */
static int parse_env(gw_config_t *cfg, FILE *err) {
  const char *idem = getenv("IDEMD_GATEWAY_UPSTREAM_IDEMPOTENT");
  int rc = 0;

  if (idem && strcmp(idem, "1") == 0)
    cfg->upstream_idempotent = 1;
  for (size_t f = 0; f < sizeof value_flags / sizeof *value_flags && rc == 0; f++) {
    char name[64] = "IDEMD_GATEWAY_";
    size_t n = strlen(name);
    const char *v;
    char *copy, *part, *save = NULL;
    int many = strcmp(value_flags[f], "--route") == 0 ||
               strcmp(value_flags[f], "--replay-header") == 0;

    for (const char *c = value_flags[f] + 2; *c && n + 1 < sizeof name; c++)
      name[n++] = *c == '-' ? '_' : (char)toupper((unsigned char)*c);
    name[n] = '\0';
    if ((v = getenv(name)) == NULL)
      continue;
    if ((copy = strdup(v)) == NULL)
      return -1;
    for (part = many ? strtok_r(copy, ";", &save) : copy; part && rc == 0;
         part = many ? strtok_r(NULL, ";", &save) : NULL) {
      char *args[2] = {(char *)value_flags[f], part};
      rc = parse_args(cfg, 2, args, err);
    }
    free(copy);
  }
  return rc;
}

int gw_config_parse(gw_config_t *cfg, int argc, char **argv, FILE *err) {
  if (parse_env(cfg, err) != 0 || parse_args(cfg, argc, argv, err) != 0)
    return -1;
  return gw_config_check(cfg, err);
}

static int parse_args(gw_config_t *cfg, int argc, char **argv, FILE *err) {
  for (int i = 0; i < argc; i++) {
    const char *flag = argv[i];
    const char *v;
    int64_t n = 0;
    int rc;

    if (strcmp(flag, "--upstream-idempotent") == 0) {
      cfg->upstream_idempotent = 1;
      continue;
    }
    if (strncmp(flag, "--", 2) != 0) {
      fprintf(err, "idemd gateway: unexpected argument '%s'\n", flag);
      return -1;
    }
    if (i + 1 >= argc) {
      fprintf(err, "idemd gateway: option %s needs a value\n", flag);
      return -1;
    }
    v = argv[++i];
    if (strcmp(flag, "--upstream") == 0) {
      rc = (strncmp(v, "http://", 7) == 0 || strncmp(v, "https://", 8) == 0)
               ? text_value(cfg->upstream, sizeof cfg->upstream, v)
               : -1;
      for (size_t len = strlen(cfg->upstream); rc == 0 && len > 0 &&
                                               cfg->upstream[len - 1] == '/';)
        cfg->upstream[--len] = '\0';
    } else if (strcmp(flag, "--route") == 0) {
      rc = cfg->nroutes < GW_MAX_ROUTES ? gw_route_parse(v, &cfg->routes[cfg->nroutes]) : -1;
      if (rc == 0)
        cfg->nroutes++;
    } else if (strcmp(flag, "--replay-header") == 0) {
      rc = cfg->nreplay_headers < GW_MAX_REPLAY_HEADERS && is_token(v) &&
                   strcasecmp(v, "Set-Cookie") != 0
               ? text_value(cfg->replay_headers[cfg->nreplay_headers],
                            sizeof cfg->replay_headers[0], v)
               : -1;
      if (rc == 0)
        cfg->nreplay_headers++;
    } else if (strcmp(flag, "--listen") == 0) {
      rc = idemd_parse_listen(v, &cfg->listen);
    } else if (strcmp(flag, "--admin-listen") == 0) {
      rc = idemd_parse_listen(v, &cfg->admin_listen);
    } else if (strcmp(flag, "--db") == 0) {
      rc = text_value(cfg->db, sizeof cfg->db, v);
    } else if (strcmp(flag, "--scope-header") == 0) {
      rc = is_token(v) ? text_value(cfg->scope_header, sizeof cfg->scope_header, v) : -1;
    } else if (strcmp(flag, "--log-key-secret") == 0) {
      rc = text_value(cfg->log_key_secret, sizeof cfg->log_key_secret, v);
    } else if (strcmp(flag, "--upstream-timeout") == 0) {
      rc = duration_value(v, 1, 600000, &cfg->upstream_timeout_ms);
    } else if (strcmp(flag, "--upstream-connect-timeout") == 0) {
      rc = duration_value(v, 1, 600000, &cfg->upstream_connect_timeout_ms);
    } else if (strcmp(flag, "--inflight-wait") == 0) {
      rc = duration_value(v, 0, 600000, &cfg->inflight_wait_ms);
    } else if (strcmp(flag, "--key-ttl") == 0) {
      rc = duration_value(v, 1, 365LL * 86400 * 1000, &cfg->key_ttl_ms);
    } else if (strcmp(flag, "--lease") == 0) {
      rc = duration_value(v, 100, 86400000, &cfg->lease_ms);
    } else if (strcmp(flag, "--db-timeout") == 0) {
      rc = duration_value(v, 100, 600000, &cfg->db_timeout_ms);
    } else if (strcmp(flag, "--max-body") == 0) {
      rc = size_value(v, 1, 64LL << 20, &cfg->max_body);
    } else if (strcmp(flag, "--max-answer") == 0) {
      rc = size_value(v, 1, 64LL << 20, &cfg->max_answer);
    } else if (strcmp(flag, "--max-connections") == 0) {
      rc = size_value(v, 1, 100000, &n);
      cfg->max_connections = (int)n;
    } else {
      fprintf(err, "idemd gateway: unknown option '%s' (see idemd gateway --help)\n", flag);
      return -1;
    }
    if (rc != 0)
      return bad(err, flag, v);
  }
  return 0;
}

int gw_config_check(const gw_config_t *cfg, FILE *err) {
  if (cfg->upstream[0] == '\0') {
    fprintf(err, "idemd gateway: --upstream http://HOST:PORT is required\n");
    return -1;
  }
  if (cfg->lease_ms < cfg->upstream_timeout_ms + GW_LEASE_MARGIN_MS) {
    /* Otherwise a record could be taken over while its upstream call is
     * still under way; the margin is for the queues a keyed request waits
     * in before its send (gateway/upstream.h). */
    fprintf(err, "idemd gateway: --lease (%lldms) must be at least %dms longer than "
            "--upstream-timeout (%lldms)\n", (long long)cfg->lease_ms, GW_LEASE_MARGIN_MS,
            (long long)cfg->upstream_timeout_ms);
    return -1;
  }
  if (cfg->admin_listen.port != 0 && cfg->admin_listen.port == cfg->listen.port &&
      strcmp(cfg->admin_listen.host, cfg->listen.host) == 0) {
    fprintf(err, "idemd gateway: --admin-listen must differ from --listen\n");
    return -1;
  }
  return 0;
}

void gw_config_usage(FILE *out) {
  fprintf(out,
          "usage: idemd gateway --upstream http://HOST:PORT --route 'METHOD /path/{param}'...\n"
          "       idemd gateway pending [--db ...]   the keys not settled yet\n"
          "       idemd gateway resolve KEY --route 'METHOD /pattern' --status N\n"
          "             [--body TEXT | --body-file FILE] [--content-type TYPE] --reason TEXT\n"
          "             --operator NAME [--scope N | --scope-value TEXT] [--key-ttl DURATION]\n"
          "             [--db ...]\n"
          "                                      complete a pending key by hand, audited\n"
          "       idemd gateway audit [--key KEY] [--db ...]   the audit trail, JSON lines\n"
          "  --upstream URL               the application behind the gateway (required)\n"
          "  --route 'METHOD /pattern'    a keyed route (repeatable); {name} is one segment\n"
          "  --listen HOST:PORT           where clients connect (127.0.0.1:8080)\n"
          "  --admin-listen HOST:PORT     GET /healthz and /metrics of the gateway "
          "(127.0.0.1:8081)\n"
          "  --db FILE|postgresql://...   the records (./idem-gateway.db)\n"
          "  --scope-header NAME          keys are scoped by this header's value "
          "(Authorization)\n"
          "  --upstream-timeout DURATION  deadline of one upstream call (10s)\n"
          "  --upstream-connect-timeout DURATION  deadline to connect (2s)\n"
          "  --upstream-idempotent        the upstream dedupes Idempotency-Key itself: "
          "a 5xx frees the key\n"
          "  --replay-header NAME         also keep and replay this answer header "
          "(repeatable; never Set-Cookie)\n"
          "  --inflight-wait DURATION     how long a duplicate waits for its original (5s)\n"
          "  --key-ttl DURATION           how long answers are kept (24h)\n"
          "  --lease DURATION             how long a gateway owns a key in flight (30s)\n"
          "  --db-timeout DURATION        PostgreSQL: bound on each call (5s)\n"
          "  --max-body BYTES             request bodies (1048576; beyond: 413)\n"
          "  --max-answer BYTES           upstream answers (1048576; beyond: 502)\n"
          "  --max-connections N          clients served at once (1000)\n"
          "  --log-key-secret SECRET      HMAC key of the key ids in logs "
          "(default: kept in the db)\n"
          "Each flag is also read from IDEMD_GATEWAY_ and its name (IDEMD_GATEWAY_UPSTREAM,\n"
          "IDEMD_GATEWAY_ROUTE='POST /a;POST /b', IDEMD_GATEWAY_UPSTREAM_IDEMPOTENT=1);\n"
          "flags win (a --route adds to the variable's).\n");
}
