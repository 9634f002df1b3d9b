//! A read-only view of every volume under a work dir, checked against the
//! mount table: what `csi-isolator status` prints. It reads checkpoints (each provider's
//! `volume.state` files with its journal's complete entries over them: a running provider
//! writes its state files back lazily; from the provider's volume summary when it is current,
//! see [`crate::provider::summary`]) and `/proc/self/mountinfo` only; it starts no plugin and
//! changes nothing (a journal's torn tail is skipped, not cut).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::csi::CAPACITY_ENFORCED_KEY;
use crate::mount::{MountError, MountTable};
use crate::provider::checkpoint;
use crate::provider::state::{ContentSource, Expansion, VolumeRecord, VolumeState};
use crate::provider::summary::{self, VolumeDir};
use crate::resource::{Layout, STATE_FILE};

/// One volume as its checkpoint and the mount table see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct VolumeStatus {
    /// `<type>/<name>` of the plugin.
    pub plugin: String,
    /// The volume id.
    pub volume_id: String,
    /// The CreateVolume name, if any.
    pub name: Option<String>,
    /// The recorded state.
    pub state: VolumeState,
    /// Containers using it.
    pub users: BTreeSet<String>,
    /// Its capacity as CreateVolume reported it (0: unknown, e.g. an adopted volume).
    pub capacity_bytes: u64,
    /// Whether the plugin says the volume holds at most its capacity (its volume context's
    /// `capacity_enforced`); `None` when the plugin does not say.
    pub capacity_enforced: Option<bool>,
    /// The CreateVolume parameters it was created with.
    pub parameters: BTreeMap<String, String>,
    /// Whether it was imported (pre-provisioned): destroy leaves it in the plugin.
    pub imported: bool,
    /// Where it can be reached from, as CreateVolume answered (empty: anywhere).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub accessible_topology: Vec<crate::provider::topology::Segments>,
    /// The capability it is published with: access type (`mount`, or `block` for a block volume,
    /// whose mount point is then a device file), access mode, fs type, mount flags.
    pub capability: crate::provider::state::Capability,
    /// The group it is staged and published with (`volume_mount_group`, see
    /// [`crate::provider::mount_group`]) while it is on the node; `None`: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mount_group: Option<u32>,
    /// Its mount point (the NodePublish target).
    pub mount_point: PathBuf,
    /// Whether the mount table has a mount at the mount point.
    pub mounted: bool,
    /// Whether the mount table has a mount at the staging path.
    pub staged: bool,
    /// What disagrees, if anything.
    pub disagreement: Option<String>,
    /// Its usage per its plugin's NodeGetVolumeStats, when asked for
    /// ([`crate::provider::stats::attach`]) and answered; the scan leaves it `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stats: Option<VolumeStats>,
    /// Its condition, when its plugin offers VOLUME_CONDITION and said one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub condition: Option<VolumeCondition>,
    /// Why its stats were asked for and are missing (timed out, the call failed, the answer
    /// was refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stats_unavailable: Option<String>,
    /// Its mutable parameters as the plugin last accepted them (`volume modify`,
    /// [`crate::provider::modify`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub mutable_parameters: BTreeMap<String, String>,
    /// Where its content came from when it was created (`volume create --from-snapshot` or
    /// `--from-volume`, [`crate::provider::snapshot`]); `None`: made empty (or imported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_source: Option<ContentSource>,
    /// An expansion not finished ([`crate::provider::expand`]): the size asked and the call it
    /// waits for (`node`: NodeExpandVolume, at the volume's next publish on this node or the
    /// next `volume expand`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expansion: Option<Expansion>,
    /// The volume was fenced from this node ([`crate::provider::handoff`]): why, and the
    /// containers whose use of it was lost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fenced: Option<crate::provider::state::Fence>,
}

/// A state file that could not be read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct UnreadableState {
    /// The file.
    pub path: PathBuf,
    /// Why.
    pub reason: String,
}

/// Everything `status` reports.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StatusReport {
    /// The volumes.
    pub volumes: Vec<VolumeStatus>,
    /// State files that could not be read (and files set aside earlier).
    pub unreadable: Vec<UnreadableState>,
}

