//! Scaffolding for recorded runs in the power-loss tests (`tests/power_loss.rs`): what is on disk
//! outside the seam, the stand-in for loop images, the order checks on the image's durability,
//! and a deterministic sample of crash states when a run has too many to recover each.
//!
//! The model ([`crate::powerloss`]) replays the recorded metadata operations; two things are
//! outside it and are handled here, each said plainly:
//! - entries that no recorded operation makes (the work dir's own directories, made at startup,
//!   the plugin's log, lock files): added to the base tree as durable from the start, since
//!   each is made again at startup when missing ([`with_unrecorded`]);
//! - the bytes of a loop volume's image (megabytes of mkfs output, not recorded): where the
//!   model keeps the image's name, a formatted image stands in for its bytes
//!   ([`stand_in_images`]); that the image was fsynced before the record that names it was
//!   promised is checked on the log itself ([`images_synced_before_their_record`]).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::powerloss::{check_promises, CrashState, Lost, Node, Op, Tree};

/// The file names of the bundled plugin's images (ext4 and raw block).
pub const IMAGE_NAMES: [&str; 2] = ["image.ext4", "image.raw"];

/// The file name of the bundled plugin's volume record.
pub const PLUGIN_RECORD: &str = "volume.json";

fn is_image(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|n| IMAGE_NAMES.iter().any(|i| n == *i))
}

/// The entries of `fin` that no recorded operation makes, added to `base` as if they had been
/// there, durable, from the start (a directory under one a recorded mkdir or rename made is
/// not: the model decides whether it is there).
pub fn with_unrecorded(mut base: Tree, fin: &Tree, ops: &[Op]) -> Tree {
    let made: Vec<&Path> = ops
        .iter()
        .filter_map(|op| match op {
            Op::Mkdir { path } => Some(path.as_path()),
            Op::Rename { to, .. } => Some(to.as_path()),
            _ => None,
        })
        .collect();
    let named = |p: &Path| ops.iter().any(|op| op.paths().contains(&p));
    for (path, node) in fin {
        let unrecorded = match node {
            Node::Dir(_) => !made.iter().any(|m| path.starts_with(m)),
            Node::File(..) => !named(path) && !made.iter().any(|m| path.starts_with(m)),
        };
        if unrecorded {
            base.entry(path.clone()).or_insert_with(|| node.clone());
        }
    }
    base
}

/// The loop images a run left (to copy as stand-ins).
pub fn images_in(tree: &Tree) -> Vec<PathBuf> {
    tree.keys().filter(|p| is_image(p)).cloned().collect()
}

