//! A program's region served from another process ([`ForeignRegion`], `farmap run`'s core),
//! with two real processes: the test binary re-runs itself as the *program*
//! (`FARMAP_FOREIGN_REGION_PROGRAM` set, a control socket on fd 3, its reaper's socket on
//! fd 4), which maps a 64 MiB region and its staging area, registers them with two
//! userfaultfds, sends a farmap-run-proto `Registered` message with its four fds, starts
//! its reaper thread, and waits for the verdict. This process serves the region with a
//! local limit of a quarter, discarded pages meaning zeros.
//!
//! The program then works on its region as on any memory, and checks what it reads:
//! 1. writes every page (each word of page `p` holds `tag(p, 1)`);
//! 2. picks 32,768 pages at random, checks each one's tag and writes the next;
//! 3. discards 1 MiB at 8 MiB and at 40 MiB (`madvise(MADV_DONTNEED)`): zeros there;
//! 4. checks every page;
//!
//! and prints `done MISMATCHES FIRST_BAD`. The tests check the program's verdict, the
//! bound on its memory while it runs (chunks counted against the limit, pages present in
//! its region and staging area, and its
//! resident set), how the session ends (exit, exec, or the handler dropped: the program is
//! killed), and that nothing of the session is left running afterwards.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::foreign::{reaper_thread, spawn_program};
use farmap_core::{Geometry, Store};
use farmap_run_proto::{decode, Msg, Registered, Verdict, MAX_MSG_LEN};
use farmap_store::MemoryStore;
use farmap_testkit::fds::{recv_fds, send_fds};
use farmap_uffd::foreign::{
    trash_len, End, ForeignFds, ForeignOptions, ForeignRegion, Program, Reaper, FOREIGN_FEATURES,
};
use farmap_uffd::sys;
use farmap_uffd::uffd::{Uffd, UffdRange};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const PAGE: usize = 4096;
/// The region's pages (64 MiB).
const PAGES: usize = 16_384;
const LEN: usize = PAGES * PAGE;
/// Phase 2's random picks.
const PICKS: usize = 32_768;
/// Phase 3's discards: 1 MiB at each offset.
const DISCARDS: [usize; 2] = [8 << 20, 40 << 20];
const DISCARD_LEN: usize = 1 << 20;
/// The longest any wait of these tests takes.
const LIMIT: Duration = Duration::from_secs(120);

/// The tests look at this process's threads: one session at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// What every word of page `p` holds after its `round`th write (0: never written, zeros).
fn tag(p: usize, round: u64) -> u64 {
    if round == 0 {
        0
    } else {
        ((p as u64) << 32) | round
    }
}

fn geometry() -> Geometry {
    Geometry::new(LEN as u64, PAGE as u64).unwrap()
}

/// The userfaultfd features of the program's region.
fn features() -> u64 {
    FOREIGN_FEATURES | sys::UFFD_FEATURE_THREAD_ID
}

/// Whether this kernel can serve a program's region (a recorded skip otherwise).
fn usable(test: &str) -> bool {
    if farmap_testkit::skip::unless(test, farmap_uffd::probe_paging()).is_none() {
        return false;
    }
    match Uffd::probe() {
        Ok(s) if s & features() == features() => true,
        Ok(s) => {
            let missing = features() & !s;
            farmap_testkit::skip(test, format!("userfaultfd lacks features {missing:#x}"));
            false
        }
        Err(e) => {
            farmap_testkit::skip(test, format!("userfaultfd: {e}"));
            false
        }
    }
}

/// A program whose region this process serves.
struct Session {
    child: Child,
    lines: BufReader<UnixStream>,
    region: Option<ForeignRegion>,
    /// Fault tasks, fetches and pushes run here.
    rt: tokio::runtime::Runtime,
    /// Tasks alive on `rt` before the region started.
    tasks_before: usize,
}

