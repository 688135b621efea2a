//! The stores a stage's tests run over: the single-mutex model store and the real local stores
//! of `farmap-store` (sparse memory, one file, a directory of chunk files).

use std::sync::Arc;

use farmap_core::{Geometry, Store};
use farmap_store::{DirOptions, DirStore, FileOptions, FileStore, MemoryStore};
use farmap_testkit::ModelStore;
use proptest::prelude::*;
use tempfile::TempDir;

/// Which store backs a stage under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backing {
    #[allow(dead_code)] // real_stores.rs runs over the real stores only
    Model,
    Memory,
    File,
    Dir,
}

/// Any backing, for proptest cases.
#[allow(dead_code)] // real_stores.rs draws none
pub fn backing() -> impl Strategy<Value = Backing> {
    prop_oneof![
        Just(Backing::Model),
        Just(Backing::Memory),
        Just(Backing::File),
        Just(Backing::Dir),
    ]
}

/// A new, empty store of geometry `g`; the `TempDir` (file and dir stores) must outlive it.
pub fn new_store(kind: Backing, g: Geometry) -> (Arc<dyn Store>, Option<TempDir>) {
    let dir = || TempDir::new().expect("a temporary directory");
    match kind {
        Backing::Model => (Arc::new(ModelStore::new(g)), None),
        Backing::Memory => (Arc::new(MemoryStore::new(g)), None),
        Backing::File => {
            let tmp = dir();
            let opts = FileOptions {
                size: Some(g.size()),
                chunk_size: g.chunk_size(),
                read_only: false,
            };
            let store = FileStore::open(&tmp.path().join("region"), opts).expect("a file store");
            (Arc::new(store), Some(tmp))
        }
        Backing::Dir => {
            let tmp = dir();
            let opts = DirOptions {
                size: Some(g.size()),
                chunk_size: Some(g.chunk_size()),
                ..DirOptions::default()
            };
            let store = DirStore::open(&tmp.path().join("region"), opts).expect("a dir store");
            (Arc::new(store), Some(tmp))
        }
    }
}
