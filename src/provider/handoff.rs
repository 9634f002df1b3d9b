//! Handing a volume from one node to another, as the provider of one node sees it.
//!
//! A single-node volume is published to one node at a time: the controller refuses
//! ControllerPublishVolume for a second node with FAILED_PRECONDITION, which the spec keeps for
//! "published at another node" and asks to name that node in its message. Such a refusal did
//! nothing on the controller, so a publish that it stops at its first step goes back to the
//! record as it was before the intent (no rollback RPCs, no use, no directories): nothing is
//! left half-done on this node, and a retry after the other node released the volume starts
//! clean.
//!
//! A dead node is fenced by an operator: `csi-isolator volume detach VOLUME --node X`
//! ([`detach`]) reads X's record (X's work dir, as an operator reaches a dead node's disk),
//! refuses while it lists users unless forced, writes a [`Fence`] into it (durable before the
//! RPC), sends ControllerUnpublishVolume(VOLUME, X) and records that it is done; a rerun after a
//! crash finishes it. When X's agent starts again its recovery ([`StorageProvider::take_fence`])
//! finds the fence: it moves the users to the fence's lost uses (warning for each), tears the node
//! side down through its node plugin (at most one more, idempotent, ControllerUnpublish) and never
//! sends ControllerPublish for them. A record the detach could not reach is fenced by the
//! controller instead: at start, a node with a controller apart asks it once to publish each
//! volume its records hold (ControllerPublish is idempotent); a FAILED_PRECONDITION (another node
//! holds it) is taken as a fence, with the same teardown and report, and never retried.

use std::collections::BTreeSet;
use std::path::Path;

use tonic::Code;

use crate::csi::{proto, Client};
use crate::error_chain::Chain;
use crate::offload::blocking;
use crate::provider::checkpoint;
use crate::provider::error::ProviderError;
use crate::provider::state::{Step, VolumeRecord, VolumeState};
use crate::provider::storage::StorageProvider;
use crate::resource::{encode_volume_id, Layout};

pub use crate::provider::state::Fence;

/// Whether recovery asks the controller whether this node still holds a volume at `state`
/// (going `towards`): it was ControllerPublished here and is not on its way down (an interrupted
/// unpublish is finished as it is, never published again to be checked).
pub(crate) fn check_hold(state: VolumeState, towards: Option<VolumeState>) -> bool {
    if towards == Some(VolumeState::Created) {
        return false;
    }
    match state.pending_step() {
        None => state.rank().is_some_and(|r| r >= 1),
        Some(step) => step.is_forward() && step != Step::ControllerPublish,
    }
}

/// Whether recovery has a fence to take for `rec` ([`StorageProvider::take_fence`]): one its
/// record holds and that is not torn down yet, or, with a controller apart
/// (`controller_apart`), a record holding the volume on a node, which the controller is asked
/// about. A volume being destroyed is destroyed, not fenced. Recovery asks only those.
pub(crate) fn fence_to_take(rec: &VolumeRecord, controller_apart: bool) -> bool {
    match &rec.fenced {
        Some(fence) => !fence.torn_down,
        None => {
            rec.node_id.is_some()
                && controller_apart
                && !rec.destroying
                && check_hold(rec.state, rec.towards)
        }
    }
}

/// What `volume detach` does, given the record found in the node's work dir.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DetachPlan {
    /// Fence the record (it says the volume is published to the node), then unpublish.
    Fence,
    /// No record of the volume on that node here: ControllerUnpublish only (forced).
    UnpublishOnly,
}

pub use crate::provider::error::DetachRefused;

