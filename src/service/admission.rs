//! Who may talk to the service on its Unix socket, and how many at once.
//!
//! The socket's file mode is the first gate; this is the second, which does
//! not depend on how the socket file or its directories were set up: every
//! accepted connection's peer credentials (`SO_PEERCRED`: the uid, gid and
//! pid of the process that called `connect(2)`, as the kernel recorded them
//! then) are checked before tonic sees the connection.
//!
//! - Admitted: uid 0, or, when the operator configured a group
//!   (`serve --allow-group`), a peer whose gid is that group. Only the
//!   primary gid is known from `SO_PEERCRED`: a member through a
//!   supplementary group connects with that group as its gid (`sg GROUP`).
//! - Anything else is closed at once, counted
//!   (`csi_isolator_connections_refused_total{listener="grpc",reason="peer"}`)
//!   and logged (uid, gid, pid) at most [`WARNINGS_PER_WINDOW`] times per
//!   [`WARN_WINDOW`], so a flood cannot fill the log.
//! - At most `max_connections` admitted connections are open at once; one
//!   over the cap is closed at once (counted, `reason="capacity"`). A slot
//!   is freed when its connection ends (the peer closes, dies, or stops
//!   answering HTTP/2 keepalive pings).
//! - Accepting never stops on a transient error (out of descriptors, a
//!   connection reset before it was accepted): it waits a moment and goes on.

use std::io::ErrorKind;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::{Connected, UdsConnectInfo};

use crate::service::metrics::{Refusal, ServiceMetrics};

/// How many refusals of one kind are logged per [`WARN_WINDOW`].
pub const WARNINGS_PER_WINDOW: u32 = 10;
/// The window of [`WARNINGS_PER_WINDOW`].
pub const WARN_WINDOW: Duration = Duration::from_secs(60);

/// Whom the service admits on its socket (see the module doc).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Admission {
    /// The group whose members are admitted besides root.
    pub group: Option<u32>,
}

impl Admission {
    /// Whether a peer with effective `uid` and `gid` may call the service.
    pub fn admits(&self, uid: u32, gid: u32) -> bool {
        uid == 0 || self.group == Some(gid)
    }
}

/// A group named on the command line could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    /// No group has that name.
    #[error(
        "--allow-group {name}: no such group (give a group name from /etc/group or a numeric gid)"
    )]
    Unknown {
        /// The name given.
        name: String,
    },
    /// The group database could not be read.
    #[error("--allow-group {name}: look up the group: {errno}")]
    Lookup {
        /// The name given.
        name: String,
        /// The error.
        errno: nix::errno::Errno,
    },
}

/// The gid a `--allow-group` value names: a number is a gid as given, a
/// name is looked up in the group database.
pub fn resolve_group(value: &str) -> Result<u32, GroupError> {
    if let Ok(gid) = value.parse::<u32>() {
        return Ok(gid);
    }
    match nix::unistd::Group::from_name(value) {
        Ok(Some(g)) => Ok(g.gid.as_raw()),
        Ok(None) => Err(GroupError::Unknown {
            name: value.to_string(),
        }),
        Err(errno) => Err(GroupError::Lookup {
            name: value.to_string(),
            errno,
        }),
    }
}

/// Logs at most [`WARNINGS_PER_WINDOW`] events per [`WARN_WINDOW`] and says
/// how many it left out. Pure: the caller passes the time.
#[derive(Debug, Default)]
pub struct WarnLimiter {
    window_start: Option<Instant>,
    shown: u32,
    suppressed: u64,
}

impl WarnLimiter {
    /// Whether the event at `now` is logged; if so, how many were left out
    /// before it (in the windows since the last one logged).
    pub fn allow(&mut self, now: Instant) -> Option<u64> {
        let expired = self
            .window_start
            .is_none_or(|start| now.saturating_duration_since(start) >= WARN_WINDOW);
        if expired {
            self.window_start = Some(now);
            self.shown = 0;
        }
        if self.shown < WARNINGS_PER_WINDOW {
            self.shown += 1;
            Some(std::mem::take(&mut self.suppressed))
        } else {
            self.suppressed += 1;
            None
        }
    }
}

/// An admitted connection: the stream and its slot under the cap.
#[derive(Debug)]
pub struct Admitted {
    stream: UnixStream,
    _slot: OwnedSemaphorePermit,
}

impl AsyncRead for Admitted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Admitted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

