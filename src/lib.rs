//! csi-isolator: makes CSI volumes usable by containers.
//!
//! The library holds all logic; the binaries in `src/bin/` only parse
//! arguments, set up logging and map errors to exit codes.
//!
//! Concerns, one module each:
//! - [`resource`]: the Mesos `Resource` model and its mount-point rules.
//! - [`csi`]: the CSI v1 gRPC client (and the generated protocol types).
//! - [`plugin`]: `csi-test-plugin`, the CSI plugin bundled for tests and `run`.
//! - [`mount`]: every mount syscall, behind one seam.
//! - [`provider`]: resource providers and the volume state machine.
//! - [`isolator`]: prepare / isolate / update / cleanup / recover.
//! - [`launcher`]: the namespace launcher used by `run` and the tests.
//! - [`service`]: `serve`, the isolator as a gRPC service on a Unix socket, with metrics.

pub mod csi;
pub mod error_chain;
pub mod isolator;
pub mod launcher;
pub mod mount;
pub mod plugin;
pub mod provider;
pub mod resource;
pub mod runner;
pub mod service;
pub mod shown;
#[doc(hidden)]
pub mod testing;
pub mod workdir;
