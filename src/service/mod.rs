//! `csi-isolator serve`: the volume isolator as a long-running service, on
//! a Unix socket (gRPC, `proto/isolator.proto`, package `csi_isolator.v1`)
//! for containerizers in any language, with metrics in the Prometheus text
//! format over HTTP.
//!
//! Contract:
//! - One `serve` per work dir: it holds `<work_dir>/run.lock` exclusively
//!   for its lifetime, like `run` (so the two never share a work dir).
//! - The socket is private: bound inside a fresh `0700` directory, made
//!   `0600` (`0660` `root:<group>` with `--allow-group`), then renamed into
//!   place, so it is never reachable with looser permissions. A stale
//!   socket (nobody accepting) is replaced; a live one or a non-socket file
//!   at the path is refused. The socket is removed on shutdown.
//! - Every connection is admitted by its peer credentials (`SO_PEERCRED`):
//!   uid 0, or the gid of the allowed group; anything else is closed at once,
//!   counted and logged at a bounded rate ([`admission`]). At most
//!   `--max-connections` admitted connections are open at once,
//!   `--max-concurrent-calls` calls run per connection, a caller waits at
//!   most `--request-timeout` for an answer, and idle connections are
//!   pinged so a dead peer frees its slot ([`ServiceLimits`]).
//! - `Isolate` accepts only the prepared container's process
//!   ([`server`]): `Update` mounts into the namespace of the pid it records.
//! - `/metrics` ([`http`]) serves a bounded number of connections, each
//!   within one deadline, from a body cached for a second; loopback by
//!   default, with a warning for any other address (the metrics name the
//!   plugins and count the volumes).
//! - On start only the provider recovers (interrupted volume operations are
//!   finished); the isolator's own recovery is the containerizer's
//!   `Recover` call with its live containers, which it should make right
//!   after connecting and before anything else. Until then, volume uses of
//!   containers that died while no service ran stay recorded (their
//!   volumes stay published).
//! - On SIGINT/SIGTERM: stop accepting, let calls in flight finish, stop
//!   the managed plugin, remove the socket and the lock. Containers are
//!   left as they are (running, volumes published): the next `serve` and
//!   its `Recover` pick them up.
//! - Every handler maps its error to a `tonic::Status` at one seam,
//!   [`error::ServiceError`]'s conversion: the code says what kind of
//!   failure it is, the message is the full error text naming the
//!   container, the volume, the CSI RPC and its code.
//!
//! Files: `accept.rs` (the accept loop and connection cap of both
//! listeners), `admission.rs` (who may connect to the socket), `server.rs`
//! (the gRPC handlers), `error.rs` (the error seam), `convert.rs` (wire
//! messages to and from library types), `metrics.rs` (what `/metrics`
//! shows, with `prometheus-client`), `http.rs` (`/metrics` on hyper),
//! `socket.rs` (the private socket), `notify.rs` (systemd's readiness
//! notification), `daemon.rs` (start-up, serving, shutdown).

/// The service protocol (`package csi_isolator.v1`), generated at build
/// time from `proto/isolator.proto`.
pub mod proto {
    #![allow(clippy::all, clippy::pedantic, missing_docs)]
    tonic::include_proto!("csi_isolator.v1");
}

pub mod accept;
pub mod admission;
pub mod convert;
pub mod daemon;
pub mod error;
pub mod http;
pub mod metrics;
pub mod notify;
pub mod server;
pub mod socket;

pub use admission::Admission;
pub use daemon::{default_socket_path, serve, ServeError, ServeOptions, ServiceLimits, Started};
pub use error::ServiceError;
pub use metrics::ServiceMetrics;
pub use server::IsolatorService;
