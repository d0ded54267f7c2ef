/* The idempotency record: what the store keeps for one (tenant, operation,
 * key), and the states it moves through (docs/idempotency.md, section 2.7). */
#ifndef IDEM_RECORD_H
#define IDEM_RECORD_H

#include <stddef.h>
#include <stdint.h>

#include "idem/canon.h"
#include "idem/key.h"

#ifdef __cplusplus
extern "C" {
#endif

#define IDEM_OPERATION_MAX 32  /* "create_payment" */
#define IDEM_ID_MAX 63         /* resource ids, correlation ids */
#define IDEM_TOKEN_MAX 32      /* owner tokens */
#define IDEM_REF_MAX 127       /* provider references */
#define IDEM_LOCATION_MAX 127  /* "/payments/pay_..." */

/*
 *   (none) --reserve--> processing --complete--> completed
 *                           |  \--------------> pending --settle--> completed
 *                           \---release-------> failed  --reserve--> processing
 *   completed / failed --expire--> (none)
 */
typedef enum idem_state {
  IDEM_STATE_NONE = 0,
  IDEM_STATE_PROCESSING,
  IDEM_STATE_COMPLETED,
  IDEM_STATE_FAILED,
  IDEM_STATE_PENDING
} idem_state_t;

/* The address of a record. Borrowed pointers; nothing to free. */
typedef struct idem_scope {
  int64_t tenant_id;
  const char *operation;
  const char *key;
} idem_scope_t;

/* A record as read from a store. Fixed-size fields are copied in; only
 * `response_body` is allocated: release it with idem_record_reset(). All
 * times are milliseconds since the epoch; 0 means "not set". */
typedef struct idem_record {
  int64_t tenant_id;
  char operation[IDEM_OPERATION_MAX + 1];
  char key[IDEM_KEY_MAX + 1];
  char fingerprint[IDEM_FINGERPRINT_LEN];
  idem_state_t state;
  int response_status;  /* 0 until a response is stored */
  char *response_body;  /* NULL until a response is stored */
  char location[IDEM_LOCATION_MAX + 1];
  char resource_id[IDEM_ID_MAX + 1];
  char provider_ref[IDEM_REF_MAX + 1];
  char correlation_id[IDEM_ID_MAX + 1];
  char owner_token[IDEM_TOKEN_MAX + 1]; /* empty unless processing */
  int64_t lease_expires_at;
  int64_t created_at;
  int64_t updated_at;
  int64_t expires_at; /* 0 while processing or pending: they never expire */
  /* Set only by a won reservation that inserted the record, on a store
   * that can find it faster by it (SQLite: its rowid); 0 from every other
   * call and store. Only that store reads it back, through
   * idem_complete_t.row. */
  int64_t row;
} idem_record_t;

/* Returns "processing", "completed", "failed", "pending" or "none". */
const char *idem_state_name(idem_state_t state);

/* Parses a state name; returns IDEM_STATE_NONE for anything else. */
idem_state_t idem_state_parse(const char *name);

/* Frees what `rec` owns and zeroes it, so it can be reused. NULL is fine. */
void idem_record_reset(idem_record_t *rec);

/* Copies at most `cap - 1` bytes of `src` (NULL counts as "") into `dst`
 * and NUL-terminates it. Returns 0, or -1 when `src` did not fit. */
int idem_copy(char *dst, size_t cap, const char *src);

#ifdef __cplusplus
}
#endif
#endif
