//! `farmap.open_region(spec) -> Region`: a userfaultfd region over a store, whose memory
//! Python reads and writes in place through the buffer protocol: `memoryview(region)`,
//! `region.memoryview()`, `numpy.frombuffer(region, dtype=...)` all wrap the mapping itself.
//!
//! Lifetime contract (what keeps every exported pointer valid):
//! - `__getbuffer__` sets the view's owner to the `Region` object (Python keeps it alive while
//!   the view lives) and counts the export under the read lock of `region`.
//! - `close()` takes the write lock and refuses (`BusyError`) while any export is counted, so
//!   the mapping is unmapped only when no view points into it. `__releasebuffer__` uncounts.
//! - Dropping the object (no view can exist then: each holds a reference) syncs and unmaps.

use std::ffi::{c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use farmap::{Geometry, RegionOptions, StoreSpec};
use parking_lot::RwLock;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyMemoryView};

use crate::errors::{Class, Failure, Fallible};
use crate::store::byte_range;
use crate::{blocking, runtime};

/// A region: memory whose content lives in a store (see the module docs).
#[pyclass(module = "farmap", name = "Region", frozen)]
#[derive(Debug)]
pub struct Region {
    spec: String,
    geometry: Geometry,
    region: RwLock<Option<Arc<farmap::Region>>>,
    exports: AtomicUsize,
}

impl Region {
    /// Wraps an open region (`spec` for messages).
    pub fn wrap(spec: String, region: Arc<farmap::Region>) -> Self {
        Self {
            spec,
            geometry: region.geometry(),
            region: RwLock::new(Some(region)),
            exports: AtomicUsize::new(0),
        }
    }

    /// The region, if it is open.
    pub fn get(&self) -> Fallible<Arc<farmap::Region>> {
        self.region
            .read()
            .clone()
            .ok_or_else(|| self.closed_error())
    }

    fn closed_error(&self) -> Failure {
        Failure::new(
            Class::Closed,
            format!("the region over {} is closed", self.spec),
        )
    }

    /// Takes the region out for closing, unless buffers are exported.
    fn take(&self) -> Fallible<Option<Arc<farmap::Region>>> {
        let mut slot = self.region.write();
        let exports = self.exports.load(Ordering::Acquire);
        if exports > 0 && slot.is_some() {
            return Err(Failure::new(
                Class::Busy,
                format!(
                    "{exports} buffer(s) of the region are still exported (memoryviews or numpy \
                     arrays): release them (del, memoryview.release()) before closing"
                ),
            ));
        }
        Ok(slot.take())
    }
}

/// Parses a mode name.
fn region_options(mode: &str) -> Fallible<RegionOptions> {
    match mode {
        "managed" => Ok(RegionOptions::default()),
        "direct" => Ok(RegionOptions::direct()),
        other => Err(Failure::new(
            Class::InvalidInput,
            format!("unknown region mode {other:?} (known: managed, direct)"),
        )),
    }
}

/// Opens the store `spec` names and maps a region over it. `mode`: `"managed"` (a background
/// pull fills the region) or `"direct"` (each first touch of a chunk fetches it). Raises
/// `UnsupportedError` where userfaultfd cannot be used.
#[pyfunction]
#[pyo3(signature = (spec, mode = "managed"))]
pub fn open_region(py: Python<'_>, spec: &str, mode: &str) -> PyResult<Region> {
    let opts = region_options(mode)?;
    let parsed: StoreSpec = spec.parse().map_err(Failure::from)?;
    let region = blocking(py, || {
        // Remote stores are opened on a runtime: enter ours for the library's blocking open.
        let _rt = runtime().enter();
        farmap::open_region(&parsed, opts)
    })
    .map_err(Failure::from)?;
    Ok(Region::wrap(parsed.to_string(), Arc::new(region)))
}

/// Migrates the region seeded at `source` (`Region.seed` in this or another process) into
/// this process: returns the new region and the report (`downtime_s`, `total_s`, `rounds`,
/// `bytes_precopy`, `bytes_postcopy`, `mode`). `mode`: `"precopy"`, `"postcopy"` or
/// `"instant"`; `max_downtime` in seconds; `key_file`: see `crate::migrate`.
#[pyfunction]
#[pyo3(signature = (source, mode = "precopy", key_file = None, max_downtime = 0.01))]
pub fn leech<'py>(
    py: Python<'py>,
    source: &str,
    mode: &str,
    key_file: Option<std::path::PathBuf>,
    max_downtime: f64,
) -> PyResult<(Region, Bound<'py, PyDict>)> {
    let (region, report) = crate::migrate::leech(py, source, mode, key_file, max_downtime)?;
    let region = Region::wrap(format!("a region migrated from {source}"), region);
    Ok((region, report))
}

