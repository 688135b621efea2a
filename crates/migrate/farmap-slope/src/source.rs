//! The source of an object migration: the process that owns the object and keeps using it
//! while its pages move.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use farmap_arena::{type_tag, Arena, Obj, Portable, SlotState, READS_CLOSED, RETIRED};
use farmap_migrate::channel::{self, Channel};
use farmap_migrate::msg::{put_header, HEADER_LEN, OBJECT_KIND};
use farmap_migrate::{auth, monotonic_ns};
use farmap_net::auth::Key;
use farmap_net::RemoteAddr;

use crate::error::SlopeError;
use crate::link::{abort, recv_within, send, send_frame};
use crate::msg::{put_runs, ArenaShape, ObjMsg};

/// Pages per `Pages` message (4 MiB of 4 KiB pages).
const BATCH_PAGES: u64 = 1024;

/// How to migrate an object.
#[derive(Debug, Clone)]
pub struct MigrateOptions {
    /// The key both sides hold (farmap's migration key).
    pub key: Key,
    /// How long connecting may take.
    pub connect_timeout: Duration,
    /// Rounds of written pages after the page set, at most, before the hand-over.
    pub max_rounds: u32,
    /// The hand-over starts once a round finds at most this many written bytes.
    pub converged_bytes: u64,
    /// How long the hand-over waits for the object's writers to leave, per try.
    pub drain_patience: Duration,
    /// Tries of the hand-over (a dirty round between two) before giving up.
    pub drain_tries: u32,
    /// How long to wait for an answer of the destination: a destination that stops
    /// answering before the release fails the migration, and the object stays here,
    /// writable again.
    pub idle_limit: Duration,
}

impl MigrateOptions {
    /// Defaults around `key`: 10 s to connect, up to 8 rounds, hand over at ≤ 256 KiB
    /// written, 100 ms of patience for writers, 5 tries, 30 s for each answer.
    pub fn new(key: Key) -> MigrateOptions {
        MigrateOptions {
            key,
            connect_timeout: Duration::from_secs(10),
            max_rounds: 8,
            converged_bytes: 256 << 10,
            drain_patience: Duration::from_millis(100),
            drain_tries: 5,
            idle_limit: crate::dest::IDLE_LIMIT,
        }
    }
}

/// What an object migration did and how long each part took (the keys of `farmap bench
/// slope`).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MigrationReport {
    /// Pages of the object's page set when the migration began.
    pub pages: u64,
    /// Bytes in a page.
    pub page_bytes: u32,
    /// From the start to the hand-over's begin (prefill and dirty rounds).
    pub prefill_ms: f64,
    /// Bytes of the page set ÷ `prefill_ms`, in MB/s (10^6 bytes).
    pub prefill_mb_per_s: f64,
    /// From writes stopped at the source to ownership at the destination.
    pub no_owner_us: f64,
    /// From reads closed at the source to ownership at the destination (reads are served
    /// by the source until then).
    pub read_unavailable_ms: f64,
    /// From writes stopped at the source to ownership at the destination.
    pub write_unavailable_ms: f64,
    /// From the call to the destination's `Done`.
    pub end_to_end_ms: f64,
    /// Dirty rounds sent before the hand-over.
    pub rounds: u32,
    /// Pages sent in the hand-over.
    pub final_dirty_pages: u64,
    /// Page bytes sent in all.
    pub bytes_moved: u64,
    /// Bytes of every frame the destination received (pages, runs, headers, messages).
    pub wire_bytes: u64,
    /// Bytes of the page set.
    pub owned_bytes: u64,
    /// Page bytes sent again (dirty rounds and the hand-over).
    pub resent_dirty_bytes: u64,
}

