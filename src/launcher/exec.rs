//! Everything between the child's start ([`spawn`]: `clone(CLONE_VM | CLONE_VFORK)`, as
//! `posix_spawn` does) and `exec`, and what it needs prepared beforehand.
//!
//! Contract: [`ExecPlan::new`] does every allocation (argv, envp, the PATH candidates, all as C strings) in
//! the parent. [`ChildPlan`] adds the fds and the pointer arrays, also before the clone. The child
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

/// Everything the child touches, fully built before the clone.
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

/// The child's stack: [`spawn`] starts the child in this process's memory, on a stack of its own
/// (mapped on first touch: the child uses a few KiB), with a guard page below it.
const CHILD_STACK_LEN: usize = 256 * 1024;

/// An anonymous mapping for the child's stack, unmapped when dropped (after the child has exec'd
/// or exited: [`spawn`] returns only then).
struct ChildStack {
    base: *mut libc::c_void,
    len: usize,
}

impl ChildStack {
    fn map() -> Result<ChildStack, Errno> {
        // SAFETY: mmap(NULL, len, ...) of a fresh private anonymous mapping touches no existing
        // memory; the result is checked against MAP_FAILED.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                CHILD_STACK_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Errno::last());
        }
        let stack = ChildStack {
            base,
            len: CHILD_STACK_LEN,
        };
        // The lowest page is the guard: an overflow faults instead of writing over other memory.
        // SAFETY: mprotect on the first page of the mapping made above.
        if unsafe { libc::mprotect(base, page_size(), libc::PROT_NONE) } < 0 {
            return Err(Errno::last());
        }
        Ok(stack)
    }

    /// The stack's top (stacks grow down on every architecture Linux runs this on but parisc),
    /// 16-byte aligned as the ABIs ask.
    fn top(&self) -> *mut libc::c_void {
        let top = self.base as usize + self.len;
        (top & !15) as *mut libc::c_void
    }
}

impl Drop for ChildStack {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `map` made; nothing runs on it any more.
        unsafe { libc::munmap(self.base, self.len) };
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf takes a constant and touches no memory.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as usize
    } else {
        4096
    }
}

/// Starts the child the way `posix_spawn` does: `clone(CLONE_VM | CLONE_VFORK)`, so the kernel
/// copies no page table (a `fork` of a large multi-threaded daemon copied all of them, on every
/// launch: the cost of a burst of launches grew with the daemon's memory). The child runs
/// [`run_child`] in this process's memory on a stack of its own; this thread is suspended until
/// the child has exec'd or exited, so when `spawn` returns the child no longer touches our memory.
/// A workload that runs as another user (`--user`) is forked instead: a task sharing the daemon's
/// memory never changes its credentials.
/// Every signal is blocked in this thread across the clone, so that no handler of this process
/// runs in the child; the child resets the handled ones to their default before it unblocks.
/// Returns the child's pid.
pub fn spawn(plan: &ChildPlan<'_>) -> Result<libc::pid_t, Errno> {
    // Only the clone runs on a stack of its own (a forked child has its copy of this one).
    let stack = match plan.exec.user {
        Some(_) => None,
        None => Some(ChildStack::map()?),
    };
    // SAFETY: sigset_t is a plain bit array for which all-zero is a valid value; sigfillset then
    // initialises it properly through the valid pointer.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut before: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `all` is a live, writable sigset_t.
    unsafe { libc::sigfillset(&mut all) };
    // SAFETY: pthread_sigmask(how, const sigset_t *set, sigset_t *old) on live sigset_ts.
    let blocked = unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut before) };
    if blocked != 0 {
        return Err(Errno::from_raw(blocked));
    }
    let pid = if let Some(stack) = &stack {
        // SAFETY: clone(fn, stack, flags, arg): `child_entry` never returns into our code (it
        // ends in execve or _exit); `stack.top()` is the top of a live mapping that outlives the
        // child's use of it (CLONE_VFORK: clone returns only once the child has exec'd or
        // exited); `arg` points at the plan, which this thread keeps alive and does not touch
        // while it is suspended. SIGCHLD as the exit signal makes the child an ordinary child
        // for waitpid.
        unsafe {
            libc::clone(
                child_entry,
                stack.top(),
                libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
                plan as *const ChildPlan<'_> as *mut libc::c_void,
            )
        }
    } else {
        // A workload that runs as another user is forked, memory copied: its credentials change
        // before its execve, and a task that shares the daemon's memory must never run as
        // another uid (the kernel would mark the shared memory by fs.suid_dumpable, and that
        // uid could reach the daemon's memory between the change and the execve).
        // SAFETY: fork in a multi-threaded process: the child only runs run_child, which makes
        // raw, async-signal-safe syscalls on data prepared before (no allocation, no locks) and
        // ends in execve or _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            run_child(plan);
        }
        pid
    };
    let cloned = Errno::last();
    // SAFETY: as above; restores the mask saved before the clone.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &before, std::ptr::null_mut()) };
    drop(stack);
    if pid < 0 {
        return Err(cloned);
    }
    Ok(pid)
}

