//! Wire-level checks of the generated CSI v1 types against the field
//! numbers, wire types and enum values of the CSI specification (v1.12).
//!
//! A plugin written against any other CSI implementation only interoperates
//! with ours if the bytes match, so these tests do not trust the generated
//! Rust names: they encode with prost and read the raw protobuf keys back
//! with a small independent reader, and they decode hand-assembled bytes
//! laid out as the spec numbers them.

use std::collections::{BTreeMap, HashMap};

use csi_isolator::csi::proto;
use prost::Message;

/// Protobuf wire types (encoding spec).
const VARINT: u8 = 0;
const I64: u8 = 1;
const LEN: u8 = 2;
const I32: u8 = 5;

/// One top-level field as it appears on the wire.
#[derive(Debug, Clone, PartialEq)]
struct Field {
    number: u64,
    wire_type: u8,
    /// The varint value for VARINT, the payload bytes otherwise.
    varint: u64,
    payload: Vec<u8>,
}

fn read_varint(buf: &[u8], pos: &mut usize) -> u64 {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *buf
            .get(*pos)
            .unwrap_or_else(|| panic!("truncated varint at byte {pos}"));
        *pos += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return value;
        }
    }
    panic!("varint longer than 10 bytes");
}

/// Splits an encoded message into its top-level fields, in wire order.
fn fields(buf: &[u8]) -> Vec<Field> {
    let mut pos = 0;
    let mut out = Vec::new();
    while pos < buf.len() {
        let key = read_varint(buf, &mut pos);
        let number = key >> 3;
        let wire_type = u8::try_from(key & 7).expect("three bits");
        assert!(number > 0, "field number 0 is invalid");
        let (varint, payload) = match wire_type {
            VARINT => (read_varint(buf, &mut pos), Vec::new()),
            LEN => {
                let len = usize::try_from(read_varint(buf, &mut pos)).expect("length fits");
                let payload = buf[pos..pos + len].to_vec();
                pos += len;
                (0, payload)
            }
            I64 => {
                pos += 8;
                (0, buf[pos - 8..pos].to_vec())
            }
            I32 => {
                pos += 4;
                (0, buf[pos - 4..pos].to_vec())
            }
            other => panic!("unexpected wire type {other} for field {number}"),
        };
        out.push(Field {
            number,
            wire_type,
            varint,
            payload,
        });
    }
    out
}

/// Field number -> wire types seen for it (repeated/map fields appear
/// several times).
fn layout(buf: &[u8]) -> BTreeMap<u64, Vec<u8>> {
    let mut map: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    for f in fields(buf) {
        map.entry(f.number).or_default().push(f.wire_type);
    }
    map
}

fn only(buf: &[u8], number: u64) -> Field {
    let found: Vec<Field> = fields(buf)
        .into_iter()
        .filter(|f| f.number == number)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "field {number} occurs {} times",
        found.len()
    );
    found.into_iter().next().expect("one field")
}

fn string_field(buf: &[u8], number: u64) -> String {
    let f = only(buf, number);
    assert_eq!(f.wire_type, LEN, "field {number} is not length-delimited");
    String::from_utf8(f.payload).expect("utf-8 string field")
}

/// A map field on the wire is a repeated entry message {key = 1, value = 2}.
fn map_field(buf: &[u8], number: u64) -> BTreeMap<String, String> {
    fields(buf)
        .into_iter()
        .filter(|f| f.number == number)
        .map(|f| {
            assert_eq!(f.wire_type, LEN, "map field {number} entry wire type");
            let entry = f.payload;
            assert_eq!(layout(&entry).keys().copied().collect::<Vec<_>>(), [1, 2]);
            (string_field(&entry, 1), string_field(&entry, 2))
        })
        .collect()
}

fn one(key: &str, value: &str) -> HashMap<String, String> {
    HashMap::from([(key.to_owned(), value.to_owned())])
}

// Hand encoding, used to build messages from the spec's numbering.
fn key(number: u64, wire_type: u8) -> Vec<u8> {
    varint(number << 3 | u64::from(wire_type))
}

fn varint(mut v: u64) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let byte = u8::try_from(v & 0x7f).expect("seven bits");
        v >>= 7;
        if v == 0 {
            out.push(byte);
            return out;
        }
        out.push(byte | 0x80);
    }
}

fn len_field(number: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = key(number, LEN);
    out.extend(varint(payload.len() as u64));
    out.extend_from_slice(payload);
    out
}

