//! The paths a container checkpoint names, checked before anything is unmounted, removed or signalled
//! on their behalf.
//!
//! Threat model: a checkpoint read back from `<work_dir>/isolators/volume/csi/<id>/state.json` may have
//! been written by an older version, left corrupt by a bug, or planted by whoever got write access to
//! the work dir. Recovery and cleanup act on what it names (they sweep mounts under its sandbox and
//! unmount its host binds), so a record must not be able to point them at the host: a sandbox of `/`,
//! `<work_dir>/sandboxes/../../x`, the work dir itself, or a path with a symlink swapped into it.
//!
//! Two halves:
//! - [`check_record`], pure: every path is absolute and already normal (no empty, `.` or `..`
//!   component, no NUL, not `/`); the sandbox neither holds the work dir nor lies in the work dir's
//!   own state, and a sandbox inside the work dir is exactly the one its front-end makes for that
//!   container (`sandboxes/<id>` for `run`, `oci-hook/<id>` for the OCI hook); every host bind lies
//!   strictly beneath the sandbox. Paths are compared component by component, never as string
//!   prefixes.
//! - [`open_sandbox`] and [`check_host_bind`], on the real file system: the sandbox is opened from its
//!   expected root (the work dir when it lies inside it, else `/`) with
//!   `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS)` ([`crate::mount::open_beneath_no_symlinks`]), and
//!   each host bind from the sandbox's own fd the same way, so a symlink anywhere on those paths is
//!   refused and containment is decided by the kernel, not by a string.
//!
//! A record that fails is refused whole: nothing it names is unmounted, removed or signalled.

use std::ffi::OsStr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;

use crate::isolator::record::ContainerRecord;
use crate::mount::{fd_path, open_beneath_no_symlinks, MountError};
use crate::shown::shown_os;
pub use crate::workdir::{HOOK_DIR, RUN_SANDBOXES};

/// Directories of the work dir that hold its own state: never a sandbox, nor inside one.
const STATE_DIRS: &[&str] = &[crate::resource::CSI_DIR, crate::workdir::ISOLATORS_DIR];

