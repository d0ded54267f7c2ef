/* The store interface: where idempotency records live; a program's own
 * rows go through effects (idem_effect_t) into its own tables. Each backend (SQLite, PostgreSQL)
 * fills in a table of functions; callers only use the idem_store_*()
 * wrappers below, so a new backend needs no change in callers.
 *
 * Every call is safe from many threads at once. Calls that write return
 * only after their transaction is durable. */
#ifndef IDEM_STORE_H
#define IDEM_STORE_H

#include <stdint.h>

#include "idem/error.h"
#include "idem/record.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct idem_store idem_store_t;

/* A write transaction in progress on a store's connection, lent to an
 * effect (below) for its length. */
typedef struct idem_tx idem_tx_t;

/* A caller's own writes, made inside the transaction that wins a key
 * (idem_reserve_t.effect) or completes its record (idem_complete_t.effect),
 * so that they commit, or roll back, with it: an application keeps its
 * own rows in its own tables and gets them written exactly once per key.
 * fn(arg, tx) runs on a store thread, inside the transaction, and writes
 * through idem_tx_handle(tx); it returns IDEM_OK, or an error, which rolls
 * the whole write back (the reservation too) and is what the reserve or
 * complete then returns. IDEM_EREFUSED is the code for a rule of the
 * caller's own that the write would break (a balance, a state checked in
 * the transaction): nothing is written and the key stays free. It may run more than once for one write (both
 * stores run a batch again, write by write, after any write of it failed), and
 * only the run that commits leaves anything: it must write only through
 * the handle, set what it reports afresh each time, and not wait (the
 * write lock is held, for other writes too, while it runs). fn NULL: no
 * effect. */
typedef struct idem_effect {
  int (*fn)(void *arg, idem_tx_t *tx);
  void *arg;
} idem_effect_t;

/* How many statements of its own a program may keep per connection
 * (idem_tx_statement()). */
#define IDEM_TX_STATEMENTS 32

/* The backend of `tx`: "sqlite" or "postgresql", as idem_store_backend(). */
const char *idem_tx_backend(const idem_tx_t *tx);

/* The connection `tx` runs on: a `sqlite3 *` for "sqlite", a `PGconn *`
 * for "postgresql". Lent for the effect's call only: run statements on
 * it, never BEGIN, COMMIT, ROLLBACK or close. (SQLite: the one idem was
 * built with, whose functions a program linking libidem calls.) */
void *idem_tx_handle(const idem_tx_t *tx);

/* The caller's statement `slot` (0 to IDEM_TX_STATEMENTS - 1) on the
 * connection `tx` runs on, made from `sql` the first time this connection
 * is asked for that slot and kept for its later transactions, so that an
 * effect does not pay for parsing its SQL on every write. A program gives
 * each of its statements a slot of its own (asking for a slot with other
 * SQL makes it again). SQLite: a `sqlite3_stmt *`, reset, with no
 * bindings, to bind and step; PostgreSQL: the name of a statement
 * prepared on the connection, for PQexecPrepared(). NULL when it cannot
 * be made (idem_store_last_error() says why; on PostgreSQL, when a
 * statement idem_tx_send() queued failed, idem_tx_flush() then returns
 * its error, IDEM_EEXIST for a unique violation). Lent for the effect's
 * call. */
void *idem_tx_statement(idem_tx_t *tx, unsigned slot, const char *sql);

/* PostgreSQL: runs the caller's prepared statement `name` (as
 * idem_tx_statement() made it) with `n` text parameters (NULL: SQL NULL)
 * when the effect needs neither its rows nor its count of rows: it is
 * queued in libpq's pipeline and goes out with the next statement that
 * needs an answer, or the COMMIT, so that a batch of writes costs fewer
 * round trips (docs/performance.md, "PostgreSQL: group commit"). IDEM_OK
 * means queued: its error, if any, comes from the next idem_tx_flush(),
 * or fails the write it belongs to (as if the effect had returned it;
 * IDEM_EEXIST for a unique violation). From the first call until
 * idem_tx_flush() or the effect's return, the connection is in pipeline
 * mode: run nothing on the handle directly in between. IDEM_ENOTSUP on
 * SQLite (run the statement), IDEM_EINVAL for a bad argument. */
IDEM_WARN_UNUSED int idem_tx_send(idem_tx_t *tx, const char *name, int n,
                                  const char *const *values);

/* Sends what idem_tx_send() queued, waits for its results and leaves
 * pipeline mode: IDEM_OK, or the first of their errors (IDEM_EEXIST for a
 * unique violation; the transaction is then failed, and so is the write).
 * Then the handle runs statements as usual. IDEM_OK when nothing is
 * queued, and always on SQLite. */
