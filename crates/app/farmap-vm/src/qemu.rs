//! The QEMU command line of a farmap VM (docs/design/vm.md §8), built from one
//! [`QemuConfig`].
//!
//! A migration's destination must run the same machine as its source: same machine type,
//! CPU model, devices, RAM backend id and size. Both command lines come from one value, so
//! they differ only in what [`Incoming`] adds (and in the socket paths, when the destination
//! is [`QemuConfig::with_sockets_in`] another folder).
//!
//! Fixed flags, and why:
//! - `-accel tcg,thread=multi -cpu max`: no KVM here; `max` is the same model at both ends.
//! - `-nodefaults -vga none -display none -monitor none`: no default devices, no VGA RAM in
//!   the migration stream, no stdio monitor.
//! - `-no-reboot`: a guest that panics (`panic=-1`) exits instead of booting again.

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};

use crate::version::QemuVersion;

/// The QEMU binary unless told otherwise.
pub const DEFAULT_QEMU: &str = "qemu-system-x86_64";
/// The kernel command line unless told otherwise.
pub const DEFAULT_APPEND: &str = "console=ttyS0 panic=-1 quiet";
/// The id of the RAM backend object (`-object memory-backend-file,id=ram0`).
pub const RAM_ID: &str = "ram0";

/// Where the guest's RAM lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ram {
    /// A file QEMU maps (`memory-backend-file`): a farmap FUSE mount's `region`, or a file on
    /// `/dev/shm`. `discard-data` is always off, so QEMU never punches the file at exit.
    File {
        /// The file (QEMU truncates it to the RAM size only when it is empty).
        path: PathBuf,
        /// `share=on`: mapped `MAP_SHARED`, so the file holds the guest's writes (and
        /// `x-ignore-shared` can leave the RAM out of a migration).
        share: bool,
    },
    /// Anonymous memory (`-m` alone): the QEMU anchors, where QEMU migrates the RAM itself.
    Anonymous,
}

/// How a destination QEMU waits for its incoming migration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Incoming {
    /// `-incoming defer`: waits for QMP `migrate-incoming`; the VM starts on its own once the
    /// state is loaded.
    Defer,
    /// `-incoming defer -S`: the same, but the VM stays paused after the load until QMP
    /// `cont`.
    DeferPaused,
}

/// One VM, as both ends of a migration run it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuConfig {
    /// The QEMU binary (default [`DEFAULT_QEMU`], found on `PATH`).
    pub qemu: PathBuf,
    /// Guest RAM in MiB.
    pub mem_mib: u64,
    /// vCPUs (default 1).
    pub smp: u32,
    /// Where the RAM lives.
    pub ram: Ram,
    /// The kernel to boot (`-kernel`); `None` boots nothing (a VM kept in `prelaunch` with
    /// `-S`, or one that only receives a migration).
    pub kernel: Option<PathBuf>,
    /// The initramfs (`-initrd`).
    pub initrd: Option<PathBuf>,
    /// The kernel command line (`-append`, only with a kernel; default [`DEFAULT_APPEND`]).
    pub append: String,
    /// The serial console's socket; QEMU listens on it (`server=on,wait=off`).
    pub serial: PathBuf,
    /// The heartbeat socket; QEMU connects to it at start-up, so it must listen already
    /// ([`HeartbeatListener`](crate::HeartbeatListener)). The guest's bytes to I/O port
    /// 0xe9 go there (`isa-debugcon`).
    pub heartbeat: PathBuf,
    /// The QMP socket; QEMU listens on it (`server=on,wait=off`).
    pub qmp: PathBuf,
    /// A disk, as QEMU's `file=` (`nbd://127.0.0.1:10809/vm1-disk`): raw, virtio.
    pub drive: Option<String>,
    /// More arguments, appended as they are.
    pub extra: Vec<String>,
}

