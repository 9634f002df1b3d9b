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
//! - The cap on connections (`reason="capacity"`) and the accept loop are
//!   [`accept`](super::accept)'s, shared with `/metrics`. A slot is freed
//!   when its connection ends (the peer closes, dies, or stops answering
//!   HTTP/2 keepalive pings).

use std::sync::Arc;
use std::time::Instant;

use futures::Stream;
use tokio::net::{UnixListener, UnixStream};
use tonic::transport::server::{Connected, UdsConnectInfo};

use crate::error_chain::Chain;
use crate::service::accept::{Admitted, Gate, Listen, WarnLimiter};
#[cfg(doc)]
use crate::service::accept::{WARNINGS_PER_WINDOW, WARN_WINDOW};
use crate::service::metrics::{Refusal, ServiceMetrics};

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

impl Connected for Admitted<UnixStream> {
    type ConnectInfo = UdsConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream().connect_info()
    }
}

/// A Unix socket whose peers are admitted by their credentials: its name in
/// logs and how its refusals are counted. serve's gRPC socket is [`Grpc`];
/// the Docker volume plugin's socket has its own.
pub trait PeerSocket: Send + 'static {
    /// The listener's name in logs.
    const NAME: &'static str;
    /// What a peer that is not admitted is counted as.
    const REFUSED_PEER: Refusal;
    /// What a connection over the cap is counted as.
    const OVER_CAPACITY: Refusal;
}

/// serve's gRPC socket.
#[derive(Debug)]
pub struct Grpc;

impl PeerSocket for Grpc {
    const NAME: &'static str = "service socket";
    const REFUSED_PEER: Refusal = Refusal::GrpcPeer;
    const OVER_CAPACITY: Refusal = Refusal::GrpcCapacity;
}

/// A Unix socket, admitting peers by their credentials.
pub struct PeerChecked<K> {
    listener: UnixListener,
    admission: Admission,
    metrics: Arc<ServiceMetrics>,
    refused_peers: WarnLimiter,
    kind: std::marker::PhantomData<K>,
}

impl<K: PeerSocket> Listen for PeerChecked<K> {
    type Stream = UnixStream;
    const NAME: &'static str = K::NAME;
    const OVER_CAPACITY: Refusal = K::OVER_CAPACITY;

    async fn accept(&mut self) -> std::io::Result<(UnixStream, String)> {
        let (stream, _) = self.listener.accept().await?;
        let peer = match stream.peer_cred() {
            Ok(c) => format!("uid {} gid {} pid {:?}", c.uid(), c.gid(), c.pid()),
            Err(_) => "unknown peer".to_string(),
        };
        Ok((stream, peer))
    }

    fn admit(&mut self, stream: &UnixStream) -> bool {
        let cred = match stream.peer_cred() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(listener = K::NAME, error = %Chain(&e), "cannot read the peer's credentials; connection closed");
                return false;
            }
        };
        let (uid, gid, pid) = (cred.uid(), cred.gid(), cred.pid());
        if self.admission.admits(uid, gid) {
            return true;
        }
        self.metrics.refused(K::REFUSED_PEER);
        if let Some(left_out) = self.refused_peers.allow(Instant::now()) {
            tracing::warn!(
                uid,
                gid,
                pid = ?pid,
                allowed_group = ?self.admission.group,
                left_out,
                "{}: connection refused: the peer is neither root nor in the allowed group",
                K::NAME
            );
        }
        false
    }
}

/// The accept gate of a socket of kind `K` (see the module doc): peers
/// checked by their credentials, at most `max_connections` at once.
pub fn gate<K: PeerSocket>(
    listener: UnixListener,
    admission: Admission,
    max_connections: usize,
    metrics: Arc<ServiceMetrics>,
) -> Gate<PeerChecked<K>> {
    let checked = PeerChecked {
        listener,
        admission,
        metrics: metrics.clone(),
        refused_peers: WarnLimiter::default(),
        kind: std::marker::PhantomData,
    };
    Gate::new(checked, max_connections, metrics)
}

/// The connections of `listener` that pass the gate (see the module doc),
/// as tonic's incoming stream. It never ends and never yields an error.
pub fn incoming(
    listener: UnixListener,
    admission: Admission,
    max_connections: usize,
    metrics: Arc<ServiceMetrics>,
) -> impl Stream<Item = Result<Admitted<UnixStream>, std::io::Error>> {
    let gate = gate::<Grpc>(listener, admission, max_connections, metrics);
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
}
