/* Tests request body parsing (400 rules) and the payment and order
 * validators (422 rules) of docs/idempotency.md, sections 3.2 and 3.3. */
#include "server/validate.h"
#include "support.h"

#include <stdio.h>
#include <stdlib.h>

#include "idem/canon.h"

/* ---- idemd_parse_body ------------------------------------------------ */

#define MSG_OBJECT "request body must be a JSON object"
#define MSG_JSON "request body is not valid JSON"
#define MSG_DUP "request body has a duplicate key"
#define MSG_UTF8 "request body is not valid UTF-8"
#define MSG_NUL "request body contains a NUL character"
#define MSG_DEPTH "request body nests deeper than 32 levels"

static const char *const fixed_messages[] = {MSG_OBJECT, MSG_JSON, MSG_DUP,
                                             MSG_UTF8, MSG_NUL, MSG_DEPTH};

#define BODY_STRLEN ((size_t)-1)

struct parse_case {
  const char *name;
  const char *body;
  size_t len;
  const char *msg; /* NULL: accepted */
  int lossy;
};

#define ZEROS_10 "0000000000"
#define ZEROS_100                                                                        \
  ZEROS_10 ZEROS_10 ZEROS_10 ZEROS_10 ZEROS_10 ZEROS_10 ZEROS_10 ZEROS_10 ZEROS_10 ZEROS_10

static const struct parse_case parse_cases[] = {
    {"object", "{\"amount\":1}", BODY_STRLEN, NULL, 0},
    {"empty object", "{}", BODY_STRLEN, NULL, 0},
    {"blanks around", " \n\t{\"a\":1}\r\n ", BODY_STRLEN, NULL, 0},
    {"UTF-8 text", "{\"a\":\"caf\xc3\xa9 \xf0\x9f\x98\x80\"}", BODY_STRLEN, NULL, 0},
    {"integer overflow", "{\"amount\": 99999999999999999999}", BODY_STRLEN, NULL, 1},
    {"negative overflow", "{\"amount\": -99999999999999999999}", BODY_STRLEN, NULL, 1},

    {"empty", "", BODY_STRLEN, MSG_OBJECT, 0},
    {"blank", "   ", BODY_STRLEN, MSG_JSON, 0},
    {"not JSON", "amount=15990", BODY_STRLEN, MSG_JSON, 0},
    {"truncated", "{\"amount\":1", BODY_STRLEN, MSG_JSON, 0},
    {"single quotes", "{'amount':1}", BODY_STRLEN, MSG_JSON, 0},
    {"trailing comma", "{\"amount\":1,}", BODY_STRLEN, MSG_JSON, 0},
    {"trailing garbage", "{\"amount\":1} x", BODY_STRLEN, MSG_JSON, 0},
    {"two objects", "{\"amount\":1}{}", BODY_STRLEN, MSG_JSON, 0},
    {"trailing NUL byte", "{\"amount\":1}\0", 13, MSG_JSON, 0},
    {"byte order mark", "\xef\xbb\xbf{}", BODY_STRLEN, MSG_JSON, 0},
    {"real overflow", "{\"amount\":1e400}", BODY_STRLEN, NULL, 1},
    /* Past 64 characters a number is read whole too: the parser would call
     * it invalid JSON (400), not a number out of range (422). */
    {"long real overflow", "{\"amount\":1" ZEROS_100 ZEROS_100 ZEROS_100 ZEROS_100 ".5}",
     BODY_STRLEN, NULL, 1},
    {"long real in range", "{\"amount\":0." ZEROS_100 "1}", BODY_STRLEN, NULL, 0},
    {"array", "[{\"amount\":1}]", BODY_STRLEN, MSG_OBJECT, 0},
    {"empty array", "[]", BODY_STRLEN, MSG_OBJECT, 0},
    {"duplicate key", "{\"amount\":1,\"amount\":2}", BODY_STRLEN, MSG_DUP, 0},
    {"nested duplicate", "{\"a\":{\"b\":1,\"b\":1}}", BODY_STRLEN, MSG_DUP, 0},
    {"invalid UTF-8 value", "{\"a\":\"\xff\"}", BODY_STRLEN, MSG_UTF8, 0},
    {"truncated UTF-8", "{\"a\":\"\xc3\"}", BODY_STRLEN, MSG_UTF8, 0},
    {"overlong UTF-8", "{\"a\":\"\xc0\xaf\"}", BODY_STRLEN, MSG_UTF8, 0},
    {"invalid UTF-8 key", "{\"\xfe\":1}", BODY_STRLEN, MSG_UTF8, 0},
    {"escaped NUL", "{\"a\":\"x\\u0000y\"}", BODY_STRLEN, MSG_NUL, 0},
    {"escaped NUL in key", "{\"a\\u0000\":1}", BODY_STRLEN, MSG_NUL, 0},
};

static int is_fixed_message(const char *msg) {
  for (size_t i = 0; i < ARRAY_LEN(fixed_messages); i++)
    if (msg && strcmp(msg, fixed_messages[i]) == 0)
      return 1;
  return 0;
}