/// Why a path read back from a container checkpoint is refused. Each names the field and the path
/// (shown escaped: it is untrusted).
#[derive(Debug, thiserror::Error)]
pub enum CheckpointPathError {
    /// The path is not absolute and normal.
    #[error("{field} {path}: {reason}")]
    NotNormal {
        /// `sandbox`, `rootfs` or `host bind`.
        field: &'static str,
        /// The path, escaped.
        path: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The sandbox is the work dir or one of its ancestors: sweeping it would take the work dir's mounts.
    #[error("sandbox {path} holds the work dir {work_dir}")]
    HoldsWorkDir {
        /// The sandbox, escaped.
        path: String,
        /// The work dir.
        work_dir: String,
    },
    /// The sandbox lies inside the work dir, but is not the one its front-end makes for the container.
    #[error("sandbox {path} lies inside the work dir but is not {expected}, the sandbox of container {container}")]
    NotItsSandbox {
        /// The sandbox, escaped.
        path: String,
        /// The container id, escaped.
        container: String,
        /// What it would have to be (or the areas it may be in).
        expected: String,
    },
    /// A host bind is not strictly beneath the record's sandbox.
    #[error("host bind {path} is not beneath the sandbox {sandbox}")]
    BindOutsideSandbox {
        /// The host bind, escaped.
        path: String,
        /// The sandbox, escaped.
        sandbox: String,
    },
    /// The path could not be opened beneath its root without following a symlink (ELOOP: a symlink
    /// is on it).
    #[error("open {field} {path} beneath {root} without following symlinks")]
    Resolve {
        /// `sandbox` or `host bind`.
        field: &'static str,
        /// The path, escaped.
        path: String,
        /// The root it was resolved beneath.
        root: String,
        /// The resolver's error.
        #[source]
        source: Box<MountError>,
    },
    /// The path exists but goes through a symlink (it is not the kernel's name for the directory).
    #[error("{field} {path} is not canonical: it resolves to {actual}")]
    NotCanonical {
        /// `sandbox` or `rootfs`.
        field: &'static str,
        /// The path, escaped.
        path: String,
        /// Where it resolves, escaped.
        actual: String,
    },
    /// The kernel names what was opened differently from the recorded path (it is not where the
    /// record says).
    #[error("{field} {path} opened as {actual}")]
    Elsewhere {
        /// `sandbox` or `host bind`.
        field: &'static str,
        /// The path, escaped.
        path: String,
        /// The kernel's name for the opened fd, escaped.
        actual: String,
    },
}

fn show(path: &Path) -> String {
    shown_os(path.as_os_str()).into_owned()
}

/// Checks that `path` is absolute and already normal: it starts with `/`, is not `/`, holds no NUL
/// and no empty, `.` or `..` component (so `//`, a trailing `/` and `/./` are refused too: a
/// checkpoint only ever holds paths in the form the kernel names them).
pub fn check_normal(field: &'static str, path: &Path) -> Result<(), CheckpointPathError> {
    let bytes = path.as_os_str().as_bytes();
    let refuse = |reason| {
        Err(CheckpointPathError::NotNormal {
            field,
            path: show(path),
            reason,
        })
    };
    if bytes.contains(&0) {
        return refuse("it contains a NUL byte");
    }
    let Some(rest) = bytes.strip_prefix(b"/") else {
        return refuse("it is not absolute");
    };
    if rest.is_empty() {
        return refuse("it is the root directory");
    }
    for component in rest.split(|b| *b == b'/') {
        match component {
            b"" => return refuse("it holds an empty component ('//' or a trailing '/')"),
            b"." => return refuse("it holds a '.' component"),
            b".." => return refuse("it holds a '..' component"),
            _ => {}
        }
    }
    Ok(())
}

/// The normal components of a path (what [`check_normal`] admits holds nothing else).
fn names(path: &Path) -> Vec<&OsStr> {
    path.components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n),
            _ => None,
        })
        .collect()
}

/// `path`'s components after `base`'s, if `path` is `base` or beneath it (compared component by
/// component).
fn beneath<'a>(path: &'a Path, base: &Path) -> Option<Vec<&'a OsStr>> {
    let p = names(path);
    let b = names(base);
    (p.len() >= b.len() && p[..b.len()] == b[..]).then(|| p[b.len()..].to_vec())
}

/// `run`'s sandbox for `container`: `<work_dir>/sandboxes/<container>`.
pub fn run_sandbox(work_dir: &Path, container: &str) -> PathBuf {
    work_dir.join(RUN_SANDBOXES).join(container)
}

/// Whether `rec` is a container of `run` on `work_dir`: its container id is valid (one path
/// component: an absolute id would replace the whole path when joined) and its sandbox is exactly
/// `<work_dir>/sandboxes/<container id>`, byte for byte (a sandbox written any other way, e.g. with
/// a `..` in it, is not).
pub fn is_run_container(rec: &ContainerRecord, work_dir: &Path) -> bool {
    crate::resource::validate_container_id(&rec.container_id).is_ok()
        && rec.config.sandbox.as_os_str() == run_sandbox(work_dir, &rec.container_id).as_os_str()
}

/// The OCI hook's directory for `container`: `<work_dir>/oci-hook/<container>`.
pub fn hook_sandbox(work_dir: &Path, container: &str) -> PathBuf {
    work_dir.join(HOOK_DIR).join(container)
}

/// Whether `rec` is a container of the OCI hook on `work_dir`: the same rule as
/// [`is_run_container`], with the sandbox exactly `<work_dir>/oci-hook/<container id>`.
pub fn is_hook_container(rec: &ContainerRecord, work_dir: &Path) -> bool {
    crate::resource::validate_container_id(&rec.container_id).is_ok()
        && rec.config.sandbox.as_os_str() == hook_sandbox(work_dir, &rec.container_id).as_os_str()
}

