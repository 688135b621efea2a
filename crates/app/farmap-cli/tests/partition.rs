//! Partitions, not kills: servers and a migration source run in a network namespace joined
//! to the test's by a veth pair, and the link is cut (`ip link set down`) for seconds in the
//! middle of the work, then healed. The processes stay alive on both sides. Nothing
//! acknowledged is lost: a remote store's writes (also when the cut outlasts the request
//! timeout: writes fail, and none lands after a later one), a mirror's (its primary
//! resynchronised after the partition) and a live migration's region (which finishes,
//! verified, whether the cut comes during the pre-copy or the post-copy).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use farmap::pipeline::PrimaryState;
use farmap::spec::{open_mirror, SpecKind};
use farmap::{ChunkIdx, Store, StoreSpec};
use farmap_net::{ClientOptions, RemoteAddr, RemoteStore};
use farmap_testkit::cli::Listening;
use farmap_testkit::process::Proc;

mod common;

const WAIT: Duration = Duration::from_secs(90);
/// How long each partition lasts.
const CUT: Duration = Duration::from_secs(3);

/// A network namespace joined to the test's by a veth pair (`host_ip` on this side,
/// `peer_ip` inside); deleted (with the pair) when dropped.
struct Netns {
    name: String,
    host_if: String,
    host_ip: String,
    peer_ip: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Netns {
    /// Namespace number `n` of this test binary (each test its own subnet), or `None` after
    /// recording a skip when namespaces cannot be made here (not root, no `ip`).
    fn new(test: &str, n: u8) -> Option<Netns> {
        let made = (|| {
            let tag = format!("{}{n}", std::process::id() % 100_000);
            let ns = Netns {
                name: format!("fm-{tag}"),
                host_if: format!("fmh{tag}"),
                host_ip: format!("10.213.{n}.1"),
                peer_ip: format!("10.213.{n}.2"),
            };
            let peer_if = format!("fmp{tag}");
            ip(&["netns", "add", &ns.name])?;
            // From here on, dropping `ns` cleans up.
            ip(&[
                "link",
                "add",
                &ns.host_if,
                "type",
                "veth",
                "peer",
                "name",
                &peer_if,
            ])?;
            ip(&["link", "set", &peer_if, "netns", &ns.name])?;
            ip(&[
                "addr",
                "add",
                &format!("{}/24", ns.host_ip),
                "dev",
                &ns.host_if,
            ])?;
            ip(&["link", "set", &ns.host_if, "up"])?;
            let inside = |args: &[&str]| {
                let mut all = vec!["-n", ns.name.as_str()];
                all.extend_from_slice(args);
                ip(&all)
            };
            inside(&[
                "addr",
                "add",
                &format!("{}/24", ns.peer_ip),
                "dev",
                &peer_if,
            ])?;
            inside(&["link", "set", &peer_if, "up"])?;
            inside(&["link", "set", "lo", "up"])?;
            Ok::<_, String>(ns)
        })();
        farmap_testkit::skip::unless(test, made).inspect(Netns::wait_reachable)
    }

    /// Waits until the link is up on this side (which needs both ends up), or its state is
    /// known to be up, at most 5 s.
    fn wait_reachable(&self) {
        let state = format!("/sys/class/net/{}/operstate", self.host_if);
        let start = Instant::now();
        while std::fs::read_to_string(&state).is_ok_and(|s| s.trim() != "up")
            && start.elapsed() < Duration::from_secs(5)
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Cuts the link: both ends lose their carrier; no process notices anything else.
    fn cut(&self) {
        ip(&["link", "set", &self.host_if, "down"]).unwrap();
    }

    /// Heals it.
    fn heal(&self) {
        ip(&["link", "set", &self.host_if, "up"]).unwrap();
    }

    /// `farmap ARGS` inside the namespace.
    fn farmap(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, env!("CARGO_BIN_EXE_farmap")]);
        cmd.args(args);
        cmd
    }

