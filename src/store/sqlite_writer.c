/* The SQLite store's group-commit writer. Every write of the store is a
 * job queued here, and one writer thread per store runs them: it takes up
 * to MAX_BATCH queued jobs at a time and runs them on its own connection
 * in one transaction with one COMMIT (one fsync) for all, while the next
 * batch queues. A write that fails is undone alone, in its own savepoint
 * (a batch whose writes may all run twice runs without savepoints first,
 * and again with them only if one fails); a failed COMMIT fails the whole
 * batch. Callers are told their results only after the COMMIT, those that
 * answer a request first. The transaction's begin and end, which
 * migrations use too, take the store's write_lock. */
#define _GNU_SOURCE /* pthread_setname_np */
#include "sqlite_impl.h"

#include <pthread.h>
#include <stdlib.h>

#define BUSY_RETRIES 50

#define MAX_BATCH 256

/* Begins a write transaction: the process's write lock, then SQLite's.
 * BEGIN IMMEDIATE can still meet another process's writer; the busy
 * timeout waits for it and we retry a bounded number of times. */
int idem__sqlite_write_begin(sqlite_store_t *s, struct conn *c) {
  int rc = SQLITE_BUSY;
  pthread_mutex_lock(&s->write_lock);
  for (int i = 0; i < BUSY_RETRIES; i++) {
    sqlite3_stmt *st = idem__sqlite_stmt(c, ST_BEGIN);
    if (st == NULL)
      break;
    rc = sqlite3_step(st);
    sqlite3_reset(st);
    if (rc == SQLITE_DONE)
      return IDEM_OK;
    if ((rc & 0xff) != SQLITE_BUSY && (rc & 0xff) != SQLITE_LOCKED)
      break;
  }
  pthread_mutex_unlock(&s->write_lock);
  return idem__sqlite_fail(c->db, rc, "begin");
}

int idem__sqlite_write_end(sqlite_store_t *s, struct conn *c, int ok) {
  int rc = IDEM_OK;
  if (ok) {
    sqlite3_stmt *st = idem__sqlite_stmt(c, ST_COMMIT);
    int src = st ? sqlite3_step(st) : SQLITE_ERROR;
    if (st)
      sqlite3_reset(st);
    if (src != SQLITE_DONE) {
      rc = idem__sqlite_fail(c->db, src, "commit");
      ok = 0;
    }
  }
  if (!ok && sqlite3_get_autocommit(c->db) == 0) {
    sqlite3_stmt *st = idem__sqlite_stmt(c, ST_ROLLBACK);
    if (st) {
      sqlite3_step(st);
      sqlite3_reset(st);
    }
  }
  pthread_mutex_unlock(&s->write_lock);
  return rc;
}

/* Runs one statement of the savepoint family on the writer's connection. */
static int savepoint(struct conn *c, enum stmt_id id) {
  sqlite3_stmt *st = idem__sqlite_stmt(c, id);
  return st ? idem__sqlite_run(c, st, "savepoint") : IDEM_ESTORE;
}

/* Runs the batch's writes one after the other, with nothing to undo one
 * alone. Returns 1 when all succeeded (the transaction stays open for the
 * COMMIT), 0 when one failed (the transaction is rolled back, and the
 * batch must run again write by write). */
static int run_batch_whole(sqlite_store_t *s, struct conn *c, struct job *jobs) {
  for (struct job *j = jobs; j; j = j->next) {
    j->rc = j->fn(c, j->arg);
    /* IDEM_ELOST (a lease lost) is returned with nothing written: it is
     * that write's result, not a failure to undo. */
    if (j->rc != IDEM_OK && j->rc != IDEM_ELOST) {
      (void)idem__sqlite_write_end(s, c, 0);
      return 0;
    }
  }
  return 1;
}

/* Runs a batch of writes in one transaction, with one COMMIT (one fsync)
 * for all; a failed COMMIT fails every write of the batch. A write that
 * fails is undone alone: each runs in its own savepoint. Savepoints cost
 * every write two statements and a copy of each page it changes again
 * (the statement journal), and a write almost never fails, so a batch of
 * writes that may run twice runs without them first; only if one of its
 * writes fails is the whole transaction rolled back and the batch run
 * again with savepoints. */
