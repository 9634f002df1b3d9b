//! Fault injection and call logging for the test plugin.
//!
//! Every RPC enters through [`Faults::enter`] before it touches anything and leaves
//! through [`Faults::leave`] after its side effect, so a fault spec can fail a call,
//! delay it, or kill the process on either side of the side effect. A `stall` sleeps inside
//! the work itself, after the RPC's checks and right before its side effect, holding the
//! volume's lock (so tests can give up on a call mid-work and retry it). A `lie` answers
//! something other than the truth ([`LieMode`]): success without the work, or the work done
//! and a reply that is wrong (empty fields, a short capacity) or not even valid protobuf.
//! Specs come from the
//! command line and, optionally, from a file that is re-read whenever its mtime changes
//! (counters reset then), so tests can change faults on a running plugin.

use csi_isolator::error_chain::Chain;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use tonic::{Code, Status};

/// Exit status of a process killed by an `exit-in` fault (like SIGKILL: 128 + 9).
pub const EXIT_CODE: i32 = 137;

/// Errors parsing fault specs or writing the call log.
#[derive(Debug, thiserror::Error)]
pub enum FaultError {
    /// A spec did not parse.
    #[error("invalid fault spec '{spec}': {reason}")]
    Parse {
        /// The spec as given.
        spec: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Reading the faults file failed.
    #[error("read faults file {path}")]
    ReadFile {
        /// The faults file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Appending to the call log failed.
    #[error("append to call log {path}")]
    Log {
        /// The log file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

/// When an `exit-in` fault kills the process, relative to the RPC's side effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExitPoint {
    /// Before the side effect.
    Before,
    /// After the side effect, before the reply.
    After,
}

/// One fault.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultSpec {
    /// Fail `rpc` with `code`, `count` times (forever when `None`).
    Fail {
        /// The CSI method name.
        rpc: String,
        /// The gRPC code returned.
        code: Code,
        /// How many calls fail.
        count: Option<u32>,
    },
    /// Sleep before handling `rpc`.
    Delay {
        /// The CSI method name.
        rpc: String,
        /// The sleep.
        millis: u64,
    },
    /// Sleep inside `rpc`'s work, right before its side effect (holding the volume's lock).
    Stall {
        /// The CSI method name.
        rpc: String,
        /// The sleep.
        millis: u64,
    },
    /// Answer `rpc` with something other than the truth (a plugin that lies, for
    /// testing the CO's checks); `mode` says what.
    Lie {
        /// The CSI method name.
        rpc: String,
        /// What the lie is.
        mode: LieMode,
    },
    /// Exit the process during the first call of `rpc`.
    ExitIn {
        /// The CSI method name.
        rpc: String,
        /// Before or after the side effect.
        point: ExitPoint,
    },
}

/// What a `lie` fault makes the plugin answer. Every mode but [`LieMode::NoWork`] does the
/// RPC's work first, so the CO is left to undo a side effect that it was told about wrongly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LieMode {
    /// `RPC` or `RPC:no-work`: success without doing the work (any RPC).
    NoWork,
    /// `ControllerPublishVolume:empty-context`: the volume is published, the reply's
    /// publish_context is empty (so NodeStage/NodePublish, which require it, then fail).
    EmptyContext,
    /// `CreateVolume:empty-id`: the volume is created, the reply's volume_id is empty.
    EmptyId,
    /// `CreateVolume:small-capacity`: the volume is created, the reply's capacity_bytes is
    /// one byte short of the request's required_bytes (no lie when none is required).
    SmallCapacity,
    /// `CreateVolume:reused-id`: the volume is created, the reply's volume_id is that of
    /// another volume the plugin has (no lie when there is none).
    ReusedId,
    /// `RPC:garbage`: the work is done, the reply's message bytes are not protobuf (a
    /// field with the invalid wire type 7). Any RPC.
    Garbage,
    /// `RPC:bad-utf8`: the work is done, a string field of the reply holds bytes that are
    /// not UTF-8. Only RPCs whose reply has a string field: CreateVolume (volume_id),
    /// ControllerPublishVolume (a publish_context value), GetPluginInfo (name) and
    /// NodeGetInfo (node_id).
    BadUtf8,
}

impl LieMode {
    /// The mode's name in a spec.
    pub fn as_str(self) -> &'static str {
        match self {
            LieMode::NoWork => "no-work",
            LieMode::EmptyContext => "empty-context",
            LieMode::EmptyId => "empty-id",
            LieMode::SmallCapacity => "small-capacity",
            LieMode::ReusedId => "reused-id",
            LieMode::Garbage => "garbage",
            LieMode::BadUtf8 => "bad-utf8",
        }
    }

