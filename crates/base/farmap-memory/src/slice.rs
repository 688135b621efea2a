//! [`RegionSlice`]: a view of live region memory that only allows volatile accesses.
//!
//! Region memory is shared with threads that Rust cannot see (the application's other threads,
//! farmap's push threads, the kernel filling missing pages and discarding pages on request),
//! so no `&[u8]` or `&mut [u8]` into it may exist in safe code: the compiler would be allowed
//! to assume that the bytes do not change under a shared reference, or that nobody else reads
//! them under a unique one. Like vm-memory's `VolatileSlice`, a [`RegionSlice`] is a pointer
//! and a length that is only ever read and written with volatile accesses, which the compiler
//! neither elides, merges nor invents. Every access is bounds-checked and fails with a
//! [`SliceError`] rather than touching memory outside the slice.
//!
//! Bytes written concurrently by another thread may be read torn (some bytes old, some new),
//! as with any shared memory; aligned 8-byte accesses ([`RegionSlice::load_u64`],
//! [`RegionSlice::store_u64`]) are single instructions and never torn on the 64-bit targets
//! farmap supports.
//!
//! Only the owners of mappings make a [`RegionSlice`] out of a raw pointer ([`SharedMapping`]
//! here, a userfaultfd region's own mapping in `farmap-uffd`), for as long as it stays mapped.
//!
//! [`SharedMapping`]: crate::SharedMapping

use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;

/// Why an access through a [`RegionSlice`] was refused (nothing was read or written).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SliceError {
    /// The range asked for does not lie inside the slice.
    #[error("{len} bytes at offset {offset} reach past the end of a slice of {size} bytes")]
    OutOfRange {
        /// Offset of the access.
        offset: usize,
        /// Length of the access.
        len: usize,
        /// Length of the slice.
        size: usize,
    },
    /// A word access at an address that is not a multiple of the word's size.
    #[error("an access of {align} bytes at offset {offset} is not aligned")]
    Misaligned {
        /// Offset of the access.
        offset: usize,
        /// The alignment it needs.
        align: usize,
    },
}

/// A bounds-checked window into region memory, accessed only with volatile reads and writes.
///
/// It borrows the region (lifetime `'a`), which stays mapped while the borrow lives. It is
/// `Copy`, `Send` and `Sync`: sharing it between threads is what region memory is for, and
/// every access is a volatile copy whose result under a concurrent write is old or new bytes,
/// never undefined behaviour in this process's Rust code.
#[derive(Clone, Copy)]
pub struct RegionSlice<'a> {
    ptr: NonNull<u8>,
    len: usize,
    _region: PhantomData<&'a [u8]>,
}

// SAFETY: a RegionSlice is a pointer into memory that is designed to be shared between
// threads; every access through it is a volatile copy (no reference is ever formed), so moving
// or sharing the value between threads cannot create a data race on Rust-owned data.
unsafe impl Send for RegionSlice<'_> {}
// SAFETY: as for Send: `&RegionSlice` only allows the same volatile accesses.
unsafe impl Sync for RegionSlice<'_> {}

/// Word size of the copy loops.
const WORD: usize = std::mem::size_of::<u64>();