static void run_batch(sqlite_store_t *s, struct conn *c, struct job *jobs) {
  int rc = idem__sqlite_write_begin(s, c);
  int whole = 1;

  for (struct job *j = jobs; j && whole; j = j->next)
    whole = j->rerunnable;
  if (rc == IDEM_OK && whole) {
    if (run_batch_whole(s, c, jobs))
      goto commit;
    atomic_fetch_add(&s->batch_reruns, 1);
    rc = idem__sqlite_write_begin(s, c);
  }
  if (rc != IDEM_OK) {
    for (struct job *j = jobs; j; j = j->next)
      j->rc = rc;
    return;
  }
  for (struct job *j = jobs; j; j = j->next) {
    /* Some errors (a full disk, I/O, memory) make SQLite roll back the
     * whole transaction. A SAVEPOINT would then start a new one, which
     * its RELEASE would commit: the rest fail unrun instead (and the
     * writes before, undone with it, fail at the COMMIT). */
    if (sqlite3_get_autocommit(c->db)) {
      j->rc = IDEM_ESTORE;
      continue;
    }
    if ((j->rc = savepoint(c, ST_SAVEPOINT)) != IDEM_OK)
      continue;
    j->rc = j->fn(c, j->arg);
    if (j->rc != IDEM_OK && savepoint(c, ST_ROLLBACK_TO) != IDEM_OK)
      j->rc = IDEM_ESTORE;
    if (savepoint(c, ST_RELEASE) != IDEM_OK && j->rc == IDEM_OK)
      j->rc = IDEM_ESTORE;
  }
commit:
  rc = idem__sqlite_write_end(s, c, 1);
  for (struct job *j = jobs; j; j = j->next)
    if (rc != IDEM_OK && j->rc == IDEM_OK)
      j->rc = rc;
}

/* The writer's connection. Its transactions never spill changed pages
 * into the WAL before their COMMIT (cache_spill off): SQLite 3.40.1
 * (Debian 12's) can lose committed transactions in a crash after a
 * ROLLBACK TO in a transaction whose spilled frames were then rewritten
 * in place (the WAL's checksum chain breaks, and recovery stops there).
 * A batch rolls back to a savepoint whenever one of its writes fails, so
 * it must not spill. A standalone reproduction with SQLite alone kept 1
 * of 101 committed rows after a simulated crash; with cache_spill off,
 * all of them. The cost is memory: a transaction's changed pages stay in
 * memory until its COMMIT, and a batch holds at most MAX_BATCH writes,
 * each bounded by the request size limits (a sweep by its batch size). */
static int writer_conn(sqlite_store_t *s, struct conn **out) {
  int rc = idem__sqlite_conn_get(s, out);
  if (rc == IDEM_OK &&
      idem__sqlite_exec((*out)->db, "PRAGMA cache_spill = OFF") != SQLITE_OK) {
    idem__sqlite_conn_put(s, *out);
    *out = NULL;
    rc = IDEM_ESTORE;
  }
  return rc;
}

/* Tells one write's caller its result. The job may be gone once told. */
static void tell(struct job *j) {
  if (j->cb) {
    idem_store_done_fn cb = j->cb;
    void *cb_arg = j->cb_arg;
    int rc = j->rc;
    free(j);
    cb(cb_arg, rc); /* may queue more writes: q_lock is not held */
  } else {
    sem_post(&j->done);
  }
}

/* Tells a committed batch's callers, those that answer a request first:
 * their answers go out while the writer makes the rest's provider calls
 * (three alternating pairs: 2.7-3.1 % more payments/s, a completion 40 us
 * sooner on average; docs/performance.md). */
static void tell_callers(struct job *batch) {
  struct job *rest = NULL, **tail = &rest;

  for (struct job *j = batch, *next; j; j = next) {
    next = j->next;
    if (j->answers) {
      tell(j);
    } else {
      *tail = j;
      tail = &j->next;
    }
  }
  *tail = NULL;
  for (struct job *j = rest, *next; j; j = next) {
    next = j->next;
    tell(j);
  }
}