fn varint_field(number: u64, value: u64) -> Vec<u8> {
    let mut out = key(number, VARINT);
    out.extend(varint(value));
    out
}

fn map_entry(number: u64, k: &str, v: &str) -> Vec<u8> {
    let mut entry = len_field(1, k.as_bytes());
    entry.extend(len_field(2, v.as_bytes()));
    len_field(number, &entry)
}

fn mount_capability(mode: proto::volume_capability::access_mode::Mode) -> proto::VolumeCapability {
    proto::VolumeCapability {
        access_type: Some(proto::volume_capability::AccessType::Mount(
            proto::volume_capability::MountVolume {
                fs_type: "ext4".into(),
                mount_flags: vec!["noatime".into(), "nodev".into()],
                volume_mount_group: "1000".into(),
            },
        )),
        access_mode: Some(proto::volume_capability::AccessMode { mode: mode as i32 }),
    }
}

#[test]
fn node_publish_volume_request_field_numbers() {
    let req = proto::NodePublishVolumeRequest {
        volume_id: "vol-1".into(),
        publish_context: one("pc", "1"),
        staging_target_path: "/staging".into(),
        target_path: "/target".into(),
        volume_capability: Some(mount_capability(
            proto::volume_capability::access_mode::Mode::SingleNodeWriter,
        )),
        readonly: true,
        secrets: one("user", "bob"),
        volume_context: one("ctx", "x"),
    };
    let buf = req.encode_to_vec();
    let expected: BTreeMap<u64, Vec<u8>> = [
        (1, vec![LEN]),
        (2, vec![LEN]),
        (3, vec![LEN]),
        (4, vec![LEN]),
        (5, vec![LEN]),
        (6, vec![VARINT]),
        (7, vec![LEN]),
        (8, vec![LEN]),
    ]
    .into_iter()
    .collect();
    assert_eq!(layout(&buf), expected);
    assert_eq!(string_field(&buf, 1), "vol-1");
    assert_eq!(
        map_field(&buf, 2),
        BTreeMap::from([("pc".into(), "1".into())])
    );
    assert_eq!(string_field(&buf, 3), "/staging");
    assert_eq!(string_field(&buf, 4), "/target");
    assert_eq!(only(&buf, 6).varint, 1);
    assert_eq!(
        map_field(&buf, 7),
        BTreeMap::from([("user".into(), "bob".into())])
    );
    assert_eq!(
        map_field(&buf, 8),
        BTreeMap::from([("ctx".into(), "x".into())])
    );
}

#[test]
fn node_publish_volume_request_decodes_spec_layout() {
    // NodePublishVolumeRequest assembled by hand from the spec numbering,
    // fields deliberately out of order.
    let mut cap = len_field(2, &len_field(1, b"xfs")); // mount { fs_type }
    cap.extend(len_field(3, &varint_field(1, 7))); // access_mode { SINGLE_NODE_MULTI_WRITER }
    let mut buf = Vec::new();
    buf.extend(map_entry(8, "ctx", "c"));
    buf.extend(varint_field(6, 1));
    buf.extend(len_field(5, &cap));
    buf.extend(len_field(4, b"/t"));
    buf.extend(len_field(3, b"/s"));
    buf.extend(map_entry(7, "k", "secret"));
    buf.extend(map_entry(2, "p", "q"));
    buf.extend(len_field(1, b"v"));
    let req = proto::NodePublishVolumeRequest::decode(buf.as_slice()).expect("decodes");
    assert_eq!(req.volume_id, "v");
    assert_eq!(req.publish_context, one("p", "q"));
    assert_eq!(req.staging_target_path, "/s");
    assert_eq!(req.target_path, "/t");
    assert!(req.readonly);
    assert_eq!(req.secrets, one("k", "secret"));
    assert_eq!(req.volume_context, one("ctx", "c"));
    let cap = req.volume_capability.expect("volume_capability = 5");
    match cap.access_type {
        Some(proto::volume_capability::AccessType::Mount(m)) => assert_eq!(m.fs_type, "xfs"),
        other => panic!("expected mount access type, got {other:?}"),
    }
    assert_eq!(
        cap.access_mode.expect("access_mode = 3").mode(),
        proto::volume_capability::access_mode::Mode::SingleNodeMultiWriter
    );
}