impl QemuConfig {
    /// A VM of `mem_mib` MiB with the defaults, its three sockets in `dir` (`serial.sock`,
    /// `hb.sock`, `qmp.sock`), no kernel.
    pub fn new(mem_mib: u64, ram: Ram, dir: &Path) -> Self {
        Self {
            qemu: PathBuf::from(DEFAULT_QEMU),
            mem_mib,
            smp: 1,
            ram,
            kernel: None,
            initrd: None,
            append: DEFAULT_APPEND.to_owned(),
            serial: dir.join("serial.sock"),
            heartbeat: dir.join("hb.sock"),
            qmp: dir.join("qmp.sock"),
            drive: None,
            extra: Vec::new(),
        }
    }

    /// The same VM with its three sockets in `dir`: a second QEMU on the same host (a
    /// migration's destination) cannot share the first one's sockets.
    pub fn with_sockets_in(&self, dir: &Path) -> Self {
        let fresh = Self::new(self.mem_mib, self.ram.clone(), dir);
        Self {
            serial: fresh.serial,
            heartbeat: fresh.heartbeat,
            qmp: fresh.qmp,
            ..self.clone()
        }
    }

    /// The arguments after the binary; a destination adds `incoming`'s.
    pub fn args(&self, incoming: Option<Incoming>) -> Vec<OsString> {
        let mut a = Args::default();
        let mem = format!("{}M", self.mem_mib);
        a.push(["-accel", "tcg,thread=multi", "-cpu", "max"]);
        a.push(["-smp", &self.smp.to_string(), "-m", &mem]);
        a.push([
            "-nodefaults",
            "-vga",
            "none",
            "-display",
            "none",
            "-no-reboot",
        ]);
        a.push(["-monitor", "none"]);
        match &self.ram {
            Ram::File { path, share } => {
                let share = if *share { "on" } else { "off" };
                let head = format!("memory-backend-file,id={RAM_ID},mem-path=");
                let tail = format!(",size={mem},share={share},discard-data=off");
                a.push(["-object".into(), option_with_path(&head, path, &tail)]);
                a.push(["-machine", &format!("pc,memory-backend={RAM_ID}")]);
            }
            Ram::Anonymous => a.push(["-machine", "pc"]),
        }
        if let Some(kernel) = &self.kernel {
            a.push([OsStr::new("-kernel"), kernel.as_os_str()]);
            if let Some(initrd) = &self.initrd {
                a.push([OsStr::new("-initrd"), initrd.as_os_str()]);
            }
            a.push(["-append", &self.append]);
        }
        let serial = option_with_path("socket,id=ser,path=", &self.serial, ",server=on,wait=off");
        a.push(["-chardev".into(), serial]);
        a.push(["-serial", "chardev:ser"]);
        let heartbeat = option_with_path("socket,id=hb,path=", &self.heartbeat, "");
        a.push(["-chardev".into(), heartbeat]);
        a.push(["-device", "isa-debugcon,iobase=0xe9,chardev=hb"]);
        let qmp = option_with_path("unix:", &self.qmp, ",server=on,wait=off");
        a.push(["-qmp".into(), qmp]);
        if let Some(drive) = &self.drive {
            let file = option_with_path("file=", Path::new(drive), ",format=raw,if=virtio");
            a.push(["-drive".into(), file]);
        }
        a.push(&self.extra);
        match incoming {
            None => {}
            Some(Incoming::Defer) => a.push(["-incoming", "defer"]),
            Some(Incoming::DeferPaused) => a.push(["-incoming", "defer", "-S"]),
        }
        a.0
    }

