//! `--metrics-listen`: a running `farmap serve` scraped for real. Data moves through it with
//! real clients (`farmap cp` over farmap's protocol, gRPC and NBD; a managed FUSE mount's
//! file), the exposition is read by Python's `prometheus_client` parser, and hostile
//! scrapers (an endless head, wrong paths and methods, a silent client, no client
//! certificate) do not hurt it.

mod common;
use common::farmap;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use farmap_testkit::cli::Listening;
use farmap_testkit::process::KillOnDrop;
use farmap_testkit::skip::skip;
use farmap_testkit::tls::Pki;
use farmap_testkit::wait::eventually;
use rand::{RngCore, SeedableRng};
use serde_json::Value;

const SIZE: usize = 4 << 20;

/// A server and where its metrics are.
struct Served {
    server: Listening,
    metrics: String,
    _log: Arc<Mutex<String>>,
}

/// Starts `farmap serve SPEC --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 ARGS...` and
/// reads the address of its metrics from stderr.
fn serve(spec: &str, args: &[&str]) -> Served {
    let mut all = vec![
        "serve",
        spec,
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "-q",
    ];
    all.extend_from_slice(args);
    let mut server = farmap().listening(&all);
    let log = server.log_stderr();
    let mut metrics = None;
    eventually(
        "the metrics line on stderr",
        Duration::from_secs(20),
        || {
            let log = log.lock().unwrap();
            metrics = log
                .split("metrics on ")
                .nth(1)
                .and_then(|rest| rest.split_whitespace().next())
                .map(|url| {
                    url.split("://")
                        .nth(1)
                        .unwrap()
                        .trim_end_matches("/metrics")
                        .to_owned()
                });
            metrics.is_some()
        },
    );
    Served {
        server,
        metrics: metrics.unwrap(),
        _log: log,
    }
}

/// Sends `request` to `addr` and reads what comes back until the server closes: `Err` when
/// the connection fails (refused, reset).
fn exchange(addr: &str, request: &[u8]) -> std::io::Result<String> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    s.write_all(request)?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// `GET /metrics`: the body, after checking the status and headers.
fn scrape(addr: &str) -> String {
    let reply = exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").expect("a scrape");
    let (head, body) = reply.split_once("\r\n\r\n").expect("a head and a body");
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(head.contains("Connection: close"), "{head}");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    body.to_owned()
}

