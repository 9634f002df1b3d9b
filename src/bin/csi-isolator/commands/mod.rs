//! One module per verb.

pub mod oci_hook;
pub mod plugin_args;
pub mod run;
pub mod serve;
pub mod status;
pub mod volume;

/// Examples shown by `--help`.
pub const EXAMPLES: &str = "\
Examples:
  # Run a command with a 64 MiB volume at ./data (created on first use, kept across runs)
  csi-isolator --work-dir /tmp/w run --volume data:64M:data -- sh -c 'date >> data/log; cat data/log'

  # Read-only volume at an absolute path inside a root filesystem
  csi-isolator run --rootfs /srv/rootfs --volume ref:1G:/ref:ro -- /bin/sh -c 'ls /ref'

  # Volumes from Mesos Resource JSON, on a CSI plugin that is already running
  csi-isolator run --plugin-endpoint unix:///run/csi/plugin.sock --resources volumes.json -- ./task

  # Every volume, its state and what the mount table says
  csi-isolator --work-dir /tmp/w status

  # Create a 64 MiB volume with the bundled plugin, publish it for a container, list, release, destroy
  csi-isolator --work-dir /tmp/w volume create data 64M
  csi-isolator --work-dir /tmp/w volume publish data --container c1
  csi-isolator --work-dir /tmp/w volume list
  csi-isolator --work-dir /tmp/w volume release data --container c1
  csi-isolator --work-dir /tmp/w volume destroy data

  # The same against a CSI plugin already serving a socket
  csi-isolator volume --plugin-endpoint unix:///run/csi/plugin.sock list";
