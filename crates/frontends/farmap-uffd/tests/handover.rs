//! Fault handling handed to another process over a Unix socket, with two real processes: the
//! test binary re-runs itself as the handler (`FARMAP_UFFD_HANDLER` set, socket on fd 3).
//! The handler serves faults and gives them back; killed, or dying with a fault in hand, it
//! leaves the owner to take over without a hang.

mod common;

use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use farmap_core::{ChunkIdx, Geometry, Store};
use farmap_pipeline::PullOptions;
use farmap_store::{FileOptions, FileStore};
use farmap_testkit::contents::write_pattern;
use farmap_testkit::wait::{eventually, within};
use farmap_testkit::{block_on, pattern_bytes};
use farmap_uffd::handover::{self, SendOptions, ServeOptions};
use farmap_uffd::{HandlerLocation, Region, RegionMode, RegionOptions, WriteTracking};

const CHUNK: usize = 64 << 10;
const SIZE: usize = 8 << 20;
const LIMIT: Duration = Duration::from_secs(20);

/// The handler's store: read-only, as farmap's handler opens it (the owner writes back, and
/// holds the file's writer lock).
fn open_file(spec: &str) -> Result<Arc<dyn Store>, String> {
    let path = spec.strip_prefix("file:").ok_or("not a file spec")?;
    let opts = FileOptions {
        size: None,
        chunk_size: CHUNK as u32,
        read_only: true,
    };
    let store = FileStore::open(Path::new(path), opts).map_err(|e| e.to_string())?;
    Ok(Arc::new(store))
}

/// A file store holding the pattern with `seed`, and its spec.
fn pattern_file(dir: &Path, seed: u64) -> (String, Arc<dyn Store>) {
    let path = dir.join("region.img");
    let g = Geometry::new(SIZE as u64, CHUNK as u64).unwrap();
    let opts = FileOptions {
        size: Some(g.size()),
        chunk_size: CHUNK as u32,
        read_only: false,
    };
    let store = FileStore::open(&path, opts).unwrap();
    block_on(async {
        write_pattern(&store, seed).await;
        store.flush().await.unwrap();
    });
    (format!("file:{}", path.display()), Arc::new(store))
}

