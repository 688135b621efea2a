//! Live migration of a region (the library's `farmap_migrate::seed` and `leech`, what the
//! migration agents of `farmap seed` / `farmap leech` run):
//!
//! - `Region.seed(listen=..., data_listen=..., key_file=None) -> Seeding` starts serving the
//!   region to one leecher (in the background, on the module's runtime);
//! - `farmap.leech(source, mode="precopy", ...) -> (Region, dict)` pulls it here and returns
//!   the new region and the report, once the hand-over is done and every chunk is local;
//! - `Seeding.wait(timeout=None) -> dict` waits for the source side to finish.
//!
//! Both sides prove they hold the same key: without `key_file`, this process's own random key
//! (a migration within one process); with it, the secret in that file (mode 0600, same as
//! `farmap seed --key-file`), for migrations between processes or hosts.
//!
//! The source application must stop writing the source region at the hand-over: the seeder's
//! writer gate closes then, but writes through a memoryview do not pass through it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use farmap::net::auth::Key;
use farmap::net::{ListenAddr, RemoteAddr};
use farmap_migrate::leech::LeechOptions;
use farmap_migrate::seed::SeedOptions;
use farmap_migrate::{Convergence, Mode, WriterGate};
use farmap_migrate::{SeedError, SeedReport};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{Class, Failure, Fallible};
use crate::{blocking, runtime};

fn key(key_file: Option<PathBuf>) -> Fallible<Key> {
    match key_file {
        None => Ok(farmap_migrate::auth::process_key()),
        Some(path) => Key::load(&path).map_err(|e| {
            use farmap::net::auth::KeyError as K;
            let class = match &e {
                K::Missing { .. } => Class::NotFound,
                K::Exposed { .. } => Class::PermissionDenied,
                K::BadLength { .. } | K::BadSecret { .. } => Class::InvalidInput,
                _ => Class::Io,
            };
            Failure::new(class, farmap::error_chain(&e))
        }),
    }
}

fn address<T: std::str::FromStr>(what: &str, s: &str) -> Fallible<T>
where
    T::Err: std::fmt::Display,
{
    s.parse()
        .map_err(|e: T::Err| Failure::new(Class::InvalidInput, format!("{what} {s:?}: {e}")))
}

fn migration_error(e: &(dyn std::error::Error + 'static)) -> Failure {
    Failure::new(Class::Migration, farmap::error_chain(e))
}

/// What a seeding's task returns.
type SeedTask = tokio::task::JoinHandle<Result<SeedReport, SeedError>>;

/// A seeding at work (see the module docs): its addresses, a way to cancel it, and the task
/// that finishes it (awaited by `wait`, which may give up and wait again).
#[pyclass(module = "farmap", name = "Seeding", frozen)]
pub struct Seeding {
    control: String,
    data: String,
    cancel: Box<dyn Fn() + Send + Sync>,
    task: Mutex<Option<SeedTask>>,
}

impl std::fmt::Debug for Seeding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seeding")
            .field("control", &self.control)
            .field("data", &self.data)
            .finish_non_exhaustive()
    }
}

/// Starts seeding `region` (`Region.seed`, see the module docs).
pub fn seed(
    py: Python<'_>,
    region: Arc<farmap::Region>,
    listen: &str,
    data_listen: &str,
    key_file: Option<PathBuf>,
) -> PyResult<Seeding> {
    let listen: ListenAddr = address("listen address", listen)?;
    let data_listen: ListenAddr = address("data address", data_listen)?;
    let key = key(key_file)?;
    let opts = SeedOptions {
        listen,
        data_listen,
        tls: None,
        reconnect_wait: Duration::from_secs(30),
        handshake_timeout: farmap_migrate::seed::HANDSHAKE_TIMEOUT,
        max_handshakes: farmap_migrate::seed::MAX_HANDSHAKES,
        log: false,
        observer: None,
        pull: Default::default(),
        push_budget: farmap_migrate::seed::PUSH_BUDGET,
        key,
    };
    let gate = Arc::new(WriterGate::new(bytes::Bytes::new));
    let seeding = blocking(py, || {
        runtime().block_on(farmap_migrate::seed(region, gate, opts))
    })
    .map_err(|e| migration_error(&e))?;
    let (control, data) = (seeding.control.to_string(), seeding.data.to_string());
    let cancel = Box::new(seeding.canceller());
    let task = runtime().spawn(seeding.finish());
    Ok(Seeding {
        control,
        data,
        cancel,
        task: Mutex::new(Some(task)),
    })
}

