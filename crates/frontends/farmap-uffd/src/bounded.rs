//! [`BoundedRegion`]: what a region with bounded local memory offers whoever controls the
//! bound (an application's agent, `farmap region limit` and `stats`), whether this process
//! maps it ([`Region`]) or serves another's ([`ForeignRegion`]).

use farmap_core::Geometry;

use crate::foreign::ForeignRegion;
use crate::options::LocalLimit;
use crate::stats::RegionStats;
use crate::{Region, RegionError};

/// A region whose local memory may be bounded (see the module docs).
pub trait BoundedRegion: Send + Sync {
    /// The region's shape.
    fn geometry(&self) -> Geometry;
    /// The page size.
    fn page_size(&self) -> usize;
    /// Its counters (with the paging block when bounded).
    fn stats(&self) -> RegionStats;
    /// Pages present now: `(in the region, staged)`; `None` when not bounded.
    fn local_pages(&self) -> Option<Result<(u64, u64), RegionError>>;
    /// Mapped chunks touched since the eviction clock last passed them (the working set as
    /// the pager sees it); `None` when not bounded. Takes time in proportion to the
    /// region's chunks.
    fn referenced_chunks(&self) -> Option<u64>;
    /// Changes the bound; `false` when the region has none.
    fn set_local_max(&self, limit: LocalLimit) -> bool;
    /// Whether its local memory is bounded.
    fn is_paged(&self) -> bool;
}

impl BoundedRegion for Region {
    fn geometry(&self) -> Geometry {
        Region::geometry(self)
    }
    fn page_size(&self) -> usize {
        Region::page_size(self)
    }
    fn stats(&self) -> RegionStats {
        Region::stats(self)
    }
    fn local_pages(&self) -> Option<Result<(u64, u64), RegionError>> {
        Region::local_pages(self)
    }
    fn referenced_chunks(&self) -> Option<u64> {
        Region::referenced_chunks(self)
    }
    fn set_local_max(&self, limit: LocalLimit) -> bool {
        Region::set_local_max(self, limit)
    }
    fn is_paged(&self) -> bool {
        Region::is_paged(self)
    }
}

impl BoundedRegion for ForeignRegion {
    fn geometry(&self) -> Geometry {
        ForeignRegion::geometry(self)
    }
    fn page_size(&self) -> usize {
        ForeignRegion::page_size(self)
    }
    fn stats(&self) -> RegionStats {
        ForeignRegion::stats(self)
    }
    fn local_pages(&self) -> Option<Result<(u64, u64), RegionError>> {
        ForeignRegion::local_pages(self)
    }
    fn referenced_chunks(&self) -> Option<u64> {
        Some(ForeignRegion::referenced_chunks(self))
    }
    fn set_local_max(&self, limit: LocalLimit) -> bool {
        ForeignRegion::set_local_max(self, limit)
    }
    fn is_paged(&self) -> bool {
        ForeignRegion::is_paged(self)
    }
}
