/* Tests idem_key_parse: the Idempotency-Key header rules of
 * docs/idempotency.md, section 2.1. */
#include "support.h"

#include <stdlib.h>

#include "idem/key.h"

#define RAW_STRLEN ((size_t)-1) /* the case's length is strlen(raw) */

struct key_case {
  const char *name;
  const char *raw;
  size_t len;
  int rc;
  const char *want; /* the parsed key when rc is IDEM_OK */
};

static const struct key_case cases[] = {
    {"plain", "abc", RAW_STRLEN, IDEM_OK, "abc"},
    {"uuid", "8e03978e-40d5-43e8-bc93-6894a57f9324", RAW_STRLEN, IDEM_OK,
     "8e03978e-40d5-43e8-bc93-6894a57f9324"},
    {"spaces trimmed", "  abc  ", RAW_STRLEN, IDEM_OK, "abc"},
    {"tabs trimmed", "\tabc\t", RAW_STRLEN, IDEM_OK, "abc"},
    {"mixed blanks trimmed", " \t \tabc\t \t", RAW_STRLEN, IDEM_OK, "abc"},
    {"quoted", "\"abc\"", RAW_STRLEN, IDEM_OK, "abc"},
    {"quoted and trimmed", " \t\"abc\"\t ", RAW_STRLEN, IDEM_OK, "abc"},
    {"escaped quote", "\"a\\\"b\"", RAW_STRLEN, IDEM_OK, "a\"b"},
    {"escaped backslash", "\"a\\\\b\"", RAW_STRLEN, IDEM_OK, "a\\b"},
    {"only escapes", "\"\\\"\\\\\"", RAW_STRLEN, IDEM_OK, "\"\\"},
    {"quote inside unquoted", "ab\"c", RAW_STRLEN, IDEM_OK, "ab\"c"},
    {"backslash unquoted", "a\\x", RAW_STRLEN, IDEM_OK, "a\\x"},
    {"every visible char",
     "!\"#$%&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`"
     "abcdefghijklmnopqrstuvwxyz{|}~",
     RAW_STRLEN, IDEM_OK,
     "!\"#$%&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`"
     "abcdefghijklmnopqrstuvwxyz{|}~"},
    /* SQL-looking keys are opaque strings, taken literally. */
    {"sql no spaces", "';DROP/**/TABLE/**/x;--", RAW_STRLEN, IDEM_OK,
     "';DROP/**/TABLE/**/x;--"},
    {"sql tautology", "1'OR'1'='1", RAW_STRLEN, IDEM_OK, "1'OR'1'='1"},
    {"sql quoted", "\"';DROP/**/TABLE/**/x;--\"", RAW_STRLEN, IDEM_OK,
     "';DROP/**/TABLE/**/x;--"},
    {"percent escape literal", "%00%0a", RAW_STRLEN, IDEM_OK, "%00%0a"},
    /* With spaces inside, the same text is not visible ASCII
     * (docs/idempotency.md, section 2.1). */
    {"sql with spaces", "'; DROP TABLE x; --", RAW_STRLEN, IDEM_EKEY_BAD_CHAR, NULL},

    {"absent", NULL, 0, IDEM_EKEY_MISSING, NULL},
    {"empty", "", RAW_STRLEN, IDEM_EKEY_MISSING, NULL},
    {"spaces only", "   ", RAW_STRLEN, IDEM_EKEY_MISSING, NULL},
    {"tabs only", "\t\t", RAW_STRLEN, IDEM_EKEY_MISSING, NULL},
    {"blanks only", " \t ", RAW_STRLEN, IDEM_EKEY_MISSING, NULL},
    {"empty quoted", "\"\"", RAW_STRLEN, IDEM_EKEY_MISSING, NULL},
    {"len 0 of non-empty", "abc", 0, IDEM_EKEY_MISSING, NULL},

    {"space inside", "a b", RAW_STRLEN, IDEM_EKEY_BAD_CHAR, NULL},
    {"space inside quotes", "\"a b\"", RAW_STRLEN, IDEM_EKEY_BAD_CHAR, NULL},
    {"only a quoted space", "\" \"", RAW_STRLEN, IDEM_EKEY_BAD_CHAR, NULL},
    {"tab inside", "a\tb", RAW_STRLEN, IDEM_EKEY_BAD_CHAR, NULL},
    {"NUL inside", "ab\0cd", 5, IDEM_EKEY_BAD_CHAR, NULL},
    {"SOH", "a\x01", RAW_STRLEN, IDEM_EKEY_BAD_CHAR, NULL},
    {"unit separator", "\x1f" "a", RAW_STRLEN, IDEM_EKEY_BAD_CHAR, NULL},
    {"LF", "a\nb", RAW_STRLEN, IDEM_EKEY_BAD_CHAR, NULL},
    {"CRLF not trimmed", "abc\r\n", RAW_STRLEN, IDEM_EKEY_BAD_CHAR, NULL},
    {"DEL", "a\x7f", RAW_STRLEN, IDEM_EKEY_BAD_CHAR, NULL},
    {"UTF-8", "caf\xc3\xa9", RAW_STRLEN, IDEM_EKEY_BAD_CHAR, NULL},
    {"byte 0x80", "\x80", RAW_STRLEN, IDEM_EKEY_BAD_CHAR, NULL},
    {"byte 0xff", "ab\xff", RAW_STRLEN, IDEM_EKEY_BAD_CHAR, NULL},
    {"control in quotes", "\"a\x01\"", RAW_STRLEN, IDEM_EKEY_BAD_CHAR, NULL},
    {"tab in quotes", "\"a\tb\"", RAW_STRLEN, IDEM_EKEY_BAD_CHAR, NULL},
    {"DEL in quotes", "\"a\x7f\"", RAW_STRLEN, IDEM_EKEY_BAD_CHAR, NULL},
    {"UTF-8 in quotes", "\"caf\xc3\xa9\"", RAW_STRLEN, IDEM_EKEY_BAD_CHAR, NULL},

    {"lone quote", "\"", RAW_STRLEN, IDEM_EKEY_BAD_QUOTE, NULL},
    {"unterminated", "\"abc", RAW_STRLEN, IDEM_EKEY_BAD_QUOTE, NULL},
    {"closing quote escaped", "\"abc\\\"", RAW_STRLEN, IDEM_EKEY_BAD_QUOTE, NULL},
    {"bad escape", "\"a\\xb\"", RAW_STRLEN, IDEM_EKEY_BAD_QUOTE, NULL},
    {"escape of n", "\"a\\nb\"", RAW_STRLEN, IDEM_EKEY_BAD_QUOTE, NULL},
    {"bare quote inside", "\"a\"b\"", RAW_STRLEN, IDEM_EKEY_BAD_QUOTE, NULL},
    {"text after string", "\"ab\"c", RAW_STRLEN, IDEM_EKEY_BAD_QUOTE, NULL},
};

