//! Mutable parameters (CSI v1.12 MODIFY_VOLUME): CreateVolume's `mutable_parameters` and
//! ControllerModifyVolume.
//!
//! The plugin knows two mutable keys, and nothing else is accepted (INVALID_ARGUMENT, naming
//! the key): `tier` (`standard` or `fast`) and `iops` (a decimal number from 1 to
//! [`MAX_IOPS`]). They change nothing in the backing: the plugin records them in the volume's
//! record and reports them in the volume_context of CreateVolume and ListVolumes as
//! `mutable.<key>` ([`MUTABLE_ECHO_PREFIX`]), so a test sees exactly what the plugin holds.
//!
//! ControllerModifyVolume merges the asked keys into the recorded ones (a key not named keeps
//! its value), needs at least one key (INVALID_ARGUMENT otherwise), answers NOT_FOUND for an
//! unknown volume, and is idempotent: asking for what the volume already has is answered OK
//! without writing. `--no-modify` (or a node-only plugin) offers no MODIFY_VOLUME: the RPC is
//! UNIMPLEMENTED and a CreateVolume carrying mutable parameters is refused.

use std::collections::{BTreeMap, HashMap};

use super::{require, Plugin, PluginError};
use csi_isolator::csi::proto;
use csi_isolator::shown::shown;

/// The mutable key choosing the volume's performance tier.
pub const TIER_KEY: &str = "tier";
/// The tiers a volume may have.
pub const TIERS: [&str; 2] = ["standard", "fast"];
/// The mutable key giving the volume's provisioned IOPS.
pub const IOPS_KEY: &str = "iops";
/// The largest `iops` accepted.
pub const MAX_IOPS: u64 = 1_000_000;
/// Prefix of the volume_context keys reporting a volume's mutable parameters.
pub const MUTABLE_ECHO_PREFIX: &str = "mutable.";

/// Checks mutable parameters against the keys the plugin knows; the error names the key (and
/// the value, shown safely) and what is accepted.
pub(super) fn check_mutable(
    rpc: &'static str,
    params: &HashMap<String, String>,
) -> Result<BTreeMap<String, String>, PluginError> {
    let invalid = |reason: String| PluginError::InvalidField {
        rpc,
        field: "mutable_parameters",
        reason,
    };
    let mut checked = BTreeMap::new();
    for (key, value) in params {
        match key.as_str() {
            TIER_KEY => {
                if !TIERS.contains(&value.as_str()) {
                    return Err(invalid(format!(
                        "{TIER_KEY} '{}' is not one of {TIERS:?}",
                        shown(value)
                    )));
                }
            }
            IOPS_KEY => {
                let ok = value.len() <= 7
                    && !value.is_empty()
                    && value.bytes().all(|b| b.is_ascii_digit())
                    && value
                        .parse::<u64>()
                        .is_ok_and(|n| (1..=MAX_IOPS).contains(&n));
                if !ok {
                    return Err(invalid(format!(
                        "{IOPS_KEY} '{}' is not a number from 1 to {MAX_IOPS}",
                        shown(value)
                    )));
                }
            }
            other => {
                return Err(invalid(format!(
                    "key '{}' is not mutable on this plugin (mutable keys: {TIER_KEY}, {IOPS_KEY})",
                    shown(other)
                )));
            }
        }
        checked.insert(key.clone(), value.clone());
    }
    Ok(checked)
}

/// The volume_context entries reporting `mutable`.
pub(super) fn echo(
    mutable: &BTreeMap<String, String>,
) -> impl Iterator<Item = (String, String)> + '_ {
    mutable
        .iter()
        .map(|(k, v)| (format!("{MUTABLE_ECHO_PREFIX}{k}"), v.clone()))
}

impl Plugin {
    /// Whether the plugin offers MODIFY_VOLUME (`--no-modify` and a node-only plugin do not).
    pub(super) fn modify_enabled(&self) -> bool {
        self.config.controller && self.config.modify
    }

    /// CreateVolume's `mutable_parameters`, checked (refused without MODIFY_VOLUME).
    pub(super) fn create_mutable(
        &self,
        params: &HashMap<String, String>,
    ) -> Result<BTreeMap<String, String>, PluginError> {
        const RPC: &str = "CreateVolume";
        if params.is_empty() {
            return Ok(BTreeMap::new());
        }
        if !self.modify_enabled() {
            return Err(PluginError::InvalidField {
                rpc: RPC,
                field: "mutable_parameters",
                reason: "this plugin offers no MODIFY_VOLUME (--no-modify): send none".into(),
            });
        }
        check_mutable(RPC, params)
    }

    /// Runs under the volume's lock.
    pub(super) fn controller_modify(
        &self,
        req: proto::ControllerModifyVolumeRequest,
    ) -> Result<proto::ControllerModifyVolumeResponse, PluginError> {
        const RPC: &str = "ControllerModifyVolume";
        if !self.modify_enabled() {
            return Err(PluginError::Unimplemented { rpc: RPC });
        }
        require(RPC, "volume_id", &req.volume_id)?;
        if req.mutable_parameters.is_empty() {
            return Err(PluginError::MissingField {
                rpc: RPC,
                field: "mutable_parameters",
            });
        }
        let asked = check_mutable(RPC, &req.mutable_parameters)?;
        let mut record = self.known_volume(RPC, &req.volume_id)?;
        let mut merged = record.mutable_parameters.clone();
        merged.extend(asked);
        if merged != record.mutable_parameters {
            self.faults.stall(RPC);
            record.mutable_parameters = merged;
            self.save(RPC, &record)?;
            tracing::info!(volume_id = %record.id, mutable = ?record.mutable_parameters, "volume modified");
        }
        Ok(proto::ControllerModifyVolumeResponse {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn known_keys_with_valid_values_are_accepted() {
        let got = check_mutable("T", &map(&[("tier", "fast"), ("iops", "1000000")])).unwrap();
        assert_eq!(got.get("tier").map(String::as_str), Some("fast"));
        assert_eq!(got.get("iops").map(String::as_str), Some("1000000"));
        assert!(check_mutable("T", &map(&[])).unwrap().is_empty());
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused_naming_the_key() {
        for (k, v) in [
            ("size", "1"),
            ("tier", "gold"),
            ("tier", ""),
            ("iops", "0"),
            ("iops", "1000001"),
            ("iops", "+5"),
            ("iops", "-1"),
            ("iops", "99999999999999999999"),
            ("iops", ""),
        ] {
            let err = check_mutable("T", &map(&[(k, v)])).unwrap_err();
            let msg = err.to_string();
            assert!(
                matches!(
                    err,
                    PluginError::InvalidField {
                        field: "mutable_parameters",
                        ..
                    }
                ),
                "{k}={v}: {msg}"
            );
        }
    }
}