#[test]
fn node_stage_and_unstage_field_numbers() {
    let req = proto::NodeStageVolumeRequest {
        volume_id: "vol-2".into(),
        publish_context: one("a", "b"),
        staging_target_path: "/stage".into(),
        volume_capability: Some(mount_capability(
            proto::volume_capability::access_mode::Mode::SingleNodeSingleWriter,
        )),
        secrets: one("s", "t"),
        volume_context: one("c", "d"),
    };
    let buf = req.encode_to_vec();
    assert_eq!(
        layout(&buf).keys().copied().collect::<Vec<_>>(),
        [1, 2, 3, 4, 5, 6]
    );
    assert_eq!(string_field(&buf, 1), "vol-2");
    assert_eq!(
        map_field(&buf, 2),
        BTreeMap::from([("a".into(), "b".into())])
    );
    assert_eq!(string_field(&buf, 3), "/stage");
    assert_eq!(
        map_field(&buf, 5),
        BTreeMap::from([("s".into(), "t".into())])
    );
    assert_eq!(
        map_field(&buf, 6),
        BTreeMap::from([("c".into(), "d".into())])
    );

    let unstage = proto::NodeUnstageVolumeRequest {
        volume_id: "vol-2".into(),
        staging_target_path: "/stage".into(),
    }
    .encode_to_vec();
    assert_eq!(string_field(&unstage, 1), "vol-2");
    assert_eq!(string_field(&unstage, 2), "/stage");

    let unpublish = proto::NodeUnpublishVolumeRequest {
        volume_id: "vol-2".into(),
        target_path: "/target".into(),
    }
    .encode_to_vec();
    assert_eq!(string_field(&unpublish, 1), "vol-2");
    assert_eq!(string_field(&unpublish, 2), "/target");
}

#[test]
fn create_volume_request_field_numbers() {
    let req = proto::CreateVolumeRequest {
        name: "pvc-1".into(),
        capacity_range: Some(proto::CapacityRange {
            required_bytes: 1 << 20,
            limit_bytes: 1 << 30,
        }),
        volume_capabilities: vec![
            mount_capability(proto::volume_capability::access_mode::Mode::SingleNodeWriter),
            mount_capability(proto::volume_capability::access_mode::Mode::MultiNodeReaderOnly),
        ],
        parameters: one("type", "fast"),
        secrets: one("token", "t"),
        volume_content_source: Some(proto::VolumeContentSource {
            r#type: Some(proto::volume_content_source::Type::Snapshot(
                proto::volume_content_source::SnapshotSource {
                    snapshot_id: "snap-1".into(),
                },
            )),
        }),
        accessibility_requirements: Some(proto::TopologyRequirement {
            requisite: vec![proto::Topology {
                segments: one("zone", "z1"),
            }],
            preferred: vec![],
        }),
        mutable_parameters: one("iops", "3000"),
    };
    let buf = req.encode_to_vec();
    let l = layout(&buf);
    assert_eq!(
        l.keys().copied().collect::<Vec<_>>(),
        [1, 2, 3, 4, 5, 6, 7, 8]
    );
    assert_eq!(l[&3], [LEN, LEN], "volume_capabilities is repeated");
    assert_eq!(string_field(&buf, 1), "pvc-1");
    assert_eq!(
        map_field(&buf, 4),
        BTreeMap::from([("type".into(), "fast".into())])
    );
    assert_eq!(
        map_field(&buf, 5),
        BTreeMap::from([("token".into(), "t".into())])
    );
    assert_eq!(
        map_field(&buf, 8),
        BTreeMap::from([("iops".into(), "3000".into())])
    );

    // CapacityRange: required_bytes = 1, limit_bytes = 2 (int64 varints).
    let range = only(&buf, 2).payload;
    assert_eq!(only(&range, 1).varint, 1 << 20);
    assert_eq!(only(&range, 2).varint, 1 << 30);

    // VolumeContentSource oneof type: snapshot = 1 { snapshot_id = 1 }.
    let source = only(&buf, 6).payload;
    assert_eq!(string_field(&only(&source, 1).payload, 1), "snap-1");
    let clone = proto::VolumeContentSource {
        r#type: Some(proto::volume_content_source::Type::Volume(
            proto::volume_content_source::VolumeSource {
                volume_id: "vol-src".into(),
            },
        )),
    }
    .encode_to_vec();
    assert_eq!(string_field(&only(&clone, 2).payload, 1), "vol-src");

    // TopologyRequirement: requisite = 1, Topology.segments = 1.
    let topo_req = only(&buf, 7).payload;
    let topology = only(&topo_req, 1).payload;
    assert_eq!(
        map_field(&topology, 1),
        BTreeMap::from([("zone".into(), "z1".into())])
    );
}

