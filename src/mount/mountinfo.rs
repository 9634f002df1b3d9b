//! Reads of kernel mount state: the [`MountTable`] trait, the `/proc/<pid>/mountinfo` parser and
//! [`ProcMountTable`], which reads the real file.
//!
//! Format (proc(5)): `id parent major:minor root mount_point options [optional fields...] - fstype source
//! super_options`. The kernel escapes space, tab, newline and backslash in root, mount point and source as
//! three-digit octal (`\040`, `\011`, `\012`, `\134`); the parser undoes that.

use std::path::{Path, PathBuf};

use super::MountError;

/// One line of a mountinfo file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountInfo {
    /// Unique id of the mount.
    pub mount_id: u32,
    /// Id of the parent mount (itself for the root of the namespace).
    pub parent_id: u32,
    /// Device major number.
    pub major: u32,
    /// Device minor number.
    pub minor: u32,
    /// The root of the mount inside its file system (e.g. the bound subdirectory).
    pub root: PathBuf,
    /// Where it is mounted, relative to the reading process's root.
    pub mount_point: PathBuf,
    /// Per-mount options (`rw`, `ro`, `nosuid`, ...).
    pub mount_options: Vec<String>,
    /// Optional fields such as `shared:1`, `master:2`, `propagate_from:3`, `unbindable`.
    pub optional_fields: Vec<String>,
    /// File system type (`ext4`, `tmpfs`, ...).
    pub fs_type: String,
    /// File system specific source (a device, or a name like `tmpfs`).
    pub source: String,
    /// Per-superblock options.
    pub super_options: Vec<String>,
}

impl MountInfo {
    /// Whether the mount itself is read-only (`ro` among its per-mount options).
    pub fn is_readonly(&self) -> bool {
        self.mount_options.iter().any(|o| o == "ro")
    }

    /// The peer group id if the mount is shared (`shared:N`).
    pub fn shared_peer_group(&self) -> Option<u32> {
        self.optional_field_value("shared")
    }

    /// The master peer group id if the mount is a slave (`master:N`).
    pub fn master_peer_group(&self) -> Option<u32> {
        self.optional_field_value("master")
    }

    /// Whether the mount is unbindable.
    pub fn is_unbindable(&self) -> bool {
        self.optional_fields.iter().any(|f| f == "unbindable")
    }

    fn optional_field_value(&self, tag: &str) -> Option<u32> {
        self.optional_fields.iter().find_map(|f| {
            let (t, v) = f.split_once(':')?;
            if t == tag {
                v.parse().ok()
            } else {
                None
            }
        })
    }
}

/// Reads of kernel mount state.
pub trait MountTable: Send + Sync + std::fmt::Debug {
    /// All mounts, in table order (parents before children, later mounts over earlier ones).
    fn mounts(&self) -> Result<Vec<MountInfo>, MountError>;

    /// Whether some mount has exactly `path` as its mount point.
    fn is_mount_point(&self, path: &Path) -> Result<bool, MountError> {
        Ok(self.mounts()?.iter().any(|m| m.mount_point == path))
    }

    /// Mounts whose mount point is `prefix` or lies below it (by path components), deepest first; mounts
    /// stacked at the same point come topmost first, so unmounting in this order always works.
    fn mounts_under(&self, prefix: &Path) -> Result<Vec<MountInfo>, MountError> {
        let mut found: Vec<(usize, MountInfo)> = self
            .mounts()?
            .into_iter()
            .filter(|m| m.mount_point.starts_with(prefix))
            .enumerate()
            .collect();
        found.sort_by(|(ia, a), (ib, b)| {
            let da = a.mount_point.components().count();
            let db = b.mount_point.components().count();
            db.cmp(&da).then(ib.cmp(ia))
        });
        Ok(found.into_iter().map(|(_, m)| m).collect())
    }

    /// The topmost mount at `path` (the last one in table order), if any.
    fn find(&self, path: &Path) -> Result<Option<MountInfo>, MountError> {
        Ok(self
            .mounts()?
            .into_iter()
            .rev()
            .find(|m| m.mount_point == path))
    }
}

/// The real mount table of a process, read from `/proc/self/mountinfo` or `/proc/<pid>/mountinfo`.
#[derive(Clone, Debug, Default)]
pub struct ProcMountTable {
    pid: Option<u32>,
}

impl ProcMountTable {
    /// The calling process's table (`/proc/self/mountinfo`).
    pub fn new() -> Self {
        ProcMountTable { pid: None }
    }

