/* The command line and IDEM_PSP_* environment of idem-psp. Every flag has
 * an environment variable; the environment is read first and flags
 * override it, except --decline-amount, whose values all add up. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "psp.h"

enum opt_kind {
  OPT_LISTEN,
  OPT_DB,
  OPT_DURATION,
  OPT_BOOL,
  OPT_DECLINE,
  OPT_CHAOS,
  OPT_SEED,
  OPT_URL,
  OPT_SECRET,
  OPT_DUPLICATES
};

struct option_def {
  const char *flag;
  const char *env;
  enum opt_kind kind;
  size_t offset; /* of the field in psp_config_t, for durations and booleans */
  const char *expected;
};

#define FAULT_FIELD(f) (offsetof(psp_config_t, faults) + offsetof(psp_faults_t, f))

static const struct option_def options[] = {
    {"--listen", "IDEM_PSP_LISTEN", OPT_LISTEN, 0, "HOST:PORT, e.g. 127.0.0.1:9090"},
    {"--db", "IDEM_PSP_DB", OPT_DB, 0, "a file path"},
    {"--latency", "IDEM_PSP_LATENCY", OPT_DURATION, FAULT_FIELD(latency_ms),
     "a duration such as 500ms, 2s or 3 (seconds), at most 1 hour"},
    {"--delay-after-charge", "IDEM_PSP_DELAY_AFTER_CHARGE", OPT_DURATION,
     FAULT_FIELD(delay_ms),
     "a duration such as 500ms, 2s or 3 (seconds), at most 1 hour"},
    {"--fail-before", "IDEM_PSP_FAIL_BEFORE", OPT_BOOL, FAULT_FIELD(fail_before),
     "true or false"},
    {"--fail-after", "IDEM_PSP_FAIL_AFTER", OPT_BOOL, FAULT_FIELD(fail_after),
     "true or false"},
    {"--drop-after", "IDEM_PSP_DROP_AFTER", OPT_BOOL, FAULT_FIELD(drop_after),
     "true or false"},
    {"--crash-after", "IDEM_PSP_CRASH_AFTER", OPT_BOOL, FAULT_FIELD(crash_after),
     "true or false"},
    {"--decline-amount", "IDEM_PSP_DECLINE_AMOUNT", OPT_DECLINE, 0,
     "positive integers (comma-separated in the environment), at most 64"},
    {"--chaos", "IDEM_PSP_CHAOS", OPT_CHAOS, 0, "a probability from 0 to 1"},
    {"--seed", "IDEM_PSP_SEED", OPT_SEED, 0, "an unsigned 64-bit integer"},
    {"--ignore-idempotency-key", "IDEM_PSP_IGNORE_IDEMPOTENCY_KEY", OPT_BOOL,
     offsetof(psp_config_t, ignore_key), "true or false"},
    {"--webhook-url", "IDEM_PSP_WEBHOOK_URL", OPT_URL, 0,
     "an http:// or https:// URL of at most 1023 characters"},
    {"--webhook-secret", "IDEM_PSP_WEBHOOK_SECRET", OPT_SECRET, 0,
     "1 to 255 visible ASCII characters"},
    {"--webhook-duplicates", "IDEM_PSP_WEBHOOK_DUPLICATES", OPT_DUPLICATES, 0,
     "a probability from 0 to 1"},
};

