/* Wall-clock and monotonic milliseconds, and RFC 3339 timestamps. */
#include "idem/clock.h"

#include <time.h>

int64_t idem_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t idem_mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t idem_mono_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

void idem_format_time(int64_t ms, char *out, size_t outlen) {
  time_t secs = (time_t)(ms / 1000);
  struct tm tm;
  gmtime_r(&secs, &tm);
  if (strftime(out, outlen, "%Y-%m-%dT%H:%M:%SZ", &tm) == 0 && outlen > 0)
    out[0] = '\0';
}
