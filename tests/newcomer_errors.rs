//! A newcomer's mistakes in the arguments of `run` and `volume`, tried with
//! the real binary: each is refused with one line that names the argument
//! and says what to do, and leaves nothing behind (no volume, mount, loop
//! device, process, nor anything created on the host's own paths).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use csi_isolator_testing::{processes_mentioning, require_root, Sandbox};

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");

/// One sandbox per case: a work dir and a place for the user's files.
struct Case {
    sb: Sandbox,
    work: PathBuf,
}

impl Case {
    fn new(label: &str) -> Case {
        require_root();
        let sb = Sandbox::new(label);
        let work = sb.join("work");
        Case { sb, work }
    }

    fn cli(&self, args: &[&str]) -> Output {
        Command::new(CLI)
            .arg("--work-dir")
            .arg(&self.work)
            .args(args)
            .env_remove("RUST_LOG")
            .env("CSI_ISOLATOR_SOCKET_DIR", self.sb.join("s"))
            .output()
            .expect("run csi-isolator")
    }

    /// Runs `args`, expects a refusal of one line holding every `says`,
    /// then checks that nothing was left.
    fn refused(&self, args: &[&str], says: &[&str]) -> String {
        let out = self.cli(args);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
        for s in says {
            assert!(stderr.contains(s), "{args:?}: {stderr:?} lacks {s:?}");
        }
        self.assert_nothing_left();
        stderr
    }

    fn assert_nothing_left(&self) {
        self.sb.assert_no_mounts_under();
        self.sb.assert_no_loop_devices();
        let procs = processes_mentioning(&self.work);
        assert!(procs.is_empty(), "processes left: {procs:?}");
        // No volume was created, so none is published either.
        let status = self.cli(&["status", "--json"]);
        let report: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
        assert_eq!(report["volumes"], serde_json::json!([]), "no volume");
    }

