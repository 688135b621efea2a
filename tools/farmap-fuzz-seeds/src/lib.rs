//! The seed corpus of farmap's fuzz targets (`fuzz/fuzz_targets/*.rs`): for each target, a
//! handful of small valid inputs, made with the decoders' own encoders (frames, hellos,
//! migration messages, NBD handshakes played between the real client and server machines,
//! netlink replies as the kernel sends them) or, for text formats, written out.
//!
//! `cargo run -p farmap-fuzz-seeds` writes them to `fuzz/corpus/<target>/seed-<name>`, where
//! they are committed; a test here fails when a seed no longer matches its committed file
//! (an encoder changed: run the command again and commit). `scripts/fuzz.sh` starts every
//! target from its corpus.
#![forbid(unsafe_code)]

use std::fs;
use std::io;
use std::path::Path;

mod nbd;

/// One input of one fuzz target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seed {
    /// The fuzz target (a file name in `fuzz/fuzz_targets/`, without `.rs`).
    pub target: &'static str,
    /// What it is, as a file name: written as `seed-<name>`.
    pub name: String,
    /// The input.
    pub bytes: Vec<u8>,
}

impl Seed {
    fn new(target: &'static str, name: impl Into<String>, bytes: impl Into<Vec<u8>>) -> Self {
        Self {
            target,
            name: name.into(),
            bytes: bytes.into(),
        }
    }

    /// Its file under a corpus directory: `<target>/seed-<name>`.
    pub fn path(&self, corpus: &Path) -> std::path::PathBuf {
        corpus.join(self.target).join(format!("seed-{}", self.name))
    }
}

/// Every seed of every target.
pub fn seeds() -> Vec<Seed> {
    let mut all = Vec::new();
    all.extend(wire_frame());
    all.extend(wire_handshake());
    all.extend(migrate_msg());
    all.extend(handover_hello());
    all.extend(dir_meta());
    all.extend(store_spec());
    all.extend(nbd::server_seeds());
    all.extend(nbd::client_seeds());
    all.extend(genl_reply());
    all.extend(version_manifest());
    all.extend(run_msg());
    all.extend(slope_msg());
    all
}

/// Writes every seed under `corpus` (creating `corpus/<target>/`); returns how many.
pub fn write_all(corpus: &Path) -> io::Result<usize> {
    let all = seeds();
    for s in &all {
        let path = s.path(corpus);
        fs::create_dir_all(path.parent().expect("a seed's path has a parent"))?;
        fs::write(&path, &s.bytes)?;
    }
    Ok(all.len())
}

