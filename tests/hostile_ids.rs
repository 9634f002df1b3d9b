//! Hostile volume names and ids pushed through the whole system, as a user
//! or a misbehaving plugin would push them: the built `csi-isolator`
//! binary, the bundled `csi-test-plugin` it manages, real mount namespaces
//! and real bind mounts (as root).
//!
//! - Names (`/`, `..`, `.`, whitespace, a literal `\040`, `%`, a leading
//!   `-`, 128 bytes, non-ASCII) go through `volume create`, two `run`s (write
//!   then read back), `volume list`, `status`, `volume publish`/`release`
//!   and `volume destroy`.
//! - Ids: the bundled plugin makes ids with any prefix (`--id-prefix`), so
//!   path syntax in the plugin's own volume ids goes through the same steps.
//! - Values the system must refuse (non-UTF-8 arguments, empty and
//!   over-long names, bad plugin names and container ids, hostile resource
//!   JSON) fail with an error naming them and leave nothing behind.
//! - A work dir whose path the kernel escapes in `/proc/self/mountinfo`
//!   (space, tab, newline, backslash) still has its mounts found by
//!   `status` and undone by `release`.
//!
//! After every case: everything created lies under `<sandbox>/work` (or the
//! socket dir `<sandbox>/s`), every work-dir component is one of the
//! encoding's safe names, nothing is mounted under the sandbox or anywhere
//! new on the host, no process of the case is left, and `status` agrees.
//!
//! The last tests pin down findings of this suite, now fixed: one line per
//! volume in tables, non-UTF-8 arguments and work dirs named and refused, CSI's
//! limits on names enforced before the plugin is called, unknown volume modes
//! refused, over-long plugin ids failing with the plugin's reason, uses
//! recorded by `volume publish` kept by `run`, container ids validated.

use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use csi_isolator::mount::{MountTable, ProcMountTable};
use csi_isolator::resource::encode_volume_id;
use csi_isolator_testing::{host_mount_points, processes_mentioning, require_root, Sandbox};
use serde_json::Value;

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");

/// The bundled plugin's type (GetPluginInfo name), a layout component.
const PLUGIN_TYPE: &str = "csi-test-plugin.csi-isolator.io";

/// One case's sandbox: the work dir, the socket dir, an empty working
/// directory for the commands and a directory for the test's own inputs.
struct Case {
    sb: Sandbox,
    work: PathBuf,
    cwd: PathBuf,
    inputs: PathBuf,
    /// Arguments added to every command that drives the plugin.
    plugin_args: Vec<OsString>,
    mounts_before: Vec<PathBuf>,
}

/// What one command did.
struct Ran {
    what: String,
    code: Option<i32>,
    stdout: Vec<u8>,
    stderr: String,
}

impl Ran {
    fn new(what: String, out: Output) -> Ran {
        Ran {
            what,
            code: out.status.code(),
            stdout: out.stdout,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// Panics unless the command succeeded.
    fn ok(self) -> Ran {
        assert_eq!(
            self.code,
            Some(0),
            "{} failed:\nstderr: {}\nstdout: {}",
            self.what,
            self.stderr,
            String::from_utf8_lossy(&self.stdout)
        );
        self
    }

    /// Panics unless the command failed.
    fn failed(self) -> Ran {
        assert!(
            self.code.is_some_and(|c| c != 0),
            "{} should have failed ({:?}); stdout: {}",
            self.what,
            self.code,
            String::from_utf8_lossy(&self.stdout)
        );
        self
    }

    fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "{}: stdout is not JSON ({e}): {}",
                self.what,
                self.stdout_text()
            )
        })
    }
}

impl Case {
    fn new(label: &str) -> Case {
        let sb = Sandbox::new(label);
        Case::with_work(sb, OsStr::new("work"))
    }

    /// A case whose work dir is `<sandbox>/<work_name>` (any bytes).
    fn with_work(sb: Sandbox, work_name: &OsStr) -> Case {
        let work = sb.join(work_name);
        let cwd = sb.mkdir("cwd");
        let inputs = sb.mkdir("in");
        let mounts_before = host_mount_points(&sb);
        Case {
            sb,
            work,
            cwd,
            inputs,
            plugin_args: Vec::new(),
            mounts_before,
        }
    }

