#!/usr/bin/env bash
# farmap's whole test suite, from a fresh clone on a fresh machine of this kind:
# installs what the tests need, then checks formatting, lints, docs, and runs every test.
# Tests that need something this machine lacks print "skipped: <why>"; under CI=true nothing
# this machine can run may be skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
# A one-off build of everything gains nothing from incremental compilation, whose caches
# would double the size of target/ (CI machines have had little disk to spare).
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

# Each step says when it starts (minutes:seconds since the suite started), so that a CI log
# shows where its time goes.
step() { printf '\n=== [%d:%02d] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*" >&2; }

# --- what the tests need from the machine ------------------------------------------------
# Debian packages the suite uses; installed only when missing (apt-get needs root).
# util-linux: setpriv, to run farmap as `nobody` (cli.rs: permission_errors_name_the_path).
# g++: libfuzzer-sys's build script compiles libFuzzer for scripts/fuzz.sh.
# qemu-system-x86 ... e2fsprogs: the kernel NBD/ublk tests' VM (scripts/vm/run.sh);
# libclang-dev: bindgen for libublk's sys crate.
# nbdkit libnbd-bin qemu-utils fio fuse3: real NBD peers (farmap-nbd's interop tests, bench nbd).
# openjdk-17-jre-headless, maven: scripts/services/cassandra.sh runs Cassandra 5.0 from Maven
# Central jars (cached under ~/.cache/farmap/) for the CQL store's tests.
# redis-server, redis-tools, openssl: the Redis store tests (scripts/services/redis.sh,
# redis-cluster.sh, redis-tls.sh makes its test CA with openssl).
# python3: the `farmap mount` tests drive the mounted file from Python (mmap, threads).
# python3-prometheus-client: the metrics tests read the exposition with its parser.
# memcached: `farmap run`'s tests run it (and redis-server) with its heap on farmap.
# openjdk-17-jdk-headless: javac for YCSB's bindings (scripts/ycsb/build.sh; `farmap bench
# run`'s smoke test).
# python3-venv, python3-dev: the Python package's venv (scripts/test-python.sh) and the
# libpython that farmap-python's unit tests link.
# fonts-dejavu-core: the text of farmap-plot's pictures (registered at run time, no fontconfig).
PKGS=(util-linux g++ qemu-system-x86 nbd-client busybox-static cpio xz-utils e2fsprogs libclang-dev
  nbdkit libnbd-bin qemu-utils fio fuse3 openjdk-17-jre-headless maven redis-server redis-tools openssl python3
  python3-prometheus-client memcached python3-venv python3-dev openjdk-17-jdk-headless
  fonts-dejavu-core nginx-light)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  step "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

target_dir="${CARGO_TARGET_DIR:-target}"
mkdir -p "$target_dir"
step "disk: $(df -h --output=avail "$target_dir" | tail -1 | tr -d ' ') free for $target_dir"

# The fuzz targets build first, in the background and at the lowest priority, in a target
# directory of their own (their coverage flags make every crate a different build, and one
# directory would serialize the two builds): they take the cores the checks below leave idle
# (a crate compiling alone, a link), and are ready when the fuzz step comes.
fuzz_target_dir="$target_dir/fuzz"
fuzz_build_log=$(mktemp)
CARGO_TARGET_DIR="$fuzz_target_dir" setsid nice -n 19 scripts/fuzz.sh --build-only >"$fuzz_build_log" 2>&1 &
fuzz_build=$!
# A check that fails ends the suite: the build goes with it (setsid made it a process group).
trap 'kill -- -"$fuzz_build" 2>/dev/null || true; rm -f "$fuzz_build_log"' EXIT

# MinIO, the S3 tests' server, is built from source once per machine (3-7 min on 2 cores; then
# cached): built here in the background, in a scheduling group of its own at the lowest
# priority (autogroups would otherwise give it half the CPU), it takes what the builds below
# leave idle, instead of holding the first S3 test for minutes. Not waited for: that test
# waits on the build's lock. Its output: $target_dir/minio-build.log.
setsid bash -c 'echo 19 >/proc/self/autogroup 2>/dev/null; exec nice -n 19 bash "$@"' minio \
  scripts/services/minio.sh "$(mktemp -d)" --build-only </dev/null >"$target_dir/minio-build.log" 2>&1 &

# --- static checks -----------------------------------------------------------------------
step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (all targets, warnings are errors)"
cargo clippy --locked --workspace --all-targets -- -D warnings

step "layers: crate arrows point down, no file import cycles (scripts/check-layers.py)"
if ! python3 scripts/check-layers.py --check >/dev/null; then
  python3 scripts/check-layers.py --check >&2 || true
  exit 1
fi

step "benchmark suite: its own arithmetic and docs rewrite (scripts/bench-suite.py --self-test)"
python3 scripts/bench-suite.py --self-test

step "cargo check without default features (the library face alone, the binary without its tools)"
cargo check --locked -p farmap -p farmap-cli --no-default-features --quiet

step "cargo doc (warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --locked --workspace --no-deps --quiet

# The fuzz targets run for real: libFuzzer, coverage-guided, built on the pinned stable
# toolchain with the SanitizerCoverage flags `cargo fuzz` uses (scripts/fuzz.sh says how),
# 12 s each from the committed corpus, two at a time. A crash fails the suite, after the
# tests have run; its input is under fuzz/artifacts/<target>/.
step "fuzz: every target for 12 s (scripts/fuzz.sh)"
fuzz_status=0
wait "$fuzz_build" || true # a failed build is built (and reported) again just below
cat "$fuzz_build_log" >&2
rm -f "$fuzz_build_log"
CARGO_TARGET_DIR="$fuzz_target_dir" scripts/fuzz.sh 12 || fuzz_status=1

# --- tests ---------------------------------------------------------------------------------
step "cargo test: building"
log=$(mktemp)
# Every test that cannot run here appends a line to this file (farmap_testkit::skip).
export FARMAP_SKIP_LOG
FARMAP_SKIP_LOG=$(mktemp)
trap 'rm -f "$log" "$FARMAP_SKIP_LOG"' EXIT
# --no-fail-fast: one failing test binary must not hide the results of the others.
status=0
# Built first, as a step of its own, so that the log tells building from running.
cargo test --locked --workspace --all-targets --no-run || status=1
step "cargo test: running"
cargo test --locked --workspace --all-targets --no-fail-fast 2>&1 | tee "$log" || status=1
cargo test --locked --workspace --doc --no-fail-fast 2>&1 | tee -a "$log" || status=1

# The Python package (docs/python.md), built over what `cargo test` just built (dev profile),
# and its pytest suite. Its counts join the closing line below.
step "python package: pip install ./python and pytest (scripts/test-python.sh)"
py_log=$(mktemp)
trap 'rm -f "$log" "$FARMAP_SKIP_LOG" "$py_log"' EXIT
scripts/test-python.sh 2>&1 | tee "$py_log" || status=1
# pytest's last line: "3 failed, 20 passed, 1 skipped in 4.2s" (errors count as failures).
read -r py_passed py_failed py_skipped < <(python3 - "$py_log" <<'PY'
import re, sys
text = open(sys.argv[1], errors="replace").read()
n = lambda w: sum(int(x) for x in re.findall(r"(\d+) " + w + r"\b", text.splitlines()[-1] if text else ""))
print(n("passed"), n("failed") + n("errors?"), n("skipped"))
PY
)
if ((py_passed + py_failed == 0)); then
  echo "the Python tests did not run (see the python package step)" >&2
  py_failed=1
  status=1
fi

# A skip's reason may span lines (a service's log): count the lines that start one.
skipped=$(grep -c '^skipped:' "$FARMAP_SKIP_LOG" || true)
if ((skipped)); then
  step "skipped tests"
  cat "$FARMAP_SKIP_LOG" >&2
fi
step "done"
# The test binaries that took longest (their own time, services' start-up included).
python3 - "$log" <<'PY' >&2 || true
import re, sys
cur, times = None, []
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"\s+Running (.+?) \((\S+)\)", line)
    if m:
        binary = re.sub(r"-[0-9a-f]{16}$", "", m.group(2).rsplit("/", 1)[-1])
        cur = f"{m.group(1)} [{binary}]"
        continue
    m = re.search(r"test result: .* finished in ([\d.]+)s", line)
    if m and cur:
        times.append((float(m.group(1)), cur))
        cur = None
