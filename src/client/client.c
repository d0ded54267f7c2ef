/* The idem client (include/idem/client.h): one request, one Idempotency-Key
 * born with it, and a bounded loop that sends that same request again until
 * the server gives a final answer. A timeout or a lost answer is never taken
 * for "nothing happened": the retry carries the same key, so the server
 * replays what it did instead of doing it twice. */
#include "idem/client.h"

#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "idem/clock.h"
#include "idem/crypto.h"

#define DEFAULT_MAX_ATTEMPTS 8
#define DEFAULT_MAX_TIME_MS 30000
#define DEFAULT_BASE_DELAY_MS 100
#define DEFAULT_MAX_DELAY_MS 5000
#define DEFAULT_ATTEMPT_TIMEOUT_MS 10000
#define DEFAULT_MAX_RESPONSE_BYTES (1024 * 1024)
#define RETRY_AFTER_MAX_S 1000000000LL
#define MAX_POLLS 10000 /* besides the time limit: the loop stays bounded */
#define METHOD_MAX 16
#define URL_MAX 4096
#define TOKEN_MAX 4096
#define USER_AGENT "idem-client/0.1"

static const char *const outcome_text[] = {
#define IDEM__CLIENT_OUTCOME_TEXT(name, text) text,
    IDEM_CLIENT_OUTCOME_MAP(IDEM__CLIENT_OUTCOME_TEXT)
#undef IDEM__CLIENT_OUTCOME_TEXT
};

const char *idem_client_outcome_str(int outcome) {
  if (outcome < 0 || outcome >= IDEM_CLIENT_OUTCOME_MAX_)
    return "unknown outcome";
  return outcome_text[outcome];
}

void idem_client_opts_default(idem_client_opts_t *opts) {
  opts->max_attempts = DEFAULT_MAX_ATTEMPTS;
  opts->max_time_ms = DEFAULT_MAX_TIME_MS;
  opts->base_delay_ms = DEFAULT_BASE_DELAY_MS;
  opts->max_delay_ms = DEFAULT_MAX_DELAY_MS;
  opts->attempt_timeout_ms = DEFAULT_ATTEMPT_TIMEOUT_MS;
  opts->max_response_bytes = DEFAULT_MAX_RESPONSE_BYTES;
  opts->on_event = NULL;
  opts->event_ctx = NULL;
}

void idem_client_result_free(idem_client_result_t *r) {
  if (r == NULL)
    return;
  free(r->body);
  free(r->location);
  free(r->request_id);
  memset(r, 0, sizeof *r);
}

/* ---- keys, backoff, Retry-After ------------------------------------- */

int idem_client_new_key(char out[IDEM_CLIENT_UUID_LEN + 1]) {
  unsigned char b[16];
  char hex[33];

  if (idem_random_bytes(b, sizeof b) != IDEM_OK) {
    out[0] = '\0';
    return IDEM_ECRYPTO;
  }
  b[6] = (unsigned char)(0x40 | (b[6] & 0x0f)); /* version 4 */
  b[8] = (unsigned char)(0x80 | (b[8] & 0x3f)); /* variant 10 */
  idem_hex(b, sizeof b, hex);
  snprintf(out, IDEM_CLIENT_UUID_LEN + 1, "%.8s-%.4s-%.4s-%.4s-%.12s", hex, hex + 8,
           hex + 12, hex + 16, hex + 20);
  return IDEM_OK;
}

int64_t idem_client_backoff_ms(const idem_client_opts_t *opts, int retry, uint64_t rnd) {
  int64_t cap = opts->max_delay_ms > 0 ? opts->max_delay_ms : 0;
  int64_t ceiling = opts->base_delay_ms > 0 ? opts->base_delay_ms : 0;

  /* Double until the cap, without ever overflowing. */
  for (int i = 0; i < retry && ceiling < cap; i++)
    ceiling = ceiling > cap / 2 ? cap : ceiling * 2;
  if (ceiling > cap)
    ceiling = cap;
  return (int64_t)(rnd % ((uint64_t)ceiling + 1));
}

static int is_space(char c) {
  return c == ' ' || c == '\t';
}

