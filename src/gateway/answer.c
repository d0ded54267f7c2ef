/* The stored form of an upstream answer (gateway/answer.h). */
#include "gateway/answer.h"

#include <jansson.h>
#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* Whether the answer header `name` is kept and replayed. */
static int replayed_header(const gw_config_t *cfg, const char *name) {
  if (strcasecmp(name, "Set-Cookie") == 0)
    return 0;
  if (strcasecmp(name, "Content-Type") == 0 || strcasecmp(name, "Location") == 0)
    return 1;
  for (int i = 0; i < cfg->nreplay_headers; i++)
    if (strcasecmp(name, cfg->replay_headers[i]) == 0)
      return 1;
  return 0;
}

int gw_body_put(json_t *doc, const char *bytes, size_t len) {
  const char *field = "body";
  json_t *v = NULL;
  char *b64;
  int n;

  if (len == 0)
    v = json_string("");
  else if (memchr(bytes, '\0', len) == NULL)
    v = json_stringn(bytes, len); /* NULL unless UTF-8 text */
  if (v == NULL && len > 0) {
    field = "body_b64";
    if (len > (size_t)INT32_MAX / 2 || (b64 = malloc(4 * ((len + 2) / 3) + 1)) == NULL)
      return IDEM_ENOMEM;
    n = EVP_EncodeBlock((unsigned char *)b64, (const unsigned char *)bytes, (int)len);
    v = json_stringn(b64, (size_t)n);
    free(b64);
  }
  return v && json_object_set_new(doc, field, v) == 0 ? IDEM_OK : IDEM_ENOMEM;
}

/* A kept header: [name, value], or [name, {"body_b64": ...}] for a value
 * that is not UTF-8 (an upstream may send any bytes), as a body is kept;
 * NULL when out of memory. */
static json_t *header_of(const char *name, const char *value) {
  json_t *v = json_string(value), *b64;
  if (v == NULL) {
    if ((b64 = json_object()) == NULL || gw_body_put(b64, value, strlen(value)) != IDEM_OK) {
      json_decref(b64);
      return NULL;
    }
    v = b64;
  }
  return json_pack("[so]", name, v);
}

int gw_answer_encode(const gw_answer_t *a, const gw_config_t *cfg, char **out) {
  json_t *doc = json_object(), *hs = json_array();
  int ok = doc && hs;

  *out = NULL;
  for (int i = 0; ok && i < a->nheaders; i++)
    if (replayed_header(cfg, a->headers[i].name))
      ok = json_array_append_new(hs, header_of(a->headers[i].name, a->headers[i].value)) == 0;
  if (ok && gw_body_put(doc, a->body, a->len) == IDEM_OK &&
      json_object_set_new(doc, "status", json_integer(a->status)) == 0 &&
      json_object_set(doc, "headers", hs) == 0)
    *out = json_dumps(doc, JSON_COMPACT);
  json_decref(hs);
  json_decref(doc);
  return *out ? IDEM_OK : IDEM_ENOMEM;
}

static int add_header(gw_answer_t *out, const char *name, const char *value) {
  gw_header_t *h = realloc(out->headers, (size_t)(out->nheaders + 1) * sizeof *h);
  if (h == NULL)
    return IDEM_ENOMEM;
  out->headers = h;
  h[out->nheaders].name = strdup(name);
  h[out->nheaders].value = strdup(value);
  out->nheaders++;
  return h[out->nheaders - 1].name && h[out->nheaders - 1].value ? IDEM_OK : IDEM_ENOMEM;
}

static int set_body(char **out, size_t *out_len, const char *bytes, size_t len) {
  if ((*out = malloc(len + 1)) == NULL)
    return IDEM_ENOMEM;
  memcpy(*out, bytes, len);
  (*out)[len] = '\0';
  *out_len = len;
  return IDEM_OK;
}

static int set_body_b64(char **out, size_t *out_len, const char *b64, size_t len) {
  int n;
  if (len % 4 != 0 || len > (size_t)INT32_MAX || (*out = malloc(len / 4 * 3 + 1)) == NULL)
    return len % 4 != 0 ? IDEM_EINVAL : IDEM_ENOMEM;
  n = EVP_DecodeBlock((unsigned char *)*out, (const unsigned char *)b64, (int)len);
  if (n < 0)
    return IDEM_EINVAL;
  /* EVP_DecodeBlock counts the padding as zero bytes. */
  for (size_t i = len; i > 0 && b64[i - 1] == '=' && n > 0; i--)
    n--;
  *out_len = (size_t)n;
  (*out)[n] = '\0';
  return IDEM_OK;
}

int gw_body_get(const json_t *doc, char **out, size_t *len) {
  json_t *body = json_object_get(doc, "body");
  json_t *b64 = json_object_get(doc, "body_b64");
  *out = NULL;
  *len = 0;
  if (json_is_string(body))
    return set_body(out, len, json_string_value(body), json_string_length(body));
  if (json_is_string(b64))
    return set_body_b64(out, len, json_string_value(b64), json_string_length(b64));
  return IDEM_EINVAL;
}

int gw_answer_decode(const char *text, gw_answer_t *out) {
  json_t *doc = json_loads(text ? text : "", 0, NULL);
  json_t *hs = json_object_get(doc, "headers");
  json_t *h;
  size_t i;
  int rc = IDEM_OK;

  memset(out, 0, sizeof *out);
  if (!json_is_integer(json_object_get(doc, "status")) || !json_is_array(hs)) {
    json_decref(doc);
    return IDEM_EINVAL;
  }
  out->status = (int)json_integer_value(json_object_get(doc, "status"));
  json_array_foreach(hs, i, h) {
    const char *name = json_string_value(json_array_get(h, 0));
    const char *value = json_string_value(json_array_get(h, 1));
    char *bytes = NULL;
    size_t len;
    if (rc == IDEM_OK && name && value == NULL && json_is_object(json_array_get(h, 1)) &&
        gw_body_get(json_array_get(h, 1), &bytes, &len) == IDEM_OK &&
        strlen(bytes) == len)
      value = bytes;
    if (rc == IDEM_OK && name && value)
      rc = add_header(out, name, value);
    free(bytes);
  }
  if (rc == IDEM_OK)
    rc = gw_body_get(doc, &out->body, &out->len);
  json_decref(doc);
  if (rc != IDEM_OK)
    gw_answer_free(out);
  return rc;
}

int gw_answer_own(int status, const char *body, gw_answer_t *out) {
  int rc;
  memset(out, 0, sizeof *out);
  out->status = status;
  rc = add_header(out, "Content-Type", "application/json");
  if (rc == IDEM_OK)
    rc = set_body(&out->body, &out->len, body, strlen(body));
  if (rc != IDEM_OK)
    gw_answer_free(out);
  return rc;
}

size_t gw_answer_bytes(const gw_answer_t *a, const char *const *extra) {
  /* libmicrohttpd's header entry (list links, kind, lengths) and the
   * response's own struct, roughly. */
  size_t n = a->len + 256;
  for (int i = 0; i < a->nheaders; i++)
    n += strlen(a->headers[i].name) + strlen(a->headers[i].value) + 64;
  for (const char *const *e = extra; e && e[0] && e[1]; e += 2)
    n += strlen(e[0]) + strlen(e[1]) + 64;
  return n;
}
