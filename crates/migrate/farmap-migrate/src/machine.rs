//! The protocol as two state machines with no I/O: [`Seeder`] and [`Leecher`]. Each takes
//! inputs (messages received, results of the actions it asked for, connection events) and
//! returns the actions to carry out, in order. The runners ([`mod@crate::seed`],
//! [`mod@crate::leech`]) do the I/O.
//!
//! ```text
//!  leecher                                   seeder
//!  Hello{0} ───────────────────────────────▶ ResetTracking        (Idle → Serving)
//!  OpenRegion (pull starts) ◀── Welcome ────
//!  PullDone:  DirtyRequest{1} ─────────────▶ TakeDirty
//!  Discard+Refetch ◀────────── Dirty{1} ────
//!   ... rounds while they converge ...
//!  Finalize ───────────────────────────────▶ Suspend, final TakeDirty  (→ Suspending)
//!  Discard, ResumeApp ◀──────── HandOver ─── (→ HandedOver: never resumes again)
//!  Resumed ────────────────────────────────▶
//!  (post-copy: faults first, rest in the background)
//!  Done ───────────────────────────────────▶ Release
//!  Finish ◀──────────────────────── Bye ────
//! ```
//!
//! Instant mode has no rounds; the manifest travels while the application runs:
//!
//! ```text
//!  Finalize ───────────────────────────────▶ Draft (pushes stop; the manifest is made)
//!  InstallManifest ◀────────── Manifest ────
//!  Installed ──────────────────────────────▶ Suspend, look at the chunks pushed lately
//!  Resume ◀─────────── Confirm, HandOver ─── (→ HandedOver)
//!  Resumed ────────────────────────────────▶ ConfirmRest (the other chunks)
//!  pending chunks confirmed ◀── Confirm ────
//! ```
//!
//! A lost connection before the hand-over aborts (the source keeps running, tracking
//! stops); after `Finalize` the leecher reconnects with its session, and the seeder, if it
//! handed over, sends the hand-over again.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::msg::{
    check_manifest, check_runs, run_pages, ManifestError, ManifestRun, Mode, Msg, RunError,
    SessionId,
};

pub use crate::msg::RegionInfo;

/// Where a [`Seeder`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeederState {
    /// No leecher; the application runs untouched.
    Idle,
    /// A leecher pulls; writes are tracked.
    Serving {
        /// The session.
        session: SessionId,
    },
    /// Finalize asked: the application is being suspended.
    Suspending {
        /// The session.
        session: SessionId,
    },
    /// Ownership moved; reads are still served (post-copy).
    HandedOver {
        /// The session.
        session: SessionId,
        /// Whether the leecher said it resumed.
        resumed: bool,
    },
    /// The leecher has everything; the region is released.
    Released,
}

/// Inputs of a [`Seeder`].
#[derive(Debug, Clone)]
pub enum SeederInput {
    /// A control message arrived.
    Received(Msg),
    /// The control connection is gone.
    Disconnected,
    /// Result of [`SeederAction::TakeDirty`].
    Dirty {
        /// The round it answers.
        round: u32,
        /// Written pages.
        runs: Vec<Range<u64>>,
    },
    /// Result of [`SeederAction::Draft`]: the manifest, the application still running.
    Drafted(Manifest),
    /// Result of [`SeederAction::Suspend`]: suspended, final dirty set taken.
    Suspended {
        /// Pages written since the last set.
        runs: Vec<Range<u64>>,
        /// In instant mode: what the seal found among the chunks written lately.
        confirm: Option<Confirm>,
        /// Application state.
        app_state: Bytes,
        /// CLOCK_MONOTONIC of the suspension (ns).
        at_ns: u64,
    },
    /// [`SeederAction::Draft`] or [`SeederAction::Suspend`] failed (the application runs
    /// on), and why.
    SuspendFailed(Arc<dyn std::error::Error + Send + Sync>),
    /// Result of [`SeederAction::ConfirmRest`].
    Confirmed(Confirm),
}

/// Actions a [`Seeder`] asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeederAction {
    /// Send a message on the control connection.
    Send(Msg),
    /// Start tracking writes from now (a first dirty scan that is thrown away).
    ResetTracking,
    /// Take the pages written since the last scan; answer with [`SeederInput::Dirty`].
    TakeDirty {
        /// The round.
        round: u32,
    },
    /// Instant mode, the application running: push what the shared store lacks for a
    /// bounded time, stop the pushes and make the manifest; answer with
    /// [`SeederInput::Drafted`] or [`SeederInput::SuspendFailed`].
    Draft,
    /// Suspend the application, take the final dirty set and its state; answer with
    /// [`SeederInput::Suspended`] or [`SeederInput::SuspendFailed`]. With `instant`: stop
    /// the pushes for good and look at the chunks written lately instead of taking a dirty
    /// set (asked for once the leecher says the manifest is installed, [`Msg::Installed`]).
    Suspend {
        /// Instant mode.
        instant: bool,
    },
    /// Instant mode, once the leecher resumed: look at the chunks the seal left pending;
    /// answer with [`SeederInput::Confirmed`].
    ConfirmRest,
    /// Let the application run again (only before the hand-over).
    Resume,
    /// The leecher is gone before the hand-over: stop tracking, the source runs untouched.
    StopTracking {
        /// Why, for the log.
        reason: String,
    },
    /// Close the control connection (after sending what came before).
    Close,
    /// The leecher lost its connection after the hand-over: keep serving and wait for it.
    AwaitReconnect,
    /// The migration is complete: release the region.
    Release,
}

