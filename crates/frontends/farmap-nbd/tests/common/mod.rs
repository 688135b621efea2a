//! Shared helpers: servers over memory stores, tools installed on demand, certificates, and
//! a raw client built on farmap-nbd-proto.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use farmap_core::{Geometry, Store};
use farmap_nbd::{serve_nbd, Export, NbdServeOptions, NbdServer};
use farmap_nbd_proto::{
    ClientConfig, ClientHandshake, ClientStep, ExportDetails, Reply, ReplyDecoder, RequestHeader,
};
use farmap_net::{ListenAddr, Listener};
use farmap_store::MemoryStore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Server options for tests: quiet, short timeouts.
pub fn quiet() -> NbdServeOptions {
    NbdServeOptions {
        log: false,
        handshake_timeout: Duration::from_secs(10),
        shutdown_grace: Duration::from_secs(5),
        ..NbdServeOptions::default()
    }
}

pub fn memory(size: u64, chunk: u64) -> Arc<dyn Store> {
    Arc::new(MemoryStore::new(Geometry::new(size, chunk).unwrap()))
}

pub fn export(name: &str, store: Arc<dyn Store>) -> Export {
    Export {
        name: name.into(),
        description: format!("test export {name:?}"),
        store,
        read_only: false,
    }
}

/// Serves `exports` on a free loopback port.
pub async fn start(exports: Vec<Export>, opts: NbdServeOptions) -> NbdServer {
    let addr: ListenAddr = "127.0.0.1:0".parse().unwrap();
    let listener = Listener::bind(&addr).await.unwrap();
    serve_nbd(exports, listener, opts).unwrap()
}

pub fn tcp(server: &NbdServer) -> SocketAddr {
    match server.local_addr() {
        ListenAddr::Tcp(a) => *a,
        other => panic!("{other}"),
    }
}

pub fn uri(server: &NbdServer, export: &str) -> String {
    format!("nbd://{}/{export}", tcp(server))
}

/// Makes sure the Debian packages providing `tools` are installed (apt-get under a lock
/// shared by every test); false (after recording a skip) when they cannot be.
pub fn need(test: &str, tools: &[(&str, &str)]) -> bool {
    let missing: Vec<&str> = tools
        .iter()
        .filter(|(bin, _)| which(bin).is_none())
        .map(|(_, pkg)| *pkg)
        .collect();
    if missing.is_empty() {
        return true;
    }
    let script = format!(
        "flock /tmp/farmap-apt.lock sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
         apt-get install -y -qq --no-install-recommends {}'",
        missing.join(" ")
    );
    let ok = Command::new("sh")
        .arg("-c")
        .arg(&script)
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    let still: Vec<&str> = tools
        .iter()
        .filter(|(bin, _)| which(bin).is_none())
        .map(|(b, _)| *b)
        .collect();
    if ok && still.is_empty() {
        return true;
    }
    farmap_testkit::skip(
        test,
        format!("{} missing and could not be installed", still.join(", ")),
    );
    false
}

fn which(bin: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(bin))
            .find(|p| p.is_file())
    })
}

/// Runs a command on a blocking thread (the server runs on the test's runtime).
pub async fn run(cmd: &str, args: &[&str]) -> Output {
    let cmd = cmd.to_owned();
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        Command::new(&cmd)
            .args(&args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {cmd}: {e}"))
    })
    .await
    .unwrap()
}

/// Runs a command that must succeed; its stdout.
pub async fn ok(cmd: &str, args: &[&str]) -> String {
    let out = run(cmd, args).await;
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Bytes that differ along the file and include a run of zeros.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut v = farmap_testkit::pattern_bytes(seed, 0, len);
    let z = len / 3;
    v[z..z + len / 8].fill(0);
    v
}

/// Reads `len` bytes at `offset` of a store.
pub async fn store_bytes(store: &Arc<dyn Store>, offset: u64, len: usize) -> Vec<u8> {
    let u = farmap_pipeline::Unaligned::new(store.clone());
    let mut buf = vec![0; len];
    u.read_at(offset, &mut buf).await.unwrap();
    buf
}