    /// Whether the lie is made on the wire, after the reply was encoded
    /// ([`LieMode::Garbage`], [`LieMode::BadUtf8`]).
    pub fn on_the_wire(self) -> bool {
        matches!(self, LieMode::Garbage | LieMode::BadUtf8)
    }

    /// The RPCs the mode applies to (`None`: any).
    fn rpcs(self) -> Option<&'static [&'static str]> {
        match self {
            LieMode::NoWork | LieMode::Garbage => None,
            LieMode::EmptyContext => Some(&["ControllerPublishVolume"]),
            LieMode::EmptyId | LieMode::SmallCapacity | LieMode::ReusedId => {
                Some(&["CreateVolume"])
            }
            LieMode::BadUtf8 => Some(&[
                "CreateVolume",
                "ControllerPublishVolume",
                "GetPluginInfo",
                "NodeGetInfo",
            ]),
        }
    }
}

const LIE_MODES: [LieMode; 7] = [
    LieMode::NoWork,
    LieMode::EmptyContext,
    LieMode::EmptyId,
    LieMode::SmallCapacity,
    LieMode::ReusedId,
    LieMode::Garbage,
    LieMode::BadUtf8,
];

fn parse_error(spec: &str, reason: impl Into<String>) -> FaultError {
    FaultError::Parse {
        spec: spec.to_string(),
        reason: reason.into(),
    }
}

/// Parses a gRPC code given by name (`UNAVAILABLE`, case-insensitive) or number.
pub fn parse_code(text: &str) -> Option<Code> {
    if let Ok(n) = text.parse::<i32>() {
        return (0..=16).contains(&n).then(|| Code::from_i32(n));
    }
    let code = match text.to_ascii_uppercase().as_str() {
        "OK" => Code::Ok,
        "CANCELLED" => Code::Cancelled,
        "UNKNOWN" => Code::Unknown,
        "INVALID_ARGUMENT" => Code::InvalidArgument,
        "DEADLINE_EXCEEDED" => Code::DeadlineExceeded,
        "NOT_FOUND" => Code::NotFound,
        "ALREADY_EXISTS" => Code::AlreadyExists,
        "PERMISSION_DENIED" => Code::PermissionDenied,
        "RESOURCE_EXHAUSTED" => Code::ResourceExhausted,
        "FAILED_PRECONDITION" => Code::FailedPrecondition,
        "ABORTED" => Code::Aborted,
        "OUT_OF_RANGE" => Code::OutOfRange,
        "UNIMPLEMENTED" => Code::Unimplemented,
        "INTERNAL" => Code::Internal,
        "UNAVAILABLE" => Code::Unavailable,
        "DATA_LOSS" => Code::DataLoss,
        "UNAUTHENTICATED" => Code::Unauthenticated,
        _ => return None,
    };
    Some(code)
}

fn check_rpc(spec: &str, rpc: &str) -> Result<String, FaultError> {
    if rpc.is_empty() || !rpc.chars().all(|c| c.is_ascii_alphanumeric()) {
        return Err(parse_error(
            spec,
            "the RPC must be a CSI method name like NodePublishVolume",
        ));
    }
    Ok(rpc.to_string())
}

