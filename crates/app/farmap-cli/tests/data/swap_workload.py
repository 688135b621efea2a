"""A working set for the swap tests: MIB MiB of seeded random bytes (one seed per MiB) in one
buffer. Prints `written VMSWAP_KB SECONDS` once it is all written, waits for a line on stdin,
reads everything back and prints `verified VMSWAP_KB SECONDS` (or `bad` and the first wrong MiB).
Run in a memory cgroup smaller than MIB, the buffer has to go through swap."""
import sys, random, time
mib = int(sys.argv[1])
def vmswap():
    for l in open('/proc/self/status'):
        if l.startswith('VmSwap:'):
            return int(l.split()[1])
buf = bytearray(mib << 20)
t0 = time.monotonic()
for i in range(mib):
    buf[i << 20:(i + 1) << 20] = random.Random(i).randbytes(1 << 20)
t1 = time.monotonic()
print("written", vmswap(), round(t1 - t0, 3), flush=True)
sys.stdin.readline()
t2 = time.monotonic()
bad = [i for i in range(mib) if buf[i << 20:(i + 1) << 20] != random.Random(i).randbytes(1 << 20)]
t3 = time.monotonic()
print("verified" if not bad else "bad " + ",".join(map(str, bad[:10])), vmswap(), round(t3 - t2, 3), flush=True)
