//! Garbage collection: removing the chunks no version references, safe while writers, forks
//! and snapshots run.
//!
//! A chunk becomes garbage when no manifest lists it: a writer that crashed or was fenced
//! before its flush, or a chunk written over before the next version. Deleting such a chunk
//! races with a writer that has just stored it (or found it already stored, and counts on
//! it) and will list it in its next version. [`gc`] therefore removes in two runs, with a
//! grace period between them, and writers keep a promise in return:
//!
//! - **Run `k`, phase 1**: every chunk no manifest lists is moved to
//!   `trash/HH/HASH.STAMP` (copied, then deleted from `chunks/`; `STAMP` is when, in
//!   milliseconds since the Unix epoch). A reader that misses a chunk in `chunks/` looks in
//!   the trash, so nothing a version lists ever stops reading.
//! - **A later run, phase 2**: a trash entry at least the grace old is restored to
//!   `chunks/` when a manifest lists it now, and deleted either way.
//! - **Writers** ([`Versioned`](crate::Versioned)) list a chunk in a version only within
//!   half the grace of seeing it in `chunks/`, and see each unsaved chunk again (restoring it
//!   from the trash when it was moved) every eighth of the grace. So a chunk moved at time
//!   `T` is listed by a version written before `T + grace/2` (which phase 2, reading the
//!   manifests at `T + grace` or later, sees), or it was seen missing and put back.
//!
//! The grace is the object store's, kept in `gc/grace` and set once, by the first writer or
//! collector to open it ([`DEFAULT_GRACE`] unless it asks for another). Its hosts' clocks
//! must agree to well within it. Versions are never deleted: what a version lists is kept.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use bytes::Bytes;
use farmap_core::{ErrorKind, Objects, StoreError, StoreResult};
use tracing::{debug, info};

use crate::chunk::{self, from_trash, trash_key, TRASH};
use crate::manifest::Manifest;
use crate::page::read_page;
use crate::{now_ms, versions_dir, Hash};

/// The grace an object store gets when its first writer or collector asks for none.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(3600);

/// The shortest grace accepted (tests use tens of milliseconds).
pub const MIN_GRACE: Duration = Duration::from_millis(10);

/// The longest grace accepted.
pub const MAX_GRACE: Duration = Duration::from_secs(30 * 24 * 3600);

const GRACE_KEY: &str = "gc/grace";
const CHUNKS: &str = "chunks";

/// The grace of `objects`: the one it keeps, or `wanted` (else [`DEFAULT_GRACE`]) kept now
/// when it has none. Asking for another grace than the one kept is refused: writers already
/// count on it.
pub async fn grace(objects: &dyn Objects, wanted: Option<Duration>) -> StoreResult<Duration> {
    grace_as(objects, wanted, true).await
}

/// Refuses a grace out of range.
pub fn check_grace(grace: Duration) -> StoreResult<()> {
    if (MIN_GRACE..=MAX_GRACE).contains(&grace) {
        Ok(())
    } else {
        Err(StoreError::invalid(format!(
            "a grace of {grace:?} is out of range: give {MIN_GRACE:?} to {MAX_GRACE:?}"
        )))
    }
}

/// [`grace`], keeping `wanted` (or the default) only when `keep`; else it is only what the
/// grace would be.
async fn grace_as(
    objects: &dyn Objects,
    wanted: Option<Duration>,
    keep: bool,
) -> StoreResult<Duration> {
    if let Some(w) = wanted {
        check_grace(w)?;
    }
    let kept = match objects.get(GRACE_KEY).await? {
        Some(kept) => kept,
        None if !keep => return Ok(wanted.unwrap_or(DEFAULT_GRACE)),
        None => {
            let ms = wanted.unwrap_or(DEFAULT_GRACE).as_millis() as u64;
            let mine = Bytes::from(format!("{ms}\n"));
            if objects.create(GRACE_KEY, mine.clone()).await? {
                mine
            } else {
                // Another opening set it first: its value holds.
                objects.get(GRACE_KEY).await?.unwrap_or(mine)
            }
        }
    };
    let ms: u64 = std::str::from_utf8(&kept)
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .ok_or_else(|| {
            StoreError::new(
                ErrorKind::Corrupt,
                format!(
                    "{GRACE_KEY} in {} does not hold a number of milliseconds",
                    objects.location()
                ),
            )
        })?;
    let kept = Duration::from_millis(ms);
    if !(MIN_GRACE..=MAX_GRACE).contains(&kept) {
        return Err(StoreError::new(
            ErrorKind::Corrupt,
            format!(
                "{GRACE_KEY} in {} holds {ms} ms, out of range",
                objects.location()
            ),
        ));
    }
    match wanted {
        Some(w) if w != kept => Err(StoreError::invalid(format!(
            "the objects in {} keep a grace of {kept:?}, set when they were first written; \
             it cannot change (writers count on it): leave the grace out",
            objects.location()
        ))),
        _ => Ok(kept),
    }
}

