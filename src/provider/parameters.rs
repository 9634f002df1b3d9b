//! CreateVolume parameters: what a caller may put in them, parsed and
//! bounded before anything is written or sent.
//!
//! Parameters come from the command line, serve's callers, a container's
//! annotations and the operator's profiles file; all but the first may be
//! hostile, and every one ends up in a checkpoint, in `status` and in a
//! plugin's request. So: at most [`MAX_PARAMETERS`] entries, keys of at most
//! [`MAX_KEY_BYTES`] bytes from a small alphabet (the one Kubernetes and
//! Nomad use for StorageClass and volume-spec parameters), values without
//! control characters, at most [`MAX_TOTAL_BYTES`] in all (CSI's limit for a
//! `map<string, string>`). Secrets never travel as parameters: a key under
//! Kubernetes' own `csi.storage.k8s.io/` prefix (secret names and
//! namespaces, fstype: external-provisioner consumes these and never sends
//! them on) or one that names a password or secret is refused.

use std::collections::BTreeMap;

/// Most parameters one volume may carry.
pub const MAX_PARAMETERS: usize = 128;
/// Longest key, in bytes (CSI's general limit for a string).
pub const MAX_KEY_BYTES: usize = 128;
/// Most bytes of keys and values together (CSI's limit for a map).
pub const MAX_TOTAL_BYTES: usize = 4096;

/// Kubernetes' reserved prefix for StorageClass keys its provisioner consumes.
const KUBERNETES_PREFIX: &str = "csi.storage.k8s.io/";

/// Why a parameter set was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParameterError {
    /// More entries than [`MAX_PARAMETERS`].
    #[error("{count} parameters, over the limit of {MAX_PARAMETERS}")]
    TooMany {
        /// How many were given.
        count: usize,
    },
    /// Keys and values add up to more than [`MAX_TOTAL_BYTES`].
    #[error("parameters of {bytes} bytes in all, over CSI's limit of {MAX_TOTAL_BYTES} bytes")]
    TooLarge {
        /// Their size.
        bytes: usize,
    },
    /// A key that is empty, too long or outside the alphabet.
    #[error("parameter key '{key}' {reason}")]
    BadKey {
        /// The key, escaped and shortened.
        key: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A value holding a control character.
    #[error("parameter '{key}': its value holds a control character")]
    BadValue {
        /// The key.
        key: String,
    },
    /// A key that carries a secret or a secret's name.
    #[error("parameter '{key}' would carry a secret: secrets never travel as CreateVolume parameters (give them to the driver through its own secret store or node configuration; see docs/real-drivers.md)")]
    Secret {
        /// The key.
        key: String,
    },
    /// A `KEY=VALUE` argument without `=`.
    #[error("invalid parameter '{text}': give KEY=VALUE")]
    NotKeyValue {
        /// The argument, escaped and shortened.
        text: String,
    },
    /// The same key given twice.
    #[error("parameter '{key}' given twice")]
    Repeated {
        /// The key.
        key: String,
    },
}

fn key_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/')
}

/// Checks one key (see the module doc).
pub fn check_key(key: &str) -> Result<(), ParameterError> {
    let bad = |reason| ParameterError::BadKey {
        key: crate::shown::shown(key).into_owned(),
        reason,
    };
    if key.is_empty() {
        return Err(bad("is empty"));
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(bad("is longer than 128 bytes"));
    }
    if !key.chars().all(key_char) {
        return Err(bad(
            "holds a character other than letters, digits, '.', '_', '-' and '/'",
        ));
    }
    let lower = key.to_ascii_lowercase();
    if lower.starts_with(KUBERNETES_PREFIX)
        || ["secret", "password", "passwd"]
            .iter()
            .any(|w| lower.contains(w))
    {
        return Err(ParameterError::Secret {
            key: key.to_string(),
        });
    }
    Ok(())
}

/// Checks a whole parameter set (see the module doc).
pub fn check(parameters: &BTreeMap<String, String>) -> Result<(), ParameterError> {
    if parameters.len() > MAX_PARAMETERS {
        return Err(ParameterError::TooMany {
            count: parameters.len(),
        });
    }
    let bytes: usize = parameters.iter().map(|(k, v)| k.len() + v.len()).sum();
    if bytes > MAX_TOTAL_BYTES {
        return Err(ParameterError::TooLarge { bytes });
    }
    for (key, value) in parameters {
        check_key(key)?;
        if value.chars().any(char::is_control) {
            return Err(ParameterError::BadValue { key: key.clone() });
        }
    }
    Ok(())
}

