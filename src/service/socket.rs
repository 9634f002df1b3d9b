//! The service's private Unix socket.
//!
//! `bind(2)` creates the socket file with the process umask, so a socket
//! bound at its final path would be reachable with looser permissions until
//! a `chmod`. Instead the socket is bound inside a fresh `0700` directory
//! next to the final path (nobody else can reach it there), made `0600`,
//! then `rename(2)`d into place: at its final path it has only ever been
//! `0600`. Missing parent directories are created `0700`.
//!
//! With an allowed group (`serve --allow-group`), the socket is `0660` and
//! owned by `root:<group>` (set inside the private directory, before the
//! rename), and the directories this creates for it are `0710`
//! `root:<group>`: the group may traverse them, nobody else may, and only
//! the owner lists or changes them. Directories that already exist are left
//! as they are; one the group cannot traverse is named in a warning, since
//! the group could not reach the socket. Whoever connects is checked again
//! by its credentials ([`crate::service::admission`]).
//!
//! A file already at the path: a socket nobody accepts on (connect is
//! refused) is a stale one from a service that died, and is replaced; a
//! socket that accepts belongs to a live service and is refused, as is
//! anything that is not a socket. [`SocketGuard`] removes the socket when
//! dropped, if the path still holds the same socket.

use crate::error_chain::Chain;
use crate::io_step::{io_step, IoStep};
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::resource::MAX_SOCKET_PATH;

/// Where the default socket goes when `<work_dir>/isolator.sock` is too
/// long for a socket address (as the provider does for plugin sockets).
pub const SHORT_SERVICE_DIR: &str = "/run/csi-isolator/serve";
/// The socket's file name.
pub const SOCKET_NAME: &str = "isolator.sock";
/// The longest path `sun_path` holds (108 bytes with the terminating NUL).
const SUN_PATH_MAX: usize = 107;
/// The private directory the socket is bound in: `<parent>/.csi-isolator-<8 hex>`.
const TEMP_DIR_LEN: usize = ".csi-isolator-".len() + 8;

/// The socket could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// The path (or the private path it is bound at first) does not fit a
    /// socket address.
    #[error("socket path {path} is too long ({len} bytes with the temporary bind path; at most {SUN_PATH_MAX}): pick a shorter --socket")]
    TooLong {
        /// The path.
        path: PathBuf,
        /// The length that did not fit.
        len: usize,
    },
    /// The socket's directory (or one on its path) may be written by another user.
    #[error(transparent)]
    UnsafeDir(#[from] crate::workdir::WorkDirError),
    /// A live service already accepts on the path.
    #[error("socket {path} is in use by a running service")]
    InUse {
        /// The path.
        path: PathBuf,
    },
    /// Something other than a socket is at the path.
    #[error("{path} exists and is not a socket: refusing to replace it")]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// A step failed.
    #[error(transparent)]
    Io(#[from] IoStep),
}

/// `<work_dir>/isolator.sock`, or `/run/csi-isolator/serve/<hash of the
/// work dir>/isolator.sock` when that is too long to bind.
pub fn default_socket_path(work_dir: &Path) -> PathBuf {
    let long = work_dir.join(SOCKET_NAME);
    if bind_path_len(&long) <= MAX_SOCKET_PATH {
        return long;
    }
    let digest = Sha256::digest(work_dir.as_os_str().as_encoded_bytes());
    let tag: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    Path::new(SHORT_SERVICE_DIR).join(tag).join(SOCKET_NAME)
}

/// The longer of the final path and the private path it is bound at first.
fn bind_path_len(path: &Path) -> usize {
    let parent = path.parent().map_or(0, |p| p.as_os_str().len());
    let temp = parent + 1 + TEMP_DIR_LEN + 2;
    temp.max(path.as_os_str().len())
}

/// Removes the socket when dropped (if it is still the one bound).
#[derive(Debug)]
pub struct SocketGuard {
    path: PathBuf,
    ino: u64,
    dev: u64,
}

impl SocketGuard {
    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        match std::fs::symlink_metadata(&self.path) {
            Ok(m) if m.ino() == self.ino && m.dev() == self.dev => {
                if let Err(e) = std::fs::remove_file(&self.path) {
                    tracing::warn!(path = %self.path.display(), error = %Chain(&e), "cannot remove the service socket");
                }
            }
            _ => {}
        }
    }
}

