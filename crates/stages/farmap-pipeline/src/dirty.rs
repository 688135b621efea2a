//! [`DirtySet`]: a lock-free bitmap of chunks written since they were last taken.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use farmap_core::{ChunkIdx, ChunkRange};

/// A set of chunk indices, one bit per chunk in `AtomicU64` words, shared by
/// [`Tracked`](crate::tracked::Tracked), [`Pusher`](crate::pusher::Pusher) and frontends that
/// track writes themselves.
///
/// # Concurrency
/// - Every method takes `&self` and never blocks; any number of markers and takers may run
///   at once.
/// - Each mark is seen by exactly one take: [`take`](Self::take) clears a word with one atomic
///   swap, so a bit set concurrently is either returned by this take or left for the next.
/// - A take *acquires* what a mark *released*: whatever the marker wrote before marking (the
///   chunk's data, in an inner store) is visible to the taker after it sees the bit. Mark a
///   chunk only after its write has completed.
/// - [`count`](Self::count) is exact when no mark or take runs; while they run it may count
///   a chunk being marked a moment early (never late, never below the true count of bits set
///   by completed marks that no take has cleared).
pub struct DirtySet {
    words: Box<[AtomicU64]>,
    chunks: u64,
    count: AtomicU64,
}

impl DirtySet {
    /// An empty set over chunks `0..chunks`.
    pub fn new(chunks: u64) -> Self {
        let words = usize::try_from(chunks.div_ceil(64)).expect("chunk count fits usize");
        Self {
            words: (0..words).map(|_| AtomicU64::new(0)).collect(),
            chunks,
            count: AtomicU64::new(0),
        }
    }

    /// Number of chunks the set covers.
    pub fn capacity(&self) -> u64 {
        self.chunks
    }

    fn locate(&self, idx: ChunkIdx) -> (usize, u64) {
        assert!(
            idx.0 < self.chunks,
            "{idx} is outside a dirty set of {} chunks",
            self.chunks
        );
        ((idx.0 / 64) as usize, 1u64 << (idx.0 % 64))
    }

    /// Marks `idx`; returns whether it was clean before.
    ///
    /// # Panics
    /// If `idx` is outside the set.
    pub fn mark(&self, idx: ChunkIdx) -> bool {
        let (w, bit) = self.locate(idx);
        // Count first, so that a take that clears the bit always subtracts after this add.
        self.count.fetch_add(1, Ordering::Relaxed);
        let before = self.words[w].fetch_or(bit, Ordering::AcqRel);
        let fresh = before & bit == 0;
        if !fresh {
            self.count.fetch_sub(1, Ordering::Relaxed);
        }
        fresh
    }

    /// Marks every chunk of `range`.
    ///
    /// # Panics
    /// If the range reaches past the set.
    pub fn mark_range(&self, range: ChunkRange) {
        if range.is_empty() {
            return;
        }
        assert!(
            range.end.0 <= self.chunks,
            "{range} reaches past a dirty set of {} chunks",
            self.chunks
        );
        let mut i = range.start.0;
        while i < range.end.0 {
            let w = (i / 64) as usize;
            let lo = i % 64;
            let hi = (range.end.0 - (i - lo)).min(64);
            let mask = if hi - lo == 64 {
                u64::MAX
            } else {
                ((1u64 << (hi - lo)) - 1) << lo
            };
            self.count
                .fetch_add(u64::from(mask.count_ones()), Ordering::Relaxed);
            let before = self.words[w].fetch_or(mask, Ordering::AcqRel);
            let already = before & mask;
            if already != 0 {
                self.count
                    .fetch_sub(u64::from(already.count_ones()), Ordering::Relaxed);
            }
            i += hi - lo;
        }
    }

    /// Unmarks `idx`; returns whether it was marked.
    ///
    /// # Panics
    /// If `idx` is outside the set.
    pub fn clear(&self, idx: ChunkIdx) -> bool {
        let (w, bit) = self.locate(idx);
        let before = self.words[w].fetch_and(!bit, Ordering::AcqRel);
        let was = before & bit != 0;
        if was {
            self.count.fetch_sub(1, Ordering::Relaxed);
        }
        was
    }

    /// Whether `idx` is marked.
    ///
    /// # Panics
    /// If `idx` is outside the set.
    pub fn is_dirty(&self, idx: ChunkIdx) -> bool {
        let (w, bit) = self.locate(idx);
        self.words[w].load(Ordering::Acquire) & bit != 0
    }

    /// Number of marked chunks (see the type's concurrency notes).
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Whether no chunk is marked.
    pub fn is_empty(&self) -> bool {
        self.count() == 0
    }

    /// Removes and returns every marked chunk, in ascending order.
    pub fn take(&self) -> Vec<ChunkIdx> {
        let mut out = Vec::new();
        self.take_into(&mut out);
        out
    }