/* Runs idemd_parse_body and checks its postconditions for `want_msg`
 * (NULL: success). `want_lossy` -1 means either. */
static void check_parse(const char *name, const char *body, size_t len,
                        const char *want_msg, int want_lossy) {
  json_t *out = (json_t *)&out; /* not NULL: the call must set it */
  const char *msg = NULL;
  int lossy = -1;
  int rc = idemd_parse_body(body, len, &out, &lossy, &msg);

  if (want_msg == NULL) {
    if (rc != 0)
      fail_msg("case '%s': rejected with \"%s\"", name, msg);
    assert_true(json_is_object(out));
    if (lossy != want_lossy)
      fail_msg("case '%s': lossy %d, want %d", name, lossy, want_lossy);
    json_decref(out);
    return;
  }
  if (rc != -1)
    fail_msg("case '%s': accepted", name);
  assert_null(out);
  if (!is_fixed_message(msg))
    fail_msg("case '%s': message \"%s\" is not one of ours", name, msg);
  /* No parser wording ("line 1 column 5", "near ...") reaches a client. */
  for (const char *w = "line\0column\0position\0near\0jansson\0"; *w; w += strlen(w) + 1)
    if (strstr(msg, w))
      fail_msg("case '%s': message \"%s\" has parser wording", name, msg);
  if (strcmp(msg, want_msg) != 0)
    fail_msg("case '%s': message \"%s\", want \"%s\"", name, msg, want_msg);
  if (want_lossy >= 0 && lossy != want_lossy)
    fail_msg("case '%s': lossy %d, want %d", name, lossy, want_lossy);
}

static void test_parse_table(void **state) {
  (void)state;
  for (size_t i = 0; i < ARRAY_LEN(parse_cases); i++) {
    const struct parse_case *c = &parse_cases[i];
    size_t len = c->len == BODY_STRLEN ? strlen(c->body) : c->len;
    check_parse(c->name, c->body, len, c->msg, c->lossy);
  }
}

/* A string, a number or a literal at the top level is valid JSON, just not
 * an object: the client should be told so, not that its JSON is broken. */
static void test_parse_scalar_is_not_an_object(void **state) {
  static const struct parse_case cases[] = {
      {"string", "\"amount\"", BODY_STRLEN, MSG_OBJECT, 0},
      {"number", "15990", BODY_STRLEN, MSG_OBJECT, 0},
      {"null", "null", BODY_STRLEN, MSG_OBJECT, 0},
      {"true", "true", BODY_STRLEN, MSG_OBJECT, 0},
  };
  (void)state;
  for (size_t i = 0; i < ARRAY_LEN(cases); i++)
    check_parse(cases[i].name, cases[i].body, strlen(cases[i].body),
                cases[i].msg, cases[i].lossy);
}

/* Builds an object nested `depth` containers deep: `{"a":` then arrays
 * (or objects) down to an innermost container holding `leaf`. Returns a
 * static buffer, so a failing case leaks nothing. */
static const char *nested(int depth, int arrays, const char *leaf) {
  static char buf[6 * 5000 + 64];
  char *p = buf;
  assert_true((size_t)depth * 6 + strlen(leaf) + 8 < sizeof buf);
  p += sprintf(p, "{");
  for (int i = 1; i < depth; i++)
    p += sprintf(p, "%s", !arrays ? "\"a\":{" : i == 1 ? "\"a\":[" : "[");
  p += sprintf(p, "%s", leaf);
  for (int i = 1; i < depth; i++)
    *p++ = arrays ? ']' : '}';
  strcpy(p, "}");
  return buf;
}

struct depth_case {
  const char *name;
  int depth, arrays;
  const char *leaf;
  const char *msg;
};

static const struct depth_case depth_cases[] = {
    {"32 objects", 32, 0, "", NULL},
    {"33 objects", 33, 0, "", MSG_DEPTH},
    {"object and 31 arrays", 32, 1, "", NULL},
    {"object and 32 arrays", 33, 1, "", MSG_DEPTH},
    {"33 objects with a leaf", 33, 0, "\"b\":1", MSG_DEPTH},
    {"2000 levels", 2000, 1, "", MSG_DEPTH},
    {"5000 levels (beyond the parser's own limit)", 5000, 1, "", MSG_DEPTH},
    {"33 levels, broken within", 33, 1, "1,,", MSG_DEPTH},
    {"32 levels, broken within", 32, 1, "1,,", MSG_JSON},
};

static void test_parse_depth(void **state) {
  (void)state;
  for (size_t i = 0; i < ARRAY_LEN(depth_cases); i++) {
    const struct depth_case *c = &depth_cases[i];
    const char *body = nested(c->depth, c->arrays, c->leaf);
    check_parse(c->name, body, strlen(body), c->msg, 0);
  }
}

/* Nesting counts containers: 32 levels holding a number or a string is
 * still 32 levels, exactly like 32 levels holding nothing. */