IDEM_WARN_UNUSED int idem_tx_flush(idem_tx_t *tx);

/* Inside a write (an effect or idem_store_write(), not idem_store_read()):
 * takes over the record of `scope` when it is pending or processing and
 * no owner's lease holds it at the transaction's time (its owner died, or
 * it was left pending), giving it a new owner token
 * and a lease of `lease_ms`, and reads it into `out` (reset it after).
 * This is how the work of an owner that died is taken over: its own
 * completion is refused from then on (IDEM_ELOST). Returns IDEM_OK,
 * IDEM_ENOTFOUND when there is no such record (none, finished, or held
 * under a live lease), IDEM_EINVAL in a read, or a store error. */
IDEM_WARN_UNUSED int idem_tx_take_over(idem_tx_t *tx, const idem_scope_t *scope,
                                       int64_t lease_ms, idem_record_t *out);

/* The time (ms since the epoch) of the write the effect is part of: the
 * reservation's or completion's now_ms. */
int64_t idem_tx_now_ms(const idem_tx_t *tx);

/* How a record ends (or pauses): its new state and the response replays
 * will get. Borrowed. */
typedef struct idem_outcome {
  idem_state_t state;      /* COMPLETED, PENDING or FAILED */
  int status;              /* HTTP status to replay */
  const char *body;        /* response body to replay (JSON object) */
  const char *location;    /* may be NULL */
  const char *resource_id; /* what the request made; NULL: keep the record's */
  const char *provider_ref; /* its reference at an outside party; NULL: keep */
} idem_outcome_t;

/* One reservation. The outcome and the effect are optional; what is given
 * is written in the one transaction that wins the key. */
typedef struct idem_reserve {
  idem_scope_t scope;
  const char *fingerprint;
  const char *correlation_id;
  int64_t now_ms;
  int64_t lease_ms; /* how long a processing owner keeps the record */
  int64_t ttl_ms;   /* lifetime of completed and failed records */
  const char *resource_id;       /* stored with the record; may be NULL */
  const idem_outcome_t *outcome; /* complete at once (single-step ops) */
  idem_effect_t effect;          /* run when the key is won, before the outcome */
} idem_reserve_t;

typedef enum idem_reserve_result {
  IDEM_RESERVE_WON = 1, /* the key is ours; the record is new (or taken over) */
  IDEM_RESERVE_EXISTS   /* another request holds the key; see the record */
} idem_reserve_result_t;

/* Completion of a record this request owns. */
typedef struct idem_complete {
  idem_scope_t scope;
  const char *owner_token;
  int64_t now_ms;
  int64_t ttl_ms;
  idem_outcome_t outcome;
  /* The record's `row`, as its reservation returned it (0: unknown). A
   * hint: a store may find the record by it, but still completes it only
   * if it has this scope and owner, and looks the key up when it does not;
   * so any value is safe, a wrong one costs a statement. */
  int64_t row;
  idem_effect_t effect; /* run once the record is ours to complete, after it */
} idem_complete_t;

/* Counters a backend keeps about its writes. */
typedef struct idem_store_stats {
  uint64_t commits; /* write transactions committed (each one sync) */
  uint64_t writes;  /* writes they carried; writes / commits is the batch */
  uint64_t batch_reruns; /* batches run again write by write after a
                          * write failed (the others were rolled back) */
} idem_store_stats_t;

/* How the store's writes are doing, for a readiness check; times on the
 * idem_mono_ms() clock, 0 for never. */
typedef struct idem_store_health {
  int writing;            /* writes under way now */
  int64_t last_ok_ms;     /* the last that reached the database */
  int64_t last_failed_ms; /* the last that failed in the store (unreachable,
                           * disk full, locked past its timeout) */
  int64_t progress_ms;    /* the last time a write ended, or began with
                           * none under way: writing > 0 for long after it
                           * means the writes hang */
  int failing;            /* 1 when, of the writes that reached the
                           * database or failed in the store, the last to
                           * end failed (times of the same millisecond
                           * cannot tell) */
} idem_store_health_t;

/* A query over records, for support tools. */
typedef struct idem_records_query {
  int64_t tenant_id;
  idem_state_t state;      /* IDEM_STATE_NONE: any */
  int64_t updated_before;  /* only records last updated before this (ms); 0: any */
  int limit;               /* at most this many, newest first */
} idem_records_query_t;