/// Frames as a peer sends them, after the byte that tells the target how to cut the stream
/// into reads (0: one byte at a time, 255: 256 bytes at a time).
fn wire_frame() -> Vec<Seed> {
    use bytes::{Bytes, BytesMut};
    use farmap_core::{Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry};
    use farmap_wire::{Frame, Message, Payload, RegionInfo, RemoteError, RunData};

    let mut frames = vec![
        (
            "read",
            Frame::new(
                1,
                Message::Read(vec![ChunkIdx(0), ChunkIdx(7), ChunkIdx(3)]),
            ),
        ),
        (
            "write",
            Frame::new(
                2,
                Message::Write {
                    idx: ChunkIdx(5),
                    data: Payload::Data(Bytes::from(vec![7u8; 64])),
                },
            ),
        ),
        (
            "write-zero",
            Frame::new(
                3,
                Message::Write {
                    idx: ChunkIdx(6),
                    data: Payload::Zero,
                },
            ),
        ),
        ("flush", Frame::new(4, Message::Flush)),
        (
            "trim",
            Frame::new(5, Message::Trim(ChunkRange::new(ChunkIdx(2), ChunkIdx(9)))),
        ),
        ("status", Frame::new(6, Message::Status(ChunkIdx(1)))),
        ("geometry", Frame::new(7, Message::Geometry)),
        (
            "read-run",
            Frame::new(
                8,
                Message::ReadRun {
                    start: ChunkIdx(5),
                    count: 9,
                },
            ),
        ),
        (
            "read-ok",
            Frame::new(
                1,
                Message::ReadOk(vec![
                    Payload::Zero,
                    Payload::Data(Bytes::from_static(b"abc")),
                ]),
            ),
        ),
        (
            "read-run-ok",
            Frame::new(
                8,
                Message::ReadRunOk(RunData::new(
                    &[false, true, false],
                    vec![Bytes::from_static(b"ab"), Bytes::from_static(b"cd")],
                )),
            ),
        ),
        ("done", Frame::new(2, Message::Done)),
        (
            "status-ok",
            Frame::new(6, Message::StatusOk(ChunkStatus::Data)),
        ),
        (
            "geometry-ok",
            Frame::new(
                7,
                Message::GeometryOk(RegionInfo {
                    geometry: Geometry::new(1 << 20, 4096).expect("a valid geometry"),
                    caps: Caps::WRITE | Caps::TRIM,
                    read_only: false,
                }),
            ),
        ),
        (
            "error",
            Frame::new(
                9,
                Message::Error(RemoteError {
                    kind: ErrorKind::OutOfRange,
                    message: "chunk 300 is past the end".into(),
                }),
            ),
        ),
    ];
    frames.extend(object_frames());
    let encode = |f: &Frame| {
        let mut b = BytesMut::new();
        f.encode(&mut b);
        b.to_vec()
    };
    let mut seeds: Vec<Seed> = frames
        .iter()
        .map(|(name, f)| Seed::new("wire_frame", *name, [&[255u8][..], &encode(f)].concat()))
        .collect();
    // A whole conversation, read a byte at a time and then 7 bytes at a time.
    let stream: Vec<u8> = frames.iter().flat_map(|(_, f)| encode(f)).collect();
    seeds.push(Seed::new(
        "wire_frame",
        "all-bytewise",
        [&[0u8][..], &stream].concat(),
    ));
    seeds.push(Seed::new(
        "wire_frame",
        "all-by-7",
        [&[6u8][..], &stream].concat(),
    ));
    seeds
}

/// Frames of an objects export (`farmap serve --objects`).
fn object_frames() -> Vec<(&'static str, farmap_wire::Frame)> {
    use bytes::Bytes;
    use farmap_wire::{Frame, Message};
    vec![
        (
            "obj-get",
            Frame::new(12, Message::ObjGet("chunks/ab/0123".into())),
        ),
        (
            "obj-create",
            Frame::new(
                13,
                Message::ObjCreate {
                    key: "regions/r/versions/00000000000000000001".into(),
                    data: Bytes::from_static(b"a manifest"),
                },
            ),
        ),
        (
            "obj-list",
            Frame::new(
                14,
                Message::ObjList {
                    dir: "chunks/ab".into(),
                    after: "0123".into(),
                },
            ),
        ),
        (
            "obj-delete",
            Frame::new(15, Message::ObjDelete("trash/ab/0123".into())),
        ),
        (
            "obj-data",
            Frame::new(12, Message::ObjData(Some(Bytes::from_static(b"bytes")))),
        ),
        ("obj-none", Frame::new(12, Message::ObjData(None))),
        ("obj-bool", Frame::new(13, Message::ObjBool(true))),
        (
            "obj-names",
            Frame::new(
                14,
                Message::ObjNames {
                    names: vec!["00".into(), "ff".into()],
                    more: true,
                },
            ),
        ),
    ]
}

