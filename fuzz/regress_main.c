/* A main() for fuzz targets without libFuzzer: runs LLVMFuzzerInitialize
 * (when the target has one) and then LLVMFuzzerTestOneInput once on each
 * file named on the command line, or on each file of a named directory (in
 * name order, dot files skipped). A property that fails aborts, so ctest
 * sees the run fail; this is how the seed corpora and every saved crash
 * are replayed in the normal and sanitizer builds. */
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz_util.h"

/* Weak: a target without it leaves this NULL. */
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

static int run_file(const char *path) {
  FILE *f = fopen(path, "rb");
  uint8_t *data = NULL;
  size_t n = 0, cap = 0;

  if (f == NULL) {
    fprintf(stderr, "regress: cannot open %s: %s\n", path, strerror(errno));
    return -1;
  }
  for (;;) {
    size_t got;
    if (n == cap) {
      uint8_t *grown = realloc(data, cap = cap ? cap * 2 : 4096);
      if (grown == NULL) {
        fclose(f);
        free(data);
        return -1;
      }
      data = grown;
    }
    got = fread(data + n, 1, cap - n, f);
    if (got == 0)
      break;
    n += got;
  }
  fclose(f);
  /* An exactly sized copy, so reads past the end are caught (ASan). */
  {
    uint8_t *exact = malloc(n ? n : 1);
    if (exact == NULL) {
      free(data);
      return -1;
    }
    if (n)
      memcpy(exact, data, n);
    free(data);
    fprintf(stderr, "regress: %s (%zu bytes)\n", path, n);
    LLVMFuzzerTestOneInput(exact, n);
    free(exact);
  }
  return 0;
}

static int by_name(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static int run_dir(const char *path, int *count) {
  DIR *d = opendir(path);
  struct dirent *e;
  char **names = NULL;
  size_t n = 0, cap = 0;
  int rc = 0;

  if (d == NULL) {
    fprintf(stderr, "regress: cannot open %s: %s\n", path, strerror(errno));
    return -1;
  }
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.')
      continue;
    if (n == cap) {
      char **grown = realloc(names, (cap = cap ? cap * 2 : 64) * sizeof *names);
      if (grown == NULL)
        break;
      names = grown;
    }
    if ((names[n] = malloc(strlen(path) + strlen(e->d_name) + 2)) == NULL)
      break;
    sprintf(names[n++], "%s/%s", path, e->d_name);
  }
  closedir(d);
  if (n > 0)
    qsort(names, n, sizeof *names, by_name);
  for (size_t i = 0; i < n; i++) {
    if (rc == 0 && run_file(names[i]) != 0)
      rc = -1;
    else if (rc == 0)
      (*count)++;
    free(names[i]);
  }
  free(names);
  return rc;
}

int main(int argc, char **argv) {
  int count = 0;

  if (argc < 2) {
    fprintf(stderr, "usage: %s FILE|DIR...\n", argv[0]);
    return 2;
  }
  if (LLVMFuzzerInitialize)
    LLVMFuzzerInitialize(&argc, &argv);
  for (int i = 1; i < argc; i++) {
    struct stat st;
    if (stat(argv[i], &st) != 0) {
      fprintf(stderr, "regress: %s: %s\n", argv[i], strerror(errno));
      return 1;
    }
    if (S_ISDIR(st.st_mode) ? run_dir(argv[i], &count) != 0
                            : run_file(argv[i]) != 0 || (count++, 0))
      return 1;
  }
  printf("regress: %d inputs passed\n", count);
  return 0;
}
