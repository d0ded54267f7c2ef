/* Tenants on either store (see tenants.h), and, on SQLite, the cache of
 * tenants found by key. */
#include "data/tenants.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "data/sql.h"
#include "idem/clock.h"

#define TEXT IDEMD_SQL_TEXT
#define NUM IDEMD_SQL_NUM

/* SQLite keeps the key's hash as a BLOB, PostgreSQL as hex text; both are
 * read as hex. */
#define TENANT_COLUMNS(hash) "id, name, key_lookup, " hash ", disabled, created_at"
#define SELECT_TENANTS(hash) "SELECT " TENANT_COLUMNS(hash) " FROM tenants "

static const char insert_sql[] =
    "INSERT INTO tenants (name, key_lookup, key_hash, created_at) "
    "VALUES ($1, $2, $3, $4) RETURNING id";
static const char update_sql[] =
    "UPDATE tenants SET key_lookup = $1, key_hash = $2, disabled = $3 WHERE name = $4";
static const struct {
  enum idemd_sql_slot slot;
  const char *sqlite, *pg;
} queries[] = {
#define QUERY(slot, rest)                                                                \
  { slot, SELECT_TENANTS("hex(key_hash)") rest, SELECT_TENANTS("key_hash") rest }
    QUERY(IDEMD_SQL_TENANT_BY_LOOKUP, "WHERE key_lookup = $1"),
    QUERY(IDEMD_SQL_TENANT_BY_NAME, "WHERE name = $1"),
    QUERY(IDEMD_SQL_TENANT_LIST, "ORDER BY name LIMIT $1"),
#undef QUERY
};
enum { Q_BY_LOOKUP, Q_BY_NAME, Q_LIST };

/* ---- The cache -----------------------------------------------------------
 *
 * Every request checks its API key, and reading the key's tenant was a
 * quarter of a replay's CPU (a read transaction: file locks, a statement).
 * Tenants found are remembered, and forgotten as soon as any tenant
 * changes, in any process: every change made here (idemd tenant create,
 * rotate, disable, enable) appends one byte to a file beside the database
 * (`<db>-tenants`, opened O_APPEND by every process that uses the
 * database), and an entry counts only while that file's size is what it
 * was before the entry was read. The byte is written after the change
 * commits, so by the time the command returns, no process answers with the
 * old key. Each thread reads the file's size at most once every
 * RECHECK_US (an fstat() per lookup was 4 % of a replay's CPU), and a
 * change's command returns only after waiting that long past its byte:
 * whatever a thread remembers of the size was read before, so by then
 * every lookup reads it again. An entry also lasts at most TTL_MS, which
 * bounds staleness after a change made another way (SQL on the file by
 * hand, a replaced file) or a command killed between its commit and its
 * byte. Without the file (say, a read-only directory), every key is read
 * from the database. PostgreSQL's tenants are read each time. */
#define CACHE_ENTRIES 64 /* direct-mapped by key lookup */
#define TTL_MS 1000
#define RECHECK_US 2000

struct entry {
  idemd_tenant_t t;
  int64_t changed;  /* the file's size when `t` was read */
  int64_t until_ms; /* idem_mono_ms() */
  int used;
};

struct idemd_tenants {
  idem_store_t *store;
  char path[4096]; /* the change file's */
  int fd;          /* the change file; -1: no cache */
  int writable;    /* 0: this process only reads it */
  int exists;      /* the file exists, whether this process can use it */
  uint64_t serial; /* tells these apart in per-thread state */
  pthread_mutex_t lock;
  struct entry *cache; /* CACHE_ENTRIES */
};

static atomic_uint_fast64_t serials;

/* The change count: the file's size; -1 when it cannot be read. */
static int64_t changed_now(const idemd_tenants_t *t) {
  struct stat st;
  return fstat(t->fd, &st) == 0 ? (int64_t)st.st_size : -1;
}

/* The change count as this thread last read it, read again when that was
 * RECHECK_US ago or more (or for other tenants). The time is taken
 * before the read, so a size is never trusted longer than that after it
 * was read. */
static int64_t changed_lately(const idemd_tenants_t *t) {
  static __thread uint64_t serial; /* of the tenants last read */
  static __thread int64_t read_us; /* idem_mono_us() before that read */
  static __thread int64_t count;
  int64_t now = idem_mono_us();

  if (serial != t->serial || count < 0 || now - read_us >= RECHECK_US) {
    count = changed_now(t);
    read_us = now;
    serial = t->serial;
  }
  return count;
}

/* Sleeps `us` microseconds, through signals. */
static void sleep_us(long long us) {
  struct timespec left = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000L};
  while (nanosleep(&left, &left) != 0 && errno == EINTR)
    ;
}

/* After a change to a tenant (committed, or maybe: an extra count only
 * empties the caches). When this process cannot count it in the file the
 * servers read (not writable by this user, or not there), it waits until
 * every entry remembered before the change has expired, so the change
 * still holds for everyone once the command returns. */
