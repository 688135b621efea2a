//! [`Metered`]: a store that counts what passes through it into the process's metrics
//! (calls, chunks and bytes, errors by kind, a latency histogram per operation).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, MemoryBase, Store,
    StoreResult,
};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// The operations counted, in the order of [`Meters::ops`].
#[derive(Debug, Clone, Copy)]
enum Op {
    Read,
    ReadPart,
    ReadChunks,
    Write,
    Flush,
    Trim,
    Status,
    Prefetch,
    CatchUp,
    TakeOver,
}

impl Op {
    const ALL: [Op; 10] = [
        Op::Read,
        Op::ReadPart,
        Op::ReadChunks,
        Op::Write,
        Op::Flush,
        Op::Trim,
        Op::Status,
        Op::Prefetch,
        Op::CatchUp,
        Op::TakeOver,
    ];

    fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::ReadPart => "read_part",
            Op::ReadChunks => "read_chunks",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Trim => "trim",
            Op::Status => "status",
            Op::Prefetch => "prefetch",
            Op::CatchUp => "catch_up",
            Op::TakeOver => "take_over",
        }
    }
}

/// A store's labels: its role in the command (`served`, `store`...) and its kind (the
/// spec's scheme: never the spec itself, which may hold a password).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StoreLabels {
    pub(crate) store: String,
    pub(crate) kind: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    store: String,
    kind: String,
    op: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    store: String,
    kind: String,
    op: &'static str,
    error: &'static str,
}

type Seconds = Family<OpLabels, Histogram, fn() -> Histogram>;

/// Latency buckets: 25 µs (a local page) to about 4 s (a slow remote), ×2.5 each.
fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(25e-6, 2.5, 14))
}

/// The metric families every metered store of a process adds to.
#[derive(Debug, Clone)]
pub(crate) struct StoreFamilies {
    calls: Family<OpLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    seconds: Seconds,
    read_bytes: Family<StoreLabels, Counter>,
    written_bytes: Family<StoreLabels, Counter>,
    read_chunks: Family<StoreLabels, Counter>,
    written_chunks: Family<StoreLabels, Counter>,
    trimmed_chunks: Family<StoreLabels, Counter>,
}

impl StoreFamilies {
    /// The families, registered in `registry`.
    pub(crate) fn register(registry: &mut Registry) -> StoreFamilies {
        let f = StoreFamilies {
            calls: Family::default(),
            errors: Family::default(),
            seconds: Family::new_with_constructor(seconds_histogram),
            read_bytes: Family::default(),
            written_bytes: Family::default(),
            read_chunks: Family::default(),
            written_chunks: Family::default(),
            trimmed_chunks: Family::default(),
        };
        let r = registry;
        r.register(
            "farmap_store_operations",
            "Store operations finished, by operation (failed ones too)",
            f.calls.clone(),
        );
        r.register(
            "farmap_store_errors",
            "Store operations that failed, by operation and kind of error",
            f.errors.clone(),
        );
        r.register(
            "farmap_store_operation_duration_seconds",
            "How long store operations took, by operation",
            f.seconds.clone(),
        );
        r.register(
            "farmap_store_read_bytes",
            "Bytes read from the store (whole chunks, parts, runs)",
            f.read_bytes.clone(),
        );
        r.register(
            "farmap_store_written_bytes",
            "Bytes written to the store",
            f.written_bytes.clone(),
        );
        r.register(
            "farmap_store_read_chunks",
            "Whole chunks read from the store",
            f.read_chunks.clone(),
        );
        r.register(
            "farmap_store_written_chunks",
            "Chunks written to the store",
            f.written_chunks.clone(),
        );
        r.register(
            "farmap_store_trimmed_chunks",
            "Chunks trimmed (made to read as zeros) in the store",
            f.trimmed_chunks.clone(),
        );
        f
    }

    /// The meters of one store, labelled `labels`.
    fn meters(&self, labels: &StoreLabels) -> Meters {
        let op = |op: Op| OpLabels {
            store: labels.store.clone(),
            kind: labels.kind.clone(),
            op: op.name(),
        };
        Meters {
            ops: Op::ALL.map(|o| OpMeters {
                calls: self.calls.get_or_create_owned(&op(o)),
                seconds: self.seconds.get_or_create_owned(&op(o)),
            }),
            errors: self.errors.clone(),
            labels: labels.clone(),
            read_bytes: self.read_bytes.get_or_create_owned(labels),
            written_bytes: self.written_bytes.get_or_create_owned(labels),
            read_chunks: self.read_chunks.get_or_create_owned(labels),
            written_chunks: self.written_chunks.get_or_create_owned(labels),
            trimmed_chunks: self.trimmed_chunks.get_or_create_owned(labels),
        }
    }
}

#[derive(Debug)]
struct OpMeters {
    calls: Counter,
    seconds: Histogram,
}

/// One store's meters, looked up once: an operation touches only its own atomics (and its
/// histogram's lock), never a family's map.
#[derive(Debug)]
struct Meters {
    ops: [OpMeters; Op::ALL.len()],
    errors: Family<ErrorLabels, Counter>,
    labels: StoreLabels,
    read_bytes: Counter,
    written_bytes: Counter,
    read_chunks: Counter,
    written_chunks: Counter,
    trimmed_chunks: Counter,
}

