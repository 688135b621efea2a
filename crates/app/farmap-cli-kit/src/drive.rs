//! Driving a live migration through an application's migration agent, with its progress on
//! stderr: what `farmap seed`, `farmap leech` and `farmap demo` share.

use anyhow::{bail, Context};
use farmap_migrate::agent::{Controller, FailKind, Reply, Request};
use serde_json::{Map, Value};

use crate::output;
use crate::status;

/// Opens an instant migration's shared store from its spec, as any farmap command opens a
/// store (for applications' agents).
pub fn shared_opener() -> farmap_migrate::SharedOpener {
    farmap_migrate::SharedOpener(std::sync::Arc::new(|spec: String| {
        Box::pin(async move {
            // A parsed spec is not `Send`: it is opened on a blocking thread.
            tokio::task::spawn_blocking(move || {
                let parsed: farmap::StoreSpec = spec
                    .parse()
                    .map_err(|e| format!("the shared store's spec {spec:?}: {e}"))?;
                let store = farmap::spec::open_store_blocking(&parsed).map_err(|e| {
                    format!("opening the shared store: {:#}", anyhow::Error::new(e))
                })?;
                Ok::<_, farmap_migrate::EndpointError>(store)
            })
            .await?
        })
    }))
}

/// How a driven migration ended.
#[derive(Debug)]
pub enum Outcome {
    /// Finished, with the agent's metrics.
    Done(Map<String, Value>),
    /// Ended without success.
    Failed(FailKind, String),
}

/// What the driver shows.
#[derive(Debug)]
pub struct Ui {
    /// Prefix of progress lines (`farmap seed`).
    pub prefix: &'static str,
    /// Print progress lines on stderr.
    pub notes: bool,
    /// Show a byte progress bar for pre-copy (`Pulled` events).
    pub bar: bool,
}

/// Sends `request` to the agent at `app` and follows it to its end; with `on_listening`
/// called for a seeder's addresses. Ctrl-C cancels before the hand-over.
pub async fn drive(
    app: &std::path::Path,
    request: Request,
    ui: Ui,
    mut on_listening: impl FnMut(&str, &str),
) -> anyhow::Result<Outcome> {
    let mut c = Controller::connect(app).await?;
    c.send(&request).await.context("sending the request")?;
    let mut bar: Option<indicatif::ProgressBar> = None;
    let note = |bar: &Option<indicatif::ProgressBar>, s: &str| {
        if !ui.notes {
            return;
        }
        let line = format!("{}: {s}", ui.prefix);
        match bar {
            Some(b) if !b.is_hidden() => b.suspend(|| status!("{line}")),
            _ => status!("{line}"),
        }
    };
    let mut handed_over = false;
    let mut interrupts = 0;
    loop {
        let reply = tokio::select! {
            r = c.next() => r.context("reading from the agent")?,
            _ = tokio::signal::ctrl_c() => {
                interrupts += 1;
                if interrupts > 1 {
                    bail!("interrupted; the agent carries on with what it was doing");
                }
                if handed_over {
                    note(&bar, "the hand-over is done: the migration finishes (it cannot be undone); Ctrl-C again stops watching");
                } else {
                    note(&bar, "cancelling: the source keeps running");
                    c.send(&Request::Cancel).await.context("asking the agent to cancel")?;
                }
                continue;
            }
        };
        let Some(reply) = reply else {
            bail!("the agent closed the connection without a result (did the application exit?)");
        };
        match reply {
            Reply::Note { msg } => note(&bar, &msg),
            Reply::Listening { control, data } => {
                note(
                    &bar,
                    &format!("waiting for a leecher: control on {control}, data plane on {data}"),
                );
                on_listening(&control, &data);
            }
            Reply::Pulled { bytes, total } => {
                if ui.bar {
                    bar.get_or_insert_with(|| output::byte_bar(total, "pre-copy", false))
                        .set_position(bytes);
                }
            }
            Reply::HandedOver => {
                handed_over = true;
                if let Some(b) = bar.take() {
                    b.finish_and_clear();
                }
                note(&bar, "handed over");
            }
            Reply::Paging(_) => {
                bail!("the agent answered a migration request with a paging report")
            }
            Reply::Done { report } => {
                if let Some(b) = bar.take() {
                    b.finish_and_clear();
                }
                return Ok(Outcome::Done(report));
            }
            Reply::Error { kind, message } => {
                if let Some(b) = bar.take() {
                    b.finish_and_clear();
                }
                return Ok(Outcome::Failed(kind, message));
            }
        }
    }
}