/// Binds the private socket at `path` (see the module doc), reachable by
/// root and, if given, the members of `group`. Call it inside a tokio
/// runtime.
pub fn bind(
    path: &Path,
    group: Option<u32>,
) -> Result<(tokio::net::UnixListener, SocketGuard), SocketError> {
    let len = bind_path_len(path);
    if len > SUN_PATH_MAX {
        return Err(SocketError::TooLong {
            path: path.to_path_buf(),
            len,
        });
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    // The socket is renamed into this directory: whoever may write in it could swap it after. It is
    // checked by the work dir's rule before anything is made in or under it.
    let (_, dir_mode) = modes(group);
    let (_, made) =
        crate::workdir::create_safe_dir(parent, crate::workdir::SERVE_SOCKET_DIR, dir_mode)?;
    // What this call made is the socket's alone (and the group's, if given); an existing
    // directory is left as it is.
    for d in &made {
        if let Some(gid) = group {
            std::os::unix::fs::chown(d, None, Some(gid))
                .map_err(io_step("give the allowed group the socket directory", d))?;
        }
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(dir_mode))
            .map_err(io_step("narrow the socket directory", d))?;
    }
    if let Some(gid) = group {
        for blocked in unreachable_by_group(parent, gid) {
            tracing::warn!(
                directory = %blocked.display(),
                group = gid,
                "the allowed group cannot traverse this directory, so it cannot reach the service socket: give the group search permission on it, or pick a --socket elsewhere"
            );
        }
    }
    remove_stale(path)?;

    let (temp_dir, temp_socket) = private_dir(parent)?;
    let bound = bind_in(&temp_socket, group).and_then(|listener| {
        std::fs::rename(&temp_socket, path).map_err(io_step("move socket into place at", path))?;
        Ok(listener)
    });
    let _ = std::fs::remove_file(&temp_socket);
    let _ = std::fs::remove_dir(&temp_dir);
    let listener = bound?;
    let meta = std::fs::symlink_metadata(path).map_err(io_step("stat", path))?;
    let guard = SocketGuard {
        path: path.to_path_buf(),
        ino: meta.ino(),
        dev: meta.dev(),
    };
    let listener =
        tokio::net::UnixListener::from_std(listener).map_err(io_step("register", path))?;
    Ok((listener, guard))
}

/// The mode of the socket (`0600`, or `0660` for a group) and of the
/// directories created for it (`0700`, or `0710` for a group).
fn modes(group: Option<u32>) -> (u32, u32) {
    match group {
        None => (0o600, 0o700),
        Some(_) => (0o660, 0o710),
    }
}

/// Whether a member of `gid` (not root, not the owner) may search a
/// directory owned by `owner_gid` with `mode`.
fn group_may_traverse(mode: u32, owner_gid: u32, gid: u32) -> bool {
    if owner_gid == gid {
        mode & 0o010 != 0
    } else {
        mode & 0o001 != 0
    }
}

/// The directories from `/` to `dir` that a member of `gid` cannot
/// traverse.
fn unreachable_by_group(dir: &Path, gid: u32) -> Vec<PathBuf> {
    let Ok(dir) = std::fs::canonicalize(dir) else {
        return Vec::new();
    };
    let mut blocked: Vec<PathBuf> = dir
        .ancestors()
        .filter(|d| {
            std::fs::metadata(d)
                .is_ok_and(|m| !group_may_traverse(m.permissions().mode(), m.gid(), gid))
        })
        .map(Path::to_path_buf)
        .collect();
    blocked.reverse();
    blocked
}

fn bind_in(
    temp_socket: &Path,
    group: Option<u32>,
) -> Result<std::os::unix::net::UnixListener, SocketError> {
    let listener = std::os::unix::net::UnixListener::bind(temp_socket)
        .map_err(io_step("bind", temp_socket))?;
    let (mode, _) = modes(group);
    if let Some(gid) = group {
        std::os::unix::fs::chown(temp_socket, None, Some(gid))
            .map_err(io_step("give the allowed group the socket", temp_socket))?;
    }
    std::fs::set_permissions(temp_socket, std::fs::Permissions::from_mode(mode))
        .map_err(io_step("chmod", temp_socket))?;
    listener
        .set_nonblocking(true)
        .map_err(io_step("set non-blocking", temp_socket))?;
    Ok(listener)
}

