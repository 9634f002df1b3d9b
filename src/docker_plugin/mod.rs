//! `csi-isolator docker-plugin`: the Docker volume plugin protocol (JSON
//! over HTTP/1.1 `POST`s on a Unix socket, as Docker and Podman speak it),
//! served on the same crash-safe provider as every other command.
//!
//! Contract:
//! - One process per work dir: it holds `<work_dir>/run.lock` for its
//!   lifetime, like `run` and `serve`.
//! - The socket (default [`DEFAULT_SOCKET`], so the driver's name is
//!   `csi-isolator`) is made as serve's is: `0600` root, bound in a private
//!   directory and renamed into place, in a directory that passes the work
//!   dir's rule; a stale one is replaced, a live one refused; removed at exit.
//! - Every connection is admitted by its peer credentials (`SO_PEERCRED`,
//!   root only), before a byte is read; at most `max_connections` at once;
//!   the head and the body are read within a deadline, the body up to
//!   `max_body` bytes (more: 413); one request per connection.
//! - Each call runs in a task of its own: a caller that gives up, or the
//!   call timeout, never cuts a publish or a create short.
//! - A Mount ID is a durable user of the volume in the provider's
//!   checkpoint (`docker-plugin/<ID>`, [`users`]), recorded before the
//!   publish: a plugin killed and started again keeps the volume published
//!   for it and serves its `Unmount`.
//! - With an engine (`--engine`), uses of volumes no live container holds
//!   are released ([`reconciler`]; the rule in [`holders`], the engine's
//!   answer bounded and checked in [`engine`]); only `docker-plugin`'s own
//!   uses, never a container's. Without one, a use lasts until its
//!   `Unmount` or `csi-isolator volume release`.
//! - Answers are 200 with the endpoint's JSON, or (for every error) a
//!   non-200 status with `{"Err": ...}` naming the endpoint, the volume
//!   and the cause down to the CSI RPC ([`error`]).
//! - Once it accepts calls, and again when it begins to stop, it tells
//!   systemd (`READY=1`, `STOPPING=1` to `$NOTIFY_SOCKET` when set:
//!   [`crate::service::notify`]), so a `Type=notify` unit ordered before
//!   `docker.service` holds dockerd back until the socket serves.
//! - On SIGINT/SIGTERM: stop accepting, let calls in flight finish (up to
//!   the drain time), stop the managed plugin, remove the socket and the
//!   lock. Published volumes stay published for their users.
//!
//! Files: `wire.rs` (the protocol's messages), `opts.rs` (`Create`'s
//! options), `handlers.rs` (one handler per endpoint, onto the provider),
//! `users.rs` (how a Mount ID is recorded), `error.rs` (errors and their
//! answers), `server.rs` (start-up, socket, HTTP, shutdown), and the engine
//! reconciliation: `holders.rs` (the decision, pure), `engine.rs` (the
//! engine's listing), `reconciler.rs` (the rounds).

pub mod engine;
pub mod error;
pub mod handlers;
pub mod holders;
pub mod opts;
pub mod reconciler;
pub mod server;
pub mod users;
pub mod wire;

pub use engine::{Endpoint as EngineEndpoint, EngineLimits};
pub use error::DockerError;
pub use handlers::{Driver, Endpoint, Scope};
pub use reconciler::EngineOptions;
pub use server::{
    run, Limits, PluginError, PluginOptions, Started, DEFAULT_SOCKET, DEFAULT_UNPUBLISH_DELAY,
};