static void test_parse_depth_with_scalar_leaf(void **state) {
  static const struct depth_case cases[] = {
      {"32 objects, number leaf", 32, 0, "\"b\":1", NULL},
      {"32 objects, string leaf", 32, 0, "\"b\":\"x\"", NULL},
      {"object and 31 arrays, number leaf", 32, 1, "1", NULL},
      /* Brackets within strings (after escaped quotes and backslashes
       * too) open nothing. */
      {"32 objects, a string of brackets", 32, 0,
       "\"b\":\"\\\\\\\"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[{{{{{{{{{{\"", NULL},
      {"object and 31 arrays, a string of brackets", 32, 1,
       "\"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\\\"{{{{\\\\\"", NULL},
  };
  (void)state;
  for (size_t i = 0; i < ARRAY_LEN(cases); i++) {
    const char *body = nested(cases[i].depth, cases[i].arrays, cases[i].leaf);
    check_parse(cases[i].name, body, strlen(body), cases[i].msg, 0);
  }
}

/* ---- validators ------------------------------------------------------- */

/* "field:code,field:code" for an errors array, checking the shape of each
 * entry on the way. The caller frees the result. */
static char *error_list(const json_t *errors) {
  size_t i, cap = 1;
  json_t *e;
  char *s;

  assert_true(json_is_array(errors));
  json_array_foreach(errors, i, e) {
    const char *field = json_string_value(json_object_get(e, "field"));
    const char *code = json_string_value(json_object_get(e, "code"));
    const char *message = json_string_value(json_object_get(e, "message"));
    assert_int_equal(json_object_size(e), 3);
    assert_non_null(field);
    assert_non_null(code);
    assert_non_null(message);
    assert_true(message[0] != '\0');
    cap += strlen(field) + strlen(code) + 2;
  }
  s = calloc(1, cap);
  assert_non_null(s);
  json_array_foreach(errors, i, e) {
    if (i > 0)
      strcat(s, ",");
    strcat(s, json_string_value(json_object_get(e, "field")));
    strcat(s, ":");
    strcat(s, json_string_value(json_object_get(e, "code")));
  }
  return s;
}

struct validate_case {
  const char *body;
  const char *errors; /* "field:code,..." or NULL when valid */
  const char *cmd;    /* canonical command when valid */
  int64_t total;      /* orders: the computed total */
};

/* Validates each case as `kind` and checks errors or command. */
static void run_validate_cases(const char *kind, const struct validate_case *cases,
                               size_t n) {
  for (size_t i = 0; i < n; i++) {
    const struct validate_case *c = &cases[i];
    json_t *cmd = (json_t *)&cmd, *errors = (json_t *)&errors;
    int64_t total = -1;
    int rc = validate_body(kind, c->body, &cmd, &errors, &total);

    if (c->errors != NULL) {
      char *got;
      if (rc != -1)
        fail_msg("%s accepted, want %s", c->body, c->errors);
      assert_null(cmd);
      got = error_list(errors);
      if (strcmp(got, c->errors) != 0)
        fail_msg("%s: errors %s, want %s", c->body, got, c->errors);
      free(got);
      json_decref(errors);
    } else {
      char *canon;
      if (rc != 0) {
        char *got = error_list(errors);
        fail_msg("%s rejected: %s", c->body, got);
      }
      assert_null(errors);
      canon = json_dumps(cmd, JSON_COMPACT | JSON_SORT_KEYS);
      if (strcmp(canon, c->cmd) != 0)
        fail_msg("%s: command %s, want %s", c->body, canon, c->cmd);
      if (strcmp(kind, "order") == 0 && total != c->total)
        fail_msg("%s: total %lld, want %lld", c->body, (long long)total,
                 (long long)c->total);
      free(canon);
      json_decref(cmd);
    }
  }
}

