/* The integration harness: runs the real idemd binary as a user would and
 * gives the tests HTTP, raw-socket and database helpers (see harness.h), on
 * SQLite or, when IDEM_TEST_STORE_URL says so, on PostgreSQL. */
#define _GNU_SOURCE
#include "harness.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <libpq-fe.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sqlite3.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

const char H_NO_CONTENT_TYPE[] = "(omit Content-Type)";

#define MAX_SERVERS 16
#define MAX_BODY (16 * 1024 * 1024)
#define START_TIMEOUT_S 30.0
#define STOP_TIMEOUT_S 20.0
#define MAX_PARAMS 16

static const char *idemd_path;
/* IDEM_TEST_STORE_URL when it names a PostgreSQL cluster; NULL: SQLite. */
static const char *store_url;

/* Answers not yet freed: a failed assertion jumps past h_resp_free(), and
 * h_teardown() frees what is left so leak reports show real leaks only. */
static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static char **live_bodies;
static json_t **live_json;
static size_t nlive, live_cap;
static void free_live(void);
static h_server_t *servers[MAX_SERVERS];
static char *tenant_keys[64];
static int ntenant_keys;

/* ---- time ---------------------------------------------------------- */

double h_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int64_t h_wall_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void nap_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
    ;
}

/* ---- files --------------------------------------------------------- */

char *h_read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  char *buf = NULL;
  size_t cap = 0, n = 0;
  if (f == NULL)
    return NULL;
  for (;;) {
    if (n + 4096 + 1 > cap) {
      char *nb;
      cap = cap ? cap * 2 : 8192;
      nb = realloc(buf, cap);
      if (nb == NULL) {
        free(buf);
        fclose(f);
        return NULL;
      }
      buf = nb;
    }
    size_t got = fread(buf + n, 1, cap - n - 1, f);
    n += got;
    if (got == 0)
      break;
  }
  fclose(f);
  buf[n] = '\0';
  if (len)
    *len = n;
  return buf;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st;
  (void)flag;
  (void)ftw;
  return remove(path);
}

static void rm_rf(const char *dir) {
  if (dir[0])
    (void)nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* Does the file contain a sanitizer report? Copies the line into why. */
static int sanitizer_report(const char *path, char *why, size_t whylen) {
  static const char *const needles[] = {"ERROR: AddressSanitizer", "ERROR: LeakSanitizer",
                                        "runtime error:", "WARNING: ThreadSanitizer"};
  char *text = h_read_file(path, NULL);
  int found = 0;
  if (text == NULL)
    return 0;
  for (size_t i = 0; i < sizeof needles / sizeof *needles && !found; i++) {
    char *p = strstr(text, needles[i]);
    if (p) {
      char *eol = strchr(p, '\n');
      snprintf(why, whylen, "%s: %.*s", path, eol ? (int)(eol - p) : 200, p);
      found = 1;
    }
  }
  free(text);
  return found;
}

/* Prints the end of idemd's log, to explain a failure. */
static void print_log_tail(const h_server_t *s) {
  size_t len;
  char *text = h_read_file(s->log, &len);
  if (text == NULL)
    return;
  fprintf(stderr, "---- last lines of %s ----\n%s%s\n----\n", s->log,
          len > 3000 ? "..." : "", len > 3000 ? text + len - 3000 : text);
  free(text);
}

/* ---- processes ----------------------------------------------------- */

void h_init(int argc, char **argv) {
  idemd_path = getenv("IDEM_TEST_IDEMD");
  if ((idemd_path == NULL || idemd_path[0] == '\0') && argc > 1)
    idemd_path = argv[1];
  if (idemd_path == NULL || access(idemd_path, X_OK) != 0) {
    fprintf(stderr, "set IDEM_TEST_IDEMD to the idemd binary (got '%s')\n",
            idemd_path ? idemd_path : "");
    exit(2);
  }
  store_url = getenv("IDEM_TEST_STORE_URL");
  if (store_url && store_url[0] == '\0')
    store_url = NULL;
  if (store_url && strncmp(store_url, "postgresql://", 13) != 0 &&
      strncmp(store_url, "postgres://", 11) != 0) {
    fprintf(stderr, "IDEM_TEST_STORE_URL must be a postgresql:// URL (got '%s')\n",
            store_url);
    exit(2);
  }
  fprintf(stderr, "integration tests on %s\n",
          store_url ? "PostgreSQL (a database per server)" : "SQLite (a file per server)");
  curl_global_init(CURL_GLOBAL_DEFAULT);
  signal(SIGPIPE, SIG_IGN);
}

int h_store_is_pg(void) {
  return store_url != NULL;
}

const char *h_store_url(void) {
  return store_url;
}

/* ---- PostgreSQL databases ------------------------------------------- */

/* Server notices ("database ... does not exist, skipping") are not news. */
static void pg_quiet(void *arg, const char *message) {
  (void)arg;
  (void)message;
}

/* `url` with its database (the path) replaced by `dbname`:
 * postgresql:///postgres?host=/tmp/x -> postgresql:///idem_t_1?host=/tmp/x.
 * Returns 0, or -1 when it does not fit. */
static int pg_url_with_db(const char *url, const char *dbname, char *out, size_t cap) {
  const char *auth = strstr(url, "://");
  const char *path, *rest;
  int n;
  if (auth == NULL)
    return -1;
  auth += 3;
  path = auth + strcspn(auth, "/?"); /* the authority ends at '/' or '?' */
  rest = *path == '/' ? path + strcspn(path, "?") : path;
  n = snprintf(out, cap, "%.*s/%s%s", (int)(path - url), url, dbname, rest);
  return n > 0 && (size_t)n < cap ? 0 : -1;
}

/* Runs one statement on the cluster's maintenance database (the URL as
 * given). Returns 0, or -1 with libpq's message in why. */
static int pg_admin(const char *sql, char *why, size_t whylen) {
  PGconn *c = PQconnectdb(store_url);
  PGresult *r;
  int ok;
  if (c == NULL || PQstatus(c) != CONNECTION_OK) {
    snprintf(why, whylen, "cannot connect to %s: %s", store_url,
             c ? PQerrorMessage(c) : "out of memory");
    PQfinish(c);
    return -1;
  }
  PQsetNoticeProcessor(c, pg_quiet, NULL);
  r = PQexec(c, sql);
  ok = PQresultStatus(r) == PGRES_COMMAND_OK;
  if (!ok)
    snprintf(why, whylen, "%s: %s", sql, PQresultErrorMessage(r));
  PQclear(r);
  PQfinish(c);
  return ok ? 0 : -1;
}

/* Creates a database with a fresh random name; its name goes to dbname and
 * idemd's URL for it to url. Returns 0 or -1 with a reason. */
static int pg_create_db(char *dbname, size_t namecap, char *url, size_t urlcap, char *why,
                        size_t whylen) {
  unsigned char rnd[6] = {0};
  char sql[128];
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0 || read(fd, rnd, sizeof rnd) != (ssize_t)sizeof rnd) {
    /* not random, but unique enough within one cluster and one process */
    static atomic_uint counter;
    unsigned v = (unsigned)getpid() * 2654435761u ^ (unsigned)h_wall_ms() ^
                 atomic_fetch_add(&counter, 1);
    memcpy(rnd, &v, sizeof v);
  }
  if (fd >= 0)
    close(fd);
  snprintf(dbname, namecap, "idem_t_%02x%02x%02x%02x%02x%02x", rnd[0], rnd[1], rnd[2],
           rnd[3], rnd[4], rnd[5]);
  if (pg_url_with_db(store_url, dbname, url, urlcap) != 0) {
    snprintf(why, whylen, "IDEM_TEST_STORE_URL is too long");
    return -1;
  }
  snprintf(sql, sizeof sql, "CREATE DATABASE %s", dbname);
  return pg_admin(sql, why, whylen);
}