typedef struct idem_store_options {
  int pool_size;       /* connections kept for concurrent callers; 0: default
                        * (PostgreSQL: at most this many open at once, 64) */
  int busy_timeout_ms; /* wait for another process's lock; 0: default */
  /* PostgreSQL: the bound on a database that hangs (0: 5000 ms; SQLite
   * ignores it). Each statement and each lock wait (statement_timeout,
   * lock_timeout), a connect (connect_timeout, at least libpq's 2 s) and
   * a wait for a free pooled connection are each bounded by it, and a
   * call whose connection has been out for twice it (a server that
   * stopped answering: it enforces its own timeouts no more) has its
   * socket shut down, so the call fails with IDEM_ESTORE and the
   * connection is replaced. TCP keepalives and tcp_user_timeout follow
   * it. Parameters in the URL win over these (docs/operations.md, "When
   * PostgreSQL hangs"). */
  int db_timeout_ms;
} idem_store_options_t;

/* The table of functions a backend provides. Wrappers document them. */
/* Called once an asynchronous write is over, with what the synchronous
 * form would have returned. It runs on a store thread: it must not wait,
 * nor make a synchronous write; it may start asynchronous ones. */
typedef void (*idem_store_done_fn)(void *arg, int rc);

typedef struct idem_store_methods {
  int version; /* 1 */
  const char *name;
  /* 1 when reads are local and never wait on writers or a network (SQLite
   * in WAL mode), so a caller with no time to wait may still read. */
  int local_reads;
  void (*close)(idem_store_t *);
  int (*start)(idem_store_t *); /* optional: background work, after open */
  int (*migrate)(idem_store_t *);
  int (*ping)(idem_store_t *);
  int (*reserve)(idem_store_t *, const idem_reserve_t *, idem_record_t *,
                 idem_reserve_result_t *);
  int (*complete)(idem_store_t *, const idem_complete_t *);
  int (*lookup)(idem_store_t *, const idem_scope_t *, int64_t now_ms,
                idem_record_t *);
  int (*meta_get_or_put)(idem_store_t *, const char *name, const char *value,
                         char **out);
  int (*sweep)(idem_store_t *, int64_t now_ms, int batch, int *deleted);
  int (*count)(idem_store_t *, const char *what, int64_t tenant_id, int64_t *n);
  int (*records_list)(idem_store_t *, const idem_records_query_t *,
                      idem_record_t *out, int *n);
  void (*stats)(idem_store_t *, idem_store_stats_t *); /* optional */
  int (*probe)(idem_store_t *);                        /* optional */
  /* optional: asynchronous reserve and complete */
  int (*reserve_async)(idem_store_t *, const idem_reserve_t *, idem_record_t *,
                       idem_reserve_result_t *, idem_store_done_fn, void *);
  int (*complete_async)(idem_store_t *, const idem_complete_t *, idem_store_done_fn,
                        void *);
  /* a write transaction, or a read, around a caller's function */
  int (*write)(idem_store_t *, const idem_effect_t *);
  int (*read)(idem_store_t *, const idem_effect_t *);
} idem_store_methods_t;

/* Opens the store named by `url`: "postgresql://..." or "postgres://..."
 * selects PostgreSQL, anything else is a SQLite file path. `opts` may be
 * NULL. Does not create the schema (see idem_store_migrate()). On success
 * `*out` owns the store (close with idem_store_close()); on failure `*out`
 * is NULL and idem_store_last_error() says why. */
IDEM_WARN_UNUSED int idem_store_open(const char *url,
                                     const idem_store_options_t *opts,
                                     idem_store_t **out);

/* Closes the store and frees it. Callers must have finished all calls. */
void idem_store_close(idem_store_t *store);

/* The backend's name ("sqlite", "postgresql"). */
const char *idem_store_backend(const idem_store_t *store);

/* 1 when the store's reads (lookup, count, ping, read) are served locally without waiting on writers or a network round
 * trip, so an event loop may make them inline; 0 when they may block. */
int idem_store_local_reads(const idem_store_t *store);

/* Follows notifications on `channel` (letters a-z, digits, '_'), sent by
 * any process on the database in a committed transaction (NOTIFY, or
 * pg_notify()), for a cache that must forget what another instance
 * changed (docs/scaling.md, "API keys on PostgreSQL"). The store's
 * listener thread calls `fn(arg, 1)` once its LISTEN on the channel has
 * succeeded and for each notification after; `fn(arg, 0)` when it lost
 * its connection: notifications may be missed until the next
 * `fn(arg, 1)`. Until the first call, the caller must assume it is not
 * listening. `fn` must be quick and must not call into the store. One
 * function per store: IDEM_EEXIST while one is set, or for a channel
 * other than the first one's; IDEM_EINVAL for a bad name. A NULL
 * `channel` removes `fn` with `arg` when they are the ones set; it is not
 * called after that returns. IDEM_ENOTSUP on a store without a listener
 * (SQLite). */
