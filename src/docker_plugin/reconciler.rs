//! The engine reconciliation's rounds (`docker-plugin --engine`): at start
//! and then every interval, the provider's uses are read, the engine is
//! asked which containers hold which volumes ([`engine::list_containers`]),
//! and the uses [`holders::decide`] finds unheld twice are released through
//! the provider's normal, crash-safe `release` (the volume is unpublished
//! after its last use).
//!
//! A round whose listing fails (engine unreachable, slow, not root, an
//! answer refused) releases nothing and is logged as a warning naming the
//! engine and the step; it also forgets the suspects, so the next two
//! successful rounds decide afresh. Stopping waits for a round's releases
//! (a listing in flight is dropped: it changes nothing).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::error_chain::Chain;
use crate::provider::StorageProvider;
use crate::shown::shown;

use super::engine::{self, Endpoint, EngineLimits};
use super::holders::{self, Suspects, Use};
use super::users;

/// What `--engine` asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineOptions {
    /// The engine's API socket.
    pub endpoint: Endpoint,
    /// The time between two rounds, and the least time between the two
    /// observations that release a use.
    pub interval: Duration,
    /// The bounds of one listing.
    pub limits: EngineLimits,
}

impl EngineOptions {
    /// Every 30 s, the default limits.
    pub fn new(endpoint: Endpoint) -> Self {
        EngineOptions {
            endpoint,
            interval: Duration::from_secs(30),
            limits: EngineLimits::default(),
        }
    }
}

/// Runs rounds until `stop` changes (or its sender goes).
pub async fn run(
    provider: Arc<StorageProvider>,
    opts: EngineOptions,
    mut stop: watch::Receiver<bool>,
) {
    tracing::info!(
        engine = %opts.endpoint,
        interval_secs = opts.interval.as_secs(),
        "engine reconciliation: uses of volumes no live container holds are released"
    );
    let clock = Instant::now();
    let mut suspects = Suspects::default();
    loop {
        match round(&provider, &opts, &suspects, clock, &mut stop).await {
            Some(next) => suspects = next,
            None => return,
        }
        tokio::select! {
            () = tokio::time::sleep(opts.interval) => {}
            _ = stop.changed() => return,
        }
    }
}

/// One round: the next suspects, or `None` when stopped during the listing.
async fn round(
    provider: &StorageProvider,
    opts: &EngineOptions,
    before: &Suspects,
    clock: Instant,
    stop: &mut watch::Receiver<bool>,
) -> Option<Suspects> {
    // The uses are read before the listing is asked for (the rule in
    // `holders` depends on it).
    let uses = named_uses(provider).await;
    let now = clock.elapsed();
    let listing = tokio::select! {
        listing = engine::list_containers(&opts.endpoint, opts.limits, engine::ROOT) => listing,
        _ = stop.changed() => return None,
    };
    let containers = match listing {
        Ok(containers) => containers,
        Err(e) => {
            tracing::warn!(
                engine = %opts.endpoint,
                error = %Chain(&e),
                "engine reconciliation: no listing this round, so nothing is released"
            );
            return Some(Suspects::default());
        }
    };
    let held = holders::held_volumes(&containers);
    let decision = holders::decide(before, &uses, &held, now, opts.interval);
    tracing::debug!(
        engine = %opts.endpoint,
        containers = containers.len(),
        held = held.len(),
        uses = uses.len(),
        suspects = decision.suspects.len(),
        "engine reconciliation round"
    );
    for u in &decision.release {
        let mount_id = users::shown_user(&u.user);
        tracing::info!(
            volume = %shown(&u.name),
            volume_id = %shown(&u.volume_id),
            mount_id = %shown(mount_id),
            engine = %opts.endpoint,
            "engine reconciliation: releasing a use of a volume no live container holds (seen twice, {} s apart)",
            opts.interval.as_secs()
        );
        if let Err(e) = provider.release(&u.volume_id, &u.user).await {
            tracing::warn!(
                volume = %shown(&u.name),
                mount_id = %shown(mount_id),
                error = %Chain(&e),
                "engine reconciliation: release of the use failed; it is tried again after two more rounds"
            );
        }
    }
    Some(decision.suspects)
}

/// Every use of a named volume, as the provider records it now.
async fn named_uses(provider: &StorageProvider) -> Vec<Use> {
    provider
        .volumes()
        .await
        .into_iter()
        .filter_map(|rec| {
            let name = rec.name?;
            let volume_id = rec.volume_id;
            Some(
                rec.users
                    .into_iter()
                    .map(|user| Use {
                        name: name.clone(),
                        volume_id: volume_id.clone(),
                        user,
                    })
                    .collect::<Vec<_>>(),
            )
        })
        .flatten()
        .collect()
}