/// What userfaultfd offers here: `{"tracking": ..., "poison": ...}`; raises `UnsupportedError`
/// (with the reason) where regions cannot be opened.
#[pyfunction]
pub fn userfaultfd_support(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let support = farmap::region::probe().map_err(Failure::from)?;
    let d = PyDict::new(py);
    d.set_item("tracking", format!("{:?}", support.tracking))?;
    d.set_item("poison", support.poison)?;
    d.set_item("features", support.features)?;
    Ok(d)
}

#[pymethods]
impl Region {
    /// The region's size in bytes.
    #[getter]
    fn size(&self) -> u64 {
        self.geometry.size()
    }

    /// The chunk size in bytes.
    #[getter]
    fn chunk_size(&self) -> u32 {
        self.geometry.chunk_size()
    }

    /// Whether the region is closed.
    #[getter]
    fn closed(&self) -> bool {
        self.region.read().is_none()
    }

    /// How many buffers (memoryviews, numpy arrays) point into the region now.
    #[getter]
    fn exports(&self) -> usize {
        self.exports.load(Ordering::Acquire)
    }

    /// The mapping's address (for ctypes and debugging).
    #[getter]
    fn address(&self) -> PyResult<usize> {
        Ok(self.get()?.as_ptr() as usize)
    }

    /// A writable memoryview of the whole region (no copy).
    fn memoryview<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyMemoryView>> {
        PyMemoryView::from(slf.as_any())
    }

