//! What the runners report as they go: progress lines for people, pre-copy progress, and the
//! point of no return. A controller (`farmap seed` / `farmap leech`, through the
//! [`agent`](crate::agent)) shows them; `log` options log them through `tracing` as well
//! (the CLI's subscriber prints them).

use std::fmt;
use std::sync::Arc;

/// One thing a runner reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A progress line for people.
    Note(String),
    /// Pre-copy progress at the destination: bytes pulled of the region's.
    Pulled {
        /// Bytes pulled so far.
        bytes: u64,
        /// The region's size.
        total: u64,
    },
    /// The hand-over happened: the source stays suspended for good and the destination
    /// resumes. From here on the migration is finished, never abandoned.
    HandedOver,
}

/// Receives a runner's [`Event`]s. Called on the runner's tasks: it must not block.
#[derive(Clone)]
pub struct Observer(Arc<dyn Fn(&Event) + Send + Sync>);

impl Observer {
    /// An observer calling `f` for every event.
    pub fn new(f: impl Fn(&Event) + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }
}

impl fmt::Debug for Observer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Observer")
    }
}

/// Where a runner's events go: stderr lines with a prefix (if `log`), and an observer.
#[derive(Debug, Clone)]
pub(crate) struct Reporter {
    pub(crate) prefix: &'static str,
    pub(crate) log: bool,
    pub(crate) observer: Option<Observer>,
}

impl Reporter {
    pub(crate) fn emit(&self, e: Event) {
        if self.log {
            if let Event::Note(s) = &e {
                tracing::info!(target: "farmap_migrate", "{}: {s}", self.prefix);
            }
        }
        if let Some(o) = &self.observer {
            (o.0)(&e);
        }
    }

    pub(crate) fn note(&self, s: impl Into<String>) {
        self.emit(Event::Note(s.into()));
    }
}