static const struct validate_case payment_cases[] = {
    {"{\"amount\":15990}", NULL, "{\"amount\":15990,\"currency\":\"BRL\"}", 0},
    {"{\"amount\":\"15990\",\"currency\":\"USD\"}", NULL,
     "{\"amount\":15990,\"currency\":\"USD\"}", 0},
    {"{\"amount\":1,\"currency\":\"BRL\",\"order_id\":\"ord_1\"}", NULL,
     "{\"amount\":1,\"currency\":\"BRL\",\"order_id\":\"ord_1\"}", 0},
    {"{\"amount\":9007199254740991}", NULL,
     "{\"amount\":9007199254740991,\"currency\":\"BRL\"}", 0},
    {"{\"amount\":\"9007199254740991\"}", NULL,
     "{\"amount\":9007199254740991,\"currency\":\"BRL\"}", 0},

    {"{}", "amount:required", NULL, 0},
    {"{\"currency\":\"BRL\"}", "amount:required", NULL, 0},
    {"{\"amount\":1.5}", "amount:not_integer", NULL, 0},
    {"{\"amount\":1.0}", "amount:not_integer", NULL, 0},
    {"{\"amount\":1e3}", "amount:not_integer", NULL, 0},
    {"{\"amount\":-5}", "amount:not_positive", NULL, 0},
    {"{\"amount\":0}", "amount:not_positive", NULL, 0},
    {"{\"amount\":\"0\"}", "amount:not_positive", NULL, 0},
    {"{\"amount\":\"100; DROP TABLE payments\"}", "amount:not_integer", NULL, 0},
    {"{\"amount\":\"\"}", "amount:not_integer", NULL, 0},
    {"{\"amount\":\"+5\"}", "amount:not_integer", NULL, 0},
    {"{\"amount\":\"-5\"}", "amount:not_integer", NULL, 0},
    {"{\"amount\":\" 5\"}", "amount:not_integer", NULL, 0},
    {"{\"amount\":\"5 \"}", "amount:not_integer", NULL, 0},
    {"{\"amount\":\"1.5\"}", "amount:not_integer", NULL, 0},
    {"{\"amount\":\"1e3\"}", "amount:not_integer", NULL, 0},
    {"{\"amount\":\"0x10\"}", "amount:not_integer", NULL, 0},
    {"{\"amount\":9007199254740992}", "amount:too_large", NULL, 0},
    {"{\"amount\":\"9007199254740992\"}", "amount:too_large", NULL, 0},
    {"{\"amount\":9223372036854775807}", "amount:too_large", NULL, 0},
    {"{\"amount\":\"99999999999999999999999999\"}", "amount:too_large", NULL, 0},
    /* Beyond the parser's integers: read lossily, still named. */
    {"{\"amount\":99999999999999999999}", "amount:too_large", NULL, 0},
    {"{\"amount\":-99999999999999999999}", "amount:not_positive", NULL, 0},
    {"{\"amount\":true}", "amount:invalid_type", NULL, 0},
    {"{\"amount\":[15990]}", "amount:invalid_type", NULL, 0},
    {"{\"amount\":{\"value\":15990}}", "amount:invalid_type", NULL, 0},
    {"{\"amount\":1,\"currency\":\"brl\"}", "currency:invalid_format", NULL, 0},
    {"{\"amount\":1,\"currency\":\"BR\"}", "currency:invalid_format", NULL, 0},
    {"{\"amount\":1,\"currency\":\"BRLL\"}", "currency:invalid_format", NULL, 0},
    {"{\"amount\":1,\"currency\":\"\"}", "currency:invalid_format", NULL, 0},
    {"{\"amount\":1,\"currency\":\"B1L\"}", "currency:invalid_format", NULL, 0},
    {"{\"amount\":1,\"currency\":\"\xc3\x89UR\"}", "currency:invalid_format", NULL, 0},
    {"{\"amount\":1,\"currency\":5}", "currency:invalid_type", NULL, 0},
    {"{\"amount\":1,\"order_id\":5}", "order_id:invalid_type", NULL, 0},
    {"{\"amount\":1,\"order_id\":\"\"}", "order_id:empty", NULL, 0},
    {"{\"amount\":1,\"order_id\":\"ord 1\"}", "order_id:invalid_format", NULL, 0},
    {"{\"amount\":1,\"foo\":1}", "foo:unknown_field", NULL, 0},
    {"{\"amount\":1,\"Amount\":1}", "Amount:unknown_field", NULL, 0},
    {"{\"amount\":1,\"status\":\"succeeded\",\"id\":\"pay_1\"}",
     "status:unknown_field,id:unknown_field", NULL, 0},
    /* Several bad fields at once: each is listed, in field order. */
    {"{\"amount\":-1,\"currency\":\"usd\",\"order_id\":7,\"x\":1}",
     "amount:not_positive,currency:invalid_format,order_id:invalid_type,"
     "x:unknown_field", NULL, 0},
    {"{\"currency\":5,\"order_id\":\"\"}",
     "amount:required,currency:invalid_type,order_id:empty", NULL, 0},
};

static void test_payment_table(void **state) {
  (void)state;
  run_validate_cases("payment", payment_cases, ARRAY_LEN(payment_cases));
}

/* order_id is limited to 255 characters. */
static void test_payment_order_id_length(void **state) {
  char body[400], want[400], id[257];
  const struct validate_case cases[] = {
      {body, NULL, want, 0},
  };
  const struct validate_case too_long[] = {
      {body, "order_id:too_long", NULL, 0},
  };
  (void)state;

  memset(id, 'o', 255);
  id[255] = '\0';
  snprintf(body, sizeof body, "{\"amount\":1,\"order_id\":\"%s\"}", id);
  snprintf(want, sizeof want, "{\"amount\":1,\"currency\":\"BRL\",\"order_id\":\"%s\"}", id);
  run_validate_cases("payment", cases, 1);
  strcat(id, "o");
  snprintf(body, sizeof body, "{\"amount\":1,\"order_id\":\"%s\"}", id);
  run_validate_cases("payment", too_long, 1);
}

