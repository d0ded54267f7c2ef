/* Internal: what every store backend shares. A backend's handle embeds
 * struct idem_store first and points it at its table of functions. */
#ifndef IDEM_STORE_IMPL_H
#define IDEM_STORE_IMPL_H

#include "idem/store.h"
#include "lib/waitset.h"

struct idem_store {
  const idem_store_methods_t *methods;
  idem__waitset_t *waits;
};

/* What an effect is lent (store.h): set up by the backend around the call. */
struct idem_tx {
  const char *backend;
  void *handle;
  int64_t now_ms;
};

/* Calls `e` (when it has a function) with a transaction on `handle`. */
int idem__effect_run(const idem_effect_t *e, const char *backend, void *handle,
                     int64_t now_ms);

/* Records `fmt` as this thread's last store error (for logs). */
void idem__store_set_error(const char *fmt, ...)
    __attribute__((format(printf, 1, 2)));

/* Wakes the in-process waiters of `scope`. Backends call it after a commit
 * that changed a record others may be waiting on. */
void idem__store_notify(idem_store_t *store, const idem_scope_t *scope);

/* Backends' constructors. On success they fill `*out` with a handle whose
 * base is initialised (methods set; waits is set by idem_store_open). */
int idem__sqlite_open(const char *path, const idem_store_options_t *opts,
                      idem_store_t **out);
int idem__postgres_open(const char *url, const idem_store_options_t *opts,
                        idem_store_t **out);

/* Tests only: applies the SQLite schema up to `version` (not past it),
 * so that a test can fill an older schema and migrate it. `store` must be
 * a SQLite store. IDEM_EINVAL for a version this program does not have. */
int idem__sqlite_migrate_to(idem_store_t *store, int version);

/* Tests only: the same for the PostgreSQL schema; `store` must be a
 * PostgreSQL store. */
int idem__postgres_migrate_to(idem_store_t *store, int version);

#endif
