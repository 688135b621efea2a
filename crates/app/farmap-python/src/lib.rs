//! farmap for Python: the native module `farmap._native`, which the pure-Python package
//! `farmap` (python/farmap) re-exports. Built with maturin (`pip install ./python`); the API
//! and its exceptions are documented in docs/python.md.
//!
//! - [`store`]: `open_store(spec)`: chunks and byte ranges of any store.
//! - [`region`]: `open_region(spec)`: a userfaultfd region whose memory Python sees through
//!   the buffer protocol (`memoryview(region)`, `numpy.frombuffer(region, ...)`), without a copy.
//! - [`mount`]: `mount(spec, dir)`: a store as one file on a FUSE mount; `Mount.unmount()`.
//! - [`migrate`]: what `Region.seed(...)` and `leech(...)` run: live migration of a region.
//! - [`errors`]: `farmap.FarmapError` and its subclasses, from the library's error kinds.
//!
//! Every call that may wait (I/O, faults, a migration) releases the GIL
//! (`Python::detach`) and runs on the module's tokio runtime ([`runtime`]), so other Python
//! threads run meanwhile.
//!
//! The buffer protocol is the one `unsafe` part: it hands Python a raw pointer to the
//! region's mapping (see `region.rs` for the contract that keeps the mapping alive while a
//! buffer is exported).

pub mod errors;
pub mod migrate;
pub mod mount;
pub mod region;
pub mod store;

use std::sync::OnceLock;

use pyo3::prelude::*;

/// The runtime that runs the stores' futures (2 workers: stores do their waiting there, the
/// callers block on them with the GIL released).
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("farmap-python")
            .enable_all()
            .build()
            .expect("starting farmap's tokio runtime")
    })
}

/// Runs `f` with the GIL released: the blocking part of every call.
pub fn blocking<T: Send, F: FnOnce() -> T + Send>(py: Python<'_>, f: F) -> T {
    py.detach(f)
}

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<store::Store>()?;
    m.add_class::<region::Region>()?;
    m.add_class::<mount::Mount>()?;
    m.add_class::<migrate::Seeding>()?;
    m.add_function(wrap_pyfunction!(store::open_store, m)?)?;
    m.add_function(wrap_pyfunction!(region::open_region, m)?)?;
    m.add_function(wrap_pyfunction!(region::userfaultfd_support, m)?)?;
    m.add_function(wrap_pyfunction!(mount::mount, m)?)?;
    m.add_function(wrap_pyfunction!(region::leech, m)?)?;
    m.add("DEFAULT_CHUNK_SIZE", farmap::DEFAULT_CHUNK_SIZE)?;
    Ok(())
}