    /// `farmap serve SPEC` inside, listening on the peer's address.
    fn serve(&self, spec: &str) -> Listening {
        let listen = format!("{}:0", self.peer_ip);
        Listening::start(&mut self.farmap(&["serve", spec, "--listen", &listen])).drained()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.name]);
        let _ = ip(&["link", "del", &self.host_if]);
    }
}

/// Chunk `idx` as written at `version`.
fn content(idx: u64, version: u64) -> Bytes {
    let mut b = vec![(idx % 251) as u8; 4096];
    b[..16].copy_from_slice(&[idx.to_le_bytes(), version.to_le_bytes()].concat());
    Bytes::from(b)
}

/// Writes chunk after chunk (round-robin over `chunks`) until `stop`, recording in `model`
/// the version of each chunk whose write was acknowledged; returns the failed writes.
async fn keep_writing(
    store: Arc<dyn Store>,
    chunks: u64,
    model: Arc<parking_lot::Mutex<Vec<u64>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> u64 {
    let mut failed = 0;
    let mut version = 1;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        for idx in 0..chunks {
            if store
                .write(ChunkIdx(idx), content(idx, version))
                .await
                .is_ok()
            {
                model.lock()[idx as usize] = version;
            } else {
                failed += 1;
            }
        }
        version += 1;
    }
    failed
}

/// A writer task over a store ([`keep_writing`]) and what it acknowledged.
struct Writing {
    model: Arc<parking_lot::Mutex<Vec<u64>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<u64>,
}

impl Writing {
    /// Starts writing chunk after chunk of the first `chunks`.
    fn start(store: Arc<dyn Store>, chunks: u64) -> Writing {
        let model = Arc::new(parking_lot::Mutex::new(vec![0u64; chunks as usize]));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let task = tokio::spawn(keep_writing(store, chunks, model.clone(), stop.clone()));
        Writing { model, stop, task }
    }

    /// Stops: the writes that failed, and the version of each chunk last acknowledged.
    async fn stop(self) -> (u64, Vec<u64>) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let failed = self.task.await.unwrap();
        let model = self.model.lock().clone();
        (failed, model)
    }
}

/// The served file, read directly.
fn served_file(path: &Path) -> farmap::store::FileStore {
    let opts = farmap::store::FileOptions {
        chunk_size: 4096,
        read_only: true,
        ..Default::default()
    };
    farmap::store::FileStore::open(path, opts).unwrap()
}

async fn check(store: &dyn Store, model: &[u64], what: &str) {
    for (idx, &version) in model.iter().enumerate() {
        let got = store.read(ChunkIdx(idx as u64)).await.unwrap();
        let want = if version == 0 {
            Bytes::from(vec![0u8; 4096])
        } else {
            content(idx as u64, version)
        };
        assert!(got == want, "{what}: chunk {idx} is not version {version}");
    }
}

