/* idem's SQLite VFS: the default one, except that writes to a write-ahead
 * log are gathered in memory and reach the file in one pwrite when SQLite
 * syncs it.
 *
 * Why: SQLite writes each WAL frame as two pwrites (its 24-byte header,
 * then the page), so a commit of 30 frames was 60 system calls before its
 * fdatasync; one pwrite of the same bytes costs the writer thread about a
 * third of the time (docs/performance.md).
 *
 * Why it is safe: the WAL never holds less than the default VFS would
 * have written at any point where that could be observed.
 * - Writes are gathered only for a connection whose commits sync the WAL
 *   (PRAGMA synchronous=FULL or EXTRA, as idem's store sets it), and a
 *   sync writes the gathered bytes first. A commit syncs before it
 *   publishes its frames in the WAL index, so other connections, which
 *   read the WAL through their own file handles, only ever look at
 *   frames that are in the file; and a failed write fails the commit.
 *   Under a weaker setting SQLite would publish frames with no call on
 *   the WAL that could report a failed write: nothing is gathered then.
 * - A connection reading its own WAL (frames spilled from its cache
 *   mid-transaction, a checkpoint), asking its size, truncating it, or
 *   closing it, gets the gathered bytes written first.
 * - Only contiguous writes are gathered: a write anywhere else writes what
 *   was gathered first, so the file sees writes in SQLite's order.
 * - Nothing is gathered after a sync until the connection's write
 *   transaction ends: without powersafe overwrite (a "psow=0" URI), SQLite
 *   pads a commit to a sector boundary and syncs in the middle of its
 *   last frame, writes the rest of it, and then publishes the frames; so
 *   a write after the sync goes straight to the file, and its failure
 *   fails the commit, as with the default VFS.
 * - Gathered bytes never outlive a lock of the connection: they are
 *   written before it gives up the WAL's write lock or its lock on the
 *   database file, as the default VFS would have written them while it
 *   held the lock. Held there, they are a rolled-back transaction's
 *   spilled frames (a commit syncs): if that write fails they are
 *   dropped, never written later over frames another writer committed.
 * - A failed write keeps the bytes gathered, so the sync or read that
 *   tried it fails and any later one writes them again: no commit can
 *   succeed without them.
 * The main database file, its -shm index and any other file go straight
 * through. */
#include "sqlite_vfs.h"

#include <pthread.h>
#include <sqlite3.h>
#include <stdlib.h>
#include <string.h>

/* Gathered bytes per WAL handle: 30 frames of 4 KiB pages. A larger
 * commit is written in pieces of at most this size, because the unix VFS
 * writes at most 128 KiB - 1 per call (more fails with SQLITE_FULL; see
 * configure_sqlite() in sqlite.c). */
#define GATHER_BYTES (124 * 1024)

typedef struct gather_file gather_file_t;

struct gather_file {
  sqlite3_file base;
  sqlite3_file *real; /* the default VFS's file, allocated right after */
  int wal;            /* gather this file's writes */
  char *buf;          /* GATHER_BYTES, made on the first write */
  size_t len;         /* bytes gathered */
  sqlite3_int64 at;   /* their offset in the file */
  /* A connection's main database file and its WAL, linked both ways: the
   * database file's shared-memory calls act on the WAL's bytes. Both are
   * used by that connection only, one thread at a time. */
  gather_file_t *peer;
  const char *name;    /* a main database: the name SQLite opened it by */
  gather_file_t *next; /* in `open_dbs` */
  int syncs_commits;   /* a main database: synchronous is FULL or EXTRA */
  int synced;          /* a WAL synced in this write transaction */
};

/* Main database files open through this VFS, for their WALs to find.
 * SQLite opens a WAL by a name from the same allocation as its
 * database's (sqlite3_filename_database() finds the latter), so the
 * pointer identifies the connection. */
static pthread_mutex_t open_dbs_lock = PTHREAD_MUTEX_INITIALIZER;
static gather_file_t *open_dbs;

/* WAL_WRITE_LOCK in SQLite's wal.c: the first shared-memory lock. */
#define WAL_WRITE_LOCK 0

static sqlite3_vfs gather_vfs;
static sqlite3_vfs *real_vfs;
static sqlite3_io_methods gather_io;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int register_rc = SQLITE_ERROR;

#define REAL(f) (((gather_file_t *)(f))->real)
#define RIO(f) (REAL(f)->pMethods)

