//! What the kernel lets one process do to another's userfaultfd regions, with two real
//! processes (`farmap run`'s design, docs/design/farmap-run.md §2.4, rests on these): the
//! test binary re-runs itself as the *program* (`FARMAP_FOREIGN_PROGRAM` set, its socket on
//! fd 3), which maps a region and a staging area, registers them with two userfaultfds, and
//! sends those fds, its pagemap and its `/proc/self/mem` over the socket. This process (the
//! *handler*) then works on the program's memory through them, and the program reports what
//! it sees. One test per fact:
//! - a fault in the program is resolved by `UFFDIO_COPY` (write-protected) from here, and
//!   `pread` on the received mem fd reads the program's pages;
//! - `PAGEMAP_SCAN` on the received pagemap reports the program's writes and protects the
//!   pages again (the next write is reported again);
//! - `UFFDIO_MOVE` issued here is refused (`EINVAL`: the kernel allows no move across
//!   address spaces, `mm != current->mm`); issued by the program itself (a thread of its
//!   own: the reaper) it moves pages between its region and staging area, both ways, and a
//!   fault on a page moved away is resolved from here by a copy of what the mem fd reads in
//!   the staging area;
//! - the program's `madvise(MADV_DONTNEED)` of its staging area (the reaper's job) raises no
//!   event on the region's fd; `MADV_DONTNEED` and `MADV_FREE` of the region raise a remove
//!   event, and the program's madvise waits until that event is read;
//! - a `pread` of the mem fd of a missing page of the region fails with `EIO` at once and
//!   raises no fault (a read from another process may not wait for a handler); of a hole of
//!   the staging area it reads zeros and maps the zero page there, where a move then finds
//!   a page present (`EEXIST`);
//! - once the program exits, or execs (its pid lives on), every read of the mem fd returns
//!   0 bytes, wherever it reads (while the mm lives, an address nothing maps fails with
//!   `EIO`); the region's fd raises nothing (no `POLLHUP`, no `POLLERR`), and copies and
//!   `PAGEMAP_SCAN` fail with `ESRCH`;
//! - `UFFDIO_ZEROPAGE` issued here resolves the program's fault with the zero page, which the
//!   write protection that follows covers (a write to it is reported);
//! - as root: the program's `fork` raises a fork event here, whose new userfaultfd is
//!   installed in *this* process's fd table; while the child shares a page, the program's
//!   move of it fails with `EBUSY`, and once the child is gone and the program wrote the
//!   page, it moves again.
//!
//! And the conversation built on the move fact: farmap's [`Reaper`] client asks the
//! program's reaper thread (here: a thread of the test program speaking farmap-run-proto on
//! fd 4) to move and discard pages in the program, and sees what stops a move.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::foreign::{reaper_thread, spawn_program};
use farmap_testkit::fds::{recv_fds, send_fds};
use farmap_uffd::foreign::{Reaper, ReaperError};
use farmap_uffd::pagemap::Pagemap;
use farmap_uffd::sys::{self, PageRegion, UffdMsg};
use farmap_uffd::uffd::{CopyError, Uffd, UffdRange};
use rustix::event::{PollFd, PollFlags};

const PAGE: usize = 4096;
/// The region's and the staging area's size.
const LEN: usize = 64 * PAGE;
const LIMIT: Duration = Duration::from_secs(20);

/// The region's userfaultfd features in the program (`fork`: with fork events).
fn loud_features(fork: bool) -> u64 {
    let mut f = sys::UFFD_FEATURE_MOVE
        | sys::UFFD_FEATURE_EVENT_REMOVE
        | sys::UFFD_FEATURE_WP_ASYNC
        | sys::UFFD_FEATURE_WP_UNPOPULATED;
    if fork {
        f |= sys::UFFD_FEATURE_EVENT_FORK;
    }
    f
}

