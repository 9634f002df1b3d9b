//! Recover: the checkpoints read back and checked, gone containers cleaned up, stale uses released.

use super::*;
use crate::error_chain::Chain;
use crate::provider::Republish;

/// What `recover` found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IsolatorRecovery {
    /// Containers recovered (known and checkpointed).
    pub recovered: Vec<String>,
    /// Containers cleaned up because they no longer exist.
    pub cleaned: Vec<String>,
    /// (volume, container) uses released because the container is gone.
    pub released_uses: Vec<(String, String)>,
    /// Checkpoints that could not be read, or that name paths not safe to act
    /// on (see [`checkpoint_paths`]), set aside or left alone (path, reason):
    /// nothing they name is unmounted, removed or signalled.
    pub corrupt: Vec<(PathBuf, String)>,
    /// What could not be done, per container (id, error); retried at the
    /// next recovery or cleanup.
    pub failures: Vec<(String, String)>,
}

impl VolumeIsolator {
    /// The containers checkpointed on disk, without loading or changing
    /// anything: lets a caller that shares the work dir with other
    /// containerizers work out which containers are not its own. Only
    /// records that pass the checks recovery makes (readable, their own
    /// directory's, paths safe to act on) are listed; the others are left to
    /// [`recover`](Self::recover), which sets them aside. Reads the file
    /// system in the caller's thread.
    pub fn checkpointed(&self) -> Vec<ContainerRecord> {
        checkpointed_in(&self.work_dir)
    }

    /// Recover: rebuilds from the checkpoints; containers not in `known`
    /// are cleaned up, and volume uses by containers that exist nowhere, or
    /// by recovered containers whose checkpoint does not have the volume
    /// (an update interrupted by a crash), are released.
    pub async fn recover(&self, known: &[String]) -> Result<IsolatorRecovery, IsolatorError> {
        let mut took = crate::phases::PhaseTimes::start();
        let known: HashSet<&str> = known.iter().map(String::as_str).collect();
        let mut report = IsolatorRecovery::default();
        let mut gone = Vec::new();
        // The journal folded into the checkpoint files first (what it replays is then on disk,
        // durably, and the journal empty), then the scan (reads, checks by fd, stale temps
        // removed, bad checkpoints set aside), on the blocking pool; what it found is then
        // loaded in order.
        let journal = self.journal.clone();
        blocking(move || {
            journal
                .get()
                .and_then(|j| j.compact())
                .map_err(|source| IsolatorError::Journal {
                    path: journal.path(),
                    source: Box::new(source),
                })
        })
        .await?;
        took.mark("compact");
        let work_dir = self.work_dir.clone();
        let scanned = blocking(move || scan_checkpoints(&work_dir)).await;
        took.mark("scan");
        for found in scanned {
            match found {
                Scanned::Record(rec) => {
                    let id = rec.container_id.clone();
                    *self.entry(&id).lock().await = Some(rec);
                    if known.contains(id.as_str()) {
                        report.recovered.push(id);
                    } else {
                        gone.push(id);
                    }
                }
                Scanned::Refused(path, reason) => report.corrupt.push((path, reason)),
            }
        }
        // One container's trouble does not stop the others' recovery.
        for id in gone {
            tracing::info!(container_id = %id, "recovery: container is gone; cleaning up");
            match self.cleanup(&id).await {
                Ok(()) => report.cleaned.push(id),
                Err(e) => {
                    tracing::error!(container_id = %id, error = %Chain(&e), "recovery: cleanup failed");
                    report
                        .failures
                        .push((id, crate::error_chain::full_message(&e)));
                }
            }
        }
        took.mark("clean up");
        // Containers that live on keep their uses: put back any the providers lost (publish is
        // idempotent and repairs unpublished ones), all in one batch whose mount checks are made
        // once for all of them. What each one's checkpoint uses, (provider, volume), is kept for
        // the sweep below.
        let mut recorded: HashMap<String, HashSet<(String, String)>> = HashMap::new();
        let mut batch = Vec::with_capacity(report.recovered.len());
        for id in &report.recovered {
            let (resources, groups) = match self.entry(id).lock().await.as_ref() {
                // The groups its prepare asked for, so a volume staged again asks the same.
                Some(r) => {
                    let user = r
                        .config
                        .user
                        .as_deref()
                        .and_then(|u| ownership::resolve_user(u).ok());
                    let wanted = self.groups_to_grant(&r.config.resources, &r.mounts, user);
                    (
                        r.config.resources.clone(),
                        ownership::groups_for_plugins(&wanted),
                    )
                }
                None => Default::default(),
            };
            let uses: HashSet<(String, String)> = resources
                .iter()
                .filter(|r| r.is_disk())
                .filter_map(|r| Some((r.provider_id()?.to_string(), r.source_id()?.to_string())))
                .collect();
            recorded.insert(id.clone(), uses);
            batch.push(Republish {
                container_id: id.clone(),
                resources,
                groups,
            });
        }
        took.mark("gather");
        let republished = self.publisher.republish(&batch).await;
        took.mark("republish");
        for (c, result) in batch.iter().zip(republished.containers) {
            if let Err(e) = result {
                tracing::error!(container_id = %c.container_id, error = %Chain(&e), "recovery: cannot re-ensure the container's volumes");
                report
                    .failures
                    .push((c.container_id.clone(), crate::error_chain::full_message(&e)));
            }
        }
        // A volume the batch's checks could not re-ensure fails each container using it.
        if !republished.unensured.is_empty() {
            let mut users: HashMap<(&str, &str), Vec<&str>> = HashMap::new();
            for (id, uses) in &recorded {
                for (provider_id, volume_id) in uses {
                    users
                        .entry((provider_id.as_str(), volume_id.as_str()))
                        .or_default()
                        .push(id.as_str());
                }
            }
            for (provider_id, volume_id, e) in &republished.unensured {
                let key = (provider_id.as_str(), volume_id.as_str());
                for id in users.get(&key).into_iter().flatten() {
                    tracing::error!(container_id = %id, %volume_id, error = %Chain(e), "recovery: cannot re-ensure the container's volumes");
                    report
                        .failures
                        .push((id.to_string(), crate::error_chain::full_message(e)));
                }
            }
        }
        let live: HashSet<String> = known
            .iter()
            .map(|s| s.to_string())
            .chain(report.recovered.iter().cloned())
            .collect();
        let volumes = self.publisher.users().await;
        for (provider_id, volume_id, user) in stale_uses(&volumes, &recorded, &live) {
            tracing::info!(%volume_id, container_id = %user, "recovery: releasing a use no live container's checkpoint has");
            match self.publisher.release(provider_id, volume_id, user).await {
                Ok(()) => report
                    .released_uses
                    .push((volume_id.to_string(), user.to_string())),
                Err(e) => report
                    .failures
                    .push((user.to_string(), crate::error_chain::full_message(&e))),
            }
        }
        took.mark("release");
        tracing::info!(containers = report.recovered.len(), took = %took, "isolator recovery done");
        Ok(report)
    }
}

