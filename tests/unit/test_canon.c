/* Tests canonical JSON and request fingerprints, alone and end to end through
 * the payment and order validators (docs/idempotency.md, section 2.3). */
#include "server/validate.h"
#include "support.h"

#include <stdlib.h>

#include "idem/canon.h"
#include "idem/crypto.h"

/* Non-ASCII is escaped as jansson writes it, with upper-case hex: these
 * bytes feed every fingerprint, so they are pinned exactly. */
struct dump_case {
  const char *input;
  const char *want;
};

static const struct dump_case dump_cases[] = {
    {"{}", "{}"},
    {"[]", "[]"},
    {"{\"b\":1,\"a\":2}", "{\"a\":2,\"b\":1}"},
    {" { \"a\" : [ 1 , 2 ,\n 3 ] ,\t\"c\" : null } ", "{\"a\":[1,2,3],\"c\":null}"},
    {"[3, 1, 2]", "[3,1,2]"},
    {"{\"z\":{\"y\":1,\"x\":{\"b\":true,\"a\":false}},\"a\":\"s\"}",
     "{\"a\":\"s\",\"z\":{\"x\":{\"a\":false,\"b\":true},\"y\":1}}"},
    {"{\"l\":[{\"d\":1,\"c\":2},{\"b\":3,\"a\":4}]}",
     "{\"l\":[{\"c\":2,\"d\":1},{\"a\":4,\"b\":3}]}"},
    /* Bytewise key order: upper case, then '_', then lower case. */
    {"{\"a\":3,\"_\":2,\"B\":1,\"aa\":4,\"A\":0}",
     "{\"A\":0,\"B\":1,\"_\":2,\"a\":3,\"aa\":4}"},
    {"{\"k\":\"caf\xc3\xa9\"}", "{\"k\":\"caf\\u00E9\"}"},
    {"{\"k\":\"\\u00e9\"}", "{\"k\":\"\\u00E9\"}"},
    {"{\"k\":\"\xf0\x9f\x98\x80\"}", "{\"k\":\"\\uD83D\\uDE00\"}"},
    {"{\"\xc3\xa9\":1,\"e\":2}", "{\"e\":2,\"\\u00E9\":1}"},
    {"{\"s\":\"a\\\"b\\\\c\\n\\u0001\"}", "{\"s\":\"a\\\"b\\\\c\\n\\u0001\"}"},
    {"{\"n\":-15990,\"m\":9007199254740991}",
     "{\"m\":9007199254740991,\"n\":-15990}"},
};

/* Canonicalises `text` and returns the malloc'd result. */
static char *canon_of(const char *text) {
  json_t *v = load_json(text);
  char *out = idem_canon_dump(v);
  json_decref(v);
  assert_non_null(out);
  return out;
}

static void test_dump_table(void **state) {
  (void)state;
  for (size_t i = 0; i < ARRAY_LEN(dump_cases); i++) {
    char *got = canon_of(dump_cases[i].input);
    if (strcmp(got, dump_cases[i].want) != 0)
      fail_msg("canon(%s) = %s, want %s", dump_cases[i].input, got,
               dump_cases[i].want);
    free(got);
  }
}

static void test_dump_is_a_fixed_point(void **state) {
  (void)state;
  for (size_t i = 0; i < ARRAY_LEN(dump_cases); i++) {
    char *once = canon_of(dump_cases[i].input);
    char *twice = canon_of(once);
    assert_string_equal(twice, once);
    free(once);
    free(twice);
  }
}