    /// `csi-isolator --work-dir <work> <args...>`; plugin sockets in `<sandbox>/s`.
    fn cmd<I, S>(&self, args: I) -> Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut c = Command::new(CLI);
        c.arg("--work-dir")
            .arg(&self.work)
            .args(args)
            .env("CSI_ISOLATOR_SOCKET_DIR", self.sb.join("s"))
            .env_remove("RUST_LOG")
            .env_remove("CSI_ISOLATOR_WORK_DIR")
            .current_dir(&self.cwd)
            .stdin(Stdio::null());
        c
    }

    fn run_cmd(&self, mut cmd: Command) -> Ran {
        // Commands with 4 KiB arguments are named by their start.
        let what: String = format!("{cmd:?}").chars().take(300).collect();
        Ran::new(what, cmd.output().expect("spawn csi-isolator"))
    }

    /// `csi-isolator volume [plugin args] <verb> <rest...>`.
    fn volume(&self, verb: &str, rest: &[&OsStr]) -> Ran {
        let mut args: Vec<OsString> = vec!["volume".into()];
        args.extend(self.plugin_args.iter().cloned());
        args.push(verb.into());
        args.extend(rest.iter().map(|s| s.to_os_string()));
        self.run_cmd(self.cmd(args))
    }

    /// `csi-isolator run [plugin args] <opts...> -- <argv...>`.
    fn run(&self, opts: &[&OsStr], argv: &[&str]) -> Ran {
        let mut args: Vec<OsString> = vec!["run".into()];
        args.extend(self.plugin_args.iter().cloned());
        args.extend(opts.iter().map(|s| s.to_os_string()));
        args.push("--".into());
        args.extend(argv.iter().map(OsString::from));
        self.run_cmd(self.cmd(args))
    }

    fn status_json(&self) -> (Option<i32>, Value) {
        let ran = self.run_cmd(self.cmd(["status", "--json"]));
        let json = ran.json();
        (ran.code, json)
    }

    /// `status --json` succeeds and reports no disagreement; returns the volumes.
    fn status_agrees(&self, when: &str) -> Vec<Value> {
        let (code, report) = self.status_json();
        assert_eq!(code, Some(0), "{when}: status disagrees: {report:#}");
        assert_eq!(report["unreadable"], Value::Array(vec![]), "{when}");
        let vols = report["volumes"].as_array().expect("volumes").clone();
        for v in &vols {
            assert!(v["disagreement"].is_null(), "{when}: {v:#}");
        }
        vols
    }

    fn list_json(&self) -> Vec<Value> {
        let ran = self.volume("list", &["--json".as_ref()]).ok();
        ran.json().as_array().expect("a list").clone()
    }

    /// `<work>/csi/<type>/default`.
    fn plugin_base(&self) -> PathBuf {
        self.work.join("csi").join(PLUGIN_TYPE).join("default")
    }

    /// The checks every case ends with (see the module docs).
    fn assert_clean(&self, allowed_roots: &[&OsStr], when: &str) {
        self.sb.assert_no_mounts_under();
        assert_eq!(
            host_mount_points(&self.sb),
            self.mounts_before,
            "{when}: the host's mount table changed"
        );
        let procs = processes_mentioning(&self.work);
        assert!(procs.is_empty(), "{when}: processes left: {procs:?}");
        assert!(
            fs::read_dir(&self.cwd).unwrap().next().is_none(),
            "{when}: something was created in the commands' working directory"
        );
        let work_name = self.work.file_name().unwrap();
        for entry in walk(self.sb.path()) {
            let rel = entry.strip_prefix(self.sb.path()).unwrap();
            let mut comps = rel.iter();
            let top = comps.next().unwrap();
            let known = [
                OsStr::new("cwd"),
                OsStr::new("in"),
                OsStr::new("s"),
                work_name,
            ];
            assert!(
                known.contains(&top) || allowed_roots.contains(&top),
                "{when}: created outside the work dir: {}",
                show(rel.as_os_str())
            );
            if top == work_name {
                for comp in comps {
                    assert!(
                        is_safe_component(comp.as_bytes()),
                        "{when}: unsafe work-dir component {} in {}",
                        show(comp),
                        show(rel.as_os_str())
                    );
                }
            }
        }
    }

    /// The work dir holds no trace of any volume: no checkpoint, mount dir,
    /// create intent, container checkpoint or sandbox, and the plugin's
    /// store is empty.
    fn assert_no_volume_left(&self, when: &str) {
        let base = self.plugin_base();
        for dir in [
            base.join("volumes"),
            base.join("mounts"),
            base.join("creating"),
            base.join("plugin/data/volumes"),
            self.work.join("sandboxes"),
            self.work.join("isolators/volume/csi"),
        ] {
            let left: Vec<String> = match fs::read_dir(&dir) {
                Ok(d) => d.flatten().map(|e| show(&e.file_name())).collect(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
                Err(e) => panic!("{when}: read {}: {e}", dir.display()),
            };
            assert!(
                left.is_empty(),
                "{when}: left in {}: {left:?}",
                dir.display()
            );
        }
    }
}

/// A value as people should see it: escaped, on one line.
fn show(s: &OsStr) -> String {
    s.as_bytes().escape_ascii().to_string()
}

/// What `encode_volume_id` may produce: `[A-Za-z0-9._%~-]`, never `.`/`..`.
fn is_safe_component(c: &[u8]) -> bool {
    !c.is_empty()
        && c != b"."
        && c != b".."
        && c.iter()
            .all(|b| b.is_ascii_alphanumeric() || b"._%~-".contains(b))
}

/// Every entry under `root` (not following symlinks), depth first.
fn walk(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = fs::read_dir(&dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
        for e in entries {
            let path = e.expect("dir entry").path();
            let meta = fs::symlink_metadata(&path).expect("lstat");
            if meta.is_dir() {
                stack.push(path.clone());
            }
            out.push(path);
        }
    }
    out
}