    /// The table of process `pid` (`/proc/<pid>/mountinfo`), i.e. of its mount namespace.
    pub fn for_pid(pid: u32) -> Self {
        ProcMountTable { pid: Some(pid) }
    }

    /// The file this table reads.
    pub fn path(&self) -> PathBuf {
        match self.pid {
            Some(pid) => PathBuf::from(format!("/proc/{pid}/mountinfo")),
            None => PathBuf::from("/proc/self/mountinfo"),
        }
    }
}

impl MountTable for ProcMountTable {
    fn mounts(&self) -> Result<Vec<MountInfo>, MountError> {
        let path = self.path();
        let text = std::fs::read_to_string(&path)
            .map_err(|source| MountError::ReadMountInfo { path, source })?;
        parse_mountinfo(&text)
    }
}

/// Parses the text of a mountinfo file. Empty lines are skipped; any malformed line fails the whole parse
/// with [`MountError::ParseMountInfo`] naming that line.
pub fn parse_mountinfo(text: &str) -> Result<Vec<MountInfo>, MountError> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(parse_line)
        .collect()
}

fn parse_line(line: &str) -> Result<MountInfo, MountError> {
    let bad = |reason: String| MountError::ParseMountInfo {
        line: line.to_string(),
        reason,
    };
    let fields: Vec<&str> = line.split(' ').collect();
    if fields.iter().any(|f| f.is_empty()) {
        return Err(bad("empty field (doubled or trailing space)".into()));
    }
    let sep = fields
        .iter()
        .position(|f| *f == "-")
        .ok_or_else(|| bad("no \"-\" separator".into()))?;
    if sep < 6 {
        return Err(bad(format!(
            "{sep} fields before the separator, need at least 6"
        )));
    }
    if fields.len() - sep - 1 != 3 {
        return Err(bad(format!(
            "{} fields after the separator, need 3",
            fields.len() - sep - 1
        )));
    }
    let number = |name: &str, s: &str| -> Result<u32, MountError> {
        s.parse::<u32>()
            .map_err(|e| bad(format!("{name} {s:?}: {e}")))
    };
    let mount_id = number("mount id", fields[0])?;
    let parent_id = number("parent id", fields[1])?;
    let (major, minor) = fields[2]
        .split_once(':')
        .ok_or_else(|| bad(format!("device {:?} is not major:minor", fields[2])))?;
    let major = number("major", major)?;
    let minor = number("minor", minor)?;
    let root = PathBuf::from(unescape(fields[3]).map_err(|r| bad(format!("root: {r}")))?);
    let mount_point =
        PathBuf::from(unescape(fields[4]).map_err(|r| bad(format!("mount point: {r}")))?);
    let list = |s: &str| s.split(',').map(str::to_string).collect::<Vec<_>>();
    Ok(MountInfo {
        mount_id,
        parent_id,
        major,
        minor,
        root,
        mount_point,
        mount_options: list(fields[5]),
        optional_fields: fields[6..sep].iter().map(|s| s.to_string()).collect(),
        fs_type: fields[sep + 1].to_string(),
        source: unescape(fields[sep + 2]).map_err(|r| bad(format!("source: {r}")))?,
        super_options: list(fields[sep + 3]),
    })
}

