//! Expansion: a volume grown in place, online when the plugin can, through ControllerExpandVolume
//! (when the controller has EXPAND_VOLUME) and NodeExpandVolume on this node (when the node has
//! EXPAND_VOLUME and the controller said `node_expansion_required`, or there is no controller step).
//!
//! The operation is checkpointed like the others: its intent ([`Expansion`]: the size asked and
//! the call still to make) is durable in the volume's record before the first RPC, the answer of
//! each call is recorded before the next, and the intent goes when the last call is done. Both
//! calls are idempotent in CSI, so an interrupted expansion is re-issued from the call its intent
//! names: by recovery on start, by the next `expand`, and (for the node call) by the next publish
//! of the volume on this node when it was not published at the time.
//!
//! What may be done is decided by [`plan`], a pure function of the record and the plugin's
//! capabilities, before any RPC: a plugin without EXPAND_VOLUME, a shrink, and an offline-only
//! plugin while the volume is in use are refused, naming what to do.

use crate::csi::proto;
use crate::provider::checkpoint;
pub use crate::provider::error::ExpandRefusal as Refusal;
use crate::provider::error::ProviderError;
use crate::provider::state::{ExpandStep, Expansion, VolumeRecord, VolumeState};
use crate::provider::storage::StorageProvider;

/// What the plugin serving now offers for expansion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpandCaps {
    /// The controller service has EXPAND_VOLUME.
    pub controller: bool,
    /// The node service has EXPAND_VOLUME.
    pub node: bool,
    /// The plugin's VolumeExpansion capability says ONLINE: a published volume may be expanded.
    pub online: bool,
}

impl ExpandCaps {
    /// The capabilities as the CSI client learnt them.
    pub fn of(caps: &crate::csi::Capabilities) -> Self {
        use crate::csi::proto::plugin_capability::volume_expansion::Type as VolumeExpansion;
        ExpandCaps {
            controller: caps.plugin.controller_service() && caps.controller.expand_volume(),
            node: caps.node.expand_volume(),
            online: caps.plugin.has_volume_expansion(VolumeExpansion::Online),
        }
    }
}

/// What an expansion does next, decided before any RPC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    /// The volume has that size already and nothing is pending: nothing to do.
    Nothing,
    /// Make `Expansion` durable, then take its step.
    Start(Expansion),
}

/// Decides an expansion of `rec` to `asked` bytes with `caps` (see the module doc). A pending
/// expansion to at least `asked` is taken up where it stopped; a larger size starts over from the
/// first call.
pub fn plan(rec: &VolumeRecord, asked: u64, caps: ExpandCaps) -> Result<Plan, Refusal> {
    if asked == 0 {
        return Err(Refusal::ZeroSize);
    }
    if let Some(pending) = rec.expansion {
        if asked <= pending.to_bytes {
            return Ok(Plan::Start(pending));
        }
    }
    if asked < rec.capacity_bytes {
        return Err(Refusal::Shrink {
            capacity: rec.capacity_bytes,
        });
    }
    if asked == rec.capacity_bytes && rec.expansion.is_none() {
        return Ok(Plan::Nothing);
    }
    if !caps.controller && !caps.node {
        return Err(Refusal::NoCapability);
    }
    // The controller call changes the volume under a published mount: that needs ONLINE. A
    // node-only expansion is the node's growing of what it has published, done while published.
    if caps.controller && !caps.online && rec.state != VolumeState::Created {
        let mut users: Vec<String> = rec.users.iter().cloned().collect();
        if users.is_empty() {
            users.push(format!("nobody now, but it is still {}", rec.state));
        }
        return Err(Refusal::OfflineOnly { users });
    }
    Ok(Plan::Start(Expansion {
        to_bytes: asked,
        step: if caps.controller {
            ExpandStep::Controller
        } else {
            ExpandStep::Node
        },
    }))
}

