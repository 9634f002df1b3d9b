//! CSI secrets: the per-operation secrets file's format, the map that carries one operation's
//! secrets without ever showing their values, and which RPC takes which operation's secrets.
//!
//! Contract:
//! - A secrets file is one JSON object whose keys are operations ([`Operation::key`]):
//!   `create`, `controller_publish`, `node_stage`, `node_publish`, `controller_expand`,
//!   `node_expand`, `snapshot`; each value is an object of string keys to string values, the `secrets` map
//!   of that operation's RPCs. An unknown operation is refused by name; a key the CSI spec does
//!   not allow (letters, digits, `-`, `_`, `.`), a value that is not a string, more than
//!   [`MAX_KEYS`] keys are refused naming the operation and the key, never the value.
//! - Which RPC carries which operation's secrets is [`Operation::of_rpc`], the one table: as in
//!   Kubernetes, `create` feeds CreateVolume and DeleteVolume, `controller_publish` feeds
//!   ControllerPublishVolume and ControllerUnpublishVolume, `snapshot` feeds CreateSnapshot and
//!   DeleteSnapshot (Kubernetes' snapshotter secrets); NodeUnstageVolume and
//!   NodeUnpublishVolume carry no secrets in CSI. An operation the file leaves out sends none.
//! - [`Secrets`] never shows a value: its `Debug` lists the keys only, it has no `Display`,
//!   and errors of this module name keys at most. Parse errors of the JSON give the position,
//!   never the text around it.
//! - Reading the file (owner-only, checked by fd) is the caller's: `provider::secrets` for
//!   csi-isolator, the bundled plugin for `--require-secrets`; both parse it here.

use std::collections::{BTreeMap, HashMap};

/// The most keys one operation's secrets may hold.
pub const MAX_KEYS: usize = 128;
/// The longest key, in bytes (CSI's limit for strings).
pub const MAX_KEY_BYTES: usize = 128;
/// The largest secrets file read, in bytes.
pub const MAX_FILE_BYTES: u64 = 64 * 1024;

/// An operation whose RPCs carry secrets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Operation {
    /// CreateVolume and DeleteVolume.
    Create,
    /// ControllerPublishVolume and ControllerUnpublishVolume.
    ControllerPublish,
    /// NodeStageVolume.
    NodeStage,
    /// NodePublishVolume.
    NodePublish,
    /// ControllerExpandVolume.
    ControllerExpand,
    /// NodeExpandVolume.
    NodeExpand,
    /// CreateSnapshot and DeleteSnapshot.
    Snapshot,
}

impl Operation {
    /// Every operation, in the order of the file's documentation.
    pub const ALL: [Operation; 7] = [
        Operation::Create,
        Operation::ControllerPublish,
        Operation::NodeStage,
        Operation::NodePublish,
        Operation::ControllerExpand,
        Operation::NodeExpand,
        Operation::Snapshot,
    ];

    /// Its key in a secrets file.
    pub fn key(self) -> &'static str {
        match self {
            Operation::Create => "create",
            Operation::ControllerPublish => "controller_publish",
            Operation::NodeStage => "node_stage",
            Operation::NodePublish => "node_publish",
            Operation::ControllerExpand => "controller_expand",
            Operation::NodeExpand => "node_expand",
            Operation::Snapshot => "snapshot",
        }
    }

    /// The operation whose secrets the CSI RPC `rpc` (its name, e.g. `DeleteVolume`) carries;
    /// `None` for an RPC that carries none from a secrets file.
    pub fn of_rpc(rpc: &str) -> Option<Operation> {
        Some(match rpc {
            "CreateVolume" | "DeleteVolume" => Operation::Create,
            "ControllerPublishVolume" | "ControllerUnpublishVolume" => Operation::ControllerPublish,
            "NodeStageVolume" => Operation::NodeStage,
            "NodePublishVolume" => Operation::NodePublish,
            "ControllerExpandVolume" => Operation::ControllerExpand,
            "NodeExpandVolume" => Operation::NodeExpand,
            "CreateSnapshot" | "DeleteSnapshot" => Operation::Snapshot,
            _ => return None,
        })
    }

    fn from_key(key: &str) -> Option<Operation> {
        Operation::ALL.into_iter().find(|op| op.key() == key)
    }
}

