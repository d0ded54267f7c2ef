# Runs at install time (an install(CODE) of CMakeLists.txt includes it):
# installs idemd.service, its paths made for the prefix being installed to
# (CPack's /usr, or any `cmake --install --prefix`), and the environment
# file it reads. /usr's configuration goes to /etc, as Debian has it;
# another prefix's to PREFIX/etc. An environment file already there is
# kept, as dpkg keeps a conffile the operator changed.
#
# Needs IDEM_SOURCE_DIR, IDEM_BINARY_DIR and IDEM_INSTALL_BINDIR.
if(CMAKE_INSTALL_PREFIX STREQUAL "/usr")
  set(_idem_etc "/etc")
else()
  set(_idem_etc "${CMAKE_INSTALL_PREFIX}/etc")
endif()
if(IS_ABSOLUTE "${IDEM_INSTALL_BINDIR}")
  set(BINDIR "${IDEM_INSTALL_BINDIR}")
else()
  set(BINDIR "${CMAKE_INSTALL_PREFIX}/${IDEM_INSTALL_BINDIR}")
endif()
set(DEFAULTS "${_idem_etc}/default/idemd")
# Made in a directory of its own for each destination: cpack and a
# `cmake --install --prefix` elsewhere may run at once (ctest -j).
string(MD5 _idem_dest "$ENV{DESTDIR}|${CMAKE_INSTALL_PREFIX}")
set(_idem_unit "${IDEM_BINARY_DIR}/deploy/${_idem_dest}/idemd.service")
configure_file("${IDEM_SOURCE_DIR}/deploy/systemd/idemd.service.in" "${_idem_unit}" @ONLY)
file(INSTALL DESTINATION "${CMAKE_INSTALL_PREFIX}/lib/systemd/system" TYPE FILE
     FILES "${_idem_unit}")
if(EXISTS "$ENV{DESTDIR}${DEFAULTS}")
  message(STATUS "Kept: $ENV{DESTDIR}${DEFAULTS} (already there; the new one is "
                 "${IDEM_SOURCE_DIR}/deploy/systemd/idemd.default)")
else()
  file(INSTALL DESTINATION "${_idem_etc}/default" TYPE FILE RENAME idemd
       FILES "${IDEM_SOURCE_DIR}/deploy/systemd/idemd.default")
endif()