/// The source side of a migration.
#[derive(Debug, Clone)]
pub struct Seeder {
    info: RegionInfo,
    state: SeederState,
    next_session: SessionId,
    /// The hand-over sent (the manifest, a confirmation and the hand-over in instant mode),
    /// to send again to a leecher that reconnects before resuming.
    handover: Vec<Msg>,
    /// Instant mode: the last confirmation, sent after the hand-over (and again to a leecher
    /// that reconnects).
    last_confirm: Option<Msg>,
    /// Instant mode: the manifest is sent and the leecher has not said it is installed.
    awaiting_install: bool,
    /// The last dirty round asked for in this session (rounds go 1, 2, 3…).
    last_round: u32,
    /// The session's mode.
    mode: Mode,
}

/// Where every chunk is after an instant hand-over (see [`Msg::Manifest`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    /// Runs of chunks covering the region once, in fetch order.
    pub runs: Vec<ManifestRun>,
    /// (generation, XXH3-64) per chunk of the `Store` runs, in run order.
    pub pushed: Vec<(u64, u64)>,
}

/// What the source found among the chunks a [`Manifest`] places in the store (see
/// [`Msg::Confirm`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Confirm {
    /// Chunk runs written since the manifest: only the source holds them.
    pub at_source: Vec<Range<u64>>,
    /// Chunk runs not looked at yet (empty in the last confirmation).
    pub pending: Vec<Range<u64>>,
}

impl Confirm {
    /// The message that carries it.
    pub fn to_msg(&self) -> Msg {
        Msg::Confirm {
            at_source: self.at_source.clone(),
            pending: self.pending.clone(),
        }
    }
}

impl Manifest {
    /// Chunks only the source holds.
    pub fn source_chunks(&self) -> u64 {
        self.runs
            .iter()
            .filter(|r| r.location == crate::msg::Location::Source)
            .map(|r| r.chunks.end - r.chunks.start)
            .sum()
    }

    /// The message that carries it.
    pub fn to_msg(&self) -> Msg {
        Msg::Manifest {
            runs: self.runs.clone(),
            pushed: self.pushed.clone(),
        }
    }
}

impl Seeder {
    /// A seeder of the region described by `info`, idle; its first session will be
    /// `first_session` (the runner gives each new session a random id with
    /// [`set_next_session`](Self::set_next_session)).
    pub fn new(info: RegionInfo, first_session: SessionId) -> Self {
        Self {
            info,
            state: SeederState::Idle,
            next_session: first_session.max(1),
            handover: Vec::new(),
            last_confirm: None,
            awaiting_install: false,
            last_round: 0,
            mode: Mode::Precopy,
        }
    }

    /// The id the next new session gets (0 is taken as 1).
    pub fn set_next_session(&mut self, id: SessionId) {
        self.next_session = id.max(1);
    }

    /// Where it is.
    pub fn state(&self) -> SeederState {
        self.state
    }

    fn welcome(&self, session: SessionId) -> Msg {
        Msg::Welcome {
            session,
            region: self.info.clone(),
        }
    }

