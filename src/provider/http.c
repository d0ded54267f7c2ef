/* The HTTP provider client on libcurl: POST /charges and POST /refunds
 * under the provider idempotency key, GET /charges/{key} and GET
 * /refunds/{key} for the reconciler, charges and refunds through the same
 * two calls. Each POST also names the payment or refund as its merchant
 * reference; for a provider that ignores keys the lookups go by it, GET
 * /charges?reference= and GET /refunds?reference= (docs/payments.md,
 * "Providers that ignore idempotency keys"). The mapping from transport events to outcomes is the point of
 * this file: only a failure that certainly happened before the request
 * left us is NOT_SENT; anything after that (timeout, 5xx, a dropped
 * connection) is UNKNOWN, because the provider may have charged (or
 * refunded). */
#include "provider/provider.h"
#include "util/curl_sent.h"

#include <curl/curl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ANSWER (64 * 1024)

typedef struct http_provider {
  idem_provider_t base;
  char *base_url;
  long connect_timeout_ms;
  long timeout_ms;
  int idempotent; /* 0: the provider ignores keys; look up by reference */
  pthread_key_t handle_key; /* one CURL handle per thread, kept alive */
} http_provider_t;

struct answer {
  char buf[MAX_ANSWER + 1];
  size_t len;
};

static size_t on_data(char *data, size_t size, size_t n, void *arg) {
  struct answer *a = arg;
  size_t len = size * n;
  size_t room = MAX_ANSWER - a->len;
  memcpy(a->buf + a->len, data, len < room ? len : room);
  a->len += len < room ? len : room;
  a->buf[a->len] = '\0';
  return len;
}

static void free_handle(void *h) { curl_easy_cleanup(h); }

/* This thread's handle, reset for a new request (connections are kept). */
static CURL *handle(http_provider_t *p) {
  CURL *c = pthread_getspecific(p->handle_key);
  if (c == NULL) {
    if ((c = curl_easy_init()) == NULL)
      return NULL;
    pthread_setspecific(p->handle_key, c);
  } else {
    curl_easy_reset(c);
  }
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, p->connect_timeout_ms);
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, p->timeout_ms);
  curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 0L);
  return c;
}

/* Reads {"id","status"} of a charge or refund: SUCCEEDED or DECLINED with
 * the id as reference; UNKNOWN when the body is not what one looks like. */
static void read_charge_json(const json_t *v, idem_charge_result_t *out) {
  const char *status = json_string_value(json_object_get(v, "status"));
  const char *id = json_string_value(json_object_get(v, "id"));

  out->outcome = IDEM_CHARGE_UNKNOWN;
  if (status && strcmp(status, "succeeded") == 0)
    out->outcome = IDEM_CHARGE_SUCCEEDED;
  else if (status && strcmp(status, "declined") == 0)
    out->outcome = IDEM_CHARGE_DECLINED;
  if (id && out->outcome != IDEM_CHARGE_UNKNOWN)
    snprintf(out->reference, sizeof out->reference, "%s", id);
}

static void read_charge(const struct answer *a, idem_charge_result_t *out) {
  json_t *v = json_loadb(a->buf, a->len, 0, NULL);
  read_charge_json(v, out);
  json_decref(v);
}

/* POSTs `body` (JSON) to base_url + `path` under Idempotency-Key `key`
 * and fills `out`: 200, 201 or 402 with a charge's (or refund's) body is
 * its outcome (402 is DECLINED whatever the body), any other answer is
 * UNKNOWN, and a failed transfer is NOT_SENT only when
 * idem__curl_nothing_sent(). */
