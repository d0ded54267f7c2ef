/* Fuzz target for request bodies: idemd_parse_body, the three validators
 * (payment, order, refund), and the canonical form and fingerprint of docs/idempotency.md, section 2.3.
 * Properties: the parser and validators keep their contracts (exactly one of
 * result or error, errors shaped {field, message, code}); the canonical form
 * does not change when the object is rebuilt with its keys inserted in reverse
 * order (at every level) or dumped indented and parsed again, and
 * canonicalising the canonical text is a no-op; a validated command's canonical
 * text written directly (idemd_payment_canon, idemd_order_canon) is the same
 * bytes; its fingerprint equals that of its canonical text parsed again, that
 * text is itself a valid body giving the same command, and key order in the
 * body does not change it. */
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "idem/canon.h"
#include "server/validate.h"

#define DUMP_FLAGS (JSON_INDENT(3) | JSON_REAL_PRECISION(17) | JSON_ENCODE_ANY)

typedef int (*validator_fn)(const json_t *body, json_t **cmd, json_t **errors,
                            int64_t *total);

static int validate_payment(const json_t *body, json_t **cmd, json_t **errors,
                            int64_t *total) {
  *total = 0;
  return idemd_validate_payment(body, cmd, errors);
}

static int validate_refund(const json_t *body, json_t **cmd, json_t **errors,
                           int64_t *total) {
  *total = 0;
  return idemd_validate_refund(body, cmd, errors);
}

/* A deep copy of `v` whose objects get their keys inserted in reverse order
 * of `v`'s (jansson keeps insertion order, so iteration order changes). */
static json_t *reversed(const json_t *v) {
  if (json_is_object(v)) {
    size_t n = json_object_size(v), i = 0;
    const char **keys = calloc(n ? n : 1, sizeof *keys);
    json_t *out = json_object(), *child;
    const char *k;
    FUZZ_CHECK(keys && out, "out of memory");
    json_object_foreach((json_t *)v, k, child) keys[i++] = k;
    while (i-- > 0)
      FUZZ_CHECK(json_object_set_new(out, keys[i], reversed(json_object_get(v, keys[i]))) == 0,
                 "cannot rebuild key %s", keys[i]);
    free(keys);
    return out;
  }
  if (json_is_array(v)) {
    json_t *out = json_array(), *child;
    size_t i;
    FUZZ_CHECK(out != NULL, "out of memory");
    json_array_foreach(v, i, child) json_array_append_new(out, reversed(child));
    return out;
  }
  return json_deep_copy(v);
}

static char *canon(const json_t *v) {
  char *c = idem_canon_dump(v);
  FUZZ_CHECK(c != NULL, "idem_canon_dump failed");
  return c;
}

/* Parses text the canonical form produced (plain JSON, any value). */
static json_t *reparse(const char *text) {
  json_error_t err;
  json_t *v = json_loads(text, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &err);
  FUZZ_CHECK(v != NULL, "our own output does not parse (%s): %.300s", err.text, text);
  return v;
}

static void fingerprint(const char *op, const json_t *cmd, char hex[IDEM_FINGERPRINT_LEN]) {
  int rc = idem_fingerprint(op, cmd, hex);
  FUZZ_CHECK(rc == IDEM_OK && strlen(hex) == 64, "idem_fingerprint failed: %d", rc);
}

static void check_errors(const json_t *errors) {
  json_t *e;
  size_t i;
  FUZZ_CHECK(json_is_array(errors) && json_array_size(errors) > 0,
             "a failed validation without errors");
  json_array_foreach(errors, i, e) {
    FUZZ_CHECK(json_is_object(e) && json_object_size(e) == 3, "error %zu is not an object of 3",
               i);
    FUZZ_CHECK(json_is_string(json_object_get(e, "field")) &&
                   json_is_string(json_object_get(e, "message")) &&
                   json_is_string(json_object_get(e, "code")),
               "error %zu lacks field, message or code", i);
    FUZZ_CHECK(json_string_length(json_object_get(e, "message")) > 0 &&
                   json_string_length(json_object_get(e, "code")) > 0,
               "error %zu has an empty message or code", i);
  }
}

