//! The one error type of the `launcher` module: one variant per failing step, each naming the volume, path or
//! process it failed on.

use std::ffi::OsString;
use std::fmt;
use std::io;
use std::path::PathBuf;

use nix::errno::Errno;
use nix::sys::signal::Signal;

use crate::mount::MountError;
use crate::mount::VolumeMount;

/// Names one volume mount in messages: `volume 'vol-1' at /data in container root /x/rootfs`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeRef {
    /// The volume id, if the mount has one.
    pub volume_id: Option<String>,
    /// The `container_path` as written in the resource.
    pub container_path: String,
    /// The root the target is resolved in (host sandbox, rootfs, `/`, or `/proc/<pid>/root`).
    pub root: PathBuf,
}

impl VolumeRef {
    /// The reference for `mount`, resolved in `root`.
    pub fn new(mount: &VolumeMount, root: impl Into<PathBuf>) -> Self {
        VolumeRef {
            volume_id: mount.volume_id.clone(),
            container_path: mount.container_path.clone(),
            root: root.into(),
        }
    }
}

impl fmt::Display for VolumeRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.volume_id {
            Some(id) => write!(f, "volume '{id}'")?,
            None => f.write_str("volume")?,
        }
        write!(
            f,
            " at {} in container root {}",
            self.container_path,
            self.root.display()
        )
    }
}

