//! The agent's local-memory requests: change the bound on the local memory of the region
//! the application holds ([`Request::SetLocalMax`](super::Request::SetLocalMax)), and report
//! its paging state ([`Request::PagingState`](super::Request::PagingState)).
//!
//! Both answer with one line, [`Reply::Paging`](super::Reply::Paging) or
//! [`Reply::Error`](super::Reply::Error) (kind `refused`), and
//! never wait for a migration: they do not take the agent's migration lock. A request is
//! validated completely before anything changes: a refused one changes nothing.
//!
//! Only a region opened with a bound (`RegionOptions::paging`) can be paged; a bound cannot
//! be added to a region at run time, nor removed (the largest limit is the whole region).

use std::sync::Arc;
use std::time::{Duration, Instant};

use farmap_uffd::{BoundedRegion, LocalLimit};
use serde::{Deserialize, Serialize};

/// The longest a [`SetLocalMaxRequest`] may ask to wait for resident memory to settle.
pub const MAX_SETTLE_WAIT: Duration = Duration::from_secs(60);

/// How often a waiting [`SetLocalMaxRequest`] looks at the region's counters.
const SETTLE_POLL: Duration = Duration::from_millis(10);

/// A bound on a region's local memory, as a controller sends it: `{"bytes":N}` or
/// `{"percent":P}`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LocalMax {
    /// At most this many bytes (rounded down to whole chunks, at least one chunk).
    Bytes(u64),
    /// At most this percentage of the region's size, in (0, 100].
    Percent(f64),
}

/// Why a [`LocalMax`] is not a limit.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum LocalMaxError {
    /// A limit of zero bytes.
    #[error("a local-memory limit of 0 bytes would hold nothing; the least is one chunk")]
    Zero,
    /// A percentage outside (0, 100].
    #[error("a local-memory limit of {0}% is not a share of the region: it must be in (0, 100]")]
    Percent(f64),
}

impl LocalMax {
    /// The limit, checked: a positive number of bytes, or a percentage in (0, 100].
    pub fn limit(self) -> Result<LocalLimit, LocalMaxError> {
        match self {
            LocalMax::Bytes(0) => Err(LocalMaxError::Zero),
            LocalMax::Bytes(b) => Ok(LocalLimit::Bytes(b)),
            LocalMax::Percent(p) if p > 0.0 && p <= 100.0 => Ok(LocalLimit::Percent(p)),
            LocalMax::Percent(p) => Err(LocalMaxError::Percent(p)),
        }
    }
}

impl From<LocalLimit> for LocalMax {
    fn from(l: LocalLimit) -> Self {
        match l {
            LocalLimit::Bytes(b) => LocalMax::Bytes(b),
            LocalLimit::Percent(p) => LocalMax::Percent(p),
        }
    }
}

/// Change the bound on the local memory of the region held here.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SetLocalMaxRequest {
    /// The new bound.
    pub local_max: LocalMax,
    /// How long to wait, in ms, for resident memory to come down to the new limit (plus
    /// `min_free`) before replying; 0 replies at once. At most [`MAX_SETTLE_WAIT`].
    #[serde(default)]
    pub wait_ms: u64,
    /// Who chose the bound: a budget shared with other programs (`farmap budget`), which
    /// the agent keeps and shows in its reports. Left out by people (`farmap region limit`):
    /// the note kept stays, though the bound is theirs until the budget's next step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<BudgetNote>,
}

/// A share of a budget that programs divide (`farmap budget NAME`): the part of
/// [`PagingReport`] that says why the bound is what it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetNote {
    /// The budget's name.
    pub name: String,
    /// The local memory all its programs share.
    pub total_bytes: u64,
    /// This program's share, the bound the budget set last.
    pub share_bytes: u64,
    /// Why the share is what it is (`new`, `idle`, `demand`, `working_set`, `step`,
    /// `held`, `floor`: see `farmap budget --help`).
    pub reason: String,
}

