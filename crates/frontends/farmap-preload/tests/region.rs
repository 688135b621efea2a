//! The library in region mode against a real handler: this test process plays `farmap run`
//! (the handshake, then [`ForeignRegion`] over the fds the program sends), and the program
//! is `/usr/bin/python3` with the library preloaded, writing and checking tagged objects
//! whose working set is larger than the local limit. A second test plays a handler that
//! serves no faults, to check the reaper's answers and that losing the handler kills the
//! program.

mod common;

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{count, preloaded, python_tagged, stat};
use farmap_core::{Geometry, Store};
use farmap_run_proto::{
    decode, Config, Done, Msg, Op, Registered, Request, Verdict, MAX_MSG_LEN, TOKEN_LEN,
};
use farmap_store::MemoryStore;
use farmap_uffd::foreign::{
    trash_len, End, ForeignFds, ForeignOptions, ForeignRegion, Program, Reaper, FOREIGN_FEATURES,
};
use farmap_uffd::uffd::Uffd;
use farmap_uffd::{sys, LocalLimit};

const PAGE: u64 = 4096;
/// The region (`--heap-max`).
const REGION: u64 = 256 << 20;
/// The local limit: a quarter of the program's 64 MiB of data.
const LOCAL: u64 = 16 << 20;
const LIMIT: Duration = Duration::from_secs(120);
const TOKEN: [u8; TOKEN_LEN] = [0xA5; TOKEN_LEN];

fn features() -> u64 {
    FOREIGN_FEATURES | sys::UFFD_FEATURE_THREAD_ID
}

fn geometry() -> Geometry {
    Geometry::new(REGION, PAGE).unwrap()
}

/// Whether this kernel can serve a program's region (a recorded skip otherwise).
fn usable(test: &str) -> bool {
    if farmap_testkit::skip::unless(test, farmap_uffd::probe_paging()).is_none() {
        return false;
    }
    match Uffd::probe() {
        Ok(s) if s & features() == features() => true,
        Ok(s) => {
            farmap_testkit::skip(test, format!("userfaultfd lacks {:#x}", features() & !s));
            false
        }
        Err(e) => {
            farmap_testkit::skip(test, format!("userfaultfd: {e}"));
            false
        }
    }
}

fn hex(token: &[u8]) -> String {
    token.iter().map(|b| format!("{b:02x}")).collect()
}

/// Reads one message.
fn read_msg(sock: &mut UnixStream) -> Msg {
    let mut buf = Vec::new();
    loop {
        if let Some((msg, used)) = decode(&buf).unwrap() {
            assert_eq!(used, buf.len(), "one message at a time");
            return msg;
        }
        let mut b = [0u8; 1];
        let n = sock
            .read(&mut b)
            .expect("reading the program's next message");
        assert_eq!(n, 1, "the program closed the socket");
        buf.push(b[0]);
    }
}

fn send(sock: &mut UnixStream, msg: Msg) {
    let mut out = [0u8; MAX_MSG_LEN];
    let n = msg.encode(&mut out).unwrap();
    sock.write_all(&out[..n]).unwrap();
}

/// A program started under the library with a session socket, and this side's end of it
/// after the handshake up to `Registered`.
struct Started {
    child: Child,
    sock: UnixStream,
    registered: Registered,
    fds: Vec<OwnedFd>,
    /// Where the program's next image (after an exec) connects.
    listener: UnixListener,
    _dir: tempfile::TempDir,
}

/// Starts `python3 -c script` under the library, accepts its session, checks its Hello,
/// sends the Config and receives its areas and fds.
fn start(script: &str) -> Started {
    let mut cmd = preloaded("/usr/bin/python3");
    cmd.args(["-c", script]);
    start_cmd(cmd, tempfile::tempdir().unwrap())
}

/// [`start`] for any program (`cmd`, with the library preloaded), its socket in `dir`.
fn start_cmd(mut cmd: Command, dir: tempfile::TempDir) -> Started {
    let path = dir.path().join("run.sock");
    let listener = UnixListener::bind(&path).unwrap();
    listener.set_nonblocking(true).unwrap();
    let mut child = cmd
        .env("FARMAP_RUN_SOCK", &path)
        .env("FARMAP_RUN_TOKEN", hex(&TOKEN))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (sock, registered, fds) = accept(&listener, &mut child);
    Started {
        child,
        sock,
        registered,
        fds,
        listener,
        _dir: dir,
    }
}

