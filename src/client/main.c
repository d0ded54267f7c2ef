/* The idem command: `idem request METHOD URL [JSON]` sends one request
 * through the client library (include/idem/client.h), retrying it under one
 * Idempotency-Key, and turns how it ended into an exit status for scripts. */
#include <curl/curl.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "idem/client.h"
#include "idem_version.h"

#define EXIT_DONE 0
#define EXIT_LOCAL 1
#define EXIT_USAGE 2
#define EXIT_REJECTED 3
#define EXIT_GAVE_UP 4
#define EXIT_PENDING 5
#define MAX_TIME_S_LIMIT 86400.0
#define MAX_ATTEMPTS_LIMIT 1000
#define METHOD_CAP 16
#define DATA_CAP (1024 * 1024) /* --data @FILE: a body idemd would refuse long before */

static const char usage_text[] =
    "usage: idem request [options] [--] METHOD URL [JSON]\n"
    "       idem --help | --version\n"
    "\n"
    "Sends METHOD URL with an Idempotency-Key, and sends the same request again,\n"
    "with the same key, after a connection error, a timeout, a 5xx or a 409\n"
    "(waiting as Retry-After says, or a backoff with full jitter). A 202 is\n"
    "followed: its Location is read until the outcome is known, then the request\n"
    "is sent once more and the server replays its final answer. Any other 4xx\n"
    "is final. JSON, when given, is sent as the body (application/json).\n"
    "\n"
    "options:\n"
    "  --token T         API key, sent as Authorization: Bearer T\n"
    "                    (default: the IDEM_TOKEN environment variable)\n"
    "  --key K           the Idempotency-Key (default: a new random UUID v4);\n"
    "                    reuse the printed key to retry the same intent later\n"
    "  -H, --header 'Name: value'\n"
    "                    one more header on every attempt (and on the polls, but\n"
    "                    Content-*); repeatable, at most 64; one named\n"
    "                    Authorization, Content-Type or Accept replaces idem's;\n"
    "                    Idempotency-Key (use --key), Content-Length and\n"
    "                    Transfer-Encoding are refused\n"
    "  -d, --data DATA   the body, instead of JSON: DATA itself, @FILE for the\n"
    "                    contents of FILE, @- for standard input (at most 1 MiB)\n"
    "  --max-time S      stop after S seconds in all, waits included (default 30)\n"
    "  --max-attempts N  send the request at most N times (default 8)\n"
    "  -v, --verbose     on stderr, a line per attempt, wait and poll as it happens\n"
    "  --                the end of the options: what follows is METHOD URL [JSON]\n"
    "\n"
    "Prints the final answer's body on stdout and one line on stderr:\n"
    "  idem: STATUS key=KEY attempts=N [polls=P] [what went wrong]\n"
    "\n"
    "exit status:\n"
    "  0  a 2xx answer (202 excepted)\n"
    "  1  a local failure: a final answer over 1 MiB (STATUS is its status:\n"
    "     a 201 took effect), out of memory, no randomness\n"
    "  2  bad usage (also a URL that is not http:// or https://, a bad key or\n"
    "     header, a --data file that cannot be read)\n"
    "  3  an answer that retrying cannot change: a 4xx other than 408, 409\n"
    "     and 429 (402 declined, 422 invalid, 401, ...), or a 1xx/3xx\n"
    "  4  gave up: attempts or time ran out on connection errors, timeouts,\n"
    "     5xx, 408, 409 or 429; the outcome is unknown: retry with the same --key\n"
    "  5  still pending: the last answer was 202 when the time ran out;\n"
    "     retry later with the same --key\n";

__attribute__((format(printf, 1, 2))) static int usage_error(const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, "idem: ");
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\n(see idem --help)\n");
  return EXIT_USAGE;
}

/* The value of an option given as "--name VALUE" or "--name=VALUE" at
 * argv[*i]; advances *i past it. NULL when argv[*i] is not that option;
 * sets *missing when it is but has no value. */