    /// The session's mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    fn refuse(reason: &str) -> Vec<SeederAction> {
        vec![
            SeederAction::Send(Msg::Abort {
                reason: reason.into(),
            }),
            SeederAction::Close,
        ]
    }

    /// The leecher broke the protocol: tell it, and undo what its session started (before
    /// the hand-over: tracking stops and a suspended source resumes; after it, the leecher
    /// may still come back with its session).
    fn reject_leecher(&mut self, reason: String) -> Vec<SeederAction> {
        use SeederAction as A;
        let mut out = vec![A::Send(Msg::Abort {
            reason: reason.clone(),
        })];
        match self.state {
            SeederState::Serving { .. } => {
                self.state = SeederState::Idle;
                out.push(A::StopTracking { reason });
            }
            SeederState::Suspending { .. } => {
                self.state = SeederState::Idle;
                out.push(A::Resume);
                out.push(A::StopTracking { reason });
            }
            SeederState::Idle | SeederState::HandedOver { .. } | SeederState::Released => {}
        }
        out.push(A::Close);
        out
    }

    /// Feeds one input; returns the actions to carry out, in order.
    pub fn step(&mut self, input: SeederInput) -> Vec<SeederAction> {
        use SeederState as S;
        match (self.state, input) {
            (S::Idle, SeederInput::Received(Msg::Hello { session: 0, mode })) => {
                self.open_session(mode)
            }
            (S::Idle, SeederInput::Received(Msg::Hello { .. })) => Self::refuse(
                "the seeder has no such session (it was abandoned before the hand-over)",
            ),
            (
                S::HandedOver { session, resumed },
                SeederInput::Received(Msg::Hello { session: s, .. }),
            ) if s == session => self.welcome_back(session, resumed),
            (
                S::Serving { .. } | S::Suspending { .. } | S::HandedOver { .. },
                SeederInput::Received(Msg::Hello { .. }),
            ) => Self::refuse("the seeder is busy with another leecher"),
            (S::Serving { .. }, SeederInput::Received(Msg::DirtyRequest { round })) => {
                self.dirty_request(round)
            }
            (S::Serving { .. }, SeederInput::Dirty { round, runs }) => {
                vec![SeederAction::Send(Msg::Dirty { round, runs })]
            }
            (S::Serving { session }, SeederInput::Received(Msg::Finalize)) => {
                self.finalize(session)
            }
            (S::Suspending { .. }, SeederInput::Drafted(manifest))
                if self.mode == Mode::Instant && self.handover.is_empty() =>
            {
                self.send_manifest(&manifest)
            }
            (S::Suspending { .. }, SeederInput::Received(Msg::Installed))
                if std::mem::take(&mut self.awaiting_install) =>
            {
                vec![SeederAction::Suspend { instant: true }]
            }
            // A manifest sent again to a leecher that reconnected: installed again, no news.
            (S::HandedOver { .. }, SeederInput::Received(Msg::Installed)) => vec![],
            (
                S::Suspending { session },
                SeederInput::Suspended {
                    runs,
                    confirm,
                    app_state,
                    at_ns,
                },
            ) => self.hand_over(session, runs, confirm, app_state, at_ns),
            (S::HandedOver { .. }, SeederInput::Confirmed(confirm)) => {
                let msg = confirm.to_msg();
                self.last_confirm = Some(msg.clone());
                vec![SeederAction::Send(msg)]
            }
            (S::Suspending { .. }, SeederInput::SuspendFailed(reason)) => {
                self.suspend_failed(&*reason)
            }
            (S::HandedOver { session, resumed }, SeederInput::Received(Msg::Resumed)) => {
                self.resumed(session, resumed)
            }
            (S::HandedOver { .. }, SeederInput::Received(Msg::Done)) => {
                self.state = S::Released;
                vec![
                    SeederAction::Send(Msg::Bye),
                    SeederAction::Release,
                    SeederAction::Close,
                ]
            }
            (
                S::Serving { .. } | S::Suspending { .. } | S::HandedOver { .. },
                SeederInput::Disconnected | SeederInput::Received(Msg::Abort { .. }),
            ) => self.leecher_left(),
            (S::Idle | S::Released, SeederInput::Disconnected) => vec![],
            (_, SeederInput::Received(other)) => self.reject_leecher(format!(
                "unexpected {} from the leecher in this state",
                msg_name(&other)
            )),
            (_, _) => vec![],
        }
    }

    /// A new leecher's `Hello`: a new session, tracking from now on.
    fn open_session(&mut self, mode: Mode) -> Vec<SeederAction> {
        if mode == Mode::Instant && self.info.shared.is_empty() {
            return Self::refuse(
                "an instant migration needs the region's chunks in a store both hosts \
                 reach, and this region has none (move it with --mode precopy or \
                 postcopy)",
            );
        }
        self.mode = mode;
        let session = self.next_session;
        self.next_session = self.next_session.wrapping_add(1).max(1);
        self.last_round = 0;
        self.state = SeederState::Serving { session };
        vec![
            SeederAction::ResetTracking,
            SeederAction::Send(self.welcome(session)),
        ]
    }

    /// The leecher of a handed-over session came back: what it may have missed, again.
    fn welcome_back(&self, session: SessionId, resumed: bool) -> Vec<SeederAction> {
        let mut out = vec![SeederAction::Send(self.welcome(session))];
        if !resumed {
            out.extend(self.handover.iter().cloned().map(SeederAction::Send));
        }
        out.extend(self.last_confirm.iter().cloned().map(SeederAction::Send));
        out
    }

    /// A dirty round asked for: only the next one.
    fn dirty_request(&mut self, round: u32) -> Vec<SeederAction> {
        if Some(round) != self.last_round.checked_add(1) {
            return self.reject_leecher(format!(
                "dirty round {round} asked for after round {}: rounds go one by one",
                self.last_round
            ));
        }
        self.last_round = round;
        vec![SeederAction::TakeDirty { round }]
    }

    /// The leecher finalizes: suspend (instant mode: draft the manifest first).
    fn finalize(&mut self, session: SessionId) -> Vec<SeederAction> {
        self.state = SeederState::Suspending { session };
        self.handover.clear();
        self.last_confirm = None;
        self.awaiting_install = false;
        if self.mode == Mode::Instant {
            vec![SeederAction::Draft]
        } else {
            vec![SeederAction::Suspend { instant: false }]
        }
    }

    /// Instant mode: the drafted manifest goes out, and the suspension waits for it.
    fn send_manifest(&mut self, manifest: &Manifest) -> Vec<SeederAction> {
        let msg = manifest.to_msg();
        self.handover.push(msg.clone());
        // The suspension waits for the leecher's `Installed`: installing a manifest
        // takes time that grows with the region, and the application runs meanwhile.
        self.awaiting_install = true;
        vec![SeederAction::Send(msg)]
    }

    /// The source is suspended: the hand-over goes out (and is kept for a reconnect).
    fn hand_over(
        &mut self,
        session: SessionId,
        runs: Vec<Range<u64>>,
        confirm: Option<Confirm>,
        app_state: Bytes,
        at_ns: u64,
    ) -> Vec<SeederAction> {
        self.state = SeederState::HandedOver {
            session,
            resumed: false,
        };
        let first = self.handover.len();
        self.handover.extend(confirm.as_ref().map(Confirm::to_msg));
        self.handover.push(Msg::HandOver {
            runs,
            app_state,
            suspended_at_ns: at_ns,
        });
        self.handover[first..]
            .iter()
            .cloned()
            .map(SeederAction::Send)
            .collect()
    }

    /// The source could not be suspended: the migration ends, the source runs on.
    fn suspend_failed(
        &mut self,
        reason: &(dyn std::error::Error + Send + Sync + 'static),
    ) -> Vec<SeederAction> {
        self.state = SeederState::Idle;
        let reason = format!(
            "the source could not be suspended: {}",
            farmap_core::error_chain(reason)
        );
        vec![
            SeederAction::Send(Msg::Abort {
                reason: reason.clone(),
            }),
            SeederAction::StopTracking { reason },
            SeederAction::Close,
        ]
    }

    /// The destination runs.
    fn resumed(&mut self, session: SessionId, resumed: bool) -> Vec<SeederAction> {
        self.state = SeederState::HandedOver {
            session,
            resumed: true,
        };
        // Instant mode: the rest is looked at once the destination runs, so that
        // the look does not compete with its resumption.
        if self.mode == Mode::Instant && !resumed {
            vec![SeederAction::ConfirmRest]
        } else {
            vec![]
        }
    }

    /// The leecher went away or gave up: before the hand-over the source runs on (resumed
    /// if it was being suspended); after it, the leecher may come back.
    fn leecher_left(&mut self) -> Vec<SeederAction> {
        use SeederAction as A;
        let mut out = Vec::new();
        let reason = match self.state {
            SeederState::Serving { .. } => {
                "the leecher went away before the hand-over; the source runs on"
            }
            SeederState::Suspending { .. } => {
                out.push(A::Resume);
                "the leecher went away during the finalization, before the hand-over; the \
                 source resumes"
            }
            _ => return vec![A::AwaitReconnect],
        };
        self.state = SeederState::Idle;
        out.push(A::StopTracking {
            reason: reason.into(),
        });
        out.push(A::Close);
        out
    }
}

