//! The farmap handshake decoders (client hello, server hello) on arbitrary bytes: they must
//! never panic, and an accepted server hello must re-encode to a hello that decodes the same.
#![no_main]

use bytes::BytesMut;
use farmap_wire::{decode_client_hello, decode_server_hello, ServerHello};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut buf = BytesMut::from(data);
    if let Ok(Some(hello)) = decode_client_hello(&mut buf) {
        let mut again = BytesMut::new();
        hello.encode(&mut again);
        assert_eq!(decode_client_hello(&mut again), Ok(Some(hello)));
    }
    let mut buf = BytesMut::from(data);
    if let Ok(Some(hello)) = decode_server_hello(&mut buf) {
        let mut again = BytesMut::new();
        hello.encode(&mut again);
        let back = decode_server_hello(&mut again).expect("a decoded hello re-encodes validly");
        match (&hello, back) {
            (ServerHello::Accepted(a), Some(ServerHello::Accepted(b))) => assert_eq!(*a, b),
            (ServerHello::Refused(a), Some(ServerHello::Refused(b))) => {
                assert_eq!(
                    (a.version, a.min_version, a.max_version, a.kind),
                    (b.version, b.min_version, b.max_version, b.kind)
                );
            }
            (ServerHello::Challenge(a), Some(ServerHello::Challenge(b))) => assert_eq!(*a, b),
            (a, b) => panic!("{a:?} re-decoded as {b:?}"),
        }
    }
});
