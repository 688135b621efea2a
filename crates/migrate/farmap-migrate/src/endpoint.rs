//! What the runners move: a [`Source`] at the seeder (a live region whose writes are tracked)
//! and a [`Destination`] at the leecher (where the pages land and the application resumes).
//!
//! A userfaultfd [`Region`] is both (written pages found with PAGEMAP_SCAN; pages installed
//! with UFFDIO_COPY and discarded with madvise). Other frontends bring their own: the FUSE
//! mount tracks writes as they reach its server and lands pages in a store that serves the
//! file ([`crate::mount`]). The state machines, wire messages and runners are the same.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use farmap_core::{BoxFuture, ChunkIdx, Geometry, Store};
use farmap_net::RunReader;
use farmap_uffd::Region;

use crate::machine::{Confirm, Manifest};
use crate::msg::{Location, ManifestRun};
use crate::view::LiveView;

/// An error of a frontend's migration hooks.
pub type EndpointError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A live region at the seeder.
pub trait Source: Send + Sync + 'static {
    /// Size and chunk size.
    fn geometry(&self) -> Geometry;
    /// The unit of write tracking and of the data plane's chunks (a power of two ≥ 4096).
    fn page_size(&self) -> u32;
    /// The pages written since the last call, as ascending disjoint runs of page indices,
    /// and starts tracking anew (the first call starts tracking). Blocks (runs on a blocking
    /// thread); every write that completed before the call is either in its answer or was in
    /// an earlier one.
    fn take_dirty(&self) -> Result<Vec<Range<u64>>, EndpointError>;
    /// The data plane: a read-only store of page-sized chunks with the region's current
    /// content.
    fn data_plane(self: Arc<Self>) -> Arc<dyn Store>;
    /// What reads runs of the data plane's pages in one piece (one copy of a run out of the
    /// region, instead of one per page); `None` serves runs page by page from the data plane.
    fn run_reader(self: Arc<Self>) -> Option<Arc<dyn RunReader>> {
        None
    }
    /// The spec of a store that holds this region's chunks and that another host can open
    /// (what an instant migration needs); `None` if there is none.
    fn shared_store(&self) -> Option<String> {
        None
    }
    /// Instant migration, while the application runs: pushes what the shared store lacks for
    /// at most `budget`; `Ok(true)` if it then held everything. Blocks.
    fn push_shared(&self, _budget: Duration) -> Result<bool, EndpointError> {
        Ok(false)
    }
    /// Instant migration, before suspending (the application runs): starts no more pushes,
    /// waits for those running, and says where each chunk is as things stand. From here on
    /// only writes change that, and a chunk only ever moves from the store to the source.
    /// Blocks.
    fn draft(&self) -> Result<Manifest, EndpointError> {
        Err("this source cannot hand over through a shared store".into())
    }
    /// Instant migration, with the writers stopped: stops every push for good (the store now
    /// belongs to the destination) and says which chunks were written since the draft among
    /// those it looks at now (the ones written lately: what the downtime can afford); the
    /// others stay pending until [`confirm_rest`](Self::confirm_rest). Blocks.
    fn seal(&self) -> Result<Confirm, EndpointError> {
        Err("this source cannot hand over through a shared store".into())
    }
    /// Instant migration, after the hand-over: the same for the chunks the seal left
    /// pending (nothing is pending afterwards). Never fails: a chunk it cannot look at is
    /// placed at the source. Blocks.
    fn confirm_rest(&self) -> Confirm {
        Confirm::default()
    }
    /// An instant migration was abandoned before its hand-over: pushes resume.
    fn unseal(&self) {}
}

/// How far back an instant migration's draft takes the chunks pushed by the source's
/// rounds as written lately (looked at inside the downtime, the rest right after it).
pub const HOT_WINDOW: Duration = Duration::from_secs(2);

/// What a seal found, for the wire.
pub fn confirm_from_delta(d: farmap_pipeline::SealDelta) -> Confirm {
    Confirm {
        at_source: d.at_source,
        pending: d.pending,
    }
}

/// Builds a manifest from a push ledger: chunks pushed and not written since are in the
/// store with their record; chunks written since are at the source, listed first in the
/// ledger's order (most recently written first); chunks never pushed are taken as the store
/// has them.
pub fn manifest_from_ledger(ledger: &farmap_pipeline::PushLedger) -> Manifest {
    let n = ledger.pushed.len() as u64;
    let mut at_source = vec![false; n as usize];
    let mut runs: Vec<ManifestRun> = Vec::new();
    for c in &ledger.dirty {
        let Some(x) = at_source.get_mut(c.0 as usize) else {
            continue;
        };
        if std::mem::replace(x, true) {
            continue;
        }
        match runs.last_mut() {
            Some(r) if r.chunks.end == c.0 => r.chunks.end += 1,
            _ => runs.push(ManifestRun {
                location: Location::Source,
                chunks: c.0..c.0 + 1,
            }),
        }
    }
    let mut pushed = Vec::new();
    let first_store = runs.len();
    for i in 0..n {
        if at_source[i as usize] {
            continue;
        }
        pushed.push(ledger.pushed[i as usize].unwrap_or((0, 0)));
        let extends = runs.len() > first_store;
        match runs.last_mut() {
            Some(r) if extends && r.chunks.end == i => r.chunks.end = i + 1,
            _ => runs.push(ManifestRun {
                location: Location::Store,
                chunks: i..i + 1,
            }),
        }
    }
    Manifest { runs, pushed }
}

