//! The plugin sockets are owner-only: a client of another uid is refused
//! by the kernel (the socket file is mode 0600, a managed plugin's socket
//! directory 0700), while root connects; a socket directory another user
//! made first is refused, so no one can stand a fake plugin there.

use csi_isolator::error_chain::FullMessage;
use csi_isolator_testing::plugin_bin;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use csi_isolator::provider::bundled::{bundled_config, BUNDLED_TYPE};
use csi_isolator::provider::StorageProvider;
use csi_isolator::resource::Layout;
use csi_isolator_testing::{require_root, PluginProcess, Sandbox};

const PYTHON: &str = "/usr/bin/python3";
const NOBODY: &str = "65534";

/// Tries to connect to `socket` as `uid` (None: as ourselves); returns
/// whether the connection was accepted, and what the client said.
fn connect_as(uid: Option<&str>, socket: &Path) -> (bool, String) {
    assert!(
        Path::new(PYTHON).is_file(),
        "{PYTHON} is missing: install the Debian package python3"
    );
    let script = "import socket,sys\ns=socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\nprint('connected')";
    let mut cmd = match uid {
        Some(uid) => {
            let mut c = Command::new("setpriv");
            c.args([
                &format!("--reuid={uid}"),
                &format!("--regid={uid}"),
                "--clear-groups",
                PYTHON,
            ]);
            c
        }
        None => Command::new(PYTHON),
    };
    let out = cmd
        .args(["-c", script])
        .arg(socket)
        .output()
        .expect("run the client");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

/// Opens every directory from the sandbox down to `dir` for search, so
/// that only the socket's own mode decides.
fn open_path_to(sb: &Sandbox, dir: &Path) {
    let mut p = dir.to_path_buf();
    loop {
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        if p == sb.path() || !p.pop() {
            break;
        }
    }
}

#[tokio::test]
async fn a_plugin_socket_refuses_other_uids() {
    require_root();
    let sb = Sandbox::new("sock-plugin");
    let plugin = PluginProcess::start(&sb, plugin_bin(), &[]).await;
    let socket = plugin.socket();
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "socket mode");
    open_path_to(&sb, socket.parent().unwrap());
    let (ok, said) = connect_as(None, &socket);
    assert!(ok, "root connects: {said}");
    let (ok, said) = connect_as(Some(NOBODY), &socket);
    assert!(!ok, "another uid must be refused: {said}");
    assert!(
        said.contains("PermissionError") || said.contains("Permission denied"),
        "{said}"
    );
    drop(plugin);
}

#[tokio::test]
async fn a_managed_plugin_socket_lives_in_an_owner_only_directory() {
    require_root();
    let sb = Sandbox::new("sock-managed");
    let work = sb.mkdir("work");
    let mut config = bundled_config(Path::new(plugin_bin()), &work, "default", &[]);
    config.socket_dir = sb.join("s");
    let provider = StorageProvider::start(config).await.unwrap();
    let socket = csi_isolator::csi::transport::socket_path(provider.client().endpoint()).unwrap();
    let dir = socket.parent().unwrap();
    let dir_mode = std::fs::metadata(dir).unwrap().permissions().mode() & 0o777;
    assert_eq!(dir_mode, 0o700, "{}", dir.display());
    let (ok, said) = connect_as(Some(NOBODY), &socket);
    assert!(!ok, "another uid must be refused: {said}");
    let (ok, said) = connect_as(None, &socket);
    assert!(ok, "root connects: {said}");
    provider.shutdown(Duration::from_secs(5)).await;
    sb.assert_no_mounts_under();
}

#[tokio::test]
async fn a_managed_plugin_socket_directory_made_first_by_another_user_is_refused() {
    require_root();
    let sb = Sandbox::new("sock-foreign");
    let work = sb.mkdir("work");
    let socket_dir = sb.join("s");
    let socket = Layout::new(&work, BUNDLED_TYPE, "default").plugin_socket(&socket_dir);
    assert!(socket.starts_with(&socket_dir), "{}", socket.display());
    // The plugin's directory, made first and owned by nobody, as it would
    // be in a shared place: it looks right (0700) but is not root's.
    let dir = socket.parent().unwrap();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::lchown(dir, Some(65534), Some(65534)).unwrap();
    let mut config = bundled_config(Path::new(plugin_bin()), &work, "default", &[]);
    config.socket_dir = socket_dir;
    let err = StorageProvider::start(config)
        .await
        .unwrap_err()
        .full_message();
    let shown = dir.display().to_string();
    for needle in [
        shown.as_str(),
        "plugin socket dir",
        "not owned by root",
        "owner uid 65534",
        "mode 0700",
        "--plugin-socket-dir",
    ] {
        assert!(err.contains(needle), "{needle:?} missing in: {err}");
    }
    assert!(!socket.exists(), "no plugin socket in a foreign directory");
    assert!(dir.is_dir(), "a refused directory is not ours to remove");
    sb.assert_no_mounts_under();
}
