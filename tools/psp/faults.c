/* Fault sets of idem-psp: durations, the X-Psp-Fault header grammar, and
 * the seeded generator behind --chaos. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "psp.h"

int psp_parse_duration(const char *s, int64_t *ms) {
  int64_t n = 0;
  size_t digits = 0;

  while (s[digits] >= '0' && s[digits] <= '9') {
    n = n * 10 + (s[digits] - '0');
    if (++digits > 10)
      return -1;
  }
  if (digits == 0)
    return -1;
  if (strcmp(s + digits, "ms") != 0) {
    if (s[digits] != '\0' && strcmp(s + digits, "s") != 0)
      return -1;
    n *= 1000;
  }
  if (n > PSP_MAX_DURATION_MS)
    return -1;
  *ms = n;
  return 0;
}

/* Applies one token ("fail-after", "latency=300ms") to `f`. */
static int apply_token(const char *tok, psp_faults_t *f) {
  static const struct {
    const char *name;
    size_t offset;
  } flags[] = {
      {"fail-before", offsetof(psp_faults_t, fail_before)},
      {"fail-after", offsetof(psp_faults_t, fail_after)},
      {"drop-after", offsetof(psp_faults_t, drop_after)},
      {"crash-after", offsetof(psp_faults_t, crash_after)},
      {"decline", offsetof(psp_faults_t, decline)},
  };

  if (strcmp(tok, "none") == 0)
    return 0;
  if (strncmp(tok, "latency=", 8) == 0)
    return psp_parse_duration(tok + 8, &f->latency_ms);
  if (strncmp(tok, "delay-after-charge=", 19) == 0)
    return psp_parse_duration(tok + 19, &f->delay_ms);
  for (size_t i = 0; i < sizeof flags / sizeof *flags; i++)
    if (strcmp(tok, flags[i].name) == 0) {
      *(int *)((char *)f + flags[i].offset) = 1;
      return 0;
    }
  return -1;
}

int psp_faults_parse(const char *list, psp_faults_t *out) {
  char tok[64];
  int ntokens = 0;

  memset(out, 0, sizeof *out);
  for (const char *p = list;;) {
    size_t n;
    while (*p == ' ' || *p == '\t')
      p++;
    n = strcspn(p, ",");
    while (n > 0 && (p[n - 1] == ' ' || p[n - 1] == '\t'))
      n--;
    if (n == 0 || n >= sizeof tok)
      return -1;
    memcpy(tok, p, n);
    tok[n] = '\0';
    if (apply_token(tok, out) != 0)
      return -1;
    ntokens++;
    p += strcspn(p, ",");
    if (*p == '\0')
      break;
    p++;
  }
  return ntokens > 0 ? 0 : -1;
}

/* Appends ",tok" (or "tok" to an empty string), truncating at outlen. */
static void append(char *out, size_t outlen, const char *tok) {
  size_t used = strlen(out);
  snprintf(out + used, outlen - used, "%s%s", used ? "," : "", tok);
}

void psp_faults_describe(const psp_faults_t *f, char *out, size_t outlen) {
  char tok[48];

  out[0] = '\0';
  if (f->latency_ms) {
    snprintf(tok, sizeof tok, "latency=%lldms", (long long)f->latency_ms);
    append(out, outlen, tok);
  }
  if (f->fail_before)
    append(out, outlen, "fail-before");
  if (f->decline)
    append(out, outlen, "decline");
  if (f->delay_ms) {
    snprintf(tok, sizeof tok, "delay-after-charge=%lldms", (long long)f->delay_ms);
    append(out, outlen, tok);
  }
  if (f->crash_after)
    append(out, outlen, "crash-after");
  if (f->drop_after)
    append(out, outlen, "drop-after");
  if (f->fail_after)
    append(out, outlen, "fail-after");
  if (out[0] == '\0')
    snprintf(out, outlen, "none");
}

/* splitmix64: tiny, good enough, and the same on every platform. */
static uint64_t chaos_state;
static pthread_mutex_t chaos_lock = PTHREAD_MUTEX_INITIALIZER;

static uint64_t next_u64(void) {
  uint64_t z = (chaos_state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

void psp_chaos_seed(uint64_t seed) {
  pthread_mutex_lock(&chaos_lock);
  chaos_state = seed;
  pthread_mutex_unlock(&chaos_lock);
}

int psp_chaos_pick(double p, psp_faults_t *f) {
  uint64_t roll, which, delay;

  if (p <= 0)
    return 0;
  /* Three draws per request, whatever the outcome, so that one request's
   * luck never shifts the faults of the next. */
  pthread_mutex_lock(&chaos_lock);
  roll = next_u64();
  which = next_u64();
  delay = next_u64();
  pthread_mutex_unlock(&chaos_lock);
  if ((double)(roll >> 11) / 9007199254740992.0 >= p)
    return 0;
  switch (which % 4) {
  case 0:
    f->fail_before = 1;
    break;
  case 1:
    f->fail_after = 1;
    break;
  case 2:
    f->drop_after = 1;
    break;
  default:
    f->delay_ms = 100 + (int64_t)(delay % 1401);
    break;
  }
  return 1;
}