/// The program for `test` (`fork`: its region's fd reports forks), or `None` (a recorded
/// skip) where this kernel lacks what the tests need.
fn program(test: &str, fork: bool) -> Option<Program> {
    usable(test).then(|| Program::start(fork))
}

/// Whether this kernel has what the tests need (a recorded skip otherwise).
fn usable(test: &str) -> bool {
    let support = match Uffd::probe() {
        Ok(s) => s,
        Err(e) => {
            farmap_testkit::skip(test, format!("userfaultfd: {e}"));
            return false;
        }
    };
    let want = loud_features(false);
    if support & want != want {
        farmap_testkit::skip(
            test,
            format!("userfaultfd lacks features {:#x}", want & !support),
        );
        return false;
    }
    true
}

/// The program as this process sees it: its socket, its areas and the fds it sent.
struct Program {
    child: Child,
    lines: BufReader<UnixStream>,
    sock: UnixStream,
    region: UffdRange,
    staging: UffdRange,
    pagemap: Pagemap,
    mem: OwnedFd,
    loud: Arc<Uffd>,
    /// Our end of the program's reaper's socket (its thread reads requests on fd 4).
    reaper: Option<UnixStream>,
}

impl Program {
    /// Starts the program (`fork`: its region's fd reports forks) and receives its fds.
    fn start(fork: bool) -> Program {
        let mode = if fork { "fork" } else { "plain" };
        let (child, ours, reaper) =
            spawn_program("program_process", ("FARMAP_FOREIGN_PROGRAM", mode));
        ours.set_read_timeout(Some(LIMIT)).unwrap();
        let mut hello = [0u8; 32];
        let (n, fds) = recv_fds(&ours, &mut hello).expect("the program's hello");
        assert_eq!(n, hello.len(), "a short hello");
        let word = |i: usize| u64::from_le_bytes(hello[i * 8..i * 8 + 8].try_into().unwrap());
        let (region_base, staging_base, len, features) = (
            word(0) as usize,
            word(1) as usize,
            word(2) as usize,
            word(3),
        );
        assert_eq!(len, LEN);
        let [loud, quiet, pagemap, mem]: [OwnedFd; 4] = fds.try_into().expect("four fds");
        let loud = Arc::new(Uffd::from_owned(loud, features));
        let quiet = Arc::new(Uffd::from_owned(quiet, sys::UFFD_FEATURE_MOVE));
        Program {
            child,
            lines: BufReader::new(ours.try_clone().unwrap()),
            sock: ours,
            region: UffdRange::new(loud.clone(), region_base, LEN),
            staging: UffdRange::new(quiet, staging_base, LEN),
            pagemap: Pagemap::from_owned(pagemap),
            mem,
            loud,
            reaper: Some(reaper),
        }
    }

    /// Fills the region's page at `off` from here with [`page_of`]`(tag)`, write-protected.
    fn fill(&self, off: usize, tag: u64) {
        self.region
            .copy(off, &page_of(tag), sys::UFFDIO_COPY_MODE_WP)
            .unwrap();
    }

    /// Sends a command; the program answers one line each.
    fn send(&mut self, command: &str) {
        writeln!(self.sock, "{command}").unwrap();
    }

    fn answer(&mut self) -> String {
        let mut line = String::new();
        self.lines
            .read_line(&mut line)
            .expect("the program's answer");
        assert!(!line.is_empty(), "the program closed its socket");
        line.trim().to_owned()
    }

    fn ask(&mut self, command: &str) -> String {
        self.send(command);
        self.answer()
    }

