/* The store wrappers: argument checks, backend dispatch, wake-ups. Faults
 * can be injected here for tests without touching backends. */
#include "store_impl.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "idem/clock.h"
#include "idem/crypto.h"

static __thread char last_error[512];

/* Fault injection for tests: when IDEM_FAULT_FILE names a file that
 * exists, every store call fails as if the database were unreachable.
 * Creating and removing the file turns the fault on and off while the
 * server runs. The variable is read once; unset, this costs nothing. */
static const char *fault_path;
static pthread_once_t fault_once = PTHREAD_ONCE_INIT;

static void read_fault_env(void) { fault_path = getenv("IDEM_FAULT_FILE"); }

static const char *fault_file(void) {
  pthread_once(&fault_once, read_fault_env);
  return fault_path;
}

static int faulty(void) {
  const char *path = fault_file();
  if (path == NULL || access(path, F_OK) != 0)
    return 0;
  idem__store_set_error("injected fault (IDEM_FAULT_FILE)");
  return 1;
}

#define FAULT_POINT()                                                          \
  do {                                                                         \
    if (faulty())                                                              \
      return IDEM_ESTORE;                                                      \
  } while (0)

void idem__store_set_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
}

const char *idem_store_last_error(void) { return last_error; }

void idem__store_notify(idem_store_t *store, const idem_scope_t *scope) {
  idem__waitset_wake(store->waits, scope);
}

static int is_postgres_url(const char *url) {
  return strncmp(url, "postgresql://", 13) == 0 ||
         strncmp(url, "postgres://", 11) == 0;
}

int idem_store_open(const char *url, const idem_store_options_t *opts,
                    idem_store_t **out) {
  idem_store_options_t defaults = {0};
  idem_store_t *s = NULL;
  int rc;

  *out = NULL;
  if (url == NULL || url[0] == '\0') {
    idem__store_set_error("empty database location");
    return IDEM_EINVAL;
  }
  if (opts == NULL)
    opts = &defaults;
  rc = is_postgres_url(url) ? idem__postgres_open(url, opts, &s)
                             : idem__sqlite_open(url, opts, &s);
  if (rc != IDEM_OK)
    return rc;
  s->waits = idem__waitset_new();
  if (s->waits == NULL) {
    s->methods->close(s);
    return IDEM_ENOMEM;
  }
  if (s->methods->start && (rc = s->methods->start(s)) != IDEM_OK) {
    idem_store_close(s);
    return rc;
  }
  *out = s;
  return IDEM_OK;
}

void idem_store_close(idem_store_t *store) {
  idem__waitset_t *ws;
  if (store == NULL)
    return;
  ws = store->waits;
  store->methods->close(store);
  idem__waitset_free(ws);
}

const char *idem_store_backend(const idem_store_t *store) {
  return store->methods->name;
}

int idem_store_migrate(idem_store_t *store) { return store->methods->migrate(store); }

int idem_store_local_reads(const idem_store_t *store) {
  return store->methods->local_reads;
}

int idem_store_listen(idem_store_t *store, const char *channel,
                      void (*fn)(void *arg, int listening), void *arg) {
  if (strcmp(store->methods->name, "postgresql") != 0)
    return IDEM_ENOTSUP;
  return idem__postgres_listen(store, channel, fn, arg);
}

int idem_store_async_writes(const idem_store_t *store) {
  return store->methods->reserve_async != NULL && store->methods->complete_async != NULL;
}

int idem_store_ping(idem_store_t *store) {
  FAULT_POINT();
  return store->methods->ping(store);
}

static int check_scope(const idem_scope_t *sc) {
  if (sc->operation == NULL || sc->key == NULL ||
      strlen(sc->operation) > IDEM_OPERATION_MAX || strlen(sc->key) > IDEM_KEY_MAX)
    return IDEM_EINVAL;
  return IDEM_OK;
}

static int check_reserve(const idem_reserve_t *req) {
  if (req->fingerprint == NULL || req->correlation_id == NULL)
    return IDEM_EINVAL;
  return check_scope(&req->scope);
}

static int check_complete(const idem_complete_t *c) {
  if (c->owner_token == NULL || c->owner_token[0] == '\0')
    return IDEM_EINVAL;
  if (c->outcome.state != IDEM_STATE_COMPLETED &&
      c->outcome.state != IDEM_STATE_PENDING &&
      c->outcome.state != IDEM_STATE_FAILED)
    return IDEM_EINVAL;
  return IDEM_OK;
}

