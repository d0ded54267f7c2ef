/* A small HTTP server of its own, on libmicrohttpd, that gets the rules
 * of docs/idempotency.md, section 2 (Idempotency-Key), from libidem: POST
 * /notes creates a note at most once per key, GET /notes/{id} reads it
 * back. Everything idempotent is libidem's: the key rules
 * (idem_key_parse), the fingerprint (idem_fingerprint), the decision and
 * the record (idem_engine_begin) over a SQLite store. The notes are this
 * program's own table, written by an effect in the transaction that wins
 * the key; this file maps decisions to HTTP answers.
 *
 *   embed-notes <port (0: any free one)> <database file>
 *
 * It listens on 127.0.0.1 only and prints "listening on
 * http://127.0.0.1:<port>" once it does; SIGINT or SIGTERM stop it. */
#include <arpa/inet.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "idem/canon.h"
#include "idem/clock.h"
#include "idem/crypto.h"
#include "idem/engine.h"
#include "idem/key.h"
#include "idem/store.h"

#define BODY_MAX 16384 /* a request body larger than this gets 413 */
#define TEXT_MAX 1000  /* characters of a note's text */
#define OPERATION "create_note"

static idem_store_t *store;
static idem_engine_t *engine;
/* Keys are scoped by a number the caller gives (a tenant, a user); this
 * server has one client, so every key is scoped to 1. */
#define TENANT 1

/* What one request gathers while libmicrohttpd hands over its body. */
typedef struct request {
  char body[BODY_MAX + 1];
  size_t len;
  int too_large;
} request_t;

/* The note a POST creates, filled by prepare() only when the request may
 * win its key, so that a replay never makes one. */
typedef struct note {
  const char *text;
  char id[32];
  char location[48];
  char *json; /* {"id":...,"text":...}, malloc'd */
  idem_outcome_t outcome;
} note_t;

/* Runs `sql` with text parameters on a connection libidem lends (an
 * effect's transaction, or a read); `out`, when given, gets the first
 * column of the first row (malloc'd). */
static int run_sql(idem_tx_t *tx, const char *sql, int n, const char *const *params,
                   char **out) {
  sqlite3_stmt *st = NULL;
  int rc;

  if (sqlite3_prepare_v2(idem_tx_handle(tx), sql, -1, &st, NULL) != SQLITE_OK)
    return IDEM_ESTORE;
  for (int i = 0; i < n; i++)
    sqlite3_bind_text(st, i + 1, params[i], -1, SQLITE_STATIC);
  rc = sqlite3_step(st);
  if (rc == SQLITE_ROW && out) {
    const unsigned char *text = sqlite3_column_text(st, 0);
    if ((*out = strdup(text ? (const char *)text : "")) == NULL)
      rc = SQLITE_NOMEM;
  }
  sqlite3_finalize(st);
  if (rc == SQLITE_NOMEM)
    return IDEM_ENOMEM;
  if (out) /* a read: one row, or none */
    return rc == SQLITE_ROW ? IDEM_OK : rc == SQLITE_DONE ? IDEM_ENOTFOUND : IDEM_ESTORE;
  return rc == SQLITE_DONE || rc == SQLITE_ROW ? IDEM_OK : IDEM_ESTORE;
}

/* The effect: the note's row, in the transaction that wins the key. */
static int insert_note(void *arg, idem_tx_t *tx) {
  const note_t *n = arg;
  const char *p[2] = {n->id, n->json};
  return run_sql(tx, "INSERT INTO notes (id, body) VALUES (?1, ?2)", 2, p, NULL);
}

static int create_table(void *arg, idem_tx_t *tx) {
  (void)arg;
  return run_sql(tx, "CREATE TABLE IF NOT EXISTS notes (id TEXT PRIMARY KEY, body TEXT NOT NULL)",
                 0, NULL, NULL);
}

struct note_read {
  const char *id;
  char *body;
};

static int read_note(void *arg, idem_tx_t *tx) {
  struct note_read *r = arg;
  return run_sql(tx, "SELECT body FROM notes WHERE id = ?1", 1, &r->id, &r->body);
}