#define ITEM_A "{\"sku\":\"A1\",\"quantity\":2,\"unit_price\":1000}"
#define ITEM_B "{\"sku\":\"B2\",\"quantity\":1,\"unit_price\":500}"
#define CANON_A "{\"quantity\":2,\"sku\":\"A1\",\"unit_price\":1000}"
#define CANON_B "{\"quantity\":1,\"sku\":\"B2\",\"unit_price\":500}"

static const struct validate_case order_cases[] = {
    {"{\"customer_id\":\"c1\",\"items\":[" ITEM_A "]}", NULL,
     "{\"currency\":\"BRL\",\"customer_id\":\"c1\",\"items\":[" CANON_A "]}", 2000},
    {"{\"customer_id\":\"c1\",\"items\":[" ITEM_A "," ITEM_B "],\"currency\":\"EUR\"}",
     NULL,
     "{\"currency\":\"EUR\",\"customer_id\":\"c1\",\"items\":[" CANON_A "," CANON_B "]}",
     2500},
    {"{\"customer_id\":\"c1\",\"items\":[{\"unit_price\":\"1000\",\"quantity\":\"2\","
     "\"sku\":\"A1\"}]}",
     NULL, "{\"currency\":\"BRL\",\"customer_id\":\"c1\",\"items\":[" CANON_A "]}", 2000},
    {"{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A\",\"quantity\":9007199254740991,"
     "\"unit_price\":1}]}",
     NULL,
     "{\"currency\":\"BRL\",\"customer_id\":\"c1\",\"items\":[{\"quantity\":"
     "9007199254740991,\"sku\":\"A\",\"unit_price\":1}]}",
     9007199254740991LL},

    {"{}", "customer_id:required,items:required", NULL, 0},
    {"{\"customer_id\":\"c1\"}", "items:required", NULL, 0},
    {"{\"customer_id\":\"c1\",\"items\":null}", "items:required", NULL, 0},
    {"{\"items\":[" ITEM_A "]}", "customer_id:required", NULL, 0},
    {"{\"customer_id\":5,\"items\":[" ITEM_A "]}", "customer_id:invalid_type", NULL, 0},
    {"{\"customer_id\":\"\",\"items\":[" ITEM_A "]}", "customer_id:empty", NULL, 0},
    {"{\"customer_id\":\"c 1\",\"items\":[" ITEM_A "]}", "customer_id:invalid_format",
     NULL, 0},
    {"{\"customer_id\":\"c1\",\"items\":[]}", "items:empty", NULL, 0},
    {"{\"customer_id\":\"c1\",\"items\":{}}", "items:invalid_type", NULL, 0},
    {"{\"customer_id\":\"c1\",\"items\":\"A1\"}", "items:invalid_type", NULL, 0},
    {"{\"customer_id\":\"c1\",\"items\":[1]}", "items[0]:invalid_type", NULL, 0},
    {"{\"customer_id\":\"c1\",\"items\":[" ITEM_A ",[]]}", "items[1]:invalid_type",
     NULL, 0},
    {"{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":0,"
     "\"unit_price\":1}]}",
     "items[0].quantity:not_positive", NULL, 0},
    {"{\"customer_id\":\"c1\",\"items\":[" ITEM_A ",{\"sku\":\"B2\",\"quantity\":1,"
     "\"unit_price\":1.5}]}",
     "items[1].unit_price:not_integer", NULL, 0},
    {"{\"customer_id\":\"c1\",\"items\":[{\"quantity\":1,\"unit_price\":1}]}",
     "items[0].sku:required", NULL, 0},
    {"{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"unit_price\":1}]}",
     "items[0].quantity:required", NULL, 0},
    {"{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":1}]}",
     "items[0].unit_price:required", NULL, 0},
    {"{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"\",\"quantity\":1,\"unit_price\":1}]}",
     "items[0].sku:empty", NULL, 0},
    {"{\"customer_id\":\"c1\",\"items\":[{\"sku\":7,\"quantity\":1,\"unit_price\":1}]}",
     "items[0].sku:invalid_type", NULL, 0},
    {"{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":1,"
     "\"unit_price\":1,\"color\":\"red\"}]}",
     "items[0].color:unknown_field", NULL, 0},
    {"{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":"
     "99999999999999999999,\"unit_price\":1}]}",
     "items[0].quantity:too_large", NULL, 0},
    {"{\"customer_id\":\"c1\",\"items\":[" ITEM_A "],\"currency\":\"eur\"}",
     "currency:invalid_format", NULL, 0},
    {"{\"customer_id\":\"c1\",\"items\":[" ITEM_A "],\"total\":2000}",
     "total:unknown_field", NULL, 0},
    /* The total must stay within 2^53 - 1: a line, or the sum of lines. */
    {"{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A\",\"quantity\":9007199254740991,"
     "\"unit_price\":2}]}",
     "items:too_large", NULL, 0},
    {"{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A\",\"quantity\":4503599627370496,"
     "\"unit_price\":1},{\"sku\":\"B\",\"quantity\":4503599627370496,\"unit_price\":1}]}",
     "items:too_large", NULL, 0},
    {"{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A\",\"quantity\":4294967296,"
     "\"unit_price\":4294967296}]}",
     "items:too_large", NULL, 0},
    /* Several at once, in field order. */
    {"{\"customer_id\":\"\",\"items\":[{\"sku\":\"A1\",\"quantity\":0,"
     "\"unit_price\":\"x\",\"color\":\"red\"}],\"currency\":\"eur\",\"note\":1}",
     "customer_id:empty,items[0].quantity:not_positive,"
     "items[0].unit_price:not_integer,items[0].color:unknown_field,"
     "currency:invalid_format,note:unknown_field",
     NULL, 0},
};

