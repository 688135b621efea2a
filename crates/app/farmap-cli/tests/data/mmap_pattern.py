"""Drives a mounted farmap file from Python (used by tests/mount.rs).

write PATH EXPECTED SEED: maps PATH shared, 4 threads write 4 KiB blocks of a pattern at
  random offsets (thread t owns the blocks whose index is t mod 4), msyncs, closes; writes the
  whole expected image to EXPECTED.
read PATH EXPECTED: 4 threads read the file at random offsets (mmap and pread) and compare
  with EXPECTED; prints "ok".
dirty PATH OFFSET TEXT: maps PATH, writes TEXT at OFFSET without msync, prints "ready",
  waits for stdin to close, exits (the kernel writes the page back at some point).
fsync PATH OFFSET TEXT: pwrite + fsync, prints "synced", waits for stdin to close.
"""
import mmap
import os
import random
import sys
import threading

BLOCK = 4096


def block(seed, idx):
    rnd = random.Random(seed * 1_000_003 + idx)
    return bytes(rnd.getrandbits(8) for _ in range(64)) * (BLOCK // 64)


def run_threads(worker, n=4):
    """Runs worker(t) for t in 0..n on n threads; raises the first exception one raised."""
    errors = []

    def run(t):
        try:
            worker(t)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]


def write(path, expected, seed):
    size = os.path.getsize(path)
    blocks = size // BLOCK
    image = bytearray(size)
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def worker(t):
        rnd = random.Random(seed + t)
        mine = [b for b in range(blocks) if b % 4 == t]
        for b in rnd.sample(mine, min(len(mine), 200)):
            data = block(seed, b)
            m[b * BLOCK:(b + 1) * BLOCK] = data
            image[b * BLOCK:(b + 1) * BLOCK] = data

    run_threads(worker)
    m.flush()  # msync
    m.close()
    os.close(fd)
    with open(expected, "wb") as f:
        f.write(image)
    print("ok", flush=True)


def read(path, expected):
    with open(expected, "rb") as f:
        image = f.read()
    size = os.path.getsize(path)
    assert size == len(image), (size, len(image))
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)

    def worker(t):
        rnd = random.Random(t)
        for _ in range(300):
            off = rnd.randrange(size)
            n = min(rnd.randrange(1, 200_000), size - off)
            got = m[off:off + n] if t % 2 == 0 else os.pread(fd, n, off)
            if got != image[off:off + n]:
                raise AssertionError(f"thread {t}: {n} bytes at {off} differ")

    run_threads(worker)
    if m[:] != image:
        raise AssertionError("the whole file differs from the expected image")
    print("ok", flush=True)


def dirty(path, offset, text):
    fd = os.open(path, os.O_RDWR)
    size = os.path.getsize(path)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    m[offset:offset + len(text)] = text
    print("ready", flush=True)
    sys.stdin.read()


def fsync(path, offset, text):
    fd = os.open(path, os.O_RDWR)
    os.pwrite(fd, text, offset)
    os.fsync(fd)
    print("synced", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "write":
        write(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif mode == "read":
        read(sys.argv[2], sys.argv[3])
    elif mode == "dirty":
        dirty(sys.argv[2], int(sys.argv[3]), sys.argv[4].encode())
    elif mode == "fsync":
        fsync(sys.argv[2], int(sys.argv[3]), sys.argv[4].encode())
    else:
        sys.exit(f"unknown mode {mode}")