static const char *option(int argc, char **argv, int *i, const char *name, int *missing) {
  size_t n = strlen(name);
  const char *a = argv[*i];

  if (strncmp(a, name, n) != 0)
    return NULL;
  if (a[n] == '=')
    return a + n + 1;
  if (a[n] != '\0')
    return NULL;
  if (*i + 1 >= argc) {
    *missing = 1;
    return NULL;
  }
  *i += 1;
  return argv[*i];
}

static int parse_seconds(const char *s, int64_t *ms) {
  char *end;
  double v = strtod(s, &end);
  if (end == s || *end != '\0' || !(v > 0) || v > MAX_TIME_S_LIMIT)
    return -1;
  *ms = (int64_t)(v * 1000.0 + 0.5);
  return *ms > 0 ? 0 : -1;
}

static int parse_attempts(const char *s, int *n) {
  char *end;
  long v = strtol(s, &end, 10);
  if (end == s || *end != '\0' || v < 1 || v > MAX_ATTEMPTS_LIMIT)
    return -1;
  *n = (int)v;
  return 0;
}

static int exit_status(idem_client_outcome_t outcome) {
  switch (outcome) {
  case IDEM_CLIENT_DONE:
    return EXIT_DONE;
  case IDEM_CLIENT_REJECTED:
    return EXIT_REJECTED;
  case IDEM_CLIENT_GAVE_UP:
    return EXIT_GAVE_UP;
  case IDEM_CLIENT_PENDING:
    return EXIT_PENDING;
  default:
    return EXIT_LOCAL;
  }
}

static void report(const idem_client_result_t *r, int verbose) {
  if (r->body_len > 0) {
    fwrite(r->body, 1, r->body_len, stdout);
    if (r->body[r->body_len - 1] != '\n')
      putchar('\n');
  }
  fflush(stdout);
  if (verbose && r->status != 0)
    fprintf(stderr, "idem: answer %ld%s%s%s%s%s\n", r->status,
            r->replayed ? " replayed" : "", r->location ? " location=" : "",
            r->location ? r->location : "", r->request_id ? " request_id=" : "",
            r->request_id ? r->request_id : "");
  fprintf(stderr, "idem: %ld key=%s attempts=%d", r->status, r->key, r->attempts);
  if (r->polls > 0)
    fprintf(stderr, " polls=%d", r->polls);
  if (r->outcome != IDEM_CLIENT_DONE)
    fprintf(stderr, " %s", idem_client_outcome_str(r->outcome));
  if ((r->outcome == IDEM_CLIENT_GAVE_UP || r->outcome == IDEM_CLIENT_FAILED) &&
      r->error[0])
    fprintf(stderr, ": %s", r->error);
  fputc('\n', stderr);
}

/* --verbose: one line per attempt, poll and wait, as they happen. */
static void on_event(const idem_client_event_t *ev, void *ctx) {
  (void)ctx;
  if (ev->kind == IDEM_CLIENT_EVENT_WAIT) {
    fprintf(stderr, "idem: wait %lld ms (%s), then %s %d\n", (long long)ev->wait_ms,
            ev->retry_after ? "Retry-After" : "backoff",
            ev->next_is_poll ? "poll" : "attempt", ev->number);
    return;
  }
  fprintf(stderr,
          "idem: %s %d: %s %s: ", ev->kind == IDEM_CLIENT_EVENT_POLL ? "poll" : "attempt",
          ev->number, ev->method, ev->url);
  if (ev->status != 0)
    fprintf(stderr, "%ld", ev->status);
  else
    fprintf(stderr, "no answer");
  if (ev->error[0])
    fprintf(stderr, "%s%s", ev->status != 0 ? ", " : ": ", ev->error);
  fprintf(stderr, " (%lld ms)\n", (long long)ev->took_ms);
}

