//! The handler's side of a program's handshake (farmap-run-proto, docs/design/farmap-run.md
//! §2.1): who is asking, what it is told to map, what it registered and sent, checked in
//! full before anything is acted on; then the region is served and the verdict sent.
//!
//! ```text
//!  program                                    handler (this module)
//!  Hello {token, pid}          ─────────▶     token, the peer's uid and pid, its ancestry
//!                              ◀─────────     Config {region_len, chunk_size, trash_len, features}
//!  Registered + 4 fds          ─────────▶     sizes, features, what each fd is
//!                              ◀─────────     Verdict {0 | refusal}
//!  (the same socket is the reaper's from here on)
//! ```
//!
//! A refusal is sent to the program (which exits: it cannot run without its heap) and
//! returned with its reason.

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use farmap_core::Store;
use farmap_run_proto::{
    decode, Config, Hello, Msg, Refusal, Registered, Verdict, MAX_MSG_LEN, TOKEN_LEN,
};
use tokio::runtime::Handle;

use super::fork::ForkCopy;
use super::reaper::Reaper;
use super::region::{ForeignFds, ForeignOptions, ForeignRegion, Program};
use crate::error::RegionError;
use crate::handover::socket::recv_with_fds;

/// How long the reaper may take to answer a request before it counts as lost.
pub const REAPER_DEADLINE: Duration = Duration::from_secs(5);

/// What a handler expects of the programs that connect to it.
#[derive(Debug, Clone)]
pub struct Expected {
    /// The token it gave them (in their environment).
    pub token: [u8; TOKEN_LEN],
    /// What they are to map and register.
    pub config: Config,
    /// Only this process and its descendants may connect (`None`: any process of this
    /// user).
    pub ancestor: Option<u32>,
}

/// Why a handshake did not end in a served region.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The socket failed, or the program went away.
    #[error("talking to the program: {0}")]
    Io(#[from] io::Error),
    /// The program sent something that is not a message of the protocol, or not the one
    /// expected now.
    #[error("the program does not speak farmap run's protocol: {0}")]
    Protocol(String),
    /// The program was refused (and told so).
    #[error("refused the program ({refusal:?}): {why}")]
    Refused {
        /// The code it was sent.
        refusal: Refusal,
        /// Why.
        why: String,
    },
}

/// A program past the handshake's checks, not served yet ([`accept`](Self::accept)).
#[derive(Debug)]
pub struct Applicant {
    /// What it said first.
    pub hello: Hello,
    /// Where its areas are.
    pub registered: Registered,
    fds: ForeignFds,
    program: Program,
    sock: UnixStream,
}

impl Applicant {
    /// The program's pid.
    pub fn pid(&self) -> u32 {
        self.program.pid
    }

    /// Serves the program's region from `store` with `opts` (on `rt`) and sends the
    /// verdict: serving, or [`Refusal::Setup`] if the region could not be set up (the
    /// error is returned).
    pub fn accept(
        self,
        store: Arc<dyn Store>,
        opts: ForeignOptions,
        rt: Handle,
    ) -> Result<ForeignRegion, RegionError> {
        let Applicant {
            registered,
            fds,
            program,
            mut sock,
            ..
        } = self;
        let reaper = sock
            .try_clone()
            .and_then(|s| Reaper::new(s, REAPER_DEADLINE))
            .map_err(|e| RegionError::sys("talking to the program's reaper", e));
        let region = reaper.and_then(|reaper| {
            ForeignRegion::start(&registered, fds, program, reaper, store, opts, rt)
        });
        let status = match &region {
            Ok(_) => 0,
            Err(_) => Refusal::Setup as u16,
        };
        if let Err(e) = send(&mut sock, Msg::Verdict(Verdict { status })) {
            // The program is gone or deaf: the region (if any) ends with it.
            tracing::debug!("sending the verdict: {e}");
        }
        region
    }

    /// Refuses the program (it is told [`Refusal::Setup`]): the handler cannot serve it.
    pub fn refuse(mut self, why: &str) -> HandshakeError {
        refuse(&mut self.sock, Refusal::Setup, why.to_owned())
    }
}

/// Who made a connection, once its first message is checked.
#[derive(Debug)]
pub enum Contact {
    /// A program image that wants its heap served.
    Program(Applicant),
    /// A program that is about to fork ([`ForkCall::serve`]).
    Fork(ForkCall),
}

