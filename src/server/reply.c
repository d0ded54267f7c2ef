/* HTTP answers of idemd: JSON bodies, common headers, error shapes. */
#include "server/reply.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/log.h"

enum MHD_Result idemd_reply(idemd_request_t *r, int status, const char *body,
                            size_t len, const idemd_reply_headers_t *h) {
  struct MHD_Response *resp;
  enum MHD_Result ret;
  char num[24];

  resp = MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
  if (resp == NULL)
    return MHD_NO;
  MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE,
                          h && h->content_type ? h->content_type
                                               : "application/json");
  MHD_add_response_header(resp, "X-Request-Id", r->request_id);
  if (atomic_load(&r->srv->draining) || (h && h->close))
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
  if (h) {
    if (h->location && h->location[0])
      MHD_add_response_header(resp, MHD_HTTP_HEADER_LOCATION, h->location);
    if (h->replayed)
      MHD_add_response_header(resp, "Idempotent-Replayed", "true");
    if (h->retry_after > 0) {
      snprintf(num, sizeof num, "%d", h->retry_after);
      MHD_add_response_header(resp, MHD_HTTP_HEADER_RETRY_AFTER, num);
    }
    if (h->allow)
      MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, h->allow);
    if (h->www_authenticate)
      MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
  }
  idemd_guard_busy(r->srv->guard, r->conn_guard, 1);
  r->status = status;
  r->responded = 1;
  if (r->may_block || r->stash) {
    /* Off the event thread: only it may queue; it does on resume. */
    r->response = resp;
    return MHD_YES;
  }
  ret = MHD_queue_response(r->conn, (unsigned)status, resp);
  MHD_destroy_response(resp);
  return ret;
}

enum MHD_Result idemd_reply_json(idemd_request_t *r, int status, json_t *value,
                                 const idemd_reply_headers_t *h) {
  char *text = value ? json_dumps(value, JSON_COMPACT) : NULL;
  enum MHD_Result ret;
  json_decref(value);
  if (text == NULL)
    return idemd_reply(r, 500, "{\"error\":\"internal error\"}", 26, NULL);
  ret = idemd_reply(r, status, text, strlen(text), h);
  free(text);
  return ret;
}

enum MHD_Result idemd_reply_error(idemd_request_t *r, int status,
                                  const char *message,
                                  const idemd_reply_headers_t *h) {
  return idemd_reply_json(r, status, json_pack("{s:s}", "error", message), h);
}

enum MHD_Result idemd_reply_errors(idemd_request_t *r, json_t *errors) {
  return idemd_reply_json(r, 422, json_pack("{s:o}", "errors", errors), NULL);
}

enum MHD_Result idemd_reply_store_error(idemd_request_t *r, int err) {
  return idemd_reply_store_failure(r, err, idem_store_last_error());
}

enum MHD_Result idemd_reply_store_failure(idemd_request_t *r, int err,
                                          const char *detail) {
  idemd_reply_headers_t h = {.retry_after = 1};
  atomic_fetch_add_explicit(&r->srv->metrics.store_errors, 1, memory_order_relaxed);
  idemd_log_event("error", "store failure", "error", idem_err_name(err),
                  "detail", detail ? detail : "", "request_id", r->request_id, NULL);
  r->outcome = OUTCOME_ERROR;
  return idemd_reply_error(r, 503, "service temporarily unavailable, retry later", &h);
}

char *idemd_mark_replayed(const char *body) {
  static const char field[] = "\"replayed\":true";
  size_t len, end;
  char *out;
  int empty;

  if (body == NULL)
    return NULL;
  len = strlen(body);
  end = len;
  while (end > 0 && (body[end - 1] == ' ' || body[end - 1] == '\n'))
    end--;
  if (end < 2 || body[0] != '{' || body[end - 1] != '}')
    return NULL;
  empty = strspn(body + 1, " \n") == end - 2;
  out = malloc(end + sizeof field + 1);
  if (out == NULL)
    return NULL;
  memcpy(out, body, end - 1);
  len = end - 1;
  if (!empty)
    out[len++] = ',';
  memcpy(out + len, field, sizeof field - 1);
  len += sizeof field - 1;
  out[len++] = '}';
  out[len] = '\0';
  return out;
}
