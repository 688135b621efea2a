"""A program writing a mounted farmap file while it migrates (used by tests/mount_migrate.rs
and scripts/bench-mount-migrate.sh).

writer PATH EXPECTED RATE: maps PATH shared and writes 4 KiB pages at random offsets, RATE
  pages a second (0: as fast as it can), each filled with its page index and a sequence
  number; prints "writing" once it has written its first page. On SIGTERM (the source's
  --after default, delivered once it is let go with SIGCONT) it finishes the page it is
  writing, writes its own image of the file to EXPECTED, prints the number of writes and
  the last page written as JSON, and exits.
check PATH EXPECTED LAST: compares PATH with EXPECTED page by page; the page LAST (the one
  being written when the writer was stopped) may hold a mix of its old and new bytes. Prints
  "ok" or the first differing pages.
refused PATH: a write must fail with EROFS and a read that reaches the server (O_DIRECT)
  with EIO; prints "refused".
"""
import errno
import json
import mmap
import os
import random
import signal
import struct
import sys
import time

PAGE = 4096


def page_bytes(idx, seq):
    return struct.pack("<QQ", idx, seq) * (PAGE // 16)


def writer(path, expected, rate):
    size = os.path.getsize(path)
    pages = size // PAGE
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    image = bytearray(m[:])  # what the file holds before we start
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    rnd = random.Random(os.getpid())
    seq, last = 0, -1
    t0 = time.monotonic()
    announced = False
    while not stop:
        p = rnd.randrange(pages)
        seq += 1
        data = page_bytes(p, seq)
        last = p
        m[p * PAGE:(p + 1) * PAGE] = data
        image[p * PAGE:(p + 1) * PAGE] = data
        if not announced:
            print("writing", flush=True)
            announced = True
        if rate > 0:
            ahead = seq / rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)
    with open(expected, "wb") as f:
        f.write(image)
    print(json.dumps({"writes": seq, "last": last}), flush=True)
    os._exit(0)


def check(path, expected, last):
    with open(path, "rb") as f:
        got = f.read()
    with open(expected, "rb") as f:
        want = f.read()
    if len(got) != len(want):
        print(f"sizes differ: {len(got)} != {len(want)}")
        return
    bad = []
    for p in range(len(want) // PAGE):
        a, b = got[p * PAGE:(p + 1) * PAGE], want[p * PAGE:(p + 1) * PAGE]
        if a != b and p != last:
            bad.append(p)
            if len(bad) >= 10:
                break
    print("ok" if not bad else f"pages differ: {bad}")


def refused(path):
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, b"x", 0)
        print("a write was accepted")
        return
    except OSError as e:
        if e.errno != errno.EROFS:
            print(f"a write failed with {e}")
            return
    os.close(fd)
    # O_DIRECT: a read that reaches the server (the page cache keeps what it held).
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, PAGE)
    try:
        os.preadv(fd, [buf], 0)
        print("a read was accepted")
        return
    except OSError as e:
        if e.errno != errno.EIO:
            print(f"a read failed with {e}")
            return
    print("refused")


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "writer":
        writer(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    elif cmd == "check":
        check(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif cmd == "refused":
        refused(sys.argv[2])
    else:
        sys.exit(f"unknown command {cmd}")