static void *writer_loop(void *arg) {
  sqlite_store_t *s = arg;
  struct conn *c = NULL;

  pthread_setname_np(pthread_self(), "idem-writer"); /* for top -H, perf */

  pthread_mutex_lock(&s->q_lock);
  for (;;) {
    struct job *batch, *last;
    int n = 1, rc;

    while (s->q_head == NULL && !s->stopping)
      pthread_cond_wait(&s->q_ready, &s->q_lock);
    if (s->q_head == NULL)
      break; /* stopping, and every queued write has run */
    /* Take what is queued now: while this batch syncs, the next forms. */
    batch = last = s->q_head;
    while (last->next && n < MAX_BATCH) {
      last = last->next;
      n++;
    }
    s->q_head = last->next;
    if (s->q_head == NULL)
      s->q_tail = NULL;
    last->next = NULL;
    pthread_mutex_unlock(&s->q_lock);

    if (c == NULL && (rc = writer_conn(s, &c)) != IDEM_OK) {
      for (struct job *j = batch; j; j = j->next)
        j->rc = rc;
    } else {
      run_batch(s, c, batch);
      atomic_fetch_add(&s->commits, 1);
      atomic_fetch_add(&s->writes, (uint_fast64_t)n);
    }

    tell_callers(batch);
    pthread_mutex_lock(&s->q_lock);
  }
  pthread_mutex_unlock(&s->q_lock);
  if (c)
    idem__sqlite_conn_put(s, c);
  return NULL;
}

void idem__sqlite_enqueue(sqlite_store_t *s, struct job *j) {
  int idle;

  j->next = NULL;
  pthread_mutex_lock(&s->q_lock);
  idle = s->q_head == NULL; /* else the writer will find it queued */
  if (s->q_tail)
    s->q_tail->next = j;
  else
    s->q_head = j;
  s->q_tail = j;
  pthread_mutex_unlock(&s->q_lock);
  if (idle)
    pthread_cond_signal(&s->q_ready);
}

/* Runs `fn` in a write transaction and returns once it is durable: IDEM_OK
 * when it returned IDEM_OK and the commit reached the disk; otherwise its
 * error, and nothing it did is kept. Every write of the store goes through
 * here, and through the writer thread, which commits many at a time. */
int idem__sqlite_write_job(sqlite_store_t *s, int (*fn)(struct conn *, void *), void *arg,
                           int rerunnable) {
  struct job j = {.fn = fn, .arg = arg, .rc = IDEM_OK, .rerunnable = rerunnable,
                  .answers = 1};

  if (s->writer_running && pthread_equal(pthread_self(), s->writer)) {
    /* A done callback that writes synchronously would wait on itself
     * forever (store.h forbids it): fail loudly instead. */
    idem__store_set_error("synchronous write from the writer thread");
    return IDEM_EINVAL;
  }
  sem_init(&j.done, 0, 0);
  idem__sqlite_enqueue(s, &j);
  while (sem_wait(&j.done) != 0) /* EINTR only */
    ;
  sem_destroy(&j.done);
  return j.rc;
}

int idem__sqlite_write_tx(sqlite_store_t *s, int (*fn)(struct conn *, void *),
                          void *arg) {
  return idem__sqlite_write_job(s, fn, arg, 0);
}

int idem__sqlite_writer_start(sqlite_store_t *s) {
  if (pthread_create(&s->writer, NULL, writer_loop, s) != 0)
    return IDEM_ENOMEM;
  s->writer_running = 1;
  return IDEM_OK;
}

void idem__sqlite_writer_stop(sqlite_store_t *s) {
  if (s->writer_running) {
    pthread_mutex_lock(&s->q_lock);
    s->stopping = 1;
    pthread_cond_signal(&s->q_ready);
    pthread_mutex_unlock(&s->q_lock);
    pthread_join(s->writer, NULL);
  }
}