/// Where a migrating region lands at the leecher. Its chunks come from a
/// [`MigrationStore`](crate::MigrationStore) (pages fetched from the seeder), which the
/// destination reads through once per chunk and keeps.
pub trait Destination: Send + Sync + 'static {
    /// Size and chunk size.
    fn geometry(&self) -> Geometry;
    /// Makes `chunks` local, fetching the missing ones (and the discarded pages of the others)
    /// with `parallel` fetches in flight. Resolves when all are local, or with the first error.
    fn fetch_chunks(
        &self,
        chunks: Vec<ChunkIdx>,
        parallel: usize,
    ) -> BoxFuture<'static, Result<(), EndpointError>>;
    /// Writes `data` at `offset` (a pre-copy dirty round; the application does not run here
    /// yet). Blocks.
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), EndpointError>;
    /// Writes `chunks` (fetched from the source of an instant migration) to the store the
    /// destination lives in, so that the shared store holds them before the source is
    /// released. Blocks.
    fn push_chunks(&self, _chunks: Vec<ChunkIdx>) -> Result<(), EndpointError> {
        Err("this destination cannot push to a shared store".into())
    }
    /// Forgets pages written at the source after they were fetched: the next access to one
    /// fetches it again. Blocks.
    fn discard_pages(&self, runs: &[Range<u64>]) -> Result<(), EndpointError>;
    /// Chunks held locally.
    fn present_chunks(&self) -> u64;
    /// Whether every chunk is local.
    fn is_complete(&self) -> bool;
}

impl Source for Region {
    fn geometry(&self) -> Geometry {
        Region::geometry(self)
    }

    fn page_size(&self) -> u32 {
        u32::try_from(Region::page_size(self)).unwrap_or(u32::MAX)
    }

    /// [`Region::take_written`]: a region whose store is shared keeps pushing while it
    /// migrates, and a push round's scan must not hide a write from the migration.
    fn take_dirty(&self) -> Result<Vec<Range<u64>>, EndpointError> {
        Ok(Region::take_written(self)?.pages)
    }

    fn data_plane(self: Arc<Self>) -> Arc<dyn Store> {
        Arc::new(LiveView::new(self))
    }

    fn run_reader(self: Arc<Self>) -> Option<Arc<dyn RunReader>> {
        Some(Arc::new(LiveView::new(self)))
    }

    /// The region's store spec, unless it is a `memory:` store (which lives only in this
    /// process) or the region was opened without one.
    fn shared_store(&self) -> Option<String> {
        self.store_spec()
            .filter(|s| !s.trim_start().starts_with("memory:"))
            .map(str::to_owned)
    }

    fn push_shared(&self, budget: Duration) -> Result<bool, EndpointError> {
        Ok(self.sync_for(budget)?)
    }

    fn draft(&self) -> Result<Manifest, EndpointError> {
        Ok(manifest_from_ledger(&self.draft_pushes(HOT_WINDOW)?.ledger))
    }

    fn seal(&self) -> Result<Confirm, EndpointError> {
        Ok(confirm_from_delta(self.seal_hot_pushes()?))
    }

    fn confirm_rest(&self) -> Confirm {
        confirm_from_delta(self.seal_rest_pushes())
    }

    fn unseal(&self) {
        self.unseal_pushes();
    }
}

impl Destination for Region {
    fn geometry(&self) -> Geometry {
        Region::geometry(self)
    }

    fn fetch_chunks(
        &self,
        chunks: Vec<ChunkIdx>,
        parallel: usize,
    ) -> BoxFuture<'static, Result<(), EndpointError>> {
        let f = Region::fetch_chunks(self, chunks, parallel);
        Box::pin(async move { f.await.map_err(Into::into) })
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), EndpointError> {
        let offset = usize::try_from(offset)?;
        Ok(Region::write_at(self, offset, data)?)
    }

    fn discard_pages(&self, runs: &[Range<u64>]) -> Result<(), EndpointError> {
        Ok(Region::discard_pages(self, runs)?)
    }

    fn push_chunks(&self, chunks: Vec<ChunkIdx>) -> Result<(), EndpointError> {
        Ok(Region::push_chunks(self, chunks)?)
    }

    fn present_chunks(&self) -> u64 {
        self.stats().present_chunks
    }

    fn is_complete(&self) -> bool {
        Region::is_complete(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use farmap_core::ChunkIdx;

    #[test]
    fn a_manifest_lists_the_source_chunks_first_most_recent_first_and_every_chunk_once() {
        let mut pushed = vec![Some((1, 11)); 10];
        pushed[2] = None;
        let ledger = farmap_pipeline::PushLedger {
            pushed,
            // 7 and 8 written last, then 3 and 4 earlier.
            dirty: vec![ChunkIdx(7), ChunkIdx(8), ChunkIdx(3), ChunkIdx(4)],
        };
        let m = manifest_from_ledger(&ledger);
        let runs: Vec<(Location, std::ops::Range<u64>)> = m
            .runs
            .iter()
            .map(|r| (r.location, r.chunks.clone()))
            .collect();
        assert_eq!(
            runs,
            [
                (Location::Source, 7..9),
                (Location::Source, 3..5),
                (Location::Store, 0..3),
                (Location::Store, 5..7),
                (Location::Store, 9..10),
            ]
        );
        // One record per store chunk, in run order; never pushed: (0, 0).
        assert_eq!(
            m.pushed,
            [(1, 11), (1, 11), (0, 0), (1, 11), (1, 11), (1, 11)]
        );
        assert_eq!(crate::msg::check_manifest(&m.runs, &m.pushed, 10), Ok(()));
    }
}