static void pg_drop_db(const char *dbname) {
  char sql[128], why[512];
  snprintf(sql, sizeof sql, "DROP DATABASE IF EXISTS %s WITH (FORCE)", dbname);
  if (pg_admin(sql, why, sizeof why) != 0)
    fprintf(stderr, "harness: could not drop database %s: %s\n", dbname, why);
}

/* CREATE DATABASE takes about half a second (it copies and syncs a
 * template), as long as the rest of a server's start. So one database is
 * kept ready: a thread makes the next while the test uses the last. */
static pthread_mutex_t spare_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t spare_changed = PTHREAD_COND_INITIALIZER;
static char spare_name[64], spare_url[512];
static int spare_ready, spare_stopping, spare_started;
static pthread_t spare_thread;

static void *spare_main(void *arg) {
  (void)arg;
  pthread_mutex_lock(&spare_lock);
  for (;;) {
    char name[64], url[512], why[512];
    int rc;
    while (spare_ready && !spare_stopping)
      pthread_cond_wait(&spare_changed, &spare_lock);
    if (spare_stopping)
      break;
    pthread_mutex_unlock(&spare_lock);
    rc = pg_create_db(name, sizeof name, url, sizeof url, why, sizeof why);
    pthread_mutex_lock(&spare_lock);
    if (rc == 0) {
      memcpy(spare_name, name, sizeof name);
      memcpy(spare_url, url, sizeof url);
      spare_ready = 1;
      pthread_cond_broadcast(&spare_changed);
    } else if (!spare_stopping) {
      /* the cluster may be down on purpose (test_pg_restart): retry later */
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_sec += 1;
      pthread_cond_timedwait(&spare_changed, &spare_lock, &ts);
    }
  }
  pthread_mutex_unlock(&spare_lock);
  return NULL;
}

/* At exit: stop the thread and drop the database it kept ready. */
static void spare_stop(void) {
  pthread_mutex_lock(&spare_lock);
  spare_stopping = 1;
  pthread_cond_broadcast(&spare_changed);
  pthread_mutex_unlock(&spare_lock);
  if (spare_started)
    pthread_join(spare_thread, NULL);
  if (spare_ready)
    pg_drop_db(spare_name);
  spare_ready = 0;
}

/* A fresh database for a server: the one kept ready if there is one (the
 * thread then makes the next), else one made now. */
static int pg_new_db(char *dbname, size_t namecap, char *url, size_t urlcap, char *why,
                     size_t whylen) {
  int took = 0;
  pthread_mutex_lock(&spare_lock);
  if (!spare_started && !spare_stopping &&
      pthread_create(&spare_thread, NULL, spare_main, NULL) == 0) {
    spare_started = 1;
    atexit(spare_stop);
  }
  if (spare_ready && strlen(spare_name) < namecap && strlen(spare_url) < urlcap) {
    snprintf(dbname, namecap, "%s", spare_name);
    snprintf(url, urlcap, "%s", spare_url);
    spare_ready = 0;
    took = 1;
    pthread_cond_broadcast(&spare_changed);
  }
  pthread_mutex_unlock(&spare_lock);
  return took ? 0 : pg_create_db(dbname, namecap, url, urlcap, why, whylen);
}

/* The environment without IDEMD_* variables, so a developer's settings
 * cannot change what a test runs. Points into environ. */
/* The environment without the variables that start with `drop`, so the
 * child is configured by its flags alone. */
static char **clean_env(const char *drop) {
  size_t n = 0, k = 0, dlen = strlen(drop);
  char **env;
  while (environ[n])
    n++;
  env = calloc(n + 1, sizeof *env);
  if (env == NULL)
    return NULL;
  for (size_t i = 0; i < n; i++)
    if (strncmp(environ[i], drop, dlen) != 0)
      env[k++] = environ[i];
  env[k] = NULL;
  return env;
}