int idem_client_retry_after_ms(const char *value, int64_t now_ms, int64_t *delay_ms) {
  const char *p, *end;
  char date[64];
  time_t when;

  if (value == NULL)
    return IDEM_EINVAL;
  for (p = value; is_space(*p); p++)
    ;
  for (end = p + strlen(p); end > p && is_space(end[-1]); end--)
    ;
  if (p == end)
    return IDEM_EINVAL;
  if (*p >= '0' && *p <= '9') {
    int64_t secs = 0;
    for (const char *q = p; q < end; q++) {
      if (*q < '0' || *q > '9')
        return IDEM_EINVAL;
      if (secs < RETRY_AFTER_MAX_S)
        secs = secs * 10 + (*q - '0');
    }
    *delay_ms = (secs < RETRY_AFTER_MAX_S ? secs : RETRY_AFTER_MAX_S) * 1000;
    return IDEM_OK;
  }
  /* Every HTTP-date form (IMF-fixdate, RFC 850, asctime) opens with the
   * day's name; requiring a letter keeps curl_getdate()'s leniency from
   * reading "-5" or "+3" as a date. */
  if (!((*p >= 'A' && *p <= 'Z') || (*p >= 'a' && *p <= 'z')) ||
      (size_t)(end - p) >= sizeof date)
    return IDEM_EINVAL;
  memcpy(date, p, (size_t)(end - p));
  date[end - p] = '\0';
  when = curl_getdate(date, NULL);
  if (when == -1)
    return IDEM_EINVAL;
  *delay_ms = (int64_t)when * 1000 > now_ms ? (int64_t)when * 1000 - now_ms : 0;
  return IDEM_OK;
}

/* ---- one exchange --------------------------------------------------- */

/* An answer's body, bounded by opts.max_response_bytes. */
typedef struct body_buf {
  char *data;
  size_t len, cap, max;
  int over; /* the answer was larger than max */
} body_buf_t;

static size_t on_body(char *ptr, size_t size, size_t n, void *ctx) {
  body_buf_t *b = ctx;
  size_t add = size * n;

  if (add > b->max - b->len) {
    b->over = 1;
    return 0; /* curl stops with CURLE_WRITE_ERROR */
  }
  if (b->len + add + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 1024;
    char *nd;
    while (cap < b->len + add + 1)
      cap *= 2;
    if ((nd = realloc(b->data, cap)) == NULL)
      return 0;
    b->data = nd;
    b->cap = cap;
  }
  memcpy(b->data + b->len, ptr, add);
  b->len += add;
  b->data[b->len] = '\0';
  return add;
}

/* What one exchange gave. Free with answer_free(). */
typedef struct answer {
  CURLcode rc; /* CURLE_OK when an HTTP answer arrived */
  long status; /* 0 when none did */
  body_buf_t body;
  int64_t retry_after;    /* ms to wait as the answer asked; -1: it did not say */
  char location[URL_MAX]; /* resolved Location on the request's origin, or "" */
  int replayed;           /* Idempotent-Replayed: true */
  char *raw_location;     /* Location as sent (malloc'd; NULL: none) */
  char *request_id;       /* X-Request-Id (malloc'd; NULL: none) */
  int64_t took_ms;
} answer_t;

static void answer_free(answer_t *a) {
  free(a->body.data);
  free(a->raw_location);
  free(a->request_id);
  a->body.data = a->raw_location = a->request_id = NULL;
}

/* The state of one idem_client_request() call. */
typedef struct call {
  CURL *h;
  const idem_client_request_t *req;
  const char *method;
  const char *body; /* NULL: none */
  size_t body_len;
  idem_client_opts_t opts;
  int64_t deadline; /* idem_mono_ms() */
  struct curl_slist *send_headers;
  struct curl_slist *poll_headers;
  idem_client_result_t *out;
  char errbuf[CURL_ERROR_SIZE];
} call_t;

/* Does `u` have the scheme, host and port of `base`? */
static int same_origin(CURLU *base, CURLU *u) {
  static const CURLUPart parts[] = {CURLUPART_SCHEME, CURLUPART_HOST, CURLUPART_PORT};
  int same = 1;

  for (size_t i = 0; i < sizeof parts / sizeof *parts && same; i++) {
    char *a = NULL, *b = NULL;
    same = curl_url_get(base, parts[i], &a, CURLU_DEFAULT_PORT) == CURLUE_OK &&
           curl_url_get(u, parts[i], &b, CURLU_DEFAULT_PORT) == CURLUE_OK &&
           strcasecmp(a, b) == 0;
    curl_free(a);
    curl_free(b);
  }
  return same;
}