times.sort(reverse=True)
print(f"slowest test binaries (all: {sum(t for t, _ in times):.0f} s):")
for t, name in times[:8]:
    print(f"  {t:7.1f} s  {name}")
PY
# One closing line for CI: totals over every test binary. "skipped" counts the tests that
# recorded a skip (they return early and libtest counts them as passed); "ignored" counts the
# `#[ignore]` entry points that tests start as child processes (`--ignored --exact <name>`,
# their output kept out of this log), which are not tests of their own.
# The Python tests' counts are added (pytest counts its skips apart from its passes; their
# reasons are in its "short test summary" above).
awk -v s="$skipped" -v pp="$py_passed" -v pf="$py_failed" -v ps="$py_skipped" '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "\n%d passed, %d failed, %d skipped, %d ignored\n", p - s + pp, f + pf, s + ps, i }' "$log"
if [[ "${CI:-}" == true ]] && ((skipped + py_skipped)); then
  echo "CI=true: $((skipped + py_skipped)) test(s) skipped; nothing this machine can run may be skipped" >&2
  exit 1
fi
if ((status)); then
  grep -E '^(test .* FAILED|failures:$|    [a-z_:]+$)' "$log" >&2 || true
  echo "some tests failed (see above)" >&2
fi
if ((fuzz_status)); then
  echo "the fuzz run failed (see the fuzz step above)" >&2
  status=1
fi
exit "$status"
