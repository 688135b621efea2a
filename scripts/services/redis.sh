#!/usr/bin/env bash
# One redis-server on loopback (an example of the service-script contract; see lib.sh).
# Prints PORT= and SPEC_BASE=redis://127.0.0.1:PORT.
# WRAP (optional): a command prefix to start the server under, split on blanks, e.g.
# WRAP="farmap run --local-max 25% --"; the tracked pid is then the wrapper's.
. "$(dirname "$0")/lib.sh"
apt_need redis-server
read -ra wrap <<<"${WRAP:-}"
port=$(free_port)
"${wrap[@]}" redis-server --port "$port" --bind 127.0.0.1 --dir "$SVC_DIR" --save '' --appendonly no \
  --daemonize no --logfile "$SVC_DIR/redis.log" >&2 &
svc_track $!
wait_port "$port" 20 $!
echo "PORT=$port"
echo "SPEC_BASE=redis://127.0.0.1:$port"
svc_ready