int idem_store_listen(idem_store_t *store, const char *channel,
                      void (*fn)(void *arg, int listening), void *arg);

/* 1 when the store has asynchronous forms of its reservation and
 * completion (idem_store_reserve_async(), idem_store_complete_async()):
 * both of idem's stores, whose writes go through a group commit; 0 when
 * they return IDEM_ENOTSUP (a backend without them). */
int idem_store_async_writes(const idem_store_t *store);

/* Creates or upgrades the schema to this program's version. Idempotent.
 * Returns IDEM_ESCHEMA if the database is newer than this program. */
IDEM_WARN_UNUSED int idem_store_migrate(idem_store_t *store);

/* Returns IDEM_OK when the store answers a trivial query. */
IDEM_WARN_UNUSED int idem_store_ping(idem_store_t *store);

/* Reserves `req->scope` in one atomic statement backed by the unique
 * constraint (never select-then-insert). A key with no record, an expired
 * record, or a failed record with the same fingerprint is won: `*result` is
 * IDEM_RESERVE_WON and `out` is the new processing record with its owner
 * token (or, with `req->outcome`, the completed record), and the effect
 * and outcome are committed in the same transaction. Otherwise
 * `*result` is IDEM_RESERVE_EXISTS, `out` is the record that holds the key,
 * and nothing was written. `out` must be reset by the caller either way. */
IDEM_WARN_UNUSED int idem_store_reserve(idem_store_t *store,
                                        const idem_reserve_t *req,
                                        idem_record_t *out,
                                        idem_reserve_result_t *result);

/* Moves a processing record, or a pending one taken over with
 * idem_tx_take_over(), to `c->outcome`, and runs `c->effect`, in one
 * transaction, only if `c->owner_token` still owns it. Returns IDEM_ELOST
 * when it does not (nothing written, the effect not run). The owner token
 * is cleared: a pending outcome leaves the record for the next take-over.
 * Wakes requests waiting on it. */
IDEM_WARN_UNUSED int idem_store_complete(idem_store_t *store,
                                         const idem_complete_t *c);

/* Asynchronous forms of idem_store_reserve() and idem_store_complete(),
 * for a caller that must not wait (an event thread). On IDEM_OK the write
 * is queued and done(arg, rc) is called exactly once, on a store thread,
 * once it is durable or has failed, with what the synchronous form would
 * have returned; everything `req` or `c` points at, and `out` and
 * `result`, must stay valid until then. Any other return means nothing
 * was queued and `done` will not be called: IDEM_ENOTSUP when the store
 * has no asynchronous writes (idem_store_async_writes()), else the error
 * the synchronous form would have returned at once. */
IDEM_WARN_UNUSED int idem_store_reserve_async(idem_store_t *store,
                                              const idem_reserve_t *req,
                                              idem_record_t *out,
                                              idem_reserve_result_t *result,
                                              idem_store_done_fn done, void *arg);
IDEM_WARN_UNUSED int idem_store_complete_async(idem_store_t *store,
                                               const idem_complete_t *c,
                                               idem_store_done_fn done, void *arg);

/* Runs e->fn(e->arg, tx) in a write transaction of its own, durable when
 * this returns IDEM_OK, and rolled back when it returns anything else
 * (which this returns): for a program's own schema and the writes that go
 * with no key. As for effects (above), it may run more than once and must
 * not wait; it joins the group commit (both stores). */
IDEM_WARN_UNUSED int idem_store_write(idem_store_t *store, const idem_effect_t *e);

/* Runs e->fn(e->arg, tx) with a connection for reads (on SQLite a reader,
 * which sees the last commit and never waits on the writer; on
 * PostgreSQL a pooled connection, outside any transaction) and returns
 * what it returns. Nothing it writes is guaranteed to stay. */
IDEM_WARN_UNUSED int idem_store_read(idem_store_t *store, const idem_effect_t *e);

/* Reads the live record of `scope` into `out` (reset it after). Returns
 * IDEM_ENOTFOUND when there is none or it expired at `now_ms`. */
IDEM_WARN_UNUSED int idem_store_lookup(idem_store_t *store,
                                       const idem_scope_t *scope,
                                       int64_t now_ms, idem_record_t *out);