/// Decides `volume detach` (pure): `rec` is the volume's record in the work dir given (if any).
pub fn detach_plan(
    rec: Option<&VolumeRecord>,
    volume: &str,
    node: &str,
    force: bool,
    work_dir: &Path,
) -> Result<DetachPlan, DetachRefused> {
    let held_here = rec.filter(|r| {
        r.node_id.as_deref() == Some(node) || r.fenced.as_ref().is_some_and(|f| f.node == node)
    });
    match held_here {
        None if force => Ok(DetachPlan::UnpublishOnly),
        None => Err(DetachRefused::NoRecord {
            volume: crate::shown::shown(volume).into_owned(),
            node: crate::shown::shown(node).into_owned(),
            work_dir: work_dir.display().to_string(),
        }),
        Some(r) if !r.users.is_empty() && !force && r.fenced.is_none() => {
            Err(DetachRefused::InUse {
                volume: crate::shown::shown(volume).into_owned(),
                node: crate::shown::shown(node).into_owned(),
                users: r
                    .users
                    .iter()
                    .map(|u| crate::shown::shown(u).into_owned())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
        }
        Some(_) => Ok(DetachPlan::Fence),
    }
}

/// What `volume detach` did.
#[derive(Debug, PartialEq, Eq)]
pub struct Detached {
    /// Whether the node's record was fenced (else only ControllerUnpublish was sent).
    pub fenced: bool,
    /// The containers whose use the node loses.
    pub lost_users: BTreeSet<String>,
}

/// `csi-isolator volume detach VOLUME --node NODE [--force]`: takes `volume` from `node` through
/// the `controller` (driver `layout`'s), fencing `node`'s record in `layout`'s work dir when it
/// is there (see the module doc). Run with the work dir locked. The fence is durable before
/// ControllerUnpublish is sent, and marked done after: a rerun finishes an interrupted detach.
pub async fn detach(
    controller: &Client,
    layout: &Layout,
    volume: &str,
    node: &str,
    force: bool,
) -> Result<Detached, ProviderError> {
    let path = layout.state_file(volume);
    let dir_name = encode_volume_id(volume);
    let read = {
        let path = path.clone();
        let layout = layout.clone();
        // The provider's journal folded into the state files first (the work dir is locked):
        // the state file is then the truth, and the fence written to it is not undone by a
        // later replay.
        blocking(move || {
            checkpoint::settle_journal(&layout)?;
            checkpoint::read(&path)
        })
        .await
    }
    .map_err(|source| ProviderError::Checkpoint {
        volume: volume.to_string(),
        source,
    })?;
    let mut rec = match read {
        Some(bytes) => Some(VolumeRecord::from_state_file(&bytes, &dir_name).map_err(
            |reason| ProviderError::CorruptState {
                path: path.clone(),
                aside: path.clone(),
                reason,
            },
        )?),
        None => None,
    };
    let plan = detach_plan(rec.as_ref(), volume, node, force, layout.base())
        .map_err(|why| ProviderError::DetachRefused { why })?;
    let mut lost_users = BTreeSet::new();
    let mut secrets_file = None;
    if let (DetachPlan::Fence, Some(rec)) = (&plan, rec.as_mut()) {
        let fence = rec.fenced.get_or_insert_with(|| Fence {
            node: node.to_string(),
            why: "detached by an operator (`csi-isolator volume detach`)".into(),
            unpublished: false,
            lost_users: BTreeSet::new(),
            torn_down: false,
        });
        fence.lost_users.extend(rec.users.iter().cloned());
        lost_users = fence.lost_users.clone();
        secrets_file = rec.secrets_file.clone();
        write_record(&path, rec).await?;
    }
    let secrets = match secrets_file {
        Some(file) => blocking(move || crate::provider::secrets::load(&file))
            .await
            .map_err(|source| ProviderError::Secrets {
                volume: volume.to_string(),
                rpc: "ControllerUnpublishVolume",
                source,
            })?
            .for_rpc("ControllerUnpublishVolume"),
        None => Default::default(),
    };
    controller
        .controller_unpublish_volume(proto::ControllerUnpublishVolumeRequest {
            volume_id: volume.to_string(),
            node_id: node.to_string(),
            secrets: secrets.to_request(),
        })
        .await
        .map_err(|source| ProviderError::Csi {
            volume: volume.to_string(),
            source,
        })?;
    // Unpublished but not yet recorded: a rerun sends the (idempotent) call again.
    checkpoint::crash_point();
    if let (DetachPlan::Fence, Some(rec)) = (&plan, rec.as_mut()) {
        if let Some(fence) = rec.fenced.as_mut() {
            fence.unpublished = true;
        }
        write_record(&path, rec).await?;
    }
    Ok(Detached {
        fenced: plan == DetachPlan::Fence,
        lost_users,
    })
}

async fn write_record(path: &Path, rec: &VolumeRecord) -> Result<(), ProviderError> {
    let bytes = serde_json::to_vec_pretty(rec).expect("a volume record always serializes");
    let at = path.to_path_buf();
    blocking(move || checkpoint::write_atomic(&at, &bytes))
        .await
        .map_err(|source| ProviderError::Checkpoint {
            volume: rec.volume_id.clone(),
            source,
        })
}

/// Whether a failed step left nothing to undo, so the record goes back to `before` (what it
/// was when the operation started): a ControllerPublish refused FAILED_PRECONDITION (published
/// at another node) when it was the operation's first step, from a volume at rest on no node.
pub(crate) fn refusal_left_nothing(
    step: Step,
    code: Option<Code>,
    before_state: VolumeState,
    before_towards: Option<VolumeState>,
) -> bool {
    step == Step::ControllerPublish
        && code == Some(Code::FailedPrecondition)
        && before_state == VolumeState::Created
        && before_towards.is_none()
}

impl StorageProvider {
    /// Recovery of a volume taken from this node while it was away (see the module doc): a
    /// fence found in the record, or a controller that refuses to publish the volume here
    /// again. `None`: not fenced, recover as usual; else what recovery did.
    pub(crate) async fn take_fence(
        &self,
        rec: &mut VolumeRecord,
    ) -> Option<Result<&'static str, ProviderError>> {
        if !fence_to_take(rec, self.config.controller_endpoint.is_some()) {
            return None;
        }
        if rec.fenced.is_none() {
            let why = self.held_elsewhere(rec).await?;
            rec.fenced = Some(Fence {
                node: rec.node_id.clone().unwrap_or_default(),
                why,
                unpublished: true,
                lost_users: BTreeSet::new(),
                torn_down: false,
            });
        }
        let fence = rec.fenced.as_mut().expect("fenced");
        fence.lost_users.extend(rec.users.iter().cloned());
        rec.users.clear();
        rec.readers.clear();
        let (why, lost) = (fence.why.clone(), fence.lost_users.clone());
        if let Err(e) = self.persist(rec).await {
            return Some(Err(e));
        }
        for container in &lost {
            tracing::warn!(volume_id = %rec.volume_id, container_id = %container, %why,
                "the volume was fenced from this node while it was away: the container lost its use of it");
        }
        {
            let mut report = self.report.lock().unwrap();
            report.actions.push(format!(
                "{}: fenced from this node ({why}); lost uses: {}",
                rec.volume_id,
                if lost.is_empty() {
                    "none".to_string()
                } else {
                    lost.iter().cloned().collect::<Vec<_>>().join(", ")
                }
            ));
        }
        // Down to CREATED through the node plugin: NodeUnpublish, NodeUnstage and at most one
        // (idempotent) ControllerUnpublish; never ControllerPublish.
        if let Err(e) = self.drive(rec, VolumeState::Created).await {
            return Some(Err(e));
        }
        if let Some(f) = rec.fenced.as_mut() {
            f.torn_down = true;
        }
        Some(self.persist(rec).await.map(|()| "fenced: torn down"))
    }

    /// Whether the controller (apart from the node plugin) now refuses to publish to this node
    /// a volume its record holds: one idempotent ControllerPublish, as the record asked it
    /// before. `Some(why)` for a FAILED_PRECONDITION (another node holds it); any other answer
    /// leaves the volume to the usual recovery.
    /// Only asked of a record [`fence_to_take`] says may be held elsewhere.
    async fn held_elsewhere(&self, rec: &VolumeRecord) -> Option<String> {
        let node = rec.node_id.clone()?;
        let secrets = self
            .secrets(
                rec.secrets_file.as_deref(),
                &rec.volume_id,
                "ControllerPublishVolume",
            )
            .await
            .ok()?;
        let asked = self
            .controller()
            .controller_publish_volume(proto::ControllerPublishVolumeRequest {
                volume_id: rec.volume_id.clone(),
                node_id: node,
                volume_capability: Some(rec.capability.to_proto()),
                readonly: rec.readonly,
                volume_context: rec.volume_context.clone().into_iter().collect(),
                secrets: secrets.to_request(),
            })
            .await;
        match asked {
            Ok(_) => None,
            Err(e) if e.code() == Some(Code::FailedPrecondition) => Some(format!(
                "the controller refused to publish it to this node again: {}",
                Chain(&e)
            )),
            Err(e) => {
                tracing::warn!(volume_id = %rec.volume_id, error = %Chain(&e), "recovery: cannot check with the controller that this node still holds the volume");
                None
            }
        }
    }

    /// What a failed step of [`drive`](StorageProvider::drive) returns: a refusal that left
    /// nothing ([`refusal_left_nothing`]) puts `rec` back to `before`, durably, and says which
    /// node cannot have the volume and what to do; any other failure is returned as it is.
    pub(crate) async fn after_failed_step(
        &self,
        rec: &mut VolumeRecord,
        before: &VolumeRecord,
        step: Step,
        error: ProviderError,
    ) -> ProviderError {
        if !refusal_left_nothing(step, error.csi_code(), before.state, before.towards) {
            return error;
        }
        let ProviderError::Csi { volume, source } = error else {
            return error;
        };
        let node = self.node_id().await.unwrap_or_else(|_| "this node".into());
        *rec = before.clone();
        // Without this write the intent stays on disk; the caller's rollback (or recovery)
        // settles it then, with one idempotent ControllerUnpublish.
        if let Err(e) = self.persist(rec).await {
            tracing::warn!(volume_id = %volume, error = %Chain(&e), "cannot record that the refused publish left nothing");
        }
        tracing::warn!(volume_id = %volume, node_id = %node, error = %Chain(&source), "the volume is published to another node");
        ProviderError::HeldByAnotherNode {
            volume,
            node,
            source: Box::new(source),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::state::Capability;
    use VolumeState as V;

    #[test]
    fn only_a_volume_held_here_and_not_on_its_way_down_is_checked_with_the_controller() {
        #[rustfmt::skip]
        let cases = [
            // (state, towards, checked)
            (V::Created, None, false),
            (V::NodeReady, None, true),
            (V::VolReady, None, true),
            (V::Published, None, true),
            // Forward steps past the controller's: held here.
            (V::NodeStage, Some(V::Published), true),
            (V::NodePublish, Some(V::Published), true),
            // Not known to be published yet: the machine re-issues it anyway.
            (V::ControllerPublish, Some(V::Published), false),
            // On the way down: finished, never published again to be checked.
            (V::NodeUnpublish, Some(V::Created), false),
            (V::NodeUnstage, Some(V::Created), false),
            (V::ControllerUnpublish, Some(V::Created), false),
            (V::NodeStage, Some(V::Created), false),
            (V::NodeUnpublish, Some(V::VolReady), false),
        ];
        for (state, towards, want) in cases {
            assert_eq!(check_hold(state, towards), want, "{state:?} {towards:?}");
        }
    }

    #[test]
    fn recovery_takes_a_fence_only_where_there_may_be_one() {
        let fence = |torn_down| Fence {
            node: "x".into(),
            why: "detached".into(),
            unpublished: true,
            lost_users: BTreeSet::new(),
            torn_down,
        };
        let rec = |node: bool, state, destroying, fenced: Option<Fence>| {
            let mut r = VolumeRecord::new("v", Capability::default());
            r.node_id = node.then(|| "x".to_string());
            r.state = state;
            r.destroying = destroying;
            r.fenced = fenced;
            r
        };
        #[rustfmt::skip]
        let cases = [
            // (record, controller apart, taken)
            // A fence in the record is taken whatever the controller, until torn down.
            (rec(true, V::Published, false, Some(fence(false))), false, true),
            (rec(false, V::Created, false, Some(fence(false))), true, true),
            (rec(true, V::Published, false, Some(fence(true))), true, false),
            (rec(true, V::Created, false, Some(fence(true))), false, false),
            // None yet: the controller apart is asked about a volume held on a node...
            (rec(true, V::Published, false, None), true, true),
            (rec(true, V::NodeReady, false, None), true, true),
            // ... and only then.
            (rec(true, V::Published, false, None), false, false),
            (rec(false, V::Published, false, None), true, false),
            (rec(true, V::Published, true, None), true, false),
            (rec(true, V::Created, false, None), true, false),
        ];
        for (i, (r, controller_apart, want)) in cases.into_iter().enumerate() {
            assert_eq!(fence_to_take(&r, controller_apart), want, "case {i}");
        }
    }

    #[test]
    fn detach_fences_the_nodes_own_record_and_forces_only_what_it_must() {
        let rec = |node: Option<&str>, users: &[&str], fenced: bool| {
            let mut r = VolumeRecord::new("v", Capability::default());
            r.node_id = node.map(str::to_string);
            r.users = users.iter().map(|u| u.to_string()).collect();
            r.fenced = fenced.then(|| Fence {
                node: "x".into(),
                why: "detached".into(),
                unpublished: false,
                lost_users: BTreeSet::new(),
                torn_down: false,
            });
            r
        };
        let dir = Path::new("/w");
        let in_use = |users: &str| {
            Err(DetachRefused::InUse {
                volume: "v".into(),
                node: "x".into(),
                users: users.into(),
            })
        };
        let no_record = Err(DetachRefused::NoRecord {
            volume: "v".into(),
            node: "x".into(),
            work_dir: "/w".into(),
        });
        #[rustfmt::skip]
        let cases = [
            // (record here, force, plan)
            (None, false, no_record.clone()),
            (None, true, Ok(DetachPlan::UnpublishOnly)),
            // Another node's record (or one published nowhere) is not X's.
            (Some(rec(Some("y"), &["c"], false)), false, no_record.clone()),
            (Some(rec(None, &[], false)), false, no_record.clone()),
            (Some(rec(Some("y"), &["c"], false)), true, Ok(DetachPlan::UnpublishOnly)),
            // X's record: fenced when nothing uses it, or when forced.
            (Some(rec(Some("x"), &[], false)), false, Ok(DetachPlan::Fence)),
            (Some(rec(Some("x"), &["c1", "c2"], false)), false, in_use("c1, c2")),
            (Some(rec(Some("x"), &["c1"], false)), true, Ok(DetachPlan::Fence)),
            // Fenced already (a rerun after a crash): finished without --force.
            (Some(rec(Some("x"), &["c1"], true)), false, Ok(DetachPlan::Fence)),
            (Some(rec(None, &[], true)), false, Ok(DetachPlan::Fence)),
        ];
        for (i, (r, force, want)) in cases.into_iter().enumerate() {
            assert_eq!(
                detach_plan(r.as_ref(), "v", "x", force, dir),
                want,
                "case {i}"
            );
        }
    }

    #[test]
    fn only_a_first_controller_publish_refused_as_held_elsewhere_left_nothing() {
        let fp = Some(Code::FailedPrecondition);
        #[rustfmt::skip]
        let cases = [
            // (step, code, before state, before towards, left nothing)
            (Step::ControllerPublish, fp, V::Created, None, true),
            // Another code may have done something (or says nothing about another node).
            (Step::ControllerPublish, Some(Code::Internal), V::Created, None, false),
            (Step::ControllerPublish, Some(Code::DeadlineExceeded), V::Created, None, false),
            (Step::ControllerPublish, None, V::Created, None, false),
            // An interrupted earlier attempt is settled by the machine, not forgotten.
            (Step::ControllerPublish, fp, V::ControllerPublish, Some(V::Published), false),
            (Step::ControllerPublish, fp, V::Created, Some(V::Published), false),
            // A republish of a volume this node had (recovery, repair) is not this case.
            (Step::ControllerPublish, fp, V::NodeReady, None, false),
            (Step::ControllerPublish, fp, V::Published, None, false),
            // Later steps went past the controller: their failures are rolled back.
            (Step::NodeStage, fp, V::Created, None, false),
            (Step::NodePublish, fp, V::Created, None, false),
            (Step::ControllerUnpublish, fp, V::Created, None, false),
        ];
        for (step, code, state, towards, want) in cases {
            assert_eq!(
                refusal_left_nothing(step, code, state, towards),
                want,
                "{step:?} {code:?} {state:?} {towards:?}"
            );
        }
    }
}
