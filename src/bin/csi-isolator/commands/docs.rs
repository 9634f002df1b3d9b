//! `completions SHELL` and `man [--dir DIR]`: shell completions and manual
//! pages generated from the clap definitions themselves, so they cannot
//! drift from the flags. Hidden verbs: they are for packagers, not users.
//! Neither touches the work dir, so neither needs root.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use clap_complete::Shell;

/// Arguments of `csi-isolator completions`.
#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell: bash, elvish, fish, powershell or zsh.
    #[arg(value_enum)]
    pub shell: Shell,
}

/// Arguments of `csi-isolator man`.
#[derive(Debug, Args)]
pub struct ManArgs {
    /// Write one page per command (csi-isolator.1, csi-isolator-run.1, ...)
    /// into this directory instead of the main page to stdout.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

/// Writes the completion script for `args.shell` to stdout.
pub fn completions(mut cmd: clap::Command, args: CompletionsArgs) -> anyhow::Result<ExitCode> {
    // Into memory first: `generate` panics on a write error (a closed pipe).
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut cmd, "csi-isolator", &mut script);
    let mut out = std::io::stdout().lock();
    out.write_all(&script)
        .and_then(|()| out.flush())
        .context("write completions to stdout")?;
    Ok(ExitCode::SUCCESS)
}

/// Writes the main manual page to stdout, or every page into `args.dir`.
pub fn man(cmd: clap::Command, args: ManArgs) -> anyhow::Result<ExitCode> {
    match args.dir {
        Some(dir) => write_pages(cmd, &dir)?,
        None => {
            let mut page = Vec::new();
            clap_mangen::Man::new(cmd)
                .render(&mut page)
                .context("render the manual page")?;
            let mut out = std::io::stdout().lock();
            out.write_all(&page)
                .and_then(|()| out.flush())
                .context("write the manual page to stdout")?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn write_pages(cmd: clap::Command, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("create manual page directory {}", dir.display()))?;
    clap_mangen::generate_to(cmd, dir)
        .with_context(|| format!("write manual pages into {}", dir.display()))
}
