//! The system side of a mount: finding what is mounted where (`/proc/self/mountinfo`),
//! stale mounts, unmounting, and the kernel knobs for 1 MiB requests.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use rustix::mount::{unmount, UnmountFlags};

/// One line of `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountInfo {
    /// The mount point.
    pub mount_point: PathBuf,
    /// The file system type (`fuse.farmap` for a farmap mount).
    pub fs_type: String,
    /// The mount's source (`farmap:PID` for a farmap mount: the serving process).
    pub source: String,
    /// Device number (`major:minor`), which names the mount's `/sys/class/bdi/` entry.
    pub device: String,
}

impl MountInfo {
    /// The serving process of a farmap mount (from its source, `farmap:PID`).
    pub fn farmap_pid(&self) -> Option<u32> {
        if self.fs_type != "fuse.farmap" {
            return None;
        }
        self.source.strip_prefix("farmap:")?.parse().ok()
    }
}

/// Undoes mountinfo's octal escapes (`\040` for a space, `\011`, `\012`, `\134`).
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) if b[i] == b'\\' => {
                let v = d.iter().fold(0u32, |v, c| v * 8 + u32::from(c - b'0'));
                out.push(v as u8);
                i += 4;
            }
            _ => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_line(line: &str) -> Option<MountInfo> {
    let (left, right) = line.split_once(" - ")?;
    let left: Vec<&str> = left.split(' ').collect();
    let mut right = right.split(' ');
    Some(MountInfo {
        device: left.get(2)?.to_string(),
        mount_point: PathBuf::from(unescape(left.get(4)?)),
        fs_type: right.next()?.to_string(),
        source: unescape(right.next()?),
    })
}

/// `dir` made absolute without following its last component (which may be a dead mount that
/// cannot be stat'ed).
fn absolute(dir: &Path) -> io::Result<PathBuf> {
    let dir = std::path::absolute(dir)?;
    match (dir.parent(), dir.file_name()) {
        (Some(parent), Some(name)) => Ok(parent.canonicalize()?.join(name)),
        _ => Ok(dir),
    }
}

/// What is mounted at `dir` (the topmost mount), from `/proc/self/mountinfo`.
pub fn find_mount(dir: &Path) -> io::Result<Option<MountInfo>> {
    let dir = absolute(dir)?;
    let table = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(table
        .lines()
        .filter_map(parse_line)
        .rfind(|m| m.mount_point == dir))
}

/// Whether `dir` is a mount point whose server is gone (`ENOTCONN`). Asks with `statfs`,
/// which a FUSE mount always sends to its server (a `stat` may be answered from the cache).
pub fn is_stale(dir: &Path) -> bool {
    matches!(rustix::fs::statfs(dir), Err(rustix::io::Errno::NOTCONN))
}

/// Lazily unmounts `dir` if its FUSE server died (`ENOTCONN`); returns whether it did.
pub fn cleanup_stale(dir: &Path) -> io::Result<bool> {
    if !is_stale(dir) {
        return Ok(false);
    }
    unmount(dir, UnmountFlags::DETACH).map_err(io::Error::from)?;
    tracing::info!(dir = %dir.display(), "lazily unmounted a FUSE mount whose server had died");
    Ok(true)
}

/// Whether `dir` is a mount point (its device differs from its parent's).
pub(crate) fn is_mount_point(dir: &Path) -> io::Result<bool> {
    let meta = std::fs::metadata(dir)?;
    let parent = dir.join("..");
    let pmeta = std::fs::metadata(&parent)?;
    Ok(meta.dev() != pmeta.dev() || meta.ino() == pmeta.ino())
}

/// How an unmount went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unmounted {
    /// Unmounted at once.
    Clean,
    /// Programs still held the file: detached, served until they let go.
    Detached,
    /// Nothing was mounted there any more.
    Gone,
}

/// Unmounts `dir`; when it is busy, detaches it (the kernel keeps it alive for the programs
/// that hold it).
pub(crate) fn unmount_or_detach(dir: &Path) -> io::Result<Unmounted> {
    match unmount(dir, UnmountFlags::empty()) {
        Ok(()) => Ok(Unmounted::Clean),
        Err(rustix::io::Errno::BUSY) => {
            unmount(dir, UnmountFlags::DETACH).map_err(io::Error::from)?;
            Ok(Unmounted::Detached)
        }
        Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => Ok(Unmounted::Gone),
        Err(e) => Err(e.into()),
    }
}

/// The kernel's cap on a FUSE request, in pages.
const MAX_PAGES_LIMIT: &str = "/proc/sys/fs/fuse/max_pages_limit";

/// Raises `max_pages_limit` to at least `pages` (root only; new mounts only). Best effort:
/// returns what it could not do.
pub(crate) fn raise_max_pages(pages: u32) -> Result<(), String> {
    let now: u32 = std::fs::read_to_string(MAX_PAGES_LIMIT)
        .map_err(|e| format!("reading {MAX_PAGES_LIMIT}: {e}"))?
        .trim()
        .parse()
        .map_err(|e| format!("parsing {MAX_PAGES_LIMIT}: {e}"))?;
    if now >= pages {
        return Ok(());
    }
    std::fs::write(MAX_PAGES_LIMIT, pages.to_string())
        .map_err(|e| format!("raising {MAX_PAGES_LIMIT} from {now} to {pages}: {e}"))
}

/// `MemAvailable` of /proc/meminfo, in bytes.
pub(crate) fn mem_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// Sets the read-ahead of the mount whose device is `device` (`major:minor`) to `kb`.
pub(crate) fn set_read_ahead(device: &str, kb: u32) -> Result<(), String> {
    let path = format!("/sys/class/bdi/{device}/read_ahead_kb");
    std::fs::write(&path, kb.to_string()).map_err(|e| format!("writing {path}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_parse() {
        let m = parse_line(
            "90 30 0:52 / /tmp/a\\040b rw,nosuid,nodev,relatime shared:1 - fuse.farmap \
             farmap:1234 rw,user_id=0,group_id=0,max_read=1048576",
        )
        .expect("parses");
        assert_eq!(m.mount_point, PathBuf::from("/tmp/a b"));
        assert_eq!(m.fs_type, "fuse.farmap");
        assert_eq!(m.device, "0:52");
        assert_eq!(m.farmap_pid(), Some(1234));
        let other = parse_line("1 0 8:1 / / rw - ext4 /dev/sda1 rw").expect("parses");
        assert_eq!(other.farmap_pid(), None);
        assert!(parse_line("garbage").is_none());
        assert_eq!(unescape("a\\134b\\"), "a\\b\\");
    }
}