#[test]
fn volume_and_create_volume_response_field_numbers() {
    let resp = proto::CreateVolumeResponse {
        volume: Some(proto::Volume {
            capacity_bytes: 4096,
            volume_id: "vol-3".into(),
            volume_context: one("k", "v"),
            content_source: None,
            accessible_topology: vec![proto::Topology {
                segments: one("rack", "r1"),
            }],
        }),
    }
    .encode_to_vec();
    let volume = only(&resp, 1).payload;
    assert_eq!(
        layout(&volume).keys().copied().collect::<Vec<_>>(),
        [1, 2, 3, 5]
    );
    assert_eq!(only(&volume, 1).varint, 4096);
    assert_eq!(string_field(&volume, 2), "vol-3");
    assert_eq!(
        map_field(&volume, 3),
        BTreeMap::from([("k".into(), "v".into())])
    );
}

#[test]
fn controller_publish_and_unpublish_field_numbers() {
    let req = proto::ControllerPublishVolumeRequest {
        volume_id: "vol-4".into(),
        node_id: "node-a".into(),
        volume_capability: Some(proto::VolumeCapability {
            access_type: Some(proto::volume_capability::AccessType::Block(
                proto::volume_capability::BlockVolume {},
            )),
            access_mode: Some(proto::volume_capability::AccessMode {
                mode: proto::volume_capability::access_mode::Mode::MultiNodeMultiWriter as i32,
            }),
        }),
        readonly: true,
        secrets: one("s", "1"),
        volume_context: one("c", "2"),
    };
    let buf = req.encode_to_vec();
    let expected: BTreeMap<u64, Vec<u8>> = [
        (1, vec![LEN]),
        (2, vec![LEN]),
        (3, vec![LEN]),
        (4, vec![VARINT]),
        (5, vec![LEN]),
        (6, vec![LEN]),
    ]
    .into_iter()
    .collect();
    assert_eq!(layout(&buf), expected);
    assert_eq!(string_field(&buf, 1), "vol-4");
    assert_eq!(string_field(&buf, 2), "node-a");
    assert_eq!(
        map_field(&buf, 5),
        BTreeMap::from([("s".into(), "1".into())])
    );
    assert_eq!(
        map_field(&buf, 6),
        BTreeMap::from([("c".into(), "2".into())])
    );

    let resp = proto::ControllerPublishVolumeResponse {
        publish_context: one("device", "/dev/sdb"),
    }
    .encode_to_vec();
    assert_eq!(
        map_field(&resp, 1),
        BTreeMap::from([("device".into(), "/dev/sdb".into())])
    );

    let unpublish = proto::ControllerUnpublishVolumeRequest {
        volume_id: "vol-4".into(),
        node_id: "node-a".into(),
        secrets: one("s", "1"),
    }
    .encode_to_vec();
    assert_eq!(
        layout(&unpublish).keys().copied().collect::<Vec<_>>(),
        [1, 2, 3]
    );
    assert_eq!(string_field(&unpublish, 2), "node-a");
}

#[test]
fn volume_capability_oneof_and_nested_numbers() {
    let block = proto::VolumeCapability {
        access_type: Some(proto::volume_capability::AccessType::Block(
            proto::volume_capability::BlockVolume {},
        )),
        access_mode: Some(proto::volume_capability::AccessMode {
            mode: proto::volume_capability::access_mode::Mode::SingleNodeReaderOnly as i32,
        }),
    }
    .encode_to_vec();
    // block = 1 (an empty message still appears once set), access_mode = 3.
    assert_eq!(
        only(&block, 1),
        Field {
            number: 1,
            wire_type: LEN,
            varint: 0,
            payload: vec![]
        }
    );
    assert_eq!(only(&only(&block, 3).payload, 1).varint, 2);
    assert!(fields(&block).iter().all(|f| f.number != 2));

    let mount =
        mount_capability(proto::volume_capability::access_mode::Mode::SingleNodeMultiWriter)
            .encode_to_vec();
    assert_eq!(layout(&mount).keys().copied().collect::<Vec<_>>(), [2, 3]);
    let mv = only(&mount, 2).payload;
    assert_eq!(string_field(&mv, 1), "ext4", "MountVolume.fs_type = 1");
    assert_eq!(
        layout(&mv)[&2],
        [LEN, LEN],
        "MountVolume.mount_flags = 2, repeated"
    );
    assert_eq!(
        string_field(&mv, 3),
        "1000",
        "MountVolume.volume_mount_group = 3"
    );
    assert_eq!(
        only(&only(&mount, 3).payload, 1).varint,
        7,
        "AccessMode.mode = 1"
    );
}