impl Connected for Admitted {
    type ConnectInfo = UdsConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

/// The gate's state, carried from one accepted connection to the next.
struct Gate {
    listener: UnixListener,
    admission: Admission,
    slots: Arc<Semaphore>,
    metrics: Arc<ServiceMetrics>,
    refused_peers: WarnLimiter,
    refused_full: WarnLimiter,
}

impl Gate {
    /// Accepts until a connection passes the gate.
    async fn next(&mut self) -> Admitted {
        loop {
            let stream = match self.listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    if !is_transient(&e) {
                        tracing::error!(error = %e, "service socket: accept failed");
                    }
                    // Out of descriptors, or a connection gone before it was
                    // accepted: try again shortly rather than spin or stop.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let cred = match stream.peer_cred() {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "service socket: cannot read the peer's credentials; connection closed");
                    continue;
                }
            };
            let (uid, gid, pid) = (cred.uid(), cred.gid(), cred.pid());
            if !self.admission.admits(uid, gid) {
                drop(stream);
                self.metrics.refused(Refusal::GrpcPeer);
                if let Some(left_out) = self.refused_peers.allow(Instant::now()) {
                    tracing::warn!(
                        uid,
                        gid,
                        pid = ?pid,
                        allowed_group = ?self.admission.group,
                        left_out,
                        "service socket: connection refused: the peer is neither root nor in the allowed group"
                    );
                }
                continue;
            }
            match self.slots.clone().try_acquire_owned() {
                Ok(slot) => {
                    return Admitted {
                        stream,
                        _slot: slot,
                    }
                }
                Err(_) => {
                    drop(stream);
                    self.metrics.refused(Refusal::GrpcCapacity);
                    if let Some(left_out) = self.refused_full.allow(Instant::now()) {
                        tracing::warn!(
                            uid,
                            gid,
                            pid = ?pid,
                            left_out,
                            "service socket: connection refused: every connection slot is taken (serve --max-connections)"
                        );
                    }
                }
            }
        }
    }
}

/// Whether an accept error concerns one connection or a passing shortage,
/// not the listener.
pub fn is_transient(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::ConnectionAborted
            | ErrorKind::ConnectionReset
            | ErrorKind::Interrupted
            | ErrorKind::WouldBlock
    ) || matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// The connections of `listener` that pass the gate (see the module doc),
/// as tonic's incoming stream. It never ends and never yields an error.
pub fn incoming(
    listener: UnixListener,
    admission: Admission,
    max_connections: usize,
    metrics: Arc<ServiceMetrics>,
) -> impl Stream<Item = Result<Admitted, std::io::Error>> {
    let gate = Gate {
        listener,
        admission,
        slots: Arc::new(Semaphore::new(max_connections)),
        metrics,
        refused_peers: WarnLimiter::default(),
        refused_full: WarnLimiter::default(),
    };
    futures::stream::unfold(gate, |mut gate| async move {
        let admitted = gate.next().await;
        Some((Ok(admitted), gate))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_root_and_the_allowed_group_only() {
        for (group, uid, gid, admitted) in [
            (None, 0, 0, true),
            (None, 0, 1234, true),
            (None, 1000, 0, false),
            (None, 65534, 65534, false),
            (Some(1234), 0, 0, true),
            (Some(1234), 1000, 1234, true),
            (Some(1234), 1000, 1235, false),
            (Some(0), 1000, 0, true),
            (Some(1234), 1234, 1000, false),
        ] {
            assert_eq!(
                Admission { group }.admits(uid, gid),
                admitted,
                "group {group:?} uid {uid} gid {gid}"
            );
        }
    }

    #[test]
    fn groups_resolve_by_number_or_name() {
        assert_eq!(resolve_group("4321").unwrap(), 4321);
        assert_eq!(resolve_group("root").unwrap(), 0);
        let e = resolve_group("no-such-group-csi").unwrap_err();
        assert!(e.to_string().contains("no-such-group-csi"), "{e}");
    }

    #[test]
    fn warnings_are_limited_per_window_and_count_what_was_left_out() {
        let t0 = Instant::now();
        let mut l = WarnLimiter::default();
        for i in 0..WARNINGS_PER_WINDOW {
            assert_eq!(l.allow(t0 + Duration::from_millis(u64::from(i))), Some(0));
        }
        for _ in 0..5 {
            assert_eq!(l.allow(t0 + Duration::from_secs(1)), None);
        }
        assert_eq!(
            l.allow(t0 + WARN_WINDOW),
            Some(5),
            "the next window says how many"
        );
        assert_eq!(l.allow(t0 + WARN_WINDOW), Some(0));
    }
}