    /// The next message on the region's fd, waiting up to the limit.
    fn message(&self) -> UffdMsg {
        let deadline = Instant::now() + LIMIT;
        let mut msgs = [UffdMsg::default(); 1];
        loop {
            if self.loud.read_messages(&mut msgs).unwrap() == 1 {
                return msgs[0];
            }
            assert!(Instant::now() < deadline, "no userfaultfd message in time");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Whether a message is pending on the region's fd after `wait`.
    fn quiet_for(&self, wait: Duration) -> bool {
        std::thread::sleep(wait);
        let mut msgs = [UffdMsg::default(); 1];
        self.loud.read_messages(&mut msgs).unwrap() == 0
    }

    /// The program's region page at `off`, read through its mem fd.
    fn pread(&self, off: usize) -> Vec<u8> {
        self.pread_at(self.region.base() + off)
    }

    /// The program's page at address `addr`, read through its mem fd.
    fn pread_at(&self, addr: usize) -> Vec<u8> {
        let mut buf = vec![0u8; PAGE];
        let at = addr as libc::off_t;
        // SAFETY: buf is valid for PAGE bytes of writes.
        let n = unsafe { libc::pread(self.mem.as_raw_fd(), buf.as_mut_ptr().cast(), PAGE, at) };
        assert_eq!(
            n,
            PAGE as isize,
            "pread: {}",
            std::io::Error::last_os_error()
        );
        buf
    }

    /// The written pages of the region (offsets), protected again.
    fn collect_written(&self) -> Vec<usize> {
        let mut scratch: Vec<PageRegion> = Vec::new();
        let mut pages = Vec::new();
        let base = self.region.base();
        self.pagemap
            .collect_written(base, base + LEN, &mut scratch, |run| {
                if run.has_data {
                    pages.extend((run.start..run.end).step_by(PAGE).map(|a| a - base));
                }
            })
            .unwrap();
        pages
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        let _ = writeln!(self.sock, "exit");
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A page whose every 8-byte word is `tag`.
fn page_of(tag: u64) -> Vec<u8> {
    tag.to_le_bytes().repeat(PAGE / 8)
}

#[test]
fn a_copy_from_another_process_resolves_the_programs_fault_and_its_mem_fd_reads_it() {
    let Some(mut p) = program(
        "a_copy_from_another_process_resolves_the_programs_fault_and_its_mem_fd_reads_it",
        false,
    ) else {
        return;
    };
    p.send(&format!("read {}", 3 * PAGE + 16));
    let m = p.message();
    assert_eq!(m.event, sys::UFFD_EVENT_PAGEFAULT);
    assert_eq!(m.arg1 as usize & !(PAGE - 1), p.region.base() + 3 * PAGE);
    p.fill(3 * PAGE, 0xfeed);
    assert_eq!(
        p.answer(),
        format!("{}", 0xfeed),
        "the program read the copied page"
    );
    assert_eq!(p.pread(3 * PAGE), page_of(0xfeed), "the mem fd reads it");
    // A write to the write-protected page: WP_ASYNC lets it through without a message.
    assert_eq!(p.ask(&format!("write {} 77", 3 * PAGE)), "ok");
    assert_eq!(&p.pread(3 * PAGE)[..8], &77u64.to_le_bytes());
    assert!(
        p.quiet_for(Duration::from_millis(50)),
        "no write-protect fault"
    );
}

#[test]
fn pagemap_scan_of_another_process_reports_its_writes_and_protects_them_again() {
    let Some(mut p) = program(
        "pagemap_scan_of_another_process_reports_its_writes_and_protects_them_again",
        false,
    ) else {
        return;
    };
    for i in 0..8 {
        p.fill(i * PAGE, i as u64);
    }
    assert_eq!(
        p.collect_written(),
        Vec::<usize>::new(),
        "copied with WP: not written"
    );
    assert_eq!(p.ask(&format!("write {} 5", PAGE)), "ok");
    assert_eq!(p.ask(&format!("write {} 6", 6 * PAGE + 8)), "ok");
    assert_eq!(p.collect_written(), vec![PAGE, 6 * PAGE]);
    assert_eq!(p.collect_written(), Vec::<usize>::new(), "protected again");
    assert_eq!(p.ask(&format!("write {} 7", PAGE)), "ok");
    assert_eq!(
        p.collect_written(),
        vec![PAGE],
        "the next write is reported again"
    );
}

#[test]
fn a_move_is_refused_across_processes_and_done_by_the_program_itself() {
    let Some(mut p) = program(
        "a_move_is_refused_across_processes_and_done_by_the_program_itself",
        false,
    ) else {
        return;
    };
    p.fill(0, 0xabc);
    p.fill(PAGE, 0xdef);
    // Issued here, on the program's fds: refused, whichever way.
    assert_eq!(
        p.region.move_to(
            0,
            &p.staging,
            5 * PAGE,
            2 * PAGE,
            sys::UFFDIO_MOVE_MODE_DONTWAKE
        ),
        Err((0, libc::EINVAL)),
        "a move across address spaces"
    );
    // Issued by the program: region → staging (on the staging area's quiet fd).
    assert_eq!(
        p.ask(&format!("move r 0 s {} {}", 5 * PAGE, 2 * PAGE)),
        format!("ok {}", 2 * PAGE)
    );
    assert_eq!(p.ask(&format!("sread {}", 5 * PAGE)), format!("{}", 0xabc));
    assert_eq!(p.ask(&format!("sread {}", 6 * PAGE)), format!("{}", 0xdef));
    // The region's page is missing again: the program's touch faults, and a copy from here
    // of what the staging area holds (read through the mem fd) resolves it.
    p.send("read 8");
    let m = p.message();
    assert_eq!(m.event, sys::UFFD_EVENT_PAGEFAULT);
    assert_eq!(m.arg1 as usize & !(PAGE - 1), p.region.base());
    let staged = p.pread_at(p.staging.base() + 5 * PAGE);
    assert_eq!(staged, page_of(0xabc), "the mem fd reads the staging area");
    p.region.copy(0, &staged, sys::UFFDIO_COPY_MODE_WP).unwrap();
    assert_eq!(p.answer(), format!("{}", 0xabc));
    // Staging → region, by the program, into a missing page of the region.
    assert_eq!(
        p.ask(&format!("move s {} r {} {}", 6 * PAGE, 9 * PAGE, PAGE)),
        format!("ok {PAGE}")
    );
    assert_eq!(p.ask(&format!("read {}", 9 * PAGE)), format!("{}", 0xdef));
    assert!(
        p.quiet_for(Duration::from_millis(50)),
        "no fault for a moved-in page"
    );
    // The staging slot it left reads as a hole (zeros, no fault).
    assert_eq!(p.ask(&format!("sread {}", 6 * PAGE)), "0");
}

#[test]
fn discarding_staging_raises_nothing_and_discarding_the_region_waits_for_its_remove_event() {
    let Some(mut p) = program(
        "discarding_staging_raises_nothing_and_discarding_the_region_waits_for_its_remove_event",
        false,
    ) else {
        return;
    };
    p.fill(0, 1);
    assert_eq!(p.ask(&format!("move r 0 s 0 {PAGE}")), format!("ok {PAGE}"));
    // The reaper's job: drop staged pages in the program's own mm.
    assert_eq!(p.ask(&format!("dontneed-staging 0 {PAGE}")), "0");
    assert!(
        p.quiet_for(Duration::from_millis(50)),
        "no event for staging"
    );
    assert_eq!(p.ask("sread 0"), "0");
    for (advice, off) in [("dontneed", 2 * PAGE), ("free", 4 * PAGE)] {
        p.fill(off, 9);
        p.send(&format!("{advice} {off} {PAGE}"));
        let m = p.message();
        assert_eq!(m.event, sys::UFFD_EVENT_REMOVE, "{advice}");
        assert_eq!(
            (m.arg0 as usize, m.arg1 as usize),
            (p.region.base() + off, p.region.base() + off + PAGE),
            "{advice}: the removed range"
        );
        assert_eq!(p.answer(), "0", "{advice} returned once its event was read");
    }
}

#[test]
fn a_fork_in_the_program_reaches_the_handler_and_shared_pages_do_not_move() {
    let test = "a_fork_in_the_program_reaches_the_handler_and_shared_pages_do_not_move";
    if !usable(test) {
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        farmap_testkit::skip(test, "fork events need CAP_SYS_PTRACE (run as root)");
        return;
    }
    let mut p = Program::start(true);
    p.fill(0, 0x51);
    p.send("fork");
    let m = p.message();
    assert_eq!(m.event, sys::UFFD_EVENT_FORK);
    let ufd = (m.arg0 & 0xffff_ffff) as RawFd;
    let link = std::fs::read_link(format!("/proc/self/fd/{ufd}")).unwrap();
    assert_eq!(
        link.to_string_lossy(),
        "anon_inode:[userfaultfd]",
        "the child's userfaultfd is installed here"
    );
    // SAFETY: the kernel installed this fd in our table for us alone.
    let child_uffd = unsafe { OwnedFd::from_raw_fd(ufd) };
    let child_pid: i32 = p.answer().parse().expect("the child's pid");
    assert!(child_pid > 0);
    // The page is shared copy-on-write with the child now: it cannot move.
    assert_eq!(
        p.ask(&format!("move r 0 s 0 {PAGE}")),
        format!("err {} 0", libc::EBUSY)
    );
    // The child ends; the program's next write makes the page its own again, and it moves.
    assert_eq!(p.ask("reap"), "0");
    drop(child_uffd);
    assert_eq!(p.ask("write 0 3"), "ok");
    assert_eq!(p.ask(&format!("move r 0 s 0 {PAGE}")), format!("ok {PAGE}"));
    assert_eq!(p.ask("sread 0"), "3");
}

#[test]
fn the_reaper_moves_and_discards_in_the_program_for_the_handler() {
    let Some(mut p) = program(
        "the_reaper_moves_and_discards_in_the_program_for_the_handler",
        false,
    ) else {
        return;
    };
    let reaper = Reaper::new(p.reaper.take().unwrap(), LIMIT).unwrap();
    let (r, s) = (p.region.base() as u64, p.staging.base() as u64);
    let page = PAGE as u64;
    for i in 0..4 {
        p.fill(i * PAGE, 100 + i as u64);
    }
    // Region → staging, through the reaper.
    assert_eq!(
        reaper.move_pages(r, s + 8 * page, 4 * page).unwrap(),
        4 * page
    );
    assert_eq!(p.ask(&format!("sread {}", 10 * PAGE)), "102");
    // A move onto present pages stops at once (EEXIST), and says so.
    p.fill(0, 7);
    match reaper.move_pages(s + 8 * page, r, page) {
        Err(ReaperError::Stopped { bytes: 0, errno }) => assert_eq!(errno, libc::EEXIST),
        other => panic!("a move onto a present page: {other:?}"),
    }
    // Staging → region, into a missing page: the program reads it without a fault.
    assert_eq!(
        reaper
            .move_pages(s + 9 * page, r + 20 * page, page)
            .unwrap(),
        page
    );
    assert_eq!(p.ask(&format!("read {}", 20 * PAGE)), "101");
    assert!(
        p.quiet_for(Duration::from_millis(50)),
        "no fault for a moved-in page"
    );
    // Dropping staged pages: a hole again.
    reaper.discard(s + 10 * page, 2 * page).unwrap();
    assert_eq!(p.ask(&format!("sread {}", 10 * PAGE)), "0");
    assert_eq!(p.ask(&format!("sread {}", 11 * PAGE)), "0");
    // A request out of the protocol's limits is not sent; one the program's kernel
    // refuses comes back as its errno (ENOMEM: nothing mapped there), not as a lost reaper.
    assert!(matches!(
        reaper.discard(s + page / 2, page),
        Err(ReaperError::Invalid(_))
    ));
    match reaper.discard(page, page) {
        Err(ReaperError::Stopped { errno, .. }) => assert_eq!(errno, libc::ENOMEM),
        other => panic!("a discard of unmapped memory: {other:?}"),
    }
    assert_eq!(p.ask("sread 0"), "0", "the program goes on");
    // The program ends: the next request finds its reaper lost, at once.
    drop(p);
    assert!(matches!(reaper.discard(s, page), Err(ReaperError::Lost(_))));
}

/// A `pread` of `len` bytes of the program's memory at `addr`, through its mem fd: the bytes
/// read, or the errno.
fn pread_mem(mem: &OwnedFd, addr: usize, len: usize) -> Result<usize, i32> {
    let mut buf = vec![0u8; len];
    rustix::io::pread(mem, &mut buf, addr as u64).map_err(|e| e.raw_os_error())
}

#[test]
fn a_mem_fd_read_of_a_missing_region_page_fails_with_eio_and_raises_no_fault() {
    let Some(p) = program(
        "a_mem_fd_read_of_a_missing_region_page_fails_with_eio_and_raises_no_fault",
        false,
    ) else {
        return;
    };
    let mem = p.mem.try_clone().unwrap();
    let addr = p.region.base() + 10 * PAGE;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(pread_mem(&mem, addr, PAGE));
    });
    // Wait for the read; should it raise a fault instead, serve it, so that nothing hangs.
    let deadline = Instant::now() + LIMIT;
    let mut msgs = [UffdMsg::default(); 1];
    let mut faults = 0;
    let read = loop {
        if let Ok(r) = rx.try_recv() {
            break r;
        }
        if p.loud.read_messages(&mut msgs).unwrap() == 1 {
            faults += 1;
            p.fill(10 * PAGE, 0x77);
        }
        assert!(
            Instant::now() < deadline,
            "the read neither failed nor faulted"
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    // The remote read may not wait for a handler (no FAULT_FLAG_ALLOW_RETRY): the kernel's
    // userfault handling refuses it, and the read fails at once.
    assert_eq!((read, faults), (Err(libc::EIO), 0));
    assert!(p.quiet_for(Duration::from_millis(50)), "no fault raised");
    assert!(
        !p.pagemap.all_in_memory(addr, addr + PAGE).unwrap(),
        "the page is still missing"
    );
}

#[test]
fn the_mem_fd_reads_nothing_once_the_program_exits_or_execs() {
    let test = "the_mem_fd_reads_nothing_once_the_program_exits_or_execs";
    for how in ["exit", "exec"] {
        let Some(mut p) = program(test, false) else {
            return;
        };
        p.fill(0, 5);
        let base = p.region.base();
        // While the mm lives: a present page reads, an address nothing maps fails (EIO).
        assert_eq!(pread_mem(&p.mem, base, 1), Ok(1), "{how}");
        assert_eq!(pread_mem(&p.mem, 0, 1), Err(libc::EIO), "{how}");
        if how == "exit" {
            p.send("exit");
            assert!(p.child.wait().unwrap().success());
        } else {
            p.send("exec");
            assert_eq!(p.answer(), "execd");
            assert!(p.child.try_wait().unwrap().is_none(), "the pid lives on");
        }
        // The mem fd's mm is gone: every read is an end of file, wherever it reads.
        assert_eq!(pread_mem(&p.mem, base, 1), Ok(0), "{how}");
        assert_eq!(pread_mem(&p.mem, 0, 1), Ok(0), "{how}");
        // The region's fd says nothing (no POLLHUP or POLLERR: the end must be watched
        // for elsewhere); copies and PAGEMAP_SCAN fail with ESRCH.
        let mut fds = [PollFd::new(&*p.loud, PollFlags::IN)];
        let now = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        assert_eq!(rustix::event::poll(&mut fds, Some(&now)), Ok(0), "{how}");
        assert_eq!(
            p.region.copy(PAGE, &page_of(1), sys::UFFDIO_COPY_MODE_WP),
            Err(CopyError::Gone),
            "{how}"
        );
        let scan = p.pagemap.all_in_memory(base, base + PAGE).unwrap_err();
        assert_eq!(scan.raw_os_error(), Some(libc::ESRCH), "{how}");
        let _ = p.child.kill();
    }
}

#[test]
fn a_mem_fd_read_of_a_staging_hole_maps_the_zero_page_there() {
    let Some(mut p) = program(
        "a_mem_fd_read_of_a_staging_hole_maps_the_zero_page_there",
        false,
    ) else {
        return;
    };
    let hole = p.staging.base() + 7 * PAGE;
    assert!(!p.pagemap.all_in_memory(hole, hole + PAGE).unwrap());
    assert_eq!(pread_mem(&p.mem, hole, 1), Ok(1), "a hole reads (as zeros)");
    assert!(
        p.pagemap.all_in_memory(hole, hole + PAGE).unwrap(),
        "the read mapped the zero page"
    );
    // Which a move into the slot then finds present.
    p.fill(0, 3);
    assert_eq!(
        p.ask(&format!("move r 0 s {} {PAGE}", 7 * PAGE)),
        format!("err {} 0", libc::EEXIST)
    );
}

#[test]
fn a_zeropage_from_another_process_resolves_the_programs_fault() {
    let Some(mut p) = program(
        "a_zeropage_from_another_process_resolves_the_programs_fault",
        false,
    ) else {
        return;
    };
    let off = 7 * PAGE;
    p.send(&format!("read {}", off + 8));
    let m = p.message();
    assert_eq!(m.event, sys::UFFD_EVENT_PAGEFAULT);
    assert_eq!(m.arg1 as usize & !(PAGE - 1), p.region.base() + off);
    // As the pager's zero fill does it: no WP mode for ZEROPAGE, so protect right after.
    p.region.write_protect(off, PAGE, false, false).unwrap();
    assert_eq!(p.region.zeropage(off, PAGE, true), Ok(PAGE));
    p.region.write_protect(off, PAGE, true, false).unwrap();
    p.region.wake(off, PAGE).unwrap();
    assert_eq!(p.answer(), "0");
    let addr = p.region.base() + off;
    assert!(
        !p.pagemap.any_not_zero_page(addr, addr + PAGE).unwrap(),
        "the shared zero page is mapped"
    );
    assert_eq!(p.collect_written(), Vec::<usize>::new());
    assert_eq!(p.ask(&format!("write {off} 4")), "ok");
    assert_eq!(p.collect_written(), vec![off], "a write to it is tracked");
}

/// The program: an entry point the tests above start as a child process (ignored in a
/// normal run, so that it does not count as a pass).
#[test]
#[ignore = "the program's entry point, started by the tests above"]
fn program_process() {
    let mode = std::env::var("FARMAP_FOREIGN_PROGRAM")
        .expect("started by a foreign_kernel test, with FARMAP_FOREIGN_PROGRAM set");
    // SAFETY: fd 3 is the socket our parent set up for us, and nothing else owns it.
    let sock = unsafe { UnixStream::from_raw_fd(3) };
    let features = loud_features(mode == "fork");
    let loud = Uffd::open(features).expect("the region's userfaultfd");
    let quiet = Uffd::open(sys::UFFD_FEATURE_MOVE).expect("the staging area's userfaultfd");
    let map = || {
        // SAFETY: a new anonymous private mapping; nothing else refers to it.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p as usize
    };
    let (region, staging) = (map(), map());
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
            .register(staging, LEN, sys::UFFDIO_REGISTER_MODE_WP)
            .expect("registering the staging area");
    }
    let open = |path: &str| std::fs::File::open(path).expect(path);
    let (pagemap, mem) = (open("/proc/self/pagemap"), open("/proc/self/mem"));
    let mut hello = Vec::new();
    for w in [region as u64, staging as u64, LEN as u64, features] {
        hello.extend_from_slice(&w.to_le_bytes());
    }
    send_fds(
        &sock,
        &hello,
        &[loud.as_fd(), quiet.as_fd(), pagemap.as_fd(), mem.as_fd()],
    )
    .expect("sending the fds");
    let (loud, quiet) = (Arc::new(loud), Arc::new(quiet));
    let areas = [
        UffdRange::new(loud.clone(), region, LEN),
        UffdRange::new(quiet.clone(), staging, LEN),
    ];
    {
        // SAFETY: fd 4 is the reaper's socket our parent set up for us, nothing else owns it.
        let reaper = unsafe { UnixStream::from_raw_fd(4) };
        let areas = [
            UffdRange::new(loud.clone(), region, LEN),
            UffdRange::new(quiet.clone(), staging, LEN),
        ];
        std::thread::spawn(move || reaper_thread(reaper, areas));
    }
    let area = |w: &str| &areas[usize::from(w == "s")];
    let mut out = sock.try_clone().unwrap();
    let mut forked: Option<i32> = None;
    for line in BufReader::new(sock).lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| -> usize { words[i].parse().unwrap() };
        let answer = match words[0] {
            "read" => {
                // SAFETY: inside the region (the tests pass offsets below LEN), aligned, and
                // only ever touched with volatile accesses.
                unsafe { ((region + num(1)) as *const u64).read_volatile() }.to_string()
            }
            "sread" => {
                // SAFETY: as for "read", in the staging area.
                unsafe { ((staging + num(1)) as *const u64).read_volatile() }.to_string()
            }
            "write" => {
                // SAFETY: as for "read".
                unsafe { ((region + num(1)) as *mut u64).write_volatile(num(2) as u64) };
                "ok".to_owned()
            }
            "dontneed" | "free" | "dontneed-staging" => {
                let base = if words[0] == "dontneed-staging" {
                    staging
                } else {
                    region
                };
                let advice = if words[0] == "free" {
                    libc::MADV_FREE
                } else {
                    libc::MADV_DONTNEED
                };
                // SAFETY: a range of our own mapping; its pages may go (the contract of the
                // registration above).
                let r = unsafe { libc::madvise((base + num(1)) as *mut _, num(2), advice) };
                if r == 0 {
                    0
                } else {
                    std::io::Error::last_os_error().raw_os_error().unwrap_or(-1)
                }
                .to_string()
            }
            "fork" => {
                // SAFETY: the child only sleeps and exits (async-signal-safe calls).
                let pid = unsafe { libc::fork() };
                if pid == 0 {
                    // SAFETY: async-signal-safe calls in the forked child.
                    unsafe {
                        libc::sleep(30);
                        libc::_exit(0);
                    }
                }
                forked = Some(pid);
                pid.to_string()
            }
            "move" => {
                // move AREA OFF AREA OFF LEN (areas r and s), issued in this process.
                let (from, to) = (area(words[1]), area(words[3]));
                let flags = sys::UFFDIO_MOVE_MODE_DONTWAKE;
                match from.move_to(num(2), to, num(4), num(5), flags) {
                    Ok(n) => format!("ok {n}"),
                    Err((n, e)) => format!("err {e} {n}"),
                }
            }
            "reap" => {
                let pid = forked.take().expect("a forked child");
                // SAFETY: plain calls on our own child.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, std::ptr::null_mut(), 0);
                }
                "0".to_owned()
            }
            "exec" => {
                // A new image: fds 3 and 4 stay open (dup2'd: no close-on-exec), and it says
                // so on fd 3 before it sleeps.
                let e = Command::new("/bin/sh")
                    .args(["-c", "echo execd >&3; exec sleep 5"])
                    .exec();
                panic!("exec: {e}");
            }
            "exit" => break,
            other => panic!("unknown command {other:?}"),
        };
        writeln!(out, "{answer}").unwrap();
    }
}