/* Writes what was gathered. On failure the bytes stay, for the next try. */
static int flush(gather_file_t *g) {
  int rc;
  if (g->len == 0)
    return SQLITE_OK;
  rc = g->real->pMethods->xWrite(g->real, g->buf, (int)g->len, g->at);
  if (rc == SQLITE_OK)
    g->len = 0;
  return rc;
}

static int g_close(sqlite3_file *f) {
  gather_file_t *g = (gather_file_t *)f;
  int rc = SQLITE_OK, rc2;

  rc = flush(g); /* nothing held unless a WAL */
  if (g->name) {
    pthread_mutex_lock(&open_dbs_lock);
    for (gather_file_t **p = &open_dbs; *p; p = &(*p)->next)
      if (*p == g) {
        *p = g->next;
        break;
      }
    pthread_mutex_unlock(&open_dbs_lock);
  }
  if (g->peer)
    g->peer->peer = NULL;
  rc2 = RIO(f)->xClose(g->real);
  free(g->buf);
  g->buf = NULL;
  return rc != SQLITE_OK ? rc : rc2;
}

static int g_read(sqlite3_file *f, void *p, int n, sqlite3_int64 off) {
  int rc = flush((gather_file_t *)f);
  return rc != SQLITE_OK ? rc : RIO(f)->xRead(REAL(f), p, n, off);
}

static int g_write(sqlite3_file *f, const void *p, int n, sqlite3_int64 off) {
  gather_file_t *g = (gather_file_t *)f;
  int gather = g->wal && !g->synced && g->peer && g->peer->syncs_commits && n > 0;
  int rc;

  if (g->len > 0 && (!gather || off != g->at + (sqlite3_int64)g->len ||
                     g->len + (size_t)n > GATHER_BYTES)) {
    if ((rc = flush(g)) != SQLITE_OK)
      return rc;
  }
  if (!gather || (size_t)n > GATHER_BYTES)
    return RIO(f)->xWrite(g->real, p, n, off);
  if (g->buf == NULL && (g->buf = malloc(GATHER_BYTES)) == NULL)
    return RIO(f)->xWrite(g->real, p, n, off);
  if (g->len == 0)
    g->at = off;
  memcpy(g->buf + g->len, p, (size_t)n);
  g->len += (size_t)n;
  return SQLITE_OK;
}

static int g_truncate(sqlite3_file *f, sqlite3_int64 size) {
  int rc = flush((gather_file_t *)f);
  return rc != SQLITE_OK ? rc : RIO(f)->xTruncate(REAL(f), size);
}

static int g_sync(sqlite3_file *f, int flags) {
  gather_file_t *g = (gather_file_t *)f;
  int rc = flush(g);
  if (rc == SQLITE_OK && (rc = RIO(f)->xSync(REAL(f), flags)) == SQLITE_OK && g->wal)
    g->synced = 1;
  return rc;
}

static int g_file_size(sqlite3_file *f, sqlite3_int64 *size) {
  int rc = flush((gather_file_t *)f);
  return rc != SQLITE_OK ? rc : RIO(f)->xFileSize(REAL(f), size);
}

static int g_lock(sqlite3_file *f, int lock) { return RIO(f)->xLock(REAL(f), lock); }

/* Before a connection gives up a lock (see the header comment). */
static void settle_before_unlock(gather_file_t *db) {
  if (db->peer == NULL)
    return;
  if (flush(db->peer) != SQLITE_OK)
    db->peer->len = 0;
  db->peer->synced = 0;
}

/* On a main database file: in exclusive locking mode, where the WAL's
 * write lock is never taken in shared memory, this is where a
 * connection's write transaction ends. */
static int g_unlock(sqlite3_file *f, int lock) {
  settle_before_unlock((gather_file_t *)f);
  return RIO(f)->xUnlock(REAL(f), lock);
}

static int g_check_reserved(sqlite3_file *f, int *out) {
  return RIO(f)->xCheckReservedLock(REAL(f), out);
}

/* Whether PRAGMA synchronous = `value` makes every commit sync the WAL. */
static int syncs_commits(const char *value) {
  return sqlite3_stricmp(value, "full") == 0 || sqlite3_stricmp(value, "extra") == 0 ||
         (value[0] >= '2' && value[0] <= '3' && value[1] == '\0');
}

/* Any file control on the WAL sees the file as SQLite wrote it. On a main
 * database file, a PRAGMA synchronous that sets a value is noted (SQLite
 * passes every PRAGMA here first, then runs it when this returns
 * SQLITE_NOTFOUND, as the unix VFS's does). */