pub fn write_file(path: &Path, data: &[u8]) {
    std::fs::write(path, data).unwrap();
}

/// A raw NBD client on farmap-nbd-proto: handshake, then requests and replies by hand.
pub struct Raw {
    pub stream: TcpStream,
    pub details: ExportDetails,
    pub buf: BytesMut,
    pub decoder: ReplyDecoder,
}

impl Raw {
    pub async fn connect(addr: SocketAddr, export: &str, structured: bool) -> Raw {
        Self::try_connect(addr, export, structured).await.unwrap()
    }

    pub async fn try_connect(
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

    pub async fn send(&mut self, h: RequestHeader, payload: &[u8]) {
        let mut b = BytesMut::new();
        h.encode(&mut b);
        b.extend_from_slice(payload);
        self.stream.write_all(&b).await.unwrap();
    }

    /// The next reply message; `read_len` gives simple read replies' lengths.
    pub async fn reply(&mut self, read_len: impl Fn(u64) -> Option<u32>) -> Option<Reply> {
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
    pub async fn full_reply(&mut self, read_len: impl Fn(u64) -> Option<u32> + Copy) -> Vec<Reply> {
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
pub fn assemble(replies: &[Reply], offset: u64, len: usize) -> Result<Vec<u8>, u32> {
    use farmap_nbd_proto::Chunk;
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

/// A CA, a server certificate for localhost/127.0.0.1 and a client certificate, as PEM
/// files in `dir` (also laid out for libnbd's `tls-certificates=DIR`: `ca-cert.pem`,
/// `client-cert.pem`, `client-key.pem` in `dir/client`, and the CA alone in `dir/nocert`).
pub struct Pki {
    pub ca: std::path::PathBuf,
    pub server_cert: std::path::PathBuf,
    pub server_key: std::path::PathBuf,
    pub client_dir: std::path::PathBuf,
    pub nocert_dir: std::path::PathBuf,
}

impl Pki {
    pub fn new(dir: &Path) -> Pki {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
        let ca_key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "farmap NBD test CA");
        let ca = params.self_signed(&ca_key).unwrap();
        let issue = |names: &[&str]| {
            let key = KeyPair::generate().unwrap();
            let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
            let mut p = CertificateParams::new(names).unwrap();
            p.distinguished_name
                .push(rcgen::DnType::CommonName, "farmap NBD test");
            let cert = p.signed_by(&key, &ca, &ca_key).unwrap();
            (cert.pem(), key.serialize_pem())
        };
        let (scert, skey) = issue(&["localhost", "127.0.0.1"]);
        let (ccert, ckey) = issue(&["client.farmap.test"]);
        let client_dir = dir.join("client");
        let nocert_dir = dir.join("nocert");
        std::fs::create_dir_all(&client_dir).unwrap();
        std::fs::create_dir_all(&nocert_dir).unwrap();
        let w = |p: std::path::PathBuf, s: &str| {
            std::fs::write(&p, s).unwrap();
            p
        };
        w(client_dir.join("ca-cert.pem"), &ca.pem());
        w(client_dir.join("client-cert.pem"), &ccert);
        w(client_dir.join("client-key.pem"), &ckey);
        w(nocert_dir.join("ca-cert.pem"), &ca.pem());
        Pki {
            ca: w(dir.join("ca.pem"), &ca.pem()),
            server_cert: w(dir.join("server.pem"), &scert),
            server_key: w(dir.join("server-key.pem"), &skey),
            client_dir,
            nocert_dir,
        }
    }

    pub fn server_tls(&self, mtls: bool) -> farmap_net::TlsServerConfig {
        farmap_net::TlsServerConfig {
            cert: self.server_cert.clone(),
            key: self.server_key.clone(),
            client_ca: mtls.then(|| self.ca.clone()),
        }
    }
}