/// A client hello, an accepting server hello and a refusing one.
fn wire_handshake() -> Vec<Seed> {
    use bytes::BytesMut;
    use farmap_core::{Caps, ErrorKind, Geometry};
    use farmap_wire::{ClientHello, Features, Refusal, RegionInfo, ServerHello, ServerInfo};

    let accepted = ServerHello::Accepted(ServerInfo {
        version: farmap_wire::VERSION,
        features: Features::ALL,
        region: RegionInfo {
            geometry: Geometry::new(10 << 20, 65536).expect("a valid geometry"),
            caps: Caps::WRITE | Caps::FLUSH,
            read_only: false,
        },
        max_frame: 4 << 20,
        max_in_flight: 64,
        max_batch: 16,
        instance: 1,
    });
    let refused = ServerHello::Refused(Refusal {
        version: farmap_wire::VERSION,
        min_version: 1,
        max_version: farmap_wire::VERSION,
        kind: ErrorKind::Unavailable,
        message: "the server is full".into(),
    });
    let mut client = BytesMut::new();
    ClientHello::current().encode(&mut client);
    let server = |h: &ServerHello| {
        let mut b = BytesMut::new();
        h.encode(&mut b);
        b.to_vec()
    };
    vec![
        Seed::new("wire_handshake", "client-hello", client.to_vec()),
        Seed::new("wire_handshake", "server-accepted", server(&accepted)),
        Seed::new("wire_handshake", "server-refused", server(&refused)),
        Seed::new(
            "wire_handshake",
            "server-challenge",
            server(&ServerHello::Challenge([9; farmap_wire::CHALLENGE_LEN])),
        ),
    ]
}

/// One frame of each migration message.
fn migrate_msg() -> Vec<Seed> {
    use bytes::Bytes;
    use farmap_migrate::msg::{Location, ManifestRun, Msg, RegionInfo};
    use farmap_migrate::Mode;

    let msgs = [
        (
            "auth-hello",
            Msg::AuthHello {
                session: 0,
                nonce: [1; 32],
            },
        ),
        (
            "auth-challenge",
            Msg::AuthChallenge {
                nonce: [2; 32],
                proof: [3; 32],
            },
        ),
        ("auth-proof", Msg::AuthProof { proof: [4; 32] }),
        (
            "hello",
            Msg::Hello {
                session: 0x1234_5678,
                mode: Mode::Postcopy,
            },
        ),
        (
            "welcome",
            Msg::Welcome {
                session: 0x1234_5678,
                region: RegionInfo {
                    size: 1 << 20,
                    chunk_size: 65536,
                    page_size: 4096,
                    data_port: 7000,
                    boot_id: [3; 16],
                    shared: "redis://h:1/0?size=1MiB".into(),
                },
            },
        ),
        ("dirty-request", Msg::DirtyRequest { round: 2 }),
        (
            "dirty",
            Msg::Dirty {
                round: 2,
                runs: vec![0..3, 10..11],
            },
        ),
        ("finalize", Msg::Finalize),
        (
            "hand-over",
            Msg::HandOver {
                runs: vec![4..8, 9..10],
                app_state: Bytes::from_static(b"state"),
                suspended_at_ns: 1_000_000,
            },
        ),
        ("resumed", Msg::Resumed),
        (
            "manifest",
            Msg::Manifest {
                runs: vec![
                    ManifestRun {
                        location: Location::Store,
                        chunks: 0..2,
                    },
                    ManifestRun {
                        location: Location::Source,
                        chunks: 2..5,
                    },
                ],
                pushed: vec![(0, 7), (1, 7)],
            },
        ),
        (
            "confirm",
            Msg::Confirm {
                at_source: vec![2..5, 7..8],
                pending: vec![3..4, 7..8],
            },
        ),
        ("installed", Msg::Installed),
        ("done", Msg::Done),
        ("bye", Msg::Bye),
        (
            "abort",
            Msg::Abort {
                reason: "the source stopped".into(),
            },
        ),
        (
            "object",
            Msg::Object(farmap_slope::msg::ObjMsg::Welcome.encode()),
        ),
    ];
    msgs.into_iter()
        .map(|(name, m)| Seed::new("migrate_msg", name, m.encode().to_vec()))
        .collect()
}