/// `disk.source.id` and the host mount point of a created volume's resource.
fn created(case: &Case, ran: &Ran) -> (String, PathBuf) {
    let res = ran.json();
    let source = &res["disk"]["source"];
    let id = source["id"].as_str().expect("disk.source.id").to_string();
    let root = source["mount"]["root"].as_str().expect("mount.root");
    let rel = root
        .strip_prefix("./")
        .unwrap_or_else(|| panic!("a created volume's root is relative: {root:?}"));
    assert_eq!(rel, format!("csi/{PLUGIN_TYPE}/default/mounts"));
    let mount_point = case
        .work
        .join(rel)
        .join(encode_volume_id(&id))
        .join("target");
    (id, mount_point)
}

fn one_volume(vols: &[Value], when: &str) -> Value {
    assert_eq!(vols.len(), 1, "{when}: one volume: {vols:#?}");
    vols[0].clone()
}

/// What a hostile value went through, for the summary.
#[derive(Default)]
struct Tally {
    cases: usize,
    commands: usize,
    table_breaks: Vec<String>,
}

/// The full life of one volume: create, run (write), run (read back), list,
/// status, publish (mounted, status agrees, data visible), release
/// (unmounted), destroy; then nothing is left. `name` is the CreateVolume
/// name; `case.plugin_args` may make the plugin's ids hostile.
fn full_life(case: &Case, name: &str, token: &str, tally: &mut Tally) -> String {
    let when = format!("name {}", show(OsStr::new(name)));
    let when = when.as_str();
    let create = case
        .volume("create", &["--".as_ref(), name.as_ref(), "8M".as_ref()])
        .ok();
    let (id, mount_point) = created(case, &create);
    assert!(!id.is_empty(), "{when}");

    let vol_arg = OsString::from(format!("--volume={name}:8M:d"));
    let write = case
        .run(
            &[&vol_arg],
            &["sh", "-c", "printf %s \"$1\" > d/f && cat d/f", "sh", token],
        )
        .ok();
    assert_eq!(write.stdout_text(), token, "{when}");
    let read = case.run(&[&vol_arg], &["cat", "d/f"]).ok();
    assert_eq!(
        read.stdout_text(),
        token,
        "{when}: read back by a second run"
    );

    let listed = one_volume(&case.list_json(), when);
    assert_eq!(listed["name"].as_str(), Some(name), "{when}: list --json");
    assert_eq!(listed["volume_id"].as_str(), Some(id.as_str()), "{when}");
    assert_eq!(listed["state"], "CREATED", "{when}");

    let status = one_volume(&case.status_agrees(when), when);
    assert_eq!(status["name"].as_str(), Some(name), "{when}: status --json");
    assert_eq!(status["volume_id"].as_str(), Some(id.as_str()), "{when}");
    assert_eq!(status["mounted"], false, "{when}");
    assert_eq!(
        status["mount_point"].as_str().map(Path::new),
        Some(mount_point.as_path()),
        "{when}"
    );

    // The tables: one line per volume is the contract; a name that breaks
    // it fails the test once every case has run.
    let table = case.volume("list", &[]).ok();
    let lines = table.stdout_text().lines().count();
    let status_table = case.run_cmd(case.cmd(["status"])).ok();
    let status_lines = status_table.stdout_text().lines().count();
    // status: the header, the volume's row, its mount point and its size.
    if lines != 2 || status_lines != 4 {
        tally.table_breaks.push(format!(
            "{when}, id {}: `volume list` printed {lines} lines (want 2), `status` {status_lines} (want 4)",
            show(OsStr::new(&id))
        ));
    }

    // Publish by id (the name resolves to it too), then release.
    let publish = case
        .volume(
            "publish",
            &[
                "--container".as_ref(),
                "c1".as_ref(),
                "--".as_ref(),
                id.as_ref(),
            ],
        )
        .ok();
    assert_eq!(
        Path::new(OsStr::from_bytes(publish.stdout.trim_ascii_end())),
        mount_point,
        "{when}: publish prints the mount point"
    );
    let table = ProcMountTable::new();
    assert!(
        table.is_mount_point(&mount_point).unwrap(),
        "{when}: {} is mounted",
        mount_point.display()
    );
    assert_eq!(
        fs::read_to_string(mount_point.join("f")).unwrap(),
        token,
        "{when}: the data is in the published volume"
    );
    let status = one_volume(&case.status_agrees(when), when);
    assert_eq!(status["state"], "PUBLISHED", "{when}");
    assert_eq!(status["mounted"], true, "{when}");
    assert_eq!(status["users"], serde_json::json!(["c1"]), "{when}");
    case.volume(
        "release",
        &[
            "--container".as_ref(),
            "c1".as_ref(),
            "--".as_ref(),
            name.as_ref(),
        ],
    )
    .ok();
    assert!(
        case.sb.mounts_under().is_empty(),
        "{when}: release unmounted everything"
    );
    let status = one_volume(&case.status_agrees(when), when);
    assert_eq!(status["state"], "CREATED", "{when}");
    assert_eq!(status["mounted"], false, "{when}");

    case.volume("destroy", &["--".as_ref(), name.as_ref()]).ok();
    assert!(case.list_json().is_empty(), "{when}: destroyed");
    assert!(case.status_agrees(when).is_empty(), "{when}");
    case.assert_no_volume_left(when);
    case.assert_clean(&[], when);
    tally.cases += 1;
    tally.commands += 14;
    id
}