/// Every way launching a container, or mounting into a running one, can fail.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The spec has no program to run.
    #[error("launch: empty command")]
    EmptyCommand,
    /// An argument, environment entry or path cannot be passed to the kernel.
    #[error("launch: {what} contains a NUL byte: {value:?}")]
    NulByte {
        /// Which kind of string (argument, environment, path).
        what: &'static str,
        /// The offending value.
        value: OsString,
    },
    /// An environment variable name is empty or contains `=`.
    #[error("launch: invalid environment variable name {name:?}")]
    InvalidEnvName {
        /// The offending name.
        name: OsString,
    },
    /// A mount's root does not fit the container (a host target with a rootfs, a rootfs target without).
    #[error("mount {at}: {reason}")]
    RootMismatch {
        /// The mount.
        at: Box<VolumeRef>,
        /// What does not fit.
        reason: &'static str,
    },
    /// The dedicated launcher thread could not be started.
    #[error("spawn the launcher thread")]
    SpawnThread {
        /// The I/O error.
        source: io::Error,
    },
    /// The dedicated launcher thread panicked.
    #[error("the launcher thread panicked")]
    ThreadPanicked,
    /// `unshare` failed.
    #[error("unshare {namespace}: {errno}")]
    Unshare {
        /// What was unshared (`mount namespace`, `pid namespace`, `fs`).
        namespace: &'static str,
        /// The kernel's answer.
        errno: Errno,
    },
    /// Entering the launch seed's mount namespace failed.
    #[error("enter the launch seed's mount namespace")]
    EnterSeed {
        /// The mount error.
        source: MountError,
    },
    /// Making `/` recursively slave in the new mount namespace failed.
    #[error("make / recursively slave")]
    MakeRootSlave {
        /// The mount error.
        source: MountError,
    },
    /// Cloning the volume's source tree (open_tree) failed.
    #[error("mount {at}: clone source {source_path}")]
    CloneSource {
        /// The mount.
        at: Box<VolumeRef>,
        /// The host source.
        source_path: PathBuf,
        /// The mount error.
        source: MountError,
    },
    /// Making the detached tree (or the bind mount) read-only failed.
    #[error("mount {at}: make read-only")]
    SetReadonly {
        /// The mount.
        at: Box<VolumeRef>,
        /// The mount error.
        source: MountError,
    },
    /// Making the volume's host mount point shared (for rslave or rshared propagation) failed.
    #[error("mount {at}: share the volume's host mount point")]
    ShareHostMountPoint {
        /// The mount.
        at: Box<VolumeRef>,
        /// The mount error.
        source: MountError,
    },
    /// Giving the attached copy its propagation failed.
    #[error("mount {at}: make the container's copy {propagation}")]
    SetPropagation {
        /// The mount.
        at: Box<VolumeRef>,
        /// The propagation asked for.
        propagation: &'static str,
        /// The mount error.
        source: MountError,
    },
    /// Resolving (and creating) the target inside its root failed.
    #[error("mount {at}: resolve target")]
    ResolveTarget {
        /// The mount.
        at: Box<VolumeRef>,
        /// The mount error.
        source: MountError,
    },
    /// The target is not there and was not to be created: its root is the
    /// host's own `/` (an absolute container path without a rootfs), where
    /// nothing is ever created.
    #[error("mount {at}: the target does not exist on the host, and nothing is created on the host's own paths: use a relative container path (it lands in the sandbox), create the directory on the host, or give the container a rootfs")]
    TargetMissingOnHost {
        /// The mount.
        at: Box<VolumeRef>,
    },
    /// The target had to be created and its parent is on a read-only file
    /// system (a read-only rootfs or bind).
    #[error("mount {at}: the target does not exist and cannot be created there (read-only file system): create it in the root filesystem beforehand, or choose a container path on a writable one")]
    TargetParentReadOnly {
        /// The mount.
        at: Box<VolumeRef>,
        /// The mount error.
        #[source]
        source: MountError,
    },
    /// Attaching the tree onto the target (move_mount, or the bind fallback) failed.
    #[error("mount {at}: attach")]
    Attach {
        /// The mount.
        at: Box<VolumeRef>,
        /// The mount error.
        source: MountError,
    },
    /// A mount of the volume kept moving inside the container's namespace while being unmounted.
    #[error("unmount volume {source_path} from the mount namespace of pid {pid}: still mounted after its mount point moved")]
    VolumeStillMounted {
        /// The container's process.
        pid: u32,
        /// The volume's source on the host.
        source_path: PathBuf,
        /// Why the last attempt did not take it down.
        #[source]
        last: Box<StillMounted>,
    },
    /// The rootfs resolves to something that cannot be a container's root (the host's `/`, or not a
    /// directory).
    #[error("rootfs {rootfs} resolves to {resolved}, which cannot be a container's root")]
    BadRootfs {
        /// The rootfs as given.
        rootfs: PathBuf,
        /// What it resolves to.
        resolved: PathBuf,
    },
    /// A directory volume's target exists and is not a directory.
    #[error("mount {at}: the target is {kind}, not a directory: refused")]
    TargetNotADirectory {
        /// The mount.
        at: Box<VolumeRef>,
        /// What the target is.
        kind: &'static str,
    },
    /// A block volume's target exists and is not a regular file (its device file is bound onto one).
    #[error("mount {at}: the target is {kind}, not a regular file (where a block volume's device goes): refused")]
    TargetNotAFile {
        /// The mount.
        at: Box<VolumeRef>,
        /// What the target is.
        kind: &'static str,
    },
    /// The volume's host path is not of the volume's kind: a block volume's is not a block device, or
    /// another volume's is a device (which a container must never be handed by a bind).
    #[error("mount {at}: {what}: refused")]
    SourceKindMismatch {
        /// The mount.
        at: Box<VolumeRef>,
        /// What is wrong.
        what: &'static str,
    },
    /// Binding the rootfs onto itself (pivot_root needs a mount point) failed.
    #[error("bind rootfs {rootfs} onto itself")]
    BindRootfs {
        /// The rootfs.
        rootfs: PathBuf,
        /// The mount error.
        source: MountError,
    },
    /// Binding the sandbox at [`crate::mount::SANDBOX_IN_ROOTFS`] in the rootfs failed.
    #[error(
        "bind sandbox {sandbox} at {} in rootfs {rootfs}",
        crate::mount::SANDBOX_IN_ROOTFS
    )]
    BindSandbox {
        /// The host sandbox.
        sandbox: PathBuf,
        /// The rootfs.
        rootfs: PathBuf,
        /// The mount error (boxed: keeps the error small).
        source: Box<MountError>,
    },
    /// Opening a directory the child needs (its cwd, the `/proc` mount point) failed.
    #[error("open {what} {path}")]
    OpenDir {
        /// Which directory.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// The mount error.
        source: MountError,
    },
    /// Changing into a directory in the launcher thread failed.
    #[error("chdir to {path}: {errno}")]
    Chdir {
        /// The directory.
        path: PathBuf,
        /// The kernel's answer.
        errno: Errno,
    },
    /// pivot_root into the rootfs failed.
    #[error("pivot_root into {rootfs}")]
    PivotRoot {
        /// The rootfs.
        rootfs: PathBuf,
        /// The mount error.
        source: MountError,
    },
    /// Detaching the old root after pivot_root failed.
    #[error("detach the old root after pivot_root into {rootfs}")]
    DetachOldRoot {
        /// The rootfs.
        rootfs: PathBuf,
        /// The mount error.
        source: MountError,
    },
    /// Creating the child's status pipe failed.
    #[error("create the exec status pipe: {errno}")]
    Pipe {
        /// The kernel's answer.
        errno: Errno,
    },
    /// Starting the child (its stack's mapping or the clone) failed.
    #[error("start {program:?} (clone): {errno}")]
    Fork {
        /// The program.
        program: OsString,
        /// The kernel's answer.
        errno: Errno,
    },
    /// Reading the child's status pipe failed.
    #[error("read the exec status of pid {pid}: {errno}")]
    ReadStatus {
        /// The child.
        pid: u32,
        /// The kernel's answer.
        errno: Errno,
    },
    /// The child could not reset its signal mask.
    #[error("child: reset the signal mask: {errno}")]
    ChildSignals {
        /// The kernel's answer.
        errno: Errno,
    },
    /// The child could not mount `/proc` for its new pid namespace.
    #[error("child: mount proc at {path}: {errno}")]
    ChildMountProc {
        /// The mount point, as the container sees it.
        path: PathBuf,
        /// The kernel's answer.
        errno: Errno,
    },
    /// The child could not change into its working directory.
    #[error("child: chdir to {path}: {errno}")]
    ChildChdir {
        /// The working directory, as the container sees it.
        path: PathBuf,
        /// The kernel's answer.
        errno: Errno,
    },
    /// The child could not take the workload's user and group.
    #[error("run the workload as uid {uid} gid {gid} ({call}): {errno}")]
    ChildUser {
        /// The user id asked for.
        uid: u32,
        /// The group id asked for.
        gid: u32,
        /// The call that failed.
        call: &'static str,
        /// The kernel's answer.
        errno: Errno,
    },
    /// The child's exec failed (for every PATH candidate).
    #[error("exec {program:?}: {errno}")]
    Exec {
        /// The program as given (argv\[0\]).
        program: OsString,
        /// The kernel's answer (EACCES if any candidate said so, else the last one).
        errno: Errno,
    },
    /// The child reported a step this launcher does not know (a bug).
    #[error("child reported unknown step {step}: {errno}")]
    UnknownChildStep {
        /// The raw step code.
        step: u32,
        /// The kernel's answer.
        errno: Errno,
    },
    /// waitpid failed.
    #[error("wait for pid {pid}: {errno}")]
    Wait {
        /// The child.
        pid: u32,
        /// The kernel's answer.
        errno: Errno,
    },
    /// Sending a signal failed.
    #[error("send {signal} to pid {pid}: {errno}")]
    Kill {
        /// The child.
        pid: u32,
        /// The signal.
        signal: Signal,
        /// The kernel's answer.
        errno: Errno,
    },
    /// The child was already reaped: its pid may belong to another process now.
    #[error("pid {pid} was already reaped")]
    Reaped {
        /// The child.
        pid: u32,
    },
    /// Opening `/proc/<pid>/ns/mnt` failed.
    #[error("open the mount namespace of pid {pid}: {errno}")]
    OpenNamespace {
        /// The container's process.
        pid: u32,
        /// The kernel's answer.
        errno: Errno,
    },
    /// Opening the container's sandbox inside its root failed.
    #[error("open sandbox {sandbox} inside the root of pid {pid}")]
    OpenSandbox {
        /// The container's process.
        pid: u32,
        /// The sandbox as the container sees it.
        sandbox: PathBuf,
        /// The mount error.
        source: MountError,
    },
    /// Entering the container's mount namespace failed.
    #[error("enter the mount namespace of pid {pid}")]
    EnterNamespace {
        /// The container's process.
        pid: u32,
        /// The mount error.
        source: MountError,
    },
    /// Unmounting from a running container failed.
    #[error("unmount {target} in the mount namespace of pid {pid}")]
    Unmount {
        /// The container's process.
        pid: u32,
        /// The mount point, as the container sees it.
        target: PathBuf,
        /// The mount error.
        source: MountError,
    },
    /// What is mounted at the target is not the volume (something else was mounted over it, or the
    /// volume's mount point was moved away): nothing is unmounted.
    #[error("unmount {target} in the mount namespace of pid {pid}: the mount there is not the volume's ({source_path}): nothing unmounted")]
    NotTheVolume {
        /// The container's process.
        pid: u32,
        /// The mount point, as the container sees it.
        target: PathBuf,
        /// The volume's source on the host.
        source_path: PathBuf,
    },
}

