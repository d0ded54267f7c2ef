/* JSON log lines for requests and events. */
#include "server/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

#include "idem/clock.h"
#include "idem/crypto.h"

static int min_level = 1;

static int level_of(const char *name) {
  static const char *const names[] = {"debug", "info", "warn", "error"};
  for (int i = 0; i < 4; i++)
    if (strcmp(name, names[i]) == 0)
      return i;
  return 3;
}

void idemd_log_set_level(const char *level) { min_level = level_of(level); }

static void timestamp(char *out, size_t len) {
  struct timeval tv;
  struct tm tm;
  char base[24];
  gettimeofday(&tv, NULL);
  gmtime_r(&tv.tv_sec, &tm);
  strftime(base, sizeof base, "%Y-%m-%dT%H:%M:%S", &tm);
  snprintf(out, len, "%.20s.%03dZ", base, (int)(tv.tv_usec / 1000) % 1000);
}

static void emit(json_t *line) {
  char *text = json_dumps(line, JSON_COMPACT | JSON_REAL_PRECISION(6));
  if (text) {
    size_t n = strlen(text);
    text[n] = '\n'; /* json_dumps leaves room for the NUL we replace */
    fwrite(text, 1, n + 1, stderr);
    free(text);
  }
  json_decref(line);
}

void idemd_log_event(const char *level, const char *msg, ...) {
  char ts[40];
  json_t *line;
  va_list ap;
  const char *k;

  if (level_of(level) < min_level)
    return;
  timestamp(ts, sizeof ts);
  line = json_pack("{s:s, s:s, s:s}", "ts", ts, "level", level, "msg", msg);
  if (line == NULL)
    return;
  va_start(ap, msg);
  while ((k = va_arg(ap, const char *)) != NULL) {
    const char *v = va_arg(ap, const char *);
    if (v != NULL)
      json_object_set_new(line, k, json_string(v));
  }
  va_end(ap);
  emit(line);
}

void idemd_key_id(const idemd_request_t *r, const char *operation) {
  idemd_request_t *w = (idemd_request_t *)r;
  unsigned char mac[IDEM_SHA256_LEN];
  char hex[IDEM_SHA256_HEX_LEN];
  char msg[32 + IDEM_OPERATION_MAX + IDEM_KEY_MAX];
  int n = snprintf(msg, sizeof msg, "%lld\n%s\n%s", (long long)r->tenant.id,
                   operation, r->key);

  w->key_id[0] = '\0';
  if (n < 0 || idem_hmac_sha256(r->srv->log_secret, sizeof r->srv->log_secret,
                                msg, (size_t)n, mac) != IDEM_OK)
    return;
  idem_hex(mac, 8, hex);
  memcpy(w->key_id, hex, 17);
}

void idemd_log_request(const idemd_request_t *r) {
  char ts[40];
  json_t *line;

  if (min_level > 1)
    return;
  timestamp(ts, sizeof ts);
  line = json_pack("{s:s, s:s, s:s, s:s, s:s, s:s, s:s, s:i, s:f}", "ts", ts,
                   "level", "info", "msg", "request", "request_id",
                   r->request_id, "method", r->method ? r->method : "",
                   "operation", idemd_op_name(r->op), "outcome",
                   idemd_outcome_name(r->outcome), "status", r->status,
                   "latency_ms",
                   (double)(idem_mono_us() - r->start_us) / 1000.0);
  if (line == NULL)
    return;
  json_object_set_new(line, "path", json_string(r->path));
  if (r->authenticated)
    json_object_set_new(line, "tenant", json_string(r->tenant.name));
  if (r->key_id[0])
    json_object_set_new(line, "key_id", json_string(r->key_id));
  if (r->aborted)
    json_object_set_new(line, "aborted", json_true());
  emit(line);
}