extern "C" fn child_entry(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `spawn` passes a pointer to a ChildPlan that lives until the child has exec'd or
    // exited (its thread is suspended until then).
    let plan = unsafe { &*(arg as *const ChildPlan<'static>) };
    run_child(plan)
}

/// Resets every signal this process handles to its default, in the child only (it has its own
/// copy of the dispositions: no CLONE_SIGHAND), so that no handler of the daemon's runs in the
/// child's shared memory once the child unblocks signals. Ignored signals stay ignored, as across
/// exec. Errors (SIGKILL, SIGSTOP, the C library's own signals) are skipped. Async-signal-safe.
fn reset_handlers() {
    // SIGRTMAX is the C library's answer (64 on most architectures, 127 on MIPS): a plain value.
    for signal in 1..=libc::SIGRTMAX() {
        // SAFETY: sigaction is plain old data for which all-zero is a valid value.
        let mut current: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: sigaction(sig, NULL, &old) only writes the live `current`.
        if unsafe { libc::sigaction(signal, std::ptr::null(), &mut current) } < 0 {
            continue;
        }
        if current.sa_sigaction == libc::SIG_DFL || current.sa_sigaction == libc::SIG_IGN {
            continue;
        }
        // SAFETY: as above.
        let mut default: libc::sigaction = unsafe { std::mem::zeroed() };
        default.sa_sigaction = libc::SIG_DFL;
        // SAFETY: sigaction(sig, &new, NULL) reads the live `default`.
        unsafe { libc::sigaction(signal, &default, std::ptr::null_mut()) };
    }
}

/// The child's whole life between clone and exec. Only raw syscalls on prepared data:
/// async-signal-safe, and nothing written to memory but its own stack and the C library's
/// thread-local errno of the suspended thread (it shares the parent's memory).
pub fn run_child(plan: &ChildPlan<'_>) -> ! {
    reset_handlers();
    // The launcher thread's mask was inherited from whoever spawned it (and [`spawn`] blocked every
    // signal around the clone); the workload starts with none.
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

    /// Spawns `argv` with a status pipe and the cwd `/`, as the launcher thread does; returns the
    /// status record read (empty: exec'd) and the exit status.
    fn spawn_and_wait(argv: &[&str]) -> (Vec<u8>, nix::sys::wait::WaitStatus) {
        spawn_as_and_wait(argv, None)
    }

    /// [`spawn_and_wait`], the workload running as `user` when given.
    fn spawn_as_and_wait(
        argv: &[&str],
        user: Option<Credentials>,
    ) -> (Vec<u8>, nix::sys::wait::WaitStatus) {
        use std::io::Read;
        let argv: Vec<OsString> = argv.iter().map(|a| os(a)).collect();
        let plan = ExecPlan::new(&argv, std::env::vars_os(), &[], user).expect("plan");
        let (read_end, write_end) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let cwd: OwnedFd = std::fs::File::open("/").unwrap().into();
        let child = ChildPlan::new(&plan, None, cwd, write_end);
        let pid = spawn(&child).expect("spawn");
        drop(child);
        let mut record = Vec::new();
        std::fs::File::from(read_end)
            .read_to_end(&mut record)
            .unwrap();
        let status = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None).unwrap();
        (record, status)
    }

    fn blocked_here() -> libc::sigset_t {
        // SAFETY: an all-zero sigset_t is valid; pthread_sigmask only writes it.
        let mut now: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above, with a NULL new set (query only).
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, std::ptr::null(), &mut now) };
        now
    }

    extern "C" fn count_usr1(_: libc::c_int) {
        USR1_SEEN.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
    static USR1_SEEN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

    #[test]
    fn the_child_starts_with_no_signal_blocked_and_the_caller_keeps_its_mask() {
        // The caller blocks SIGUSR2 and handles SIGUSR1 (as the daemon handles signals).
        let mut usr2: libc::sigset_t = blocked_here();
        // SAFETY: `usr2` is a live sigset_t.
        unsafe { libc::sigaddset(&mut usr2, libc::SIGUSR2) };
        // SAFETY: as in blocked_here.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &usr2, std::ptr::null_mut()) };
        // SAFETY: count_usr1 only touches an atomic: async-signal-safe.
        unsafe { libc::signal(libc::SIGUSR1, count_usr1 as *const () as libc::sighandler_t) };

        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("status");
        // The child's SigBlk (spawn blocked every signal around the clone: the child must start
        // with none), and SIGUSR1 at its default in the workload (execve resets a caught signal
        // in any case: this does not show reset_handlers, whose window is before the execve).
        let script = format!(
            "grep ^SigBlk: /proc/self/status > {0}; kill -USR1 $$; echo survived >> {0}",
            out.display()
        );
        let (record, status) = spawn_and_wait(&["/bin/sh", "-c", &script]);
        assert!(record.is_empty(), "exec failed: {record:?}");
        assert_eq!(
            status,
            nix::sys::wait::WaitStatus::Signaled(
                nix::unistd::Pid::from_raw(status.pid().unwrap().as_raw()),
                nix::sys::signal::Signal::SIGUSR1,
                false
            )
        );
        let shown = std::fs::read_to_string(&out).unwrap();
        assert_eq!(shown.trim(), "SigBlk:\t0000000000000000");
        assert_eq!(USR1_SEEN.load(std::sync::atomic::Ordering::SeqCst), 0);

        let after = blocked_here();
        // SAFETY: sigismember reads the live sets.
        unsafe {
            assert_eq!(libc::sigismember(&after, libc::SIGUSR2), 1);
            assert_eq!(libc::sigismember(&after, libc::SIGTERM), 0);
        }
    }

    /// A workload that runs as another user is forked (its credentials change before execve:
    /// it must not share the daemon's memory), and still reports as the clone path does.
    #[test]
    fn a_workload_of_another_user_starts_and_runs_as_that_user() {
        if !nix::unistd::geteuid().is_root() {
            panic!("this test changes the child's uid: run it as root");
        }
        let dir = tempfile::tempdir().unwrap();
        // The child (nobody) reaches its file through the temp dir.
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let out = dir.path().join("id");
        std::fs::File::create(&out).unwrap();
        std::os::unix::fs::chown(&out, Some(65534), Some(65534)).unwrap();
        let script = format!("id -u > {0}; id -g >> {0}", out.display());
        let user = Credentials {
            uid: 65534,
            gid: 65534,
        };
        // SAFETY: as below.
        let dumpable = unsafe { libc::prctl(libc::PR_GET_DUMPABLE) };
        assert_eq!(dumpable, 1, "the test process starts dumpable");
        let (record, status) = spawn_as_and_wait(&["/bin/sh", "-c", &script], Some(user));
        assert!(record.is_empty(), "exec failed: {record:?}");
        assert!(
            matches!(status, nix::sys::wait::WaitStatus::Exited(_, 0)),
            "{status:?}"
        );
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "65534\n65534\n");
        // The daemon's own credentials are untouched, and so is its memory's dumpable mark (a
        // child sharing the memory that changed uid would have set it to fs.suid_dumpable).
        assert!(nix::unistd::geteuid().is_root());
        // SAFETY: prctl(PR_GET_DUMPABLE) takes no pointer and returns the flag.
        assert_eq!(unsafe { libc::prctl(libc::PR_GET_DUMPABLE) }, dumpable);
    }

    #[test]
    fn an_exec_that_fails_is_reported_through_the_pipe_and_the_child_exits_127() {
        let (record, status) = spawn_and_wait(&["/nonexistent/program"]);
        assert_eq!(record.len(), REPORT_LEN);
        let mut fixed = [0u8; REPORT_LEN];
        fixed.copy_from_slice(&record);
        let plan = ExecPlan::new(&[os("/nonexistent/program")], Vec::new(), &[], None).unwrap();
        let err = decode_report(&fixed, &plan, PathBuf::from("/proc"), PathBuf::from("/"));
        assert!(
            matches!(
                err,
                LaunchError::Exec {
                    errno: Errno::ENOENT,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(matches!(
            status,
            nix::sys::wait::WaitStatus::Exited(_, CHILD_FAILURE_EXIT)
        ));
    }

    #[test]
    fn many_children_start_from_a_process_with_a_large_heap() {
        // 64 MiB touched: with fork every start copied its page tables; with the clone none is.
        let heap = vec![1u8; 64 << 20];
        for _ in 0..32 {
            let (record, status) = spawn_and_wait(&["/bin/true"]);
            assert!(record.is_empty());
            assert!(matches!(status, nix::sys::wait::WaitStatus::Exited(_, 0)));
        }
        std::hint::black_box(heap);
    }
}