/// What an expansion did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expanded {
    /// The volume's size now, as the plugin reported it.
    pub capacity_bytes: u64,
    /// The node call waits for the volume's next publish on this node.
    pub node_pending: bool,
}

impl StorageProvider {
    /// Expands the volume `volume_id` to `bytes` (see the module doc). Refusals come before any
    /// RPC and change nothing.
    pub async fn expand_volume(
        &self,
        volume_id: &str,
        bytes: u64,
    ) -> Result<Expanded, ProviderError> {
        let slot = self.slot(volume_id)?;
        let mut rec = slot.record.lock().await;
        if rec.destroying {
            return Err(ProviderError::Destroying {
                volume: volume_id.to_string(),
            });
        }
        let caps = ExpandCaps::of(&self.capabilities());
        let expansion = match plan(&rec, bytes, caps) {
            Ok(Plan::Nothing) => {
                return Ok(Expanded {
                    capacity_bytes: rec.capacity_bytes,
                    node_pending: false,
                })
            }
            Ok(Plan::Start(expansion)) => expansion,
            Err(refusal) => {
                return Err(ProviderError::ExpandRefused {
                    volume: volume_id.to_string(),
                    bytes,
                    why: refusal,
                })
            }
        };
        // The secrets are checked before the intent: a file that cannot be used stops here.
        for rpc in ["ControllerExpandVolume", "NodeExpandVolume"] {
            self.secrets(rec.secrets_file.as_deref(), volume_id, rpc)
                .await?;
        }
        if rec.expansion != Some(expansion) {
            let before = rec.clone();
            rec.expansion = Some(expansion);
            if let Err(e) = self.persist(&rec).await {
                *rec = before;
                return Err(e);
            }
        }
        self.continue_expansion(&mut rec, caps).await
    }

    /// Takes the record's pending expansion on from the call it names: the controller call, then
    /// the node call if the volume is published here (otherwise it waits for the next publish).
    pub(crate) async fn continue_expansion(
        &self,
        rec: &mut VolumeRecord,
        caps: ExpandCaps,
    ) -> Result<Expanded, ProviderError> {
        let Some(mut expansion) = rec.expansion else {
            return Ok(Expanded {
                capacity_bytes: rec.capacity_bytes,
                node_pending: false,
            });
        };
        if expansion.step == ExpandStep::Controller {
            let node_required = self.controller_expand(rec, expansion.to_bytes).await?;
            checkpoint::crash_point();
            expansion.step = ExpandStep::Node;
            rec.expansion = (node_required && caps.node).then_some(expansion);
            self.persist(rec).await?;
        }
        if rec.expansion.is_some() && rec.state == VolumeState::Published {
            self.node_expand(rec, expansion.to_bytes).await?;
            checkpoint::crash_point();
            rec.expansion = None;
            self.persist(rec).await?;
        }
        Ok(Expanded {
            capacity_bytes: rec.capacity_bytes,
            node_pending: rec.expansion.is_some(),
        })
    }

    /// ControllerExpandVolume; records the size the plugin reports. Whether the node must expand too.
    async fn controller_expand(
        &self,
        rec: &mut VolumeRecord,
        bytes: u64,
    ) -> Result<bool, ProviderError> {
        let id = rec.volume_id.clone();
        let secrets = self
            .secrets(rec.secrets_file.as_deref(), &id, "ControllerExpandVolume")
            .await?;
        let resp = self
            .controller()
            .controller_expand_volume(proto::ControllerExpandVolumeRequest {
                volume_id: id.clone(),
                capacity_range: Some(proto::CapacityRange {
                    required_bytes: to_i64(bytes),
                    limit_bytes: 0,
                }),
                secrets: secrets.to_request(),
                volume_capability: Some(rec.capability.to_proto()),
            })
            .await
            .map_err(|source| ProviderError::Csi {
                volume: id.clone(),
                source,
            })?;
        rec.capacity_bytes =
            reported_size(&id, "ControllerExpandVolume", resp.capacity_bytes, bytes)?;
        Ok(resp.node_expansion_required)
    }