    fn file(&self, name: &str, content: &str) -> PathBuf {
        let path = self.sb.join(name);
        std::fs::write(&path, content).unwrap();
        path
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn an_absolute_container_path_missing_on_the_host_is_refused_and_not_created() {
    let case = Case::new("ne-missing-target");
    // Directly under / as a newcomer writes it, and one under the sandbox.
    let top = format!("/csi-isolator-newcomer-{}", std::process::id());
    let deep = case.sb.join("absent/data");
    for target in [top.as_str(), s(&deep)] {
        let volume = format!("data:64M:{target}");
        case.refused(
            &["run", "--volume", &volume, "--", "true"],
            &[
                "volume 'data'",
                &format!("container path {target} does not exist on the host"),
                "use a relative path such as",
                "lands in the sandbox",
                &format!("create the directory {target} on the host"),
                "--rootfs",
            ],
        );
        assert!(!Path::new(target).exists(), "{target} was created");
    }
    assert!(!case.sb.join("absent").exists(), "a parent was created");
}

#[test]
fn an_absolute_container_path_that_is_a_host_file_is_refused() {
    let case = Case::new("ne-file-target");
    let file = case.file("plain", "keep me");
    let volume = format!("data:16M:{}", file.display());
    case.refused(
        &["run", "--volume", &volume, "--", "true"],
        &[
            "volume 'data'",
            "is not a directory on the host",
            "--rootfs",
        ],
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
}

#[test]
fn a_resources_container_path_missing_on_the_host_is_refused() {
    let case = Case::new("ne-resources-target");
    let target = case.sb.join("nope");
    let json = format!(
        r#"[{{"name":"disk","type":"SCALAR","scalar":{{"value":16}},"disk":{{"volume":{{"mode":"RW","container_path":"{}"}}}}}}]"#,
        target.display()
    );
    let resources = case.file("res.json", &json);
    case.refused(
        &["run", "--resources", s(&resources), "--", "true"],
        &["--resources", "does not exist on the host", "--rootfs"],
    );
    assert!(!target.exists());
}

#[test]
fn a_rootfs_that_is_missing_or_a_file_is_refused() {
    let case = Case::new("ne-rootfs");
    let missing = case.sb.join("no-rootfs");
    case.refused(
        &["run", "--rootfs", s(&missing), "--", "true"],
        &["--rootfs", "no such directory", "leave --rootfs out"],
    );
    let file = case.file("rootfs-file", "");
    case.refused(
        &["run", "--rootfs", s(&file), "--", "true"],
        &["--rootfs", "a file, not a directory"],
    );
}

#[test]
fn a_resources_file_missing_a_directory_or_not_json_is_refused() {
    let case = Case::new("ne-resources-file");
    let missing = case.sb.join("none.json");
    case.refused(
        &["run", "--resources", s(&missing), "--", "true"],
        &["--resources", "no such file", "a JSON file"],
    );
    case.refused(
        &["run", "--resources", s(case.sb.path()), "--", "true"],
        &["--resources", "a directory, not a file"],
    );
    let bad = case.file("bad.json", "volumes: data");
    case.refused(
        &["run", "--resources", s(&bad), "--", "true"],
        &["--resources", "not a JSON list of Mesos Resource objects"],
    );
}

#[test]
fn a_plugin_endpoint_that_is_not_a_socket_is_refused_at_once() {
    let case = Case::new("ne-endpoint");
    let file = case.file("not-a-socket", "");
    let endpoint = format!("unix://{}", file.display());
    let started = std::time::Instant::now();
    for args in [
        vec!["run", "--plugin-endpoint", &endpoint, "--", "true"],
        vec!["volume", "--plugin-endpoint", &endpoint, "list"],
    ] {
        case.refused(
            &args,
            &["--plugin-endpoint", "is not a socket", "the bundled plugin"],
        );
    }
    // Not after the plugin timeout (30 s) of retried connects.
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
}

#[test]
fn a_volume_create_size_of_zero_or_words_is_refused() {
    let case = Case::new("ne-size");
    for size in ["0", "lots"] {
        case.refused(
            &["volume", "create", "data", size],
            &[&format!("invalid SIZE '{size}'"), "above 0", "64M"],
        );
    }
}

#[test]
fn an_access_mode_csi_does_not_define_is_refused_naming_the_ones_it_does() {
    let case = Case::new("ne-mode");
    for (verb, extra) in [("create", "1M"), ("import", "--volume-id=v1")] {
        case.refused(
            &[
                "volume",
                verb,
                "data",
                extra,
                "--access-mode",
                "single_node_writer",
            ],
            &[
                &format!("volume {verb} data: option '--access-mode'"),
                "unknown CSI access mode 'single_node_writer'",
                "expected one of SINGLE_NODE_WRITER, SINGLE_NODE_READER_ONLY",
            ],
        );
    }
}

#[test]
fn a_container_path_above_the_root_keeps_its_lexical_refusal() {
    let case = Case::new("ne-dotdot");
    for path in ["../x", "/nowhere/../../../tmp"] {
        let volume = format!("data:16M:{path}");
        let said = case.cli(&["run", "--volume", &volume, "--", "true"]);
        let stderr = String::from_utf8_lossy(&said.stderr);
        assert_eq!(said.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains(&format!("container_path '{path}': resolves outside")),
            "{path}: {stderr}"
        );
        case.sb.assert_no_mounts_under();
    }
}

#[test]
fn a_target_under_a_read_only_rootfs_says_it_cannot_be_created() {
    let case = Case::new("ne-ro-rootfs");
    // The sandbox's mount point exists, so only the volume's target is missing.
    let rootfs = case.sb.join("rootfs");
    std::fs::create_dir_all(rootfs.join("mnt/mesos/sandbox")).unwrap();
    let ro = |args: &[&str]| {
        let st = Command::new("mount")
            .args(args)
            .arg(&rootfs)
            .arg(&rootfs)
            .status();
        assert!(st.unwrap().success(), "mount {args:?}");
    };
    ro(&["--bind"]);
    ro(&["-o", "remount,bind,ro"]);
    let out = case.cli(&[
        "run",
        "--rootfs",
        s(&rootfs),
        "--volume",
        "d:16M:/newdir",
        "--",
        "true",
    ]);
    nix::mount::umount2(&rootfs, nix::mount::MntFlags::MNT_DETACH).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("at /newdir")
            && stderr.contains("cannot be created there (read-only file system)")
            && stderr.contains("create it in the root filesystem beforehand"),
        "{stderr}"
    );
    // Published for the mount, then rolled back: nothing mounted or in use.
    case.sb.assert_no_mounts_under();
    case.sb.assert_no_loop_devices();
    assert!(processes_mentioning(&case.work).is_empty());
    let status = case.cli(&["status", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    for v in report["volumes"].as_array().unwrap() {
        assert_eq!(v["mounted"], false, "{v}");
        assert_eq!(v["users"], serde_json::json!([]), "{v}");
    }
    assert!(!rootfs.join("newdir").exists());
}
