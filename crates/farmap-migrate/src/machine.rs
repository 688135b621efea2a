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
//! A lost connection before the hand-over aborts (the source keeps running, tracking
//! stops); after `Finalize` the leecher reconnects with its session, and the seeder, if it
//! handed over, sends the hand-over again.

use std::ops::Range;
use std::time::Duration;

use bytes::Bytes;

use crate::msg::{run_pages, Msg};

/// What a seeder knows about its region, sent in `Welcome`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfo {
    /// Region size in bytes.
    pub size: u64,
    /// Chunk size of the region.
    pub chunk_size: u32,
    /// Page size (the tracking unit).
    pub page_size: u32,
    /// Data plane TCP port (0 for a Unix socket).
    pub data_port: u16,
    /// Boot id of the seeder's host.
    pub boot_id: [u8; 16],
}

/// Where a [`Seeder`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeederState {
    /// No leecher; the application runs untouched.
    Idle,
    /// A leecher pulls; writes are tracked.
    Serving {
        /// The session.
        session: u64,
    },
    /// Finalize asked: the application is being suspended.
    Suspending {
        /// The session.
        session: u64,
    },
    /// Ownership moved; reads are still served (post-copy).
    HandedOver {
        /// The session.
        session: u64,
        /// Whether the leecher said it resumed.
        resumed: bool,
    },
    /// The leecher has everything; the region is released.
    Released,
}

/// Inputs of a [`Seeder`].
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// Result of [`SeederAction::Suspend`]: suspended, final dirty set taken.
    Suspended {
        /// Pages written since the last set.
        runs: Vec<Range<u64>>,
        /// Application state.
        app_state: Bytes,
        /// CLOCK_MONOTONIC of the suspension (ns).
        at_ns: u64,
    },
    /// [`SeederAction::Suspend`] failed (the application runs on).
    SuspendFailed(String),
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
    /// Suspend the application, take the final dirty set and its state; answer with
    /// [`SeederInput::Suspended`] or [`SeederInput::SuspendFailed`].
    Suspend,
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
    next_session: u64,
    /// The hand-over sent, to send again to a leecher that reconnects before resuming.
    handover: Option<Msg>,
}

impl Seeder {
    /// A seeder of the region described by `info`, idle. `session_seed` makes session ids
    /// unique across seeder restarts (e.g. the process id and the time).
    pub fn new(info: RegionInfo, session_seed: u64) -> Self {
        Self {
            info,
            state: SeederState::Idle,
            next_session: session_seed.max(1),
            handover: None,
        }
    }

    /// Where it is.
    pub fn state(&self) -> SeederState {
        self.state
    }

    fn welcome(&self, session: u64) -> Msg {
        Msg::Welcome {
            session,
            size: self.info.size,
            chunk_size: self.info.chunk_size,
            page_size: self.info.page_size,
            data_port: self.info.data_port,
            boot_id: self.info.boot_id,
        }
    }

    fn refuse(reason: &str) -> Vec<SeederAction> {
        vec![
            SeederAction::Send(Msg::Abort {
                reason: reason.into(),
            }),
            SeederAction::Close,
        ]
    }

