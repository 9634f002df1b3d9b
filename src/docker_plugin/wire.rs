//! The Docker volume plugin protocol's messages (moby's
//! `docs/extend/plugins_volume.md`, protocol 1.2): JSON bodies of `POST`s,
//! field names as the engine writes them.
//!
//! Requests are parsed leniently where the engines differ: Docker sends
//! `Opts` as `{}` or `null`, Podman leaves it out when empty; `ID` is
//! absent outside `Mount` and `Unmount`. Unknown fields are ignored (a
//! newer engine may add some). Every answer carries `Err`, empty on success;
//! an error is sent with a non-200 status too, since Podman takes any 200 as
//! success.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// The content type of every request and answer.
pub const CONTENT_TYPE: &str = "application/vnd.docker.plugins.v1.2+json";

/// The body of `Create`, `Remove`, `Mount`, `Unmount`, `Path` and `Get`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Request {
    /// The volume name.
    #[serde(rename = "Name", default)]
    pub name: String,
    /// `Create`'s options (`docker volume create -o KEY=VALUE`).
    #[serde(rename = "Opts", default)]
    pub opts: Option<BTreeMap<String, String>>,
    /// `Mount`'s and `Unmount`'s caller: one use of the volume.
    #[serde(rename = "ID", default)]
    pub id: Option<String>,
}

/// `Plugin.Activate`'s answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Activated {
    /// The plugin subsystems served.
    #[serde(rename = "Implements")]
    pub implements: Vec<&'static str>,
}

/// `VolumeDriver.Capabilities`' answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Capabilities {
    /// The capabilities.
    #[serde(rename = "Capabilities")]
    pub capabilities: Scope,
}

/// Where the driver's volumes are visible: `local` (this host) or `global`
/// (the cluster: the engine creates a volume once for all hosts).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Scope {
    /// `local` or `global`.
    #[serde(rename = "Scope")]
    pub scope: &'static str,
}

/// The answer of `Create`, `Remove`, `Unmount`: only `Err`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Done {
    /// The error, empty on success.
    #[serde(rename = "Err")]
    pub err: String,
}

/// The answer of `Mount` and `Path`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MountPoint {
    /// The host path of the volume (empty when it is not published).
    #[serde(rename = "Mountpoint")]
    pub mountpoint: String,
    /// The error, empty on success.
    #[serde(rename = "Err")]
    pub err: String,
}

/// One volume as `Get` and `List` show it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Volume {
    /// The name.
    #[serde(rename = "Name")]
    pub name: String,
    /// The host path while it is published, else empty.
    #[serde(rename = "Mountpoint")]
    pub mountpoint: String,
    /// What `docker volume inspect` shows under `Status` (only from `Get`).
    #[serde(rename = "Status", skip_serializing_if = "Option::is_none")]
    pub status: Option<Status>,
}

/// A volume's status, from the provider's record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Status {
    /// The CSI volume id.
    pub volume_id: String,
    /// The plugin (`<type>/<name>`, the provider id).
    pub plugin: String,
    /// The provider's state of the volume (`VOL_READY`, `PUBLISHED`, ...).
    pub state: String,
    /// Its capacity in bytes (0: unknown).
    pub capacity_bytes: u64,
    /// The Mount IDs using it.
    pub users: BTreeSet<String>,
    /// Whether it was imported (`volume-id`): then `docker volume rm` only
    /// forgets it, the plugin keeps it.
    pub imported: bool,
    /// Its usage, asked of the plugin at this `Get` while it is published (when the plugin
    /// offers GET_VOLUME_STATS).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stats: Option<crate::provider::stats::VolumeStats>,
    /// Its condition, when the plugin offers VOLUME_CONDITION.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub condition: Option<crate::provider::stats::VolumeCondition>,
    /// Why its stats were asked for and are missing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stats_unavailable: Option<String>,
}

/// `Get`'s answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Got {
    /// The volume.
    #[serde(rename = "Volume")]
    pub volume: Volume,
    /// The error, empty on success.
    #[serde(rename = "Err")]
    pub err: String,
}

/// `List`'s answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Listed {
    /// Every named volume of the provider.
    #[serde(rename = "Volumes")]
    pub volumes: Vec<Volume>,
    /// The error, empty on success.
    #[serde(rename = "Err")]
    pub err: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_as_each_engine_sends_them() {
        for (body, name, opts, id) in [
            (r#"{"Name":"v","Opts":{}}"#, "v", Some(0), None),
            (r#"{"Name":"v","Opts":null}"#, "v", None, None),
            (r#"{"Name":"v"}"#, "v", None, None),
            (r#"{"Name":"v","Opts":{"size":"1G"}}"#, "v", Some(1), None),
            (r#"{"Name":"v","ID":"abc"}"#, "v", None, Some("abc")),
            (r#"{"Name":"v","ID":"abc","New":1}"#, "v", None, Some("abc")),
            ("{}", "", None, None),
        ] {
            let r: Request = serde_json::from_str(body).unwrap();
            assert_eq!(r.name, name, "{body}");
            assert_eq!(r.opts.map(|o| o.len()), opts, "{body}");
            assert_eq!(r.id.as_deref(), id, "{body}");
        }
        for bad in [r#"{"Name":1}"#, r#"{"Opts":{"a":1}}"#, "[", ""] {
            assert!(serde_json::from_str::<Request>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn answers_use_the_engines_field_names() {
        let got = Got {
            volume: Volume {
                name: "v".into(),
                mountpoint: "/m".into(),
                status: None,
            },
            err: String::new(),
        };
        assert_eq!(
            serde_json::to_string(&got).unwrap(),
            r#"{"Volume":{"Name":"v","Mountpoint":"/m"},"Err":""}"#
        );
        let caps = Capabilities {
            capabilities: Scope { scope: "local" },
        };
        assert_eq!(
            serde_json::to_string(&caps).unwrap(),
            r#"{"Capabilities":{"Scope":"local"}}"#
        );
    }
}