static void post_keyed(http_provider_t *p, const char *path, const char *key,
                       const char *body, idem_charge_result_t *out) {
  struct answer *a = calloc(1, sizeof *a);
  struct curl_slist *hdrs = NULL;
  char url[512], key_header[300];
  CURL *c = handle(p);
  CURLcode rc;
  long code = 0;

  out->outcome = IDEM_CHARGE_NOT_SENT;
  out->reference[0] = '\0';
  if (c == NULL || a == NULL || body == NULL) {
    free(a);
    return;
  }
  snprintf(url, sizeof url, "%s%s", p->base_url, path);
  snprintf(key_header, sizeof key_header, "Idempotency-Key: %s", key);
  hdrs = curl_slist_append(hdrs, "Content-Type: application/json");
  hdrs = curl_slist_append(hdrs, key_header);
  hdrs = curl_slist_append(hdrs, "Expect:");
  curl_easy_setopt(c, CURLOPT_URL, url);
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdrs);
  curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
  /* libcurl sends a request again, by itself, when a kept-alive connection
   * it reused closes unanswered (see nothing_sent()). Under one key that
   * is harmless; to a provider that ignores keys it is a second charge, so
   * then every POST goes on a connection of its own. */
  if (!p->idempotent)
    curl_easy_setopt(c, CURLOPT_FRESH_CONNECT, 1L);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, a);

  rc = curl_easy_perform(c);
  if (rc != CURLE_OK) {
    out->outcome = idem__curl_nothing_sent(c) ? IDEM_CHARGE_NOT_SENT : IDEM_CHARGE_UNKNOWN;
  } else {
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    if (code == 200 || code == 201 || code == 402)
      read_charge(a, out);
    else
      out->outcome = IDEM_CHARGE_UNKNOWN; /* 5xx, or an answer we do not understand */
    if (code == 402 && out->outcome == IDEM_CHARGE_UNKNOWN)
      out->outcome = IDEM_CHARGE_DECLINED;
  }
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, NULL);
  curl_slist_free_all(hdrs);
  free(a);
}

/* Reads {"<list>": [charge, ...]}, what was made under one reference:
 * none is NOT_FOUND; a succeeded one (the first, should a provider have
 * made two) SUCCEEDED; else, all declined, DECLINED (the last one's
 * reference); anything else UNKNOWN. */
static void read_list(const struct answer *a, const char *list,
                      idem_charge_result_t *out) {
  json_t *v = json_loadb(a->buf, a->len, 0, NULL);
  json_t *items = json_object_get(v, list), *item;
  idem_charge_result_t one;
  size_t i;

  out->outcome = IDEM_CHARGE_UNKNOWN;
  if (json_is_array(items)) {
    out->outcome = IDEM_CHARGE_NOT_FOUND;
    json_array_foreach(items, i, item) {
      memset(&one, 0, sizeof one);
      read_charge_json(item, &one);
      if (one.outcome == IDEM_CHARGE_UNKNOWN) {
        out->outcome = IDEM_CHARGE_UNKNOWN; /* one we cannot read: cannot tell */
        break;
      }
      if (out->outcome != IDEM_CHARGE_SUCCEEDED)
        *out = one;
    }
  }
  if (out->outcome == IDEM_CHARGE_UNKNOWN || out->outcome == IDEM_CHARGE_NOT_FOUND)
    out->reference[0] = '\0';
  json_decref(v);
}

/* GETs base_url + `prefix` + the escaped `key` and fills `out`: 200 with a
 * charge's (or refund's) body is its outcome, 404 NOT_FOUND, anything else
 * UNKNOWN. With `list` (the prefix is then "/charges?reference=" or the
 * like), the 200's body is that list, read by read_list(). */
static void get_keyed(http_provider_t *p, const char *prefix, const char *key,
                      const char *list, idem_charge_result_t *out) {
  struct answer *a = calloc(1, sizeof *a);
  char url[1024];
  CURL *c = handle(p);
  char *escaped;
  long code = 0;

  out->outcome = IDEM_CHARGE_UNKNOWN;
  out->reference[0] = '\0';
  if (c == NULL || a == NULL) {
    free(a);
    return;
  }
  escaped = curl_easy_escape(c, key, 0);
  snprintf(url, sizeof url, "%s%s%s", p->base_url, prefix, escaped ? escaped : "");
  curl_free(escaped);
  curl_easy_setopt(c, CURLOPT_URL, url);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, a);
  if (curl_easy_perform(c) == CURLE_OK) {
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    if (code == 200 && list)
      read_list(a, list, out);
    else if (code == 200)
      read_charge(a, out);
    else if (code == 404 && list == NULL)
      out->outcome = IDEM_CHARGE_NOT_FOUND;
  }
  free(a);
}

