/* The webhooks of idem-psp: each charge and refund made becomes a signed
 * event, queued in memory and sent by one sender thread to --webhook-url,
 * at least once (sometimes twice, with --webhook-duplicates), retried with
 * a capped backoff until the receiver answers 2xx, and under --chaos
 * delayed at random, which reorders them. The signature is the one idemd
 * checks (src/provider/webhook.h, docs/payments.md "Webhooks").
 *
 * The queue lives in memory only: a crash (crash-after, kill -9) loses
 * the events not yet delivered, as a provider's outage would delay them;
 * idemd's reconciler is the safety net. */
#include <curl/curl.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "psp.h"

/* One delivery: an event (or its duplicate), due at `due_ms`. */
struct delivery {
  struct delivery *next;
  char *body; /* the event's JSON, signed anew at each attempt */
  char id[32];
  char type[24];
  char key[PSP_KEY_MAX + 1];
  int64_t due_ms; /* CLOCK_MONOTONIC */
  int attempts;
};

struct psp_webhooks {
  const psp_config_t *cfg;
  pthread_t thread;
  pthread_mutex_t lock;
  pthread_cond_t wake;    /* on CLOCK_MONOTONIC */
  struct delivery *queue; /* sorted by due_ms, earliest first */
  size_t queued;
  int stopping;
  uint64_t rng; /* draws of duplicates and chaos delays, under `lock` */
  CURL *curl;   /* the sender thread's only */
};

static int64_t mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* splitmix64, as --chaos draws faults (faults.c), on a stream of its own so
 * that events never shift the faults of requests. */
