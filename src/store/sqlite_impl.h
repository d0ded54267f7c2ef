/* Internal to the SQLite store: the handle, a pooled connection, a queued
 * write, and the functions its files (sqlite.c, sqlite_schema.c,
 * sqlite_writer.c) share. Nothing outside src/store/sqlite*.c includes it. */
#ifndef IDEM_STORE_SQLITE_IMPL_H
#define IDEM_STORE_SQLITE_IMPL_H

#include "store_impl.h"

#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sqlite3.h>

/* The statements every connection prepares once (sqlite.c's stmt_sql). */
enum stmt_id {
  ST_BEGIN,
  ST_COMMIT,
  ST_ROLLBACK,
  ST_RESERVE,
  ST_READ_RECORD,
  ST_COMPLETE,
  ST_COMPLETE_ROW,
  ST_META_PUT,
  ST_META_GET,
  ST_SWEEP,
  ST_PING,
  ST_SAVEPOINT,
  ST_ROLLBACK_TO,
  ST_RELEASE,
  ST_RECORDS_LIST,
  ST_TAKE_OVER,
  ST_PROBE,
  ST_COUNT_
};

struct conn {
  sqlite3 *db;
  sqlite3_stmt *st[ST_COUNT_];
  /* The caller's (idem_tx_statement()), with the SQL each was made from. */
  sqlite3_stmt *caller_st[IDEM_TX_STATEMENTS];
  const char *caller_sql[IDEM_TX_STATEMENTS];
  struct conn *next;
};

/* A write waiting for the group-commit writer. A synchronous caller
 * sleeps on `done` alone, so a commit wakes exactly the callers of its
 * batch; an asynchronous one is called back (`cb`) by the writer. */
struct job {
  int (*fn)(struct conn *, void *);
  void *arg;
  int rc;
  /* fn may run again after a rollback: it sets every output it has and
   * holds nothing from an earlier run (reservations and completions). */
  int rerunnable;
  sem_t done;
  /* Asynchronous: called after the commit; the job was malloc'd, first in
   * its block, and the writer frees the block before calling. */
  idem_store_done_fn cb;
  void *cb_arg;
  /* Its caller answers a request once told (a completion, a single-step
   * reservation, a synchronous caller): told before the batch's other
   * writes, whose callbacks go on to slower work (a provider call). */
  int answers;
  struct job *next;
};

typedef struct sqlite_store {
  struct idem_store base;
  char *path;
  int busy_timeout_ms;
  pthread_mutex_t pool_lock;
  struct conn *free_conns;
  pthread_mutex_t write_lock; /* one write transaction at a time */

  /* Group commit (sqlite_writer.c): callers queue their writes and sleep;
   * one writer thread runs the queued writes in one transaction and one
   * fsync, then wakes each of their callers. */
  pthread_mutex_t q_lock;
  pthread_cond_t q_ready; /* the writer waits for work */
  struct job *q_head, *q_tail;
  int stopping;
  int writer_running;
  pthread_t writer;
  atomic_uint_fast64_t commits, writes, batch_reruns;
} sqlite_store_t;

/* sqlite.c */

/* Maps a SQLite result code `rc` on `db` (NULL: none open) to an idem
 * error, recording the message for the log (idem__store_set_error). */
int idem__sqlite_fail(sqlite3 *db, int rc, const char *what);

/* Runs `sql` (no rows wanted) on `db`; returns a SQLite result code, the
 * message recorded on failure. */
int idem__sqlite_exec(sqlite3 *db, const char *sql);

/* Takes a connection from the pool, or opens one (WAL, synchronous=FULL,
 * foreign keys on); the caller gives it back with idem__sqlite_conn_put(). */
int idem__sqlite_conn_get(sqlite_store_t *s, struct conn **out);

/* Gives `c`, which holds no open transaction, back to the pool. */
void idem__sqlite_conn_put(sqlite_store_t *s, struct conn *c);

/* The prepared statement `id` of `c`, reset and unbound (prepared on first
 * use); NULL, the error recorded, when it cannot be prepared. */
sqlite3_stmt *idem__sqlite_stmt(struct conn *c, enum stmt_id id);

/* Steps `st`, a statement that returns no rows, to completion and resets
 * it: IDEM_OK, or the error as idem__sqlite_fail() maps it. */
int idem__sqlite_run(struct conn *c, sqlite3_stmt *st, const char *what);

/* sqlite_writer.c */

/* Begins a write transaction on `c` (BEGIN IMMEDIATE), holding s->write_lock
 * until idem__sqlite_write_end(); on failure the lock is released. */
int idem__sqlite_write_begin(sqlite_store_t *s, struct conn *c);

/* Commits (`ok`) or rolls back the transaction idem__sqlite_write_begin()
 * began, and releases s->write_lock; a failed COMMIT rolls back too. */
int idem__sqlite_write_end(sqlite_store_t *s, struct conn *c, int ok);

/* Queues `j` for the writer thread and returns at once; the writer sets
 * j->rc and tells the caller after the commit (j->cb, or j->done). */
void idem__sqlite_enqueue(sqlite_store_t *s, struct job *j);

/* Runs `fn` through the writer thread and waits until its transaction is
 * committed: IDEM_OK only when it is durable, else the error and nothing
 * kept. `rerunnable`: `fn` may run twice (struct job). Not from the writer. */
int idem__sqlite_write_job(sqlite_store_t *s, int (*fn)(struct conn *, void *),
                           void *arg, int rerunnable);

/* idem__sqlite_write_job() for a write that must run only once. */
int idem__sqlite_write_tx(sqlite_store_t *s, int (*fn)(struct conn *, void *),
                          void *arg);

/* Starts the writer thread of `s` (its queue's lock and condition already
 * initialised): IDEM_OK, or IDEM_ENOMEM with no thread started. */
int idem__sqlite_writer_start(sqlite_store_t *s);

/* Stops the writer thread, if started, once every queued write has run. */
void idem__sqlite_writer_stop(sqlite_store_t *s);

/* sqlite_schema.c */

/* The store's migrate method: applies every schema version this program
 * has that the database lacks, all in one transaction. */
int idem__sqlite_migrate(idem_store_t *base);

#endif