/// Copies `image` (sparse) to `to`.
pub fn copy_sparse(image: &Path, to: &Path) {
    let out = Command::new("cp")
        .arg("--sparse=always")
        .arg(image)
        .arg(to)
        .output()
        .expect("run cp");
    assert!(
        out.status.success(),
        "copy {} to {}: {}",
        image.display(),
        to.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// In a materialized crash state: every image whose name survived gets the bytes of the
/// formatted image `good` (the model holds its name and mode, not its bytes). Returns how many.
pub fn stand_in_images(state: &CrashState, good: &Path) -> usize {
    let mut n = 0;
    for path in state.tree.keys().filter(|p| is_image(p)) {
        std::fs::remove_file(path).unwrap_or_else(|e| panic!("replace {}: {e}", path.display()));
        copy_sparse(good, path);
        n += 1;
    }
    n
}

/// Checks on the log that every image created was fsynced, and its directory synced, after
/// its create and before the plugin's record in that directory was promised: so where the
/// record survives a power cut, the image survives whole (what [`stand_in_images`] assumes).
/// Returns how many images were checked.
pub fn images_synced_before_their_record(ops: &[Op]) -> Result<usize, String> {
    let mut checked = 0;
    for (i, op) in ops.iter().enumerate() {
        let Op::Create { path, .. } = op else {
            continue;
        };
        if !is_image(path) {
            continue;
        }
        let dir = path.parent().expect("an image has a directory");
        let record = dir.join(PLUGIN_RECORD);
        let promised = ops[i..]
            .iter()
            .position(|op| {
                matches!(op, Op::Promised(crate::powerloss::Promise::Written { path: p, .. }) if *p == record)
            })
            .map(|j| i + j);
        let Some(promised) = promised else {
            // A create that failed before its record: nothing names the image.
            continue;
        };
        let between = &ops[i..promised];
        let synced = between
            .iter()
            .position(|op| matches!(op, Op::Fsync { path: p } if p == path));
        let Some(synced) = synced else {
            return Err(format!(
                "image {} is named by the record promised at op {promised} without an fsync of the image",
                path.display()
            ));
        };
        if !between[synced..]
            .iter()
            .any(|op| matches!(op, Op::FsyncDir { path: p } if p == dir))
        {
            return Err(format!(
                "image {}: its directory is not synced between the image's fsync and the record's promise (op {promised})",
                path.display()
            ));
        }
        checked += 1;
    }
    Ok(checked)
}

/// [`check_promises`], except for a promise a later operation of the prefix undid through a
/// directory above it: the rename of an ancestor (the plugin's delete renames a volume's or a
/// snapshot's whole directory to a tombstone) or its rmdir. The model's checker allows only a
/// later operation on the promised path itself; until it learns ancestors (a request to its
/// owner), this is where that rule lives.
pub fn promises_kept(ops: &[Op], state: &CrashState) -> Vec<Lost> {
    let prefix = &ops[..state.point];
    check_promises(ops, state)
        .into_iter()
        .filter(|lost| {
            let path = Op::Promised(lost.promise.clone()).paths()[0].to_path_buf();
            let last = prefix
                .iter()
                .rposition(|op| matches!(op, Op::Promised(_)) && op.paths()[0] == path)
                .unwrap_or(0);
            !prefix[last..].iter().any(|op| match op {
                Op::Rename { from, .. } | Op::Rmdir { path: from } => {
                    *from != path && path.starts_with(from)
                }
                _ => false,
            })
        })
        .collect()
}

/// At most `max` of `states`, deterministically: evenly spaced over the run, the first and last
/// always in (the states are in order of the cut, so every part of the run is sampled).
pub fn sample_states(states: Vec<CrashState>, max: usize) -> Vec<CrashState> {
    let n = states.len();
    if n <= max || max < 2 {
        return states;
    }
    let keep: std::collections::BTreeSet<usize> =
        (0..max).map(|i| i * (n - 1) / (max - 1)).collect();
    states
        .into_iter()
        .enumerate()
        .filter(|(i, _)| keep.contains(i))
        .map(|(_, s)| s)
        .collect()
}

/// The index in `ops` of the first promise at a path for which `pred` holds.
pub fn first_promise(ops: &[Op], pred: impl Fn(&Path) -> bool) -> Option<usize> {
    ops.iter()
        .position(|op| matches!(op, Op::Promised(_)) && op.paths().first().is_some_and(|p| pred(p)))
}

/// The index in `ops` of the last promise at a path for which `pred` holds.
pub fn last_promise(ops: &[Op], pred: impl Fn(&Path) -> bool) -> Option<usize> {
    ops.iter().rposition(|op| {
        matches!(op, Op::Promised(_)) && op.paths().first().is_some_and(|p| pred(p))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::powerloss::Promise;

    fn p(s: &str) -> PathBuf {
        PathBuf::from(s)
    }

    fn image_run(fsync: bool, sync_dir: bool) -> Vec<Op> {
        let mut ops = vec![
            Op::Mkdir { path: p("/w/v") },
            Op::FsyncDir { path: p("/w") },
            Op::Create {
                path: p("/w/v/image.ext4"),
                mode: 0o600,
            },
        ];
        if fsync {
            ops.push(Op::Fsync {
                path: p("/w/v/image.ext4"),
            });
        }
        if sync_dir {
            ops.push(Op::FsyncDir { path: p("/w/v") });
        }
        ops.push(Op::Promised(Promise::Written {
            path: p("/w/v/volume.json"),
            bytes: b"{}".to_vec(),
        }));
        ops
    }

    #[test]
    fn an_image_not_synced_before_its_record_is_reported() {
        assert_eq!(
            images_synced_before_their_record(&image_run(true, true)),
            Ok(1)
        );
        let err = images_synced_before_their_record(&image_run(false, true)).unwrap_err();
        assert!(err.contains("without an fsync of the image"), "{err}");
        let err = images_synced_before_their_record(&image_run(true, false)).unwrap_err();
        assert!(err.contains("directory is not synced"), "{err}");
    }

    /// A record whose directory was renamed to a tombstone afterwards may be gone; one whose
    /// directory was not touched may not.
    #[test]
    fn a_promise_undone_by_renaming_its_directory_is_not_lost() {
        let record = p("/w/v/volume.json");
        let promise = Op::Promised(Promise::Written {
            path: record.clone(),
            bytes: b"{}".to_vec(),
        });
        let state = |point| CrashState {
            point,
            tree: [(p("/w"), Node::Dir(0o700))].into_iter().collect(),
        };
        let renamed = vec![
            promise.clone(),
            Op::Rename {
                from: p("/w/v"),
                to: p("/w/.deleted-v"),
            },
        ];
        assert_eq!(check_promises(&renamed, &state(2)).len(), 1);
        assert!(promises_kept(&renamed, &state(2)).is_empty());
        let untouched = vec![
            promise,
            Op::Rename {
                from: p("/w/other"),
                to: p("/w/.deleted-other"),
            },
        ];
        assert_eq!(promises_kept(&untouched, &state(2)).len(), 1);
    }

    #[test]
    fn a_sample_is_bounded_spread_and_keeps_both_ends() {
        let states: Vec<CrashState> = (0..100)
            .map(|point| CrashState {
                point,
                tree: Tree::new(),
            })
            .collect();
        let s = sample_states(states.clone(), 10);
        assert_eq!(s.len(), 10);
        assert_eq!(s[0].point, 0);
        assert_eq!(s[9].point, 99);
        assert!(s.windows(2).all(|w| w[1].point - w[0].point <= 11));
        assert_eq!(sample_states(states, 200).len(), 100);
    }
}