/* Each group lists spellings of one value; other groups differ. */
static const char *const spellings[][3] = {
    {"{\"amount\":15990,\"currency\":\"BRL\"}",
     "{\"currency\":\"BRL\",\"amount\":15990}",
     " {\n\t\"currency\" : \"BRL\" ,  \"amount\":15990 }\n"},
    {"{\"a\":{\"x\":1,\"y\":[1,{\"q\":1,\"p\":2}]}}",
     "{\"a\":{\"y\":[1,{\"p\":2,\"q\":1}],\"x\":1}}",
     "{ \"a\" : { \"y\" : [ 1 , { \"p\" : 2 , \"q\" : 1 } ] , \"x\" : 1 } }"},
    {"{\"k\":\"\xc3\xa9\"}", "{\"k\":\"\\u00e9\"}", "{\"k\":\"\\u00E9\"}"},
    /* Neighbours of the groups above: each must differ from them. */
    {"{\"amount\":15990,\"currency\":\"brl\"}", NULL, NULL},
    {"{\"amount\":\"15990\",\"currency\":\"BRL\"}", NULL, NULL},
    {"{\"a\":{\"x\":1,\"y\":[{\"q\":1,\"p\":2},1]}}", NULL, NULL},
};

static void test_dump_stable_across_spellings(void **state) {
  (void)state;
  for (size_t g = 0; g < ARRAY_LEN(spellings); g++) {
    char *first = canon_of(spellings[g][0]);
    for (size_t s = 1; s < 3 && spellings[g][s]; s++) {
      char *other = canon_of(spellings[g][s]);
      if (strcmp(first, other) != 0)
        fail_msg("%s and %s canonicalise differently: %s vs %s",
                 spellings[g][0], spellings[g][s], first, other);
      free(other);
    }
    for (size_t h = 0; h < g; h++) {
      char *earlier = canon_of(spellings[h][0]);
      if (strcmp(first, earlier) == 0)
        fail_msg("%s and %s canonicalise alike", spellings[g][0],
                 spellings[h][0]);
      free(earlier);
    }
    free(first);
  }
}

static void test_dump_null(void **state) {
  (void)state;
  assert_null(idem_canon_dump(NULL));
}

/* Fingerprints `text` under `operation`, checking the hex format. */
static void fingerprint_of(const char *operation, const char *text,
                           char hex[IDEM_FINGERPRINT_LEN]) {
  json_t *v = load_json(text);
  int rc = idem_fingerprint(operation, v, hex);
  json_decref(v);
  assert_int_equal(rc, IDEM_OK);
  assert_int_equal(strlen(hex), 64);
  assert_int_equal(strspn(hex, "0123456789abcdef"), 64);
}

static void test_fingerprint_definition(void **state) {
  /* sha256 of "create_payment\n{\"amount\":15990,\"currency\":\"BRL\"}",
   * computed with sha256sum. */
  static const char want[] =
      "0ed6d96bd868f01812dfe68408794c86f288716fa92914970a1ec3df9fb3c9a9";
  char hex[IDEM_FINGERPRINT_LEN];
  (void)state;

  fingerprint_of("create_payment", "{\"currency\":\"BRL\",\"amount\":15990}", hex);
  assert_string_equal(hex, want);
}

static void test_fingerprint_operation_and_command(void **state) {
  char pay[IDEM_FINGERPRINT_LEN], pay2[IDEM_FINGERPRINT_LEN];
  char order[IDEM_FINGERPRINT_LEN], other[IDEM_FINGERPRINT_LEN];
  (void)state;

  fingerprint_of("create_payment", "{\"amount\":15990,\"currency\":\"BRL\"}", pay);
  fingerprint_of("create_payment", " {\"currency\": \"BRL\", \"amount\": 15990} ", pay2);
  fingerprint_of("create_order", "{\"amount\":15990,\"currency\":\"BRL\"}", order);
  fingerprint_of("create_payment", "{\"amount\":15991,\"currency\":\"BRL\"}", other);
  assert_string_equal(pay, pay2);
  assert_string_not_equal(pay, order);
  assert_string_not_equal(pay, other);
}

