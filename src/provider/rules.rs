//! Pure rules more than one operation of the provider applies: CSI's bounds on the names a CO
//! generates, and whether a failed call may have had its effect. Nothing here does I/O.

use crate::provider::error::ProviderError;

/// Whether a failed call may have had its effect (the plugin may have
/// acted): the intent is kept for recovery then.
pub fn is_ambiguous(source: &crate::csi::CsiError) -> bool {
    matches!(
        source.code(),
        None | Some(
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
        )
    )
}

/// CSI's general limit for strings, which `CreateVolumeRequest.name` keeps.
pub const MAX_NAME_BYTES: usize = 128;

/// Checks a CreateVolume name as the CSI spec bounds it: REQUIRED (not
/// empty), at most 128 bytes (the "Size Limits" for strings, for messages
/// COs generate), and none of the characters the spec bans in names:
/// U+0000-U+0008, U+000B, U+000C, U+000E-U+001F, U+007F-U+009F (tab,
/// newline and carriage return are allowed). The error names the volume,
/// escaped and shortened.
pub fn validate_volume_name(name: &str) -> Result<(), ProviderError> {
    validate_name("volume", name)
}

/// [`validate_volume_name`] for the name of a `field` (`volume`, `snapshot`: CSI bounds
/// CreateSnapshot's name the same way).
pub fn validate_name(field: &'static str, name: &str) -> Result<(), ProviderError> {
    let banned =
        |c: &char| matches!(*c as u32, 0x00..=0x08 | 0x0b | 0x0c | 0x0e..=0x1f | 0x7f..=0x9f);
    let reason = if name.is_empty() {
        "its name is empty (CSI requires one)".to_string()
    } else if name.len() > MAX_NAME_BYTES {
        format!(
            "its name is {} bytes, over CSI's limit of {MAX_NAME_BYTES} bytes",
            name.len()
        )
    } else if let Some(c) = name.chars().find(banned) {
        format!(
            "its name holds U+{:04X}, a control character CSI bans in volume names",
            c as u32
        )
    } else {
        return Ok(());
    };
    Err(ProviderError::InvalidName {
        field,
        value: crate::shown::shown(name).into_owned(),
        reason,
    })
}
