/* The gateway's HTTP client to its upstream, on libcurl: kept-alive
 * connections, a deadline, and what became of each call, telling "nothing
 * was sent" from "sent, no answer" as the provider client does
 * (util/curl_sent.h; docs/gateway.md, "When the upstream does not
 * answer"). */
#ifndef IDEM_GATEWAY_UPSTREAM_H
#define IDEM_GATEWAY_UPSTREAM_H

#include <stddef.h>
#include <stdint.h>

typedef struct gw_upstream gw_upstream_t;

typedef enum gw_up_result {
  GW_UP_ANSWERED = 1, /* a whole answer, within the caps */
  GW_UP_NOT_SENT,     /* not one byte went out: safe to send again */
  GW_UP_NO_ANSWER,    /* sent, and no whole answer (timeout, connection lost) */
  GW_UP_TOO_LARGE     /* answered, but beyond the cap: not kept */
} gw_up_result_t;

/* One header, name and value as they came. */
typedef struct gw_header {
  char *name;
  char *value;
} gw_header_t;

/* An answer. Owned: free with gw_answer_free(). */
typedef struct gw_answer {
  int status;
  gw_header_t *headers;
  int nheaders;
  char *body; /* NUL-terminated after `len` bytes (NULL when empty) */
  size_t len;
} gw_answer_t;

/* One call: `target` is the path and query as the client sent them;
 * `headers` is a NULL-terminated list of "Name: value" lines sent as they
 * are (curl adds none of its own: Host comes from the list when it holds
 * one). Borrowed for the call. */
typedef struct gw_up_request {
  const char *method;
  const char *target;
  const char *const *headers;
  const char *body;
  size_t body_len;
  /* 1: never sent twice, not even by libcurl's own second try of a
   * request that a kept-alive connection dropped unanswered (a keyed
   * request, or one whose method is not idempotent, RFC 9110 9.2.2). */
  int once;
  /* When the key's lease runs out (the record's lease_expires_at, ms of
   * idem_now_ms()), or 0 for none: the call is sent only if it can end
   * before then, else it is GW_UP_NOT_SENT (gw_upstream_deadline()). */
  int64_t lease_expires_at;
} gw_up_request_t;

/* Kept between the end of a call's deadline and its lease's end: the
 * store's clock, libcurl's start after the check. */
#define GW_LEASE_SLACK_MS 250
/* --lease must exceed --upstream-timeout by at least this: a keyed
 * request waits in queues (the store's writer, the I/O thread) between
 * its reservation and its send (docs/gateway.md, "Flags"). */
#define GW_LEASE_MARGIN_MS 500

/* The deadline of a call of `timeout_ms` starting at `now_ms` under a
 * lease running out at `lease_expires_at` (0: none): `timeout_ms`, never
 * past the lease less GW_LEASE_SLACK_MS; or -1 when it could not end
 * before then, so it must not be sent (the same rule as idemd's provider
 * calls, idem_provider_call_may_start()): the key could be taken over
 * and sent again while this call goes on. */
int64_t gw_upstream_deadline(int64_t timeout_ms, int64_t lease_expires_at, int64_t now_ms);

/* Makes a client of `base_url` ("http://host:port", no trailing slash).
 * Answers over `max_answer` body bytes are GW_UP_TOO_LARGE. Returns NULL
 * when out of memory. Free with gw_upstream_free(). */
gw_upstream_t *gw_upstream_new(const char *base_url, int64_t connect_timeout_ms,
                               int64_t timeout_ms, size_t max_answer);

/* Frees the client and its kept connections. */
void gw_upstream_free(gw_upstream_t *u);

/* Sends `req` and fills `out` (zeroed first; free it with
 * gw_answer_free() whatever the result): its status, headers and body for
 * GW_UP_ANSWERED, the status alone for GW_UP_TOO_LARGE. Safe from many
 * threads at once. */
gw_up_result_t gw_upstream_call(gw_upstream_t *u, const gw_up_request_t *req,
                                gw_answer_t *out);