/// What the scan of the checkpoints found, per container directory.
enum Scanned {
    /// A checkpoint that passed every check, to load.
    Record(ContainerRecord),
    /// A checkpoint refused (set aside, or left alone if not a real directory), and why.
    Refused(PathBuf, String),
}

/// Reads and checks every container checkpoint under the checkpoint root of `work_dir` (see
/// [`read_record`]): stale temp files of each real directory are removed, a checkpoint that cannot
/// be trusted is set aside (nothing is done through a symlink: not even that), an empty directory
/// removed. Blocks on the file system.
fn scan_checkpoints(work_dir: &Path) -> Vec<Scanned> {
    let Ok(entries) = std::fs::read_dir(checkpoint_root(work_dir)) else {
        return Vec::new();
    };
    // A node's thousands of directories, each on its own: a few threads, a run each, answers in
    // the listing's order.
    let entries: Vec<std::fs::DirEntry> = entries.flatten().collect();
    crate::offload::scoped_runs(entries, CHECKPOINTS_PER_THREAD, |run| {
        run.iter().filter_map(|e| scan_one(work_dir, e)).collect()
    })
}

/// Container directories per scanning thread of [`scan_checkpoints`].
const CHECKPOINTS_PER_THREAD: usize = 512;

/// One container directory of [`scan_checkpoints`]: its record, or why it is refused (`None`:
/// an empty one, removed).
fn scan_one(work_dir: &Path, e: &std::fs::DirEntry) -> Option<Scanned> {
    let path = e.path().join("state.json");
    match read_record(work_dir, e) {
        Ok(rec) => {
            checkpoint::remove_stale_temps(&e.path());
            Some(Scanned::Record(rec))
        }
        // Nothing is done through a symlink: not even setting it aside.
        Err(RecordRefusal::NotADirectory) => {
            let reason =
                "the container's checkpoint directory is not a directory (a symlink?): left alone"
                    .to_string();
            tracing::error!(path = %e.path().display(), %reason, "container checkpoint refused");
            Some(Scanned::Refused(e.path(), reason))
        }
        Err(RecordRefusal::Bad(reason)) => {
            checkpoint::remove_stale_temps(&e.path());
            tracing::error!(path = %path.display(), %reason, "container checkpoint set aside");
            let _ = checkpoint::set_aside(&path);
            Some(Scanned::Refused(path, reason))
        }
        Err(RecordRefusal::Unreadable(reason)) if path.exists() => {
            checkpoint::remove_stale_temps(&e.path());
            tracing::error!(path = %path.display(), %reason, "container checkpoint set aside");
            let _ = checkpoint::set_aside(&path);
            Some(Scanned::Refused(path, reason))
        }
        Err(RecordRefusal::Unreadable(_)) => {
            checkpoint::remove_stale_temps(&e.path());
            let _ = crate::durable::remove_dir(&e.path());
            None
        }
    }
}