/// Parses the value of `--fail`: `RPC=CODE[:COUNT]`.
pub fn parse_fail(spec: &str) -> Result<FaultSpec, FaultError> {
    let (rpc, rest) = spec
        .split_once('=')
        .ok_or_else(|| parse_error(spec, "expected RPC=CODE[:COUNT]"))?;
    let (code, count) = match rest.split_once(':') {
        Some((code, count)) => {
            let n = count
                .parse::<u32>()
                .map_err(|_| parse_error(spec, "COUNT must be a number"))?;
            (code, Some(n))
        }
        None => (rest, None),
    };
    let code = parse_code(code).ok_or_else(|| parse_error(spec, "unknown gRPC code"))?;
    if code == Code::Ok {
        return Err(parse_error(spec, "failing with OK makes no sense"));
    }
    Ok(FaultSpec::Fail {
        rpc: check_rpc(spec, rpc)?,
        code,
        count,
    })
}

fn parse_rpc_millis(spec: &str) -> Result<(String, u64), FaultError> {
    let (rpc, millis) = spec
        .split_once('=')
        .ok_or_else(|| parse_error(spec, "expected RPC=MILLIS"))?;
    let millis = millis
        .parse::<u64>()
        .map_err(|_| parse_error(spec, "MILLIS must be a number"))?;
    Ok((check_rpc(spec, rpc)?, millis))
}

/// Parses the value of `--delay`: `RPC=MILLIS`.
pub fn parse_delay(spec: &str) -> Result<FaultSpec, FaultError> {
    let (rpc, millis) = parse_rpc_millis(spec)?;
    Ok(FaultSpec::Delay { rpc, millis })
}

/// Parses the value of `--stall`: `RPC=MILLIS`.
pub fn parse_stall(spec: &str) -> Result<FaultSpec, FaultError> {
    let (rpc, millis) = parse_rpc_millis(spec)?;
    Ok(FaultSpec::Stall { rpc, millis })
}

/// Parses the value of `--lie`: `RPC[:MODE]` (see [`LieMode`]; without a mode, `no-work`).
pub fn parse_lie(spec: &str) -> Result<FaultSpec, FaultError> {
    let (rpc, mode) = match spec.split_once(':') {
        Some((rpc, name)) => {
            let mode = LIE_MODES
                .into_iter()
                .find(|m| m.as_str() == name)
                .ok_or_else(|| {
                    let known: Vec<&str> = LIE_MODES.iter().map(|m| m.as_str()).collect();
                    parse_error(
                        spec,
                        format!("unknown lie mode (expected one of {})", known.join(", ")),
                    )
                })?;
            (rpc, mode)
        }
        None => (spec, LieMode::NoWork),
    };
    let rpc = check_rpc(spec, rpc)?;
    if let Some(rpcs) = mode.rpcs() {
        if !rpcs.contains(&rpc.as_str()) {
            return Err(parse_error(
                spec,
                format!(
                    "lie mode {} applies only to {}",
                    mode.as_str(),
                    rpcs.join(", ")
                ),
            ));
        }
    }
    Ok(FaultSpec::Lie { rpc, mode })
}

/// Parses the value of `--exit-in`: `RPC[:before|after]`.
pub fn parse_exit_in(spec: &str) -> Result<FaultSpec, FaultError> {
    let (rpc, point) = match spec.split_once(':') {
        Some((rpc, "before")) => (rpc, ExitPoint::Before),
        Some((rpc, "after")) => (rpc, ExitPoint::After),
        Some(_) => return Err(parse_error(spec, "expected RPC[:before|after]")),
        None => (spec, ExitPoint::After),
    };
    Ok(FaultSpec::ExitIn {
        rpc: check_rpc(spec, rpc)?,
        point,
    })
}

/// Parses a faults file: one `fail ...`, `delay ...`, `stall ...`, `lie ...` or `exit-in ...`
/// spec per line;
/// blank lines and lines starting with `#` are ignored.
pub fn parse_file(text: &str) -> Result<Vec<FaultSpec>, FaultError> {
    let mut specs = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (kind, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        let rest = rest.trim();
        specs.push(match kind {
            "fail" => parse_fail(rest)?,
            "delay" => parse_delay(rest)?,
            "stall" => parse_stall(rest)?,
            "lie" => parse_lie(rest)?,
            "exit-in" => parse_exit_in(rest)?,
            _ => {
                return Err(parse_error(
                    line,
                    "expected 'fail', 'delay', 'stall', 'lie' or 'exit-in'",
                ))
            }
        });
    }
    Ok(specs)
}

