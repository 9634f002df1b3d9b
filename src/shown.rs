//! How untrusted values (volume names and ids, container ids, paths) are shown to people: on one line
//! and inert, in tables, messages and logs. JSON output never goes through this.

use std::borrow::Cow;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

/// Values longer than this many bytes are shortened in tables and messages.
const SHOWN_WHOLE: usize = 256;
/// How many characters of a shortened value are kept.
const SHOWN_HEAD: usize = 64;

/// A name, id or path as people should see it in a table or a message: on
/// one line and inert. Control characters (and the bidi overrides that
/// reorder a line) are escaped as `escape_debug` writes them, a backslash
/// is doubled so the escapes stay unambiguous, and a value over 256 bytes is
/// cut to its first 64 characters plus `… (N bytes)`. Plain names are
/// returned untouched. JSON output never goes through this.
pub fn shown(value: &str) -> Cow<'_, str> {
    if value.len() <= SHOWN_WHOLE && !value.chars().any(needs_escape) {
        return Cow::Borrowed(value);
    }
    let mut out = String::new();
    escape_into(&mut out, value);
    Cow::Owned(shorten(out, value.len()))
}

/// [`shown`] for bytes that may not be UTF-8 (arguments, paths): bytes
/// that are not UTF-8 are written `\xNN`.
pub fn shown_os(value: &OsStr) -> Cow<'_, str> {
    if let Some(text) = value.to_str() {
        return shown(text);
    }
    let mut out = String::new();
    for chunk in value.as_bytes().utf8_chunks() {
        escape_into(&mut out, chunk.valid());
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    Cow::Owned(shorten(out, value.len()))
}

/// A message (which may quote untrusted values) on one line: escaped as
/// [`shown`] escapes, never shortened.
pub fn escaped(text: &str) -> Cow<'_, str> {
    if !text.chars().any(needs_escape) {
        return Cow::Borrowed(text);
    }
    let mut out = String::new();
    escape_into(&mut out, text);
    Cow::Owned(out)
}

fn needs_escape(c: char) -> bool {
    c == '\\' || c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

fn escape_into(out: &mut String, text: &str) {
    for c in text.chars() {
        if needs_escape(c) {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
}

/// `escaped` cut to its head when the original value had `len` bytes over
/// the bound.
fn shorten(escaped: String, len: usize) -> String {
    if len <= SHOWN_WHOLE {
        return escaped;
    }
    let head: String = escaped.chars().take(SHOWN_HEAD).collect();
    format!("{head}… ({len} bytes)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_escapes_only_what_needs_it() {
        assert!(matches!(shown("data-1 卷/ü"), Cow::Borrowed("data-1 卷/ü")));
        assert_eq!(shown("new\nline\t\r\x1b[2J"), "new\\nline\\t\\r\\u{1b}[2J");
        assert_eq!(shown("a\\040b"), "a\\\\040b");
        assert_eq!(shown("rev\u{202e}x"), "rev\\u{202e}x");
        let long = "n".repeat(4096);
        assert_eq!(shown(&long), format!("{}… (4096 bytes)", "n".repeat(64)));
        assert_eq!(shown(&"x".repeat(256)), "x".repeat(256));
        assert_eq!(shown_os(OsStr::from_bytes(b"a\xffb\n")), "a\\xffb\\n");
        assert!(!shown_os(OsStr::from_bytes(b"a\xffb")).contains('\u{fffd}'));
    }
}