/* The hex SHA-256 of `operation`, a newline and `canon`, computed here. */
static void reference_fingerprint(const char *operation, const char *canon,
                                  char hex[IDEM_FINGERPRINT_LEN]) {
  size_t oplen = strlen(operation), len = strlen(canon);
  char *buf = malloc(oplen + 1 + len);
  unsigned char digest[IDEM_SHA256_LEN];

  assert_non_null(buf);
  memcpy(buf, operation, oplen);
  buf[oplen] = '\n';
  memcpy(buf + oplen + 1, canon, len);
  assert_int_equal(idem_sha256(buf, oplen + 1 + len, digest), IDEM_OK);
  idem_hex(digest, sizeof digest, hex);
  free(buf);
}

/* The fingerprint of canonical text, whether it fits idem_fingerprint_text()'s
 * 2,048-byte stack buffer or not, and the same as idem_fingerprint()'s. */
static void test_fingerprint_text(void **state) {
  static const char want[] =
      "0ed6d96bd868f01812dfe68408794c86f288716fa92914970a1ec3df9fb3c9a9";
  static const char text[] = "{\"amount\":15990,\"currency\":\"BRL\"}";
  char hex[IDEM_FINGERPRINT_LEN], expect[IDEM_FINGERPRINT_LEN], via_json[IDEM_FINGERPRINT_LEN];
  (void)state;

  assert_int_equal(idem_fingerprint_text("create_payment", text, strlen(text), hex), IDEM_OK);
  assert_string_equal(hex, want);
  /* Only `len` bytes count. */
  assert_int_equal(idem_fingerprint_text("create_payment",
                                         "{\"amount\":15990,\"currency\":\"BRL\"}xyz",
                                         strlen(text), hex),
                   IDEM_OK);
  assert_string_equal(hex, want);

  /* "create_order", a newline and {"customer_id":"..."} of k characters
   * take 13 + 18 + k bytes: 2,048 at k = 2,017; and far beyond. */
  static const size_t sizes[] = {2015, 2016, 2017, 2018, 2019, 5000};
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
    size_t k = sizes[i];
    char *id = malloc(k + 1), *canon;
    json_t *v;

    assert_non_null(id);
    memset(id, 'b', k);
    id[k] = '\0';
    v = json_pack("{s:s}", "customer_id", id);
    canon = idem_canon_dump(v);
    assert_non_null(canon);
    assert_int_equal(strlen(canon), 18 + k);
    reference_fingerprint("create_order", canon, expect);
    assert_int_equal(idem_fingerprint_text("create_order", canon, strlen(canon), hex), IDEM_OK);
    assert_string_equal(hex, expect);
    assert_int_equal(idem_fingerprint("create_order", v, via_json), IDEM_OK);
    assert_string_equal(via_json, expect);
    free(canon);
    json_decref(v);
    free(id);
  }

  memset(hex, 'x', sizeof hex);
  assert_int_equal(idem_fingerprint_text(NULL, text, strlen(text), hex), IDEM_EINVAL);
  assert_string_equal(hex, "");
  memset(hex, 'x', sizeof hex);
  assert_int_equal(idem_fingerprint_text("create_payment", NULL, 0, hex), IDEM_EINVAL);
  assert_string_equal(hex, "");
}

static void test_fingerprint_bad_arguments(void **state) {
  char hex[IDEM_FINGERPRINT_LEN];
  json_t *v = load_json("{}");
  (void)state;

  memset(hex, 'x', sizeof hex);
  assert_int_equal(idem_fingerprint(NULL, v, hex), IDEM_EINVAL);
  assert_string_equal(hex, "");
  memset(hex, 'x', sizeof hex);
  assert_int_equal(idem_fingerprint("create_payment", NULL, hex), IDEM_EINVAL);
  assert_string_equal(hex, "");
  json_decref(v);
}

/* docs/idempotency.md, section 2.3, end to end: body -> parse -> validate ->
 * fingerprint. Bodies in one group must share a fingerprint; groups must
 * differ. */
struct body_group {
  const char *kind, *operation;
  const char *bodies[4];
};

