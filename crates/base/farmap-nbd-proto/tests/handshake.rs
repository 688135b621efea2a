//! The handshakes against byte sequences written from the protocol document, and the two
//! machines against each other.

use bytes::{BufMut, BytesMut};
use farmap_nbd_proto::consts::{info, opt, rep, tflag};
use farmap_nbd_proto::*;

fn export(name: &str, size: u64) -> ExportInfo {
    ExportInfo {
        name: name.into(),
        description: format!("the {name} disk"),
        size,
        flags: tflag::SEND_FLUSH | tflag::SEND_FUA | tflag::SEND_TRIM | tflag::CAN_MULTI_CONN,
        block: BlockSize {
            min: 1,
            preferred: 4096,
            max: 1 << 25,
        },
    }
}

fn server(tls: TlsMode) -> ServerHandshake {
    ServerHandshake::new(ServerConfig {
        exports: vec![export("", 1 << 20), export("b", 4096)],
        tls,
    })
}

fn option(o: u32, data: &[u8]) -> Vec<u8> {
    let mut v = b"IHAVEOPT".to_vec();
    v.extend_from_slice(&o.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    v
}

fn go_data(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut v = (name.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(name.as_bytes());
    v.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        v.extend_from_slice(&i.to_be_bytes());
    }
    v
}

fn meta_data(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut v = (name.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(name.as_bytes());
    v.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        v.extend_from_slice(&(q.len() as u32).to_be_bytes());
        v.extend_from_slice(q.as_bytes());
    }
    v
}

/// Splits option replies: (option, type, data).
fn replies(mut b: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
    let mut v = Vec::new();
    while !b.is_empty() {
        assert_eq!(
            &b[..8],
            &[0, 3, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9],
            "reply magic"
        );
        let o = u32::from_be_bytes(b[8..12].try_into().unwrap());
        let t = u32::from_be_bytes(b[12..16].try_into().unwrap());
        let l = u32::from_be_bytes(b[16..20].try_into().unwrap()) as usize;
        v.push((o, t, b[20..20 + l].to_vec()));
        b = &b[20 + l..];
    }
    v
}

fn run(s: &mut ServerHandshake, input: &[u8]) -> (Result<ServerStep, HandshakeError>, Vec<u8>) {
    let mut inp = BytesMut::from(input);
    let mut out = BytesMut::new();
    let r = s.step(&mut inp, &mut out);
    (r, out.to_vec())
}

#[test]
fn the_greeting_is_nbdmagic_ihaveopt_and_fixed_newstyle_no_zeroes() {
    let mut out = BytesMut::new();
    server(TlsMode::Off).greeting(&mut out);
    assert_eq!(&out[..], b"NBDMAGICIHAVEOPT\x00\x03");
}

#[test]
fn go_with_structured_replies_and_base_allocation() {
    let mut s = server(TlsMode::Off);
    let mut input = vec![0, 0, 0, 3]; // client flags: fixed newstyle, no zeroes
    input.extend(option(opt::STRUCTURED_REPLY, &[]));
    let (r, out) = run(&mut s, &input);
    assert_eq!(r, Ok(ServerStep::NeedMore));
    assert_eq!(
        replies(&out),
        vec![(opt::STRUCTURED_REPLY, rep::ACK, vec![])]
    );

    let (r, out) = run(
        &mut s,
        &option(
            opt::SET_META_CONTEXT,
            &meta_data("", &["base:allocation", "qemu:dirty"]),
        ),
    );
    assert_eq!(r, Ok(ServerStep::NeedMore));
    let mut ctx = 1u32.to_be_bytes().to_vec();
    ctx.extend_from_slice(b"base:allocation");
    assert_eq!(
        replies(&out),
        vec![
            (opt::SET_META_CONTEXT, rep::META_CONTEXT, ctx),
            (opt::SET_META_CONTEXT, rep::ACK, vec![]),
        ]
    );

    let (r, out) = run(
        &mut s,
        &option(opt::GO, &go_data("", &[info::NAME, info::BLOCK_SIZE])),
    );
    let flags = tflag::HAS_FLAGS
        | tflag::SEND_FLUSH
        | tflag::SEND_FUA
        | tflag::SEND_TRIM
        | tflag::CAN_MULTI_CONN;
    assert_eq!(
        r,
        Ok(ServerStep::Done(Negotiated {
            export: 0,
            structured: true,
            allocation_context: Some(1),
            flags,
        }))
    );
    let r = replies(&out);
    // INFO_EXPORT: type 0, size 2^20, flags.
    let mut exp = vec![0, 0, 0, 0, 0, 0, 0, 0x10, 0, 0];
    exp.extend_from_slice(&flags.to_be_bytes());
    assert_eq!(r[0], (opt::GO, rep::INFO, exp));
    assert_eq!(r[1], (opt::GO, rep::INFO, vec![0, 1])); // NAME: ""
    assert_eq!(
        r[2],
        (
            opt::GO,
            rep::INFO,
            vec![0, 3, 0, 0, 0, 1, 0, 0, 0x10, 0, 2, 0, 0, 0]
        )
    );
    assert_eq!(r[3], (opt::GO, rep::ACK, vec![]));
    assert_eq!(r.len(), 4);
}

#[test]
fn meta_context_for_another_export_is_not_active() {
    let mut s = server(TlsMode::Off);
    let mut input = vec![0, 0, 0, 1];
    input.extend(option(opt::STRUCTURED_REPLY, &[]));
    input.extend(option(
        opt::SET_META_CONTEXT,
        &meta_data("b", &["base:allocation"]),
    ));
    input.extend(option(opt::GO, &go_data("", &[])));
    let (r, _) = run(&mut s, &input);
    match r {
        Ok(ServerStep::Done(n)) => assert_eq!((n.export, n.allocation_context), (0, None)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn set_meta_context_without_structured_replies_is_invalid() {
    let mut s = server(TlsMode::Off);
    let mut input = vec![0, 0, 0, 1];
    input.extend(option(
        opt::SET_META_CONTEXT,
        &meta_data("", &["base:allocation"]),
    ));
    let (r, out) = run(&mut s, &input);
    assert_eq!(r, Ok(ServerStep::NeedMore));
    assert_eq!(replies(&out)[0].1, rep::ERR_INVALID);
}

#[test]
fn list_meta_context_answers_the_base_wildcard() {
    let mut s = server(TlsMode::Off);
    let mut input = vec![0, 0, 0, 1];
    input.extend(option(opt::LIST_META_CONTEXT, &meta_data("", &["base:"])));
    let (_, out) = run(&mut s, &input);
    let r = replies(&out);
    assert_eq!(r[0].1, rep::META_CONTEXT);
    assert_eq!(&r[0].2[4..], b"base:allocation");
    assert_eq!(r[1].1, rep::ACK);
}

#[test]
fn export_name_with_and_without_the_124_zeros() {
    for (cflags, want) in [(1u8, 10 + 124), (3, 10)] {
        let mut s = server(TlsMode::Off);
        let mut input = vec![0, 0, 0, cflags];
        input.extend(option(opt::EXPORT_NAME, b"b"));
        let (r, out) = run(&mut s, &input);
        assert!(
            matches!(r, Ok(ServerStep::Done(Negotiated { export: 1, .. }))),
            "{r:?}"
        );
        assert_eq!(out.len(), want);
        assert_eq!(&out[..8], &4096u64.to_be_bytes());
        assert!(out[10..].iter().all(|&b| b == 0));
    }
    let mut s = server(TlsMode::Off);
    let mut input = vec![0, 0, 0, 1];
    input.extend(option(opt::EXPORT_NAME, b"nope"));
    let (r, _) = run(&mut s, &input);
    assert_eq!(
        r,
        Err(HandshakeError::UnknownExport {
            name: "nope".into()
        })
    );
}

#[test]
fn list_unknown_and_malformed_options() {
    let mut s = server(TlsMode::Off);
    let mut input = vec![0, 0, 0, 1];
    input.extend(option(opt::LIST, &[]));
    input.extend(option(opt::INFO, &go_data("nope", &[])));
    input.extend(option(opt::GO, &[0, 0, 0, 9, b'x']));
    input.extend(option(99, b"whatever"));
    input.extend(option(opt::STARTTLS, &[]));
    let (r, out) = run(&mut s, &input);
    assert_eq!(r, Ok(ServerStep::NeedMore));
    let r = replies(&out);
    let types: Vec<u32> = r.iter().map(|x| x.1).collect();
    assert_eq!(
        types,
        vec![
            rep::SERVER,
            rep::SERVER,
            rep::ACK,
            rep::ERR_UNKNOWN,
            rep::ERR_INVALID,
            rep::ERR_UNSUP,
            rep::ERR_POLICY
        ]
    );
    assert_eq!(&r[1].2[..5], &[0, 0, 0, 1, b'b']);
    assert_eq!(&r[1].2[5..], b"the b disk");
}

#[test]
fn an_oversized_option_is_skipped_unbuffered_and_refused() {
    let mut s = server(TlsMode::Off);
    let mut inp = BytesMut::from(&[0u8, 0, 0, 1][..]);
    inp.put_slice(b"IHAVEOPT");
    inp.put_u32(opt::INFO);
    inp.put_u32(1 << 30);
    let mut out = BytesMut::new();
    assert_eq!(s.step(&mut inp, &mut out), Ok(ServerStep::NeedMore));
    assert!(inp.is_empty() && out.is_empty());
    // Feed 1 GiB in 1 MiB pieces: nothing accumulates.
    let piece = vec![0xaau8; 1 << 20];
    for _ in 0..1024 {
        inp.put_slice(&piece);
        s.step(&mut inp, &mut out).unwrap();
        assert!(inp.is_empty());
    }
    assert_eq!(replies(&out)[0].1, rep::ERR_TOO_BIG);
    let (r, _) = run(&mut s, &option(opt::GO, &go_data("", &[])));
    assert!(matches!(r, Ok(ServerStep::Done(_))), "{r:?}");
}

#[test]
fn forced_tls_refuses_everything_but_starttls_and_forgets_earlier_state() {
    let mut s = server(TlsMode::Required);
    let mut input = vec![0, 0, 0, 1];
    input.extend(option(opt::STRUCTURED_REPLY, &[]));
    input.extend(option(opt::LIST, &[]));
    input.extend(option(opt::GO, &go_data("", &[])));
    input.extend(option(opt::STARTTLS, &[]));
    let (r, out) = run(&mut s, &input);
    assert_eq!(r, Ok(ServerStep::StartTls));
    let types: Vec<u32> = replies(&out).iter().map(|x| x.1).collect();
    assert_eq!(
        types,
        vec![
            rep::ERR_TLS_REQD,
            rep::ERR_TLS_REQD,
            rep::ERR_TLS_REQD,
            rep::ACK
        ]
    );
    s.tls_started();
    let mut input = option(opt::STARTTLS, &[]);
    input.extend(option(opt::GO, &go_data("", &[])));
    let (r, out) = run(&mut s, &input);
    assert_eq!(replies(&out)[0].1, rep::ERR_INVALID);
    match r {
        Ok(ServerStep::Done(n)) => assert!(!n.structured),
        other => panic!("{other:?}"),
    }
    // EXPORT_NAME before TLS cannot be answered: a hard disconnect.
    let mut s = server(TlsMode::Required);
    let mut input = vec![0, 0, 0, 1];
    input.extend(option(opt::EXPORT_NAME, b""));
    assert_eq!(run(&mut s, &input).0, Err(HandshakeError::TlsRequired));
}

#[test]
fn bad_client_flags_and_bad_option_magic_end_the_handshake() {
    let mut s = server(TlsMode::Off);
    assert!(matches!(
        run(&mut s, &[0, 0, 0, 0x81]).0,
        Err(HandshakeError::ClientFlags { flags: 0x81 })
    ));
    let mut s = server(TlsMode::Off);
    let mut input = vec![0, 0, 0, 1];
    input.extend(b"GET / HTTP/1.1\r\n");
    assert!(matches!(
        run(&mut s, &input).0,
        Err(HandshakeError::BadMagic { .. })
    ));
    let mut s = server(TlsMode::Off);
    let mut input = vec![0, 0, 0, 1];
    input.extend(option(opt::ABORT, &[]));
    let (r, out) = run(&mut s, &input);
    assert_eq!(r, Ok(ServerStep::Aborted));
    assert_eq!(replies(&out), vec![(opt::ABORT, rep::ACK, vec![])]);
}

/// Drives a client and a server machine against each other, byte by byte.
fn converse(client: ClientConfig, tls: TlsMode) -> (ExportDetails, Negotiated) {
    let mut s = server(tls);
    let mut c = ClientHandshake::new(client);
    let mut to_client = BytesMut::new();
    let mut to_server = BytesMut::new();
    let mut client_in = BytesMut::new();
    s.greeting(&mut to_client);
    let mut done_s = None;
    let mut done_c = None;
    for _ in 0..10_000 {
        // The client gets one byte at a time: every partial-input path is taken.
        if done_c.is_none() {
            let n = to_client.len().min(1);
            client_in.extend_from_slice(&to_client.split_to(n));
            match c.step(&mut client_in, &mut to_server).unwrap() {
                ClientStep::NeedMore => {}
                ClientStep::StartTls => c.tls_started(&mut to_server),
                ClientStep::Done(d) => done_c = Some(d),
            }
        }
        if done_s.is_none() {
            match s.step(&mut to_server, &mut to_client).unwrap() {
                ServerStep::NeedMore => {}
                ServerStep::StartTls => s.tls_started(),
                ServerStep::Done(n) => done_s = Some(n),
                ServerStep::Aborted => panic!("aborted"),
            }
        }
        if let (Some(c), Some(s)) = (&done_c, &done_s) {
            return (c.clone(), s.clone());
        }
    }
    panic!("the handshake did not finish");
}

#[test]
fn client_and_server_machines_agree() {
    for tls in [false, true] {
        let (c, s) = converse(
            ClientConfig {
                export: "b".into(),
                tls,
                structured: true,
                allocation: true,
            },
            if tls { TlsMode::Required } else { TlsMode::Off },
        );
        assert_eq!(c.size, 4096);
        assert_eq!(c.flags, s.flags);
        assert!(c.structured && s.structured);
        assert_eq!(c.allocation_context, s.allocation_context);
        assert_eq!(c.allocation_context, Some(1));
        assert_eq!(c.block.unwrap().preferred, 4096);
        assert_eq!(s.export, 1);
    }
    let (c, s) = converse(
        ClientConfig {
            export: "".into(),
            tls: false,
            structured: false,
            allocation: false,
        },
        TlsMode::Off,
    );
    assert!(!c.structured && !s.structured && c.allocation_context.is_none());
    assert_eq!(c.size, 1 << 20);
}

#[test]
fn the_client_falls_back_to_export_name_and_reports_refusals() {
    // A server that knows no GO: ERR_UNSUP, then EXPORT_NAME's reply without zeros.
    let mut c = ClientHandshake::new(ClientConfig {
        export: "x".into(),
        tls: false,
        structured: false,
        allocation: false,
    });
    let mut inp = BytesMut::from(&b"NBDMAGICIHAVEOPT\x00\x03"[..]);
    let mut out = BytesMut::new();
    assert_eq!(c.step(&mut inp, &mut out).unwrap(), ClientStep::NeedMore);
    assert_eq!(&out[..4], &[0, 0, 0, 3]);
    inp.put_u64(0x3e889045565a9);
    inp.put_u32(opt::GO);
    inp.put_u32(rep::ERR_UNSUP);
    inp.put_u32(0);
    out.clear();
    assert_eq!(c.step(&mut inp, &mut out).unwrap(), ClientStep::NeedMore);
    assert_eq!(&out[..], &option(opt::EXPORT_NAME, b"x")[..]);
    inp.put_u64(12345);
    inp.put_u16(tflag::HAS_FLAGS | tflag::READ_ONLY);
    match c.step(&mut inp, &mut out).unwrap() {
        ClientStep::Done(d) => assert_eq!((d.size, d.flags), (12345, 3)),
        other => panic!("{other:?}"),
    }

    let mut c = ClientHandshake::new(ClientConfig {
        export: "x".into(),
        tls: false,
        structured: false,
        allocation: false,
    });
    let mut inp = BytesMut::from(&b"NBDMAGICIHAVEOPT\x00\x01"[..]);
    inp.put_u64(0x3e889045565a9);
    inp.put_u32(opt::GO);
    inp.put_u32(rep::ERR_UNKNOWN);
    inp.put_u32(4);
    inp.put_slice(b"gone");
    let e = c.step(&mut inp, &mut BytesMut::new()).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("NBD_OPT_GO") && msg.contains("no such export") && msg.contains("gone"),
        "{msg}"
    );
}