    /// Feeds one input; returns the actions to carry out, in order.
    pub fn step(&mut self, input: SeederInput) -> Vec<SeederAction> {
        use SeederAction as A;
        use SeederState as S;
        match (self.state, input) {
            (S::Idle, SeederInput::Received(Msg::Hello { session: 0 })) => {
                let session = self.next_session;
                self.next_session += 1;
                self.state = S::Serving { session };
                vec![A::ResetTracking, A::Send(self.welcome(session))]
            }
            (S::Idle, SeederInput::Received(Msg::Hello { .. })) => Self::refuse(
                "the seeder has no such session (it was abandoned before the hand-over)",
            ),
            (
                S::HandedOver { session, resumed },
                SeederInput::Received(Msg::Hello { session: s }),
            ) if s == session => {
                let mut out = vec![A::Send(self.welcome(session))];
                if let (false, Some(h)) = (resumed, &self.handover) {
                    out.push(A::Send(h.clone()));
                }
                out
            }
            (
                S::Serving { .. } | S::Suspending { .. } | S::HandedOver { .. },
                SeederInput::Received(Msg::Hello { .. }),
            ) => Self::refuse("the seeder is busy with another leecher"),
            (S::Serving { .. }, SeederInput::Received(Msg::DirtyRequest { round })) => {
                vec![A::TakeDirty { round }]
            }
            (S::Serving { .. }, SeederInput::Dirty { round, runs }) => {
                vec![A::Send(Msg::Dirty { round, runs })]
            }
            (S::Serving { session }, SeederInput::Received(Msg::Finalize)) => {
                self.state = S::Suspending { session };
                vec![A::Suspend]
            }
            (
                S::Suspending { session },
                SeederInput::Suspended {
                    runs,
                    app_state,
                    at_ns,
                },
            ) => {
                self.state = S::HandedOver {
                    session,
                    resumed: false,
                };
                let h = Msg::HandOver {
                    runs,
                    app_state,
                    suspended_at_ns: at_ns,
                };
                self.handover = Some(h.clone());
                vec![A::Send(h)]
            }
            (S::Suspending { .. }, SeederInput::SuspendFailed(reason)) => {
                self.state = S::Idle;
                let reason = format!("the source could not be suspended: {reason}");
                vec![
                    A::Send(Msg::Abort {
                        reason: reason.clone(),
                    }),
                    A::StopTracking { reason },
                    A::Close,
                ]
            }
            (S::HandedOver { session, .. }, SeederInput::Received(Msg::Resumed)) => {
                self.state = S::HandedOver {
                    session,
                    resumed: true,
                };
                vec![]
            }
            (S::HandedOver { .. }, SeederInput::Received(Msg::Done)) => {
                self.state = S::Released;
                vec![A::Send(Msg::Bye), A::Release, A::Close]
            }
            (
                S::Serving { .. },
                SeederInput::Disconnected | SeederInput::Received(Msg::Abort { .. }),
            ) => {
                self.state = S::Idle;
                vec![
                    A::StopTracking {
                        reason: "the leecher went away before the hand-over; the source runs on"
                            .into(),
                    },
                    A::Close,
                ]
            }
            (
                S::Suspending { .. },
                SeederInput::Disconnected | SeederInput::Received(Msg::Abort { .. }),
            ) => {
                self.state = S::Idle;
                vec![
                    A::Resume,
                    A::StopTracking {
                        reason: "the leecher went away during the finalization, before the \
                                 hand-over; the source resumes"
                            .into(),
                    },
                    A::Close,
                ]
            }
            (
                S::HandedOver { .. },
                SeederInput::Disconnected | SeederInput::Received(Msg::Abort { .. }),
            ) => {
                vec![A::AwaitReconnect]
            }
            (S::Idle | S::Released, SeederInput::Disconnected) => vec![],
            (_, SeederInput::Received(other)) => Self::refuse(&format!(
                "unexpected {} from the leecher in this state",
                msg_name(&other)
            )),
            (_, _) => vec![],
        }
    }
}

/// A message's name, for errors.
pub fn msg_name(m: &Msg) -> &'static str {
    match m {
        Msg::Hello { .. } => "Hello",
        Msg::Welcome { .. } => "Welcome",
        Msg::DirtyRequest { .. } => "DirtyRequest",
        Msg::Dirty { .. } => "Dirty",
        Msg::Finalize => "Finalize",
        Msg::HandOver { .. } => "HandOver",
        Msg::Resumed => "Resumed",
        Msg::Done => "Done",
        Msg::Bye => "Bye",
        Msg::Abort { .. } => "Abort",
    }
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
        session: u64,
        /// Region size.
        size: u64,
        /// Chunk size.
        chunk_size: u32,
        /// Page size.
        page_size: u32,
        /// Data plane port.
        data_port: u16,
        /// Seeder boot id.
        boot_id: [u8; 16],
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
    },
    /// Reconnect the control connection; answer with [`LeecherInput::Reconnected`].
    Reconnect,
    /// The migration is complete: detach the region from the seeder.
    Finish,
    /// Abandon the migration (before the hand-over: the source runs on).
    Abort(String),
}

/// The destination side of a migration.
#[derive(Debug, Clone)]
pub struct Leecher {
    state: LeecherState,
    policy: Convergence,
    session: u64,
    last_pages: Option<u64>,
    /// Dirty rounds done.
    rounds: u32,
}

impl Leecher {
    /// A leecher that will converge by `policy`.
    pub fn new(policy: Convergence) -> Self {
        Self {
            state: LeecherState::Connecting,
            policy,
            session: 0,
            last_pages: None,
            rounds: 0,
        }
    }

    /// The first actions: say hello.
    pub fn start(&self) -> Vec<LeecherAction> {
        vec![LeecherAction::Send(Msg::Hello { session: 0 })]
    }

    /// Where it is.
    pub fn state(&self) -> LeecherState {
        self.state
    }

    /// Dirty rounds done so far.
    pub fn rounds(&self) -> u32 {
        self.rounds
    }