    /// Removes every marked chunk and appends it to `out`, in ascending order; returns how many
    /// were appended. Reusing `out` avoids an allocation per round.
    pub fn take_into(&self, out: &mut Vec<ChunkIdx>) -> usize {
        let before = out.len();
        for (w, word) in self.words.iter().enumerate() {
            // A plain load first: most words of a large region are clean, and a swap would
            // claim their cache lines for writing.
            if word.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut bits = word.swap(0, Ordering::AcqRel);
            if bits == 0 {
                continue;
            }
            self.count
                .fetch_sub(u64::from(bits.count_ones()), Ordering::Relaxed);
            let base = w as u64 * 64;
            while bits != 0 {
                out.push(ChunkIdx(base + u64::from(bits.trailing_zeros())));
                bits &= bits - 1;
            }
        }
        out.len() - before
    }
}

impl fmt::Debug for DirtySet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DirtySet")
            .field("chunks", &self.chunks)
            .field("dirty", &self.count())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::sync::Arc;

    #[test]
    fn mark_take_count() {
        let d = DirtySet::new(200);
        assert!(d.is_empty());
        assert!(d.mark(ChunkIdx(3)));
        assert!(!d.mark(ChunkIdx(3)), "a second mark is not fresh");
        assert!(d.mark(ChunkIdx(199)));
        assert!(d.mark(ChunkIdx(64)));
        assert_eq!(d.count(), 3);
        assert!(d.is_dirty(ChunkIdx(64)));
        assert!(!d.is_dirty(ChunkIdx(65)));
        assert_eq!(d.take(), vec![ChunkIdx(3), ChunkIdx(64), ChunkIdx(199)]);
        assert_eq!(d.count(), 0);
        assert!(d.take().is_empty());
        assert!(!d.is_dirty(ChunkIdx(3)));
    }

    #[test]
    fn mark_range_matches_single_marks() {
        for (start, end) in [
            (0, 0),
            (0, 1),
            (5, 64),
            (63, 65),
            (0, 200),
            (64, 128),
            (70, 199),
        ] {
            let d = DirtySet::new(200);
            d.mark(ChunkIdx(100));
            d.mark_range(ChunkRange::new(ChunkIdx(start), ChunkIdx(end)));
            let mut want: BTreeSet<u64> = (start..end).collect();
            want.insert(100);
            assert_eq!(d.count(), want.len() as u64, "count after {start}..{end}");
            let got: Vec<u64> = d.take().into_iter().map(|c| c.0).collect();
            assert_eq!(got, want.into_iter().collect::<Vec<_>>(), "{start}..{end}");
        }
    }

    #[test]
    #[should_panic(expected = "outside a dirty set")]
    fn out_of_range_mark_panics() {
        DirtySet::new(10).mark(ChunkIdx(10));
    }

    #[test]
    fn every_mark_is_taken_exactly_once() {
        // Markers mark (chunk, round) pairs by marking a chunk and recording the round in a
        // log; a taker concurrently takes. Every chunk marked at least once after the last
        // take that returned it must be returned by a later take: we check that the union of
        // takes covers every marked chunk, and that no take returns an unmarked chunk.
        const CHUNKS: u64 = 1000;
        let d = Arc::new(DirtySet::new(CHUNKS));
        let marked: Arc<Vec<AtomicU64>> =
            Arc::new((0..CHUNKS).map(|_| AtomicU64::new(0)).collect());
        let markers: Vec<_> = (0..3)
            .map(|t| {
                let d = d.clone();
                let marked = marked.clone();
                std::thread::spawn(move || {
                    for i in 0..20_000u64 {
                        let c = (i * 7919 + t * 13) % CHUNKS;
                        marked[c as usize].fetch_add(1, Ordering::SeqCst);
                        d.mark(ChunkIdx(c));
                    }
                })
            })
            .collect();
        let taken: Vec<AtomicU64> = (0..CHUNKS).map(|_| AtomicU64::new(0)).collect();
        let mut rounds = 0;
        while markers.iter().any(|m| !m.is_finished()) || rounds == 0 {
            for c in d.take() {
                taken[c.as_usize()].fetch_add(1, Ordering::SeqCst);
            }
            rounds += 1;
        }
        for m in markers {
            m.join().unwrap();
        }
        for c in d.take() {
            taken[c.as_usize()].fetch_add(1, Ordering::SeqCst);
        }
        assert_eq!(d.count(), 0, "the count returns to zero");
        for c in 0..CHUNKS as usize {
            let m = marked[c].load(Ordering::SeqCst);
            let t = taken[c].load(Ordering::SeqCst);
            assert!(t <= m, "chunk {c} taken {t} times but marked only {m}");
            assert_eq!(t > 0, m > 0, "chunk {c}: marked {m} times, taken {t} times");
        }
    }
}