impl StatusReport {
    /// The report as `serde_json::to_writer_pretty` writes it, byte for byte, its volumes
    /// serialized by a few threads (a node's 10,000 are megabytes of JSON), each into a buffer
    /// of its own, written in order.
    pub fn write_pretty_json(&self, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        out.write_all(b"{\n  \"volumes\": ")?;
        write_pretty_array(out, &self.volumes)?;
        out.write_all(b",\n  \"unreadable\": ")?;
        write_pretty_array(out, &self.unreadable)?;
        out.write_all(b"\n}")
    }
}

/// Items serialized in a pretty JSON array that is a field of the top-level object (so each
/// item is indented by two levels), as `serde_json`'s pretty printer writes it.
fn write_pretty_array<T: Serialize + Sync>(
    out: &mut dyn std::io::Write,
    items: &[T],
) -> std::io::Result<()> {
    if items.is_empty() {
        return out.write_all(b"[]");
    }
    let refs: Vec<&T> = items.iter().collect();
    let runs = crate::offload::scoped_runs(refs, ITEMS_PER_WRITER, |run| vec![pretty_run(run)]);
    out.write_all(b"[\n")?;
    for (i, text) in runs.into_iter().enumerate() {
        if i > 0 {
            out.write_all(b",\n")?;
        }
        out.write_all(&text?)?;
    }
    out.write_all(b"\n  ]")
}

/// A run of an array's items as [`write_pretty_array`] writes them, without the brackets.
fn pretty_run<T: Serialize>(run: Vec<&T>) -> std::io::Result<Vec<u8>> {
    let mut text = Vec::new();
    let mut one = Vec::new();
    for item in run {
        one.clear();
        serde_json::to_writer_pretty(&mut one, item).map_err(std::io::Error::from)?;
        if !text.is_empty() {
            text.extend_from_slice(b",\n");
        }
        // Two levels in: JSON text holds a newline only between tokens (one in a string is
        // escaped), so each line gains the indent.
        text.extend_from_slice(b"    ");
        for line in one.split_inclusive(|&b| b == b'\n') {
            text.extend_from_slice(line);
            if line.ends_with(b"\n") {
                text.extend_from_slice(b"    ");
            }
        }
    }
    Ok(text)
}

/// Items per serializing thread of [`StatusReport::write_pretty_json`].
const ITEMS_PER_WRITER: usize = 1024;

/// How [`scan_with`] reads the volume directories.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScanOptions {
    /// Use a provider's volume summary when it is current (else, and when false, every
    /// directory is read: the full scan). The answer is the same.
    pub use_summary: bool,
    /// Directories per reading thread ([`summary::DIRS_PER_THREAD`]; lower in tests).
    pub dirs_per_thread: usize,
}

impl Default for ScanOptions {
    fn default() -> Self {
        ScanOptions {
            use_summary: true,
            dirs_per_thread: summary::DIRS_PER_THREAD,
        }
    }
}

/// Scans `<work_dir>/csi/*/*/volumes/*/volume.state` and compares with `table`.
///
/// Its cost: per provider one read of its journal, of its volume summary, one listing of its
/// `volumes/` and one `statx` per state file the summary records (re-reading, as the full scan
/// does, a directory whose state file changed since: status reads the truth) when the summary
/// is current; else (an older release's work dir, or until the provider's next compaction after
/// `volume detach`), per volume directory, a listing and a read of the state file the journal
/// does not cover; spread over a few threads (see [`crate::provider::summary`]). Then one
/// mount check per target and staging path ([`MountTable::mount_points_beneath`]).
pub fn scan(work_dir: &Path, table: &dyn MountTable) -> Result<StatusReport, MountError> {
    scan_with(work_dir, table, ScanOptions::default())
}

