/* idem-psp, the payment-provider simulator: what its files share. The
 * configuration (config.c), the fault set of one request (faults.c), the
 * store of charges and refunds (store.c) and the HTTP server (http.c);
 * main.c ties them. */
#ifndef IDEM_PSP_H
#define IDEM_PSP_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define PSP_KEY_MAX 255
#define PSP_MAX_BODY (64 * 1024)
#define PSP_MAX_DECLINES 64
#define PSP_MAX_DURATION_MS ((int64_t)3600 * 1000)
#define PSP_URL_MAX 1023
#define PSP_SECRET_MAX 255
#define PSP_LIST_MAX 100 /* charges or refunds in one GET ?reference= */
/* Webhooks (webhooks.c): an attempt's time limit, the backoff's cap, the
 * attempts of one delivery, the events held at once, and the most a
 * --chaos delay adds. */
#define PSP_WEBHOOK_TIMEOUT_MS 5000L
#define PSP_WEBHOOK_BACKOFF_MAX_MS 5000
#define PSP_WEBHOOK_MAX_ATTEMPTS 100
#define PSP_WEBHOOK_QUEUE_MAX 100000
#define PSP_WEBHOOK_CHAOS_DELAY_MS 2000

/* The faults applied to one POST /charges or POST /refunds, in the order
 * they act: latency, fail-before, (the charge or refund, declined when
 * `decline`), delay-after-charge, then crash-after, drop-after or
 * fail-after. */
typedef struct psp_faults {
  int64_t latency_ms;
  int64_t delay_ms; /* delay-after-charge */
  int fail_before;
  int fail_after;
  int drop_after;
  int crash_after;
  int decline;
} psp_faults_t;

typedef struct psp_config {
  char listen_host[256];
  int listen_port;
  char db[1024];
  psp_faults_t faults; /* the default for every request */
  int64_t decline_amounts[PSP_MAX_DECLINES];
  int ndecline;
  double chaos; /* 0..1 */
  uint64_t seed;
  int seed_set;
  char webhook_url[PSP_URL_MAX + 1];       /* "" for no webhooks */
  char webhook_secret[PSP_SECRET_MAX + 1]; /* set whenever webhook_url is */
  double webhook_duplicates;               /* 0..1 */
  int ignore_key; /* every POST makes a new charge or refund */
} psp_config_t;

/* ---- config.c ---- */

enum { PSP_RUN = 0, PSP_HELP = 1, PSP_VERSION = 2, PSP_BAD_USAGE = -1 };

/* Fills `cfg` from the IDEM_PSP_* environment, then from argv (flags win).
 * Returns PSP_RUN, PSP_HELP (--help anywhere), PSP_VERSION (--version
 * anywhere), or PSP_BAD_USAGE with a one-line reason in `err`. */
int psp_config_load(psp_config_t *cfg, int argc, char **argv, char *err, size_t errlen);
void psp_usage(FILE *out);
/* Is `amount` one of the --decline-amount values? */
int psp_config_declines(const psp_config_t *cfg, int64_t amount);

/* ---- faults.c ---- */

/* "500ms", "2s" or a bare number of seconds, up to PSP_MAX_DURATION_MS.
 * Returns 0 and sets *ms, or -1. */
int psp_parse_duration(const char *s, int64_t *ms);
/* Parses an X-Psp-Fault value (comma-separated; "none" for no fault) into
 * a zeroed `out`. Returns 0, or -1 when a token is unknown or malformed. */
int psp_faults_parse(const char *list, psp_faults_t *out);
/* Writes the faults as an X-Psp-Fault value ("none" when empty). */
void psp_faults_describe(const psp_faults_t *f, char *out, size_t outlen);
/* Seeds the chaos generator. */
void psp_chaos_seed(uint64_t seed);
/* With probability `p` adds one fault to `f` (fail-before, fail-after,
 * drop-after, or delay-after-charge of 100-1500 ms) and returns 1; else
 * returns 0. The sequence of draws is fixed by the seed. Thread-safe. */
int psp_chaos_pick(double p, psp_faults_t *f);

/* ---- store.c ---- */

/* A charge, or a refund of one: both are made once per key, ever, and
 * stored and answered alike. */
typedef struct psp_charge {
  char id[40];               /* ch_... or re_... */
  char key[PSP_KEY_MAX + 1]; /* the Idempotency-Key it was made under (its
                                own id when the key was ignored) */
  char charge[PSP_KEY_MAX + 1]; /* a refund's: the key of the charge refunded */
  int64_t amount;
  char currency[4];
  char status[16]; /* "succeeded" or "declined" */
  char created_at[32];
  char reference[PSP_KEY_MAX + 1]; /* the merchant's, "" when none was sent */
} psp_charge_t;

typedef struct psp_store psp_store_t;

enum { PSP_STORE_ERROR = -1, PSP_FOUND = 0, PSP_NOT_FOUND = 1, PSP_CREATED = 2 };