static uint64_t next_u64(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/* A draw in [0, 1). */
static double draw(psp_webhooks_t *wh) {
  return (double)(next_u64(&wh->rng) >> 11) / 9007199254740992.0;
}

static void free_delivery(struct delivery *d) {
  if (d) {
    free(d->body);
    free(d);
  }
}

/* Inserts `d` after every delivery due no later; the caller holds the lock. */
static void enqueue_locked(psp_webhooks_t *wh, struct delivery *d) {
  struct delivery **at = &wh->queue;
  while (*at && (*at)->due_ms <= d->due_ms)
    at = &(*at)->next;
  d->next = *at;
  *at = d;
  wh->queued++;
}

static void log_dropped(const struct delivery *d, const char *why) {
  psp_log(json_pack("{s:s, s:s, s:s, s:s, s:i, s:s}", "event", "webhook_dropped", "id",
                    d->id, "type", d->type, "key", d->key, "attempts", d->attempts, "why",
                    why));
}

/* A copy of `d` due `delay_ms` from now, or NULL when out of memory. */
static struct delivery *copy_delivery(const struct delivery *d, int64_t delay_ms) {
  struct delivery *c = calloc(1, sizeof *c);
  if (c == NULL || (c->body = strdup(d->body)) == NULL) {
    free(c);
    return NULL;
  }
  memcpy(c->id, d->id, sizeof c->id);
  memcpy(c->type, d->type, sizeof c->type);
  memcpy(c->key, d->key, sizeof c->key);
  c->due_ms = mono_ms() + delay_ms;
  return c;
}

void psp_webhooks_emit(psp_webhooks_t *wh, psp_kind_t kind, const psp_charge_t *c) {
  struct delivery d = {0}, *copies[2] = {NULL, NULL};
  unsigned char raw[12];
  int succeeded = strcmp(c->status, "succeeded") == 0;
  /* The merchant's name for it: the key it was made under or, when the
   * key was ignored (stored under its own id), its reference. */
  const char *key = strcmp(c->key, c->id) == 0 && c->reference[0] ? c->reference : c->key;
  json_t *event;

  if (wh == NULL)
    return;
  if (RAND_bytes(raw, sizeof raw) != 1) {
    psp_log(json_pack("{s:s, s:s, s:s}", "event", "webhook_dropped", "key", key, "why",
                      "no random bytes for an event id"));
    return;
  }
  memcpy(d.id, "evt_", 4);
  for (size_t i = 0; i < sizeof raw; i++)
    snprintf(d.id + 4 + 2 * i, 3, "%02x", raw[i]);
  snprintf(d.type, sizeof d.type, "%s.%s", kind == PSP_KIND_REFUND ? "refund" : "charge",
           succeeded ? "succeeded" : "declined");
  snprintf(d.key, sizeof d.key, "%s", key);
  event = json_pack("{s:s, s:s, s:I, s:{s:s, s:s, s:I}}", "id", d.id, "type", d.type,
                    "created", (json_int_t)time(NULL), "data", "key", key, "id", c->id,
                    "amount", (json_int_t)c->amount);
  d.body = event ? json_dumps(event, JSON_COMPACT) : NULL;
  json_decref(event);
  if (d.body == NULL) {
    log_dropped(&d, "out of memory");
    return;
  }

  pthread_mutex_lock(&wh->lock);
  for (int i = 0; i < 2; i++) {
    /* Two draws per copy whatever they decide, so the sequence stays
     * fixed by the seed. */
    double dup = draw(wh), chaos = draw(wh);
    int64_t delay = (int64_t)(next_u64(&wh->rng) % (PSP_WEBHOOK_CHAOS_DELAY_MS + 1));
    if (i == 1 && dup >= wh->cfg->webhook_duplicates)
      break;
    if (chaos >= wh->cfg->chaos)
      delay = 0;
    if (wh->queued >= PSP_WEBHOOK_QUEUE_MAX) {
      log_dropped(&d, "queue full");
      break;
    }
    if ((copies[i] = copy_delivery(&d, delay)) == NULL) {
      log_dropped(&d, "out of memory");
      break;
    }
    enqueue_locked(wh, copies[i]);
  }
  pthread_cond_signal(&wh->wake);
  pthread_mutex_unlock(&wh->lock);
  free(d.body);
}

/* The wait before attempt n + 1 after n failed ones: 100 ms doubling, at
 * most PSP_WEBHOOK_BACKOFF_MAX_MS. */
static int64_t backoff_ms(int attempts) {
  int64_t ms = 100;
  for (int i = 1; i < attempts && ms < PSP_WEBHOOK_BACKOFF_MAX_MS; i++)
    ms *= 2;
  return ms < PSP_WEBHOOK_BACKOFF_MAX_MS ? ms : PSP_WEBHOOK_BACKOFF_MAX_MS;
}

/* "t=<now>,v1=<hex HMAC-SHA256 of "<t>.<body>">" into `out`; 0 or -1. */
static int sign(const char *secret, const char *body, char *out, size_t outlen) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int maclen = 0;
  char t[24], *text;
  size_t tn, bn = strlen(body), used;

  snprintf(t, sizeof t, "%lld", (long long)time(NULL));
  tn = strlen(t);
  if ((text = malloc(tn + 1 + bn)) == NULL)
    return -1;
  memcpy(text, t, tn);
  text[tn] = '.';
  memcpy(text + tn + 1, body, bn);
  if (HMAC(EVP_sha256(), secret, (int)strlen(secret), (unsigned char *)text, tn + 1 + bn,
           mac, &maclen) == NULL) {
    free(text);
    return -1;
  }
  free(text);
  used = (size_t)snprintf(out, outlen, "t=%s,v1=", t);
  for (unsigned i = 0; i < maclen && used + 2 < outlen; i++, used += 2)
    snprintf(out + used, 3, "%02x", mac[i]);
  return 0;
}

static size_t discard(char *b, size_t size, size_t n, void *ud) {
  (void)b;
  (void)ud;
  return size * n;
}

/* Aborts a transfer in flight once the sender is stopping. */
static int on_progress(void *ud, curl_off_t dt, curl_off_t dn, curl_off_t ut,
                       curl_off_t un) {
  psp_webhooks_t *wh = ud;
  int stopping;
  (void)dt;
  (void)dn;
  (void)ut;
  (void)un;
  pthread_mutex_lock(&wh->lock);
  stopping = wh->stopping;
  pthread_mutex_unlock(&wh->lock);
  return stopping;
}

/* One attempt: the HTTP status (0 when none came back). */
static long send_once(psp_webhooks_t *wh, const struct delivery *d) {
  char sig[160], header[200];
  struct curl_slist *h = NULL;
  CURL *c = wh->curl;
  long status = 0;

  if (sign(wh->cfg->webhook_secret, d->body, sig, sizeof sig) != 0)
    return 0;
  snprintf(header, sizeof header, "Idem-Psp-Signature: %s", sig);
  h = curl_slist_append(h, "Content-Type: application/json");
  h = curl_slist_append(h, header);
  h = curl_slist_append(h, "Expect:");
  curl_easy_reset(c);
  curl_easy_setopt(c, CURLOPT_URL, wh->cfg->webhook_url);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
  curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 0L);
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, 2000L);
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, PSP_WEBHOOK_TIMEOUT_MS);
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
  curl_easy_setopt(c, CURLOPT_POSTFIELDS, d->body);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, discard);
  curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, on_progress);
  curl_easy_setopt(c, CURLOPT_XFERINFODATA, wh);
  if (curl_easy_perform(c) == CURLE_OK)
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, NULL);
  curl_slist_free_all(h);
  return status;
}

