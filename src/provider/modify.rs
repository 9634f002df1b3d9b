//! Mutable parameters: a volume's parameters changed in place through ControllerModifyVolume
//! (CSI v1.12 MODIFY_VOLUME).
//!
//! Checkpointed like expansion ([`crate::provider::expand`]): the parameters asked are durable
//! in the volume's record (`modifying`) before the RPC; once the plugin accepted them they are
//! merged into the record's `mutable_parameters` and the intent goes, in one write.
//! ControllerModifyVolume is idempotent in CSI, so an interrupted modification is re-issued as
//! it was asked: by recovery on start, and by the next `modify` (which first finishes it). A
//! refusal the plugin judged ([`refused_for_good`]: INVALID_ARGUMENT for a key it does not
//! know, NOT_FOUND...) changed nothing: the intent goes with it.
//!
//! What may be done is decided by [`plan`], a pure function, before any RPC: no parameters,
//! parameters the one rule for parameters ([`crate::provider::parameters::check`]) refuses
//! (secrets-looking keys, control characters, sizes), and a plugin without MODIFY_VOLUME are
//! refused, naming what to do.

use std::collections::BTreeMap;

use crate::csi::proto;
use crate::provider::checkpoint;
pub use crate::provider::error::ModifyRefusal as Refusal;
use crate::provider::error::ProviderError;
use crate::provider::state::VolumeRecord;
use crate::provider::storage::StorageProvider;

/// Decides a modification of `rec` to `asked`, the plugin's controller having MODIFY_VOLUME
/// or not: `None` when the volume has those values already and nothing is pending.
pub fn plan(
    rec: &VolumeRecord,
    asked: &BTreeMap<String, String>,
    has_capability: bool,
) -> Result<Option<BTreeMap<String, String>>, Refusal> {
    if asked.is_empty() {
        return Err(Refusal::Nothing);
    }
    crate::provider::parameters::check(asked).map_err(Refusal::Parameters)?;
    if !has_capability {
        return Err(Refusal::NoCapability);
    }
    let already = asked
        .iter()
        .all(|(k, v)| rec.mutable_parameters.get(k) == Some(v));
    if already && rec.modifying.is_none() {
        return Ok(None);
    }
    Ok(Some(asked.clone()))
}

/// Whether a failed ControllerModifyVolume was a refusal (the plugin judged the request and
/// changed nothing: the intent goes) rather than a call that may or may not have been done
/// (no answer, UNAVAILABLE, DEADLINE_EXCEEDED, ABORTED, INTERNAL...: the intent stays, to be
/// re-issued).
pub fn refused_for_good(code: Option<tonic::Code>) -> bool {
    use tonic::Code;
    matches!(
        code,
        Some(
            Code::InvalidArgument
                | Code::NotFound
                | Code::Unimplemented
                | Code::OutOfRange
                | Code::FailedPrecondition
                | Code::PermissionDenied
                | Code::Unauthenticated
        )
    )
}

impl StorageProvider {
    /// Modifies the mutable parameters of the volume `volume_id` (see the module doc); returns
    /// the volume's mutable parameters after. Refusals come before any RPC and change nothing.
    pub async fn modify_volume(
        &self,
        volume_id: &str,
        asked: &BTreeMap<String, String>,
    ) -> Result<BTreeMap<String, String>, ProviderError> {
        let slot = self.slot(volume_id)?;
        let mut rec = slot.record.lock().await;
        if rec.destroying {
            return Err(ProviderError::Destroying {
                volume: volume_id.to_string(),
            });
        }
        let caps = self.capabilities();
        let has = caps.plugin.controller_service() && caps.controller.modify_volume();
        let refused = |why| ProviderError::ModifyRefused {
            volume: volume_id.to_string(),
            why,
        };
        let Some(asked) = plan(&rec, asked, has).map_err(refused)? else {
            return Ok(rec.mutable_parameters.to_btree());
        };
        // One pending at a time: an interrupted one is finished first (what it asked was
        // accepted by the rule when it was made durable).
        self.continue_modify(&mut rec).await?;
        if !rec.modifying.as_ref().is_some_and(|m| *m == asked) {
            let before = rec.clone();
            rec.modifying = Some(asked.into());
            if let Err(e) = self.persist(&rec).await {
                *rec = before;
                return Err(e);
            }
        }
        self.continue_modify(&mut rec).await?;
        Ok(rec.mutable_parameters.to_btree())
    }

    /// Sends the record's pending modification (if any) and records it done.
    pub(crate) async fn continue_modify(
        &self,
        rec: &mut VolumeRecord,
    ) -> Result<(), ProviderError> {
        let Some(asked) = rec.modifying.clone() else {
            return Ok(());
        };
        let id = rec.volume_id.clone();
        let answer = self
            .controller()
            .controller_modify_volume(proto::ControllerModifyVolumeRequest {
                volume_id: id.clone(),
                secrets: Default::default(),
                mutable_parameters: asked.clone().into_iter().collect(),
            })
            .await;
        if let Err(source) = answer {
            if refused_for_good(source.code()) {
                // The plugin said no: nothing was changed, nothing is left to re-issue.
                rec.modifying = None;
                self.persist(rec).await?;
            }
            return Err(ProviderError::Csi { volume: id, source });
        }
        checkpoint::crash_point();
        rec.mutable_parameters.extend(asked);
        rec.modifying = None;
        self.persist(rec).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::parameters::ParameterError;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn record() -> VolumeRecord {
        let mut rec = VolumeRecord::new("v1", crate::provider::Capability::default());
        rec.mutable_parameters = map(&[("tier", "standard")]).into();
        rec
    }

    #[test]
    fn refusals_come_before_any_rpc() {
        let rec = record();
        assert_eq!(plan(&rec, &map(&[]), true), Err(Refusal::Nothing));
        assert_eq!(
            plan(&rec, &map(&[("tier", "fast")]), false),
            Err(Refusal::NoCapability)
        );
        assert!(matches!(
            plan(
                &rec,
                &map(&[("csi.storage.k8s.io/provisioner-secret-name", "x")]),
                true
            ),
            Err(Refusal::Parameters(ParameterError::Secret { .. }))
        ));
        assert!(matches!(
            plan(&rec, &map(&[("tier", "a\nb")]), true),
            Err(Refusal::Parameters(ParameterError::BadValue { .. }))
        ));
    }

    #[test]
    fn only_a_judged_refusal_drops_the_intent() {
        use tonic::Code;
        for code in [Code::InvalidArgument, Code::NotFound, Code::Unimplemented] {
            assert!(refused_for_good(Some(code)), "{code:?}");
        }
        for code in [
            Code::Unavailable,
            Code::DeadlineExceeded,
            Code::Aborted,
            Code::Internal,
            Code::Cancelled,
            Code::Unknown,
        ] {
            assert!(!refused_for_good(Some(code)), "{code:?}");
        }
        assert!(!refused_for_good(None));
    }

    #[test]
    fn what_the_volume_has_is_nothing_to_do_unless_one_is_pending() {
        let mut rec = record();
        assert_eq!(plan(&rec, &map(&[("tier", "standard")]), true), Ok(None));
        let asked = map(&[("tier", "fast"), ("iops", "10")]);
        assert_eq!(plan(&rec, &asked, true), Ok(Some(asked.clone())));
        rec.modifying = Some(map(&[("iops", "5")]).into());
        assert_eq!(
            plan(&rec, &map(&[("tier", "standard")]), true),
            Ok(Some(map(&[("tier", "standard")])))
        );
    }
}
