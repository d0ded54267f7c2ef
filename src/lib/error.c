/* idem_strerror(): the fixed texts behind the error enum. */
#include "idem/error.h"

static const char *const texts[] = {
#define IDEM__ERR_TEXT(name, text) text,
    IDEM_ERRNO_MAP(IDEM__ERR_TEXT)
#undef IDEM__ERR_TEXT
};

static const char *const names[] = {
#define IDEM__ERR_NAME(name, text) #name,
    IDEM_ERRNO_MAP(IDEM__ERR_NAME)
#undef IDEM__ERR_NAME
};

const char *idem_strerror(int err) {
  if (err < 0 || err >= IDEM_ERR_MAX_)
    return "unknown error";
  return texts[err];
}

const char *idem_err_name(int err) {
  if (err < 0 || err >= IDEM_ERR_MAX_)
    return "UNKNOWN";
  return names[err];
}
