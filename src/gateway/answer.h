/* An upstream answer as the gateway keeps it in an idempotency record
 * (docs/gateway.md, "What is kept and replayed"): status, the headers
 * that are replayed (Content-Type, Location and those named by
 * --replay-header; never Set-Cookie) and the body, in one JSON text that
 * either store holds whatever the bytes are. */
#ifndef IDEM_GATEWAY_ANSWER_H
#define IDEM_GATEWAY_ANSWER_H

#include <jansson.h>

#include "gateway/gateway.h"
#include "gateway/upstream.h"

/* Encodes the part of `a` that is replayed under `cfg` into `*out`
 * (malloc'd; the caller frees it): {"status":N,"headers":[[name,value],
 * ...],"body":"..."}, or "body_b64" for a body that is not UTF-8 text
 * without NUL bytes. Returns IDEM_OK or IDEM_ENOMEM. */
int gw_answer_encode(const gw_answer_t *a, const gw_config_t *cfg, char **out);

/* Decodes a text gw_answer_encode() made into `out` (zeroed first; free
 * it with gw_answer_free()). Returns IDEM_OK, IDEM_EINVAL for a text it
 * did not make, or IDEM_ENOMEM. */
int gw_answer_decode(const char *text, gw_answer_t *out);

/* Sets `len` bytes at `bytes` in the JSON object `doc` as "body" (UTF-8
 * text without NUL bytes) or "body_b64" (base64). IDEM_OK or IDEM_ENOMEM. */
int gw_body_put(json_t *doc, const char *bytes, size_t len);

/* Reads what gw_body_put() set into `*out` (malloc'd, NUL-terminated
 * after `*len` bytes). IDEM_OK, IDEM_EINVAL or IDEM_ENOMEM. */
int gw_body_get(const json_t *doc, char **out, size_t *len);

/* Makes a JSON answer of the gateway's own into `out` (to free with
 * gw_answer_free()): `status` with Content-Type application/json and
 * `body`. Returns IDEM_OK or IDEM_ENOMEM. */
int gw_answer_own(int status, const char *body, gw_answer_t *out);

/* The memory `a` and the extra header pairs `extra` (NULL-terminated,
 * may be NULL) take once made a response: the body, each header's name
 * and value, and a little for each header's bookkeeping. What the replay
 * cache charges for a kept replay (keyed.c): kept headers alone can
 * total 64 KiB. */
size_t gw_answer_bytes(const gw_answer_t *a, const char *const *extra);

#endif
