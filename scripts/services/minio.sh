#!/usr/bin/env bash
# One MinIO server (S3) on loopback, with an empty test bucket (see lib.sh for the contract).
# Prints PORT=, ENDPOINT=, ACCESS_KEY=, SECRET_KEY=, REGION=, BUCKET= and
# SPEC_BASE=s3://BUCKET (append /prefix?endpoint=...; see crates/stores/farmap-s3).
#
# MinIO has no semver tags: the pinned pseudo-version below is built once with `go install`
# (3-7 min on 2 cores) and the binary cached under $CACHE/minio-<version>/, so later runs
# start in about a second. Builds are serialized by a lock file of their own.
. "$(dirname "$0")/lib.sh"

MINIO_VERSION=v0.0.0-20260212201848-7aac2a2c5b7c
bin_dir="$CACHE/minio-$MINIO_VERSION"
bin="$bin_dir/minio"
access_key=farmap-test
secret_key=farmap-test-secret
bucket=farmap-test
region=us-east-1

build_minio() {
  export PATH="$PATH:/usr/local/go/bin"
  command -v go >/dev/null || apt_need golang-go
  mkdir -p "$bin_dir"
  # One build at a time (several test binaries may start MinIO at once on a cold cache).
  exec 9>"$bin_dir/build.lock"
  flock 9
  if [ ! -x "$bin" ]; then
    log "building minio $MINIO_VERSION with $(go version) (once; cached in $bin_dir)"
    local tmp
    tmp=$(mktemp -d "$bin_dir/build.XXXXXX")
    GOBIN="$tmp" GOFLAGS=-mod=mod go install "github.com/minio/minio@$MINIO_VERSION" >&2 \
      || { rm -rf "$tmp"; die "go install of minio $MINIO_VERSION failed"; }
    mv "$tmp/minio" "$bin"
    rm -rf "$tmp"
  fi
  exec 9>&-
}

[ -x "$bin" ] || build_minio
# `minio.sh DIR --build-only`: the binary only (scripts/test.sh builds it ahead of the tests).
[ "${2:-}" = --build-only ] && exit 0
apt_need curl

port=$(free_port 1)
mkdir -p "$SVC_DIR/data"
# The objects go when the server does (a shared service's directory outlives the test run).
trap 'svc_cleanup; rm -rf "$SVC_DIR/data"' EXIT
# GOGC=400: MinIO's CPU is the limit of many requests in flight on a small machine, and its
# garbage collector a visible part of it (measured on 2 shared cores: managed reads of 64 KiB
# objects 275-280 -> 317-351 MB/s, 4 KiB direct reads a little faster too); it costs
# memory, which a test server has. The scanner (usage crawling after the benches' writes)
# runs at its slowest.
GOGC=${GOGC:-400} MINIO_SCANNER_SPEED=${MINIO_SCANNER_SPEED:-slowest} \
MINIO_ROOT_USER=$access_key MINIO_ROOT_PASSWORD=$secret_key MINIO_BROWSER=off \
  MINIO_UPDATE=off MINIO_CI_CD=1 \
  "$bin" server "$SVC_DIR/data" --quiet \
  --address "127.0.0.1:$port" --console-address "127.0.0.1:$((port + 1))" \
  >"$SVC_DIR/minio.log" 2>&1 &
pid=$!
svc_track $pid

endpoint="http://127.0.0.1:$port"
for i in $(seq 1 300); do
  curl -sf "$endpoint/minio/health/ready" >/dev/null && break
  kill -0 $pid 2>/dev/null || { tail -n 30 "$SVC_DIR/minio.log" >&2; die "minio exited before it was ready"; }
  [ "$i" = 300 ] && die "minio not ready after 30s"
  sleep 0.1
done

# Create the bucket: a signed PUT (curl signs AWS SigV4 itself). MinIO can answer 503 (its
# object layer not initialized yet) for a moment after its readiness check passed on a busy
# machine: retry for up to 30 s, and say what it answered if it never takes the bucket.
answer=
for i in $(seq 1 150); do
  kill -0 $pid 2>/dev/null || { tail -n 30 "$SVC_DIR/minio.log" >&2; die "minio exited while the bucket was created"; }
  answer=$(curl -s -o "$SVC_DIR/bucket.out" -w '%{http_code}' --aws-sigv4 "aws:amz:$region:s3" \
    --user "$access_key:$secret_key" -X PUT "$endpoint/$bucket" 2>&1) || true
  [ "$answer" = 200 ] && break
  [ "$i" = 150 ] && {
    cat "$SVC_DIR/bucket.out" >&2 2>/dev/null
    tail -n 30 "$SVC_DIR/minio.log" >&2
    die "cannot create bucket $bucket: the last answer was HTTP '$answer'"
  }
  sleep 0.2
done

echo "PORT=$port"
echo "ENDPOINT=$endpoint"
echo "ACCESS_KEY=$access_key"
echo "SECRET_KEY=$secret_key"
echo "REGION=$region"
echo "BUCKET=$bucket"
echo "SPEC_BASE=s3://$bucket"
svc_ready
