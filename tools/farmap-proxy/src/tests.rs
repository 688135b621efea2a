//! The proxy's tests: link arithmetic, timing, throughput, integrity, EOF and errors.

use super::*;
use farmap_testkit::wait::runtime;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener as StdListener, TcpStream as StdStream};
use std::sync::Mutex;
use std::thread;

/// Held by every test that runs a proxy: those that measure time must not share the machine
/// with one that moves 100 MB.
static TIMING: Mutex<()> = Mutex::new(());

fn timing_lock() -> std::sync::MutexGuard<'static, ()> {
    TIMING.lock().unwrap_or_else(|e| e.into_inner())
}

fn start(rt: &tokio::runtime::Runtime, to: SocketAddr, options: ProxyOptions) -> ProxyHandle {
    rt.block_on(async {
        Proxy::bind("127.0.0.1:0", to, options)
            .await
            .expect("bind")
            .spawn()
    })
}

fn ms(v: f64) -> Duration {
    Duration::from_secs_f64(v / 1e3)
}

fn options(rtt: Duration, bandwidth: Option<&str>) -> ProxyOptions {
    ProxyOptions {
        rtt,
        bandwidth: bandwidth.map(|b| b.parse().expect("bandwidth")),
        queue_limit: None,
    }
}

/// A deterministic, non-periodic byte stream.
fn pattern(seed: u64, i: u64) -> u8 {
    ((i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

/// A server that accepts once and hands the connection to `serve` on a thread.
fn server(serve: impl FnOnce(StdStream) + Send + 'static) -> SocketAddr {
    let listener = StdListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    thread::spawn(move || {
        let (stream, _) = listener.accept().expect("accept");
        stream.set_nodelay(true).expect("nodelay");
        serve(stream);
    });
    addr
}

fn connect(addr: SocketAddr) -> StdStream {
    let s = StdStream::connect(addr).expect("connect to the proxy");
    s.set_nodelay(true).expect("nodelay");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    s
}

fn send_pattern(mut s: StdStream, seed: u64, len: u64) {
    let mut buf = vec![0u8; 50_000];
    let mut off = 0;
    while off < len {
        let n = (len - off).min(buf.len() as u64) as usize;
        for (i, b) in buf[..n].iter_mut().enumerate() {
            *b = pattern(seed, off + i as u64);
        }
        s.write_all(&buf[..n]).expect("send");
        off += n as u64;
    }
    s.shutdown(Shutdown::Write).expect("half-close");
}

/// Reads to EOF and checks every byte; returns (bytes, first byte at, last byte at).
fn expect_pattern(mut s: StdStream, seed: u64) -> (u64, Instant, Instant) {
    let mut buf = vec![0u8; 70_000];
    let mut off = 0u64;
    let mut first = None;
    let mut last = Instant::now();
    loop {
        let n = s.read(&mut buf).expect("receive");
        if n == 0 {
            break;
        }
        last = Instant::now();
        first.get_or_insert(last);
        for (i, b) in buf[..n].iter().enumerate() {
            let at = off + i as u64;
            assert_eq!(*b, pattern(seed, at), "byte {at} differs");
        }
        off += n as u64;
    }
    (off, first.unwrap_or(last), last)
}

#[test]
fn the_link_clock_serializes_then_delays() {
    let link = Link::new(options(ms(10.0), Some("8Mbit")));
    assert_eq!(
        link.slice, MIN_SLICE,
        "100 µs of 1 MB/s is less than a segment"
    );
    let mut clock = LinkClock::new(link);
    let t0 = clock.free_at + Duration::from_secs(1);
    // 1000 bytes at 1 MB/s take 1 ms on the wire, then 5 ms of propagation.
    assert_eq!(clock.due(t0, 1000), t0 + ms(6.0));
    // Read at the same moment: queued behind the first.
    assert_eq!(clock.due(t0, 1000), t0 + ms(7.0));
    // Read after the link went idle: starts at once.
    let t1 = t0 + ms(100.0);
    assert_eq!(clock.due(t1, 0), t1 + ms(5.0));
    let plain = Link::new(options(ms(3.0), None));
    assert_eq!(LinkClock::new(plain).due(t1, 1 << 20), t1 + ms(1.5));
}

#[test]
fn queue_limits_cover_the_bandwidth_delay_product() {
    let small = options(Duration::ZERO, None);
    assert_eq!(small.effective_queue_limit(), MIN_QUEUE);
    let slow = options(ms(40.0), Some("1Gbit"));
    // 125 MB/s × 20 ms = 2.5 MB one way, twice, plus 4 MiB.
    assert_eq!(slow.effective_queue_limit(), 5_000_000 + MIN_QUEUE);
    let tiny = ProxyOptions {
        queue_limit: Some(1),
        ..small
    };
    assert_eq!(tiny.effective_queue_limit(), MIN_QUEUE);
}

/// An upstream that echoes 8-byte pings.
fn echo_server() -> SocketAddr {
    server(|mut s| {
        let mut b = [0u8; 8];
        while s.read_exact(&mut b).is_ok() {
            if s.write_all(&b).is_err() {
                break;
            }
        }
    })
}

/// Round trips of 8-byte pings on `c`, each after `idle` without traffic: (median, min).
fn ping_pong(c: &mut StdStream, pings: usize, idle: Duration) -> (Duration, Duration) {
    let mut times = Vec::with_capacity(pings);
    for i in 0..pings + 5 {
        thread::sleep(idle);
        let ping = (i as u64).to_le_bytes();
        let start = Instant::now();
        c.write_all(&ping).expect("ping");
        let mut pong = [0u8; 8];
        c.read_exact(&mut pong).expect("pong");
        let took = start.elapsed();
        assert_eq!(pong, ping);
        if i >= 5 {
            times.push(took);
        }
    }
    times.sort();
    (times[times.len() / 2], times[0])
}

#[test]
fn round_trips_are_never_shorter_than_the_rtt() {
    // Only "never early" and "bytes intact" (`ping_pong` checks each pong) are asserted: how
    // much the proxy adds to the median round trip is measured by `farmap bench proxy`.
    let _timing = timing_lock();
    let rt = runtime();
    for rtt in [Duration::ZERO, ms(2.0), ms(10.0)] {
        let proxy = start(&rt, echo_server(), options(rtt, None));
        let mut proxied = connect(proxy.local_addr());
        let (median, min) = ping_pong(&mut proxied, 50, Duration::ZERO);
        eprintln!("rtt {rtt:?}: median {median:?}, min {min:?}");
        assert!(min >= rtt, "rtt {rtt:?}: a round trip took only {min:?}");
    }
}

/// Sends `len` bytes through a proxy; returns the rate seen by the receiver in bytes/s.
fn bulk_rate(options: ProxyOptions, len: u64) -> f64 {
    let rt = runtime();
    let (tx, rx) = std::sync::mpsc::channel();
    let upstream = server(move |s| {
        tx.send(expect_pattern(s, 7)).expect("report");
    });
    let proxy = start(&rt, upstream, options);
    send_pattern(connect(proxy.local_addr()), 7, len);
    let (got, first, last) = rx.recv_timeout(Duration::from_secs(60)).expect("transfer");
    assert_eq!(got, len);
    // Bytes after the first read, over the time they took to arrive.
    (len - MIN_SLICE as u64) as f64 / (last - first).as_secs_f64()
}

#[test]
fn bandwidth_is_never_exceeded() {
    // Never faster than the link (the virtual clock has no burst allowance), every byte
    // intact (`bulk_rate` checks them). How close to the link it runs is measured by
    // `farmap bench proxy`.
    let _timing = timing_lock();
    let want = 12.5e6;
    // 4 MB: 0.32 s at 100 Mbit/s.
    let rate = bulk_rate(options(ms(2.0), Some("100Mbit")), 4_000_000);
    eprintln!("100Mbit: {:.2} MB/s", rate / 1e6);
    assert!(rate <= want * 1.1, "{:.2} MB/s beats the link", rate / 1e6);
}

#[test]
fn large_transfers_arrive_intact_both_ways() {
    let _timing = timing_lock();
    for (bw, len) in [(None, 48 << 20), (Some("2Gbit"), 16 << 20)] {
        let rt = runtime();
        let (tx, rx) = std::sync::mpsc::channel();
        let upstream = server(move |s| {
            let back = s.try_clone().expect("clone");
            let sender = thread::spawn(move || send_pattern(back, 2, len));
            let got = expect_pattern(s, 1).0;
            sender.join().expect("server sender");
            tx.send(got).expect("report");
        });
        let proxy = start(&rt, upstream, options(ms(1.0), bw));
        let c = connect(proxy.local_addr());
        let out = c.try_clone().expect("clone");
        let sender = thread::spawn(move || send_pattern(out, 1, len));
        let (back, _, _) = expect_pattern(c, 2);
        sender.join().expect("client sender");
        assert_eq!(back, len, "{bw:?}: bytes from the server");
        let up = rx.recv_timeout(Duration::from_secs(60)).expect("server");
        assert_eq!(up, len, "{bw:?}: bytes to the server");
        let stats = proxy.stats();
        assert_eq!((stats.bytes_up, stats.bytes_down), (len, len));
        assert_eq!((stats.accepted, stats.failed), (1, 0));
    }
}

#[test]
fn eof_is_forwarded_after_the_delay_and_the_other_way_keeps_working() {
    let _timing = timing_lock();
    let rt = runtime();
    let one_way = ms(3.0);
    let (tx, rx) = std::sync::mpsc::channel();
    let upstream = server(move |mut s| {
        let mut got = Vec::new();
        s.read_to_end(&mut got).expect("read to EOF");
        let eof_at = Instant::now();
        // Half-closed by the client: replying still works.
        s.write_all(b"bye").expect("reply");
        tx.send((got, eof_at)).expect("report");
    });
    let proxy = start(&rt, upstream, options(one_way * 2, None));
    let mut c = connect(proxy.local_addr());
    c.write_all(b"hello").expect("send");
    let closed_at = Instant::now();
    c.shutdown(Shutdown::Write).expect("half-close");
    let mut reply = Vec::new();
    c.read_to_end(&mut reply).expect("reply then EOF");
    let (got, eof_at) = rx.recv().expect("server");
    assert_eq!(got, b"hello");
    assert_eq!(reply, b"bye");
    assert!(eof_at - closed_at >= one_way, "EOF arrived early");
}

#[test]
fn an_unreachable_upstream_disconnects_the_client_and_is_reported() {
    let _timing = timing_lock();
    let rt = runtime();
    let gone = StdListener::bind("127.0.0.1:0").expect("bind");
    let addr = gone.local_addr().expect("addr");
    drop(gone);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let proxy = rt.block_on(async {
        Proxy::bind("127.0.0.1:0", addr, ProxyOptions::default())
            .await
            .expect("bind")
            .on_error(move |e| log.lock().expect("log").push(e.to_string()))
            .spawn()
    });
    let mut c = connect(proxy.local_addr());
    let mut buf = [0u8; 1];
    // Closed without data: EOF (or a reset if the close raced a write).
    assert!(!matches!(c.read(&mut buf), Ok(n) if n > 0));
    let stats = proxy.stats();
    assert_eq!((stats.accepted, stats.failed, stats.active), (1, 1, 0));
    let seen = seen.lock().expect("log");
    assert!(
        seen.len() == 1 && seen[0].contains(&format!("cannot connect to {addr}")),
        "{seen:?}"
    );
}

#[test]
fn a_failed_side_closes_the_other() {
    let _timing = timing_lock();
    let rt = runtime();
    // The server resets the connection (closing with unread data) while the client sends.
    let upstream = server(|mut s| {
        let mut b = [0u8; 1];
        s.read_exact(&mut b).expect("first byte");
        thread::sleep(Duration::from_millis(50));
    });
    let proxy = start(&rt, upstream, options(ms(1.0), None));
    let mut c = connect(proxy.local_addr());
    c.set_write_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let chunk = vec![1u8; 64 * 1024];
    let started = Instant::now();
    let mut failed = false;
    while started.elapsed() < Duration::from_secs(10) {
        if c.write_all(&chunk).is_err() {
            failed = true;
            break;
        }
    }
    assert!(failed, "writes kept succeeding after the server went away");
    // The proxy counts the connection closed once both of its halves have ended, which
    // may be just after the client saw its write fail.
    let deadline = Instant::now() + Duration::from_secs(5);
    while proxy.stats().active != 0 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(proxy.stats().active, 0);
}

#[test]
fn a_stalled_receiver_bounds_what_is_queued() {
    let _timing = timing_lock();
    let rt = runtime();
    let (done, wait) = std::sync::mpsc::channel::<()>();
    // The server never reads until told to.
    let upstream = server(move |_s| {
        let _ = wait.recv();
    });
    let proxy = start(&rt, upstream, options(Duration::ZERO, None));
    let mut c = connect(proxy.local_addr());
    c.set_write_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");
    let chunk = vec![1u8; 64 * 1024];
    let mut sent = 0usize;
    while sent < 256 << 20 {
        match c.write(&chunk) {
            Ok(n) => sent += n,
            Err(_) => break,
        }
    }
    // The proxy's queue (4 MiB) plus four socket buffers, far from 256 MiB.
    assert!(sent < 64 << 20, "{sent} bytes were accepted");
    let _ = done.send(());
}

#[test]
fn shutdown_closes_open_connections() {
    let _timing = timing_lock();
    let rt = runtime();
    let upstream = server(|mut s| {
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    });
    let proxy = start(&rt, upstream, ProxyOptions::default());
    let addr = proxy.local_addr();
    let mut c = connect(addr);
    c.write_all(b"x").expect("send");
    rt.block_on(proxy.shutdown());
    let mut buf = [0u8; 1];
    assert!(!matches!(c.read(&mut buf), Ok(n) if n > 0));
    assert!(StdStream::connect(addr).is_err(), "still listening");
}