/// A program about to fork: its token and credentials checked, not answered yet.
#[derive(Debug)]
pub struct ForkCall {
    pid: u32,
    region: u64,
    sock: UnixStream,
}

/// How long a fork's connection waits for the fork's event after it paused the pager.
const FORK_EVENT_WAIT: Duration = Duration::from_secs(10);

/// How long a fork's connection waits for the fork's child to be copied (the copy of a
/// large heap from a slow store takes a while; a fork that fails ends it at once).
pub const FORK_WAIT: Duration = Duration::from_secs(600);

impl ForkCall {
    /// The forking program's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The address of the forking program's region (an exec makes a new region under the
    /// same pid: this names the one of the image that forks).
    pub fn region(&self) -> u64 {
        self.region
    }

    /// Serves the fork on `region` (the program's, found by [`pid`](Self::pid) and
    /// [`region`](Self::region)): pauses its
    /// pager and says so; once the fork's child is whole, tells it (it waits on the same
    /// connection, which it inherited). Returns what was copied, or `None` if the fork
    /// did not happen (the program closed the connection first).
    pub fn serve(mut self, region: &ForeignRegion) -> Result<Option<ForkCopy>, HandshakeError> {
        self.sock.set_read_timeout(None)?;
        let pause = region.pause_for_fork();
        send(&mut self.sock, Msg::Verdict(Verdict { status: 0 }))?;
        let start = std::time::Instant::now();
        while start.elapsed() < FORK_WAIT {
            match pause.wait_child(Duration::from_millis(20)) {
                Some(Ok(copy)) => {
                    // The child may be gone already: nothing to tell then.
                    let _ = send(&mut self.sock, Msg::Verdict(Verdict { status: 0 }));
                    return Ok(Some(copy));
                }
                Some(Err(why)) => {
                    let _ = send(
                        &mut self.sock,
                        Msg::Verdict(Verdict {
                            status: Refusal::Setup as u16,
                        }),
                    );
                    return Err(HandshakeError::Protocol(format!(
                        "copying the forked child's heap: {why}"
                    )));
                }
                None if peer_closed(&self.sock)? => return Ok(None),
                None if pause.waiting_for_fork() && start.elapsed() > FORK_EVENT_WAIT => {
                    // A child that waits for a copy that will never come: it is told to
                    // stop (its heap may have holes).
                    let _ = send(
                        &mut self.sock,
                        Msg::Verdict(Verdict {
                            status: Refusal::Setup as u16,
                        }),
                    );
                    return Err(HandshakeError::Protocol(format!(
                        "the program announced a fork, but none came within {FORK_EVENT_WAIT:?}"
                    )));
                }
                None => {}
            }
        }
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the fork's child was not copied within {FORK_WAIT:?}"),
        )
        .into())
    }

    /// Refuses the fork (the program forks unpaused, or not at all).
    pub fn refuse(mut self, why: &str) -> HandshakeError {
        refuse(&mut self.sock, Refusal::Setup, why.to_owned())
    }
}

/// Whether the peer closed the connection (every copy of it); bytes it sent are a
/// protocol error (nothing is expected from it).
fn peer_closed(sock: &UnixStream) -> Result<bool, HandshakeError> {
    sock.set_nonblocking(true)?;
    let mut byte = [0u8; 1];
    let r = rustix::net::recv(sock, &mut byte, rustix::net::RecvFlags::PEEK);
    sock.set_nonblocking(false)?;
    match r {
        Ok((0, _)) => Ok(true),
        Ok(_) => Err(HandshakeError::Protocol(
            "the forking program sent bytes out of turn".into(),
        )),
        Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => Ok(false),
        Err(e) => Err(io::Error::from(e).into()),
    }
}

