#!/usr/bin/env bash
# Builds the throw-away initramfs of farmap's VM tests and fetches the kernel it boots with:
# busybox, Debian's nbd-client and mkfs.ext4 (with the libraries `ldd` lists), the kernel
# modules the guest needs (loaded at boot), the given binaries (in /bin, stripped, with their
# libraries) and files, and SCRIPT as /guest.sh, which the guest's init runs with `sh -ex` in
# /tmp after loading the modules and, when the VM has a NIC, bringing up the network (qemu
# user networking: the host's loopback is 10.0.2.2 to the guest). Lines the guest prints that
# start with `MARK ` are for the caller; the init ends with `MARK guest-exit RC` and powers off.
#
# usage: scripts/vm/initramfs.sh --out DIR --guest SCRIPT [--bin PATH[:NAME]]...
#                                [--file SRC:DEST]... [--vmcheck]
#
# Writes DIR/initramfs.cpio and DIR/vmlinuz (a link to the cached kernel). --vmcheck compiles
# scripts/vm/vmcheck.c (the self-checking guest, docs/design/vm.md §7) into /bin/vmcheck.
# Exit status: 0 when built; 2 on bad arguments; 3 when this machine cannot build it (the
# reason on stderr). The kernel is downloaded once and cached under ~/.cache/farmap/vm/ (see
# kernel.sh). scripts/vm/run.sh boots the result for a script; farmap-vm's tests boot it with
# their own qemu command line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

out="" guest="" vmcheck=0
bins=() files=()
while (($#)); do
  case $1 in
    --out) out=$2; shift 2 ;;
    --guest) guest=$2; shift 2 ;;
    --bin) bins+=("$2"); shift 2 ;;
    --file) files+=("$2"); shift 2 ;;
    --vmcheck) vmcheck=1; shift ;;
    *) echo "vm/initramfs.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -n $out ]] || { echo "vm/initramfs.sh: --out DIR is required" >&2; exit 2; }
[[ -f $guest ]] || { echo "vm/initramfs.sh: --guest SCRIPT is required (got '$guest')" >&2; exit 2; }

unavailable() { echo "vm/initramfs.sh: cannot build the VM here: $*" >&2; exit 3; }

# --- what the host needs (installed when missing, as scripts/test.sh does) ---------------
need=(nbd-client busybox-static cpio xz-utils e2fsprogs)
((vmcheck)) && need+=(gcc libc6-dev)
missing=()
for p in "${need[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "vm/initramfs.sh: installing ${missing[*]}" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >&2 \
    || unavailable "the packages ${missing[*]} are missing and could not be installed"
fi

kdir=$("$here/kernel.sh") || unavailable "the bookworm-backports kernel could not be fetched (see above)"

mkdir -p "$out"
R=$(mktemp -d "$out/.root.XXXXXX")
trap 'rm -rf "$R"' EXIT
mkdir -p "$R"/{bin,sbin,usr/bin,usr/sbin,lib/modules,etc,proc,sys,dev,tmp,mnt,run}

# Copies an executable to DEST in the initramfs, with every library `ldd` names.
add_exe() {
  local src=$1 dest=$2 lib
  mkdir -p "$R$(dirname "$dest")"
  if [[ ${3:-} == strip ]] && command -v strip >/dev/null; then
    strip -o "$R$dest" "$src"
  else
    cp -L "$src" "$R$dest"
  fi
  chmod 755 "$R$dest"
  for lib in $(ldd "$src" 2>/dev/null | grep -o '/[^ ]*' || true); do
    [[ -e $R$lib ]] && continue
    mkdir -p "$R$(dirname "$lib")"
    cp -L "$lib" "$R$lib"
  done
}

cp /bin/busybox "$R/bin/busybox"
add_exe "$(command -v nbd-client)" /sbin/nbd-client
add_exe "$(command -v mke2fs)" /sbin/mke2fs
ln -s mke2fs "$R/sbin/mkfs.ext4"
[[ -f /etc/mke2fs.conf ]] && cp /etc/mke2fs.conf "$R/etc/"
if ((vmcheck)); then
  gcc -O2 -static -Wall -Wextra -Werror -o "$R/bin/vmcheck" "$here/vmcheck.c" \
    || { echo "vm/initramfs.sh: scripts/vm/vmcheck.c does not compile" >&2; exit 1; }
fi
for b in "${bins[@]}"; do
  src=${b%%:*} name=$(basename "$src")
  [[ $b == *:* ]] && name=${b#*:}
  [[ -x $src ]] || { echo "vm/initramfs.sh: --bin $src is not an executable" >&2; exit 2; }
  add_exe "$src" "/bin/$name" strip
done
for f in "${files[@]}"; do
  mkdir -p "$R$(dirname "${f#*:}")"
  cp -L "${f%%:*}" "$R${f#*:}"
done
cp "$kdir"/modules/*.ko "$R/lib/modules/"
cp "$kdir/modules.order" "$R/lib/modules/"
cp "$guest" "$R/guest.sh"

cat >"$R/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
for m in $(cat /lib/modules/modules.order); do
  insmod /lib/modules/$m.ko || echo "MARK insmod-failed $m"
done
ip link set lo up
if [ -e /sys/class/net/eth0 ]; then
  ip link set eth0 up
  ip addr add 10.0.2.15/24 dev eth0
  ip route add default via 10.0.2.2
fi
echo "MARK guest-start $(uname -r)"
cd /tmp
sh -ex /guest.sh
rc=$?
sync
echo "MARK guest-exit $rc"
poweroff -f
INIT
chmod 755 "$R/init"
(cd "$R" && find . | cpio -o -H newc --quiet) >"$out/initramfs.cpio.tmp"
mv "$out/initramfs.cpio.tmp" "$out/initramfs.cpio"
ln -sfn "$kdir/vmlinuz" "$out/vmlinuz"