/// A spec with its run-time state.
#[derive(Debug)]
struct Armed {
    spec: FaultSpec,
    /// Failures left for a counted `Fail`.
    remaining: Option<u32>,
}

impl Armed {
    fn new(spec: FaultSpec) -> Armed {
        let remaining = match &spec {
            FaultSpec::Fail { count, .. } => *count,
            _ => None,
        };
        Armed { spec, remaining }
    }
}

#[derive(Debug)]
struct State {
    cli: Vec<Armed>,
    file: Vec<Armed>,
    file_mtime: Option<SystemTime>,
}

/// The fault injector and call logger shared by every RPC handler.
#[derive(Debug)]
pub struct Faults {
    state: Mutex<State>,
    faults_file: Option<PathBuf>,
    log_calls: Option<PathBuf>,
}

/// What [`Faults::enter`] decided for one call.
#[derive(Debug)]
pub struct Entered {
    exit_after: bool,
}

impl Faults {
    /// A fault injector with the command-line `specs`, an optional faults file and an
    /// optional call log.
    pub fn new(
        specs: Vec<FaultSpec>,
        faults_file: Option<PathBuf>,
        log_calls: Option<PathBuf>,
    ) -> Faults {
        Faults {
            state: Mutex::new(State {
                cli: specs.into_iter().map(Armed::new).collect(),
                file: Vec::new(),
                file_mtime: None,
            }),
            faults_file,
            log_calls,
        }
    }

    /// Runs at the start of every RPC: logs the call, then applies delays, `exit-in
    /// before` and failures. `Err` is the status the RPC must return at once.
    pub async fn enter(&self, rpc: &str, volume_id: &str) -> Result<Entered, Status> {
        if let Some(path) = &self.log_calls {
            if let Err(e) = append_line(path, rpc, volume_id) {
                tracing::error!(rpc, error = %Chain(&e), "call log");
                return Err(Status::internal(csi_isolator::error_chain::full_message(
                    &e,
                )));
            }
        }
        let mut delay = 0u64;
        let mut fail = None;
        let mut exit_before = false;
        let mut exit_after = false;
        {
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            self.reload(&mut state);
            let State { cli, file, .. } = &mut *state;
            for armed in cli.iter_mut().chain(file.iter_mut()) {
                match &armed.spec {
                    FaultSpec::Delay { rpc: r, millis } if r == rpc => delay += millis,
                    FaultSpec::ExitIn { rpc: r, point } if r == rpc => match point {
                        ExitPoint::Before => exit_before = true,
                        ExitPoint::After => exit_after = true,
                    },
                    FaultSpec::Fail { rpc: r, code, .. } if r == rpc && fail.is_none() => {
                        match &mut armed.remaining {
                            Some(0) => {}
                            Some(n) => {
                                *n -= 1;
                                fail = Some(*code);
                            }
                            None => fail = Some(*code),
                        }
                    }
                    _ => {}
                }
            }
        }
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if exit_before {
            exit_now(rpc, "before");
        }
        if let Some(code) = fail {
            return Err(Status::new(code, format!("{rpc}: injected fault")));
        }
        Ok(Entered { exit_after })
    }

    /// Whether `rpc` is to be answered with success without doing its work.
    pub fn lie(&self, rpc: &str) -> bool {
        self.lie_mode(rpc, |m| m == LieMode::NoWork).is_some()
    }

    /// The lie to tell in `rpc`'s reply after doing its work, if any (the first spec
    /// of another mode than [`LieMode::NoWork`]).
    pub fn reply_lie(&self, rpc: &str) -> Option<LieMode> {
        self.lie_mode(rpc, |m| m != LieMode::NoWork)
    }