impl<'a> RegionSlice<'a> {
    /// A slice of `len` bytes at `ptr`.
    ///
    /// # Safety
    /// For all of `'a`, `ptr..ptr+len` must stay mapped readable and writable memory (its
    /// pages may be missing and filled by a userfaultfd handler of another thread or process,
    /// or discarded and filled again), and no Rust reference (`&`/`&mut`) to any of its bytes
    /// may be used while the slice is used: region memory is only accessed volatilely or
    /// through raw pointers by code that accepts concurrent changes.
    pub unsafe fn new(ptr: NonNull<u8>, len: usize) -> RegionSlice<'a> {
        RegionSlice {
            ptr,
            len,
            _region: PhantomData,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slice has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte, for raw accesses (atomics, system calls) by code that keeps the
    /// contract of [`RegionSlice::new`]. Dereferencing it is `unsafe`.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The slice as plain bytes. Prefer the volatile accessors, which need no `unsafe`.
    ///
    /// # Safety
    /// While the returned slice lives, nothing may change these bytes: no write through any
    /// `RegionSlice` (a region's `memory()` or `write_at`), raw pointers or another thread,
    /// and no discard of its pages (a region's `discard_pages`: discarded pages read as
    /// refetched content). farmap itself meanwhile only fills missing pages (a read of a
    /// missing page waits for its fill, so no read sees it change), reads pages to push them,
    /// and changes their write protection: none of that changes a byte the slice can observe.
    pub unsafe fn as_slice(&self) -> &'a [u8] {
        // SAFETY: mapped and readable for `'a` (`new`'s contract); the caller guarantees that
        // no byte changes while the reference lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The slice as plain mutable bytes; writes are tracked and pushed like any other. Prefer
    /// the volatile accessors, which need no `unsafe`.
    ///
    /// # Safety
    /// While the returned slice lives, no other code may read or write these bytes (through
    /// this or any other `RegionSlice`, raw pointers, another thread, or a discard), except
    /// farmap's own push threads, which read written pages with volatile loads while the
    /// application writes them: the caller accepts that a push may copy a write half done (the
    /// write is reported by the next scan and pushed again).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &'a mut [u8] {
        // SAFETY: mapped and writable for `'a` (`new`'s contract); the caller guarantees that
        // this is the only access to these bytes while the reference lives (but for farmap's
        // volatile push reads, which it accepts).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Checks that `offset..offset+len` lies in the slice.
    fn check(&self, offset: usize, len: usize) -> Result<(), SliceError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(SliceError::OutOfRange {
                offset,
                len,
                size: self.len,
            }),
        }
    }

    /// Checks an aligned word access of `align` bytes at `offset`.
    fn check_word(&self, offset: usize, align: usize) -> Result<(), SliceError> {
        self.check(offset, align)?;
        if !(self.ptr.as_ptr() as usize)
            .wrapping_add(offset)
            .is_multiple_of(align)
        {
            return Err(SliceError::Misaligned { offset, align });
        }
        Ok(())
    }

    /// The `len` bytes at `offset`, as a slice of the same memory.
    pub fn subslice(&self, offset: usize, len: usize) -> Result<RegionSlice<'a>, SliceError> {
        self.check(offset, len)?;
        Ok(RegionSlice {
            // SAFETY: `offset <= self.len` (checked), so the result stays inside (or one past
            // the end of) the slice's memory and is not null.
            ptr: unsafe { self.ptr.add(offset) },
            len,
            _region: PhantomData,
        })
    }

    /// Splits the slice in two at `mid`.
    pub fn split_at(&self, mid: usize) -> Result<(RegionSlice<'a>, RegionSlice<'a>), SliceError> {
        Ok((self.subslice(0, mid)?, self.subslice(mid, self.len - mid)?))
    }

    /// Copies `dst.len()` bytes at `offset` into `dst` with volatile loads (8 bytes at a time
    /// where aligned). Bytes another thread writes meanwhile may be copied old or new.
    pub fn read_into(&self, offset: usize, dst: &mut [u8]) -> Result<(), SliceError> {
        self.check(offset, dst.len())?;
        // SAFETY: the source range lies in the slice (checked), readable for `'a` by
        // `new`'s contract; `dst` is an exclusive Rust buffer, which cannot overlap region
        // memory (no reference into it exists, `new`'s contract).
        unsafe { copy_from_volatile(self.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// A copy of the `len` bytes at `offset`, as [`read_into`](Self::read_into) makes it,
    /// into a new vector that is not zeroed first (a buffer filled once, not twice).
    pub fn read_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>, SliceError> {
        self.check(offset, len)?;
        let mut v = Vec::with_capacity(len);
        // SAFETY: the source range lies in the slice (checked), readable for `'a` by
        // `new`'s contract; the vector's spare capacity (at least `len` bytes, a fresh
        // allocation) is writable and cannot overlap region memory. Every one of the `len`
        // bytes is written before the length is set.
        unsafe {
            copy_from_volatile(self.ptr.as_ptr().add(offset), v.as_mut_ptr(), len);
            v.set_len(len);
        }
        Ok(v)
    }

    /// Copies `src` to `offset` with volatile stores (8 bytes at a time where aligned).
    pub fn write_from(&self, offset: usize, src: &[u8]) -> Result<(), SliceError> {
        self.check(offset, src.len())?;
        // SAFETY: the destination range lies in the slice (checked), writable for `'a` by
        // `new`'s contract; `src` is a Rust buffer, which cannot overlap region memory.
        unsafe { copy_to_volatile(src, self.ptr.as_ptr().add(offset)) };
        Ok(())
    }

    /// Sets `len` bytes at `offset` to `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<(), SliceError> {
        self.check(offset, len)?;
        let chunk = [byte; 256];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(chunk.len());
            self.write_from(offset + done, &chunk[..n])?;
            done += n;
        }
        Ok(())
    }

    /// A copy of the whole slice.
    pub fn to_vec(&self) -> Vec<u8> {
        self.read_vec(0, self.len)
            .expect("the whole slice is in range")
    }

    /// The byte at `offset` (a volatile load).
    pub fn load_u8(&self, offset: usize) -> Result<u8, SliceError> {
        self.check(offset, 1)?;
        // SAFETY: the byte lies in the slice (checked), readable for `'a` (`new`'s contract).
        Ok(unsafe { self.ptr.as_ptr().add(offset).read_volatile() })
    }

    /// Stores `v` at `offset` (a volatile store).
    pub fn store_u8(&self, offset: usize, v: u8) -> Result<(), SliceError> {
        self.check(offset, 1)?;
        // SAFETY: the byte lies in the slice (checked), writable for `'a` (`new`'s contract).
        unsafe { self.ptr.as_ptr().add(offset).write_volatile(v) };
        Ok(())
    }

    /// The native-endian `u64` at `offset`, which must be 8-byte aligned (one volatile load,
    /// never torn).
    pub fn load_u64(&self, offset: usize) -> Result<u64, SliceError> {
        self.check_word(offset, WORD)?;
        // SAFETY: the word lies in the slice and is aligned (checked), readable for `'a`.
        Ok(unsafe { self.ptr.as_ptr().add(offset).cast::<u64>().read_volatile() })
    }

    /// Stores the native-endian `v` at `offset`, which must be 8-byte aligned (one volatile
    /// store, never torn).
    pub fn store_u64(&self, offset: usize, v: u64) -> Result<(), SliceError> {
        self.check_word(offset, WORD)?;
        // SAFETY: the word lies in the slice and is aligned (checked), writable for `'a`.
        unsafe {
            self.ptr
                .as_ptr()
                .add(offset)
                .cast::<u64>()
                .write_volatile(v)
        };
        Ok(())
    }
}

