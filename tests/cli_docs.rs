//! Shell completions and manual pages, generated from the clap definitions
//! by the hidden `completions` and `man` verbs: they name every verb and the
//! security flags, touch no work dir, and need no root.

use std::path::Path;
use std::process::{Command, Output};

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");

/// The verbs users see, and flags whose absence from a completion or a page
/// would hide a security option.
const VERBS: [&str; 6] = [
    "run",
    "status",
    "volume",
    "serve",
    "docker-plugin",
    "oci-hook",
];

/// Runs `csi-isolator` with a work dir that must stay untouched.
fn cli(work: &Path, args: &[&str]) -> Output {
    let out = Command::new(CLI)
        .arg("--work-dir")
        .arg(work)
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run csi-isolator");
    assert!(
        out.status.success(),
        "csi-isolator {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !work.exists(),
        "csi-isolator {args:?} created the work dir {}",
        work.display()
    );
    out
}

#[test]
fn completions_for_every_shell_name_every_verb_and_the_security_flags() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let work = tmp.path().join("work");
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let script = String::from_utf8(cli(&work, &["completions", shell]).stdout)
            .expect("completions are UTF-8");
        for word in VERBS.iter().chain(&[
            "allow-group",
            "tenant-annotation",
            "allow-raw-resources",
            "allow-parameter",
            "disk-profiles",
        ]) {
            assert!(script.contains(word), "{shell} completions lack {word}");
        }
    }
}

#[test]
fn man_prints_the_main_page_and_writes_one_page_per_command() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let work = tmp.path().join("work");
    let page = String::from_utf8(cli(&work, &["man"]).stdout).expect("page is UTF-8");
    assert!(page.contains(".TH csi-isolator 1"), "no title line: {page}");
    for verb in VERBS {
        // The SUBCOMMANDS section names each page, roff-escaped.
        let see = format!(r"csi\-isolator\-{}(1)", verb.replace('-', r"\-"));
        assert!(page.contains(&see), "the main page lacks {see}");
    }

    let dir = tmp.path().join("man1");
    cli(
        &work,
        &["man", "--dir", dir.to_str().expect("UTF-8 temp dir")],
    );
    for verb in VERBS {
        let path = dir.join(format!("csi-isolator-{verb}.1"));
        assert!(path.is_file(), "no page {}", path.display());
    }
    let serve = std::fs::read_to_string(dir.join("csi-isolator-serve.1")).expect("read serve page");
    // roff escapes the dashes of flags.
    assert!(
        serve.contains(r"allow\-group"),
        "serve's page lacks --allow-group"
    );
}

#[test]
fn the_generating_verbs_are_hidden_from_help() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let help = String::from_utf8(cli(&tmp.path().join("work"), &["--help"]).stdout)
        .expect("help is UTF-8");
    for line in help.lines() {
        let first = line.split_whitespace().next();
        assert!(
            !matches!(first, Some("completions" | "man")),
            "--help lists a packagers' verb: {line}"
        );
    }
}
