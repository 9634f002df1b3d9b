//! Everything between `fork` and `exec`, and what it needs prepared beforehand.
//!
//! Contract: [`ExecPlan::new`] does every allocation (argv, envp, the PATH candidates, all as C strings) in
//! the parent. [`ChildPlan`] adds the fds and the pointer arrays, also before the fork. The forked child
//! then runs [`run_child`], which only makes raw, async-signal-safe syscalls on what the plan holds: no
//! allocation, no locks, no panics, nothing that another thread of the parent could have left half-updated.
//! A failure before exec is written to the close-on-exec status pipe as a fixed-size record (step, errno,
//! detail) and the child `_exit`s with 127; a successful exec closes the pipe, so the parent reads EOF.

use std::ffi::{CString, OsStr, OsString};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;

use nix::errno::Errno;

use super::{Credentials, LaunchError};
use crate::mount::ns;

/// The PATH used when the workload's environment has none (the usual root PATH).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Exit code of a child that failed before exec (the shell's "command not found" convention).
pub const CHILD_FAILURE_EXIT: i32 = 127;

/// Step codes written to the status pipe.
const STEP_SIGNALS: u32 = 1;
const STEP_PROC: u32 = 2;
const STEP_CHDIR: u32 = 3;
const STEP_EXEC: u32 = 4;
const STEP_USER: u32 = 5;

/// Size of one status record: step (u32), errno (i32), detail (u32), native endian.
pub const REPORT_LEN: usize = 12;

fn cstring(what: &'static str, value: &OsStr) -> Result<CString, LaunchError> {
    CString::new(value.as_bytes()).map_err(|_| LaunchError::NulByte {
        what,
        value: value.to_os_string(),
    })
}

/// The program, its arguments and environment, as C strings, plus the PATH candidates to try in order
/// (execvp semantics, resolved in the container's filesystem because exec happens after the pivot).
#[derive(Debug)]
pub struct ExecPlan {
    program: OsString,
    argv: Vec<CString>,
    envp: Vec<CString>,
    candidates: Vec<CString>,
    user: Option<Credentials>,
}

impl ExecPlan {
    /// Builds the plan: `env` entries are added to (and override) `inherited`; the workload
    /// runs as `user` when given.
    pub fn new(
        argv: &[OsString],
        inherited: impl IntoIterator<Item = (OsString, OsString)>,
        env: &[(OsString, OsString)],
        user: Option<Credentials>,
    ) -> Result<ExecPlan, LaunchError> {
        let program = argv.first().ok_or(LaunchError::EmptyCommand)?.clone();
        if program.is_empty() {
            return Err(LaunchError::EmptyCommand);
        }
        let argv = argv
            .iter()
            .map(|a| cstring("argument", a))
            .collect::<Result<Vec<_>, _>>()?;
        let merged = merge_env(inherited, env);
        let mut envp = Vec::with_capacity(merged.len());
        for (key, value) in &merged {
            if key.is_empty() || key.as_bytes().contains(&b'=') {
                return Err(LaunchError::InvalidEnvName { name: key.clone() });
            }
            let mut entry = key.clone().into_vec();
            entry.push(b'=');
            entry.extend_from_slice(value.as_bytes());
            envp.push(cstring("environment entry", OsStr::from_bytes(&entry))?);
        }
        let path = merged
            .iter()
            .find(|(k, _)| k.as_bytes() == b"PATH")
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| OsString::from(DEFAULT_PATH));
        let candidates = exec_candidates(&program, &path)
            .into_iter()
            .map(|c| cstring("program path", c.as_os_str()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ExecPlan {
            program,
            argv,
            envp,
            candidates,
            user,
        })
    }

    /// argv\[0\] as given.
    pub fn program(&self) -> &OsStr {
        &self.program
    }
}

/// The inherited environment with `env` applied on top (later entries win), in a stable order.
fn merge_env(
    inherited: impl IntoIterator<Item = (OsString, OsString)>,
    env: &[(OsString, OsString)],
) -> Vec<(OsString, OsString)> {
    let mut merged: Vec<(OsString, OsString)> = Vec::new();
    for (key, value) in inherited.into_iter().chain(env.iter().cloned()) {
        match merged.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => merged.push((key, value)),
        }
    }
    merged
}

/// execvp's search: a program with a `/` is used as is; otherwise each PATH entry in order (an empty entry
/// means the current directory).
fn exec_candidates(program: &OsStr, path: &OsStr) -> Vec<PathBuf> {
    if program.as_bytes().contains(&b'/') {
        return vec![PathBuf::from(program)];
    }
    path.as_bytes()
        .split(|b| *b == b':')
        .map(|dir| {
            let dir = if dir.is_empty() { b"." as &[u8] } else { dir };
            PathBuf::from(OsStr::from_bytes(dir)).join(program)
        })
        .collect()
}

/// Everything the forked child touches, fully built before the fork.
pub struct ChildPlan<'a> {
    exec: &'a ExecPlan,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    empty_mask: libc::sigset_t,
    /// Where to mount a fresh proc (pid namespace only), as an O_PATH fd.
    pub proc_dir: Option<OwnedFd>,
    /// The workload's working directory, as an O_PATH fd.
    pub cwd: OwnedFd,
    /// The write end of the status pipe (close-on-exec).
    pub report: OwnedFd,
}