/// Accepts `child`'s session on `listener`, checks its Hello, sends the Config and
/// receives its areas and fds.
fn accept(listener: &UnixListener, child: &mut Child) -> (UnixStream, Registered, Vec<OwnedFd>) {
    let deadline = Instant::now() + LIMIT;
    let mut sock = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if let Some(status) = child.try_wait().unwrap() {
                    panic!("the program ended before connecting: {status:?}");
                }
                assert!(Instant::now() < deadline, "the program never connected");
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    sock.set_nonblocking(false).unwrap();
    sock.set_read_timeout(Some(LIMIT)).unwrap();
    let Msg::Hello(hello) = read_msg(&mut sock) else {
        panic!("not a Hello")
    };
    assert_eq!(hello.token, TOKEN);
    assert_eq!(hello.pid, child.id());
    send(
        &mut sock,
        Msg::Config(Config {
            region_len: REGION,
            chunk_size: PAGE as u32,
            trash_len: trash_len(geometry()),
            features: features(),
        }),
    );
    let mut buf = [0u8; MAX_MSG_LEN];
    let (n, fds) = farmap_testkit::fds::recv_fds(&sock, &mut buf).expect("the program's areas");
    let Some((Msg::Registered(registered), used)) = decode(&buf[..n]).unwrap() else {
        panic!("not a Registered message: {:?}", &buf[..n]);
    };
    assert_eq!(used, n);
    assert_eq!(fds.len(), 4);
    assert_eq!(registered.region_len, REGION);
    assert_eq!(registered.staging_len, REGION + trash_len(geometry()));
    assert_eq!(registered.features, features());
    (sock, registered, fds)
}

/// Waits for the program's end; its status, stdout and stderr.
fn finish(mut child: Child) -> (std::process::ExitStatus, String, String) {
    let deadline = Instant::now() + LIMIT;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "the program did not end");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut out = String::new();
    let mut err = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (status, out, err)
}

/// Serves a started program's region with [`LOCAL`] bytes local, and sends the verdict.
/// Returns the socket, the listener and the directory too, which must live as long as the
/// program.
fn serve(
    s: Started,
    rt: &tokio::runtime::Runtime,
) -> (
    ForeignRegion,
    Child,
    (UnixStream, UnixListener, tempfile::TempDir),
) {
    let pid = s.child.id();
    let pidfd = rustix::process::pidfd_open(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::PidfdFlags::empty(),
    )
    .unwrap();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(geometry()));
    let mut opts = ForeignOptions::default();
    opts.paging.local_max = LocalLimit::Bytes(LOCAL);
    let mut sock = s.sock;
    let region = ForeignRegion::start(
        &s.registered,
        ForeignFds::try_from(s.fds).unwrap(),
        Program { pid, pidfd },
        Reaper::new(sock.try_clone().unwrap(), Duration::from_secs(5)).unwrap(),
        store,
        opts,
        rt.handle().clone(),
    )
    .unwrap();
    send(&mut sock, Msg::Verdict(Verdict { status: 0 }));
    (region, s.child, (sock, s.listener, s._dir))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn python_reads_back_64_mib_through_a_region_bounded_to_16_mib() {
    let test = "python_reads_back_64_mib_through_a_region_bounded_to_16_mib";
    if !usable(test) {
        return;
    }
    let rt = runtime();
    let s = start(&python_tagged(1, 64));
    let (region, child, _sock) = serve(s, &rt);
    let (status, out, err) = finish(child);
    assert!(status.success(), "python: {status:?}\n{out}\n{err}");
    assert_eq!(out.trim(), "ok", "{err}");
    let st = common::stats(&std::process::Output {
        status,
        stdout: out.into_bytes(),
        stderr: err.clone().into_bytes(),
    });
    assert_eq!(stat(&st, "mode"), "region", "{err}");
    assert!(count(&st, "main_allocs") > 1024, "{st:?}");
    assert_eq!(region.wait_end(Duration::from_secs(10)), Some(End::Exited));
    let stats = region.stats();
    let p = stats.paging.clone().unwrap();
    eprintln!("{stats:?}");
    assert!(stats.faults > (LOCAL / PAGE), "{stats:?}");
    assert!(p.evictions_reactive + p.evictions_proactive > 0, "{p:?}");
    assert!(p.limit_chunks <= LOCAL / PAGE, "{p:?}");
    drop(region);
}

