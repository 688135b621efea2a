#!/usr/bin/env bash
# One memcached on loopback (see lib.sh for the service-script contract).
#   bash scripts/services/memcached.sh DIR [MB]
# MB: the item memory, -m (64 by default). Two worker threads, no UDP. Prints PORT=.
# WRAP (optional): a command prefix to start the server under, split on blanks, e.g.
# WRAP="farmap run --local-max 25% --"; the tracked pid is then the wrapper's.
. "$(dirname "$0")/lib.sh"
MB=${2:-64}
[[ "$MB" =~ ^[1-9][0-9]*$ ]] || die "MB must be a positive integer, not $MB"
apt_need memcached
read -ra wrap <<<"${WRAP:-}"
# memcached refuses to run as root without -u; `-u root` keeps the user (it only clears the
# supplementary groups), so that a wrapper and the server stay the same user.
user=()
[ "$(id -u)" != 0 ] || user=(-u root)
port=$(free_port)
"${wrap[@]}" memcached "${user[@]}" -l 127.0.0.1 -p "$port" -m "$MB" -t 2 -U 0 \
  >&2 &
svc_track $!
wait_port "$port" 20 $!
echo "PORT=$port"
svc_ready