/// Runs the handshake on `sock` (a connection a program made) up to its verdict: checks
/// its hello, tells it `expected.config`, receives and checks what it registered, all
/// within `timeout` (a peer that says nothing, or trickles its messages a byte at a time,
/// is cut off then: the socket is shut down and the handshake fails). A connection that
/// announces a fork instead is checked the same way (token, credentials) and returned as
/// [`Contact::Fork`].
pub fn handshake(
    mut sock: UnixStream,
    expected: &Expected,
    timeout: Duration,
) -> Result<Contact, HandshakeError> {
    sock.set_read_timeout(Some(timeout))?;
    sock.set_write_timeout(Some(timeout))?;
    let deadline = Deadline::arm(&sock, timeout)?;
    let steps = handshake_steps(&mut sock, expected);
    if !deadline.disarm() {
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the handshake took longer than {timeout:?}"),
        )
        .into());
    }
    let (hello, registered, fds, pidfd) = match steps? {
        Steps::Program(hello, registered, fds, pidfd) => (hello, registered, fds, pidfd),
        Steps::Fork(pid, region) => return Ok(Contact::Fork(ForkCall { pid, region, sock })),
    };
    // From here on the reaper's requests have their own deadline.
    sock.set_read_timeout(None)?;
    sock.set_write_timeout(None)?;
    Ok(Contact::Program(Applicant {
        hello,
        registered,
        fds,
        program: Program {
            pid: hello.pid,
            pidfd,
        },
        sock,
    }))
}

/// What the handshake's steps found.
enum Steps {
    Program(Hello, Registered, ForeignFds, OwnedFd),
    /// A fork announced by this pid, of its region at this address.
    Fork(u32, u64),
}

/// The steps of [`handshake`] up to its verdict: the hello, what was registered, the
/// descriptors, a pidfd of the program.
fn handshake_steps(sock: &mut UnixStream, expected: &Expected) -> Result<Steps, HandshakeError> {
    let (hello, fork) = match read_msg(sock)? {
        Msg::Hello(hello) => (hello, None),
        Msg::ForkPrepare(f) => (
            Hello {
                token: f.token,
                pid: f.pid,
            },
            Some(f.region),
        ),
        _ => {
            return Err(HandshakeError::Protocol(
                "the first message is not a hello".into(),
            ))
        }
    };
    if !same_token(&hello.token, &expected.token) {
        return Err(refuse(sock, Refusal::Token, "a wrong token".into()));
    }
    if let Err(why) = check_peer(sock, hello.pid, expected.ancestor) {
        return Err(refuse(sock, Refusal::Stranger, why));
    }
    if let Some(region) = fork {
        return Ok(Steps::Fork(hello.pid, region));
    }
    send(sock, Msg::Config(expected.config))?;
    let (registered, fds) = read_registered(sock)?;
    let c = &expected.config;
    let staging_len = c.region_len + c.trash_len;
    // Fork events need a privilege the program may lack: it may go without them (its
    // region is then not inherited by its children).
    let features_ok = registered.features == c.features
        || registered.features == c.features & !crate::sys::UFFD_FEATURE_EVENT_FORK;
    if registered.region_len != c.region_len
        || registered.staging_len != staging_len
        || !features_ok
    {
        let why = format!(
            "registered {registered:?}, configured {} bytes, staging {staging_len}, features {:#x}",
            c.region_len, c.features
        );
        return Err(refuse(sock, Refusal::Areas, why));
    }
    let fds = match check_fds(fds, hello.pid) {
        Ok(fds) => fds,
        Err(why) => return Err(refuse(sock, Refusal::Descriptors, why)),
    };
    let pidfd = match rustix::process::Pid::from_raw(hello.pid as i32)
        .ok_or(rustix::io::Errno::SRCH)
        .and_then(|pid| rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()))
    {
        Ok(fd) => fd,
        Err(e) => return Err(refuse(sock, Refusal::Stranger, format!("pidfd_open: {e}"))),
    };
    Ok(Steps::Program(hello, registered, fds, pidfd))
}

/// Shuts a handshake's socket down (both ways) unless disarmed in time: every read after
/// that ends at once. Each read has its own timeout too, but that restarts with every byte.
struct Deadline {
    disarm: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<bool>>,
}

