//! Shared by the CLI's integration tests (each test binary uses some of it).
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// Starts `farmap serve ARGS...` and waits for its "listening on ADDR" line: the child and
/// ADDR. Its stderr is read (and dropped) to the end on a thread of its own, so the server
/// never blocks on a full pipe nor fails to log because the pipe is closed.
pub fn serve(args: &[&str]) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_farmap"))
        .arg("serve")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start farmap serve");
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    // The first line, before any connection is logged: that is what tools wait for.
    let Some(addr) = line
        .split("listening on ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .map(str::to_owned)
    else {
        // Not left running (holding its port, and whatever it inherited) after the panic.
        let _ = child.kill();
        let _ = child.wait();
        panic!("no address in {line:?}");
    };
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    (child, addr)
}

/// A CA and two certificates signed by it (server for 127.0.0.1, client), as PEM files.
pub fn pki(dir: &Path) -> [String; 5] {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = params.self_signed(&ca_key).unwrap();
    let write = |name: &str, pem: String| {
        let p = dir.join(name);
        std::fs::write(&p, pem).unwrap();
        p.display().to_string()
    };
    let leaf = |name: &str, san: &str| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![san.to_owned()])
            .unwrap()
            .signed_by(&key, &ca, &ca_key)
            .unwrap();
        (
            write(&format!("{name}.pem"), cert.pem()),
            write(&format!("{name}-key.pem"), key.serialize_pem()),
        )
    };
    let (server, server_key) = leaf("server", "127.0.0.1");
    let (client, client_key) = leaf("client", "client.test");
    [
        write("ca.pem", ca.pem()),
        server,
        server_key,
        client,
        client_key,
    ]
}

/// The lines of `r` (a child's stdout or stderr), read to the end on a thread of their own
/// (so the child never blocks on a full pipe); with `tag`, each is also echoed to stderr
/// as `[tag] line`.
pub fn lines(
    r: impl std::io::Read + Send + 'static,
    tag: Option<String>,
) -> std::sync::mpsc::Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(r).lines().map_while(Result::ok) {
            if let Some(tag) = &tag {
                eprintln!("[{tag}] {l}");
            }
            if tx.send(l).is_err() {
                return;
            }
        }
    });
    rx
}

/// The next line of `out` that is a JSON object whose `event` is `event`, skipping the
/// others; panics naming `who` if none comes within `wait`.
pub fn next_event(
    out: &std::sync::mpsc::Receiver<String>,
    event: &str,
    who: &str,
    wait: std::time::Duration,
) -> serde_json::Value {
    let deadline = std::time::Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let l = out
            .recv_timeout(left)
            .unwrap_or_else(|e| panic!("{who}: no '{event}' event ({e})"));
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&l) {
            if v["event"] == event {
                return v;
            }
        }
    }
}
