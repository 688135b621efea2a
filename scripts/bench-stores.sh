#!/usr/bin/env bash
# `farmap bench stores` on every store service this checkout has: redis, redis-cluster, and
# minio / cassandra when scripts/services/minio.sh / cassandra.sh exist. Each service script
# prints SPEC_BASE= (a store spec without size); the bench adds size and chunk.
# usage: scripts/bench-stores.sh [BENCH ARGS...]    (e.g. --size 256MiB --json)
# FARMAP=path/to/farmap to use a built binary; otherwise it builds the release one.
# STORES="redis minio" to start only some of the services.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
if [ -z "${FARMAP:-}" ]; then
  cargo build --release --locked -p farmap-cli >&2
  FARMAP=${CARGO_TARGET_DIR:-$root/target}/release/farmap
fi
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# var NAME KEY: what service NAME printed as KEY=.
var() { sed -n "s/^$2=//p" "$work/$1.out"; }

# start NAME: runs scripts/services/NAME.sh, waits for READY, sets base to its SPEC_BASE.
# (Not in a $(...) subshell: the service stops when its parent process exits.)
start() {
  local name=$1 out=$work/$1.out
  mkdir -p "$work/$name"
  bash "scripts/services/$name.sh" "$work/$name" >"$out" 2>"$work/$name.log" &
  pids+=($!)
  for _ in $(seq 1 9000); do
    grep -qx READY "$out" && { base=$(var "$name" SPEC_BASE); return 0; }
    kill -0 "${pids[-1]}" 2>/dev/null || { echo "service $name failed:" >&2; tail -n 20 "$work/$name.log" >&2; return 1; }
    sleep 0.1
  done
  echo "service $name: no READY" >&2
  return 1
}

stores=()
for name in ${STORES:-redis redis-cluster minio cassandra}; do
  [ -f "scripts/services/$name.sh" ] || continue
  if start "$name"; then
    # A scratch region in each (the bench overwrites it), and what the service's SPEC_BASE
    # leaves out: MinIO's endpoint and credentials, Cassandra's keyspace.
    case $name in
      redis) spec="$base/0?prefix=bench" ;;
      redis-cluster) spec="$base?prefix=bench" ;;
      minio)
        spec="s3://$(var minio BUCKET)/bench?endpoint=$(var minio ENDPOINT)&region=$(var minio REGION)"
        export AWS_ACCESS_KEY_ID=$(var minio ACCESS_KEY) AWS_SECRET_ACCESS_KEY=$(var minio SECRET_KEY)
        ;;
      cassandra) spec="$base/farmap_bench?table=bench&create=true" ;;
      *) spec=$base ;;
    esac
    echo "started $name: $spec" >&2
    stores+=(--store "$spec")
  fi
done
"$FARMAP" bench stores "${stores[@]}" "$@"