/* Runs one validator; returns the command (owned) or NULL. */
static json_t *run(validator_fn fn, const json_t *body, int64_t *total) {
  json_t *cmd = (json_t *)1, *errors = (json_t *)1;
  int rc = fn(body, &cmd, &errors, total);
  if (rc == 0) {
    FUZZ_CHECK(json_is_object(cmd) && errors == NULL, "success without a command");
    return cmd;
  }
  FUZZ_CHECK(rc == -1 && cmd == NULL, "failure %d with a command", rc);
  check_errors(errors);
  json_decref(errors);
  return NULL;
}

/* The command a valid payment body means, built from the body alone with
 * jansson (as the validator did before it filled a struct): an oracle for
 * idemd_payment_canon() that shares no code with it. */
static json_t *payment_from_body(const json_t *body) {
  const json_t *amount = json_object_get(body, "amount");
  const json_t *cur = json_object_get(body, "currency");
  const json_t *order = json_object_get(body, "order_id");
  json_int_t value = json_is_integer(amount) ? json_integer_value(amount)
                                             : strtoll(json_string_value(amount), NULL, 10);
  json_t *cmd = json_pack("{s:I, s:s}", "amount", value, "currency",
                          json_is_string(cur) ? json_string_value(cur) : "BRL");

  FUZZ_CHECK(cmd != NULL, "out of memory");
  if (json_is_string(order))
    json_object_set_new(cmd, "order_id", json_string(json_string_value(order)));
  return cmd;
}

/* `body` gave the payment command `cmd`: its fields are in range, and the
 * canonical text payments are fingerprinted by (written directly,
 * idemd_payment_canon()) is idem_canon_dump()'s of the command the body
 * means. */
static void check_payment_cmd(const json_t *body, const json_t *cmd) {
  json_t *amount = json_object_get(cmd, "amount"), *errors = NULL, *oracle;
  const char *cur = json_string_value(json_object_get(cmd, "currency"));
  idemd_payment_cmd_t direct;
  char text[IDEMD_PAYMENT_CANON_MAX], *want;
  size_t len;

  FUZZ_CHECK(json_is_integer(amount) && json_integer_value(amount) >= 1 &&
                 json_integer_value(amount) <= IDEMD_MAX_SAFE_INT,
             "payment amount out of range");
  FUZZ_CHECK(cur && strlen(cur) == 3 && strspn(cur, "ABCDEFGHIJKLMNOPQRSTUVWXYZ") == 3,
             "payment currency '%s'", cur ? cur : "(none)");
  FUZZ_CHECK(idemd_validate_payment_cmd(body, &direct, &errors) == 0 && errors == NULL,
             "the payment validators disagree");
  len = idemd_payment_canon(&direct, text);
  oracle = payment_from_body(body);
  want = canon(oracle);
  FUZZ_CHECK(len == strlen(want) && strcmp(text, want) == 0,
             "payment canonical text:\n  %.300s\n  %.300s", text, want);
  free(want);
  json_decref(oracle);
}

static void check_order_cmd(const json_t *cmd, int64_t total) {
  json_t *items = json_object_get(cmd, "items"), *it;
  int64_t sum = 0;
  size_t i;
  FUZZ_CHECK(json_is_array(items) && json_array_size(items) >= 1 &&
                 json_array_size(items) <= IDEMD_MAX_ITEMS,
             "order items");
  json_array_foreach(items, i, it) {
    int64_t q = json_integer_value(json_object_get(it, "quantity"));
    int64_t p = json_integer_value(json_object_get(it, "unit_price"));
    FUZZ_CHECK(q >= 1 && p >= 1, "item %zu: quantity %lld, unit_price %lld", i, (long long)q,
               (long long)p);
    sum += q * p;
    FUZZ_CHECK(sum <= IDEMD_MAX_SAFE_INT, "total beyond 2^53 - 1 accepted");
  }
  FUZZ_CHECK(sum == total, "total %lld, items sum to %lld", (long long)total, (long long)sum);
  /* Orders are fingerprinted by their canonical text written directly. */
  {
    size_t len = 0;
    char *direct = idemd_order_canon(cmd, &len), *want = canon(cmd);
    FUZZ_CHECK(direct != NULL && len == strlen(want) && strcmp(direct, want) == 0,
               "order canonical text:\n  %.300s\n  %.300s", direct ? direct : "(none)", want);
    free(direct);
    free(want);
  }
}