static void log_attempt(const struct delivery *d, long status, int64_t ms) {
  char now[32];
  time_t t = time(NULL);
  struct tm tm;
  gmtime_r(&t, &tm);
  strftime(now, sizeof now, "%Y-%m-%dT%H:%M:%SZ", &tm);
  psp_log(json_pack("{s:s, s:s, s:s, s:s, s:s, s:i, s:o, s:I}", "time", now, "event",
                    "webhook", "id", d->id, "type", d->type, "key", d->key, "attempt",
                    d->attempts, "status", status ? json_integer(status) : json_null(),
                    "ms", (json_int_t)ms));
}

/* Takes the earliest delivery once it is due; NULL when stopping. */
static struct delivery *next_due(psp_webhooks_t *wh) {
  struct delivery *d = NULL;

  pthread_mutex_lock(&wh->lock);
  while (!wh->stopping) {
    int64_t now = mono_ms();
    if (wh->queue && wh->queue->due_ms <= now) {
      d = wh->queue;
      wh->queue = d->next;
      wh->queued--;
      break;
    }
    if (wh->queue == NULL) {
      pthread_cond_wait(&wh->wake, &wh->lock);
    } else {
      int64_t due = wh->queue->due_ms;
      struct timespec until = {(time_t)(due / 1000), (long)(due % 1000) * 1000000L};
      (void)pthread_cond_timedwait(&wh->wake, &wh->lock, &until);
    }
  }
  pthread_mutex_unlock(&wh->lock);
  return d;
}

static void *sender_main(void *arg) {
  psp_webhooks_t *wh = arg;
  struct delivery *d;

  while ((d = next_due(wh)) != NULL) {
    int64_t start = mono_ms();
    long status;

    d->attempts++;
    status = send_once(wh, d);
    log_attempt(d, status, mono_ms() - start);
    if (status >= 200 && status < 300) {
      free_delivery(d);
      continue;
    }
    if (d->attempts >= PSP_WEBHOOK_MAX_ATTEMPTS) {
      log_dropped(d, "no 2xx after the last attempt");
      free_delivery(d);
      continue;
    }
    d->due_ms = mono_ms() + backoff_ms(d->attempts);
    pthread_mutex_lock(&wh->lock);
    enqueue_locked(wh, d);
    pthread_mutex_unlock(&wh->lock);
  }
  return NULL;
}

psp_webhooks_t *psp_webhooks_start(const psp_config_t *cfg, char *err, size_t errlen) {
  psp_webhooks_t *wh = calloc(1, sizeof *wh);
  pthread_condattr_t attr;
  int rc;

  if (wh == NULL || (wh->curl = curl_easy_init()) == NULL) {
    free(wh);
    snprintf(err, errlen, "out of memory");
    return NULL;
  }
  wh->cfg = cfg;
  wh->rng = cfg->seed ^ 0x7765626830303031ULL; /* "webh0001": apart from --chaos's */
  pthread_mutex_init(&wh->lock, NULL);
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(&wh->wake, &attr);
  pthread_condattr_destroy(&attr);
  if ((rc = pthread_create(&wh->thread, NULL, sender_main, wh)) != 0) {
    snprintf(err, errlen, "cannot start the webhook sender: %s", strerror(rc));
    pthread_cond_destroy(&wh->wake);
    pthread_mutex_destroy(&wh->lock);
    curl_easy_cleanup(wh->curl);
    free(wh);
    return NULL;
  }
  return wh;
}

void psp_webhooks_stop(psp_webhooks_t *wh) {
  size_t unsent;

  if (wh == NULL)
    return;
  pthread_mutex_lock(&wh->lock);
  wh->stopping = 1;
  pthread_cond_broadcast(&wh->wake);
  pthread_mutex_unlock(&wh->lock);
  pthread_join(wh->thread, NULL);
  unsent = wh->queued;
  while (wh->queue) {
    struct delivery *d = wh->queue;
    wh->queue = d->next;
    free_delivery(d);
  }
  psp_log(
      json_pack("{s:s, s:I}", "event", "webhooks_stopped", "unsent", (json_int_t)unsent));
  curl_easy_cleanup(wh->curl);
  pthread_cond_destroy(&wh->wake);
  pthread_mutex_destroy(&wh->lock);
  free(wh);
}
