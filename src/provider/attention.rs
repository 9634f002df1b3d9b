//! What ensure-all checks: a provider's watch of its published targets and the pure decision of
//! which volumes the next sweep looks at ([`Attention`]), fed by the watch's changes and by mount
//! checks. The I/O is [`StorageProvider::sweep`](crate::provider::StorageProvider)'s.

use std::collections::{BTreeSet, HashMap};

use crate::mount::{MountChanges, MountWatch, RootCheck, WatchMode};

/// A provider's watch of its published targets ([`MountWatch`]) and what it has learnt from it.
#[derive(Debug)]
pub(crate) struct Watched {
    pub(crate) source: Box<dyn MountWatch>,
    pub(crate) attention: std::sync::Mutex<Attention>,
}

impl Watched {
    /// A watch whose first sweep checks every volume in use (nothing is known of them yet).
    pub(crate) fn new(source: Box<dyn MountWatch>) -> Watched {
        let wants_ids = source.mode() == WatchMode::Fanotify;
        Watched {
            source,
            attention: std::sync::Mutex::new(Attention::new(wants_ids)),
        }
    }

    /// How many times the watch has been read: taken before a mount check, handed to
    /// [`learn`](Self::learn) after it.
    pub(crate) fn looks(&self) -> u64 {
        self.attention.lock().unwrap().looks
    }

    /// Whether the watch names mounts by id (so the ids of our targets are worth a statx).
    pub(crate) fn wants_ids(&self) -> bool {
        self.attention.lock().unwrap().wants_ids
    }

    pub(crate) fn learn(&self, volume: &str, check: RootCheck, seen: u64) {
        self.attention.lock().unwrap().learn(volume, check, seen);
    }

    pub(crate) fn mark(&self, volume: &str) {
        self.attention.lock().unwrap().mark(volume);
    }

    /// Reads the watch for a check of every volume in use that the caller makes itself, and
    /// learns from ([`learn`](Self::learn), [`mark`](Self::mark)) as a sweep does: recovery's.
    /// That check is the full sweep owed since the start, and covers whatever the watch said
    /// until now, so what this read says is dropped.
    pub(crate) fn take_for_full_check(&self) {
        let changes = self.source.changes();
        let _covered = self.attention.lock().unwrap().take(changes);
    }
}

/// Which volumes the next sweep is to check. Pure: fed with what the watch said and what mount
/// checks found, it decides; the provider's sweep does the I/O.
#[derive(Debug)]
pub(crate) struct Attention {
    /// Check every volume in use (the watch could not say what changed).
    everything: bool,
    /// Check these.
    volumes: BTreeSet<String>,
    /// Published targets by unique mount id (only when the watch names mounts by id).
    by_mount: HashMap<u64, String>,
    wants_ids: bool,
    /// How many times [`take`](Self::take) has read the watch.
    looks: u64,
}

/// What one sweep checks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ToCheck {
    Everything,
    Volumes(BTreeSet<String>),
}

impl Attention {
    pub(crate) fn new(wants_ids: bool) -> Attention {
        Attention {
            everything: true,
            volumes: BTreeSet::new(),
            by_mount: HashMap::new(),
            wants_ids,
            looks: 0,
        }
    }

    /// What the next sweep checks, given what changed since the last one; the marks are taken (a
    /// sweep marks again what it could not finish).
    pub(crate) fn take(&mut self, changes: MountChanges) -> ToCheck {
        self.looks += 1;
        match changes {
            MountChanges::Nothing => {}
            MountChanges::Unknown => self.everything = true,
            MountChanges::Detached(ids) => {
                for id in ids {
                    // Ids are never reused: a detached one is forgotten.
                    if let Some(volume) = self.by_mount.remove(&id) {
                        self.volumes.insert(volume);
                    }
                }
            }
        }
        if std::mem::take(&mut self.everything) {
            // The full sweep learns every published target's mount again.
            self.by_mount.clear();
            self.volumes.clear();
            ToCheck::Everything
        } else {
            ToCheck::Volumes(std::mem::take(&mut self.volumes))
        }
    }

    /// What a mount check of a published volume's target found, the check having started when the
    /// watch had been read `seen` times. Its id is remembered, unless the watch was read since the
    /// check began (that read may have carried the mount's detach, unrecognized), the id is
    /// unknown or the target is not mounted: then the volume is checked again next time rather
    /// than trusted.
    pub(crate) fn learn(&mut self, volume: &str, check: RootCheck, seen: u64) {
        if !self.wants_ids {
            return;
        }
        match (check.mounted, check.unique_id) {
            (true, Some(id)) if seen == self.looks => {
                self.by_mount.insert(id, volume.to_string());
            }
            _ => self.mark(volume),
        }
    }

    /// The next sweep checks `volume`.
    pub(crate) fn mark(&mut self, volume: &str) {
        if !self.everything {
            self.volumes.insert(volume.to_string());
        }
    }
}