/// Makes sure chunk `hash` is in `chunks/`, putting it back from the trash when a collector
/// moved it. `region` is for the message when it is gone.
pub(crate) async fn ensure(objects: &dyn Objects, hash: &Hash, region: &str) -> StoreResult<()> {
    let key = chunk::key(hash);
    if objects.exists(&key).await? {
        return Ok(());
    }
    match from_trash(objects, hash).await? {
        Some(bytes) => {
            objects.create(&key, bytes).await?;
            debug!(chunk = %hash.hex(), "put a chunk back from the trash");
            Ok(())
        }
        None => Err(StoreError::new(
            ErrorKind::Corrupt,
            format!(
                "region {region:?}: the unsaved chunk {} is gone from {} (collected as garbage: \
                 was this writer stopped for longer than the grace?)",
                hash.hex(),
                objects.location()
            ),
        )),
    }
}

/// How a collection is run.
#[derive(Debug, Clone, Default)]
pub struct GcOptions {
    /// The grace to keep when the object store has none yet (see [`grace`]).
    pub grace: Option<Duration>,
    /// Count what would be moved and deleted, and change nothing.
    pub dry_run: bool,
}

/// What a collection did (or, dry, would do).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// The object store's grace, in milliseconds.
    pub grace_ms: u64,
    /// Regions read.
    pub regions: u64,
    /// Versions read.
    pub versions: u64,
    /// Distinct chunks some version lists.
    pub referenced: u64,
    /// Chunks found in `chunks/`.
    pub chunks: u64,
    /// Chunks moved to the trash by this run, and their stored bytes.
    pub trashed: u64,
    /// Stored bytes of the chunks moved to the trash.
    pub trashed_bytes: u64,
    /// Trash entries put back because a version written since lists them.
    pub restored: u64,
    /// Trash entries deleted for good, and their stored bytes.
    pub deleted: u64,
    /// Stored bytes of the entries deleted.
    pub deleted_bytes: u64,
    /// Trash entries younger than the grace, left for a later run.
    pub waiting: u64,
}

/// Every chunk any version of any region lists (and every page of a chunk map, which is
/// stored as a chunk), with the count of regions and versions.
async fn referenced(objects: &dyn Objects) -> StoreResult<(HashSet<Hash>, u64, u64)> {
    let mut set = HashSet::new();
    let mut pages = HashSet::new();
    let regions = objects.list("regions").await?;
    let mut versions = 0;
    for region in &regions {
        for name in objects.list(&versions_dir(region)).await? {
            let key = format!("{}/{name}", versions_dir(region));
            // A manifest (or page) that cannot be read stops the collection before anything
            // is removed: what it lists is unknown.
            let stop = |e: StoreError| {
                StoreError::new(
                    e.kind(),
                    format!(
                        "{key} in {}: {e}; nothing was collected",
                        objects.location()
                    ),
                )
            };
            let bytes = objects.get(&key).await?.ok_or_else(|| {
                StoreError::new(
                    ErrorKind::Corrupt,
                    format!("{key} vanished while collecting: versions are never deleted"),
                )
            })?;
            let m = Manifest::decode(&bytes).map_err(stop)?;
            set.extend(
                m.entries
                    .into_iter()
                    .map(|(_, h)| h)
                    .filter(|h| *h != Hash::ZERO),
            );
            for page in m.pages.iter().filter(|p| p.hash != Hash::ZERO) {
                // Pages are shared by versions: each is read once.
                if !pages.insert(page.hash) {
                    continue;
                }
                set.insert(page.hash);
                let p = read_page(objects, page.hash, m.page_chunks)
                    .await
                    .map_err(stop)?;
                set.extend(p.entries().iter().map(|(_, h)| *h));
            }
            versions += 1;
        }
    }
    Ok((set, regions.len() as u64, versions))
}