#[test]
fn the_reaper_answers_requests_and_losing_the_handler_kills_the_program() {
    let test = "the_reaper_answers_requests_and_losing_the_handler_kills_the_program";
    if !usable(test) {
        return;
    }
    // Nobody serves the region's faults here: the program blocks in its first allocation
    // from the region, while its reaper (started before the region heap) answers. Its
    // session fds are placed from 900 up.
    let mut cmd = preloaded("/usr/bin/python3");
    cmd.args(["-c", "print('never')"])
        .env("FARMAP_RUN_FD_BASE", "900");
    let mut s = start_cmd(cmd, tempfile::tempdir().unwrap());
    let high: Vec<String> = std::fs::read_dir(format!("/proc/{}/fd", s.child.id()))
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            let n: u32 = e.file_name().to_str()?.parse().ok()?;
            (n >= 900).then(|| std::fs::read_link(e.path()).ok())?
        })
        .map(|l| l.display().to_string())
        .collect();
    assert_eq!(high.len(), 3, "{high:?}");
    assert_eq!(
        high.iter().filter(|l| l.contains("userfaultfd")).count(),
        2,
        "{high:?}"
    );
    assert_eq!(
        high.iter().filter(|l| l.starts_with("socket:")).count(),
        1,
        "{high:?}"
    );
    let r = s.registered;
    // The kernel may place the two areas next to each other: "outside" is outside both.
    let below = r.region.min(r.staging) - 16 * PAGE;
    let above = (r.region + r.region_len).max(r.staging + r.staging_len) + 16 * PAGE;
    let requests = [
        // Outside both areas: refused, untouched.
        (
            Op::Discard {
                start: below,
                len: PAGE,
            },
            libc::EINVAL,
            0,
        ),
        // Across the end of the staging area.
        (
            Op::Discard {
                start: r.staging + r.staging_len - PAGE,
                len: 2 * PAGE,
            },
            libc::EINVAL,
            0,
        ),
        // Inside the staging area: done.
        (
            Op::Discard {
                start: r.staging,
                len: 4 * PAGE,
            },
            0,
            4 * PAGE,
        ),
        // A move whose source page is missing: the kernel's ENOENT, nothing moved.
        (
            Op::Move {
                src: r.staging,
                dst: r.region + 8 * PAGE,
                len: PAGE,
            },
            libc::ENOENT,
            0,
        ),
        // A move to outside the areas.
        (
            Op::Move {
                src: r.staging,
                dst: above,
                len: PAGE,
            },
            libc::EINVAL,
            0,
        ),
    ];
    send(&mut s.sock, Msg::Verdict(Verdict { status: 0 }));
    for (id, (op, errno, bytes)) in requests.into_iter().enumerate() {
        let id = id as u32 + 1;
        send(&mut s.sock, Msg::Request(Request { id, op }));
        assert_eq!(
            read_msg(&mut s.sock),
            Msg::Done(Done { id, errno, bytes }),
            "{op:?}"
        );
    }
    assert!(s.child.try_wait().unwrap().is_none(), "the program waits");
    drop(s.sock);
    drop(s.fds);
    let started = Instant::now();
    let (status, out, _) = finish(s.child);
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(!out.contains("never"));
}

#[test]
fn a_refusal_ends_the_program_with_127() {
    let test = "a_refusal_ends_the_program_with_127";
    if !usable(test) {
        return;
    }
    let mut s = start("print('never')");
    send(&mut s.sock, Msg::Verdict(Verdict { status: 1 }));
    let (status, out, err) = finish(s.child);
    assert_eq!(status.code(), Some(127), "{status:?} {err}");
    assert!(err.contains("refused"), "{err}");
    assert!(!out.contains("never"));
}