/// One operation's secrets: a CSI `secrets` map whose values are never shown (see the
/// module doc). Put into an outgoing request with [`Secrets::to_request`] only.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secrets(BTreeMap<String, String>);

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secrets")
            .field("keys", &self.0.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl Secrets {
    /// The secrets a request carries (its `secrets` field), to redact the plugin's answers.
    pub fn of_request(map: &HashMap<String, String>) -> Secrets {
        Secrets(map.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The keys (never the values).
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }

    /// The map for a request's `secrets` field: the only way the values leave this type.
    pub fn to_request(&self) -> HashMap<String, String> {
        self.0.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }

    /// `text` with every value replaced by `<redacted>`: for a message a plugin sent back
    /// about a call that carried these secrets (a plugin may echo what it got).
    pub fn redact(&self, text: &str) -> String {
        let mut values: Vec<&str> = self
            .0
            .values()
            .map(String::as_str)
            .filter(|v| !v.is_empty())
            .collect();
        // The longest first: a value containing another is replaced whole.
        values.sort_by_key(|v| std::cmp::Reverse(v.len()));
        let mut out = text.to_string();
        for v in values {
            if out.contains(v) {
                out = out.replace(v, "<redacted>");
            }
        }
        out
    }

    /// How `got` (a request's `secrets`) differs from these, the expected ones: the first key
    /// missing, unexpected or with another value. Names keys only.
    pub fn mismatch(&self, got: &HashMap<String, String>) -> Option<Mismatch> {
        for (key, value) in &self.0 {
            match got.get(key) {
                None => return Some(Mismatch::Missing(key.clone())),
                Some(v) if v != value => return Some(Mismatch::Differs(key.clone())),
                Some(_) => {}
            }
        }
        let mut extra: Vec<&String> = got.keys().filter(|k| !self.0.contains_key(*k)).collect();
        extra.sort();
        extra
            .first()
            .map(|k| Mismatch::Unexpected(crate::shown::shown(k).into_owned()))
    }
}

impl<const N: usize> From<[(&str, &str); N]> for Secrets {
    fn from(pairs: [(&str, &str); N]) -> Secrets {
        Secrets(
            pairs
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }
}

/// How a request's secrets differ from the expected ones (keys only, never values).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Mismatch {
    /// An expected key is not there.
    #[error("secret '{0}' is missing")]
    Missing(String),
    /// A key is there with another value.
    #[error("secret '{0}' has another value")]
    Differs(String),
    /// A key nobody expects (shown escaped).
    #[error("secret '{0}' is not expected")]
    Unexpected(String),
}

impl Mismatch {
    /// Whether the secrets were there but wrong (the caller is not who it claims), rather than
    /// malformed: UNAUTHENTICATED rather than INVALID_ARGUMENT.
    pub fn is_wrong_value(&self) -> bool {
        matches!(self, Mismatch::Differs(_))
    }
}

/// The secrets of every operation, as a secrets file gives them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SecretsFile {
    ops: BTreeMap<Operation, Secrets>,
}

/// Why a secrets file's content is refused (never quoting a value).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// Not JSON (the position only).
    #[error("not JSON ({what} at line {line}, column {column})")]
    Syntax {
        /// serde_json's category of the error.
        what: &'static str,
        /// Where.
        line: usize,
        /// Where.
        column: usize,
    },
    /// The top level is not an object.
    #[error("not a JSON object of operations ({})", known_operations())]
    NotAnObject,
    /// An operation this version does not know.
    #[error("unknown operation '{0}' (known: {known})", known = known_operations())]
    UnknownOperation(String),
    /// An operation whose value is not an object.
    #[error("operation '{0}' is not an object of secret names to values")]
    OperationNotAnObject(&'static str),
    /// Too many keys in one operation.
    #[error("operation '{op}' has {count} secrets, over the limit of {MAX_KEYS}")]
    TooManyKeys {
        /// The operation.
        op: &'static str,
        /// How many.
        count: usize,
    },
    /// A key CSI does not allow.
    #[error("operation '{op}': secret name '{key}' {reason}")]
    BadKey {
        /// The operation.
        op: &'static str,
        /// The key, escaped and shortened.
        key: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// A value that is not a string.
    #[error("operation '{op}': the value of secret '{key}' is not a string")]
    NotAString {
        /// The operation.
        op: &'static str,
        /// The key.
        key: String,
    },
}

fn known_operations() -> String {
    Operation::ALL.map(Operation::key).join(", ")
}

/// CSI's rule for a secret's key: alphanumeric characters, `-`, `_` or `.`.
fn check_key(key: &str) -> Result<(), &'static str> {
    if key.is_empty() {
        return Err("is empty");
    }
    if key.len() > MAX_KEY_BYTES {
        return Err("is over 128 bytes");
    }
    if !key
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err("holds a character CSI does not allow (letters, digits, '-', '_', '.')");
    }
    Ok(())
}