/* What a POST makes, and what a key names: charges and refunds have keys
 * of their own (one key may name a charge and a refund). */
typedef enum psp_kind { PSP_KIND_CHARGE = 0, PSP_KIND_REFUND = 1 } psp_kind_t;

/* Opens (creating) the database at `path`: WAL, synchronous=FULL, schema.
 * Returns the store (close with psp_store_close) or NULL with a reason. */
psp_store_t *psp_store_open(const char *path, char *err, size_t errlen);
void psp_store_close(psp_store_t *s);
/* Counts one POST /charges (or /refunds, by `kind`), and one for `key`
 * unless it is NULL. Returns 0 or PSP_STORE_ERROR. */
int psp_store_count_request(psp_store_t *s, psp_kind_t kind, const char *key);
/* Inserts `want` unless its key already has a charge, then reads the
 * charge of that key into `out`. Returns PSP_CREATED, PSP_FOUND (a charge
 * made earlier, which may differ from `want`) or PSP_STORE_ERROR. With
 * `ignore_key` the charge is stored under its own id (want->id) as its
 * key: always a new one. */
int psp_store_charge(psp_store_t *s, const psp_charge_t *want, int ignore_key,
                     psp_charge_t *out);
/* In one transaction: unless want->key already has a refund (with
 * `ignore_key`: always; the refund is stored under its own id as its
 * key), inserts `want` as a refund of the charge under want->charge (or,
 * when no charge has that key, the charge of that reference, a succeeded
 * one first), "succeeded" or
 * "declined" (want->status is not read): declined when `decline`, when
 * that charge is unknown or not succeeded, when want->currency is given
 * ("" takes the charge's) and is not the charge's, or when the charge's
 * succeeded refunds and want->amount would exceed it. Then reads the
 * refund of that key into `out`. Returns PSP_CREATED, PSP_FOUND (a refund
 * made earlier, which may differ from `want`) or PSP_STORE_ERROR. */
int psp_store_refund(psp_store_t *s, const psp_charge_t *want, int decline,
                     int ignore_key, psp_charge_t *out);
/* Reads into out[0..max) the charges (or refunds) made under `reference`,
 * oldest first, and sets *n. Returns 0 or PSP_STORE_ERROR. */
int psp_store_list(psp_store_t *s, psp_kind_t kind, const char *reference,
                   psp_charge_t *out, int max, int *n);
/* Reads the charge (or refund) made under `key`: PSP_FOUND, PSP_NOT_FOUND
 * or PSP_STORE_ERROR. */
int psp_store_get(psp_store_t *s, psp_kind_t kind, const char *key, psp_charge_t *out);
/* The body of GET /stats (caller owns it), or NULL on a store error. */
json_t *psp_store_stats(psp_store_t *s);

/* ---- webhooks.c ---- */

typedef struct psp_webhooks psp_webhooks_t;

/* Starts the sender thread of cfg->webhook_url (set), which must outlive
 * it. Returns the sender (stop with psp_webhooks_stop), or NULL with a
 * reason in `err`. */
psp_webhooks_t *psp_webhooks_start(const psp_config_t *cfg, char *err, size_t errlen);
/* Queues the event of `c`, a charge or refund just made (`kind`), whose
 * data.key is c->key, or c->reference when the key was ignored: sent
 * once, and a second time with probability cfg->webhook_duplicates, each
 * copy delayed up to PSP_WEBHOOK_CHAOS_DELAY_MS with probability
 * cfg->chaos. Never blocks on the network. Does nothing when `wh` is NULL;
 * an event that cannot be queued (out of memory, PSP_WEBHOOK_QUEUE_MAX
 * queued) is logged as dropped. Thread-safe. */
void psp_webhooks_emit(psp_webhooks_t *wh, psp_kind_t kind, const psp_charge_t *c);
/* Stops the sender (a transfer in flight is cut short), logs how many
 * deliveries were left unsent and frees it all. NULL does nothing. */
void psp_webhooks_stop(psp_webhooks_t *wh);

/* ---- http.c ---- */

typedef struct psp_server psp_server_t;

enum { PSP_START_BAD_ADDRESS = -2, PSP_START_FAILED = -1 };

/* Starts serving on cfg's address (thread per connection); each charge and
 * refund made goes to `webhooks` (NULL: none). `cfg`, `store` and
 * `webhooks` must outlive the server. Returns 0 and sets *out, or
 * PSP_START_BAD_ADDRESS / PSP_START_FAILED with a reason in `err`. */
int psp_server_start(const psp_config_t *cfg, psp_store_t *store,
                     psp_webhooks_t *webhooks, psp_server_t **out, char *err,
                     size_t errlen);
/* Wakes requests sleeping in a fault, waits for requests in flight and
 * frees the server. */
void psp_server_stop(psp_server_t *srv);

/* Writes one JSON object as a line on stderr (steals `line`). */
void psp_log(json_t *line);

#endif