/* A write begins: counted, and the time of progress set when it is the
 * only one. */
static void write_began(idem_store_t *s) {
  if (atomic_fetch_add_explicit(&s->writing, 1, memory_order_relaxed) == 0)
    atomic_store_explicit(&s->progress_ms, idem_mono_ms(), memory_order_relaxed);
}

/* A write ended with `rc`, which it returns: a store failure (unreachable,
 * full, locked past its timeout) or one that reached the database (done,
 * or refused by its data: a lost lease, a unique key) is noted; a caller's
 * error (an argument, an effect's own) says nothing of the store. */
static int write_ended(idem_store_t *s, int rc) {
  int64_t now = idem_mono_ms();

  if (rc == IDEM_ESTORE || rc == IDEM_ETIMEDOUT) {
    atomic_store_explicit(&s->last_failed_ms, now, memory_order_relaxed);
    atomic_store_explicit(&s->failing, 1, memory_order_relaxed);
  } else if (rc == IDEM_OK || rc == IDEM_ELOST || rc == IDEM_EEXIST) {
    atomic_store_explicit(&s->last_ok_ms, now, memory_order_relaxed);
    atomic_store_explicit(&s->failing, 0, memory_order_relaxed);
  }
  atomic_store_explicit(&s->progress_ms, now, memory_order_relaxed);
  atomic_fetch_sub_explicit(&s->writing, 1, memory_order_release);
  return rc;
}

/* A caller's own write (idem_store_write()) is health only when it fails
 * in the store: it may touch only the caller's tables, which a lock on
 * the records table leaves writable (PostgreSQL locks by table), and its
 * successes, frequent (the reconciler's claims), would hide that the
 * records cannot be written and keep the probe from running. */
static int caller_write_ended(idem_store_t *s, int rc) {
  if (rc == IDEM_ESTORE || rc == IDEM_ETIMEDOUT) {
    atomic_store_explicit(&s->last_failed_ms, idem_mono_ms(), memory_order_relaxed);
    atomic_store_explicit(&s->failing, 1, memory_order_relaxed);
  }
  return rc;
}

void idem_store_health(idem_store_t *store, idem_store_health_t *out) {
  out->writing = atomic_load_explicit(&store->writing, memory_order_acquire);
  out->last_ok_ms = atomic_load_explicit(&store->last_ok_ms, memory_order_relaxed);
  out->last_failed_ms = atomic_load_explicit(&store->last_failed_ms, memory_order_relaxed);
  out->progress_ms = atomic_load_explicit(&store->progress_ms, memory_order_relaxed);
  out->failing = atomic_load_explicit(&store->failing, memory_order_relaxed);
}

int idem_store_probe(idem_store_t *store) {
  write_began(store);
  if (faulty())
    return write_ended(store, IDEM_ESTORE);
  if (store->methods->probe == NULL)
    return write_ended(store, IDEM_ENOTSUP);
  return write_ended(store, store->methods->probe(store));
}

static int reserve_now(idem_store_t *store, const idem_reserve_t *req,
                       idem_record_t *out, idem_reserve_result_t *result) {
  FAULT_POINT();
  int rc = check_reserve(req);
  if (rc != IDEM_OK)
    return rc;
  rc = store->methods->reserve(store, req, out, result);
  /* Another request's owner token is that request's alone. */
  if (rc == IDEM_OK && *result == IDEM_RESERVE_EXISTS)
    memset(out->owner_token, 0, sizeof out->owner_token);
  return rc;
}

int idem_store_reserve(idem_store_t *store, const idem_reserve_t *req,
                       idem_record_t *out, idem_reserve_result_t *result) {
  write_began(store);
  return write_ended(store, reserve_now(store, req, out, result));
}

static int complete_now(idem_store_t *store, const idem_complete_t *c) {
  FAULT_POINT();
  int rc = check_complete(c);
  if (rc != IDEM_OK)
    return rc;
  rc = store->methods->complete(store, c);
  if (rc == IDEM_OK)
    idem__store_notify(store, &c->scope);
  return rc;
}

int idem_store_complete(idem_store_t *store, const idem_complete_t *c) {
  write_began(store);
  return write_ended(store, complete_now(store, c));
}

/* What the synchronous wrappers do after the backend, for the
 * asynchronous forms: run on the store thread before the caller's `done`. */
struct async_shim {
  idem_store_t *store;
  const idem_scope_t *scope;
  idem_record_t *out;
  idem_reserve_result_t *result;
  idem_store_done_fn done;
  void *arg;
};

