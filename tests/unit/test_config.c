/* Tests idemd's configuration: durations, defaults, IDEMD_* variables,
 * flags in both spellings, and the errors for bad input. */
#include "server/config.h"
#include "support.h"

#include <stdio.h>
#include <stdlib.h>

static const char *const env_names[] = {
    "IDEMD_LISTEN", "IDEMD_DB", "IDEMD_PROVIDER", "IDEMD_PROVIDER_CONNECT_TIMEOUT",
    "IDEMD_PROVIDER_TIMEOUT", "IDEMD_RECONCILE_INTERVAL", "IDEMD_THREADS",
    "IDEMD_INFLIGHT_WAIT", "IDEMD_KEY_TTL", "IDEMD_LEASE", "IDEMD_SANDBOX_DELAY",
    "IDEMD_SANDBOX_DECLINE_AMOUNT", "IDEMD_SANDBOX_UNCERTAIN_AMOUNT",
    "IDEMD_SANDBOX_UNAVAILABLE_AMOUNT", "IDEMD_METRICS_LISTEN", "IDEMD_TLS_CERT",
    "IDEMD_TLS_KEY", "IDEMD_DB_TIMEOUT", "IDEMD_PROVIDER_IDEMPOTENCY",
};

/* Each test starts and ends with no IDEMD_* variable set. */
static int clear_env(void **state) {
  (void)state;
  for (size_t i = 0; i < ARRAY_LEN(env_names); i++)
    unsetenv(env_names[i]);
  return 0;
}

struct duration_case {
  const char *text;
  int rc;
  int64_t ms;
};

static const struct duration_case duration_cases[] = {
    {"500ms", 0, 500},
    {"5s", 0, 5000},
    {"5", 0, 5000},
    {"0", 0, 0},
    {"0ms", 0, 0},
    {"10m", 0, 600000},
    {"24h", 0, 86400000},
    {"86400", 0, 86400000},
    {"", -1, 0},
    {"5x", -1, 0},
    {"-1", -1, 0},
    {"s", -1, 0},
    {"ms", -1, 0},
    {"+5", -1, 0},
    {" 5", -1, 0},
    {"5 s", -1, 0},
    {"5s ", -1, 0},
    {"5.5s", -1, 0},
    {"5S", -1, 0},
    {"1d", -1, 0},
    {"5sms", -1, 0},
    {"99999999999999999999", -1, 0},
    {"9223372036854775807h", -1, 0},
};

static void test_parse_duration(void **state) {
  (void)state;
  for (size_t i = 0; i < ARRAY_LEN(duration_cases); i++) {
    const struct duration_case *c = &duration_cases[i];
    int64_t ms = -42;
    int rc = idemd_parse_duration(c->text, &ms);
    if (rc != c->rc)
      fail_msg("duration \"%s\": got %d, want %d", c->text, rc, c->rc);
    if (rc == 0 && ms != c->ms)
      fail_msg("duration \"%s\": %lld ms, want %lld", c->text, (long long)ms,
               (long long)c->ms);
  }
  assert_int_equal(idemd_parse_duration(NULL, &(int64_t){0}), -1);
}

/* Captures what the parser writes to its error stream. */
struct capture {
  FILE *f;
  char *text;
  size_t len;
};

static void capture_open(struct capture *c) {
  c->text = NULL;
  c->len = 0;
  c->f = open_memstream(&c->text, &c->len);
  assert_non_null(c->f);
}

/* Closes the stream; c->text then holds everything written (free it). */
static void capture_close(struct capture *c) {
  fclose(c->f);
  c->f = NULL;
}

/* Parses `argv` (NULL-terminated) into `cfg` (starting from the defaults);
 * returns the result and leaves the error output in `*err_text`, which
 * the caller frees. */
static int parse_args(idemd_config_t *cfg, const char *const *argv,
                      char **err_text) {
  struct capture err;
  int argc = 0, rc;

  while (argv[argc])
    argc++;
  idemd_config_defaults(cfg);
  capture_open(&err);
  rc = idemd_config_parse(cfg, argc, (char **)argv, err.f);
  capture_close(&err);
  *err_text = err.text;
  return rc;
}

