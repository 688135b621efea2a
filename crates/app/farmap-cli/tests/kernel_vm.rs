//! The kernel's block-device clients against farmap, in a qemu VM (this machine's kernel has
//! neither nbd nor ublk): one boot runs both parts, the host checks the stores afterwards.
//!
//! - NBD: the guest's `nbd-client` connects with 4 sockets to an NBD server on the host
//!   ([`start_nbd_server`]), writes a pattern through `/dev/nbd0`, writes another through a
//!   `MAP_SHARED` mapping of the device, makes an ext4 file system on its first 32 MiB,
//!   writes a file, remounts and checks it, discards a range, and disconnects.
//! - ublk: the guest runs `farmap mount --ublk farmap://10.0.2.2:PORT` (a host `farmap serve`
//!   of a directory store) and does the same on `/dev/ublkbN`, then stops it with SIGTERM.
//! - farmap's own kernel NBD client: the guest runs `farmap mount --nbd --managed
//!   farmap://10.0.2.2:PORT --connections 4` (netlink, 4 sockets to its in-process server
//!   over a managed cache of the host's store: a flush pushes everything)
//!   and does the same on `/dev/nbdN`; then it writes a pattern with no fsync while holding
//!   the device open (so no last close writes it back) with periodic writeback off, and stops
//!   the mount with SIGTERM: only the mount's flush-first teardown can bring that pattern to
//!   the store. The library's path / file / slice mounts (`NbdMount::path/open/map`) run in
//!   the guest too (`farmap __guest nbd-lib` on a file store the guest then checks).
//!
//! On the host, each store's bytes must hold both patterns, zeros where the guest discarded,
//! its first 32 MiB must pass
//! `e2fsck -fn`, and the file read back from that image with `debugfs` must be the pattern
//! the guest wrote.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use farmap_testkit::pattern_bytes;
// A child process killed (and reaped) when dropped.
use farmap_testkit::process::KillOnDrop as Proc;
use farmap_testkit::vm::{Vm, VmError};

const MIB: u64 = 1 << 20;
/// The device's size.
const SIZE: u64 = 64 * MIB;
/// The ext4 file system covers the first 32 MiB; the patterns lie beyond it.
const FS_MIB: u64 = 32;
/// Written with pwrite + fsync: an odd offset and length.
const WRITE_RANGE: (u64, u64, u64) = (40 * MIB + 1000, 3 * MIB + 77, 11);
/// Written through a MAP_SHARED mapping + msync: an offset inside a page.
const MMAP_RANGE: (u64, u64, u64) = (48 * MIB + 3 * 4096 + 100, MIB + 333, 12);
/// Written with pwrite, then its middle discarded (`blkdiscard`): must read as zeros after.
const DISCARD_RANGE: (u64, u64, u64) = (56 * MIB, 2 * MIB, 14);
/// The discarded part of [`DISCARD_RANGE`] (offset, length).
const DISCARDED: (u64, u64) = (57 * MIB, 256 << 10);
/// The file written into the ext4 file system.
const FILE: (u64, u64) = (MIB + 5, 13);
/// Written through `farmap mount --nbd`'s device with no fsync, just before SIGTERM.
const UNSYNCED_RANGE: (u64, u64, u64) = (60 * MIB + 5 * 4096 + 17, 512 * 1024 + 3, 15);

fn farmap_bin() -> &'static str {
    env!("CARGO_BIN_EXE_farmap")
}

/// An NBD server for the guest's kernel client.
struct NbdServer {
    proc: Proc,
    port: u16,
    export: String,
    /// The store spec the host reads the served bytes back from, after [`NbdServer::stop`].
    store: String,
}

impl NbdServer {
    /// Stops the server (it flushes what it holds).
    fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.proc.0.id().to_string()])
            .status();
        let _ = self.proc.0.wait();
    }
}

