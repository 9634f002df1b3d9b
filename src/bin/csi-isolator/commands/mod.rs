//! One module per verb.

pub mod plugin_args;
pub mod status;
pub mod volume;

/// Examples shown by `--help`.
pub const EXAMPLES: &str = "\
Examples:
  # Create a 64 MiB volume with the bundled plugin, publish it for a container, list, release, destroy
  csi-isolator --work-dir /tmp/w volume create data 64M
  csi-isolator --work-dir /tmp/w volume publish data --container c1
  csi-isolator --work-dir /tmp/w volume list
  csi-isolator --work-dir /tmp/w volume release data --container c1
  csi-isolator --work-dir /tmp/w volume destroy data

  # The same against a CSI plugin already serving a socket
  csi-isolator volume --plugin-endpoint unix:///run/csi/plugin.sock list";