/* Resolves a Location value against `base` into `out`; "" when it cannot be
 * parsed, does not fit, or points elsewhere (the token must not leave the
 * request's origin). */
static void resolve_location(const char *base, const char *loc, char *out, size_t cap) {
  CURLU *b = curl_url(), *u = NULL;
  char *s = NULL;

  out[0] = '\0';
  if (b != NULL && curl_url_set(b, CURLUPART_URL, base, 0) == CURLUE_OK &&
      (u = curl_url_dup(b)) != NULL &&
      curl_url_set(u, CURLUPART_URL, loc, 0) == CURLUE_OK && same_origin(b, u) &&
      curl_url_get(u, CURLUPART_URL, &s, 0) == CURLUE_OK && strlen(s) < cap)
    memcpy(out, s, strlen(s) + 1);
  curl_free(s);
  curl_url_cleanup(u);
  curl_url_cleanup(b);
}

static void read_headers(call_t *c, answer_t *a) {
  struct curl_header *hd;

  /* An unreadable Retry-After is ignored: the backoff decides. */
  if (curl_easy_header(c->h, "Retry-After", 0, CURLH_HEADER, -1, &hd) == CURLHE_OK &&
      idem_client_retry_after_ms(hd->value, idem_now_ms(), &a->retry_after) != IDEM_OK)
    a->retry_after = -1;
  if (curl_easy_header(c->h, "Location", 0, CURLH_HEADER, -1, &hd) == CURLHE_OK) {
    resolve_location(c->req->url, hd->value, a->location, sizeof a->location);
    a->raw_location = strdup(hd->value); /* NULL out of memory: reported as none */
  }
  if (curl_easy_header(c->h, "X-Request-Id", 0, CURLH_HEADER, -1, &hd) == CURLHE_OK)
    a->request_id = strdup(hd->value);
  a->replayed = curl_easy_header(c->h, "Idempotent-Replayed", 0, CURLH_HEADER, -1, &hd) ==
                    CURLHE_OK &&
                strcasecmp(hd->value, "true") == 0;
}

/* One HTTP exchange: the request itself (`poll_url` NULL) or a GET of
 * `poll_url`. The timeout is the smaller of the per-attempt one and the
 * time left. The caller frees a->body.data. */
static void exchange(call_t *c, const char *poll_url, answer_t *a) {
  CURL *h = c->h;
  int64_t start = idem_mono_ms(), left = c->deadline - start;
  long timeout =
      (long)(left < c->opts.attempt_timeout_ms ? left : c->opts.attempt_timeout_ms);

  memset(a, 0, sizeof *a);
  a->retry_after = -1;
  a->body.max = c->opts.max_response_bytes;
  c->errbuf[0] = '\0';
  curl_easy_reset(h); /* keeps the connection cache */
  curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(h, CURLOPT_FOLLOWLOCATION, 0L);
  curl_easy_setopt(h, CURLOPT_USERAGENT, USER_AGENT);
  curl_easy_setopt(h, CURLOPT_ERRORBUFFER, c->errbuf);
  curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, timeout > 1 ? timeout : 1L);
  curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, timeout > 1 ? timeout : 1L);
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(h, CURLOPT_WRITEDATA, &a->body);
  if (poll_url != NULL) {
    curl_easy_setopt(h, CURLOPT_URL, poll_url);
    curl_easy_setopt(h, CURLOPT_HTTPGET, 1L);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, c->poll_headers);
  } else {
    const char *body = c->body;
    curl_easy_setopt(h, CURLOPT_URL, c->req->url);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, c->send_headers);
    if (strcmp(c->method, "GET") == 0 && body == NULL) {
      curl_easy_setopt(h, CURLOPT_HTTPGET, 1L);
    } else if (strcmp(c->method, "HEAD") == 0 && body == NULL) {
      curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    } else {
      /* POSTFIELDS gives a Content-Length, also 0 for a bodiless POST. */
      curl_easy_setopt(h, CURLOPT_POSTFIELDS, body ? body : "");
      curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE,
                       (curl_off_t)(body ? c->body_len : 0));
      if (strcmp(c->method, "POST") != 0)
        curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, c->method);
    }
  }
  a->rc = curl_easy_perform(h);
  a->took_ms = idem_mono_ms() - start;
  /* An answer over max_response_bytes has its status and headers still:
   * whether it is final, and what the request did, are known. */
  if (a->rc != CURLE_OK && !(a->rc == CURLE_WRITE_ERROR && a->body.over))
    return;
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &a->status);
  read_headers(c, a);
}

