//! The capabilities a plugin advertises, as typed sets.
//!
//! Contract: built from the plugin's `GetPluginCapabilities`,
//! `ControllerGetCapabilities` and `NodeGetCapabilities` answers. Values the
//! generated enums do not know (a newer spec revision) and `UNKNOWN` are
//! dropped, so `has` only ever answers for capabilities this crate can act
//! on. A plugin without `CONTROLLER_SERVICE` has an empty controller set.

use std::collections::BTreeSet;

use super::proto::{
    controller_service_capability, node_service_capability, plugin_capability,
    ControllerServiceCapability, NodeServiceCapability, PluginCapability,
};

/// Controller RPC capability (`ControllerServiceCapability.RPC.Type`).
pub type ControllerRpc = controller_service_capability::rpc::Type;
/// Node RPC capability (`NodeServiceCapability.RPC.Type`).
pub type NodeRpc = node_service_capability::rpc::Type;
/// Plugin service capability (`PluginCapability.Service.Type`).
pub type PluginService = plugin_capability::service::Type;
/// Plugin volume expansion capability (`PluginCapability.VolumeExpansion.Type`).
pub type VolumeExpansion = plugin_capability::volume_expansion::Type;

/// Everything a plugin advertised, discovered once per connection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// Identity service answer.
    pub plugin: PluginCapabilities,
    /// Controller service answer (empty when the plugin has no controller
    /// service).
    pub controller: ControllerCapabilities,
    /// Node service answer.
    pub node: NodeCapabilities,
}

/// Which services of a plugin a [`Client`](super::Client) drives, and so which
/// capabilities it discovers: a plugin deployed as a controller plugin alone need not serve
/// the Node service (NodeGetCapabilities included), and one deployed as a node plugin alone
/// need not serve the Controller service.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Services {
    /// Both (one plugin for both; the default).
    #[default]
    Both,
    /// The Controller service only (`--controller-endpoint`): node capabilities are not asked.
    Controller,
    /// The Node service only (`--plugin-endpoint` beside a `--controller-endpoint`):
    /// controller capabilities are not asked.
    Node,
}

impl Services {
    /// Whether the client asks for the controller's capabilities.
    pub fn controller(self) -> bool {
        self != Services::Node
    }

    /// Whether the client asks for the node's capabilities.
    pub fn node(self) -> bool {
        self != Services::Controller
    }
}

impl Capabilities {
    /// What a driver split into a controller plugin and a node plugin offers as one: the
    /// controller's RPCs from the controller plugin, the node's from the node plugin, and the
    /// plugin (identity) capabilities either advertises.
    pub fn joined(controller: &Capabilities, node: &Capabilities) -> Capabilities {
        let mut plugin = controller.plugin.clone();
        plugin.services.extend(node.plugin.services.iter().copied());
        plugin
            .volume_expansion
            .extend(node.plugin.volume_expansion.iter().copied());
        Capabilities {
            plugin,
            controller: controller.controller.clone(),
            node: node.node.clone(),
        }
    }
}

/// Capabilities from `GetPluginCapabilities`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PluginCapabilities {
    services: BTreeSet<PluginService>,
    volume_expansion: BTreeSet<VolumeExpansion>,
}

impl PluginCapabilities {
    /// Builds the set from the plugin's answer.
    pub fn from_proto(caps: &[PluginCapability]) -> Self {
        let mut out = Self::default();
        for cap in caps {
            match cap.r#type {
                Some(plugin_capability::Type::Service(s)) => {
                    if let Some(t) = known(
                        PluginService::try_from(s.r#type).ok(),
                        PluginService::Unknown,
                    ) {
                        out.services.insert(t);
                    }
                }
                Some(plugin_capability::Type::VolumeExpansion(v)) => {
                    if let Some(t) = known(
                        VolumeExpansion::try_from(v.r#type).ok(),
                        VolumeExpansion::Unknown,
                    ) {
                        out.volume_expansion.insert(t);
                    }
                }
                None => {}
            }
        }
        out
    }

    /// Whether the plugin advertised service capability `service`.
    pub fn has(&self, service: PluginService) -> bool {
        self.services.contains(&service)
    }

    /// Same as [`has`](Self::has).
    pub fn contains(&self, service: PluginService) -> bool {
        self.has(service)
    }

    /// Whether the plugin advertised volume expansion mode `mode`.
    pub fn has_volume_expansion(&self, mode: VolumeExpansion) -> bool {
        self.volume_expansion.contains(&mode)
    }

    /// The advertised service capabilities.
    pub fn services(&self) -> impl Iterator<Item = PluginService> + '_ {
        self.services.iter().copied()
    }

    /// `CONTROLLER_SERVICE`: the plugin serves the Controller service.
    pub fn controller_service(&self) -> bool {
        self.has(PluginService::ControllerService)
    }