    /// NodeExpandVolume on the volume's publish target; records the size the plugin reports (0: it
    /// did not say, the controller's answer stands).
    async fn node_expand(&self, rec: &mut VolumeRecord, bytes: u64) -> Result<(), ProviderError> {
        let id = rec.volume_id.clone();
        let secrets = self
            .secrets(rec.secrets_file.as_deref(), &id, "NodeExpandVolume")
            .await?;
        let staged = self.step_caps().stage_unstage;
        let resp = self
            .client()
            .node_expand_volume(proto::NodeExpandVolumeRequest {
                volume_id: id.clone(),
                volume_path: self
                    .layout()
                    .target_path(&id)
                    .to_string_lossy()
                    .into_owned(),
                capacity_range: Some(proto::CapacityRange {
                    required_bytes: to_i64(bytes),
                    limit_bytes: 0,
                }),
                staging_target_path: if staged {
                    self.layout()
                        .staging_path(&id)
                        .to_string_lossy()
                        .into_owned()
                } else {
                    String::new()
                },
                volume_capability: Some(rec.capability.to_proto()),
                secrets: secrets.to_request(),
            })
            .await
            .map_err(|source| ProviderError::Csi {
                volume: id.clone(),
                source,
            })?;
        if resp.capacity_bytes != 0 {
            rec.capacity_bytes =
                reported_size(&id, "NodeExpandVolume", resp.capacity_bytes, bytes)?;
        }
        Ok(())
    }

    /// After a publish on this node: the node call of an expansion that was waiting for it. A
    /// failure is logged and the call stays pending (the volume works at its old size meanwhile).
    pub(crate) async fn node_expand_after_publish(&self, rec: &mut VolumeRecord) {
        if !matches!(rec.expansion, Some(e) if e.step == ExpandStep::Node)
            || rec.state != VolumeState::Published
        {
            return;
        }
        let caps = ExpandCaps::of(&self.capabilities());
        if let Err(e) = self.continue_expansion(rec, caps).await {
            tracing::warn!(volume_id = %rec.volume_id, error = %crate::error_chain::Chain(&e), "NodeExpandVolume after publish failed: the volume keeps its old size on this node until the next publish or expand");
        }
    }
}

/// What a pending expansion waits for, as `status` says it.
pub fn pending_line(e: &Expansion) -> String {
    match e.step {
        ExpandStep::Controller => format!(
            "to {} bytes: ControllerExpandVolume not finished; the next start or `volume expand` with that size finishes it",
            e.to_bytes
        ),
        ExpandStep::Node => format!(
            "to {} bytes: NodeExpandVolume waits for the volume's next publish on this node (or `volume expand` with that size while it is published)",
            e.to_bytes
        ),
    }
}