/// The paging state of the region held here (the answer to both local-memory requests).
/// Byte counts are whole chunks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PagingReport {
    /// The region's size.
    pub region_bytes: u64,
    /// Its chunk size (the unit of the limit).
    pub chunk_bytes: u64,
    /// The bound on local memory now.
    pub limit_bytes: u64,
    /// What proactive reclaim keeps free below the limit; resident memory stays at most
    /// `limit_bytes + min_free_bytes`.
    pub min_free_bytes: u64,
    /// Counted against the limit now: mapped, staged and being fetched.
    pub resident_bytes: u64,
    /// Of those, staged (moved out of the region, still local).
    pub staged_bytes: u64,
    /// Pages present in memory now, in the region and its staging area, from the page
    /// tables (`None` if they could not be scanned).
    pub local_bytes: Option<u64>,
    /// Whether `resident_bytes ≤ limit_bytes + min_free_bytes`.
    pub within_limit: bool,
    /// Staged chunks dropped by faults that found the region full.
    pub evictions_reactive: u64,
    /// Staged chunks dropped by the reclaim thread, ahead of need.
    pub evictions_proactive: u64,
    /// Chunks moved from the region into staging.
    pub deactivations: u64,
    /// Faults served by moving a staged chunk back (no I/O).
    pub staged_refaults: u64,
    /// Faults that found the region at its limit: how often the proactive reclaim fell
    /// behind.
    #[serde(default)]
    pub full_faults: u64,
    /// Chunks admitted over the limit (within `min_free_bytes`) while a reclaim made room.
    #[serde(default)]
    pub overcommits: u64,
    /// Page faults the region's handler resolved (missing pages; write-protect faults are
    /// not counted).
    #[serde(default)]
    pub faults: u64,
    /// Chunks read ahead of their faults.
    #[serde(default)]
    pub prefetched: u64,
    /// Of those, chunks touched afterwards.
    #[serde(default)]
    pub prefetch_hits: u64,
    /// Of those, chunks dropped before any touch.
    #[serde(default)]
    pub prefetch_wasted: u64,
    /// Mapped memory touched since the eviction clock last passed it: the working set as
    /// the pager sees it (`None` from an agent that does not count it).
    #[serde(default)]
    pub referenced_bytes: Option<u64>,
    /// The budget this program's bound is a share of, if it is in one (`farmap run
    /// --budget`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<BudgetNote>,
}

impl PagingReport {
    /// The state of `region` now; `None` if its local memory is not bounded. Blocks (scans
    /// the page tables).
    pub fn of(region: &dyn BoundedRegion) -> Option<PagingReport> {
        let stats = region.stats();
        let p = stats.paging?;
        let g = region.geometry();
        let chunk = u64::from(g.chunk_size());
        let page = region.page_size() as u64;
        let local_bytes = match region.local_pages() {
            Some(Ok((mapped, staged))) => Some((mapped + staged) * page),
            Some(Err(e)) => {
                tracing::debug!("scanning the region's present pages: {e}");
                None
            }
            None => None,
        };
        Some(PagingReport {
            region_bytes: g.size(),
            chunk_bytes: chunk,
            limit_bytes: p.limit_chunks * chunk,
            min_free_bytes: p.min_free_chunks * chunk,
            resident_bytes: p.resident_chunks * chunk,
            staged_bytes: p.staged_chunks * chunk,
            local_bytes,
            within_limit: p.resident_chunks <= p.limit_chunks + p.min_free_chunks,
            evictions_reactive: p.evictions_reactive,
            evictions_proactive: p.evictions_proactive,
            deactivations: p.deactivations,
            staged_refaults: p.staged_refaults,
            full_faults: p.full_faults,
            overcommits: p.overcommits,
            faults: stats.faults,
            prefetched: p.prefetched,
            prefetch_hits: p.prefetch_hits,
            prefetch_wasted: p.prefetch_wasted,
            referenced_bytes: region.referenced_chunks().map(|c| c * chunk),
            budget: None,
        })
    }
}

