//! [`Objects`] on this machine: [`DirObjects`] (one file per object under a directory) and
//! [`MemoryObjects`] (a map, for tests and benchmarks).

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use farmap_core::{check_key, BoxFuture, Objects, StoreError, StoreResult};
use parking_lot::Mutex;

use crate::blocking::blocking;

/// Where a [`DirObjects`] writes an object before linking it into place.
const TEMP_DIR: &str = ".tmp";

/// Objects as files under a directory: `KEY` is the file `ROOT/KEY`.
///
/// An object is written to a temporary file, synced, then hard-linked to its name: the link
/// fails when the name exists, which makes [`create`](Objects::create) atomic between
/// processes (and hosts sharing the directory over a file system with POSIX link
/// semantics), and a crash leaves the object whole or absent. The directory entry is synced
/// before `create` returns.
#[derive(Debug, Clone)]
pub struct DirObjects {
    root: Arc<PathBuf>,
}

impl DirObjects {
    /// Objects under `root`, created (with its parents) when missing.
    pub fn open(root: impl Into<PathBuf>) -> StoreResult<Self> {
        let root = root.into();
        let err = |e| {
            StoreError::io(
                format!("cannot create the object directory {}", root.display()),
                e,
            )
        };
        if !root.exists() {
            fs::create_dir_all(&root).map_err(err)?;
            if let Some(parent) = root.parent().filter(|p| !p.as_os_str().is_empty()) {
                sync_dir(parent).map_err(err)?;
            }
        }
        fs::create_dir_all(root.join(TEMP_DIR)).map_err(err)?;
        Ok(Self {
            root: Arc::new(root),
        })
    }

    fn path(&self, key: &str) -> StoreResult<PathBuf> {
        check_key(key)?;
        Ok(self.root.join(key))
    }
}

/// A name for a temporary file no other writer of this process or another uses.
fn temp_name() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{}-{}-{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Creates `dir` and its missing parents under `root`, each made durable in its parent (a
/// crash must not take away a folder that holds an acknowledged object).
fn create_dirs(root: &Path, dir: &Path) -> io::Result<()> {
    let mut missing = Vec::new();
    let mut d = dir;
    while d != root && !d.exists() {
        missing.push(d);
        match d.parent() {
            Some(p) => d = p,
            None => break,
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    fs::create_dir_all(dir)?;
    for created in missing {
        if let Some(parent) = created.parent() {
            sync_dir(parent)?;
        }
    }
    Ok(())
}

fn create_file(root: &Path, path: &Path, data: &[u8]) -> io::Result<bool> {
    let parent = path.parent().unwrap_or(root);
    create_dirs(root, parent)?;
    let temp = root.join(TEMP_DIR).join(temp_name());
    let written = (|| {
        let mut f = File::create_new(&temp)?;
        f.write_all(data)?;
        f.sync_all()
    })();
    let linked = written.and_then(|()| fs::hard_link(&temp, path));
    let _ = fs::remove_file(&temp);
    match linked {
        Ok(()) => {
            sync_dir(parent)?;
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    }
}

impl Objects for DirObjects {
    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<Option<Bytes>>> {
        Box::pin(async move {
            let path = self.path(key)?;
            blocking(move || match fs::read(&path) {
                Ok(data) => Ok(Some(Bytes::from(data))),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(StoreError::io(format!("cannot read {}", path.display()), e)),
            })
            .await
        })
    }

    fn exists<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(async move {
            let path = self.path(key)?;
            blocking(move || match fs::symlink_metadata(&path) {
                Ok(m) => Ok(m.is_file()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
                Err(e) => Err(StoreError::io(format!("cannot stat {}", path.display()), e)),
            })
            .await
        })
    }

    fn create<'a>(&'a self, key: &'a str, data: Bytes) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(async move {
            let path = self.path(key)?;
            let root = self.root.clone();
            blocking(move || {
                create_file(&root, &path, &data)
                    .map_err(|e| StoreError::io(format!("cannot create {}", path.display()), e))
            })
            .await
        })
    }

    fn list<'a>(&'a self, dir: &'a str) -> BoxFuture<'a, StoreResult<Vec<String>>> {
        Box::pin(async move {
            let path = self.path(dir)?;
            blocking(move || {
                let entries = match fs::read_dir(&path) {
                    Ok(e) => e,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
                    Err(e) => {
                        return Err(StoreError::io(format!("cannot list {}", path.display()), e))
                    }
                };
                let mut names = Vec::new();
                for entry in entries {
                    let entry = entry.map_err(|e| {
                        StoreError::io(format!("cannot list {}", path.display()), e)
                    })?;
                    if let Some(name) = entry.file_name().to_str() {
                        if check_key(name).is_ok() {
                            names.push(name.to_owned());
                        }
                    }
                }
                names.sort();
                Ok(names)
            })
            .await
        })
    }

    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(async move {
            let path = self.path(key)?;
            blocking(move || match fs::remove_file(&path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(StoreError::io(
                    format!("cannot remove {}", path.display()),
                    e,
                )),
            })
            .await
        })
    }

    fn location(&self) -> String {
        format!("dir:{}", self.root.display())
    }
}

/// Objects in this process's memory: gone with the last clone.
#[derive(Debug, Clone, Default)]
pub struct MemoryObjects {
    map: Arc<Mutex<BTreeMap<String, Bytes>>>,
}

impl MemoryObjects {
    /// No objects.
    pub fn new() -> Self {
        Self::default()
    }

    /// The bytes of every object, keys included.
    pub fn bytes(&self) -> u64 {
        self.map
            .lock()
            .iter()
            .map(|(k, v)| (k.len() + v.len()) as u64)
            .sum()
    }
}

impl Objects for MemoryObjects {
    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<Option<Bytes>>> {
        Box::pin(async move {
            check_key(key)?;
            Ok(self.map.lock().get(key).cloned())
        })
    }

    fn create<'a>(&'a self, key: &'a str, data: Bytes) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(async move {
            check_key(key)?;
            let mut map = self.map.lock();
            if map.contains_key(key) {
                return Ok(false);
            }
            map.insert(key.to_owned(), data);
            Ok(true)
        })
    }

    fn list<'a>(&'a self, dir: &'a str) -> BoxFuture<'a, StoreResult<Vec<String>>> {
        Box::pin(async move {
            check_key(dir)?;
            let prefix = format!("{dir}/");
            let map = self.map.lock();
            let mut names: Vec<String> = map
                .range(prefix.clone()..)
                .take_while(|(k, _)| k.starts_with(&prefix))
                .filter_map(|(k, _)| k[prefix.len()..].split('/').next().map(str::to_owned))
                .collect();
            names.dedup();
            Ok(names)
        })
    }

    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(async move {
            check_key(key)?;
            self.map.lock().remove(key);
            Ok(())
        })
    }

    fn location(&self) -> String {
        "memory:".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dir_objects_keep_the_contract() {
        let dir = tempfile::tempdir().unwrap();
        let o = DirObjects::open(dir.path().join("o")).unwrap();
        farmap_testkit::check_objects_contract(Arc::new(o)).await;
        assert_eq!(
            fs::read_dir(dir.path().join("o").join(TEMP_DIR))
                .unwrap()
                .count(),
            0
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn memory_objects_keep_the_contract() {
        farmap_testkit::check_objects_contract(Arc::new(MemoryObjects::new())).await;
    }
}