/// A message's name, for errors.
pub fn msg_name(m: &Msg) -> &'static str {
    m.name()
}

/// What discarding one page of the final set costs the downtime (one `madvise` and one
/// round trip through the fault reader; measured 10–90 µs on a loaded 2-core VM).
pub const DISCARD_COST: Duration = Duration::from_micros(20);

/// When the leecher stops pre-copy rounds and finalizes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Convergence {
    /// The downtime budget: finalize once a final set as large as the last round's would be
    /// discarded in half of it (at [`DISCARD_COST`] per page).
    pub max_downtime: Duration,
    /// Most dirty rounds.
    pub max_rounds: u32,
    /// A round whose set is above this fraction of the previous one is not converging.
    pub min_shrink: f64,
}

impl Default for Convergence {
    /// 10 ms, 30 rounds, 0.9.
    fn default() -> Self {
        Self {
            max_downtime: Duration::from_millis(10),
            max_rounds: 30,
            min_shrink: 0.9,
        }
    }
}

/// What a leecher's dirty round did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoundResult {
    /// Pages in the round's set.
    pub pages: u64,
    /// Runs in it.
    pub runs: u64,
    /// Time spent writing the pages in place.
    pub apply: Duration,
    /// Whole round time (discard and refetch).
    pub elapsed: Duration,
}

/// What a leecher accepts of a seeder's region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeecherLimits {
    /// This host's page size: the seeder's must be the same (its dirty pages are discarded
    /// here page by page).
    pub page_size: u32,
    /// Largest region accepted, in bytes.
    pub max_size: u64,
    /// Most chunks a region may have (each costs the region some bookkeeping).
    pub max_chunks: u64,
}

impl LeecherLimits {
    /// A page of `page_size` bytes, regions of at most 1 TiB and 2^24 chunks.
    pub fn new(page_size: u32) -> Self {
        Self {
            page_size,
            max_size: 1 << 40,
            max_chunks: 1 << 24,
        }
    }
}