/// The label value of an error kind (`not_found`...).
fn error_label(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::Io => "io",
        ErrorKind::NotFound => "not_found",
        ErrorKind::OutOfRange => "out_of_range",
        ErrorKind::InvalidInput => "invalid_input",
        ErrorKind::Timeout => "timeout",
        ErrorKind::Unavailable => "unavailable",
        ErrorKind::Corrupt => "corrupt",
        ErrorKind::Closed => "closed",
        ErrorKind::ReadOnly => "read_only",
        ErrorKind::Unsupported => "unsupported",
        ErrorKind::PermissionDenied => "permission_denied",
        ErrorKind::NoSpace => "no_space",
        ErrorKind::Cancelled => "cancelled",
        ErrorKind::Fenced => "fenced",
        _ => "other",
    }
}

/// A store that counts the operations passing through it into the process's metrics.
///
/// - Every operation, the hints too, is forwarded to the inner store unchanged, at once.
/// - An operation is counted when it finishes (one whose future is dropped first is not);
///   bytes and chunks only when it succeeds. Counters are atomics; each operation's
///   histogram has a lock of its own, held for one observation.
#[derive(Debug)]
pub struct Metered {
    inner: Arc<dyn Store>,
    m: Meters,
}

impl Metered {
    pub(crate) fn new(
        inner: Arc<dyn Store>,
        families: &StoreFamilies,
        labels: &StoreLabels,
    ) -> Self {
        Metered {
            inner,
            m: families.meters(labels),
        }
    }

    /// Counts `op`, started at `start`, with its result.
    fn done<T>(&self, op: Op, start: Instant, result: &StoreResult<T>) {
        let meters = &self.m.ops[op as usize];
        meters.calls.inc();
        meters.seconds.observe(start.elapsed().as_secs_f64());
        if let Err(e) = result {
            let labels = ErrorLabels {
                store: self.m.labels.store.clone(),
                kind: self.m.labels.kind.clone(),
                op: op.name(),
                error: error_label(e.kind()),
            };
            self.m.errors.get_or_create(&labels).inc();
        }
    }

    fn read_some(&self, bytes: usize, chunks: u64) {
        self.m.read_bytes.inc_by(bytes as u64);
        self.m.read_chunks.inc_by(chunks);
    }
}

impl Store for Metered {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }

    fn caps(&self) -> Caps {
        self.inner.caps()
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            let start = Instant::now();
            let r = self.inner.read(idx).await;
            if let Ok(data) = &r {
                self.read_some(data.len(), 1);
            }
            self.done(Op::Read, start, &r);
            r
        })
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let start = Instant::now();
            let len = data.len() as u64;
            let r = self.inner.write(idx, data).await;
            if r.is_ok() {
                self.m.written_bytes.inc_by(len);
                self.m.written_chunks.inc();
            }
            self.done(Op::Write, start, &r);
            r
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let start = Instant::now();
            let r = self.inner.flush().await;
            self.done(Op::Flush, start, &r);
            r
        })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let start = Instant::now();
            let r = self.inner.trim(range).await;
            if r.is_ok() {
                self.m.trimmed_chunks.inc_by(range.len());
            }
            self.done(Op::Trim, start, &r);
            r
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            let start = Instant::now();
            let r = self.inner.status(idx).await;
            self.done(Op::Status, start, &r);
            r
        })
    }

    fn read_part(
        &self,
        idx: ChunkIdx,
        offset: usize,
        len: usize,
    ) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            let start = Instant::now();
            let r = self.inner.read_part(idx, offset, len).await;
            if let Ok(data) = &r {
                self.read_some(data.len(), 0);
            }
            self.done(Op::ReadPart, start, &r);
            r
        })
    }

    fn prefetch(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let start = Instant::now();
            let r = self.inner.prefetch(idx).await;
            self.done(Op::Prefetch, start, &r);
            r
        })
    }

    fn chunks_per_read(&self) -> u32 {
        self.inner.chunks_per_read()
    }

    fn read_chunks(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<Vec<Bytes>>> {
        Box::pin(async move {
            let start = Instant::now();
            let r = self.inner.read_chunks(range).await;
            if let Ok(chunks) = &r {
                let bytes = chunks.iter().map(Bytes::len).sum();
                self.read_some(bytes, chunks.len() as u64);
            }
            self.done(Op::ReadChunks, start, &r);
            r
        })
    }

    fn catch_up(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let start = Instant::now();
            let r = self.inner.catch_up().await;
            self.done(Op::CatchUp, start, &r);
            r
        })
    }

    fn take_over(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let start = Instant::now();
            let r = self.inner.take_over().await;
            self.done(Op::TakeOver, start, &r);
            r
        })
    }

    fn memory_base(&self) -> BoxFuture<'_, StoreResult<Option<Arc<dyn MemoryBase>>>> {
        self.inner.memory_base()
    }

    fn working_set(&self) -> Option<Arc<[ChunkIdx]>> {
        self.inner.working_set()
    }

    fn reports_touches(&self) {
        self.inner.reports_touches()
    }

    fn touched(&self, idx: ChunkIdx) {
        self.inner.touched(idx)
    }
}