impl<'a> ChildPlan<'a> {
    /// Builds the pointer arrays and the empty signal mask for `exec`.
    pub fn new(
        exec: &'a ExecPlan,
        proc_dir: Option<OwnedFd>,
        cwd: OwnedFd,
        report: OwnedFd,
    ) -> ChildPlan<'a> {
        let terminated = |v: &[CString]| {
            v.iter()
                .map(|c| c.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect::<Vec<_>>()
        };
        // SAFETY: sigset_t is a plain bit array for which all-zero is a valid value; sigemptyset then
        // initialises it properly through the valid pointer.
        let mut empty_mask: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `empty_mask` is a live, writable sigset_t.
        unsafe { libc::sigemptyset(&mut empty_mask) };
        ChildPlan {
            argv: terminated(&exec.argv),
            envp: terminated(&exec.envp),
            exec,
            empty_mask,
            proc_dir,
            cwd,
            report,
        }
    }
}

/// Writes one status record and exits with [`CHILD_FAILURE_EXIT`]. Async-signal-safe.
fn fail(plan: &ChildPlan<'_>, step: u32, errno: Errno, detail: u32) -> ! {
    let mut record = [0u8; REPORT_LEN];
    record[0..4].copy_from_slice(&step.to_ne_bytes());
    record[4..8].copy_from_slice(&(errno as i32).to_ne_bytes());
    record[8..12].copy_from_slice(&detail.to_ne_bytes());
    let mut written = 0;
    while written < REPORT_LEN {
        // SAFETY: write(int fd, const void *buf, size_t n): the fd is open (owned by the plan) and the
        // pointer/length lie within the stack array `record`.
        let n = unsafe {
            libc::write(
                plan.report.as_raw_fd(),
                record[written..].as_ptr().cast(),
                REPORT_LEN - written,
            )
        };
        if n > 0 {
            written += n as usize;
        } else if n < 0 && Errno::last() == Errno::EINTR {
            continue;
        } else {
            break;
        }
    }
    // SAFETY: _exit(2) ends the process at once, without running atexit handlers or flushing stdio buffers
    // copied from the parent.
    unsafe { libc::_exit(CHILD_FAILURE_EXIT) }
}

/// The child's whole life between fork and exec. Only raw syscalls on prepared data: async-signal-safe.
pub fn run_child(plan: &ChildPlan<'_>) -> ! {
    // The launcher thread's mask was inherited from whoever spawned it; the workload starts with none.
    // SAFETY: sigprocmask(how, const sigset_t *set, sigset_t *old): `set` points at the prepared mask, old
    // is NULL.
    if unsafe { libc::sigprocmask(libc::SIG_SETMASK, &plan.empty_mask, std::ptr::null_mut()) } < 0 {
        fail(plan, STEP_SIGNALS, Errno::last(), 0);
    }
    // The Rust runtime ignores SIGPIPE and exec keeps ignored signals ignored: give the workload the default.
    // SAFETY: signal(2) with a valid signal number and SIG_DFL is async-signal-safe and touches no memory
    // of ours.
    if unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) } == libc::SIG_ERR {
        fail(plan, STEP_SIGNALS, Errno::last(), 0);
    }
    if let Some(proc_dir) = &plan.proc_dir {
        if let Err(errno) = ns::mount_proc_at_raw(proc_dir.as_fd()) {
            fail(plan, STEP_PROC, errno, 0);
        }
    }
    if let Err(errno) = ns::fchdir_raw(plan.cwd.as_fd()) {
        fail(plan, STEP_CHDIR, errno, 0);
    }
    // Last, once nothing else needs root: the workload's user and its one group. Raw syscalls
    // (this process has one thread; libc's wrappers would signal threads it no longer has).
    // Dropping to a non-zero uid clears every capability; the parent-death signal, were one
    // set, would be cleared too (none is).
    if let Some(user) = plan.exec.user {
        let groups = [user.gid as libc::gid_t];
        // SAFETY: setgroups(size, const gid_t *list): `groups` is a live one-element array.
        if unsafe { libc::syscall(libc::SYS_setgroups, 1 as libc::size_t, groups.as_ptr()) } < 0 {
            fail(plan, STEP_USER, Errno::last(), 0);
        }
        // SAFETY: setresgid/setresuid take three ids by value and touch no memory.
        if unsafe { libc::syscall(libc::SYS_setresgid, user.gid, user.gid, user.gid) } < 0 {
            fail(plan, STEP_USER, Errno::last(), 1);
        }
        // SAFETY: as above.
        if unsafe { libc::syscall(libc::SYS_setresuid, user.uid, user.uid, user.uid) } < 0 {
            fail(plan, STEP_USER, Errno::last(), 2);
        }
    }
    let mut last = Errno::ENOENT;
    let mut denied = false;
    for candidate in &plan.exec.candidates {
        // SAFETY: execve(path, argv, envp): `path` is a NUL-terminated string owned by the plan, argv and
        // envp are NULL-terminated arrays of pointers into C strings the plan owns; all outlive the call
        // (on success the process image is replaced).
        unsafe { libc::execve(candidate.as_ptr(), plan.argv.as_ptr(), plan.envp.as_ptr()) };
        last = Errno::last();
        match last {
            // Keep looking, as execvp does; remember that something was there but not executable.
            Errno::EACCES => denied = true,
            Errno::ENOENT | Errno::ENOTDIR | Errno::ESTALE | Errno::ENODEV | Errno::ETIMEDOUT => {}
            _ => break,
        }
    }
    if denied && matches!(last, Errno::ENOENT | Errno::ENOTDIR) {
        last = Errno::EACCES;
    }
    fail(plan, STEP_EXEC, last, 0)
}

