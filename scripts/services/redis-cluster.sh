#!/usr/bin/env bash
# A 3-node Redis Cluster on loopback (3 primaries, no replicas; see lib.sh for the contract).
# Prints NODES=h:p,h:p,h:p, PORT1..3=, PID1..3= (a test may kill one node: the cluster then
# keeps serving the slots of the others, cluster-require-full-coverage being off) and
# SPEC_BASE=redis+cluster://NODES/.
. "$(dirname "$0")/lib.sh"
apt_need redis-server redis-tools
nodes=()
for i in 1 2 3; do
  # The cluster bus listens on PORT+10000.
  port=$(free_port 10000)
  mkdir -p "$SVC_DIR/n$i"
  redis-server --port "$port" --bind 127.0.0.1 --dir "$SVC_DIR/n$i" --save '' --appendonly no \
    --cluster-enabled yes --cluster-config-file "$SVC_DIR/n$i/nodes.conf" \
    --cluster-node-timeout 2000 --cluster-require-full-coverage no \
    --daemonize no --logfile "$SVC_DIR/n$i/redis.log" >&2 &
  pid=$!
  svc_track "$pid"
  wait_port "$port" 20 "$pid"
  nodes+=("127.0.0.1:$port")
  echo "PORT$i=$port"
  echo "PID$i=$pid"
done
redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >&2
# Ready when every node sees the whole cluster as ok.
for _ in $(seq 1 100); do
  ok=0
  for n in "${nodes[@]}"; do
    redis-cli -h 127.0.0.1 -p "${n##*:}" cluster info 2>/dev/null | grep -q 'cluster_state:ok' && ok=$((ok + 1))
  done
  [ "$ok" = 3 ] && break
  sleep 0.1
done
[ "$ok" = 3 ] || die "the cluster did not reach cluster_state:ok"
list=$(IFS=,; echo "${nodes[*]}")
echo "NODES=$list"
echo "SPEC_BASE=redis+cluster://$list/"
# Like svc_ready, but a node that dies (a test killing it on purpose) does not stop the others.
echo READY
while kill -0 "$SVC_PARENT" 2>/dev/null; do sleep 0.5; done