/// farmap's own NBD server (`farmap serve --nbd`) of a directory store, exported as `farmap`
/// (the default export "" is a small memory store the guest never touches). The host reads
/// the directory store back after [`NbdServer::stop`] (the server flushes on SIGTERM).
fn start_nbd_server(dir: &Path) -> Result<NbdServer, String> {
    let spec = format!("dir:{}/nbd?size={SIZE}", dir.display());
    let (proc, port) = spawn_farmap_serve(&[
        "serve",
        "--nbd",
        "memory:1MiB",
        "--export",
        &format!("farmap={spec}"),
        "--listen",
        "127.0.0.1:0",
        "--quiet",
    ])?;
    Ok(NbdServer {
        proc,
        port,
        export: "farmap".into(),
        store: format!("dir:{}/nbd", dir.display()),
    })
}

/// Starts `farmap ARGS` (a `serve` on port 0) and reads the port it printed on stderr.
fn spawn_farmap_serve(args: &[&str]) -> Result<(Proc, u16), String> {
    let mut child = Command::new(farmap_bin())
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start farmap {args:?}: {e}"))?;
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).map_err(|e| e.to_string())?;
    let addr = line
        .split("listening on ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .map(|a| a.trim_end_matches(',').to_owned())
        .ok_or_else(|| format!("farmap {args:?} printed no address: {line:?}"))?;
    // Keep draining its stderr so that it never blocks on a full pipe.
    let what = args[..2].join(" ");
    std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = stderr.read_to_string(&mut rest);
        if !rest.trim().is_empty() {
            eprintln!("farmap {what}: {rest}");
        }
    });
    let port = addr
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| format!("no port in {addr:?}"))?;
    Ok((Proc(child), port))
}

/// A `farmap serve` of directory store `name`, for one of the guest's farmap devices.
fn start_farmap_serve(dir: &Path, name: &str) -> (Proc, u16, String) {
    let spec = format!("dir:{}/{name}?size=64MiB", dir.display());
    let (proc, port) = spawn_farmap_serve(&["serve", &spec, "--listen", "127.0.0.1:0", "--quiet"])
        .expect("start farmap serve");
    (proc, port, format!("dir:{}/{name}", dir.display()))
}

/// The checks the guest runs on block device `$DEV` (a shell fragment).
fn device_checks(tag: &str) -> String {
    let (wo, wl, ws) = WRITE_RANGE;
    let (mo, ml, ms) = MMAP_RANGE;
    let (fl, fs) = FILE;
    let (dwo, dwl, dws) = DISCARD_RANGE;
    let (dof, dl) = DISCARDED;
    format!(
        r#"
farmap __guest pattern-write $DEV {dwo} {dwl} {dws}
blkdiscard -o {dof} -l {dl} $DEV
farmap __guest pattern-write $DEV {wo} {wl} {ws}
farmap __guest pattern-check $DEV {wo} {wl} {ws}
farmap __guest mmap-write $DEV {mo} {ml} {ms}
farmap __guest mmap-check $DEV {mo} {ml} {ms}
farmap __guest pattern-check $DEV {mo} {ml} {ms}
mkfs.ext4 -F -q $DEV {FS_MIB}M
mkdir -p /mnt/{tag}
mount -t ext4 $DEV /mnt/{tag}
farmap __guest pattern-write /mnt/{tag}/data 0 {fl} {fs}
umount /mnt/{tag}
mount -t ext4 $DEV /mnt/{tag}
farmap __guest pattern-check /mnt/{tag}/data 0 {fl} {fs}
echo "MARK {tag}-file $(md5sum /mnt/{tag}/data | cut -d' ' -f1)"
umount /mnt/{tag}
farmap __guest pattern-check $DEV {wo} {wl} {ws}
"#
    )
}