/* fork + execve with stdout/stderr redirected. Returns the pid or -1. */
pid_t h_spawn(char *const argv[], int out_fd, int err_fd, const char *drop_env) {
  pid_t parent = getpid();
  char **env = clean_env(drop_env);
  pid_t pid;
  if (env == NULL)
    return -1;
  pid = fork();
  if (pid == 0) {
    int devnull = open("/dev/null", O_RDONLY);
    /* Die with the test, whatever happens to it. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent)
      _exit(127);
    if (devnull >= 0)
      dup2(devnull, 0);
    dup2(out_fd, 1);
    dup2(err_fd, 2);
    execve(argv[0], argv, env);
    _exit(127);
  }
  free(env);
  return pid;
}

pid_t h_spawn_logged(char *const argv[], const char *log, const char *drop_env,
                     char *why, size_t whylen) {
  int fd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  pid_t pid;
  if (fd < 0) {
    snprintf(why, whylen, "cannot open %s: %s", log, strerror(errno));
    return -1;
  }
  pid = h_spawn(argv, fd, fd, drop_env);
  close(fd);
  if (pid < 0)
    snprintf(why, whylen, "fork failed: %s", strerror(errno));
  return pid;
}

int h_free_port(void) {
  struct sockaddr_in a = {.sin_family = AF_INET};
  socklen_t len = sizeof a;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int port = -1;
  if (fd < 0)
    return -1;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
      getsockname(fd, (struct sockaddr *)&a, &len) == 0)
    port = ntohs(a.sin_port);
  close(fd);
  return port;
}

static size_t discard(char *buf, size_t size, size_t n, void *ud) {
  (void)buf;
  (void)ud;
  return size * n;
}

static int healthz_ok(h_server_t *s) {
  CURL *c = curl_easy_init();
  char url[96];
  long status = 0;
  if (c == NULL)
    return 0;
  snprintf(url, sizeof url, "http://127.0.0.1:%d/healthz", s->port);
  curl_easy_setopt(c, CURLOPT_URL, url);
  curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 2000L);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, discard);
  if (curl_easy_perform(c) == CURLE_OK)
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
  curl_easy_cleanup(c);
  return status == 200;
}

/* Does the file contain `needle` after offset `from`? */
static int logged_since(const char *path, off_t from, const char *needle) {
  size_t len;
  char *text = h_read_file(path, &len);
  int found = text && (size_t)from <= len && strstr(text + from, needle) != NULL;
  free(text);
  return found;
}

/* Starts idemd on s->dir; retries on another port when the one picked was
 * taken meanwhile. Returns 0, or -1 with a reason in why. */
static int launch(h_server_t *s, char *why, size_t whylen) {
  for (int attempt = 0; attempt < 5; attempt++) {
    char listen[64];
    char *argv[8 + H_MAX_FLAGS + 1];
    int argc = 0, status;
    struct stat st;
    off_t log_start = stat(s->log, &st) == 0 ? st.st_size : 0;
    double deadline;

    s->port = h_free_port();
    if (s->port <= 0) {
      snprintf(why, whylen, "no free port");
      return -1;
    }
    snprintf(listen, sizeof listen, "127.0.0.1:%d", s->port);
    argv[argc++] = (char *)idemd_path;
    argv[argc++] = "serve";
    argv[argc++] = "--db";
    argv[argc++] = s->db;
    argv[argc++] = "--listen";
    argv[argc++] = listen;
    for (int i = 0; s->flags[i]; i++)
      argv[argc++] = s->flags[i];
    argv[argc] = NULL;

    if ((s->pid = h_spawn_logged(argv, s->log, "IDEMD_", why, whylen)) < 0)
      return -1;
    s->running = 1;

    deadline = h_now() + START_TIMEOUT_S;
    for (;;) {
      pid_t w = waitpid(s->pid, &status, WNOHANG);
      if (w == s->pid) {
        int port_taken = logged_since(s->log, log_start, "cannot listen");
        s->running = 0;
        if (port_taken)
          break; /* try another port */
        snprintf(why, whylen, "idemd exited during start-up (status 0x%x)", status);
        return -1;
      }
      /* Our own "listening" line first: a healthz answer alone could come
       * from another process that took the port meanwhile. */
      if (logged_since(s->log, log_start, "\"msg\":\"listening\"") && healthz_ok(s))
        return 0;
      if (h_now() > deadline) {
        kill(s->pid, SIGKILL);
        waitpid(s->pid, &status, 0);
        s->running = 0;
        snprintf(why, whylen, "GET /healthz did not answer 200 within %.0f s",
                 START_TIMEOUT_S);
        return -1;
      }
      nap_ms(10);
    }
  }
  snprintf(why, whylen, "could not find a free port in 5 attempts");
  return -1;
}

static void set_flags(h_server_t *s, const char *const *flags) {
  for (int i = 0; s->flags[i]; i++) {
    free(s->flags[i]);
    s->flags[i] = NULL;
  }
  for (int i = 0; flags && flags[i]; i++) {
    if (i >= H_MAX_FLAGS)
      fail_msg("too many flags");
    s->flags[i] = strdup(flags[i]);
    assert_non_null(s->flags[i]);
  }
}

/* Starts a server on `db` (NULL: a new database of its own). */
static h_server_t *start_on(const char *db, const char *const *flags) {
  const char *tmp = getenv("TMPDIR");
  h_server_t *s = calloc(1, sizeof *s);
  char why[1024];
  int slot = -1;

  assert_non_null(s);
  for (int i = 0; i < MAX_SERVERS && slot < 0; i++)
    if (servers[i] == NULL)
      slot = i;
  if (slot < 0)
    fail_msg("more than %d servers in one test", MAX_SERVERS);
  servers[slot] = s;
  snprintf(s->dir, sizeof s->dir, "%s/idem-it-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
  if (mkdtemp(s->dir) == NULL)
    fail_msg("mkdtemp: %s", strerror(errno));
  snprintf(s->log, sizeof s->log, "%s/idemd.log", s->dir);
  snprintf(s->cli_log, sizeof s->cli_log, "%s/cli.log", s->dir);
  if (db != NULL) {
    if (strlen(db) >= sizeof s->db)
      fail_msg("database name too long: %s", db);
    snprintf(s->db, sizeof s->db, "%s", db);
  } else if (store_url == NULL) {
    snprintf(s->db, sizeof s->db, "%s/idem.db", s->dir);
  } else if (pg_new_db(s->pg_dbname, sizeof s->pg_dbname, s->db, sizeof s->db, why,
                          sizeof why) != 0) {
    s->pg_dbname[0] = '\0';
    fail_msg("cannot create a PostgreSQL database: %s", why);
  }
  set_flags(s, flags);
  if (launch(s, why, sizeof why) != 0) {
    print_log_tail(s);
    fail_msg("idemd did not start: %s", why);
  }
  /* The store really is the one meant (its "listening" line names it). */
  if (!logged_since(s->log, 0,
                    strncmp(s->db, "postgres", 8) == 0 ? "\"store\":\"postgresql\""
                                                       : "\"store\":\"sqlite\"")) {
    print_log_tail(s);
    fail_msg("idemd does not run on the store in %s", s->db);
  }
  return s;
}

h_server_t *h_server_start(const char *const *flags) {
  return start_on(NULL, flags);
}

h_server_t *h_server_start_on(const char *db, const char *const *flags) {
  assert_non_null(db);
  return start_on(db, flags);
}

void h_server_restart(h_server_t *s, const char *const *flags) {
  char why[512];
  assert_false(s->running);
  set_flags(s, flags);
  if (launch(s, why, sizeof why) != 0) {
    print_log_tail(s);
    fail_msg("idemd did not start again: %s", why);
  }
}

/* Stops s; returns 0 or -1 with a reason. */
static int stop(h_server_t *s, char *why, size_t whylen) {
  double deadline = h_now() + STOP_TIMEOUT_S;
  int status = 0;

  why[0] = '\0';
  if (!s->running)
    return 0;
  kill(s->pid, SIGTERM);
  for (;;) {
    pid_t w = waitpid(s->pid, &status, WNOHANG);
    if (w == s->pid)
      break;
    if (w < 0 && errno != EINTR) {
      snprintf(why, whylen, "waitpid: %s", strerror(errno));
      s->running = 0;
      return -1;
    }
    if (h_now() > deadline) {
      kill(s->pid, SIGKILL);
      waitpid(s->pid, &status, 0);
      s->running = 0;
      snprintf(why, whylen, "idemd did not exit within %.0f s of SIGTERM",
               STOP_TIMEOUT_S);
      return -1;
    }
    nap_ms(5);
  }
  s->running = 0;
  if (sanitizer_report(s->log, why, whylen) || sanitizer_report(s->cli_log, why, whylen))
    return -1;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    if (WIFSIGNALED(status))
      snprintf(why, whylen, "idemd died of signal %d", WTERMSIG(status));
    else
      snprintf(why, whylen, "idemd exited with status %d after SIGTERM",
               WEXITSTATUS(status));
    return -1;
  }
  return 0;
}

void h_server_stop(h_server_t *s) {
  char why[1024];
  if (stop(s, why, sizeof why) != 0) {
    print_log_tail(s);
    fail_msg("%s", why);
  }
}

int h_teardown(void **state) {
  char why[1024], first[1024] = "";
  (void)state;
  h_context_clear();
  /* Every server first: several may share one database. */
  for (int i = 0; i < MAX_SERVERS; i++) {
    h_server_t *s = servers[i];
    if (s && stop(s, why, sizeof why) != 0 && first[0] == '\0') {
      print_log_tail(s);
      snprintf(first, sizeof first, "%s", why);
    }
  }
  for (int i = 0; i < MAX_SERVERS; i++) {
    h_server_t *s = servers[i];
    if (s == NULL)
      continue;
    PQfinish(s->pg);
    if (getenv("IDEM_TEST_KEEP") == NULL) {
      rm_rf(s->dir);
      if (s->pg_dbname[0])
        pg_drop_db(s->pg_dbname);
    } else {
      fprintf(stderr, "kept %s%s%s\n", s->dir, s->pg_dbname[0] ? " and database " : "",
              s->pg_dbname);
    }
    for (int k = 0; s->flags[k]; k++)
      free(s->flags[k]);
    free(s);
    servers[i] = NULL;
  }
  for (int i = 0; i < ntenant_keys; i++)
    free(tenant_keys[i]);
  ntenant_keys = 0;
  free_live();
  if (first[0])
    fail_msg("%s", first);
  return 0;
}

/* Runs idemd with `args` (NULL-terminated, after the binary) and `--db` of
 * the server, stdout captured into `out` (malloc'd; free it), stderr
 * appended to the server's CLI log (checked for sanitizer reports at
 * stop). Returns the exit status, or -1 if it did not exit normally. */
int h_cli(h_server_t *s, const char *const *args, char **out) {
  char *argv[24];
  size_t n = 0, cap = 4096, len = 0;
  int pipefd[2], errfd, status;
  char *buf = malloc(cap);
  pid_t pid;

  assert_non_null(buf);
  argv[n++] = (char *)idemd_path;
  for (size_t i = 0; args[i]; i++) {
    assert_true(n < sizeof argv / sizeof *argv - 3);
    argv[n++] = (char *)args[i];
  }
  argv[n++] = "--db";
  argv[n++] = s->db;
  argv[n] = NULL;
  assert_int_equal(pipe(pipefd), 0);
  errfd = open(s->cli_log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  assert_true(errfd >= 0);
  pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    extern char **environ;
    dup2(pipefd[1], 1);
    dup2(errfd, 2);
    close(pipefd[0]);
    close(pipefd[1]);
    /* The configuration is what the test says, not the caller's IDEMD_*. */
    for (char **e = environ; *e;) {
      if (strncmp(*e, "IDEMD_", 6) == 0) {
        char name[128];
        size_t k = strcspn(*e, "=");
        snprintf(name, sizeof name, "%.*s", (int)k, *e);
        unsetenv(name);
      } else {
        e++;
      }
    }
    execv(idemd_path, argv);
    _exit(127);
  }
  close(pipefd[1]);
  close(errfd);
  for (;;) {
    ssize_t got;
    if (len + 1 >= cap) {
      char *b = realloc(buf, cap * 2);
      assert_non_null(b);
      buf = b;
      cap *= 2;
    }
    got = read(pipefd[0], buf + len, cap - 1 - len);
    if (got < 0 && errno == EINTR)
      continue;
    if (got <= 0)
      break;
    len += (size_t)got;
  }
  close(pipefd[0]);
  buf[len] = '\0';
  while (waitpid(pid, &status, 0) < 0)
    assert_int_equal(errno, EINTR);
  *out = buf;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

const char *h_tenant(h_server_t *s, const char *name) {
  char *argv[] = {
      (char *)idemd_path, "tenant", "create", (char *)name, "--db", s->db, NULL};
  char out[512];
  size_t n = 0;
  int pipefd[2], errfd, status;
  pid_t pid;
  char *key;

  assert_true(ntenant_keys < 64);
  assert_int_equal(pipe2(pipefd, O_CLOEXEC), 0);
  errfd = open(s->cli_log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  assert_true(errfd >= 0);
  pid = h_spawn(argv, pipefd[1], errfd, "IDEMD_");
  close(pipefd[1]);
  close(errfd);
  assert_true(pid > 0);
  for (;;) {
    ssize_t got = read(pipefd[0], out + n, sizeof out - 1 - n);
    if (got < 0 && errno == EINTR)
      continue;
    if (got <= 0)
      break;
    n += (size_t)got;
    if (n == sizeof out - 1)
      break;
  }
  close(pipefd[0]);
  out[n] = '\0';
  assert_int_equal(waitpid(pid, &status, 0), pid);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    fail_msg("idemd tenant create %s: status 0x%x (see %s)", name, status, s->cli_log);
  /* The key alone on one line. */
  assert_true(n > 1);
  assert_int_equal(out[n - 1], '\n');
  out[n - 1] = '\0';
  assert_null(strchr(out, '\n'));
  assert_int_equal(strncmp(out, "idem_", 5), 0);
  key = strdup(out);
  assert_non_null(key);
  tenant_keys[ntenant_keys++] = key;
  return key;
}

/* ---- HTTP ---------------------------------------------------------- */

static void copy_value(char *dst, size_t cap, const char *v, size_t len) {
  if (len >= cap)
    len = cap - 1;
  memcpy(dst, v, len);
  dst[len] = '\0';
}

/* Records the headers the tests look at, from one "Name: value" line. */
static void take_header(h_resp_t *r, const char *line, size_t len) {
  static const struct {
    const char *name;
    size_t off, cap;
  } known[] = {
      {"Location", offsetof(h_resp_t, location), sizeof((h_resp_t *)0)->location},
      {"Idempotent-Replayed", offsetof(h_resp_t, replayed),
       sizeof((h_resp_t *)0)->replayed},
      {"Retry-After", offsetof(h_resp_t, retry_after),
       sizeof((h_resp_t *)0)->retry_after},
      {"Allow", offsetof(h_resp_t, allow), sizeof((h_resp_t *)0)->allow},
      {"WWW-Authenticate", offsetof(h_resp_t, www_authenticate),
       sizeof((h_resp_t *)0)->www_authenticate},
      {"X-Request-Id", offsetof(h_resp_t, request_id), sizeof((h_resp_t *)0)->request_id},
      {"Content-Type", offsetof(h_resp_t, content_type),
       sizeof((h_resp_t *)0)->content_type},
  };
  const char *colon = memchr(line, ':', len);
  size_t nlen, vlen;
  const char *v;

  if (colon == NULL)
    return;
  nlen = (size_t)(colon - line);
  v = colon + 1;
  vlen = len - nlen - 1;
  while (vlen > 0 && (*v == ' ' || *v == '\t')) {
    v++;
    vlen--;
  }
  while (vlen > 0 && (v[vlen - 1] == '\r' || v[vlen - 1] == '\n' || v[vlen - 1] == ' ' ||
                      v[vlen - 1] == '\t'))
    vlen--;
  for (size_t i = 0; i < sizeof known / sizeof *known; i++)
    if (strlen(known[i].name) == nlen && strncasecmp(line, known[i].name, nlen) == 0)
      copy_value((char *)r + known[i].off, known[i].cap, v, vlen);
}

static void reset_headers(h_resp_t *r) {
  r->location[0] = r->replayed[0] = r->retry_after[0] = r->allow[0] = '\0';
  r->www_authenticate[0] = r->request_id[0] = r->content_type[0] = '\0';
}

static size_t on_header(char *buf, size_t size, size_t n, void *ud) {
  h_resp_t *r = ud;
  size_t len = size * n;
  if (len >= 5 && strncmp(buf, "HTTP/", 5) == 0)
    reset_headers(r);
  else
    take_header(r, buf, len);
  return len;
}

static int append(h_resp_t *r, const char *data, size_t len) {
  char *nb;
  if (r->body_len + len > MAX_BODY)
    return -1;
  nb = realloc(r->body, r->body_len + len + 1);
  if (nb == NULL)
    return -1;
  r->body = nb;
  memcpy(r->body + r->body_len, data, len);
  r->body_len += len;
  r->body[r->body_len] = '\0';
  return 0;
}

static size_t on_body(char *buf, size_t size, size_t n, void *ud) {
  return append(ud, buf, size * n) == 0 ? size * n : 0;
}

static void finish(h_resp_t *r) {
  if (r->body == NULL) {
    r->body = calloc(1, 1);
    r->body_len = 0;
  }
  r->json = r->body_len ? json_loadb(r->body, r->body_len, 0, NULL) : NULL;
  r->t_end = h_now();
  pthread_mutex_lock(&live_lock);
  if (nlive == live_cap) {
    size_t cap = live_cap ? live_cap * 2 : 256;
    char **b = realloc(live_bodies, cap * sizeof *b);
    json_t **j = b ? realloc(live_json, cap * sizeof *j) : NULL;
    if (b)
      live_bodies = b;
    if (j) {
      live_json = j;
      live_cap = cap;
    }
  }
  if (nlive < live_cap && r->body) {
    live_bodies[nlive] = r->body;
    live_json[nlive++] = r->json;
  }
  pthread_mutex_unlock(&live_lock);
}

static void forget(const char *body) {
  pthread_mutex_lock(&live_lock);
  for (size_t i = nlive; i-- > 0;)
    if (live_bodies[i] == body) {
      live_bodies[i] = live_bodies[--nlive];
      live_json[i] = live_json[nlive];
      break;
    }
  pthread_mutex_unlock(&live_lock);
}

static void free_live(void) {
  pthread_mutex_lock(&live_lock);
  for (size_t i = 0; i < nlive; i++) {
    free(live_bodies[i]);
    json_decref(live_json[i]);
  }
  nlive = 0;
  free(live_bodies);
  free(live_json);
  live_bodies = NULL;
  live_json = NULL;
  live_cap = 0;
  pthread_mutex_unlock(&live_lock);
}

static size_t ignore_body(char *b, size_t size, size_t n, void *ud) {
  (void)b;
  (void)ud;
  return size * n;
}

CURLcode h_post_timeout(h_server_t *s, const char *path, const char *token,
                        const char *key, const char *body, long timeout_ms) {
  struct curl_slist *hdrs = NULL;
  char url[192], auth[256], idem[320];
  CURL *c = curl_easy_init();
  CURLcode rc;

  if (c == NULL)
    return CURLE_FAILED_INIT;
  snprintf(url, sizeof url, "http://127.0.0.1:%d%s", s->port, path);
  snprintf(auth, sizeof auth, "Authorization: Bearer %s", token);
  snprintf(idem, sizeof idem, "Idempotency-Key: %s", key);
  hdrs = curl_slist_append(hdrs, auth);
  hdrs = curl_slist_append(hdrs, idem);
  hdrs = curl_slist_append(hdrs, "Content-Type: application/json");
  hdrs = curl_slist_append(hdrs, "Expect:");
  curl_easy_setopt(c, CURLOPT_URL, url);
  curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdrs);
  curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, timeout_ms);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, ignore_body);
  rc = curl_easy_perform(c);
  curl_slist_free_all(hdrs);
  curl_easy_cleanup(c);
  return rc;
}

void h_http_on(CURL *c, h_server_t *s, const h_req_t *req, h_resp_t *out) {
  const char *method = req->method ? req->method : "GET";
  struct curl_slist *hdrs = NULL;
  char url[1200], line[1200];
  size_t body_len = req->body ? (req->body_len ? req->body_len : strlen(req->body)) : 0;
  double start = h_now();
  CURLcode rc;

  memset(out, 0, sizeof *out);
  curl_easy_reset(c);
  snprintf(url, sizeof url, "http://127.0.0.1:%d%s", s->port, req->path);
  curl_easy_setopt(c, CURLOPT_URL, url);
  curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 60000L);
  curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(c, CURLOPT_HEADERDATA, out);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, out);

  if (strcmp(method, "GET") == 0) {
    curl_easy_setopt(c, CURLOPT_HTTPGET, 1L);
  } else if (strcmp(method, "HEAD") == 0) {
    curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
  } else {
    if (strcmp(method, "POST") != 0)
      curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    if (req->body || strcmp(method, "POST") == 0) {
      curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)body_len);
      curl_easy_setopt(c, CURLOPT_POSTFIELDS, req->body ? req->body : "");
    }
  }

  if (req->token) {
    snprintf(line, sizeof line, "Authorization: Bearer %s", req->token);
    hdrs = curl_slist_append(hdrs, line);
  }
  if (req->key && req->key[0]) {
    snprintf(line, sizeof line, "Idempotency-Key: %s", req->key);
    hdrs = curl_slist_append(hdrs, line);
  } else if (req->key) {
    hdrs = curl_slist_append(hdrs, "Idempotency-Key;"); /* sent empty */
  }
  if (req->content_type == H_NO_CONTENT_TYPE) {
    hdrs = curl_slist_append(hdrs, "Content-Type:"); /* libcurl adds none */
  } else if (req->content_type) {
    snprintf(line, sizeof line, "Content-Type: %s", req->content_type);
    hdrs = curl_slist_append(hdrs, line);
  } else if (req->body) {
    hdrs = curl_slist_append(hdrs, "Content-Type: application/json");
  }
  hdrs = curl_slist_append(hdrs, "Expect:");
  for (int i = 0; i < H_MAX_HEADERS && req->headers[i]; i++)
    hdrs = curl_slist_append(hdrs, req->headers[i]);
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdrs);

  rc = curl_easy_perform(c);
  if (rc == CURLE_OK)
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &out->status);
  else
    out->transport_error = (int)rc;
  curl_slist_free_all(hdrs);
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, NULL);
  finish(out);
  out->seconds = out->t_end - start;
}

