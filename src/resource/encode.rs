//! Turning ids into path components.
//!
//! Plugin volume ids are arbitrary strings chosen by the CSI plugin, so they
//! are *encoded* into one safe component: every byte outside
//! `[A-Za-z0-9._-]` becomes `%XX` (upper-case hex); the ids `.` and `..`
//! have their dots encoded too. The encoding is injective, and an encoding
//! never contains `/`, NUL or a raw `~`.
//!
//! An id whose encoding is longer than [`MAX_ENCODED_LEN`] bytes is
//! *hashed*: a prefix of its encoding (never cut inside a `%XX` triple),
//! `~`, then the hex SHA-256 of the full id, [`MAX_ENCODED_LEN`] bytes at
//! most. Only hashed names contain a raw `~`, so the two forms never
//! collide; the empty id, which no plugin may use, is hashed as well so its
//! name is not empty. Hashed names cannot be decoded.
//!
//! Ids that the CO itself allows into paths (persistence ids, container ids,
//! plugin type and name) are *validated* instead, by
//! [`validate_path_component`].

use sha2::{Digest, Sha256};

use super::error::ResourceError;

/// Longest name [`encode_volume_id`] returns, in bytes.
pub const MAX_ENCODED_LEN: usize = 200;

/// Longest component [`validate_path_component`] accepts, in bytes
/// (Linux `NAME_MAX`).
pub const MAX_COMPONENT_LEN: usize = 255;

/// The marker that separates a hashed name's prefix from its hash.
const HASH_MARK: char = '~';

/// Hex digits of a SHA-256.
const HASH_HEX_LEN: usize = 64;

fn is_safe_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')
}

fn push_escaped(out: &mut String, b: u8) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push('%');
    out.push(HEX[usize::from(b >> 4)] as char);
    out.push(HEX[usize::from(b & 0xf)] as char);
}

fn percent_encode(id: &str) -> String {
    let mut out = String::with_capacity(id.len());
    if id == "." || id == ".." {
        for b in id.bytes() {
            push_escaped(&mut out, b);
        }
        return out;
    }
    for b in id.bytes() {
        if is_safe_byte(b) {
            out.push(b as char);
        } else {
            push_escaped(&mut out, b);
        }
    }
    out
}

/// Encodes a plugin volume id into a single safe path component, bounded to
/// [`MAX_ENCODED_LEN`] bytes; see the module docs for the scheme.
///
/// The result is never empty, `.` or `..`, and holds only
/// `[A-Za-z0-9._%~-]`.
pub fn encode_volume_id(id: &str) -> String {
    let encoded = percent_encode(id);
    if !encoded.is_empty() && encoded.len() <= MAX_ENCODED_LEN {
        return encoded;
    }
    let digest = Sha256::digest(id.as_bytes());
    let mut cut = MAX_ENCODED_LEN - 1 - HASH_HEX_LEN;
    // Never leave half an escape behind: a '%' within the last two bytes
    // of the prefix starts a triple the cut would split.
    if let Some(pos) = encoded.as_bytes()[..cut.min(encoded.len())]
        .iter()
        .rposition(|&b| b == b'%')
    {
        if pos + 3 > cut {
            cut = pos;
        }
    }
    let mut out = String::with_capacity(MAX_ENCODED_LEN);
    out.push_str(&encoded[..cut.min(encoded.len())]);
    out.push(HASH_MARK);
    for b in digest {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// Decodes a name made by [`encode_volume_id`] back into the volume id.
///
/// Returns `None` for hashed names (they hold a `~`) and for anything
/// [`encode_volume_id`] would not have produced: a stray `%`, lower-case
/// or non-canonical escapes, bytes outside the encoding's alphabet, or an
/// id that is not UTF-8.
pub fn decode_volume_id(name: &str) -> Option<String> {
    if name.contains(HASH_MARK) {
        return None;
    }
    let bytes = name.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes.get(i + 1..i + 3)?;
                let hex = std::str::from_utf8(hex).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b if is_safe_byte(b) => {
                out.push(b);
                i += 1;
            }
            _ => return None,
        }
    }
    let id = String::from_utf8(out).ok()?;
    // One id, one name: refuse `%41` for `A`, `%2e` for `.`, and so on.
    (encode_volume_id(&id) == name).then_some(id)
}