/// The records [`VolumeIsolator::checkpointed`] lists, for the isolator of `work_dir`: the
/// checkpoint files with the isolator's journal replayed over them (a container the journal
/// names is as its last entry says, file or no file). A journal that cannot be read lists the
/// files alone (and is logged): recovery, which needs it, then stops naming it.
pub(crate) fn checkpointed_in(work_dir: &Path) -> Vec<ContainerRecord> {
    let mut journaled = journaled_or_logged(work_dir);
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(checkpoint_root(work_dir)) {
        for e in entries.flatten() {
            let id = e.file_name().to_string_lossy().into_owned();
            let found = match journaled.remove(&id) {
                Some(None) => continue,
                Some(Some(bytes)) => check_bytes(work_dir, &id, &bytes),
                None => read_record(work_dir, &e),
            };
            out.extend(found.ok());
        }
    }
    for (id, bytes) in journaled {
        if let Some(bytes) = bytes {
            out.extend(check_bytes(work_dir, &id, &bytes).ok());
        }
    }
    out
}

/// The ids of the containers checkpointed in `work_dir`, readable or not: the checkpoint
/// directories, and the containers the isolator's journal names, less those it removed.
pub(crate) fn checkpointed_ids(work_dir: &Path) -> HashSet<String> {
    let mut ids: HashSet<String> = std::fs::read_dir(checkpoint_root(work_dir))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    for (id, state) in journaled_or_logged(work_dir) {
        match state {
            Some(_) => ids.insert(id),
            None => ids.remove(&id),
        };
    }
    ids
}

fn journaled_or_logged(work_dir: &Path) -> crate::isolator::journal::Journaled {
    crate::isolator::journal::read_journaled(work_dir).unwrap_or_else(|e| {
        tracing::error!(error = %crate::error_chain::full_message(&e), "isolator journal unreadable: listing the checkpoint files alone");
        Default::default()
    })
}

/// Reads one container's checkpoint from its directory entry under the checkpoint root of
/// `work_dir` and checks it: a real directory (not a symlink), then [`check_bytes`].
fn read_record(work_dir: &Path, e: &std::fs::DirEntry) -> Result<ContainerRecord, RecordRefusal> {
    let id = e.file_name().to_string_lossy().into_owned();
    if !e.file_type().is_ok_and(|t| t.is_dir()) {
        return Err(RecordRefusal::NotADirectory);
    }
    let path = e.path().join("state.json");
    let bytes = read_checkpoint_file(&path).map_err(RecordRefusal::Unreadable)?;
    check_bytes(work_dir, &id, &bytes)
}