/// [`scan`], reading the volume directories as `how` says.
pub fn scan_with(
    work_dir: &Path,
    table: &dyn MountTable,
    how: ScanOptions,
) -> Result<StatusReport, MountError> {
    let csi = work_dir.join("csi");
    let mut report = StatusReport::default();
    for (plugin_type, plugin_name) in plugins(&csi) {
        let layout = Layout::new(work_dir, &plugin_type, &plugin_name);
        let volumes = layout.volumes_dir();
        let summary_path = layout.base().join(summary::SUMMARY_FILE);
        // The journal first, then the listing of `volumes/` (thousands of entries) and the
        // summary (megabytes) side by side. Not the listing before the journal: a compaction
        // between the two makes a volume's directory and then drops its journal entry, and a
        // volume neither listed nor journaled would be missing from the report.
        let journal = checkpoint::read_journal_entries(&layout);
        let want_summary = how.use_summary && matches!(journal, Ok(Some(_)));
        let (listed, read_summary) = std::thread::scope(|s| {
            let summary = want_summary.then(|| s.spawn(|| summary::read(&summary_path)));
            let listed = summary::list(&volumes);
            (listed, summary.map(crate::offload::joined))
        });
        // The journal's complete entries, over the state files: the truth while a provider
        // runs (its state files are written back lazily). A refused journal is reported and
        // the state files shown alone.
        let (journaled, found_summary) = match journal {
            Ok(entries) => {
                let summary = entries.as_ref().zip(read_summary).and_then(|(p, read)| {
                    summary::keep_current(&summary_path, read, p.first_seq, p.entries.len() as u64)
                });
                // All of them, over a summary too: those it covers say again what it says, and a
                // crash between its write and the journal's reset may have left a volume
                // directory its entry names unmade (the full scan then finds it by the entry).
                let entries = entries.map(|p| p.entries).unwrap_or_default();
                let (journaled, _) =
                    checkpoint::replay(&entries, crate::resource::encode_volume_id);
                (journaled, summary)
            }
            Err(e) => {
                report.unreadable.push(UnreadableState {
                    path: layout.base().join(checkpoint::JOURNAL_FILE),
                    reason: crate::error_chain::full_message(&e),
                });
                Default::default()
            }
        };
        let plugin = format!("{plugin_type}/{plugin_name}");
        // Thousands of directories checked (or read), their records parsed and their mount
        // points asked, by a few threads, a run of directories each.
        let plan = summary::plan(listed, found_summary, &journaled);
        let runs = crate::offload::scoped_runs(plan.names, how.dirs_per_thread, |run| {
            let found = summary::resolve(&volumes, &journaled, plan.read_at, run);
            let read = found.iter().filter(|(_, read)| *read).count();
            let found = found.into_iter().map(|(dir, _)| dir).collect();
            vec![(read, scan_run(&plugin, &layout, table, found))]
        });
        let mut read = 0;
        for (run_read, run) in runs {
            let (unreadable, volumes) = run?;
            read += run_read;
            report.unreadable.extend(unreadable);
            // The first run's volumes taken as they are (megabytes not copied), the others
            // appended (a large buffer grows in place).
            if report.volumes.is_empty() {
                report.volumes = volumes;
            } else {
                report.volumes.extend(volumes);
            }
        }
        tracing::debug!(%plugin, read, "volume directories read one by one");
    }
    Ok(report)
}

/// One run of a provider's volume directories: each record parsed, then one question to the
/// table about all their mount points. What could not be read (set-aside files, states), and
/// the volumes, in the run's order.
fn scan_run(
    plugin: &str,
    layout: &Layout,
    table: &dyn MountTable,
    run: Vec<VolumeDir>,
) -> Result<(Vec<UnreadableState>, Vec<VolumeStatus>), MountError> {
    let volumes = layout.volumes_dir();
    let mut unreadable = Vec::new();
    let mut parsed = Vec::with_capacity(run.len());
    for found in run {
        let VolumeDir {
            name,
            set_aside,
            state,
            state_file: _,
        } = found;
        let rec = state.map(|read| read.and_then(|b| VolumeRecord::from_state_file(&b, &name)));
        unreadable.extend(set_aside.into_iter().map(|file| UnreadableState {
            path: volumes.join(&name).join(file),
            reason: "set aside as corrupt by an earlier recovery".into(),
        }));
        match rec {
            Some(Ok(rec)) => parsed.push((name, rec)),
            Some(Err(reason)) => unreadable.push(UnreadableState {
                path: volumes.join(&name).join(STATE_FILE),
                reason,
            }),
            None => {}
        }
    }
    // Its directory's name is its encoded id (`from_state_file` checked): its mount points are
    // asked relative to `mounts/`, each volume's target and staging path, in that order.
    let mounts = layout.mounts_dir();
    let names: Vec<&str> = parsed.iter().map(|(name, _)| name.as_str()).collect();
    let answers = table.mount_points_beneath(&mounts, &names, &Layout::MOUNT_POINTS)?;
    let statuses = parsed
        .into_iter()
        .zip(answers.chunks(2))
        .map(|((name, rec), mounted)| {
            let target = Layout::target_named(&mounts, &name);
            volume_status(plugin.to_string(), target, mounted[0], mounted[1], rec)
        })
        .collect();
    Ok((unreadable, statuses))
}

