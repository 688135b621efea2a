//! A pager for the paging module's unit tests: over two mappings of this process (a region
//! and a staging area, neither registered with a userfaultfd: the tests drive its states),
//! moving pages through a reaper of this process that nobody answers, so that staged chunks
//! come back by copy.

use std::sync::Arc;
use std::time::Duration;

use farmap_core::{ChunkIdx, Geometry};

use super::state::St;
use super::{trash_len, Pager, PagerParts};
use crate::mapping::OwnedMapping;
use crate::memory::{Events, PushRead, PushReads};
use crate::options::{Prefetch, RemoveMeans};
use crate::pagemap::Pagemap;
use crate::space::{Area, Moves};
use crate::uffd::{Uffd, UffdRange};

/// The chunk size (one page) and the chunks of a test pager.
pub(super) const PAGE: usize = 4096;
pub(super) const CHUNKS: u64 = 4;

/// A test pager, with its region and staging area.
pub(super) struct Fixture {
    pub pager: Pager,
    pub region: OwnedMapping,
    pub staging: OwnedMapping,
}

/// A pager (see the module docs) whose removed chunks mean `remove`, prefetching
/// `prefetch`; chunk 1 staged, its slot full of 0xab, the others remote. `None`: skipped.
pub(super) fn pager(test: &str, remove: RemoveMeans, prefetch: Prefetch) -> Option<Fixture> {
    let uffd = match Uffd::open(0) {
        Ok(u) => Arc::new(u),
        Err(e) => {
            farmap_testkit::skip(test, format!("userfaultfd: {e}"));
            return None;
        }
    };
    let pid = std::process::id();
    let (space, _peer) =
        crate::foreign::testing::space_of(test, pid, 0, Duration::from_millis(10))?;
    let geometry = Geometry::new(CHUNKS * PAGE as u64, PAGE as u64).unwrap();
    let len = CHUNKS as usize * PAGE;
    let region = OwnedMapping::new(len, None).unwrap();
    let staging = OwnedMapping::new(len + trash_len(geometry), None).unwrap();
    staging.slice().fill(PAGE, PAGE, 0xab).unwrap();
    let pager = Pager::new(PagerParts {
        region: UffdRange::new(uffd.clone(), region.addr(), len),
        staging: UffdRange::new(uffd, staging.addr(), len),
        staging_map: Area::Local(staging.shared()),
        moves: Moves::Reaper(Arc::new(space)),
        events: Arc::new(Events::default()),
        geometry,
        limit: CHUNKS,
        min_free: Some(1),
        fresh: false,
        prefetch,
        region_counters: Default::default(),
        pagemap: Pagemap::open_self().unwrap(),
        remove,
    });
    {
        let mut st = pager.state.lock();
        st.chunk[1] = St::Staged;
        st.slot_busy[1] = true;
        st.n_staged = 1;
        st.resident = 1;
        st.stage_seq = 1;
        st.stage_id[1] = 1;
        st.staged.push_back((1, 1));
    }
    Some(Fixture {
        pager,
        region,
        staging,
    })
}

/// Where a push would read chunk `i` now (a pin taken is given back).
pub(super) fn push_read(pager: &Pager, i: u64) -> PushRead {
    let mut buf = vec![0u8; PAGE];
    let r = PushReads::read_for_push(pager, ChunkIdx(i), &mut buf);
    if r == PushRead::Pinned {
        PushReads::unpin(pager, ChunkIdx(i));
    }
    r
}