    /// `VOLUME_ACCESSIBILITY_CONSTRAINTS`: volumes are not reachable from
    /// every node.
    pub fn volume_accessibility_constraints(&self) -> bool {
        self.has(PluginService::VolumeAccessibilityConstraints)
    }
}

/// Capabilities from `ControllerGetCapabilities`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ControllerCapabilities {
    rpcs: BTreeSet<ControllerRpc>,
}

impl ControllerCapabilities {
    /// Builds the set from the plugin's answer.
    pub fn from_proto(caps: &[ControllerServiceCapability]) -> Self {
        let rpcs = caps
            .iter()
            .filter_map(|c| match c.r#type {
                Some(controller_service_capability::Type::Rpc(rpc)) => known(
                    ControllerRpc::try_from(rpc.r#type).ok(),
                    ControllerRpc::Unknown,
                ),
                None => None,
            })
            .collect();
        Self { rpcs }
    }

    /// Whether the plugin advertised controller capability `rpc`.
    pub fn has(&self, rpc: ControllerRpc) -> bool {
        self.rpcs.contains(&rpc)
    }

    /// Same as [`has`](Self::has).
    pub fn contains(&self, rpc: ControllerRpc) -> bool {
        self.has(rpc)
    }

    /// The advertised capabilities.
    pub fn iter(&self) -> impl Iterator<Item = ControllerRpc> + '_ {
        self.rpcs.iter().copied()
    }

    /// `CREATE_DELETE_VOLUME`.
    pub fn create_delete_volume(&self) -> bool {
        self.has(ControllerRpc::CreateDeleteVolume)
    }

    /// `PUBLISH_UNPUBLISH_VOLUME`: ControllerPublish/Unpublish must be
    /// called around node staging.
    pub fn publish_unpublish_volume(&self) -> bool {
        self.has(ControllerRpc::PublishUnpublishVolume)
    }

    /// `LIST_VOLUMES`.
    pub fn list_volumes(&self) -> bool {
        self.has(ControllerRpc::ListVolumes)
    }

    /// `GET_CAPACITY`.
    pub fn get_capacity(&self) -> bool {
        self.has(ControllerRpc::GetCapacity)
    }

    /// `PUBLISH_READONLY`.
    pub fn publish_readonly(&self) -> bool {
        self.has(ControllerRpc::PublishReadonly)
    }

    /// `EXPAND_VOLUME`.
    pub fn expand_volume(&self) -> bool {
        self.has(ControllerRpc::ExpandVolume)
    }

    /// `MODIFY_VOLUME`.
    pub fn modify_volume(&self) -> bool {
        self.has(ControllerRpc::ModifyVolume)
    }
}

/// Capabilities from `NodeGetCapabilities`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeCapabilities {
    rpcs: BTreeSet<NodeRpc>,
}

impl NodeCapabilities {
    /// Builds the set from the plugin's answer.
    pub fn from_proto(caps: &[NodeServiceCapability]) -> Self {
        let rpcs = caps
            .iter()
            .filter_map(|c| match c.r#type {
                Some(node_service_capability::Type::Rpc(rpc)) => {
                    known(NodeRpc::try_from(rpc.r#type).ok(), NodeRpc::Unknown)
                }
                None => None,
            })
            .collect();
        Self { rpcs }
    }

    /// Whether the plugin advertised node capability `rpc`.
    pub fn has(&self, rpc: NodeRpc) -> bool {
        self.rpcs.contains(&rpc)
    }

    /// Same as [`has`](Self::has).
    pub fn contains(&self, rpc: NodeRpc) -> bool {
        self.has(rpc)
    }

    /// The advertised capabilities.
    pub fn iter(&self) -> impl Iterator<Item = NodeRpc> + '_ {
        self.rpcs.iter().copied()
    }

    /// `STAGE_UNSTAGE_VOLUME`: NodeStage/Unstage must be called around
    /// node publishing.
    pub fn stage_unstage_volume(&self) -> bool {
        self.has(NodeRpc::StageUnstageVolume)
    }

    /// `GET_VOLUME_STATS`.
    pub fn get_volume_stats(&self) -> bool {
        self.has(NodeRpc::GetVolumeStats)
    }

    /// `EXPAND_VOLUME`.
    pub fn expand_volume(&self) -> bool {
        self.has(NodeRpc::ExpandVolume)
    }

    /// `VOLUME_CONDITION`.
    pub fn volume_condition(&self) -> bool {
        self.has(NodeRpc::VolumeCondition)
    }

    /// `VOLUME_MOUNT_GROUP`: NodeStage and NodePublish take a mount volume's
    /// `volume_mount_group` (never sent to a plugin without it).
    pub fn volume_mount_group(&self) -> bool {
        self.has(NodeRpc::VolumeMountGroup)
    }
}

