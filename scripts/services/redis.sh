#!/usr/bin/env bash
# One redis-server on loopback (an example of the service-script contract; see lib.sh).
# Prints PORT= and SPEC_BASE=redis://127.0.0.1:PORT.
. "$(dirname "$0")/lib.sh"
apt_need redis-server
port=$(free_port)
redis-server --port "$port" --bind 127.0.0.1 --dir "$SVC_DIR" --save '' --appendonly no \
  --daemonize no --logfile "$SVC_DIR/redis.log" >&2 &
svc_track $!
wait_port "$port" 20 $!
echo "PORT=$port"
echo "SPEC_BASE=redis://127.0.0.1:$port"
svc_ready