    /// A copy of `length` bytes at `offset` (fetching what is missing).
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: i64,
        length: i64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (offset, len) = byte_range(self.geometry, offset, length)?;
        let region = self.get()?;
        let data = blocking(py, || {
            let mut buf = vec![0u8; len as usize];
            region
                .memory()
                .read_into(offset as usize, &mut buf)
                .map(|()| buf)
        })
        .map_err(|e| Failure::from(farmap::RegionError::from(e)))?;
        Ok(PyBytes::new(py, &data))
    }

    /// Writes `data` at `offset` (tracked and pushed like any write).
    fn write(&self, py: Python<'_>, offset: i64, data: &[u8]) -> PyResult<()> {
        let (offset, _) = byte_range(self.geometry, offset, data.len() as i64)?;
        let region = self.get()?;
        blocking(py, || region.memory().write_from(offset as usize, data))
            .map_err(|e| Failure::from(farmap::RegionError::from(e)))?;
        Ok(())
    }

    /// Pushes every chunk written so far to the store and flushes it.
    fn sync(&self, py: Python<'_>) -> PyResult<()> {
        let region = self.get()?;
        blocking(py, || region.sync()).map_err(Failure::from)?;
        Ok(())
    }

    /// Same as `sync()`.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        self.sync(py)
    }

    /// Starts seeding this region to one leecher (a live migration): returns at once;
    /// `Seeding.control` is the address `farmap.leech` connects to.
    #[pyo3(signature = (listen = "127.0.0.1:0", data_listen = "127.0.0.1:0", key_file = None))]
    fn seed(
        &self,
        py: Python<'_>,
        listen: &str,
        data_listen: &str,
        key_file: Option<std::path::PathBuf>,
    ) -> PyResult<crate::migrate::Seeding> {
        crate::migrate::seed(py, self.get()?, listen, data_listen, key_file)
    }

    /// Counters: faults, chunks fetched, bytes fetched, chunks present, tracking in use.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.get()?.stats();
        let d = PyDict::new(py);
        d.set_item("tracking", format!("{:?}", s.tracking))?;
        d.set_item("faults", s.faults)?;
        d.set_item("chunks_fetched", s.chunks_fetched)?;
        d.set_item("bytes_fetched", s.bytes_fetched)?;
        d.set_item("present_chunks", s.present_chunks)?;
        Ok(d)
    }

    /// Syncs, then unmaps the region. Raises `BusyError` (and changes nothing) while buffers
    /// are exported. Closing twice does nothing.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let Some(region) = self.take()? else {
            return Ok(());
        };
        let result = blocking(py, || match Arc::try_unwrap(region) {
            Ok(region) => region.close(),
            // A migration still holds it: sync; it is unmapped when the migration lets go.
            Err(shared) => shared.sync(),
        });
        result.map_err(Failure::from)?;
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Closes the region. When the block raised and buffers are still exported (the
    /// traceback's frames may hold the arrays), the region stays open and the block's own
    /// exception goes on, rather than a `BusyError` that would hide it; the region is synced
    /// and unmapped when the last reference goes.
    fn __exit__(
        &self,
        py: Python<'_>,
        ty: Option<Bound<'_, PyAny>>,
        _value: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        if ty.is_some() && self.exports.load(Ordering::Acquire) > 0 {
            return Ok(false);
        }
        self.close(py)?;
        Ok(false)
    }

    fn __len__(&self) -> usize {
        self.geometry.size() as usize
    }

    fn __repr__(&self) -> String {
        format!(
            "<farmap.Region over {} ({}){}>",
            self.spec,
            self.geometry,
            if self.closed() { ", closed" } else { "" }
        )
    }

    /// The buffer protocol: a writable, one-dimensional buffer of unsigned bytes over the
    /// whole mapping.
    ///
    /// # Safety
    ///
    /// Called by Python with `view` pointing at a `Py_buffer` to fill (or null).
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("no buffer view to fill"));
        }
        let this = slf.get();
        // The read lock orders this export against `close` (which counts under the write
        // lock): the mapping cannot go away between the check and the count.
        let guard = this.region.read();
        let Some(region) = guard.as_ref() else {
            return Err(this.closed_error().into());
        };
        let (buf, len) = (region.as_ptr(), region.len());
        let len = isize::try_from(len)
            .map_err(|_| PyBufferError::new_err("the region is too large for a buffer"))?;
        this.exports.fetch_add(1, Ordering::AcqRel);
        drop(guard);
        // SAFETY: `view` is non-null and Python hands us a `Py_buffer` to fill. `buf` points
        // at `len` bytes mapped for as long as the region is open; the view holds a strong
        // reference to `slf` (its `obj`) and the export is counted, and `close` refuses while
        // the count is not zero, so the mapping outlives the view. Writers through the
        // buffer race with nothing in Rust that assumes exclusive access: the region's memory
        // is only ever accessed with volatile copies on the Rust side (RegionSlice).
        unsafe {
            (*view).obj = slf.into_any().into_ptr();
            (*view).buf = buf.cast::<c_void>();
            (*view).len = len;
            (*view).readonly = 0;
            (*view).itemsize = 1;
            (*view).format = if flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT {
                // A static string: nothing to free in __releasebuffer__.
                c"B".as_ptr().cast_mut()
            } else {
                ptr::null_mut()
            };
            (*view).ndim = 1;
            (*view).shape = if flags & ffi::PyBUF_ND == ffi::PyBUF_ND {
                &raw mut (*view).len
            } else {
                ptr::null_mut()
            };
            (*view).strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
                &raw mut (*view).itemsize
            } else {
                ptr::null_mut()
            };
            (*view).suboffsets = ptr::null_mut();
            (*view).internal = ptr::null_mut();
        }
        Ok(())
    }

    /// Ends an export made by `__getbuffer__`.
    ///
    /// # Safety
    ///
    /// Called by Python once per successful `__getbuffer__`, with its view.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        self.exports.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for Region {
    /// A region dropped without `close()` is synced (best effort) and unmapped; no buffer can
    /// point into it then (each holds a reference to this object).
    fn drop(&mut self) {
        if let Some(region) = self.region.get_mut().take() {
            if let Ok(region) = Arc::try_unwrap(region) {
                if let Err(e) = region.close() {
                    tracing::warn!("closing a dropped region: {}", farmap::error_chain(&e));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use farmap::RegionMode;

    #[test]
    fn modes_are_managed_or_direct() {
        assert!(matches!(
            region_options("managed").unwrap().mode,
            RegionMode::Managed(_)
        ));
        assert!(matches!(
            region_options("direct").unwrap().mode,
            RegionMode::Direct
        ));
        let e = region_options("Direct").unwrap_err();
        assert_eq!(e.class, Class::InvalidInput);
        assert!(e.message.contains("managed, direct"), "{}", e.message);
    }
}