/// CreateVolume names a user may choose. The CSI spec allows any Unicode
/// string of at most 128 bytes without most control characters; none of
/// these may become a path, and `:` is `--volume`'s separator.
fn hostile_names() -> Vec<String> {
    vec![
        "a/b".into(),
        "../../escape".into(),
        "..".into(),
        ".".into(),
        "/".into(),
        "with space".into(),
        "new\nline".into(),
        "tab\there".into(),
        "cr\rname".into(),
        "\\040octal".into(),
        "100%2F%".into(),
        "%2E%2E".into(),
        "-leading-dash".into(),
        "--volume".into(),
        "卷/ü".into(),
        "/".repeat(128),
        "x".repeat(128),
    ]
}

fn names_case(range: std::ops::Range<usize>) {
    require_root();
    let mut tally = Tally::default();
    let names = hostile_names();
    for (i, name) in names[range.clone()].iter().enumerate() {
        let case = Case::new("hostile-name");
        let id = full_life(&case, name, &format!("token-{i}\n"), &mut tally);
        assert!(id.starts_with("vol-"), "the plugin chose the id: {id}");
    }
    assert!(
        tally.table_breaks.is_empty(),
        "table output broken: {:#?}",
        tally.table_breaks
    );
    eprintln!(
        "hostile_ids: {} hostile names (of {}) through create/run/run/list/status/publish/release/destroy, {} commands",
        tally.cases,
        names.len(),
        tally.commands
    );
}

#[test]
fn hostile_names_live_and_die_cleanly_first_half() {
    names_case(0..hostile_names().len() / 2);
}

#[test]
fn hostile_names_live_and_die_cleanly_second_half() {
    names_case(hostile_names().len() / 2..hostile_names().len());
}

/// Prefixes the plugin puts in front of its ids (16 hex digits follow).
fn hostile_id_prefixes() -> Vec<String> {
    vec![
        "../../".into(),
        "/".into(),
        "/../".into(),
        ".".into(),
        "..".into(),
        "-".into(),
        " ".into(),
        "\n".into(),
        "\t".into(),
        "\\040".into(),
        "%".into(),
        "%2E%2E%2F".into(),
        "a b\n\t\\040%/-.".into(),
        "卷".into(),
        // 216 bytes: over CSI's 128 and over the 200 bytes an encoded name
        // may have, so the work dir gets the hashed form.
        "a".repeat(200),
    ]
}

fn ids_case(range: std::ops::Range<usize>) {
    require_root();
    let mut tally = Tally::default();
    let prefixes = hostile_id_prefixes();
    for (i, prefix) in prefixes[range].iter().enumerate() {
        let mut case = Case::new("hostile-id");
        case.plugin_args = vec![format!("--plugin-arg=--id-prefix={prefix}").into()];
        let id = full_life(&case, "v", &format!("id-token-{i}"), &mut tally);
        assert!(
            id.starts_with(prefix.as_str()) && id.len() == prefix.len() + 16,
            "the plugin's id {} has the prefix {}",
            show(OsStr::new(&id)),
            show(OsStr::new(prefix))
        );
    }
    assert!(
        tally.table_breaks.is_empty(),
        "table output broken: {:#?}",
        tally.table_breaks
    );
    eprintln!(
        "hostile_ids: {} hostile plugin volume ids (of {}) through the same life, {} commands",
        tally.cases,
        prefixes.len(),
        tally.commands
    );
}

#[test]
fn hostile_plugin_volume_ids_are_encoded_end_to_end_first_half() {
    ids_case(0..hostile_id_prefixes().len() / 2);
}

#[test]
fn hostile_plugin_volume_ids_are_encoded_end_to_end_second_half() {
    ids_case(hostile_id_prefixes().len() / 2..hostile_id_prefixes().len());
}

/// Asserts a refusal: it failed, says `says`, ran no workload, and left no
/// volume behind.
fn refused(case: &Case, ran: Ran, says: &[&str], when: &str) {
    let ran = ran.failed();
    for s in says {
        assert!(
            ran.stderr.contains(s),
            "{when}: the error should say {s:?}: {}",
            ran.stderr
        );
    }
    assert!(
        !ran.stdout_text().contains("workload-ran"),
        "{when}: the workload ran"
    );
    case.assert_no_volume_left(when);
    case.assert_clean(&[], when);
}