/// The region held here if its local memory is bounded; why a local-memory request is
/// refused otherwise.
fn paged(region: Option<Arc<dyn BoundedRegion>>) -> Result<Arc<dyn BoundedRegion>, String> {
    match region {
        None => Err(
            "this process holds no userfaultfd region (none yet, handed over, or a \
                     mounted file), so it has no local memory to bound"
                .into(),
        ),
        Some(r) if !r.is_paged() => Err("the region here was opened without a local-memory \
                                         limit (--local-max), and one cannot be added at run \
                                         time"
            .into()),
        Some(r) => Ok(r),
    }
}

/// The answer to [`Request::PagingState`](super::Request::PagingState): the report, or why
/// the agent refuses.
pub(super) async fn state(region: Option<Arc<dyn BoundedRegion>>) -> Result<PagingReport, String> {
    report(paged(region)?).await
}

/// Applies a [`SetLocalMaxRequest`] to `region` (the one the application holds) and replies
/// with the state after it. Everything is checked before the limit changes.
pub(super) async fn set_local_max(
    req: SetLocalMaxRequest,
    region: Option<Arc<dyn BoundedRegion>>,
) -> Result<PagingReport, String> {
    let limit = req.local_max.limit().map_err(|e| e.to_string())?;
    let wait = Duration::from_millis(req.wait_ms);
    if wait > MAX_SETTLE_WAIT {
        return Err(format!(
            "wait_ms {} is longer than the {} s a request may wait",
            req.wait_ms,
            MAX_SETTLE_WAIT.as_secs()
        ));
    }
    let region = paged(region)?;
    if !region.set_local_max(limit) {
        // A bounded region stays bounded; said rather than assumed.
        return Err("the region lost its local-memory limit".into());
    }
    if req.budget.is_some() {
        // A budget's step, every few seconds: not news.
        tracing::debug!(?limit, "local-memory limit changed by a budget");
    } else {
        tracing::info!(?limit, "local-memory limit changed by the agent");
    }
    let deadline = Instant::now() + wait;
    while Instant::now() < deadline && !settled(&*region) {
        tokio::time::sleep(SETTLE_POLL).await;
    }
    report(region).await
}

/// Whether resident memory is within the limit plus `min_free`.
fn settled(region: &dyn BoundedRegion) -> bool {
    region
        .stats()
        .paging
        .is_some_and(|p| p.resident_chunks <= p.limit_chunks + p.min_free_chunks)
}