fn known<T: PartialEq>(value: Option<T>, unknown: T) -> Option<T> {
    value.filter(|v| *v != unknown)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn controller_cap(t: i32) -> ControllerServiceCapability {
        ControllerServiceCapability {
            r#type: Some(controller_service_capability::Type::Rpc(
                controller_service_capability::Rpc { r#type: t },
            )),
        }
    }

    fn node_cap(t: i32) -> NodeServiceCapability {
        NodeServiceCapability {
            r#type: Some(node_service_capability::Type::Rpc(
                node_service_capability::Rpc { r#type: t },
            )),
        }
    }

    #[test]
    fn plugin_capabilities_split_services_and_expansion() {
        let caps = PluginCapabilities::from_proto(&[
            PluginCapability {
                r#type: Some(plugin_capability::Type::Service(
                    plugin_capability::Service {
                        r#type: PluginService::ControllerService as i32,
                    },
                )),
            },
            PluginCapability {
                r#type: Some(plugin_capability::Type::VolumeExpansion(
                    plugin_capability::VolumeExpansion {
                        r#type: VolumeExpansion::Online as i32,
                    },
                )),
            },
            PluginCapability { r#type: None },
        ]);
        assert!(caps.controller_service());
        assert!(!caps.volume_accessibility_constraints());
        assert!(caps.has_volume_expansion(VolumeExpansion::Online));
        assert!(!caps.has_volume_expansion(VolumeExpansion::Offline));
        assert_eq!(
            caps.services().collect::<Vec<_>>(),
            vec![PluginService::ControllerService]
        );
    }

    #[test]
    fn controller_capabilities_drop_unknown_values() {
        let caps = ControllerCapabilities::from_proto(&[
            controller_cap(ControllerRpc::CreateDeleteVolume as i32),
            controller_cap(ControllerRpc::PublishUnpublishVolume as i32),
            controller_cap(0),
            controller_cap(9999),
        ]);
        assert!(caps.create_delete_volume());
        assert!(caps.publish_unpublish_volume());
        assert!(caps.contains(ControllerRpc::PublishUnpublishVolume));
        assert!(!caps.list_volumes());
        assert!(!caps.has(ControllerRpc::Unknown));
        assert_eq!(caps.iter().count(), 2);
    }

    #[test]
    fn node_capabilities() {
        let caps =
            NodeCapabilities::from_proto(&[node_cap(NodeRpc::GetVolumeStats as i32), node_cap(-1)]);
        assert!(caps.get_volume_stats());
        assert!(!caps.stage_unstage_volume());
        assert_eq!(
            caps.iter().collect::<Vec<_>>(),
            vec![NodeRpc::GetVolumeStats]
        );
        assert!(NodeCapabilities::from_proto(&[]).iter().next().is_none());
    }

    fn service(t: PluginService) -> PluginCapability {
        PluginCapability {
            r#type: Some(plugin_capability::Type::Service(
                plugin_capability::Service { r#type: t as i32 },
            )),
        }
    }

    #[test]
    fn a_split_driver_takes_each_service_from_its_own_plugin() {
        let controller = Capabilities {
            plugin: PluginCapabilities::from_proto(&[service(PluginService::ControllerService)]),
            controller: ControllerCapabilities::from_proto(&[controller_cap(
                ControllerRpc::PublishUnpublishVolume as i32,
            )]),
            // A `both` plugin at the controller endpoint: its node set is not used.
            node: NodeCapabilities::from_proto(&[node_cap(NodeRpc::GetVolumeStats as i32)]),
        };
        let node = Capabilities {
            plugin: PluginCapabilities::from_proto(&[service(
                PluginService::VolumeAccessibilityConstraints,
            )]),
            controller: ControllerCapabilities::from_proto(&[controller_cap(
                ControllerRpc::ListVolumes as i32,
            )]),
            node: NodeCapabilities::from_proto(&[node_cap(NodeRpc::StageUnstageVolume as i32)]),
        };
        let joined = Capabilities::joined(&controller, &node);
        assert!(joined.controller.publish_unpublish_volume());
        assert!(
            !joined.controller.list_volumes(),
            "the node plugin's controller set is not used"
        );
        assert!(joined.node.stage_unstage_volume());
        assert!(
            !joined.node.get_volume_stats(),
            "the controller plugin's node set is not used"
        );
        assert!(joined.plugin.controller_service());
        assert!(joined.plugin.volume_accessibility_constraints());
    }

    #[test]
    fn services_say_which_capabilities_are_asked() {
        for (services, controller, node) in [
            (Services::Both, true, true),
            (Services::Controller, true, false),
            (Services::Node, false, true),
        ] {
            assert_eq!(services.controller(), controller, "{services:?}");
            assert_eq!(services.node(), node, "{services:?}");
        }
        assert_eq!(Services::default(), Services::Both);
    }
}