/* Where a streamed answer goes (gw_upstream_stream()). */
typedef struct gw_up_stream {
  /* Called once, at the first byte of the body, with the answer's status
   * and headers (its body empty). Returns 0 to go on, else the transfer
   * ends. */
  int (*on_head)(void *arg, const gw_answer_t *head);
  /* Called with each piece of the body as it comes; may wait (the
   * client's pace holds the upstream's back). Returns 0 to go on, else
   * the transfer ends. */
  int (*on_data)(void *arg, const char *data, size_t n);
  /* Optional: asked about once a second while the transfer goes on, even
   * when nothing comes; nonzero ends it, cut short (the gateway stops). */
  int (*cut)(void *arg);
  void *arg;
} gw_up_stream_t;

/* As gw_upstream_call(), the body passed to `sink` as it comes rather
 * than gathered, without a cap: the deadline is then on the upstream's
 * silence (no byte for the call's deadline), not on the whole. When
 * on_head() was called, returns GW_UP_ANSWERED for a whole answer passed
 * on and GW_UP_NO_ANSWER for one cut short; otherwise (an answer without
 * a body, or none) as gw_upstream_call(), `out` holding it. `out` is
 * zeroed first; free it with gw_answer_free(). */
gw_up_result_t gw_upstream_stream(gw_upstream_t *u, const gw_up_request_t *req,
                                  const gw_up_stream_t *sink, gw_answer_t *out);

/* One call without a waiting thread (gw_upstream_submit()). The caller
 * owns it: sets `req` (borrowed until `done`), `done` and `arg`, and
 * keeps it until `done` is called. */
typedef struct gw_up_call gw_up_call_t;
struct gw_up_call {
  gw_up_request_t req;
  /* Called once, on the I/O thread, when the call is over: `result` and
   * `answer` (as gw_upstream_call() fills it; the caller frees it) are
   * set. It must not wait: the I/O thread runs every call. */
  void (*done)(gw_up_call_t *call);
  void *arg;
  gw_up_result_t result;
  gw_answer_t answer;
  /* The client's own while the call goes on. */
  gw_up_call_t *next_;
  void *priv_;
};

/* Starts the I/O thread of `u` (one), which runs the calls given to
 * gw_upstream_submit() at once on libcurl's multi interface, with the
 * same deadline, caps, kept-alive connections and results as
 * gw_upstream_call(). Returns 0, or -1 when it cannot. */
int gw_upstream_loop_start(gw_upstream_t *u);

/* Hands `call` to the I/O thread. Returns 0: `call->done` follows once
 * (it may run before this returns); -1, with nothing sent and `done` not
 * to be called, when there is no I/O thread or it is stopping. Safe from
 * any thread. */
int gw_upstream_submit(gw_upstream_t *u, gw_up_call_t *call);

/* Stops the I/O thread: new calls are refused, the calls under way end
 * (each within its deadline, `done` called), then the thread is joined.
 * The loop's memory stays: gw_upstream_submit() may still be called (and
 * refuses) until gw_upstream_free(), which frees it. Without an I/O
 * thread, nothing; a second call, nothing. gw_upstream_free() does it
 * too. */
void gw_upstream_loop_stop(gw_upstream_t *u);

/* Frees what `a` owns and zeroes it. */
void gw_answer_free(gw_answer_t *a);

/* 1 when `name` is a hop-by-hop header of RFC 9110, section 7.6.1
 * (Connection, Proxy-Connection, Keep-Alive, TE, Transfer-Encoding,
 * Upgrade), or is named in the `connection` header value (may be NULL):
 * a proxy never forwards those. */
int gw_hop_by_hop(const char *name, const char *connection);

/* 1 when a request header may be passed on (docs/gateway.md, "What the
 * gateway refuses"): `name` a token of RFC 9110 (section 5.6.2), `value`
 * without a control byte other than HTAB (no CR, LF, NUL or DEL: a bare
 * CR would end the line at the upstream and smuggle another request).
 * Bytes 0x80-0xFF (obs-text) pass. */
int gw_header_ok(const char *name, const char *value);

/* 1 when `target` is a request-target the gateway sends on: it starts
 * with '/', holds only bytes 0x21-0x7E and no '#', and its path (before
 * any '?') has no dot segment ("." or "..", also percent-encoded): the
 * upstream would resolve one to another path than the routes see. */
int gw_target_ok(const char *target);

#endif