void h_http(h_server_t *s, const h_req_t *req, h_resp_t *out) {
  CURL *c = curl_easy_init();
  if (c == NULL) {
    memset(out, 0, sizeof *out);
    out->transport_error = -1;
    finish(out);
    return;
  }
  h_http_on(c, s, req, out);
  curl_easy_cleanup(c);
}

void h_post(h_server_t *s, const char *path, const char *token, const char *key,
            const char *body, h_resp_t *out) {
  h_req_t r = {.method = "POST", .path = path, .token = token, .key = key, .body = body};
  h_http(s, &r, out);
}

void h_get(h_server_t *s, const char *path, const char *token, h_resp_t *out) {
  h_req_t r = {.method = "GET", .path = path, .token = token};
  h_http(s, &r, out);
}

void h_resp_free(h_resp_t *r) {
  if (r->body)
    forget(r->body);
  free(r->body);
  json_decref(r->json);
  memset(r, 0, sizeof *r);
}

/* ---- raw requests -------------------------------------------------- */

static void parse_raw(h_resp_t *out, const char *buf, size_t len) {
  const char *end = memmem(buf, len, "\r\n\r\n", 4);
  const char *p, *eol;
  long content_length = -1;

  if (end == NULL || len < 12 || strncmp(buf, "HTTP/1.", 7) != 0) {
    out->transport_error = -2;
    return;
  }
  out->status = strtol(buf + 9, NULL, 10);
  p = memchr(buf, '\n', (size_t)(end - buf));
  while (p && p < end) {
    p++;
    eol = memchr(p, '\n', (size_t)(end + 2 - p));
    if (eol == NULL)
      break;
    take_header(out, p, (size_t)(eol - p));
    if ((size_t)(eol - p) > 15 && strncasecmp(p, "Content-Length:", 15) == 0)
      content_length = strtol(p + 15, NULL, 10);
    p = eol;
  }
  end += 4;
  len -= (size_t)(end - buf);
  if (content_length >= 0 && (size_t)content_length < len)
    len = (size_t)content_length;
  (void)append(out, end, len);
}

