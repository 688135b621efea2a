//! Raw-socket clients: errors that must not end the connection, and input that must.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use common::*;
use farmap_core::Store;
use farmap_nbd::NbdServeOptions;
use farmap_nbd_proto::consts::{cflag, errno};
use farmap_nbd_proto::{
    Chunk, ClientConfig, ClientHandshake, ClientStep, Command, ExportDetails, Reply, ReplyDecoder,
    RequestHeader,
};
use farmap_testkit::tls::Pki;
use farmap_testkit::{pattern_with_zeros, Hooked};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A raw NBD client on farmap-nbd-proto: handshake, then requests and replies by hand.
struct Raw {
    stream: TcpStream,
    details: ExportDetails,
    buf: BytesMut,
    decoder: ReplyDecoder,
}

impl Raw {
    async fn connect(addr: SocketAddr, export: &str, structured: bool) -> Raw {
        Self::try_connect(addr, export, structured).await.unwrap()
    }

    async fn try_connect(
        addr: SocketAddr,
        export: &str,
        structured: bool,
    ) -> Result<Raw, farmap_nbd_proto::ClientHandshakeError> {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let mut m = ClientHandshake::new(ClientConfig {
            export: export.into(),
            tls: false,
            structured,
            allocation: structured,
        });
        let mut buf = BytesMut::new();
        let mut out = BytesMut::new();
        loop {
            let step = m.step(&mut buf, &mut out)?;
            if !out.is_empty() {
                stream.write_all(&out).await.unwrap();
                out.clear();
            }
            match step {
                ClientStep::NeedMore => {
                    assert!(
                        stream.read_buf(&mut buf).await.unwrap() > 0,
                        "server closed"
                    );
                }
                ClientStep::StartTls => unreachable!(),
                ClientStep::Done(details) => {
                    return Ok(Raw {
                        stream,
                        details,
                        buf,
                        decoder: ReplyDecoder::new(64 << 20),
                    })
                }
            }
        }
    }

    async fn send(&mut self, h: RequestHeader, payload: &[u8]) {
        let mut b = BytesMut::new();
        h.encode(&mut b);
        b.extend_from_slice(payload);
        self.stream.write_all(&b).await.unwrap();
    }

    /// The next reply message; `read_len` gives simple read replies' lengths.
    async fn reply(&mut self, read_len: impl Fn(u64) -> Option<u32>) -> Option<Reply> {
        loop {
            if let Some(r) = self.decoder.decode(&mut self.buf, &read_len).unwrap() {
                return Some(r);
            }
            let n =
                tokio::time::timeout(Duration::from_secs(20), self.stream.read_buf(&mut self.buf))
                    .await
                    .expect("a reply within 20 s")
                    .unwrap_or(0);
            if n == 0 {
                return None;
            }
        }
    }

    /// All messages of the reply to one request (until its final one).
    async fn full_reply(&mut self, read_len: impl Fn(u64) -> Option<u32> + Copy) -> Vec<Reply> {
        let mut v = Vec::new();
        loop {
            let r = self.reply(read_len).await.expect("a reply");
            let fin = r.is_final();
            v.push(r);
            if fin {
                return v;
            }
        }
    }
}

/// The data of a structured read reply, with holes as zeros, checked to cover
/// `offset..offset+len` exactly.
fn assemble(replies: &[Reply], offset: u64, len: usize) -> Result<Vec<u8>, u32> {
    let mut out = vec![0u8; len];
    let mut covered = 0usize;
    for r in replies {
        match r {
            Reply::Chunk { chunk, .. } => match chunk {
                Chunk::OffsetData { offset: o, data } => {
                    let at = (o - offset) as usize;
                    out[at..at + data.len()].copy_from_slice(data);
                    covered += data.len();
                }
                Chunk::OffsetHole { length, .. } => covered += *length as usize,
                Chunk::Error { errno, .. } => return Err(*errno),
                Chunk::None => {}
                other => panic!("{other:?}"),
            },
            Reply::Simple { error, data, .. } => {
                if *error != 0 {
                    return Err(*error);
                }
                let d: &Bytes = data.as_ref().unwrap();
                out.copy_from_slice(d);
                covered = len;
            }
        }
    }
    assert_eq!(covered, len, "the reply covers the request");
    Ok(out)
}

