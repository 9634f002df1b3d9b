//! Blocking work off the async workers: one helper, [`blocking`], used by the provider and the
//! isolator for every step that fsyncs, calls a mount syscall, reads the mount table or `/proc`,
//! or sleeps between EBUSY retries. Imports nothing from the crate.

/// Runs blocking work (a checkpoint's fsyncs, a mount syscall, a statx, a
/// read of the mount table or of a directory, an EBUSY retry's sleep) on
/// tokio's blocking pool and waits for it, so the async workers (two on a
/// two-core node) go on with other volumes meanwhile. The caller's order of
/// effects is kept: it resumes only once the work is done. A panic in the
/// work is resumed in the caller.
pub(crate) async fn blocking<T, F>(work: F) -> T
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    match tokio::task::spawn_blocking(work).await {
        Ok(value) => value,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Only a runtime shutting down cancels a blocking task before it starts.
        Err(e) => panic!("blocking work cancelled: {e}"),
    }
}