/* The merchant reference is the provider key: the payment's id. */
static void http_charge(idem_provider_t *base, const idem_charge_t *ch,
                        idem_charge_result_t *out) {
  json_t *v = json_pack("{s:I, s:s, s:s}", "amount", (json_int_t)ch->amount, "currency",
                        ch->currency, "reference", ch->provider_key);
  char *body = v ? json_dumps(v, JSON_COMPACT) : NULL;

  json_decref(v);
  /* Out of memory before anything was sent: NOT_SENT. */
  post_keyed((http_provider_t *)base, "/charges", ch->provider_key, body, out);
  free(body);
}

static void http_lookup(idem_provider_t *base, const idem_charge_t *ch,
                        idem_charge_result_t *out) {
  http_provider_t *p = (http_provider_t *)base;
  if (p->idempotent)
    get_keyed(p, "/charges/", ch->provider_key, NULL, out);
  else
    get_keyed(p, "/charges?reference=", ch->provider_key, "charges", out);
}

/* The refund's currency is not sent: a provider refunds in the charge's
 * currency (tools/psp/README.md, POST /refunds). */
static void http_refund(idem_provider_t *base, const idem_refund_req_t *r,
                        idem_charge_result_t *out) {
  json_t *v = json_pack("{s:s, s:I, s:s}", "charge", r->charge_key, "amount",
                        (json_int_t)r->amount, "reference", r->provider_key);
  char *body = v ? json_dumps(v, JSON_COMPACT) : NULL;

  json_decref(v);
  /* Out of memory before anything was sent: NOT_SENT. */
  post_keyed((http_provider_t *)base, "/refunds", r->provider_key, body, out);
  free(body);
}

static void http_refund_lookup(idem_provider_t *base, const idem_refund_req_t *r,
                               idem_charge_result_t *out) {
  http_provider_t *p = (http_provider_t *)base;
  if (p->idempotent)
    get_keyed(p, "/refunds/", r->provider_key, NULL, out);
  else
    get_keyed(p, "/refunds?reference=", r->provider_key, "refunds", out);
}

static void http_close(idem_provider_t *base) {
  http_provider_t *p = (http_provider_t *)base;
  CURL *c = pthread_getspecific(p->handle_key);
  if (c) {
    pthread_setspecific(p->handle_key, NULL);
    curl_easy_cleanup(c);
  }
  /* Handles of threads still alive are freed when those threads exit. */
  pthread_key_delete(p->handle_key);
  free(p->base_url);
  free(p);
}

idem_provider_t *idem_http_provider_new(const char *base_url,
                                        int64_t connect_timeout_ms,
                                        int64_t timeout_ms, int idempotent) {
  http_provider_t *p;
  size_t len;

  if (strncmp(base_url, "http://", 7) != 0 && strncmp(base_url, "https://", 8) != 0)
    return NULL;
  if ((p = calloc(1, sizeof *p)) == NULL)
    return NULL;
  if ((p->base_url = strdup(base_url)) == NULL ||
      pthread_key_create(&p->handle_key, free_handle) != 0) {
    free(p->base_url);
    free(p);
    return NULL;
  }
  len = strlen(p->base_url);
  while (len > 0 && p->base_url[len - 1] == '/')
    p->base_url[--len] = '\0';
  p->base.name = "http";
  p->base.charge = http_charge;
  p->base.lookup = http_lookup;
  p->base.refund = http_refund;
  p->base.refund_lookup = http_refund_lookup;
  p->base.close = http_close;
  p->connect_timeout_ms = (long)connect_timeout_ms;
  p->timeout_ms = (long)timeout_ms;
  p->idempotent = idempotent;
  return &p->base;
}
