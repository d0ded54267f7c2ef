/* Small helpers shared by the unit tests: cmocka includes, table sizes,
 * JSON loading and, when server/validate.h is included first, a helper
 * that runs a request body through the parser and a validator. */
#ifndef IDEM_TEST_SUPPORT_H
#define IDEM_TEST_SUPPORT_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#define ARRAY_LEN(a) (sizeof(a) / sizeof *(a))

/* Removes a SQLite store's database file and the files beside it (WAL,
 * shared memory, rollback journal, the tenant cache's change file). */
static inline void remove_sqlite_files(const char *path) {
  static const char *const suffix[] = {"", "-wal", "-shm", "-journal", "-tenants"};
  char name[1024];

  for (size_t i = 0; i < ARRAY_LEN(suffix); i++) {
    snprintf(name, sizeof name, "%s%s", path, suffix[i]);
    unlink(name);
  }
}

/* Loads `text` as JSON (any value); fails the test if it does not parse.
 * The caller owns the result. */
static inline json_t *load_json(const char *text) {
  json_error_t err;
  json_t *v = json_loads(text, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &err);
  if (v == NULL)
    fail_msg("test fixture is not JSON (%s): %s", err.text, text);
  return v;
}

/* Fails the test unless `haystack` contains `needle`. */
#define assert_contains(haystack, needle)                                      \
  do {                                                                         \
    const char *h_ = (haystack), *n_ = (needle);                               \
    if (h_ == NULL || strstr(h_, n_) == NULL)                                  \
      fail_msg("\"%s\" does not contain \"%s\"", h_ ? h_ : "(null)", n_);      \
  } while (0)

#ifdef IDEMD_VALIDATE_H
/* Parses `body` with idemd_parse_body (which must accept it) and validates
 * it as `kind` ("payment" or "order"). Returns the validator's result; the
 * caller owns `*cmd` or `*errors`. `total` may be NULL. */
static inline int validate_body(const char *kind, const char *body,
                                json_t **cmd, json_t **errors,
                                int64_t *total) {
  const char *msg = NULL;
  json_t *obj = NULL;
  int64_t ignored = 0;
  int out_of_range = -1, rc;

  if (idemd_parse_body(body, strlen(body), &obj, &out_of_range, &msg) != 0)
    fail_msg("body rejected by idemd_parse_body (%s): %s", msg, body);
  if (strcmp(kind, "payment") == 0)
    rc = idemd_validate_payment(obj, cmd, errors);
  else
    rc = idemd_validate_order(obj, cmd, errors, total ? total : &ignored);
  json_decref(obj);
  return rc;
}
#endif

#endif
