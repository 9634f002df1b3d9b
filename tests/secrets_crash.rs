//! `csi-isolator serve` killed (SIGKILL, by `CSI_ISOLATOR_CRASH_AFTER_WRITE=N`) at every crash
//! point of a volume's life with a secrets file (CreateVolume, Prepare, Cleanup,
//! DestroyVolume), against a plugin in `--require-secrets` mode. After each crash a fresh serve
//! recovers (its own start, then Recover) and finishes the volume's life; every call recovery
//! re-issues (CreateVolume from the create intent, ControllerUnpublish, DeleteVolume) must
//! carry the secrets of the recorded file, or the plugin refuses it. Then: no refusal in the
//! plugin's log, no volume left in the plugin, nothing mounted. The loop ends when the life
//! completes without a crash. The same for an imported volume's life (ImportVolume with a
//! secrets file, whose intent carries the file to recovery; DestroyVolume deleting it).

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use csi_isolator::csi::proto as csi;
use csi_isolator::service::proto::{
    CleanupRequest, ContainerConfig, CreateVolumeRequest, DestroyVolumeRequest,
    ImportVolumeRequest, PrepareRequest, StatusRequest,
};
use csi_isolator_testing::crash::EndpointServeRuns;
use csi_isolator_testing::{require_root, PluginProcess, Sandbox};

const CLI: &str = env!("CARGO_BIN_EXE_csi-isolator");
const MIB: u64 = 1024 * 1024;
const MAX_POINTS: u32 = 40;

/// The serve runs of a test, and the secrets file its volumes are made with.
struct Env {
    runs: EndpointServeRuns,
    secrets: PathBuf,
}