/// The pure half (see the module doc): `rec`'s sandbox, rootfs and host binds, against the work dir
/// `work_dir` (trusted, as the operator gave it).
pub fn check_record(rec: &ContainerRecord, work_dir: &Path) -> Result<(), CheckpointPathError> {
    let sandbox = &rec.config.sandbox;
    check_normal("sandbox", sandbox)?;
    if let Some(rootfs) = &rec.config.rootfs {
        check_normal("rootfs", rootfs)?;
    }
    if beneath(work_dir, sandbox).is_some() {
        return Err(CheckpointPathError::HoldsWorkDir {
            path: show(sandbox),
            work_dir: show(work_dir),
        });
    }
    if let Some(rel) = beneath(sandbox, work_dir) {
        let id = OsStr::new(&rec.container_id);
        let own = [RUN_SANDBOXES, HOOK_DIR]
            .iter()
            .any(|area| rel.len() == 2 && rel[0] == OsStr::new(area) && rel[1] == id);
        if !own {
            let expected = match rel.first() {
                Some(area) if *area == OsStr::new(HOOK_DIR) => {
                    show(&work_dir.join(HOOK_DIR).join(id))
                }
                Some(area) if STATE_DIRS.iter().any(|s| *area == OsStr::new(s)) => {
                    format!(
                        "{} (it lies in the work dir's own state)",
                        show(&run_sandbox(work_dir, &rec.container_id))
                    )
                }
                _ => show(&run_sandbox(work_dir, &rec.container_id)),
            };
            return Err(CheckpointPathError::NotItsSandbox {
                path: show(sandbox),
                container: shown_os(id).into_owned(),
                expected,
            });
        }
    }
    for bind in &rec.host_binds {
        check_normal("host bind", bind)?;
        if beneath(bind, sandbox).is_none_or(|rel| rel.is_empty()) {
            return Err(CheckpointPathError::BindOutsideSandbox {
                path: show(bind),
                sandbox: show(sandbox),
            });
        }
    }
    Ok(())
}

/// Checks, when `path` exists, that it is canonical (no symlink on it), as a path must be for a later
/// read-back to resolve it without following symlinks. A missing path passes (nothing is there to
/// mount under).
pub fn check_canonical(field: &'static str, path: &Path) -> Result<(), CheckpointPathError> {
    match std::fs::canonicalize(path) {
        Ok(actual) if actual.as_os_str() != path.as_os_str() => {
            Err(CheckpointPathError::NotCanonical {
                field,
                path: show(path),
                actual: show(&actual),
            })
        }
        _ => Ok(()),
    }
}

/// Opens `rel` (normal components only) beneath `root` following no symlink
/// ([`open_beneath_no_symlinks`]): `None` if it does not exist; a symlink on it is refused.
fn open_beneath(
    field: &'static str,
    path: &Path,
    root: &Path,
    rel: &[&OsStr],
) -> Result<Option<OwnedFd>, CheckpointPathError> {
    let rel: PathBuf = rel.iter().collect();
    match open_beneath_no_symlinks(root, &rel) {
        Ok(fd) => Ok(Some(fd)),
        Err(MountError::Resolve {
            errno: Errno::ENOENT,
            ..
        }) => Ok(None),
        Err(source) => Err(CheckpointPathError::Resolve {
            field,
            path: show(path),
            root: show(root),
            source: Box::new(source),
        }),
    }
}

/// The kernel's name for `fd` must be `expected`.
fn check_named(
    field: &'static str,
    path: &Path,
    fd: &OwnedFd,
    expected: &Path,
) -> Result<PathBuf, CheckpointPathError> {
    let actual = fd_path(fd.as_fd()).map_err(|source| CheckpointPathError::Resolve {
        field,
        path: show(path),
        root: "/proc/self/fd".to_string(),
        source: Box::new(source),
    })?;
    if actual.as_os_str() != expected.as_os_str() {
        return Err(CheckpointPathError::Elsewhere {
            field,
            path: show(path),
            actual: show(&actual),
        });
    }
    Ok(actual)
}