/* Calls idem_key_parse on a case, with `out` pre-filled with junk so that
 * leftovers are visible; returns the result code. */
static int parse(const char *raw, size_t len, char out[IDEM_KEY_MAX + 1],
                 size_t *out_len) {
  if (raw != NULL && len == RAW_STRLEN)
    len = strlen(raw);
  memset(out, 'Z', IDEM_KEY_MAX + 1);
  *out_len = 12345;
  return idem_key_parse(raw, len, out, out_len);
}

static void test_table(void **state) {
  (void)state;
  for (size_t i = 0; i < ARRAY_LEN(cases); i++) {
    const struct key_case *c = &cases[i];
    char out[IDEM_KEY_MAX + 1];
    size_t out_len;
    int rc = parse(c->raw, c->len, out, &out_len);

    if (rc != c->rc)
      fail_msg("case '%s': got %s, want %s", c->name, idem_err_name(rc),
               idem_err_name(c->rc));
    if (rc == IDEM_OK) {
      assert_string_equal(out, c->want);
      assert_int_equal(out_len, strlen(c->want));
    }
  }
}

/* The header promises an empty `out` and a zero length on every error. */
static void test_error_leaves_output_empty(void **state) {
  char failed[1024] = "";
  (void)state;
  for (size_t i = 0; i < ARRAY_LEN(cases); i++) {
    const struct key_case *c = &cases[i];
    char out[IDEM_KEY_MAX + 1];
    size_t out_len;

    if (c->rc == IDEM_OK)
      continue;
    (void)parse(c->raw, c->len, out, &out_len);
    assert_int_equal(out_len, 0);
    if (out[0] != '\0') {
      /* Collect every offender, so one run shows the whole pattern. */
      strncat(failed, " '", sizeof failed - strlen(failed) - 1);
      strncat(failed, c->name, sizeof failed - strlen(failed) - 1);
      strncat(failed, "'", sizeof failed - strlen(failed) - 1);
    }
  }
  if (failed[0])
    fail_msg("out is not empty after the error in:%s", failed);
}

