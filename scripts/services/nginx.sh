#!/usr/bin/env bash
# One nginx on loopback serving DIR/www as static files (it honours Range, sends a strong ETag
# and Last-Modified, and checks If-Match): the web server of the http:// store's tests.
# Prints PORT=, ROOT= (the directory it serves: tests write files there) and
# URL_BASE=http://127.0.0.1:PORT.
. "$(dirname "$0")/lib.sh"
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || apt_need nginx-light
PATH=$PATH:/usr/sbin
port=$(free_port)
root="$SVC_DIR/www"
mkdir -p "$root" "$SVC_DIR/tmp"
cat >"$SVC_DIR/nginx.conf" <<CONF
daemon off;
master_process off;
worker_processes 1;
pid $SVC_DIR/nginx.pid;
error_log $SVC_DIR/error.log;
events { worker_connections 256; }
http {
  access_log $SVC_DIR/access.log;
  client_body_temp_path $SVC_DIR/tmp/body;
  default_type application/octet-stream;
  server {
    listen 127.0.0.1:$port;
    root $root;
  }
}
CONF
nginx -p "$SVC_DIR" -e "$SVC_DIR/error.log" -c "$SVC_DIR/nginx.conf" >&2 &
svc_track $!
wait_port "$port" 20 $!
echo "PORT=$port"
echo "ROOT=$root"
echo "URL_BASE=http://127.0.0.1:$port"
svc_ready