#[pymethods]
impl Seeding {
    /// Where leechers connect (`HOST:PORT` or `unix:/path`).
    #[getter]
    fn control(&self) -> &str {
        &self.control
    }

    /// Where the data plane listens.
    #[getter]
    fn data(&self) -> &str {
        &self.data
    }

    /// Abandons the seeding if the hand-over has not happened yet (the source runs on).
    fn cancel(&self) {
        (self.cancel)();
    }

    /// Waits until the region was handed over and released: `{"dirty_sets", "dirty_pages",
    /// "elapsed_s", "mode"}`. With `timeout` (seconds), raises `StoreTimeoutError` when it
    /// is not done by then (the seeding goes on; wait again).
    #[pyo3(signature = (timeout = None))]
    fn wait<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyDict>> {
        let timeout = timeout
            .map(|t| {
                Duration::try_from_secs_f64(t).map_err(|_| {
                    Failure::new(Class::InvalidInput, format!("timeout {t} is not seconds"))
                })
            })
            .transpose()?;
        let Some(mut task) = self.task.lock().take() else {
            return Err(Failure::new(Class::Closed, "this seeding was waited for already").into());
        };
        let (task, done) = blocking(py, || {
            let done = runtime().block_on(async {
                match timeout {
                    Some(t) => tokio::time::timeout(t, &mut task).await.ok(),
                    None => Some((&mut task).await),
                }
            });
            (task, done)
        });
        let Some(done) = done else {
            *self.task.lock() = Some(task);
            return Err(Failure::new(
                Class::Timeout,
                format!("the seeding at {} was not done in time", self.control),
            )
            .into());
        };
        let report = done
            .map_err(|e| migration_error(&e))?
            .map_err(|e| migration_error(&e))?;
        let d = PyDict::new(py);
        d.set_item("dirty_sets", report.dirty_sets)?;
        d.set_item("dirty_pages", report.dirty_pages)?;
        d.set_item("elapsed_s", report.elapsed.as_secs_f64())?;
        d.set_item("mode", report.mode.to_string())?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "<farmap.Seeding control={} data={}>",
            self.control, self.data
        )
    }
}

/// Migrates the region seeded at `source` into this process (`farmap.leech`, see
/// `region::leech`): the new region and the report (`downtime_s`, `total_s`, `rounds`,
/// `bytes_precopy`, `bytes_postcopy`, `mode`).
pub fn leech<'py>(
    py: Python<'py>,
    source: &str,
    mode: &str,
    key_file: Option<PathBuf>,
    max_downtime: f64,
) -> PyResult<(Arc<farmap::Region>, Bound<'py, PyDict>)> {
    let from: RemoteAddr = address("source address", source)?;
    let mode: Mode = mode
        .parse()
        .map_err(|e: String| Failure::new(Class::InvalidInput, e))?;
    let max_downtime = Duration::try_from_secs_f64(max_downtime).map_err(|_| {
        Failure::new(
            Class::InvalidInput,
            format!("max_downtime {max_downtime} is not a duration in seconds"),
        )
    })?;
    let opts = LeechOptions {
        mode,
        convergence: Convergence {
            max_downtime,
            ..Convergence::default()
        },
        key: key(key_file)?,
        ..LeechOptions::new(from)
    };
    let report = blocking(py, || {
        let (_cancel, cancelled) = tokio::sync::watch::channel(false);
        runtime().block_on(farmap_migrate::leech(opts, Box::new(|_, _| {}), cancelled))
    })
    .map_err(|e| migration_error(&e))?;
    let d = PyDict::new(py);
    d.set_item("downtime_s", report.downtime.as_secs_f64())?;
    d.set_item("total_s", report.total.as_secs_f64())?;
    d.set_item("rounds", report.rounds)?;
    d.set_item("bytes_precopy", report.bytes_precopy)?;
    d.set_item("bytes_postcopy", report.bytes_postcopy)?;
    d.set_item("mode", report.mode.to_string())?;
    Ok((report.region, d))
}
