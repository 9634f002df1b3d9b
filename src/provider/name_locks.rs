//! Per-name locks (a CreateVolume's name, the snapshot key): one async mutex per name, made on
//! first use and dropped once nobody holds it, so a node that made 10,000 volumes does not keep
//! 10,000 locks (docs/benchmarks.md, "10,000 volumes").

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The fewest entries at which unused locks are looked for.
const PRUNE_FLOOR: usize = 64;

/// The locks by name.
#[derive(Debug, Default)]
pub(crate) struct NameLocks {
    inner: Mutex<Locks>,
}

#[derive(Debug, Default)]
struct Locks {
    by_name: HashMap<String, Arc<tokio::sync::Mutex<()>>>,
    /// The size at which the unused ones are next dropped: twice what was left the last time
    /// (at least [`PRUNE_FLOOR`]), so dropping costs O(1) per call, amortized.
    prune_at: usize,
}

impl NameLocks {
    /// The lock of `name`: the same one for every caller while any caller holds it (a clone is
    /// only ever made here, under the map's mutex, so a lock nobody else holds is unused).
    pub(crate) fn get(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if locks.by_name.len() >= locks.prune_at.max(PRUNE_FLOOR) {
            locks.by_name.retain(|_, lock| Arc::strong_count(lock) > 1);
            locks.by_name.shrink_to_fit();
            locks.prune_at = 2 * locks.by_name.len();
        }
        locks.by_name.entry(name.to_string()).or_default().clone()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().unwrap().by_name.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_has_one_lock_while_it_is_held() {
        let locks = NameLocks::default();
        let held = locks.get("a");
        for i in 0..1000 {
            drop(locks.get(&format!("other-{i}")));
        }
        assert!(
            Arc::ptr_eq(&held, &locks.get("a")),
            "a held lock is never dropped"
        );
        assert!(!Arc::ptr_eq(&locks.get("b"), &locks.get("c")));
    }

    #[test]
    fn unused_locks_are_dropped() {
        let locks = NameLocks::default();
        let held: Vec<_> = (0..10).map(|i| locks.get(&format!("held-{i}"))).collect();
        for i in 0..10_000 {
            drop(locks.get(&format!("v-{i}")));
        }
        assert!(locks.len() <= 2 * PRUNE_FLOOR, "{} locks kept", locks.len());
        for (i, h) in held.iter().enumerate() {
            assert!(Arc::ptr_eq(h, &locks.get(&format!("held-{i}"))));
        }
    }
}
