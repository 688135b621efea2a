#!/usr/bin/env bash
# One Apache Cassandra 5.0 node on loopback (see lib.sh for the service-script contract).
#   bash scripts/services/cassandra.sh DIR [auth]
# Jars come from Maven Central (cassandra-all and its runtime dependencies, ≈ 70 MB, ≈ 30 s
# the first time) and are cached under ~/.cache/farmap/cassandra-VERSION/lib; the node's data,
# config and logs live in DIR. The CQL, storage and JMX ports are free ports. With `auth`, the
# node requires a password (PasswordAuthenticator; the superuser is cassandra/cassandra).
# Prints PORT=, SPEC_BASE=cql://127.0.0.1:PORT (cql://cassandra:cassandra@... with auth),
# then READY once the node answers a CQL OPTIONS request. Java is stopped when the script
# ends (SIGTERM, or the test process exiting).
. "$(dirname "$0")/lib.sh"

VER=${CASSANDRA_VERSION:-5.0.9}
HEAP_MIN=${CASSANDRA_HEAP_MIN:-512M}
HEAP_MAX=${CASSANDRA_HEAP_MAX:-1G}
AUTH=${2:-}
case "$AUTH" in "" | auth) ;; *) die "unknown argument $AUTH (expected: auth)" ;; esac

command -v java >/dev/null || apt_need openjdk-17-jre-headless
command -v mvn >/dev/null || apt_need maven

# --- 1. jars, cached outside DIR (one download at a time; a half-done one is never used) ---
JARS="$CACHE/cassandra-$VER/lib"
if [ ! -f "$JARS/cassandra-all-$VER.jar" ]; then
  mkdir -p "$CACHE/cassandra-$VER"
  exec 9>"$CACHE/cassandra-$VER/.lock"
  flock 9
  if [ ! -f "$JARS/cassandra-all-$VER.jar" ]; then
    log "downloading Cassandra $VER jars from Maven Central (once; cached in $JARS)"
    tmp=$(mktemp -d "$CACHE/cassandra-$VER/.download.XXXXXX")
    cat >"$tmp/pom.xml" <<POM
<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>
<groupId>farmap</groupId><artifactId>cassandra-runtime</artifactId><version>1</version><packaging>pom</packaging>
<dependencies><dependency><groupId>org.apache.cassandra</groupId><artifactId>cassandra-all</artifactId><version>$VER</version></dependency></dependencies></project>
POM
    (cd "$tmp" && mvn -q -B dependency:copy-dependencies -DoutputDirectory=lib -DincludeScope=runtime) >&2 ||
      { rm -rf "$tmp"; die "mvn could not fetch cassandra-all $VER"; }
    rm -rf "$JARS"
    mv "$tmp/lib" "$JARS"
    rm -rf "$tmp"
  fi
  exec 9>&-
fi
JAMM=$(ls "$JARS"/jamm-*.jar 2>/dev/null | head -n 1)
[ -n "$JAMM" ] || die "no jamm jar in $JARS (delete the directory to download again)"

# --- 2. config ------------------------------------------------------------------------------
cql_port=$(free_port)
storage_port=$(free_port)
jmx_port=$(free_port)
while [ "$storage_port" = "$cql_port" ]; do storage_port=$(free_port); done
while [ "$jmx_port" = "$cql_port" ] || [ "$jmx_port" = "$storage_port" ]; do jmx_port=$(free_port); done
mkdir -p "$SVC_DIR/conf" "$SVC_DIR/run"
if [ -n "$AUTH" ]; then
  authenticator=PasswordAuthenticator
  authorizer=CassandraAuthorizer
else
  authenticator=AllowAllAuthenticator
  authorizer=AllowAllAuthorizer
fi
cat >"$SVC_DIR/conf/cassandra.yaml" <<YAML
cluster_name: farmap-test
num_tokens: 1
initial_token: 0
partitioner: org.apache.cassandra.dht.Murmur3Partitioner
commitlog_sync: periodic
commitlog_sync_period: 10000ms
endpoint_snitch: SimpleSnitch
seed_provider:
  - class_name: org.apache.cassandra.locator.SimpleSeedProvider
    parameters:
      - seeds: "127.0.0.1:$storage_port"