/// Hand-over hellos (the target reads a reply from the same bytes' first 16), and replies.
fn handover_hello() -> Vec<Seed> {
    use farmap_uffd::handover::message::{encode_reply, Hello, Refusal, FLAG_PULL};

    let hello = |flags, len: u64, spec: &str| {
        let chunk_size = 65536u32;
        let chunks = len.div_ceil(u64::from(chunk_size));
        Hello {
            flags,
            base: 0x7f00_0000_0000,
            len,
            page_size: 4096,
            chunk_size,
            features: 0,
            spec: spec.into(),
            present: vec![0b1010_0101; chunks.div_ceil(8) as usize],
        }
        .encode()
    };
    vec![
        Seed::new(
            "handover_hello",
            "hello",
            hello(0, 1 << 20, "memory:1MiB?chunk=64KiB"),
        ),
        Seed::new(
            "handover_hello",
            "hello-pull",
            hello(FLAG_PULL, 3 << 16, "farmap://127.0.0.1:7000"),
        ),
        Seed::new("handover_hello", "reply-ok", encode_reply(None)),
        Seed::new(
            "handover_hello",
            "reply-store",
            encode_reply(Some(Refusal::Store)),
        ),
    ]
}

/// Every kind of object migration message (farmap-slope).
fn slope_msg() -> Vec<Seed> {
    use bytes::Bytes;
    use farmap_slope::msg::{ArenaShape, ObjMsg};
    let msgs = [
        (
            "hello",
            ObjMsg::Hello {
                slot: 3,
                tag: 9,
                build_id: [7; 32],
                arena: ArenaShape {
                    base: 1 << 44,
                    size: 1 << 34,
                    slot_shift: 30,
                    chunk: 65536,
                    page: 4096,
                },
            },
        ),
        ("welcome", ObjMsg::Welcome),
        (
            "pages",
            ObjMsg::Pages {
                round: 1,
                runs: vec![0..1, 5..6],
                data: Bytes::from(vec![1u8; 8192]),
            },
        ),
        (
            "handover",
            ObjMsg::HandOver {
                runs: vec![2..3, 6..7],
                data: Bytes::from(vec![2u8; 8192]),
                writes_stopped_ns: 5,
            },
        ),
        ("installed", ObjMsg::Installed { installed_ns: 6 }),
        ("released", ObjMsg::Released { released_ns: 7 }),
        (
            "done",
            ObjMsg::Done {
                owned_ns: 8,
                received_bytes: 9,
            },
        ),
        (
            "abort",
            ObjMsg::Abort {
                reason: "no room".into(),
            },
        ),
        ("flush", ObjMsg::Flush { round: 3 }),
        ("flushed", ObjMsg::Flushed { round: 3 }),
    ];
    msgs.into_iter()
        .map(|(name, m)| Seed::new("slope_msg", name, m.encode().to_vec()))
        .collect()
}

/// Every kind of `farmap run` message, and two back to back.
fn run_msg() -> Vec<Seed> {
    use farmap_run_proto::{
        Config, Done, ForkPrepare, Hello, Msg, Op, Registered, Request, Verdict, MAX_MSG_LEN,
    };
    let base = 0x7f00_0000_0000u64;
    let msgs = [
        (
            "hello",
            Msg::Hello(Hello {
                token: [7; 32],
                pid: 4242,
            }),
        ),
        (
            "config",
            Msg::Config(Config {
                region_len: 1 << 30,
                chunk_size: 4096,
                trash_len: 64 * 4096,
                features: 0x1_a048,
            }),
        ),
        (
            "registered",
            Msg::Registered(Registered {
                region: base,
                region_len: 1 << 30,
                staging: base + (2 << 30),
                staging_len: (1 << 30) + 64 * 4096,
                features: 0x1_a048,
            }),
        ),
        ("verdict", Msg::Verdict(Verdict { status: 3 })),
        (
            "fork_prepare",
            Msg::ForkPrepare(ForkPrepare {
                token: [7; 32],
                pid: 4243,
                region: base,
            }),
        ),
        (
            "discard",
            Msg::Request(Request {
                id: 1,
                op: Op::Discard {
                    start: base + (2 << 30),
                    len: 16 * 4096,
                },
            }),
        ),
        (
            "touch",
            Msg::Request(Request {
                id: 3,
                op: Op::Touch {
                    start: base,
                    len: 8 * 4096,
                },
            }),
        ),
        (
            "move",
            Msg::Request(Request {
                id: 2,
                op: Op::Move {
                    src: base,
                    dst: base + (2 << 30),
                    len: 32 * 4096,
                },
            }),
        ),
        (
            "done",
            Msg::Done(Done {
                id: 2,
                errno: 16,
                bytes: 4096,
            }),
        ),
    ];
    let encode = |m: &Msg| {
        let mut out = [0u8; MAX_MSG_LEN];
        let n = m.encode(&mut out).expect("a seed message encodes");
        out[..n].to_vec()
    };
    let mut seeds: Vec<Seed> = msgs
        .iter()
        .map(|(name, m)| Seed::new("run_msg", *name, encode(m)))
        .collect();
    let mut two = encode(&msgs[4].1);
    two.extend(encode(&msgs[6].1));
    seeds.push(Seed::new("run_msg", "two", two));
    seeds
}