/// The sandbox of a record that passed [`check_record`], opened by fd beneath its expected root (the
/// work dir when it lies inside it, else `/`) following no symlink, with the kernel's name for it
/// (what the mount table calls it). `None` when it does not exist (nothing can be mounted under it).
pub fn open_sandbox(
    rec: &ContainerRecord,
    work_dir: &Path,
) -> Result<Option<(OwnedFd, PathBuf)>, CheckpointPathError> {
    let sandbox = &rec.config.sandbox;
    let (root, rel) = match beneath(sandbox, work_dir) {
        Some(rel) => (work_dir.to_path_buf(), rel),
        None => (PathBuf::from("/"), names(sandbox)),
    };
    let Some(fd) = open_beneath("sandbox", sandbox, &root, &rel)? else {
        return Ok(None);
    };
    // The root is trusted; its kernel name plus the components resolved beneath it is where the
    // sandbox must be.
    let root_name = std::fs::canonicalize(&root).map_err(|e| CheckpointPathError::Resolve {
        field: "sandbox",
        path: show(sandbox),
        root: show(&root),
        source: Box::new(MountError::Resolve {
            step: "canonicalize root",
            root: root.clone(),
            path: sandbox.clone(),
            errno: Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)),
        }),
    })?;
    let expected: PathBuf = root_name.join(rel.iter().collect::<PathBuf>());
    let name = check_named("sandbox", sandbox, &fd, &expected)?;
    Ok(Some((fd, name)))
}