listen_address: 127.0.0.1
rpc_address: 127.0.0.1
storage_port: $storage_port
native_transport_port: $cql_port
start_native_transport: true
authenticator: $authenticator
authorizer: $authorizer
data_file_directories: [$SVC_DIR/run/data]
commitlog_directory: $SVC_DIR/run/commitlog
saved_caches_directory: $SVC_DIR/run/saved_caches
hints_directory: $SVC_DIR/run/hints
cdc_raw_directory: $SVC_DIR/run/cdc_raw
YAML
cat >"$SVC_DIR/conf/logback.xml" <<'XML'
<configuration>
  <appender name="FILE" class="ch.qos.logback.core.FileAppender">
    <file>${cassandra.logdir}/system.log</file>
    <encoder><pattern>%-5level [%thread] %date{ISO8601} %F:%L - %msg%n</pattern></encoder>
  </appender>
  <root level="INFO"><appender-ref ref="FILE"/></root>
</configuration>
XML

# --- 3. launch (the JPMS flags of Cassandra 5.0's conf/jvm17-server.options) ----------------
JPMS=(
  -Djdk.attach.allowAttachSelf=true
  --add-exports java.base/jdk.internal.misc=ALL-UNNAMED
  --add-exports java.management.rmi/com.sun.jmx.remote.internal.rmi=ALL-UNNAMED
  --add-exports java.rmi/sun.rmi.registry=ALL-UNNAMED
  --add-exports java.rmi/sun.rmi.server=ALL-UNNAMED
  --add-exports java.sql/java.sql=ALL-UNNAMED
  --add-exports java.base/java.lang.ref=ALL-UNNAMED
  --add-exports jdk.unsupported/sun.misc=ALL-UNNAMED
  --add-exports jdk.compiler/com.sun.tools.javac.file=ALL-UNNAMED
  --add-exports jdk.attach/sun.tools.attach=ALL-UNNAMED
  --add-opens java.base/java.lang.module=ALL-UNNAMED
  --add-opens java.base/jdk.internal.loader=ALL-UNNAMED
  --add-opens java.base/jdk.internal.ref=ALL-UNNAMED
  --add-opens java.base/jdk.internal.reflect=ALL-UNNAMED
  --add-opens java.base/jdk.internal.math=ALL-UNNAMED
  --add-opens java.base/jdk.internal.module=ALL-UNNAMED
  --add-opens java.base/jdk.internal.util.jar=ALL-UNNAMED
  --add-opens jdk.management/com.sun.management.internal=ALL-UNNAMED
  --add-opens java.base/sun.nio.ch=ALL-UNNAMED
  --add-opens java.base/java.io=ALL-UNNAMED
  --add-opens java.base/java.lang.reflect=ALL-UNNAMED
  --add-opens jdk.compiler/com.sun.tools.javac=ALL-UNNAMED
  --add-opens java.base/java.lang=ALL-UNNAMED
  --add-opens java.base/java.util=ALL-UNNAMED
)
log "starting Cassandra $VER: CQL on 127.0.0.1:$cql_port, data in $SVC_DIR/run"
java "-Xms$HEAP_MIN" "-Xmx$HEAP_MAX" -Xss256k -XX:+UseG1GC -ea -da:net.openhft... \
  "${JPMS[@]}" -Dio.netty.tryReflectionSetAccessible=true \
  -Djava.net.preferIPv4Stack=true \
  "-javaagent:$JAMM" \
  "-Dcassandra.config=file://$SVC_DIR/conf/cassandra.yaml" \
  "-Dlogback.configurationFile=$SVC_DIR/conf/logback.xml" \
  "-Dcassandra.logdir=$SVC_DIR/run" \
  "-Dcassandra.storagedir=$SVC_DIR/run" \
  -Dcassandra-foreground=yes \
  -Dcassandra.skip_wait_for_gossip_to_settle=0 \
  -Dcassandra.ring_delay_ms=100 \
  -Dcassandra.superuser_setup_delay_ms=0 \
  "-Dcassandra.jmx.local.port=$jmx_port" \
  -cp "$SVC_DIR/conf:$JARS/*" \
  org.apache.cassandra.service.CassandraDaemon >"$SVC_DIR/run/stdout.log" 2>&1 &
