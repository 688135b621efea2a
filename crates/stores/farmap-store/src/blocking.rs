//! Running blocking file system calls off the async worker threads.

use farmap_core::{ErrorKind, StoreError, StoreResult};

/// Runs `f` on Tokio's blocking pool and returns its result.
///
/// A panic inside `f` is resumed in the caller (it is a bug, not an I/O error); a task
/// cancelled because the runtime is shutting down becomes [`ErrorKind::Cancelled`].
pub(crate) async fn blocking<T, F>(f: F) -> StoreResult<T>
where
    T: Send + 'static,
    F: FnOnce() -> StoreResult<T> + Send + 'static,
{
    match tokio::task::spawn_blocking(f).await {
        Ok(result) => result,
        Err(err) if err.is_panic() => std::panic::resume_unwind(err.into_panic()),
        Err(_) => Err(StoreError::new(
            ErrorKind::Cancelled,
            "a file operation was cancelled because the runtime is shutting down",
        )),
    }
}