impl Deadline {
    fn arm(sock: &UnixStream, limit: Duration) -> io::Result<Deadline> {
        let sock = sock.try_clone()?;
        let (tx, rx) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("farmap-run-deadline".into())
            .spawn(move || match rx.recv_timeout(limit) {
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let _ = sock.shutdown(std::net::Shutdown::Both);
                    true
                }
                _ => false,
            })?;
        Ok(Deadline {
            disarm: Some(tx),
            thread: Some(thread),
        })
    }

    /// Stops the clock; whether it had not run out yet (the socket is untouched).
    fn disarm(mut self) -> bool {
        self.stop()
    }

    fn stop(&mut self) -> bool {
        drop(self.disarm.take());
        match self.thread.take() {
            Some(t) => !t.join().unwrap_or(true),
            None => true,
        }
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Sends `refusal` (best effort) and returns the error.
fn refuse(sock: &mut UnixStream, refusal: Refusal, why: String) -> HandshakeError {
    let _ = send(
        sock,
        Msg::Verdict(Verdict {
            status: refusal as u16,
        }),
    );
    HandshakeError::Refused { refusal, why }
}

fn send(sock: &mut UnixStream, msg: Msg) -> io::Result<()> {
    let mut out = [0u8; MAX_MSG_LEN];
    let n = msg
        .encode(&mut out)
        .map_err(|e| io::Error::other(e.to_string()))?;
    sock.write_all(&out[..n])
}

/// Reads one message, byte-exact (never past its end: what follows is not ours to read).
fn read_msg(sock: &mut UnixStream) -> Result<Msg, HandshakeError> {
    let mut buf = [0u8; MAX_MSG_LEN];
    let mut have = 0;
    loop {
        match decode(&buf[..have]) {
            Ok(Some((msg, _))) => return Ok(msg),
            Ok(None) => {}
            Err(e) => return Err(HandshakeError::Protocol(e.to_string())),
        }
        // The header says how long the message is; read up to its end only.
        let want = if have < farmap_run_proto::HEADER_LEN {
            farmap_run_proto::HEADER_LEN
        } else {
            let len = u32::from_le_bytes(buf[8..12].try_into().expect("4 bytes")) as usize;
            (farmap_run_proto::HEADER_LEN + len).min(MAX_MSG_LEN)
        };
        let n = sock.read(&mut buf[have..want])?;
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
        }
        have += n;
    }
}

/// The length of a `Registered` message (a header and five 8-byte fields).
const REGISTERED_LEN: usize = farmap_run_proto::HEADER_LEN + 40;

/// Receives the program's `Registered` message and its descriptors.
fn read_registered(sock: &UnixStream) -> Result<(Registered, Vec<OwnedFd>), HandshakeError> {
    let len = REGISTERED_LEN;
    let mut buf = [0u8; MAX_MSG_LEN];
    let fds = recv_with_fds(sock, &mut buf[..len])?;
    match decode(&buf[..len]) {
        Ok(Some((Msg::Registered(r), _))) => Ok((r, fds)),
        Ok(_) => Err(HandshakeError::Protocol(
            "expected the areas the program registered".into(),
        )),
        Err(e) => Err(HandshakeError::Protocol(e.to_string())),
    }
}

/// Compares tokens in time that does not depend on where they differ.
fn same_token(a: &[u8; TOKEN_LEN], b: &[u8; TOKEN_LEN]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The peer is this user's process `pid`, and a descendant of `ancestor` (or it).
fn check_peer(sock: &UnixStream, pid: u32, ancestor: Option<u32>) -> Result<(), String> {
    let cred = rustix::net::sockopt::socket_peercred(sock)
        .map_err(|e| format!("reading the peer's credentials: {e}"))?;
    let uid = rustix::process::geteuid();
    if cred.uid != uid {
        return Err(format!(
            "the peer is user {}, not {}",
            cred.uid.as_raw(),
            uid.as_raw()
        ));
    }
    let peer = cred.pid.as_raw_nonzero().get() as u32;
    if peer != pid {
        return Err(format!("the peer is process {peer}, its hello says {pid}"));
    }
    if let Some(root) = ancestor {
        if !descends_from(pid, root) {
            return Err(format!("process {pid} was not started by process {root}"));
        }
    }
    Ok(())
}

/// Whether `pid` is `root` or one of its descendants (by the parent links in `/proc`).
fn descends_from(mut pid: u32, root: u32) -> bool {
    for _ in 0..4096 {
        if pid == root {
            return true;
        }
        match parent_of(pid) {
            Some(p) if p > 1 && p != pid => pid = p,
            _ => return false,
        }
    }
    false
}

/// The parent of `pid` (field 4 of `/proc/PID/stat`).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold anything.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(1)?.parse().ok()
}

