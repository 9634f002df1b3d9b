//! Handing a volume from one node to another, as the provider of one node sees it.
//!
//! A single-node volume is published to one node at a time: the controller refuses
//! ControllerPublishVolume for a second node with FAILED_PRECONDITION, which the spec keeps for
//! "published at another node" and asks to name that node in its message. Such a refusal did
//! nothing on the controller, so a publish that it stops at its first step goes back to the
//! record as it was before the intent (no rollback RPCs, no use, no directories): nothing is
//! left half-done on this node, and a retry after the other node released the volume starts
//! clean.

use tonic::Code;

use crate::error_chain::Chain;
use crate::provider::error::ProviderError;
use crate::provider::state::{Step, VolumeRecord, VolumeState};
use crate::provider::storage::StorageProvider;

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
    use VolumeState as V;

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
