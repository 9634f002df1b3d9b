//! Publishing volumes for containers and releasing them.
//!
//! A container becomes a user of a volume durably *before* the volume is
//! published, so a crash mid-publish leaves a user that recovery honours;
//! the user is removed durably before the last-use unpublish starts.
//! Publishing for a container re-ensures every volume of this provider that
//! a live container uses (ensure-all), repairing any found unpublished.
//!
//! Ensure-all costs O(volumes that may need work), not O(volumes in use): a launch checks only the
//! volumes in its [`Attention`](crate::provider::attention::Attention) — those whose mount the kernel reported detached ([`MountWatch`](crate::mount::MountWatch):
//! the provider remembers each published target's unique mount id), and those the provider's own
//! operations left short of PUBLISHED with users (a failed publish or repair, a volume busy
//! during a sweep). A watch that cannot say what changed (an overflow, the mountinfo poll seeing
//! any change, no watch at all, the first sweep after a start) makes the sweep check every volume
//! in use, as it always did.
//!
//! Recovery re-ensures every container of a node at once: its publishes leave the checks of the
//! volumes already published to one batch for all of them ([`MountCheck::Batched`],
//! [`StorageProvider::ensure_listed`]), a few trips to the blocking pool, not one per container.

use std::collections::{BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;

use crate::error_chain::Chain;
use crate::mount::WatchMode;
use crate::offload::blocking_each;
use crate::provider::access::{self, Access};
use crate::provider::attention::ToCheck;
use crate::provider::error::ProviderError;
use crate::provider::mount_group;
use crate::provider::recover::{recovery_action, settle_goal, Action};
use crate::provider::state::{AccessType, VolumeRecord, VolumeState};
use crate::provider::storage::{Slot, StorageProvider, UnpublishPolicy};
use crate::provider::topology;

impl StorageProvider {
    /// Publishes one volume for `container_id` and returns its host mount
    /// point. Idempotent for the same container.
    #[tracing::instrument(skip(self))]
    pub async fn publish(
        &self,
        volume_id: &str,
        container_id: &str,
    ) -> Result<PathBuf, ProviderError> {
        self.publish_use(volume_id, container_id)
            .await
            .map(|(p, _)| p)
    }

    /// [`publish`](Self::publish), also saying whether the container became
    /// a user now (rollbacks must only undo uses they added). The use's access is what the
    /// volume allows ([`publish_use_as`](Self::publish_use_as) with `None`).
    pub(crate) async fn publish_use(
        &self,
        volume_id: &str,
        container_id: &str,
    ) -> Result<(PathBuf, bool), ProviderError> {
        self.publish_use_as(volume_id, container_id, None).await
    }

    /// Publishes one volume for `container_id`, whose use reads or writes as `access` says
    /// (`None`, for a caller that cannot tell, such as Docker's Mount: reading for a volume of a
    /// reader-only access mode, writing otherwise). A new use, or a reading use that now
    /// writes, is first checked against the volume's access mode ([`access::admit`]) and
    /// refused before anything is recorded or sent. Also says whether the container became a
    /// user now (rollbacks must only undo uses they added).
    pub async fn publish_use_as(
        &self,
        volume_id: &str,
        container_id: &str,
        access: Option<Access>,
    ) -> Result<(PathBuf, bool), ProviderError> {
        let asked = VolumeUse {
            volume_id: volume_id.to_string(),
            access,
            mount_group: None,
        };
        self.publish_one(&asked, container_id)
            .await
            .map(|o| (o.mount_point, o.added))
    }

    /// [`publish_use_as`](Self::publish_use_as) for one [`VolumeUse`], its group included: a
    /// publish that brings the volume onto the node stages it with that group when the plugin
    /// takes one ([`mount_group::group_after`]); the group is recorded with the first intent.
    pub async fn publish_one(
        &self,
        asked: &VolumeUse,
        container_id: &str,
    ) -> Result<UseOutcome, ProviderError> {
        self.publish_one_checked(asked, container_id, MountCheck::Now)
            .await
    }

    /// [`publish_one`](Self::publish_one), a volume at rest at PUBLISHED checked as `check` says.
    async fn publish_one_checked(
        &self,
        asked: &VolumeUse,
        container_id: &str,
        check: MountCheck,
    ) -> Result<UseOutcome, ProviderError> {
        let (volume_id, access) = (asked.volume_id.as_str(), asked.access);
        let slot = self.slot(volume_id)?;
        let mut rec = slot.record.lock().await;
        if rec.destroying {
            return Err(ProviderError::Destroying {
                volume: volume_id.to_string(),
            });
        }
        if !rec.accessible_topology.is_empty() {
            let node = self.node_info().await?;
            if !topology::accessible_from(&rec.accessible_topology, &node.topology) {
                return Err(ProviderError::NotAccessible {
                    volume: volume_id.to_string(),
                    accessible: topology::describe(&rec.accessible_topology),
                    node: topology::describe(std::slice::from_ref(&node.topology)),
                });
            }
        }
        let access = access.unwrap_or(if rec.capability.is_reader_only() {
            Access::Read
        } else {
            Access::Write
        });
        let was_user = rec.users.contains(container_id);
        let was_reader = rec.readers.contains(container_id);
        // A use that wrote keeps writing (a container's other binds of the volume may).
        let reads = !access.writes() && (!was_user || was_reader);
        if !was_user || (was_reader && !reads) {
            let asked = if reads { Access::Read } else { Access::Write };
            access::admit(rec.capability.mode(), rec.uses(), container_id, asked).map_err(
                |refusal| ProviderError::AccessModeRefused {
                    volume: volume_id.to_string(),
                    mode: crate::shown::shown(&rec.capability.access_mode).into_owned(),
                    container: crate::shown::shown(container_id).into_owned(),
                    why: refusal.explain(),
                },
            )?;
        }
        self.choose_mount_group(&mut rec, container_id, asked.mount_group);
        // The new user becomes durable with the first transition's intent,
        // before any RPC (or on its own when there is nothing to do).
        let added = rec.users.insert(container_id.to_string());
        let reader_changed = if reads {
            rec.readers.insert(container_id.to_string())
        } else {
            rec.readers.remove(container_id)
        };
        let ensured = if check == MountCheck::Batched && rec.rests_at(VolumeState::Published) {
            Ok(false)
        } else {
            self.ensure_published(&mut rec).await
        };
        let outcome = match ensured {
            Ok(false) if added || reader_changed => self.persist(&rec).await,
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        };
        let result = match outcome {
            Ok(()) => Ok(UseOutcome {
                mount_point: self.mount_point(volume_id),
                added,
                mount_group: rec.mount_group,
            }),
            Err(e) => {
                if added {
                    // Leave nothing half-done: drop the use we just added and,
                    // when it was the only one, take the volume back down.
                    rec.remove_user(container_id);
                    let undo = match self.settle_unused(&mut rec).await {
                        Ok(false) => self.persist(&rec).await,
                        Ok(true) => Ok(()),
                        Err(undo) => Err(undo),
                    };
                    if let Err(undo) = undo {
                        tracing::error!(volume_id, error = %Chain(&undo), "rollback after failed publish failed");
                    }
                } else if reader_changed && was_reader {
                    // The use goes back to reading; persisted with the next change.
                    rec.readers.insert(container_id.to_string());
                }
                Err(e)
            }
        };
        slot.sync_users(&rec);
        result
    }

    /// Sets the group the volume is to be staged and published with, before the publish that
    /// needs it ([`mount_group::group_after`]); a group it cannot have now is logged.
    fn choose_mount_group(&self, rec: &mut VolumeRecord, container_id: &str, asked: Option<u32>) {
        let offered = self.capabilities().node.volume_mount_group()
            && rec.capability.access_type == AccessType::Mount;
        let on_node = rec.state.is_node_side();
        let others_use_it = rec.users.iter().any(|u| u != container_id);
        let group =
            mount_group::group_after(rec.mount_group, on_node, others_use_it, offered, asked);
        if let Some(wanted) = asked.filter(|_| offered && group != asked) {
            tracing::warn!(volume_id = %rec.volume_id, container_id, wanted, staged_with = ?group,
                "the volume stays as it was staged for its other users: the container's group gets no access from the plugin");
        }
        rec.mount_group = group;
    }

    /// Ends `container_id`'s use of a volume; under the last-use policy the
    /// last release unpublishes it. Releasing a volume the container does not
    /// use is a no-op, except that an unused volume left mid-way by an
    /// earlier failed release is settled again.
    #[tracing::instrument(skip(self))]
    pub async fn release(&self, volume_id: &str, container_id: &str) -> Result<(), ProviderError> {
        let slot = match self.slot(volume_id) {
            Ok(s) => s,
            Err(ProviderError::UnknownVolume { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        let mut rec = slot.record.lock().await;
        let removed = rec.remove_user(container_id);
        if removed && rec.users.is_empty() && !self.config.unpublish_delay.is_zero() {
            *slot.idle_since.lock().unwrap() = Some(Instant::now());
        }
        let due = self.settle_due(&slot, &rec);
        if !removed && !due {
            return Ok(());
        }
        // The removal becomes durable with the first unpublish intent (or on
        // its own when the volume stays published, or waits for the delay).
        let settled = if due {
            self.settle_unused(&mut rec).await
        } else {
            Ok(false)
        };
        let result = match settled {
            Ok(false) if removed => self.persist(&rec).await,
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        };
        slot.sync_users(&rec);
        result
    }

    /// Whether an unused volume is not where the policy wants it (an
    /// interrupted or failed unpublish).
    fn needs_settling(&self, rec: &VolumeRecord) -> bool {
        rec.users.is_empty()
            && !rec.destroying
            && (!rec.state.is_steady()
                || (self.config.policy == UnpublishPolicy::LastUse
                    && rec.state != VolumeState::Created))
    }

    /// Whether an unused volume is to be settled now: it needs it, and it is not waiting out
    /// the unpublish delay since its last user left ([`idle_wait`]). An interrupted step is
    /// never left waiting.
    fn settle_due(&self, slot: &Slot, rec: &VolumeRecord) -> bool {
        self.needs_settling(rec)
            && !(rec.state.is_steady()
                && idle_wait(
                    *slot.idle_since.lock().unwrap(),
                    self.config.unpublish_delay,
                    Instant::now(),
                )
                .is_some())
    }

    /// Settles every unused volume that a failed release left mid-way, or whose unpublish
    /// delay has passed (skipping volumes with an operation in flight). Failures are logged.
    /// With an unpublish delay, call it periodically (docker-plugin does, every second).
    pub async fn settle_idle(&self) {
        let slots: Vec<Arc<Slot>> = self.slots.lock().unwrap().values().cloned().collect();
        for slot in slots {
            let Ok(mut rec) = slot.record.try_lock() else {
                continue;
            };
            if self.settle_due(&slot, &rec) {
                if let Err(e) = self.settle_unused(&mut rec).await {
                    tracing::warn!(volume_id = %rec.volume_id, error = %Chain(&e), "cannot settle an unused volume yet");
                }
            }
        }
    }

    /// Publishes a container's volumes concurrently, then re-ensures every
    /// other volume in use. Returns each mount point and whether the use is
    /// new. On failure the uses added here are released again (uses the
    /// container had before are kept) and the first error is returned.
    pub async fn publish_for_container(
        &self,
        container_id: &str,
        volume_ids: &[String],
    ) -> Result<Vec<(PathBuf, bool)>, ProviderError> {
        let uses: Vec<VolumeUse> = volume_ids
            .iter()
            .map(|id| VolumeUse {
                volume_id: id.clone(),
                access: None,
                mount_group: None,
            })
            .collect();
        let published = self.publish_uses(container_id, &uses).await?;
        Ok(published
            .into_iter()
            .map(|o| (o.mount_point, o.added))
            .collect())
    }

    /// [`publish_for_container`](Self::publish_for_container), each volume with the access and
    /// group of the container's use ([`publish_one`](Self::publish_one)).
    pub async fn publish_uses(
        &self,
        container_id: &str,
        uses: &[VolumeUse],
    ) -> Result<Vec<UseOutcome>, ProviderError> {
        self.publish_uses_checked(container_id, uses, MountCheck::Now)
            .await
    }

    /// [`publish_uses`](Self::publish_uses), its volumes at rest at PUBLISHED checked as `check`
    /// says; with [`MountCheck::Batched`], ensure-all is the caller's too.
    pub(crate) async fn publish_uses_checked(
        &self,
        container_id: &str,
        uses: &[VolumeUse],
        check: MountCheck,
    ) -> Result<Vec<UseOutcome>, ProviderError> {
        let volume_ids: Vec<String> = uses.iter().map(|u| u.volume_id.clone()).collect();
        let results = join_all(
            uses.iter()
                .map(|u| self.publish_one_checked(u, container_id, check)),
        )
        .await;
        if let Some(pos) = results.iter().position(|r| r.is_err()) {
            let added: Vec<&String> = volume_ids
                .iter()
                .zip(&results)
                .filter(|(_, r)| matches!(r, Ok(o) if o.added))
                .map(|(id, _)| id)
                .collect();
            join_all(added.iter().map(|id| self.release(id, container_id))).await;
            let mut results = results;
            return Err(results.swap_remove(pos).unwrap_err());
        }
        if check == MountCheck::Now {
            let skip: HashSet<&str> = volume_ids.iter().map(String::as_str).collect();
            self.ensure_in_use(&skip).await;
        }
        Ok(results.into_iter().map(Result::unwrap).collect())
    }

    /// Releases every volume of this provider that `container_id` uses, then
    /// retries any unused volume a failed release left mid-way.
    pub async fn release_container(&self, container_id: &str) -> Result<(), ProviderError> {
        let ids: Vec<String> = self
            .slots
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, s)| s.has_user(container_id))
            .map(|(id, _)| id.clone())
            .collect();
        let results = join_all(ids.iter().map(|id| self.release(id, container_id))).await;
        self.settle_idle().await;
        results
            .into_iter()
            .collect::<Result<Vec<()>, _>>()
            .map(|_| ())
    }

    /// Ensure-all: every volume with users is published and really mounted;
    /// one found otherwise is repaired. Failures are logged (they belong to
    /// other containers' volumes) and returned as (volume id, error).
    pub async fn ensure_in_use(&self, skip: &HashSet<&str>) -> Vec<(String, ProviderError)> {
        // One sweep at a time: a publish arriving during a sweep relies on it.
        use std::sync::atomic::Ordering;
        if self
            .sweeping
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Vec::new();
        }
        // Reset even when the caller drops this future mid-sweep.
        struct Reset<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Reset<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _reset = Reset(&self.sweeping);
        self.sweep(skip).await
    }

    async fn sweep(&self, skip: &HashSet<&str>) -> Vec<(String, ProviderError)> {
        let changes = self.watched.source.changes();
        let to_check = self.watched.attention.lock().unwrap().take(changes);
        let slots: Vec<(String, Arc<Slot>)> = {
            let all = self.slots.lock().unwrap();
            match &to_check {
                ToCheck::Everything => all.iter().map(|(id, s)| (id.clone(), s.clone())).collect(),
                ToCheck::Volumes(ids) => ids
                    .iter()
                    .filter_map(|id| Some((id.clone(), all.get(id)?.clone())))
                    .collect(),
            }
        };
        if slots.is_empty() {
            return Vec::new();
        }
        // A volume with an operation in flight is left to it: that operation ends in a
        // consistent state, and waiting for it would serialize every launch behind every other.
        // It stays marked, so a later launch looks at it again; so does one this launch skips
        // (the launch's own volumes, just checked by their publish: marked, since a full sweep
        // forgets every mount it knew).
        let mut held = Vec::new();
        for (id, slot) in &slots {
            let locked = (!skip.contains(id.as_str()))
                .then(|| slot.record.try_lock().ok())
                .flatten();
            match locked {
                Some(rec) if recovery_action(&rec, self.config.policy) == Action::Republish => {
                    held.push((id.as_str(), rec))
                }
                Some(_) => {}
                None => self.watched.mark(id),
            }
        }
        self.ensure_held(&mut held).await
    }

    /// How this provider learns of its volumes unmounted behind its back (for `status` and the logs).
    pub fn mount_watch_mode(&self) -> WatchMode {
        self.watched.source.mode()
    }

    /// Drives a volume to PUBLISHED and checks the mount table: a volume
    /// recorded as published whose target is not mounted is re-staged and
    /// re-published (both idempotent).
    pub(crate) async fn ensure_published(
        &self,
        rec: &mut VolumeRecord,
    ) -> Result<bool, ProviderError> {
        self.ensure_published_all(&mut [rec])
            .await
            .pop()
            .expect("one result per record")
    }

    /// [`ensure_published`](Self::ensure_published) of many records the caller holds: whether
    /// each target recorded as published is still mounted is asked in a few trips to the
    /// blocking pool for all of them (one statx each, [`blocking_each`]); then only those not at
    /// rest at PUBLISHED (found unmounted, or short of it) are driven, concurrently. The watch
    /// learns each mount found or made; one left short of PUBLISHED is marked for the next
    /// sweep. Answers each record's result (whether it wrote its checkpoint), in order.
    pub(crate) async fn ensure_published_all(
        &self,
        recs: &mut [&mut VolumeRecord],
    ) -> Vec<Result<bool, ProviderError>> {
        let seen = self.watched.looks();
        let targets: Vec<(usize, PathBuf)> = recs
            .iter()
            .enumerate()
            .filter(|(_, rec)| rec.state == VolumeState::Published)
            .map(|(i, rec)| (i, self.mount_point(&rec.volume_id)))
            .collect();
        // One statx each, not a read of the whole table (which grows with every mount on the
        // node). An unreadable answer repairs nothing on a guess.
        let table = self.table.clone();
        let checked = blocking_each(targets, move |(i, target)| {
            let mounted = table.check_mount_root(&target);
            (i, target, mounted)
        })
        .await;
        for (i, target, mounted) in checked {
            let rec = &mut *recs[i];
            // Not mounted: the repair that follows learns the new mount.
            match &mounted {
                Ok(check) if check.mounted => self.watched.learn(&rec.volume_id, *check, seen),
                Ok(_) => {}
                // Cannot be told: the next sweep checks it again.
                Err(_) => self.watched.mark(&rec.volume_id),
            }
            note_mount_check(rec, &target, mounted.map(|c| c.mounted));
        }
        // Only what needs work gets a future: with a thousand volumes in use, a thousand
        // futures of `drive` (kilobytes each) for nothing cost more than the checks themselves.
        let mut results: Vec<Result<bool, ProviderError>> =
            recs.iter().map(|_| Ok(false)).collect();
        let to_drive = recs
            .iter_mut()
            .enumerate()
            .filter(|(_, rec)| !rec.rests_at(VolumeState::Published));
        let driven = join_all(to_drive.map(|(i, rec)| async move {
            let driven = self.drive(rec, VolumeState::Published).await;
            match &driven {
                // Published now: NodePublish's step told the watch its new mount (`call`).
                Ok(_) => {}
                // Left short of PUBLISHED while in use: the next launch retries it.
                Err(_) => self.watched.mark(&rec.volume_id),
            }
            (i, driven)
        }))
        .await;
        for (i, result) in driven {
            results[i] = result;
        }
        results
    }

    /// [`ensure_published_all`](Self::ensure_published_all) of records held with their ids;
    /// the failures, logged (they may belong to other containers' volumes), as (volume id, error).
    async fn ensure_held(
        &self,
        held: &mut [(&str, tokio::sync::MutexGuard<'_, VolumeRecord>)],
    ) -> Vec<(String, ProviderError)> {
        let results = {
            let mut recs: Vec<&mut VolumeRecord> =
                held.iter_mut().map(|(_, rec)| &mut **rec).collect();
            self.ensure_published_all(&mut recs).await
        };
        let failures: Vec<(String, ProviderError)> = held
            .iter()
            .zip(results)
            .filter_map(|((id, _), result)| Some((id.to_string(), result.err()?)))
            .collect();
        for (id, e) in &failures {
            tracing::error!(volume_id = %id, error = %Chain(e), "cannot re-ensure a volume in use");
        }
        failures
    }

    /// Ensure-all after publishes that left their mount checks to the caller
    /// ([`MountCheck::Batched`]): each volume of `ids` in use is checked and repaired
    /// ([`ensure_published_all`](Self::ensure_published_all)), after any operation in flight on
    /// it, then every other volume in use as a launch's ensure-all checks them. Failures are
    /// logged and returned as (volume id, error).
    pub(crate) async fn ensure_listed(
        &self,
        ids: &BTreeSet<String>,
    ) -> Vec<(String, ProviderError)> {
        let slots: Vec<(&str, Arc<Slot>)> = {
            let all = self.slots.lock().unwrap();
            ids.iter()
                .filter_map(|id| Some((id.as_str(), all.get(id)?.clone())))
                .collect()
        };
        let mut failures = {
            // Taken in id order (`ids` is sorted), and nothing else waits for one volume while
            // it holds another (the sweep only tries its locks): holding many cannot deadlock.
            let mut held = Vec::new();
            for (id, slot) in &slots {
                let rec = slot.record.lock().await;
                if recovery_action(&rec, self.config.policy) == Action::Republish {
                    held.push((*id, rec));
                }
            }
            self.ensure_held(&mut held).await
        };
        let skip: HashSet<&str> = ids.iter().map(String::as_str).collect();
        failures.extend(self.ensure_in_use(&skip).await);
        failures
    }

    /// After the last user left: unpublish under last-use, keep otherwise
    /// (but never leave an interrupted step behind).
    pub(crate) async fn settle_unused(
        &self,
        rec: &mut VolumeRecord,
    ) -> Result<bool, ProviderError> {
        if !rec.users.is_empty() {
            return Ok(false);
        }
        match settle_goal(rec.state, rec.towards, self.config.policy) {
            Some(goal) => self.drive(rec, goal).await,
            None => Ok(false),
        }
    }
}

/// When a publish checks that a volume recorded as published (at rest at PUBLISHED) is still
/// mounted. A volume short of PUBLISHED is driven there at once either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MountCheck {
    /// At once (one statx), then ensure-all of the provider's other volumes in use: a launch.
    Now,
    /// Left to the caller, who publishes many containers' volumes and then checks them all at
    /// once with [`StorageProvider::ensure_listed`] (recovery's re-ensure of every container).
    Batched,
}

/// One volume a container is to use ([`StorageProvider::publish_uses`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeUse {
    /// The volume id.
    pub volume_id: String,
    /// Whether the use reads or writes (`None`: what the volume allows, see
    /// [`StorageProvider::publish_use_as`]).
    pub access: Option<Access>,
    /// The group the workload runs with, when the volume is to be made accessible to it
    /// (`volume_mount_group`, see [`mount_group`]); `None`: no group asked.
    pub mount_group: Option<u32>,
}

/// What publishing one use did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UseOutcome {
    /// Where the volume is mounted on the host.
    pub mount_point: PathBuf,
    /// Whether the container became a user now.
    pub added: bool,
    /// The group the plugin staged and published the volume with (`None`: none; then the
    /// plugin made nothing accessible to a group, and the isolator's own rule applies).
    pub mount_group: Option<u32>,
}

