/* Wall-clock and monotonic milliseconds, and RFC 3339 timestamps. */
#include "idem/clock.h"

#include <string.h>
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

/* The text of the second a thread formatted last: every new payment and
 * order is stamped, and gmtime_r() (which takes glibc's time zone lock)
 * and strftime() were most of the cost. */
struct formatted_second {
  int valid;
  time_t secs;
  size_t len;    /* strftime's result: 0 when the text did not fit */
  char text[64]; /* any year an int holds, and more */
};

void idem_format_time(int64_t ms, char *out, size_t outlen) {
  static __thread struct formatted_second last;
  time_t secs = (time_t)(ms / 1000);

  if (!last.valid || last.secs != secs) {
    struct tm tm;
    last.len = gmtime_r(&secs, &tm) == NULL
                   ? 0
                   : strftime(last.text, sizeof last.text, "%Y-%m-%dT%H:%M:%SZ", &tm);
    last.secs = secs;
    last.valid = 1;
  }
  if (outlen == 0)
    return;
  if (last.len == 0 || last.len >= outlen) /* as strftime() into `out` */
    out[0] = '\0';
  else
    memcpy(out, last.text, last.len + 1);
}
