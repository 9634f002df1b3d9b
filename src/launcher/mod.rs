//! The namespace launcher used by `csi-isolator run` and the tests: runs a workload in a new mount namespace
//! (optionally a new pid namespace too) with its volume mounts applied, optionally pivoted into a rootfs, and
//! hands back its exit status. [`inject`] mounts into and unmounts from a container that already runs.
//!
//! # Contract
//! [`launch`] returns only once the workload has exec'd with every mount of [`LaunchSpec::mounts`] in place,
//! or with the error of the first step that failed, naming the step and the volume or path. On failure no
//! mount is left anywhere: everything was made in a mount namespace that dies with the failed attempt, and
//! the host's mount table is never changed (`/` is made recursively slave before the first mount; with a
//! rootfs and a launch seed, the namespace is a copy of the private seed, the rootfs and sandbox attached
//! recursively slave), except
//! that a volume asked with rslave or rshared propagation has its host mount point made shared first
//! (idempotent; see [`share_host`]). Targets
//! are resolved by fd inside their root (sandbox, rootfs, or `/` for host targets, which must exist), so a
//! symlink in the container's filesystem cannot send a mount out of it. stdin, stdout and stderr are
//! inherited. The workload's cwd is the sandbox (at [`SANDBOX_IN_ROOTFS`] with a rootfs). Its environment
//! is the launcher's plus [`LaunchSpec::env`]; the program is looked up in that environment's `PATH` (inside
//! the rootfs, if any) the way `execvp` does (without its `/bin/sh` fallback for `ENOEXEC`).
//!
//! # Design: build the namespace on a thread, start the child from that thread
//! The parent is a multi-threaded tokio process. A child started from it may only do async-signal-safe work
//! until exec: another thread may have held the allocator's or any other lock at the moment of the clone.
//! Yet resolving targets by fd and reporting useful errors allocates. And the resolution cannot simply be
//! done in the parent and handed over as O_PATH fds: an fd opened in the host namespace names a *host*
//! mount, and after the child's `unshare(CLONE_NEWNS)` the kernel refuses to attach onto a mount of another
//! namespace (`move_mount` checks that the target mount belongs to the caller's namespace).
//!
//! So [`launch`] starts a dedicated thread, and that thread does the whole setup in ordinary Rust:
//! 1. `unshare(CLONE_NEWNS)`: mount namespaces (and, implied, `CLONE_FS` root/cwd) are per task, so only this
//!    thread moves into the new namespace; the tokio workers never notice.
//!    Before it, in the host's namespace, the host mount point of each rslave or rshared volume is made
//!    shared ([`share_host`]), so that this namespace's copy of it is a peer.
//! 2. The rshared volumes cloned (detached trees that are still peers of their host mount point), then
//!    `/` made recursively slave: host mount events still flow in, none flow out, except through the
//!    rshared clones, which `/`'s change does not reach.
//! 3. Sandbox volumes: each source cloned as a detached tree (`open_tree(OPEN_TREE_CLONE | AT_RECURSIVE)`),
//!    made read-only on the detached tree (`mount_setattr`) if asked, the target resolved (and created) by
//!    fd inside the host sandbox, then `move_mount` onto that fd, then the copy's propagation set
//!    recursively (private, slave, or left shared). With a rootfs, the sandbox volumes from the first
//!    rshared one on wait for step 4 and are attached under the rootfs's sandbox bind instead: the old
//!    root that step 6 detaches (an unmount that propagates) must hold no peer of a host mount point.
//!    Sources are cloned before targets are created, so a missing source fails before anything is
//!    touched.
//! 4. With a rootfs: the rootfs bound onto itself (pivot_root needs a mount point), the sandbox bound
//!    recursively, carrying its volumes, at [`SANDBOX_IN_ROOTFS`] resolved by fd inside the rootfs; then the
//!    rootfs volumes, resolved inside the rootfs. Without one, host volumes, whose targets must exist.
//! 5. With a pid namespace, the mount point for the new proc (`<rootfs>/proc` by fd, or `/proc`) is opened.
//! 6. With a rootfs: `pivot_root(".", ".")` from inside it and a lazy unmount of the old root. pivot_root
//!    moves the root of every task whose root was the old one *in this namespace*: only this thread.
//! 7. With a pid namespace: `unshare(CLONE_NEWPID)`, so the next child of this thread is pid 1 there.
//! 8. The child started from this thread with `clone(CLONE_VM | CLONE_VFORK)` ([`exec::spawn`], the way
//!    `posix_spawn` starts one: no page table is copied, where a `fork` of a daemon holding thousands of
//!    volumes copied them all on every launch), every signal blocked in this thread across the clone. The
//!    child inherits this thread's namespaces, root and cwd, and runs in the process's memory on a stack of
//!    its own while this thread is suspended until it has exec'd or exited. It runs only [`exec`]'s child
//!    code: reset the handled signals to their default, the signal mask and SIGPIPE, mount a new proc on the
//!    prepared fd (it must be the child, as proc shows the pid namespace of whoever mounts it), `fchdir` to
//!    the prepared cwd fd, `execve` each PATH candidate prepared before the clone. Every C string, pointer
//!    array and fd was prepared before; the child allocates nothing, takes no lock and writes to no memory
//!    but its own stack. A failure is written as a fixed-size (step, errno) record to a close-on-exec pipe;
//!    the thread reads EOF on a successful exec.
//!
//! The thread then ends; the namespace lives on with the workload and vanishes with it, or with the
//! thread if a step failed first. The process's other threads never changed namespace.
//!
//! # A container with a rootfs starts from the seed
//! Step 1 copies every mount of the daemon's namespace, two per volume published on the node, and the
//! workload's exit tears the copy down: a launch's cost would grow with the node's volumes (about 50 ms
//! at 10,000 on the benchmark machine, docs/benchmarks.md), and a burst of launches would wait on the
//! kernel's namespace lock for each other's copies. A container with a rootfs sees none of those mounts
//! once pivoted, so when the process's launch seed exists (the `seed` module: a private namespace holding a tmpfs
//! and a bind of `/proc`, made once), it is built differently: every volume's source, the rootfs and the
//! sandbox are cloned as detached trees in the daemon's namespace first (host mount points shared for
//! rslave/rshared volumes before, as in step 1), then the thread enters the seed and unshares from it
//! (a copy of two mounts), attaches the rootfs on the seed's `/rootfs` and the sandbox inside it, both
//! made recursively slave (what step 2 does to `/`), then the volumes with their own propagation, and
//! pivots (step 6 detaches the seed's copy). The workload gets the same mounts either way. Without a
//! seed (`CSI_ISOLATOR_LAUNCH_SEED=off`, a kernel without `open_tree`, or a seed that could not be
//! made) it is built as above. A container without a rootfs runs on the host's paths: its namespace must be a copy of the
//! daemon's, and step 1 stands.
//!
//! [`launch`] blocks (mount work and waiting for exec): call it from `tokio::task::spawn_blocking` in async
//! code. [`Launched::wait`] blocks too; [`Launched::wait_async`] waits on a pidfd through tokio's reactor.