/// A Python that has the `prometheus_client` parser (Debian's python3-prometheus-client is
/// for the system's Python, which may not be first on PATH).
fn python_with_parser() -> Option<&'static str> {
    ["/usr/bin/python3", "python3"].into_iter().find(|py| {
        Command::new(py)
            .args(["-c", "import prometheus_client.parser"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

const PARSE: &str = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
out = []
for fam in text_string_to_metric_families(sys.stdin.read()):
    for s in fam.samples:
        out.append({"family": fam.name, "type": fam.type, "name": s.name,
                    "labels": s.labels, "value": s.value})
print(json.dumps(out))
"#;

/// One sample of the exposition, as the parser read it.
#[derive(Debug)]
struct Sample {
    family: String,
    kind: String,
    labels: HashMap<String, String>,
    value: f64,
}

/// The samples of `text`, by sample name; the test fails if the parser refuses it.
fn parse(python: &str, text: &str) -> HashMap<String, Vec<Sample>> {
    let mut child = Command::new(python)
        .args(["-c", PARSE])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the parser refused the exposition: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    let mut samples: HashMap<String, Vec<Sample>> = HashMap::new();
    for r in rows {
        let labels = r["labels"].as_object().unwrap();
        samples
            .entry(r["name"].as_str().unwrap().to_owned())
            .or_default()
            .push(Sample {
                family: r["family"].as_str().unwrap().to_owned(),
                kind: r["type"].as_str().unwrap().to_owned(),
                labels: labels
                    .iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
                    .collect(),
                value: r["value"].as_f64().unwrap(),
            });
    }
    samples
}

/// The value of sample `name` whose labels include `labels` (0 when there is none), after
/// checking its family's type.
fn value(
    samples: &HashMap<String, Vec<Sample>>,
    name: &str,
    kind: &str,
    labels: &[(&str, &str)],
) -> f64 {
    let found: Vec<&Sample> = samples
        .get(name)
        .into_iter()
        .flatten()
        .filter(|s| {
            labels
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .collect();
    for s in &found {
        assert_eq!(s.kind, kind, "{name} (family {}) is a {}", s.family, s.kind);
    }
    found.iter().map(|s| s.value).sum()
}

fn random_file(path: &Path, seed: u64) {
    let mut data = vec![0u8; SIZE];
    rand::rngs::SmallRng::seed_from_u64(seed).fill_bytes(&mut data);
    std::fs::write(path, &data).unwrap();
}

/// Copies a random file into `url` and back, checking the round trip.
fn round_trip(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (src, back) = (dir.path().join("src"), dir.path().join("back"));
    random_file(&src, 3);
    for (from, to) in [
        (format!("file:{}", src.display()), url.to_owned()),
        (url.to_owned(), format!("file:{}", back.display())),
    ] {
        let out = farmap().run(&["cp", "-q", &from, &to]);
        assert!(out.status.success(), "cp {from} {to}: {out:?}");
    }
    assert!(std::fs::read(&src).unwrap() == std::fs::read(&back).unwrap());
}

/// Serves with `args`, copies through `scheme://ADDR` both ways, and checks what the scrape
/// says of the served store and (for `protocol`) of the connections.
fn data_through(test: &str, args: &[&str], scheme: &str, protocol: Option<&str>) {
    let Some(python) = python_with_parser() else {
        return skip(
            test,
            "no Python with prometheus_client (python3-prometheus-client)",
        );
    };
    let served = serve("memory:4MiB?chunk=16KiB", args);
    let url = format!("{scheme}://{}", served.server.addr());
    let idle = parse(python, &scrape(&served.metrics));
    round_trip(&url);
    let s = parse(python, &scrape(&served.metrics));
    let store = [("store", "served"), ("kind", "memory")];
    let size = SIZE as f64;
    for (name, at_least) in [
        ("farmap_store_written_bytes_total", size),
        ("farmap_store_read_bytes_total", size),
        ("farmap_store_written_chunks_total", 256.0),
    ] {
        let v = value(&s, name, "counter", &store);
        assert!(v >= at_least, "{name} = {v}, under {at_least}");
    }
    let writes = [("store", "served"), ("op", "write")];
    assert!(value(&s, "farmap_store_operations_total", "counter", &writes) >= 256.0);
    let count = "farmap_store_operation_duration_seconds_count";
    assert!(value(&s, count, "histogram", &writes) >= 256.0);
    let inf = [("op", "write"), ("le", "+Inf")];
    assert!(
        value(
            &s,
            "farmap_store_operation_duration_seconds_bucket",
            "histogram",
            &inf
        ) >= 256.0
    );
    if let Some(protocol) = protocol {
        let p = [("protocol", protocol)];
        let name = "farmap_connections_accepted_total";
        let (before, after) = (
            value(&idle, name, "counter", &p),
            value(&s, name, "counter", &p),
        );
        assert!(after >= before + 2.0, "{name}: {before} then {after}");
        // A connection held open is counted while it is.
        let held = TcpStream::connect(served.server.addr()).unwrap();
        eventually("farmap_connections at 1", Duration::from_secs(10), || {
            let s = parse(python, &scrape(&served.metrics));
            value(&s, "farmap_connections", "gauge", &p) >= 1.0
        });
        drop(held);
    }
}

#[test]
fn native_serve_counts_bytes_and_connections() {
    data_through(
        "native_serve_counts_bytes_and_connections",
        &[],
        "farmap",
        Some("native"),
    );
}

#[test]
fn nbd_serve_counts_bytes_and_connections() {
    data_through(
        "nbd_serve_counts_bytes_and_connections",
        &["--nbd"],
        "nbd",
        Some("nbd"),
    );
}

#[test]
fn grpc_serve_counts_bytes() {
    data_through("grpc_serve_counts_bytes", &["--grpc"], "farmap+grpc", None);
}

#[test]
fn hostile_scrapers_do_not_hurt_the_server() {
    let Some(python) = python_with_parser() else {
        return skip(
            "hostile_scrapers_do_not_hurt_the_server",
            "no Python with prometheus_client (python3-prometheus-client)",
        );
    };
    let served = serve("memory:4MiB?chunk=16KiB", &[]);
    let m = served.metrics.as_str();
    // A silent client and one that stops mid-line hold a slot each, not the endpoint.
    let silent = TcpStream::connect(m).unwrap();
    let mut stalled = TcpStream::connect(m).unwrap();
    stalled.write_all(b"GET /metr").unwrap();
    // A head that never ends: cut at 8 KiB (431), or the connection is closed on it.
    let mut endless = b"GET /metrics HTTP/1.1\r\n".to_vec();
    while endless.len() < 64 * 1024 {
        endless.extend_from_slice(b"X-Filler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
    }
    match exchange(m, &endless) {
        Ok(reply) => assert!(
            reply.is_empty() || reply.starts_with("HTTP/1.1 431"),
            "{reply}"
        ),
        Err(e) => eprintln!("the endless head's connection failed: {e}"),
    }
    for (request, status) in [
        (&b"GET /nope HTTP/1.1\r\n\r\n"[..], "HTTP/1.1 404"),
        (
            b"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc",
            "HTTP/1.1 405",
        ),
        (b"\x16\x03\x01\x00\xff\x01\r\n\r\n", "HTTP/1.1 400"),
    ] {
        let reply = exchange(m, request).unwrap();
        assert!(reply.starts_with(status), "{request:?}: {reply}");
    }
    let start = Instant::now();
    parse(python, &scrape(m));
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "a scrape waited for the silent clients"
    );
    // The data path is untouched, and scrapes still count it.
    round_trip(&format!("farmap://{}", served.server.addr()));
    let s = parse(python, &scrape(m));
    let v = value(
        &s,
        "farmap_store_read_bytes_total",
        "counter",
        &[("store", "served")],
    );
    assert!(v >= SIZE as f64, "read bytes {v}");
    drop((silent, stalled));
    let (status, log) = served.server.stop("TERM");
    assert!(status.success(), "{status:?}: {log}");
}

/// Sends one `GET /metrics` over TLS configured by `tls`: the reply, or why it failed.
fn tls_scrape(addr: &str, tls: farmap_net::TlsClientConfig) -> Result<String, String> {
    farmap_testkit::wait::block_on(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (connector, name) = tls.connector("127.0.0.1").map_err(|e| e.to_string())?;
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let mut s = connector
            .connect(name, tcp)
            .await
            .map_err(|e| e.to_string())?;
        s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n")
            .await
            .map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.map_err(|e| e.to_string())?;
        Ok(String::from_utf8_lossy(&out).into_owned())
    })
}

#[test]
fn metrics_over_mutual_tls_answer_only_clients_with_a_certificate() {
    let pki = Pki::new();
    let [ca, cert, key, client_cert, client_key] = pki.paths();
    let served = serve(
        "memory:1MiB",
        &[
            "--metrics-tls-cert",
            &cert,
            "--metrics-tls-key",
            &key,
            "--metrics-client-ca",
            &ca,
        ],
    );
    let log = served._log.lock().unwrap().clone();
    assert!(
        log.contains("metrics on https://") && log.contains("(mutual TLS)"),
        "{log}"
    );
    let client = |with_cert: bool| farmap_net::TlsClientConfig {
        ca: ca.clone().into(),
        cert: with_cert.then(|| client_cert.clone().into()),
        key: with_cert.then(|| client_key.clone().into()),
        server_name: None,
    };
    let reply = tls_scrape(&served.metrics, client(true)).expect("a scrape with a certificate");
    assert!(reply.starts_with("HTTP/1.1 200 OK"), "{reply}");
    assert!(reply.contains("farmap_store_operations_total"), "{reply}");
    match tls_scrape(&served.metrics, client(false)) {
        Ok(reply) => assert!(
            !reply.contains("200 OK"),
            "answered without a certificate: {reply}"
        ),
        Err(e) => eprintln!("without a certificate: {e}"),
    }
    // Plain HTTP to the TLS endpoint gets no metrics either.
    let plain = exchange(&served.metrics, b"GET /metrics HTTP/1.1\r\n\r\n").unwrap_or_default();
    assert!(!plain.contains("farmap_"), "{plain}");
}

/// Starts `farmap mount DIR STORE ARGS...`: the process (killed if the test fails), the
/// mounted file's path, and the address of its metrics.
fn mount(dir: &Path, store: &str, args: &[&str]) -> (KillOnDrop, String, String) {
    let mut child = farmap()
        .command()
        .args(["mount", dir.to_str().unwrap(), store])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start farmap mount");
    let (stdout, stderr) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let child = KillOnDrop(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(url) = line.split("metrics on http://").nth(1) {
                let _ = tx.send(url.trim_end_matches("/metrics").to_owned());
            }
        }
    });
    let mut path = String::new();
    BufReader::new(stdout).read_line(&mut path).unwrap();
    let metrics = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the metrics line");
    (child, path.trim().to_owned(), metrics)
}

#[test]
fn a_managed_mount_counts_its_store_and_its_pushes() {
    let test = "a_managed_mount_counts_its_store_and_its_pushes";
    let Some(python) = python_with_parser() else {
        return skip(
            test,
            "no Python with prometheus_client (python3-prometheus-client)",
        );
    };
    if !farmap_testkit::skip::fuse_mountable(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let args = ["--managed", "--metrics-listen", "127.0.0.1:0"];
    let (mut child, path, metrics) = mount(dir.path(), "memory:4MiB?chunk=16KiB", &args);
    let mut data = vec![0u8; SIZE];
    rand::rngs::SmallRng::seed_from_u64(5).fill_bytes(&mut data);
    let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all(&data).unwrap();
    // An fsync pushes everything to the store.
    f.sync_all().unwrap();
    drop(f);
    assert!(std::fs::read(&path).unwrap() == data);
    let s = parse(python, &scrape(&metrics));
    let store = [("store", "store"), ("kind", "memory")];
    let written = value(&s, "farmap_store_written_bytes_total", "counter", &store);
    assert!(written >= SIZE as f64, "written {written}");
    let pushed = value(&s, "farmap_push_bytes_total", "counter", &[]);
    assert!(pushed >= SIZE as f64, "pushed {pushed}");
    let present = value(&s, "farmap_cache_present_chunks", "gauge", &[]);
    assert!(present >= 256.0, "present {present}");
    farmap_testkit::process::terminate(&mut child.0, Duration::from_secs(60));
}

/// The interposition library `farmap run` loads, from this build (skipped without it or
/// without bounded userfaultfd regions).
fn preload(test: &str) -> Option<std::path::PathBuf> {
    common::preload_library(test)
}

/// `farmap run --metrics-listen`: a Python program touching 48 MiB of heap at an 8 MiB
/// bound, scraped while it runs: faults, evictions and the bytes written back, the heap's
/// store counted as `store="heap"`, resident memory within the bound (plus `min_free`).
#[test]
fn farmap_run_counts_its_programs_heap() {
    let test = "farmap_run_counts_its_programs_heap";
    let Some(python) = python_with_parser() else {
        return skip(
            test,
            "no Python with prometheus_client (python3-prometheus-client)",
        );
    };
    let Some(so) = preload(test) else { return };
    let script = "import time\n\
                  b = [bytearray(1 << 20) for _ in range(48)]\n\
                  for x in b: x[::4096] = b'\\x01' * (len(x) // 4096)\n\
                  print('ready', flush=True)\n\
                  time.sleep(60)\n";
    let mut child = farmap()
        .command()
        .args(["run", "--preload", so.to_str().unwrap()])
        .args(["--heap-max", "256MiB", "--local-max", "8MiB"])
        .args([
            "--metrics-listen",
            "127.0.0.1:0",
            "--",
            "/usr/bin/python3",
            "-c",
            script,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start farmap run");
    let (stdout, stderr) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let mut child = KillOnDrop(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(url) = line.split("metrics on http://").nth(1) {
                let _ = tx.send(url.trim_end_matches("/metrics").to_owned());
            }
        }
    });
    let metrics = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the metrics line");
    let mut ready = String::new();
    BufReader::new(stdout).read_line(&mut ready).unwrap();
    assert_eq!(ready.trim(), "ready", "the program did not get ready");
    let s = parse(python, &scrape(&metrics));
    // Every page of the 48 MiB was touched: faulted in, or prefetched with a fault's window.
    let faults = value(&s, "farmap_region_faults_total", "counter", &[]);
    let prefetched = value(&s, "farmap_region_prefetched_total", "counter", &[]);
    assert!(faults > 0.0, "faults {faults}");
    assert!(
        faults + prefetched >= 48.0 * 256.0,
        "faults {faults} prefetched {prefetched}"
    );
    // At most 8 MiB (and min_free) of them stay.
    let evictions = value(&s, "farmap_region_evictions_total", "counter", &[]);
    assert!(evictions >= 39.0 * 256.0, "evictions {evictions}");
    let pushed = value(&s, "farmap_region_pushed_bytes_total", "counter", &[]);
    assert!(pushed > 0.0, "pushed {pushed}");
    let heap = [("store", "heap"), ("kind", "memory")];
    let written = value(&s, "farmap_store_written_bytes_total", "counter", &heap);
    assert!(written > 0.0, "written {written}");
    assert_eq!(value(&s, "farmap_run_programs", "gauge", &[]), 1.0);
    let limit = value(&s, "farmap_region_limit_bytes", "gauge", &[]);
    assert_eq!(limit, (8 << 20) as f64);
    let resident = value(&s, "farmap_region_resident_bytes", "gauge", &[]);
    // At most the limit plus min_free (a 32nd of it).
    assert!(resident <= limit * 33.0 / 32.0, "resident {resident}");
    farmap_testkit::process::terminate(&mut child.0, Duration::from_secs(60));
}