/// Every `(hash, key, stamp)` under `trash/` (stamp `None` for a chunk key).
async fn walk(objects: &dyn Objects, top: &str) -> StoreResult<Vec<(Hash, String, Option<u64>)>> {
    let mut out = Vec::new();
    for dir in objects.list(top).await? {
        for name in objects.list(&format!("{top}/{dir}")).await? {
            let (hex, stamp) = match name.split_once('.') {
                Some((hex, s)) => match s.parse() {
                    Ok(s) => (hex, Some(s)),
                    Err(_) => continue,
                },
                None => (name.as_str(), None),
            };
            let Some(hash) = parse_hex(hex) else { continue };
            out.push((hash, format!("{top}/{dir}/{name}"), stamp));
        }
    }
    Ok(out)
}

fn parse_hex(hex: &str) -> Option<Hash> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(Hash(out))
}

/// Collects the garbage of `objects` (see the module documentation): restores or deletes
/// what an earlier run moved to the trash at least the grace ago, then moves to the trash
/// every chunk no version lists.
pub async fn gc(objects: &dyn Objects, opts: &GcOptions) -> StoreResult<GcReport> {
    // A dry run keeps no grace either.
    let grace = grace_as(objects, opts.grace, !opts.dry_run).await?;
    let grace_ms = grace.as_millis() as u64;
    let mut report = GcReport {
        grace_ms,
        ..GcReport::default()
    };
    let trash = walk(objects, TRASH).await?;
    // Manifests are read after this instant: every version written before it is seen.
    let read_at = now_ms();
    let (refs, regions, versions) = referenced(objects).await?;
    report.regions = regions;
    report.versions = versions;
    report.referenced = refs.len() as u64;
    info!(regions, versions, chunks = refs.len(), "read every version");

    // Phase 2: what an earlier run moved, once the grace has passed.
    for (hash, key, stamp) in trash {
        let Some(stamp) = stamp else { continue };
        if stamp.saturating_add(grace_ms) > read_at {
            report.waiting += 1;
            continue;
        }
        let Some(bytes) = objects.get(&key).await? else {
            continue;
        };
        if refs.contains(&hash) {
            report.restored += u64::from(!objects.exists(&chunk::key(&hash)).await?);
            if !opts.dry_run {
                objects.create(&chunk::key(&hash), bytes).await?;
            }
        } else {
            report.deleted += 1;
            report.deleted_bytes += bytes.len() as u64;
        }
        if !opts.dry_run {
            objects.delete(&key).await?;
        }
    }

    // Phase 1: chunks no version lists go to the trash.
    for (hash, key, _) in walk(objects, CHUNKS).await? {
        report.chunks += 1;
        if refs.contains(&hash) {
            continue;
        }
        let stamp = now_ms();
        let started = Instant::now();
        let Some(bytes) = objects.get(&key).await? else {
            continue;
        };
        report.trashed += 1;
        report.trashed_bytes += bytes.len() as u64;
        if opts.dry_run {
            continue;
        }
        objects
            .create(&trash_key(&hash, stamp), bytes.clone())
            .await?;
        objects.delete(&key).await?;
        // Writers count on a move being stamped within half the grace of the delete: a
        // move that took longer is undone (the chunk stays, the entry goes at a later run).
        if started.elapsed() > grace / 2 {
            objects.create(&key, bytes).await?;
        }
    }
    info!(
        trashed = report.trashed,
        restored = report.restored,
        deleted = report.deleted,
        waiting = report.waiting,
        "collected"
    );
    Ok(report)
}