async fn report(region: Arc<dyn BoundedRegion>) -> Result<PagingReport, String> {
    match tokio::task::spawn_blocking(move || PagingReport::of(&*region)).await {
        Ok(Some(r)) => Ok(r),
        Ok(None) => Err("the region lost its local-memory limit".into()),
        Err(e) => Err(format!("reading the region's paging state failed: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Reply, Request};
    use super::*;

    #[test]
    fn limits_are_checked() {
        assert_eq!(LocalMax::Bytes(4096).limit(), Ok(LocalLimit::Bytes(4096)));
        assert_eq!(
            LocalMax::Percent(100.0).limit(),
            Ok(LocalLimit::Percent(100.0))
        );
        assert_eq!(LocalMax::Percent(0.5).limit(), Ok(LocalLimit::Percent(0.5)));
        assert_eq!(LocalMax::Bytes(0).limit(), Err(LocalMaxError::Zero));
        for p in [0.0, -1.0, 150.0, 100.01, f64::NAN, f64::INFINITY] {
            assert!(LocalMax::Percent(p).limit().is_err(), "{p}");
        }
        let e = LocalMax::Percent(150.0).limit().unwrap_err().to_string();
        assert!(e.contains("150%") && e.contains("(0, 100]"), "{e}");
        assert_eq!(
            LocalMax::from(LocalLimit::Percent(30.0)),
            LocalMax::Percent(30.0)
        );
    }

    #[test]
    fn requests_and_replies_have_a_stable_form() {
        let r = Request::SetLocalMax(SetLocalMaxRequest {
            local_max: LocalMax::Percent(30.0),
            wait_ms: 500,
            budget: None,
        });
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(
            s,
            r#"{"op":"set_local_max","local_max":{"percent":30.0},"wait_ms":500}"#
        );
        assert_eq!(serde_json::from_str::<Request>(&s).unwrap(), r);
        // wait_ms may be left out; a size is a whole number of bytes.
        let r: Request =
            serde_json::from_str(r#"{"op":"set_local_max","local_max":{"bytes":65536}}"#).unwrap();
        assert_eq!(
            r,
            Request::SetLocalMax(SetLocalMaxRequest {
                local_max: LocalMax::Bytes(65536),
                wait_ms: 0,
                budget: None,
            })
        );
        for bad in [
            r#"{"op":"set_local_max","local_max":{"bytes":-1}}"#,
            r#"{"op":"set_local_max","local_max":{"bytes":1.5}}"#,
            r#"{"op":"set_local_max","local_max":"30%"}"#,
            r#"{"op":"set_local_max","local_max":{"bytes":1,"percent":2}}"#,
            r#"{"op":"set_local_max"}"#,
        ] {
            assert!(serde_json::from_str::<Request>(bad).is_err(), "{bad}");
        }
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"op":"paging_state"}"#).unwrap(),
            Request::PagingState
        );
        let report = PagingReport {
            region_bytes: 1 << 20,
            chunk_bytes: 65536,
            limit_bytes: 262144,
            min_free_bytes: 65536,
            resident_bytes: 262144,
            staged_bytes: 65536,
            local_bytes: Some(258048),
            within_limit: true,
            evictions_reactive: 1,
            evictions_proactive: 2,
            deactivations: 3,
            staged_refaults: 4,
            full_faults: 5,
            overcommits: 6,
            faults: 7,
            prefetched: 8,
            prefetch_hits: 9,
            prefetch_wasted: 10,
            referenced_bytes: Some(40960),
            budget: None,
        };
        let s = serde_json::to_string(&Reply::Paging(report.clone())).unwrap();
        // An older agent's report, without the fault and prefetch counters, still reads.
        let old = s.replace(
            r#","faults":7,"prefetched":8,"prefetch_hits":9,"prefetch_wasted":10"#,
            "",
        );
        assert_ne!(old, s);
        match serde_json::from_str::<Reply>(&old).unwrap() {
            Reply::Paging(r) => assert_eq!((r.faults, r.prefetched), (0, 0)),
            other => panic!("{other:?}"),
        }
        assert!(
            s.starts_with(r#"{"event":"paging","region_bytes":1048576,"chunk_bytes":65536,"limit_bytes":262144,"min_free_bytes":65536,"resident_bytes":262144,"staged_bytes":65536,"local_bytes":258048,"#),
            "{s}"
        );
        assert_eq!(
            serde_json::from_str::<Reply>(&s).unwrap(),
            Reply::Paging(report.clone())
        );
        // A program in a budget: the note, as the budget sent it with its bound.
        let note = BudgetNote {
            name: "web".into(),
            total_bytes: 64 << 20,
            share_bytes: 40 << 20,
            reason: "demand".into(),
        };
        let noted = PagingReport {
            budget: Some(note.clone()),
            ..report
        };
        let s = serde_json::to_string(&Reply::Paging(noted.clone())).unwrap();
        assert!(
            s.ends_with(r#""referenced_bytes":40960,"budget":{"name":"web","total_bytes":67108864,"share_bytes":41943040,"reason":"demand"}}"#),
            "{s}"
        );
        assert_eq!(
            serde_json::from_str::<Reply>(&s).unwrap(),
            Reply::Paging(noted)
        );
        let r = Request::SetLocalMax(SetLocalMaxRequest {
            local_max: LocalMax::Bytes(40 << 20),
            wait_ms: 0,
            budget: Some(note),
        });
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<Request>(&s).unwrap(), r);
    }
}