pub mod error;
pub mod exec;
pub mod inject;
pub mod process;
mod root;
mod seed;
mod setup;

use std::ffi::OsString;
use std::path::PathBuf;

pub use error::{LaunchError, StillMounted, VolumeRef};
pub use process::Launched;
pub use seed::SEED_ENV;
pub use setup::{clone_source, set_propagation, set_propagation_of, share_host, DetachedTree};

use crate::mount::{Syscall, VolumeMount};

// Intra-doc link target for the docs above.
#[cfg(doc)]
use crate::mount::SANDBOX_IN_ROOTFS;

/// What to run, and where.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LaunchSpec {
    /// The program and its arguments (argv\[0\] is looked up in PATH unless it contains a `/`).
    pub argv: Vec<OsString>,
    /// Environment variables added to (and overriding) the inherited environment.
    pub env: Vec<(OsString, OsString)>,
    /// The sandbox on the host: the workload's cwd; with a rootfs it is bound at [`SANDBOX_IN_ROOTFS`]
    /// inside it and the cwd is that.
    pub sandbox: PathBuf,
    /// The root filesystem to pivot into (host path), if any.
    pub rootfs: Option<PathBuf>,
    /// The volume mounts, parents before children (as `prepare` returns them in `LaunchInfo`).
    pub mounts: Vec<VolumeMount>,
    /// Also run the workload as pid 1 of a new pid namespace, with a fresh `/proc`.
    pub pid_namespace: bool,
    /// The user and group the workload runs as (its only group; `None`: as the launcher, root).
    pub user: Option<Credentials>,
}

/// A user id and the one group id a workload runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Credentials {
    /// The user id.
    pub uid: u32,
    /// The group id (the only group: supplementary groups are dropped).
    pub gid: u32,
}

/// Starts `spec`'s workload (see the module doc) and returns once it has exec'd with all mounts in place,
/// every mount-related call made through `sys` (the child's own `/proc` mount excepted: it is made
/// with async-signal-safe raw calls). Blocking: async callers use `spawn_blocking`.
#[tracing::instrument(skip(sys, spec), fields(program = ?spec.argv.first(), sandbox = %spec.sandbox.display(), rootfs = ?spec.rootfs, mounts = spec.mounts.len(), pid_namespace = spec.pid_namespace))]
pub fn launch(sys: &dyn Syscall, spec: &LaunchSpec) -> Result<Launched, LaunchError> {
    // Everything the child will need, built here, long before the clone.
    let plan = exec::ExecPlan::new(&spec.argv, std::env::vars_os(), &spec.env, spec.user)?;
    setup::check_roots(spec)?;
    // A rootfs given through a symlink is resolved once, here: every later step (the self-bind, the sandbox
    // bind, the targets, pivot_root) then works on the same directory, whatever the link says meanwhile.
    let resolved;
    let spec = match &spec.rootfs {
        Some(rootfs) => {
            resolved = LaunchSpec {
                rootfs: Some(setup::resolve_rootfs(rootfs)?),
                ..spec.clone()
            };
            &resolved
        }
        None => spec,
    };
    let launched = std::thread::scope(|scope| {
        let handle = std::thread::Builder::new()
            .name("csi-launcher".to_string())
            .spawn_scoped(scope, || setup::build_and_start(sys, spec, &plan))
            .map_err(|source| LaunchError::SpawnThread { source })?;
        handle.join().map_err(|_| LaunchError::ThreadPanicked)?
    })?;
    tracing::info!(pid = launched.pid(), "workload started");
    Ok(launched)
}
