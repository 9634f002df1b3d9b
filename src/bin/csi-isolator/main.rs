//! `csi-isolator`: thin command line over the library. One file per verb
//! in `commands/`; this file parses arguments, sets up logging and maps
//! errors to exit codes.

mod commands;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

/// Makes CSI volumes usable by containers.
#[derive(Debug, Parser)]
#[command(name = "csi-isolator", version, about, after_help = commands::EXAMPLES)]
struct Cli {
    /// The agent work dir (state, mount points, managed plugins).
    #[arg(
        long,
        global = true,
        env = "CSI_ISOLATOR_WORK_DIR",
        default_value = "/var/lib/csi-isolator"
    )]
    work_dir: PathBuf,
    /// Log as JSON lines instead of text (the level comes from RUST_LOG).
    #[arg(long, global = true)]
    log_json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a command with CSI volumes in a new mount namespace; exits with its status.
    Run(commands::run::RunArgs),
    /// Every volume with its state, users, mount point and what the mount table says.
    Status(commands::status::StatusArgs),
    /// Create, publish, release, destroy and list volumes of a provider.
    Volume(commands::volume::VolumeArgs),
    /// Serve the isolator on a Unix socket (gRPC) for containerizers, with Prometheus metrics.
    Serve(commands::serve::ServeArgs),
    /// Serve the Docker (and Podman) volume plugin protocol on a Unix socket, for any CSI driver.
    DockerPlugin(commands::docker_plugin::DockerPluginArgs),
    /// OCI runtime hook (createRuntime, poststop): CSI volumes named by annotations; state on stdin.
    OciHook(commands::oci_hook::OciHookArgs),
    /// Print the completion script for a shell (bash, elvish, fish, powershell, zsh).
    #[command(hide = true)]
    Completions(commands::docs::CompletionsArgs),
    /// Print the manual page (or write one page per command with --dir).
    #[command(hide = true)]
    Man(commands::docs::ManArgs),
}

fn main() -> ExitCode {
    // Before any thread exists: the daemons' threads then share few arenas, and big transient
    // blocks go back to the kernel when freed (see the module).
    csi_isolator::memory::set_up_allocator();
    let cli = Cli::parse();
    init_logging(cli.log_json);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("csi-isolator: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => commands::run::run(&cli.work_dir, args).await,
            Command::Status(args) => commands::status::run(&cli.work_dir, args).await,
            Command::Volume(args) => commands::volume::run(&cli.work_dir, args).await,
            Command::Serve(args) => commands::serve::run(&cli.work_dir, args).await,
            Command::DockerPlugin(args) => commands::docker_plugin::run(&cli.work_dir, args).await,
            Command::OciHook(args) => commands::oci_hook::run(&cli.work_dir, args).await,
            // Generated from the definitions above; the work dir is not touched.
            Command::Completions(args) => commands::docs::completions(Cli::command(), args),
            Command::Man(args) => commands::docs::man(Cli::command(), args),
        }
    });
    match result {
        Ok(code) => code,
        // The reader of a listing went (`| head`): stop quietly, as `ls` does, with the shell's
        // code for SIGPIPE; the command has shut its plugin down on the way out.
        Err(e) if closed_pipe(e.as_ref()) => ExitCode::from(141),
        Err(e) => {
            eprintln!(
                "csi-isolator: {}",
                csi_isolator::error_chain::full_message(e.as_ref())
            );
            ExitCode::FAILURE
        }
    }
}

/// Whether `e` comes from writing to a pipe whose reader has gone (Rust ignores SIGPIPE, so a
/// write gets EPIPE instead).
fn closed_pipe(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
        {
            return true;
        }
        cause = c.source();
    }
    false
}

fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}