impl SecretsFile {
    /// Parses a secrets file's bytes (see the module doc).
    pub fn parse(bytes: &[u8]) -> Result<SecretsFile, FormatError> {
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| FormatError::Syntax {
                what: match e.classify() {
                    serde_json::error::Category::Eof => "unexpected end",
                    serde_json::error::Category::Syntax => "syntax error",
                    serde_json::error::Category::Data => "bad data",
                    serde_json::error::Category::Io => "read error",
                },
                line: e.line(),
                column: e.column(),
            })?;
        let serde_json::Value::Object(top) = value else {
            return Err(FormatError::NotAnObject);
        };
        let mut ops = BTreeMap::new();
        for (name, entries) in top {
            let op = Operation::from_key(&name).ok_or_else(|| {
                FormatError::UnknownOperation(crate::shown::shown(&name).into_owned())
            })?;
            let serde_json::Value::Object(entries) = entries else {
                return Err(FormatError::OperationNotAnObject(op.key()));
            };
            if entries.len() > MAX_KEYS {
                return Err(FormatError::TooManyKeys {
                    op: op.key(),
                    count: entries.len(),
                });
            }
            let mut map = BTreeMap::new();
            for (key, value) in entries {
                check_key(&key).map_err(|reason| FormatError::BadKey {
                    op: op.key(),
                    key: crate::shown::shown(&key).into_owned(),
                    reason,
                })?;
                let serde_json::Value::String(value) = value else {
                    return Err(FormatError::NotAString { op: op.key(), key });
                };
                map.insert(key, value);
            }
            ops.insert(op, Secrets(map));
        }
        Ok(SecretsFile { ops })
    }

    /// The secrets of `op` (none when the file leaves it out).
    pub fn get(&self, op: Operation) -> Secrets {
        self.ops.get(&op).cloned().unwrap_or_default()
    }

    /// The secrets the RPC `rpc` carries ([`Operation::of_rpc`]); none for an RPC without.
    pub fn for_rpc(&self, rpc: &str) -> Secrets {
        Operation::of_rpc(rpc)
            .map(|op| self.get(op))
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALUE: &str = "s3cr3t-value";

    #[test]
    fn every_operation_parses_and_feeds_its_rpcs() {
        let text = serde_json::json!({
            "create": {"k": "create-v"},
            "controller_publish": {"k": "cp-v"},
            "node_stage": {"user.name": "ns-v", "pass_word-1": VALUE},
            "node_publish": {"k": "np-v"},
            "controller_expand": {"k": "ce-v"},
            "node_expand": {"k": "ne-v"},
            "snapshot": {"k": "sn-v"},
        })
        .to_string();
        let file = SecretsFile::parse(text.as_bytes()).unwrap();
        let value = |rpc: &str, key: &str| file.for_rpc(rpc).to_request().get(key).cloned();
        for (rpc, want) in [
            ("CreateVolume", "create-v"),
            ("DeleteVolume", "create-v"),
            ("ControllerPublishVolume", "cp-v"),
            ("ControllerUnpublishVolume", "cp-v"),
            ("NodePublishVolume", "np-v"),
            ("ControllerExpandVolume", "ce-v"),
            ("NodeExpandVolume", "ne-v"),
            ("CreateSnapshot", "sn-v"),
            ("DeleteSnapshot", "sn-v"),
        ] {
            assert_eq!(value(rpc, "k").as_deref(), Some(want), "{rpc}");
        }
        assert_eq!(
            value("NodeStageVolume", "pass_word-1").as_deref(),
            Some(VALUE)
        );
        for rpc in [
            "NodeUnstageVolume",
            "NodeUnpublishVolume",
            "ValidateVolumeCapabilities",
        ] {
            assert!(file.for_rpc(rpc).is_empty(), "{rpc}");
        }
    }

    #[test]
    fn an_operation_left_out_sends_none() {
        let file = SecretsFile::parse(br#"{"node_stage": {"k": "v"}}"#).unwrap();
        assert!(file.for_rpc("CreateVolume").is_empty());
        assert!(SecretsFile::parse(b"{}")
            .unwrap()
            .get(Operation::NodeStage)
            .is_empty());
    }

    #[test]
    fn bad_content_is_refused_by_name_never_by_value() {
        let big: serde_json::Map<String, serde_json::Value> = (0..=MAX_KEYS)
            .map(|i| (format!("k{i}"), serde_json::Value::from(VALUE)))
            .collect();
        let cases: Vec<(String, &str)> = vec![
            (format!("{{\"create\": {{\"k\": \"{VALUE}\""), "not JSON"),
            (format!("[\"{VALUE}\"]"), "not a JSON object"),
            (format!("\"{VALUE}\""), "not a JSON object"),
            (
                format!("{{\"node_unstage\": {{\"k\": \"{VALUE}\"}}}}"),
                "unknown operation 'node_unstage'",
            ),
            (
                format!("{{\"create\": \"{VALUE}\"}}"),
                "operation 'create' is not an object",
            ),
            (
                format!("{{\"node_stage\": {{\"k\": [\"{VALUE}\"]}}}}"),
                "the value of secret 'k' is not a string",
            ),
            (
                format!("{{\"node_stage\": {{\"a b\": \"{VALUE}\"}}}}"),
                "secret name 'a b' holds a character",
            ),
            (
                format!("{{\"node_stage\": {{\"\": \"{VALUE}\"}}}}"),
                "secret name '' is empty",
            ),
            (
                serde_json::json!({ "create": big }).to_string(),
                "over the limit of 128",
            ),
        ];
        for (text, want) in cases {
            let err = SecretsFile::parse(text.as_bytes()).unwrap_err().to_string();
            assert!(err.contains(want), "{text}: {err}");
            assert!(!err.contains(VALUE), "{text}: the value shows in {err}");
        }
    }

    #[test]
    fn debug_shows_keys_never_values() {
        let s = Secrets::from([("username", "bob"), ("password", VALUE)]);
        let shown = format!(
            "{s:?} {:?}",
            SecretsFile::parse(br#"{"create": {"password": "s3cr3t-value"}}"#).unwrap()
        );
        assert!(shown.contains("password"), "{shown}");
        assert!(!shown.contains(VALUE) && !shown.contains("bob"), "{shown}");
    }

    #[test]
    fn mismatch_names_the_first_key_that_differs() {
        let want = Secrets::from([("a", "1"), ("b", "2")]);
        let got = |pairs: &[(&str, &str)]| -> HashMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(want.mismatch(&got(&[("a", "1"), ("b", "2")])), None);
        assert_eq!(
            want.mismatch(&got(&[("a", "1")])),
            Some(Mismatch::Missing("b".into()))
        );
        let differs = want.mismatch(&got(&[("a", "1"), ("b", VALUE)])).unwrap();
        assert_eq!(differs, Mismatch::Differs("b".into()));
        assert!(differs.is_wrong_value());
        assert!(!differs.to_string().contains(VALUE));
        assert_eq!(
            want.mismatch(&got(&[("a", "1"), ("b", "2"), ("c", "3")])),
            Some(Mismatch::Unexpected("c".into()))
        );
        assert_eq!(
            Secrets::default().mismatch(&got(&[("x", "1")])),
            Some(Mismatch::Unexpected("x".into()))
        );
    }

    #[test]
    fn redact_replaces_every_value_longest_first() {
        let s = Secrets::from([("a", "abc"), ("b", "abcdef"), ("c", "")]);
        assert_eq!(
            s.redact("got abcdef and abc, nothing else"),
            "got <redacted> and <redacted>, nothing else"
        );
    }
}
