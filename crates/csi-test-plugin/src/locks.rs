//! Per-key locks (one per volume, one for CreateVolume) that serialize the plugin's work.
//!
//! Contract:
//! - A [`KeyGuard`] is owned (`'static`), so the blocking task that does the work holds it:
//!   the lock is released when the work really ends, not when the RPC handler is dropped
//!   (a client whose deadline expires makes tonic drop the handler while the blocking work
//!   keeps running; a retry must not overlap it).
//! - Locks are taken from async code ([`LockMap::lock`]) or from a blocking thread
//!   ([`LockMap::blocking_lock`]).
//! - The map holds an entry only while someone holds or waits on its lock: every release
//!   (and every abandoned wait) drops the entries nobody references any more.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::OwnedMutexGuard;

type KeyLock = Arc<tokio::sync::Mutex<()>>;

/// The per-key locks of one plugin.
#[derive(Debug, Default)]
pub(crate) struct LockMap {
    map: Mutex<HashMap<String, KeyLock>>,
}

/// A held lock; dropping it releases the lock and prunes the map.
#[derive(Debug)]
pub(crate) struct KeyGuard {
    guard: Option<OwnedMutexGuard<()>>,
    map: Arc<LockMap>,
}

impl Drop for KeyGuard {
    fn drop(&mut self) {
        // Release first, so our own reference no longer counts when pruning.
        drop(self.guard.take());
        self.map.prune();
    }
}

/// Prunes the map when a wait is abandoned (the waiting future dropped).
struct Waiting<'a>(&'a LockMap);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.prune();
    }
}

impl LockMap {
    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<String, KeyLock>> {
        // Every mutation under this lock is a single insert or retain: a poisoned map is
        // still consistent.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn entry(&self, key: &str) -> KeyLock {
        self.entries().entry(key.to_string()).or_default().clone()
    }

    /// Drops every entry referenced only by the map: nobody holds or waits on it. References
    /// are taken under the map's mutex, so an entry cannot gain a waiter while it is checked.
    fn prune(&self) {
        self.entries().retain(|_, lock| Arc::strong_count(lock) > 1);
    }

    /// Waits for the lock of `key`.
    pub(crate) async fn lock(self: &Arc<Self>, key: &str) -> KeyGuard {
        let lock = self.entry(key);
        let waiting = Waiting(self);
        let guard = lock.lock_owned().await;
        drop(waiting);
        KeyGuard {
            guard: Some(guard),
            map: Arc::clone(self),
        }
    }

    /// Takes the lock of `key` from a blocking thread (never from async code).
    pub(crate) fn blocking_lock(self: &Arc<Self>, key: &str) -> KeyGuard {
        let guard = self.entry(key).blocking_lock_owned();
        KeyGuard {
            guard: Some(guard),
            map: Arc::clone(self),
        }
    }

    /// How many keys have an entry.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn entries_live_only_while_held_or_awaited() {
        let locks = Arc::new(LockMap::default());
        let a = locks.lock("a").await;
        let b = locks.lock("b").await;
        assert_eq!(locks.len(), 2);
        // A waiter keeps the entry after the holder releases.
        let waiter = {
            let locks = locks.clone();
            tokio::spawn(async move {
                let _g = locks.lock("a").await;
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(b);
        assert_eq!(locks.len(), 1, "b is free and unreferenced");
        drop(a);
        assert_eq!(locks.len(), 1, "a still has its waiter");
        waiter.await.unwrap();
        assert_eq!(locks.len(), 0);
    }

    #[tokio::test]
    async fn an_abandoned_wait_leaves_no_entry() {
        let locks = Arc::new(LockMap::default());
        let held = locks.lock("a").await;
        let gave_up = tokio::time::timeout(Duration::from_millis(50), locks.lock("a")).await;
        assert!(gave_up.is_err());
        drop(held);
        assert_eq!(locks.len(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_guard_moved_into_blocking_work_holds_the_lock_until_the_work_ends() {
        let locks = Arc::new(LockMap::default());
        let guard = locks.lock("v").await;
        let work = tokio::task::spawn_blocking(move || {
            let _guard = guard;
            std::thread::sleep(Duration::from_millis(200));
        });
        let started = std::time::Instant::now();
        let blocking = {
            let locks = locks.clone();
            tokio::task::spawn_blocking(move || drop(locks.blocking_lock("v")))
        };
        let _again = locks.lock("v").await;
        assert!(started.elapsed() >= Duration::from_millis(150));
        drop(_again);
        blocking.await.unwrap();
        work.await.unwrap();
        assert_eq!(locks.len(), 0);
    }
}