impl LaunchError {
    /// The kernel errno behind this error, if there is one.
    pub fn errno(&self) -> Option<Errno> {
        match self {
            LaunchError::Unshare { errno, .. }
            | LaunchError::Chdir { errno, .. }
            | LaunchError::Pipe { errno }
            | LaunchError::Fork { errno, .. }
            | LaunchError::ReadStatus { errno, .. }
            | LaunchError::ChildSignals { errno }
            | LaunchError::ChildMountProc { errno, .. }
            | LaunchError::ChildChdir { errno, .. }
            | LaunchError::ChildUser { errno, .. }
            | LaunchError::Exec { errno, .. }
            | LaunchError::UnknownChildStep { errno, .. }
            | LaunchError::Wait { errno, .. }
            | LaunchError::Kill { errno, .. }
            | LaunchError::OpenNamespace { errno, .. } => Some(*errno),
            LaunchError::MakeRootSlave { source }
            | LaunchError::EnterSeed { source }
            | LaunchError::CloneSource { source, .. }
            | LaunchError::SetReadonly { source, .. }
            | LaunchError::ShareHostMountPoint { source, .. }
            | LaunchError::SetPropagation { source, .. }
            | LaunchError::ResolveTarget { source, .. }
            | LaunchError::TargetParentReadOnly { source, .. }
            | LaunchError::Attach { source, .. }
            | LaunchError::BindRootfs { source, .. }
            | LaunchError::OpenDir { source, .. }
            | LaunchError::PivotRoot { source, .. }
            | LaunchError::DetachOldRoot { source, .. }
            | LaunchError::OpenSandbox { source, .. }
            | LaunchError::EnterNamespace { source, .. }
            | LaunchError::Unmount { source, .. } => source.errno(),
            LaunchError::BindSandbox { source, .. } => source.errno(),
            LaunchError::SpawnThread { source } => source.raw_os_error().map(Errno::from_raw),
            LaunchError::TargetMissingOnHost { .. } => Some(Errno::ENOENT),
            LaunchError::EmptyCommand
            | LaunchError::NulByte { .. }
            | LaunchError::InvalidEnvName { .. }
            | LaunchError::RootMismatch { .. }
            | LaunchError::ThreadPanicked
            | LaunchError::NotTheVolume { .. }
            | LaunchError::BadRootfs { .. }
            | LaunchError::VolumeStillMounted { .. }
            | LaunchError::TargetNotADirectory { .. }
            | LaunchError::TargetNotAFile { .. }
            | LaunchError::SourceKindMismatch { .. }
            | LaunchError::Reaped { .. } => None,
        }
    }
}