/// A volume's status from its record and whether its mount point (`target`) and its staging
/// path are mount points.
fn volume_status(
    plugin: String,
    target: PathBuf,
    is_mounted: bool,
    staged: bool,
    rec: VolumeRecord,
) -> VolumeStatus {
    VolumeStatus {
        plugin,
        disagreement: disagreement(&rec, is_mounted),
        volume_id: rec.volume_id,
        name: rec.name,
        state: rec.state,
        capacity_bytes: rec.capacity_bytes,
        capacity_enforced: rec
            .volume_context
            .get(CAPACITY_ENFORCED_KEY)
            .and_then(|v| v.parse().ok()),
        users: rec.users.into_iter().collect(),
        parameters: rec.parameters.into_iter().collect(),
        imported: rec.pre_provisioned,
        accessible_topology: rec.accessible_topology,
        capability: rec.capability,
        mount_group: rec.mount_group.filter(|_| rec.state.is_node_side()),
        mount_point: target,
        mounted: is_mounted,
        staged,
        stats: None,
        condition: None,
        stats_unavailable: None,
        mutable_parameters: rec.mutable_parameters.into_iter().collect(),
        content_source: rec.content_source,
        expansion: rec.expansion,
        fenced: rec.fenced,
    }
}

fn disagreement(rec: &VolumeRecord, mounted: bool) -> Option<String> {
    match rec.state {
        VolumeState::Published if !mounted => {
            Some("recorded PUBLISHED but nothing is mounted at the mount point".into())
        }
        VolumeState::Created | VolumeState::NodeReady | VolumeState::VolReady if mounted => Some(
            format!("recorded {} but the mount point is mounted", rec.state),
        ),
        s if !s.is_steady() => Some(format!(
            "{s}: an operation is in progress or was interrupted"
        )),
        _ if !rec.users.is_empty() && rec.state != VolumeState::Published => {
            Some("in use but not published".into())
        }
        _ => None,
    }
}

fn plugins(csi: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let Ok(types) = std::fs::read_dir(csi) else {
        return out;
    };
    for t in types.flatten().filter(|e| e.path().is_dir()) {
        let Ok(names) = std::fs::read_dir(t.path()) else {
            continue;
        };
        for n in names.flatten().filter(|e| e.path().is_dir()) {
            out.push((
                t.file_name().to_string_lossy().into_owned(),
                n.file_name().to_string_lossy().into_owned(),
            ));
        }
    }
    out.sort();
    out
}

/// A volume's usage as its plugin reports it; `None` where the plugin says nothing (a block
/// volume has its total bytes only).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeStats {
    /// Bytes the volume holds.
    pub bytes_total: Option<u64>,
    /// Bytes used.
    pub bytes_used: Option<u64>,
    /// Bytes still available to the workload.
    pub bytes_available: Option<u64>,
    /// Inodes the volume holds.
    pub inodes_total: Option<u64>,
    /// Inodes used.
    pub inodes_used: Option<u64>,
    /// Inodes still available.
    pub inodes_free: Option<u64>,
}

