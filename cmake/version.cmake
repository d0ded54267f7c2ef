# Writes idem_version.h, the one version of every program (--version) and
# of idemd's idem_build_info: the project's version (CMakeLists.txt) and,
# in a git checkout, `git describe` of the source. Run at every build (not
# only at configure time) so that a commit or an edit shows at once; the
# file is rewritten only when its text changes, so nothing is recompiled
# otherwise.
#
# cmake -DIDEM_SOURCE_DIR=... -DIDEM_PROJECT_VERSION=x.y.z
#       [-DIDEM_GIT=/usr/bin/git] -DIDEM_VERSION_HEADER=... -P version.cmake
set(revision "")
if(IDEM_GIT)
  execute_process(COMMAND "${IDEM_GIT}" -C "${IDEM_SOURCE_DIR}" describe --tags --always
                          --dirty --abbrev=7
                  OUTPUT_VARIABLE out RESULT_VARIABLE rc ERROR_QUIET
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  # Only what is safe in a C string and a Prometheus label.
  if(rc EQUAL 0 AND out MATCHES "^[A-Za-z0-9._+-]+$")
    set(revision "${out}")
  endif()
endif()
if(revision STREQUAL "")
  set(full "${IDEM_PROJECT_VERSION}")
else()
  set(full "${IDEM_PROJECT_VERSION} (git ${revision})")
endif()
set(text "/* Made by cmake/version.cmake at build time: do not edit. */
#define IDEM_VERSION \"${IDEM_PROJECT_VERSION}\"
/* git describe of the source, \"\" outside a git checkout. */
#define IDEM_REVISION \"${revision}\"
/* What --version prints after the program's name. */
#define IDEM_VERSION_STRING \"${full}\"
")
set(old "")
if(EXISTS "${IDEM_VERSION_HEADER}")
  file(READ "${IDEM_VERSION_HEADER}" old)
endif()
if(NOT old STREQUAL text)
  file(WRITE "${IDEM_VERSION_HEADER}" "${text}")
endif()
