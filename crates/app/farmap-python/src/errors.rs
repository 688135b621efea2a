//! Errors: every failure of the library becomes a [`Failure`] (a [`Class`] and a message, plain
//! Rust, tested here), and a failure becomes an instance of one of the Python exception classes
//! made at import ([`Exceptions`]): `farmap.FarmapError` and its subclasses, each also a
//! subclass of the built-in exception a Python programmer would catch (`SpecError` is a
//! `ValueError`, `OutOfRangeError` an `IndexError`, ...).

use farmap::{error_chain, ErrorKind, OpenError, OpenRegionError, RegionError, StoreError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

/// Which Python exception a failure raises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// A store spec that does not parse or names an impossible shape.
    Spec,
    /// A malformed request (wrong chunk length, bad argument).
    InvalidInput,
    /// A chunk index or byte range outside the region.
    OutOfRange,
    /// Something the store needs does not exist.
    NotFound,
    /// Credentials missing or refused, or the store is read-only.
    PermissionDenied,
    /// This system or store cannot do it (userfaultfd unavailable, an operation a store lacks).
    Unsupported,
    /// Did not finish in time.
    Timeout,
    /// The backend cannot be reached.
    Unavailable,
    /// Data failed verification.
    Corrupt,
    /// The store, region or mount is closed.
    Closed,
    /// A buffer of the region is still exported (close refused).
    Busy,
    /// Mounting or unmounting failed.
    Mount,
    /// A migration failed.
    Migration,
    /// Reading or writing failed (the device, the service, a system call).
    Io,
}

impl Class {
    /// Every class, for the table of exceptions.
    pub const ALL: [Class; 14] = [
        Class::Spec,
        Class::InvalidInput,
        Class::OutOfRange,
        Class::NotFound,
        Class::PermissionDenied,
        Class::Unsupported,
        Class::Timeout,
        Class::Unavailable,
        Class::Corrupt,
        Class::Closed,
        Class::Busy,
        Class::Mount,
        Class::Migration,
        Class::Io,
    ];

    /// The Python class name and the built-in exception it also derives from (`None`: only
    /// `FarmapError`).
    pub fn python(self) -> (&'static str, Option<&'static str>) {
        match self {
            Class::Spec => ("SpecError", Some("ValueError")),
            Class::InvalidInput => ("InvalidInputError", Some("ValueError")),
            Class::OutOfRange => ("OutOfRangeError", Some("IndexError")),
            Class::NotFound => ("NotFoundError", Some("FileNotFoundError")),
            Class::PermissionDenied => ("PermissionDeniedError", Some("PermissionError")),
            Class::Unsupported => ("UnsupportedError", Some("OSError")),
            Class::Timeout => ("StoreTimeoutError", Some("TimeoutError")),
            Class::Unavailable => ("UnavailableError", Some("ConnectionError")),
            Class::Corrupt => ("CorruptError", None),
            Class::Closed => ("ClosedError", None),
            Class::Busy => ("BusyError", Some("BufferError")),
            Class::Mount => ("MountError", Some("OSError")),
            Class::Migration => ("MigrationError", None),
            Class::Io => ("StoreIOError", Some("OSError")),
        }
    }

    /// The class of a store error's kind.
    pub fn of_kind(kind: ErrorKind) -> Class {
        match kind {
            ErrorKind::NotFound => Class::NotFound,
            ErrorKind::OutOfRange => Class::OutOfRange,
            ErrorKind::InvalidInput => Class::InvalidInput,
            ErrorKind::Timeout => Class::Timeout,
            ErrorKind::Unavailable => Class::Unavailable,
            ErrorKind::Corrupt => Class::Corrupt,
            ErrorKind::Closed | ErrorKind::Cancelled => Class::Closed,
            ErrorKind::ReadOnly | ErrorKind::PermissionDenied | ErrorKind::Fenced => {
                Class::PermissionDenied
            }
            ErrorKind::Unsupported => Class::Unsupported,
            // Io, NoSpace and kinds added later.
            _ => Class::Io,
        }
    }
}

/// A failure on its way to Python: which exception, and its message (the error's chain of
/// causes, one sentence).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// Which exception.
    pub class: Class,
    /// Its message.
    pub message: String,
}

impl Failure {
    /// A failure of `class` saying `message`.
    pub fn new(class: Class, message: impl Into<String>) -> Self {
        Self {
            class,
            message: message.into(),
        }
    }

    fn chain(class: Class, err: &(dyn std::error::Error + 'static)) -> Self {
        Self::new(class, error_chain(err))
    }
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        Failure::chain(Class::of_kind(e.kind()), &e)
    }
}

impl From<farmap::SpecError> for Failure {
    fn from(e: farmap::SpecError) -> Self {
        Failure::chain(Class::Spec, &e)
    }
}

impl From<OpenError> for Failure {
    fn from(e: OpenError) -> Self {
        let class = match &e {
            OpenError::Store { source, .. } => Class::of_kind(source.kind()),
            OpenError::Geometry { .. } => Class::Spec,
            _ => Class::Io,
        };
        Failure::chain(class, &e)
    }
}

impl From<RegionError> for Failure {
    fn from(e: RegionError) -> Self {
        let class = match &e {
            RegionError::Unsupported { .. } => Class::Unsupported,
            RegionError::Geometry { .. } => Class::InvalidInput,
            RegionError::Push(s) | RegionError::Read(s) => Class::of_kind(s.kind()),
            RegionError::Slice(_) => Class::OutOfRange,
            RegionError::Closed => Class::Closed,
            _ => Class::Io,
        };
        Failure::chain(class, &e)
    }
}