static void bump(idemd_tenants_t *t) {
  if (t->fd >= 0 && t->writable && write(t->fd, "+", 1) == 1) {
    /* Until every thread that read the size before this byte reads it
     * again (changed_lately). */
    sleep_us(RECHECK_US + 1000);
    return;
  }
  if (!t->exists)
    return; /* no file, so no server remembers keys */
  fprintf(stderr,
          "idemd: cannot count a tenant change in %s; waiting %d ms "
          "for servers to forget the old key\n",
          t->path, TTL_MS + 100);
  sleep_us((TTL_MS + 100) * 1000LL);
}

/* The database's file, as SQLite resolved it (symbolic links and all, as
 * its -wal and -shm are). */
static int db_file(void *arg, idem_tx_t *tx) {
  const char *name = sqlite3_db_filename(idem_tx_handle(tx), "main");
  snprintf(arg, 4096, "%s", name ? name : "");
  return IDEM_OK;
}

/* Opens the change file of a SQLite database, creating it with the
 * database's mode and owner as SQLite does for its -wal and -shm.
 * Read-only when this user may not write it (its changes then wait
 * instead); no cache at all when it cannot be opened. */
static void open_change_file(idemd_tenants_t *t) {
  char name[4096] = "";
  idem_effect_t e = {db_file, name};
  struct stat st;
  int fd;

  if (strcmp(idem_store_backend(t->store), "sqlite") != 0 ||
      idem_store_read(t->store, &e) != IDEM_OK || name[0] == '\0' ||
      stat(name, &st) != 0 ||
      snprintf(t->path, sizeof t->path, "%s-tenants", name) >= (int)sizeof t->path)
    return;
  if ((t->cache = calloc(CACHE_ENTRIES, sizeof *t->cache)) == NULL) {
    t->exists = access(t->path, F_OK) == 0;
    return;
  }
  fd = open(t->path, O_WRONLY | O_APPEND | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
            st.st_mode & 0777);
  if (fd >= 0) {
    (void)fchmod(fd, st.st_mode & 0777); /* not narrowed by the umask */
    if (geteuid() == 0)
      (void)fchown(fd, st.st_uid, st.st_gid);
    t->writable = 1;
  } else if (errno == EEXIST) {
    fd = open(t->path, O_WRONLY | O_APPEND | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0)
      t->writable = 1;
    else if (errno == EACCES)
      fd = open(t->path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  }
  if (fd >= 0 && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))) {
    close(fd);
    fd = -1;
    t->writable = 0;
  }
  t->fd = fd;
  t->exists = fd >= 0 || access(t->path, F_OK) == 0;
}

int idemd_tenants_open(idem_store_t *store, idemd_tenants_t **out) {
  idemd_tenants_t *t = calloc(1, sizeof *t);

  *out = NULL;
  if (t == NULL)
    return IDEM_ENOMEM;
  t->store = store;
  t->fd = -1;
  t->serial = atomic_fetch_add(&serials, 1) + 1;
  pthread_mutex_init(&t->lock, NULL);
  open_change_file(t);
  *out = t;
  return IDEM_OK;
}

void idemd_tenants_close(idemd_tenants_t *t) {
  if (t == NULL)
    return;
  if (t->fd >= 0)
    close(t->fd);
  pthread_mutex_destroy(&t->lock);
  free(t->cache);
  free(t);
}

static struct entry *slot_of(idemd_tenants_t *t, const char *lookup) {
  uint32_t h = 2166136261u;
  for (const unsigned char *p = (const unsigned char *)lookup; *p; p++)
    h = (h ^ *p) * 16777619u;
  return &t->cache[h % CACHE_ENTRIES];
}

/* ---- Rows ---------------------------------------------------------------- */

static int unhex(const char *hex, unsigned char *out, size_t len) {
  if (hex == NULL || strlen(hex) != 2 * len)
    return -1;
  for (size_t i = 0; i < len; i++) {
    unsigned v;
    if (sscanf(hex + 2 * i, "%2x", &v) != 1)
      return -1;
    out[i] = (unsigned char)v;
  }
  return 0;
}

/* Rows read into `out`, up to `max`. */
struct rows {
  idemd_tenant_t *out;
  int max, n;
};

static int got_tenant(void *arg, const char *const *cols) {
  struct rows *r = arg;
  idemd_tenant_t *t;

  if (r->n >= r->max)
    return IDEM_OK;
  t = &r->out[r->n++];
  memset(t, 0, sizeof *t);
  t->id = cols[0] ? strtoll(cols[0], NULL, 10) : 0;
  idem_copy(t->name, sizeof t->name, cols[1] ? cols[1] : "");
  idem_copy(t->key_lookup, sizeof t->key_lookup, cols[2] ? cols[2] : "");
  if (unhex(cols[3], t->key_hash, sizeof t->key_hash) != 0)
    memset(t->key_hash, 0, sizeof t->key_hash); /* matches no key */
  t->disabled = cols[4] ? atoi(cols[4]) : 0;
  t->created_at = cols[5] ? strtoll(cols[5], NULL, 10) : 0;
  return IDEM_OK;
}