#[test]
fn access_mode_enum_values_match_spec() {
    use proto::volume_capability::access_mode::Mode;
    let table = [
        (Mode::Unknown, 0, "UNKNOWN"),
        (Mode::SingleNodeWriter, 1, "SINGLE_NODE_WRITER"),
        (Mode::SingleNodeReaderOnly, 2, "SINGLE_NODE_READER_ONLY"),
        (Mode::MultiNodeReaderOnly, 3, "MULTI_NODE_READER_ONLY"),
        (Mode::MultiNodeSingleWriter, 4, "MULTI_NODE_SINGLE_WRITER"),
        (Mode::MultiNodeMultiWriter, 5, "MULTI_NODE_MULTI_WRITER"),
        (Mode::SingleNodeSingleWriter, 6, "SINGLE_NODE_SINGLE_WRITER"),
        (Mode::SingleNodeMultiWriter, 7, "SINGLE_NODE_MULTI_WRITER"),
    ];
    for (mode, number, name) in table {
        assert_eq!(mode as i32, number, "{name}");
        assert_eq!(mode.as_str_name(), name);
        assert_eq!(Mode::try_from(number), Ok(mode));
        assert_eq!(Mode::from_str_name(name), Some(mode));
    }
    assert!(Mode::try_from(8).is_err(), "no access mode 8 in the spec");
}

#[test]
fn capability_enum_values_match_spec() {
    use proto::controller_service_capability::rpc::Type as Ctrl;
    let ctrl = [
        (Ctrl::CreateDeleteVolume, 1),
        (Ctrl::PublishUnpublishVolume, 2),
        (Ctrl::ListVolumes, 3),
        (Ctrl::GetCapacity, 4),
        (Ctrl::CreateDeleteSnapshot, 5),
        (Ctrl::ListSnapshots, 6),
        (Ctrl::CloneVolume, 7),
        (Ctrl::PublishReadonly, 8),
        (Ctrl::ExpandVolume, 9),
        (Ctrl::ListVolumesPublishedNodes, 10),
        (Ctrl::VolumeCondition, 11),
        (Ctrl::GetVolume, 12),
        (Ctrl::SingleNodeMultiWriter, 13),
        (Ctrl::ModifyVolume, 14),
        (Ctrl::GetSnapshot, 15),
    ];
    for (t, n) in ctrl {
        assert_eq!(t as i32, n, "{}", t.as_str_name());
    }

    use proto::node_service_capability::rpc::Type as Node;
    let node = [
        (Node::StageUnstageVolume, 1),
        (Node::GetVolumeStats, 2),
        (Node::ExpandVolume, 3),
        (Node::VolumeCondition, 4),
        (Node::SingleNodeMultiWriter, 5),
        (Node::VolumeMountGroup, 6),
    ];
    for (t, n) in node {
        assert_eq!(t as i32, n, "{}", t.as_str_name());
    }

    use proto::plugin_capability::service::Type as Svc;
    assert_eq!(Svc::ControllerService as i32, 1);
    assert_eq!(Svc::VolumeAccessibilityConstraints as i32, 2);
    assert_eq!(Svc::GroupControllerService as i32, 3);
    assert_eq!(Svc::SnapshotMetadataService as i32, 4);
    use proto::plugin_capability::volume_expansion::Type as Exp;
    assert_eq!((Exp::Online as i32, Exp::Offline as i32), (1, 2));
    use proto::volume_usage::Unit;
    assert_eq!((Unit::Bytes as i32, Unit::Inodes as i32), (1, 2));
    assert_eq!(proto::BlockMetadataType::VariableLength as i32, 2);
    use proto::group_controller_service_capability::rpc::Type as Group;
    assert_eq!(Group::CreateDeleteGetVolumeGroupSnapshot as i32, 1);
}