/// Runs `work` while the link is cut for [`CUT`] after `before`.
async fn partitioned(ns: &Netns, before: Duration) {
    tokio::time::sleep(before).await;
    eprintln!("cutting the link for {CUT:?}");
    ns.cut();
    tokio::time::sleep(CUT).await;
    ns.heal();
    eprintln!("healed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_store_rides_out_a_partition_and_loses_nothing() {
    let Some(ns) = Netns::new("a_remote_store_rides_out_a_partition_and_loses_nothing", 1) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("served.img");
    let server = ns.serve(&format!("file:{}?size=1MiB&chunk=4KiB", file.display()));
    let store: Arc<dyn Store> = Arc::new(
        RemoteStore::connect(
            RemoteAddr::Tcp(server.addr().to_owned()),
            ClientOptions::default(),
        )
        .await
        .unwrap(),
    );
    let writing = Writing::start(store.clone(), 256);
    partitioned(&ns, Duration::from_millis(500)).await;
    // Writes go on after the heal.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (failed, model) = writing.stop().await;
    store.flush().await.expect("the flush after the partition");
    assert_eq!(
        failed, 0,
        "a {CUT:?} partition is shorter than the request timeout: no write fails"
    );
    assert!(model.iter().all(|&v| v >= 2), "writes went on: {model:?}");
    check(&*store, &model, "through the store").await;
    // And in the server's file, read by a store of its own.
    check(&served_file(&file), &model, "in the served file").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_longer_than_the_request_timeout_fails_writes_and_lets_none_land_late() {
    let Some(ns) = Netns::new(
        "a_cut_longer_than_the_request_timeout_fails_writes_and_lets_none_land_late",
        4,
    ) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("served.img");
    let server = ns.serve(&format!("file:{}?size=1MiB&chunk=4KiB", file.display()));
    let timeout = Duration::from_secs(1);
    let store: Arc<dyn Store> = Arc::new(
        RemoteStore::connect(
            RemoteAddr::Tcp(server.addr().to_owned()),
            ClientOptions {
                request_timeout: timeout,
                ..ClientOptions::default()
            },
        )
        .await
        .unwrap(),
    );
    let writing = Writing::start(store.clone(), 64);
    partitioned(&ns, Duration::from_millis(500)).await;
    // Writes go on after the heal, long enough for anything held in the cut to arrive.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (failed, model) = writing.stop().await;
    assert!(
        failed > 0,
        "a {CUT:?} cut is longer than the {timeout:?} request timeout: writes fail"
    );
    assert!(model.iter().all(|&v| v >= 2), "writes went on: {model:?}");
    store.flush().await.expect("the flush after the partition");
    // A write that failed in the cut must not land after a later one was acknowledged:
    // every chunk holds the version last acknowledged.
    tokio::time::sleep(Duration::from_secs(1)).await;
    check(&*store, &model, "through the store").await;
    check(&served_file(&file), &model, "in the served file").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_serves_through_a_partition_and_resyncs_its_primary() {
    let Some(ns) = Netns::new(
        "a_mirror_serves_through_a_partition_and_resyncs_its_primary",
        2,
    ) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("primary.img");
    let server = ns.serve(&format!("file:{}?size=1MiB&chunk=4KiB", file.display()));
    let spec: StoreSpec = format!(
        "mirror:(farmap://{}?timeout=2s)(file:{}?size=1MiB&chunk=4KiB)?timeout=500ms&probe=50ms",
        server.addr(),
        dir.path().join("mirror.img").display()
    )
    .parse()
    .unwrap();
    let SpecKind::Mirror {
        primary,
        mirror,
        options,
    } = &spec.kind
    else {
        panic!("a mirror spec")
    };
    let mirrored = Arc::new(open_mirror(&spec, primary, mirror, *options).await.unwrap());
    let store: Arc<dyn Store> = mirrored.clone();
    let writing = Writing::start(store.clone(), 256);
    partitioned(&ns, Duration::from_millis(500)).await;
    let st = mirrored.mirror_status();
    assert!(st.failovers >= 1, "the partition was noticed: {st:?}");
    // Writes go on while the primary is resynchronised, until it is up again.
    let deadline = Instant::now() + Duration::from_secs(30);
    while mirrored.mirror_status().primary != PrimaryState::Up {
        assert!(
            Instant::now() < deadline,
            "no resync: {:?}",
            mirrored.mirror_status()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (failed, model) = writing.stop().await;
    assert_eq!(failed, 0, "the mirror took every write");
    store.flush().await.unwrap();
    let st = mirrored.mirror_status();
    assert!(st.resynced > 0, "{st:?}");
    check(&*store, &model, "through the mirror").await;
    // On the primary itself, once writes in flight during the partition have landed (a
    // late one must not undo the resync): every acknowledged write is there.
    tokio::time::sleep(Duration::from_secs(2)).await;
    check(&served_file(&file), &model, "on the resynchronised primary").await;
}

/// An application with a region (or waiting for one) and its migration agent, as in
/// migrate.rs, started by `cmd` (inside a namespace or not).
struct App {
    proc: Proc,
    agent: PathBuf,
}

impl App {
    fn start(mut cmd: Command, dir: &Path, name: &str, size: u64, init: bool) -> App {
        let agent = dir.join(format!("{name}.agent"));
        cmd.args([
            "__demo-node",
            "--size",
            &size.to_string(),
            "--seed",
            "7",
            "--ops-per-sec",
            "200",
            "--agent",
            agent.to_str().unwrap(),
        ]);
        if init {
            cmd.arg("--init");
        }
        let mut proc = Proc::spawn(name, &mut cmd, WAIT);
        proc.event("ready");
        App { proc, agent }
    }

    fn verify(&mut self) -> Option<u64> {
        self.proc.send("verify");
        let v = self.proc.event("verified");
        if v["error"] == "no region here" {
            return None;
        }
        assert_eq!(v["ok"], true, "{}: region differs: {v}", self.proc.name());
        Some(v["ops"].as_u64().unwrap())
    }
}

/// A live migration of a 64 MiB region from an app in the namespace to one here (the leecher
/// run with `leech_args` added), the link cut for [`CUT`] at `cut_at`: a source still in
/// charge runs on during the cut, and the migration finishes after the heal, verified at the
/// destination.
fn migrate_across_a_cut(test: &str, net: u8, leech_args: &[&str], cut_at: Cut) {
    let Some(ns) = Netns::new(test, net) else {
        return;
    };
    if farmap_testkit::skip::unless(test, farmap_uffd::probe()).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let size = 64u64 << 20;
    let mut src = App::start(ns.farmap(&[]), dir.path(), "src", size, true);
    let mut dst = App::start(common::farmap().command(), dir.path(), "dst", size, false);
    let listen = format!("{}:0", ns.peer_ip);
    let mut seed = common::farmap().proc(
        "seed",
        &[
            "seed",
            "--app",
            src.agent.to_str().unwrap(),
            "--listen",
            &listen,
            "--data-listen",
            &listen,
            "--json",
        ],
        WAIT,
    );
    let l = seed.stderr_line("waiting for a leecher: control on ");
    let rest = l.split("control on ").nth(1).unwrap();
    let (control, _) = rest.split_once(", data plane on ").unwrap();
    let mut args = vec![
        "leech",
        "--app",
        dst.agent.to_str().unwrap(),
        "--from",
        control.trim(),
        "--json",
    ];
    args.extend_from_slice(leech_args);
    let mut leech = common::farmap().proc("leech", &args, WAIT);
    match cut_at {
        Cut::PreCopy => {
            seed.stderr_line("a leecher connected");
        }
        Cut::PostCopy => {
            leech.stderr_line("resumed here");
        }
    }
    eprintln!("cutting the link for {CUT:?} ({cut_at:?})");
    ns.cut();
    std::thread::sleep(CUT);
    if cut_at == Cut::PreCopy {
        assert!(
            src.verify().is_some(),
            "the source runs on during the partition"
        );
    }
    ns.heal();
    eprintln!("healed");
    let (ok, out, err) = leech.finish();
    assert!(ok, "leech failed across the partition ({cut_at:?}): {err}");
    let report: serde_json::Value = serde_json::from_str(out.last().unwrap()).unwrap();
    assert_eq!(report["region_bytes"], size);
    let (ok, _, err) = seed.finish();
    assert!(ok, "seed failed: {err}");
    assert_eq!(src.verify(), None, "the source handed the region over");
    assert!(dst.verify().is_some(), "verified at the destination");
}

/// When a migration's link is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    /// As soon as the leecher is in: the pull of the region is under way, the source runs.
    PreCopy,
    /// Once the region is handed over and the destination runs, its chunks still coming.
    PostCopy,
}

#[test]
fn a_migration_across_a_partition_finishes_verified() {
    migrate_across_a_cut(
        "a_migration_across_a_partition_finishes_verified",
        3,
        &[],
        Cut::PreCopy,
    );
}

/// The link is cut during the post-copy (paced so that the pull lasts past the cut): the
/// destination waits, and after the heal the migration finishes, verified.
#[test]
fn a_partition_during_the_post_copy_is_ridden_out() {
    migrate_across_a_cut(
        "a_partition_during_the_post_copy_is_ridden_out",
        5,
        // 64 MiB at 8 MB/s: the pull lasts about 8 s, past the cut.
        &["--mode", "postcopy", "--max-rate", "8MB"],
        Cut::PostCopy,
    );
}
