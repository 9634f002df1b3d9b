//! The one error of an I/O step on a path, shared by every module that creates, opens, reads or
//! removes files: `create mount directory /var/lib/…/mounts/vol-1`, caused by the `io::Error`.
//!
//! Contract: its text names the step and the path, and only those; the kernel's answer is its
//! [`source`](std::error::Error::source), written out once by the error chain (`error_chain`) wherever an
//! error reaches a person. A module's error enum holds it as `Io(#[from] IoStep)` (shown
//! transparently when the step says enough, or under a variant that adds what the layer knows).

use std::io;
use std::path::{Path, PathBuf};

/// An I/O step on `path` failed.
#[derive(Debug, thiserror::Error)]
#[error("{step} {path}")]
pub struct IoStep {
    /// What was being done (`create mount directory`, `bind`, `open`, ...).
    pub step: &'static str,
    /// The path it was done on.
    pub path: PathBuf,
    /// The I/O error.
    #[source]
    pub source: io::Error,
}

impl IoStep {
    /// The error `source` of `step` on `path`.
    pub fn new(step: &'static str, path: impl AsRef<Path>, source: io::Error) -> Self {
        IoStep {
            step,
            path: path.as_ref().to_path_buf(),
            source,
        }
    }

    /// The kernel's answer (or the library's), to look at its kind.
    pub fn kind(&self) -> io::ErrorKind {
        self.source.kind()
    }
}

/// The error of `step` on `path`, for `map_err`: `fs::create_dir(p).map_err(io_step("create directory", p))`.
/// `?` turns it into the caller's error (`Io(#[from] IoStep)`).
pub fn io_step<'a>(step: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> IoStep + 'a {
    move |source| IoStep::new(step, path, source)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_step_and_the_path_and_keeps_the_cause_as_its_source() {
        let e = io_step("create mount directory", Path::new("/w/mounts/v"))(
            io::Error::from_raw_os_error(libc::EACCES),
        );
        assert_eq!(e.to_string(), "create mount directory /w/mounts/v");
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        let source = std::error::Error::source(&e).expect("a source");
        assert!(source.to_string().contains("ermission denied"), "{source}");
    }
}