/// How much longer an unused volume waits before it is unpublished: its last user left at
/// `idle_since` (`None`: not waiting, e.g. after a restart, or with no delay) and it waits
/// `delay` in all. `None` when it waits no more.
pub(crate) fn idle_wait(
    idle_since: Option<Instant>,
    delay: Duration,
    now: Instant,
) -> Option<Duration> {
    let since = idle_since?;
    let waited = now.saturating_duration_since(since);
    (waited < delay).then(|| delay - waited)
}

/// What a mount check of a volume recorded as published means for its record: not mounted sends
/// it back to NODE_READY (re-staged and re-published, both idempotent); an unreadable answer
/// repairs nothing on a guess.
fn note_mount_check<E: std::error::Error + 'static>(
    rec: &mut VolumeRecord,
    target: &Path,
    mounted: Result<bool, E>,
) {
    match mounted {
        Ok(true) => {}
        Ok(false) => {
            tracing::warn!(volume_id = %rec.volume_id, target = %target.display(),
                "recorded as published but not mounted; repairing");
            rec.state = VolumeState::NodeReady;
        }
        Err(e) => {
            tracing::warn!(volume_id = %rec.volume_id, error = %Chain(&e), "cannot check the mount")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unused_volume_waits_out_the_delay_from_its_last_release_and_no_longer() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        // (idle since, delay, now, still to wait)
        let cases = [
            (None, s(10), t0, None),
            (Some(t0), Duration::ZERO, t0, None),
            (Some(t0), s(10), t0, Some(s(10))),
            (Some(t0), s(10), t0 + s(4), Some(s(6))),
            (Some(t0), s(10), t0 + s(10), None),
            (Some(t0), s(10), t0 + s(60), None),
            // A clock read before the release (another thread's `now`) waits the whole delay.
            (Some(t0 + s(1)), s(10), t0, Some(s(10))),
        ];
        for (since, delay, now, wait) in cases {
            assert_eq!(
                idle_wait(since, delay, now),
                wait,
                "{since:?} {delay:?} {now:?}"
            );
        }
    }
}