    /// The command that starts this VM as one `sh -c` line, every word single-quoted (for
    /// `farmap vm migrate --dst-launch`).
    pub fn shell_command(&self, incoming: Option<Incoming>) -> String {
        let quote = |w: &OsStr| format!("'{}'", w.to_string_lossy().replace('\'', "'\\''"));
        std::iter::once(quote(self.qemu.as_os_str()))
            .chain(self.args(incoming).iter().map(|a| quote(a)))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The command that starts this VM (its standard streams left as they are).
    pub fn command(&self, incoming: Option<Incoming>) -> Command {
        let mut command = Command::new(&self.qemu);
        command.args(self.args(incoming));
        command
    }
}

/// A failure to learn a QEMU binary's version.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QemuError {
    /// The binary could not be started (not installed, not executable).
    #[error("cannot run {}", binary.display())]
    Spawn {
        /// The binary.
        binary: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// `--version` failed.
    #[error("{} --version failed ({status}): {stderr}", binary.display())]
    Failed {
        /// The binary.
        binary: PathBuf,
        /// Its exit status.
        status: ExitStatus,
        /// Its standard error.
        stderr: String,
    },
    /// `--version` printed something else than `QEMU emulator version X.Y.Z`.
    #[error("{} --version printed no QEMU version: {output:?}", binary.display())]
    Banner {
        /// The binary.
        binary: PathBuf,
        /// What it printed.
        output: String,
    },
}

/// The version of a QEMU binary, from `BINARY --version`.
pub fn qemu_version(binary: impl AsRef<Path>) -> Result<QemuVersion, QemuError> {
    let binary = binary.as_ref().to_path_buf();
    let output = match Command::new(&binary).arg("--version").output() {
        Ok(output) => output,
        Err(source) => return Err(QemuError::Spawn { binary, source }),
    };
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr).trim().to_owned();
        let status = output.status;
        return Err(QemuError::Failed {
            binary,
            status,
            stderr,
        });
    }
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    QemuVersion::parse_banner(&stdout).ok_or(QemuError::Banner {
        binary,
        output: stdout,
    })
}

/// Arguments being collected.
#[derive(Debug, Default)]
struct Args(Vec<OsString>);

impl Args {
    fn push<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(&mut self, args: I) {
        self.0
            .extend(args.into_iter().map(|s| s.as_ref().to_os_string()));
    }
}