/// Checks that `value` can be used verbatim as one path component: not
/// empty, not `.` or `..`, no `/`, no NUL, at most [`MAX_COMPONENT_LEN`]
/// bytes. `field` names the value in the error (e.g. `container id`).
pub fn validate_path_component(field: &str, value: &str) -> Result<(), ResourceError> {
    let reason = if value.is_empty() {
        Some("is empty")
    } else if value == "." || value == ".." {
        Some("is a relative path component")
    } else if value.contains('/') {
        Some("contains '/'")
    } else if value.contains('\0') {
        Some("contains NUL")
    } else if value.len() > MAX_COMPONENT_LEN {
        Some("is longer than 255 bytes")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(ResourceError::InvalidPathComponent {
            field: field.to_owned(),
            value: value.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

/// Checks a container id, wherever it comes from (the command line, `serve`, the OCI hook,
/// the isolator's `prepare`): one safe path component (it
/// names the container's checkpoint and sandbox directories), and neither a
/// `,` (the USERS columns join ids with commas) nor a control character.
pub fn validate_container_id(id: &str) -> Result<(), ResourceError> {
    const FIELD: &str = "container id";
    validate_path_component(FIELD, id)?;
    let reason = if id.contains(',') {
        Some("contains ','")
    } else if id.chars().any(char::is_control) {
        Some("contains a control character")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(ResourceError::InvalidPathComponent {
            field: FIELD.to_owned(),
            value: id.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_table() {
        let cases: &[(&str, &str)] = &[
            ("vol-1", "vol-1"),
            ("a.b_c-D9", "a.b_c-D9"),
            (".", "%2E"),
            ("..", "%2E%2E"),
            ("...", "..."),
            (".hidden", ".hidden"),
            ("a/b", "a%2Fb"),
            ("../../etc", "..%2F..%2Fetc"),
            ("a\0b", "a%00b"),
            ("line\nbreak", "line%0Abreak"),
            ("\\040", "%5C040"),
            ("sp ace", "sp%20ace"),
            ("~", "%7E"),
            ("%41", "%2541"),
            ("ü", "%C3%BC"),
            ("卷", "%E5%8D%B7"),
        ];
        for (id, want) in cases {
            assert_eq!(encode_volume_id(id), *want, "id {id:?}");
            assert_eq!(
                decode_volume_id(want).as_deref(),
                Some(*id),
                "name {want:?}"
            );
        }
    }

    #[test]
    fn decode_refuses_non_canonical_names() {
        for name in [
            "%41", "%2e", "%2E%2Ea", "%", "%4", "%ZZ", "a/b", "a b", "~abc", "%FF", "", ".", "..",
        ] {
            assert_eq!(decode_volume_id(name), None, "name {name:?}");
        }
    }

    #[test]
    fn long_ids_are_bounded_unique_and_safe() {
        let exact = "a".repeat(MAX_ENCODED_LEN);
        assert_eq!(encode_volume_id(&exact), exact, "200 bytes still fit");

        let ids = [
            "a".repeat(MAX_ENCODED_LEN + 1),
            "a".repeat(MAX_ENCODED_LEN + 2),
            "/".repeat(4096),
            "/".repeat(4097),
            // Puts a '%' at every offset around the cut.
            format!("a/{}", "/".repeat(300)),
            format!("aa/{}", "/".repeat(300)),
            "ü".repeat(1000),
            String::new(),
        ];
        let mut seen = std::collections::HashSet::new();
        for id in &ids {
            let name = encode_volume_id(id);
            assert!(name.len() <= MAX_ENCODED_LEN, "{} bytes", name.len());
            assert!(!name.is_empty());
            assert!(name
                .bytes()
                .all(|b| is_safe_byte(b) || b == b'%' || b == b'~'));
            let (prefix, hash) = name.split_once('~').expect("hashed");
            assert_eq!(hash.len(), HASH_HEX_LEN);
            assert!(percent_encode(id).starts_with(prefix));
            // The prefix holds only whole escapes.
            let tail = prefix.rfind('%').map_or(0, |p| prefix.len() - p);
            assert!(tail == 0 || tail >= 3, "split escape in {prefix:?}");
            assert_eq!(decode_volume_id(&name), None);
            assert!(seen.insert(name), "collision for id of {} bytes", id.len());
        }
        assert_eq!(
            encode_volume_id(&ids[3]),
            encode_volume_id(&"/".repeat(4097))
        );
    }

    #[test]
    fn validate_component_table() {
        let long = "x".repeat(MAX_COMPONENT_LEN);
        let too_long = "x".repeat(MAX_COMPONENT_LEN + 1);
        let cases: &[(&str, Option<&str>)] = &[
            ("pv-1", None),
            ("...", None),
            ("a b", None),
            ("ü", None),
            (&long, None),
            ("", Some("is empty")),
            (".", Some("is a relative path component")),
            ("..", Some("is a relative path component")),
            ("a/b", Some("contains '/'")),
            ("/", Some("contains '/'")),
            ("a\0", Some("contains NUL")),
            (&too_long, Some("is longer than 255 bytes")),
        ];
        for (value, want) in cases {
            match (validate_path_component("container id", value), want) {
                (Ok(()), None) => {}
                (Err(ResourceError::InvalidPathComponent { field, reason, .. }), Some(want)) => {
                    assert_eq!(field, "container id");
                    assert_eq!(reason, *want, "value {value:?}");
                }
                (got, want) => panic!("value {value:?}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn container_ids() {
        for good in ["c1", "run-0123abcd", "a b", "卷"] {
            validate_container_id(good).unwrap();
        }
        for (bad, says) in [
            ("", "is empty"),
            ("..", "relative"),
            ("a/b", "'/'"),
            ("a,b", "','"),
            ("a\nb", "control character"),
            ("a\u{85}b", "control character"),
        ] {
            let err = validate_container_id(bad).unwrap_err().to_string();
            assert!(
                err.starts_with("invalid container id") && err.contains(says),
                "{bad:?}: {err}"
            );
        }
    }
}