/* The body of --data: `arg` itself, or the contents of the file after '@'
 * ("@-": standard input), at most DATA_CAP bytes, into *out (malloc'd, a
 * NUL after its *len bytes). Returns EXIT_DONE, or after saying why
 * EXIT_USAGE (the file cannot be read, or is too large) or EXIT_LOCAL (out
 * of memory). */
static int read_data(const char *arg, char **out, size_t *len) {
  const char *path = arg + 1;
  FILE *f;
  char *buf;
  size_t n = 0;
  int err = 0;

  if (arg[0] != '@') {
    *len = strlen(arg);
    *out = strdup(arg);
    if (*out != NULL)
      return EXIT_DONE;
    fprintf(stderr, "idem: out of memory\n");
    return EXIT_LOCAL;
  }
  f = strcmp(path, "-") == 0 ? stdin : fopen(path, "rb");
  if (f == NULL)
    return usage_error("--data %s: cannot open '%s': %s", arg, path, strerror(errno));
  buf = malloc(DATA_CAP + 2);
  if (buf != NULL) {
    size_t got;
    while ((got = fread(buf + n, 1, DATA_CAP + 1 - n, f)) > 0 && n + got <= DATA_CAP)
      n += got;
    if (got > 0)
      n += got; /* over the cap: refused below */
    err = ferror(f) ? errno : 0;
  }
  if (f != stdin)
    fclose(f);
  if (buf == NULL) {
    fprintf(stderr, "idem: out of memory\n");
    return EXIT_LOCAL;
  }
  if (err != 0 || n > DATA_CAP) {
    free(buf);
    if (err != 0)
      return usage_error("--data %s: cannot read '%s': %s", arg, path, strerror(err));
    return usage_error("--data %s: more than %d bytes", arg, DATA_CAP);
  }
  buf[n] = '\0';
  *out = buf;
  *len = n;
  return EXIT_DONE;
}

/* The value of "-X VALUE" or "-XVALUE" at argv[*i], for the short option
 * `flag` ("-H"); as option(). */
static const char *short_option(int argc, char **argv, int *i, const char *flag,
                                int *missing) {
  const char *a = argv[*i];
  if (strncmp(a, flag, 2) != 0)
    return NULL;
  if (a[2] != '\0')
    return a + 2;
  if (*i + 1 >= argc) {
    *missing = 1;
    return NULL;
  }
  *i += 1;
  return argv[*i];
}