/* Whether another try may get another answer: 409 (the request is still in
 * flight), 408 and 429 (the server or a proxy asks for later), and 5xx. */
static int status_is_retried(long status) {
  return status == 408 || status == 409 || status == 429 || status >= 500;
}

/* Failures that another attempt cannot fix. */
static int transport_is_final(const answer_t *a) {
  switch (a->rc) {
  case CURLE_UNSUPPORTED_PROTOCOL:
  case CURLE_URL_MALFORMAT:
  case CURLE_NOT_BUILT_IN:
  case CURLE_OUT_OF_MEMORY:
  case CURLE_BAD_FUNCTION_ARGUMENT:
  case CURLE_UNKNOWN_OPTION:
  case CURLE_WRITE_ERROR: /* our own cap on the answer's size */
  case CURLE_PEER_FAILED_VERIFICATION:
    return 1;
  default:
    return 0;
  }
}

static void note_transport_error(call_t *c, const answer_t *a) {
  idem_client_result_t *out = c->out;
  if (a->body.over)
    snprintf(out->error, sizeof out->error, "the answer is larger than %zu bytes",
             c->opts.max_response_bytes);
  else
    snprintf(out->error, sizeof out->error, "%s",
             c->errbuf[0] ? c->errbuf : curl_easy_strerror(a->rc));
}

/* ---- the loop ------------------------------------------------------- */

/* What to do after an answer. */
typedef enum step {
  STEP_DONE,   /* final: out->outcome is set */
  STEP_RETRY,  /* wait, then send the request again */
  STEP_POLL,   /* wait, then GET the Location */
  STEP_RESEND, /* send the request again now: its outcome is known */
} step_t;

/* The request's own answer: keeps it in `out` and decides. */
static step_t after_send(call_t *c, answer_t *a) {
  idem_client_result_t *out = c->out;

  if (a->rc != CURLE_OK && a->status == 0) {
    note_transport_error(c, a);
    if (!transport_is_final(a))
      return STEP_RETRY;
    out->outcome = IDEM_CLIENT_FAILED;
    return STEP_DONE;
  }
  /* An answer, whole or over the cap: it is the request's last status. */
  free(out->body);
  free(out->location);
  free(out->request_id);
  out->status = a->status;
  out->body = NULL;
  out->body_len = 0;
  out->error[0] = '\0';
  out->replayed = a->replayed;
  out->location = a->raw_location;
  out->request_id = a->request_id;
  a->raw_location = a->request_id = NULL;
  if (a->rc != CURLE_OK) { /* over max_response_bytes: no body kept */
    note_transport_error(c, a);
    if (status_is_retried(a->status))
      return STEP_RETRY;
    if (a->status == 202) /* as a 202 of any size: poll, or send again */
      return a->location[0] ? STEP_POLL : STEP_RETRY;
    out->outcome = IDEM_CLIENT_FAILED;
    return STEP_DONE;
  }
  out->body = a->body.data;
  out->body_len = a->body.len;
  a->body.data = NULL;
  if (status_is_retried(a->status))
    return STEP_RETRY;
  if (a->status == 202)
    return a->location[0] ? STEP_POLL : STEP_RETRY;
  out->outcome =
      a->status >= 200 && a->status < 300 ? IDEM_CLIENT_DONE : IDEM_CLIENT_REJECTED;
  return STEP_DONE;
}

/* Is this 200/201 body a resource still waiting for its outcome? */
static int still_pending(const answer_t *a) {
  json_t *doc = a->body.data ? json_loadb(a->body.data, a->body.len, 0, NULL) : NULL;
  const char *status = json_string_value(json_object_get(doc, "status"));
  int pending = status != NULL && strcmp(status, "pending") == 0;
  json_decref(doc);
  return pending;
}