static void test_defaults(void **state) {
  idemd_config_t cfg, parsed;
  const char *const argv[] = {NULL};
  char *err;
  (void)state;

  idemd_config_defaults(&cfg);
  assert_string_equal(cfg.listen.host, "127.0.0.1");
  assert_int_equal(cfg.listen.port, 8080);
  /* Off: /metrics on --listen, plain HTTP. */
  assert_string_equal(cfg.metrics_listen.host, "");
  assert_string_equal(cfg.tls_cert, "");
  assert_string_equal(cfg.tls_key, "");
  assert_string_equal(cfg.db, "./idem.db");
  assert_string_equal(cfg.provider, "sandbox");
  assert_string_equal(cfg.provider_idempotency, "on");
  assert_int_equal(cfg.threads, 0); /* one fewer than the cores */
  assert_int_equal(cfg.workers, 128);
  assert_int_equal(cfg.active_workers, 0); /* four per core */
  assert_int_equal(cfg.inflight_wait_ms, 5000);
  assert_int_equal(cfg.key_ttl_ms, 86400000);
  assert_int_equal(cfg.lease_ms, 30000);
  assert_int_equal(cfg.provider_connect_timeout_ms, 2000);
  assert_int_equal(cfg.provider_timeout_ms, 10000);
  assert_int_equal(cfg.reconcile_interval_ms, 2000);
  assert_int_equal(cfg.db_timeout_ms, 5000);
  assert_int_equal(cfg.sandbox_delay_ms, 0);
  assert_int_equal(cfg.sandbox_decline_amount, 0);
  assert_int_equal(cfg.sandbox_uncertain_amount, 0);
  assert_int_equal(cfg.sandbox_unavailable_amount, 0);

  /* No flags, no environment: the defaults, untouched, and no output. */
  assert_int_equal(parse_args(&parsed, argv, &err), 0);
  assert_memory_equal(&parsed, &cfg, sizeof cfg);
  assert_string_equal(err, "");
  free(err);
}

static void test_environment_then_flags(void **state) {
  const char *const argv[] = {"--db", "/flag/idem.db", "--threads=8", NULL};
  idemd_config_t cfg;
  char *err;
  (void)state;

  setenv("IDEMD_DB", "/env/idem.db", 1);
  setenv("IDEMD_THREADS", "4", 1);
  setenv("IDEMD_LISTEN", "0.0.0.0:9000", 1);
  setenv("IDEMD_KEY_TTL", "1h", 1);
  setenv("IDEMD_PROVIDER", "http://127.0.0.1:9090", 1);
  setenv("IDEMD_METRICS_LISTEN", "10.0.0.5:9100", 1);
  setenv("IDEMD_TLS_CERT", "/etc/idem/cert.pem", 1);
  setenv("IDEMD_TLS_KEY", "/etc/idem/key.pem", 1);
  setenv("IDEMD_DB_TIMEOUT", "2m", 1);
  setenv("IDEMD_PROVIDER_IDEMPOTENCY", "off", 1);
  assert_int_equal(parse_args(&cfg, argv, &err), 3);
  assert_string_equal(err, "");
  free(err);
  /* Flags win over the environment... */
  assert_string_equal(cfg.db, "/flag/idem.db");
  assert_int_equal(cfg.threads, 8);
  /* ...and the environment wins over the defaults. */
  assert_string_equal(cfg.listen.host, "0.0.0.0");
  assert_int_equal(cfg.listen.port, 9000);
  assert_int_equal(cfg.key_ttl_ms, 3600000);
  assert_string_equal(cfg.provider, "http://127.0.0.1:9090");
  assert_int_equal(cfg.lease_ms, 30000);
  assert_string_equal(cfg.metrics_listen.host, "10.0.0.5");
  assert_int_equal(cfg.metrics_listen.port, 9100);
  assert_string_equal(cfg.tls_cert, "/etc/idem/cert.pem");
  assert_string_equal(cfg.tls_key, "/etc/idem/key.pem");
  assert_int_equal(cfg.db_timeout_ms, 120000);
  assert_string_equal(cfg.provider_idempotency, "off");
}

