/* Fuzz target for the gateway's parsers (src/gateway/, docs/gateway.md):
 * the stored forms of answers and requests, and route specs. The first
 * byte picks one; the rest is the input. Properties: any bytes kept as an
 * answer's or a request's body come back byte for byte, with the status,
 * method and target; a stored text this code did not make is refused or
 * decodes to something that encodes and decodes to itself; an accepted
 * route has an upper-case method and an operation that fits a record, and
 * matches its own pattern with each parameter filled in. */
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "gateway/answer.h"
#include "gateway/gateway.h"
#include "gateway/requests.h"

static char *text_of(const uint8_t *data, size_t size) {
  char *t = malloc(size + 1);
  FUZZ_CHECK(t != NULL, "out of memory");
  memcpy(t, data, size);
  t[size] = '\0';
  return t;
}

/* Any bytes as an answer's body survive the stored form. */
static void answer_bytes(const uint8_t *data, size_t size) {
  gw_config_t cfg;
  gw_header_t h = {"Content-Type", "application/octet-stream"};
  gw_answer_t a = {.status = 201, .headers = &h, .nheaders = 1, .body = (char *)data,
                   .len = size};
  gw_answer_t back;
  char *text = NULL;

  gw_config_defaults(&cfg);
  FUZZ_CHECK(gw_answer_encode(&a, &cfg, &text) == IDEM_OK, "encode failed");
  FUZZ_CHECK(gw_answer_decode(text, &back) == IDEM_OK, "decode of own text failed: %s", text);
  FUZZ_CHECK(back.status == 201 && back.len == size &&
                 (size == 0 || memcmp(back.body, data, size) == 0),
             "body changed (%zu bytes)", size);
  FUZZ_CHECK(back.nheaders == 1, "headers changed");
  gw_answer_free(&back);
  free(text);
}

/* A stored text from anywhere: refused, or stable through a round trip. */
static void answer_text(const uint8_t *data, size_t size) {
  char *t = text_of(data, size);
  gw_config_t cfg;
  gw_answer_t a, b;
  char *again = NULL;

  gw_config_defaults(&cfg);
  cfg.nreplay_headers = 0;
  if (gw_answer_decode(t, &a) == IDEM_OK) {
    FUZZ_CHECK(gw_answer_encode(&a, &cfg, &again) == IDEM_OK, "encode failed");
    FUZZ_CHECK(gw_answer_decode(again, &b) == IDEM_OK, "own text refused: %s", again);
    FUZZ_CHECK(a.status == b.status && a.len == b.len &&
                   (a.len == 0 || memcmp(a.body, b.body, a.len) == 0),
               "round trip changed the answer");
    gw_answer_free(&b);
    gw_answer_free(&a);
    free(again);
  }
  free(t);
}

/* Any bytes as a request's body, and a target, survive the stored form. */
static void request_bytes(const uint8_t *data, size_t size) {
  char *lines[] = {"Idempotency-Key: k", NULL};
  char *text = gw_request_encode("POST", "/orders?a=1", lines, (const char *)data, size);
  char *method, *target, *body, **headers;
  size_t len;

  FUZZ_CHECK(text != NULL, "encode failed");
  FUZZ_CHECK(gw_request_decode(text, &method, &target, &headers, &body, &len) == IDEM_OK,
             "decode of own text failed");
  FUZZ_CHECK(strcmp(method, "POST") == 0 && strcmp(target, "/orders?a=1") == 0 &&
                 strcmp(headers[0], lines[0]) == 0 && headers[1] == NULL,
             "request line or headers changed");
  FUZZ_CHECK(len == size && (size == 0 || memcmp(body, data, size) == 0), "body changed");
  free(headers[0]);
  free(headers);
  free(method);
  free(target);
  free(body);
  free(text);
}

static void route(const uint8_t *data, size_t size) {
  char *spec = text_of(data, size);
  gw_config_t cfg;
  char path[GW_PATTERN_MAX * 2 + 1];
  size_t n = 0;

  gw_config_defaults(&cfg);
  if (strlen(spec) == size && gw_route_parse(spec, &cfg.routes[0]) == 0) {
    const gw_route_t *r = &cfg.routes[0];
    cfg.nroutes = 1;
    for (const char *m = r->method; *m; m++)
      FUZZ_CHECK(*m >= 'A' && *m <= 'Z', "method '%s'", r->method);
    FUZZ_CHECK(strlen(r->operation) <= IDEM_OPERATION_MAX, "operation too long");
    /* The pattern with each {name} filled in matches it. */
    for (const char *p = r->pattern; *p && n + 2 < sizeof path;) {
      if (*p == '{') {
        path[n++] = 'v';
        p = strchr(p, '}') + 1;
      } else {
        path[n++] = *p++;
      }
    }
    path[n] = '\0';
    FUZZ_CHECK(gw_route_match(&cfg, r->method, path) == r, "'%s' does not match '%s'", path,
               spec);
  }
  free(spec);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0)
    return 0;
  switch (data[0] % 4) {
  case 0:
    answer_bytes(data + 1, size - 1);
    break;
  case 1:
    answer_text(data + 1, size - 1);
    break;
  case 2:
    request_bytes(data + 1, size - 1);
    break;
  default:
    route(data + 1, size - 1);
    break;
  }
  return 0;
}