impl From<OpenRegionError> for Failure {
    fn from(e: OpenRegionError) -> Self {
        let inner = match e {
            OpenRegionError::Store(e) => Failure::from(e),
            OpenRegionError::Region(e) => Failure::from(e),
            e => return Failure::chain(Class::Io, &e),
        };
        Failure::new(
            inner.class,
            format!("cannot open the region: {}", inner.message),
        )
    }
}

impl From<farmap_fuse::MountError> for Failure {
    fn from(e: farmap_fuse::MountError) -> Self {
        use farmap_fuse::MountError as M;
        let class = match &e {
            M::BadName { .. } | M::BadMountPoint { .. } => Class::InvalidInput,
            _ => Class::Mount,
        };
        Failure::chain(class, &e)
    }
}

/// The Python exception classes, made once at import.
#[derive(Debug)]
pub struct Exceptions {
    /// `farmap.FarmapError`, the base of all.
    pub base: Py<PyType>,
    /// One per [`Class`], in [`Class::ALL`] order.
    pub classes: Vec<Py<PyType>>,
}

static EXCEPTIONS: PyOnceLock<Exceptions> = PyOnceLock::new();

/// The exception classes (made on first use: `type(name, bases, {...})`).
pub fn exceptions(py: Python<'_>) -> PyResult<&Exceptions> {
    EXCEPTIONS.get_or_try_init(py, || make_exceptions(py))
}

fn make_exceptions(py: Python<'_>) -> PyResult<Exceptions> {
    let builtins = py.import("builtins")?;
    let type_ = builtins.getattr("type")?;
    let new_class = |name: &str, bases: Bound<'_, PyTuple>, doc: &str| -> PyResult<Py<PyType>> {
        let ns = PyDict::new(py);
        ns.set_item("__module__", "farmap")?;
        ns.set_item("__doc__", doc)?;
        let class = type_.call1((name, bases, ns))?;
        Ok(class.cast_into::<PyType>()?.unbind())
    };
    let exception = builtins.getattr("Exception")?;
    let base = new_class(
        "FarmapError",
        PyTuple::new(py, [exception])?,
        "The base of every error farmap raises.",
    )?;
    let mut classes = Vec::with_capacity(Class::ALL.len());
    for class in Class::ALL {
        let (name, builtin) = class.python();
        let mut bases = vec![base.bind(py).clone().into_any()];
        if let Some(b) = builtin {
            bases.push(builtins.getattr(b)?);
        }
        let doc = format!("farmap's {name}; see docs/python.md for when it is raised.");
        classes.push(new_class(name, PyTuple::new(py, bases)?, &doc)?);
    }
    Ok(Exceptions { base, classes })
}

/// Adds `FarmapError` and its subclasses to module `m`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let ex = exceptions(py)?;
    m.add("FarmapError", ex.base.clone_ref(py))?;
    for (class, ty) in Class::ALL.iter().zip(&ex.classes) {
        m.add(class.python().0, ty.clone_ref(py))?;
    }
    Ok(())
}

impl From<Failure> for PyErr {
    fn from(f: Failure) -> PyErr {
        Python::attach(|py| match exceptions(py) {
            Ok(ex) => {
                let i = Class::ALL.iter().position(|c| *c == f.class).unwrap_or(0);
                PyErr::from_type(ex.classes[i].bind(py).clone(), f.message)
            }
            Err(e) => e,
        })
    }
}

/// A result whose error is a [`Failure`].
pub type Fallible<T> = Result<T, Failure>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_store_kind_has_a_class_and_the_obvious_ones_are_exact() {
        for kind in ErrorKind::ALL {
            let f = Failure::from(StoreError::new(kind, "chunk 3"));
            assert!(f.message.contains("chunk 3"), "{f:?}");
        }
        let class = |k| Failure::from(StoreError::new(k, "x")).class;
        assert_eq!(class(ErrorKind::OutOfRange), Class::OutOfRange);
        assert_eq!(class(ErrorKind::InvalidInput), Class::InvalidInput);
        assert_eq!(class(ErrorKind::NotFound), Class::NotFound);
        assert_eq!(class(ErrorKind::PermissionDenied), Class::PermissionDenied);
        assert_eq!(class(ErrorKind::ReadOnly), Class::PermissionDenied);
        assert_eq!(class(ErrorKind::Unsupported), Class::Unsupported);
        assert_eq!(class(ErrorKind::Io), Class::Io);
    }

    #[test]
    fn spec_errors_are_spec_errors_with_the_spec_in_the_message() {
        let e = "nosuch:thing".parse::<farmap::StoreSpec>().unwrap_err();
        let f = Failure::from(e);
        assert_eq!(f.class, Class::Spec);
        assert!(f.message.contains("nosuch"), "{}", f.message);
        // A size that is no size is a spec error too, not an I/O error.
        let e = "memory:12XB".parse::<farmap::StoreSpec>().unwrap_err();
        assert_eq!(Failure::from(e).class, Class::Spec);
    }

    #[test]
    fn a_missing_file_store_is_not_found() {
        let dir =
            std::env::temp_dir().join(format!("farmap-python-missing-{}", std::process::id()));
        // Without size= an absent file cannot be created.
        let spec: farmap::StoreSpec = format!("file:{}/absent.img", dir.display())
            .parse()
            .unwrap();
        let e = farmap::open_store(&spec).unwrap_err();
        let f = Failure::from(e);
        assert_eq!(f.class, Class::NotFound, "{f:?}");
        assert!(f.message.contains("absent.img"), "{}", f.message);
    }

    #[test]
    fn python_names_are_unique_and_end_in_error() {
        let mut names: Vec<_> = Class::ALL.iter().map(|c| c.python().0).collect();
        assert!(names.iter().all(|n| n.ends_with("Error")));
        names.sort();
        names.dedup();
        assert_eq!(names.len(), Class::ALL.len());
    }
}