/// Why a seeder's `Welcome` cannot be acted on (nothing has been opened).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WelcomeError {
    /// Not a power of two of at least 4 KiB.
    #[error("the page size {page_size} is not a power of two of at least 4096 bytes")]
    PageSize {
        /// The page size offered.
        page_size: u32,
    },
    /// Another page size than this host's.
    #[error("the seeder's page size {page_size} differs from this host's {local}")]
    PageMismatch {
        /// The seeder's.
        page_size: u32,
        /// This host's.
        local: u32,
    },
    /// A chunk size that is not a power of two at least a page.
    #[error(
        "the chunk size {chunk_size} is not a power of two of at least the page size {page_size}"
    )]
    ChunkSize {
        /// The chunk size offered.
        chunk_size: u32,
        /// The page size offered.
        page_size: u32,
    },
    /// A region size of zero, not a whole number of pages, or above the limits.
    #[error(
        "the region size {size} is zero, not a whole number of {page_size}-byte pages, or above \
         this leecher's limits ({max_size} bytes, {max_chunks} chunks)"
    )]
    Size {
        /// The size offered.
        size: u64,
        /// The page size offered.
        page_size: u32,
        /// The largest size accepted.
        max_size: u64,
        /// The most chunks accepted.
        max_chunks: u64,
    },
}

/// Why a seeder's instant hand-over cannot be acted on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InstantError {
    /// The Welcome named no shared store.
    #[error("the seeder named no shared store, which an instant migration needs")]
    NoSharedStore,
    /// The hand-over came without a manifest.
    #[error("the hand-over of an instant migration came without a manifest")]
    NoManifest,
    /// The hand-over came without the confirmation of the chunks written lately.
    #[error("the hand-over of an instant migration came without a confirmation")]
    NoConfirm,
    /// A confirmation's chunk runs do not fit the region.
    #[error("a confirmation's chunk runs")]
    ConfirmRuns(#[source] RunError),
    /// The manifest does not describe the region.
    #[error("its manifest")]
    Manifest(#[source] ManifestError),
}

/// Checks a `Welcome`'s region description against `limits`.
pub fn check_welcome(
    size: u64,
    chunk_size: u32,
    page_size: u32,
    limits: &LeecherLimits,
) -> Result<(), WelcomeError> {
    if !page_size.is_power_of_two() || page_size < 4096 {
        return Err(WelcomeError::PageSize { page_size });
    }
    if page_size != limits.page_size {
        return Err(WelcomeError::PageMismatch {
            page_size,
            local: limits.page_size,
        });
    }
    if !chunk_size.is_power_of_two() || chunk_size < page_size {
        return Err(WelcomeError::ChunkSize {
            chunk_size,
            page_size,
        });
    }
    let chunks = size.div_ceil(u64::from(chunk_size));
    if size == 0
        || !size.is_multiple_of(u64::from(page_size))
        || size > limits.max_size
        || chunks > limits.max_chunks
    {
        return Err(WelcomeError::Size {
            size,
            page_size,
            max_size: limits.max_size,
            max_chunks: limits.max_chunks,
        });
    }
    Ok(())
}

/// What a seeder's message broke.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    /// A `Welcome` describing a region this leecher cannot hold.
    #[error("its Welcome")]
    Welcome(#[source] WelcomeError),
    /// An instant hand-over that cannot be acted on.
    #[error("its instant hand-over")]
    Instant(#[source] InstantError),
    /// Page runs that do not fit the region.
    #[error("the page runs of its {msg}")]
    Runs {
        /// The message.
        msg: &'static str,
        /// What is wrong with them.
        #[source]
        source: RunError,
    },
}

/// Why a [`Leecher`] gives up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AbortCause {
    /// The control connection ended before the hand-over.
    #[error("the seeder went away before the hand-over; the source keeps running")]
    SeederGone,
    /// The seeder sent `Abort` before the hand-over.
    #[error("the seeder abandoned the migration: {reason}")]
    SeederAborted {
        /// The seeder's reason.
        reason: String,
    },
    /// The seeder sent `Abort` after the hand-over.
    #[error(
        "the seeder failed after the hand-over ({reason}); the application runs here, but \
         chunks not yet fetched are lost"
    )]
    SeederFailedAfterHandOver {
        /// The seeder's reason.
        reason: String,
    },
    /// A message that has no place in this state.
    #[error("unexpected {msg} from the seeder in state {state:?}")]
    Unexpected {
        /// The message's name.
        msg: &'static str,
        /// The leecher's state.
        state: LeecherState,
    },
    /// A message that breaks the protocol (nothing of it was acted on).
    #[error("the seeder sent an invalid message")]
    Invalid(#[source] Violation),
}

/// Why pre-copy stopped and the leecher finalized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finalization {
    /// The last round's set fits the downtime budget.
    Converged,
    /// `max_rounds` was reached before the set fit the budget.
    MaxRounds,
    /// Rounds stopped shrinking before the set fit the budget.
    NotShrinking,
    /// The mode has no pre-copy (post-copy, instant).
    NoPreCopy,
}

/// Where a [`Leecher`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeecherState {
    /// Hello sent, waiting for Welcome.
    Connecting,
    /// Pre-copy: the background pull (round 0) or dirty round `round`.
    PreCopy {
        /// Round in progress.
        round: u32,
    },
    /// Finalize sent; waiting for the hand-over.
    Finalizing,
    /// The application runs here; the last chunks arrive.
    PostCopy,
    /// Done sent, waiting for Bye.
    Completing,
    /// Complete.
    Finished,
    /// Abandoned before the hand-over.
    Aborted,
}

