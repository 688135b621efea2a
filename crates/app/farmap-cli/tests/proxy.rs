//! `farmap proxy`, run for real: the listening address on stderr, delayed and rate-limited
//! forwarding, clear errors, and a clean stop on Ctrl-C. (The proxy's precision is measured
//! by the `farmap-net` unit tests, alone on the machine.)

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use farmap_testkit::cli::Listening;

mod common;
use common::farmap;

/// A proxy process and the address it printed.
struct Running {
    proxy: Listening,
    addr: SocketAddr,
}

impl Running {
    /// A proxy on a loopback port to `upstream`, with `extra` options.
    fn to(upstream: &str, extra: &[&str]) -> Self {
        let mut args = vec!["--listen", "127.0.0.1:0", "--to", upstream];
        args.extend_from_slice(extra);
        Self::start(&args)
    }

    fn start(args: &[&str]) -> Self {
        let mut all = vec!["proxy"];
        all.extend_from_slice(args);
        let proxy = farmap().listening(&all);
        let addr = proxy
            .addr()
            .parse::<SocketAddr>()
            .unwrap_or_else(|e| panic!("{e}: {}", proxy.banner()));
        Self { proxy, addr }
    }

    /// Sends Ctrl-C; returns the exit status's success and the rest of stderr.
    fn interrupt(self) -> (bool, String) {
        let (status, rest) = self.proxy.stop("INT");
        (status.success(), rest)
    }
}

/// An upstream that echoes everything on each connection.
fn echo_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { break };
            thread::spawn(move || {
                let _ = conn.set_nodelay(true);
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 || conn.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

fn connect(addr: SocketAddr) -> TcpStream {
    let c = TcpStream::connect(addr).expect("connect");
    c.set_nodelay(true).expect("nodelay");
    c.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    c
}

#[test]
fn help_names_the_link_options() {
    let o = farmap().run(&["proxy", "--help"]);
    assert!(o.status.success());
    let help = String::from_utf8_lossy(&o.stdout);
    for word in ["--listen", "--to", "--rtt", "--bandwidth", "Mbit", "MB/s"] {
        assert!(help.contains(word), "proxy --help lacks {word}:\n{help}");
    }
}

#[test]
fn bad_arguments_give_one_line_errors() {
    for (args, want) in [
        ("--to 127.0.0.1:1 --bandwidth 100", "bits"),
        (
            "--to nowhere.invalid:1 --rtt 1ms",
            "cannot resolve the address nowhere.invalid:1",
        ),
        ("--to 127.0.0.1:1 --listen 256.0.0.1:0", "256.0.0.1:0"),
    ] {
        let mut all = vec!["proxy"];
        if !args.contains("--listen") {
            all.extend(["--listen", "127.0.0.1:0"]);
        }
        all.extend(args.split_whitespace());
        let o = farmap().run(&all);
        assert!(!o.status.success(), "{args} should fail");
        let err = String::from_utf8_lossy(&o.stderr);
        let first = err.lines().next().unwrap_or_default();
        assert!(first.contains(want), "{args}: {err:?} lacks {want:?}");
    }
}

#[test]
fn forwards_with_the_round_trip_time_and_stops_on_ctrl_c() {
    let upstream = echo_server().to_string();
    let proxy = Running::to(&upstream, &["--rtt", "10ms"]);
    let mut c = connect(proxy.addr);
    let mut times = Vec::new();
    for i in 0..20u64 {
        let start = Instant::now();
        c.write_all(&i.to_le_bytes()).expect("ping");
        let mut pong = [0u8; 8];
        c.read_exact(&mut pong).expect("pong");
        times.push(start.elapsed());
        assert_eq!(pong, i.to_le_bytes());
    }
    // Never faster than the round trip; how much the proxy adds is `farmap bench proxy`'s.
    times.sort();
    assert!(times[0] >= Duration::from_millis(10), "{times:?}");
    // EOF travels through, and the echo's EOF comes back.
    c.shutdown(Shutdown::Write).expect("half-close");
    let mut rest = Vec::new();
    c.read_to_end(&mut rest).expect("EOF");
    assert!(rest.is_empty());
    let (ok, stderr) = proxy.interrupt();
    assert!(ok, "exit status after Ctrl-C: {stderr}");
    assert!(
        stderr.contains("stopped after 1 connections (0 failed), 160 bytes up, 160 bytes down"),
        "{stderr}"
    );
}

#[test]
fn limits_bandwidth_and_reports_unreachable_upstreams() {
    let upstream = echo_server().to_string();
    let proxy = Running::to(&upstream, &["--bandwidth", "100Mbit"]);
    // 2.5 MB each way at 12.5 MB/s: at least 0.2 s (both ways run at once).
    let c = connect(proxy.addr);
    let mut out = c.try_clone().expect("clone");
    let sender = thread::spawn(move || {
        let block = vec![5u8; 100_000];
        for _ in 0..25 {
            out.write_all(&block).expect("send");
        }
        out.shutdown(Shutdown::Write).expect("half-close");
    });
    let start = Instant::now();
    let mut back = Vec::new();
    (&c).read_to_end(&mut back).expect("echo");
    let took = start.elapsed();
    sender.join().expect("sender");
    assert_eq!(back.len(), 2_500_000);
    assert!(back.iter().all(|&b| b == 5));
    assert!(
        took >= Duration::from_millis(190),
        "{took:?} is faster than the link"
    );
    drop(proxy);

    // An upstream nobody listens on: the client is disconnected and the error is logged.
    let gone = TcpListener::bind("127.0.0.1:0").expect("bind");
    let to = gone.local_addr().expect("addr").to_string();
    drop(gone);
    let proxy = Running::to(&to, &[]);
    let mut c = connect(proxy.addr);
    let mut buf = [0u8; 1];
    assert!(!matches!(c.read(&mut buf), Ok(n) if n > 0));
    let (ok, stderr) = proxy.interrupt();
    assert!(ok);
    assert!(
        stderr.contains(&format!("cannot connect to {to}")),
        "{stderr}"
    );
    assert!(stderr.contains("(1 failed)"), "{stderr}");
}