/// A volume's condition as its plugin reports it (CSI's `VolumeCondition`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeCondition {
    /// Whether the plugin finds the volume abnormal.
    pub abnormal: bool,
    /// The plugin's message (at most [`crate::provider::stats::MESSAGE_MAX_BYTES`]).
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mount::FakeSyscall;
    use crate::provider::state::Capability;

    #[test]
    fn flags_disagreements_with_the_mount_table() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path(), "t", "n");
        let write = |id: &str, state: VolumeState, users: &[&str]| {
            let mut r = VolumeRecord::new(id, Capability::default());
            r.state = state;
            r.users = users.iter().map(|s| s.to_string()).collect();
            let p = layout.state_file(id);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, serde_json::to_vec(&r).unwrap()).unwrap();
        };
        write("ok", VolumeState::Published, &["c1"]);
        write("lost", VolumeState::Published, &["c1"]);
        write("stray", VolumeState::Created, &[]);
        write("busy", VolumeState::NodeStage, &["c2"]);
        std::fs::create_dir_all(layout.volume_dir("bad")).unwrap();
        std::fs::write(layout.volume_dir("bad").join(STATE_FILE), b"{").unwrap();
        let table = FakeSyscall::new();
        table.add_mount("x", &layout.target_path("ok"), "ext4");
        table.add_mount("x", &layout.target_path("stray"), "ext4");
        let report = scan(dir.path(), &table).unwrap();
        let by_id = |id: &str| report.volumes.iter().find(|v| v.volume_id == id).unwrap();
        assert_eq!(by_id("ok").disagreement, None);
        assert!(by_id("ok").mounted);
        assert!(by_id("lost")
            .disagreement
            .as_deref()
            .unwrap()
            .contains("nothing is mounted"));
        assert!(by_id("stray")
            .disagreement
            .as_deref()
            .unwrap()
            .contains("CREATED"));
        assert!(by_id("busy")
            .disagreement
            .as_deref()
            .unwrap()
            .contains("interrupted"));
        assert_eq!(report.unreadable.len(), 1);
    }

    /// The report's own writer says what serde_json's pretty printer says, byte for byte:
    /// empty lists, one item, and more items than one writing thread takes.
    #[test]
    fn the_report_is_written_as_serde_json_writes_it() {
        let volume = |i: usize| {
            let mut rec = VolumeRecord::new(format!("v{i}"), Capability::default());
            rec.state = VolumeState::Published;
            rec.users = [format!("c{i}"), "line\nbreak \"quoted\"".to_string()]
                .into_iter()
                .collect();
            rec.parameters = [("k".to_string(), "v\tw".to_string())]
                .into_iter()
                .collect();
            volume_status(
                "t/n".into(),
                PathBuf::from(format!("/m/{i}")),
                true,
                i % 2 == 0,
                rec,
            )
        };
        let unreadable = |i: usize| UnreadableState {
            path: PathBuf::from(format!("/w/v{i}/volume.state")),
            reason: "EIO\n".into(),
        };
        for (volumes, unreadables) in [
            (0, 0),
            (1, 0),
            (0, 1),
            (2, 3),
            (ITEMS_PER_WRITER * 3 + 1, 2),
        ] {
            let report = StatusReport {
                volumes: (0..volumes).map(volume).collect(),
                unreadable: (0..unreadables).map(unreadable).collect(),
            };
            let mut ours = Vec::new();
            report.write_pretty_json(&mut ours).unwrap();
            let theirs = serde_json::to_vec_pretty(&report).unwrap();
            assert!(
                ours == theirs,
                "{volumes} volumes, {unreadables} unreadable: {}",
                String::from_utf8_lossy(&ours[..ours.len().min(400)])
            );
        }
    }

    /// A state file's bytes: volume `id` in `state`.
    fn rec(id: &str, state: VolumeState) -> Vec<u8> {
        let mut r = VolumeRecord::new(id, Capability::default());
        r.state = state;
        serde_json::to_vec(&r).unwrap()
    }

    /// A node's thousands of volume directories are read by several threads: every one is
    /// listed once, in the names' order, with the journal over its file and its set-aside files.
    #[test]
    fn many_volume_directories_are_read_in_parallel_in_order() {
        use crate::durable::journal::{encode, header};
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path(), "t", "n");
        // Lowered so that a few dozen directories take several threads, as thousands do.
        let per_thread = 8;
        let n = 3 * per_thread + 7;
        let id = |i: usize| format!("v{i:05}");
        for i in 0..n {
            let p = layout.state_file(&id(i));
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, rec(&id(i), VolumeState::Created)).unwrap();
        }
        // One set aside (its file gone), one removed and one moved on by the journal, one only
        // the journal knows.
        let aside = layout
            .volume_dir(&id(5))
            .join(format!("{STATE_FILE}.corrupt-1"));
        std::fs::rename(layout.state_file(&id(5)), &aside).unwrap();
        let mut j = header(1);
        let entries = [
            (id(7), None),
            (id(n - 1), Some(rec(&id(n - 1), VolumeState::Published))),
            (id(n + 1), Some(rec(&id(n + 1), VolumeState::NodeReady))),
        ];
        for (seq, (volume_id, state)) in entries.into_iter().enumerate() {
            let e = checkpoint::VolumeEntry { volume_id, state };
            encode(seq as u64 + 1, &e.encode(), &mut j);
        }
        std::fs::write(layout.base().join(checkpoint::JOURNAL_FILE), &j).unwrap();
        let how = ScanOptions {
            use_summary: false,
            dirs_per_thread: per_thread,
        };
        let report = scan_with(dir.path(), &FakeSyscall::new(), how).unwrap();
        let want: Vec<String> = (0..n)
            .filter(|&i| i != 5 && i != 7)
            .map(id)
            .chain([id(n + 1)])
            .collect();
        let got: Vec<&str> = report
            .volumes
            .iter()
            .map(|v| v.volume_id.as_str())
            .collect();
        assert_eq!(got, want);
        let state_of = |i: usize| {
            report
                .volumes
                .iter()
                .find(|v| v.volume_id == id(i))
                .unwrap()
                .state
        };
        assert_eq!(state_of(n - 1), VolumeState::Published);
        assert_eq!(state_of(n + 1), VolumeState::NodeReady);
        assert_eq!(state_of(0), VolumeState::Created);
        assert_eq!(
            report.unreadable,
            [UnreadableState {
                path: aside,
                reason: "set aside as corrupt by an earlier recovery".into()
            }]
        );
    }

    /// The journal's entries win over the state files: a newer state, a volume only the
    /// journal knows, a removal; a torn tail is skipped and left in place.
    #[test]
    fn the_journal_is_overlaid_on_the_state_files() {
        use crate::durable::journal::{encode, header};
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path(), "t", "n");
        for id in ["old", "gone"] {
            let p = layout.state_file(id);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, rec(id, VolumeState::Created)).unwrap();
        }
        let mut j = header(1);
        let entries = [
            checkpoint::VolumeEntry {
                volume_id: "old".into(),
                state: Some(rec("old", VolumeState::Published)),
            },
            checkpoint::VolumeEntry {
                volume_id: "new".into(),
                state: Some(rec("new", VolumeState::NodeReady)),
            },
            checkpoint::VolumeEntry {
                volume_id: "gone".into(),
                state: None,
            },
        ];
        for (n, e) in entries.iter().enumerate() {
            encode(n as u64 + 1, &e.encode(), &mut j);
        }
        j.extend_from_slice(&[7; 9]);
        let jpath = layout.base().join(checkpoint::JOURNAL_FILE);
        std::fs::write(&jpath, &j).unwrap();
        let report = scan(dir.path(), &FakeSyscall::new()).unwrap();
        let states: Vec<_> = report
            .volumes
            .iter()
            .map(|v| (v.volume_id.as_str(), v.state))
            .collect();
        assert_eq!(
            states,
            [
                ("new", VolumeState::NodeReady),
                ("old", VolumeState::Published)
            ]
        );
        assert!(report.unreadable.is_empty(), "{:?}", report.unreadable);
        assert_eq!(std::fs::read(&jpath).unwrap(), j, "status changed nothing");
        // A planted symlink in the journal's place is refused and reported, not followed.
        std::fs::remove_file(&jpath).unwrap();
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &jpath).unwrap();
        let report = scan(dir.path(), &FakeSyscall::new()).unwrap();
        assert_eq!(report.unreadable.len(), 1);
        assert!(report.unreadable[0].reason.contains("symlink"));
    }
}