#[test]
fn redis_keeps_40_mib_of_keys_through_a_region_bounded_to_16_mib() {
    let test = "redis_keeps_40_mib_of_keys_through_a_region_bounded_to_16_mib";
    if !usable(test) {
        return;
    }
    if Command::new("redis-cli").arg("--version").output().is_err() {
        farmap_testkit::skip(test, "redis-server or redis-cli is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let redis_sock = dir.path().join("redis.sock");
    let mut cmd = preloaded("redis-server");
    cmd.args([
        "--port",
        "0",
        "--save",
        "",
        "--appendonly",
        "no",
        "--unixsocket",
    ])
    .arg(&redis_sock)
    .current_dir(dir.path());
    let rt = runtime();
    let s = start_cmd(cmd, dir);
    let (region, mut child, _sock) = serve(s, &rt);
    let cli = |args: &[&str]| {
        let out = Command::new("redis-cli")
            .arg("-s")
            .arg(&redis_sock)
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let deadline = Instant::now() + LIMIT;
    while cli(&["PING"]) != "PONG" {
        if child.try_wait().unwrap().is_some() {
            let (status, out, err) = finish(child);
            panic!("redis-server ended: {status:?}\n{out}\n{err}");
        }
        assert!(Instant::now() < deadline, "redis-server never answered");
        std::thread::sleep(Duration::from_millis(20));
    }
    let value = "string.rep(string.char(65 + i % 26), 1000) .. i";
    let fill = format!(
        "for i=1,40000 do redis.call('SET', 'k'..i, {value}) end return redis.call('DBSIZE')"
    );
    assert_eq!(cli(&["EVAL", &fill, "0"]), "40000");
    let check = format!(
        "for i=1,40000 do if redis.call('GET', 'k'..i) ~= {value} then return i end end return 0"
    );
    assert_eq!(cli(&["EVAL", &check, "0"]), "0", "a key read back wrong");
    let _ = cli(&["SHUTDOWN", "NOSAVE"]);
    let (status, out, err) = finish(child);
    assert!(status.success(), "redis-server: {status:?}\n{out}\n{err}");
    let st = common::stats(&std::process::Output {
        status,
        stdout: Vec::new(),
        stderr: err.into_bytes(),
    });
    assert_eq!(stat(&st, "mode"), "region");
    assert!(count(&st, "main_allocs") > 80_000, "{st:?}");
    assert_eq!(region.wait_end(Duration::from_secs(10)), Some(End::Exited));
    let stats = region.stats();
    let p = stats.paging.clone().unwrap();
    eprintln!("{stats:?}");
    assert!(stats.faults > LOCAL / PAGE, "{stats:?}");
    assert!(p.evictions_reactive + p.evictions_proactive > 0, "{p:?}");
}

/// A C program in region mode that forks: the child allocates from a heap of its own, and
/// touching its parent's heap object kills it (SIGSEGV: the region is `MADV_DONTFORK`).
const FORK_C: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
int main(void) {
    char *p = malloc(100000);
    memset(p, 7, 100000);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        char *q = malloc(100000);
        memset(q, 9, 100000);
        int ok = q[99999] == 9;
        free(q);
        printf("child allocated %d\n", ok);
        fflush(stdout);
        volatile char c = p[5];
        printf("child read the parent's object: %d\n", c);
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    printf("child signal %d\n", WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    printf("parent reads %d\n", p[99999]);
    free(p);
    return 0;
}
"#;

#[test]
fn a_forked_child_allocates_on_its_own_and_faults_on_its_parents_heap() {
    let test = "a_forked_child_allocates_on_its_own_and_faults_on_its_parents_heap";
    if !usable(test) {
        return;
    }
    if Command::new("gcc").arg("--version").output().is_err() {
        farmap_testkit::skip(test, "gcc is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (src, exe) = (dir.path().join("fork.c"), dir.path().join("fork"));
    std::fs::write(&src, FORK_C).unwrap();
    let built = Command::new("gcc")
        .args(["-O1", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap();
    common::assert_success(&built, "gcc");
    let rt = runtime();
    let s = start_cmd(preloaded(exe.to_str().unwrap()), dir);
    let (region, child, _sock) = serve(s, &rt);
    let (status, out, err) = finish(child);
    assert!(status.success(), "{status:?}\n{out}\n{err}");
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        ["child allocated 1", "child signal 11", "parent reads 7"],
        "{err}"
    );
    drop(region);
}

#[test]
fn an_exec_ends_the_session_and_the_new_image_opens_its_own() {
    let test = "an_exec_ends_the_session_and_the_new_image_opens_its_own";
    if !usable(test) {
        return;
    }
    let rt = runtime();
    let mut cmd = preloaded("/bin/sh");
    cmd.args([
        "-c",
        "exec /usr/bin/python3 -c \"$0\"",
        &python_tagged(1, 32),
    ]);
    let s = start_cmd(cmd, tempfile::tempdir().unwrap());
    let (first, mut child, (_sock, listener, dir)) = serve(s, &rt);
    assert_eq!(first.wait_end(LIMIT), Some(End::Replaced));
    let (sock, registered, fds) = accept(&listener, &mut child);
    let s = Started {
        child,
        sock,
        registered,
        fds,
        listener,
        _dir: dir,
    };
    let (second, child, _keep) = serve(s, &rt);
    let (status, out, err) = finish(child);
    assert!(status.success(), "{status:?}\n{out}\n{err}");
    assert_eq!(out.trim(), "ok", "{err}");
    assert_eq!(second.wait_end(Duration::from_secs(10)), Some(End::Exited));
    let stats = second.stats();
    let p = stats.paging.clone().unwrap();
    assert!(stats.faults > LOCAL / PAGE, "{stats:?}");
    assert!(p.evictions_reactive + p.evictions_proactive > 0, "{p:?}");
    drop((first, second));
}