/// Inputs of a [`Leecher`].
#[derive(Debug, Clone, PartialEq)]
pub enum LeecherInput {
    /// A control message arrived.
    Received(Msg),
    /// The control connection is gone.
    Disconnected,
    /// The control connection is back (after [`LeecherAction::Reconnect`]).
    Reconnected,
    /// The background pull went through every chunk.
    PullDone,
    /// A dirty round's discard and refetch are done.
    RoundDone(RoundResult),
    /// Every chunk is local (post-copy finished).
    AllLocal,
}

/// Actions a [`Leecher`] asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeecherAction {
    /// Send a message.
    Send(Msg),
    /// Open the destination region over the seeder's data plane and start pulling; answer
    /// with [`LeecherInput::PullDone`].
    OpenRegion {
        /// The seeder's session.
        session: SessionId,
        /// The region, as the Welcome described it.
        region: RegionInfo,
        /// The mode: only pre-copy pulls before the hand-over.
        mode: Mode,
    },
    /// Discard these pages and fetch them again; answer with [`LeecherInput::RoundDone`].
    Refresh {
        /// Pages.
        runs: Vec<Range<u64>>,
    },
    /// Discard these pages, then resume the application at once with its state; fetch the
    /// pages' chunks in the background (faults fetch theirs first); answer with
    /// [`LeecherInput::AllLocal`] when everything is local.
    Resume {
        /// Pages written at the source since the last round.
        runs: Vec<Range<u64>>,
        /// Application state.
        app_state: Bytes,
        /// Suspension time at the source (CLOCK_MONOTONIC ns).
        suspended_at_ns: u64,
        /// Instant mode: what the source found among the chunks written lately (the
        /// manifest came before, with [`LeecherAction::InstallManifest`]).
        confirm: Option<Confirm>,
        /// Post-copy mode: every chunk comes from the source (no page was pulled before).
        fetch_all: bool,
    },
    /// Instant mode, before the hand-over: where each chunk is (every chunk it places in the
    /// store is pending until a confirmation says otherwise).
    InstallManifest(Manifest),
    /// Instant mode, after the hand-over: the last confirmation.
    Confirm(Confirm),
    /// Reconnect the control connection; answer with [`LeecherInput::Reconnected`].
    Reconnect,
    /// The migration is complete: detach the region from the seeder.
    Finish,
    /// Abandon the migration (before the hand-over: the source runs on).
    Abort(AbortCause),
}

/// The destination side of a migration.
#[derive(Debug, Clone)]
pub struct Leecher {
    state: LeecherState,
    policy: Convergence,
    limits: LeecherLimits,
    session: SessionId,
    /// Pages of the region (from the Welcome): page runs must fall in them.
    pages: u64,
    last_pages: Option<u64>,
    /// Dirty rounds done.
    rounds: u32,
    finalization: Option<Finalization>,
    mode: Mode,
    /// Chunks of the region (from the Welcome).
    chunks: u64,
    /// Instant mode: a manifest was received (and installed).
    manifest_seen: bool,
    /// Instant mode: the confirmation received before the hand-over.
    hot: Option<Confirm>,
}

impl Leecher {
    /// The session the seeder gave (0 before its `Welcome`).
    pub fn session(&self) -> SessionId {
        self.session
    }

    /// A leecher that will converge by `policy` and accepts regions within `limits`.
    pub fn new(policy: Convergence, limits: LeecherLimits) -> Self {
        Self {
            state: LeecherState::Connecting,
            policy,
            limits,
            session: 0,
            pages: 0,
            last_pages: None,
            rounds: 0,
            finalization: None,
            mode: Mode::Precopy,
            chunks: 0,
            manifest_seen: false,
            hot: None,
        }
    }

    /// The same, moving the region in `mode`.
    pub fn with_mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// The mode asked for.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Why pre-copy stopped, once it has.
    pub fn finalization(&self) -> Option<Finalization> {
        self.finalization
    }

    /// Gives up on a message that breaks the protocol: tells the seeder, acts on nothing of it.
    fn invalid(&mut self, v: Violation) -> Vec<LeecherAction> {
        let cause = AbortCause::Invalid(v);
        let reason = farmap_core::error_chain(&cause);
        if matches!(
            self.state,
            LeecherState::PostCopy | LeecherState::Completing
        ) {
            // The application runs here: keep going (the seeder may recover); say why.
            return vec![LeecherAction::Abort(cause)];
        }
        self.state = LeecherState::Aborted;
        vec![
            LeecherAction::Send(Msg::Abort { reason }),
            LeecherAction::Abort(cause),
        ]
    }

    /// The first actions: say hello.
    pub fn start(&self) -> Vec<LeecherAction> {
        vec![LeecherAction::Send(Msg::Hello {
            session: 0,
            mode: self.mode,
        })]
    }

    /// Where it is.
    pub fn state(&self) -> LeecherState {
        self.state
    }