    /// Whether round results say: finalize now.
    fn converged(&self, r: &RoundResult) -> bool {
        if self.rounds >= self.policy.max_rounds {
            return true;
        }
        // The final set is at most about as large as this round's (rounds shrink it), and each
        // of its pages is discarded during the downtime.
        let expected = DISCARD_COST.as_secs_f64() * r.pages as f64;
        if r.pages == 0 || expected <= self.policy.max_downtime.as_secs_f64() / 2.0 {
            return true;
        }
        matches!(self.last_pages, Some(prev) if prev > 0
            && r.pages as f64 > prev as f64 * self.policy.min_shrink)
    }

    /// Feeds one input; returns the actions to carry out, in order.
    pub fn step(&mut self, input: LeecherInput) -> Vec<LeecherAction> {
        use LeecherAction as A;
        use LeecherState as S;
        match (self.state, input) {
            (
                S::Connecting,
                LeecherInput::Received(Msg::Welcome {
                    session,
                    size,
                    chunk_size,
                    page_size,
                    data_port,
                    boot_id,
                }),
            ) => {
                self.session = session;
                self.state = S::PreCopy { round: 0 };
                vec![A::OpenRegion {
                    session,
                    size,
                    chunk_size,
                    page_size,
                    data_port,
                    boot_id,
                }]
            }
            (S::PreCopy { round: 0 }, LeecherInput::PullDone) => {
                self.state = S::PreCopy { round: 1 };
                vec![A::Send(Msg::DirtyRequest { round: 1 })]
            }
            (S::PreCopy { round }, LeecherInput::Received(Msg::Dirty { round: r, runs }))
                if r == round && round > 0 =>
            {
                vec![A::Refresh { runs }]
            }
            (S::PreCopy { round }, LeecherInput::RoundDone(result)) if round > 0 => {
                self.rounds = round;
                let done = self.converged(&result);
                self.last_pages = Some(result.pages);
                if done {
                    self.state = S::Finalizing;
                    vec![A::Send(Msg::Finalize)]
                } else {
                    self.state = S::PreCopy { round: round + 1 };
                    vec![A::Send(Msg::DirtyRequest { round: round + 1 })]
                }
            }
            (
                S::Finalizing,
                LeecherInput::Received(Msg::HandOver {
                    runs,
                    app_state,
                    suspended_at_ns,
                }),
            ) => {
                self.state = S::PostCopy;
                vec![
                    A::Resume {
                        runs,
                        app_state,
                        suspended_at_ns,
                    },
                    A::Send(Msg::Resumed),
                ]
            }
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
                })]
            }
            (S::Finalizing | S::PostCopy, LeecherInput::Received(Msg::Welcome { .. })) => vec![],
            (S::Completing, LeecherInput::Received(Msg::Welcome { .. })) => {
                vec![A::Send(Msg::Done)]
            }
            // A hand-over sent again after a reconnect: already resumed.
            (S::PostCopy | S::Completing, LeecherInput::Received(Msg::HandOver { .. })) => {
                if self.state == S::PostCopy {
                    vec![A::Send(Msg::Resumed)]
                } else {
                    vec![]
                }
            }
            (S::Connecting | S::PreCopy { .. }, LeecherInput::Disconnected) => {
                self.state = S::Aborted;
                vec![A::Abort(
                    "the seeder went away before the hand-over; the source keeps running".into(),
                )]
            }
            (
                S::Connecting | S::PreCopy { .. } | S::Finalizing,
                LeecherInput::Received(Msg::Abort { reason }),
            ) => {
                self.state = S::Aborted;
                vec![A::Abort(format!(
                    "the seeder abandoned the migration: {reason}"
                ))]
            }
            (S::PostCopy | S::Completing, LeecherInput::Received(Msg::Abort { reason })) => {
                vec![A::Abort(format!(
                    "the seeder failed after the hand-over ({reason}); the application runs \
                     here, but chunks not yet fetched are lost"
                ))]
            }
            (S::Finished | S::Aborted, _) => vec![],
            (state, LeecherInput::Received(m)) => {
                let reason = format!(
                    "unexpected {} from the seeder in state {state:?}",
                    msg_name(&m)
                );
                if matches!(state, S::PostCopy | S::Completing) {
                    vec![A::Abort(reason)]
                } else {
                    self.state = S::Aborted;
                    vec![
                        A::Send(Msg::Abort {
                            reason: reason.clone(),
                        }),
                        A::Abort(reason),
                    ]
                }
            }
            (_, _) => vec![],
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
