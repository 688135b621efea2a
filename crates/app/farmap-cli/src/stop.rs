//! How a daemon command (`serve`, `mount`, `swap on`...) learns that it must stop: SIGINT or
//! SIGTERM, listened for from its first step so that a signal that comes while it starts up
//! still stops it cleanly (flushing what was acknowledged) instead of killing it.

use anyhow::Context;

/// Set once SIGINT or SIGTERM has come, after [`listen_for_stop`].
static STOPPED: std::sync::OnceLock<tokio::sync::watch::Receiver<bool>> =
    std::sync::OnceLock::new();

/// Starts listening for SIGINT and SIGTERM (once per process; later calls do nothing). A
/// daemon calls it first thing, so a signal that comes before it reaches [`stop_signal`]
/// (while it opens its store or mounts) still stops it cleanly instead of killing it.
pub fn listen_for_stop() -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    if STOPPED.get().is_some() {
        return Ok(());
    }
    let mut term = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("listening for SIGINT")?;
    let (tx, rx) = tokio::sync::watch::channel(false);
    if STOPPED.set(rx).is_ok() {
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            let _ = tx.send(true);
            // Keep the sender: a closed channel would read as "stopped" forever anyway, but
            // this keeps the value observable by receivers cloned later.
            std::future::pending::<()>().await;
        });
    }
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM, including one that came since [`listen_for_stop`].
pub async fn stop_signal() -> anyhow::Result<()> {
    listen_for_stop()?;
    let mut stopped = STOPPED.get().expect("set by listen_for_stop").clone();
    stopped
        .wait_for(|stopped| *stopped)
        .await
        .context("listening for SIGINT/SIGTERM")?;
    Ok(())
}