void psp_usage(FILE *out) {
  fputs("usage: idem-psp [options]\n"
        "\n"
        "A payment-provider simulator with fault injection, for tests of idem.\n"
        "\n"
        "  --listen HOST:PORT        address to listen on (127.0.0.1:9090)\n"
        "  --db FILE                 SQLite file of charges, refunds and counters\n"
        "                            (./psp.db)\n"
        "  --latency DUR             sleep before handling each POST /charges\n"
        "                            or POST /refunds\n"
        "  --delay-after-charge DUR  charge (or refund), then wait DUR before\n"
        "                            answering\n"
        "  --fail-before             answer 500 without charging (or refunding)\n"
        "  --fail-after              charge (or refund), then answer 500\n"
        "  --drop-after              charge (or refund), then close the\n"
        "                            connection unanswered\n"
        "  --crash-after             charge (or refund), then exit at once with\n"
        "                            status 3\n"
        "  --decline-amount N        decline (402) charges and refunds of amount N;\n"
        "                            repeatable\n"
        "  --chaos P                 with probability P, a random fault per request\n"
        "  --seed S                  seed of --chaos (default: random, logged)\n"
        "  --ignore-idempotency-key  make a new charge (or refund) for every POST,\n"
        "                            as a provider that ignores keys would\n"
        "  --webhook-url URL         send each charge's and refund's outcome as a\n"
        "                            signed event to URL, retried until a 2xx\n"
        "  --webhook-secret S        the shared secret that signs the events\n"
        "                            (required with --webhook-url)\n"
        "  --webhook-duplicates P    send each event a second time with\n"
        "                            probability P\n"
        "  --help                    this text\n"
        "  --version                 the version, as idemd --version prints it\n"
        "\n"
        "DUR is 500ms, 2s, or a bare number of seconds. Each option can also be\n"
        "set by its environment variable: IDEM_PSP_LISTEN, IDEM_PSP_DB,\n"
        "IDEM_PSP_LATENCY, IDEM_PSP_DELAY_AFTER_CHARGE, IDEM_PSP_FAIL_BEFORE,\n"
        "IDEM_PSP_FAIL_AFTER, IDEM_PSP_DROP_AFTER, IDEM_PSP_CRASH_AFTER (true or\n"
        "false), IDEM_PSP_DECLINE_AMOUNT (N,N,...), IDEM_PSP_CHAOS, IDEM_PSP_SEED,\n"
        "IDEM_PSP_IGNORE_IDEMPOTENCY_KEY, IDEM_PSP_WEBHOOK_URL, IDEM_PSP_WEBHOOK_SECRET, IDEM_PSP_WEBHOOK_DUPLICATES.\n"
        "With --chaos P, each webhook delivery is also delayed (up to 2 s) with\n"
        "probability P, which reorders them.\n"
        "\n"
        "Per request, the header X-Psp-Fault replaces all of the above faults\n"
        "(and --chaos): a comma-separated list of latency=DUR,\n"
        "delay-after-charge=DUR, fail-before, fail-after, drop-after,\n"
        "crash-after, decline, or none.\n"
        "\n"
        "Routes: POST /charges (Idempotency-Key; {\"amount\": N, \"reference\": R}),\n"
        "GET /charges/{key}, GET /charges?reference=R,\n"
        "POST /refunds (Idempotency-Key; {\"charge\": KEY, \"amount\": N,\n"
        "\"reference\": R}), GET /refunds/{key}, GET /refunds?reference=R,\n"
        "GET /stats, GET /healthz. The faults act on POST /charges and\n"
        "POST /refunds alike. SIGTERM or SIGINT: clean exit 0.\n",
        out);
}

static int parse_listen(const char *v, psp_config_t *cfg) {
  const char *colon, *host = v;
  size_t hostlen;
  char *end;
  long port;

  if (v[0] == '[') {
    const char *close = strchr(v, ']');
    if (close == NULL || close[1] != ':')
      return -1;
    host = v + 1;
    hostlen = (size_t)(close - host);
    colon = close + 1;
  } else {
    colon = strrchr(v, ':');
    if (colon == NULL)
      return -1;
    hostlen = (size_t)(colon - v);
    if (memchr(v, ':', hostlen) != NULL)
      return -1; /* IPv6 needs brackets */
  }
  if (hostlen == 0 || hostlen >= sizeof cfg->listen_host || colon[1] < '0' ||
      colon[1] > '9')
    return -1;
  errno = 0;
  port = strtol(colon + 1, &end, 10);
  if (errno || *end != '\0' || port < 1 || port > 65535)
    return -1;
  memcpy(cfg->listen_host, host, hostlen);
  cfg->listen_host[hostlen] = '\0';
  cfg->listen_port = (int)port;
  return 0;
}

static int parse_bool(const char *v, int *out) {
  static const char *const yes[] = {"1", "true", "yes", "on"};
  static const char *const no[] = {"0", "false", "no", "off", ""};
  for (size_t i = 0; i < sizeof yes / sizeof *yes; i++)
    if (strcmp(v, yes[i]) == 0)
      return *out = 1, 0;
  for (size_t i = 0; i < sizeof no / sizeof *no; i++)
    if (strcmp(v, no[i]) == 0)
      return *out = 0, 0;
  return -1;
}

/* A probability: a number from 0 to 1. */
static int parse_probability(const char *v, double *out) {
  char *end;
  errno = 0;
  *out = strtod(v, &end);
  return v[0] == '\0' || *end != '\0' || errno || !(*out >= 0 && *out <= 1) ? -1 : 0;
}

/* 1 to `cap` visible ASCII characters into `out`. */
static int parse_visible(const char *v, char *out, size_t cap) {
  size_t n = strlen(v);
  if (n == 0 || n > cap)
    return -1;
  for (size_t i = 0; i < n; i++)
    if ((unsigned char)v[i] < 0x21 || (unsigned char)v[i] > 0x7e)
      return -1;
  memcpy(out, v, n + 1);
  return 0;
}

/* Positive JSON-safe integers, separated by commas. */
static int parse_declines(const char *v, psp_config_t *cfg) {
  for (const char *p = v;;) {
    char *end;
    long long n;
    if (*p < '0' || *p > '9')
      return -1;
    errno = 0;
    n = strtoll(p, &end, 10);
    if (errno || n < 1 || n > 9007199254740991LL || cfg->ndecline >= PSP_MAX_DECLINES)
      return -1;
    cfg->decline_amounts[cfg->ndecline++] = n;
    if (*end == '\0')
      return 0;
    if (*end != ',')
      return -1;
    p = end + 1;
  }
}

