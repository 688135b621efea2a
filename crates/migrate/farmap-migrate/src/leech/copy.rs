//! The leecher's copies: the dirty rounds of a pre-copy, the post-copy pull, the instant
//! mode's pull of what the seeder left, and the bulk pull they share.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use farmap_core::{error_chain, ChunkIdx, StoreError};
use futures::StreamExt;

use crate::budget::Pacer;
use crate::endpoint::{Destination, EndpointError};
use crate::event::{Event, Reporter};
use crate::machine::{Manifest, RoundResult};
use crate::msg::{run_pages, Location};
use crate::view::MigrationStore;

/// Pages per read of a dirty round (the round's set is read and written batch by batch).
const REFRESH_BATCH: u64 = 1024;
/// Reads of a dirty round in flight at once: one at a time, a round of scattered pages paid a
/// round trip of the data plane per batch (12 batches for the 12,000 pages of a 1 GiB demo's
/// first round).
const REFRESH_READS: usize = 4;

/// Why a dirty round failed (the migration is abandoned; the source runs on).
#[derive(Debug, thiserror::Error)]
pub(super) enum RoundError {
    #[error("reading the changed pages failed")]
    Read(#[source] StoreError),
    #[error("writing the changed pages failed")]
    Write(#[source] EndpointError),
    #[error("writing the changed pages panicked")]
    Task(#[source] tokio::task::JoinError),
}

/// A pre-copy dirty round: read the changed pages and write them in place, batch by batch,
/// [`REFRESH_READS`] batches read at once while the one before is written (1024 pages of
/// reading is a round trip and a transfer; writing them is a memcpy on a blocking thread).
/// The application does not run here yet, and a write costs a memcpy where a discard costs a
/// round trip through the fault reader per run.
pub(super) async fn refresh_round<D: Destination>(
    region: Arc<D>,
    store: Arc<MigrationStore>,
    runs: &[Range<u64>],
    page: u64,
    rep: &Reporter,
    pacer: &Pacer,
) -> Result<RoundResult, RoundError> {
    let t0 = Instant::now();
    let mut read = Duration::ZERO;
    let mut apply = Duration::ZERO;
    let store = &store;
    let mut reads = futures::stream::iter(batches_of(runs, REFRESH_BATCH))
        .map(|batch| async move {
            pacer.pace(run_pages(&batch) * page).await;
            store.read_runs(&batch).await
        })
        .buffered(REFRESH_READS);
    let mut writing: Option<tokio::task::JoinHandle<Result<Duration, EndpointError>>> = None;
    // Waits for the batch being written; a failed or panicked write fails the round.
    async fn written(
        job: tokio::task::JoinHandle<Result<Duration, EndpointError>>,
    ) -> Result<Duration, RoundError> {
        job.await
            .map_err(RoundError::Task)?
            .map_err(RoundError::Write)
    }
    while let Some(segments) = reads.next().await {
        // Until the last batch arrived (reads overlap each other and the writes).
        read = t0.elapsed();
        if let Some(job) = writing.take() {
            apply += written(job).await?;
        }
        let segments = segments.map_err(RoundError::Read)?;
        let r = region.clone();
        // One write per run of pages holding data, and zeros where the source now has zero
        // pages (their old content is here).
        writing = Some(tokio::task::spawn_blocking(move || {
            let t = Instant::now();
            segments.iter().try_for_each(|s| {
                let at = s.pages.start * page;
                match &s.data {
                    Some(d) => r.write_at(at, d),
                    None => write_zeros(&*r, at, (s.pages.end - s.pages.start) * page),
                }
            })?;
            Ok(t.elapsed())
        }));
    }
    if let Some(job) = writing.take() {
        apply += written(job).await?;
    }
    let pages = run_pages(runs);
    rep.note(format!(
        "round: {pages} pages in {} runs: read in {:.1} ms, written in place in {:.1} ms \
         (overlapping the reads), {:.1} ms in all",
        runs.len(),
        read.as_secs_f64() * 1e3,
        apply.as_secs_f64() * 1e3,
        t0.elapsed().as_secs_f64() * 1e3,
    ));
    Ok(RoundResult {
        pages,
        runs: runs.len() as u64,
        apply,
        elapsed: t0.elapsed(),
    })
}

/// `runs` (ascending) cut into batches of at most `max` pages each.
fn batches_of(runs: &[Range<u64>], max: u64) -> Vec<Vec<Range<u64>>> {
    let mut out: Vec<Vec<Range<u64>>> = Vec::new();
    let mut cur: Vec<Range<u64>> = Vec::new();
    let mut n = 0;
    for r in runs {
        let mut at = r.start;
        while at < r.end {
            let take = (r.end - at).min(max - n);
            cur.push(at..at + take);
            n += take;
            at += take;
            if n == max {
                out.push(std::mem::take(&mut cur));
                n = 0;
            }
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Writes `len` zero bytes at `offset` (shared zeros, one write per 4 MiB).
fn write_zeros<D: Destination>(d: &D, offset: u64, len: u64) -> Result<(), EndpointError> {
    let max = u64::from(farmap_core::MAX_CHUNK_SIZE);
    let mut done = 0;
    while done < len {
        let n = (len - done).min(max);
        d.write_at(offset + done, &farmap_core::zero_chunk(n as usize))?;
        done += n;
    }
    Ok(())
}

/// Post-copy: fetch the chunks of the pages discarded at the hand-over (faults fetch theirs
/// first), batch by batch, retrying until every chunk is local.
pub(super) async fn post_copy<D: Destination>(
    region: Arc<D>,
    store: Arc<MigrationStore>,
    runs: Vec<Range<u64>>,
    page: u64,
    chunk: u64,
    workers: usize,
    rep: Reporter,
) {
    let chunks = chunks_of(&runs, page, chunk);
    let per_chunk = (chunk / page).max(1);
    loop {
        let mut failed = None;
        for batch in chunks.chunks(PULL_BATCH as usize) {
            let (Some(first), Some(last)) = (batch.first(), batch.last()) else {
                continue;
            };
            let lo = first.0.saturating_mul(per_chunk);
            let hi = last.0.saturating_add(1).saturating_mul(per_chunk);
            let pages = clip(&runs, lo, hi);
            let _ = store.stage(&pages).await;
            let fetched = region.fetch_chunks(batch.to_vec(), workers).await;
            store.unstage(&pages);
            if let Err(e) = fetched {
                failed = Some(e);
                break;
            }
        }
        let (have, all) = (region.present_chunks(), region.geometry().chunk_count());
        match &failed {
            None => rep.note(format!("post-copy: {have} of {all} chunks present")),
            Some(e) => rep.note(format!(
                "post-copy: {}; {have} of {all} chunks present; retrying",
                error_chain(e.as_ref())
            )),
        }
        if failed.is_none() && region.is_complete() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// After an instant hand-over: fetch the chunks only the source holds (those written
/// lately first, then in the manifest's order; faults fetch theirs first) and push each
/// batch to the shared store; once the source has confirmed every chunk, the same for the
/// chunks it found written last, then read and check the chunks the store holds (one failing
/// its check is read from the source, and pushed again), so that the source holds nothing
/// the destination needs when it is released. Retries until done.
#[allow(clippy::too_many_arguments)]
pub(super) async fn instant_copy<D: Destination>(
    region: Arc<D>,
    store: Arc<MigrationStore>,
    manifest: Manifest,
    first: Vec<Range<u64>>,
    page: u64,
    chunk: u64,
    workers: usize,
    rep: Reporter,
) {
    let n = region.geometry().chunk_count();
    let mut done = vec![false; n as usize];
    let mut source = Vec::new();
    let lately = first.iter().flat_map(|r| r.clone());
    let placed = manifest
        .runs
        .iter()
        .filter(|r| r.location == Location::Source)
        .flat_map(|r| r.chunks.clone());
    for c in lately.chain(placed) {
        if let Some(d) = done.get_mut(c as usize) {
            if !std::mem::replace(d, true) {
                source.push(ChunkIdx(c));
            }
        }
    }
    drop(manifest);
    let copy = CopyCtx {
        region: &region,
        store: &store,
        page,
        chunk,
        workers,
        rep: &rep,
    };
    let t0 = Instant::now();
    copy.fetch_all(&source, true).await;
    if !source.is_empty() {
        let took = t0.elapsed().as_secs_f64();
        let rolled = store.rolled_back().len();
        let came = source.len().saturating_sub(rolled);
        rep.note(if rolled == 0 {
            format!(
                "instant: the {} chunks only the source held came in {:.1} ms ({:.0} MB/s)",
                source.len(),
                took * 1e3,
                (came as u64 * chunk) as f64 / took.max(1e-9) / 1e6
            )
        } else {
            format!(
                "instant: of the {} chunks only the source held, {came} came in and {rolled} \
                 rolled back (the source is gone), after {:.1} ms",
                source.len(),
                took * 1e3,
            )
        });
    }
    copy.push(&source).await;
    store.wait_confirmed().await;
    let (all_source, shared) = store.instant_places();
    let late: Vec<ChunkIdx> = all_source
        .into_iter()
        .filter(|c| !done[c.0 as usize])
        .collect();
    copy.batches(&late, true).await;
    copy.batches(&shared, false).await;
    // Chunks whose store copy failed its check came from the source: the store gets them
    // now, or it would keep serving the bad copy once the source is gone.
    let failed = store.take_failed();
    if !failed.is_empty() {
        copy.batches(&failed, true).await;
    }
    let c = store.instant_counts();
    rep.note(format!(
        "instant: {} chunks from the source, {} from the shared store, {} failed their check",
        c.chunks_from_source, c.chunks_from_store, c.verify_failures
    ));
}

/// What [`instant_copy`] fetches with.
struct CopyCtx<'a, D> {
    region: &'a Arc<D>,
    store: &'a Arc<MigrationStore>,
    page: u64,
    chunk: u64,
    workers: usize,
    rep: &'a Reporter,
}

impl<D: Destination> CopyCtx<'_, D> {
    /// Fetches `chunks` batch by batch (from the source: [`INSTANT_IN_FLIGHT`] batches at
    /// once, each staged in one read first; from the store, where nobody waits for them,
    /// one at a time, so that the application keeps the CPU), retrying each batch until it
    /// is done; then, for chunks from the source, pushes them to the shared store. The
    /// application waits for the fetches, not for the pushes, which follow once everything
    /// is here.
    async fn batches(&self, chunks: &[ChunkIdx], from_source: bool) {
        self.fetch_all(chunks, from_source).await;
        if from_source {
            self.push(chunks).await;
        }
    }

    /// The fetches of [`batches`](Self::batches).
    async fn fetch_all(&self, chunks: &[ChunkIdx], from_source: bool) {
        let in_flight = if from_source { INSTANT_IN_FLIGHT } else { 1 };
        futures::stream::iter(chunks.chunks(PULL_BATCH as usize))
            .for_each_concurrent(in_flight, |batch| self.fetch(batch, from_source))
            .await;
    }

    /// Pushes `chunks`, fetched from the source, to the shared store, batch by batch.
    async fn push(&self, chunks: &[ChunkIdx]) {
        for batch in chunks.chunks(PULL_BATCH as usize) {
            loop {
                let (r, b) = (self.region.clone(), batch.to_vec());
                match tokio::task::spawn_blocking(move || r.push_chunks(b))
                    .await
                    .unwrap_or_else(|e| Err(e.into()))
                {
                    Ok(()) => break,
                    Err(e) => self.retry_after(e.as_ref()).await,
                }
            }
        }
    }

    /// Fetches one batch, retrying until it is done.
    async fn fetch(&self, batch: &[ChunkIdx], from_source: bool) {
        let per_chunk = (self.chunk / self.page).max(1);
        let total_pages = self.region.geometry().size().div_ceil(self.page);
        loop {
            let pages: Vec<Range<u64>> = if from_source {
                let mut sorted = batch.to_vec();
                sorted.sort_unstable();
                let mut runs: Vec<Range<u64>> = Vec::new();
                for c in sorted {
                    let (a, b) = (c.0 * per_chunk, ((c.0 + 1) * per_chunk).min(total_pages));
                    match runs.last_mut() {
                        Some(r) if r.end == a => r.end = b,
                        _ => runs.push(a..b),
                    }
                }
                runs
            } else {
                Vec::new()
            };
            if !pages.is_empty() {
                let _ = self.store.stage(&pages).await;
            }
            let fetched = self.region.fetch_chunks(batch.to_vec(), self.workers).await;
            self.store.unstage(&pages);
            match fetched {
                Ok(()) => return,
                Err(e) => self.retry_after(e.as_ref()).await,
            }
        }
    }

    async fn retry_after(&self, e: &(dyn std::error::Error + Send + Sync + 'static)) {
        self.rep
            .note(format!("instant: {}; retrying", error_chain(e)));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How long the destination keeps its CPUs awake waiting for the hand-over: the source's
/// suspension and last scan take milliseconds; past this, the CPUs may halt again.
pub(super) const HANDOVER_AWAKE: Duration = Duration::from_millis(100);

/// Batches an instant migration's copy fetches at once.
const INSTANT_IN_FLIGHT: usize = 4;

/// Chunks per bulk-pull batch (one `read_many` of their pages, then one install each).
const PULL_BATCH: u64 = 64;
/// Bulk-pull batches in flight (enough to fill a long fat link: 8 × 4 MiB).
const PULL_IN_FLIGHT: usize = 8;

/// Why the bulk pull failed.
#[derive(Debug, thiserror::Error)]
pub(super) enum PullError {
    #[error("reading pages from the seeder failed")]
    Read(#[source] StoreError),
    #[error("installing chunks failed")]
    Install(#[source] EndpointError),
    #[error("a pull task panicked")]
    Task(#[source] tokio::task::JoinError),
}

/// Pre-copy: the whole region, batch by batch, several batches in flight.
pub(super) async fn bulk_pull<D: Destination>(
    region: Arc<D>,
    store: Arc<MigrationStore>,
    page: u64,
    chunk: u64,
    workers: usize,
    rep: Reporter,
    pacer: Arc<Pacer>,
) -> Result<(), PullError> {
    let chunks = region.geometry().chunk_count();
    let total = region.geometry().size();
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..PULL_IN_FLIGHT {
        let (region, store, next, rep) = (region.clone(), store.clone(), next.clone(), rep.clone());
        let pacer = pacer.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let first = next.fetch_add(PULL_BATCH, std::sync::atomic::Ordering::AcqRel);
                if first >= chunks {
                    return Ok::<(), PullError>(());
                }
                let last = (first + PULL_BATCH).min(chunks);
                let p0 = first * chunk / page;
                let p1 = (last * chunk).min(total) / page;
                let pages: Vec<Range<u64>> = std::iter::once(p0..p1).collect();
                pacer.pace((p1 - p0) * page).await;
                store.stage(&pages).await.map_err(PullError::Read)?;
                let r = region
                    .fetch_chunks((first..last).map(ChunkIdx).collect(), workers)
                    .await;
                store.unstage(&pages);
                r.map_err(PullError::Install)?;
                rep.emit(Event::Pulled {
                    bytes: store.bytes().0.min(total),
                    total,
                });
            }
        }));
    }
    for t in tasks {
        t.await.map_err(PullError::Task)??;
    }
    Ok(())
}

/// The chunks holding pages of `runs` (checked runs: ascending, within the region),
/// ascending, each once.
fn chunks_of(runs: &[Range<u64>], page: u64, chunk: u64) -> Vec<ChunkIdx> {
    let mut out: Vec<ChunkIdx> = Vec::new();
    for r in runs {
        if r.start >= r.end {
            continue;
        }
        let a = r.start.saturating_mul(page) / chunk;
        let b = r.end.saturating_mul(page).saturating_sub(1) / chunk;
        let from = out.last().map_or(a, |l| a.max(l.0 + 1));
        out.extend((from..=b).map(ChunkIdx));
    }
    out
}

/// The parts of checked `runs` inside pages `lo..hi`.
fn clip(runs: &[Range<u64>], lo: u64, hi: u64) -> Vec<Range<u64>> {
    let first = runs.partition_point(|r| r.end <= lo);
    runs[first..]
        .iter()
        .take_while(|r| r.start < hi)
        .map(|r| r.start.max(lo)..r.end.min(hi))
        .collect()
}

/// `chunks` (ascending) as runs, for messages: `3, 7-9, 12` (at most 20 runs, then `...`).
pub(crate) fn chunk_list(chunks: &[u64]) -> String {
    let runs = crate::view::ascending_runs(chunks);
    let mut out: Vec<String> = runs
        .iter()
        .take(20)
        .map(|r| {
            if r.end - r.start == 1 {
                r.start.to_string()
            } else {
                format!("{}-{}", r.start, r.end - 1)
            }
        })
        .collect();
    if runs.len() > 20 {
        out.push("...".into());
    }
    out.join(", ")
}