static void test_flag_forms(void **state) {
  const char *const argv[] = {
      "--listen=[::1]:8081", "--inflight-wait=250ms", "--key-ttl", "10m",
      "--lease=45s", "--provider-timeout=40s", "--provider-connect-timeout",
      "500ms", "--reconcile-interval=100ms", "--provider=http://127.0.0.1:9090",
      "--sandbox-delay", "15", "--sandbox-decline-amount=666",
      "--sandbox-uncertain-amount", "777", "--sandbox-unavailable-amount=888",
      "--db=postgresql://u@h/db?sslmode=disable", "--metrics-listen=[::1]:0",
      "--tls-cert", "c.pem", "--tls-key=k.pem", "--db-timeout", "250ms", NULL};
  idemd_config_t cfg;
  char *err;
  (void)state;

  assert_int_equal(parse_args(&cfg, argv, &err), (int)ARRAY_LEN(argv) - 1);
  free(err);
  assert_string_equal(cfg.listen.host, "[::1]");
  assert_int_equal(cfg.listen.port, 8081);
  assert_int_equal(cfg.inflight_wait_ms, 250);
  assert_int_equal(cfg.key_ttl_ms, 600000);
  assert_int_equal(cfg.lease_ms, 45000);
  assert_int_equal(cfg.provider_timeout_ms, 40000);
  assert_int_equal(cfg.provider_connect_timeout_ms, 500);
  assert_int_equal(cfg.reconcile_interval_ms, 100);
  assert_string_equal(cfg.provider, "http://127.0.0.1:9090");
  assert_int_equal(cfg.sandbox_delay_ms, 15000);
  assert_int_equal(cfg.sandbox_decline_amount, 666);
  assert_int_equal(cfg.sandbox_uncertain_amount, 777);
  assert_int_equal(cfg.sandbox_unavailable_amount, 888);
  assert_string_equal(cfg.db, "postgresql://u@h/db?sslmode=disable");
  assert_string_equal(cfg.metrics_listen.host, "[::1]");
  assert_int_equal(cfg.metrics_listen.port, 0);
  assert_string_equal(cfg.tls_cert, "c.pem");
  assert_string_equal(cfg.tls_key, "k.pem");
  assert_int_equal(cfg.db_timeout_ms, 250);
}

/* A positional argument ends the flags; the count says where. */
static void test_positional_stops_scan(void **state) {
  const char *const argv[] = {"--db", "x.db", "serve", "--threads", "3", NULL};
  const char *const first[] = {"tenant", "--db", "y.db", NULL};
  idemd_config_t cfg;
  char *err;
  (void)state;

  assert_int_equal(parse_args(&cfg, argv, &err), 2);
  free(err);
  assert_string_equal(cfg.db, "x.db");
  assert_int_equal(cfg.threads, 0);
  assert_int_equal(parse_args(&cfg, first, &err), 0);
  free(err);
  assert_string_equal(cfg.db, "./idem.db");
}

struct bad_case {
  const char *argv[3];
  const char *message; /* what the error output must contain */
};

