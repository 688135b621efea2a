#!/usr/bin/env bash
# Fetches the Debian bookworm-backports kernel (which has nbd.ko and ublk_drv.ko as modules)
# once and caches it under ~/.cache/farmap/vm/ (or $FARMAP_VM_CACHE); prints the directory
# holding `vmlinuz`, `modules/` (the decompressed .ko files the guest needs) and
# `modules.order` (their names in load order).
# A cached kernel is reused without touching the network.
set -euo pipefail

CACHE=${FARMAP_VM_CACHE:-$HOME/.cache/farmap/vm}
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9

# The modules the guest needs (with what they depend on, found below). A cached kernel whose
# module set differs is extracted again from the cached package.
want=${FARMAP_VM_MODULES:-failover net_failover virtio_net virtio_blk nbd ublk_drv crc32c_generic ext4}
if [[ -f $CACHE/current ]]; then
  dir=$CACHE/$(cat "$CACHE/current")
  if [[ -f $dir/vmlinuz && -f $dir/modules.order && $(cat "$dir/modules.want" 2>/dev/null) == "$want" ]]; then
    echo "$dir"
    exit 0
  fi
fi

log() { printf 'vm/kernel.sh: %s\n' "$*" >&2; }
for tool in apt-get apt-cache dpkg-deb xz; do
  command -v "$tool" >/dev/null || { log "needs $tool"; exit 1; }
done

W=$(mktemp -d "$CACHE/.fetch.XXXXXX")
trap 'rm -rf "$W"' EXIT
MIRROR=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
if [[ -z $MIRROR ]]; then
  MIRROR=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
fi
MIRROR=${MIRROR:-http://deb.debian.org/debian}
mkdir -p "$W/lists/partial" "$W/archives/partial"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR bookworm-backports main" >"$W/sources.list"
APTO=(-o "Dir::Etc::sourcelist=$W/sources.list" -o Dir::Etc::sourceparts=/nonexistent
  -o "Dir::State::Lists=$W/lists" -o "Dir::Cache::archives=$W/archives" -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
log "fetching the bookworm-backports package lists from $MIRROR"
apt-get "${APTO[@]}" -qq update >&2
KPKG=$(apt-cache "${APTO[@]}" depends linux-image-amd64 | awk '/Depends: linux-image-6/{print $2; exit}')
[[ -n $KPKG ]] || { log "no linux-image-6.* package in bookworm-backports"; exit 1; }
KV=${KPKG#linux-image-}
KV=${KV%-unsigned}
mkdir -p "$CACHE/debs"
if ! compgen -G "$CACHE/debs/${KPKG}_*.deb" >/dev/null; then
  log "downloading $KPKG (about 100 MB; once)"
  (cd "$W" && apt-get "${APTO[@]}" -qq download "$KPKG" >&2)
  mv "$W"/"${KPKG}"_*.deb "$CACHE/debs/"
fi
dpkg-deb -x "$CACHE/debs/${KPKG}"_*.deb "$W/k"

out=$CACHE/$KV
rm -rf "$out"
mkdir -p "$out/modules"
cp "$W/k/boot/vmlinuz-$KV" "$out/vmlinuz"
mdir=$W/k/lib/modules/$KV
# The modules the guest needs, with what they depend on (read from each module's .modinfo:
# `depends=` and `softdep=pre:`), decompressed, flat (names are unique), and a modules.dep
# in load order. The package has no modules.dep (depmod writes it at install).
declare -A path=() done=()
while IFS= read -r -d '' m; do
  b=$(basename "$m"); b=${b%.xz}; b=${b%.zst}; b=${b%.ko}
  path[${b//-/_}]=$m
done < <(find "$mdir/kernel" -name '*.ko*' -print0)
decompress() {
  case $1 in
    *.xz) xz -dc "$1" ;;
    *.zst) zstd -qdc "$1" ;;
    *) cat "$1" ;;
  esac
}
order=()
add() {
  local name=${1//-/_} m deps d
  [[ -n ${done[$name]:-} ]] && return 0
  done[$name]=1
  m=${path[$name]:-}
  if [[ -z $m && $name == crypto_* ]]; then
    add "${name#crypto_}" # an algorithm's alias names its module
    return 0
  fi
  if [[ -z $m ]]; then
    grep -q "/${1}.ko" "$mdir/modules.builtin" 2>/dev/null && return 0
    log "module $1 is neither a module nor built in; skipping it"
    return 0
  fi
  decompress "$m" >"$out/modules/$name.ko"
  deps=$( (grep -a -o -E 'depends=[A-Za-z0-9_,-]*' "$out/modules/$name.ko" || true) | head -1 | cut -d= -f2 | tr , ' ')
  deps+=" $( (grep -a -o -E 'softdep=pre: [A-Za-z0-9_ -]*' "$out/modules/$name.ko" || true) | head -1 | cut -d: -f2)"
  for d in $deps; do add "$d"; done
  order+=("$name")
}
for m in $want; do add "$m"; done
printf '%s\n' "${order[@]}" >"$out/modules.order"
echo "$want" >"$out/modules.want"
echo "$KV" >"$CACHE/current"
log "cached kernel $KV in $out"
echo "$out"