/// Turns a status record from the child into the error it stands for.
pub fn decode_report(
    record: &[u8; REPORT_LEN],
    exec: &ExecPlan,
    proc_path: PathBuf,
    cwd_path: PathBuf,
) -> LaunchError {
    let word = |i: usize| {
        let mut b = [0u8; 4];
        b.copy_from_slice(&record[i..i + 4]);
        b
    };
    let step = u32::from_ne_bytes(word(0));
    let errno = Errno::from_raw(i32::from_ne_bytes(word(4)));
    match step {
        STEP_SIGNALS => LaunchError::ChildSignals { errno },
        STEP_PROC => LaunchError::ChildMountProc {
            path: proc_path,
            errno,
        },
        STEP_CHDIR => LaunchError::ChildChdir {
            path: cwd_path,
            errno,
        },
        STEP_EXEC => LaunchError::Exec {
            program: exec.program.clone(),
            errno,
        },
        STEP_USER => LaunchError::ChildUser {
            uid: exec.user.map(|u| u.uid).unwrap_or_default(),
            gid: exec.user.map(|u| u.gid).unwrap_or_default(),
            call: match u32::from_ne_bytes(word(8)) {
                0 => "setgroups",
                1 => "setresgid",
                _ => "setresuid",
            },
            errno,
        },
        step => LaunchError::UnknownChildStep { step, errno },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(s: &str) -> OsString {
        OsString::from(s)
    }

    #[test]
    fn candidates_follow_execvp() {
        let cases: &[(&str, &str, &[&str])] = &[
            ("sh", "/bin:/usr/bin", &["/bin/sh", "/usr/bin/sh"]),
            ("./run", "/bin", &["./run"]),
            ("/bin/sh", "/usr/bin", &["/bin/sh"]),
            ("tool", "/a::/b", &["/a/tool", "./tool", "/b/tool"]),
        ];
        for (program, path, want) in cases {
            let got = exec_candidates(OsStr::new(program), OsStr::new(path));
            let want: Vec<PathBuf> = want.iter().map(PathBuf::from).collect();
            assert_eq!(got, want, "program {program} PATH {path}");
        }
    }

    #[test]
    fn env_overrides_inherited_and_sets_path() {
        let plan = ExecPlan::new(
            &[os("prog"), os("arg")],
            vec![(os("A"), os("1")), (os("PATH"), os("/x"))],
            &[(os("A"), os("2")), (os("B"), os("3"))],
            None,
        )
        .expect("plan");
        let env: Vec<String> = plan
            .envp
            .iter()
            .map(|c| c.to_string_lossy().into_owned())
            .collect();
        assert_eq!(env, vec!["A=2", "PATH=/x", "B=3"]);
        assert_eq!(plan.candidates, vec![CString::new("/x/prog").unwrap()]);
    }

    #[test]
    fn default_path_without_one() {
        let plan = ExecPlan::new(&[os("sh")], Vec::new(), &[], None).expect("plan");
        assert_eq!(plan.candidates.len(), DEFAULT_PATH.split(':').count());
    }

    #[test]
    fn bad_inputs_are_refused() {
        assert!(matches!(
            ExecPlan::new(&[], Vec::new(), &[], None),
            Err(LaunchError::EmptyCommand)
        ));
        assert!(matches!(
            ExecPlan::new(&[os("a\0b")], Vec::new(), &[], None),
            Err(LaunchError::NulByte { .. })
        ));
        assert!(matches!(
            ExecPlan::new(&[os("a")], Vec::new(), &[(os("K=V"), os("x"))], None),
            Err(LaunchError::InvalidEnvName { .. })
        ));
    }

    #[test]
    fn reports_round_trip() {
        let plan = ExecPlan::new(&[os("prog")], Vec::new(), &[], None).expect("plan");
        let mut record = [0u8; REPORT_LEN];
        record[0..4].copy_from_slice(&STEP_EXEC.to_ne_bytes());
        record[4..8].copy_from_slice(&(libc::EACCES).to_ne_bytes());
        let err = decode_report(&record, &plan, PathBuf::from("/proc"), PathBuf::from("/"));
        assert!(matches!(
            err,
            LaunchError::Exec { ref program, errno: Errno::EACCES } if program == "prog"
        ));
    }
}