static enum MHD_Result reply(struct MHD_Connection *conn, unsigned status,
                             const char *body, const char *location, int replayed,
                             int retry_after) {
  struct MHD_Response *resp =
      MHD_create_response_from_buffer(strlen(body), (void *)body, MHD_RESPMEM_MUST_COPY);
  enum MHD_Result ret;

  if (resp == NULL)
    return MHD_NO;
  MHD_add_response_header(resp, "Content-Type", "application/json");
  if (location && location[0])
    MHD_add_response_header(resp, "Location", location);
  if (replayed)
    MHD_add_response_header(resp, "Idempotent-Replayed", "true");
  if (retry_after)
    MHD_add_response_header(resp, "Retry-After", "1");
  ret = MHD_queue_response(conn, status, resp);
  MHD_destroy_response(resp);
  return ret;
}

static enum MHD_Result reply_error(struct MHD_Connection *conn, unsigned status,
                                   const char *message) {
  char body[512];
  json_t *err = json_pack("{s:s}", "error", message);
  char *text = err ? json_dumps(err, JSON_COMPACT) : NULL;

  snprintf(body, sizeof body, "%s", text ? text : "{}");
  free(text);
  json_decref(err);
  return reply(conn, status, body, NULL, 0, status == MHD_HTTP_CONFLICT);
}

/* The note's id and body, made once the engine is about to reserve the
 * key; the effect writes them with the record, in its transaction. */
static int prepare(void *arg) {
  note_t *n = arg;
  char token[21];
  json_t *doc;
  int rc = idem_sortable_token(token, sizeof token - 1, idem_now_ms());

  if (rc != IDEM_OK)
    return rc;
  snprintf(n->id, sizeof n->id, "note_%s", token);
  snprintf(n->location, sizeof n->location, "/notes/%s", n->id);
  free(n->json);
  doc = json_pack("{s:s,s:s}", "id", n->id, "text", n->text);
  n->json = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
  json_decref(doc);
  if (n->json == NULL)
    return IDEM_ENOMEM;
  n->outcome = (idem_outcome_t){.state = IDEM_STATE_COMPLETED,
                                .status = MHD_HTTP_CREATED,
                                .body = n->json,
                                .location = n->location,
                                .resource_id = n->id};
  return IDEM_OK;
}

/* POST /notes: parse the key and the body, then let the engine decide.
 * A single step: the note's row (the effect) and the completed record
 * are written in the one transaction that wins the key. */
static enum MHD_Result create_note(struct MHD_Connection *conn, const request_t *req) {
  const char *raw = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Idempotency-Key");
  char key[IDEM_KEY_MAX + 1], fp[IDEM_FINGERPRINT_LEN], corr[17];
  size_t key_len;
  note_t note = {0};
  idem_record_t rec = {0};
  idem_decision_t d;
  enum MHD_Result ret;
  json_t *body, *cmd;
  int rc = idem_key_parse(raw, raw ? strlen(raw) : 0, key, &key_len);

  if (rc != IDEM_OK)
    return reply_error(conn, MHD_HTTP_BAD_REQUEST, idem_strerror(rc));
  if (req->too_large)
    return reply_error(conn, 413, "body too large");
  body = json_loadb(req->body, req->len, JSON_REJECT_DUPLICATES, NULL);
  note.text = json_string_value(json_object_get(body, "text"));
  if (!json_is_object(body) || json_object_size(body) != 1 || note.text == NULL ||
      note.text[0] == '\0' || strlen(note.text) > TEXT_MAX) {
    json_decref(body);
    return reply_error(conn, MHD_HTTP_BAD_REQUEST,
                       "body must be {\"text\": \"...\"} (1 to 1000 characters)");
  }
  /* The validated command is what the fingerprint covers. */
  cmd = json_pack("{s:s}", "text", note.text);
  rc = cmd ? idem_fingerprint(OPERATION, cmd, fp) : IDEM_ENOMEM;
  json_decref(cmd);
  if (rc == IDEM_OK)
    rc = idem_random_token(corr, sizeof corr - 1);
  if (rc != IDEM_OK) {
    json_decref(body);
    return reply_error(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, idem_strerror(rc));
  }

