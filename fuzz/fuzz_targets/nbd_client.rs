//! The NBD client's decoders on arbitrary server bytes: the handshake machine, then the
//! reply decoder on what follows. Neither may panic or accept a chunk over its limit.
#![no_main]

use bytes::BytesMut;
use farmap_nbd_proto::{
    Chunk, ClientConfig, ClientHandshake, ClientStep, Reply, ReplyDecoder,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&piece, data)) = data.split_first() else {
        return;
    };
    let piece = usize::from(piece) + 1;
    let mut hs = ClientHandshake::new(ClientConfig {
        export: String::new(),
        tls: piece % 2 == 0,
        structured: true,
        allocation: true,
    });
    // Start right after a valid greeting so that option replies are reached.
    let mut buf = BytesMut::from(&b"NBDMAGICIHAVEOPT\x00\x03"[..]);
    let mut out = BytesMut::new();
    let mut replies: Option<ReplyDecoder> = None;
    for part in data.chunks(piece) {
        buf.extend_from_slice(part);
        match &mut replies {
            None => match hs.step(&mut buf, &mut out) {
                Ok(ClientStep::NeedMore) => {}
                Ok(ClientStep::StartTls) => hs.tls_started(&mut out),
                Ok(ClientStep::Done(_)) => replies = Some(ReplyDecoder::new(1 << 16)),
                Err(_) => return,
            },
            Some(d) => loop {
                match d.decode(&mut buf, |c| (c & 1 == 0).then_some((c >> 48) as u32)) {
                    Ok(Some(Reply::Chunk { chunk: Chunk::OffsetData { data, .. }, .. })) => {
                        assert!(data.len() <= (1 << 16) + 32)
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(_) => return,
                }
            },
        }
    }
});
