//! Importing a pre-provisioned volume: one that exists in the plugin
//! already (made by hand, by another CO, or behind our back) is recorded
//! under a name, as created, so it can be published like any other.
//!
//! The same durable intent as a create (`creating/<enc name>.intent`, with
//! the volume's id) is written before ValidateVolumeCapabilities, then the
//! volume's first checkpoint, then the intent goes: a crash anywhere is
//! finished by recovery, which re-sends the (read-only) validation. An
//! imported volume is pre-provisioned: destroy forgets it and leaves it in
//! the plugin unless asked to delete it. `plugin_volumes` lists what the
//! plugin has that the provider does not know (ListVolumes), as Mesos'
//! storage local resource provider reports pre-existing volumes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::csi::proto;
use crate::provider::checkpoint;
use crate::provider::create::{CreateIntent, CreateSpec, ImportSpec};
use crate::provider::error::ProviderError;
use crate::provider::parameters;
use crate::provider::rules::{is_ambiguous, validate_volume_name};
use crate::provider::state::{VolumeRecord, FORMAT_VERSION};
use crate::provider::storage::StorageProvider;
use crate::resource::Resource;

/// Longest volume id `import` takes: the bundled plugin's limit, generous
/// for real drivers (ceph-csi's ids are under 100 bytes).
pub const MAX_IMPORT_ID_BYTES: usize = 255;

/// Checks what an import names before anything is written: the name as
/// CreateVolume would, the id (non-empty, bounded, no control characters)
/// and the volume context as bounded as parameters are.
pub fn validate_import(spec: &ImportSpec) -> Result<(), ProviderError> {
    validate_volume_name(&spec.name)?;
    let id = &spec.volume_id;
    let reason = if id.is_empty() {
        "it is empty".to_string()
    } else if id.len() > MAX_IMPORT_ID_BYTES {
        format!(
            "it is {} bytes, over the limit of {MAX_IMPORT_ID_BYTES} bytes",
            id.len()
        )
    } else if id.chars().any(char::is_control) {
        "it holds a control character".to_string()
    } else {
        return parameters::check(&spec.volume_context).map_err(|source| {
            ProviderError::Parameters {
                volume: spec.name.clone(),
                source,
            }
        });
    };
    Err(ProviderError::InvalidName {
        field: "volume id",
        value: crate::shown::shown(id).into_owned(),
        reason,
    })
}

/// Most volumes `plugin_volumes` reads from a plugin (its answers are not
/// trusted to end).
pub const MAX_LISTED: usize = 10_000;

/// The `max_entries` of each ListVolumes page `plugin_volumes` asks for
/// (a plugin may answer with fewer; every `next_token` is followed).
pub const LIST_PAGE_ENTRIES: i32 = 1000;

/// How far `plugin_volumes` read the plugin's list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listing {
    /// To its end (the last page had no `next_token`).
    Complete,
    /// Stopped after [`MAX_LISTED`] entries: the plugin has more.
    Capped,
    /// Stopped because the plugin answered the `next_token` it was given (it would loop).
    TokenRepeated,
}

/// After a page: the token of the next one, or how the listing ends. Pure, table-tested.
fn after_page(asked: &str, next: &str, seen: usize) -> Result<(), Listing> {
    if next.is_empty() {
        Err(Listing::Complete)
    } else if next == asked {
        Err(Listing::TokenRepeated)
    } else if seen >= MAX_LISTED {
        Err(Listing::Capped)
    } else {
        Ok(())
    }
}

/// A volume the plugin has and the provider does not know.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginVolume {
    /// The plugin's volume id.
    pub volume_id: String,
    /// Its capacity in bytes (0: unknown).
    pub capacity_bytes: u64,
    /// Its volume context, as the plugin reports it.
    pub volume_context: BTreeMap<String, String>,
}