#[test]
fn values_the_system_must_refuse_leave_nothing_behind() {
    require_root();
    let case = Case::new("hostile-refused");
    let mut count = 0;
    let workload = ["sh", "-c", "echo workload-ran"];

    // Non-UTF-8 bytes on the command line: refused by argument parsing,
    // before anything is created (the work dir does not even exist).
    let bad = OsStr::from_bytes(b"a\xffb");
    let mut vol = OsString::from("--volume=");
    vol.push(bad);
    vol.push(":8M:d");
    for ran in [
        case.volume("create", &["--".as_ref(), bad, "8M".as_ref()]),
        case.run(&[&vol], &workload),
        case.volume("publish", &["--container".as_ref(), "c".as_ref(), bad]),
        case.volume("destroy", &[bad]),
    ] {
        let when = format!("non-UTF-8 argument: {}", ran.what);
        assert_eq!(ran.code, Some(2), "{when}: a usage error: {}", ran.stderr);
        refused(&case, ran, &["invalid UTF-8"], &when);
        assert!(!case.work.exists(), "{when}: nothing created");
        count += 1;
    }

    // The empty name: `--volume` refuses it, and so does `volume create`
    // (the provider checks names before any intent or RPC).
    let ran = case.run(&["--volume=:8M:d".as_ref()], &workload);
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    refused(&case, ran, &["missing NAME"], "empty --volume name");
    let ran = case.volume("create", &["--".as_ref(), "".as_ref(), "8M".as_ref()]);
    refused(&case, ran, &["volume ''", "name"], "empty create name");
    count += 2;

    // Over CSI's 128-byte limit for strings (CreateVolumeRequest.name has
    // no other limit): refused, whether 129 bytes or 4 KiB.
    for len in [129, 4096] {
        let long = "n".repeat(len);
        let when = format!("{len}-byte name");
        // Shown whole up to 256 bytes, else shortened to its start.
        let says = if len <= 256 {
            long.clone()
        } else {
            format!("{}… ({len} bytes)", &long[..64])
        };
        let ran = case.volume("create", &["--".as_ref(), long.as_ref(), "8M".as_ref()]);
        refused(&case, ran, &[&says, "128 bytes"], &when);
        let ran = case.run(&[format!("--volume={long}:8M:d").as_ref()], &workload);
        refused(&case, ran, &[&says, "128 bytes"], &when);
        count += 2;
    }

    // Plugin names are path components, validated, not encoded.
    for name in ["..", ".", "a/b", "", "../../x", &"p".repeat(256)] {
        let when = format!("plugin name {name:?}");
        let ran = case.run_cmd(case.cmd(["volume", "--plugin-name", name, "list"]));
        refused(
            &case,
            ran,
            &["invalid plugin name", &format!("{name:?}")],
            &when,
        );
        let ran = case.run(
            &[
                "--plugin-name".as_ref(),
                name.as_ref(),
                "--volume=v:8M:d".as_ref(),
            ],
            &workload,
        );
        refused(
            &case,
            ran,
            &["invalid plugin name", &format!("{name:?}")],
            &when,
        );
        count += 2;
    }

    // Container ids of `run` are path components too.
    for id in ["..", ".", "a/b", "", "../../x", &"c".repeat(256)] {
        let when = format!("container id {id:?}");
        let ran = case.run(
            &[
                "--container-id".as_ref(),
                id.as_ref(),
                "--volume=v:8M:d".as_ref(),
            ],
            &workload,
        );
        refused(
            &case,
            ran,
            &["invalid container id", &format!("{id:?}")],
            &when,
        );
        count += 1;
    }
    eprintln!("hostile_ids: {count} refusals, each leaving nothing behind");
}

/// A resource list holding one volume resource, written to `<in>/<file>`.
fn resources_file(case: &Case, file: &str, resource: &Value) -> PathBuf {
    let path = case.inputs.join(file);
    fs::write(
        &path,
        serde_json::to_vec(&serde_json::json!([resource])).unwrap(),
    )
    .unwrap();
    path
}