/* Returns a ticket to pass to idem_store_wait(). Take it before reading the
 * record you intend to wait on, so a completion in between is not missed. */
uint64_t idem_store_watch(idem_store_t *store, const idem_scope_t *scope);

/* Sleeps until a record that hashes like `scope` changed since `ticket`, or
 * `timeout_ms` passed. Returns IDEM_OK (re-read the record; it may be
 * unchanged) or IDEM_ETIMEDOUT. Holds no lock of the store while asleep. */
int idem_store_wait(idem_store_t *store, const idem_scope_t *scope,
                    uint64_t ticket, int64_t timeout_ms);

/* A request parked until its key changes, holding no thread (see
 * idem_store_park()). The caller owns it and sets the two first fields;
 * the rest belongs to the store while it is parked. */
typedef struct idem_store_waiter {
  /* Called once, from the thread that changed the key or expired the
   * waiter; `timed_out` is 1 when its deadline passed. It must not wait,
   * and the store no longer refers to `w` once it is called. */
  void (*wake)(struct idem_store_waiter *w, int timed_out);
  int64_t deadline_ms; /* on the idem_mono_ms() clock */
  uint64_t hash;       /* the store's: of the scope it waits on */
  struct idem_store_waiter *next;
} idem_store_waiter_t;

/* Instead of sleeping in idem_store_wait(): parks `w` until `scope`'s
 * record changes (w->wake(w, 0); rarely another key with the same hash,
 * a spurious wake-up: read the record again) or
 * idem_store_expire_waiters() finds its deadline passed (w->wake(w, 1)).
 * Returns 0 when parked, or 1 when a record of its stripe changed since
 * `ticket` (nothing is parked and `wake` is not called: read again). */
int idem_store_park(idem_store_t *store, const idem_scope_t *scope,
                    uint64_t ticket, idem_store_waiter_t *w);

/* Wakes, as timed out, every parked waiter whose deadline is at or before
 * `now_ms` (INT64_MAX: all of them). Returns how many it woke. */
int idem_store_expire_waiters(idem_store_t *store, int64_t now_ms);

/* Stores `value` under `name` unless a value is there already, then reads
 * the value that won into `*out` (malloc'd; caller frees). Safe when many
 * processes race on first start. */
IDEM_WARN_UNUSED int idem_store_meta_get_or_put(idem_store_t *store,
                                                const char *name,
                                                const char *value, char **out);

/* Deletes up to `batch` completed or failed records that expired at
 * `now_ms` (never pending or processing ones); `*deleted` gets the count. */
IDEM_WARN_UNUSED int idem_store_sweep(idem_store_t *store, int64_t now_ms,
                                      int batch, int *deleted);

/* Counts records for tests, tools and metrics: `what` is "records",
 * "processing" or "pending"; or
 * "oldest_pending", the creation time (ms) of the oldest pending record, 0
 * when there is none. `tenant_id` 0 means all tenants. */
IDEM_WARN_UNUSED int idem_store_count(idem_store_t *store, const char *what,
                                      int64_t tenant_id, int64_t *n);

/* Lists records of one tenant matching `q` (at most q->limit, which must
 * not exceed the size of `out`), most recently updated first, whatever
 * their expiry. `*n` gets the count; reset each record after use. */
IDEM_WARN_UNUSED int idem_store_records_list(idem_store_t *store,
                                             const idem_records_query_t *q,
                                             idem_record_t *out, int *n);

/* Fills `out` with how the writes of records made through this handle
 * are doing: every reservation, completion and probe, asynchronous ones
 * until their callback. A caller's own write (idem_store_write()) counts
 * only when it fails in the store: it may touch only the caller's tables,
 * which a lock on the records table leaves writable. Never blocks. */
void idem_store_health(idem_store_t *store, idem_store_health_t *out);

/* A write of the store's own that changes a row, so that it needs the
 * write lock and room on disk like any other, through the path every write
 * takes (SQLite: the group commit); durable when it returns IDEM_OK. For a
 * readiness check while no other write tells how writes are doing.
 * IDEM_ENOTSUP on a backend without it. */
IDEM_WARN_UNUSED int idem_store_probe(idem_store_t *store);

/* Fills `out` with the backend's write counters (zeros when it keeps
 * none). Cheap: safe to call on every metrics scrape. */
void idem_store_stats(idem_store_t *store, idem_store_stats_t *out);

/* The last backend error message seen by this thread, for logs only:
 * it may hold SQL or library text and must never reach an HTTP body. */
const char *idem_store_last_error(void);

#ifdef __cplusplus
}
#endif
#endif