static const struct body_group groups[] = {
    {"payment", "create_payment",
     {"{\"amount\":15990}", "{\"currency\":\"BRL\",\"amount\":\"15990\"}",
      "{ \"amount\" : 15990 , \"currency\":\"BRL\" }"}},
    {"payment", "create_payment", {"{\"amount\":15991}"}},
    {"payment", "create_payment", {"{\"amount\":15990,\"currency\":\"USD\"}"}},
    {"payment", "create_payment",
     {"{\"amount\":15990,\"order_id\":\"ord_1\"}",
      "{\"order_id\":\"ord_1\",\"amount\":\"15990\",\"currency\":\"BRL\"}"}},
    {"order", "create_order",
     {"{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"A1\",\"quantity\":2,"
      "\"unit_price\":1000},{\"sku\":\"B2\",\"quantity\":1,\"unit_price\":500}]}",
      "{\"items\":[{\"unit_price\":\"1000\",\"sku\":\"A1\",\"quantity\":2},"
      "{\"quantity\":\"1\",\"unit_price\":500,\"sku\":\"B2\"}],"
      "\"currency\":\"BRL\",\"customer_id\":\"c1\"}"}},
    /* Item order is part of the order. */
    {"order", "create_order",
     {"{\"customer_id\":\"c1\",\"items\":[{\"sku\":\"B2\",\"quantity\":1,"
      "\"unit_price\":500},{\"sku\":\"A1\",\"quantity\":2,\"unit_price\":1000}]}"}},
    {"order", "create_order",
     {"{\"customer_id\":\"c2\",\"items\":[{\"sku\":\"A1\",\"quantity\":2,"
      "\"unit_price\":1000},{\"sku\":\"B2\",\"quantity\":1,\"unit_price\":500}]}"}},
    {"order", "create_order",
     {"{\"customer_id\":\"c1\",\"currency\":\"EUR\",\"items\":[{\"sku\":\"A1\","
      "\"quantity\":2,\"unit_price\":1000},{\"sku\":\"B2\",\"quantity\":1,"
      "\"unit_price\":500}]}"}},
};

static void validated_fingerprint(const struct body_group *g, const char *body,
                                  char hex[IDEM_FINGERPRINT_LEN]) {
  json_t *cmd = NULL, *errors = NULL;
  if (validate_body(g->kind, body, &cmd, &errors, NULL) != 0) {
    char *e = json_dumps(errors, JSON_COMPACT);
    fail_msg("%s rejected: %s", body, e);
  }
  assert_int_equal(idem_fingerprint(g->operation, cmd, hex), IDEM_OK);
  json_decref(cmd);
}

static void test_fingerprint_of_validated_commands(void **state) {
  char first[ARRAY_LEN(groups)][IDEM_FINGERPRINT_LEN];
  (void)state;

  for (size_t g = 0; g < ARRAY_LEN(groups); g++) {
    validated_fingerprint(&groups[g], groups[g].bodies[0], first[g]);
    for (size_t b = 1; b < ARRAY_LEN(groups[g].bodies) && groups[g].bodies[b]; b++) {
      char hex[IDEM_FINGERPRINT_LEN];
      validated_fingerprint(&groups[g], groups[g].bodies[b], hex);
      if (strcmp(hex, first[g]) != 0)
        fail_msg("%s and %s have different fingerprints", groups[g].bodies[0],
                 groups[g].bodies[b]);
    }
    for (size_t h = 0; h < g; h++)
      if (strcmp(first[g], first[h]) == 0)
        fail_msg("%s and %s share a fingerprint", groups[g].bodies[0],
                 groups[h].bodies[0]);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_dump_table),
      cmocka_unit_test(test_dump_is_a_fixed_point),
      cmocka_unit_test(test_dump_stable_across_spellings),
      cmocka_unit_test(test_dump_null),
      cmocka_unit_test(test_fingerprint_definition),
      cmocka_unit_test(test_fingerprint_operation_and_command),
      cmocka_unit_test(test_fingerprint_text),
      cmocka_unit_test(test_fingerprint_bad_arguments),
      cmocka_unit_test(test_fingerprint_of_validated_commands),
  };
  return cmocka_run_group_tests_name("canon", tests, NULL, NULL);
}