impl StorageProvider {
    /// Records an existing CSI volume under `spec.name`, as created: after
    /// ValidateVolumeCapabilities when the plugin has a controller service.
    /// It is pre-provisioned: destroy forgets it and leaves it in the plugin
    /// unless asked to delete it. The same name and id again is the same
    /// import; a name or id already recorded otherwise is refused.
    pub async fn import_volume(&self, spec: ImportSpec) -> Result<Resource, ProviderError> {
        self.import_volume_with_secrets(spec, None).await
    }

    /// [`import_volume`](Self::import_volume) of a volume whose calls carry the secrets of
    /// `secrets_file` ([`crate::provider::secrets`]): checked now, before anything is written,
    /// recorded with the volume, read again at each call. The same import again must name the
    /// same file.
    #[tracing::instrument(skip(self, spec), fields(name = %spec.name.escape_debug(), volume_id = %spec.volume_id.escape_debug()))]
    pub async fn import_volume_with_secrets(
        &self,
        spec: ImportSpec,
        secrets_file: Option<std::path::PathBuf>,
    ) -> Result<Resource, ProviderError> {
        validate_import(&spec)?;
        self.read_secrets(secrets_file.as_deref(), &spec.name, "import")
            .await?;
        let lock = self.name_lock(&spec.name);
        let _guard = lock.lock().await;
        let refuse = |clash: String| ProviderError::ImportRefused {
            name: crate::shown::shown(&spec.name).into_owned(),
            volume_id: crate::shown::shown(&spec.volume_id).into_owned(),
            clash,
        };
        if let Some(rec) = self.find_by_name(&spec.name).await {
            if rec.volume_id == spec.volume_id && rec.pre_provisioned {
                crate::provider::secrets::same_file(
                    &spec.name,
                    rec.secrets_file.as_deref(),
                    secrets_file.as_deref(),
                )?;
                return Ok(self.resource_for(&rec));
            }
            return Err(refuse(format!(
                "the name is taken by volume '{}': choose another name",
                crate::shown::shown(&rec.volume_id)
            )));
        }
        if let Some(rec) = self.volume(&spec.volume_id).await {
            return Err(refuse(format!(
                "the volume is already recorded{}: use it by that name",
                rec.name
                    .as_deref()
                    .map(|n| format!(" as '{}'", crate::shown::shown(n)))
                    .unwrap_or_default()
            )));
        }
        self.check_mode_offered(&spec.name, &spec.capability)?;
        let mut create = CreateSpec::new(&spec.name, spec.capacity_bytes);
        create.capability = spec.capability.clone();
        create.secrets_file = secrets_file;
        let intent = CreateIntent {
            format: FORMAT_VERSION,
            spec: create,
            import: Some(spec),
        };
        self.begin_intent(&intent).await?;
        let rec = self
            .finish_import(
                intent.import.as_ref().expect("set above"),
                intent.spec.secrets_file.as_deref(),
            )
            .await?;
        Ok(self.resource_for(&rec))
    }