int h_dial(h_server_t *s) {
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)s->port)};
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  assert_true(fd >= 0);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0)
    fail_msg("connect to 127.0.0.1:%d: %s", s->port, strerror(errno));
  return fd;
}

void h_raw(h_server_t *s, const char *bytes, size_t len, h_resp_t *out) {
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)s->port)};
  struct timeval tv = {30, 0};
  char *buf = NULL;
  size_t n = 0, cap = 0, sent = 0;
  double start = h_now();
  int fd;

  memset(out, 0, sizeof *out);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    out->transport_error = -1;
    goto done;
  }
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  while (sent < len) {
    ssize_t w = send(fd, bytes + sent, len - sent, MSG_NOSIGNAL);
    if (w <= 0) {
      if (w < 0 && errno == EINTR)
        continue;
      break; /* the server may answer before reading everything */
    }
    sent += (size_t)w;
  }
  for (;;) {
    ssize_t got;
    if (n + 4096 > cap) {
      char *nb = realloc(buf, cap = cap ? cap * 2 : 16384);
      if (nb == NULL)
        break;
      buf = nb;
    }
    got = recv(fd, buf + n, cap - n, 0);
    if (got < 0 && errno == EINTR)
      continue;
    if (got <= 0)
      break;
    n += (size_t)got;
  }
  if (buf)
    parse_raw(out, buf, n);
  else
    out->transport_error = -2;
