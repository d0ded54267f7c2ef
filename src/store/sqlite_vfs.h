/* A SQLite VFS that writes each commit to the write-ahead log in one
 * system call. See sqlite_vfs.c. */
#ifndef IDEM_STORE_SQLITE_VFS_H
#define IDEM_STORE_SQLITE_VFS_H

/* The name to pass to sqlite3_open_v2() for the VFS below. */
#define IDEM_SQLITE_VFS "idem-gather"

/* Registers IDEM_SQLITE_VFS (not as the default) on top of SQLite's
 * default VFS, once per process; safe from many threads. Returns a SQLite
 * result code: SQLITE_OK once registered. */
int idem_sqlite_vfs_register(void);

#endif
