# Makes an installed man page from one of docs/man: the title line's
# source field ("idem") gains the version, and the page is gzipped, as
# Debian installs man pages. At build time:
#
# cmake -DIDEM_MAN_IN=docs/man/idemd.8 -DIDEM_MAN_OUT=build/man/idemd.8.gz
#       -DIDEM_PROJECT_VERSION=x.y.z -DIDEM_GZIP=/usr/bin/gzip -P man.cmake
file(READ "${IDEM_MAN_IN}" page)
string(REGEX REPLACE "(\n\\.TH [^\n]*[0-9]) idem " "\\1 \"idem ${IDEM_PROJECT_VERSION}\" "
       page "${page}")
string(REGEX REPLACE "\\.gz$" "" plain "${IDEM_MAN_OUT}")
file(WRITE "${plain}" "${page}")
# -n: no name or time in the header, so the same page gives the same file.
execute_process(COMMAND "${IDEM_GZIP}" -9nf "${plain}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "gzip ${plain} failed")
endif()