/// The four descriptors are what the protocol says: two userfaultfds, then the program's
/// own pagemap and mem files (a program cannot pass another process's off as its own).
fn check_fds(fds: Vec<OwnedFd>, pid: u32) -> Result<ForeignFds, String> {
    let fds = ForeignFds::try_from(fds).map_err(|e| e.to_string())?;
    let link = |fd: &OwnedFd| {
        std::fs::read_link(format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd()))
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    for (what, fd) in [
        ("the region's", &fds.region_uffd),
        ("the staging area's", &fds.staging_uffd),
    ] {
        let l = link(fd);
        if l != "anon_inode:[userfaultfd]" {
            return Err(format!("{what} userfaultfd is {l:?}"));
        }
    }
    for (name, fd) in [("pagemap", &fds.pagemap), ("mem", &fds.mem)] {
        let want = format!("/proc/{pid}/{name}");
        let l = link(fd);
        if l != want {
            return Err(format!("the {name} descriptor is {l:?}, not {want}"));
        }
    }
    Ok(fds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registered_message_is_as_long_as_said() {
        let mut out = [0u8; MAX_MSG_LEN];
        let r = Registered {
            region: 1 << 30,
            region_len: 1 << 20,
            staging: 1 << 31,
            staging_len: 2 << 20,
            features: 0,
        };
        assert_eq!(Msg::Registered(r).encode(&mut out).unwrap(), REGISTERED_LEN);
    }

    #[test]
    fn a_peer_that_trickles_its_hello_is_cut_off_at_the_deadline() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let trickle = std::thread::spawn(move || {
            // A hello's header, then its body, a byte every 50 ms: each read gets a byte
            // well within its own timeout (the whole message would take 2.8 s).
            let mut hello = b"FMRN\x01\x00\x01\x00".to_vec();
            hello.extend((TOKEN_LEN as u32 + 8).to_le_bytes());
            hello.extend([0u8; 4 + TOKEN_LEN + 8]);
            for b in hello {
                if theirs.write_all(&[b]).is_err() {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            false
        });
        let expected = Expected {
            token: [1; TOKEN_LEN],
            config: Config {
                region_len: 1 << 20,
                chunk_size: 4096,
                trash_len: 1 << 18,
                features: 0,
            },
            ancestor: None,
        };
        let t = std::time::Instant::now();
        let err = handshake(ours, &expected, Duration::from_millis(400)).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        assert!(matches!(err, HandshakeError::Io(_)), "{err}");
        assert!(trickle.join().unwrap(), "the peer's socket was shut down");
    }

    #[test]
    fn tokens_compare_whole() {
        let a = [7u8; TOKEN_LEN];
        let mut b = a;
        assert!(same_token(&a, &b));
        b[TOKEN_LEN - 1] ^= 1;
        assert!(!same_token(&a, &b));
    }

    #[test]
    fn this_process_descends_from_its_parent_and_not_from_a_child() {
        let me = std::process::id();
        let parent = parent_of(me).unwrap();
        assert!(descends_from(me, me));
        assert!(descends_from(me, parent));
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        assert!(descends_from(child.id(), me));
        assert!(!descends_from(me, child.id()));
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn descriptors_must_be_userfaultfds_and_the_programs_own_files() {
        let me = std::process::id();
        let open = |p: &str| -> OwnedFd { std::fs::File::open(p).unwrap().into() };
        // Not userfaultfds.
        let fds = vec![
            open("/dev/null"),
            open("/dev/null"),
            open("/proc/self/pagemap"),
            open("/proc/self/mem"),
        ];
        let err = check_fds(fds, me).unwrap_err();
        assert!(err.contains("userfaultfd"), "{err}");
        let Ok(a) = crate::uffd::Uffd::open(0) else {
            farmap_testkit::skip(
                "foreign::accept::descriptors_must_be_userfaultfds_and_the_programs_own_files",
                "no userfaultfd",
            );
            return;
        };
        let b = crate::uffd::Uffd::open(0).unwrap();
        let fd = |u: crate::uffd::Uffd| -> OwnedFd { u.as_fd().try_clone_to_owned().unwrap() };
        // Another process's pagemap (a child's: this one may open it).
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let fds = vec![
            fd(a),
            fd(b),
            open(&format!("/proc/{}/pagemap", child.id())),
            open("/proc/self/mem"),
        ];
        let err = check_fds(fds, me).unwrap_err();
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(err.contains("pagemap"), "{err}");
        let fds = vec![
            fd(crate::uffd::Uffd::open(0).unwrap()),
            fd(crate::uffd::Uffd::open(0).unwrap()),
            open("/proc/self/pagemap"),
            open("/proc/self/mem"),
        ];
        assert!(check_fds(fds, me).is_ok());
    }
}
