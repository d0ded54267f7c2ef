/* Record states and the helpers that own a record's memory. */
#include "idem/record.h"

#include <stdlib.h>
#include <string.h>

static const char *const state_names[] = {"none", "processing", "completed",
                                          "failed", "pending"};

const char *idem_state_name(idem_state_t state) {
  if ((int)state < 0 || (size_t)state >= sizeof state_names / sizeof *state_names)
    return "none";
  return state_names[state];
}

idem_state_t idem_state_parse(const char *name) {
  if (name == NULL)
    return IDEM_STATE_NONE;
  for (size_t i = 1; i < sizeof state_names / sizeof *state_names; i++)
    if (strcmp(name, state_names[i]) == 0)
      return (idem_state_t)i;
  return IDEM_STATE_NONE;
}

void idem_record_reset(idem_record_t *rec) {
  if (rec == NULL)
    return;
  free(rec->response_body);
  memset(rec, 0, sizeof *rec);
}

int idem_copy(char *dst, size_t cap, const char *src) {
  size_t n;
  if (cap == 0)
    return -1;
  if (src == NULL)
    src = "";
  n = strlen(src);
  if (n >= cap) {
    memcpy(dst, src, cap - 1);
    dst[cap - 1] = '\0';
    return -1;
  }
  memcpy(dst, src, n + 1);
  return 0;
}