/// Undoes the kernel's `\ooo` octal escapes (show_mountinfo uses them for " \t\n\\").
fn unescape(s: &str) -> Result<String, String> {
    if !s.contains('\\') {
        return Ok(s.to_string());
    }
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' {
            let digits = bytes
                .get(i + 1..i + 4)
                .filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)))
                .ok_or_else(|| format!("bad escape at byte {i} of {s:?}"))?;
            let value = digits
                .iter()
                .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
            let byte = u8::try_from(value).map_err(|_| format!("escape out of range in {s:?}"))?;
            out.push(byte);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    // Paths are bytes on Linux; keep invalid UTF-8 visible rather than failing the whole table.
    Ok(String::from_utf8_lossy(&out).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_table() {
        struct Case {
            line: &'static str,
            mount_point: &'static str,
            root: &'static str,
            source: &'static str,
            optional: &'static [&'static str],
            readonly: bool,
        }
        let cases = [
            Case {
                line: "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue",
                mount_point: "/mnt2",
                root: "/mnt1",
                source: "/dev/root",
                optional: &["master:1"],
                readonly: false,
            },
            Case {
                line: "22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw",
                mount_point: "/proc",
                root: "/",
                source: "proc",
                optional: &["shared:12"],
                readonly: false,
            },
            Case {
                line: "99 22 8:1 /a\\040b /mnt/with\\040space\\011tab\\012nl\\134bs ro,relatime - ext4 /dev/sd\\040a ro",
                mount_point: "/mnt/with space\ttab\nnl\\bs",
                root: "/a b",
                source: "/dev/sd a",
                optional: &[],
                readonly: true,
            },
            Case {
                line: "100 99 0:50 / /x ro shared:3 master:2 propagate_from:1 unbindable - tmpfs tmpfs rw,size=10k",
                mount_point: "/x",
                root: "/",
                source: "tmpfs",
                optional: &["shared:3", "master:2", "propagate_from:1", "unbindable"],
                readonly: true,
            },
        ];
        for c in &cases {
            let parsed = parse_mountinfo(c.line).unwrap_or_else(|e| panic!("{}: {e}", c.line));
            assert_eq!(parsed.len(), 1);
            let m = &parsed[0];
            assert_eq!(m.mount_point, Path::new(c.mount_point), "{}", c.line);
            assert_eq!(m.root, Path::new(c.root), "{}", c.line);
            assert_eq!(m.source, c.source, "{}", c.line);
            assert_eq!(m.optional_fields, c.optional, "{}", c.line);
            assert_eq!(m.is_readonly(), c.readonly, "{}", c.line);
        }
    }

    #[test]
    fn parses_all_fields() {
        let m = &parse_mountinfo(
            "36 35 98:7 /mnt1 /mnt2 rw,noatime shared:4 master:1 - ext3 /dev/root rw,errors=continue\n",
        )
        .unwrap()[0];
        assert_eq!(
            *m,
            MountInfo {
                mount_id: 36,
                parent_id: 35,
                major: 98,
                minor: 7,
                root: "/mnt1".into(),
                mount_point: "/mnt2".into(),
                mount_options: vec!["rw".into(), "noatime".into()],
                optional_fields: vec!["shared:4".into(), "master:1".into()],
                fs_type: "ext3".into(),
                source: "/dev/root".into(),
                super_options: vec!["rw".into(), "errors=continue".into()],
            }
        );
        assert_eq!(m.shared_peer_group(), Some(4));
        assert_eq!(m.master_peer_group(), Some(1));
        assert!(!m.is_unbindable());
    }

    #[test]
    fn rejects_malformed_lines() {
        let good = "22 1 0:21 / /proc rw - proc proc rw";
        let cases: &[(&str, &str)] = &[
            ("22 1 0:21 / /proc rw proc proc rw", "separator"),
            ("x 1 0:21 / /proc rw - proc proc rw", "mount id"),
            ("22 y 0:21 / /proc rw - proc proc rw", "parent id"),
            ("22 1 021 / /proc rw - proc proc rw", "major:minor"),
            ("22 1 0:z / /proc rw - proc proc rw", "minor"),
            ("22 1 0:21 / rw - proc proc rw", "before the separator"),
            ("22 1 0:21 / /proc rw - proc proc", "after the separator"),
            (
                "22 1 0:21 / /proc rw - proc proc rw extra",
                "after the separator",
            ),
            ("22 1 0:21 / /pr\\04 rw - proc proc rw", "mount point"),
            ("22 1 0:21 /\\999 /proc rw - proc proc rw", "root"),
            ("22 1 0:21 / /proc rw - proc proc\\400 rw", "source"),
            ("22 1 0:21 /  /proc rw - proc proc rw", "empty field"),
        ];
        for (line, reason) in cases {
            let text = format!("{good}\n{line}\n{good}\n");
            match parse_mountinfo(&text) {
                Err(MountError::ParseMountInfo { line: l, reason: r }) => {
                    assert_eq!(l, *line);
                    assert!(r.contains(reason), "{line}: reason {r:?} lacks {reason:?}");
                    let msg = MountError::ParseMountInfo { line: l, reason: r }.to_string();
                    assert!(msg.contains(&format!("{line:?}")), "{msg}");
                }
                other => panic!("{line}: expected ParseMountInfo, got {other:?}"),
            }
        }
    }

    #[test]
    fn skips_blank_lines_and_reads_real_table() {
        assert!(parse_mountinfo("\n\n").unwrap().is_empty());
        let real = ProcMountTable::new().mounts().unwrap();
        assert!(real.iter().any(|m| m.mount_point == Path::new("/")));
        assert!(ProcMountTable::new()
            .is_mount_point(Path::new("/"))
            .unwrap());
        let pid = std::process::id();
        let by_pid = ProcMountTable::for_pid(pid).mounts().unwrap();
        assert_eq!(by_pid.len(), real.len());
    }
}