/// Starts the handler process (its output captured if `capture`); returns our end of its
/// socket.
fn spawn_handler(mode: &str, capture: bool) -> (UnixStream, Child) {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let fd = theirs.as_raw_fd();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "handler_process",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("FARMAP_UFFD_HANDLER", mode)
    .stdout(if capture {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    // SAFETY: between fork and exec the child only calls dup2, which is async-signal-safe;
    // the copy on fd 3 has no close-on-exec flag, so exactly this child inherits the socket.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    drop(theirs);
    (ours, child)
}

/// The handler process: an entry point the tests above start as a child process (ignored in
/// a normal run, so that it does not count as a pass).
#[test]
#[ignore = "the handler process's entry point, started by the hand-over tests"]
fn handler_process() {
    let mode = std::env::var("FARMAP_UFFD_HANDLER")
        .expect("started by a hand-over test, with FARMAP_UFFD_HANDLER set");
    // SAFETY: fd 3 is the socket our parent set up for us, and nothing else owns it.
    let sock = unsafe { UnixStream::from_raw_fd(3) };
    let opts = ServeOptions {
        exit_after_faults: (mode == "die-on-3rd").then_some(3),
        ..ServeOptions::default()
    };
    let report = handover::serve(sock, open_file, opts).unwrap();
    println!(
        "handler: served {} faults, fetched {} chunks",
        report.faults, report.chunks_fetched
    );
}

fn open_region(spec: String, store: Arc<dyn Store>, mode: RegionMode) -> Region {
    let opts = RegionOptions {
        mode,
        store_spec: Some(spec),
        ..direct(WriteTracking::Async)
    };
    Region::open(store, opts).unwrap()
}

fn byte(off: usize) -> u8 {
    pattern_bytes(6, off as u64, 1)[0]
}

/// Reads one byte per chunk of `chunks` on another thread, with a time limit.
fn touch(region: &Arc<Region>, chunks: std::ops::Range<usize>) {
    let r = region.clone();
    within(LIMIT, "touching the region", move || {
        let mem = r.memory();
        for c in chunks {
            let off = c * CHUNK + 123;
            assert_eq!(mem.load_u8(off).unwrap(), byte(off), "byte {off}");
        }
    });
}

#[test]
fn a_handler_process_serves_faults_and_gives_them_back() {
    if !uffd_available("a_handler_process_serves_faults_and_gives_them_back") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (spec, store) = pattern_file(dir.path(), 6);
    let region = Arc::new(open_region(spec, store.clone(), RegionMode::Direct));
    touch(&region, 0..2);
    let (sock, child) = spawn_handler("serve", true);
    handover::send(&region, sock, SendOptions::default()).unwrap();
    assert_eq!(region.handler(), HandlerLocation::Remote);
    let before = region.stats();
    touch(&region, 2..40);
    let after = region.stats();
    assert_eq!(after.faults, before.faults, "the other process served them");
    assert_eq!(after.handler, HandlerLocation::Remote);
    // Writes are still tracked and pushed here, including to pages the handler installed.
    region.memory().store_u8(10 * CHUNK + 1, 0xEE).unwrap();
    // Not yet present: the handler fetches it first.
    region.memory().store_u8(60 * CHUNK, 0xDD).unwrap();
    region.sync().unwrap();
    let c10 = block_on(store.read(ChunkIdx(10))).unwrap();
    let c60 = block_on(store.read(ChunkIdx(60))).unwrap();
    assert_eq!((c10[1], c60[0]), (0xEE, 0xDD));
    assert_eq!(c60[1], byte(60 * CHUNK + 1));
    handover::reclaim(&region, LIMIT).unwrap();
    assert_eq!(region.handler(), HandlerLocation::Local);
    let out = within(LIMIT, "the handler's exit", move || {
        child.wait_with_output().unwrap()
    });
    assert!(out.status.success(), "{out:?}");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("handler: served"), "{said}");
    touch(&region, 70..80);
    assert!(
        region.stats().faults >= before.faults + 10,
        "served here again"
    );
}

#[test]
fn a_managed_region_is_pulled_by_the_handler() {
    if !uffd_available("a_managed_region_is_pulled_by_the_handler") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (spec, store) = pattern_file(dir.path(), 6);
    let pull = PullOptions {
        workers: 1,
        ..PullOptions::default()
    };
    let region = Arc::new(open_region(spec, store, RegionMode::Managed(pull)));
    let (sock, mut child) = spawn_handler("serve", false);
    handover::send(&region, sock, SendOptions::default()).unwrap();
    let before = region.stats().chunks_fetched;
    eventually("the handler pulled the region", LIMIT, || {
        // The handler's pull installs everything; this process fetches nothing.
        let r = region.clone();
        within(LIMIT, "reading the region", move || {
            let mem = r.memory();
            (0..mem.len() / CHUNK)
                .all(|c| mem.load_u8(c * CHUNK + 7).unwrap() == byte(c * CHUNK + 7))
        })
    });
    // A fetch of this process's own puller that was in flight when it stopped may finish.
    assert!(region.stats().chunks_fetched <= before + 1);
    handover::reclaim(&region, LIMIT).unwrap();
    within(LIMIT, "the handler's exit", move || child.wait().unwrap());
}

#[test]
fn the_owner_takes_over_when_the_handler_is_killed() {
    if !uffd_available("the_owner_takes_over_when_the_handler_is_killed") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (spec, store) = pattern_file(dir.path(), 6);
    let region = Arc::new(open_region(spec, store, RegionMode::Direct));
    let (sock, mut child) = spawn_handler("serve", false);
    handover::send(&region, sock, SendOptions::default()).unwrap();
    touch(&region, 0..5);
    let served_here = region.stats().faults;
    child.kill().unwrap();
    child.wait().unwrap();
    touch(&region, 5..50);
    assert!(region.stats().faults >= served_here + 45);
    assert_eq!(region.handler(), HandlerLocation::Local);
}

#[test]
fn a_fault_the_dying_handler_read_is_served_after_take_over() {
    if !uffd_available("a_fault_the_dying_handler_read_is_served_after_take_over") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (spec, store) = pattern_file(dir.path(), 6);
    let region = Arc::new(open_region(spec, store, RegionMode::Direct));
    let (sock, mut child) = spawn_handler("die-on-3rd", false);
    handover::send(&region, sock, SendOptions::default()).unwrap();
    touch(&region, 0..2);
    assert_eq!(region.stats().faults, 0, "served remotely");
    // The third fault is read by the handler, which exits without serving it: the thread
    // stays blocked until this process notices and wakes the region.
    touch(&region, 2..3);
    let status = child.wait().unwrap();
    assert!(
        status.success(),
        "the handler exited on purpose: {status:?}"
    );
    assert_eq!(region.handler(), HandlerLocation::Local);
    assert!(
        region.stats().faults >= 1,
        "the re-raised fault was served here"
    );
    touch(&region, 3..10);
}

#[test]
fn sending_needs_a_spec_and_async_tracking() {
    if !uffd_available("sending_needs_a_spec_and_async_tracking") {
        return;
    }
    let g = Geometry::new(1 << 20, CHUNK as u64).unwrap();
    let store = Arc::new(farmap_store::MemoryStore::new(g));
    let region = Region::open(store.clone(), direct(WriteTracking::Async)).unwrap();
    let (a, _b) = UnixStream::pair().unwrap();
    let err = handover::send(&region, a, SendOptions::default()).unwrap_err();
    assert!(matches!(err, handover::HandoverError::NoSpec), "{err}");
    let opts = RegionOptions {
        store_spec: Some("memory:1MiB".into()),
        ..direct(WriteTracking::SyncFaults)
    };
    let region = Region::open(store, opts).unwrap();
    let (a, _b) = UnixStream::pair().unwrap();
    let err = handover::send(&region, a, SendOptions::default()).unwrap_err();
    assert!(
        matches!(err, handover::HandoverError::NeedsAsyncTracking),
        "{err}"
    );
}

#[test]
fn a_silent_handler_times_out_and_the_owner_keeps_serving() {
    if !uffd_available("a_silent_handler_times_out_and_the_owner_keeps_serving") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (spec, store) = pattern_file(dir.path(), 6);
    let region = Arc::new(open_region(spec, store, RegionMode::Direct));
    let (a, _silent) = UnixStream::pair().unwrap();
    let opts = SendOptions {
        reply_timeout: Duration::from_millis(100),
        ..SendOptions::default()
    };
    let err = handover::send(&region, a, opts).unwrap_err();
    assert!(matches!(err, handover::HandoverError::Timeout(_)), "{err}");
    assert_eq!(region.handler(), HandlerLocation::Local);
    touch(&region, 0..4);
}

/// A chunk discarded while another process served faults (so this process never sees the
/// remove event: `discard_pages` makes the chunk absent here itself) is fetched again when
/// touched after take-over.
#[test]
fn a_chunk_discarded_during_hand_over_is_fetched_again_after() {
    if !uffd_available("a_chunk_discarded_during_hand_over_is_fetched_again_after") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (spec, store) = pattern_file(dir.path(), 6);
    let region = Arc::new(open_region(spec, store, RegionMode::Direct));
    touch(&region, 0..1);
    eventually("chunk 0 present", Duration::from_secs(1), || {
        region.stats().present_chunks == 1
    });
    let (sock, child) = spawn_handler("serve", false);
    handover::send(&region, sock, SendOptions::default()).unwrap();
    let r = region.clone();
    within(LIMIT, "discarding chunk 0", move || {
        let pages = (CHUNK / r.page_size()) as u64;
        #[allow(clippy::single_range_in_vec_init)] // one run of pages
        r.discard_pages(&[0..pages]).unwrap();
    });
    handover::reclaim(&region, LIMIT).unwrap();
    within(LIMIT, "the handler's exit", move || {
        let mut child = child;
        child.wait().unwrap()
    });
    assert_eq!(region.stats().present_chunks, 0, "discarded: absent here");
    let fetched = region.stats().chunks_fetched;
    touch(&region, 0..1);
    // The fetch is counted after its copy, which may wake the touching thread first.
    eventually("chunk 0 fetched again", Duration::from_secs(1), || {
        region.stats().chunks_fetched > fetched
    });
    assert_eq!(region.stats().chunks_fetched, fetched + 1, "fetched once");
}

/// The other user's side of `an_owner_of_another_user_is_refused_before_anything_is_read`:
/// connects to the handler's socket, sends a few bytes, prints what comes back.
#[test]
#[ignore = "run as another user by an_owner_of_another_user_is_refused_before_anything_is_read"]
fn stranger_owner() {
    use std::io::{Read, Write};
    let path = std::env::var("FARMAP_STRANGER_SOCK").expect("started by the test");
    let mut s = UnixStream::connect(path).unwrap();
    let _ = s.write_all(b"FMHO not really a hello");
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    println!("REPLY {} bytes", reply.len());
}

/// A handler opens the store its owner names with its own privileges: an owner of another
/// user is refused before a byte of its hello is read (and its spec is never opened).
#[test]
fn an_owner_of_another_user_is_refused_before_anything_is_read() {
    use std::os::unix::fs::PermissionsExt;
    let test = "an_owner_of_another_user_is_refused_before_anything_is_read";
    if rustix::process::geteuid().as_raw() != 0 {
        farmap_testkit::skip(test, "not root: cannot run the other user");
        return;
    }
    if Command::new("setpriv").arg("--version").output().is_err() {
        farmap_testkit::skip(test, "setpriv (util-linux) is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = dir.path().join("handler.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).unwrap();
    let child = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "stranger_owner",
            "--ignored",
            "--exact",
            "--nocapture",
            "-q",
        ])
        .env("FARMAP_STRANGER_SOCK", &path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (sock, _) = listener.accept().unwrap();
    let opened = std::sync::atomic::AtomicBool::new(false);
    let e = handover::serve(
        sock,
        |_: &str| {
            opened.store(true, std::sync::atomic::Ordering::SeqCst);
            Err::<Arc<dyn Store>, _>("must not be opened".to_owned())
        },
        ServeOptions::default(),
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            handover::HandoverError::Stranger {
                owner: 65534,
                handler: 0
            }
        ),
        "{e}"
    );
    assert!(!opened.load(std::sync::atomic::Ordering::SeqCst));
    let out = child.wait_with_output().unwrap();
    let out = String::from_utf8_lossy(&out.stdout);
    assert!(out.contains("REPLY"), "the owner was answered: {out}");
    assert!(!out.contains("REPLY 0 bytes"), "with a refusal: {out}");
}