/// Version manifests (a whole one, a delta) and stored chunks (compressed, raw), each behind
/// the two length bytes the target reads first.
fn version_manifest() -> Vec<Seed> {
    use farmap_versions::page::{Page, PageRef};
    use farmap_versions::{chunk, touched, Hash, Manifest, Parent};

    let m = Manifest {
        seq: 3,
        epoch: 1,
        base: 2,
        size: 1 << 20,
        chunk_size: 65536,
        whole: false,
        time_ms: 1_764_000_000_000,
        entries: vec![(0, Hash::of(b"a")), (7, Hash::ZERO), (15, Hash::of(b"b"))],
        pages: Vec::new(),
        page_chunks: 0,
        from: None,
    };
    let page = Page::new(vec![(0, Hash::of(b"a")), (63, Hash::of(b"b"))]);
    let paged = Manifest {
        seq: 4,
        base: 4,
        whole: true,
        entries: Vec::new(),
        pages: vec![PageRef {
            hash: Hash::of(&page.encode()),
            chunks: 2,
        }],
        page_chunks: 64,
        ..m.clone()
    };
    let fork = Manifest {
        seq: 0,
        base: 0,
        from: Some(Parent {
            region: "base".into(),
            seq: 5,
            depth: 1,
        }),
        ..m.clone()
    };
    let whole = Manifest {
        seq: 2,
        base: 2,
        whole: true,
        ..m.clone()
    };
    let stored = |data: &[u8]| {
        let mut out = ((data.len() - 1) as u16).to_le_bytes().to_vec();
        out.extend_from_slice(&chunk::encode(data));
        out
    };
    let noise: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    vec![
        Seed::new("version_manifest", "delta", m.encode()),
        Seed::new("version_manifest", "whole", whole.encode()),
        Seed::new("version_manifest", "fork", fork.encode()),
        Seed::new("version_manifest", "paged", paged.encode()),
        Seed::new("version_manifest", "page", page.encode()),
        Seed::new("version_manifest", "touched", touched::encode(&[5, 2, 7])),
        Seed::new(
            "version_manifest",
            "chunk-zstd",
            stored(&b"farmap ".repeat(512)),
        ),
        Seed::new("version_manifest", "chunk-raw", stored(&noise)),
    ]
}

/// The metadata file of real dir stores, and one written by hand with spaces and CRLF.
fn dir_meta() -> Vec<Seed> {
    use farmap_store::{DirOptions, DirStore};

    let real = |size, chunk_size| {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("store");
        let opts = DirOptions {
            size: Some(size),
            chunk_size: Some(chunk_size),
            ..DirOptions::default()
        };
        drop(DirStore::open(&path, opts).expect("a dir store is created"));
        fs::read(path.join("farmap-dir.meta")).expect("the store has its metadata file")
    };
    vec![
        Seed::new("dir_meta", "1GiB", real(1 << 30, 65536)),
        Seed::new("dir_meta", "odd-size", real(1_000_000, 4096)),
        Seed::new(
            "dir_meta",
            "spaces-crlf",
            &b"farmap-dir 1\r\n chunk = 4194304 \r\n\r\nsize=4194304\r\n"[..],
        ),
    ]
}

