//! What a test process logs, captured in memory: one `tracing` subscriber per process (nextest
//! runs each test in its own), installed by the first [`capture`] at the level it names, and read
//! back with [`captured`]. The secrets tests search it for values that must never be logged; the
//! day-2 tests for the warnings they expect.

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();

/// Installs the capturing subscriber at `level` (every target) if this process has none yet.
pub fn capture(level: tracing::Level) {
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(level)
            .with_ansi(false)
            .with_writer(move || Sink(sink.clone()))
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        buf
    });
}

/// Everything logged since [`capture`] (empty if it was never called).
pub fn captured() -> String {
    LOGS.get()
        .map(|b| String::from_utf8_lossy(&b.lock().unwrap_or_else(|p| p.into_inner())).into_owned())
        .unwrap_or_default()
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(data);
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