/// Parses `KEY=VALUE` arguments (the value may hold `=` and be empty) into
/// a checked set; a key given twice is refused.
pub fn parse<'a>(
    args: impl IntoIterator<Item = &'a str>,
) -> Result<BTreeMap<String, String>, ParameterError> {
    let mut out = BTreeMap::new();
    for text in args {
        let (key, value) = text
            .split_once('=')
            .ok_or_else(|| ParameterError::NotKeyValue {
                text: crate::shown::shown(text).into_owned(),
            })?;
        check_key(key)?;
        if out.insert(key.to_string(), value.to_string()).is_some() {
            return Err(ParameterError::Repeated {
                key: key.to_string(),
            });
        }
        if out.len() > MAX_PARAMETERS {
            return Err(ParameterError::TooMany { count: out.len() });
        }
    }
    check(&out)?;
    Ok(out)
}

/// The first key (in order) on which two parameter sets differ: present in
/// one only, or with other values.
pub fn first_difference<'a>(
    recorded: &'a BTreeMap<String, String>,
    asked: &'a BTreeMap<String, String>,
) -> Option<&'a str> {
    recorded
        .keys()
        .chain(asked.keys())
        .filter(|k| recorded.get(*k) != asked.get(*k))
        .min()
        .map(String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn key_value_arguments_parse_into_a_checked_set() {
        let got = parse(["server=nfs.example", "share=/export", "opts=a=b", "empty="]).unwrap();
        assert_eq!(
            got,
            map(&[
                ("server", "nfs.example"),
                ("share", "/export"),
                ("opts", "a=b"),
                ("empty", "")
            ])
        );
        assert_eq!(
            parse(["noequals"]).unwrap_err(),
            ParameterError::NotKeyValue {
                text: "noequals".into()
            }
        );
        assert_eq!(
            parse(["a=1", "a=2"]).unwrap_err(),
            ParameterError::Repeated { key: "a".into() }
        );
    }

    #[test]
    fn hostile_keys_values_and_sizes_are_refused() {
        let long_key = "k".repeat(MAX_KEY_BYTES + 1);
        let cases: Vec<(BTreeMap<String, String>, &str)> = vec![
            (map(&[("", "v")]), "is empty"),
            (map(&[(&long_key, "v")]), "longer than 128"),
            (map(&[("a b", "v")]), "other than letters"),
            (map(&[("a\nb", "v")]), "other than letters"),
            (map(&[("k", "line\nbreak")]), "control character"),
            (map(&[("k", "esc\u{1b}[2J")]), "control character"),
            (
                map(&[("csi.storage.k8s.io/provisioner-secret-name", "s")]),
                "secret",
            ),
            (map(&[("adminPassword", "hunter2")]), "secret"),
            (map(&[("userSecret", "x")]), "secret"),
            (map(&[("big", &"v".repeat(MAX_TOTAL_BYTES))]), "4096 bytes"),
        ];
        for (params, want) in cases {
            let err = check(&params).unwrap_err().to_string();
            assert!(err.contains(want), "{params:?}: {err}");
        }
        let many: BTreeMap<String, String> = (0..=MAX_PARAMETERS)
            .map(|i| (format!("k{i}"), String::new()))
            .collect();
        assert_eq!(
            check(&many).unwrap_err(),
            ParameterError::TooMany {
                count: MAX_PARAMETERS + 1
            }
        );
    }

    #[test]
    fn real_driver_parameters_pass() {
        let ok = map(&[
            ("server", "nfs-server.default.svc.cluster.local"),
            ("share", "/"),
            ("subDir", "${pvc.metadata.namespace}"),
            ("source", "//smb-server/share"),
            ("clusterID", "b9127830-b0cc-4e34-aa47-9d1a2e9949a8"),
            ("pool", "rbd"),
            ("imageFeatures", "layering"),
        ]);
        check(&ok).unwrap();
    }

    #[test]
    fn the_first_differing_key_is_named() {
        let a = map(&[("a", "1"), ("b", "2")]);
        assert_eq!(first_difference(&a, &a), None);
        assert_eq!(first_difference(&a, &map(&[("a", "1")])), Some("b"));
        assert_eq!(
            first_difference(&a, &map(&[("a", "1"), ("b", "3")])),
            Some("b")
        );
        assert_eq!(first_difference(&map(&[]), &map(&[("z", "")])), Some("z"));
        assert_eq!(first_difference(&a, &map(&[])), Some("a"));
    }
}