static void async_reserved(void *p, int rc) {
  struct async_shim sh = *(struct async_shim *)p;
  free(p);
  write_ended(sh.store, rc);
  if (rc != IDEM_OK)
    idem_record_reset(sh.out); /* as after a failed synchronous reserve */
  else if (*sh.result == IDEM_RESERVE_EXISTS)
    memset(sh.out->owner_token, 0, sizeof sh.out->owner_token);
  sh.done(sh.arg, rc);
}

static void async_completed(void *p, int rc) {
  struct async_shim sh = *(struct async_shim *)p;
  free(p);
  write_ended(sh.store, rc);
  if (rc == IDEM_OK)
    idem__store_notify(sh.store, sh.scope);
  sh.done(sh.arg, rc);
}

int idem_store_reserve_async(idem_store_t *store, const idem_reserve_t *req,
                             idem_record_t *out, idem_reserve_result_t *result,
                             idem_store_done_fn done, void *arg) {
  struct async_shim *sh;
  int rc;

  FAULT_POINT();
  if (store->methods->reserve_async == NULL)
    return IDEM_ENOTSUP;
  if ((rc = check_reserve(req)) != IDEM_OK)
    return rc;
  if ((sh = malloc(sizeof *sh)) == NULL)
    return IDEM_ENOMEM;
  *sh = (struct async_shim){store, &req->scope, out, result, done, arg};
  write_began(store);
  rc = store->methods->reserve_async(store, req, out, result, async_reserved, sh);
  if (rc != IDEM_OK) {
    free(sh);
    write_ended(store, rc);
  }
  return rc;
}

int idem_store_complete_async(idem_store_t *store, const idem_complete_t *c,
                              idem_store_done_fn done, void *arg) {
  struct async_shim *sh;
  int rc;

  FAULT_POINT();
  if (store->methods->complete_async == NULL)
    return IDEM_ENOTSUP;
  if ((rc = check_complete(c)) != IDEM_OK)
    return rc;
  if ((sh = malloc(sizeof *sh)) == NULL)
    return IDEM_ENOMEM;
  *sh = (struct async_shim){store, &c->scope, NULL, NULL, done, arg};
  write_began(store);
  rc = store->methods->complete_async(store, c, async_completed, sh);
  if (rc != IDEM_OK) {
    free(sh);
    write_ended(store, rc);
  }
  return rc;
}

const char *idem_tx_backend(const idem_tx_t *tx) { return tx->backend; }

int idem__won_record(const idem_reserve_t *req, const char *owner, int64_t row,
                      idem_record_t *out) {
  /* Copied as the backends copy what they read. */
  idem_record_reset(out);
  out->tenant_id = req->scope.tenant_id;
  idem_copy(out->operation, sizeof out->operation, req->scope.operation);
  idem_copy(out->key, sizeof out->key, req->scope.key);
  idem_copy(out->fingerprint, sizeof out->fingerprint, req->fingerprint);
  idem_copy(out->resource_id, sizeof out->resource_id, req->resource_id);
  idem_copy(out->correlation_id, sizeof out->correlation_id, req->correlation_id);
  idem_copy(out->owner_token, sizeof out->owner_token, owner);
  out->state = IDEM_STATE_PROCESSING;
  out->lease_expires_at = req->now_ms + req->lease_ms;
  out->created_at = req->now_ms;
  out->updated_at = req->now_ms;
  out->row = row;
  return IDEM_OK;
}

int idem__settled_record(const idem_reserve_t *req, const char *owner, int64_t row,
                          idem_record_t *out) {
  const idem_outcome_t *o = req->outcome;
  int rc = idem__won_record(req, owner, row, out);

  if (rc != IDEM_OK)
    return rc;
  out->state = o->state;
  out->response_status = o->status;
  if (o->body && (out->response_body = strdup(o->body)) == NULL)
    return IDEM_ENOMEM;
  idem_copy(out->location, sizeof out->location, o->location);
  if (o->resource_id)
    idem_copy(out->resource_id, sizeof out->resource_id, o->resource_id);
  idem_copy(out->provider_ref, sizeof out->provider_ref, o->provider_ref);
  out->owner_token[0] = '\0';
  out->lease_expires_at = 0;
  out->expires_at = o->state == IDEM_STATE_PENDING ? 0 : req->now_ms + req->ttl_ms;
  return IDEM_OK;
}

void *idem_tx_handle(const idem_tx_t *tx) { return tx->handle; }

