//! `Create`'s options (`docker volume create -o KEY=VALUE`, `--mount
//! ...,volume-opt=KEY=VALUE`): what to create or import. Pure, table-tested.
//!
//! Options are untrusted input from whoever may run the engine's CLI (on a
//! rootless Podman host, any user). Ours are read and checked here; every
//! other key is a CreateVolume parameter (or, for an import, a volume
//! context entry) and passes [`parameters::check`] before anything is
//! written or sent, so a key outside CSI's bounds or one naming a secret is
//! refused by name. No option names a host path or a plugin.

use std::collections::BTreeMap;

use crate::provider::mount_spec::{Key, OptionError, VolumeOptions};
use crate::provider::{parameters, AccessType, Capability, CreateSpec, ImportSpec};
use crate::shown::shown;

/// Import the plugin's volume of this id instead of creating one.
pub const VOLUME_ID: &str = "volume-id";
/// What a `Create` asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    /// A new volume (or the existing one of that name, with the same parameters).
    Create(CreateSpec),
    /// A volume the plugin has already, recorded under the name, with its secrets file.
    Import(ImportSpec, Option<std::path::PathBuf>),
}

/// An option that cannot be used, named: the one parser's error ([`crate::provider::mount_spec`]).
pub type OptError = OptionError;

fn refuse(key: &str, reason: impl Into<String>) -> OptError {
    OptError {
        key: shown(key).into_owned(),
        reason: reason.into(),
    }
}

/// The plan of `Create {Name: name, Opts: opts}`.
pub fn plan(name: &str, opts: &BTreeMap<String, String>) -> Result<Plan, OptError> {
    let mut options = VolumeOptions::default();
    let mut rest = BTreeMap::new();
    let mut volume_id = None;
    for (key, value) in opts {
        match (Key::from_name(key), key.as_str()) {
            (Some(k), _) if k.is_volume_option() => options.set(k, key, value)?,
            (Some(_), _) => {
                return Err(refuse(
                    key,
                    "is set per container by the engine (`docker run --mount ...,readonly`), not on the volume",
                ))
            }
            (None, VOLUME_ID) if value.is_empty() => return Err(refuse(key, "empty value")),
            (None, VOLUME_ID) => volume_id = Some(value.clone()),
            _ => {
                rest.insert(key.clone(), value.clone());
            }
        }
    }
    if options.access_type == Some(AccessType::Block) {
        return Err(refuse(
            "type",
            "block volumes cannot be Docker volumes (the engine mounts a volume's directory; \
             hand a block volume to a container with serve's PrepareOci, which gives `--device`)",
        ));
    }
    let mut capability = Capability::default();
    options.apply(&mut capability);
    let capacity_bytes = options.size_bytes.unwrap_or(0);
    parameters::check(&rest).map_err(|e| match &e {
        parameters::ParameterError::BadKey { key, .. }
        | parameters::ParameterError::BadValue { key }
        | parameters::ParameterError::Secret { key } => OptError {
            key: key.clone(),
            reason: e.to_string(),
        },
        _ => refuse("*", e.to_string()),
    })?;
    Ok(match volume_id {
        Some(volume_id) => Plan::Import(
            ImportSpec {
                name: name.to_string(),
                volume_id,
                capacity_bytes,
                capability,
                volume_context: rest,
            },
            options.secrets,
        ),
        None => {
            let mut spec = CreateSpec::new(name, capacity_bytes);
            spec.capability = capability;
            spec.parameters = rest;
            spec.secrets_file = options.secrets;
            Plan::Create(spec)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn options_become_a_create_or_an_import() {
        let Plan::Create(spec) = plan(
            "v",
            &opts(&[
                ("size", "64M"),
                ("access-mode", "MULTI_NODE_MULTI_WRITER"),
                ("fs-type", "ext4"),
                ("mount-flags", "noatime,nodiratime"),
                ("server", "nfs.example.com"),
            ]),
        )
        .unwrap() else {
            panic!("a create")
        };
        assert_eq!(spec.name, "v");
        assert_eq!(spec.capacity_bytes, 64 << 20);
        assert_eq!(spec.capability.access_mode, "MULTI_NODE_MULTI_WRITER");
        assert_eq!(spec.capability.fs_type, "ext4");
        assert_eq!(spec.capability.mount_flags, ["noatime", "nodiratime"]);
        assert_eq!(spec.parameters, opts(&[("server", "nfs.example.com")]));

        assert_eq!(
            plan("v", &BTreeMap::new()).unwrap(),
            Plan::Create(CreateSpec::new("v", 0)),
            "no options: the plugin's default size"
        );

        let Plan::Import(spec, _) = plan(
            "old",
            &opts(&[("volume-id", "nfs#a#b"), ("size", "1G"), ("share", "/x")]),
        )
        .unwrap() else {
            panic!("an import")
        };
        assert_eq!(spec.volume_id, "nfs#a#b");
        assert_eq!(spec.capacity_bytes, 1 << 30);
        assert_eq!(spec.volume_context, opts(&[("share", "/x")]));
    }

    #[test]
    fn a_secrets_file_reaches_the_create_and_the_import() {
        let Plan::Create(spec) = plan("v", &opts(&[("secrets", "/etc/csi/v.json")])).unwrap()
        else {
            panic!("a create")
        };
        assert_eq!(
            spec.secrets_file.as_deref(),
            Some(std::path::Path::new("/etc/csi/v.json"))
        );
        let Plan::Import(_, secrets) = plan(
            "old",
            &opts(&[("volume-id", "x"), ("secrets", "/etc/csi/old.json")]),
        )
        .unwrap() else {
            panic!("an import")
        };
        assert_eq!(
            secrets.as_deref(),
            Some(std::path::Path::new("/etc/csi/old.json"))
        );
        let e = plan("v", &opts(&[("secrets", "relative.json")])).unwrap_err();
        assert!(e.to_string().contains("not an absolute path"), "{e}");
    }

    #[test]
    fn bad_options_are_refused_by_name() {
        for (pairs, key, says) in [
            (&[("size", "big")][..], "size", "invalid size 'big'"),
            (&[("size", "0")], "size", "above 0"),
            (&[("size", "")], "size", "empty value"),
            (
                &[("access-mode", "RW")],
                "access-mode",
                "unknown CSI access mode 'RW'",
            ),
            (
                &[("fs-type", "ext4 -o x")],
                "fs-type",
                "not a filesystem type",
            ),
            (&[("mount-flags", "a,,b")], "mount-flags", "empty"),
            (&[("volume-id", "")], "volume-id", "empty value"),
            (&[("bad key", "x")], "bad key", "parameter key"),
            (
                &[("csi.storage.k8s.io/secret", "x")],
                "csi.storage.k8s.io/secret",
                "secret",
            ),
            (&[("k", "a\nb")], "k", "control character"),
            (
                &[("readonly", "true")],
                "readonly",
                "set per container by the engine",
            ),
            (&[("target", "/x")], "target", "set per container"),
            (&[("type", "tape")], "type", "unknown type 'tape'"),
            (&[("type", "block")], "type", "cannot be Docker volumes"),
        ] {
            let e = plan("v", &opts(pairs)).unwrap_err();
            assert_eq!(e.key, key, "{pairs:?}: {e}");
            assert!(e.to_string().contains(says), "{pairs:?}: {e}");
            assert!(e.to_string().contains(&format!("option '{key}'")), "{e}");
        }
    }
}