    /// ValidateVolumeCapabilities (when the plugin has a controller
    /// service), the volume's first checkpoint, then the intent removed. A
    /// definite refusal drops the intent; an ambiguous failure keeps it for
    /// recovery to retry.
    pub(crate) async fn finish_import(
        &self,
        spec: &ImportSpec,
        secrets_file: Option<&std::path::Path>,
    ) -> Result<VolumeRecord, ProviderError> {
        if self.capabilities().plugin.controller_service() {
            let answer = self
                .controller
                .validate_volume_capabilities(proto::ValidateVolumeCapabilitiesRequest {
                    volume_id: spec.volume_id.clone(),
                    volume_context: spec.volume_context.clone().into_iter().collect(),
                    volume_capabilities: vec![spec.capability.to_proto()],
                    ..Default::default()
                })
                .await;
            let refused = match answer {
                Ok(resp) if resp.confirmed.is_some() => None,
                Ok(resp) => Some(ProviderError::ImportRefused {
                    name: crate::shown::shown(&spec.name).into_owned(),
                    volume_id: crate::shown::shown(&spec.volume_id).into_owned(),
                    clash: format!(
                        "ValidateVolumeCapabilities did not confirm access mode {}{}: give the --access-mode the volume supports",
                        spec.capability.access_mode,
                        if resp.message.is_empty() {
                            String::new()
                        } else {
                            format!(" ({})", crate::shown::shown(&resp.message))
                        }
                    ),
                }),
                Err(source) => {
                    if is_ambiguous(&source) {
                        return Err(ProviderError::Csi {
                            volume: spec.volume_id.clone(),
                            source,
                        });
                    }
                    Some(ProviderError::Csi {
                        volume: spec.volume_id.clone(),
                        source,
                    })
                }
            };
            if let Some(err) = refused {
                self.drop_intent(&spec.name).await;
                return Err(err);
            }
            checkpoint::crash_point();
        }
        let mut rec = VolumeRecord::new(spec.volume_id.clone(), spec.capability.clone());
        rec.name = Some(spec.name.clone());
        rec.capacity_bytes = spec.capacity_bytes;
        rec.pre_provisioned = true;
        rec.readonly = rec.capability.is_reader_only();
        rec.volume_context = spec.volume_context.clone().into();
        rec.vendor = Some(self.vendor.clone());
        rec.secrets_file = secrets_file.map(std::path::Path::to_path_buf);
        let rec = self.record_new(rec, &spec.name).await?;
        tracing::info!(volume_id = %rec.volume_id, name = %spec.name.escape_debug(), "volume imported");
        Ok(rec)
    }

    /// The plugin's volumes this provider does not know (ListVolumes, page
    /// by page, at most [`MAX_LISTED`]), and whether the list was read to its
    /// end. Refused, saying so, when the plugin lacks LIST_VOLUMES.
    pub async fn plugin_volumes(&self) -> Result<(Vec<PluginVolume>, Listing), ProviderError> {
        let caps = self.capabilities();
        if !caps.plugin.controller_service() || !caps.controller.list_volumes() {
            return Err(ProviderError::NoListVolumes {
                plugin: self.id().to_string(),
            });
        }
        let mut out = Vec::new();
        let mut seen = 0usize;
        let mut token = String::new();
        loop {
            let page = self
                .controller
                .list_volumes(proto::ListVolumesRequest {
                    max_entries: LIST_PAGE_ENTRIES,
                    starting_token: token.clone(),
                })
                .await
                .map_err(|source| ProviderError::Plugin {
                    plugin: self.id().to_string(),
                    source,
                })?;
            for entry in page.entries {
                seen += 1;
                let Some(v) = entry.volume else { continue };
                if v.volume_id.is_empty() || self.volume(&v.volume_id).await.is_some() {
                    continue;
                }
                out.push(PluginVolume {
                    volume_id: v.volume_id,
                    capacity_bytes: u64::try_from(v.capacity_bytes).unwrap_or(0),
                    volume_context: v.volume_context.into_iter().collect(),
                });
            }
            if let Err(listing) = after_page(&token, &page.next_token, seen) {
                out.sort_by(|a, b| a.volume_id.cmp(&b.volume_id));
                return Ok((out, listing));
            }
            token = page.next_token;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listing_follows_new_tokens_and_ends_on_none_a_repeat_or_the_cap() {
        let below = MAX_LISTED - 1;
        let cases = [
            ("", "", 3, Err(Listing::Complete)),
            ("", "p2", 1000, Ok(())),
            ("p2", "p3", 2000, Ok(())),
            ("p2", "", 2000, Err(Listing::Complete)),
            ("p2", "p2", 2000, Err(Listing::TokenRepeated)),
            ("p2", "p3", below, Ok(())),
            ("p2", "p3", MAX_LISTED, Err(Listing::Capped)),
            // The end of the list wins over the cap: nothing was left out.
            ("p2", "", MAX_LISTED, Err(Listing::Complete)),
        ];
        for (asked, next, seen, want) in cases {
            assert_eq!(
                after_page(asked, next, seen),
                want,
                "{asked:?} -> {next:?} after {seen}"
            );
        }
    }
}