    fn lie_mode(&self, rpc: &str, wanted: impl Fn(LieMode) -> bool) -> Option<LieMode> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.reload(&mut state);
        state
            .cli
            .iter()
            .chain(state.file.iter())
            .find_map(|armed| match &armed.spec {
                FaultSpec::Lie { rpc: r, mode } if r == rpc && wanted(*mode) => Some(*mode),
                _ => None,
            })
    }

    /// Runs inside the RPC's work (on its blocking thread, under the volume's lock), right
    /// before the side effect: sleeps for the `stall` specs of `rpc`.
    pub fn stall(&self, rpc: &str) {
        let millis: u64 = {
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            self.reload(&mut state);
            state
                .cli
                .iter()
                .chain(state.file.iter())
                .map(|armed| match &armed.spec {
                    FaultSpec::Stall { rpc: r, millis } if r == rpc => *millis,
                    _ => 0,
                })
                .sum()
        };
        if millis > 0 {
            tracing::info!(rpc, millis, "stall fault: sleeping before the side effect");
            std::thread::sleep(Duration::from_millis(millis));
        }
    }

    /// Runs after the RPC's side effect, before the reply.
    pub fn leave(&self, rpc: &str, entered: Entered) {
        if entered.exit_after {
            exit_now(rpc, "after");
        }
    }

    /// Re-reads the faults file if its mtime changed; a missing or unreadable file means
    /// no file faults (logged), so a test can delete it to clear them.
    fn reload(&self, state: &mut State) {
        let Some(path) = &self.faults_file else {
            return;
        };
        let mtime = fs::metadata(path).and_then(|m| m.modified()).ok();
        if mtime == state.file_mtime {
            return;
        }
        state.file_mtime = mtime;
        let specs = match fs::read_to_string(path) {
            Ok(text) => parse_file(&text),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(source) => Err(FaultError::ReadFile {
                path: path.clone(),
                source,
            }),
        };
        match specs {
            Ok(specs) => {
                state.file = specs.into_iter().map(Armed::new).collect();
                for armed in &mut state.cli {
                    *armed = Armed::new(armed.spec.clone());
                }
            }
            Err(e) => tracing::error!(error = %Chain(&e), "faults file ignored"),
        }
    }
}

fn append_line(path: &Path, rpc: &str, volume_id: &str) -> Result<(), FaultError> {
    let vol = if volume_id.is_empty() { "-" } else { volume_id };
    let line = format!("{rpc} {vol}\n");
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        // One write of the whole line on an O_APPEND file: concurrent lines never interleave.
        .and_then(|mut f| f.write_all(line.as_bytes()))
        .map_err(|source| FaultError::Log {
            path: path.to_path_buf(),
            source,
        })
}