/// Moves `obj` to the destination listening at `to` (a [`crate::ObjListener`] of another
/// process of the same arena), while the object stays in use here: writers are never
/// blocked during prefill (their writes are tracked and sent again), then writes stop,
/// the last written pages go with the hand-over, reads go on here until the destination
/// has installed the object, and then it is the destination's. Blocks until then.
///
/// On success the object is gone from this process: `obj`'s guards answer
/// [`Moved`](farmap_arena::Moved), and dropping it leaves the slot reserved. On an error
/// before the release, the object stays here and usable.
pub fn migrate<T: Portable>(
    obj: &Obj<T>,
    to: &RemoteAddr,
    opts: &MigrateOptions,
) -> Result<MigrationReport, SlopeError> {
    let arena = obj.arena().clone();
    let slot = obj.slot();
    if !arena
        .slots()
        .transition(slot, SlotState::Local, SlotState::Outbound)
    {
        let state = match arena.slots().state(slot) {
            Some(SlotState::Away) => "it migrated away",
            Some(SlotState::Outbound) => "it is migrating already",
            _ => "it is not this process's",
        };
        return Err(SlopeError::NotHere { slot, state });
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(SlopeError::io("starting a runtime"))?;
    let mut released = false;
    let result = rt.block_on(run(&arena, slot, type_tag::<T>(), to, opts, &mut released));
    let gate = arena.gate(slot).expect("the object's slot exists");
    if released {
        // The destination owns the object, whatever happened after.
        gate.close(RETIRED);
        arena.discard_slot(slot);
    } else if result.is_err() {
        gate.reopen(READS_CLOSED | farmap_arena::WRITES_CLOSED);
        arena
            .slots()
            .transition(slot, SlotState::Outbound, SlotState::Local);
    }
    result
}

/// The object's pages as slot-relative runs.
fn relative(arena: &Arena, slot: u32, runs: Vec<Range<u64>>) -> Vec<Range<u64>> {
    let first = arena.slot_pages(slot).start;
    runs.into_iter()
        .map(|r| r.start - first..r.end - first)
        .collect()
}

/// Splits `runs` into batches of at most `BATCH_PAGES` pages.
fn batches(runs: &[Range<u64>]) -> Vec<Vec<Range<u64>>> {
    let mut out = vec![Vec::new()];
    let mut in_batch = 0u64;
    for r in runs {
        let mut start = r.start;
        while start < r.end {
            if in_batch == BATCH_PAGES {
                out.push(Vec::new());
                in_batch = 0;
            }
            let end = r.end.min(start + (BATCH_PAGES - in_batch));
            out.last_mut().expect("one batch at least").push(start..end);
            in_batch += end - start;
            start = end;
        }
    }
    out.retain(|b| !b.is_empty());
    out
}

/// Merges two ascending run lists into one.
fn union(a: &[Range<u64>], b: &[Range<u64>]) -> Vec<Range<u64>> {
    let mut all: Vec<Range<u64>> = a.iter().chain(b).cloned().collect();
    all.sort_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::with_capacity(all.len());
    for r in all {
        match out.last_mut() {
            Some(l) if r.start <= l.end => l.end = l.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

fn pages_in(runs: &[Range<u64>]) -> u64 {
    runs.iter().map(|r| r.end - r.start).sum()
}

async fn run(
    arena: &Arc<Arena>,
    slot: u32,
    tag: u64,
    to: &RemoteAddr,
    opts: &MigrateOptions,
    released: &mut bool,
) -> Result<MigrationReport, SlopeError> {
    let started = Instant::now();
    let mut ch = channel::connect(to, None, opts.connect_timeout)
        .await
        .map_err(SlopeError::io("connecting to the destination"))?;
    auth::leecher(&mut ch, &opts.key, 0)
        .await
        .map_err(|e| SlopeError::Auth(e.to_string()))?;
    match exchange(arena, slot, tag, opts, &mut ch, started, released).await {
        Ok(r) => Ok(r),
        Err(e) if !*released => Err(abort(&mut ch, e).await),
        Err(e) => Err(e),
    }
}

async fn exchange(
    arena: &Arc<Arena>,
    slot: u32,
    tag: u64,
    opts: &MigrateOptions,
    ch: &mut Channel,
    started: Instant,
    released: &mut bool,
) -> Result<MigrationReport, SlopeError> {
    let cfg = *arena.config();
    let page = arena.region().page_size();
    let (build_id, _) = arena.image();
    let shape = ArenaShape {
        base: cfg.base as u64,
        size: cfg.size as u64,
        slot_shift: cfg.slot_shift,
        chunk: cfg.chunk,
        page: page as u32,
    };
    send(
        ch,
        &ObjMsg::Hello {
            slot,
            tag,
            build_id: build_id.0,
            arena: shape,
        },
    )
    .await?;
    match recv_within(ch, opts.idle_limit).await? {
        ObjMsg::Welcome => {}
        m => {
            return Err(SlopeError::Protocol(format!(
                "expected Welcome, got {}",
                m.name()
            )))
        }
    }
    let mut report = MigrationReport {
        page_bytes: page as u32,
        ..MigrationReport::default()
    };
    // Tracking starts with this scan: a write after it is found by a later one. Scans cover
    // the object's extent (up to its heap's high water, which only grows), not the slot.
    let extent = || {
        arena.object_extent(slot).ok_or(SlopeError::NotHere {
            slot,
            state: "gone",
        })
    };
    arena.take_written_in(extent()?)?;
    let set = relative(arena, slot, arena.region().pages_in_memory(extent()?)?);
    report.pages = pages_in(&set);
    report.owned_bytes = report.pages * page as u64;
    send_runs(arena, slot, ch, 0, &set, &mut report).await?;
    let converged_pages = opts.converged_bytes / page as u64;
    let mut pending = Vec::new();
    // Round 0 sent the page set.
    let mut previous = report.pages;
    for round in 1..=opts.max_rounds {
        let dirty = relative(arena, slot, arena.take_written_in(extent()?)?.pages);
        let n = pages_in(&dirty);
        // Stop when the rest fits the hand-over, or when a round did not shrink the
        // written set by a fifth: the writers keep up with the rounds, and every further
        // round would only cost them a write-protect fault per page again.
        if n <= converged_pages
            || round == opts.max_rounds
            || n.saturating_mul(5) > previous.saturating_mul(4)
        {
            pending = dirty;
            break;
        }
        previous = n;
        report.rounds = round;
        send_runs(arena, slot, ch, round, &dirty, &mut report).await?;
    }
    // Wait for the destination to install what is in flight: the window then holds only
    // the pages written since.
    send(
        ch,
        &ObjMsg::Flush {
            round: report.rounds,
        },
    )
    .await?;
    match recv_within(ch, opts.idle_limit).await? {
        ObjMsg::Flushed { .. } => {}
        m => {
            return Err(SlopeError::Protocol(format!(
                "expected Flushed, got {}",
                m.name()
            )))
        }
    }
    let gate = arena.gate(slot).expect("the object's slot exists");
    let mut tries = 0;
    while !gate.close_writes_and_drain(opts.drain_patience) {
        tries += 1;
        if tries >= opts.drain_tries {
            return Err(SlopeError::WritersBusy(opts.drain_patience));
        }
        let dirty = relative(arena, slot, arena.take_written_in(extent()?)?.pages);
        pending = union(&pending, &dirty);
    }
    // No owner from here: writes are stopped and not yet allowed at the destination.
    let writes_stopped_ns = monotonic_ns();
    let mark = |what: &str| {
        let since_us = (monotonic_ns() - writes_stopped_ns) / 1000;
        tracing::debug!(slot, since_us, "object migration: {what}");
    };
    report.prefill_ms = started.elapsed().as_secs_f64() * 1e3;
    let last = relative(arena, slot, arena.take_written_in(extent()?)?.pages);
    let runs = union(&pending, &last);
    report.final_dirty_pages = pages_in(&runs);
    mark("final scan");
    // All but the last batch go as pages of a last round; the hand-over carries the last.
    let mut parts = batches(&runs);
    let tail = parts.pop().unwrap_or_default();
    for part in parts {
        send_runs(arena, slot, ch, u32::MAX, &part, &mut report).await?;
    }
    let (frame, data) = page_frame(arena, slot, &tail, |f| f.put_u8(4), Some(writes_stopped_ns))?;
    report.bytes_moved += data;
    report.resent_dirty_bytes += data;
    send_frame(ch, &frame).await?;
    mark("hand-over sent");
    match recv_within(ch, opts.idle_limit).await? {
        ObjMsg::Installed { .. } => {}
        m => {
            return Err(SlopeError::Protocol(format!(
                "expected Installed, got {}",
                m.name()
            )))
        }
    }
    mark("installed");
    // Reads move to the destination: close them here and wait for the readers to leave.
    gate.close(READS_CLOSED);
    let reads_closed_ns = monotonic_ns();
    while !gate.drain(Duration::from_secs(1), farmap_arena::Gate::readers) {
        tracing::warn!(
            slot,
            "readers of a migrating object are still out after 1 s"
        );
    }
    arena
        .slots()
        .transition(slot, SlotState::Outbound, SlotState::Away);
    *released = true;
    send(
        ch,
        &ObjMsg::Released {
            released_ns: monotonic_ns(),
        },
    )
    .await?;
    let owned_ns = match recv_within(ch, opts.idle_limit).await? {
        ObjMsg::Done {
            owned_ns,
            received_bytes,
        } => {
            report.wire_bytes = received_bytes;
            owned_ns
        }
        m => {
            return Err(SlopeError::Protocol(format!(
                "expected Done, got {}",
                m.name()
            )))
        }
    };
    let ms = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1e6;
    report.no_owner_us = ms(writes_stopped_ns, owned_ns) * 1e3;
    report.write_unavailable_ms = ms(writes_stopped_ns, owned_ns);
    report.read_unavailable_ms = ms(reads_closed_ns, owned_ns);
    report.prefill_mb_per_s = if report.prefill_ms > 0.0 {
        report.owned_bytes as f64 / 1e6 / (report.prefill_ms / 1e3)
    } else {
        0.0
    };
    report.end_to_end_ms = started.elapsed().as_secs_f64() * 1e3;
    Ok(report)
}

async fn send_runs(
    arena: &Arena,
    slot: u32,
    ch: &mut Channel,
    round: u32,
    runs: &[Range<u64>],
    report: &mut MigrationReport,
) -> Result<(), SlopeError> {
    for batch in batches(runs) {
        let (frame, data) = page_frame(
            arena,
            slot,
            &batch,
            |f| {
                f.put_u8(3);
                f.put_u32(round);
            },
            None,
        )?;
        report.bytes_moved += data;
        if round > 0 {
            report.resent_dirty_bytes += data;
        }
        send_frame(ch, &frame).await?;
    }
    Ok(())
}

/// A whole `Object` frame carrying the pages of `runs`, read straight from the object into
/// the frame (one copy): `head` writes the message's kind and fields before its runs,
/// `tail` (a `HandOver`'s time) follows the data. Returns the frame and its data bytes.
fn page_frame(
    arena: &Arena,
    slot: u32,
    runs: &[Range<u64>],
    head: impl FnOnce(&mut BytesMut),
    tail: Option<u64>,
) -> Result<(Bytes, u64), SlopeError> {
    let page = arena.region().page_size();
    let data_len = pages_in(runs) as usize * page;
    let mut body = BytesMut::new();
    head(&mut body);
    put_runs(&mut body, runs);
    body.put_u32(data_len as u32);
    let payload = body.len() + data_len + tail.map_or(0, |_| 8);
    let mut f = BytesMut::with_capacity(HEADER_LEN + payload);
    put_header(&mut f, OBJECT_KIND, payload as u32);
    f.put_slice(&body);
    let mut at = f.len();
    f.resize(at + data_len, 0);
    let slot_off = arena.slot_addrs(slot).start - arena.config().base;
    for r in runs {
        let len = (r.end - r.start) as usize * page;
        arena
            .region()
            .read_at(slot_off + r.start as usize * page, &mut f[at..at + len])?;
        at += len;
    }
    if let Some(t) = tail {
        f.put_u64(t);
    }
    Ok((f.freeze(), data_len as u64))
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // one-run lists are the cases
mod tests {
    use super::*;

    #[test]
    fn batches_split_runs_at_the_batch_size_and_union_merges() {
        let b = batches(&[0..1000, 2000..2100]);
        assert_eq!(b, vec![vec![0..1000, 2000..2024], vec![2024..2100]]);
        assert_eq!(batches(&[]), Vec::<Vec<Range<u64>>>::new());
        assert_eq!(batches(&[0..3000]).len(), 3);
        assert_eq!(
            union(&[0..2, 10..12], &[1..4, 12..13, 20..21]),
            vec![0..4, 10..13, 20..21]
        );
    }
}
