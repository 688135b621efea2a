#!/usr/bin/env bash
# Live migration of a mount, measured: a SIZE file (memory store) on `farmap mount --agent`, a
# Python writer dirtying RATE random 4 KiB pages a second through a MAP_SHARED mapping, moved
# to an empty `farmap mount --agent` on this host (0 ms RTT) with `farmap seed`/`farmap leech`.
# One JSON line per run: the leech report plus `bytes_ratio` ((pre + post) / size),
# `dirty_pct_per_s` (the writer's rate as a share of the file's pages) and `verified` (the
# destination equals what the writer wrote before it was stopped).
#
#   scripts/bench-mount-migrate.sh [FARMAP] [RUNS] [SIZE_MIB] [RATE]
# (root, /dev/fuse, python3). Defaults: target/release/farmap, 3 runs, 256 MiB, 5000 pages/s.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
farmap="${1:-$here/target/release/farmap}"
runs="${2:-3}"
size_mib="${3:-256}"
rate="${4:-5000}"
writer="$here/crates/app/farmap-cli/tests/data/mount_writer.py"
pages=$((size_mib * 256))

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

for run in $(seq 1 "$runs"); do
  tmp="$(mktemp -d)"
  mkdir "$tmp/src" "$tmp/dst"
  "$farmap" mount "$tmp/src" "memory:${size_mib}MiB" --agent "$tmp/src.sock" >"$tmp/src.out" 2>"$tmp/src.log" &
  src=$!
  "$farmap" mount "$tmp/dst" --agent "$tmp/dst.sock" >/dev/null 2>"$tmp/dst.log" &
  dst=$!
  pids=("$src" "$dst")
  until [[ -s "$tmp/src.out" && -S "$tmp/dst.sock" ]]; do sleep 0.05; done
  python3 "$writer" writer "$tmp/src/region" "$tmp/expected" "$rate" >"$tmp/w.out" 2>"$tmp/w.err" &
  w=$!
  pids+=("$w")
  until [[ -s "$tmp/w.out" ]]; do sleep 0.05; done
  sleep 1 # the writer at its pace
  "$farmap" seed --app "$tmp/src.sock" --listen 127.0.0.1:0 --json >"$tmp/seed.out" 2>"$tmp/seed.err" &
  seed=$!
  until grep -q "control on" "$tmp/seed.err" 2>/dev/null; do sleep 0.02; done
  control=$(grep -o "control on [0-9.:]*" "$tmp/seed.err" | cut -d' ' -f3)
  data=$(grep -o "data plane on [0-9.:]*" "$tmp/seed.err" | cut -d' ' -f4)
  report=$("$farmap" leech --app "$tmp/dst.sock" --from "$control" --data "$data" --json 2>"$tmp/leech.err")
  wait "$seed"
  wait "$w" || true
  last=$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["last"])' "$tmp/w.out")
  check=$(python3 "$writer" check "$tmp/dst/region" "$tmp/expected" "$last")
  python3 - "$report" "$check" "$size_mib" "$rate" "$pages" <<'EOF'
import json, sys
r = json.loads(sys.argv[1])
size = int(sys.argv[3]) << 20
r["bench"] = "mount-migrate"
r["bytes_ratio"] = round((r["bytes_precopy"] + r["bytes_postcopy"]) / size, 3)
r["dirty_pct_per_s"] = round(100 * float(sys.argv[4]) / int(sys.argv[5]), 2)
r["verified"] = sys.argv[2] == "ok"
print(json.dumps(r, sort_keys=True), flush=True)
EOF
  kill -TERM "$src" "$dst"
  wait "$src" "$dst" 2>/dev/null || true
  pids=()
  rm -rf "$tmp"
done