/// A size for the wire (sizes above i64::MAX are not sizes a plugin can be asked).
fn to_i64(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// The size a plugin reported for an expansion to `asked`: a negative size, or one smaller than
/// asked, is the plugin misbehaving (CSI: at least the required bytes).
fn reported_size(
    volume: &str,
    rpc: &'static str,
    reported: i64,
    asked: u64,
) -> Result<u64, ProviderError> {
    match u64::try_from(reported) {
        Ok(size) if size >= asked => Ok(size),
        _ => Err(ProviderError::PluginMisbehaved {
            volume: volume.to_string(),
            rpc,
            what: format!("reported a size of {reported} bytes for an expansion to {asked}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(state: VolumeState, capacity: u64, users: &[&str]) -> VolumeRecord {
        let mut r = VolumeRecord::new("v1", crate::provider::Capability::default());
        r.state = state;
        r.capacity_bytes = capacity;
        r.users = users.iter().map(|u| u.to_string()).collect();
        r
    }

    const ALL: ExpandCaps = ExpandCaps {
        controller: true,
        node: true,
        online: true,
    };

    #[test]
    fn plans_follow_size_capabilities_and_use() {
        let published = rec(VolumeState::Published, 100, &["c1"]);
        let created = rec(VolumeState::Created, 100, &[]);
        let controller = |to| {
            Ok(Plan::Start(Expansion {
                to_bytes: to,
                step: ExpandStep::Controller,
            }))
        };
        assert_eq!(plan(&published, 200, ALL), controller(200));
        assert_eq!(plan(&published, 100, ALL), Ok(Plan::Nothing));
        assert_eq!(plan(&published, 0, ALL), Err(Refusal::ZeroSize));
        assert_eq!(
            plan(&published, 50, ALL),
            Err(Refusal::Shrink { capacity: 100 })
        );
        let none = ExpandCaps {
            controller: false,
            node: false,
            online: false,
        };
        assert_eq!(plan(&created, 200, none), Err(Refusal::NoCapability));
        // Offline only: refused in use, fine when nothing is published.
        let offline = ExpandCaps {
            online: false,
            ..ALL
        };
        assert_eq!(
            plan(&published, 200, offline),
            Err(Refusal::OfflineOnly {
                users: vec!["c1".into()]
            })
        );
        assert_eq!(plan(&created, 200, offline), controller(200));
        // A node-only plugin grows what it published.
        let node_only = ExpandCaps {
            controller: false,
            node: true,
            online: false,
        };
        assert_eq!(
            plan(&published, 200, node_only),
            Ok(Plan::Start(Expansion {
                to_bytes: 200,
                step: ExpandStep::Node
            }))
        );
    }

    #[test]
    fn a_pending_expansion_is_taken_up_where_it_stopped() {
        let mut r = rec(VolumeState::Created, 300, &[]);
        let pending = Expansion {
            to_bytes: 300,
            step: ExpandStep::Node,
        };
        r.expansion = Some(pending);
        // The same size (or less, up to it): the pending call, even with capacity recorded.
        assert_eq!(plan(&r, 300, ALL), Ok(Plan::Start(pending)));
        assert_eq!(plan(&r, 200, ALL), Ok(Plan::Start(pending)));
        // Larger: over again from the controller.
        assert_eq!(
            plan(&r, 400, ALL),
            Ok(Plan::Start(Expansion {
                to_bytes: 400,
                step: ExpandStep::Controller
            }))
        );
    }

    #[test]
    fn reported_sizes_below_the_ask_are_the_plugins_fault() {
        assert_eq!(reported_size("v", "R", 200, 100).unwrap(), 200);
        for bad in [-1, 99] {
            let err = reported_size("v", "ControllerExpandVolume", bad, 100).unwrap_err();
            assert!(
                err.to_string().contains("ControllerExpandVolume")
                    || format!("{err:?}").contains("reported a size"),
                "{err:?}"
            );
        }
        assert_eq!(to_i64(u64::MAX), i64::MAX);
    }

    #[test]
    fn pending_expansions_say_what_they_wait_for() {
        let node = pending_line(&Expansion {
            to_bytes: 7,
            step: ExpandStep::Node,
        });
        assert!(
            node.starts_with("to 7 bytes: NodeExpandVolume waits for the volume's next publish"),
            "{node}"
        );
        let controller = pending_line(&Expansion {
            to_bytes: 9,
            step: ExpandStep::Controller,
        });
        assert!(
            controller.contains("ControllerExpandVolume not finished"),
            "{controller}"
        );
    }

    #[test]
    fn refusals_say_what_to_do() {
        assert!(Refusal::Shrink { capacity: 5 }
            .to_string()
            .contains("give a larger size"));
        assert!(Refusal::OfflineOnly {
            users: vec!["a".into(), "b".into()]
        }
        .to_string()
        .contains("used by a, b: stop them and retry"));
    }
}
