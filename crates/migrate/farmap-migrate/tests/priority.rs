//! The pull's priority, lowered for the whole process and restored at the hand-over, leaves
//! the fault path's idle-priority companions at `SCHED_IDLE` (its own process: it changes
//! the priority of every thread).

use std::time::{Duration, Instant};

use farmap_migrate::budget::PullPriority;

/// The scheduling policy of thread `tid` of this process (`SCHED_IDLE` is 5).
fn policy(tid: i32) -> Option<u32> {
    let sched = std::fs::read_to_string(format!("/proc/self/task/{tid}/sched")).ok()?;
    sched
        .lines()
        .find(|l| l.starts_with("policy"))?
        .split(':')
        .nth(1)?
        .trim()
        .parse()
        .ok()
}

#[test]
fn restoring_the_priority_leaves_the_idle_companions_alone() {
    let awake = farmap_uffd::KeepAwake::new().unwrap();
    // The companions list themselves, then take SCHED_IDLE.
    let start = Instant::now();
    let companions = loop {
        let c = farmap_uffd::idle_companions();
        if !c.is_empty() && c.iter().all(|&t| policy(t) == Some(5)) {
            break c;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the companions did not start at SCHED_IDLE: {c:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    // "/proc/thread-self" links to "<pid>/task/<tid>".
    let me: i32 = std::fs::read_link("/proc/thread-self")
        .unwrap()
        .file_name()
        .and_then(|t| t.to_str()?.parse().ok())
        .unwrap();

    assert_eq!(PullPriority::Idle.apply_to_process(), 0);
    assert_eq!(policy(me), Some(5), "lowered");
    assert_eq!(PullPriority::Normal.apply_to_process(), 0);
    assert_eq!(policy(me), Some(0), "restored to SCHED_OTHER");
    for &t in &companions {
        assert_eq!(policy(t), Some(5), "companion {t} stays at SCHED_IDLE");
    }
    drop(awake);
    assert!(
        farmap_uffd::idle_companions().is_empty(),
        "joined companions are no longer listed"
    );
}