/// Specs of every scheme and stage, as users write them.
fn store_spec() -> Vec<Seed> {
    [
        ("memory", "memory:1GiB?chunk=4KiB"),
        ("file", "file:./a&b.img?size=1GiB&ro=yes"),
        ("dir", "dir:/x?size=1PiB&chunk=4MiB&max-open=3&ro"),
        (
            "farmaps",
            "farmaps://h:1?ca=a&cert=c&key=k&name=n&timeout=1500ms&connections=2",
        ),
        ("farmap-unix", "farmap+unix:/s?timeout=0.5s"),
        ("grpc", "farmap+grpc://h:2?timeout=90s&connections=2"),
        ("redis", "redis://u:pa@ss:w@127.0.0.1:6379/2?size=1MiB"),
        ("redis-cluster", "redis+cluster://:pw@h:1,h:2/?size=1MiB"),
        (
            "s3",
            "s3://bucket/a/b?endpoint=http://127.0.0.1:9000&region=eu-west-1&retries=3&size=64MiB&chunk=1MiB",
        ),
        (
            "cql",
            "cql://u:p%3Aw@h:1,h2/ks?table=t&region=r&size=3MiB&consistency=one&create=true",
        ),
        ("nbd", "nbd://h/disk%20one?chunk=1MiB&ro&connections=2&timeout=5s"),
        ("nbds-unix", "nbds+unix:///e?socket=/s&ca=a&cert=c&key=k&name=n"),
        ("versioned", "versioned:(dir:./o)/vm-1@before.x?size=1GiB&chunk=1MiB&ro"),
        (
            "tier",
            "tier:(memory:64MiB?cap=16MiB)(dir:/tmp/x?size=64MiB&cap=64MiB)?demote=5s",
        ),
        ("verified", "verified:(file:./r.img?size=1MiB)"),
        (
            "mirror",
            "mirror:(file:a.img?size=1MiB)(farmap://h:1?timeout=1s)?policy=primary-first&backlog=64",
        ),
        // Inputs that crashed the target once (`found-*` seeds need not parse).
        ("found-empty-option", "verified:?="),
        ("found-user-without-password", "rediss://n:@bd:00001"),
        ("found-demote-nanos", "tier:(memory:6058MiB)?demote=999999.99999995s"),
        (
            "found-long-fraction",
            "dir:&?size=000051650375503757.1540930516503165037550375503755540MiB&",
        ),
    ]
    .into_iter()
    .map(|(name, text)| Seed::new("store_spec", name, text.as_bytes()))
    .collect()
}

