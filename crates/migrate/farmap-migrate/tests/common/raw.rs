//! The control protocol spoken by hand, for fake seeders and raw leechers: framed messages on
//! a TCP stream, and either side of the authentication with this process's key (the one
//! seeders and leechers built with default options hold).
#![allow(dead_code)] // not every test binary plays both sides

use farmap_migrate::auth::{process_key, LeecherExchange, Proven, SeederExchange};
use farmap_migrate::msg::{decode_header, Msg, HEADER_LEN};
use farmap_net::auth::{Key, KeySlot};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads one message.
pub async fn read_msg(s: &mut TcpStream) -> std::io::Result<Msg> {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).await?;
    let h = decode_header(&h).map_err(std::io::Error::other)?;
    let mut p = vec![0u8; h.len as usize];
    s.read_exact(&mut p).await?;
    Msg::decode(h.kind, &p).map_err(std::io::Error::other)
}

/// Writes one message.
pub async fn write_msg(s: &mut TcpStream, m: &Msg) {
    s.write_all(&m.encode()).await.unwrap();
}

/// The reason of an `Abort` (panics on anything else).
pub fn abort_reason(m: std::io::Result<Msg>) -> String {
    match m {
        Ok(Msg::Abort { reason }) => reason,
        other => panic!("expected an Abort, got {other:?}"),
    }
}

/// A fake seeder's side of the authentication, with this process's key: what the leecher
/// proved; `data`, its data plane's key slot, then requires the session's data key.
pub async fn as_seeder(s: &mut TcpStream, data: &KeySlot) -> Proven {
    let (session, nonce) = match read_msg(s).await.unwrap() {
        Msg::AuthHello { session, nonce } => (session, nonce),
        other => panic!("expected an AuthHello, got {other:?}"),
    };
    let key = process_key();
    let (exchange, challenge) = SeederExchange::start(key.clone(), key, session, nonce);
    write_msg(s, &challenge).await;
    let proof = match read_msg(s).await.unwrap() {
        Msg::AuthProof { proof } => proof,
        other => panic!("expected an AuthProof, got {other:?}"),
    };
    let proven = exchange.finish(&proof).expect("the leecher proves the key");
    data.set(Some(proven.data_key()));
    proven
}

/// A raw leecher's side of the authentication for `session` with `key`: what was proven,
/// or the seeder's refusal (its `Abort` reason).
pub async fn as_leecher(s: &mut TcpStream, key: &Key, session: u128) -> Result<Proven, String> {
    let (exchange, hello) = LeecherExchange::start(key, session);
    write_msg(s, &hello).await;
    match read_msg(s).await {
        Ok(Msg::AuthChallenge { nonce, proof }) => {
            let (answer, proven) = exchange.answer(&nonce, &proof).map_err(|e| e.to_string())?;
            write_msg(s, &answer).await;
            Ok(proven)
        }
        other => Err(abort_reason(other)),
    }
}

/// [`as_leecher`] for a new session with this process's key, which must succeed.
pub async fn as_new_leecher(s: &mut TcpStream) -> Proven {
    as_leecher(s, &process_key(), 0)
        .await
        .expect("the seeder accepts this process's key")
}
