# The Debian package, idem_<version>_amd64.deb, made by `cpack -G DEB` in
# a build directory (scripts/package.sh makes a Release build and runs it):
# what `cmake --install` installs, under /usr (the programs, libidem and
# the client library with their headers, CMake package and pkg-config
# files, the licences, the man pages, idemd.service) and
# /etc/default/idemd, a conffile; deploy/debian's maintainer scripts make
# the user idem. Dependencies: what dpkg-shlibdeps finds the programs link,
# adduser for postinst and procps for the unit's ExecReload (/bin/kill).
# tests/package checks the result.
set(IDEM_PACKAGE_MAINTAINER "idem maintainers <maintainers@users.noreply.a-seed-eca67dab.example>"
    CACHE STRING "The Maintainer field of the Debian package")
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME idem)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_VENDOR "the idem authors")
set(CPACK_PACKAGE_CONTACT "${IDEM_PACKAGE_MAINTAINER}")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "HTTP payments and orders API that is safe to retry")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION net)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
# The long description; CPack puts the summary above it and a space
# before each line, as deb-control(5) wants.
set(CPACK_DEBIAN_PACKAGE_DESCRIPTION "idemd serves payments and orders over HTTP and makes every creating
request safe to send again: the same Idempotency-Key with the same
request gets the first answer back instead of a second charge. Records
are kept in SQLite or PostgreSQL. The package holds idemd with its
systemd unit, the idem client, the idem-psp provider simulator, and
libidem and the client library (static, with headers, a CMake package
and pkg-config files) for C programs of your own.")
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_DEPENDS "adduser, procps")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
    ${PROJECT_SOURCE_DIR}/deploy/debian/conffiles ${PROJECT_SOURCE_DIR}/deploy/debian/postinst
    ${PROJECT_SOURCE_DIR}/deploy/debian/prerm ${PROJECT_SOURCE_DIR}/deploy/debian/postrm)
# The scripts 0755 and conffiles 0644, whatever the checkout's modes.
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
# No source package: the source is the git repository.
set(CPACK_SOURCE_GENERATOR "")
include(CPack)