/// Datagrams as the kernel answers the NBD client: the controller's family reply with its
/// ack, a connect reply, an error, the end of a dump.
fn genl_reply() -> Vec<Seed> {
    use farmap_nbd_kernel::genl::consts::*;
    use farmap_nbd_kernel::genl::{ack, MessageBuilder};

    let mut family = MessageBuilder::new(GENL_ID_CTRL, 0, 4, CTRL_CMD_NEWFAMILY, 2);
    family
        .string(CTRL_ATTR_FAMILY_NAME, NBD_FAMILY)
        .u16(CTRL_ATTR_FAMILY_ID, 0x1b)
        .nested(CTRL_ATTR_MCAST_GROUPS, |m| {
            m.nested(1, |m| {
                m.u32(CTRL_ATTR_MCAST_GRP_ID, 9)
                    .string(CTRL_ATTR_MCAST_GRP_NAME, "nbd_mc_group");
            });
        });
    let family = [family.finish(), ack(4, 0)].concat();
    let mut connect = MessageBuilder::new(0x1b, 0, 5, NBD_CMD_CONNECT, NBD_GENL_VERSION);
    connect.u32(NBD_ATTR_INDEX, 7);
    let mut done = ack(6, 0);
    done[4..6].copy_from_slice(&NLMSG_DONE.to_ne_bytes());
    vec![
        Seed::new("genl_reply", "family", family),
        Seed::new("genl_reply", "connect", connect.finish()),
        Seed::new("genl_reply", "error", ack(3, -2)),
        Seed::new("genl_reply", "done", done),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::path::PathBuf;

    fn repo() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    #[test]
    fn the_committed_corpus_holds_every_seed() {
        let corpus = repo().join("fuzz/corpus");
        let mut stale = Vec::new();
        for s in seeds() {
            let path = s.path(&corpus);
            if fs::read(&path).ok().as_ref() != Some(&s.bytes) {
                stale.push(path.display().to_string());
            }
        }
        assert!(
            stale.is_empty(),
            "seeds missing or out of date (run `cargo run -p farmap-fuzz-seeds` and commit \
             fuzz/corpus/): {stale:#?}"
        );
    }

    #[test]
    fn every_fuzz_target_has_seeds_and_names_are_unique() {
        let targets: BTreeSet<String> = fs::read_dir(repo().join("fuzz/fuzz_targets"))
            .expect("fuzz/fuzz_targets")
            .map(|e| e.expect("an entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "rs"))
            .map(|p| {
                p.file_stem()
                    .expect("a stem")
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        assert_eq!(targets.len(), 12, "{targets:?}");
        let all = seeds();
        for t in &targets {
            let n = all.iter().filter(|s| s.target == t).count();
            assert!(n >= 3, "{t} has {n} seeds");
        }
        let names: BTreeSet<_> = all.iter().map(|s| (s.target, &s.name)).collect();
        assert_eq!(names.len(), all.len(), "two seeds share a file name");
        assert!(all.iter().all(|s| targets.contains(s.target)));
    }

    /// A seed the decoder refuses would only test its first check.
    #[test]
    fn binary_seeds_are_accepted_by_their_decoders() {
        use bytes::BytesMut;
        for s in seeds() {
            let b = &s.bytes[..];
            let what = format!("{}/{}", s.target, s.name);
            match s.target {
                "wire_frame" => {
                    let mut buf = BytesMut::from(&b[1..]);
                    let mut d = farmap_wire::FrameDecoder::new(farmap_wire::Limits::default());
                    while !buf.is_empty() {
                        d.decode(&mut buf).expect(&what).expect(&what);
                    }
                }
                "wire_handshake" if s.name == "client-hello" => {
                    let hello = farmap_wire::decode_client_hello(&mut BytesMut::from(b));
                    assert!(matches!(hello, Ok(Some(_))), "{what}");
                }
                "wire_handshake" => {
                    let hello = farmap_wire::decode_server_hello(&mut BytesMut::from(b));
                    assert!(matches!(hello, Ok(Some(_))), "{what}");
                }
                "migrate_msg" => {
                    use farmap_migrate::msg::{decode_header, Msg, HEADER_LEN};
                    let h = decode_header(b[..HEADER_LEN].try_into().unwrap()).expect(&what);
                    Msg::decode(h.kind, &b[HEADER_LEN..]).expect(&what);
                }
                "handover_hello" if s.name.starts_with("reply") => {
                    use farmap_uffd::handover::message::{decode_reply, REPLY_LEN};
                    decode_reply(b[..REPLY_LEN].try_into().unwrap()).expect(&what);
                }
                "handover_hello" => {
                    use farmap_uffd::handover::message::{Hello, HEADER_LEN};
                    let h = Hello::decode_header(b[..HEADER_LEN].try_into().unwrap());
                    let h = h.expect(&what);
                    Hello::from_parts(&h, &b[h.header_len..]).expect(&what);
                }
                "genl_reply" => {
                    farmap_nbd_kernel::genl::decode(b).expect(&what);
                }
                _ => {}
            }
        }
    }

    #[test]
    fn spec_seeds_parse_and_print_back() {
        let specs = seeds().into_iter().filter(|s| s.target == "store_spec");
        for s in specs.filter(|s| !s.name.starts_with("found-")) {
            let text = String::from_utf8(s.bytes).expect("UTF-8");
            let spec: farmap::StoreSpec = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            let again: farmap::StoreSpec = spec.to_secret_string().parse().expect("reads back");
            assert_eq!(again, spec, "{text}");
        }
    }
}
