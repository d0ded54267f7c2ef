/* The idem client: sends one request with an Idempotency-Key over libcurl and
 * retries that same request, under that same key, until it has a final answer,
 * so that a lost response or a timeout never becomes a second charge
 * (docs/idempotency.md, section 2.4; docs/payments.md, "the client should"). */
#ifndef IDEM_CLIENT_H
#define IDEM_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "idem/error.h"
#include "idem/key.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How a call ended. 0 is a final 2xx answer; codes are only ever added at
 * the end of this list. */
#define IDEM_CLIENT_OUTCOME_MAP(X)                                                       \
  X(DONE, "final answer")                                                                \
  X(REJECTED, "answer not retried")                                                      \
  X(GAVE_UP, "gave up")                                                                  \
  X(PENDING, "still pending")                                                            \
  X(FAILED, "local failure")

typedef enum idem_client_outcome {
#define IDEM__CLIENT_OUTCOME_ENUM(name, text) IDEM_CLIENT_##name,
  IDEM_CLIENT_OUTCOME_MAP(IDEM__CLIENT_OUTCOME_ENUM)
#undef IDEM__CLIENT_OUTCOME_ENUM
  IDEM_CLIENT_OUTCOME_MAX_
} idem_client_outcome_t;

/* IDEM_CLIENT_DONE      a 2xx answer other than 202 (after a 202, the
 *                       answer to the request sent again once its Location
 *                       said the outcome is known);
 * IDEM_CLIENT_REJECTED  an answer that retrying cannot change: any 4xx but
 *                       408, 409 and 429 (402 declined, 422 invalid, ...),
 *                       or a 1xx/3xx;
 * IDEM_CLIENT_GAVE_UP   attempts or time ran out while the answers were
 *                       connection errors, timeouts, 5xx, 408, 409 or 429;
 * IDEM_CLIENT_PENDING   attempts or time ran out while the request's last
 *                       answer was 202: the outcome is not known yet; send
 *                       it again later with the same key (result.key);
 * IDEM_CLIENT_FAILED    a failure on this side that retrying cannot fix (a
 *                       URL or scheme curl refuses, a final answer over
 *                       max_response_bytes, out of memory); result.error.
 *                       For an answer over the cap, result.status is its
 *                       status (a 201 means the request took effect) and
 *                       result.body is NULL; one whose status is retried
 *                       (5xx, a proxy's error page) is retried. */

/* Returns a static text for `outcome` ("gave up"; "unknown outcome" for a
 * code outside the list). */
const char *idem_client_outcome_str(int outcome);

/* What a call is doing, for progress reports (opts.on_event). */
typedef enum idem_client_event_kind {
  IDEM_CLIENT_EVENT_ATTEMPT, /* the request itself was sent; its answer, or none */
  IDEM_CLIENT_EVENT_POLL,    /* a GET of a 202's Location; its answer, or none */
  IDEM_CLIENT_EVENT_WAIT     /* a wait begins, before the next attempt or poll */
} idem_client_event_kind_t;

typedef struct idem_client_event {
  idem_client_event_kind_t kind;
  int number; /* ATTEMPT, POLL: which one (from 1); WAIT: the one waited for */
  /* ATTEMPT and POLL: */
  const char *method; /* what was sent ("GET" for a poll) */
  const char *url;
  long status;       /* the answer's status; 0 when none came */
  const char *error; /* why there is no (usable) answer; "" when nothing went wrong */
  int64_t took_ms;   /* the exchange, connect included */
  /* WAIT: */
  int64_t wait_ms;
  int retry_after;  /* 1: as the answer's Retry-After said; 0: the backoff */
  int next_is_poll; /* 1: a poll follows; 0: an attempt */
} idem_client_event_t;

/* Called in the calling thread, during idem_client_request(); `ev` and its
 * strings live until the callback returns. */
typedef void idem_client_event_fn(const idem_client_event_t *ev, void *ctx);

/* Knobs of the retry loop. Fill with idem_client_opts_default(), then
 * change what you need. Times are milliseconds. */
typedef struct idem_client_opts {
  int max_attempts;           /* sends of the request itself, first included (8) */
  int64_t max_time_ms;        /* the whole call, waits included (30 000) */
  int64_t base_delay_ms;      /* backoff base (100) */
  int64_t max_delay_ms;       /* backoff cap (5 000) */
  int64_t attempt_timeout_ms; /* one exchange, connect included (10 000) */
  size_t max_response_bytes;  /* larger answers are IDEM_CLIENT_FAILED (1 MiB) */
  idem_client_event_fn *on_event; /* each attempt, poll and wait (NULL: none) */
  void *event_ctx;                /* passed to on_event */
} idem_client_opts_t;

/* Writes the defaults above to `opts`. */
void idem_client_opts_default(idem_client_opts_t *opts);

#define IDEM_CLIENT_HEADERS_MAX 64       /* extra header lines in one request */
#define IDEM_CLIENT_HEADER_LINE_MAX 8192 /* bytes of one of them */

/* One request. Strings are borrowed for the duration of the call. Zero
 * the fields you do not set (new ones are only ever added at the end). */
