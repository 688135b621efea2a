//! `farmap.mount(spec, dir) -> Mount`: the store as one file on a FUSE mount (the library's
//! `farmap_fuse::FuseMount`, what `farmap mount DIR STORE` serves), served by threads of this
//! process until `Mount.unmount()`. Needs root (or a `fusermount3` the user may run) and
//! `/dev/fuse`.

use std::path::PathBuf;

use parking_lot::Mutex;
use pyo3::prelude::*;

use crate::blocking;
use crate::errors::{Class, Failure};
use crate::store::open_spec;

/// A mounted store: the file `path` inside the mount point `dir`.
#[pyclass(module = "farmap", name = "Mount", frozen)]
#[derive(Debug)]
pub struct Mount {
    spec: String,
    dir: PathBuf,
    path: PathBuf,
    size: u64,
    mount: Mutex<Option<farmap_fuse::FuseMount>>,
}

/// Mounts the store `spec` names at `dir` (an existing, empty directory) as the file
/// `dir/<name>`; `read_only` refuses writes.
#[pyfunction]
#[pyo3(signature = (spec, dir, name = None, read_only = false))]
pub fn mount(
    py: Python<'_>,
    spec: &str,
    dir: PathBuf,
    name: Option<String>,
    read_only: bool,
) -> PyResult<Mount> {
    let mut opts = farmap_fuse::MountOptions {
        read_only,
        ..Default::default()
    };
    if let Some(name) = name {
        opts.name = name;
    }
    let (spec, mount) = blocking(py, || -> Result<_, Failure> {
        let (parsed, store) = open_spec(spec)?;
        let mount = farmap_fuse::FuseMount::mount(store, &dir, opts)?;
        Ok((parsed.to_string(), mount))
    })?;
    Ok(Mount {
        spec,
        dir: mount.dir().to_path_buf(),
        path: mount.path().to_path_buf(),
        size: mount.geometry().size(),
        mount: Mutex::new(Some(mount)),
    })
}

#[pymethods]
impl Mount {
    /// The mounted file.
    #[getter]
    fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// The mount point.
    #[getter]
    fn dir(&self) -> PathBuf {
        self.dir.clone()
    }

    /// The file's size (the store's).
    #[getter]
    fn size(&self) -> u64 {
        self.size
    }

    /// Whether it is still mounted by this object.
    #[getter]
    fn mounted(&self) -> bool {
        self.mount.lock().as_ref().is_some_and(|m| !m.is_ended())
    }

    /// Writes the file's dirty pages back to the store and flushes it.
    fn sync(&self, py: Python<'_>) -> PyResult<()> {
        let guard = self.mount.lock();
        let Some(mount) = guard.as_ref() else {
            return Err(Failure::new(
                Class::Closed,
                format!("{} is unmounted", self.dir.display()),
            )
            .into());
        };
        blocking(py, || mount.sync()).map_err(Failure::from)?;
        Ok(())
    }

    /// Syncs, unmounts (waiting until programs that hold the file let go) and flushes the
    /// store. Unmounting twice does nothing.
    fn unmount(&self, py: Python<'_>) -> PyResult<()> {
        let Some(mount) = self.mount.lock().take() else {
            return Ok(());
        };
        blocking(py, || mount.unmount()).map_err(Failure::from)?;
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
        self.unmount(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "<farmap.Mount {} at {}{}>",
            self.spec,
            self.path.display(),
            if self.mounted() { "" } else { ", unmounted" }
        )
    }
}
