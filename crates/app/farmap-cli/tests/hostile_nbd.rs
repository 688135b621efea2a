//! `farmap serve --nbd` under attack, run for real with raw NBD clients: requests that are
//! tiny on the wire but large in the server (`NBD_CMD_CACHE` of 32 MiB, 1-byte reads of
//! 4 MiB chunks), pipelined and never answered by reading. The server's resident memory
//! (`VmRSS`) stays within `--max-memory` plus a fixed overhead, a good client is served
//! meanwhile (its rate alone and under attack are printed), and SIGTERM stops it within
//! seconds.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;
use common::hostile::{assert_peak_within, big_file, keeps_half_rate, serve_with_budget};

const MIB: u64 = 1 << 20;
const CHUNK: u64 = 4 * MIB;
const READ: u16 = 0;
const CACHE: u16 = 5;

/// Opens a session with `NBD_OPT_EXPORT_NAME` (the oldest way in: simple replies).
fn nbd_session(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello).unwrap();
    assert_eq!(&hello[..16], b"NBDMAGICIHAVEOPT");
    // FIXED_NEWSTYLE | NO_ZEROES, then EXPORT_NAME "" (the default export).
    let mut out = 3u32.to_be_bytes().to_vec();
    out.extend_from_slice(b"IHAVEOPT");
    out.extend_from_slice(&1u32.to_be_bytes());
    out.extend_from_slice(&0u32.to_be_bytes());
    s.write_all(&out).unwrap();
    let mut export = [0u8; 10];
    s.read_exact(&mut export).unwrap();
    s
}

fn request(out: &mut Vec<u8>, command: u16, cookie: u64, offset: u64, length: u32) {
    out.extend_from_slice(&0x2560_9513u32.to_be_bytes());
    out.extend_from_slice(&0u16.to_be_bytes());
    out.extend_from_slice(&command.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&length.to_be_bytes());
}

fn pattern(offset: u64) -> u8 {
    (offset / 4096) as u8 | 1
}

/// 4 KiB reads of the first 16 MiB on a session of its own, each checked.
fn good_reads(addr: SocketAddr, reads: u64) {
    let mut s = nbd_session(addr);
    for i in 0..reads {
        let offset = (i * 7919 % 4096) * 4096;
        let mut out = Vec::new();
        request(&mut out, READ, i, offset, 4096);
        s.write_all(&out).unwrap();
        let mut reply = [0u8; 16 + 4096];
        s.read_exact(&mut reply)
            .unwrap_or_else(|e| panic!("a good read at {offset} was not answered: {e}"));
        assert_eq!(&reply[..4], &0x6744_6698u32.to_be_bytes(), "a simple reply");
        assert_eq!(&reply[4..8], &[0; 4], "no error");
        assert_eq!(u64::from_be_bytes(reply[8..16].try_into().unwrap()), i);
        assert!(reply[16..].iter().all(|b| *b == pattern(offset)));
    }
}