impl Session {
    /// Starts the program in `mode` (`run` or `exec`) and serves its region with a limit of
    /// a quarter; returns once it said `ready`.
    fn start(mode: &str) -> Session {
        let (child, ours, reaper) =
            spawn_program("foreign_program", ("FARMAP_FOREIGN_REGION_PROGRAM", mode));
        ours.set_read_timeout(Some(LIMIT)).unwrap();
        let mut buf = [0u8; MAX_MSG_LEN];
        let (n, fds) = recv_fds(&ours, &mut buf).expect("the program's Registered message");
        let Some((Msg::Registered(registered), used)) = decode(&buf[..n]).unwrap() else {
            panic!("not a Registered message: {:?}", &buf[..n]);
        };
        assert_eq!(used, n);
        let pid = child.id();
        let pidfd = rustix::process::pidfd_open(
            rustix::process::Pid::from_raw(pid as i32).unwrap(),
            rustix::process::PidfdFlags::empty(),
        )
        .unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let tasks_before = rt.metrics().num_alive_tasks();
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new(geometry()));
        let region = ForeignRegion::start(
            &registered,
            ForeignFds::try_from(fds).unwrap(),
            Program { pid, pidfd },
            Reaper::new(reaper, Duration::from_secs(5)).unwrap(),
            store,
            ForeignOptions::default(),
            rt.handle().clone(),
        )
        .unwrap();
        let mut out = [0u8; MAX_MSG_LEN];
        let k = Msg::Verdict(Verdict { status: 0 })
            .encode(&mut out)
            .unwrap();
        (&ours).write_all(&out[..k]).unwrap();
        let mut s = Session {
            child,
            lines: BufReader::new(ours),
            region: Some(region),
            rt,
            tasks_before,
        };
        assert_eq!(s.line(), "ready");
        s
    }

    fn region(&self) -> &ForeignRegion {
        self.region.as_ref().unwrap()
    }

    /// The program's next line ("" once it closed its socket).
    fn line(&mut self) -> String {
        let mut line = String::new();
        self.lines
            .read_line(&mut line)
            .expect("the program's next line");
        line.trim().to_owned()
    }

    /// Drops the region, then checks that nothing of it runs any more: the runtime's tasks
    /// are back to what they were, and no thread of the session is left.
    fn drop_region_and_check_nothing_is_left(&mut self) {
        drop(self.region.take());
        let deadline = Instant::now() + Duration::from_secs(1);
        while self.rt.metrics().num_alive_tasks() > self.tasks_before {
            assert!(
                Instant::now() < deadline,
                "{} tasks still alive on the runtime, {} before the session",
                self.rt.metrics().num_alive_tasks(),
                self.tasks_before
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let left: Vec<String> = session_threads();
        assert!(left.is_empty(), "threads left after the drop: {left:?}");
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// This process's threads that belong to a session (reader, reclaim, watcher).
fn session_threads() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_owned())
        .filter(|n| {
            n.starts_with("farmap-uffd-rea")
                || n.starts_with("farmap-uffd-rec")
                || n.starts_with("farmap-run-watc")
        })
        .collect()
}

/// The program's resident set (`VmRSS`), bytes.
fn rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[test]
fn a_programs_region_reads_what_it_wrote_within_its_bound_and_ends_with_it() {
    let test = "a_programs_region_reads_what_it_wrote_within_its_bound_and_ends_with_it";
    if !usable(test) {
        return;
    }
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut s = Session::start("run");
    let pid = s.child.id();
    let paging = s.region().stats().paging.unwrap();
    let bound_pages = paging.limit_chunks + paging.min_free_chunks;
    let rss_ready = rss(pid).unwrap();
    let rss_bound = rss_ready + bound_pages * PAGE as u64 + (4 << 20);
    let (stop, samples) = (AtomicBool::new(false), AtomicU64::new(0));
    let (max_pages, max_rss, max_units) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    let done = std::thread::scope(|scope| {
        let region = s.region.as_ref().unwrap();
        scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let resident = region.stats().paging.unwrap().resident_chunks;
                max_units.fetch_max(resident, Ordering::Relaxed);
                if let Some(Ok((in_region, staged))) = region.local_pages() {
                    max_pages.fetch_max(in_region + staged, Ordering::Relaxed);
                }
                if let Some(r) = rss(pid) {
                    max_rss.fetch_max(r, Ordering::Relaxed);
                }
                samples.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        let mut phases = Vec::new();
        let done = loop {
            let line = {
                let mut line = String::new();
                s.lines.read_line(&mut line).expect("the program's lines");
                line.trim().to_owned()
            };
            assert!(!line.is_empty(), "the program ended early: {phases:?}");
            if line.starts_with("done") {
                break line;
            }
            phases.push(line);
        };
        stop.store(true, Ordering::Relaxed);
        assert_eq!(phases, ["phase 1", "phase 2", "phase 3", "phase 4"]);
        done
    });
    assert_eq!(
        done, "done 0 -",
        "the program read something it did not write"
    );
    let status = s.child.wait().unwrap();
    assert!(status.success(), "the program: {status:?}");
    assert_eq!(
        s.region().wait_end(Duration::from_secs(10)),
        Some(End::Exited)
    );
    let stats = s.region().stats();
    let p = stats.paging.clone().unwrap();
    eprintln!(
        "{} samples: at most {} chunks resident (bound {bound_pages}), resident set at most {} \
         bytes (ready {rss_ready}), at most {} pages present by the page tables; {stats:?}",
        samples.load(Ordering::Relaxed),
        max_units.load(Ordering::Relaxed),
        max_rss.load(Ordering::Relaxed),
        max_pages.load(Ordering::Relaxed),
    );
    assert!(samples.load(Ordering::Relaxed) > 10, "too few samples");
    assert!(
        max_units.load(Ordering::Relaxed) <= bound_pages,
        "more chunks resident than limit + min_free ({bound_pages})"
    );
    assert!(
        max_pages.load(Ordering::Relaxed) <= bound_pages,
        "more pages present in the region and staging area than limit + min_free"
    );
    assert!(
        max_rss.load(Ordering::Relaxed) <= rss_bound,
        "the program's resident set went past {rss_bound} bytes"
    );
    assert!(stats.faults >= PAGES as u64, "{stats:?}");
    assert!(stats.remove_events >= 2, "{stats:?}");
    assert!(p.evictions_reactive + p.evictions_proactive > 0, "{p:?}");
    assert!(p.deactivations > 0, "{p:?}");
    assert!(p.staged_refaults > 0, "no staged chunk came back: {p:?}");
    assert_eq!(p.staged_refaults_in_thread, 0, "{p:?}");
    assert!(p.zero_fills > 0, "{p:?}");
    assert!(stats.pushed_chunks > 0, "nothing written back: {stats:?}");
    s.drop_region_and_check_nothing_is_left();
}

#[test]
fn dropping_the_handler_kills_the_program() {
    let test = "dropping_the_handler_kills_the_program";
    if !usable(test) {
        return;
    }
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut s = Session::start("run");
    assert_eq!(s.line(), "phase 1");
    assert_eq!(s.line(), "phase 2");
    let started = Instant::now();
    s.drop_region_and_check_nothing_is_left();
    let status = s.child.wait().unwrap();
    assert_eq!(
        status.signal(),
        Some(libc::SIGKILL),
        "the program: {status:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    let mut rest = String::new();
    let _ = s.lines.read_to_string(&mut rest);
    assert!(!rest.contains("done"), "the program finished: {rest:?}");
}

#[test]
fn an_exec_ends_the_session_and_the_new_image_lives_on() {
    let test = "an_exec_ends_the_session_and_the_new_image_lives_on";
    if !usable(test) {
        return;
    }
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut s = Session::start("exec");
    assert_eq!(
        s.region().wait_end(Duration::from_secs(5)),
        Some(End::Replaced)
    );
    assert!(
        s.child.try_wait().unwrap().is_none(),
        "the new image runs on"
    );
    s.drop_region_and_check_nothing_is_left();
    assert!(
        s.child.try_wait().unwrap().is_none(),
        "a replaced program is not killed when its region is dropped"
    );
}

/// The program: an entry point the tests above start as a child process (ignored in a
/// normal run, so that it does not count as a pass).
#[test]
#[ignore = "the program's entry point, started by the tests above"]
fn foreign_program() {
    let mode = std::env::var("FARMAP_FOREIGN_REGION_PROGRAM")
        .expect("started by a foreign_region test, with FARMAP_FOREIGN_REGION_PROGRAM set");
    // SAFETY: fds 3 and 4 are the sockets our parent set up for us; nothing else owns them.
    let (sock, reaper) = unsafe { (UnixStream::from_raw_fd(3), UnixStream::from_raw_fd(4)) };
    for fd in [3, 4] {
        // Closed by an exec, as the preload library's are.
        // SAFETY: plain fcntl on our own fds.
        let r = unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        assert_eq!(r, 0);
    }
    let g = geometry();
    let staging_len = LEN + trash_len(g) as usize;
    let loud = Uffd::open(features()).expect("the region's userfaultfd");
    let quiet = Uffd::open(sys::UFFD_FEATURE_MOVE).expect("the staging area's userfaultfd");
    let map = |len: usize| {
        // SAFETY: a new anonymous private mapping; nothing else refers to it.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p as usize
    };
    let (region, staging) = (map(LEN), map(staging_len));
    // SAFETY: both are anonymous private mappings of this process that no Rust reference
    // covers: they are only touched with volatile accesses below.
    unsafe {
        loud.register(
            region,
            LEN,
            sys::UFFDIO_REGISTER_MODE_MISSING | sys::UFFDIO_REGISTER_MODE_WP,
        )
        .expect("registering the region");
        quiet
            .register(staging, staging_len, sys::UFFDIO_REGISTER_MODE_WP)
            .expect("registering the staging area");
    }
    let open = |path: &str| std::fs::File::open(path).expect(path);
    let (pagemap, mem) = (open("/proc/self/pagemap"), open("/proc/self/mem"));
    let registered = Msg::Registered(Registered {
        region: region as u64,
        region_len: LEN as u64,
        staging: staging as u64,
        staging_len: staging_len as u64,
        features: features(),
    });
    let mut buf = [0u8; MAX_MSG_LEN];
    let n = registered.encode(&mut buf).unwrap();
    use std::os::fd::AsFd;
    send_fds(
        &sock,
        &buf[..n],
        &[loud.as_fd(), quiet.as_fd(), pagemap.as_fd(), mem.as_fd()],
    )
    .expect("sending the fds");
    let (loud, quiet) = (Arc::new(loud), Arc::new(quiet));
    let areas = [
        UffdRange::new(loud, region, LEN),
        UffdRange::new(quiet, staging, staging_len),
    ];
    std::thread::spawn(move || {
        reaper_thread(reaper, areas);
        // The handler is gone: nobody keeps this program's memory bounded.
        // SAFETY: a plain kill of ourselves.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    });
    let mut got = Vec::new();
    let verdict = loop {
        if let Some((msg, _)) = decode(&got).unwrap() {
            break msg;
        }
        let mut chunk = [0u8; MAX_MSG_LEN];
        let k = (&sock).read(&mut chunk).unwrap();
        assert!(k > 0, "the handler closed the socket");
        got.extend_from_slice(&chunk[..k]);
    };
    assert_eq!(verdict, Msg::Verdict(Verdict { status: 0 }));
    let mut out = sock.try_clone().unwrap();
    writeln!(out, "ready").unwrap();
    if mode == "exec" {
        let e = Command::new("/bin/sleep").arg("5").exec();
        panic!("exec: {e}");
    }
    run_phases(region, &mut out);
}

/// The program's work on its region (see the module docs); prints each phase as it
/// starts, and `done MISMATCHES FIRST_BAD`.
fn run_phases(region: usize, out: &mut UnixStream) {
    let words = PAGE / 8;
    let word = |p: usize, w: usize| (region + p * PAGE + w * 8) as *mut u64;
    let write_page = |p: usize, v: u64| {
        for w in 0..words {
            // SAFETY: inside the region, aligned, only touched with volatile accesses.
            unsafe { word(p, w).write_volatile(v) };
        }
    };
    let mut mismatches = 0u64;
    let mut first_bad = String::from("-");
    let mut check_page = |p: usize, want: u64| {
        for w in 0..words {
            // SAFETY: as in write_page.
            let got = unsafe { word(p, w).read_volatile() };
            if got != want {
                if mismatches == 0 {
                    first_bad = format!("page {p} word {w}: {got:#x} not {want:#x}");
                }
                mismatches += 1;
                return;
            }
        }
    };
    let mut round = vec![0u64; PAGES];
    writeln!(out, "phase 1").unwrap();
    for (p, r) in round.iter_mut().enumerate() {
        *r = 1;
        write_page(p, tag(p, 1));
    }
    writeln!(out, "phase 2").unwrap();
    let mut rng = SmallRng::seed_from_u64(7);
    for _ in 0..PICKS {
        let p = rng.gen_range(0..PAGES);
        check_page(p, tag(p, round[p]));
        round[p] += 1;
        write_page(p, tag(p, round[p]));
    }
    writeln!(out, "phase 3").unwrap();
    for at in DISCARDS {
        // SAFETY: a range of our own region; its pages may go (the registration's contract).
        let r = unsafe { libc::madvise((region + at) as *mut _, DISCARD_LEN, libc::MADV_DONTNEED) };
        assert_eq!(r, 0, "madvise: {}", std::io::Error::last_os_error());
        round[at / PAGE..(at + DISCARD_LEN) / PAGE].fill(0);
    }
    writeln!(out, "phase 4").unwrap();
    for (p, &r) in round.iter().enumerate() {
        check_page(p, tag(p, r));
    }
    writeln!(out, "done {mismatches} {first_bad}").unwrap();
}

#[test]
fn tags_are_distinct_and_zero_means_never_written() {
    assert_eq!(tag(5, 0), 0);
    assert_ne!(tag(0, 1), 0);
    assert_ne!(tag(1, 1), tag(0, 1));
    assert_ne!(tag(1, 2), tag(1, 1));
}