/// Checks a checkpoint's bytes for container `id` (from its file or the journal): a record
/// that parses, of a format this build knows, for the container `id` names, whose paths pass
/// [`checkpoint_paths::check_record`] and whose sandbox and host binds open by fd without a
/// symlink. The error says why (for the report).
fn check_bytes(work_dir: &Path, id: &str, bytes: &[u8]) -> Result<ContainerRecord, RecordRefusal> {
    let rec = serde_json::from_slice::<ContainerRecord>(bytes)
        .map_err(|e| RecordRefusal::Bad(e.to_string()))?;
    if rec.container_id != id {
        return Err(RecordRefusal::Bad(format!(
            "container id '{}' does not match its directory",
            crate::shown::shown(&rec.container_id)
        )));
    }
    if rec.format > FORMAT_VERSION {
        return Err(RecordRefusal::Bad(format!(
            "format {} is newer than this build's {FORMAT_VERSION}",
            rec.format
        )));
    }
    let unsafe_path =
        |e: CheckpointPathError| RecordRefusal::Bad(crate::error_chain::full_message(&e));
    checkpoint_paths::check_record(&rec, work_dir).map_err(unsafe_path)?;
    if let Some((fd, name)) = checkpoint_paths::open_sandbox(&rec, work_dir).map_err(unsafe_path)? {
        for b in &rec.host_binds {
            checkpoint_paths::check_host_bind(&rec, &fd, &name, b).map_err(unsafe_path)?;
        }
    }
    Ok(rec)
}

/// The uses recovery releases, as (provider, volume, container): a use is released when its
/// container is gone (neither in `recorded`, the recovered containers' checkpointed uses, nor in
/// `live`), and also when its container lives on but its checkpoint does not have the volume: a
/// crash in an update after the new volume's use became durable and before the checkpoint recorded
/// it (the update failed: the container keeps its old set), or after the checkpoint dropped a
/// removed volume and before its use was released. A user that is not a container id
/// (`docker-plugin/<Mount ID>`: no container id holds a `/`) was not made by a containerizer and
/// is never released here; `docker-plugin` and its engine reconciliation own it.
fn stale_uses<'a>(
    volumes: &'a [VolumeUsers],
    recorded: &HashMap<String, HashSet<(String, String)>>,
    live: &HashSet<String>,
) -> Vec<(&'a str, &'a str, &'a str)> {
    let mut out = Vec::new();
    for vol in volumes {
        let key = (vol.provider_id.clone(), vol.volume_id.clone());
        for user in &vol.users {
            if crate::resource::validate_container_id(user).is_err() {
                continue;
            }
            let stale = match recorded.get(user) {
                Some(uses) => !uses.contains(&key),
                None => !live.contains(user),
            };
            if stale {
                out.push((
                    vol.provider_id.as_str(),
                    vol.volume_id.as_str(),
                    user.as_str(),
                ));
            }
        }
    }
    out
}

/// Why [`VolumeIsolator::read_record`] refused a checkpoint.
#[derive(Debug)]
enum RecordRefusal {
    /// The container's directory is not a real directory: nothing is done through it.
    NotADirectory,
    /// `state.json` could not be read (missing: an empty directory).
    Unreadable(String),
    /// It was read but cannot be trusted (parse, id, format, paths): set aside.
    Bad(String),
}

/// The largest container checkpoint read back (a record is a few KiB).
const MAX_CHECKPOINT_BYTES: u64 = 1 << 20;