/* An answer to a GET of the Location. */
static step_t after_poll(call_t *c, const answer_t *a) {
  if (a->rc == CURLE_WRITE_ERROR && a->body.over) {
    /* Over the cap, its body unread: poll again while it says to wait
     * (a proxy's error page, say), else ask the request itself, whose
     * answer is the one reported. */
    note_transport_error(c, a);
    return a->status == 202 || status_is_retried(a->status) ? STEP_POLL : STEP_RETRY;
  }
  if (a->rc == CURLE_OK)
    c->out->error[0] = '\0';
  if (a->rc != CURLE_OK) {
    note_transport_error(c, a);
    if (!transport_is_final(a))
      return STEP_POLL;
    c->out->outcome = IDEM_CLIENT_FAILED;
    return STEP_DONE;
  }
  if (a->status == 202 || status_is_retried(a->status))
    return STEP_POLL;
  if (a->status == 402)
    return STEP_RESEND;
  if (a->status == 200 || a->status == 201)
    return still_pending(a) ? STEP_POLL : STEP_RESEND;
  /* The Location does not answer for the resource: ask the request itself,
   * which replays the server's stored answer under the key. */
  return STEP_RETRY;
}

static void nap_ms(int64_t ms) {
  struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
}

/* Tells opts.on_event, if set, of an exchange just made. */
static void tell_exchange(call_t *c, const answer_t *a, int poll, const char *url) {
  char error[sizeof c->out->error];
  idem_client_event_t ev = {.kind =
                                poll ? IDEM_CLIENT_EVENT_POLL : IDEM_CLIENT_EVENT_ATTEMPT,
                            .number = poll ? c->out->polls : c->out->attempts,
                            .method = poll ? "GET" : c->method,
                            .url = url,
                            .status = a->status,
                            .error = error,
                            .took_ms = a->took_ms};

  if (c->opts.on_event == NULL)
    return;
  error[0] = '\0';
  if (a->body.over)
    snprintf(error, sizeof error, "the answer is larger than %zu bytes",
             c->opts.max_response_bytes);
  else if (a->rc != CURLE_OK)
    snprintf(error, sizeof error, "%s",
             c->errbuf[0] ? c->errbuf : curl_easy_strerror(a->rc));
  c->opts.on_event(&ev, c->opts.event_ctx);
}

/* Waits before the next try: what the answer asked for, else the backoff
 * for try number `n` (0 for the first wait). Returns 0 when that wait would
 * pass the deadline (the call then stops rather than come back early). */
static int wait_before(call_t *c, const answer_t *a, int n, int poll) {
  int64_t delay = a->retry_after;
  uint64_t rnd = 0;

  if (delay < 0) {
    if (idem_random_bytes(&rnd, sizeof rnd) != IDEM_OK)
      rnd = UINT64_MAX; /* no randomness: some wait within bounds still */
    delay = idem_client_backoff_ms(&c->opts, n, rnd);
  }
  if (delay >= c->deadline - idem_mono_ms())
    return 0;
  if (c->opts.on_event != NULL) {
    idem_client_event_t ev = {.kind = IDEM_CLIENT_EVENT_WAIT,
                              .number = poll ? c->out->polls + 1 : c->out->attempts + 1,
                              .error = "",
                              .wait_ms = delay,
                              .retry_after = a->retry_after >= 0,
                              .next_is_poll = poll};
    c->opts.on_event(&ev, c->opts.event_ctx);
  }
  nap_ms(delay);
  return 1;
}

static void run(call_t *c) {
  idem_client_result_t *out = c->out;
  char poll_url[URL_MAX];
  int polling = 0;

  for (;;) {
    answer_t a;
    step_t step;
    int waited;

    if (idem_mono_ms() >= c->deadline)
      break;
    if (polling) {
      exchange(c, poll_url, &a);
      out->polls++;
      tell_exchange(c, &a, 1, poll_url);
      step = after_poll(c, &a);
    } else {
      if (out->attempts >= c->opts.max_attempts)
        break;
      exchange(c, NULL, &a);
      out->attempts++;
      tell_exchange(c, &a, 0, c->req->url);
      step = after_send(c, &a);
      if (step == STEP_POLL)
        memcpy(poll_url, a.location, sizeof poll_url);
    }
    if (step == STEP_POLL && out->polls >= MAX_POLLS)
      step = STEP_RETRY;
    polling = step == STEP_POLL;
    if (step == STEP_DONE) {
      answer_free(&a);
      return;
    }
    /* No wait for a send that will not come: out of attempts. */
    if (step == STEP_RETRY && out->attempts >= c->opts.max_attempts) {
      answer_free(&a);
      break;
    }
    waited = step == STEP_RESEND ||
             wait_before(c, &a, polling ? out->polls : out->attempts - 1, polling);
    answer_free(&a);
    if (!waited)
      break;
  }
  /* Out of attempts or time without a final answer. */
  out->outcome = out->status == 202 ? IDEM_CLIENT_PENDING : IDEM_CLIENT_GAVE_UP;
}

