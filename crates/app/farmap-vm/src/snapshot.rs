//! A guest saved and started again through QEMU's migration stream into a file
//! (docs/design/vm.md §10).
//!
//! - With its RAM on a shared file (a farmap mount), `x-ignore-shared` keeps the RAM out of
//!   the stream: the file holds the device state only (tens of KB), and the RAM stays where
//!   the mount keeps it. A restore maps the same RAM (the mount of the saved version) and
//!   loads the device state: the guest runs at once, and its pages come on touch.
//! - Without it (anonymous RAM), the stream is the whole guest: QEMU's own save and restore,
//!   whose guest starts only once every page is in.
//!
//! QEMU 7.2 has no `file:` URI: the stream goes through `exec:cat`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::qmp::{Qmp, QmpError};

/// Why a save or a restore failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// QEMU refused or failed a step.
    #[error(transparent)]
    Qmp(#[from] QmpError),
    /// The guest is not in a state this step can start from.
    #[error("the guest is {status}, not {wanted}")]
    State {
        /// Its run state.
        status: String,
        /// What the step needs.
        wanted: &'static str,
    },
    /// A file could not be written, synced or read.
    #[error("{what} {}", path.display())]
    Io {
        /// What was done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
}

/// What a save did.
#[derive(Debug, Clone, PartialEq)]
pub struct Saved {
    /// The bytes of the state file.
    pub state_bytes: u64,
    /// From stopping the guest to QEMU's `completed`.
    pub save: Duration,
    /// The shared RAM file's sync (its store's flush), when there is one.
    pub flush: Option<Duration>,
}

/// A path as one word of `sh -c` (QEMU runs `exec:` URIs with `/bin/sh -c`).
fn sh_quote(path: &Path) -> String {
    format!("'{}'", path.to_string_lossy().replace('\'', r"'\''"))
}

/// The file a save writes before it renames it to `state`.
fn partial(state: &Path) -> PathBuf {
    let mut name = state.as_os_str().to_owned();
    name.push(".partial");
    PathBuf::from(name)
}

/// Saves the guest behind `qmp` (running or paused) into `state`, stopping it first.
///
/// - `shared_ram`: the RAM file to leave out of the stream (`x-ignore-shared`) and to sync
///   once the guest is stopped, so that its store holds what the device state refers to
///   (a `versioned:` store keeps it as a version, with the order the guest touched its
///   pages); `None` saves the whole guest into `state`.
/// - The state is written beside `state` and renamed into place once complete and synced:
///   `state` is never half a save.
/// - On success the guest stays stopped (`postmigrate`; quit it, or `cont` it to go on). On
///   a failure it runs again if it ran before, and `state` is untouched.
pub async fn save(
    qmp: &mut Qmp,
    state: &Path,
    shared_ram: Option<&Path>,
    timeout: Duration,
) -> Result<Saved, SnapshotError> {
    let status = qmp.status().await?;
    if status != "running" && status != "paused" {
        return Err(SnapshotError::State {
            status,
            wanted: "running or paused",
        });
    }
    let tmp = partial(state);
    let _ = std::fs::remove_file(&tmp);
    qmp.set_capabilities(&[("x-ignore-shared", shared_ram.is_some()), ("events", true)])
        .await?;
    let t0 = Instant::now();
    // Stopped first: the stream is then one pass over a still guest (QEMU 7.2's live pass
    // over a busy TCG guest restored a guest that crashed at once, docs/design/vm.md §2.8).
    let started = async {
        if status == "running" {
            qmp.stop().await?;
        }
        qmp.migrate(&format!("exec:cat > {}", sh_quote(&tmp))).await
    };
    let done = match started.await {
        Ok(()) => qmp.wait_migration_status(timeout, "completed").await,
        Err(e) => Err(e),
    };
    let save = t0.elapsed();
    let io = |what, path: &Path| {
        let path = path.to_path_buf();
        move |source| SnapshotError::Io { what, path, source }
    };
    let finish = async {
        done?;
        let mut flush = None;
        if let Some(ram) = shared_ram {
            let t = Instant::now();
            std::fs::File::open(ram)
                .and_then(|f| f.sync_all())
                .map_err(io("syncing the guest's RAM file", ram))?;
            flush = Some(t.elapsed());
        }
        let file = std::fs::File::open(&tmp).map_err(io("opening the saved state", &tmp))?;
        file.sync_all()
            .map_err(io("syncing the saved state", &tmp))?;
        let state_bytes = file
            .metadata()
            .map_err(io("reading the size of", &tmp))?
            .len();
        std::fs::rename(&tmp, state).map_err(io("renaming the saved state to", state))?;
        if let Some(dir) = state.parent().filter(|d| !d.as_os_str().is_empty()) {
            let _ = std::fs::File::open(dir).and_then(|d| d.sync_all());
        }
        Ok(Saved {
            state_bytes,
            save,
            flush,
        })
    };
    match finish.await {
        Ok(saved) => Ok(saved),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            // A failed migration restarts the guest by itself; a completed one left it
            // stopped, and it was running.
            if status == "running" && qmp.status().await.is_ok_and(|s| s != "running") {
                let _ = qmp.cont().await;
            }
            Err(e)
        }
    }
}

/// Starts the guest saved in `state` in the QEMU behind `qmp`, which was started with
/// `-incoming defer` and the same command line as the saved one but for its paths (with
/// `shared_ram`, its RAM is the file holding the saved RAM, e.g. a farmap mount of the
/// saved version). Returns once the guest runs: the time from `migrate-incoming` to then.
pub async fn restore(
    qmp: &mut Qmp,
    state: &Path,
    shared_ram: bool,
    timeout: Duration,
) -> Result<Duration, SnapshotError> {
    let status = qmp.status().await?;
    if status != "inmigrate" {
        return Err(SnapshotError::State {
            status,
            wanted: "inmigrate (QEMU started with -incoming defer)",
        });
    }
    std::fs::metadata(state).map_err(|source| SnapshotError::Io {
        what: "reading the saved state",
        path: state.to_path_buf(),
        source,
    })?;
    qmp.set_capabilities(&[("x-ignore-shared", shared_ram), ("events", true)])
        .await?;
    let t0 = Instant::now();
    qmp.migrate_incoming(&format!("exec:cat {}", sh_quote(state)))
        .await?;
    // The saved guest was stopped: once loaded it is `paused`, and runs on `cont`.
    let deadline = Instant::now() + timeout;
    loop {
        match qmp.status().await?.as_str() {
            "inmigrate" if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            "paused" => qmp.cont().await?,
            "running" => return Ok(t0.elapsed()),
            status => {
                return Err(SnapshotError::State {
                    status: status.to_owned(),
                    wanted: "running once its state is loaded (within the timeout)",
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_one_shell_word_whatever_they_hold() {
        assert_eq!(sh_quote(Path::new("/a b/c")), "'/a b/c'");
        assert_eq!(sh_quote(Path::new("/it's;rm -rf")), r"'/it'\''s;rm -rf'");
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "printf %s {}",
                sh_quote(Path::new("x'$(id)`y` \"z\""))
            ))
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "x'$(id)`y` \"z\"");
    }

    #[test]
    fn a_save_is_written_beside_its_name() {
        assert_eq!(
            partial(Path::new("/s/vm1.state")),
            Path::new("/s/vm1.state.partial")
        );
    }
}
