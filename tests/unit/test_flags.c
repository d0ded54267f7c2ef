/* Tests util/flags.c, the one reader of an operator command's flags:
 * idemd's way (the common flags, such as --db, left for its config
 * parser, with their values) and the gateway's (anything else refused),
 * both refusing a flag given twice or without a value, and a word too
 * many. Table-driven: each row is a command line and what it reads to. */
#include "support.h"

#include <stdlib.h>

#include "util/flags.h"

#define MAX_ARGS 12

static const char *const names[] = {"--as", "--reason", NULL};

struct row {
  const char *name;
  int pass_others, max_words;
  const char *args[MAX_ARGS]; /* NULL-terminated */
  int want;                   /* what idem__flags_take() returns */
  const char *as, *reason;    /* the values read (when want >= 0) */
  const char *words[2];       /* the words read */
  const char *left[MAX_ARGS]; /* what stays in argv, in order */
};

#define IDEMD .pass_others = 1
#define GATEWAY .pass_others = 0

static const struct row rows[] = {
    {"idemd: flags, words and common flags with their values", IDEMD, .max_words = 2,
     .args = {"resolve", "--db", "x.db", "pay_1", "--as", "succeeded", "--key-ttl=1h",
              "--reason", "r"},
     .want = 3, .as = "succeeded", .reason = "r", .words = {"resolve", "pay_1"},
     .left = {"--db", "x.db", "--key-ttl=1h"}},
    {"idemd: a common flag's value is not a word", IDEMD, .args = {"--db", "x.db"},
     .want = 2, .left = {"--db", "x.db"}},
    {"idemd: a common flag followed by a flag", IDEMD, .args = {"--verbose", "--as", "a"},
     .want = 1, .as = "a", .left = {"--verbose"}},
    {"idemd: a flag given twice", IDEMD, .max_words = 2,
     .args = {"--as", "succeeded", "--as", "declined"}, .want = -1},
    {"idemd: a flag without a value", IDEMD, .max_words = 2,
     .args = {"resolve", "--reason"}, .want = -1},
    {"idemd: a word too many", IDEMD, .max_words = 1, .args = {"resolve", "pay_1"},
     .want = -1},
    {"gateway: a key and flags", GATEWAY, .max_words = 1,
     .args = {"--as", "a", "k1", "--reason", "b"}, .want = 0, .as = "a", .reason = "b",
     .words = {"k1"}},
    {"gateway: no key", GATEWAY, .max_words = 1, .args = {"--reason", "b"}, .want = 0,
     .reason = "b"},
    {"gateway: an empty key is a word", GATEWAY, .max_words = 1, .args = {""}, .want = 0,
     .words = {""}},
    {"gateway: another flag is refused", GATEWAY, .max_words = 1,
     .args = {"k1", "--db", "x.db"}, .want = -1},
    {"gateway: a second key", GATEWAY, .max_words = 1, .args = {"k1", "k2"}, .want = -1},
    {"gateway: a flag given twice", GATEWAY, .max_words = 1,
     .args = {"--reason", "b", "--reason", "b"}, .want = -1},
    {"gateway: a flag without a value", GATEWAY, .max_words = 1, .args = {"k1", "--as"},
     .want = -1},
};

static void test_rows(void **state) {
  (void)state;
  for (size_t r = 0; r < ARRAY_LEN(rows); r++) {
    const struct row *t = &rows[r];
    char *argv[MAX_ARGS];
    const char *v[2] = {"stale", "stale"}, *words[2] = {NULL, NULL};
    idem__flags_t f = {"test", names, v, words, t->max_words, 0, t->pass_others};
    int argc = 0, got;

    while (argc < MAX_ARGS && t->args[argc])
      argc++;
    for (int i = 0; i < argc; i++)
      argv[i] = (char *)t->args[i];
    got = idem__flags_take(&f, argc, argv);
    if (got != t->want)
      fail_msg("%s: returned %d, want %d", t->name, got, t->want);
    if (got < 0)
      continue;
    if ((v[0] == NULL) != (t->as == NULL) || (v[0] && strcmp(v[0], t->as) != 0) ||
        (v[1] == NULL) != (t->reason == NULL) || (v[1] && strcmp(v[1], t->reason) != 0))
      fail_msg("%s: read --as '%s' --reason '%s'", t->name, v[0] ? v[0] : "(none)",
               v[1] ? v[1] : "(none)");
    for (int i = 0; i < 2; i++)
      if ((i < f.nwords) != (t->words[i] != NULL) ||
          (i < f.nwords && strcmp(words[i], t->words[i]) != 0))
        fail_msg("%s: word %d is '%s'", t->name, i, i < f.nwords ? words[i] : "(none)");
    for (int i = 0; i < got; i++)
      if (t->left[i] == NULL || strcmp(argv[i], t->left[i]) != 0)
        fail_msg("%s: argv[%d] left is '%s'", t->name, i, argv[i]);
    if (got < MAX_ARGS && t->left[got] != NULL)
      fail_msg("%s: '%s' not left in argv", t->name, t->left[got]);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rows),
  };
  return cmocka_run_group_tests_name("unit: flags", tests, NULL, NULL);
}
