//! Security regressions of `csi-isolator oci-hook` (issue 18, findings 1, 4 and the hook's part of 5),
//! each through real runc with the hook as its createRuntime and poststop hooks: whoever sets
//! annotations cannot make the hook mount a host path, name another tenant's volume or create volumes
//! without bound, and a checkpoint planted in the work dir cannot make the hook remove anything
//! outside `<work_dir>/oci-hook`.
//!
//! Needs root, `runc` on PATH and `/bin/busybox` (package busybox-static); nothing is installed at test
//! time.

use csi_isolator_testing::plugin_bin;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use csi_isolator::isolator::hook::{
    HOOK_DIR, PARAMETERS_ANNOTATION, RESOURCES_ANNOTATION, VOLUMES_ANNOTATION,
};
use csi_isolator::isolator::{ContainerConfig, ContainerRecord};
use csi_isolator::provider::VolumeRecord;
use csi_isolator::resource::VolumeMode;
use csi_isolator_testing::{
    host_mount_points, require_root, require_runc, runc_run, set_oci_hooks, start_bundled_provider,
    RuncBundle, RuncRun, Sandbox,
};

const BIN: &str = env!("CARGO_BIN_EXE_csi-isolator");
const RUN_TIMEOUT: Duration = Duration::from_secs(90);
/// The annotation CRI-O sets to the pod's namespace, used as the tenant.
const NAMESPACE: &str = "io.kubernetes.pod.namespace";

/// A busybox bundle whose hooks run the OCI hook on `<sandbox>/work` with `extra` hook arguments.
struct Bundle {
    runc: RuncBundle,
    rootfs: PathBuf,
    work: PathBuf,
    sockets: PathBuf,
}

fn build_bundle(sb: &Sandbox, extra: &[&str]) -> Bundle {
    require_root();
    require_runc();
    let mut runc = RuncBundle::new(sb, "bundle");
    let work = sb.join("work");
    let sockets = sb.join("s");
    set_oci_hooks(&mut runc, Path::new(BIN), &work, &sockets, extra);
    Bundle {
        rootfs: runc.rootfs.clone(),
        runc,
        work,
        sockets,
    }
}

/// Runs `script` in a container with `annotations` to completion (poststop included).
fn run(
    sb: &Sandbox,
    bundle: &Bundle,
    name: &str,
    annotations: serde_json::Value,
    script: &str,
) -> RuncRun {
    let mut config = bundle.runc.config_for(script);
    config["annotations"] = annotations;
    let id = format!("csi-sec-{name}-{}", std::process::id());
    let r = runc_run(sb, &bundle.runc, &id, &config, RUN_TIMEOUT);
    let _ = r.guard.delete();
    r
}

fn assert_ran(r: &RuncRun) {
    assert_eq!(
        r.code,
        Some(0),
        "container {} failed\nstdout:\n{}\nstderr:\n{}",
        r.id,
        r.stdout,
        r.stderr
    );
}

/// The container never started, and runc's stderr carries the hook's one-line refusal with `says`.
fn assert_refused(r: &RuncRun, says: &[&str]) {
    assert_ne!(r.code, Some(0), "runc must fail: {}", r.stderr);
    assert!(
        !r.stdout.contains("started"),
        "the workload ran: {}",
        r.stdout
    );
    assert!(
        r.stderr
            .contains("csi-isolator: oci-hook create-runtime: container 'csi-sec-"),
        "the hook refused: {}",
        r.stderr
    );
    for s in says {
        assert!(r.stderr.contains(s), "stderr names {s:?}: {}", r.stderr);
    }
}

/// The provider's volumes on the hook's work dir.
async fn volumes(sb: &Sandbox, bundle: &Bundle) -> Vec<VolumeRecord> {
    let provider =
        start_bundled_provider(sb, Path::new(plugin_bin()), &bundle.work, &bundle.sockets).await;
    let out = provider.volumes().await;
    provider.shutdown(Duration::from_secs(5)).await;
    out
}

/// The resources annotation naming the provider's volume recorded as `name`, at `/data`.
async fn resource_of(sb: &Sandbox, bundle: &Bundle, name: &str) -> String {
    let provider =
        start_bundled_provider(sb, Path::new(plugin_bin()), &bundle.work, &bundle.sockets).await;
    let rec = provider
        .find_by_name(name)
        .await
        .unwrap_or_else(|| panic!("volume {name} not found"));
    let res = provider
        .resource_for(&rec)
        .with_volume("/data", VolumeMode::Rw);
    provider.shutdown(Duration::from_secs(5)).await;
    serde_json::to_string(&[res]).unwrap()
}