done:
  if (fd >= 0)
    close(fd);
  free(buf);
  finish(out);
  out->seconds = out->t_end - start;
}

void h_raw_post(h_server_t *s, const char *path, const char *token, const char *key_value,
                const char *body, h_resp_t *out) {
  size_t blen = body ? strlen(body) : 0;
  size_t cap = 2048 + blen + (key_value ? strlen(key_value) : 0);
  char *req = malloc(cap);
  int n;

  if (req == NULL) {
    memset(out, 0, sizeof *out);
    out->transport_error = -1;
    finish(out);
    return;
  }
  n = snprintf(req, cap,
               "POST %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: close\r\n"
               "Content-Type: application/json\r\nContent-Length: %zu\r\n",
               path, s->port, blen);
  if (token)
    n += snprintf(req + n, cap - (size_t)n, "Authorization: Bearer %s\r\n", token);
  if (key_value)
    n += snprintf(req + n, cap - (size_t)n, "Idempotency-Key:%s\r\n", key_value);
  n += snprintf(req + n, cap - (size_t)n, "\r\n%s", body ? body : "");
  h_raw(s, req, (size_t)n, out);
  free(req);
}

/* ---- released together --------------------------------------------- */

struct job {
  h_server_t *s;
  const h_req_t *req;
  h_resp_t *out;
  CURL *c;
  pthread_barrier_t *barrier;
};

static void *job_main(void *p) {
  struct job *j = p;
  pthread_barrier_wait(j->barrier);
  h_http_on(j->c, j->s, j->req, j->out);
  return NULL;
}

void h_together(h_server_t *s, const h_req_t *reqs, int n, h_resp_t *out) {
  h_server_t **each = calloc((size_t)n, sizeof *each);
  assert_non_null(each);
  for (int i = 0; i < n; i++)
    each[i] = s;
  h_together_on(each, reqs, n, out);
  free(each);
}

void h_together_on(h_server_t *const *servers_of, const h_req_t *reqs, int n,
                   h_resp_t *out) {
  pthread_barrier_t barrier;
  pthread_t *threads = calloc((size_t)n, sizeof *threads);
  struct job *jobs = calloc((size_t)n, sizeof *jobs);

  assert_non_null(threads);
  assert_non_null(jobs);
  assert_int_equal(pthread_barrier_init(&barrier, NULL, (unsigned)n), 0);
  for (int i = 0; i < n; i++) {
    jobs[i] = (struct job){servers_of[i], &reqs[i], &out[i], curl_easy_init(), &barrier};
    assert_non_null(jobs[i].c);
  }
  for (int i = 0; i < n; i++)
    assert_int_equal(pthread_create(&threads[i], NULL, job_main, &jobs[i]), 0);
  for (int i = 0; i < n; i++)
    pthread_join(threads[i], NULL);
  for (int i = 0; i < n; i++)
    curl_easy_cleanup(jobs[i].c);
  pthread_barrier_destroy(&barrier);
  free(threads);
  free(jobs);
}

