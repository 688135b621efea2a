//! The budget's socket: where it is, and what is said on it (one JSON object per line,
//! each at most [`MAX_LINE`] bytes).
//!
//! - A member (`farmap run --budget NAME`) sends `{"op":"join","agent":PATH,
//!   "region_bytes":N}` and gets `{"event":"joined",...}` (its first share) or
//!   `{"event":"error","message":...}`. It keeps the connection open while it runs: the
//!   member leaves the budget when it closes.
//! - `farmap budget NAME --status` sends `{"op":"status"}` and gets `{"event":"status",...}`.

use std::io;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use farmap_migrate::agent::BudgetNote;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt};

/// The longest line either side sends (a join names a socket path: at most 108 bytes).
pub const MAX_LINE: usize = 4096;

/// The longest budget name.
const MAX_NAME: usize = 64;

/// What a peer of the coordinator asks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Hello {
    /// Join the budget (`farmap run --budget`).
    Join {
        /// The member's agent: a Unix socket owned by the member's user.
        agent: PathBuf,
        /// The member's heap size (`--heap-max`): no share is larger.
        #[serde(default)]
        region_bytes: u64,
    },
    /// List the members and their shares.
    Status,
}

/// What the coordinator answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Answer {
    /// Joined: the first share.
    Joined {
        /// The budget, the share and why.
        note: BudgetNote,
    },
    /// The members.
    Status(Status),
    /// Refused.
    Error {
        /// Why.
        message: String,
    },
}

/// A budget's members and their shares.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Status {
    /// The budget's name.
    pub name: String,
    /// What the members share.
    pub total_bytes: u64,
    /// The least share.
    pub floor_bytes: u64,
    /// How often the shares are divided again.
    pub interval_ms: u64,
    /// The members, oldest first.
    pub members: Vec<MemberStatus>,
}

/// One member, as the coordinator last saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemberStatus {
    /// The member's process (`farmap run`), from the socket's credentials.
    pub pid: Option<u32>,
    /// Its agent.
    pub agent: PathBuf,
    /// Its share.
    pub share_bytes: u64,
    /// Why (see `farmap budget --help`).
    pub reason: String,
    /// Its bound, as its agent last said (`None` until its program's heap is served).
    pub limit_bytes: Option<u64>,
    /// Held locally.
    pub resident_bytes: u64,
    /// Touched since the pager's clock last passed it.
    pub referenced_bytes: u64,
    /// Faults per second, smoothed.
    pub faults_per_sec: f64,
    /// Consecutive intervals without faults.
    pub idle_intervals: u32,
}

/// Reads one line of at most [`MAX_LINE`] bytes; `Ok(None)` at the end of the stream.
pub async fn read_line<R: AsyncBufRead + Unpin>(r: &mut R) -> io::Result<Option<String>> {
    let mut buf = Vec::new();
    let n = (&mut *r)
        .take(MAX_LINE as u64 + 1)
        .read_until(b'\n', &mut buf)
        .await?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() != Some(&b'\n') {
        return Err(if buf.len() > MAX_LINE {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a line longer than {MAX_LINE} bytes"),
            )
        } else {
            io::ErrorKind::UnexpectedEof.into()
        });
    }
    buf.pop();
    String::from_utf8(buf)
        .map(Some)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "a line not in UTF-8"))
}

/// One line of `value`.
pub fn line<T: Serialize>(value: &T) -> Vec<u8> {
    let mut l = serde_json::to_vec(value).expect("budget messages serialize");
    l.push(b'\n');
    l
}

/// The coordinator's socket for budget `name`: `name` itself if it has a `/` (a path),
/// else `NAME.sock` in [`default_dir`].
pub fn socket_path(name: &str) -> anyhow::Result<PathBuf> {
    if name.contains('/') {
        return Ok(PathBuf::from(name));
    }
    check_name(name)?;
    Ok(default_dir()?.join(format!("{name}.sock")))
}

/// The name shown for a budget: its file name without `.sock` when given as a path.
pub fn display_name(name: &str) -> String {
    match name.contains('/') {
        true => Path::new(name)
            .file_stem()
            .map_or_else(|| name.to_owned(), |s| s.to_string_lossy().into_owned()),
        false => name.to_owned(),
    }
}

fn check_name(name: &str) -> anyhow::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if !ok {
        bail!(
            "{name:?} is not a budget name: 1 to {MAX_NAME} letters, digits, '.', '_' or '-', \
             not starting with '.' (or a socket path, with a '/')"
        );
    }
    Ok(())
}

/// Where budgets' sockets are: `$XDG_RUNTIME_DIR/farmap/budget`, else
/// `/run/farmap/budget` for root.
pub fn default_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute() && p.is_dir())
    {
        return Ok(dir.join("farmap/budget"));
    }
    if rustix::process::geteuid().is_root() {
        return Ok(PathBuf::from("/run/farmap/budget"));
    }
    bail!("$XDG_RUNTIME_DIR is not set: name the budget's socket by its path (with a '/')")
}

/// Creates the directory of a coordinator's socket (mode 0700) if it is missing, and
/// checks that it is this user's and no one else's: nobody else may put a socket there.
pub fn private_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("creating {}", dir.display()))?;
    }
    let meta = std::fs::symlink_metadata(dir).with_context(|| format!("{}", dir.display()))?;
    let me = rustix::process::geteuid().as_raw();
    if !meta.is_dir() || meta.uid() != me || meta.mode() & 0o022 != 0 {
        bail!(
            "{} must be a directory of this user that no one else can write (it holds the \
             budget's socket)",
            dir.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_and_paths_kept() {
        assert_eq!(
            socket_path("/tmp/b/web.sock").unwrap(),
            PathBuf::from("/tmp/b/web.sock")
        );
        assert_eq!(display_name("/tmp/b/web.sock"), "web");
        assert_eq!(display_name("web"), "web");
        for bad in ["", ".hidden", "a b", "x;y", &"n".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        check_name("web-1.prod_a").unwrap();
    }

    #[test]
    fn messages_have_a_stable_form() {
        let j: Hello =
            serde_json::from_str(r#"{"op":"join","agent":"/run/a.sock","region_bytes":4096}"#)
                .unwrap();
        assert_eq!(
            j,
            Hello::Join {
                agent: "/run/a.sock".into(),
                region_bytes: 4096
            }
        );
        assert_eq!(
            serde_json::from_str::<Hello>(r#"{"op":"status"}"#).unwrap(),
            Hello::Status
        );
        for bad in [
            r#"{"op":"join"}"#,
            r#"{"op":"join","agent":"/a","extra":1}"#,
            r#"{"op":"leave"}"#,
            r#"[]"#,
        ] {
            assert!(serde_json::from_str::<Hello>(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn lines_are_capped() {
        let long = vec![b'a'; MAX_LINE + 10];
        let mut r = tokio::io::BufReader::new(&long[..]);
        let e = read_line(&mut r).await.unwrap_err();
        assert!(e.to_string().contains("longer"), "{e}");
        let mut r = tokio::io::BufReader::new(&b"{\"op\":\"status\"}\nrest"[..]);
        assert_eq!(
            read_line(&mut r).await.unwrap().as_deref(),
            Some(r#"{"op":"status"}"#)
        );
        assert!(read_line(&mut r).await.is_err(), "a line cut short");
        let mut r = tokio::io::BufReader::new(&b""[..]);
        assert_eq!(read_line(&mut r).await.unwrap(), None);
    }
}