static void test_order_table(void **state) {
  (void)state;
  run_validate_cases("order", order_cases, ARRAY_LEN(order_cases));
}

/* Builds an order body with `n` copies of ITEM_B. */
static char *order_with_items(size_t n) {
  size_t cap = 64 + n * (sizeof ITEM_B + 1);
  char *s = malloc(cap), *p = s;
  assert_non_null(s);
  p += sprintf(p, "{\"customer_id\":\"c1\",\"items\":[");
  for (size_t i = 0; i < n; i++)
    p += sprintf(p, "%s%s", i ? "," : "", ITEM_B);
  strcpy(p, "]}");
  return s;
}

static void test_order_item_count(void **state) {
  char *body;
  json_t *cmd = NULL, *errors = NULL;
  int64_t total = 0;
  char *got;
  (void)state;

  body = order_with_items(IDEMD_MAX_ITEMS);
  assert_int_equal(validate_body("order", body, &cmd, &errors, &total), 0);
  assert_int_equal(json_array_size(json_object_get(cmd, "items")), IDEMD_MAX_ITEMS);
  assert_int_equal(total, 500 * IDEMD_MAX_ITEMS);
  json_decref(cmd);
  free(body);

  body = order_with_items(IDEMD_MAX_ITEMS + 1);
  assert_int_equal(validate_body("order", body, &cmd, &errors, &total), -1);
  got = error_list(errors);
  assert_string_equal(got, "items:too_many");
  free(got);
  json_decref(errors);
  free(body);
}

/* What prepare() in orders.c built before the order was written by hand:
 * json_pack() of the same fields, dumped with JSON_COMPACT. */
static char *order_with_jansson(const json_t *cmd, const char *id, int64_t total,
                                const char *created_at) {
  json_t *order = json_pack("{s:s, s:O, s:O, s:O, s:I, s:s, s:s}", "id", id,
                            "customer_id", json_object_get(cmd, "customer_id"), "items",
                            json_object_get(cmd, "items"), "currency",
                            json_object_get(cmd, "currency"), "total", (json_int_t)total,
                            "status", "created", "created_at", created_at);
  char *text = json_dumps(order, JSON_COMPACT);
  json_decref(order);
  return text;
}

/* The longest order text: a customer_id of 255 quotes, and the most items,
 * each with a sku of 64 characters that each need escaping and the
 * largest numbers whose total stays under 2^53. */
static char *worst_order(void) {
  char quotes[256], sku[65];
  json_t *items = json_array(), *v;
  char *text;

  memset(quotes, '"', 255);
  quotes[255] = '\0';
  for (int i = 0; i < 64; i++)
    sku[i] = i % 2 ? '\\' : '"';
  sku[64] = '\0';
  for (int i = 0; i < IDEMD_MAX_ITEMS; i++)
    json_array_append_new(items, json_pack("{s:s, s:I, s:I}", "sku", sku, "quantity",
                                           (json_int_t)9, "unit_price",
                                           (json_int_t)9999999999999LL));
  v = json_pack("{s:s, s:o}", "customer_id", quotes, "items", items);
  text = json_dumps(v, 0);
  json_decref(v);
  return text;
}

/* idemd_order_json() and idemd_order_canon() against jansson, for orders
 * of every shape the validator lets through: one item and the most, the
 * largest numbers, the longest identifiers, and every visible ASCII
 * character (quotes and backslashes among them) in the strings. */
