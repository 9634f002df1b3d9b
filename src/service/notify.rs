//! systemd's service notification protocol (`sd_notify(3)`), the few lines a `Type=notify`
//! unit needs: a datagram of `KEY=VALUE` lines to the Unix socket named by `$NOTIFY_SOCKET`.
//!
//! Contract:
//! - Without `$NOTIFY_SOCKET` (not started by systemd, or by a unit of another `Type=`) nothing
//!   is sent and that is no error.
//! - An address starting with `@` is an abstract socket (`@` standing for the leading NUL), one
//!   starting with `/` a path; any other (systemd's `vsock:` forms) is refused by name.
//! - One datagram per call, sent from an unbound socket: systemd identifies the sender by its
//!   credentials, so only the main process's messages count (`NotifyAccess=main`, the default).
//! - The variable stays set: a managed plugin started later inherits it, and systemd ignores it
//!   under `NotifyAccess=main` (unsetting it would need `std::env::remove_var`, unsound once the
//!   async runtime's threads run).

use std::ffi::OsStr;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

use crate::shown::shown_os;

/// The variable systemd sets for a `Type=notify` service.
pub const NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";

/// The service is ready (after its socket accepts calls).
pub const READY: &str = "READY=1";

/// The service is stopping (after the stop signal, before the drain).
pub const STOPPING: &str = "STOPPING=1";

/// A notification could not be sent.
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    /// `$NOTIFY_SOCKET` is neither `@NAME` nor an absolute path.
    #[error("{NOTIFY_SOCKET}='{addr}': not an abstract (@NAME) or absolute socket address")]
    Address {
        /// The address, shown escaped.
        addr: String,
    },
    /// The datagram could not be sent.
    #[error("notify systemd at {NOTIFY_SOCKET}='{addr}'")]
    Send {
        /// The address, shown escaped.
        addr: String,
        /// The socket error.
        source: std::io::Error,
    },
}

/// Sends `state` (`KEY=VALUE` lines) to `$NOTIFY_SOCKET`: `Ok(false)` when it is not set.
pub fn notify(state: &str) -> Result<bool, NotifyError> {
    match std::env::var_os(NOTIFY_SOCKET) {
        Some(addr) => notify_to(&addr, state).map(|()| true),
        None => Ok(false),
    }
}

/// Sends `state` to the socket at `addr` (`$NOTIFY_SOCKET`'s syntax).
pub fn notify_to(addr: &OsStr, state: &str) -> Result<(), NotifyError> {
    let shown_addr = || shown_os(addr).into_owned();
    let bytes = addr.as_bytes();
    let target = match bytes.first() {
        Some(b'@') => SocketAddr::from_abstract_name(&bytes[1..]),
        Some(b'/') => SocketAddr::from_pathname(addr),
        _ => return Err(NotifyError::Address { addr: shown_addr() }),
    }
    .map_err(|_| NotifyError::Address { addr: shown_addr() })?;
    let send = || -> std::io::Result<()> {
        let socket = UnixDatagram::unbound()?;
        socket.send_to_addr(state.as_bytes(), &target)?;
        Ok(())
    };
    send().map_err(|source| NotifyError::Send {
        addr: shown_addr(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn receive(socket: &UnixDatagram) -> String {
        socket
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut buf = [0u8; 512];
        let n = socket.recv(&mut buf).expect("a datagram");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[test]
    fn sends_to_a_path_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        notify_to(path.as_os_str(), "READY=1\nSTATUS=serving").unwrap();
        assert_eq!(receive(&listener), "READY=1\nSTATUS=serving");
    }

    #[test]
    fn sends_to_an_abstract_socket() {
        let name = format!("csi-isolator-notify-test-{:08x}", rand::random::<u32>());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixDatagram::bind_addr(&addr).unwrap();
        notify_to(OsStr::new(&format!("@{name}")), STOPPING).unwrap();
        assert_eq!(receive(&listener), STOPPING);
    }

    #[test]
    fn refuses_other_addresses_and_reports_a_missing_socket() {
        for bad in ["", "relative/path", "vsock:2:1234"] {
            let err = notify_to(OsStr::new(bad), READY).unwrap_err();
            assert!(matches!(err, NotifyError::Address { .. }), "{bad}: {err}");
            assert!(err.to_string().contains("NOTIFY_SOCKET"), "{err}");
        }
        let dir = tempfile::tempdir().unwrap();
        let gone = dir.path().join("nobody-listens");
        let err = notify_to(gone.as_os_str(), READY).unwrap_err();
        assert!(matches!(err, NotifyError::Send { .. }), "{err}");
        let message = crate::error_chain::full_message(&err);
        assert!(
            message.contains("nobody-listens") && message.contains("No such file"),
            "{message}"
        );
    }
}