fn req(command: Command, cookie: u64, offset: u64, length: u32) -> RequestHeader {
    RequestHeader {
        flags: 0,
        command,
        cookie,
        offset,
        length,
    }
}

fn error_of(replies: &[Reply]) -> Option<u32> {
    replies.iter().find_map(|r| match r {
        Reply::Simple { error, .. } if *error != 0 => Some(*error),
        Reply::Chunk {
            chunk: Chunk::Error { errno, .. },
            ..
        } => Some(*errno),
        _ => None,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_answered_and_the_connection_goes_on() {
    let store = memory(1 << 20, 4096);
    let ro = memory(1 << 16, 4096);
    let mut ro_export = export("ro", ro);
    ro_export.read_only = true;
    let server = start(vec![export("", store.clone()), ro_export], quiet()).await;
    for structured in [true, false] {
        let mut c = Raw::connect(tcp(&server), "", structured).await;
        assert_eq!(c.details.size, 1 << 20);
        let lens = |cookie: u64| (cookie >= 100).then_some(4096u32);
        // Past the end: EINVAL for a read, ENOSPC for a write, EINVAL for a trim.
        c.send(req(Command::Read, 1, (1 << 20) - 10, 20), &[]).await;
        assert_eq!(error_of(&c.full_reply(lens).await), Some(errno::EINVAL));
        c.send(req(Command::Write, 2, 1 << 20, 4), b"abcd").await;
        assert_eq!(error_of(&c.full_reply(lens).await), Some(errno::ENOSPC));
        c.send(req(Command::Trim, 3, u64::MAX - 1, 4096), &[]).await;
        assert_eq!(error_of(&c.full_reply(lens).await), Some(errno::EINVAL));
        // Unknown command, unknown flag.
        c.send(req(Command::Other(77), 4, 0, 0), &[]).await;
        assert_eq!(error_of(&c.full_reply(lens).await), Some(errno::EINVAL));
        let mut h = req(Command::Flush, 5, 0, 0);
        h.flags = cflag::REQ_ONE;
        c.send(h, &[]).await;
        assert_eq!(error_of(&c.full_reply(lens).await), Some(errno::EINVAL));
        // The connection still works: write at an odd offset, read it back.
        c.send(req(Command::Write, 6, 4095, 3), b"xyz").await;
        assert_eq!(error_of(&c.full_reply(lens).await), None);
        c.send(req(Command::Read, 100, 4092, 4096), &[]).await;
        let data = assemble(&c.full_reply(lens).await, 4092, 4096).unwrap();
        assert_eq!(&data[3..6], b"xyz");
        assert!(data[..3].iter().chain(&data[6..]).all(|&b| b == 0));
    }
    // Block status without a selected context is EINVAL (structured, no meta context).
    let mut c = Raw::connect(tcp(&server), "", false).await;
    c.send(req(Command::BlockStatus, 9, 0, 4096), &[]).await;
    assert_eq!(error_of(&c.full_reply(|_| None).await), Some(errno::EINVAL));
    // A read-only export refuses writes with EPERM.
    let mut c = Raw::connect(tcp(&server), "ro", true).await;
    assert_ne!(
        c.details.flags & farmap_nbd_proto::consts::tflag::READ_ONLY,
        0
    );
    c.send(req(Command::Write, 1, 0, 2), b"no").await;
    assert_eq!(error_of(&c.full_reply(|_| None).await), Some(errno::EPERM));
    c.send(req(Command::WriteZeroes, 2, 0, 4096), &[]).await;
    assert_eq!(error_of(&c.full_reply(|_| None).await), Some(errno::EPERM));
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_write_is_refused_before_its_payload_arrives() {
    let store = memory(1 << 20, 4096);
    let server = start(vec![export("", store.clone())], quiet()).await;
    let mut c = Raw::connect(tcp(&server), "", true).await;
    let max = c.details.block.unwrap().max;
    // Only the header: the refusal must come before a single payload byte is sent (the
    // server cannot have buffered the payload).
    c.send(req(Command::Write, 7, 0, max + 1), &[]).await;
    let r = c.full_reply(|_| None).await;
    assert_eq!(r[0].cookie(), 7);
    assert_eq!(error_of(&r), Some(errno::EINVAL));
    // The payload follows (it is skipped), then a normal request is served.
    let piece = vec![0xeeu8; 1 << 20];
    let mut left = max as usize + 1;
    while left > 0 {
        let n = left.min(piece.len());
        c.stream.write_all(&piece[..n]).await.unwrap();
        left -= n;
    }
    c.send(req(Command::Write, 8, 8192, 4), b"okay").await;
    assert_eq!(error_of(&c.full_reply(|_| None).await), None);
    assert_eq!(
        store_bytes(&store, 0, 4).await,
        vec![0; 4],
        "nothing written"
    );
    assert_eq!(store_bytes(&store, 8192, 4).await, b"okay");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_magic_closes_the_connection_and_a_vanished_client_hurts_no_one() {
    let store = memory(1 << 20, 4096);
    let server = start(vec![export("", store.clone())], quiet()).await;
    let mut c = Raw::connect(tcp(&server), "", true).await;
    c.stream
        .write_all(b"GET / HTTP/1.1\r\nHost: example\r\n\r\n")
        .await
        .unwrap();
    let mut b = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(10), c.stream.read(&mut b))
        .await
        .expect("closed within 10 s")
        .unwrap_or(0);
    assert_eq!(n, 0, "the server closes without answering garbage");

    // A client that leaves in the middle of a write payload.
    let mut gone = Raw::connect(tcp(&server), "", true).await;
    gone.send(req(Command::Write, 1, 0, 1 << 20), &vec![1u8; 1 << 19])
        .await;
    drop(gone);
    // Another client is served, and the server notices the first one left.
    let mut c = Raw::connect(tcp(&server), "", true).await;
    c.send(req(Command::Write, 2, 100, 5), b"still").await;
    assert_eq!(error_of(&c.full_reply(|_| None).await), None);
    assert_eq!(
        store_bytes(&store, 0, 4).await,
        vec![0; 4],
        "half a write is not written"
    );
    for _ in 0..200 {
        if server.connections() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(server.connections(), 1);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_requests_in_flight_are_all_answered_and_disc_finishes_them_first() {
    let store = memory(4 << 20, 65536);
    let server = start(vec![export("", store.clone())], quiet()).await;
    let mut c = Raw::connect(tcp(&server), "", true).await;
    let data = pattern_with_zeros(3, 4 << 20);
    // 64 writes of 64 KiB pipelined without waiting, then DISC: every write is answered
    // and applied before the server closes.
    for i in 0..64u64 {
        let at = i as usize * 65536;
        c.send(
            req(Command::Write, i, at as u64, 65536),
            &data[at..at + 65536],
        )
        .await;
    }
    c.send(req(Command::Disc, 999, 0, 0), &[]).await;
    let mut seen = std::collections::HashSet::new();
    while let Some(r) = c.reply(|_| None).await {
        assert_eq!(error_of(std::slice::from_ref(&r)), None);
        assert!(seen.insert(r.cookie()));
    }
    assert_eq!(seen.len(), 64);
    assert_eq!(store_bytes(&store, 0, 4 << 20).await, data);
    // Pipelined reads with structured replies: holes for chunks never written.
    let mut c = Raw::connect(tcp(&server), "", true).await;
    c.send(req(Command::Trim, 1, 65536, 65536), &[]).await;
    c.full_reply(|_| None).await;
    for i in 0..32u64 {
        c.send(req(Command::Read, 10 + i, i * 100_003, 100_000), &[])
            .await;
    }
    let mut per: std::collections::HashMap<u64, Vec<Reply>> = Default::default();
    let mut done = 0;
    while done < 32 {
        let r = c.reply(|_| None).await.unwrap();
        if r.is_final() {
            done += 1;
        }
        per.entry(r.cookie()).or_default().push(r);
    }
    let mut expect = data.clone();
    expect[65536..131072].fill(0);
    for i in 0..32u64 {
        let at = (i * 100_003) as usize;
        let got = assemble(&per[&(10 + i)], at as u64, 100_000).unwrap();
        assert_eq!(got, &expect[at..at + 100_000], "read {i}");
    }
    let holes = per
        .values()
        .flatten()
        .filter(|r| {
            matches!(
                r,
                Reply::Chunk {
                    chunk: Chunk::OffsetHole { .. },
                    ..
                }
            )
        })
        .count();
    assert!(holes > 0, "the trimmed chunk is sent as a hole");
    let _ = Bytes::new();
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_server_refuses_plain_clients_with_tls_required() {
    let pki = Pki::new();
    let opts = tls_options(&pki, false);
    let server = start(vec![export("", memory(1 << 20, 4096))], opts).await;
    let e = Raw::try_connect(tcp(&server), "", true)
        .await
        .err()
        .expect("refused");
    assert!(e.to_string().contains("TLS required"), "{e}");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_over_the_maximum_payload_are_served_in_pieces_or_refused() {
    const MAX: u32 = 64 * 1024;
    let store = memory(1 << 20, 4096);
    let data = pattern_with_zeros(5, 1 << 20);
    farmap_pipeline::Unaligned::new(store.clone())
        .write_at(0, &data)
        .await
        .unwrap();
    // Holes: a run of never-written chunks in the middle of the read below.
    store
        .trim(farmap_core::ChunkRange::new(
            farmap_core::ChunkIdx(40),
            farmap_core::ChunkIdx(50),
        ))
        .await
        .unwrap();
    let mut expect = data.clone();
    expect[40 * 4096..50 * 4096].fill(0);
    let opts = NbdServeOptions {
        max_payload: MAX,
        ..quiet()
    };
    let server = start(vec![export("", store.clone())], opts).await;

    // Structured: a read of over four maximum payloads at an odd offset comes in pieces, no
    // data chunk over the maximum, the last chunk alone flagged done, every byte right.
    let mut c = Raw::connect(tcp(&server), "", true).await;
    assert_eq!(c.details.block.unwrap().max, MAX, "announced = served");
    let (off, len) = (4093u64, 300_001u32);
    c.send(req(Command::Read, 1, off, len), &[]).await;
    let replies = c.full_reply(|_| None).await;
    let mut data_chunks = 0;
    for (i, r) in replies.iter().enumerate() {
        let Reply::Chunk { chunk, done, .. } = r else {
            panic!("a simple reply to a structured read: {r:?}");
        };
        assert_eq!(*done, i + 1 == replies.len(), "only the last chunk ends it");
        if let Chunk::OffsetData { data, .. } = chunk {
            assert!(data.len() <= MAX as usize, "a data chunk of {}", data.len());
            data_chunks += 1;
        }
    }
    assert!(data_chunks >= 5, "{data_chunks} data chunks");
    assert!(
        replies.iter().any(|r| matches!(
            r,
            Reply::Chunk {
                chunk: Chunk::OffsetHole { .. },
                ..
            }
        )),
        "the trimmed chunks are holes"
    );
    let got = assemble(&replies, off, len as usize).unwrap();
    assert!(got == expect[off as usize..off as usize + len as usize]);
    // Past the end is still EINVAL, before anything is read.
    c.send(req(Command::Read, 2, 1 << 19, 1 << 19 | 1), &[])
        .await;
    let r = c.full_reply(|_| None).await;
    assert_eq!(r.len(), 1);
    assert_eq!(error_of(&r), Some(errno::EINVAL));

    // Simple replies cannot be split: over the maximum is EINVAL, the connection goes on.
    let mut c = Raw::connect(tcp(&server), "", false).await;
    let lens = |cookie: u64| match cookie {
        3 => Some(MAX + 1),
        4 => Some(MAX),
        _ => None,
    };
    c.send(req(Command::Read, 3, 0, MAX + 1), &[]).await;
    assert_eq!(error_of(&c.full_reply(lens).await), Some(errno::EINVAL));
    c.send(req(Command::Read, 4, 7, MAX), &[]).await;
    let got = assemble(&c.full_reply(lens).await, 7, MAX as usize).unwrap();
    assert!(got == expect[7..7 + MAX as usize]);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_large_writes_and_reads_keep_every_byte() {
    // Writes of several maximum payloads back to back, each read into a buffer of its own,
    // interleaved with reads, then checked against the store.
    let store = memory(8 << 20, 65536);
    let server = start(vec![export("", store.clone())], quiet()).await;
    let mut c = Raw::connect(tcp(&server), "", true).await;
    let data = pattern_with_zeros(9, 8 << 20);
    let mut sizes = vec![1 << 20, 65536, 3 << 20, 100_000];
    sizes.push((8 << 20) - sizes.iter().sum::<usize>());
    let mut msg = Vec::new();
    let mut at = 0usize;
    for (i, n) in sizes.iter().enumerate() {
        let mut b = bytes::BytesMut::new();
        req(Command::Write, i as u64, at as u64, *n as u32).encode(&mut b);
        msg.extend_from_slice(&b);
        msg.extend_from_slice(&data[at..at + n]);
        let mut b = bytes::BytesMut::new();
        req(Command::Read, 100 + i as u64, 0, 4096).encode(&mut b);
        msg.extend_from_slice(&b);
        at += n;
    }
    assert_eq!(at, 8 << 20);
    c.stream.write_all(&msg).await.unwrap();
    for _ in 0..2 * sizes.len() {
        let r = c.full_reply(|_| None).await;
        assert_eq!(error_of(&r), None);
    }
    assert!(store_bytes(&store, 0, 8 << 20).await == data);
    server.shutdown().await.unwrap();
}

/// Small writes arrive many to one read of the socket; the payload a store keeps must not be
/// a slice of that shared receive buffer (a memory store keeps it for good: each 4 KiB chunk
/// would pin the whole buffer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_writes_in_one_burst_do_not_pin_the_receive_buffer() {
    // Where the payloads the store was given live in memory.
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let recorded = seen.clone();
    let rec = std::sync::Arc::new(Hooked::through(memory(1 << 20, 4096)).before_writes(
        move |_, data| {
            recorded
                .lock()
                .unwrap()
                .push((data.as_ptr() as usize, data.len()));
            Box::pin(async { Ok(()) })
        },
    ));
    let server = start(vec![export("", rec.clone())], quiet()).await;
    let mut c = Raw::connect(tcp(&server), "", true).await;
    // 32 writes of 4 KiB in one socket write: they land in one receive buffer.
    let mut burst = bytes::BytesMut::new();
    for i in 0..32u64 {
        req(Command::Write, i, i * 4096, 4096).encode(&mut burst);
        burst.extend_from_slice(&[i as u8 + 1; 4096]);
    }
    c.stream.write_all(&burst).await.unwrap();
    for _ in 0..32 {
        assert_eq!(error_of(&c.full_reply(|_| None).await), None);
    }
    let mut seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 32);
    seen.sort_unstable();
    // Slices of one buffer would sit a request header (28 bytes) apart.
    for w in seen.windows(2) {
        let ((a, len), (b, _)) = (w[0], w[1]);
        assert_ne!(
            b,
            a + len + 28,
            "two payloads are neighbours in one buffer: the store keeps the receive buffer"
        );
    }
    for i in 0..32u64 {
        assert_eq!(
            store_bytes(&(rec.clone() as std::sync::Arc<dyn Store>), i * 4096, 4096).await,
            vec![i as u8 + 1; 4096]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_announces_only_what_its_store_does() {
    use farmap_nbd_proto::consts::tflag;
    let g = farmap_core::Geometry::new(1 << 20, 4096).unwrap();
    // Writes and status, but no trim and no durable flush (a volatile store).
    let plain = std::sync::Arc::new(farmap_testkit::ModelStore::with_caps(
        g,
        farmap_core::Caps::WRITE | farmap_core::Caps::STATUS,
    ));
    let full = std::sync::Arc::new(farmap_testkit::ModelStore::with_caps(
        g,
        farmap_core::Caps::WRITE | farmap_core::Caps::TRIM | farmap_core::Caps::FLUSH,
    ));
    let server = start(
        vec![export("", plain.clone()), export("full", full)],
        quiet(),
    )
    .await;
    let mut c = Raw::connect(tcp(&server), "", true).await;
    let f = c.details.flags;
    assert_eq!(
        f & (tflag::SEND_TRIM | tflag::SEND_FLUSH | tflag::SEND_FUA),
        0,
        "{f:#x}"
    );
    assert_ne!(
        f & tflag::SEND_WRITE_ZEROES,
        0,
        "zeros can always be written"
    );
    // WRITE_ZEROES without NO_HOLE on a store that cannot trim: zeros are written.
    c.send(req(Command::Write, 1, 8192, 4), b"abcd").await;
    assert_eq!(error_of(&c.full_reply(|_| None).await), None);
    c.send(req(Command::WriteZeroes, 2, 4096, 3 * 4096), &[])
        .await;
    assert_eq!(error_of(&c.full_reply(|_| None).await), None);
    assert_eq!(
        store_bytes(&(plain.clone() as std::sync::Arc<dyn Store>), 8192, 4).await,
        [0; 4]
    );
    // A fast zero would be no faster than writing: refused at once.
    let mut h = req(Command::WriteZeroes, 3, 0, 4096);
    h.flags = cflag::FAST_ZERO;
    c.send(h, &[]).await;
    assert_eq!(
        error_of(&c.full_reply(|_| None).await),
        Some(errno::ENOTSUP)
    );
    let c = Raw::connect(tcp(&server), "full", true).await;
    let f = c.details.flags;
    let want = tflag::SEND_TRIM | tflag::SEND_FLUSH | tflag::SEND_FUA;
    assert_eq!(f & want, want, "{f:#x}");
    server.shutdown().await.unwrap();
}

/// A store whose reads never finish; counts the reads dropped (cancelled).
#[derive(Debug)]
struct Stuck {
    g: farmap_core::Geometry,
    dropped: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

struct CountDrop(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl Drop for CountDrop {
    fn drop(&mut self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Store for Stuck {
    fn geometry(&self) -> farmap_core::Geometry {
        self.g
    }
    fn caps(&self) -> farmap_core::Caps {
        farmap_core::Caps::PARALLEL
    }
    fn read(
        &self,
        _idx: farmap_core::ChunkIdx,
    ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<Bytes>> {
        let guard = CountDrop(self.dropped.clone());
        Box::pin(async move {
            let _guard = guard;
            std::future::pending().await
        })
    }
    fn write(
        &self,
        _idx: farmap_core::ChunkIdx,
        _data: Bytes,
    ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<()>> {
        Box::pin(async { Err(farmap_core::StoreError::invalid("read-only")) })
    }
    fn flush(&self) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }
    fn trim(
        &self,
        _range: farmap_core::ChunkRange,
    ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<()>> {
        Box::pin(async { Err(farmap_core::StoreError::invalid("read-only")) })
    }
    fn status(
        &self,
        _idx: farmap_core::ChunkIdx,
    ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<farmap_core::ChunkStatus>> {
        Box::pin(async { Ok(farmap_core::ChunkStatus::Unknown) })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_requests_of_a_client_that_leaves_are_cancelled() {
    let dropped = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let store = std::sync::Arc::new(Stuck {
        g: farmap_core::Geometry::new(1 << 20, 4096).unwrap(),
        dropped: dropped.clone(),
    });
    let mut e = export("", store);
    e.read_only = true;
    // Turns enough for the three reads to reach the store.
    let opts = farmap_nbd::NbdServeOptions {
        max_running: 8,
        ..quiet()
    };
    let server = start(vec![e], opts).await;
    let mut c = Raw::connect(tcp(&server), "", true).await;
    for i in 0..3u64 {
        c.send(req(Command::Read, i, i * 4096, 4096), &[]).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        dropped.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the reads wait"
    );
    drop(c);
    let start = std::time::Instant::now();
    while dropped.load(std::sync::atomic::Ordering::SeqCst) < 3 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the reads of a client that left were not cancelled ({} of 3)",
            dropped.load(std::sync::atomic::Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let t = std::time::Instant::now();
    server.shutdown().await.unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}
