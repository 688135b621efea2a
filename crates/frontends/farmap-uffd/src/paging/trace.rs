//! The pager's trace: what happened to each chunk, with the pages of the chunk in the
//! region and in its staging slot after each step. Recorded only when `FARMAP_PAGER_TRACE`
//! is set; read through [`Diagnostics::pager_trace`](crate::Diagnostics::pager_trace).

use farmap_core::ChunkIdx;

use super::Pager;
use crate::uffd::UffdRange;

impl Pager {
    /// Records `what` in chunk `i`'s trace, with the pages it has in the region and in its
    /// staging slot now (only while tracing).
    pub(super) fn tr(&self, i: u64, what: impl FnOnce() -> String) {
        if let Some(t) = &self.trace {
            let (off, len) = self.chunk_span(i);
            let count = |r: &UffdRange| {
                let mut n = 0;
                let mut v = Vec::new();
                let _ =
                    self.pagemap
                        .in_memory(r.base() + off, r.base() + off + len, &mut v, |run| {
                            n += (run.end - run.start) / 4096
                        });
                n
            };
            let line = format!(
                "{} [region {} slot {}]",
                what(),
                count(&self.region),
                count(&self.staging)
            );
            t.lock().push((i, line));
        }
    }

    /// Records an installed chunk (for
    /// [`PushReads::trace_install`](crate::memory::PushReads::trace_install)).
    pub(super) fn trace_install(&self, idx: ChunkIdx, copied: usize, present: usize) {
        self.tr(idx.0, || {
            format!("install copied {copied} present {present}")
        });
    }

    /// The trace of chunk `i` (debugging; `FARMAP_PAGER_TRACE` set).
    pub(crate) fn trace_of(&self, i: u64) -> Vec<String> {
        self.trace
            .as_ref()
            .map(|t| {
                let t = t.lock();
                let pos = t
                    .iter()
                    .rposition(|(c, s)| *c == i && s.starts_with("active-missing"))
                    .unwrap_or(t.len());
                t[..(pos + 1).min(t.len())]
                    .iter()
                    .filter(|(c, _)| *c == i)
                    .map(|(c, s)| format!("{c}: {s}"))
                    .collect()
            })
            .unwrap_or_default()
    }
}