int64_t idem_tx_now_ms(const idem_tx_t *tx) { return tx->now_ms; }

void *idem_tx_statement(idem_tx_t *tx, unsigned slot, const char *sql) {
  if (slot >= IDEM_TX_STATEMENTS || sql == NULL) {
    idem__store_set_error("statement slot %u: out of range, or no SQL", slot);
    return NULL;
  }
  return tx->ops->statement(tx, slot, sql);
}

int idem_tx_take_over(idem_tx_t *tx, const idem_scope_t *scope, int64_t lease_ms,
                      idem_record_t *out) {
  char owner[IDEM_TOKEN_MAX + 1];

  if (!tx->writable || scope == NULL || lease_ms <= 0 ||
      check_scope(scope) != IDEM_OK)
    return IDEM_EINVAL;
  if (idem_random_token(owner, IDEM_TOKEN_MAX) != IDEM_OK)
    return IDEM_ECRYPTO;
  return tx->ops->take_over(tx, scope, owner, tx->now_ms + lease_ms, out);
}

int idem_tx_send(idem_tx_t *tx, const char *name, int n, const char *const *values) {
  if (tx->ops->send == NULL)
    return IDEM_ENOTSUP;
  if (name == NULL || n < 0 || (n > 0 && values == NULL))
    return IDEM_EINVAL;
  return tx->ops->send(tx, name, n, values);
}

int idem_tx_flush(idem_tx_t *tx) {
  return tx->ops->flush ? tx->ops->flush(tx) : IDEM_OK;
}

int idem__effect_run(const idem_effect_t *e, idem_tx_t *tx) {
  int rc;

  if (e == NULL || e->fn == NULL)
    return IDEM_OK;
  rc = e->fn(e->arg, tx);
  if (rc != IDEM_OK)
    idem__store_set_error("the caller's effect failed: %s", idem_err_name(rc));
  return rc;
}

int idem_store_write(idem_store_t *store, const idem_effect_t *e) {
  if (e == NULL || e->fn == NULL)
    return IDEM_EINVAL;
  if (faulty())
    return caller_write_ended(store, IDEM_ESTORE);
  return caller_write_ended(store, store->methods->write(store, e));
}

int idem_store_read(idem_store_t *store, const idem_effect_t *e) {
  FAULT_POINT();
  if (e == NULL || e->fn == NULL)
    return IDEM_EINVAL;
  return store->methods->read(store, e);
}

int idem_store_lookup(idem_store_t *store, const idem_scope_t *scope,
                      int64_t now_ms, idem_record_t *out) {
  FAULT_POINT();
  return store->methods->lookup(store, scope, now_ms, out);
}

uint64_t idem_store_watch(idem_store_t *store, const idem_scope_t *scope) {
  return idem__waitset_ticket(store->waits, scope);
}

int idem_store_park(idem_store_t *store, const idem_scope_t *scope,
                    uint64_t ticket, idem_store_waiter_t *w) {
  return idem__waitset_park(store->waits, scope, ticket, w);
}

int idem_store_expire_waiters(idem_store_t *store, int64_t now_ms) {
  return idem__waitset_expire(store->waits, now_ms);
}

int idem_store_wait(idem_store_t *store, const idem_scope_t *scope,
                    uint64_t ticket, int64_t timeout_ms) {
  return idem__waitset_wait(store->waits, scope, ticket, timeout_ms);
}

int idem_store_meta_get_or_put(idem_store_t *store, const char *name,
                               const char *value, char **out) {
  *out = NULL;
  return store->methods->meta_get_or_put(store, name, value, out);
}

int idem_store_sweep(idem_store_t *store, int64_t now_ms, int batch,
                     int *deleted) {
  FAULT_POINT();
  *deleted = 0;
  if (batch <= 0)
    return IDEM_EINVAL;
  return store->methods->sweep(store, now_ms, batch, deleted);
}

int idem_store_count(idem_store_t *store, const char *what, int64_t tenant_id,
                     int64_t *n) {
  *n = 0;
  return store->methods->count(store, what, tenant_id, n);
}

int idem_store_records_list(idem_store_t *store, const idem_records_query_t *q,
                            idem_record_t *out, int *n) {
  *n = 0;
  if (q->limit <= 0)
    return IDEM_EINVAL;
  return store->methods->records_list(store, q, out, n);
}

void idem_store_stats(idem_store_t *store, idem_store_stats_t *out) {
  memset(out, 0, sizeof *out);
  if (store->methods->stats)
    store->methods->stats(store, out);
}