/// A container checkpoint's bytes: a regular file, not reached through a symlink, never blocking on
/// a FIFO planted in its place, at most [`MAX_CHECKPOINT_BYTES`]. A checkpoint is data found in the
/// work dir, read like anything else found there.
fn read_checkpoint_file(path: &std::path::Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| e.to_string())?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".to_string());
    }
    let mut bytes = Vec::new();
    file.take(MAX_CHECKPOINT_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > MAX_CHECKPOINT_BYTES {
        return Err(format!("larger than {MAX_CHECKPOINT_BYTES} bytes"));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node's thousands of container directories are scanned by a few threads: each is
    /// answered once, in the listing's order, and each kind handled as alone (a good checkpoint
    /// loaded, a bad one set aside, an empty directory removed, a symlink left alone).
    #[test]
    fn thousands_of_checkpoints_are_scanned_in_order_on_a_few_threads() {
        let work = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let root = checkpoint_root(work.path());
        std::fs::create_dir_all(&root).unwrap();
        let count = CHECKPOINTS_PER_THREAD * 2 + 300;
        for i in 0..count {
            let id = format!("c{i:05}");
            let dir = root.join(&id);
            match i % 4 {
                0 => {
                    std::fs::create_dir(&dir).unwrap();
                    let config = crate::isolator::ContainerConfig {
                        sandbox: elsewhere.path().join(&id),
                        ..Default::default()
                    };
                    let rec = ContainerRecord::new(&id, config, Vec::new());
                    std::fs::write(dir.join("state.json"), serde_json::to_vec(&rec).unwrap())
                        .unwrap();
                }
                1 => {
                    std::fs::create_dir(&dir).unwrap();
                    std::fs::write(dir.join("state.json"), b"{\"format").unwrap();
                }
                2 => std::fs::create_dir(&dir).unwrap(),
                _ => std::os::unix::fs::symlink(elsewhere.path(), &dir).unwrap(),
            }
        }
        let listed: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        let scanned = scan_checkpoints(work.path());
        let answered: Vec<String> = scanned
            .iter()
            .map(|found| match found {
                Scanned::Record(rec) => rec.container_id.clone(),
                Scanned::Refused(path, _) => {
                    let dir = if path.ends_with("state.json") {
                        path.parent().unwrap()
                    } else {
                        path.as_path()
                    };
                    dir.file_name().unwrap().to_string_lossy().into_owned()
                }
            })
            .collect();
        let kind = |id: &str| id[1..].parse::<usize>().unwrap() % 4;
        let want: Vec<String> = listed.into_iter().filter(|id| kind(id) != 2).collect();
        assert_eq!(
            answered, want,
            "every directory but the empty ones, in listing order"
        );
        for (found, id) in scanned.iter().zip(&want) {
            match (found, kind(id)) {
                (Scanned::Record(_), 0) => {}
                (Scanned::Refused(_, why), 1) => assert!(!why.is_empty()),
                (Scanned::Refused(_, why), 3) => assert!(why.contains("symlink"), "{why}"),
                (other, k) => panic!("{id} (kind {k}): {:?}", matches!(other, Scanned::Record(_))),
            }
            let dir = root.join(id);
            match kind(id) {
                1 => assert!(!dir.join("state.json").exists(), "{id}: set aside"),
                3 => assert!(dir.symlink_metadata().unwrap().file_type().is_symlink()),
                _ => {}
            }
        }
        for i in (2..count).step_by(4) {
            assert!(
                !root.join(format!("c{i:05}")).exists(),
                "empty c{i:05} removed"
            );
        }
    }

    #[test]
    fn stale_uses_table() {
        let vol = |p: &str, v: &str, users: &[&str]| VolumeUsers {
            provider_id: p.to_string(),
            volume_id: v.to_string(),
            users: users.iter().map(|u| u.to_string()).collect(),
        };
        let uses = |pairs: &[(&str, &str)]| -> HashSet<(String, String)> {
            pairs
                .iter()
                .map(|(p, v)| (p.to_string(), v.to_string()))
                .collect()
        };
        // c1 recovered with v1 of p; c2 known to the caller but not checkpointed here (another
        // containerizer's); c3 exists nowhere.
        let recorded = HashMap::from([("c1".to_string(), uses(&[("p", "v1")]))]);
        let live: HashSet<String> = ["c1", "c2"].iter().map(|s| s.to_string()).collect();
        // (case, volumes, released as (provider, volume, container))
        type Case<'a> = (&'a str, Vec<VolumeUsers>, Vec<(&'a str, &'a str, &'a str)>);
        let cases: Vec<Case> = vec![
            (
                "a recorded use stays",
                vec![vol("p", "v1", &["c1"])],
                vec![],
            ),
            (
                "a live caller's use stays",
                vec![vol("p", "v2", &["c2"])],
                vec![],
            ),
            (
                "a gone container's use goes",
                vec![vol("p", "v1", &["c1", "c3"])],
                vec![("p", "v1", "c3")],
            ),
            (
                "a recovered container's use its checkpoint lacks goes",
                vec![vol("p", "v2", &["c1"])],
                vec![("p", "v2", "c1")],
            ),
            (
                "the same volume id under another provider is another volume",
                vec![vol("q", "v1", &["c1"])],
                vec![("q", "v1", "c1")],
            ),
            ("no users", vec![vol("p", "v9", &[])], vec![]),
            (
                "a use docker-plugin made is not a container's: it stays",
                vec![vol("p", "v1", &["c1", "docker-plugin/0123abcd"])],
                vec![],
            ),
        ];
        for (case, volumes, released) in cases {
            assert_eq!(stale_uses(&volumes, &recorded, &live), released, "{case}");
        }
    }
}