/* ---- the database -------------------------------------------------- */

/* SQLite: runs sql with text parameters; returns SQLITE_ROW with the
 * statement positioned on the first row, SQLITE_DONE for none, or an error. */
static int query(h_server_t *s, sqlite3 **db, sqlite3_stmt **st, const char *sql,
                 va_list ap) {
  const char *p;
  int i = 1, rc;

  *st = NULL;
  rc = sqlite3_open_v2(s->db, db, SQLITE_OPEN_READONLY, NULL);
  if (rc != SQLITE_OK)
    return rc;
  sqlite3_busy_timeout(*db, 10000);
  rc = sqlite3_prepare_v2(*db, sql, -1, st, NULL);
  if (rc != SQLITE_OK)
    return rc;
  while ((p = va_arg(ap, const char *)) != NULL)
    sqlite3_bind_text(*st, i++, p, -1, SQLITE_TRANSIENT);
  return sqlite3_step(*st);
}

static void query_done(sqlite3 *db, sqlite3_stmt *st) {
  sqlite3_finalize(st);
  sqlite3_close(db);
}

/* The SQL with ?N placeholders written as $N, outside quoted literals and
 * identifiers (the same length; malloc'd). */
static char *pg_sql(const char *sql) {
  char *out = strdup(sql);
  char quote = 0;
  if (out == NULL)
    return NULL;
  for (size_t i = 0; out[i]; i++) {
    char c = out[i];
    if (quote) {
      if (c == quote)
        quote = 0; /* '' inside a literal closes and reopens it: still right */
    } else if (c == '\'' || c == '"') {
      quote = c;
    } else if (c == '?' && isdigit((unsigned char)out[i + 1])) {
      out[i] = '$';
    }
  }
  return out;
}

/* PostgreSQL: runs sql on the server's database through the harness's own
 * read-only connection, opened on first use and again when it broke (the
 * cluster may have been restarted). Returns the result (PGRES_TUPLES_OK;
 * the caller clears it) or NULL with the reason in why. */
static PGresult *pg_query(h_server_t *s, const char *sql, va_list ap, char *why,
                          size_t whylen) {
  const char *params[MAX_PARAMS];
  const char *p;
  char *q = pg_sql(sql);
  int n = 0;

  if (q == NULL) {
    snprintf(why, whylen, "out of memory");
    return NULL;
  }
  while ((p = va_arg(ap, const char *)) != NULL) {
    if (n == MAX_PARAMS) {
      snprintf(why, whylen, "more than %d parameters", MAX_PARAMS);
      free(q);
      return NULL;
    }
    params[n++] = p;
  }
  for (int attempt = 0; attempt < 2; attempt++) {
    PGresult *res;
    if (s->pg == NULL || PQstatus(s->pg) != CONNECTION_OK) {
      PQfinish(s->pg);
      s->pg = PQconnectdb(s->db);
      if (s->pg == NULL || PQstatus(s->pg) != CONNECTION_OK) {
        snprintf(why, whylen, "cannot connect: %s",
                 s->pg ? PQerrorMessage(s->pg) : "out of memory");
        continue;
      }
      PQsetNoticeProcessor(s->pg, pg_quiet, NULL);
      PQclear(PQexec(s->pg, "SET default_transaction_read_only = on"));
    }
    res = PQexecParams(s->pg, q, n, NULL, params, NULL, NULL, 0);
    if (PQresultStatus(res) == PGRES_TUPLES_OK) {
      free(q);
      return res;
    }
    snprintf(why, whylen, "%s", PQresultErrorMessage(res));
    PQclear(res);
    if (PQstatus(s->pg) == CONNECTION_OK)
      break; /* the query itself failed: no second try */
  }
  free(q);
  return NULL;
}

/* The first column of the first row as an integer (NULL reads as 0).
 * Returns 1 with *v set, 0 when there is no row, -1 with a reason. */
static int first_int(h_server_t *s, const char *sql, va_list ap, int64_t *v, char *why,
                     size_t whylen) {
  int found;
  *v = 0;
  if (store_url) {
    PGresult *res = pg_query(s, sql, ap, why, whylen);
    if (res == NULL)
      return -1;
    found = PQntuples(res) > 0 && PQnfields(res) > 0;
    if (found && !PQgetisnull(res, 0, 0))
      *v = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
    PQclear(res);
    return found;
  } else {
    sqlite3 *db = NULL;
    sqlite3_stmt *st;
    int rc = query(s, &db, &st, sql, ap);
    if (rc == SQLITE_ROW)
      *v = sqlite3_column_int64(st, 0);
    else if (rc != SQLITE_DONE)
      snprintf(why, whylen, "%s (%d)", db ? sqlite3_errmsg(db) : "open failed", rc);
    query_done(db, st);
    return rc == SQLITE_ROW ? 1 : rc == SQLITE_DONE ? 0 : -1;
  }
}

/* Same, as text: *v is malloc'd, NULL for a NULL value. */
static int first_text(h_server_t *s, const char *sql, va_list ap, char **v, char *why,
                      size_t whylen) {
  int found;
  *v = NULL;
  if (store_url) {
    PGresult *res = pg_query(s, sql, ap, why, whylen);
    if (res == NULL)
      return -1;
    found = PQntuples(res) > 0 && PQnfields(res) > 0;
    if (found && !PQgetisnull(res, 0, 0))
      *v = strdup(PQgetvalue(res, 0, 0));
    PQclear(res);
    return found;
  } else {
    sqlite3 *db = NULL;
    sqlite3_stmt *st;
    int rc = query(s, &db, &st, sql, ap);
    if (rc == SQLITE_ROW && sqlite3_column_type(st, 0) != SQLITE_NULL)
      *v = strdup((const char *)sqlite3_column_text(st, 0));
    else if (rc != SQLITE_ROW && rc != SQLITE_DONE)
      snprintf(why, whylen, "%s (%d)", db ? sqlite3_errmsg(db) : "open failed", rc);
    query_done(db, st);
    return rc == SQLITE_ROW ? 1 : rc == SQLITE_DONE ? 0 : -1;
  }
}

int64_t h__db_int(h_server_t *s, const char *sql, ...) {
  char why[1024] = "no row";
  int64_t v;
  va_list ap;
  int rc;

  va_start(ap, sql);
  rc = first_int(s, sql, ap, &v, why, sizeof why);
  va_end(ap);
  if (rc != 1)
    fail_msg("query '%s': %s", sql, why);
  return v;
}

