# Shared pieces of the service scripts (sourced). A service script is run as
#   bash scripts/services/NAME.sh DIR [ARGS...]
# by farmap_testkit::Service: it starts its server(s) on 127.0.0.1 with data in DIR, prints
# KEY=VALUE lines and then READY on stdout, logs to stderr, and stays alive until SIGTERM or
# until its parent (the test process) exits; then it stops its servers. See
# crates/testkit/farmap-testkit/src/service.rs.
set -euo pipefail

SVC_DIR=${1:?usage: $0 DIR [ARGS...]}
SVC_PARENT=$PPID
CACHE=${FARMAP_CACHE:-$HOME/.cache/farmap}
mkdir -p "$CACHE" "$SVC_DIR"
SVC_PIDS=()

log() { printf '%s: %s\n' "$(basename "$0" .sh)" "$*" >&2; }
die() { log "$*"; exit 1; }

svc_cleanup() {
  local p
  for p in "${SVC_PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${SVC_PIDS[@]}"; do
    for _ in $(seq 1 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
  done
  # Once the test process is gone nobody reads the data or the logs: leave nothing behind
  # (a stopped service's directory is removed by Service::stop).
  if ! kill -0 "$SVC_PARENT" 2>/dev/null; then rm -rf "$SVC_DIR"; fi
}
trap svc_cleanup EXIT
trap 'exit 0' TERM INT

# svc_track PID: stop this process when the service stops.
svc_track() { SVC_PIDS+=("$1"); }

# port_free PORT: whether nothing listens on 127.0.0.1:PORT.
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# free_port [PLUS]: a port where PORT (and PORT+PLUS, when given) are free, both below the
# kernel's ephemeral range: a port in that range can be taken at any moment as the local port
# of some outgoing connection or of a listener on port 0, and the server's bind then fails
# ("port already in use") although nothing listened when the port was chosen.
free_port() {
  local plus=${1:-0} p lo=10000 hi
  hi=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
  hi=$((hi - 1 - plus))
  [ "$hi" -gt $((lo + 100)) ] || die "no room for ports below the ephemeral range ($hi)"
  for _ in $(seq 1 200); do
    p=$((lo + RANDOM % (hi - lo)))
    port_free "$p" && { [ "$plus" = 0 ] || port_free $((p + plus)); } && { echo "$p"; return 0; }
  done
  die "no free port found"
}

# wait_port PORT SECONDS [PID]: wait until something listens on PORT (fails if PID dies).
wait_port() {
  local port=$1 secs=$2 pid=${3:-}
  for _ in $(seq 1 $((secs * 10))); do
    port_free "$port" || return 0
    if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then die "server (pid $pid) exited before listening on $port"; fi
    sleep 0.1
  done
  die "nothing listens on 127.0.0.1:$port after ${secs}s"
}

# apt_need PKG...: install Debian packages that are missing (root).
apt_need() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  log "installing ${missing[*]}"
  # Several test binaries may start services at once: one apt at a time.
  flock /tmp/farmap-apt.lock sh -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ${missing[*]}" >&2
}

# svc_ready: print READY and stay alive until SIGTERM or the parent exits.
svc_ready() {
  echo READY
  while kill -0 "$SVC_PARENT" 2>/dev/null; do
    for p in "${SVC_PIDS[@]}"; do kill -0 "$p" 2>/dev/null || die "server pid $p died"; done
    sleep 0.5
  done
}
