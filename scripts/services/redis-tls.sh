#!/usr/bin/env bash
# One redis-server on loopback that speaks only TLS (for `rediss://`), with a test CA made
# here by openssl. Clients are not asked for certificates (--tls-auth-clients no).
# Prints PORT=, CA= (the PEM of the CA that signed the server's certificate, for 127.0.0.1),
# WRONG_CA= (the PEM of another CA) and SPEC_BASE=rediss://127.0.0.1:PORT.
. "$(dirname "$0")/lib.sh"
apt_need redis-server openssl
d=$SVC_DIR/tls
mkdir -p "$d"
ca() { # ca NAME: a self-signed CA
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
    -subj "/CN=farmap test $1" -keyout "$d/$1-key.pem" -out "$d/$1.pem" 2>/dev/null
}
ca ca
ca wrong-ca
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=127.0.0.1" \
  -keyout "$d/server-key.pem" -out "$d/server.csr" 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n' >"$d/ext.cnf"
openssl x509 -req -in "$d/server.csr" -CA "$d/ca.pem" -CAkey "$d/ca-key.pem" -CAcreateserial \
  -days 2 -extfile "$d/ext.cnf" -out "$d/server.pem" 2>/dev/null
port=$(free_port)
redis-server --port 0 --tls-port "$port" --bind 127.0.0.1 --dir "$SVC_DIR" --save '' \
  --appendonly no --daemonize no --logfile "$SVC_DIR/redis.log" \
  --tls-cert-file "$d/server.pem" --tls-key-file "$d/server-key.pem" \
  --tls-ca-cert-file "$d/ca.pem" --tls-auth-clients no >&2 &
svc_track $!
wait_port "$port" 20 $!
echo "PORT=$port"
echo "CA=$d/ca.pem"
echo "WRONG_CA=$d/wrong-ca.pem"
echo "SPEC_BASE=rediss://127.0.0.1:$port"
svc_ready
