/* Error codes shared by libidem, its stores and idemd.
 * 0 is success; every failure is a small positive number with a fixed text. */
#ifndef IDEM_ERROR_H
#define IDEM_ERROR_H

#ifdef __cplusplus
extern "C" {
#endif

#define IDEM_WARN_UNUSED __attribute__((warn_unused_result))

/* Codes are only ever added at the end of this list. */
#define IDEM_ERRNO_MAP(X)                                                  \
  X(OK, "success")                                                         \
  X(EINVAL, "invalid argument")                                            \
  X(ENOMEM, "out of memory")                                               \
  X(EKEY_MISSING, "Idempotency-Key header is required")                    \
  X(EKEY_TOO_LONG, "Idempotency-Key must be at most 255 characters")       \
  X(EKEY_BAD_CHAR, "Idempotency-Key must be visible ASCII characters")     \
  X(EKEY_BAD_QUOTE, "Idempotency-Key has an unterminated or invalid quoted string") \
  X(ENOTFOUND, "not found")                                                \
  X(ELOST, "the record is owned by another request")                       \
  X(ESTORE, "the store is unavailable")                                    \
  X(ESCHEMA, "the database schema is newer than this program")             \
  X(ETIMEDOUT, "timed out")                                                \
  X(EEXIST, "already exists")                                              \
  X(EJSON, "invalid JSON")                                                 \
  X(ECRYPTO, "cryptographic library failure")                             \
  X(ENOTSUP, "not supported by this store")                                \
  X(EAGAIN, "not done yet: the engine calls back")                         \
  X(EREFUSED, "refused by a rule of the application")

typedef enum idem_err {
#define IDEM__ERR_ENUM(name, text) IDEM_##name,
  IDEM_ERRNO_MAP(IDEM__ERR_ENUM)
#undef IDEM__ERR_ENUM
  IDEM_ERR_MAX_
} idem_err_t;

/* Returns a static, human-readable text for `err` (never NULL; an unknown
 * code gives "unknown error"). Safe to show to API clients. */
const char *idem_strerror(int err);

/* Returns the code's name without the prefix ("EKEY_MISSING"), for logs. */
const char *idem_err_name(int err);

#ifdef __cplusplus
}
#endif
#endif
