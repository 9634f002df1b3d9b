//! Looking at what a test's work dir holds: the files and directories below a root, found by
//! name (a volume's checkpoint, the plugin's image of it, its socket), whether a path is a
//! mount point, and a payload of a given size written into a volume.

use std::io::Write;
use std::path::{Path, PathBuf};

use csi_isolator::mount::{MountTable, ProcMountTable};

/// Every entry below `root` (not `root` itself), depth first; directories are entered, links
/// are not followed, and a directory that cannot be read (gone meanwhile) is passed over.
pub fn entries_below(root: &Path) -> Vec<std::fs::DirEntry> {
    let mut found = Vec::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let t = e
                .file_type()
                .unwrap_or_else(|err| panic!("file type of {}: {err}", e.path().display()));
            if t.is_dir() {
                todo.push(e.path());
            }
            found.push(e);
        }
    }
    found
}

/// Every file (anything but a directory) named `name` below `root`.
pub fn files_named(root: &Path, name: &str) -> Vec<PathBuf> {
    entries_below(root)
        .into_iter()
        .filter(|e| e.file_name() == name && !e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect()
}

/// The one file or directory named `name` below `root`, deeper than `root/name` (the plugin
/// keeps a volume's image or data in a directory of its own); panics when there is none.
pub fn find_below(root: &Path, name: &str) -> PathBuf {
    entries_below(root)
        .into_iter()
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n == name) && *p != root.join(name))
        .unwrap_or_else(|| panic!("no {name} below {}", root.display()))
}

/// Whether `path` is a mount point in this process's mount table.
pub fn is_mounted(path: &Path) -> bool {
    ProcMountTable::new()
        .is_mount_point(path)
        .unwrap_or_else(|e| panic!("read the mount table for {}: {e}", path.display()))
}

/// Writes `mib` MiB (a repeated byte) to `dir/payload` and syncs it.
pub fn write_mib(dir: &Path, mib: u64) {
    let path = dir.join("payload");
    let mut f =
        std::fs::File::create(&path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    let chunk = vec![0x5au8; 1 << 20];
    for _ in 0..mib {
        f.write_all(&chunk)
            .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }
    f.sync_all()
        .unwrap_or_else(|e| panic!("sync {}: {e}", path.display()));
}