char *h__db_text(h_server_t *s, const char *sql, ...) {
  char why[1024] = "";
  char *v;
  va_list ap;
  int rc;

  va_start(ap, sql);
  rc = first_text(s, sql, ap, &v, why, sizeof why);
  va_end(ap);
  if (rc < 0)
    fail_msg("query '%s': %s", sql, why);
  return v;
}

int h__db_wait(h_server_t *s, int timeout_ms, const char *sql, ...) {
  double deadline = h_now() + timeout_ms / 1000.0;
  for (;;) {
    char why[1024] = "no row";
    int64_t v;
    va_list ap;
    int rc;

    va_start(ap, sql);
    rc = first_int(s, sql, ap, &v, why, sizeof why);
    va_end(ap);
    if (rc != 1)
      fail_msg("query '%s' failed: %s", sql, why);
    if (v >= 1)
      return 1;
    if (h_now() > deadline)
      return 0;
    nap_ms(5);
  }
}

/* ---- assertions ---------------------------------------------------- */

static char context[512];

void h_context(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(context, sizeof context, fmt, ap);
  va_end(ap);
}

void h_context_clear(void) {
  context[0] = '\0';
}

#define FAIL(fmt, ...)                                                                   \
  fail_msg("%s%s%s" fmt, context[0] ? "[" : "", context, context[0] ? "] " : "",         \
           __VA_ARGS__)

void h__assert_db(h_server_t *s, int64_t want, const char *sql, ...) {
  char why[1024] = "no row";
  int64_t v;
  va_list ap;
  int rc;

  va_start(ap, sql);
  rc = first_int(s, sql, ap, &v, why, sizeof why);
  va_end(ap);
  if (rc != 1)
    FAIL("query '%s' failed: %s", sql, why);
  if (v != want)
    FAIL("'%s' gives %lld, want %lld", sql, (long long)v, (long long)want);
}

/* Library or internal text that must never reach an HTTP body. */
static void assert_no_internals(const h_resp_t *r) {
  static const char *const leaks[] = {
      "sqlite",  "select ", "insert ", "update ", "constraint", "jansson",
      "/src/",   ".c:",     "stack",   "segfault", "postgres",  "libpq"};
  for (size_t i = 0; i < sizeof leaks / sizeof *leaks; i++)
    if (r->body && strcasestr(r->body, leaks[i]))
      FAIL("error body shows internals ('%s'): %.600s", leaks[i], r->body);
}

void h_assert_status(const h_resp_t *r, long status) {
  if (r->status != status)
    FAIL("status %ld (transport error %d), want %ld; body: %.600s", r->status,
         r->transport_error, status, r->body ? r->body : "");
}

void h_assert_error(const h_resp_t *r, long status, const char *message) {
  json_t *e;
  h_assert_status(r, status);
  if (!json_is_object(r->json) || json_object_size(r->json) != 1)
    FAIL("want a body with only \"error\", got: %.600s", r->body);
  e = json_object_get(r->json, "error");
  if (!json_is_string(e) || json_string_length(e) == 0)
    FAIL("\"error\" is not a non-empty string: %.600s", r->body);
  if (message && strcmp(json_string_value(e), message) != 0)
    FAIL("error \"%s\", want \"%s\"", json_string_value(e), message);
  if (strncmp(r->content_type, "application/json", 16) != 0)
    FAIL("Content-Type '%s' on an error", r->content_type);
  assert_no_internals(r);
}

void h_assert_field_error(const h_resp_t *r, const char *field) {
  json_t *errors, *e;
  size_t i;
  int named = 0;

  h_assert_status(r, 422);
  if (!json_is_object(r->json) || json_object_size(r->json) != 1)
    FAIL("want a body with only \"errors\", got: %.600s", r->body);
  errors = json_object_get(r->json, "errors");
  if (!json_is_array(errors) || json_array_size(errors) == 0)
    FAIL("\"errors\" is not a non-empty array: %.600s", r->body);
  json_array_foreach(errors, i, e) {
    json_t *f = json_object_get(e, "field"), *m = json_object_get(e, "message"),
           *c = json_object_get(e, "code");
    if (!json_is_object(e) || json_object_size(e) != 3 || !json_is_string(f) ||
        !json_is_string(m) || !json_is_string(c) || json_string_length(m) == 0 ||
        json_string_length(c) == 0)
      FAIL("error %zu is not {field, message, code}: %.600s", i, r->body);
    if (strcmp(json_string_value(f), field) == 0)
      named = 1;
  }
  if (!named)
    FAIL("no error names the field '%s': %.600s", field, r->body);
  assert_no_internals(r);
}

void h_assert_first(const h_resp_t *r, long status) {
  h_assert_status(r, status);
  if (!json_is_object(r->json))
    FAIL("body is not a JSON object: %.600s", r->body);
  if (json_object_get(r->json, "replayed") != NULL)
    FAIL("a first answer has a \"replayed\" field: %.600s", r->body);
  if (r->replayed[0])
    FAIL("a first answer has Idempotent-Replayed: %s", r->replayed);
}

void h_assert_replay_of(const h_resp_t *r, const h_resp_t *first) {
  json_t *copy;
  h_assert_status(r, first->status);
  if (!json_is_object(r->json))
    FAIL("replay body is not a JSON object: %.600s", r->body);
  if (!json_is_true(json_object_get(r->json, "replayed")))
    FAIL("replay body lacks \"replayed\": true: %.600s", r->body);
  if (strcmp(r->replayed, "true") != 0)
    FAIL("Idempotent-Replayed is '%s', want 'true'", r->replayed);
  if (strcmp(r->location, first->location) != 0)
    FAIL("replay Location '%s', first '%s'", r->location, first->location);
  copy = json_deep_copy(r->json);
  assert_non_null(copy);
  json_object_del(copy, "replayed");
  if (!json_equal(copy, first->json)) {
    json_decref(copy);
    FAIL("replay body differs from the first answer:\n  first:  %.600s\n  replay: %.600s",
         first->body, r->body);
  }
  json_decref(copy);
}

void h_assert_healthy(h_server_t *s) {
  h_resp_t r;
  h_get(s, "/healthz", NULL, &r);
  h_assert_status(&r, 200);
  assert_non_null(r.json);
  assert_string_equal(json_string_value(json_object_get(r.json, "status")), "ok");
  h_resp_free(&r);
}

double h_metric(const char *text, const char *name) {
  size_t n = strlen(name);
  for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
    if (strncmp(p, name, n) == 0 && p[n] == ' ')
      return strtod(p + n + 1, NULL);
  return -1;
}

const char *h_id(const h_resp_t *r) {
  const char *id = json_string_value(json_object_get(r->json, "id"));
  if (id == NULL)
    FAIL("answer has no \"id\": %.600s", r->body ? r->body : "");
  return id;
}