#[test]
fn hostile_resource_json_is_refused_or_encoded() {
    require_root();
    let case = Case::new("hostile-resources");
    let mut count = 0;
    let create = case
        .volume("create", &["real".as_ref(), "8M".as_ref()])
        .ok();
    let (id, _) = created(&case, &create);
    let mut good = create.json();
    good["disk"]["volume"] = serde_json::json!({"container_path": "d", "mode": "RW"});
    let file = resources_file(&case, "good.json", &good);
    case.run(
        &["--resources".as_ref(), file.as_ref()],
        &["sh", "-c", "echo kept > d/f"],
    )
    .ok();

    // After each refusal the real volume is untouched: unused, unmounted,
    // its data intact.
    let intact = |when: &str| {
        let vol = one_volume(&case.status_agrees(when), when);
        assert_eq!(vol["state"], "CREATED", "{when}");
        assert_eq!(vol["users"], serde_json::json!([]), "{when}");
        let read = case
            .run(&["--resources".as_ref(), file.as_ref()], &["cat", "d/f"])
            .ok();
        assert_eq!(read.stdout_text(), "kept\n", "{when}");
        case.assert_clean(&[], when);
        for dir in ["sandboxes", "isolators/volume/csi"] {
            let dir = case.work.join(dir);
            let left = fs::read_dir(&dir).map(|d| d.count()).unwrap_or(0);
            assert_eq!(left, 0, "{when}: left in {}", dir.display());
        }
    };

    // A non-UTF-8 byte inside a JSON string.
    let text = serde_json::to_vec(&serde_json::json!([good])).unwrap();
    let field = b"\"container_path\":\"d";
    let at = text
        .windows(field.len())
        .position(|w| w == field)
        .expect("the container path in the JSON");
    let mut bad = text.clone();
    bad.insert(at + field.len(), 0xff);
    let bad_file = case.inputs.join("non-utf8.json");
    fs::write(&bad_file, &bad).unwrap();
    let ran = case.run(
        &["--resources".as_ref(), bad_file.as_ref()],
        &["echo", "workload-ran"],
    );
    let ran = ran.failed();
    assert!(
        ran.stderr.contains(&bad_file.display().to_string()) && ran.stderr.contains("UTF-8"),
        "names the file and the problem: {}",
        ran.stderr
    );
    assert!(!ran.stdout_text().contains("workload-ran"));
    intact("non-UTF-8 byte in the resource JSON");
    count += 1;

    // Ids with path syntax: never a path. With the provider's id: an
    // unknown volume; without a provider: the encoded mount point of an
    // operator-prepared disk, which does not exist.
    let mut with_provider = good.clone();
    let dotdot_id = format!("../../{id}");
    with_provider["disk"]["source"]["id"] = dotdot_id.clone().into();
    let mut without_provider = good.clone();
    without_provider["disk"]["source"]["id"] = "../../../../etc".into();
    without_provider
        .as_object_mut()
        .unwrap()
        .remove("provider_id");
    let mut absolute_root = without_provider.clone();
    absolute_root["disk"]["source"]["mount"]["root"] = "/etc".into();
    for (label, res, says) in [
        (
            "id ../../<real id>",
            &with_provider,
            vec![dotdot_id.as_str()],
        ),
        (
            "id ../../../../etc, no provider",
            &without_provider,
            vec!["..%2F..%2F..%2F..%2Fetc/target"],
        ),
        (
            "id ../../../../etc under /etc",
            &absolute_root,
            vec!["/etc/..%2F..%2F..%2F..%2Fetc/target"],
        ),
    ] {
        let f = resources_file(&case, "id.json", res);
        let ran = case
            .run(
                &["--resources".as_ref(), f.as_ref()],
                &["echo", "workload-ran"],
            )
            .failed();
        for s in says {
            assert!(ran.stderr.contains(s), "{label}: {}", ran.stderr);
        }
        assert!(!ran.stdout_text().contains("workload-ran"), "{label}");
        let mounts = case.plugin_base().join("mounts");
        let encoded = fs::read_dir(&mounts)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .filter(|n| n.as_bytes().starts_with(b".."))
            .count();
        assert_eq!(encoded, 0, "{label}: nothing made for the id");
        intact(label);
        count += 1;
    }

    // Container paths that climb out, and roots with `..`.
    for path in [
        "..",
        "../escape",
        "../../escape",
        "a/../../escape",
        "d/../..",
        "/..",
        "/etc/x/../../../tmp",
        "",
    ] {
        let mut res = good.clone();
        res["disk"]["volume"]["container_path"] = path.into();
        let f = resources_file(&case, "path.json", &res);
        let ran = case
            .run(
                &["--resources".as_ref(), f.as_ref()],
                &["echo", "workload-ran"],
            )
            .failed();
        assert!(
            ran.stderr.contains(&format!("container_path '{path}'")),
            "container_path {path:?}: {}",
            ran.stderr
        );
        assert!(!ran.stdout_text().contains("workload-ran"));
        intact(&format!("container_path {path:?}"));
        count += 1;
    }
    for root in ["./csi/../../../etc", "../x", "/srv/../etc"] {
        let mut res = good.clone();
        res["disk"]["source"]["mount"]["root"] = root.into();
        let f = resources_file(&case, "root.json", &res);
        let ran = case
            .run(
                &["--resources".as_ref(), f.as_ref()],
                &["echo", "workload-ran"],
            )
            .failed();
        assert!(
            ran.stderr.contains("disk.source.mount.root") && ran.stderr.contains(root),
            "root {root:?}: {}",
            ran.stderr
        );
        intact(&format!("mount.root {root:?}"));
        count += 1;
    }

    // Hostile but harmless container paths: inside the sandbox, as asked.
    for path in ["da ta\nx", "\\040", "-d", "./d/./e", "%2E%2E"] {
        let mut res = good.clone();
        res["disk"]["volume"]["container_path"] = path.into();
        let f = resources_file(&case, "ok-path.json", &res);
        let ran = case
            .run(
                &["--resources".as_ref(), f.as_ref()],
                &["sh", "-c", "cat \"./$1/f\"", "sh", path],
            )
            .ok();
        assert_eq!(ran.stdout_text(), "kept\n", "container_path {path:?}");
        intact(&format!("container_path {path:?}"));
        count += 1;
    }
    eprintln!("hostile_ids: {count} hostile resource JSON cases");
}