impl fmt::Debug for RegionSlice<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionSlice")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

/// Copies of at least this many bytes go through [`bulk_copy`] where it has a fast path.
const BULK: usize = 512;

/// Copies `len` bytes from `src` to `dst` with one `rep movsb` (x86-64; `false` elsewhere,
/// copying nothing). The instruction is opaque to the compiler, like a volatile access: it
/// cannot assume the bytes stay as they are, or split, merge or elide the accesses; bytes
/// another thread writes meanwhile are copied old or new. On CPUs with fast string moves
/// (ERMS) it copies at `memcpy`'s speed, where the volatile word loops below are slower
/// (measured here, copying 512 MiB out with `read_vec`, median of 3: 4 KiB pieces 22.7
/// against 18.7 GB/s, 64 KiB 18.8 against 12.0, 4 MiB 18.3 against 15.6).
///
/// # Safety
/// `src..src+len` must be readable, `dst..dst+len` writable, and the two must not overlap.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
unsafe fn bulk_copy(src: *const u8, dst: *mut u8, len: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the caller's contract: `len` bytes readable at `src` and writable at
        // `dst`, not overlapping. The direction flag is clear at every function boundary
        // (the System V ABI), so the copy goes forwards; the registers it changes are
        // declared as clobbered.
        unsafe {
            std::arch::asm!(
                "rep movsb",
                inout("rcx") len => _,
                inout("rsi") src => _,
                inout("rdi") dst => _,
                options(nostack, preserves_flags)
            );
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Copies `len` bytes from `src` to `d`: volatile byte loads up to the first 8-byte
/// boundary of `src`, then volatile word loads (four per round), then volatile byte loads
/// for the tail. The stores to `d` are plain (unaligned) ones, so `d` may be uninitialized.
///
/// # Safety
/// `src..src+len` must be readable, `d..d+len` writable, and the two must not overlap.
unsafe fn copy_from_volatile(src: *const u8, d: *mut u8, len: usize) {
    if len >= BULK {
        // SAFETY: the caller's contract, which is `bulk_copy`'s.
        if unsafe { bulk_copy(src, d, len) } {
            return;
        }
    }
    let head = src.align_offset(WORD).min(len);
    let mut i = 0;
    while i < head {
        // SAFETY: `i < head <= len`: the byte lies in the readable source (the caller's
        // contract) and in the destination.
        unsafe { d.add(i).write(src.add(i).read_volatile()) };
        i += 1;
    }
    while i + 4 * WORD <= len {
        // SAFETY: `i + 32 <= len`: the four words lie in the readable source and in the destination;
        // `src + i` is 8-byte aligned (past the head), the `dst` stores are unaligned ones.
        unsafe {
            let p = src.add(i).cast::<u64>();
            let q = d.add(i).cast::<u64>();
            let (a, b, c, e) = (
                p.read_volatile(),
                p.add(1).read_volatile(),
                p.add(2).read_volatile(),
                p.add(3).read_volatile(),
            );
            q.write_unaligned(a);
            q.add(1).write_unaligned(b);
            q.add(2).write_unaligned(c);
            q.add(3).write_unaligned(e);
        }
        i += 4 * WORD;
    }
    while i + WORD <= len {
        // SAFETY: `i + 8 <= len`: the word lies in the source and in the destination; `src + i` is
        // aligned (past the head), the `dst` store is an unaligned one.
        unsafe {
            let w = src.add(i).cast::<u64>().read_volatile();
            d.add(i).cast::<u64>().write_unaligned(w);
        }
        i += WORD;
    }
    while i < len {
        // SAFETY: `i < len`: the byte lies in the readable source and in the destination.
        unsafe { d.add(i).write(src.add(i).read_volatile()) };
        i += 1;
    }
}

/// Copies `src` to `dst` with volatile stores, word-sized where `dst` is aligned; the loads
/// from `src` are plain (unaligned) ones.
///
/// # Safety
/// `dst..dst+src.len()` must be writable, and must not overlap `src`.
unsafe fn copy_to_volatile(src: &[u8], dst: *mut u8) {
    let len = src.len();
    let s = src.as_ptr();
    if len >= BULK {
        // SAFETY: the caller's contract, which is `bulk_copy`'s.
        if unsafe { bulk_copy(s, dst, len) } {
            return;
        }
    }
    let head = dst.align_offset(WORD).min(len);
    let mut i = 0;
    while i < head {
        // SAFETY: `i < head <= len`: the byte lies in the writable destination (the
        // caller's contract) and in `src`.
        unsafe { dst.add(i).write_volatile(s.add(i).read()) };
        i += 1;
    }
    while i + 4 * WORD <= len {
        // SAFETY: `i + 32 <= len`: the four words lie in the writable destination and in
        // `src`; `dst + i` is 8-byte aligned (past the head), the `src` loads are unaligned.
        unsafe {
            let p = s.add(i).cast::<u64>();
            let q = dst.add(i).cast::<u64>();
            let (a, b, c, e) = (
                p.read_unaligned(),
                p.add(1).read_unaligned(),
                p.add(2).read_unaligned(),
                p.add(3).read_unaligned(),
            );
            q.write_volatile(a);
            q.add(1).write_volatile(b);
            q.add(2).write_volatile(c);
            q.add(3).write_volatile(e);
        }
        i += 4 * WORD;
    }
    while i + WORD <= len {
        // SAFETY: `i + 8 <= len`: the word lies in the destination and in `src`; `dst + i`
        // is aligned (past the head), the `src` load is an unaligned one.
        unsafe {
            let w = s.add(i).cast::<u64>().read_unaligned();
            dst.add(i).cast::<u64>().write_volatile(w);
        }
        i += WORD;
    }
    while i < len {
        // SAFETY: `i < len`: the byte lies in the writable destination and in `src`.
        unsafe { dst.add(i).write_volatile(s.add(i).read()) };
        i += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slice over a heap buffer that no reference touches while the slice is used.
    fn with_buffer(len: usize, f: impl FnOnce(RegionSlice<'_>)) {
        let mut buf = vec![0u64; len.div_ceil(8) + 1];
        let ptr = NonNull::new(buf.as_mut_ptr().cast::<u8>()).unwrap();
        // SAFETY: `buf` outlives the slice (dropped after `f` returns) and is only accessed
        // through it while `f` runs.
        f(unsafe { RegionSlice::new(ptr, len) });
        drop(buf);
    }

    #[test]
    fn out_of_range_accesses_are_refused_and_touch_nothing() {
        with_buffer(100, |s| {
            let oob = |offset, len| SliceError::OutOfRange {
                offset,
                len,
                size: 100,
            };
            assert_eq!(s.read_into(90, &mut [0; 11]), Err(oob(90, 11)));
            assert_eq!(s.read_vec(90, 11), Err(oob(90, 11)));
            assert_eq!(s.read_vec(usize::MAX, 2), Err(oob(usize::MAX, 2)));
            assert_eq!(s.write_from(100, &[1]), Err(oob(100, 1)));
            assert_eq!(s.write_from(usize::MAX, &[1, 2]), Err(oob(usize::MAX, 2)));
            assert_eq!(s.load_u8(100), Err(oob(100, 1)));
            assert_eq!(s.store_u8(100, 1), Err(oob(100, 1)));
            assert_eq!(s.load_u64(96), Err(oob(96, 8)));
            assert_eq!(s.fill(50, 51, 7), Err(oob(50, 51)));
            assert!(s.subslice(101, 0).is_err());
            assert!(s.subslice(50, 51).is_err());
            assert!(s.split_at(101).is_err());
            assert_eq!(s.to_vec(), vec![0; 100], "a refused access wrote something");
            // The edges themselves are fine.
            s.write_from(99, &[5]).unwrap();
            assert_eq!(s.load_u8(99), Ok(5));
            assert!(s.read_into(100, &mut []).is_ok());
            let tail = s.subslice(96, 4).unwrap();
            assert_eq!(tail.len(), 4);
            assert!(tail.read_into(1, &mut [0; 4]).is_err());
        });
    }

    #[test]
    fn misaligned_words_are_refused() {
        with_buffer(64, |s| {
            assert_eq!(
                s.load_u64(3),
                Err(SliceError::Misaligned {
                    offset: 3,
                    align: 8
                })
            );
            assert!(s.store_u64(12, 1).is_err());
            s.store_u64(16, 0x0102_0304_0506_0708).unwrap();
            assert_eq!(s.load_u64(16), Ok(0x0102_0304_0506_0708));
            let sub = s.subslice(1, 40).unwrap();
            assert!(sub.load_u64(0).is_err(), "alignment is of the address");
            assert_eq!(sub.load_u64(15), Ok(0x0102_0304_0506_0708));
        });
    }

    #[test]
    fn bulk_copies_match_a_plain_model_at_every_alignment() {
        let len = 3 * BULK + 77;
        with_buffer(len, |s| {
            let mut model = vec![0u8; len];
            for (round, (off, n)) in [(0, len), (1, BULK), (7, BULK + 9), (BULK - 3, 2 * BULK)]
                .into_iter()
                .enumerate()
            {
                let data: Vec<u8> = (0..n).map(|i| (i * 7 + round) as u8).collect();
                s.write_from(off, &data).unwrap();
                model[off..off + n].copy_from_slice(&data);
                assert_eq!(s.read_vec(off, n).unwrap(), data);
                let mut back = vec![0u8; n + 3];
                s.read_into(off, &mut back[3..]).unwrap();
                assert_eq!(back[3..], data[..]);
                assert_eq!(
                    back[..3],
                    [0, 0, 0],
                    "the copy wrote outside its destination"
                );
            }
            assert_eq!(s.to_vec(), model);
        });
    }

    #[test]
    fn copies_match_a_plain_model_at_every_alignment() {
        let len = 300;
        with_buffer(len, |s| {
            let mut model = vec![0u8; len];
            let mut seed = 7u32;
            for round in 0..400 {
                seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
                let off = (seed >> 8) as usize % len;
                let n = (seed >> 20) as usize % (len - off + 1);
                let data: Vec<u8> = (0..n).map(|i| (i + round) as u8).collect();
                s.write_from(off, &data).unwrap();
                model[off..off + n].copy_from_slice(&data);
                let mut back = vec![0u8; n];
                s.read_into(off, &mut back).unwrap();
                assert_eq!(back, data);
                // The unzeroed copy: every byte at every alignment and length.
                let start = (seed >> 4) as usize % len;
                let m = (seed >> 12) as usize % (len - start + 1);
                assert_eq!(s.read_vec(start, m).unwrap(), model[start..start + m]);
            }
            assert_eq!(s.to_vec(), model);
            s.fill(3, 250, 0xAB).unwrap();
            model[3..253].fill(0xAB);
            assert_eq!(s.to_vec(), model);
        });
    }
}
