/* Internal: what every store backend shares. A backend's handle embeds
 * struct idem_store first and points it at its table of functions. */
#ifndef IDEM_STORE_IMPL_H
#define IDEM_STORE_IMPL_H

#include <stdatomic.h>

#include "idem/store.h"
#include "lib/waitset.h"

struct idem_store {
  const idem_store_methods_t *methods;
  idem__waitset_t *waits;
  /* How writes are doing (idem_store_health()), kept by the wrappers. */
  atomic_int writing;
  atomic_llong last_ok_ms, last_failed_ms, progress_ms;
  atomic_int failing; /* the last write to end failed in the store */
};

/* What a backend does for idem_tx_statement() and idem_tx_take_over(), on
 * the backend's connection `tx->conn`; the owner token is made by the
 * caller. */
typedef struct idem__tx_ops {
  void *(*statement)(idem_tx_t *tx, unsigned slot, const char *sql);
  int (*take_over)(idem_tx_t *tx, const idem_scope_t *scope, const char *owner,
                   int64_t lease_expires_at, idem_record_t *out);
  /* Optional (PostgreSQL): idem_tx_send() and idem_tx_flush(). */
  int (*send)(idem_tx_t *tx, const char *name, int n, const char *const *values);
  int (*flush)(idem_tx_t *tx);
} idem__tx_ops_t;

/* What an effect is lent (store.h): set up by the backend around the call. */
struct idem_tx {
  const char *backend;
  void *handle;
  int64_t now_ms;
  const idem__tx_ops_t *ops;
  void *conn;   /* the backend's connection, for `ops` */
  int writable; /* 0 in idem_store_read() */
};

/* Calls `e` (when it has a function) with `tx`. */
int idem__effect_run(const idem_effect_t *e, idem_tx_t *tx);

/* Records `fmt` as this thread's last store error (for logs). */
void idem__store_set_error(const char *fmt, ...)
    __attribute__((format(printf, 1, 2)));

/* Wakes the in-process waiters of `scope`. Backends call it after a commit
 * that changed a record others may be waiting on. */
void idem__store_notify(idem_store_t *store, const idem_scope_t *scope);

/* The record a won reservation left, without reading it back (both
 * backends' reservation writes these values whether it inserted the row or
 * took an old one over: its DO UPDATE sets every column). `row` is
 * SQLite's rowid, or 0. IDEM_OK. */
int idem__won_record(const idem_reserve_t *req, const char *owner, int64_t row,
                     idem_record_t *out);

/* The record a single-step reservation left once the completion wrote
 * req->outcome over the won one, as the backends' completion sets it.
 * IDEM_OK or IDEM_ENOMEM. */
int idem__settled_record(const idem_reserve_t *req, const char *owner, int64_t row,
                         idem_record_t *out);

/* Backends' constructors. On success they fill `*out` with a handle whose
 * base is initialised (methods set; waits is set by idem_store_open). */
int idem__sqlite_open(const char *path, const idem_store_options_t *opts,
                      idem_store_t **out);
int idem__postgres_open(const char *url, const idem_store_options_t *opts,
                        idem_store_t **out);

/* idem_store_listen() on a PostgreSQL store. */
int idem__postgres_listen(idem_store_t *store, const char *channel,
                          void (*fn)(void *arg, int listening), void *arg);
/* Tests only: applies the SQLite schema up to `version` (not past it),
 * so that a test can fill an older schema and migrate it. `store` must be
 * a SQLite store. IDEM_EINVAL for a version this program does not have. */
int idem__sqlite_migrate_to(idem_store_t *store, int version);

/* Tests only: the same for the PostgreSQL schema; `store` must be a
 * PostgreSQL store. */
int idem__postgres_migrate_to(idem_store_t *store, int version);

#endif