static void test_order_json_matches_jansson(void **state) {
  char visible[96], customer[256], *bodies[5];
  size_t n = 0;
  (void)state;

  for (int c = 0x21; c < 0x7f; c++) /* visible ASCII, no space */
    visible[n++] = (char)c;
  visible[n] = '\0';
  memset(customer, 'c', 255);
  customer[255] = '\0';
  json_t *v = json_pack("{s:s, s:[{s:s, s:I, s:I}, {s:s, s:I, s:I}], s:s}", "customer_id",
                        visible, "items", "sku", "\"\\", "quantity", (json_int_t)1,
                        "unit_price", (json_int_t)1, "sku", "a\\\"b/c", "quantity",
                        (json_int_t)2, "unit_price", (json_int_t)3, "currency", "USD");
  bodies[0] = json_dumps(v, 0);
  json_decref(v);
  v = json_pack("{s:s, s:[{s:s, s:I, s:I}]}", "customer_id", customer, "items", "sku",
                "A1", "quantity", (json_int_t)1, "unit_price",
                (json_int_t)IDEMD_MAX_SAFE_INT);
  bodies[1] = json_dumps(v, 0);
  json_decref(v);
  bodies[2] = strdup("{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":2,"
                     "\"unit_price\":1000}],\"currency\":\"BRL\"}");
  bodies[3] = order_with_items(IDEMD_MAX_ITEMS);
  bodies[4] = worst_order();

  for (size_t i = 0; i < ARRAY_LEN(bodies); i++) {
    json_t *cmd = NULL, *errors = NULL;
    int64_t total = 0;
    char *got, *want;
    size_t len = 0;

    assert_non_null(bodies[i]);
    if (validate_body("order", bodies[i], &cmd, &errors, &total) != 0)
      fail_msg("%s rejected: %s", bodies[i], error_list(errors));
    got = idemd_order_json(cmd, "ord_01k8pdkllp0buf3vimcdvb0a", total,
                           "2026-12-01T18:24:59Z");
    want = order_with_jansson(cmd, "ord_01k8pdkllp0buf3vimcdvb0a", total,
                              "2026-12-01T18:24:59Z");
    assert_non_null(got);
    assert_non_null(want);
    assert_string_equal(got, want);
    free(got);
    free(want);
    got = idemd_order_canon(cmd, &len);
    want = idem_canon_dump(cmd);
    assert_non_null(got);
    assert_non_null(want);
    assert_string_equal(got, want);
    assert_int_equal(len, strlen(want));
    free(got);
    free(want);
    json_decref(cmd);
    free(bodies[i]);
  }
}

/* idemd_payment_canon() against idem_canon_dump() of the same command
 * built in jansson, for payments of every shape the validator lets
 * through: default and given currency, no order_id and the longest, the
 * largest amount, and every visible ASCII character in order_id. */
static void test_payment_canon_matches_jansson(void **state) {
  char visible[96], longest[IDEMD_ORDER_ID_MAX + 1], *bodies[5];
  size_t n = 0;
  (void)state;

  for (int c = 0x21; c < 0x7f; c++) /* visible ASCII, no space */
    visible[n++] = (char)c;
  visible[n] = '\0';
  memset(longest, '\\', IDEMD_ORDER_ID_MAX); /* each one escaped */
  longest[IDEMD_ORDER_ID_MAX] = '\0';
  json_t *v = json_pack("{s:I, s:s}", "amount", (json_int_t)1, "order_id", visible);
  bodies[0] = json_dumps(v, 0);
  json_decref(v);
  v = json_pack("{s:s, s:s, s:s}", "order_id", longest, "currency", "USD", "amount",
                "9007199254740991");
  bodies[1] = json_dumps(v, 0);
  json_decref(v);
  bodies[2] = strdup("{\"amount\":15990}");
  bodies[3] = strdup("{\"currency\":\"EUR\",\"order_id\":null,\"amount\":42}");
  bodies[4] = strdup("{\"order_id\":\"ord_01k8pdkllp0buf3vimcdvb0a\",\"amount\":\"7\"}");

  for (size_t i = 0; i < ARRAY_LEN(bodies); i++) {
    json_t *body, *cmd_json, *errors = NULL;
    idemd_payment_cmd_t cmd;
    char got[IDEMD_PAYMENT_CANON_MAX], *want;
    size_t len;

    assert_non_null(bodies[i]);
    body = json_loads(bodies[i], 0, NULL);
    assert_non_null(body);
    if (idemd_validate_payment_cmd(body, &cmd, &errors) != 0)
      fail_msg("%s rejected: %s", bodies[i], error_list(errors));
    assert_null(errors);
    len = idemd_payment_canon(&cmd, got);
    assert_int_equal(len, strlen(got));
    cmd_json = idemd_payment_cmd_json(&cmd);
    want = idem_canon_dump(cmd_json);
    assert_non_null(want);
    assert_string_equal(got, want);
    free(want);
    json_decref(cmd_json);
    json_decref(body);
    free(bodies[i]);
  }
}

/* Fingerprints of validated bodies, pinned: records stored by earlier
 * versions hold them, and a retry must match (computed with sha256sum of
 * the operation, a newline and the canonical text). */