pid=$!
svc_track "$pid"

# --- 4. ready when the node answers a CQL OPTIONS request (a SUPPORTED frame, opcode 6) -----
# The port opens once the node has started its native transport; the request proves it
# speaks CQL. Protocol v4 header: version, flags, stream (2 bytes), opcode 5, length 0.
cql_answers() {
  local reply
  reply=$(timeout 5 bash -c '
    exec 3<>"/dev/tcp/127.0.0.1/$0" || exit 1
    printf "\x04\x00\x00\x00\x05\x00\x00\x00\x00" >&3
    head -c 5 <&3 | od -An -tx1' "$cql_port" 2>/dev/null) || return 1
  [ "$(echo $reply)" = "84 00 00 00 06" ]
}
started=$SECONDS
until cql_answers; do
  if ! kill -0 "$pid" 2>/dev/null; then
    tail -n 40 "$SVC_DIR/run/stdout.log" "$SVC_DIR/run/system.log" >&2 2>/dev/null || true
    die "Cassandra (pid $pid) exited before answering CQL"
  fi
  ((SECONDS - started < 180)) || die "Cassandra does not answer CQL on $cql_port after 180 s"
  sleep 0.25
done
log "Cassandra answers CQL on 127.0.0.1:$cql_port after $((SECONDS - started)) s"
# --- 5. with auth, ready when the default superuser logs in ------------------------------
# The node makes the role `cassandra` in a background task once it is up (even with
# superuser_setup_delay_ms=0), so on a busy machine the port answers before the password does.
# STARTUP, then AUTH_RESPONSE with SASL PLAIN ("\0user\0password"): AUTH_SUCCESS is opcode 0x10.
cql_logs_in() {
  timeout 5 python3 - "$cql_port" <<'PY' 2>/dev/null
import socket, struct, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=4)
def frame(stream, opcode, body):
    s.sendall(struct.pack(">BBhBI", 4, 0, stream, opcode, len(body)) + body)
    head = b""
    while len(head) < 9:
        more = s.recv(9 - len(head))
        if not more:
            sys.exit(1)
        head += more
    _, _, _, op, n = struct.unpack(">BBhBI", head)
    left = n
    while left:
        more = s.recv(min(left, 65536))
        if not more:
            sys.exit(1)
        left -= len(more)
    return op
def string(t):
    return struct.pack(">H", len(t)) + t
if frame(1, 0x01, struct.pack(">H", 1) + string(b"CQL_VERSION") + string(b"3.0.0")) != 0x03:
    sys.exit(1)
token = b"\0cassandra\0cassandra"
sys.exit(0 if frame(2, 0x0F, struct.pack(">i", len(token)) + token) == 0x10 else 1)
PY
}
if [ -n "$AUTH" ]; then
  until cql_logs_in; do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 40 "$SVC_DIR/run/system.log" >&2 2>/dev/null || true
      die "Cassandra (pid $pid) exited before its default superuser could log in"
    fi
    ((SECONDS - started < 180)) || die "the default superuser cannot log in to Cassandra after 180 s"
    sleep 0.25
  done
  log "the default superuser logs in after $((SECONDS - started)) s"
fi
if [ -n "$AUTH" ]; then
  echo "USER=cassandra"
  echo "PASSWORD=cassandra"
  echo "SPEC_BASE=cql://cassandra:cassandra@127.0.0.1:$cql_port"
else
  echo "SPEC_BASE=cql://127.0.0.1:$cql_port"
fi
echo "PORT=$cql_port"
svc_ready