/// A fresh `0700` directory in `parent` and the socket path inside it.
fn private_dir(parent: &Path) -> Result<(PathBuf, PathBuf), SocketError> {
    let mut last = None;
    for _ in 0..16 {
        let dir = parent.join(format!(".csi-isolator-{:08x}", rand::random::<u32>()));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {
                let socket = dir.join("s");
                return Ok((dir, socket));
            }
            Err(e) if e.kind() == ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(io_step("create private directory", &dir)(e).into()),
        }
    }
    Err(io_step("create private directory in", parent)(
        last.expect("the loop ran and every attempt found the name taken"),
    )
    .into())
}

/// Removes a stale socket at `path`; refuses a live one and non-sockets.
fn remove_stale(path: &Path) -> Result<(), SocketError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_step("stat", path)(e).into()),
    };
    if !meta.file_type().is_socket() {
        return Err(SocketError::NotASocket {
            path: path.to_path_buf(),
        });
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => Err(SocketError::InUse {
            path: path.to_path_buf(),
        }),
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
            tracing::info!(path = %path.display(), "removing a stale service socket");
            match std::fs::remove_file(path) {
                Err(e) if e.kind() != ErrorKind::NotFound => {
                    Err(io_step("remove stale socket", path)(e).into())
                }
                _ => Ok(()),
            }
        }
        Err(e) => Err(io_step("probe existing socket", path)(e).into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_path_falls_back_when_too_long() {
        let short = Path::new("/var/lib/csi-isolator");
        assert_eq!(default_socket_path(short), short.join(SOCKET_NAME));
        let long = PathBuf::from(format!("/tmp/{}", "d".repeat(90)));
        let p = default_socket_path(&long);
        assert!(p.starts_with(SHORT_SERVICE_DIR), "{}", p.display());
        assert!(bind_path_len(&p) <= MAX_SOCKET_PATH);
        assert_eq!(p, default_socket_path(&long), "stable per work dir");
    }

    #[tokio::test]
    async fn binds_private_replaces_stale_refuses_live() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("x.sock");
        let (listener, guard) = bind(&path, None).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let parent = std::fs::metadata(path.parent().unwrap()).unwrap();
        assert_eq!(parent.permissions().mode() & 0o777, 0o700);
        // Nothing but the socket is left in its directory.
        assert_eq!(
            std::fs::read_dir(path.parent().unwrap()).unwrap().count(),
            1
        );
        assert!(matches!(bind(&path, None), Err(SocketError::InUse { .. })));
        // A dead listener leaves a stale socket, which the next bind replaces.
        drop(listener);
        std::mem::forget(guard);
        let (_listener, guard) = bind(&path, None).unwrap();
        drop(guard);
        assert!(!path.exists(), "the guard removes the socket");
        std::fs::write(&path, b"x").unwrap();
        assert!(matches!(
            bind(&path, None),
            Err(SocketError::NotASocket { .. })
        ));
    }

    #[tokio::test]
    async fn with_a_group_the_socket_and_its_new_directories_are_the_groups_only() {
        csi_isolator_testing::require_root();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a").join("b").join("x.sock");
        let gid = 4242;
        let (_listener, _guard) = bind(&path, Some(gid)).unwrap();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert_eq!(
            (meta.permissions().mode() & 0o777, meta.uid(), meta.gid()),
            (0o660, 0, gid)
        );
        for d in [dir.path().join("a"), dir.path().join("a/b")] {
            let m = std::fs::metadata(&d).unwrap();
            assert_eq!(
                (m.permissions().mode() & 0o777, m.uid(), m.gid()),
                (0o710, 0, gid),
                "{}",
                d.display()
            );
        }
        assert_eq!(
            unreachable_by_group(&dir.path().join("a/b"), gid),
            Vec::<PathBuf>::new()
        );
        // A directory on the way that the group cannot search is named.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        assert_eq!(
            unreachable_by_group(&dir.path().join("a/b"), gid),
            vec![std::fs::canonicalize(dir.path()).unwrap()]
        );
    }

    #[test]
    fn group_traversal_follows_the_mode_bits_that_apply() {
        for (mode, owner_gid, gid, ok) in [
            (0o710, 5, 5, true),
            (0o700, 5, 5, false),
            (0o701, 5, 5, false),
            (0o711, 0, 5, true),
            (0o770, 0, 5, false),
            (0o755, 0, 5, true),
            (0o1777, 0, 5, true),
        ] {
            assert_eq!(
                group_may_traverse(mode, owner_gid, gid),
                ok,
                "{mode:o} group {owner_gid} for {gid}"
            );
        }
    }
}