typedef struct idem_client_request {
  const char *method; /* "POST", "GET", ...: upper-case letters; NULL: "POST" */
  const char *url;    /* absolute http:// or https:// URL */
  const char *token;  /* sent as Authorization: Bearer TOKEN; NULL: none */
  const char *key;    /* Idempotency-Key; NULL: a new UUID v4 */
  const char *body;   /* JSON, sent with Content-Type: application/json;
                         NULL: no body */
  size_t body_len;    /* bytes of body (it may then hold NULs); 0: strlen(body) */
  /* Extra header lines "Name: value", NULL-terminated (NULL: none), sent
   * on every attempt and, but for Content-* ones, on the polls of a 202's
   * Location. One named as the client's own (Authorization, Content-Type,
   * Accept, User-Agent) replaces it; "Name:" with no value is sent empty.
   * At most IDEM_CLIENT_HEADERS_MAX lines of IDEM_CLIENT_HEADER_LINE_MAX
   * bytes; a name must be an HTTP token, a value free of control bytes but tabs,
   * and Idempotency-Key (that is `key`), Content-Length and
   * Transfer-Encoding (the client frames the body) are refused. */
  const char *const *headers;
} idem_client_request_t;

/* What a call did. Free with idem_client_result_free(). */
typedef struct idem_client_result {
  idem_client_outcome_t outcome;
  long status; /* the last HTTP status the request itself got (polls of
                  Location excluded); 0 when it never got one */
  char *body;  /* that answer's body, NUL-terminated (malloc'd; NULL
                  when there was none) */
  size_t body_len;
  char key[IDEM_KEY_MAX + 1]; /* the Idempotency-Key sent on every attempt */
  int attempts;               /* sends of the request itself */
  int polls;                  /* GETs of a 202's Location */
  char error[256];            /* the last transport failure or local error, "" if none */
  /* Of the answer that gave `status` (all 0/NULL when there was none): */
  int replayed;     /* 1 when it carried Idempotent-Replayed: true: the server
                       sent its stored answer again, nothing ran twice */
  char *location;   /* its Location header, as sent (malloc'd; NULL: none) */
  char *request_id; /* its X-Request-Id, the server's id for the log line
                       (malloc'd; NULL: none) */
} idem_client_result_t;

/* Sends `req` and retries it, the same method, URL, body and key, on
 * connection errors, timeouts, 5xx, 408, 409 and 429, waiting as the answer's
 * Retry-After says (seconds or an HTTP-date) or else a full-jitter backoff
 * (idem_client_backoff_ms), until `opts->max_attempts` sends or
 * `opts->max_time_ms` in all. Each exchange gets the smaller of
 * attempt_timeout_ms and the time left; a wait that would end past the
 * time limit ends the call instead (it never comes back early). A 202 is
 * followed: its Location (resolved against req->url, and only on the same
 * scheme, host and port, since it gets the token) is read with GET, with
 * the same waits, until the resource is final (a 200/201 whose "status" is
 * not "pending", or a 402); then the request is sent once more under the
 * same key (if max_attempts allows: else the call ends PENDING), which
 * makes the server replay its stored final answer. No wait follows the
 * last attempt. A 202
 * without a usable Location, or a Location that answers anything else, is
 * met by sending the request again. Other 4xx answers are never retried.
 * `opts` NULL means the defaults.
 *
 * Thread-safe: every call has its own curl handle and no state is shared.
 * The caller must have called curl_global_init() once, before any thread
 * calls this, and calls curl_global_cleanup() after the last call ends.
 *
 * opts->on_event, when set, is told of each attempt, poll and wait as it
 * happens (the idem command's --verbose).
 *
 * Returns IDEM_OK with `*out` filled (check out->outcome, then out->status);
 * the caller owns it and frees it with idem_client_result_free(). Returns
 * IDEM_EINVAL (no URL or not an http(s) one, a method, key or token that is
 * not a valid header value, an extra header refused as req->headers says,
 * max_attempts < 1, a time limit or max_response_bytes <= 0), IDEM_ENOMEM
 * or IDEM_ECRYPTO (no key could be generated) before anything was sent;
 * `*out` then holds nothing to free. */
IDEM_WARN_UNUSED int idem_client_request(const idem_client_request_t *req,
                                         const idem_client_opts_t *opts,
                                         idem_client_result_t *out);

/* Frees out->body, ->location and ->request_id and zeroes `*r`. NULL and
 * zeroed results are fine. */
void idem_client_result_free(idem_client_result_t *r);

#define IDEM_CLIENT_UUID_LEN 36

/* Writes a new random UUID version 4 (RFC 9562, lower-case hex,
 * "xxxxxxxx-xxxx-4xxx-Yxxx-xxxxxxxxxxxx") and a NUL to `out`, from the
 * CSPRNG. Returns IDEM_OK, or IDEM_ECRYPTO with `out` an empty string. */
IDEM_WARN_UNUSED int idem_client_new_key(char out[IDEM_CLIENT_UUID_LEN + 1]);

/* The wait before retry number `retry` (0 for the wait after the first
 * attempt): full jitter, `rnd` mapped onto [0, min(max_delay_ms,
 * base_delay_ms * 2^retry)] (both ends included; negative knobs count as
 * 0). Pure: pass random bits as `rnd`; the client uses the CSPRNG. */
int64_t idem_client_backoff_ms(const idem_client_opts_t *opts, int retry, uint64_t rnd);

/* Parses a Retry-After value: delta-seconds ("120", spaces around allowed)
 * or an HTTP-date ("Wed, 21 Oct 2015 07:28:00 GMT", as curl_getdate()
 * reads it), into milliseconds to wait from `now_ms` (wall clock, ms since
 * the epoch; a date in the past is 0; seconds beyond 10^9 count as 10^9).
 * Returns IDEM_OK with `*delay_ms` set, or IDEM_EINVAL (NULL, empty,
 * negative, fractional or unreadable) leaving it untouched. */
IDEM_WARN_UNUSED int idem_client_retry_after_ms(const char *value, int64_t now_ms,
                                                int64_t *delay_ms);

#ifdef __cplusplus
}
#endif
#endif