struct length_case {
  const char *name;
  const char *prefix, *suffix; /* around `count` copies of `fill` */
  size_t count;
  const char *fill;
  int rc;
  size_t want_len;
};

static const struct length_case length_cases[] = {
    {"1 char", "", "", 1, "k", IDEM_OK, 1},
    {"255 chars", "", "", 255, "k", IDEM_OK, 255},
    {"256 chars", "", "", 256, "k", IDEM_EKEY_TOO_LONG, 0},
    {"4096 chars", "", "", 4096, "k", IDEM_EKEY_TOO_LONG, 0},
    {"255 chars, blanks around", " \t  ", "\t  ", 255, "k", IDEM_OK, 255},
    {"256 chars, blanks around", "  ", "  ", 256, "k", IDEM_EKEY_TOO_LONG, 0},
    {"quoted 255", "\"", "\"", 255, "q", IDEM_OK, 255},
    {"quoted 256", "\"", "\"", 256, "q", IDEM_EKEY_TOO_LONG, 0},
    /* 254 + one escaped char = 255 after unquoting (258 bytes raw). */
    {"quoted 254 + escape", "\"", "\\\"\"", 254, "q", IDEM_OK, 255},
    {"quoted 255 + escape", "\"", "\\\\\"", 255, "q", IDEM_EKEY_TOO_LONG, 0},
    /* 255 escaped backslashes: 512 bytes raw, 255 after unquoting. */
    {"quoted 255 escapes", "\"", "\"", 255, "\\\\", IDEM_OK, 255},
    {"quoted 256 escapes", "\"", "\"", 256, "\\\\", IDEM_EKEY_TOO_LONG, 0},
};

static void test_length(void **state) {
  (void)state;
  for (size_t i = 0; i < ARRAY_LEN(length_cases); i++) {
    const struct length_case *c = &length_cases[i];
    size_t fill_len = strlen(c->fill);
    size_t cap = strlen(c->prefix) + c->count * fill_len + strlen(c->suffix) + 1;
    char *raw = malloc(cap);
    char out[IDEM_KEY_MAX + 1];
    size_t out_len, n;
    int rc;

    assert_non_null(raw);
    n = (size_t)sprintf(raw, "%s", c->prefix);
    for (size_t k = 0; k < c->count; k++, n += fill_len)
      memcpy(raw + n, c->fill, fill_len);
    strcpy(raw + n, c->suffix);
    rc = parse(raw, strlen(raw), out, &out_len);
    free(raw);
    if (rc != c->rc)
      fail_msg("case '%s': got %s, want %s", c->name, idem_err_name(rc),
               idem_err_name(c->rc));
    assert_int_equal(out_len, c->want_len);
    assert_int_equal(strlen(out), c->want_len);
  }
}

/* Only `len` bytes are read: a buffer that is not NUL-terminated works,
 * and bytes past `len` are ignored. */
static void test_reads_only_len_bytes(void **state) {
  char out[IDEM_KEY_MAX + 1];
  size_t out_len;
  const char raw[] = {'k', 'e', 'y', ' ', 'x'};
  (void)state;

  assert_int_equal(parse(raw, 3, out, &out_len), IDEM_OK);
  assert_string_equal(out, "key");
  assert_int_equal(parse(raw, 4, out, &out_len), IDEM_OK);
  assert_string_equal(out, "key");
  assert_int_equal(parse(raw, sizeof raw, out, &out_len), IDEM_EKEY_BAD_CHAR);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_table),
      cmocka_unit_test(test_error_leaves_output_empty),
      cmocka_unit_test(test_length),
      cmocka_unit_test(test_reads_only_len_bytes),
  };
  return cmocka_run_group_tests_name("key", tests, NULL, NULL);
}