static int g_file_control(sqlite3_file *f, int op, void *arg) {
  gather_file_t *g = (gather_file_t *)f;
  int rc = flush(g);

  if (rc != SQLITE_OK)
    return rc;
  if (op == SQLITE_FCNTL_PRAGMA && g->name != NULL) {
    char **a = arg; /* a[1]: the pragma's name, a[2]: its value or NULL */
    if (a[1] != NULL && a[2] != NULL && sqlite3_stricmp(a[1], "synchronous") == 0) {
      g->syncs_commits = syncs_commits(a[2]);
      if (g->peer && !g->syncs_commits && (rc = flush(g->peer)) != SQLITE_OK)
        return rc;
    }
  }
  return RIO(f)->xFileControl(REAL(f), op, arg);
}

static int g_sector_size(sqlite3_file *f) { return RIO(f)->xSectorSize(REAL(f)); }

static int g_device_characteristics(sqlite3_file *f) {
  return RIO(f)->xDeviceCharacteristics(REAL(f));
}

static int g_shm_map(sqlite3_file *f, int region, int size, int extend, void volatile **p) {
  return RIO(f)->xShmMap(REAL(f), region, size, extend, p);
}

/* On a main database file. Taking the WAL's write lock begins the
 * connection's write transaction; giving it up ends it. */
static int g_shm_lock(sqlite3_file *f, int offset, int n, int flags) {
  gather_file_t *db = (gather_file_t *)f;
  int write_lock = offset <= WAL_WRITE_LOCK && WAL_WRITE_LOCK < offset + n, rc;

  if ((flags & SQLITE_SHM_UNLOCK) && write_lock)
    settle_before_unlock(db);
  rc = RIO(f)->xShmLock(REAL(f), offset, n, flags);
  /* A write transaction begins: a checkpoint's sync since the last one
   * (checkpoints run outside the write lock) does not stop gathering. */
  if (rc == SQLITE_OK && (flags & SQLITE_SHM_LOCK) && write_lock && db->peer)
    db->peer->synced = 0;
  return rc;
}

static void g_shm_barrier(sqlite3_file *f) { RIO(f)->xShmBarrier(REAL(f)); }

static int g_shm_unmap(sqlite3_file *f, int delete_flag) {
  return RIO(f)->xShmUnmap(REAL(f), delete_flag);
}

static int g_fetch(sqlite3_file *f, sqlite3_int64 off, int n, void **p) {
  return RIO(f)->xFetch(REAL(f), off, n, p);
}

static int g_unfetch(sqlite3_file *f, sqlite3_int64 off, void *p) {
  return RIO(f)->xUnfetch(REAL(f), off, p);
}

static int g_open(sqlite3_vfs *vfs, const char *name, sqlite3_file *f, int flags,
                  int *out_flags) {
  gather_file_t *g = (gather_file_t *)f;
  int rc;

  (void)vfs;
  memset(g, 0, sizeof *g);
  g->real = (sqlite3_file *)(g + 1);
  rc = real_vfs->xOpen(real_vfs, name, g->real, flags, out_flags);
  if (rc != SQLITE_OK || g->real->pMethods == NULL) {
    /* SQLite closes a file whose open failed only if it has methods. */
    if (g->real->pMethods != NULL)
      g->real->pMethods->xClose(g->real);
    g->base.pMethods = NULL;
    return rc != SQLITE_OK ? rc : SQLITE_CANTOPEN;
  }
  /* gather_io offers every method of version 3 (shared memory, mmap):
   * a real file without them (not the unix VFS's) cannot be opened. */
  if (g->real->pMethods->iVersion < gather_io.iVersion) {
    g->real->pMethods->xClose(g->real);
    g->base.pMethods = NULL;
    return SQLITE_CANTOPEN;
  }
  g->wal = (flags & SQLITE_OPEN_WAL) != 0;
  g->base.pMethods = &gather_io;
  if ((flags & SQLITE_OPEN_MAIN_DB) && name != NULL) {
    g->name = name;
    pthread_mutex_lock(&open_dbs_lock);
    g->next = open_dbs;
    open_dbs = g;
    pthread_mutex_unlock(&open_dbs_lock);
  } else if (g->wal && name != NULL) {
    const char *db = sqlite3_filename_database(name);
    pthread_mutex_lock(&open_dbs_lock);
    for (gather_file_t *d = open_dbs; d; d = d->next)
      if (d->name == db) {
        d->peer = g;
        g->peer = d;
        break;
      }
    pthread_mutex_unlock(&open_dbs_lock);
    /* Not found (not expected): without a peer nothing is gathered (see
     * g_write), since nothing would settle a rolled-back transaction's
     * bytes. */
  }
  return SQLITE_OK;
}