fn exit_now(rpc: &str, point: &str) -> ! {
    tracing::warn!(rpc, point, "exit-in fault: exiting without a reply");
    std::process::exit(EXIT_CODE);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        assert_eq!(
            parse_fail("NodePublishVolume=UNAVAILABLE:2").unwrap(),
            FaultSpec::Fail {
                rpc: "NodePublishVolume".into(),
                code: Code::Unavailable,
                count: Some(2)
            }
        );
        assert_eq!(
            parse_fail("Probe=14").unwrap(),
            FaultSpec::Fail {
                rpc: "Probe".into(),
                code: Code::Unavailable,
                count: None
            }
        );
        assert_eq!(
            parse_delay("Probe=100").unwrap(),
            FaultSpec::Delay {
                rpc: "Probe".into(),
                millis: 100
            }
        );
        assert_eq!(
            parse_exit_in("NodeStageVolume").unwrap(),
            FaultSpec::ExitIn {
                rpc: "NodeStageVolume".into(),
                point: ExitPoint::After
            }
        );
        assert_eq!(
            parse_exit_in("NodeStageVolume:before").unwrap(),
            FaultSpec::ExitIn {
                rpc: "NodeStageVolume".into(),
                point: ExitPoint::Before
            }
        );
        for bad in [
            "Probe",
            "Probe=NOPE",
            "Probe=OK",
            "Probe=14:x",
            "=14",
            "a b=14",
        ] {
            assert!(parse_fail(bad).is_err(), "{bad}");
        }
        assert!(parse_exit_in("Probe:during").is_err());
        assert!(parse_delay("Probe=soon").is_err());
        assert_eq!(
            parse_stall("CreateVolume=250").unwrap(),
            FaultSpec::Stall {
                rpc: "CreateVolume".into(),
                millis: 250
            }
        );
        assert!(parse_stall("CreateVolume").is_err());
    }

    #[test]
    fn parses_lies_and_refuses_modes_that_do_not_fit_the_rpc() {
        let lie = |rpc: &str, mode| FaultSpec::Lie {
            rpc: rpc.into(),
            mode,
        };
        let cases = [
            (
                "NodePublishVolume",
                lie("NodePublishVolume", LieMode::NoWork),
            ),
            (
                "NodeStageVolume:no-work",
                lie("NodeStageVolume", LieMode::NoWork),
            ),
            (
                "ControllerPublishVolume:empty-context",
                lie("ControllerPublishVolume", LieMode::EmptyContext),
            ),
            (
                "CreateVolume:empty-id",
                lie("CreateVolume", LieMode::EmptyId),
            ),
            (
                "CreateVolume:small-capacity",
                lie("CreateVolume", LieMode::SmallCapacity),
            ),
            (
                "CreateVolume:reused-id",
                lie("CreateVolume", LieMode::ReusedId),
            ),
            (
                "NodeStageVolume:garbage",
                lie("NodeStageVolume", LieMode::Garbage),
            ),
            (
                "GetPluginInfo:bad-utf8",
                lie("GetPluginInfo", LieMode::BadUtf8),
            ),
        ];
        for (spec, want) in cases {
            assert_eq!(parse_lie(spec).unwrap(), want, "{spec}");
        }
        for bad in [
            "NodeStageVolume:empty-context",
            "NodePublishVolume:empty-id",
            "NodeStageVolume:bad-utf8",
            "CreateVolume:fib",
            ":garbage",
        ] {
            let err = parse_lie(bad).unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("invalid fault spec '{bad}'")),
                "{err}"
            );
        }
        assert!(parse_lie("NodeStageVolume:empty-context")
            .unwrap_err()
            .to_string()
            .ends_with("lie mode empty-context applies only to ControllerPublishVolume"));
    }

    #[test]
    fn lies_without_work_and_lies_in_the_reply_are_told_apart() {
        let faults = Faults::new(
            vec![
                parse_lie("NodePublishVolume").unwrap(),
                parse_lie("CreateVolume:empty-id").unwrap(),
            ],
            None,
            None,
        );
        assert!(faults.lie("NodePublishVolume"));
        assert_eq!(faults.reply_lie("NodePublishVolume"), None);
        assert!(!faults.lie("CreateVolume"));
        assert_eq!(faults.reply_lie("CreateVolume"), Some(LieMode::EmptyId));
        assert_eq!(faults.reply_lie("DeleteVolume"), None);
    }

    #[test]
    fn parses_files() {
        let specs = parse_file("# comment\nfail NodePublishVolume=UNAVAILABLE:2\n\ndelay Probe=100\nexit-in NodeStageVolume:after\nstall CreateVolume=10\nlie NodeStageVolume:garbage\n")
            .unwrap();
        assert_eq!(specs.len(), 5);
        assert!(parse_file("explode Probe").is_err());
    }

    #[tokio::test]
    async fn counted_failures_run_out_and_file_changes_reset_counters() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("faults");
        let log = dir.path().join("calls");
        let faults = Faults::new(
            vec![parse_fail("Probe=ABORTED:1").unwrap()],
            Some(file.clone()),
            Some(log.clone()),
        );
        assert_eq!(
            faults.enter("Probe", "").await.unwrap_err().code(),
            Code::Aborted
        );
        assert!(faults.enter("Probe", "").await.is_ok());
        fs::write(&file, "fail CreateVolume=INTERNAL:1\n").unwrap();
        // The reload resets the command-line counter too.
        assert_eq!(
            faults.enter("Probe", "").await.unwrap_err().code(),
            Code::Aborted
        );
        assert_eq!(
            faults.enter("CreateVolume", "v").await.unwrap_err().code(),
            Code::Internal
        );
        assert!(faults.enter("CreateVolume", "v").await.is_ok());
        let logged = fs::read_to_string(&log).unwrap();
        assert_eq!(
            logged,
            "Probe -\nProbe -\nProbe -\nCreateVolume v\nCreateVolume v\n"
        );
    }
}