/* ---- the call ------------------------------------------------------- */

/* 1 when `s` is 1 to `max` visible ASCII characters (no spaces). */
static int visible_ascii(const char *s, size_t max) {
  size_t n = 0;
  for (; s[n]; n++)
    if (n >= max || (unsigned char)s[n] < 0x21 || (unsigned char)s[n] > 0x7e)
      return 0;
  return n > 0;
}

static int valid_method(const char *m) {
  size_t n = 0;
  for (; m[n]; n++)
    if (n >= METHOD_MAX || m[n] < 'A' || m[n] > 'Z')
      return 0;
  return n > 0;
}

/* An absolute http:// or https:// URL that curl can parse. */
static int valid_url(const char *url) {
  CURLU *u = curl_url();
  char *scheme = NULL;
  int ok = u != NULL && curl_url_set(u, CURLUPART_URL, url, 0) == CURLUE_OK &&
           curl_url_get(u, CURLUPART_SCHEME, &scheme, 0) == CURLUE_OK &&
           (strcmp(scheme, "http") == 0 || strcmp(scheme, "https") == 0) &&
           strlen(url) < URL_MAX;
  curl_free(scheme);
  curl_url_cleanup(u);
  return ok;
}

/* Appends `prefix` + `value` as one header line to *list. Returns 0, or -1
 * out of memory (the list is then unchanged). */
static int add_header(struct curl_slist **list, const char *prefix, const char *value) {
  size_t need = strlen(prefix) + strlen(value) + 1;
  char *line = malloc(need);
  struct curl_slist *next = NULL;

  if (line != NULL) {
    snprintf(line, need, "%s%s", prefix, value);
    next = curl_slist_append(*list, line);
    free(line);
  }
  if (next == NULL)
    return -1;
  *list = next;
  return 0;
}

/* ---- extra header lines -------------------------------------------- */

/* Names an extra line may not have: the key is req->key, and the client
 * frames the body itself. */
static const char *const refused_names[] = {"Idempotency-Key", "Content-Length",
                                            "Transfer-Encoding"};

/* RFC 9110's tchar, the characters of a header's name. */
static int is_tchar(unsigned char ch) {
  return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
         (ch >= '0' && ch <= '9') ||
         (ch != '\0' && strchr("!#$%&'*+-.^_`|~", ch) != NULL);
}

/* The length of the name of `line` when it is "Name: value" with a token
 * for a name and no control character but tabs in the value; else 0. */
static size_t header_name_len(const char *line) {
  size_t n = 0;

  if (strlen(line) > IDEM_CLIENT_HEADER_LINE_MAX)
    return 0;
  while (is_tchar((unsigned char)line[n]))
    n++;
  if (n == 0 || line[n] != ':')
    return 0;
  for (const unsigned char *v = (const unsigned char *)line + n + 1; *v; v++)
    if (*v != '\t' && (*v < 0x20 || *v == 0x7f))
      return 0;
  return n;
}

static int name_is(const char *line, size_t n, const char *name) {
  return strlen(name) == n && strncasecmp(line, name, n) == 0;
}

/* Does req->headers (already checked) have a line named `name`? */
static int has_header(const idem_client_request_t *req, const char *name) {
  for (const char *const *h = req->headers; h && *h; h++)
    if (name_is(*h, header_name_len(*h), name))
      return 1;
  return 0;
}

static int valid_headers(const char *const *h) {
  for (size_t i = 0; h && h[i]; i++) {
    size_t n = header_name_len(h[i]);
    if (i >= IDEM_CLIENT_HEADERS_MAX || n == 0)
      return 0;
    for (size_t j = 0; j < sizeof refused_names / sizeof *refused_names; j++)
      if (name_is(h[i], n, refused_names[j]))
        return 0;
  }
  return 1;
}