#[test]
fn capability_oneofs_on_the_wire() {
    // NodeGetCapabilitiesResponse.capabilities = 1 -> NodeServiceCapability
    // oneof type { rpc = 1 } -> RPC.type = 1.
    let resp = proto::NodeGetCapabilitiesResponse {
        capabilities: vec![proto::NodeServiceCapability {
            r#type: Some(proto::node_service_capability::Type::Rpc(
                proto::node_service_capability::Rpc {
                    r#type: proto::node_service_capability::rpc::Type::StageUnstageVolume as i32,
                },
            )),
        }],
    }
    .encode_to_vec();
    let cap = only(&resp, 1).payload;
    assert_eq!(only(&only(&cap, 1).payload, 1).varint, 1);

    // PluginCapability oneof type { service = 1; volume_expansion = 2 }.
    let expansion = proto::PluginCapability {
        r#type: Some(proto::plugin_capability::Type::VolumeExpansion(
            proto::plugin_capability::VolumeExpansion {
                r#type: proto::plugin_capability::volume_expansion::Type::Offline as i32,
            },
        )),
    }
    .encode_to_vec();
    assert_eq!(only(&only(&expansion, 2).payload, 1).varint, 2);

    // ProbeResponse.ready = 1 is a google.protobuf.BoolValue { value = 1 }.
    let probe = proto::ProbeResponse { ready: Some(true) }.encode_to_vec();
    assert_eq!(only(&only(&probe, 1).payload, 1).varint, 1);
}

#[test]
fn node_info_and_stats_field_numbers() {
    let info = proto::NodeGetInfoResponse {
        node_id: "node-b".into(),
        max_volumes_per_node: 16,
        accessible_topology: Some(proto::Topology {
            segments: one("zone", "z2"),
        }),
    }
    .encode_to_vec();
    assert_eq!(string_field(&info, 1), "node-b");
    assert_eq!(only(&info, 2).varint, 16);
    assert_eq!(map_field(&only(&info, 3).payload, 1).len(), 1);

    let stats = proto::NodeGetVolumeStatsResponse {
        usage: vec![proto::VolumeUsage {
            available: 1,
            total: 3,
            used: 2,
            unit: proto::volume_usage::Unit::Bytes as i32,
        }],
        volume_condition: Some(proto::VolumeCondition {
            abnormal: true,
            message: "io errors".into(),
        }),
    }
    .encode_to_vec();
    let usage = only(&stats, 1).payload;
    let got: Vec<(u64, u64)> = fields(&usage)
        .iter()
        .map(|f| (f.number, f.varint))
        .collect();
    assert_eq!(got, [(1, 1), (2, 3), (3, 2), (4, 1)]);
    let condition = only(&stats, 2).payload;
    assert_eq!(only(&condition, 1).varint, 1);
    assert_eq!(string_field(&condition, 2), "io errors");
}

#[test]
fn snapshot_timestamp_and_services_exist() {
    let snap = proto::Snapshot {
        size_bytes: 10,
        snapshot_id: "snap-2".into(),
        source_volume_id: "vol-5".into(),
        creation_time: Some(prost_types::Timestamp {
            seconds: 1_700_000_000,
            nanos: 5,
        }),
        ready_to_use: true,
        group_snapshot_id: "group-1".into(),
    }
    .encode_to_vec();
    assert_eq!(
        layout(&snap).keys().copied().collect::<Vec<_>>(),
        [1, 2, 3, 4, 5, 6]
    );
    let ts = only(&snap, 4).payload;
    assert_eq!(only(&ts, 1).varint, 1_700_000_000);
    assert_eq!(only(&ts, 2).varint, 5);
    assert_eq!(string_field(&snap, 6), "group-1");

    // Every service of the spec is generated with client and server.
    fn named<T>() -> &'static str {
        std::any::type_name::<T>()
    }
    let names = [
        named::<proto::identity_client::IdentityClient<tonic::transport::Channel>>(),
        named::<proto::controller_client::ControllerClient<tonic::transport::Channel>>(),
        named::<proto::group_controller_client::GroupControllerClient<tonic::transport::Channel>>(),
        named::<proto::snapshot_metadata_client::SnapshotMetadataClient<tonic::transport::Channel>>(
        ),
        named::<proto::node_client::NodeClient<tonic::transport::Channel>>(),
    ];
    for (name, service) in names.iter().zip([
        "IdentityClient",
        "ControllerClient",
        "GroupControllerClient",
        "SnapshotMetadataClient",
        "NodeClient",
    ]) {
        assert!(name.contains(service), "{name}");
    }
}
