#!/usr/bin/env bash
# A redis-server primary with one replica on loopback (for `flush=wait`: WAIT counts the
# replicas that acknowledged a connection's writes). Prints PORT= (the primary),
# REPLICA_PORT= and SPEC_BASE=redis://127.0.0.1:PORT, once the replica's link is up.
. "$(dirname "$0")/lib.sh"
apt_need redis-server
port=$(free_port)
redis-server --port "$port" --bind 127.0.0.1 --dir "$SVC_DIR" --save '' --appendonly no \
  --daemonize no --logfile "$SVC_DIR/primary.log" >&2 &
svc_track $!
wait_port "$port" 20 $!
mkdir -p "$SVC_DIR/replica"
rport=$(free_port)
redis-server --port "$rport" --bind 127.0.0.1 --dir "$SVC_DIR/replica" --save '' \
  --appendonly no --daemonize no --logfile "$SVC_DIR/replica.log" \
  --replicaof 127.0.0.1 "$port" >&2 &
svc_track $!
wait_port "$rport" 20 $!
for _ in $(seq 200); do
  redis-cli -p "$rport" info replication 2>/dev/null | grep -q '^master_link_status:up' && break
  sleep 0.1
done
redis-cli -p "$rport" info replication | grep -q '^master_link_status:up' ||
  die "the replica did not link to its primary in 20 s"
echo "PORT=$port"
echo "REPLICA_PORT=$rport"
echo "SPEC_BASE=redis://127.0.0.1:$port"
svc_ready
