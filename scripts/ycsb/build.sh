#!/usr/bin/env bash
# YCSB 0.17.0 core (Maven Central) with farmap's own two DB bindings (scripts/ycsb/src/):
#   farmap.ycsb.RedisClient      redis hashes + a sorted-set index for scans (Jedis)
#   farmap.ycsb.MemcachedClient  memcached text protocol over a socket (no scans)
# Usage: CP=$(bash scripts/ycsb/build.sh | sed -n 's/^CLASSPATH=//p')
# Prints exactly one line on stdout, CLASSPATH=<absolute jars joined by ':'>; logs go to stderr.
# Idempotent: the jars (YCSB core, its runtime dependencies and Jedis; fetched once with
# `mvn dependency:copy-dependencies`, ≈ 10 s) and the compiled bindings (a jar named after a
# hash of the sources, rebuilt when they change) are cached under
# ${FARMAP_CACHE:-${XDG_CACHE_HOME:-~/.cache}/farmap}/ycsb-0.17.0/; concurrent runs wait on a
# lock and a half-done download or build is never used.
#
# Load (any DB; then the run phase on the same data):
#   java -cp "$CP" site.ycsb.Client -load -db farmap.ycsb.RedisClient \
#     -p workload=site.ycsb.workloads.CoreWorkload -p recordcount=10000 \
#     -p fieldcount=10 -p fieldlength=100 -p fieldlengthdistribution=constant \
#     -p dataintegrity=true -threads 4 -p redis.host=127.0.0.1 -p redis.port=P -s
# Run (workload B: 95% reads / 5% updates; A: readproportion=0.5 updateproportion=0.5):
#   java -cp "$CP" site.ycsb.Client -t -db farmap.ycsb.RedisClient \
#     -p workload=site.ycsb.workloads.CoreWorkload -p recordcount=10000 \
#     -p fieldcount=10 -p fieldlength=100 -p fieldlengthdistribution=constant \
#     -p dataintegrity=true -threads 4 -p redis.host=127.0.0.1 -p redis.port=P \
#     -p operationcount=50000 -p requestdistribution=zipfian \
#     -p readproportion=0.95 -p updateproportion=0.05 -p scanproportion=0 -p insertproportion=0 \
#     -p measurementtype=hdrhistogram -p hdrhistogram.percentiles=50,99,99.9
# memcached: -db farmap.ycsb.MemcachedClient -p memcached.host=127.0.0.1 -p memcached.port=P.
# Properties: redis.host (127.0.0.1), redis.port (6379), redis.timeout (ms, 10000);
#   memcached.host (127.0.0.1), memcached.port (11211), memcached.timeout (ms, 10000).
# Notes:
# - The record/field layout must be the same in load and run (recordcount, fieldcount,
#   fieldlength, fieldlengthdistribution): dataintegrity=true checks every value read
#   against a deterministic function of key and field name, and it requires
#   fieldlengthdistribution=constant (the Client exits with an error otherwise).
#   CoreWorkload's defaults are readallfields=true and writeallfields=false (an update writes
#   one field); both bindings handle either.
# - Output (stdout; -s prints a status line every 10 s on stderr):
#   [OVERALL], RunTime(ms), N / [OVERALL], Throughput(ops/sec), X
#   [READ], Operations, N / AverageLatency(us) / MinLatency(us) / MaxLatency(us)
#   [READ], 50thPercentileLatency(us), N / 99thPercentileLatency(us) / 99.9PercentileLatency(us)
#   [READ], Return=OK, N (a failed check: [VERIFY] lines and [READ], Return=UNEXPECTED_STATE)
#   and the same for [UPDATE], [INSERT], [CLEANUP], [READ-FAILED], [VERIFY].
set -euo pipefail

YCSB_VERSION=0.17.0
JEDIS_VERSION=${JEDIS_VERSION:-8.0.2}
HERE=$(cd "$(dirname "$0")" && pwd)
SRC="$HERE/src"
CACHE=${FARMAP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/farmap}
DIR="$CACHE/ycsb-$YCSB_VERSION"
LIB="$DIR/lib-jedis-$JEDIS_VERSION"

log() { printf 'ycsb/build: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

# apt_need PKG...: install Debian packages that are missing (root; one apt at a time).
apt_need() {
  log "installing $*"
  flock /tmp/farmap-apt.lock sh -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $*" >&2
}
command -v javac >/dev/null || apt_need openjdk-17-jdk-headless
command -v jar >/dev/null || apt_need openjdk-17-jdk-headless
command -v mvn >/dev/null || apt_need maven

mkdir -p "$DIR"
exec 9>"$DIR/.lock"
flock 9

# --- 1. YCSB core, its runtime dependencies and Jedis ------------------------------------------
if [ ! -f "$LIB/.complete" ]; then
  log "downloading YCSB $YCSB_VERSION core and Jedis $JEDIS_VERSION from Maven Central (once; cached in $LIB)"
  tmp=$(mktemp -d "$DIR/.download.XXXXXX")
  cat >"$tmp/pom.xml" <<POM
<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>
<groupId>farmap</groupId><artifactId>ycsb-runtime</artifactId><version>1</version><packaging>pom</packaging>
<dependencies>
<dependency><groupId>site.ycsb</groupId><artifactId>core</artifactId><version>$YCSB_VERSION</version></dependency>
<dependency><groupId>redis.clients</groupId><artifactId>jedis</artifactId><version>$JEDIS_VERSION</version></dependency>
</dependencies></project>
POM
  # (Debian's maven 3.8 writes colour resets even with -B -q: they are removed from the log.)
  (cd "$tmp" && mvn -q -B -Dstyle.color=never dependency:copy-dependencies -DoutputDirectory=lib -DincludeScope=runtime 2>&1 |
    sed 's/\x1b\[[0-9;]*m//g' >&2) ||
    { rm -rf "$tmp"; die "mvn could not fetch site.ycsb:core:$YCSB_VERSION and redis.clients:jedis:$JEDIS_VERSION"; }
  [ -f "$tmp/lib/core-$YCSB_VERSION.jar" ] || { rm -rf "$tmp"; die "no core-$YCSB_VERSION.jar after mvn"; }
  touch "$tmp/lib/.complete"
  rm -rf "$LIB"
  mv "$tmp/lib" "$LIB"
  rm -rf "$tmp"
fi
DEPS=$(find "$LIB" -maxdepth 1 -name '*.jar' | LC_ALL=C sort | paste -sd: -)

# --- 2. the bindings, compiled into a jar named after a hash of the sources and the deps ------
hash=$( (cd "$SRC" && find . -name '*.java' | LC_ALL=C sort | xargs sha256sum; echo "$DEPS") |
  sha256sum | cut -c1-16)
JAR="$DIR/farmap-ycsb-$hash.jar"
if [ ! -f "$JAR" ]; then
  log "compiling $SRC into $JAR"
  tmp=$(mktemp -d "$DIR/.build.XXXXXX")
  mapfile -t sources < <(find "$SRC" -name '*.java' | LC_ALL=C sort)
  javac --release 17 -Xlint:all,-serial,-options -encoding UTF-8 -cp "$DEPS" -d "$tmp/classes" "${sources[@]}" >&2 ||
    { rm -rf "$tmp"; die "javac failed"; }
  jar --create --file "$tmp/farmap-ycsb.jar" -C "$tmp/classes" . >&2 || { rm -rf "$tmp"; die "jar failed"; }
  mv "$tmp/farmap-ycsb.jar" "$JAR"
  rm -rf "$tmp"
fi
exec 9>&-
echo "CLASSPATH=$JAR:$DEPS"