struct query {
  int which;
  idemd_sql_param_t param;
  struct rows rows;
};

static int query_fn(void *arg, idem_tx_t *tx) {
  struct query *q = arg;
  q->rows.n = 0;
  return idemd_sql_run(tx, queries[q->which].slot,
                       idemd_sql_is_sqlite(tx) ? queries[q->which].sqlite
                                               : queries[q->which].pg,
                       &q->param, 1, got_tenant, &q->rows, NULL);
}

/* One tenant by lookup or name. */
static int read_one(idemd_tenants_t *t, int which, const char *arg, idemd_tenant_t *out) {
  struct query q = {which, TEXT(arg), {out, 1, 0}};
  idem_effect_t e = {query_fn, &q};
  int rc = idem_store_read(t->store, &e);

  if (rc == IDEM_OK && q.rows.n == 0)
    rc = IDEM_ENOTFOUND;
  if (rc != IDEM_OK)
    memset(out, 0, sizeof *out);
  return rc;
}

int idemd_tenant_find(idemd_tenants_t *t, const char *lookup, idemd_tenant_t *out) {
  struct entry *e;
  int64_t changed, now;
  int rc;

  if (t->fd < 0 || (changed = changed_lately(t)) < 0)
    return read_one(t, Q_BY_LOOKUP, lookup, out);
  /* `changed` is read before the tenant: a change after it makes the
   * entry stale at once. */
  now = idem_mono_ms();
  e = slot_of(t, lookup);
  pthread_mutex_lock(&t->lock);
  if (e->used && e->changed == changed && e->until_ms > now &&
      strcmp(e->t.key_lookup, lookup) == 0) {
    *out = e->t;
    pthread_mutex_unlock(&t->lock);
    return IDEM_OK;
  }
  pthread_mutex_unlock(&t->lock);
  rc = read_one(t, Q_BY_LOOKUP, lookup, out);
  if (rc == IDEM_OK) { /* unknown keys are not remembered */
    pthread_mutex_lock(&t->lock);
    *e = (struct entry){*out, changed, now + TTL_MS, 1};
    pthread_mutex_unlock(&t->lock);
  }
  return rc;
}

int idemd_tenant_by_name(idemd_tenants_t *t, const char *name, idemd_tenant_t *out) {
  return read_one(t, Q_BY_NAME, name, out);
}

int idemd_tenant_list(idemd_tenants_t *t, idemd_tenant_t *out, int max, int *n) {
  struct query q = {Q_LIST, NUM(max), {out, max, 0}};
  idem_effect_t e = {query_fn, &q};
  int rc = max > 0 ? idem_store_read(t->store, &e) : IDEM_EINVAL;

  *n = rc == IDEM_OK ? q.rows.n : 0;
  return rc;
}

/* ---- Changes ------------------------------------------------------------- */

static int got_id(void *arg, const char *const *cols) {
  *(int64_t *)arg = cols[0] ? strtoll(cols[0], NULL, 10) : 0;
  return IDEM_OK;
}

static int insert_fn(void *arg, idem_tx_t *tx) {
  idemd_tenant_t *tenant = arg;
  idemd_sql_param_t p[4] = {TEXT(tenant->name), TEXT(tenant->key_lookup),
                            IDEMD_SQL_BYTES(tenant->key_hash, sizeof tenant->key_hash),
                            NUM(tenant->created_at)};
  tenant->id = 0;
  return idemd_sql_run(tx, IDEMD_SQL_TENANT_INSERT, insert_sql, p, 4, got_id, &tenant->id,
                       NULL);
}

int idemd_tenant_create(idemd_tenants_t *t, idemd_tenant_t *tenant) {
  idem_effect_t e = {insert_fn, tenant};
  int rc = idem_store_write(t->store, &e);

  if (rc != IDEM_EEXIST) /* it may have committed: count it */
    bump(t);
  return rc;
}

static int update_fn(void *arg, idem_tx_t *tx) {
  const idemd_tenant_t *tenant = arg;
  idemd_sql_param_t p[4] = {TEXT(tenant->key_lookup),
                            IDEMD_SQL_BYTES(tenant->key_hash, sizeof tenant->key_hash),
                            NUM(tenant->disabled), TEXT(tenant->name)};
  int changes = 0;
  int rc =
      idemd_sql_run(tx, IDEMD_SQL_TENANT_UPDATE, update_sql, p, 4, NULL, NULL, &changes);
  return rc == IDEM_OK && changes == 0 ? IDEM_ENOTFOUND : rc;
}

int idemd_tenant_update(idemd_tenants_t *t, const idemd_tenant_t *tenant) {
  idem_effect_t e = {update_fn, (void *)tenant};
  int rc = idem_store_write(t->store, &e);

  if (rc != IDEM_ENOTFOUND) /* it may have committed: count it */
    bump(t);
  return rc;
}
