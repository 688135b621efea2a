//! The NBD server's decoders on arbitrary client bytes: the handshake machine, then the
//! request decoder on what follows. Neither may panic, buffer an oversized write, or answer
//! with more than it was asked.
#![no_main]

use bytes::BytesMut;
use farmap_nbd_proto::{
    BlockSize, ExportInfo, Incoming, RequestDecoder, ServerConfig, ServerHandshake, ServerStep,
    TlsMode,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&piece, data)) = data.split_first() else {
        return;
    };
    let piece = usize::from(piece) + 1;
    let mut hs = ServerHandshake::new(ServerConfig {
        exports: vec![ExportInfo {
            name: String::new(),
            description: "d".into(),
            size: 1 << 20,
            flags: 0,
            block: BlockSize { min: 1, preferred: 4096, max: 1 << 16 },
        }],
        tls: if piece % 2 == 0 { TlsMode::Required } else { TlsMode::Off },
    });
    let mut buf = BytesMut::new();
    let mut out = BytesMut::new();
    let mut requests: Option<RequestDecoder> = None;
    for part in data.chunks(piece) {
        buf.extend_from_slice(part);
        match &mut requests {
            None => match hs.step(&mut buf, &mut out) {
                Ok(ServerStep::NeedMore) => {}
                Ok(ServerStep::StartTls) => hs.tls_started(),
                Ok(ServerStep::Done(_)) => requests = Some(RequestDecoder::new(1 << 16)),
                Ok(ServerStep::Aborted) | Err(_) => return,
            },
            Some(d) => loop {
                match d.decode(&mut buf) {
                    Ok(Some(Incoming::Request { payload, .. })) => assert!(payload.len() <= 1 << 16),
                    Ok(Some(Incoming::Oversized(h))) => assert!(h.length > 1 << 16),
                    Ok(None) => break,
                    Err(_) => return,
                }
            },
        }
        assert!(buf.len() <= (1 << 16) + 64 * 1024 + 512);
    }
});
