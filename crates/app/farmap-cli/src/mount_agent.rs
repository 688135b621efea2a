//! `farmap mount ... --agent SOCKET`: the migration agent inside the mount's process, so that
//! `farmap seed --app SOCKET` / `farmap leech --app SOCKET` move the file to a mount on
//! another host while programs keep using it (design: docs/mount-migration.md).
//!
//! The source is `farmap mount DIR STORE --agent S`; the destination `farmap mount DIR2
//! --agent S2` with no store: it mounts DIR2 when a migration arrives (requests wait until
//! the hand-over) and serves the file from then on.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use farmap::Store;
use farmap_fuse::{Access, FuseMount, MountOptions};
use farmap_migrate::agent::{self, App};
use farmap_migrate::mount::{After, MountDest, MountShared, MountSource, SuspendHow};
use farmap_migrate::{LeechReport, Opener, Resumer, SeedReport, Source, Suspend};
use parking_lot::Mutex;
use serde_json::{json, Map, Value};
use tokio::sync::Notify;

use crate::stop::stop_signal;

/// The mount this process serves (none yet at a destination), shared with the agent.
#[derive(Default)]
struct Slot {
    mount: Mutex<Option<FuseMount>>,
    changed: Notify,
}

/// Times of the last arrival: when the source suspended its programs and when this mount
/// opened (CLOCK_MONOTONIC ns).
#[derive(Default, Clone, Copy)]
struct Arrival {
    suspended_ns: u64,
    opened_ns: u64,
}

struct MountApp {
    dir: PathBuf,
    opts: MountOptions,
    how: SuspendHow,
    after: After,
    slot: Arc<Slot>,
    arrival: Arc<Mutex<Arrival>>,
    /// The source's store, when another host can open it (instant migrations).
    shared: Option<MountShared>,
}

impl App for MountApp {
    type Dest = MountDest;

    fn region(&self) -> Option<(Arc<dyn Source>, Arc<dyn Suspend>)> {
        let slot = self.slot.mount.lock();
        let m = slot.as_ref()?;
        if m.control().access() != Access::Open {
            return None;
        }
        let src = Arc::new(
            MountSource::new(
                m.path().to_path_buf(),
                m.store().clone(),
                m.control().clone(),
                self.how.clone(),
                self.after.clone(),
            )
            .with_shared(self.shared.clone()),
        );
        Some((src.clone(), src))
    }

    /// A mounted file is not a userfaultfd region: its local memory is bounded by the
    /// mount's own cache options, not through the agent.
    fn uffd_region(&self) -> Option<Arc<farmap_uffd::Region>> {
        None
    }

    fn shared_opener(&self) -> Option<farmap_migrate::SharedOpener> {
        Some(farmap_cli_kit::drive::shared_opener())
    }

    /// The store this mount was started over, when another host can open it.
    fn approved_shared(&self) -> Vec<String> {
        self.shared.iter().map(|s| s.spec.clone()).collect()
    }

    fn released(&self, _report: &SeedReport) {
        tracing::info!(
            "the file moved to the destination: this mount now refuses reads (EIO) and writes \
             (EROFS)"
        );
    }

    fn opener(&self) -> Opener<MountDest> {
        let (dir, opts, slot) = (self.dir.clone(), self.opts.clone(), self.slot.clone());
        Box::new(move |store, ctx| {
            Box::pin(async move {
                let dest = MountDest::new(store, &ctx);
                let served: Arc<dyn Store> = Arc::new(dest.clone());
                // A mount left by an abandoned migration (never opened) is replaced.
                let stale = {
                    let mut s = slot.mount.lock();
                    match s.as_ref().map(|m| m.control().access()) {
                        Some(Access::Held) => s.take(),
                        Some(_) => return Err("this process already serves a file".into()),
                        None => None,
                    }
                };
                let opts = MountOptions {
                    access: Access::Held,
                    ..opts
                };
                let mount = tokio::task::spawn_blocking(move || {
                    if let Some(m) = stale {
                        let _ = m.unmount();
                    }
                    FuseMount::mount(served, &dir, opts)
                })
                .await??;
                *slot.mount.lock() = Some(mount);
                slot.changed.notify_waiters();
                Ok(Arc::new(dest))
            })
        })
    }

