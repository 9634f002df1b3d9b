//! Resource providers: the storage local resource provider (one CSI plugin
//! instance and the volumes made through it, with the crash-safe volume
//! state machine of DESIGN.md) and the [`Manager`] that routes publish
//! requests to providers by `Resource.provider_id`.
//!
//! Files: `state.rs` (the machine and its record), `next_step.rs` (which
//! step the machine takes next: pure decisions, table-tested), `checkpoint.rs` (atomic,
//! durable writes; the layout they go in is [`crate::resource::Layout`]), `supervisor.rs` (the
//! managed plugin process), `storage.rs` (the provider and its transitions),
//! `create.rs`, `publish.rs`, `recover.rs` (one lifecycle step each),
//! `manager.rs` (routing), `name_locks.rs` (per-name locks, dropped once unused), `status.rs` and `summary.rs` (what `status` reads: the volume directories, in full or from the summary each compaction writes), `mount_group.rs` (which group a volume is staged with: pure), `mount_spec.rs` (the one parser of a volume's options, for every
//! front end), `access.rs` (which uses an access mode admits: pure, table-tested), `handoff.rs` (a volume
//! another node holds, and a node fenced while it was away); `tests.rs`,
//! the machine driven without root against an in-process
//! CSI plugin that records its calls.

pub mod access;
mod attention;
pub mod bundled;
pub mod checkpoint;
mod create;
pub mod error;
pub mod expand;
pub mod handoff;
mod import;
pub mod manager;
pub mod modify;
pub mod mount_group;
pub mod mount_spec;
mod name_locks;
mod next_step;
pub mod parameters;
pub mod profiles;
mod publish;
mod recover;
mod rules;
pub mod secrets;
pub mod snapshot;
pub mod state;
pub mod stats;
pub mod status;
pub mod storage;
pub mod summary;
pub mod supervisor;
#[cfg(test)]
mod tests;
pub mod topology;

pub use access::Access;
pub use create::{CreateSpec, ImportSpec};
pub use error::{NotReadyCause, ProviderError};
pub use import::{
    validate_import, Listing, PluginVolume, LIST_PAGE_ENTRIES, MAX_IMPORT_ID_BYTES, MAX_LISTED,
};
pub use manager::{Manager, MountGroups, PublishedVolume, Republish, Republished};
pub use mount_spec::{MountSpec, VolumeOptions};
pub use publish::{UseOutcome, VolumeUse};
pub use rules::{validate_volume_name, MAX_NAME_BYTES};
pub use state::{AccessType, Capability, UnknownAccessType, VolumeRecord, VolumeState};
pub use storage::{PluginSource, ProviderConfig, RecoveryReport, StorageProvider, UnpublishPolicy};
pub use supervisor::{PluginCommand, Supervisor};