static void test_fingerprints_pinned(void **state) {
  static const struct {
    const char *operation, *body, *fingerprint;
  } cases[] = {
      {"create_payment", "{\"amount\":15990}",
       "0ed6d96bd868f01812dfe68408794c86f288716fa92914970a1ec3df9fb3c9a9"},
      {"create_payment", "{\"order_id\":\"a\\\"b\\\\c/d\",\"currency\":\"USD\",\"amount\":1}",
       "76e177176d56292a1bd4c7e559c68d3347a43b0bac6a43fb9905dfca28825777"},
      {"create_payment", NULL, /* the largest amount, the longest order_id */
       "cf0af846ce7a8e914620e7adf610a04d57abea701a908b8c79656bec226a76cf"},
      {"create_order",
       "{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":2,"
       "\"unit_price\":1000},{\"unit_price\":5,\"quantity\":1,\"sku\":\"B\\\"2\"}]}",
       "f598058793aa422a9d4e949ef384262d63a245dc775b589c337e829ab655fd12"},
  };
  char longest[400];
  size_t n;
  (void)state;

  n = (size_t)snprintf(longest, sizeof longest,
                       "{\"amount\":\"9007199254740991\",\"order_id\":\"");
  memset(longest + n, 'o', IDEMD_ORDER_ID_MAX);
  strcpy(longest + n + IDEMD_ORDER_ID_MAX, "\"}");
  for (size_t i = 0; i < ARRAY_LEN(cases); i++) {
    json_t *body = json_loads(cases[i].body ? cases[i].body : longest, 0, NULL), *cmd;
    json_t *errors = NULL;
    char hex[IDEM_FINGERPRINT_LEN], *text;
    size_t len;
    int64_t total;

    assert_non_null(body);
    if (strcmp(cases[i].operation, "create_payment") == 0) {
      idemd_payment_cmd_t pay;
      char canon[IDEMD_PAYMENT_CANON_MAX];
      assert_int_equal(idemd_validate_payment_cmd(body, &pay, &errors), 0);
      len = idemd_payment_canon(&pay, canon);
      assert_int_equal(idem_fingerprint_text(cases[i].operation, canon, len, hex), IDEM_OK);
    } else {
      assert_int_equal(idemd_validate_order(body, &cmd, &errors, &total), 0);
      text = idemd_order_canon(cmd, &len);
      assert_non_null(text);
      assert_int_equal(idem_fingerprint_text(cases[i].operation, text, len, hex), IDEM_OK);
      free(text);
      json_decref(cmd);
    }
    if (strcmp(hex, cases[i].fingerprint) != 0)
      fail_msg("%s: fingerprint %s, want %s", cases[i].body ? cases[i].body : longest, hex,
               cases[i].fingerprint);
    json_decref(body);
  }
}

/* A rejected payment leaves no command behind. */
static void test_payment_cmd_rejected(void **state) {
  json_t *body = json_loads("{\"amount\":1,\"order_id\":\"ord 1\"}", 0, NULL);
  json_t *errors = NULL;
  idemd_payment_cmd_t cmd;
  (void)state;

  memset(&cmd, 'x', sizeof cmd);
  assert_int_equal(idemd_validate_payment_cmd(body, &cmd, &errors), -1);
  assert_non_null(errors);
  assert_int_equal(cmd.amount, 0);
  assert_string_equal(cmd.currency, "");
  assert_string_equal(cmd.order_id, "");
  json_decref(errors);
  json_decref(body);
}

/* Anything but an order command is refused, not written half. */
static void test_order_json_refuses_other_commands(void **state) {
  json_t *payment = json_pack("{s:I, s:s}", "amount", (json_int_t)1, "currency", "BRL");
  json_t *no_sku = json_pack("{s:s, s:[{s:I}], s:s}", "customer_id", "c1", "items",
                             "quantity", (json_int_t)1, "currency", "BRL");
  json_t *text_price = json_pack("{s:s, s:[{s:s, s:I, s:s}], s:s}", "customer_id", "c1",
                                 "items", "sku", "A1", "quantity", (json_int_t)1,
                                 "unit_price", "1", "currency", "BRL");
  size_t len;
  (void)state;
  assert_null(idemd_order_json(payment, "ord_1", 1, "2026-12-01T00:00:00Z"));
  assert_null(idemd_order_json(no_sku, "ord_1", 1, "2026-12-01T00:00:00Z"));
  assert_null(idemd_order_json(text_price, "ord_1", 1, "2026-12-01T00:00:00Z"));
  assert_null(idemd_order_canon(payment, &len));
  assert_null(idemd_order_canon(no_sku, &len));
  assert_null(idemd_order_canon(text_price, &len));
  json_decref(payment);
  json_decref(no_sku);
  json_decref(text_price);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parse_table),
      cmocka_unit_test(test_parse_scalar_is_not_an_object),
      cmocka_unit_test(test_parse_depth),
      cmocka_unit_test(test_parse_depth_with_scalar_leaf),
      cmocka_unit_test(test_payment_table),
      cmocka_unit_test(test_payment_order_id_length),
      cmocka_unit_test(test_order_table),
      cmocka_unit_test(test_order_item_count),
      cmocka_unit_test(test_order_json_matches_jansson),
      cmocka_unit_test(test_order_json_refuses_other_commands),
      cmocka_unit_test(test_payment_canon_matches_jansson),
      cmocka_unit_test(test_payment_cmd_rejected),
      cmocka_unit_test(test_fingerprints_pinned),
  };
  return cmocka_run_group_tests_name("validate", tests, NULL, NULL);
}