    /// Dirty rounds done so far.
    pub fn rounds(&self) -> u32 {
        self.rounds
    }

    /// Whether round results say: finalize now, and why.
    fn converged(&self, r: &RoundResult) -> Option<Finalization> {
        // The final set is at most about as large as this round's (rounds shrink it), and each
        // of its pages is discarded during the downtime.
        let expected = DISCARD_COST.as_secs_f64() * r.pages as f64;
        if r.pages == 0 || expected <= self.policy.max_downtime.as_secs_f64() / 2.0 {
            return Some(Finalization::Converged);
        }
        if self.rounds >= self.policy.max_rounds {
            return Some(Finalization::MaxRounds);
        }
        matches!(self.last_pages, Some(prev) if prev > 0
            && r.pages as f64 > prev as f64 * self.policy.min_shrink)
        .then_some(Finalization::NotShrinking)
    }

    /// Feeds one input; returns the actions to carry out, in order.
    pub fn step(&mut self, input: LeecherInput) -> Vec<LeecherAction> {
        use LeecherAction as A;
        use LeecherState as S;
        match (self.state, input) {
            (S::Connecting, LeecherInput::Received(Msg::Welcome { session, region })) => {
                self.welcomed(session, region)
            }
            (S::Finalizing, LeecherInput::Received(Msg::Manifest { runs, pushed }))
                if self.mode == Mode::Instant =>
            {
                self.install_manifest(runs, pushed)
            }
            (
                S::Finalizing | S::PostCopy | S::Completing,
                LeecherInput::Received(Msg::Confirm { at_source, pending }),
            ) if self.mode == Mode::Instant => self.confirm(at_source, pending),
            // A manifest sent again after a reconnect: already acted on.
            (S::PostCopy | S::Completing, LeecherInput::Received(Msg::Manifest { .. }))
                if self.mode == Mode::Instant =>
            {
                vec![]
            }
            (S::PreCopy { round: 0 }, LeecherInput::PullDone) => {
                self.state = S::PreCopy { round: 1 };
                vec![A::Send(Msg::DirtyRequest { round: 1 })]
            }
            (S::PreCopy { round }, LeecherInput::Received(Msg::Dirty { round: r, runs }))
                if r == round && round > 0 =>
            {
                if let Err(source) = check_runs(&runs, self.pages) {
                    return self.invalid(Violation::Runs {
                        msg: "Dirty",
                        source,
                    });
                }
                vec![A::Refresh { runs }]
            }
            (S::PreCopy { round }, LeecherInput::RoundDone(result)) if round > 0 => {
                self.round_done(round, &result)
            }
            (
                S::Finalizing,
                LeecherInput::Received(Msg::HandOver {
                    runs,
                    app_state,
                    suspended_at_ns,
                }),
            ) => self.handed_over(runs, app_state, suspended_at_ns),
            (S::PostCopy, LeecherInput::AllLocal) => {
                self.state = S::Completing;
                vec![A::Send(Msg::Done)]
            }
            (S::Completing, LeecherInput::Received(Msg::Bye)) => {
                self.state = S::Finished;
                vec![A::Finish]
            }
            // After Finalize, the connection is needed again: reconnect with the session.
            (S::Finalizing | S::PostCopy | S::Completing, LeecherInput::Disconnected) => {
                vec![A::Reconnect]
            }
            (S::Finalizing | S::PostCopy | S::Completing, LeecherInput::Reconnected) => {
                vec![A::Send(Msg::Hello {
                    session: self.session,
                    mode: self.mode,
                })]
            }
            (S::Finalizing | S::PostCopy, LeecherInput::Received(Msg::Welcome { .. })) => vec![],
            (S::Completing, LeecherInput::Received(Msg::Welcome { .. })) => {
                vec![A::Send(Msg::Done)]
            }
            // A hand-over sent again after a reconnect: already resumed.
            (S::PostCopy, LeecherInput::Received(Msg::HandOver { .. })) => {
                vec![A::Send(Msg::Resumed)]
            }
            (S::Completing, LeecherInput::Received(Msg::HandOver { .. })) => vec![],
            (S::Connecting | S::PreCopy { .. }, LeecherInput::Disconnected) => {
                self.state = S::Aborted;
                vec![A::Abort(AbortCause::SeederGone)]
            }
            (
                S::Connecting | S::PreCopy { .. } | S::Finalizing,
                LeecherInput::Received(Msg::Abort { reason }),
            ) => {
                self.state = S::Aborted;
                vec![A::Abort(AbortCause::SeederAborted { reason })]
            }
            (S::PostCopy | S::Completing, LeecherInput::Received(Msg::Abort { reason })) => {
                vec![A::Abort(AbortCause::SeederFailedAfterHandOver { reason })]
            }
            (S::Finished | S::Aborted, _) => vec![],
            (state, LeecherInput::Received(m)) => self.unexpected(state, &m),
            (_, _) => vec![],
        }
    }

