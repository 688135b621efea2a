"""SQLite in WAL mode on a migrating farmap mount (used by tests/mount_migrate.rs).

The mount exposes one file; SQLite's WAL needs its -wal and -shm files next to the database.
So the mounted file holds an ext4 file system (through a loop device) and the database, its
WAL and its shared memory index live on it: every byte SQLite writes reaches the farmap file.

write DB LOG COUNT: opens DB in WAL mode (synchronous=FULL) and commits transactions (one
  row each, ids counting up from the largest present), COUNT of them (0: until killed);
  after each COMMIT returns, appends its id to LOG (outside the mount) and flushes it;
  prints "writing" after the first.
check DB LOG: PRAGMA integrity_check must be ok, the journal mode WAL, and every id in LOG
  present; prints "ok ROWS".
"""
import os
import sqlite3
import sys


def open_db(path):
    db = sqlite3.connect(path, isolation_level=None, timeout=30)
    mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if mode != "wal":
        sys.exit(f"journal mode is {mode}, not wal")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, payload BLOB)")
    return db


def write(path, log, count):
    db = open_db(path)
    start = (db.execute("SELECT max(id) FROM t").fetchone()[0] or 0) + 1
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    i = start
    while count == 0 or i < start + count:
        db.execute("BEGIN")
        db.execute("INSERT INTO t VALUES (?, randomblob(700))", (i,))
        db.execute("COMMIT")
        os.write(fd, f"{i}\n".encode())
        if i == start:
            print("writing", flush=True)
        i += 1
    db.close()
    print(f"wrote {i - start}", flush=True)


def check(path, log):
    db = open_db(path)
    ok = db.execute("PRAGMA integrity_check").fetchone()[0]
    if ok != "ok":
        sys.exit(f"integrity_check: {ok}")
    have = {r[0] for r in db.execute("SELECT id FROM t")}
    with open(log) as f:
        logged = [int(x) for x in f.read().split()]
    missing = [i for i in logged if i not in have]
    if missing:
        sys.exit(f"{len(missing)} committed transactions are missing, first {missing[:5]}")
    print(f"ok {len(have)}")


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1] == "check":
        check(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