/// Why the last sweep of a volume's moved mounts in a container did not take it down (see
/// [`LaunchError::VolumeStillMounted`]).
#[derive(Debug, thiserror::Error)]
pub enum StillMounted {
    /// The mount moved again between two reads of the container's mount table.
    #[error("it was moved again between two reads of the mount table")]
    MovedAgain,
    /// The directory holding the moved mount could not be opened (moved again, or a symlink now).
    #[error("open the directory of {}", path.display())]
    OpenParent {
        /// The mount point, as the container's table names it.
        path: PathBuf,
        /// The mount error.
        #[source]
        source: MountError,
    },
    /// What is mounted on top at the mount point is not the volume.
    #[error("what is mounted on top at {} is not the volume", path.display())]
    NotTheVolume {
        /// The mount point, as the container's table names it.
        path: PathBuf,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error_chain::FullMessage;
    use crate::mount::TargetRoot;

    fn mount(id: Option<&str>) -> VolumeMount {
        VolumeMount {
            source: PathBuf::from("/src"),
            source_root: None,
            root: TargetRoot::Rootfs,
            target: PathBuf::from("data"),
            container_path: "/data".to_string(),
            readonly: false,
            volume_id: id.map(str::to_string),
            provider_id: None,
            block: false,
            propagation: Default::default(),
            hardening: Default::default(),
        }
    }

    #[test]
    fn messages_name_the_step_and_the_volume() {
        let cases = [
            (
                LaunchError::ResolveTarget {
                    at: Box::new(VolumeRef::new(&mount(Some("vol-1")), "/x/rootfs")),
                    source: MountError::Resolve {
                        step: "openat2",
                        root: PathBuf::from("/x/rootfs"),
                        path: PathBuf::from("data"),
                        errno: Errno::ELOOP,
                    },
                },
                "mount volume 'vol-1' at /data in container root /x/rootfs: resolve target: \
                 resolve data inside /x/rootfs: openat2: ELOOP",
            ),
            (
                LaunchError::Attach {
                    at: Box::new(VolumeRef::new(&mount(None), "/")),
                    source: MountError::MoveMount {
                        from: 3,
                        to: 4,
                        errno: Errno::EINVAL,
                    },
                },
                "mount volume at /data in container root /: attach: move_mount fd 3 onto fd 4: EINVAL",
            ),
            (
                LaunchError::TargetMissingOnHost {
                    at: Box::new(VolumeRef::new(&mount(Some("vol-1")), "/")),
                },
                "mount volume 'vol-1' at /data in container root /: the target does not exist \
                 on the host, and nothing is created on the host's own paths: use a relative \
                 container path (it lands in the sandbox), create the directory on the host, or \
                 give the container a rootfs",
            ),
            (
                LaunchError::Exec {
                    program: OsString::from("nope"),
                    errno: Errno::ENOENT,
                },
                "exec \"nope\": ENOENT",
            ),
        ];
        for (error, want) in cases {
            let got = error.full_message();
            assert!(got.starts_with(want), "got {got:?}, want prefix {want:?}");
            assert!(error.errno().is_some());
        }
    }

    /// The last problem of a sweep is the cause, written once after the volume and the pid.
    #[test]
    fn a_volume_still_mounted_names_its_last_problem_as_the_cause() {
        let still = |last| LaunchError::VolumeStillMounted {
            pid: 42,
            source_path: PathBuf::from("/w/mounts/vol-1"),
            last,
        };
        let head = "unmount volume /w/mounts/vol-1 from the mount namespace of pid 42: still \
                    mounted after its mount point moved";
        for (last, cause) in [
            (
                StillMounted::MovedAgain,
                "it was moved again between two reads of the mount table".to_string(),
            ),
            (
                StillMounted::NotTheVolume {
                    path: PathBuf::from("/data"),
                },
                "what is mounted on top at /data is not the volume".to_string(),
            ),
            (
                StillMounted::OpenParent {
                    path: PathBuf::from("/data"),
                    source: MountError::NotMounted {
                        target: PathBuf::from("/"),
                    },
                },
                "open the directory of /data: unmount /: not mounted".to_string(),
            ),
        ] {
            assert_eq!(
                still(Box::new(last)).full_message(),
                format!("{head}: {cause}")
            );
        }
    }
}