#[test]
fn cache_requests_and_tiny_reads_never_read_keep_the_nbd_server_in_its_budget() {
    // Allowance beside --max-memory: the process itself (runtime, threads, the binary) and
    // one reserve per connection (a 4 MiB chunk each, five connections).
    const MAX_MEMORY: u64 = 64 * MIB;
    const OVERHEAD: u64 = 96 * MIB;
    let dir = tempfile::tempdir().unwrap();
    let path = big_file(dir.path(), 4096 * MIB, 16 * MIB, 4096, pattern);
    let spec = format!("file:{}?chunk=4MiB", path.display());
    let server = serve_with_budget("--nbd", &spec, MAX_MEMORY);
    let addr: SocketAddr = server.addr().parse().unwrap();
    let base = farmap_testkit::process::rss_bytes(server.id());
    // The good client's rate alone (median of three rounds of 50 reads).
    let round = || {
        let t = Instant::now();
        good_reads(addr, 50);
        t.elapsed()
    };
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let alone = median((0..3).map(|_| round()).collect());

    // Two clients send 128 CACHE requests of 32 MiB each (28 bytes on the wire, 4 GiB in
    // the server if it read them whole); two send 4,000 1-byte reads, each of another
    // 4 MiB chunk (112 KB on the wire, 16 GB of chunks if each reply kept its chunk).
    let mut cache = Vec::new();
    for i in 0..128u64 {
        request(&mut cache, CACHE, i, (i % 32) * 32 * MIB, 32 << 20);
    }
    let mut tiny = Vec::new();
    for i in 0..4000u64 {
        request(&mut tiny, READ, i, (i % 1024) * CHUNK + 1, 1);
    }
    let (cache, tiny) = (Arc::new(cache), Arc::new(tiny));
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let sessions: Vec<_> = (0..4).map(|_| nbd_session(addr)).collect();
    let attackers: Vec<_> = [&cache, &cache, &tiny, &tiny]
        .into_iter()
        .zip(sessions)
        .map(|(bytes, s)| {
            let (bytes, stop, sent) = ((*bytes).clone(), stop.clone(), sent.clone());
            std::thread::spawn(move || {
                farmap_testkit::process::pipeline_without_reading(s, &bytes, &stop, &sent)
            })
        })
        .collect();

    let mut peak = 0;
    // The median round of an 8 s window under attack.
    let window = |peak: &mut u64| {
        let start = Instant::now();
        let mut rounds = Vec::new();
        while start.elapsed() < Duration::from_secs(8) {
            rounds.push(round());
            *peak = (*peak).max(farmap_testkit::process::rss_bytes(server.id()));
        }
        median(rounds)
    };
    let mut attacked = window(&mut peak);
    if !keeps_half_rate(alone, attacked) {
        // One more window: a busy host can slow a window down; a server that starves the
        // good client slows both.
        println!("the first window's median was {attacked:?} ({alone:?} alone): once more");
        attacked = attacked.min(window(&mut peak));
    }
    peak = peak.max(farmap_testkit::process::rss_bytes(server.id()));
    println!(
        "farmap serve --nbd VmRSS {} MiB at start, peak {} MiB under 4 clients that never read \
         (--max-memory {} MiB); 50 good reads took {alone:?} alone, {attacked:?} under attack",
        base / MIB,
        peak / MIB,
        MAX_MEMORY / MIB
    );
    assert!(
        sent.load(Ordering::Relaxed) > 2 * cache.len() as u64,
        "the attackers got requests through"
    );
    assert_peak_within(peak, MAX_MEMORY, OVERHEAD);

    // Before the budget counted what requests hold, the good client was not answered at all.
    assert!(
        attacked < Duration::from_secs(15),
        "50 good reads took {attacked:?} under attack ({alone:?} alone)"
    );
    // At least half its unloaded rate (issue bar). The store's work is shared out between
    // connections (`--max-running`, a turn per chunk operation, the connection with the
    // fewest out first), a read of part of a chunk reads only that part from the file, and
    // CACHE on a file is a read-ahead hint: the attackers' requests no longer cost a 4 MiB
    // chunk read each. Before, the good client ran about 20 times slower under this attack.
    // (20 ms of slack: the rounds take milliseconds, and hosts are noisy.)
    assert!(
        keeps_half_rate(alone, attacked),
        "50 good reads took {attacked:?} under attack, {alone:?} alone"
    );

    // Told to stop with the attackers still connected and unread: it stops within seconds.
    let t = Instant::now();
    let (status, _) = server.stop("TERM");
    let took = t.elapsed();
    stop.store(true, Ordering::Relaxed);
    for a in attackers {
        a.join().unwrap();
    }
    println!("stopped in {took:?} ({status})");
    // Requests that have not reached the store are answered with an error, those at the
    // store finish, and clients that do not read are not waited for: well under the 10 s
    // grace (it took the whole grace before).
    assert!(
        took < Duration::from_secs(5),
        "SIGTERM took {took:?} to stop the server"
    );
}