  idem_begin_t b = {.scope = {TENANT, OPERATION, key},
                    .fingerprint = fp,
                    .correlation_id = corr,
                    .effect = {insert_note, &note},
                    .outcome = &note.outcome,
                    .prepare = prepare,
                    .arg = &note};
  rc = idem_engine_begin(engine, &b, &rec, &d); /* may wait for a duplicate */
  if (rc != IDEM_OK) {
    fprintf(stderr, "embed-notes: %s (%s)\n", idem_strerror(rc), idem_store_last_error());
    ret = reply_error(conn, MHD_HTTP_SERVICE_UNAVAILABLE, "try again later");
  } else if (d == IDEM_DECIDE_EXECUTE) { /* won and completed: the note is new */
    ret = reply(conn, rec.response_status, rec.response_body ? rec.response_body : "{}",
                rec.location, 0, 0);
  } else if (d == IDEM_DECIDE_REPLAY || d == IDEM_DECIDE_PENDING) {
    ret = reply(conn, rec.response_status, rec.response_body ? rec.response_body : "{}",
                rec.location, 1, 0);
  } else if (d == IDEM_DECIDE_MISMATCH) {
    ret = reply_error(conn, 422, "Idempotency-Key was used with another request");
  } else { /* IN_FLIGHT: the original still runs at the wait's bound */
    ret = reply_error(conn, MHD_HTTP_CONFLICT, "a request with this key is in progress");
  }
  idem_record_reset(&rec);
  free(note.json);
  json_decref(body);
  return ret;
}

/* GET /notes/{id}: the row the key's first request wrote. */
static enum MHD_Result get_note(struct MHD_Connection *conn, const char *id) {
  struct note_read r = {id, NULL};
  idem_effect_t e = {read_note, &r};
  int rc = idem_store_read(store, &e);
  enum MHD_Result ret;

  if (rc == IDEM_ENOTFOUND)
    return reply_error(conn, MHD_HTTP_NOT_FOUND, "no such note");
  if (rc != IDEM_OK)
    return reply_error(conn, MHD_HTTP_SERVICE_UNAVAILABLE, "try again later");
  ret = reply(conn, MHD_HTTP_OK, r.body, NULL, 0, 0);
  free(r.body);
  return ret;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *upload,
                              size_t *upload_size, void **con_cls) {
  request_t *req = *con_cls;

  if (req == NULL) { /* first call: headers only */
    if ((req = calloc(1, sizeof *req)) == NULL)
      return MHD_NO;
    *con_cls = req;
    return MHD_YES;
  }
  if (*upload_size > 0) {
    if (req->len + *upload_size > BODY_MAX)
      req->too_large = 1;
    if (!req->too_large) {
      memcpy(req->body + req->len, upload, *upload_size);
      req->len += *upload_size;
    }
    *upload_size = 0;
    return MHD_YES;
  }
  if (strcmp(url, "/notes") == 0 && strcmp(method, "POST") == 0)
    return create_note(conn, req);
  if (strncmp(url, "/notes/", 7) == 0 && strcmp(method, "GET") == 0)
    return get_note(conn, url + 7);
  return reply_error(conn, MHD_HTTP_NOT_FOUND, "no such route");
}

static void request_done(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode code) {
  free(*con_cls);
  *con_cls = NULL;
}

int main(int argc, char **argv) {
  struct sockaddr_in addr = {.sin_family = AF_INET};
  struct MHD_Daemon *d;
  const union MHD_DaemonInfo *info;
  sigset_t stop;
  int rc, sig;

  if (argc != 3) {
    fprintf(stderr, "usage: embed-notes <port> <database file>\n");
    return 2;
  }
  addr.sin_port = htons((uint16_t)atoi(argv[1]));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  idem_effect_t schema = {create_table, NULL};
  if ((rc = idem_store_open(argv[2], NULL, &store)) != IDEM_OK ||
      (rc = idem_store_migrate(store)) != IDEM_OK ||
      (rc = idem_store_write(store, &schema)) != IDEM_OK ||
      (rc = idem_engine_new(store, NULL, &engine)) != IDEM_OK) {
    fprintf(stderr, "embed-notes: %s (%s)\n", idem_strerror(rc), idem_store_last_error());
    return 1;
  }

  /* Signals are taken by sigwait() below, not by the server's threads. */
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, NULL);
  /* A thread per connection: idem_engine_begin() may block while it waits
   * for a duplicate in flight, which costs only that connection's thread. */
  d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD, 0,
                       NULL, NULL, handle, NULL, MHD_OPTION_SOCK_ADDR, &addr,
                       MHD_OPTION_NOTIFY_COMPLETED, request_done, NULL, MHD_OPTION_END);
  if (d == NULL || (info = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT)) == NULL) {
    fprintf(stderr, "embed-notes: cannot listen on 127.0.0.1:%s\n", argv[1]);
    return 1;
  }
  printf("listening on http://127.0.0.1:%u\n", (unsigned)info->port);
  fflush(stdout);
  sigwait(&stop, &sig);

  MHD_stop_daemon(d);
  idem_engine_free(engine);
  idem_store_close(store);
  return 0;
}