/* Appends an extra line to *list: as given, or "Name;" for an empty value
 * (curl's way to send one; "Name:" would only drop a header of its own). */
static int add_extra(struct curl_slist **list, const char *line) {
  size_t n = header_name_len(line);
  const char *v = line + n + 1;
  char name[IDEM_CLIENT_HEADER_LINE_MAX + 2];

  while (*v == ' ' || *v == '\t')
    v++;
  if (*v != '\0')
    return add_header(list, "", line);
  memcpy(name, line, n);
  memcpy(name + n, ";", 2);
  return add_header(list, "", name);
}

/* The headers of the request itself and of the polls: the client's own,
 * less those the caller's extra lines replace, then those lines. Returns
 * 0 or -1. */
static int build_headers(call_t *c) {
  const idem_client_request_t *req = c->req;
  struct curl_slist **send = &c->send_headers, **poll = &c->poll_headers;
  int bad = 0;

  if (req->token != NULL && !has_header(req, "Authorization"))
    bad |= add_header(send, "Authorization: Bearer ", req->token) |
           add_header(poll, "Authorization: Bearer ", req->token);
  bad |= add_header(send, "Idempotency-Key: ", c->out->key);
  /* "Content-Type:" with no value drops the form type curl would add. */
  if (!has_header(req, "Content-Type"))
    bad |= add_header(send, "Content-Type:", c->body ? " application/json" : "");
  if (!has_header(req, "Accept"))
    bad |= add_header(send, "Accept: ", "application/json") |
           add_header(poll, "Accept: ", "application/json");
  if (!has_header(req, "Expect"))
    bad |= add_header(send, "Expect:", ""); /* no 100-continue round trip */
  for (const char *const *h = req->headers; h && *h; h++) {
    bad |= add_extra(send, *h);
    if (strncasecmp(*h, "Content-", 8) != 0) /* a GET has no content */
      bad |= add_extra(poll, *h);
  }
  return bad ? -1 : 0;
}

static int valid_opts(const idem_client_opts_t *o) {
  return o->max_attempts >= 1 && o->max_time_ms > 0 && o->attempt_timeout_ms > 0 &&
         o->max_response_bytes > 0;
}

int idem_client_request(const idem_client_request_t *req, const idem_client_opts_t *opts,
                        idem_client_result_t *out) {
  call_t c = {.req = req, .out = out};
  int rc = IDEM_OK;

  if (out == NULL)
    return IDEM_EINVAL;
  memset(out, 0, sizeof *out);
  if (opts != NULL)
    c.opts = *opts;
  else
    idem_client_opts_default(&c.opts);
  if (req == NULL || req->url == NULL || !valid_url(req->url) || !valid_opts(&c.opts))
    return IDEM_EINVAL;
  c.method = req->method ? req->method : "POST";
  if (!valid_method(c.method) || (req->token && !visible_ascii(req->token, TOKEN_MAX)) ||
      (req->key && !visible_ascii(req->key, IDEM_KEY_MAX)) ||
      !valid_headers(req->headers))
    return IDEM_EINVAL;
  c.body = req->body;
  c.body_len = req->body == NULL ? 0 : req->body_len ? req->body_len : strlen(req->body);

  /* The key is born here, with the intent, and every attempt reuses it. */
  if (req->key != NULL)
    snprintf(out->key, sizeof out->key, "%s", req->key);
  else if (idem_client_new_key(out->key) != IDEM_OK)
    return IDEM_ECRYPTO;

  if (build_headers(&c) != 0 || (c.h = curl_easy_init()) == NULL) {
    rc = IDEM_ENOMEM;
    memset(out, 0, sizeof *out);
  } else {
    int64_t now = idem_mono_ms();
    /* INT64_MAX, say, for no limit: the deadline saturates. */
    c.deadline = c.opts.max_time_ms > INT64_MAX - now ? INT64_MAX : now + c.opts.max_time_ms;
    run(&c);
  }
  curl_easy_cleanup(c.h);
  curl_slist_free_all(c.send_headers);
  curl_slist_free_all(c.poll_headers);
  return rc;
}