/// The volume's life: create, prepare for `container`, cleanup, destroy. Stops at the first
/// failed call (a crash).
async fn life(env: &Env, name: &str, container: &str) -> Result<(), tonic::Status> {
    let mut c = env.runs.client().await;
    let created = c
        .create_volume(CreateVolumeRequest {
            name: name.into(),
            capacity_bytes: 4 * MIB,
            container_path: "data".into(),
            secrets_file: env.secrets.to_string_lossy().into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let sandbox = env.runs.sb.mkdir(format!("sandboxes/{container}"));
    c.prepare(PrepareRequest {
        container_id: container.into(),
        config: Some(ContainerConfig {
            resources_json: format!("[{}]", created.resource_json),
            sandbox: sandbox.to_string_lossy().into(),
            ..Default::default()
        }),
    })
    .await?;
    c.cleanup(CleanupRequest {
        container_id: container.into(),
    })
    .await?;
    c.destroy_volume(DestroyVolumeRequest {
        volume_id: created.volume_id,
        ..Default::default()
    })
    .await?;
    Ok(())
}

fn write_secrets(path: &Path, text: &str) {
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(text.as_bytes()).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// A sandbox `label` with a secrets file, and the bundled plugin (dir backing) requiring it.
async fn start_plugin(label: &str) -> (PluginProcess, Env) {
    require_root();
    let sb = Sandbox::new(label);
    let dir = sb.mkdir("secrets");
    let secrets = dir.join("volume.json");
    write_secrets(
        &secrets,
        r#"{"create": {"t": "c-1"}, "controller_publish": {"t": "cp-2"},
            "node_stage": {"t": "ns-3"}, "node_publish": {"t": "np-4"}}"#,
    );
    let (plugin, runs) = EndpointServeRuns::on_bundled_plugin(
        sb,
        CLI,
        &[
            "--backing",
            "dir",
            "--require-secrets",
            secrets.to_str().unwrap(),
        ],
    )
    .await;
    (plugin, Env { runs, secrets })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_crash_point_of_a_volume_with_secrets_recovers_with_them() {
    let (plugin, env) = start_plugin("secrets-crash").await;
    let mut crashed = 0;
    for n in 1..=MAX_POINTS {
        let (name, container) = (format!("v{n}"), format!("c{n}"));
        let completed = env.runs.armed(n, || life(&env, &name, &container)).await;
        if completed {
            println!("{crashed} crash points survived");
            break;
        }
        crashed += 1;
        // A fresh serve recovers, and the life is finished (the same name is the same
        // volume; Cleanup of a container Recover cleaned is a no-op).
        let (child, _) = env.runs.recovered(n).await;
        life(&env, &name, &container)
            .await
            .unwrap_or_else(|e| panic!("crash point {n}: finishing the life: {e}"));
        env.runs.stop(child);
        assert!(
            !plugin.stderr().contains("--require-secrets expects"),
            "crash point {n}: a call without its secrets:\n{}",
            plugin.stderr()
        );
        assert!(
            plugin.listed().await.is_empty(),
            "crash point {n}: a volume left"
        );
        env.runs.sb.assert_no_mounts_under();
        assert!(n < MAX_POINTS, "the life never completed");
    }
    assert!(crashed > 3, "only {crashed} crash points");
}

/// An imported volume's life: import (with the secrets file), prepare, cleanup, destroy
/// deleting it in the plugin.
async fn import_life(
    env: &Env,
    name: &str,
    container: &str,
    volume_id: &str,
) -> Result<(), tonic::Status> {
    let mut c = env.runs.client().await;
    let imported = c
        .import_volume(ImportVolumeRequest {
            name: name.into(),
            volume_id: volume_id.into(),
            container_path: "data".into(),
            secrets_file: env.secrets.to_string_lossy().into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let sandbox = env.runs.sb.mkdir(format!("sandboxes/{container}"));
    c.prepare(PrepareRequest {
        container_id: container.into(),
        config: Some(ContainerConfig {
            resources_json: format!("[{}]", imported.resource_json),
            sandbox: sandbox.to_string_lossy().into(),
            ..Default::default()
        }),
    })
    .await?;
    c.cleanup(CleanupRequest {
        container_id: container.into(),
    })
    .await?;
    c.destroy_volume(DestroyVolumeRequest {
        volume_id: imported.volume_id,
        delete_imported: true,
        ..Default::default()
    })
    .await?;
    Ok(())
}

/// The create secrets the plugin requires, for the test's own calls to it.
fn create_secrets() -> std::collections::HashMap<String, String> {
    [("t".to_string(), "c-1".to_string())].into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_crash_point_of_an_imported_volume_with_secrets_recovers_with_them() {
    let (plugin, env) = start_plugin("secrets-crash-import").await;
    let mut raw = csi_isolator_testing::raw_clients(&plugin.socket())
        .await
        .unwrap();
    let mut crashed = 0;
    for n in 1..=MAX_POINTS {
        let (name, container) = (format!("i{n}"), format!("c{n}"));
        // The volume exists in the plugin before csi-isolator hears of it.
        let made = raw
            .controller
            .create_volume(csi::CreateVolumeRequest {
                name: format!("made-{n}"),
                volume_capabilities: vec![csi_isolator_testing::mount_capability(
                    csi::volume_capability::access_mode::Mode::SingleNodeWriter,
                )],
                secrets: create_secrets(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        let completed = env
            .runs
            .armed(n, || import_life(&env, &name, &container, &made.volume_id))
            .await;
        if completed {
            println!("{crashed} crash points survived");
            break;
        }
        crashed += 1;
        // A fresh serve recovers (an import intent is finished at its start); whatever it
        // holds is destroyed, deleting it in the plugin; a volume never recorded is deleted
        // there directly.
        let (child, mut c) = env.runs.recovered(n).await;
        let status = c.status(StatusRequest {}).await.unwrap().into_inner();
        for v in status.volumes {
            c.destroy_volume(DestroyVolumeRequest {
                volume_id: v.volume_id.clone(),
                delete_imported: true,
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("crash point {n}: destroy {}: {e}", v.volume_id));
        }
        env.runs.stop(child);
        for left in plugin.listed().await {
            let id = left.volume.unwrap().volume_id;
            raw.controller
                .delete_volume(csi::DeleteVolumeRequest {
                    volume_id: id,
                    secrets: create_secrets(),
                })
                .await
                .unwrap();
        }
        assert!(
            !plugin.stderr().contains("--require-secrets expects"),
            "crash point {n}: a call without its secrets:\n{}",
            plugin.stderr()
        );
        env.runs.sb.assert_no_mounts_under();
        assert!(n < MAX_POINTS, "the life never completed");
    }
    assert!(
        plugin.listed().await.is_empty(),
        "a volume left in the plugin"
    );
    assert!(crashed > 3, "only {crashed} crash points");
}