/// A host bind of a record that passed [`check_record`], checked beneath the sandbox's fd (from
/// [`open_sandbox`], whose kernel name is `sandbox_name`) following no symlink; returns the kernel's
/// name for it, or `None` when it does not exist. A bind of a file is checked through its parent
/// directory, and must not itself be a symlink.
pub fn check_host_bind(
    rec: &ContainerRecord,
    sandbox_fd: &OwnedFd,
    sandbox_name: &Path,
    bind: &Path,
) -> Result<Option<PathBuf>, CheckpointPathError> {
    let rel = beneath(bind, &rec.config.sandbox).unwrap_or_default();
    let Some((last, parents)) = rel.split_last() else {
        return Err(CheckpointPathError::BindOutsideSandbox {
            path: show(bind),
            sandbox: show(&rec.config.sandbox),
        });
    };
    let expected = sandbox_name.join(rel.iter().collect::<PathBuf>());
    let root = crate::mount::proc_fd_path(sandbox_fd.as_fd());
    match open_beneath("host bind", bind, &root, &rel) {
        Ok(Some(fd)) => return check_named("host bind", bind, &fd, &expected).map(Some),
        Ok(None) => return Ok(None),
        Err(CheckpointPathError::Resolve { source, .. })
            if matches!(
                *source,
                MountError::Resolve {
                    errno: Errno::ENOTDIR,
                    ..
                }
            ) => {}
        Err(e) => return Err(e),
    }
    // Not a directory: a bind of a file. Its parent must resolve like a directory bind, and the
    // name itself must not be a symlink.
    let Some(parent) = open_beneath("host bind", bind, &root, parents)? else {
        return Ok(None);
    };
    check_named(
        "host bind",
        bind,
        &parent,
        expected.parent().unwrap_or(sandbox_name),
    )?;
    let st = nix::sys::stat::fstatat(&parent, *last, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
        .map_err(|errno| CheckpointPathError::Resolve {
            field: "host bind",
            path: show(bind),
            root: show(sandbox_name),
            source: Box::new(MountError::Resolve {
                step: "fstatat",
                root: sandbox_name.to_path_buf(),
                path: bind.to_path_buf(),
                errno,
            }),
        })?;
    let kind =
        nix::sys::stat::SFlag::from_bits_truncate(st.st_mode) & nix::sys::stat::SFlag::S_IFMT;
    if kind == nix::sys::stat::SFlag::S_IFLNK {
        return Err(CheckpointPathError::Resolve {
            field: "host bind",
            path: show(bind),
            root: show(sandbox_name),
            source: Box::new(MountError::Resolve {
                step: "fstatat",
                root: sandbox_name.to_path_buf(),
                path: bind.to_path_buf(),
                errno: Errno::ELOOP,
            }),
        });
    }
    Ok(Some(expected))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error_chain::FullMessage;
    use crate::isolator::ContainerConfig;

    const WORK: &str = "/var/lib/csi-isolator";

    fn record(id: &str, sandbox: &str, rootfs: Option<&str>, binds: &[&str]) -> ContainerRecord {
        let config = ContainerConfig {
            sandbox: PathBuf::from(sandbox),
            rootfs: rootfs.map(PathBuf::from),
            ..ContainerConfig::default()
        };
        ContainerRecord {
            host_binds: binds.iter().map(PathBuf::from).collect(),
            binds_in_sandbox: true,
            ..ContainerRecord::new(id, config, Vec::new())
        }
    }

    #[test]
    fn normal_paths_table() {
        for (path, ok) in [
            ("/a", true),
            ("/a/b c/d", true),
            ("/a/...", true),
            ("/a/.hidden", true),
            ("", false),
            ("/", false),
            ("a/b", false),
            ("./a", false),
            ("//a", false),
            ("/a//b", false),
            ("/a/", false),
            ("/a/./b", false),
            ("/a/.", false),
            ("/a/../b", false),
            ("/..", false),
            ("/a/b\0c", false),
        ] {
            assert_eq!(
                check_normal("sandbox", Path::new(path)).is_ok(),
                ok,
                "{path:?}"
            );
        }
    }

    #[test]
    fn record_table() {
        let hook = format!("{WORK}/{HOOK_DIR}/c1");
        let run = format!("{WORK}/sandboxes/c1");
        let cases: Vec<(&str, ContainerRecord, Option<&str>)> = vec![
            ("run's own sandbox", record("c1", &run, None, &[]), None),
            (
                "the hook's own dir",
                record("c1", &hook, Some("/b/rootfs"), &[]),
                None,
            ),
            (
                "a sandbox outside the work dir",
                record(
                    "c1",
                    "/mesos/runs/c1",
                    None,
                    &["/mesos/runs/c1/data", "/mesos/runs/c1/a/b"],
                ),
                None,
            ),
            (
                "a sibling whose name extends the work dir's",
                record("c1", "/var/lib/csi-isolator2/x", None, &[]),
                None,
            ),
            (
                "sandbox '/'",
                record("c1", "/", None, &[]),
                Some("root directory"),
            ),
            (
                "relative sandbox",
                record("c1", "sandboxes/c1", None, &[]),
                Some("not absolute"),
            ),
            (
                "'..' in the sandbox",
                record("c1", &format!("{WORK}/sandboxes/../../decoy"), None, &[]),
                Some("'..'"),
            ),
            (
                "'.' in the sandbox",
                record("c1", &format!("{WORK}/sandboxes/./c1"), None, &[]),
                Some("'.'"),
            ),
            (
                "NUL in the sandbox",
                record("c1", &format!("{WORK}/sandboxes/c1\0x"), None, &[]),
                Some("NUL"),
            ),
            (
                "the work dir",
                record("c1", WORK, None, &[]),
                Some("holds the work dir"),
            ),
            (
                "an ancestor of the work dir",
                record("c1", "/var/lib", None, &[]),
                Some("holds the work dir"),
            ),
            (
                "another container's run sandbox",
                record("c1", &format!("{WORK}/sandboxes/c2"), None, &[]),
                Some("is not /var/lib/csi-isolator/sandboxes/c1"),
            ),
            (
                "below run's sandbox",
                record("c1", &format!("{WORK}/sandboxes/c1/x"), None, &[]),
                Some("is not"),
            ),
            (
                "the sandboxes dir",
                record("c1", &format!("{WORK}/sandboxes"), None, &[]),
                Some("is not"),
            ),
            (
                "another hook container's dir",
                record("c1", &format!("{WORK}/{HOOK_DIR}/c2"), None, &[]),
                Some("oci-hook/c1"),
            ),
            (
                "inside csi/",
                record("c1", &format!("{WORK}/csi/x/y"), None, &[]),
                Some("own state"),
            ),
            (
                "inside isolators/",
                record("c1", &format!("{WORK}/isolators/volume/csi/c1"), None, &[]),
                Some("own state"),
            ),
            (
                "elsewhere in the work dir",
                record("c1", &format!("{WORK}/plugin"), None, &[]),
                Some("is not"),
            ),
            (
                "'..' in the rootfs",
                record("c1", &run, Some("/b/../etc"), &[]),
                Some("rootfs"),
            ),
            (
                "relative rootfs",
                record("c1", &run, Some("rootfs"), &[]),
                Some("rootfs"),
            ),
            (
                "a host bind outside the sandbox",
                record("c1", "/s/c1", None, &["/decoy"]),
                Some("not beneath"),
            ),
            (
                "a host bind in a sibling with a longer name",
                record("c1", "/s/c1", None, &["/s/c10/x"]),
                Some("not beneath"),
            ),
            (
                "a host bind that is the sandbox",
                record("c1", "/s/c1", None, &["/s/c1"]),
                Some("not beneath"),
            ),
            (
                "a host bind with '..'",
                record("c1", "/s/c1", None, &["/s/c1/../../decoy"]),
                Some("'..'"),
            ),
            (
                "a relative host bind",
                record("c1", "/s/c1", None, &["data"]),
                Some("not absolute"),
            ),
            (
                "a host bind '/'",
                record("c1", "/s/c1", None, &["/"]),
                Some("root directory"),
            ),
        ];
        for (what, rec, refused) in cases {
            let got = check_record(&rec, Path::new(WORK));
            match (refused, got) {
                (None, Ok(())) => {}
                (Some(says), Err(e)) => {
                    let msg = e.full_message();
                    assert!(msg.contains(says), "{what}: {msg:?} does not say {says:?}");
                    assert!(!msg.contains('\0'), "{what}: {msg:?}");
                }
                (None, Err(e)) => panic!("{what}: refused: {e}"),
                (Some(says), Ok(())) => panic!("{what}: accepted, expected {says:?}"),
            }
        }
    }

    #[test]
    fn run_containers_are_named_exactly() {
        let w = Path::new(WORK);
        assert!(is_run_container(
            &record("c1", &format!("{WORK}/sandboxes/c1"), None, &[]),
            w
        ));
        for other in [
            format!("{WORK}/sandboxes/c2"),
            format!("{WORK}/sandboxes/../sandboxes/c1"),
            format!("{WORK}/sandboxes//c1"),
            format!("{WORK}/sandboxes/c1/"),
            format!("{WORK}/{HOOK_DIR}/c1"),
        ] {
            assert!(
                !is_run_container(&record("c1", &other, None, &[]), w),
                "{other}"
            );
        }
        // An id that is a path replaces the work dir when joined: never run's.
        assert!(!is_run_container(
            &record("/srv/s/c1", "/srv/s/c1", None, &[]),
            w
        ));
        assert!(!is_run_container(
            &record("../c1", &format!("{WORK}/c1"), None, &[]),
            w
        ));
    }

    #[test]
    fn hook_containers_are_named_exactly() {
        let w = Path::new(WORK);
        assert!(is_hook_container(
            &record("c1", &format!("{WORK}/{HOOK_DIR}/c1"), None, &[]),
            w
        ));
        for (id, other) in [
            ("c1", format!("{WORK}/{HOOK_DIR}/../../decoy")),
            ("c1", format!("{WORK}/{HOOK_DIR}/c1/..")),
            ("c1", format!("{WORK}/{HOOK_DIR}/../{HOOK_DIR}/c1")),
            ("c1", format!("{WORK}/{HOOK_DIR}")),
            ("c1", format!("{WORK}/{HOOK_DIR}/c1/x")),
            ("c1", format!("{WORK}/{HOOK_DIR}/c2")),
            ("c1", format!("{WORK}/sandboxes/c1")),
            ("c1", format!("/v/{HOOK_DIR}/c1")),
            ("..", format!("{WORK}/{HOOK_DIR}/..")),
            ("", format!("{WORK}/{HOOK_DIR}/")),
        ] {
            assert!(
                !is_hook_container(&record(id, &other, None, &[]), w),
                "{id} {other}"
            );
        }
    }

    /// The I/O half on a real tree (no root needed): a symlink anywhere on the sandbox or a host
    /// bind is refused; plain directories and files pass; what is missing is `None`.
    #[test]
    fn symlinks_on_checkpointed_paths_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(tmp.path()).unwrap();
        let work = base.join("work");
        let decoy = base.join("decoy");
        std::fs::create_dir_all(work.join("sandboxes/c1/data")).unwrap();
        std::fs::write(work.join("sandboxes/c1/file"), b"").unwrap();
        std::fs::create_dir_all(decoy.join("m")).unwrap();
        std::os::unix::fs::symlink(&decoy, work.join("sandboxes/c2")).unwrap();
        std::os::unix::fs::symlink(&decoy, work.join("sandboxes/c1/link")).unwrap();
        std::os::unix::fs::symlink(decoy.join("m"), work.join("sandboxes/c1/flink")).unwrap();

        let s = |id: &str| format!("{}/sandboxes/{id}", work.display());
        let good = record("c1", &s("c1"), None, &[]);
        check_record(&good, &work).unwrap();
        let (fd, name) = open_sandbox(&good, &work).unwrap().expect("sandbox exists");
        assert_eq!(name, work.join("sandboxes/c1"));
        let bind = |rel: &str| work.join("sandboxes/c1").join(rel);
        assert_eq!(
            check_host_bind(&good, &fd, &name, &bind("data")).unwrap(),
            Some(bind("data"))
        );
        assert_eq!(
            check_host_bind(&good, &fd, &name, &bind("file")).unwrap(),
            Some(bind("file"))
        );
        assert_eq!(
            check_host_bind(&good, &fd, &name, &bind("missing/x")).unwrap(),
            None
        );
        for rel in ["link", "link/m", "flink"] {
            let err = check_host_bind(&good, &fd, &name, &bind(rel)).unwrap_err();
            assert!(
                err.full_message()
                    .contains("Too many levels of symbolic links")
                    || err.full_message().contains("ELOOP"),
                "{rel}: {err}"
            );
        }

        // The sandbox itself swapped for a symlink.
        let swapped = record("c2", &s("c2"), None, &[]);
        check_record(&swapped, &work).unwrap();
        let err = open_sandbox(&swapped, &work).unwrap_err();
        assert!(matches!(err, CheckpointPathError::Resolve { .. }), "{err}");
        // A sandbox outside the work dir with a symlink on its way.
        let outside = record(
            "c3",
            &format!("{}/m", work.join("sandboxes/c2").display()),
            None,
            &[],
        );
        check_record(&outside, &work).unwrap_err();
        let via_link = record(
            "c3",
            &format!("{}/m", base.join("alias").display()),
            None,
            &[],
        );
        std::os::unix::fs::symlink(&decoy, base.join("alias")).unwrap();
        check_record(&via_link, &work).unwrap();
        assert!(open_sandbox(&via_link, &work).is_err());
        // What prepare records must be canonical: a path through a symlink is refused, a
        // canonical or missing one passes.
        let err = check_canonical("sandbox", &base.join("alias/m")).unwrap_err();
        assert!(err.full_message().contains("not canonical"), "{err}");
        check_canonical("sandbox", &work.join("sandboxes/c1")).unwrap();
        check_canonical("sandbox", &work.join("sandboxes/missing")).unwrap();
        // Missing: nothing to do.
        assert!(open_sandbox(&record("c4", &s("c4"), None, &[]), &work)
            .unwrap()
            .is_none());
    }
}
