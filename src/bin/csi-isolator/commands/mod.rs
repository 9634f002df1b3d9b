//! One module per verb, and what the verbs share: how untrusted values
//! (volume names and ids, container ids, paths) are shown to people, and
//! how arguments that are not UTF-8 are refused.

use std::ffi::OsStr;

use clap::builder::{StringValueParser, TypedValueParser};
use clap::error::ErrorKind;

/// `println!` that returns the write's error (`?`) instead of panicking: a listing piped into
/// `head` sees EPIPE when the reader goes, and the command then ends quietly (see `main`).
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout(), $($arg)*)?
    }};
}

pub mod docker_plugin;
pub mod docs;
pub mod oci_hook;
pub mod plugin_args;
pub mod run;
pub mod serve;
pub mod status;
pub mod volume;

pub use csi_isolator::shown::{escaped, shown, shown_os};

/// What ends a long-running verb (`serve`, `docker-plugin`): the first SIGINT or SIGTERM. The
/// handlers are installed when this is called, before the service's socket exists, so a signal
/// sent right after the service says `ready` is never lost.
pub fn stop_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use anyhow::Context;
    use tokio::signal::unix::{signal, SignalKind};
    let mut sigint = signal(SignalKind::interrupt()).context("install SIGINT handler")?;
    let mut sigterm = signal(SignalKind::terminate()).context("install SIGTERM handler")?;
    Ok(async move {
        tokio::select! {
            _ = sigint.recv() => {}
            _ = sigterm.recv() => {}
        }
    })
}

/// Examples shown by `--help`.
pub const EXAMPLES: &str = "\
Examples:
  # Run a command with a 64 MiB volume at ./data (created on first use, kept across runs)
  csi-isolator --work-dir /var/lib/csi-demo run --volume data:64M:data -- sh -c 'date >> data/log; cat data/log'

  # Read-only volume at an absolute path inside a root filesystem
  csi-isolator run --rootfs /srv/rootfs --volume ref:1G:/ref:ro -- /bin/sh -c 'ls /ref'

  # Volumes from Mesos Resource JSON, on a CSI plugin that is already running
  csi-isolator run --plugin-endpoint unix:///run/csi/plugin.sock --resources volumes.json -- ./task

  # Every volume, its state and what the mount table says
  csi-isolator --work-dir /var/lib/csi-demo status

  # Create a 64 MiB volume with the bundled plugin, publish it for a container, list, release, destroy
  csi-isolator --work-dir /var/lib/csi-demo volume create data 64M
  csi-isolator --work-dir /var/lib/csi-demo volume publish data --container c1
  csi-isolator --work-dir /var/lib/csi-demo volume list
  csi-isolator --work-dir /var/lib/csi-demo volume release data --container c1
  csi-isolator --work-dir /var/lib/csi-demo volume destroy data

  # The same against a CSI plugin already serving a socket
  csi-isolator volume --plugin-endpoint unix:///run/csi/plugin.sock list";

/// A clap value parser that takes a value as the OS gave it: one that is
/// not UTF-8 is refused (a usage error, exit status 2) naming the argument
/// and showing the value escaped; a UTF-8 one goes on to the inner parser.
#[derive(Clone)]
pub struct Utf8<P>(pub P);

/// [`Utf8`] around a plain `String` argument.
pub fn text() -> Utf8<StringValueParser> {
    Utf8(StringValueParser::new())
}

impl<P: TypedValueParser> TypedValueParser for Utf8<P> {
    type Value = P::Value;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<Self::Value, clap::Error> {
        if value.to_str().is_none() {
            let what = arg.map_or_else(|| "an argument".to_string(), |a| a.to_string());
            let message = format!("invalid UTF-8 in {what}: '{}'\n", shown_os(value));
            return Err(clap::Error::raw(ErrorKind::InvalidUtf8, message).with_cmd(cmd));
        }
        self.0.parse_ref(cmd, arg, value)
    }
}