/// A disk of the host at `root` (no provider unless `provider` is given), mounted at `/data`.
fn host_disk(provider: Option<&str>, source: Option<serde_json::Value>) -> String {
    let mut r = serde_json::json!({"name": "disk", "type": "SCALAR", "scalar": {"value": 1},
        "reservations": [{"type": "STATIC", "role": "r1"}],
        "disk": {"persistence": {"id": "pv1"}, "volume": {"container_path": "/data", "mode": "RW"}}});
    if let Some(p) = provider {
        r["provider_id"] = serde_json::json!({ "value": p });
    }
    if let Some(s) = source {
        r["disk"]["source"] = s;
    }
    serde_json::to_string(&[r]).unwrap()
}

fn mount_root(root: &str) -> Option<serde_json::Value> {
    Some(serde_json::json!({"type": "MOUNT", "mount": {"root": root}}))
}

fn path_root(root: &str) -> Option<serde_json::Value> {
    Some(serde_json::json!({"type": "PATH", "path": {"root": root}}))
}

/// A root-only host directory holding a secret file.
fn secret_dir(sb: &Sandbox) -> PathBuf {
    let dir = sb.mkdir("secret");
    fs::write(dir.join("file"), "host secret\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
    dir
}

const OUR_PROVIDER: &str = "csi-test-plugin.csi-isolator.io.default";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resources_annotation_with_a_host_path_is_refused_and_nothing_is_mounted() {
    let sb = Sandbox::new("hook-sec-raw");
    let bundle = build_bundle(&sb, &[]);
    let secret = secret_dir(&sb);
    let secret = secret.to_str().unwrap();
    let before = host_mount_points(&sb);
    for (name, annotation, says) in [
        (
            "abs",
            host_disk(None, mount_root(secret)),
            "it has no provider_id (a disk of the host, not a volume)".to_string(),
        ),
        (
            "abs-ours",
            host_disk(Some(OUR_PROVIDER), mount_root(secret)),
            format!("disk.source.mount.root '{secret}' is a host path"),
        ),
        (
            "slash",
            host_disk(Some(OUR_PROVIDER), mount_root("/")),
            "disk.source.mount.root '/' is a host path".to_string(),
        ),
        (
            "abs-path",
            host_disk(Some(OUR_PROVIDER), path_root(secret)),
            format!("disk.source.path.root '{secret}' is a host path"),
        ),
        (
            "path-slash",
            host_disk(None, path_root("/")),
            "it has no provider_id (a disk of the host, not a volume)".to_string(),
        ),
        (
            "default-disk",
            host_disk(Some(OUR_PROVIDER), None),
            "it has no disk.source (the agent's default disk, a host directory)".to_string(),
        ),
    ] {
        let r = run(
            &sb,
            &bundle,
            name,
            serde_json::json!({ RESOURCES_ANNOTATION: annotation }),
            "cat /data/file; echo started",
        );
        assert_refused(
            &r,
            &[
                "annotation io.csi-isolator.resources: resource disk",
                &says,
                "pass --allow-raw-resources in the hook's arguments",
            ],
        );
        assert!(!r.stdout.contains("host secret"), "{name}: {}", r.stdout);
        // Nothing was mounted or made: not on the host, not in the rootfs.
        assert_eq!(host_mount_points(&sb), before, "{name}: host mount table");
        assert!(
            !bundle.rootfs.join("data").exists(),
            "{name}: /data made in the rootfs"
        );
        let checkpoint = bundle.work.join("isolators/volume/csi").join(&r.id);
        assert!(
            !checkpoint.exists(),
            "{name}: {} left",
            checkpoint.display()
        );
    }
    assert_eq!(
        fs::read_to_string(sb.join("secret/file")).unwrap(),
        "host secret\n"
    );
    sb.assert_no_mounts_under();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_resources_are_mounted_when_the_operator_allows_them() {
    let sb = Sandbox::new("hook-sec-rawok");
    let bundle = build_bundle(&sb, &["--allow-raw-resources"]);
    let secret = secret_dir(&sb);
    let before = host_mount_points(&sb);
    let r = run(
        &sb,
        &bundle,
        "raw",
        serde_json::json!({ RESOURCES_ANNOTATION: host_disk(None, mount_root(secret.to_str().unwrap())) }),
        "cat /data/file && echo written > /data/new",
    );
    assert_ran(&r);
    assert_eq!(r.stdout, "host secret\n");
    assert_eq!(fs::read_to_string(secret.join("new")).unwrap(), "written\n");
    assert_eq!(host_mount_points(&sb), before, "host mount table");
    sb.assert_no_mounts_under();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_naming_the_same_volume_get_their_own() {
    let sb = Sandbox::new("hook-sec-tenant");
    let bundle = build_bundle(&sb, &["--tenant-annotation", NAMESPACE]);
    let a = run(
        &sb,
        &bundle,
        "a",
        serde_json::json!({ NAMESPACE: "ns-a", VOLUMES_ANNOTATION: "data:16M:/data" }),
        "echo a-secret > /data/secret",
    );
    assert_ran(&a);
    let b = run(
        &sb,
        &bundle,
        "b",
        serde_json::json!({ NAMESPACE: "ns-b", VOLUMES_ANNOTATION: "data:16M:/data" }),
        "ls -A /data; cat /data/secret 2>/dev/null || echo no-secret; grep -c ' /data ' /proc/mounts",
    );
    assert_ran(&b);
    assert!(
        !b.stdout.contains("a-secret"),
        "tenant b read a's data: {}",
        b.stdout
    );
    assert!(b.stdout.contains("no-secret"), "{}", b.stdout);
    assert!(
        b.stdout.ends_with("1\n"),
        "b had its own volume at /data: {}",
        b.stdout
    );
    // Two volumes, one per tenant, and a's data is still a's.
    let names: Vec<String> = volumes(&sb, &bundle)
        .await
        .into_iter()
        .filter_map(|v| v.name)
        .collect();
    assert!(
        names.contains(&"ns-a.data".to_string()) && names.contains(&"ns-b.data".to_string()),
        "{names:?}"
    );
    let a2 = run(
        &sb,
        &bundle,
        "a2",
        serde_json::json!({ NAMESPACE: "ns-a", VOLUMES_ANNOTATION: "data:16M:/data" }),
        "cat /data/secret",
    );
    assert_ran(&a2);
    assert_eq!(a2.stdout, "a-secret\n");
    sb.assert_no_mounts_under();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_without_its_tenant_is_refused() {
    let sb = Sandbox::new("hook-sec-notenant");
    let bundle = build_bundle(&sb, &["--tenant-annotation", NAMESPACE]);
    let before = host_mount_points(&sb);
    for (name, annotations, says) in [
        (
            "missing",
            serde_json::json!({ VOLUMES_ANNOTATION: "data:16M:/data" }),
            "tenant annotation 'io.kubernetes.pod.namespace' is missing",
        ),
        (
            "empty",
            serde_json::json!({ NAMESPACE: "", VOLUMES_ANNOTATION: "data:16M:/data" }),
            "tenant annotation 'io.kubernetes.pod.namespace' is empty",
        ),
        (
            "dotted",
            serde_json::json!({ NAMESPACE: "ns-a.x", VOLUMES_ANNOTATION: "data:16M:/data" }),
            "'ns-a.x' holds '.'",
        ),
    ] {
        let r = run(&sb, &bundle, name, annotations, "echo started");
        assert_refused(
            &r,
            &[says, "--tenant-annotation io.kubernetes.pod.namespace"],
        );
        assert!(!bundle.rootfs.join("data").exists(), "{name}");
    }
    assert_eq!(host_mount_points(&sb), before);
    // Nothing was created for a container without a tenant.
    assert!(volumes(&sb, &bundle).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parameters_annotation_sets_only_the_keys_the_operator_allows() {
    let sb = Sandbox::new("hook-sec-params");
    // The bundled plugin refuses a create without `share` and echoes what it got.
    let bundle = build_bundle(
        &sb,
        &[
            "--allow-parameter",
            "share",
            "--plugin-arg=--require-parameters=share",
        ],
    );
    let before = host_mount_points(&sb);
    let vols = "data:16M:/data";
    let long = "x".repeat(5000);
    for (name, parameters, says) in [
        (
            "denied",
            serde_json::json!({"data": {"share": "/export", "server": "evil.example"}}),
            "parameter 'server' refused",
        ),
        (
            "oversized",
            serde_json::json!({"data": {"share": long}}),
            "over CSI's limit of 4096 bytes",
        ),
        (
            "hostile",
            serde_json::json!({"data": {"share\n": "x"}}),
            "other than letters",
        ),
        (
            "elsewhere",
            serde_json::json!({"other": {"share": "/export"}}),
            "names no volume",
        ),
    ] {
        let annotations = serde_json::json!({
            VOLUMES_ANNOTATION: vols,
            PARAMETERS_ANNOTATION: parameters.to_string(),
        });
        let r = run(&sb, &bundle, name, annotations, "echo started");
        assert_refused(&r, &[says]);
    }
    assert_eq!(host_mount_points(&sb), before);
    assert!(volumes(&sb, &bundle).await.is_empty(), "nothing created");
    // Without the annotation the plugin refuses (the parameter is required)...
    let r = run(
        &sb,
        &bundle,
        "none",
        serde_json::json!({ VOLUMES_ANNOTATION: vols }),
        "echo started",
    );
    assert_refused(&r, &["parameter 'share' is required"]);
    // ... with an allowed key it reaches CreateVolume, and comes back in the volume context.
    let with = |share: &str| {
        serde_json::json!({
            VOLUMES_ANNOTATION: vols,
            PARAMETERS_ANNOTATION: serde_json::json!({"data": {"share": share}}).to_string(),
        })
    };
    assert_ran(&run(&sb, &bundle, "ok", with("/export"), "echo started"));
    let recorded = volumes(&sb, &bundle).await;
    assert_eq!(recorded.len(), 1);
    assert_eq!(recorded[0].parameters["share"], "/export");
    assert_eq!(recorded[0].volume_context["parameter.share"], "/export");
    // Another value for the same volume is refused by key; none at all uses it as created.
    let r = run(&sb, &bundle, "other", with("/other"), "echo started");
    assert_refused(&r, &["key 'share'"]);
    assert_ran(&run(
        &sb,
        &bundle,
        "reuse",
        serde_json::json!({ VOLUMES_ANNOTATION: vols }),
        "echo started",
    ));
    assert_eq!(host_mount_points(&sb), before);
    sb.assert_no_mounts_under();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resources_naming_another_tenants_volume_are_refused() {
    let sb = Sandbox::new("hook-sec-xtenant");
    let bundle = build_bundle(&sb, &["--tenant-annotation", NAMESPACE]);
    let a = run(
        &sb,
        &bundle,
        "a",
        serde_json::json!({ NAMESPACE: "ns-a", VOLUMES_ANNOTATION: "data:16M:/data" }),
        "echo a-secret > /data/secret",
    );
    assert_ran(&a);
    let resource = resource_of(&sb, &bundle, "ns-a.data").await;
    let before = host_mount_points(&sb);
    let b = run(
        &sb,
        &bundle,
        "b",
        serde_json::json!({ NAMESPACE: "ns-b", RESOURCES_ANNOTATION: resource }),
        "cat /data/secret; echo started",
    );
    assert_refused(&b, &["is not a volume of tenant 'ns-b'"]);
    assert!(!b.stdout.contains("a-secret"));
    assert_eq!(host_mount_points(&sb), before);
    // The same annotation from a's own tenant is the provider's own volume: admitted.
    let a2 = run(
        &sb,
        &bundle,
        "a2",
        serde_json::json!({ NAMESPACE: "ns-a", RESOURCES_ANNOTATION: resource }),
        "cat /data/secret",
    );
    assert_ran(&a2);
    assert_eq!(a2.stdout, "a-secret\n");
    sb.assert_no_mounts_under();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_caps_refuse_the_extra_volume() {
    let sb = Sandbox::new("hook-sec-caps");
    let bundle = build_bundle(
        &sb,
        &[
            "--tenant-annotation",
            NAMESPACE,
            "--max-volumes-per-tenant",
            "2",
            "--max-capacity-per-tenant",
            "40M",
        ],
    );
    let tenant =
        |ns: &str, volumes: &str| serde_json::json!({ NAMESPACE: ns, VOLUMES_ANNOTATION: volumes });
    assert_ran(&run(
        &sb,
        &bundle,
        "two",
        tenant("ns-a", "v1:16M:/v1,v2:16M:/v2"),
        "true",
    ));
    // Count: a third volume of ns-a is refused before CreateVolume.
    let r = run(
        &sb,
        &bundle,
        "third",
        tenant("ns-a", "v3:16M:/v3"),
        "echo started",
    );
    assert_refused(
        &r,
        &[
            "volume 'v3' of tenant 'ns-a': create: refused: the tenant has 2 volumes and the cap is 2",
            "--max-volumes-per-tenant",
        ],
    );
    // Naming volumes it has creates nothing, so it is not capped.
    assert_ran(&run(
        &sb,
        &bundle,
        "again",
        tenant("ns-a", "v1:16M:/v1"),
        "true",
    ));
    // Capacity, for another tenant (the caps are per tenant): 32M, then 16M more is over 40M.
    assert_ran(&run(
        &sb,
        &bundle,
        "big",
        tenant("ns-b", "w1:32M:/w1"),
        "true",
    ));
    let r = run(
        &sb,
        &bundle,
        "over",
        tenant("ns-b", "w2:16M:/w2"),
        "echo started",
    );
    assert_refused(
        &r,
        &[
            "volume 'w2' of tenant 'ns-b': create: refused: 16777216 more bytes would take the tenant from 33554432 bytes over the cap of 41943040 bytes",
            "--max-capacity-per-tenant",
        ],
    );
    let names: Vec<String> = volumes(&sb, &bundle)
        .await
        .into_iter()
        .filter_map(|v| v.name)
        .collect();
    assert_eq!(names.len(), 3, "{names:?}");
    assert!(
        !names.iter().any(|n| n == "ns-a.v3" || n == "ns-b.w2"),
        "{names:?}"
    );
    sb.assert_no_mounts_under();
}

/// Writes a checkpoint for container `id` whose sandbox is `sandbox` and whose process is gone (none
/// recorded), as someone who could write into the work dir would.
fn plant_checkpoint(work: &Path, id: &str, sandbox: &Path) {
    let config = ContainerConfig {
        sandbox: sandbox.to_path_buf(),
        ..ContainerConfig::default()
    };
    let rec = ContainerRecord::new(id, config, Vec::new());
    let dir = work.join("isolators/volume/csi").join(id);
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("state.json"), serde_json::to_vec(&rec).unwrap()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reaper_never_removes_a_planted_sandbox() {
    let sb = Sandbox::new("hook-sec-reap");
    let bundle = build_bundle(&sb, &[]);
    let decoy = sb.mkdir("decoy");
    fs::write(decoy.join("keep"), "x").unwrap();
    let decoy2 = sb.mkdir("decoy2");
    fs::write(decoy2.join("keep"), "x").unwrap();
    fs::create_dir_all(bundle.work.join(HOOK_DIR)).unwrap();
    // `oci-hook/../../decoy` starts with `oci-hook` as a string prefix (and component-wise).
    plant_checkpoint(
        &bundle.work,
        "dotdot",
        &bundle.work.join(HOOK_DIR).join("../../decoy"),
    );
    // A sandbox that is exactly `oci-hook/<id>`, but a symlink to a decoy.
    std::os::unix::fs::symlink(&decoy2, bundle.work.join(HOOK_DIR).join("linked")).unwrap();
    plant_checkpoint(
        &bundle.work,
        "linked",
        &bundle.work.join(HOOK_DIR).join("linked"),
    );
    // The hook reaps stale containers at every create-runtime.
    let r = run(
        &sb,
        &bundle,
        "reap",
        serde_json::json!({ VOLUMES_ANNOTATION: "data:16M:/data" }),
        "true",
    );
    assert_ran(&r);
    assert!(decoy.join("keep").exists(), "the `..` decoy was removed");
    assert!(
        decoy2.join("keep").exists(),
        "the symlinked decoy was removed"
    );
    // Neither record passes the checkpoint path checks (a `..` sandbox; a sandbox that is a
    // symlink): both are left alone, their checkpoints kept for an operator to look at, the
    // symlink never followed, never removed.
    for id in ["dotdot", "linked"] {
        assert!(
            bundle
                .work
                .join(format!("isolators/volume/csi/{id}/state.json"))
                .exists(),
            "{id}"
        );
    }
    assert!(
        fs::symlink_metadata(bundle.work.join(HOOK_DIR).join("linked"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    sb.assert_no_mounts_under();
}