/// Whether the raw `/proc/self/mountinfo` holds `needle` (an escaped path).
fn raw_mountinfo_has(needle: &[u8]) -> bool {
    let raw = fs::read("/proc/self/mountinfo").unwrap();
    raw.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn mount_points_the_kernel_escapes_are_found_and_undone() {
    require_root();
    // Space, tab, newline and backslash are written as \040, \011, \012
    // and \134 in mountinfo; a literal "\040" must not read as a space.
    let work_name = OsStr::new("work dir\t\n\\040%-x \\134");
    let mut case = Case::with_work(Sandbox::new("hostile-mountinfo"), work_name);
    case.plugin_args = vec!["--plugin-arg=--id-prefix=a b\n\\040/".into()];
    let name = "n\n\\040 x";
    let create = case
        .volume("create", &["--".as_ref(), name.as_ref(), "8M".as_ref()])
        .ok();
    let (id, mount_point) = created(&case, &create);

    // A run through the same paths: it mounts the volume in its own
    // namespace; the host sees the publish and, after it, the unpublish.
    let vol_arg = OsString::from(format!("--volume={name}:8M:d"));
    let ran = case
        .run(&[&vol_arg], &["sh", "-c", "echo esc > d/f; cat d/f"])
        .ok();
    assert_eq!(ran.stdout_text(), "esc\n");
    assert!(case.sb.mounts_under().is_empty(), "the run unpublished it");
    let vol = one_volume(&case.status_agrees("after run"), "after run");
    assert_eq!(vol["state"], "CREATED");

    let publish = case
        .volume(
            "publish",
            &["--container".as_ref(), "c1".as_ref(), name.as_ref()],
        )
        .ok();
    assert_eq!(
        Path::new(OsStr::from_bytes(publish.stdout.trim_ascii_end())),
        mount_point
    );
    assert!(
        raw_mountinfo_has(b"work\\040dir\\011\\012\\134040%-x\\040\\134134/csi/"),
        "the kernel escaped the work dir in mountinfo"
    );
    let table = ProcMountTable::new();
    assert!(
        table.is_mount_point(&mount_point).unwrap(),
        "found by the parser"
    );
    let under: Vec<PathBuf> = table
        .mounts_under(&case.work)
        .unwrap()
        .into_iter()
        .map(|m| m.mount_point)
        .collect();
    assert!(under.contains(&mount_point), "{under:?}");
    let staging = mount_point.with_file_name("staging");
    assert!(under.contains(&staging), "staged: {under:?}");
    let vol = one_volume(&case.status_agrees("published"), "published");
    assert_eq!(vol["mounted"], true);
    assert_eq!(vol["staged"], true);
    assert_eq!(vol["state"], "PUBLISHED");
    assert_eq!(vol["volume_id"].as_str(), Some(id.as_str()));
    assert_eq!(
        vol["mount_point"].as_str().map(Path::new),
        Some(mount_point.as_path())
    );

    assert_eq!(fs::read_to_string(mount_point.join("f")).unwrap(), "esc\n");
    assert_eq!(vol["users"], serde_json::json!(["c1"]));

    case.volume(
        "release",
        &["--container".as_ref(), "c1".as_ref(), name.as_ref()],
    )
    .ok();
    assert!(
        table.mounts_under(&case.work).unwrap().is_empty(),
        "release unmounted the target and the staging path"
    );
    let vol = one_volume(&case.status_agrees("released"), "released");
    assert_eq!(vol["mounted"], false);
    assert_eq!(vol["staged"], false);
    case.volume("destroy", &[name.as_ref()]).ok();
    case.assert_no_volume_left("mountinfo escapes");
    case.assert_clean(&[], "mountinfo escapes");
    eprintln!(
        "hostile_ids: 1 work dir with mountinfo escapes (publish, run, status, release, destroy)"
    );
}

// ---------------------------------------------------------------------------
// Findings: the behaviour the system should have and does not have yet.
// ---------------------------------------------------------------------------

/// `volume list` and `status` print one line per volume (plus status's
/// mount point and size lines); names and ids are escaped, never written raw.
#[test]
fn tables_keep_one_line_per_volume() {
    require_root();
    let mut case = Case::new("hostile-table");
    // ESC is banned in CreateVolume names (CSI), so it comes in the
    // plugin's ids; names hold the control characters CSI allows.
    case.plugin_args = vec!["--plugin-arg=--id-prefix=i\nd\t\x1b[2J".into()];
    let names = ["new\nline", "cr\rname", "tab\tname"];
    for name in names {
        case.volume("create", &[name.as_ref(), "8M".as_ref()]).ok();
    }
    let list = case.volume("list", &[]).ok().stdout_text();
    let status = case.run_cmd(case.cmd(["status"])).ok().stdout_text();
    for (what, text, per_volume) in [("volume list", &list, 1), ("status", &status, 3)] {
        assert_eq!(
            text.lines().count(),
            1 + per_volume * names.len(),
            "{what}: one row per volume:\n{text}"
        );
        assert!(
            !text.chars().any(|c| c.is_control() && c != '\n'),
            "{what}: no raw control characters:\n{text:?}"
        );
    }
}

/// A non-UTF-8 argument is refused naming the argument, escaped.
#[test]
fn non_utf8_argument_error_names_the_value() {
    require_root();
    let case = Case::new("hostile-utf8");
    let ran = case
        .volume("create", &[OsStr::from_bytes(b"a\xffb"), "8M".as_ref()])
        .failed();
    // Shown escaped (a\xffb) or at least lossily (a\u{FFFD}b), with its place.
    assert!(
        ran.stderr.contains("a\\xffb") || ran.stderr.contains("a\u{FFFD}b"),
        "{}",
        ran.stderr
    );
}

/// CSI: strings SHALL NOT exceed 128 bytes in messages generated by COs,
/// and CreateVolumeRequest.name bans U+0000-U+0008, U+000B, U+000C,
/// U+000E-U+001F and U+007F-U+009F. The CO refuses such a name itself,
/// before writing an intent or calling the plugin.
#[test]
fn names_csi_forbids_never_reach_the_plugin() {
    require_root();
    let mut case = Case::new("hostile-csi-name");
    let calls = case.inputs.join("calls.log");
    let mut arg = OsString::from("--plugin-arg=--log-calls=");
    arg.push(&calls);
    case.plugin_args = vec![arg];
    for name in [
        "n".repeat(129),
        "ctl\x01".into(),
        "esc\x1b".into(),
        "del\x7f".into(),
        "c1\u{85}".into(),
    ] {
        let ran = case
            .volume("create", &[name.as_ref(), "8M".as_ref()])
            .failed();
        assert!(ran.stderr.contains("name"), "{}", ran.stderr);
        let log = fs::read_to_string(&calls).unwrap_or_default();
        assert!(
            !log.contains("CreateVolume"),
            "{name:?} reached the plugin: {log}"
        );
    }
}

/// A work dir whose path is not UTF-8: everything stays under it (or it
/// is refused up front, since CSI paths are UTF-8 strings).
#[test]
fn a_non_utf8_work_dir_is_kept_whole_or_refused() {
    require_root();
    let case = Case::with_work(
        Sandbox::new("hostile-workdir"),
        OsStr::from_bytes(b"work\xff"),
    );
    let create = case.volume("create", &["v".as_ref(), "8M".as_ref()]);
    if create.code != Some(0) {
        assert!(create.stderr.contains("UTF-8"), "{}", create.stderr);
        case.assert_clean(&[], "refused");
        return;
    }
    case.volume(
        "publish",
        &["--container".as_ref(), "c".as_ref(), "v".as_ref()],
    )
    .ok();
    case.status_agrees("published");
    case.volume(
        "release",
        &["--container".as_ref(), "c".as_ref(), "v".as_ref()],
    )
    .ok();
    case.volume("destroy", &["v".as_ref()]).ok();
    case.assert_clean(&[], "non-UTF-8 work dir");
}

/// Mesos' `Volume.Mode` is `RW` or `RO`; anything else is refused, never
/// read as read-write.
#[test]
fn an_unknown_volume_mode_is_not_read_write() {
    require_root();
    let case = Case::new("hostile-mode");
    let create = case.volume("create", &["v".as_ref(), "8M".as_ref()]).ok();
    for mode in ["ro", "READ_ONLY", "R\u{ff}W"] {
        let mut res = create.json();
        res["disk"]["volume"] = serde_json::json!({"container_path": "d", "mode": mode});
        let f = resources_file(&case, "mode.json", &res);
        let ran = case.run(
            &["--resources".as_ref(), f.as_ref()],
            &["sh", "-c", "echo x > d/f && echo wrote"],
        );
        assert!(
            !ran.stdout_text().contains("wrote"),
            "mode {mode:?} gave a writable mount"
        );
    }
}

/// A plugin id too long for the plugin's store: the CO's error says what
/// the plugin said (here it is lost: the plugin's message, holding the id
/// three times, overflows the HTTP/2 header limit).
#[test]
fn an_over_long_plugin_id_fails_with_the_plugins_reason() {
    require_root();
    let mut case = Case::new("hostile-long-id");
    case.plugin_args = vec![format!("--plugin-arg=--id-prefix={}", "/".repeat(4096)).into()];
    let ran = case
        .volume("create", &["v".as_ref(), "8M".as_ref()])
        .failed();
    assert!(!ran.stderr.contains("h2 protocol error"), "{}", ran.stderr);
    case.assert_no_volume_left("4 KiB id");
    case.assert_clean(&[], "4 KiB id");
}

/// `volume publish --container` refuses an empty container id, as `run`
/// does.
#[test]
fn an_empty_container_id_is_refused_by_volume_publish() {
    require_root();
    let case = Case::new("hostile-user");
    case.volume("create", &["v".as_ref(), "8M".as_ref()]).ok();
    case.volume(
        "publish",
        &["--container".as_ref(), "".as_ref(), "v".as_ref()],
    )
    .failed();
    let vol = one_volume(&case.list_json(), "empty container id");
    assert_eq!(vol["users"], serde_json::json!([]));
}

/// A use recorded with `volume publish --container` survives a later `run`
/// on the same work dir (DESIGN.md: a volume still used by a live container
/// is never unpublished).
#[test]
fn a_run_keeps_uses_recorded_by_volume_publish() {
    require_root();
    let case = Case::new("hostile-keep-use");
    let create = case.volume("create", &["v".as_ref(), "8M".as_ref()]).ok();
    let (_, mount_point) = created(&case, &create);
    case.volume(
        "publish",
        &["--container".as_ref(), "c1".as_ref(), "v".as_ref()],
    )
    .ok();
    case.run(&["--volume=v:8M:d".as_ref()], &["true"]).ok();
    assert!(
        ProcMountTable::new().is_mount_point(&mount_point).unwrap(),
        "c1 still uses the volume"
    );
    case.volume(
        "release",
        &["--container".as_ref(), "c1".as_ref(), "v".as_ref()],
    )
    .ok();
}
