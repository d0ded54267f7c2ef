/* Internal: JSON text written directly, for what a request writes on its
 * hot path (a payment's and an order's bodies, the request log line).
 * Building a json_t and dumping it was a seventh of a new payment's
 * instructions and a ninth of a new order's (docs/performance.md); unit
 * tests compare what is written here with json_dumps(JSON_COMPACT) for
 * the same values, and numbers with printf's. */
#ifndef IDEM_UTIL_JSON_TEXT_H
#define IDEM_UTIL_JSON_TEXT_H

#include <stddef.h>
#include <string.h>

/* The most bytes idem__json_string() writes for a string of `len` bytes. */
#define IDEM_JSON_STRING_MAX(len) (6 * (len) + 2)

/* Copies the string literal `lit` (JSON text: a key, punctuation) to
 * `out`, without its NUL, and gives its length. */
#define IDEM_JSON_LIT(out, lit) (memcpy((out), (lit), sizeof(lit) - 1), sizeof(lit) - 1)

/* Writes `s` to `out` as a JSON string, quotes included, and returns the
 * bytes written (no NUL). `"` and `\` are escaped with a backslash, bytes
 * below 0x20 as \u00XX, all others copied: for visible ASCII (what idemd's
 * validators let through) the same bytes as json_dumps(). `out` must have
 * room for IDEM_JSON_STRING_MAX(strlen(s)) bytes. */
size_t idem__json_string(char *out, const char *s);

/* Writes `s` escaped as the inside of a JSON string (no quotes), at most
 * `cap` bytes of it, and returns the bytes written (no NUL). `"` and `\`
 * are escaped with a backslash, and every byte outside 0x20-0x7E as
 * \u00XX (a byte above 0x7E as the code point of its value, not as part
 * of a UTF-8 character): the text is ASCII, and a valid JSON string
 * between quotes, whatever `s` holds. When the escaped text is longer
 * than `cap`, what is written is its first `cap` bytes, which may end
 * inside an escape. For text bounded in place (the request log line). */
size_t idem__json_escape_ascii(char *out, size_t cap, const char *s);

/* The most bytes idem__json_int() writes: 19 digits and a sign. */
#define IDEM_JSON_INT_MAX 20

/* Writes `v` to `out` in decimal, as printf's "%lld" would, and returns
 * the bytes written (no NUL). `out` must have room for IDEM_JSON_INT_MAX
 * bytes. */
size_t idem__json_int(char *out, long long v);

#endif
