#!/usr/bin/env bash
# Boots a Debian kernel (bookworm-backports: nbd.ko and ublk_drv.ko) under qemu's software
# emulation with a throw-away initramfs, runs a guest script in it and reports the result.
#
# usage: scripts/vm/run.sh --guest SCRIPT [--bin PATH[:NAME]]... [--file SRC:DEST]...
#                          [--timeout SECS] [--mem MB] [--smp N]
#
# The initramfs holds busybox, Debian's nbd-client and mkfs.ext4 (with the libraries `ldd`
# lists), the kernel modules the guest needs (loaded at boot), the given binaries (in /bin,
# stripped, with their libraries) and files, and SCRIPT as /guest.sh, which the guest runs
# with `sh -ex` in /tmp after loading the modules and bringing up the network (qemu user
# networking: the host's loopback is 10.0.2.2 to the guest). Lines the guest prints that
# start with `MARK ` are for the caller; the guest ends with `MARK guest-exit RC`.
#
# The serial console goes to stdout. Exit status: 0 when the guest script succeeded; 1 when
# it failed or the guest died (the console's tail goes to stderr); 124 on timeout; 3 when
# this machine cannot run the VM (the reason on stderr).
# The kernel is downloaded once and cached under ~/.cache/farmap/vm/ (see kernel.sh).
# qemu is CPU-heavy: callers on a shared machine run this under a lock.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

guest="" timeout=240 mem=1024 smp=2
bins=() files=()
while (($#)); do
  case $1 in
    --guest) guest=$2; shift 2 ;;
    --bin) bins+=("$2"); shift 2 ;;
    --file) files+=("$2"); shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    --mem) mem=$2; shift 2 ;;
    --smp) smp=$2; shift 2 ;;
    *) echo "vm/run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -f $guest ]] || { echo "vm/run.sh: --guest SCRIPT is required (got '$guest')" >&2; exit 2; }

unavailable() { echo "vm/run.sh: cannot run the VM here: $*" >&2; exit 3; }

# --- what the host needs (installed when missing, as scripts/test.sh does) ---------------
need=(qemu-system-x86 nbd-client busybox-static cpio xz-utils e2fsprogs)
missing=()
for p in "${need[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "vm/run.sh: installing ${missing[*]}" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >&2 \
    || unavailable "the packages ${missing[*]} are missing and could not be installed"
fi

kdir=$("$here/kernel.sh") || unavailable "the bookworm-backports kernel could not be fetched (see above)"

W=$(mktemp -d "${TMPDIR:-/tmp}/farmap-vm.XXXXXX")
trap 'rm -rf "$W"' EXIT
R=$W/root
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
for b in "${bins[@]}"; do
  src=${b%%:*} name=$(basename "$src")
  [[ $b == *:* ]] && name=${b#*:}
  [[ -x $src ]] || { echo "vm/run.sh: --bin $src is not an executable" >&2; exit 2; }
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
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
ip route add default via 10.0.2.2
echo "MARK guest-start $(uname -r)"
cd /tmp
sh -ex /guest.sh
rc=$?
sync
echo "MARK guest-exit $rc"
poweroff -f
INIT
chmod 755 "$R/init"
(cd "$R" && find . | cpio -o -H newc --quiet) >"$W/initramfs.cpio"

log=$W/console.log
set +e
timeout -k 5 "$timeout" qemu-system-x86_64 -accel tcg,thread=multi -cpu max -m "$mem" -smp "$smp" \
  -kernel "$kdir/vmlinuz" -initrd "$W/initramfs.cpio" \
  -append "console=ttyS0 panic=-1 quiet" \
  -display none -serial stdio -monitor none -no-reboot \
  -netdev user,id=n0 -device virtio-net-pci,netdev=n0,romfile= </dev/null 2>&1 | tr -d '\r' | tee "$log"
rc=${PIPESTATUS[0]}
set -e
if grep -q '^MARK guest-exit 0$' "$log"; then
  exit 0
fi
if ((rc == 124)); then
  echo "vm/run.sh: the guest did not finish within ${timeout}s; the console's last lines:" >&2
else
  echo "vm/run.sh: the guest script failed (qemu exit $rc); the console's last lines:" >&2
fi
tail -n 60 "$log" >&2
((rc == 124)) && exit 124
exit 1