static int request_command(int argc, char **argv) {
  idem_client_opts_t opts;
  idem_client_request_t req = {0};
  idem_client_result_t res;
  const char *positional[3];
  const char *headers[IDEM_CLIENT_HEADERS_MAX + 1];
  const char *data = NULL;
  char method[METHOD_CAP + 1];
  char *body = NULL;
  size_t body_len = 0;
  int npos = 0, nheaders = 0, verbose = 0, options_end = 0, rc;

  idem_client_opts_default(&opts);
  req.token = getenv("IDEM_TOKEN");
  for (int i = 0; i < argc; i++) {
    const char *v;
    int missing = 0;
    if (options_end || (argv[i][0] != '-' || argv[i][1] == '\0')) {
      if (npos >= 3)
        return usage_error("too many arguments: '%s'", argv[i]);
      positional[npos++] = argv[i];
    } else if (strcmp(argv[i], "--") == 0) {
      options_end = 1;
    } else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      fputs(usage_text, stdout);
      return EXIT_DONE;
    } else if (strcmp(argv[i], "--verbose") == 0 || strcmp(argv[i], "-v") == 0) {
      verbose = 1;
    } else if ((v = option(argc, argv, &i, "--token", &missing)) != NULL) {
      req.token = v;
    } else if ((v = option(argc, argv, &i, "--key", &missing)) != NULL) {
      req.key = v;
    } else if ((v = option(argc, argv, &i, "--header", &missing)) != NULL ||
               (!missing && (v = short_option(argc, argv, &i, "-H", &missing)) != NULL)) {
      if (nheaders >= IDEM_CLIENT_HEADERS_MAX)
        return usage_error("at most %d headers", IDEM_CLIENT_HEADERS_MAX);
      headers[nheaders++] = v;
    } else if ((v = option(argc, argv, &i, "--data", &missing)) != NULL ||
               (!missing && (v = short_option(argc, argv, &i, "-d", &missing)) != NULL)) {
      if (data != NULL)
        return usage_error("--data given twice");
      data = v;
    } else if ((v = option(argc, argv, &i, "--max-time", &missing)) != NULL) {
      if (parse_seconds(v, &opts.max_time_ms) != 0)
        return usage_error(
            "--max-time takes seconds, more than 0 and at most 86400: '%s'", v);
    } else if ((v = option(argc, argv, &i, "--max-attempts", &missing)) != NULL) {
      if (parse_attempts(v, &opts.max_attempts) != 0)
        return usage_error("--max-attempts takes a whole number from 1 to 1000: '%s'", v);
    } else if (missing) {
      return usage_error("%s needs a value", argv[i]);
    } else {
      return usage_error("unknown option '%s'", argv[i]);
    }
  }
  headers[nheaders] = NULL;
  if (npos < 2)
    return usage_error("request needs METHOD and URL");
  if (npos > 2 && data != NULL)
    return usage_error("both --data and a JSON argument: give the body once");
  if (strlen(positional[0]) > METHOD_CAP)
    return usage_error("not an HTTP method: '%s'", positional[0]);
  for (size_t i = 0; i <= strlen(positional[0]); i++)
    method[i] = (char)(positional[0][i] >= 'a' && positional[0][i] <= 'z'
                           ? positional[0][i] - 'a' + 'A'
                           : positional[0][i]);
  for (int i = 0; i < nheaders; i++) {
    if (strchr(headers[i], ':') == NULL)
      return usage_error("a header is 'Name: value': '%s'", headers[i]);
    if (strncasecmp(headers[i], "Idempotency-Key:", 16) == 0)
      return usage_error("the Idempotency-Key is set with --key, not -H");
  }
  if (data != NULL && (rc = read_data(data, &body, &body_len)) != EXIT_DONE)
    return rc;
  req.method = method;
  req.url = positional[1];
  req.body = body ? body : npos > 2 ? positional[2] : NULL;
  req.body_len = body ? body_len : 0;
  req.headers = nheaders > 0 ? headers : NULL;
  if (req.token != NULL && req.token[0] == '\0')
    req.token = NULL;
  if (verbose)
    opts.on_event = on_event;

  rc = idem_client_request(&req, &opts, &res);
  if (rc == IDEM_EINVAL) {
    free(body);
    return usage_error("%s", "invalid request: METHOD must be letters, URL http:// or "
                             "https://, the key 1-255 visible ASCII characters, the "
                             "token visible ASCII, a header 'Name: value' with a name of "
                             "letters, digits and !#$%&'*+-.^_`|~, not Idempotency-Key, "
                             "Content-Length or Transfer-Encoding");
  }
  free(body);
  if (rc != IDEM_OK) {
    fprintf(stderr, "idem: %s\n", idem_strerror(rc));
    return EXIT_LOCAL;
  }
  report(&res, verbose);
  rc = exit_status(res.outcome);
  idem_client_result_free(&res);
  return rc;
}

int main(int argc, char **argv) {
  int status;

  if (argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
                    strcmp(argv[1], "help") == 0)) {
    fputs(usage_text, stdout);
    return EXIT_DONE;
  }
  if (argc == 2 && strcmp(argv[1], "--version") == 0) {
    printf("idem %s\n", IDEM_VERSION_STRING);
    return EXIT_DONE;
  }
  if (argc < 2 || strcmp(argv[1], "request") != 0) {
    fputs(usage_text, stderr);
    return EXIT_USAGE;
  }
  if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
    fprintf(stderr, "idem: cannot initialise libcurl\n");
    return EXIT_LOCAL;
  }
  status = request_command(argc - 2, argv + 2);
  curl_global_cleanup();
  return status;
}