/// `head` + `path` + `tail` as one QEMU option list (`key=VALUE,key=...`), the path's commas
/// doubled as QEMU reads them.
fn option_with_path(head: &str, path: &Path, tail: &str) -> OsString {
    let mut out = head.as_bytes().to_vec();
    for &b in path.as_os_str().as_bytes() {
        out.push(b);
        if b == b',' {
            out.push(b',');
        }
    }
    out.extend_from_slice(tail.as_bytes());
    OsString::from_vec(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: Vec<OsString>) -> Vec<String> {
        args.into_iter().map(|a| a.into_string().unwrap()).collect()
    }

    fn common(ram: &[&str]) -> Vec<String> {
        let mut v: Vec<&str> = vec![
            "-accel",
            "tcg,thread=multi",
            "-cpu",
            "max",
            "-smp",
            "1",
            "-m",
            "256M",
            "-nodefaults",
            "-vga",
            "none",
            "-display",
            "none",
            "-no-reboot",
            "-monitor",
            "none",
        ];
        v.extend_from_slice(ram);
        v.extend_from_slice(&[
            "-kernel",
            "/k/vmlinuz",
            "-initrd",
            "/k/vmcheck.cpio",
            "-append",
            "console=ttyS0 panic=-1 quiet",
            "-chardev",
            "socket,id=ser,path=/run/vm/serial.sock,server=on,wait=off",
            "-serial",
            "chardev:ser",
            "-chardev",
            "socket,id=hb,path=/run/vm/hb.sock",
            "-device",
            "isa-debugcon,iobase=0xe9,chardev=hb",
            "-qmp",
            "unix:/run/vm/qmp.sock,server=on,wait=off",
        ]);
        v.into_iter().map(str::to_owned).collect()
    }

    fn config(ram: Ram) -> QemuConfig {
        let mut c = QemuConfig::new(256, ram, Path::new("/run/vm"));
        c.kernel = Some("/k/vmlinuz".into());
        c.initrd = Some("/k/vmcheck.cpio".into());
        c
    }

    fn file_ram() -> Ram {
        Ram::File {
            path: "/run/vm1/region".into(),
            share: true,
        }
    }

    #[test]
    fn file_backed_ram() {
        let args = strings(config(file_ram()).args(None));
        let ram = [
            "-object",
            "memory-backend-file,id=ram0,mem-path=/run/vm1/region,size=256M,share=on,discard-data=off",
            "-machine",
            "pc,memory-backend=ram0",
        ];
        assert_eq!(args, common(&ram));
    }

    #[test]
    fn anonymous_ram() {
        let args = strings(config(Ram::Anonymous).args(None));
        assert_eq!(args, common(&["-machine", "pc"]));
    }

    #[test]
    fn source_and_destination_differ_only_in_incoming() {
        for ram in [file_ram(), Ram::Anonymous] {
            let mut c = config(ram);
            c.smp = 2;
            c.drive = Some("nbd://127.0.0.1:10809/vm1-disk".into());
            c.extra = vec!["-rtc".into(), "clock=vm".into()];
            let source = strings(c.args(None));
            assert!(source.ends_with(&[
                "-drive".into(),
                "file=nbd://127.0.0.1:10809/vm1-disk,format=raw,if=virtio".into(),
                "-rtc".into(),
                "clock=vm".into(),
            ]));
            let dest = strings(c.args(Some(Incoming::Defer)));
            assert_eq!(dest[..source.len()], source[..]);
            assert_eq!(dest[source.len()..], ["-incoming", "defer"]);
            let paused = strings(c.args(Some(Incoming::DeferPaused)));
            assert_eq!(paused[source.len()..], ["-incoming", "defer", "-S"]);
            let command = c.command(Some(Incoming::Defer));
            assert_eq!(command.get_program(), "qemu-system-x86_64");
            assert_eq!(
                strings(command.get_args().map(OsStr::to_os_string).collect()),
                dest
            );
        }
    }

    #[test]
    fn other_sockets_same_machine() {
        let c = config(file_ram());
        let d = c.with_sockets_in(Path::new("/run/vm-dst"));
        assert_eq!(d.qmp, Path::new("/run/vm-dst/qmp.sock"));
        let same = QemuConfig {
            serial: c.serial.clone(),
            heartbeat: c.heartbeat.clone(),
            qmp: c.qmp.clone(),
            ..d.clone()
        };
        assert_eq!(same, c);
    }

    #[test]
    fn no_kernel_no_append_and_commas_doubled() {
        let ram = Ram::File {
            path: "/dev/shm/a,b".into(),
            share: false,
        };
        let mut c = QemuConfig::new(64, ram, Path::new("/tmp/x,y"));
        c.kernel = None;
        let args = strings(c.args(None));
        assert!(!args.iter().any(|a| a == "-kernel" || a == "-append"));
        assert!(args.contains(
            &"memory-backend-file,id=ram0,mem-path=/dev/shm/a,,b,size=64M,share=off,discard-data=off"
                .to_owned()
        ));
        assert!(args.contains(&"unix:/tmp/x,,y/qmp.sock,server=on,wait=off".to_owned()));
    }

    #[test]
    fn version_of_a_missing_binary_names_it() {
        let err = qemu_version("/nonexistent/qemu-system-x86_64").unwrap_err();
        assert!(matches!(err, QemuError::Spawn { .. }), "{err:?}");
        assert!(err.to_string().contains("/nonexistent/qemu-system-x86_64"));
        let err = qemu_version("true").unwrap_err();
        assert!(matches!(err, QemuError::Banner { .. }), "{err:?}");
    }

    #[test]
    fn version_of_the_installed_qemu() {
        match qemu_version(DEFAULT_QEMU) {
            Ok(v) => assert!(v >= QemuVersion::new(7, 0, 0), "{v}"),
            Err(QemuError::Spawn { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                eprintln!("skipped: {DEFAULT_QEMU} is not installed");
            }
            Err(e) => panic!("{e}"),
        }
    }
}
