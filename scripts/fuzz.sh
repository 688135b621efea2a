#!/usr/bin/env bash
# Runs farmap's fuzz targets (fuzz/fuzz_targets/*.rs) with libFuzzer, coverage-guided, on the
# pinned stable toolchain:
#
#   scripts/fuzz.sh [--keep] [SECONDS] [TARGET...]
#   scripts/fuzz.sh --build-only [TARGET...]
#
# Each TARGET (default: all) runs for SECONDS (default 30) from its committed corpus
# fuzz/corpus/<target>/, one per core at a time (FUZZ_JOBS=N to change). New inputs go to a
# scratch directory that is deleted afterwards; with --keep, those that add coverage are
# merged into fuzz/corpus/<target>/ (commit them if they are worth keeping). --build-only
# builds the targets and stops (scripts/test.sh builds them early, in the background).
# It prints one line per target: executions, executions per second, edges covered, the
# committed seeds and the corpus at the end, crashes with the path of the input. A crash, a
# hang (10 s) or an allocation over 2 GiB is saved under fuzz/artifacts/<target>/ beside the
# run's log (fuzz.log), and the script exits 1. Reproduce one with the printed command (the
# binary runs a saved input once).
#
# How: no nightly and no cargo-fuzz. The targets are plain libfuzzer-sys binaries; cargo
# builds them with the SanitizerCoverage flags that `cargo fuzz` passes (all stable `-C`
# options, so no RUSTC_BOOTSTRAP), for the host triple given explicitly so that build scripts
# and proc macros stay uninstrumented. No AddressSanitizer: every decoder fuzzed here is in a
# `forbid(unsafe_code)` module, and debug assertions and overflow checks are on (fuzz/Cargo.toml).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

keep=false
build_only=false
args=()
for a in "$@"; do
  case "$a" in
    --keep) keep=true ;;
    --build-only) build_only=true ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $a" >&2; exit 2 ;;
    *) args+=("$a") ;;
  esac
done
seconds=30
if ((${#args[@]})) && [[ "${args[0]}" =~ ^[0-9]+$ ]]; then
  seconds=${args[0]}
  args=("${args[@]:1}")
fi
all=()
for f in fuzz/fuzz_targets/*.rs; do all+=("$(basename "$f" .rs)"); done
targets=("${args[@]}")
((${#targets[@]})) || targets=("${all[@]}")
for t in "${targets[@]}"; do
  if [[ ! -f "fuzz/fuzz_targets/$t.rs" ]]; then
    echo "fuzz.sh: no fuzz target $t (there are: ${all[*]})" >&2
    exit 2
  fi
done

# libfuzzer-sys compiles libFuzzer (C++) in its build script.
if ! command -v c++ >/dev/null; then
  echo "fuzz.sh: installing g++ (libFuzzer is C++)" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ >/dev/null
fi

triple=$(rustc -vV | sed -n 's/^host: //p')
target_dir="${CARGO_TARGET_DIR:-fuzz/target}"
[[ "$target_dir" = /* ]] || target_dir="$PWD/$target_dir"
bins=()
for t in "${targets[@]}"; do bins+=(--bin "$t"); done
echo "fuzz.sh: cargo build of ${#targets[@]} target(s) (coverage-instrumented, $target_dir)" >&2
start=$SECONDS
RUSTFLAGS="-Cpasses=sancov-module \
  -Cllvm-args=-sanitizer-coverage-level=4 \
  -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
  -Cllvm-args=-sanitizer-coverage-pc-table \
  -Cllvm-args=-sanitizer-coverage-trace-compares \
  --cfg fuzzing" \
  CARGO_TARGET_DIR="$target_dir" \
  cargo build --locked --quiet --release --manifest-path fuzz/Cargo.toml --target "$triple" "${bins[@]}"
((SECONDS - start < 2)) || echo "fuzz.sh: built in $((SECONDS - start)) s" >&2
! $build_only || exit 0

scratch=$(mktemp -d "${TMPDIR:-/tmp}/farmap-fuzz.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
touch "$scratch/start"

# Runs target $1 for $seconds; leaves its exit code in $scratch/$1.rc.
run_one() {
  local t=$1 art="fuzz/artifacts/$1"
  mkdir -p "$art" "$scratch/$t" "fuzz/corpus/$t"
  local rc=0
  RUST_BACKTRACE=1 "$target_dir/$triple/release/$t" \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$art/" "$scratch/$t" "fuzz/corpus/$t" >"$art/fuzz.log" 2>&1 || rc=$?
  echo "$rc" >"$scratch/$t.rc"
}

jobs="${FUZZ_JOBS:-$(nproc)}"
((jobs <= ${#targets[@]})) || jobs=${#targets[@]}
echo "fuzz.sh: ${#targets[@]} target(s), ${seconds} s each, $jobs at a time" >&2
running=0
for t in "${targets[@]}"; do
  if ((running >= jobs)); then
    wait -n || true
    running=$((running - 1))
  fi
  run_one "$t" &
  running=$((running + 1))
done
wait

# stat NAME LOG: a number from libFuzzer's final statistics.
stat() { sed -n "s/^stat::$1: *//p" "$2" | tail -1; }

failed=0
printf '%-16s %12s %9s %6s %6s %7s  %s\n' target executions exec/s cov seeds corpus crashes
for t in "${targets[@]}"; do
  art="fuzz/artifacts/$t"
  log="$art/fuzz.log"
  rc=$(cat "$scratch/$t.rc")
  runs=$(stat number_of_executed_units "$log")
  rate=$(stat average_exec_per_sec "$log")
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2 || true)
  seeds=$(find "fuzz/corpus/$t" -type f | wc -l)
  corp=$(grep -o 'corp: [0-9]*' "$log" | tail -1 | cut -d' ' -f2 || true)
  found=$(find "$art" -type f -newer "$scratch/start" \
    \( -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' -o -name 'leak-*' \) | sort)
  crashes=$(grep -c . <<<"$found" || true)
  note=$crashes
  if ((crashes)); then
    note="$crashes $(paste -sd' ' <<<"$found")"
  elif ((rc)); then
    note="0 (libFuzzer exited $rc: see $log)"
  fi
  printf '%-16s %12s %9s %6s %6s %7s  %s\n' "$t" "${runs:-?}" "${rate:-?}" "${cov:-?}" \
    "$seeds" "${corp:-?}" "$note"
  if ((rc || crashes)); then
    failed=1
  elif $keep; then
    # Keep only the new inputs that add coverage to the committed corpus.
    "$target_dir/$triple/release/$t" -merge=1 "fuzz/corpus/$t" "$scratch/$t" >>"$log" 2>&1
  fi
done

for t in "${targets[@]}"; do
  log="fuzz/artifacts/$t/fuzz.log"
  [[ "$(cat "$scratch/$t.rc")" != 0 ]] || continue
  echo >&2
  echo "--- $t: $(grep -m1 -E 'panicked at|ERROR: libFuzzer' "$log" || echo "exit $(cat "$scratch/$t.rc")")" >&2
  grep -m1 -A4 'panicked at' "$log" | tail -n +2 | cut -c1-400 >&2 || true
  for f in $(find "fuzz/artifacts/$t" -type f -newer "$scratch/start" -name '*-*' ! -name '*.log'); do
    echo "reproduce: $target_dir/$triple/release/$t $f" >&2
  done
done
if $keep && ! ((failed)); then
  echo "fuzz.sh: merged new coverage into fuzz/corpus/ (see git status)" >&2
fi
exit "$failed"
