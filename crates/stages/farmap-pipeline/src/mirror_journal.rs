//! [`Journal`]: what a [`Mirrored`](crate::Mirrored) stage owes its stores, kept on disk, so
//! that a process that stops while the primary is down (or the mirror missed writes) leaves
//! the next one knowing which chunks to resync and which to refuse.
//!
//! The file is a list of 9-byte entries: a tag (`P`: the primary must be sent this chunk
//! before it serves reads; `M`: the mirror missed this chunk's last write) and the chunk
//! index (u64, little-endian). New entries are appended and synced before the write that
//! made them is acknowledged; entries that no longer hold are dropped by rewriting the file
//! whole (a temporary file, synced, renamed over it). A torn last entry (a crash while
//! appending) is ignored: its write was not acknowledged.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use farmap_core::{ErrorKind, StoreError, StoreResult};

const ENTRY: usize = 9;
/// The primary owes this chunk (resync it from the mirror).
pub(crate) const PRIMARY: u8 = b'P';
/// The mirror missed this chunk.
pub(crate) const MIRROR: u8 = b'M';

/// A mirrored stage's journal file.
#[derive(Debug)]
pub(crate) struct Journal {
    path: PathBuf,
    /// Opened (and created, with its directory) by the first append.
    file: Option<File>,
}

/// What a journal held when opened.
#[derive(Debug, Default)]
pub(crate) struct Owed {
    pub(crate) to_resync: BTreeSet<u64>,
    pub(crate) mirror_missing: BTreeSet<u64>,
}

fn io_error(what: String) -> impl FnOnce(std::io::Error) -> StoreError {
    move |e| StoreError::new(ErrorKind::Io, what).with_source(e)
}

impl Journal {
    /// The journal at `path`, and what it owes (nothing when there is no file: it is made
    /// by the first entry).
    pub(crate) fn open(path: &Path) -> StoreResult<(Journal, Owed)> {
        let what = || format!("the mirror journal {}", path.display());
        let mut owed = Owed::default();
        let mut file = match OpenOptions::new().read(true).append(true).open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let journal = Journal {
                    path: path.to_owned(),
                    file: None,
                };
                return Ok((journal, owed));
            }
            Err(e) => return Err(io_error(format!("opening {}", what()))(e)),
        };
        let mut raw = Vec::new();
        file.read_to_end(&mut raw)
            .map_err(io_error(format!("reading {}", what())))?;
        let whole = raw.len() - raw.len() % ENTRY;
        if whole < raw.len() {
            // A torn last entry: its write was never acknowledged.
            file.set_len(whole as u64)
                .map_err(io_error(format!("truncating {}", what())))?;
        }
        for e in raw[..whole].chunks_exact(ENTRY) {
            let idx = u64::from_le_bytes(e[1..].try_into().expect("8 bytes"));
            match e[0] {
                PRIMARY => owed.to_resync.insert(idx),
                MIRROR => owed.mirror_missing.insert(idx),
                tag => {
                    return Err(StoreError::new(
                        ErrorKind::Corrupt,
                        format!(
                            "{} has an entry tagged {tag:#04x}: not a mirror journal",
                            what()
                        ),
                    ))
                }
            };
        }
        let journal = Journal {
            path: path.to_owned(),
            file: Some(file),
        };
        Ok((journal, owed))
    }

    fn file(&mut self) -> StoreResult<&mut File> {
        if self.file.is_none() {
            if let Some(dir) = self.path.parent() {
                std::fs::create_dir_all(dir)
                    .map_err(io_error(format!("creating {}", dir.display())))?;
            }
            let f = OpenOptions::new()
                .read(true)
                .append(true)
                .create(true)
                .open(&self.path)
                .map_err(io_error(format!(
                    "creating the mirror journal {}",
                    self.path.display()
                )))?;
            self.file = Some(f);
        }
        Ok(self.file.as_mut().expect("opened above"))
    }

    /// Appends `entries` and syncs them.
    pub(crate) fn append(&mut self, entries: &[(u8, u64)]) -> StoreResult<()> {
        let mut buf = Vec::with_capacity(entries.len() * ENTRY);
        for (tag, idx) in entries {
            buf.push(*tag);
            buf.extend_from_slice(&idx.to_le_bytes());
        }
        let what = format!("the mirror journal {}", self.path.display());
        let file = self.file()?;
        file.write_all(&buf)
            .map_err(io_error(format!("appending to {what}")))?;
        file.sync_data()
            .map_err(io_error(format!("syncing {what}")))
    }

    /// Replaces the file's entries with `owed` (an empty journal is removed).
    pub(crate) fn rewrite(&mut self, owed: &Owed) -> StoreResult<()> {
        let what = || format!("the mirror journal {}", self.path.display());
        if owed.to_resync.is_empty() && owed.mirror_missing.is_empty() {
            if let Some(f) = self.file.take() {
                f.set_len(0)
                    .and_then(|()| f.sync_data())
                    .map_err(io_error(format!("emptying {}", what())))?;
            }
            return match std::fs::remove_file(&self.path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(io_error(format!("removing {}", what()))(e)),
            };
        }
        let tmp = self.path.with_extension("journal.new");
        let mut buf = Vec::new();
        for (tag, set) in [(PRIMARY, &owed.to_resync), (MIRROR, &owed.mirror_missing)] {
            for idx in set {
                buf.push(tag);
                buf.extend_from_slice(&idx.to_le_bytes());
            }
        }
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(io_error(format!("creating {}", dir.display())))?;
        }
        let written = (|| {
            let mut f = File::create(&tmp)?;
            f.write_all(&buf)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &self.path)?;
            if let Some(dir) = self.path.parent() {
                File::open(dir)?.sync_all()?;
            }
            OpenOptions::new().append(true).read(true).open(&self.path)
        })();
        self.file = Some(written.map_err(io_error(format!("rewriting {}", what())))?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_survive_a_reopen_and_a_rewrite_drops_what_no_longer_holds() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state/m.journal");
        let (mut j, owed) = Journal::open(&path).unwrap();
        assert!(owed.to_resync.is_empty() && owed.mirror_missing.is_empty());
        j.append(&[(PRIMARY, 3), (PRIMARY, 9), (MIRROR, 4)])
            .unwrap();
        drop(j);
        // A torn entry at the end (a crash while appending) is ignored.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(&[PRIMARY, 1, 2]).unwrap();
        drop(f);
        let (mut j, owed) = Journal::open(&path).unwrap();
        assert_eq!(owed.to_resync, BTreeSet::from([3, 9]));
        assert_eq!(owed.mirror_missing, BTreeSet::from([4]));
        let mut now = Owed::default();
        now.to_resync.insert(9);
        j.rewrite(&now).unwrap();
        j.append(&[(MIRROR, 5)]).unwrap();
        drop(j);
        let (mut j, owed) = Journal::open(&path).unwrap();
        assert_eq!(owed.to_resync, BTreeSet::from([9]));
        assert_eq!(owed.mirror_missing, BTreeSet::from([5]));
        j.rewrite(&Owed::default()).unwrap();
        assert!(!path.exists(), "an empty journal is removed");
        std::fs::write(&path, [b'X'; 9]).unwrap();
        assert_eq!(Journal::open(&path).unwrap_err().kind(), ErrorKind::Corrupt);
    }
}