    /// The seeder's `Welcome`: checked, then the region opens (pre-copy: and pulls).
    fn welcomed(&mut self, session: SessionId, region: RegionInfo) -> Vec<LeecherAction> {
        let RegionInfo {
            size,
            chunk_size,
            page_size,
            ..
        } = region;
        if let Err(e) = check_welcome(size, chunk_size, page_size, &self.limits) {
            return self.invalid(Violation::Welcome(e));
        }
        if self.mode == Mode::Instant && region.shared.is_empty() {
            return self.invalid(Violation::Instant(InstantError::NoSharedStore));
        }
        self.session = session;
        self.pages = size / u64::from(page_size);
        self.chunks = size.div_ceil(u64::from(chunk_size));
        let open = LeecherAction::OpenRegion {
            session,
            region,
            mode: self.mode,
        };
        if self.mode == Mode::Precopy {
            self.state = LeecherState::PreCopy { round: 0 };
            vec![open]
        } else {
            // Nothing to pull first: hand over at once.
            self.finalization = Some(Finalization::NoPreCopy);
            self.state = LeecherState::Finalizing;
            vec![open, LeecherAction::Send(Msg::Finalize)]
        }
    }

    /// Instant mode: the manifest, checked, is installed and acknowledged.
    fn install_manifest(
        &mut self,
        runs: Vec<ManifestRun>,
        pushed: Vec<(u64, u64)>,
    ) -> Vec<LeecherAction> {
        if let Err(e) = check_manifest(&runs, &pushed, self.chunks) {
            return self.invalid(Violation::Instant(InstantError::Manifest(e)));
        }
        self.manifest_seen = true;
        self.hot = None;
        // The runner installs it before it sends the acknowledgement (actions run
        // in order).
        vec![
            LeecherAction::InstallManifest(Manifest { runs, pushed }),
            LeecherAction::Send(Msg::Installed),
        ]
    }

    /// Instant mode: a confirmation, checked; kept for the hand-over if it comes before it.
    fn confirm(
        &mut self,
        at_source: Vec<Range<u64>>,
        pending: Vec<Range<u64>>,
    ) -> Vec<LeecherAction> {
        for runs in [&at_source, &pending] {
            if let Err(e) = check_runs(runs, self.chunks) {
                return self.invalid(Violation::Instant(InstantError::ConfirmRuns(e)));
            }
        }
        if !self.manifest_seen {
            return self.invalid(Violation::Instant(InstantError::NoManifest));
        }
        let c = Confirm { at_source, pending };
        if self.state == LeecherState::Finalizing {
            self.hot = Some(c);
            vec![]
        } else {
            vec![LeecherAction::Confirm(c)]
        }
    }

    /// A dirty round is done: finalize if it converged, else ask for the next.
    fn round_done(&mut self, round: u32, result: &RoundResult) -> Vec<LeecherAction> {
        self.rounds = round;
        let done = self.converged(result);
        self.last_pages = Some(result.pages);
        if done.is_some() {
            self.finalization = done;
            self.state = LeecherState::Finalizing;
            vec![LeecherAction::Send(Msg::Finalize)]
        } else {
            self.state = LeecherState::PreCopy { round: round + 1 };
            vec![LeecherAction::Send(Msg::DirtyRequest { round: round + 1 })]
        }
    }

    /// The hand-over, checked: the application resumes here.
    fn handed_over(
        &mut self,
        runs: Vec<Range<u64>>,
        app_state: Bytes,
        suspended_at_ns: u64,
    ) -> Vec<LeecherAction> {
        if let Err(source) = check_runs(&runs, self.pages) {
            return self.invalid(Violation::Runs {
                msg: "HandOver",
                source,
            });
        }
        let confirm = match self.mode {
            Mode::Instant if !self.manifest_seen => {
                return self.invalid(Violation::Instant(InstantError::NoManifest))
            }
            Mode::Instant => match self.hot.take() {
                Some(c) => Some(c),
                None => return self.invalid(Violation::Instant(InstantError::NoConfirm)),
            },
            _ => None,
        };
        self.state = LeecherState::PostCopy;
        vec![
            LeecherAction::Resume {
                runs,
                app_state,
                suspended_at_ns,
                confirm,
                fetch_all: self.mode == Mode::Postcopy,
            },
            LeecherAction::Send(Msg::Resumed),
        ]
    }

    /// A message with no place in `state`: after the hand-over, said and survived; before
    /// it, the migration is abandoned.
    fn unexpected(&mut self, state: LeecherState, m: &Msg) -> Vec<LeecherAction> {
        let cause = AbortCause::Unexpected {
            msg: msg_name(m),
            state,
        };
        if matches!(state, LeecherState::PostCopy | LeecherState::Completing) {
            vec![LeecherAction::Abort(cause)]
        } else {
            self.state = LeecherState::Aborted;
            vec![
                LeecherAction::Send(Msg::Abort {
                    reason: cause.to_string(),
                }),
                LeecherAction::Abort(cause),
            ]
        }
    }
}

/// Pages in a set of runs (re-exported for runners).
pub fn pages(runs: &[Range<u64>]) -> u64 {
    run_pages(runs)
}

#[cfg(test)]
#[path = "machine_tests.rs"]
mod tests;
