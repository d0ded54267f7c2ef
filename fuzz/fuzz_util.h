/* What the fuzz targets share: the libFuzzer entry points and a property
 * check that stops the run (abort, so libFuzzer saves the input and the
 * regression runner fails) with a message naming what broke. */
#ifndef IDEM_FUZZ_UTIL_H
#define IDEM_FUZZ_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FUZZ_CHECK(cond, ...)                                                  \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "fuzz property failed at %s:%d: %s\n  ", __FILE__,       \
              __LINE__, #cond);                                                \
      fprintf(stderr, __VA_ARGS__);                                            \
      fputc('\n', stderr);                                                     \
      abort();                                                                 \
    }                                                                          \
  } while (0)

#endif
