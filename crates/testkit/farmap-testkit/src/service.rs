//! Real servers for integration tests (Redis, MinIO, Cassandra, nbdkit...), started by a script.
//!
//! Each service has a script `scripts/services/<name>.sh DIR [ARGS...]` in the repository. The
//! script installs or builds what it needs (cached under `~/.cache/farmap/`), starts the
//! server(s) on 127.0.0.1 with their data in `DIR`, prints `KEY=VALUE` lines on stdout (the
//! ports, a ready-made store spec...) and then a line `READY`, and stays alive until it is sent
//! SIGTERM or its parent (the test process) exits, when it stops its servers. Anything it
//! logs goes to stderr. `scripts/services/lib.sh` has the shared pieces (free ports, waiting for
//! a port, the parent watch).
//!
//! [`Service::start`] runs one instance for a test; [`Service::shared`] starts one per test
//! binary and keeps it until the process exits (a Cassandra node takes seconds to start).
//! A service that cannot be started is an error the test reports through
//! [`skip`](fn@crate::skip) (which fails under `CI=true`).

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Why a service could not be started.
#[derive(Debug)]
pub struct ServiceError {
    /// The service's name.
    pub name: String,
    /// What went wrong (with the script's last output lines when it exited).
    pub reason: String,
    /// Whether the script ran and exited before `READY` (not a timeout or a missing script).
    pub exited: bool,
}

impl std::fmt::Display for ServiceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cannot start service {}: {}", self.name, self.reason)
    }
}

impl std::error::Error for ServiceError {}

/// A running service: its script's process and the values it printed.
#[derive(Debug)]
pub struct Service {
    name: String,
    vars: HashMap<String, String>,
    child: Mutex<Option<Child>>,
    dir: PathBuf,
}

/// The repository's root (the testkit crate sits at `crates/testkit/farmap-testkit`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(3)
        .expect("crates/testkit/farmap-testkit has three parents")
        .to_path_buf()
}

/// How long a script may take to print `READY` (installing a package or downloading jars on
/// a cold machine included; building MinIO from source takes minutes the first time).
const START_TIMEOUT: Duration = Duration::from_secs(15 * 60);

/// How many times [`Service::start`] runs a script that exits before `READY`.
pub const START_ATTEMPTS: u32 = 3;

impl Service {
    /// Starts `scripts/services/<name>.sh` with a fresh data directory and `args`, and waits
    /// for its `READY` line. A script that exits before `READY` is started again (at most
    /// [`START_ATTEMPTS`] times, each in a fresh directory): on a busy machine a server's port
    /// can be taken between the script's choice and its bind, or a server can refuse its
    /// first requests although its readiness check passed. A script that hangs is not.
    pub fn start(name: &str, args: &[&str]) -> Result<Service, ServiceError> {
        let mut attempt = 1;
        loop {
            match Service::start_once(name, args) {
                Err(e) if e.exited && attempt < START_ATTEMPTS => {
                    eprintln!(
                        "service {name}: attempt {attempt} of {START_ATTEMPTS} failed, starting it again: {}",
                        e.reason
                    );
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    fn start_once(name: &str, args: &[&str]) -> Result<Service, ServiceError> {
        let err = |reason: String| ServiceError {
            name: name.to_string(),
            reason,
            exited: false,
        };
        let script = repo_root()
            .join("scripts/services")
            .join(format!("{name}.sh"));
        if !script.is_file() {
            return Err(err(format!("no script {}", script.display())));
        }
        let dir = std::env::temp_dir().join(format!(
            "farmap-svc-{name}-{}-{}",
            std::process::id(),
            unique()
        ));
        // A directory of that name is left over from a process that had this pid before (a
        // service shared by a test binary is not stopped, its script is): start afresh, or
        // the servers would find the last run's state (a Redis cluster node its old peers).
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| err(format!("{}: {e}", dir.display())))?;
        let log = dir.join("script.log");
        let stderr =
            std::fs::File::create(&log).map_err(|e| err(format!("{}: {e}", log.display())))?;
        let mut child = Command::new("bash")
            .arg(&script)
            .arg(&dir)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(|e| err(format!("running {}: {e}", script.display())))?;
        let stdout = child.stdout.take().expect("piped");
        // Read the script's lines on a thread so that a hung script hits the deadline.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + START_TIMEOUT;
        let mut vars = HashMap::new();
        let tail = |log: &Path| {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(20)..].join("\n")
        };
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) if line.trim() == "READY" => break,
                Ok(line) => {
                    if let Some((k, v)) = line.split_once('=') {
                        vars.insert(k.trim().to_string(), v.trim().to_string());
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(err(format!(
                        "no READY within {START_TIMEOUT:?}; its log ({}):\n{}",
                        log.display(),
                        tail(&log)
                    )));
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    let status = child.wait().ok();
                    return Err(ServiceError {
                        exited: true,
                        ..err(format!(
                            "the script exited ({status:?}) before READY; its log ({}):\n{}",
                            log.display(),
                            tail(&log)
                        ))
                    });
                }
            }
        }
        Ok(Service {
            name: name.to_string(),
            vars,
            child: Mutex::new(Some(child)),
            dir,
        })
    }

    /// One instance of `name` for the whole test binary, started on first use and stopped
    /// when the process exits (the script watches its parent). Every caller gets the same
    /// instance or the same error.
    pub fn shared(name: &'static str) -> Result<&'static Service, ServiceError> {
        static SHARED: OnceLock<Mutex<HashMap<&'static str, &'static OnceLock<SharedSlot>>>> =
            OnceLock::new();
        let slot: &'static OnceLock<SharedSlot> = {
            let mut map = SHARED
                .get_or_init(Default::default)
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            map.entry(name)
                .or_insert_with(|| Box::leak(Box::new(OnceLock::new())))
        };
        let result =
            slot.get_or_init(|| Service::start(name, &[]).map(|s| &*Box::leak(Box::new(s))));
        match result {
            Ok(s) => Ok(s),
            Err(e) => Err(ServiceError {
                name: e.name.clone(),
                reason: e.reason.clone(),
                exited: e.exited,
            }),
        }
    }

    /// The service's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A value the script printed (`KEY=VALUE`).
    ///
    /// # Panics
    /// If the script did not print `key`: the test and the script disagree.
    pub fn var(&self, key: &str) -> &str {
        self.vars.get(key).map(String::as_str).unwrap_or_else(|| {
            panic!(
                "service {} printed no {key}= (it printed: {:?})",
                self.name,
                self.vars.keys().collect::<Vec<_>>()
            )
        })
    }

    /// Every value the script printed.
    pub fn vars(&self) -> &HashMap<String, String> {
        &self.vars
    }

    /// The service's data directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Stops the service (SIGTERM to the script, which stops its servers) and waits for it.
    pub fn stop(&self) {
        let child = self.child.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(mut child) = child {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let _ = child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

type SharedSlot = Result<&'static Service, ServiceError>;

impl Drop for Service {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A name that no other call in this process gives, nor an earlier run (its pid and the time
/// are in it): `TAG-PID-N-NANOS`, for the regions, prefixes and keys a test makes on a server
/// that other tests, and earlier runs, use too.
pub fn unique_name(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{tag}-{}-{}-{nanos}", std::process::id(), unique())
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}