/* The rest of the VFS is the default one's, called with its own handle. */
static int v_delete(sqlite3_vfs *vfs, const char *name, int sync_dir) {
  (void)vfs;
  return real_vfs->xDelete(real_vfs, name, sync_dir);
}

static int v_access(sqlite3_vfs *vfs, const char *name, int flags, int *out) {
  (void)vfs;
  return real_vfs->xAccess(real_vfs, name, flags, out);
}

static int v_full_pathname(sqlite3_vfs *vfs, const char *name, int n, char *out) {
  (void)vfs;
  return real_vfs->xFullPathname(real_vfs, name, n, out);
}

static void *v_dlopen(sqlite3_vfs *vfs, const char *name) {
  (void)vfs;
  return real_vfs->xDlOpen(real_vfs, name);
}

static void v_dlerror(sqlite3_vfs *vfs, int n, char *out) {
  (void)vfs;
  real_vfs->xDlError(real_vfs, n, out);
}

static void (*v_dlsym(sqlite3_vfs *vfs, void *h, const char *sym))(void) {
  (void)vfs;
  return real_vfs->xDlSym(real_vfs, h, sym);
}

static void v_dlclose(sqlite3_vfs *vfs, void *h) {
  (void)vfs;
  real_vfs->xDlClose(real_vfs, h);
}

static int v_randomness(sqlite3_vfs *vfs, int n, char *out) {
  (void)vfs;
  return real_vfs->xRandomness(real_vfs, n, out);
}

static int v_sleep(sqlite3_vfs *vfs, int us) {
  (void)vfs;
  return real_vfs->xSleep(real_vfs, us);
}

static int v_current_time(sqlite3_vfs *vfs, double *out) {
  (void)vfs;
  return real_vfs->xCurrentTime(real_vfs, out);
}

static int v_last_error(sqlite3_vfs *vfs, int n, char *out) {
  (void)vfs;
  return real_vfs->xGetLastError(real_vfs, n, out);
}

static int v_current_time_int64(sqlite3_vfs *vfs, sqlite3_int64 *out) {
  (void)vfs;
  return real_vfs->xCurrentTimeInt64(real_vfs, out);
}

static void register_once(void) {
  real_vfs = sqlite3_vfs_find(NULL);
  if (real_vfs == NULL || real_vfs->iVersion < 2)
    return;
  gather_io = (sqlite3_io_methods){
      .iVersion = 3,
      .xClose = g_close,
      .xRead = g_read,
      .xWrite = g_write,
      .xTruncate = g_truncate,
      .xSync = g_sync,
      .xFileSize = g_file_size,
      .xLock = g_lock,
      .xUnlock = g_unlock,
      .xCheckReservedLock = g_check_reserved,
      .xFileControl = g_file_control,
      .xSectorSize = g_sector_size,
      .xDeviceCharacteristics = g_device_characteristics,
      .xShmMap = g_shm_map,
      .xShmLock = g_shm_lock,
      .xShmBarrier = g_shm_barrier,
      .xShmUnmap = g_shm_unmap,
      .xFetch = g_fetch,
      .xUnfetch = g_unfetch,
  };
  gather_vfs = (sqlite3_vfs){
      .iVersion = 2,
      .szOsFile = (int)sizeof(gather_file_t) + real_vfs->szOsFile,
      .mxPathname = real_vfs->mxPathname,
      .zName = IDEM_SQLITE_VFS,
      .xOpen = g_open,
      .xDelete = v_delete,
      .xAccess = v_access,
      .xFullPathname = v_full_pathname,
      .xDlOpen = v_dlopen,
      .xDlError = v_dlerror,
      .xDlSym = v_dlsym,
      .xDlClose = v_dlclose,
      .xRandomness = v_randomness,
      .xSleep = v_sleep,
      .xCurrentTime = v_current_time,
      .xGetLastError = v_last_error,
      .xCurrentTimeInt64 = v_current_time_int64,
  };
  register_rc = sqlite3_vfs_register(&gather_vfs, 0);
}

int idem_sqlite_vfs_register(void) {
  pthread_once(&once, register_once);
  return register_rc;
}
