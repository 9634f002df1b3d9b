//! Disk faults under the work dir: a full filesystem, then one that turned
//! read-only. The operation fails cleanly (an error naming the checkpoint,
//! the volume untouched on disk and in memory, nothing mounted), nothing
//! half-written is trusted afterwards, and it works again once space is back.

use csi_isolator_testing::plugin_bin;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use csi_isolator::mount::{self, LinuxSyscall, MountFlags, MountTable, ProcMountTable, Syscall};
use csi_isolator::provider::{
    CreateSpec, PluginSource, ProviderConfig, ProviderError, StorageProvider, VolumeState,
};
use csi_isolator_testing::{require_root, PluginProcess, Sandbox};

/// A small ext4 filesystem on a loop device, mounted at `<sandbox>/work`.
fn small_work_fs(sb: &Sandbox) -> PathBuf {
    let image = sb.join("work.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&image)
        .output()
        .expect("run mkfs.ext4 (e2fsprogs)");
    assert!(
        out.status.success(),
        "mkfs.ext4: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let work = sb.mkdir("work");
    let dev = mount::attach(&image, false).unwrap();
    LinuxSyscall::new()
        .mount_filesystem(&dev.path, &work, "ext4", MountFlags::default(), "")
        .unwrap();
    // The mount holds the loop device now; autoclear frees it on unmount.
    drop(dev);
    work
}

/// Fills the filesystem holding `dir` until ENOSPC; returns the filler.
fn fill(dir: &Path) -> PathBuf {
    let filler = dir.join("filler");
    let mut f = std::fs::File::create(&filler).unwrap();
    // Big chunks first, then smaller ones, down to single bytes, so that not
    // even a partial block is left (as root, ext4's reserved blocks go too).
    for size in [64 << 10, 4 << 10, 512, 1] {
        let chunk = vec![0u8; size];
        loop {
            match f.write_all(&chunk) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(e) => panic!("fill: {e}"),
            }
        }
    }
    let _ = f.sync_all();
    filler
}

#[tokio::test]
async fn a_full_or_read_only_work_dir_fails_cleanly_and_recovers() {
    require_root();
    let sb = Sandbox::new("disk-full");
    let plugin = PluginProcess::start(&sb, plugin_bin(), &[]).await;
    let work = small_work_fs(&sb);
    let mut config = ProviderConfig::new(
        "",
        "default",
        &work,
        PluginSource::Endpoint(plugin.endpoint()),
    );
    config.provider_id.clear();
    let provider = StorageProvider::start(config.clone()).await.unwrap();
    let id = provider
        .create_volume(CreateSpec::new("v", 4 << 20))
        .await
        .unwrap()
        .source_id()
        .unwrap()
        .to_string();
    let target = provider.mount_point(&id);
    // The create's journal entry written back: the state file is there to be compared.
    provider.compact_journal().await;
    let state_file = provider.layout().state_file(&id);
    let checkpoint = |p: &StorageProvider| {
        csi_isolator::provider::checkpoint::read_state(p.layout(), &id)
            .unwrap()
            .expect("a checkpoint")
    };
    let before = checkpoint(&provider);
    assert_eq!(std::fs::read(&state_file).unwrap(), before);

    // 1. Full: the intent cannot be written, so no RPC is sent and nothing is kept; or, as
    //    the journal's last block has room for it, the publish fails at its first step that
    //    needs a new block (the volume's directories were made with it: the plugin's target
    //    directory at NodePublish), and nothing past it is done.
    let filler = fill(&work);
    let err = provider.publish(&id, "c1").await.unwrap_err();
    let chain = csi_isolator::error_chain::Chain(&err).to_string();
    let no_space = chain.contains("No space left on device");
    assert!(
        matches!(err, ProviderError::Checkpoint { .. }) || no_space,
        "{chain}"
    );
    assert!(err.to_string().contains(&id), "names the volume: {err}");
    let rec = provider.volume(&id).await.unwrap();
    assert!(rec.users.is_empty(), "the use was not kept");
    if matches!(err, ProviderError::Checkpoint { .. }) {
        assert_eq!(rec.state, VolumeState::Created);
        assert_eq!(checkpoint(&provider), before, "the checkpoint is untouched");
    } else {
        // The intent was durable: the volume is left on its way to PUBLISHED (its rollback's
        // own write failed on the full disk, logged), which the next publish (below) or a
        // recovery takes up. On disk the intent still names c1: a recovery before the next
        // publish would take c1's use up, and the containerizer's Recover drops it if c1 is
        // not running.
        assert!(rec.state.pending_step().is_some(), "between steps: {rec:?}");
        assert_eq!(rec.towards, Some(VolumeState::Published));
        let on_disk: serde_json::Value = serde_json::from_slice(&checkpoint(&provider)).unwrap();
        assert_eq!(on_disk["towards"], "PUBLISHED", "{on_disk}");
    }
    assert!(!ProcMountTable::new().is_mount_point(&target).unwrap());
    // Without a durable intent no RPC; with one, nothing past the step that failed.
    let sent = |rpc: &str| plugin.calls().iter().any(|c| c.starts_with(rpc));
    if matches!(err, ProviderError::Checkpoint { .. }) {
        assert!(
            !sent("NodePublishVolume") && !sent("ControllerPublishVolume"),
            "no RPC was sent without a durable intent: {:?}",
            plugin.calls()
        );
    } else {
        assert!(chain.contains("NodePublishVolume"), "{chain}");
        assert!(
            ProcMountTable::new()
                .mounts_under(&work)
                .unwrap()
                .iter()
                .all(|m| m.mount_point != target),
            "no target mounted after the failed NodePublish"
        );
    }
    let leftovers: Vec<_> = std::fs::read_dir(state_file.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        leftovers,
        vec![std::ffi::OsString::from("volume.state")],
        "no temp file left"
    );

    // 2. Space is back: it works.
    std::fs::remove_file(&filler).unwrap();
    provider.publish(&id, "c1").await.unwrap();
    assert!(ProcMountTable::new().is_mount_point(&target).unwrap());

    // 3. The filesystem turns read-only: the release fails cleanly, the
    //    volume stays published and in use (nothing half-done).
    LinuxSyscall::new()
        .remount_bind_readonly(&work)
        .unwrap_or_else(|_| {
            let out = Command::new("mount")
                .args(["-o", "remount,ro"])
                .arg(&work)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "remount ro: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        });
    let err = provider.release(&id, "c1").await.unwrap_err();
    assert!(matches!(err, ProviderError::Checkpoint { .. }), "{err}");
    let rec = provider.volume(&id).await.unwrap();
    assert_eq!(rec.state, VolumeState::Published, "still published");
    assert!(ProcMountTable::new().is_mount_point(&target).unwrap());
    provider.shutdown(Duration::from_secs(5)).await;
    drop(provider);

    // 4. Writable again; a restarted provider trusts only what is on disk:
    //    the volume is in use by c1, published; releasing now works.
    let out = Command::new("mount")
        .args(["-o", "remount,rw"])
        .arg(&work)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "remount rw: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let provider = StorageProvider::start(config).await.unwrap();
    let rec = provider.volume(&id).await.unwrap();
    assert_eq!(rec.users.iter().collect::<Vec<_>>(), vec!["c1"]);
    assert_eq!(rec.state, VolumeState::Published);
    assert!(provider.recovery_report().corrupt.is_empty());
    provider.release(&id, "c1").await.unwrap();
    assert!(!ProcMountTable::new().is_mount_point(&target).unwrap());
    provider.destroy_volume(&id).await.unwrap();
    provider.shutdown(Duration::from_secs(5)).await;
    drop(provider);
    LinuxSyscall::new().unmount(&work, false).unwrap();
    drop(plugin);
    sb.assert_no_mounts_under();
    sb.assert_no_loop_devices();
}