static void check_command(const char *op, validator_fn fn, const json_t *body) {
  char fp[IDEM_FINGERPRINT_LEN], fp2[IDEM_FINGERPRINT_LEN];
  int64_t total = -1, total2 = -1;
  json_t *cmd = run(fn, body, &total), *cmd2, *again, *rev = reversed(body);
  char *text;

  /* Key order in the body never changes the outcome. */
  cmd2 = run(fn, rev, &total2);
  json_decref(rev);
  FUZZ_CHECK((cmd == NULL) == (cmd2 == NULL), "%s: key order changed the validation", op);
  if (cmd == NULL)
    return;
  fingerprint(op, cmd, fp);
  fingerprint(op, cmd2, fp2);
  FUZZ_CHECK(strcmp(fp, fp2) == 0 && total == total2, "%s: key order changed the fingerprint",
             op);
  json_decref(cmd2);
  if (fn == validate_payment)
    check_payment_cmd(body, cmd);
  else if (fn == idemd_validate_order)
    check_order_cmd(cmd, total);

  /* The canonical text, parsed again, has the same fingerprint... */
  text = canon(cmd);
  again = reparse(text);
  fingerprint(op, again, fp2);
  FUZZ_CHECK(strcmp(fp, fp2) == 0, "%s: fingerprint changed through %s", op, text);
  json_decref(again);

  /* ...and, sent as a body, validates to the same command. */
  {
    const char *msg = NULL;
    int oor = 0;
    json_t *body2 = NULL;
    FUZZ_CHECK(idemd_parse_body(text, strlen(text), &body2, &oor, &msg) == 0,
               "%s: canonical command rejected as a body (%s): %s", op, msg, text);
    cmd2 = run(fn, body2, &total2);
    FUZZ_CHECK(cmd2 != NULL, "%s: canonical command fails validation: %s", op, text);
    fingerprint(op, cmd2, fp2);
    FUZZ_CHECK(strcmp(fp, fp2) == 0 && total == total2,
               "%s: canonical command validates to another fingerprint: %s", op, text);
    json_decref(cmd2);
    json_decref(body2);
  }
  free(text);
  json_decref(cmd);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  json_t *body = (json_t *)1, *copy;
  const char *msg = NULL;
  int out_of_range = -1;
  char *c, *c2, *dump;

  if (idemd_parse_body((const char *)data, size, &body, &out_of_range, &msg) != 0) {
    FUZZ_CHECK(body == NULL, "a rejected body with a result");
    FUZZ_CHECK(msg != NULL && msg[0] != '\0', "a rejected body without a message");
    return 0;
  }
  FUZZ_CHECK(json_is_object(body), "an accepted body that is not an object");
  FUZZ_CHECK(out_of_range == 0 || out_of_range == 1, "out_of_range is %d", out_of_range);

  c = canon(body);
  /* Stable under key order... */
  copy = reversed(body);
  c2 = canon(copy);
  FUZZ_CHECK(strcmp(c, c2) == 0, "key order changed the canonical form:\n  %.300s\n  %.300s", c,
             c2);
  free(c2);
  json_decref(copy);
  /* ...under whitespace... */
  dump = json_dumps(body, DUMP_FLAGS);
  FUZZ_CHECK(dump != NULL, "json_dumps failed");
  copy = reparse(dump);
  c2 = canon(copy);
  FUZZ_CHECK(strcmp(c, c2) == 0, "indentation changed the canonical form:\n  %.300s\n  %.300s",
             c, c2);
  free(c2);
  free(dump);
  json_decref(copy);
  /* ...and canonicalising the canonical text is a no-op. */
  copy = reparse(c);
  c2 = canon(copy);
  FUZZ_CHECK(strcmp(c, c2) == 0, "canonical form is not a fixed point:\n  %.300s\n  %.300s", c,
             c2);
  free(c2);
  json_decref(copy);
  free(c);

  check_command("create_payment", validate_payment, body);
  check_command("create_order", idemd_validate_order, body);
  check_command("create_refund", validate_refund, body);
  json_decref(body);
  return 0;
}
