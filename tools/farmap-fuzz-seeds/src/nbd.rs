//! Seeds of the `nbd_server` and `nbd_client` targets: the real client and server handshake
//! machines played against each other in memory (with the targets' settings), then requests
//! or replies of the transmission phase. Each seed starts with the byte that tells the target
//! how to cut the stream into reads and whether TLS is on (`byte + 1` even: TLS).

use bytes::BytesMut;
use farmap_nbd_proto::consts::{cflag, cmd};
use farmap_nbd_proto::{
    block_status_chunk, error_chunk, error_offset_chunk, none_chunk, offset_data_header,
    offset_hole_chunk, simple_reply, BlockSize, ClientConfig, ClientHandshake, ClientStep, Command,
    ExportInfo, Extent, RequestHeader, ServerConfig, ServerHandshake, ServerStep, TlsMode,
};

use crate::Seed;

/// The export of the `nbd_server` target.
fn export() -> ExportInfo {
    ExportInfo {
        name: String::new(),
        description: "d".into(),
        size: 1 << 20,
        flags: 0,
        block: BlockSize {
            min: 1,
            preferred: 4096,
            max: 1 << 16,
        },
    }
}

/// What each side sent in a handshake between the real machines: the client's bytes, and the
/// server's after its 18-byte greeting (which the `nbd_client` target starts from).
fn handshake(tls: bool) -> (Vec<u8>, Vec<u8>) {
    let mut server = ServerHandshake::new(ServerConfig {
        exports: vec![export()],
        tls: if tls { TlsMode::Required } else { TlsMode::Off },
    });
    let mut client = ClientHandshake::new(ClientConfig {
        export: String::new(),
        tls,
        structured: true,
        allocation: true,
    });
    let mut to_client = BytesMut::new();
    server.greeting(&mut to_client);
    let mut to_server = BytesMut::new();
    let (mut client_sent, mut server_sent) = (Vec::new(), Vec::new());
    let (mut client_done, mut server_done) = (false, false);
    for _ in 0..64 {
        if !client_done {
            let mut out = BytesMut::new();
            match client
                .step(&mut to_client, &mut out)
                .expect("the client agrees")
            {
                ClientStep::NeedMore => {}
                ClientStep::StartTls => client.tls_started(&mut out),
                ClientStep::Done(_) => client_done = true,
            }
            client_sent.extend_from_slice(&out);
            to_server.extend_from_slice(&out);
        }
        if !server_done {
            let mut out = BytesMut::new();
            match server
                .step(&mut to_server, &mut out)
                .expect("the server agrees")
            {
                ServerStep::NeedMore => {}
                ServerStep::StartTls => server.tls_started(),
                ServerStep::Done(_) => server_done = true,
                ServerStep::Aborted => panic!("the client aborted"),
            }
            server_sent.extend_from_slice(&out);
            to_client.extend_from_slice(&out);
        }
        if client_done && server_done {
            return (client_sent, server_sent);
        }
    }
    panic!("the handshake did not finish");
}

fn request(command: Command, flags: u16, cookie: u64, offset: u64, length: u32) -> Vec<u8> {
    RequestHeader {
        flags,
        command,
        cookie,
        offset,
        length,
    }
    .to_bytes()
    .to_vec()
}

/// Client handshakes, then requests of every command.
pub(crate) fn server_seeds() -> Vec<Seed> {
    let mut requests = Vec::new();
    requests.extend(request(Command::Read, 0, 1, 0, 4096));
    requests.extend(request(Command::Write, cflag::FUA, 2, 512, 16));
    requests.extend([0xab; 16]);
    requests.extend(request(Command::Flush, 0, 3, 0, 0));
    requests.extend(request(Command::Trim, 0, 4, 4096, 8192));
    requests.extend(request(Command::WriteZeroes, 0, 5, 0, 65536));
    requests.extend(request(Command::BlockStatus, 0, 6, 0, 1 << 20));
    requests.extend(request(Command::Cache, 0, 7, 0, 4096));
    requests.extend(request(Command::Other(cmd::BLOCK_STATUS + 9), 0, 8, 0, 0));
    requests.extend(request(Command::Disc, 0, 9, 0, 0));
    let (plain, _) = handshake(false);
    let (tls, _) = handshake(true);
    vec![
        // 31-byte reads, no TLS.
        Seed::new("nbd_server", "handshake", [&[30u8][..], &plain].concat()),
        Seed::new(
            "nbd_server",
            "requests-bytewise",
            [&[0u8][..], &plain, &requests].concat(),
        ),
        // 2-byte reads, TLS required.
        Seed::new(
            "nbd_server",
            "tls-requests",
            [&[1u8][..], &tls, &requests].concat(),
        ),
    ]
}

/// Server handshakes (after the greeting), then replies of every kind.
pub(crate) fn client_seeds() -> Vec<Seed> {
    // The target expects `cookie >> 48` bytes after a successful simple reply to an even
    // cookie (a read), none after any other.
    let read_cookie = (16u64 << 48) | 2;
    let mut replies = Vec::new();
    replies.extend(simple_reply(read_cookie, 0));
    replies.extend([0x5a; 16]);
    replies.extend(simple_reply(3, 0));
    replies.extend(simple_reply(read_cookie, 5));
    replies.extend(offset_data_header(4, 0, 8, false));
    replies.extend([1u8; 8]);
    replies.extend(offset_hole_chunk(4, 8, 4096, false));
    replies.extend(none_chunk(4));
    replies.extend(block_status_chunk(
        5,
        1,
        &[
            Extent {
                length: 4096,
                flags: 3,
            },
            Extent {
                length: 61440,
                flags: 0,
            },
        ],
        true,
    ));
    replies.extend(error_chunk(6, 5, "input/output error", false));
    replies.extend(error_offset_chunk(6, 5, "bad sector", 4096, true));
    let (_, plain) = handshake(false);
    let (_, tls) = handshake(true);
    vec![
        Seed::new("nbd_client", "handshake", [&[30u8][..], &plain].concat()),
        Seed::new(
            "nbd_client",
            "replies-bytewise",
            [&[0u8][..], &plain, &replies].concat(),
        ),
        Seed::new(
            "nbd_client",
            "tls-replies",
            [&[1u8][..], &tls, &replies].concat(),
        ),
    ]
}