fn guest_script(nbd: &NbdServer, farmap_port: u16, mount_port: u16) -> String {
    let (uo, ul, us) = UNSYNCED_RANGE;
    format!(
        r#"
# --- kernel NBD client, 4 sockets ---
nbd-client 10.0.2.2 {nport} /dev/nbd0 -N {export} -C 4
DEV=/dev/nbd0
echo "MARK nbd-size $(cat /sys/block/nbd0/size)"
{nbd_checks}
sync
nbd-client -d /dev/nbd0
echo MARK nbd-done

# --- ublk device served by farmap in the guest over the host's farmap serve ---
farmap mount --ublk farmap://10.0.2.2:{fport} --queues 2 >/tmp/ublk.path 2>/tmp/ublk.log &
UPID=$!
i=0
while [ ! -s /tmp/ublk.path ]; do
  i=$((i+1)); [ $i -lt 300 ] || {{ cat /tmp/ublk.log; exit 1; }}
  kill -0 $UPID || {{ cat /tmp/ublk.log; exit 1; }}
  sleep 0.2
done
DEV=$(cat /tmp/ublk.path)
echo "MARK ublk-dev $DEV"
{ublk_checks}
sync
kill -TERM $UPID
wait $UPID || {{ cat /tmp/ublk.log; exit 1; }}
cat /tmp/ublk.log
echo MARK ublk-done

# --- the library's kernel NBD client: path, file and slice mounts of a file store ---
farmap __guest nbd-lib 'file:/tmp/lib.img?size=16MiB' 5000 300000 7
farmap __guest pattern-check /tmp/lib.img 5000 300000 7
farmap __guest pattern-check /tmp/lib.img 305000 300000 8
echo MARK nbd-lib-ok

# --- farmap mount --nbd: the kernel's NBD client on 4 sockets to farmap in the guest ---
farmap mount --nbd --managed farmap://10.0.2.2:{mport} --connections 4 --json >/tmp/nbdm.json 2>/tmp/nbdm.log &
MPID=$!
i=0
while [ ! -s /tmp/nbdm.json ]; do
  i=$((i+1)); [ $i -lt 300 ] || {{ cat /tmp/nbdm.log; exit 1; }}
  kill -0 $MPID || {{ cat /tmp/nbdm.log; exit 1; }}
  sleep 0.2
done
echo "MARK nbdm-json $(cat /tmp/nbdm.json)"
DEV=$(sed 's/.*"device":"\([^"]*\)".*/\1/' /tmp/nbdm.json)
N=${{DEV#/dev/nbd}}
echo "MARK nbdm-size $(cat /sys/block/nbd$N/size)"
echo "MARK nbdm-backend $(cat /sys/block/nbd$N/backend)"
{mount_checks}
sync
# Left in the page cache: periodic writeback off, the device held open (no last-close sync).
echo 0 > /proc/sys/vm/dirty_writeback_centisecs
exec 3<$DEV
W0=$(awk '{{print $7}}' /sys/block/nbd$N/stat)
farmap __guest pattern-write $DEV {uo} {ul} {us} --no-sync
W1=$(awk '{{print $7}}' /sys/block/nbd$N/stat)
echo "MARK nbdm-sectors-written-before-stop $((W1 - W0))"
kill -TERM $MPID
wait $MPID || {{ cat /tmp/nbdm.log; exit 1; }}
exec 3<&-
cat /tmp/nbdm.log
echo MARK nbdm-done
"#,
        mport = mount_port,
        mount_checks = device_checks("nbdm"),
        nport = nbd.port,
        export = nbd.export,
        fport = farmap_port,
        nbd_checks = device_checks("nbd"),
        ublk_checks = device_checks("ublk"),
    )
}

/// Copies the store's bytes into a file on the host (`farmap cp`).
fn host_image(store: &str, dir: &Path, name: &str) -> PathBuf {
    let out = dir.join(format!("{name}.img"));
    let o = Command::new(farmap_bin())
        .args(["cp", store, &format!("file:{}", out.display())])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "farmap cp {store} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

/// The host's checks of what the guest wrote through one device.
fn check_store(what: &str, store: &str, dir: &Path) {
    let image = host_image(store, dir, what);
    let bytes = std::fs::read(&image).unwrap();
    assert_eq!(bytes.len() as u64, SIZE, "{what}: store size");
    for (name, (off, len, seed)) in [("pwrite", WRITE_RANGE), ("mmap", MMAP_RANGE)] {
        let got = &bytes[off as usize..(off + len) as usize];
        let want = pattern_bytes(seed, off, len as usize);
        if let Some(i) = got.iter().zip(&want).position(|(g, w)| g != w) {
            panic!(
                "{what}: the {name} pattern differs in the store at byte {} ({:#04x}, expected {:#04x})",
                off + i as u64,
                got[i],
                want[i]
            );
        }
    }
    let (dwo, dwl, dws) = DISCARD_RANGE;
    let (dof, dl) = DISCARDED;
    let expected: Vec<u8> = pattern_bytes(dws, dwo, dwl as usize)
        .into_iter()
        .enumerate()
        .map(|(i, b)| {
            let at = dwo + i as u64;
            if (dof..dof + dl).contains(&at) {
                0
            } else {
                b
            }
        })
        .collect();
    let got = &bytes[dwo as usize..(dwo + dwl) as usize];
    if let Some(i) = got.iter().zip(&expected).position(|(g, w)| g != w) {
        panic!(
            "{what}: after blkdiscard of {dl} bytes at {dof}, byte {} is {:#04x}, expected {:#04x}",
            dwo + i as u64,
            got[i],
            expected[i]
        );
    }
    let fs = dir.join(format!("{what}-fs.img"));
    std::fs::write(&fs, &bytes[..(FS_MIB * MIB) as usize]).unwrap();
    let fsck = Command::new("e2fsck").arg("-fn").arg(&fs).output().unwrap();
    assert!(
        fsck.status.success(),
        "{what}: e2fsck -fn of the store's file system failed: {}{}",
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );
    let cat = Command::new("debugfs")
        .args(["-R", "cat /data"])
        .arg(&fs)
        .output()
        .unwrap();
    assert!(cat.status.success(), "{what}: debugfs cat /data failed");
    let (flen, fseed) = FILE;
    assert!(
        cat.stdout == pattern_bytes(fseed, 0, flen as usize),
        "{what}: the file in the store's ext4 ({} bytes) is not the pattern the guest wrote ({flen} bytes)",
        cat.stdout.len()
    );
}

#[test]
fn kernel_nbd_and_ublk_in_a_vm() {
    const NAME: &str = "kernel_nbd_and_ublk_in_a_vm";
    let dir = tempfile::tempdir().unwrap();
    let nbd = match start_nbd_server(dir.path()) {
        Ok(s) => s,
        Err(why) => return farmap_testkit::skip(NAME, why),
    };
    let (serve, farmap_port, ublk_store) = start_farmap_serve(dir.path(), "ublk");
    let (mount_serve, mount_port, mount_store) = start_farmap_serve(dir.path(), "nbdm");
    let vm = Vm::new(guest_script(&nbd, farmap_port, mount_port))
        .bin(farmap_bin(), "farmap")
        .timeout(Duration::from_secs(300));
    let out = match vm.run() {
        Ok(out) => out,
        Err(VmError::Unavailable(why)) => return farmap_testkit::skip(NAME, why),
        Err(e) => panic!("{e}"),
    };
    // For the log (shown with --nocapture or when an assertion below fails).
    eprintln!("guest marks: {:?}", out.marks);
    for line in out.console.lines().filter(|l| l.starts_with("farmap")) {
        eprintln!("guest: {line}");
    }
    let nbd_store = nbd.store.clone();
    nbd.stop();
    // SIGTERM: the server answers what is in flight and flushes the store.
    let _ = Command::new("kill")
        .args(["-TERM", &serve.0.id().to_string()])
        .status();
    drop(serve);
    let _ = Command::new("kill")
        .args(["-TERM", &mount_serve.0.id().to_string()])
        .status();
    drop(mount_serve);

    assert_eq!(
        out.mark("nbd-size"),
        Some((SIZE / 512).to_string().as_str()),
        "/dev/nbd0's size in sectors"
    );
    // nbd-client prints one negotiation line per socket.
    let sockets = out.console.matches("Negotiation: ..size").count();
    assert_eq!(sockets, 4, "nbd-client -C 4 negotiated {sockets} sockets");
    // The same file content through both devices (each checked against the pattern in the
    // guest, and below on the host).
    let sums = (
        out.mark("nbd-file"),
        out.mark("ublk-file"),
        out.mark("nbdm-file"),
    );
    assert!(
        matches!(sums, (Some(a), Some(b), Some(c)) if a.len() == 32 && a == b && a == c),
        "md5 of the file read back through nbd-client, ublk and mount --nbd: {sums:?}"
    );
    check_mount_nbd(&out);
    assert!(out.mark("nbd-done").is_some() && out.mark("ublk-done").is_some());
    assert!(
        out.mark("ublk-dev")
            .is_some_and(|d| d.starts_with("/dev/ublkb")),
        "the ublk mount printed {:?}",
        out.mark("ublk-dev")
    );
    check_store("nbd", &nbd_store, dir.path());
    check_store("ublk", &ublk_store, dir.path());
    check_store("mount-nbd", &mount_store, dir.path());
    // The pattern written with no fsync just before SIGTERM reached the store: the teardown
    // flushed before it disconnected.
    let image = host_image(&mount_store, dir.path(), "mount-nbd-unsynced");
    let bytes = std::fs::read(&image).unwrap();
    let (uo, ul, us) = UNSYNCED_RANGE;
    let got = &bytes[uo as usize..(uo + ul) as usize];
    let want = pattern_bytes(us, uo, ul as usize);
    if let Some(i) = got.iter().zip(&want).position(|(g, w)| g != w) {
        panic!(
            "mount --nbd: the pattern left in the page cache at SIGTERM is not in the store \
             (byte {} is {:#04x}, expected {:#04x}): the teardown did not flush it",
            uo + i as u64,
            got[i],
            want[i]
        );
    }
}

/// What the guest saw of `farmap mount --nbd`'s device.
fn check_mount_nbd(out: &farmap_testkit::vm::VmOutput) {
    assert!(
        out.mark("nbd-lib-ok").is_some(),
        "the library's nbd-lib run"
    );
    let json = out.mark("nbdm-json").expect("mount --nbd printed its JSON");
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    assert!(
        v["device"]
            .as_str()
            .is_some_and(|d| d.starts_with("/dev/nbd")),
        "device: {json}"
    );
    assert_eq!(v["size"], SIZE, "{json}");
    assert_eq!(
        v["connections"], 4,
        "the in-process server's connections: {json}"
    );
    assert_eq!(v["block_size"], 4096, "{json}");
    assert_eq!(
        out.mark("nbdm-size"),
        Some((SIZE / 512).to_string().as_str()),
        "/sys/block/nbdN/size of mount --nbd's device"
    );
    assert!(
        out.mark("nbdm-backend")
            .is_some_and(|b| b.starts_with("farmap:")),
        "/sys/block/nbdN/backend: {:?}",
        out.mark("nbdm-backend")
    );
    // The unsynced pattern had not reached the device before SIGTERM (else the test below
    // would prove nothing about the teardown).
    let early: u64 = out
        .mark("nbdm-sectors-written-before-stop")
        .and_then(|s| s.parse().ok())
        .expect("sectors written mark");
    assert!(
        early < UNSYNCED_RANGE.1 / 512,
        "{early} sectors reached the device before SIGTERM: the unsynced pattern was written back early"
    );
    assert!(out.mark("nbdm-done").is_some());
}
