/* Time for records and logs: wall-clock milliseconds, a monotonic clock for
 * deadlines, and the timestamp format of API bodies. */
#ifndef IDEM_CLOCK_H
#define IDEM_CLOCK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Milliseconds since the Unix epoch (CLOCK_REALTIME). */
int64_t idem_now_ms(void);

/* Milliseconds on CLOCK_MONOTONIC; only differences are meaningful. */
int64_t idem_mono_ms(void);

/* Microseconds on CLOCK_MONOTONIC; only differences are meaningful. */
int64_t idem_mono_us(void);

/* Formats `ms` since the epoch as RFC 3339 UTC with seconds precision
 * ("2026-11-30T08:13:19Z") into `out` (at least 21 bytes; an empty string
 * when the text does not fit, nothing written when `outlen` is 0). Each
 * thread remembers the last second it formatted. */
void idem_format_time(int64_t ms, char *out, size_t outlen);

#ifdef __cplusplus
}
#endif
#endif
