//! `farmap.open_store(spec) -> Store`: chunks and byte ranges of any store a spec names.
//!
//! Byte ranges go through the pipeline's `Unaligned` stage (a range cut into the chunks it
//! covers, partial chunks read, modified and written back under a per-chunk lock); chunk
//! calls go through the same stage so that both kinds of writer share its locks.

use std::sync::Arc;

use bytes::Bytes;
use farmap::pipeline::Unaligned;
use farmap::Store as _;
use farmap::{ChunkIdx, Geometry, StoreSpec};
use parking_lot::RwLock;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{Class, Failure, Fallible};
use crate::{blocking, runtime};

/// The store behind a `Store`: byte ranges and chunks through one `Unaligned` stage.
type Ranges = Arc<Unaligned<Arc<dyn farmap::Store>>>;

/// An open store. Close it (or use `with`) to flush and release it.
#[pyclass(module = "farmap", name = "Store", frozen)]
#[derive(Debug)]
pub struct Store {
    spec: String,
    geometry: Geometry,
    store: RwLock<Option<Ranges>>,
}

/// Parses `spec` (a [`StoreSpec`]) and opens its store on the module's runtime.
pub fn open_spec(spec: &str) -> Fallible<(StoreSpec, Arc<dyn farmap::Store>)> {
    let parsed: StoreSpec = spec.parse()?;
    let store = runtime().block_on(farmap::open_store_async(&parsed))?;
    Ok((parsed, store))
}

/// Opens the store `spec` names (`memory:64MiB`, `file:./disk.img?size=1GiB`,
/// `dir:./chunks?size=1GiB&chunk=1MiB`, `redis://...`, ...).
#[pyfunction]
pub fn open_store(py: Python<'_>, spec: &str) -> PyResult<Store> {
    let (parsed, store) = blocking(py, || open_spec(spec))?;
    Ok(Store {
        spec: parsed.to_string(),
        geometry: store.geometry(),
        store: RwLock::new(Some(Arc::new(Unaligned::new(store)))),
    })
}

/// Checks a chunk index given by Python (negative or past the end: out of range).
pub fn chunk_index(geometry: Geometry, index: i64) -> Fallible<ChunkIdx> {
    match u64::try_from(index) {
        Ok(i) if i < geometry.chunk_count() => Ok(ChunkIdx(i)),
        _ => Err(Failure::new(
            Class::OutOfRange,
            format!(
                "chunk {index} is outside the region (chunks 0 to {})",
                geometry.chunk_count() - 1
            ),
        )),
    }
}

/// Checks a byte range given by Python (`offset`, `len`) against `geometry`.
pub fn byte_range(geometry: Geometry, offset: i64, len: i64) -> Fallible<(u64, u64)> {
    let size = geometry.size();
    match (u64::try_from(offset), u64::try_from(len)) {
        (Ok(o), Ok(l)) if o.checked_add(l).is_some_and(|end| end <= size) => Ok((o, l)),
        _ => Err(Failure::new(
            Class::OutOfRange,
            format!("{len} bytes at {offset} are outside the region of {size} bytes"),
        )),
    }
}

impl Store {
    fn get(&self) -> Fallible<Ranges> {
        self.store.read().clone().ok_or_else(|| {
            Failure::new(Class::Closed, format!("the store {} is closed", self.spec))
        })
    }
}

#[pymethods]
impl Store {
    /// The spec the store was opened with (secrets hidden).
    #[getter]
    fn spec(&self) -> &str {
        &self.spec
    }

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

    /// The number of chunks.
    #[getter]
    fn chunk_count(&self) -> u64 {
        self.geometry.chunk_count()
    }

    /// Whether the store is closed.
    #[getter]
    fn closed(&self) -> bool {
        self.store.read().is_none()
    }

    /// Reads chunk `index` (missing chunks read as zeros).
    fn read_chunk<'py>(&self, py: Python<'py>, index: i64) -> PyResult<Bound<'py, PyBytes>> {
        let idx = chunk_index(self.geometry, index)?;
        let store = self.get()?;
        let data: Bytes =
            blocking(py, || runtime().block_on(store.read(idx))).map_err(Failure::from)?;
        Ok(PyBytes::new(py, &data))
    }

    /// Writes chunk `index` whole: `data` must be exactly the chunk's length.
    fn write_chunk(&self, py: Python<'_>, index: i64, data: &[u8]) -> PyResult<()> {
        let idx = chunk_index(self.geometry, index)?;
        let want = self.geometry.chunk_len(idx);
        if data.len() != want {
            return Err(Failure::new(
                Class::InvalidInput,
                format!("chunk {index} is {want} bytes; {} given", data.len()),
            )
            .into());
        }
        let store = self.get()?;
        let data = Bytes::copy_from_slice(data);
        blocking(py, || runtime().block_on(store.write(idx, data))).map_err(Failure::from)?;
        Ok(())
    }

    /// Reads `length` bytes at `offset` (any offset and length inside the region).
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: i64,
        length: i64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (offset, len) = byte_range(self.geometry, offset, length)?;
        let store = self.get()?;
        let data = blocking(py, || {
            runtime().block_on(store.read_bytes(offset, len as usize))
        })
        .map_err(Failure::from)?;
        Ok(PyBytes::new(py, &data))
    }

    /// Writes `data` at `offset`: chunks covered in part are read, changed and written back.
    fn write(&self, py: Python<'_>, offset: i64, data: &[u8]) -> PyResult<()> {
        let (offset, _) = byte_range(self.geometry, offset, data.len() as i64)?;
        let store = self.get()?;
        let data = Bytes::copy_from_slice(data);
        blocking(py, || runtime().block_on(store.write_bytes(offset, data)))
            .map_err(Failure::from)?;
        Ok(())
    }

    /// Makes what was written durable (file and dir stores: synced to disk).
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let store = self.get()?;
        blocking(py, || runtime().block_on(store.flush())).map_err(Failure::from)?;
        Ok(())
    }

    /// Flushes and closes the store (closing twice does nothing). Calls after it raise
    /// `ClosedError`.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let Some(store) = self.store.write().take() else {
            return Ok(());
        };
        blocking(py, || runtime().block_on(store.flush())).map_err(Failure::from)?;
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _ty: Option<Bound<'_, PyAny>>,
        _value: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "<farmap.Store {} ({}){}>",
            self.spec,
            self.geometry,
            if self.closed() { ", closed" } else { "" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g() -> Geometry {
        Geometry::new(10 * 4096, 4096).unwrap()
    }

    #[test]
    fn chunk_indexes_outside_the_region_are_refused() {
        assert_eq!(chunk_index(g(), 0).unwrap(), ChunkIdx(0));
        assert_eq!(chunk_index(g(), 9).unwrap(), ChunkIdx(9));
        for bad in [-1, 10, i64::MAX, i64::MIN] {
            assert_eq!(chunk_index(g(), bad).unwrap_err().class, Class::OutOfRange);
        }
    }

    #[test]
    fn byte_ranges_must_end_inside_the_region() {
        assert_eq!(byte_range(g(), 0, 40960).unwrap(), (0, 40960));
        assert_eq!(byte_range(g(), 40960, 0).unwrap(), (40960, 0));
        for (o, l) in [
            (-1, 1),
            (0, -1),
            (40960, 1),
            (1, 40960),
            (i64::MAX, i64::MAX),
        ] {
            assert_eq!(byte_range(g(), o, l).unwrap_err().class, Class::OutOfRange);
        }
    }
}
