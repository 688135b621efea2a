#!/usr/bin/env bash
# Boots a Debian kernel (bookworm-backports: nbd.ko and ublk_drv.ko) under qemu's software
# emulation with a throw-away initramfs, runs a guest script in it and reports the result.
#
# usage: scripts/vm/run.sh --guest SCRIPT [--bin PATH[:NAME]]... [--file SRC:DEST]...
#                          [--timeout SECS] [--mem MB] [--smp N]
#
# scripts/vm/initramfs.sh builds the initramfs (busybox, nbd-client, mkfs.ext4, the modules,
# the given binaries and files, SCRIPT as /guest.sh: see it for the guest's environment);
# this script boots it with one fixed qemu command line (a virtio NIC on user networking).
# Lines the guest prints that start with `MARK ` are for the caller; the guest ends with
# `MARK guest-exit RC`.
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

dpkg-query -W -f='${Status}' qemu-system-x86 2>/dev/null | grep -q "install ok installed" || {
  echo "vm/run.sh: installing qemu-system-x86" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-system-x86; } >&2 \
    || unavailable "qemu-system-x86 is missing and could not be installed"
}

W=$(mktemp -d "${TMPDIR:-/tmp}/farmap-vm.XXXXXX")
trap 'rm -rf "$W"' EXIT
args=(--out "$W" --guest "$guest")
for b in "${bins[@]}"; do args+=(--bin "$b"); done
for f in "${files[@]}"; do args+=(--file "$f"); done
set +e
"$here/initramfs.sh" "${args[@]}"
rc=$?
set -e
((rc == 3)) && unavailable "see above"
((rc == 0)) || exit "$rc"

log=$W/console.log
set +e
timeout -k 5 "$timeout" qemu-system-x86_64 -accel tcg,thread=multi -cpu max -m "$mem" -smp "$smp" \
  -kernel "$W/vmlinuz" -initrd "$W/initramfs.cpio" \
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