static const struct bad_case bad_cases[] = {
    {{"--nope", NULL}, "unknown option '--nope'"},
    {{"--dbx=a.db", NULL}, "unknown option '--dbx=a.db'"},
    {{"--DB", "a.db"}, "unknown option '--DB'"},
    {{"--", NULL}, "unknown option '--'"},
    {{"--db", NULL}, "--db needs a value"},
    {{"--db=", NULL}, "invalid value for --db"},
    {{"--threads", "-1"}, "invalid value for --threads: '-1'"},
    {{"--threads", "1025"}, "invalid value for --threads: '1025'"},
    {{"--threads", "8x"}, "invalid value for --threads: '8x'"},
    {{"--threads=", NULL}, "invalid value for --threads"},
    {{"--listen", "8080"}, "invalid value for --listen: '8080'"},
    {{"--listen", ":8080"}, "invalid value for --listen"},
    {{"--listen", "localhost:"}, "invalid value for --listen"},
    {{"--listen", "localhost:65536"}, "invalid value for --listen"},
    {{"--listen", "localhost:http"}, "invalid value for --listen"},
    /* The metrics listener's address is read as --listen's. */
    {{"--metrics-listen", "9100"}, "invalid value for --metrics-listen: '9100'"},
    {{"--metrics-listen", ":9100"}, "invalid value for --metrics-listen"},
    {{"--metrics-listen", "localhost:65536"}, "invalid value for --metrics-listen"},
    {{"--metrics-listen=", NULL}, "invalid value for --metrics-listen"},
    {{"--metrics-listen", "127.0.0.1:8080"}, "--metrics-listen must differ from --listen"},
    /* Both TLS files or neither. */
    {{"--tls-cert", "c.pem"}, "--tls-cert and --tls-key go together: --tls-cert was given alone"},
    {{"--tls-key", "k.pem"}, "--tls-cert and --tls-key go together: --tls-key was given alone"},
    {{"--tls-cert=", NULL}, "invalid value for --tls-cert"},
    {{"--inflight-wait", "5x"}, "invalid value for --inflight-wait: '5x'"},
    {{"--inflight-wait", "11m"}, "invalid value for --inflight-wait"},
    {{"--key-ttl", "0"}, "invalid value for --key-ttl"},
    {{"--lease", "99ms"}, "invalid value for --lease"},
    {{"--reconcile-interval", "9ms"}, "invalid value for --reconcile-interval"},
    {{"--provider", "ftp://psp"}, "invalid value for --provider: 'ftp://psp'"},
    {{"--provider-idempotency", "no"}, "invalid value for --provider-idempotency: 'no'"},
    {{"--provider-idempotency", "maybe"}, "invalid value for --provider-idempotency"},
    /* The lease must outlast a provider call (default 10s). */
    {{"--lease", "10s"}, "must be longer than --provider-timeout"},
    {{"--provider-timeout=30s", NULL}, "must be longer than --provider-timeout"},
    /* --db-timeout: 100ms to 10m, a duration. */
    {{"--db-timeout", "0"}, "invalid value for --db-timeout: '0'"},
    {{"--db-timeout", "99ms"}, "invalid value for --db-timeout: '99ms'"},
    {{"--db-timeout", "11m"}, "invalid value for --db-timeout: '11m'"},
    {{"--db-timeout", "-1s"}, "invalid value for --db-timeout: '-1s'"},
    {{"--db-timeout", "5 s"}, "invalid value for --db-timeout: '5 s'"},
    {{"--db-timeout=", NULL}, "invalid value for --db-timeout"},
    {{"--db-timeout", NULL}, "--db-timeout needs a value"},
    {{"--sandbox-decline-amount", "-1"}, "invalid value for --sandbox-decline-amount"},
    {{"--sandbox-decline-amount", "9007199254740992"},
     "invalid value for --sandbox-decline-amount"},
};

static void test_bad_flags(void **state) {
  (void)state;
  for (size_t i = 0; i < ARRAY_LEN(bad_cases); i++) {
    idemd_config_t cfg;
    char *err;
    int rc = parse_args(&cfg, bad_cases[i].argv, &err);
    if (rc != -1)
      fail_msg("%s %s: got %d, want -1", bad_cases[i].argv[0],
               bad_cases[i].argv[1] ? bad_cases[i].argv[1] : "", rc);
    assert_contains(err, bad_cases[i].message);
    free(err);
  }
}

struct bad_env_case {
  const char *name, *value;
};

static const struct bad_env_case bad_env_cases[] = {
    {"IDEMD_THREADS", "abc"},
    {"IDEMD_LISTEN", "nowhere"},
    {"IDEMD_KEY_TTL", "forever"},
    {"IDEMD_DB", ""},
    {"IDEMD_METRICS_LISTEN", "9100"},
    {"IDEMD_TLS_KEY", ""},
    {"IDEMD_DB_TIMEOUT", "soon"},
    {"IDEMD_DB_TIMEOUT", "50ms"},
};

static void test_bad_environment(void **state) {
  const char *const argv[] = {NULL};
  (void)state;
  for (size_t i = 0; i < ARRAY_LEN(bad_env_cases); i++) {
    idemd_config_t cfg;
    char *err;
    setenv(bad_env_cases[i].name, bad_env_cases[i].value, 1);
    assert_int_equal(parse_args(&cfg, argv, &err), -1);
    assert_contains(err, bad_env_cases[i].name);
    free(err);
    unsetenv(bad_env_cases[i].name);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parse_duration),
      cmocka_unit_test_setup_teardown(test_defaults, clear_env, clear_env),
      cmocka_unit_test_setup_teardown(test_environment_then_flags, clear_env, clear_env),
      cmocka_unit_test_setup_teardown(test_flag_forms, clear_env, clear_env),
      cmocka_unit_test_setup_teardown(test_positional_stops_scan, clear_env, clear_env),
      cmocka_unit_test_setup_teardown(test_bad_flags, clear_env, clear_env),
      cmocka_unit_test_setup_teardown(test_bad_environment, clear_env, clear_env),
  };
  return cmocka_run_group_tests_name("config", tests, NULL, NULL);
}
