/* An operator's command's flags (see flags.h). */
#include "util/flags.h"

#include <stdio.h>
#include <string.h>

/* The index of `arg` in `names`, or -1. */
static int named(const char *const *names, const char *arg) {
  for (int j = 0; names[j]; j++)
    if (strcmp(arg, names[j]) == 0)
      return j;
  return -1;
}

int idem__flags_take(idem__flags_t *f, int argc, char **argv) {
  int kept = 0;

  for (int j = 0; f->names[j]; j++)
    f->values[j] = NULL;
  f->nwords = 0;
  for (int i = 0; i < argc; i++) {
    int k = named(f->names, argv[i]);
    if (k >= 0) {
      if (i + 1 >= argc) {
        fprintf(stderr, "%s: option %s needs a value\n", f->prog, argv[i]);
        return -1;
      }
      /* Given twice, which would one mean? (--as succeeded --as declined) */
      if (f->values[k] != NULL) {
        fprintf(stderr, "%s: option %s given twice\n", f->prog, argv[i]);
        return -1;
      }
      f->values[k] = argv[++i];
    } else if (strncmp(argv[i], "--", 2) != 0 && f->nwords < f->max_words) {
      f->words[f->nwords++] = argv[i];
    } else if (strncmp(argv[i], "--", 2) == 0 && f->pass_others) {
      argv[kept++] = argv[i];
      if (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0 &&
          strchr(argv[i], '=') == NULL)
        argv[kept++] = argv[++i]; /* a common flag's value */
    } else {
      fprintf(stderr, "%s: unexpected argument '%s'\n", f->prog, argv[i]);
      return -1;
    }
  }
  return kept;
}