    fn resumer(&self) -> Resumer<MountDest> {
        let (slot, arrival) = (self.slot.clone(), self.arrival.clone());
        Box::new(move |_dest, state| {
            if let Some(m) = slot.mount.lock().as_ref() {
                m.control().open();
            }
            let opened_ns = farmap_migrate::monotonic_ns();
            let suspended_ns = <[u8; 8]>::try_from(&state[..])
                .map(u64::from_le_bytes)
                .unwrap_or(0);
            *arrival.lock() = Arrival {
                suspended_ns,
                opened_ns,
            };
        })
    }

    fn arrived(&self, _report: &LeechReport<MountDest>) -> Map<String, Value> {
        let a = *self.arrival.lock();
        let mut m = Map::new();
        if let Some(path) = self.slot.mount.lock().as_ref().map(|m| m.path().to_owned()) {
            m.insert("path".into(), json!(path));
        }
        // The programs' freeze: from their suspension at the source to this mount opening
        // (the same clock: both on one host), when the source said when.
        if a.suspended_ns != 0 && a.opened_ns >= a.suspended_ns {
            let ms = (a.opened_ns - a.suspended_ns) as f64 / 1e6;
            m.insert("app_freeze_ms".into(), json!((ms * 100.0).round() / 100.0));
        }
        m
    }
}

/// What `farmap mount --agent` was given.
pub struct AgentMount {
    pub socket: PathBuf,
    pub dir: PathBuf,
    pub opts: MountOptions,
    pub how: SuspendHow,
    pub after: After,
    /// The mount at the source (none at a destination).
    pub mount: Option<FuseMount>,
    /// The source's store, when another host can open it (instant migrations).
    pub shared: Option<MountShared>,
}

/// Serves the agent (and the mount, once there is one) until SIGINT/SIGTERM or an unmount;
/// then unmounts, flushing.
pub async fn run(a: AgentMount) -> anyhow::Result<ExitCode> {
    let slot = Arc::new(Slot::default());
    let source = a.mount.is_some();
    *slot.mount.lock() = a.mount;
    let app = Arc::new(MountApp {
        dir: a.dir.clone(),
        opts: a.opts,
        how: a.how,
        after: a.after,
        slot: slot.clone(),
        arrival: Default::default(),
        shared: a.shared,
    });
    let agent = agent::serve(&a.socket, app)
        .await
        .with_context(|| format!("starting the migration agent on {}", a.socket.display()))?;
    status!(
        "farmap mount: migration agent on {} ({})",
        a.socket.display(),
        if source {
            "farmap seed --app moves this file away"
        } else {
            "waiting for a file: farmap leech --app brings one here"
        }
    );
    let by_signal = loop {
        let ended = slot.mount.lock().as_ref().map(|m| m.ended());
        let changed = slot.changed.notified();
        tokio::select! {
            r = stop_signal() => { r?; break true }
            _ = async { match ended { Some(e) => e.await, None => std::future::pending().await } } => break false,
            _ = changed => continue,
        }
    };
    drop(agent);
    let Some(mount) = slot.mount.lock().take() else {
        return Ok(ExitCode::SUCCESS);
    };
    let dir = mount.dir().to_path_buf();
    if by_signal {
        status!("farmap mount: flushing and unmounting {}", dir.display());
    }
    let retired = mount.control().access() == Access::Retired;
    let unmounted = tokio::task::spawn_blocking(move || mount.unmount()).await?;
    match unmounted {
        // A mount whose file moved away refuses the last write-back: nothing is lost.
        Err(e) if retired => {
            tracing::debug!("unmounting the retired mount: {e}");
        }
        r => r.context("unmounting")?,
    }
    status!("farmap mount: unmounted");
    Ok(ExitCode::SUCCESS)
}
