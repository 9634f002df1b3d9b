//! A volume's secrets file (`--mount ...,secrets=FILE`, serve's `secrets_file`, Docker's
//! `secrets` option): the reference is recorded with the volume, the content is read at each
//! call that carries secrets and never kept.
//!
//! Contract:
//! - The path must be absolute (recovery and later commands resolve it from another directory).
//! - The file must be root's alone, checked on the open descriptor before a byte is read
//!   ([`crate::workdir::read_root_file`] with [`FileRule::RootOnly`]): a regular file of one
//!   name, owned by root, no permission for group or others, not a symbolic link, in a directory
//!   that passes the work dir's rule, at most [`MAX_FILE_BYTES`]; its format is
//!   [`crate::csi::secrets`]. Anything else is refused naming the path and what to fix, never
//!   the content.
//! - [`load`] is called once per RPC that carries secrets (and once when a volume is created or
//!   imported with a secrets file, so a bad file is refused before anything is written or
//!   sent): a rotated file is used from the next call on. The secrets live only in the request.

use std::path::{Path, PathBuf};

use crate::csi::secrets::{FormatError, MAX_FILE_BYTES};
use crate::csi::SecretsFile;
use crate::workdir::{self, FileRule, RootFileError};

/// What a secrets file's directory is checked for, as errors name it.
pub const SECRETS_FILE_DIR: workdir::Purpose = workdir::Purpose {
    what: "secrets file's directory",
    flag: "secrets=",
};

/// A secrets file refused (never quoting its content).
#[derive(Debug, thiserror::Error)]
pub enum SecretsError {
    /// A relative path.
    #[error("secrets file {path}: not an absolute path: give the file's full path (it is read again at later calls and by recovery, from another directory)")]
    NotAbsolute {
        /// The path as given.
        path: PathBuf,
    },
    /// The directory, the file's ownership or mode, its size, or reading it.
    #[error("secrets file {path}: {source}{remedy}")]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: RootFileError,
        /// What to do.
        remedy: &'static str,
    },
    /// Not the secrets file format.
    #[error("secrets file {path}: {source} (see docs/secrets.md)")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: FormatError,
    },
}

/// Checks that `path` names a secrets file as the module doc says and parses it.
pub fn load(path: &Path) -> Result<SecretsFile, SecretsError> {
    if !path.is_absolute() {
        return Err(SecretsError::NotAbsolute {
            path: path.to_path_buf(),
        });
    }
    let bytes = workdir::read_root_file(path, SECRETS_FILE_DIR, FileRule::RootOnly, MAX_FILE_BYTES)
        .map_err(|source| {
            let remedy = match &source {
                RootFileError::Unsafe { .. } => ": it holds credentials, so it must be root's alone: a regular file of one name, owned by root, mode 0600 or 0400 (chown root, chmod go=), not a symbolic link",
                RootFileError::TooLarge { .. } => ": a secrets file holds a few keys per operation",
                RootFileError::Directory(_) | RootFileError::Io { .. } => "",
            };
            SecretsError::File {
                path: path.to_path_buf(),
                source,
                remedy,
            }
        })?;
    SecretsFile::parse(&bytes).map_err(|source| SecretsError::Format {
        path: path.to_path_buf(),
        source,
    })
}

/// Refuses a second create or import of the volume `name` that names another secrets file than
/// the one recorded (`None`: no file): the secrets are rotated by changing the file's content.
pub(crate) fn same_file(
    name: &str,
    recorded: Option<&Path>,
    asked: Option<&Path>,
) -> Result<(), crate::provider::ProviderError> {
    if recorded == asked {
        return Ok(());
    }
    let shown = |f: Option<&Path>| f.map_or("none".to_string(), |p| p.display().to_string());
    Err(crate::provider::ProviderError::SecretsFileDiffers {
        volume: name.to_string(),
        recorded: shown(recorded),
        asked: shown(asked),
    })
}