static int set_option(psp_config_t *cfg, const struct option_def *o, const char *v) {
  char *end;

  switch (o->kind) {
  case OPT_LISTEN:
    return parse_listen(v, cfg);
  case OPT_DB:
    if (v[0] == '\0' || strlen(v) >= sizeof cfg->db)
      return -1;
    strcpy(cfg->db, v);
    return 0;
  case OPT_DURATION:
    return psp_parse_duration(v, (int64_t *)((char *)cfg + o->offset));
  case OPT_BOOL:
    return parse_bool(v, (int *)((char *)cfg + o->offset));
  case OPT_DECLINE:
    return parse_declines(v, cfg);
  case OPT_CHAOS:
    return parse_probability(v, &cfg->chaos);
  case OPT_DUPLICATES:
    return parse_probability(v, &cfg->webhook_duplicates);
  case OPT_URL:
    if (strncmp(v, "http://", 7) != 0 && strncmp(v, "https://", 8) != 0)
      return -1;
    return parse_visible(v, cfg->webhook_url, PSP_URL_MAX);
  case OPT_SECRET:
    return parse_visible(v, cfg->webhook_secret, PSP_SECRET_MAX);
  case OPT_SEED:
    errno = 0;
    cfg->seed = strtoull(v, &end, 10);
    cfg->seed_set = 1;
    return v[0] < '0' || v[0] > '9' || *end != '\0' || errno ? -1 : 0;
  }
  return -1;
}

static int set_or_explain(psp_config_t *cfg, const struct option_def *o, const char *v,
                          char *err, size_t errlen) {
  if (set_option(cfg, o, v) == 0)
    return 0;
  snprintf(err, errlen, "invalid value '%.200s' for %s (%s): expected %s", v, o->flag,
           o->env, o->expected);
  return -1;
}

static const struct option_def *find_option(const char *arg, size_t len) {
  for (size_t i = 0; i < sizeof options / sizeof *options; i++)
    if (strlen(options[i].flag) == len && strncmp(arg, options[i].flag, len) == 0)
      return &options[i];
  return NULL;
}

int psp_config_load(psp_config_t *cfg, int argc, char **argv, char *err, size_t errlen) {
  memset(cfg, 0, sizeof *cfg);
  strcpy(cfg->listen_host, "127.0.0.1");
  cfg->listen_port = 9090;
  strcpy(cfg->db, "./psp.db");

  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0)
      return PSP_HELP;
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--version") == 0)
      return PSP_VERSION;
  for (size_t i = 0; i < sizeof options / sizeof *options; i++) {
    const char *v = getenv(options[i].env);
    if (v && set_or_explain(cfg, &options[i], v, err, errlen) != 0)
      return PSP_BAD_USAGE;
  }
  for (int i = 1; i < argc; i++) {
    const char *arg = argv[i], *eq = strchr(arg, '='), *v;
    const struct option_def *o = find_option(arg, eq ? (size_t)(eq - arg) : strlen(arg));
    if (o == NULL) {
      snprintf(err, errlen, "unknown argument '%.200s' (see --help)", arg);
      return PSP_BAD_USAGE;
    }
    if (eq)
      v = eq + 1;
    else if (o->kind == OPT_BOOL)
      v = "true";
    else if (i + 1 < argc)
      v = argv[++i];
    else {
      snprintf(err, errlen, "%s needs a value: %s", o->flag, o->expected);
      return PSP_BAD_USAGE;
    }
    if (set_or_explain(cfg, o, v, err, errlen) != 0)
      return PSP_BAD_USAGE;
  }
  /* Webhooks go nowhere without a URL, and unsigned events would be
   * refused: each of these flags needs the other. */
  if ((cfg->webhook_url[0] != '\0') != (cfg->webhook_secret[0] != '\0') ||
      (cfg->webhook_duplicates > 0 && cfg->webhook_url[0] == '\0')) {
    snprintf(err, errlen, "%s",
             cfg->webhook_url[0] ? "--webhook-url needs --webhook-secret (or "
                                   "IDEM_PSP_WEBHOOK_SECRET)"
                                 : "--webhook-secret and --webhook-duplicates need "
                                   "--webhook-url (or IDEM_PSP_WEBHOOK_URL)");
    return PSP_BAD_USAGE;
  }
  return PSP_RUN;
}

int psp_config_declines(const psp_config_t *cfg, int64_t amount) {
  for (int i = 0; i < cfg->ndecline; i++)
    if (cfg->decline_amounts[i] == amount)
      return 1;
  return 0;
}
