//! The embedded default: the bundled `csi-test-plugin`, started and
//! supervised by the provider, found next to the running binary.

use std::path::{Path, PathBuf};

use crate::provider::storage::{PluginSource, ProviderConfig};
use crate::provider::supervisor::PluginCommand;
use crate::resource::Layout;

/// The plugin type of the bundled plugin (its GetPluginInfo name).
pub const BUNDLED_TYPE: &str = "csi-test-plugin.csi-isolator.io";
/// The executable name of the bundled plugin.
pub const BUNDLED_BINARY: &str = "csi-test-plugin";

/// Where the bundled plugin's executable is: next to the running binary
/// (or, for test binaries in `target/*/deps`, one directory up).
pub fn bundled_plugin_path() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [dir.join(BUNDLED_BINARY), dir.parent()?.join(BUNDLED_BINARY)]
        .into_iter()
        .find(|p| p.is_file())
}

/// The key of the bundled plugin's GetPluginInfo manifest that reports, when it runs with
/// `--report-syncs` (the benchmark), how many fsync, fdatasync and syncfs calls its process has
/// made through the durable seam ([`crate::durable::syncs`]).
pub const SYNCS_KEY: &str = "durable_syncs";

/// A provider configuration for the bundled plugin managed under
/// `work_dir`, with extra plugin arguments (e.g. `--backing loop`).
pub fn bundled_config(
    program: &Path,
    work_dir: &Path,
    plugin_name: &str,
    extra_args: &[String],
) -> ProviderConfig {
    let layout = Layout::new(work_dir, BUNDLED_TYPE, plugin_name);
    let mut args = vec![
        "--work-dir".to_string(),
        layout.plugin_data_dir().to_string_lossy().into_owned(),
    ];
    args.extend(extra_args.iter().cloned());
    // The plugin reads its endpoint from CSI_ENDPOINT, which the supervisor sets.
    ProviderConfig::new(
        BUNDLED_TYPE,
        plugin_name,
        work_dir,
        PluginSource::Managed(PluginCommand {
            program: program.to_path_buf(),
            args,
            env: Vec::new(),
        }),
    )
}
