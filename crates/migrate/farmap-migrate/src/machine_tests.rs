#![allow(clippy::single_range_in_vec_init)] // page runs: one run is a real case
use super::*;
use std::ops::Range;

fn info() -> RegionInfo {
    RegionInfo {
        size: 1 << 20,
        chunk_size: 65536,
        page_size: 4096,
        data_port: 9,
        boot_id: [1; 16],
        shared: String::new(),
    }
}

fn round(pages: u64) -> RoundResult {
    RoundResult {
        pages,
        runs: pages,
        apply: Duration::from_millis(1),
        elapsed: Duration::from_millis(2),
    }
}

/// Feeds the seeder's sends to the leecher; returns the leecher's actions.
fn deliver(l: &mut Leecher, actions: Vec<SeederAction>) -> Vec<LeecherAction> {
    let mut out = Vec::new();
    for a in actions {
        if let SeederAction::Send(m) = a {
            out.extend(l.step(LeecherInput::Received(m)));
        }
    }
    out
}

fn sent(actions: &[LeecherAction]) -> Vec<Msg> {
    actions
        .iter()
        .filter_map(|a| match a {
            LeecherAction::Send(m) => Some(m.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn a_whole_migration_step_by_step() {
    let mut s = Seeder::new(info(), 5);
    let mut l = Leecher::new(Convergence::default(), LeecherLimits::new(4096));
    let hello = sent(&l.start());
    let a = s.step(SeederInput::Received(hello[0].clone()));
    assert_eq!(a[0], SeederAction::ResetTracking);
    assert_eq!(s.state(), SeederState::Serving { session: 5 });
    let la = deliver(&mut l, a);
    assert!(matches!(
        la[0],
        LeecherAction::OpenRegion {
            session: 5,
            region: RegionInfo { data_port: 9, .. },
            ..
        }
    ));
    let la = l.step(LeecherInput::PullDone);
    assert_eq!(sent(&la), vec![Msg::DirtyRequest { round: 1 }]);
    let a = s.step(SeederInput::Received(Msg::DirtyRequest { round: 1 }));
    assert_eq!(a, vec![SeederAction::TakeDirty { round: 1 }]);
    let a = s.step(SeederInput::Dirty {
        round: 1,
        runs: vec![0..100],
    });
    let la = deliver(&mut l, a);
    assert_eq!(la, vec![LeecherAction::Refresh { runs: vec![0..100] }]);
    // 1000 pages would take 20 ms to discard: too slow for a 10 ms budget, go on.
    let la = l.step(LeecherInput::RoundDone(round(1000)));
    assert_eq!(sent(&la), vec![Msg::DirtyRequest { round: 2 }]);
    let _ = s.step(SeederInput::Received(Msg::DirtyRequest { round: 2 }));
    let la = deliver(
        &mut l,
        s.step(SeederInput::Dirty {
            round: 2,
            runs: vec![3..5],
        }),
    );
    assert_eq!(la.len(), 1);
    // 2 pages: converged.
    let la = l.step(LeecherInput::RoundDone(round(2)));
    assert_eq!(sent(&la), vec![Msg::Finalize]);
    assert_eq!(l.state(), LeecherState::Finalizing);
    assert_eq!(l.rounds(), 2);
    assert_eq!(
        s.step(SeederInput::Received(Msg::Finalize)),
        vec![SeederAction::Suspend { instant: false }]
    );
    let a = s.step(SeederInput::Suspended {
        runs: vec![7..8],
        confirm: None,
        app_state: Bytes::from_static(b"op=42"),
        at_ns: 1,
    });
    assert!(matches!(
        s.state(),
        SeederState::HandedOver { resumed: false, .. }
    ));
    let la = deliver(&mut l, a);
    assert!(
        matches!(&la[0], LeecherAction::Resume { runs, app_state, .. }
        if runs == &vec![7..8] && &app_state[..] == b"op=42")
    );
    assert_eq!(sent(&la), vec![Msg::Resumed]);
    assert!(s.step(SeederInput::Received(Msg::Resumed)).is_empty());
    let la = l.step(LeecherInput::AllLocal);
    assert_eq!(sent(&la), vec![Msg::Done]);
    let a = s.step(SeederInput::Received(Msg::Done));
    assert!(a.contains(&SeederAction::Release));
    assert_eq!(s.state(), SeederState::Released);
    assert_eq!(deliver(&mut l, a), vec![LeecherAction::Finish]);
    assert_eq!(l.state(), LeecherState::Finished);
}

#[test]
fn leecher_gone_before_the_hand_over_leaves_the_source_running() {
    let mut s = Seeder::new(info(), 1);
    s.step(SeederInput::Received(Msg::Hello {
        session: 0,
        mode: Mode::Precopy,
    }));
    let a = s.step(SeederInput::Disconnected);
    assert!(matches!(a[0], SeederAction::StopTracking { .. }));
    assert_eq!(s.state(), SeederState::Idle);
    // During the finalization, before the hand-over: resume.
    s.step(SeederInput::Received(Msg::Hello {
        session: 0,
        mode: Mode::Precopy,
    }));
    s.step(SeederInput::Received(Msg::Finalize));
    let a = s.step(SeederInput::Disconnected);
    assert_eq!(a[0], SeederAction::Resume);
    // A new leecher may come.
    assert!(matches!(
        s.step(SeederInput::Received(Msg::Hello {
            session: 0,
            mode: Mode::Precopy
        }))[0],
        SeederAction::ResetTracking
    ));
}

#[test]
fn seeder_gone_before_finalize_aborts_the_leecher() {
    let mut l = Leecher::new(Convergence::default(), LeecherLimits::new(4096));
    l.step(LeecherInput::Received(Msg::Welcome {
        session: 3,
        region: RegionInfo {
            data_port: 1,
            boot_id: [0; 16],
            ..info()
        },
    }));
    let a = l.step(LeecherInput::Disconnected);
    assert_eq!(a, vec![LeecherAction::Abort(AbortCause::SeederGone)]);
    assert_eq!(l.state(), LeecherState::Aborted);
}

#[test]
fn a_connection_lost_after_finalize_is_resumed_with_the_session() {
    let mut s = Seeder::new(info(), 8);
    let mut l = Leecher::new(
        Convergence {
            max_rounds: 1,
            ..Convergence::default()
        },
        LeecherLimits::new(4096),
    );
    deliver(
        &mut l,
        s.step(SeederInput::Received(Msg::Hello {
            session: 0,
            mode: Mode::Precopy,
        })),
    );
    l.step(LeecherInput::PullDone);
    s.step(SeederInput::Received(Msg::DirtyRequest { round: 1 }));
    deliver(
        &mut l,
        s.step(SeederInput::Dirty {
            round: 1,
            runs: vec![],
        }),
    );
    assert_eq!(
        sent(&l.step(LeecherInput::RoundDone(round(0)))),
        vec![Msg::Finalize]
    );
    s.step(SeederInput::Received(Msg::Finalize));
    let handover = s.step(SeederInput::Suspended {
        runs: vec![],
        confirm: None,
        app_state: Bytes::new(),
        at_ns: 0,
    });
    // The hand-over is lost with the connection.
    drop(handover);
    assert_eq!(
        s.step(SeederInput::Disconnected),
        vec![SeederAction::AwaitReconnect]
    );
    assert_eq!(
        l.step(LeecherInput::Disconnected),
        vec![LeecherAction::Reconnect]
    );
    let hello = sent(&l.step(LeecherInput::Reconnected));
    assert_eq!(
        hello,
        vec![Msg::Hello {
            session: 8,
            mode: Mode::Precopy
        }]
    );
    let a = s.step(SeederInput::Received(hello[0].clone()));
    assert!(matches!(
        a[0],
        SeederAction::Send(Msg::Welcome { session: 8, .. })
    ));
    // The seeder sends the hand-over again; the leecher resumes once.
    assert!(matches!(a[1], SeederAction::Send(Msg::HandOver { .. })));
    let la = l.step(empty_handover());
    assert!(matches!(la[0], LeecherAction::Resume { .. }));
    let again = l.step(empty_handover());
    assert_eq!(sent(&again), vec![Msg::Resumed]);
    // A stranger's session is refused.
    let mut s2 = Seeder::new(info(), 1);
    assert!(matches!(
        s2.step(SeederInput::Received(Msg::Hello {
            session: 77,
            mode: Mode::Precopy
        }))[0],
        SeederAction::Send(Msg::Abort { .. })
    ));
}

#[test]
fn rounds_stop_when_the_set_stops_shrinking() {
    let mut l = Leecher::new(Convergence::default(), LeecherLimits::new(4096));
    l.step(LeecherInput::Received(Msg::Welcome {
        session: 1,
        region: RegionInfo {
            data_port: 1,
            boot_id: [0; 16],
            ..info()
        },
    }));
    l.step(LeecherInput::PullDone);
    assert_eq!(
        sent(&l.step(LeecherInput::RoundDone(round(1000)))),
        vec![Msg::DirtyRequest { round: 2 }]
    );
    assert_eq!(
        sent(&l.step(LeecherInput::RoundDone(round(500)))),
        vec![Msg::DirtyRequest { round: 3 }]
    );
    assert_eq!(
        sent(&l.step(LeecherInput::RoundDone(round(480)))),
        vec![Msg::Finalize]
    );
}

fn welcome(size: u64, chunk_size: u32, page_size: u32) -> Msg {
    Msg::Welcome {
        session: 1,
        region: RegionInfo {
            size,
            chunk_size,
            page_size,
            data_port: 1,
            boot_id: [0; 16],
            shared: String::new(),
        },
    }
}

/// A leecher past its Welcome (1 MiB of 4 KiB pages: 256 pages), at dirty round 1.
fn at_round_one() -> Leecher {
    let mut l = Leecher::new(Convergence::default(), LeecherLimits::new(4096));
    l.step(LeecherInput::Received(welcome(1 << 20, 65536, 4096)));
    l.step(LeecherInput::PullDone);
    l
}

fn invalid(actions: &[LeecherAction]) -> &Violation {
    match actions.last() {
        Some(LeecherAction::Abort(AbortCause::Invalid(v))) => v,
        other => panic!("expected an abort for an invalid message, got {other:?}"),
    }
}

#[test]
fn bad_welcomes_are_refused_before_anything_is_opened() {
    let cases = [
        (welcome(1 << 20, 65536, 0), "power of two"),
        (welcome(1 << 20, 65536, 3), "power of two"),
        (welcome(1 << 20, 65536, 1 << 30), "differs from this host"),
        (welcome(1 << 20, 1 << 30, 1 << 30), "differs from this host"),
        (welcome(1 << 20, 2048, 4096), "chunk size"),
        (welcome(1 << 20, 65536 + 4096, 4096), "chunk size"),
        (welcome(0, 65536, 4096), "region size"),
        (welcome((1 << 20) + 1, 65536, 4096), "region size"),
        (welcome(1 << 50, 65536, 4096), "region size"),
        (welcome(1 << 39, 4096, 4096), "region size"),
    ];
    for (msg, says) in cases {
        let mut l = Leecher::new(Convergence::default(), LeecherLimits::new(4096));
        let a = l.step(LeecherInput::Received(msg.clone()));
        assert!(
            !a.iter()
                .any(|a| matches!(a, LeecherAction::OpenRegion { .. })),
            "{msg:?} opened a region"
        );
        let v = invalid(&a);
        let text = farmap_core::error_chain(v);
        assert!(text.contains(says), "{msg:?}: {text}");
        assert!(
            matches!(&a[0], LeecherAction::Send(Msg::Abort { reason }) if reason.contains(says))
        );
        assert_eq!(l.state(), LeecherState::Aborted);
    }
}

#[test]
fn page_runs_outside_the_region_are_refused_as_ranges() {
    let bad: [Vec<Range<u64>>; 5] = [
        vec![250..257],
        vec![0..(1 << 32)],
        vec![0..1 << 32, 1 << 32..2 << 32],
        vec![10..20, 15..30],
        vec![10..20, 0..5],
    ];
    for runs in bad {
        let mut l = at_round_one();
        let a = l.step(LeecherInput::Received(Msg::Dirty {
            round: 1,
            runs: runs.clone(),
        }));
        assert!(
            matches!(invalid(&a), Violation::Runs { msg: "Dirty", .. }),
            "{runs:?}"
        );
        assert_eq!(l.state(), LeecherState::Aborted);
    }
    // A hand-over with runs past the end is refused too, and nothing resumes.
    let mut l = at_round_one();
    l.step(LeecherInput::Received(Msg::Dirty {
        round: 1,
        runs: vec![0..256],
    }));
    assert_eq!(
        sent(&l.step(LeecherInput::RoundDone(round(0)))),
        vec![Msg::Finalize]
    );
    let a = l.step(LeecherInput::Received(Msg::HandOver {
        runs: vec![0..u64::MAX],
        app_state: Bytes::new(),
        suspended_at_ns: 0,
    }));
    assert!(!a.iter().any(|a| matches!(a, LeecherAction::Resume { .. })));
    assert!(matches!(
        invalid(&a),
        Violation::Runs {
            msg: "HandOver",
            ..
        }
    ));
}

#[test]
fn max_rounds_is_not_called_converged() {
    let mut l = Leecher::new(
        Convergence {
            max_rounds: 1,
            ..Convergence::default()
        },
        LeecherLimits::new(4096),
    );
    l.step(LeecherInput::Received(welcome(1 << 20, 65536, 4096)));
    l.step(LeecherInput::PullDone);
    assert_eq!(
        sent(&l.step(LeecherInput::RoundDone(round(100_000)))),
        vec![Msg::Finalize]
    );
    assert_eq!(l.finalization(), Some(Finalization::MaxRounds));
    let mut l = at_round_one();
    l.step(LeecherInput::RoundDone(round(0)));
    assert_eq!(l.finalization(), Some(Finalization::Converged));
}

#[test]
fn a_leecher_out_of_step_is_dropped_and_tracking_stops() {
    let mut s = Seeder::new(info(), 5);
    s.step(SeederInput::Received(Msg::Hello {
        session: 0,
        mode: Mode::Precopy,
    }));
    let a = s.step(SeederInput::Received(Msg::DirtyRequest { round: 7 }));
    assert!(matches!(&a[0], SeederAction::Send(Msg::Abort { .. })));
    assert!(a
        .iter()
        .any(|a| matches!(a, SeederAction::StopTracking { .. })));
    assert_eq!(a.last(), Some(&SeederAction::Close));
    assert_eq!(s.state(), SeederState::Idle);
    // The next leecher is welcome.
    s.step(SeederInput::Received(Msg::Hello {
        session: 0,
        mode: Mode::Precopy,
    }));
    assert!(matches!(
        s.step(SeederInput::Received(Msg::Bye))[0],
        SeederAction::Send(Msg::Abort { .. })
    ));
    assert_eq!(s.state(), SeederState::Idle);
}

#[test]
fn a_failed_suspension_tells_the_leecher_why_and_leaves_the_source_running() {
    let mut s = Seeder::new(info(), 1);
    s.step(SeederInput::Received(Msg::Hello {
        session: 0,
        mode: Mode::Precopy,
    }));
    assert_eq!(
        s.step(SeederInput::Received(Msg::Finalize)),
        vec![SeederAction::Suspend { instant: false }]
    );
    let cause = std::io::Error::new(std::io::ErrorKind::PermissionDenied, "kill(1234) refused");
    let a = s.step(SeederInput::SuspendFailed(std::sync::Arc::new(cause)));
    let reason = match &a[..] {
        [SeederAction::Send(Msg::Abort { reason }), SeederAction::StopTracking { .. }, SeederAction::Close] => {
            reason.clone()
        }
        other => panic!("{other:?}"),
    };
    assert!(
        reason.contains("could not be suspended") && reason.contains("kill(1234) refused"),
        "{reason}"
    );
    assert_eq!(s.state(), SeederState::Idle);
}

fn shared_info() -> RegionInfo {
    RegionInfo {
        shared: "farmap://127.0.0.1:7000".into(),
        ..info()
    }
}

#[test]
fn post_copy_hands_over_at_once_and_fetches_everything() {
    let mut s = Seeder::new(info(), 5);
    let mut l =
        Leecher::new(Convergence::default(), LeecherLimits::new(4096)).with_mode(Mode::Postcopy);
    let hello = sent(&l.start());
    assert_eq!(
        hello,
        vec![Msg::Hello {
            session: 0,
            mode: Mode::Postcopy
        }]
    );
    let la = deliver(&mut l, s.step(SeederInput::Received(hello[0].clone())));
    assert!(matches!(
        la[0],
        LeecherAction::OpenRegion {
            mode: Mode::Postcopy,
            ..
        }
    ));
    assert_eq!(sent(&la), vec![Msg::Finalize], "no pull, no rounds");
    assert_eq!(l.finalization(), Some(Finalization::NoPreCopy));
    assert_eq!(
        s.step(SeederInput::Received(Msg::Finalize)),
        vec![SeederAction::Suspend { instant: false }]
    );
    let la = deliver(
        &mut l,
        s.step(SeederInput::Suspended {
            runs: vec![1..2],
            confirm: None,
            app_state: Bytes::new(),
            at_ns: 1,
        }),
    );
    assert!(matches!(
        &la[0],
        LeecherAction::Resume {
            fetch_all: true,
            confirm: None,
            ..
        }
    ));
}

/// A hand-over with nothing in it.
fn empty_handover() -> LeecherInput {
    LeecherInput::Received(Msg::HandOver {
        runs: vec![],
        app_state: Bytes::new(),
        suspended_at_ns: 0,
    })
}

/// Why `la` gives an instant migration up, if it does.
fn instant_abort(la: &[LeecherAction]) -> Option<&InstantError> {
    la.iter().find_map(|a| match a {
        LeecherAction::Abort(AbortCause::Invalid(Violation::Instant(e))) => Some(e),
        _ => None,
    })
}

fn manifest() -> Manifest {
    use crate::msg::Location;
    Manifest {
        runs: vec![
            ManifestRun {
                location: Location::Source,
                chunks: 10..12,
            },
            ManifestRun {
                location: Location::Store,
                chunks: 0..10,
            },
            ManifestRun {
                location: Location::Store,
                chunks: 12..16,
            },
        ],
        pushed: vec![(1, 2); 14],
    }
}

#[test]
fn instant_sends_the_manifest_while_running_then_confirms_in_two_steps_and_again_after_a_reconnect()
{
    let mut s = Seeder::new(shared_info(), 5);
    let mut l =
        Leecher::new(Convergence::default(), LeecherLimits::new(4096)).with_mode(Mode::Instant);
    let hello = sent(&l.start())[0].clone();
    let la = deliver(&mut l, s.step(SeederInput::Received(hello)));
    assert!(matches!(
        &la[0],
        LeecherAction::OpenRegion { region, mode: Mode::Instant, .. }
            if region.shared == "farmap://127.0.0.1:7000"
    ));
    assert_eq!(sent(&la), vec![Msg::Finalize]);
    // The draft comes first, the application still running; then the suspension.
    assert_eq!(
        s.step(SeederInput::Received(Msg::Finalize)),
        vec![SeederAction::Draft]
    );
    let a = s.step(SeederInput::Drafted(manifest()));
    assert_eq!(a, vec![SeederAction::Send(manifest().to_msg())]);
    // The suspension waits until the destination has installed the manifest.
    let la = deliver(&mut l, a);
    assert_eq!(
        la,
        vec![
            LeecherAction::InstallManifest(manifest()),
            LeecherAction::Send(Msg::Installed)
        ]
    );
    assert_eq!(
        s.step(SeederInput::Received(Msg::Installed)),
        vec![SeederAction::Suspend { instant: true }]
    );
    let hot = Confirm {
        at_source: vec![3..4],
        pending: vec![0..3, 12..16],
    };
    let a = s.step(SeederInput::Suspended {
        runs: vec![],
        confirm: Some(hot.clone()),
        app_state: Bytes::from_static(b"x"),
        at_ns: 1,
    });
    assert_eq!(a.len(), 2);
    assert_eq!(a[0], SeederAction::Send(hot.to_msg()));
    assert!(matches!(a[1], SeederAction::Send(Msg::HandOver { .. })));
    // The connection drops before the leecher saw them: all of it is sent again.
    s.step(SeederInput::Disconnected);
    let again = s.step(SeederInput::Received(Msg::Hello {
        session: 5,
        mode: Mode::Instant,
    }));
    assert_eq!(
        again.len(),
        4,
        "welcome, manifest, confirmation, hand-over: {again:?}"
    );
    let la = deliver(&mut l, a);
    assert!(matches!(
        &la[0],
        LeecherAction::Resume { confirm: Some(c), fetch_all: false, .. } if *c == hot
    ));
    // The rest is looked at once the destination runs (once).
    assert_eq!(sent(&la), vec![Msg::Resumed]);
    assert_eq!(
        s.step(SeederInput::Received(Msg::Resumed)),
        vec![SeederAction::ConfirmRest]
    );
    // The rest, after the hand-over; and again to a leecher that reconnects after resuming.
    let rest = Confirm {
        at_source: vec![13..14],
        pending: vec![],
    };
    let a = s.step(SeederInput::Confirmed(rest.clone()));
    assert_eq!(a, vec![SeederAction::Send(rest.to_msg())]);
    assert_eq!(
        deliver(&mut l, a),
        vec![LeecherAction::Confirm(rest.clone())]
    );
    assert!(s.step(SeederInput::Received(Msg::Resumed)).is_empty());
    s.step(SeederInput::Disconnected);
    let again = s.step(SeederInput::Received(Msg::Hello {
        session: 5,
        mode: Mode::Instant,
    }));
    assert_eq!(again.len(), 2, "welcome, the last confirmation: {again:?}");
    assert_eq!(again[1], SeederAction::Send(rest.to_msg()));
    // The manifest sent again after the resume: ignored.
    assert!(deliver(&mut l, vec![SeederAction::Send(manifest().to_msg())]).is_empty());
}

#[test]
fn a_hand_over_without_its_confirmation_or_a_confirmation_past_the_region_is_refused() {
    let start = || {
        let mut s = Seeder::new(shared_info(), 5);
        let mut l =
            Leecher::new(Convergence::default(), LeecherLimits::new(4096)).with_mode(Mode::Instant);
        let hello = sent(&l.start())[0].clone();
        deliver(&mut l, s.step(SeederInput::Received(hello)));
        deliver(&mut l, vec![SeederAction::Send(manifest().to_msg())]);
        l
    };
    let mut l = start();
    let la = l.step(empty_handover());
    assert!(
        matches!(instant_abort(&la), Some(InstantError::NoConfirm)),
        "{la:?}"
    );
    assert_eq!(l.state(), LeecherState::Aborted);
    let mut l = start();
    let la = l.step(LeecherInput::Received(Msg::Confirm {
        at_source: vec![15..17],
        pending: vec![],
    }));
    assert!(
        matches!(instant_abort(&la), Some(InstantError::ConfirmRuns(_))),
        "{la:?}"
    );
    // A confirmation in another mode is a protocol error too.
    let mut l = Leecher::new(Convergence::default(), LeecherLimits::new(4096));
    let la = l.step(LeecherInput::Received(Msg::Confirm {
        at_source: vec![],
        pending: vec![],
    }));
    assert!(la
        .iter()
        .any(|a| matches!(a, LeecherAction::Abort(AbortCause::Unexpected { .. }))));
}

#[test]
fn instant_without_a_shared_store_or_with_a_bad_manifest_is_refused() {
    let mut s = Seeder::new(info(), 5);
    let refused = s.step(SeederInput::Received(Msg::Hello {
        session: 0,
        mode: Mode::Instant,
    }));
    assert!(
        matches!(&refused[0], SeederAction::Send(Msg::Abort { reason }) if reason.contains("store")),
        "{refused:?}"
    );
    assert_eq!(s.state(), SeederState::Idle);
    // A leecher told of no shared store gives up before opening anything.
    let mut l =
        Leecher::new(Convergence::default(), LeecherLimits::new(4096)).with_mode(Mode::Instant);
    let la = l.step(LeecherInput::Received(welcome(1 << 20, 65536, 4096)));
    assert!(
        matches!(instant_abort(&la), Some(InstantError::NoSharedStore)),
        "{la:?}"
    );
    // A manifest that leaves chunks out aborts before the hand-over.
    let mut s = Seeder::new(shared_info(), 5);
    let mut l =
        Leecher::new(Convergence::default(), LeecherLimits::new(4096)).with_mode(Mode::Instant);
    let hello = sent(&l.start())[0].clone();
    deliver(&mut l, s.step(SeederInput::Received(hello)));
    let mut m = manifest();
    m.runs.pop();
    m.pushed.truncate(10);
    let la = deliver(&mut l, vec![SeederAction::Send(m.to_msg())]);
    assert!(
        matches!(instant_abort(&la), Some(InstantError::Manifest(_))),
        "{la:?}"
    );
    assert_eq!(l.state(), LeecherState::Aborted);
    // A hand-over without a manifest too.
    let mut l =
        Leecher::new(Convergence::default(), LeecherLimits::new(4096)).with_mode(Mode::Instant);
    let hello = sent(&l.start())[0].clone();
    deliver(
        &mut l,
        Seeder::new(shared_info(), 5).step(SeederInput::Received(hello)),
    );
    let la = l.step(empty_handover());
    assert!(
        matches!(instant_abort(&la), Some(InstantError::NoManifest)),
        "{la:?}"
    );
}
