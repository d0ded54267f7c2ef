/* Internal: the flags of an operator's command (`idemd payments resolve`,
 * `idemd audit`, `idemd gateway resolve`, `idemd gateway audit`), read in
 * one way: each named flag takes the next argument as its value, at most
 * once; the arguments that are not flags are the command's words; any
 * other flag is either refused or left for the caller's own parser of
 * the common flags (--db and the like, server/config.h). */
#ifndef IDEM_UTIL_FLAGS_H
#define IDEM_UTIL_FLAGS_H

/* What to read, and where it goes. The strings are argv's. */
typedef struct idem__flags {
  const char *prog;         /* the messages' prefix: "idemd", "idemd gateway" */
  const char *const *names; /* the flags read, NULL-terminated: "--as", ... */
  const char **values;      /* out: one per name, NULL when not given */
  const char **words;       /* out: the arguments that are not flags */
  int max_words;            /* room in `words` */
  int nwords;               /* out: how many there are */
  int pass_others;          /* 1: other flags (with the value that follows one
                             * written without '=') are left in argv; 0: refused */
} idem__flags_t;

/* Reads argv[0..argc) into `f` (values and words set afresh). A named
 * flag without a value, or given twice, an argument beyond `max_words`,
 * and (without pass_others) any other flag are refused: -1, after one
 * line on stderr saying which. Else returns how many arguments were left,
 * moved in order to the front of argv (0 without pass_others). */
int idem__flags_take(idem__flags_t *f, int argc, char **argv);

#endif
