//! Which step the volume state machine takes next: the pure decisions of
//! [`drive`](super::storage::StorageProvider), apart from its I/O.
//!
//! `drive` loops: it decides with [`next_step`], makes the step's intent
//! durable, sends the RPC and records the result. Before the loop,
//! [`resume_point`] says where an interrupted operation is taken up from.
//! Nothing here reads a file, the mount table or the plugin: what the plugin
//! offers ([`StepCaps`]) and whether a mount is left at the staging path are
//! facts the caller gathers, and the tables below try every combination.

use crate::provider::state::{Step, VolumeState};

/// What the plugin serving now offers, as far as choosing steps goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StepCaps {
    /// A controller service with PUBLISH_UNPUBLISH_VOLUME: the controller
    /// steps are sent (a node-only plugin has none).
    pub(crate) controller_publish: bool,
    /// The node service offers STAGE_UNSTAGE_VOLUME: the stage steps are sent.
    pub(crate) stage_unstage: bool,
}

impl StepCaps {
    /// The capabilities as the CSI client learnt them.
    pub(crate) fn of(caps: &crate::csi::Capabilities) -> Self {
        StepCaps {
            controller_publish: caps.plugin.controller_service()
                && caps.controller.publish_unpublish_volume(),
            stage_unstage: caps.node.stage_unstage_volume(),
        }
    }

    /// Whether `step` has an RPC to send to this plugin (NodePublish and
    /// NodeUnpublish always do).
    pub(crate) fn has_rpc(self, step: Step) -> bool {
        match step {
            Step::ControllerPublish | Step::ControllerUnpublish => self.controller_publish,
            Step::NodeStage | Step::NodeUnstage => self.stage_unstage,
            Step::NodePublish | Step::NodeUnpublish => true,
        }
    }
}

/// What `drive` does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// The goal is reached.
    Done,
    /// Record the step's intent (once per operation), send its RPC, record
    /// the state it leads to.
    Call(Step),
    /// Move to the state the step leads to without an RPC: the plugin has
    /// none for it.
    Skip(Step),
}

/// The state an operation towards `goal` starts from, given the record's
/// `state` and `towards` (the goal of an operation a crash or failure
/// interrupted, if any).
///
/// Going back over an interrupted forward operation: its intent says only
/// which step started and where it was going, so the plugin may have gone
/// as far as `towards`; the undo starts from the last forward step into
/// `towards`. Otherwise the record's state stands.
pub(crate) fn resume_point(
    state: VolumeState,
    towards: Option<VolumeState>,
    goal: VolumeState,
) -> VolumeState {
    if let (Some(pending), Some(towards)) = (state.pending_step(), towards) {
        if pending.is_forward()
            && goal.rank() < pending.to().rank()
            && towards.rank() > pending.to().rank()
        {
            if let Some(last) = Step::forward_into(towards) {
                return last.transient();
            }
        }
    }
    state
}

/// The next step from `state` towards the steady state `goal`.
///
/// From a transient state (a step in flight when the operation stopped) the
/// pending step is finished first, or undone when it went forward past the
/// goal; from a steady state the machine moves one rank towards the goal. A
/// step is skipped when the plugin has no RPC for it, except a NodeUnstage
/// while a mount is left at the staging path (`staging_mounted`: a plugin
/// without STAGE_UNSTAGE_VOLUME replaced one with it): that one is called,
/// and the call refuses rather than leave the mount behind unseen.
pub(crate) fn next_step(
    state: VolumeState,
    goal: VolumeState,
    caps: StepCaps,
    staging_mounted: bool,
) -> Next {
    let step = match state.pending_step() {
        Some(pending) if pending.is_forward() && goal.rank() < pending.to().rank() => {
            pending.reverse()
        }
        Some(pending) => pending,
        None => match state.next_step_towards(goal) {
            None => return Next::Done,
            Some(step) => step,
        },
    };
    if caps.has_rpc(step) || (step == Step::NodeUnstage && staging_mounted) {
        Next::Call(step)
    } else {
        Next::Skip(step)
    }
}

/// The directories the CO creates on the node for the plugin (CSI: the staging path itself,
/// the target's parent), as a forward operation needs them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct NodeDirs {
    /// `mounts/<id>/staging`, for NodeStageVolume.
    pub(crate) staging: bool,
    /// `mounts/<id>`, the target's parent, for NodePublishVolume.
    pub(crate) mount: bool,
}

impl NodeDirs {
    pub(crate) const STAGING: NodeDirs = NodeDirs {
        staging: true,
        mount: false,
    };
    pub(crate) const MOUNT: NodeDirs = NodeDirs {
        staging: false,
        mount: true,
    };
}

/// The directories an operation whose first RPC is `first`, going to `goal`, will need, made
/// (or found: they live with the volume) with its intent rather than before each step: the
/// staging path when it stages (`stage_unstage`: the plugin offers it, and a NodeStage lies
/// ahead), the mount directory when it publishes. None going back.
pub(crate) fn node_dirs(first: Step, goal: VolumeState, stage_unstage: bool) -> NodeDirs {
    let reaches = |state: VolumeState| goal.rank() >= state.rank();
    let forward = first.is_forward();
    NodeDirs {
        staging: forward
            && stage_unstage
            && first != Step::NodePublish
            && reaches(VolumeState::VolReady),
        mount: forward && reaches(VolumeState::Published),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Next::{Call, Done, Skip};
    use Step as S;
    use VolumeState::*;

    const FULL: StepCaps = StepCaps {
        controller_publish: true,
        stage_unstage: true,
    };
    const NODE_ONLY: StepCaps = StepCaps {
        controller_publish: false,
        stage_unstage: true,
    };
    const NO_STAGE: StepCaps = StepCaps {
        controller_publish: true,
        stage_unstage: false,
    };
    const PUBLISH_ONLY: StepCaps = StepCaps {
        controller_publish: false,
        stage_unstage: false,
    };

    /// (state, goal, next with FULL, NODE_ONLY, NO_STAGE, PUBLISH_ONLY), the
    /// staging path empty. Every state × every steady goal.
    #[rustfmt::skip]
    const TABLE: &[(VolumeState, VolumeState, [Next; 4])] = &[
        // Already there.
        (Created,   Created,   [Done, Done, Done, Done]),
        (NodeReady, NodeReady, [Done, Done, Done, Done]),
        (VolReady,  VolReady,  [Done, Done, Done, Done]),
        (Published, Published, [Done, Done, Done, Done]),
        // Forward, one rank at a time.
        (Created,   NodeReady, [Call(S::ControllerPublish), Skip(S::ControllerPublish), Call(S::ControllerPublish), Skip(S::ControllerPublish)]),
        (Created,   VolReady,  [Call(S::ControllerPublish), Skip(S::ControllerPublish), Call(S::ControllerPublish), Skip(S::ControllerPublish)]),
        (Created,   Published, [Call(S::ControllerPublish), Skip(S::ControllerPublish), Call(S::ControllerPublish), Skip(S::ControllerPublish)]),
        (NodeReady, VolReady,  [Call(S::NodeStage), Call(S::NodeStage), Skip(S::NodeStage), Skip(S::NodeStage)]),
        (NodeReady, Published, [Call(S::NodeStage), Call(S::NodeStage), Skip(S::NodeStage), Skip(S::NodeStage)]),
        (VolReady,  Published, [Call(S::NodePublish); 4]),
        // Backward, one rank at a time.
        (Published, VolReady,  [Call(S::NodeUnpublish); 4]),
        (Published, NodeReady, [Call(S::NodeUnpublish); 4]),
        (Published, Created,   [Call(S::NodeUnpublish); 4]),
        (VolReady,  NodeReady, [Call(S::NodeUnstage), Call(S::NodeUnstage), Skip(S::NodeUnstage), Skip(S::NodeUnstage)]),
        (VolReady,  Created,   [Call(S::NodeUnstage), Call(S::NodeUnstage), Skip(S::NodeUnstage), Skip(S::NodeUnstage)]),
        (NodeReady, Created,   [Call(S::ControllerUnpublish), Skip(S::ControllerUnpublish), Call(S::ControllerUnpublish), Skip(S::ControllerUnpublish)]),
        // A forward step in flight: finished when the goal is at or past it...
        (ControllerPublish, NodeReady, [Call(S::ControllerPublish), Skip(S::ControllerPublish), Call(S::ControllerPublish), Skip(S::ControllerPublish)]),
        (ControllerPublish, Published, [Call(S::ControllerPublish), Skip(S::ControllerPublish), Call(S::ControllerPublish), Skip(S::ControllerPublish)]),
        (NodeStage,   VolReady,  [Call(S::NodeStage), Call(S::NodeStage), Skip(S::NodeStage), Skip(S::NodeStage)]),
        (NodeStage,   Published, [Call(S::NodeStage), Call(S::NodeStage), Skip(S::NodeStage), Skip(S::NodeStage)]),
        (NodePublish, Published, [Call(S::NodePublish); 4]),
        // ... undone when the goal is behind it.
        (ControllerPublish, Created, [Call(S::ControllerUnpublish), Skip(S::ControllerUnpublish), Call(S::ControllerUnpublish), Skip(S::ControllerUnpublish)]),
        (NodeStage,   NodeReady, [Call(S::NodeUnstage), Call(S::NodeUnstage), Skip(S::NodeUnstage), Skip(S::NodeUnstage)]),
        (NodeStage,   Created,   [Call(S::NodeUnstage), Call(S::NodeUnstage), Skip(S::NodeUnstage), Skip(S::NodeUnstage)]),
        (NodePublish, VolReady,  [Call(S::NodeUnpublish); 4]),
        (NodePublish, Created,   [Call(S::NodeUnpublish); 4]),
        // A backward step in flight is finished whatever the goal: the
        // plugin may have undone the mount already.
        (NodeUnpublish, Created,   [Call(S::NodeUnpublish); 4]),
        (NodeUnpublish, VolReady,  [Call(S::NodeUnpublish); 4]),
        (NodeUnpublish, Published, [Call(S::NodeUnpublish); 4]),
        (NodeUnstage, Created,   [Call(S::NodeUnstage), Call(S::NodeUnstage), Skip(S::NodeUnstage), Skip(S::NodeUnstage)]),
        (NodeUnstage, Published, [Call(S::NodeUnstage), Call(S::NodeUnstage), Skip(S::NodeUnstage), Skip(S::NodeUnstage)]),
        (ControllerUnpublish, Created,   [Call(S::ControllerUnpublish), Skip(S::ControllerUnpublish), Call(S::ControllerUnpublish), Skip(S::ControllerUnpublish)]),
        (ControllerUnpublish, Published, [Call(S::ControllerUnpublish), Skip(S::ControllerUnpublish), Call(S::ControllerUnpublish), Skip(S::ControllerUnpublish)]),
    ];

    #[test]
    fn next_step_for_every_state_goal_and_plugin() {
        let caps = [FULL, NODE_ONLY, NO_STAGE, PUBLISH_ONLY];
        for (state, goal, expected) in TABLE {
            for (caps, expected) in caps.iter().zip(expected) {
                assert_eq!(
                    next_step(*state, *goal, *caps, false),
                    *expected,
                    "from {state} towards {goal} with {caps:?}"
                );
            }
        }
        // The table holds every steady goal from every steady state.
        let steady = [Created, NodeReady, VolReady, Published];
        for state in steady {
            for goal in steady {
                assert!(
                    TABLE.iter().any(|(s, g, _)| (*s, *g) == (state, goal)),
                    "{state} -> {goal} missing from the table"
                );
            }
        }
    }

    #[test]
    fn a_mount_left_at_staging_is_never_skipped_past() {
        // A plugin without STAGE_UNSTAGE_VOLUME (it replaced one with it) and
        // a mount still at the staging path: NodeUnstage is not skipped.
        for caps in [NO_STAGE, PUBLISH_ONLY] {
            for (state, goal) in [
                (VolReady, NodeReady),
                (VolReady, Created),
                (NodeStage, Created),
                (NodeUnstage, Published),
            ] {
                assert_eq!(
                    next_step(state, goal, caps, true),
                    Call(S::NodeUnstage),
                    "from {state} towards {goal} with {caps:?}"
                );
            }
            // Every other step is chosen as without the mount.
            for (state, goal, expected) in TABLE {
                let without = next_step(*state, *goal, caps, false);
                if without != Skip(S::NodeUnstage) {
                    assert_eq!(next_step(*state, *goal, caps, true), without);
                    assert!(expected.contains(&without));
                }
            }
        }
    }

    #[test]
    fn walking_the_steps_reaches_the_goal_through_the_expected_rpcs() {
        // A whole operation as drive runs it: the RPCs sent, in order.
        let walk = |mut state: VolumeState, goal, caps| {
            let mut rpcs = vec![];
            for _ in 0..10 {
                match next_step(state, goal, caps, false) {
                    Done => return (state, rpcs),
                    Call(step) => {
                        rpcs.push(step);
                        state = step.to();
                    }
                    Skip(step) => state = step.to(),
                }
            }
            panic!("no end from {state} towards {goal}");
        };
        let all = vec![S::ControllerPublish, S::NodeStage, S::NodePublish];
        assert_eq!(walk(Created, Published, FULL), (Published, all));
        assert_eq!(
            walk(Created, Published, NODE_ONLY),
            (Published, vec![S::NodeStage, S::NodePublish])
        );
        assert_eq!(
            walk(Created, Published, NO_STAGE),
            (Published, vec![S::ControllerPublish, S::NodePublish])
        );
        assert_eq!(
            walk(Created, Published, PUBLISH_ONLY),
            (Published, vec![S::NodePublish])
        );
        let back = vec![S::NodeUnpublish, S::NodeUnstage, S::ControllerUnpublish];
        assert_eq!(walk(Published, Created, FULL), (Created, back));
        assert_eq!(
            walk(Published, Created, PUBLISH_ONLY),
            (Created, vec![S::NodeUnpublish])
        );
        // An interrupted unpublish is finished before publishing again.
        assert_eq!(
            walk(NodeUnstage, Published, FULL),
            (
                Published,
                vec![S::NodeUnstage, S::NodeStage, S::NodePublish]
            )
        );
    }

    #[test]
    fn resume_point_undoes_from_as_far_as_the_plugin_may_have_gone() {
        #[rustfmt::skip]
        let table = [
            // (state, towards, goal, resumed from)
            // A forward operation to PUBLISHED interrupted at its first step,
            // now going back: the plugin may have published, so undo from there.
            (ControllerPublish, Some(Published), Created, NodePublish),
            (NodeStage,         Some(Published), Created, NodePublish),
            (NodeStage,         Some(Published), NodeReady, NodePublish),
            (ControllerPublish, Some(VolReady),  Created, NodeStage),
            // The goal at or past where the operation went: nothing to widen.
            (ControllerPublish, Some(Published), Published, ControllerPublish),
            (ControllerPublish, Some(Published), NodeReady, ControllerPublish),
            (NodeStage,         Some(Published), VolReady, NodeStage),
            // The step in flight was the operation's last: it is the one undone.
            (NodePublish,       Some(Published), Created, NodePublish),
            (ControllerPublish, Some(NodeReady), Created, ControllerPublish),
            // No recorded goal (an older checkpoint): the step in flight only.
            (ControllerPublish, None, Created, ControllerPublish),
            // Backward operations and steady states stand.
            (NodeUnpublish,     Some(Created), Published, NodeUnpublish),
            (NodeUnstage,       Some(Created), Created, NodeUnstage),
            (Published,         None, Created, Published),
            (NodeReady,         Some(Published), Created, NodeReady),
        ];
        for (state, towards, goal, expected) in table {
            assert_eq!(
                resume_point(state, towards, goal),
                expected,
                "{state} towards {towards:?}, now going to {goal}"
            );
        }
    }

    #[test]
    fn a_forward_operation_makes_the_directories_of_the_steps_ahead_and_none_going_back() {
        let (both, mount, staging, none) = (
            NodeDirs {
                staging: true,
                mount: true,
            },
            NodeDirs::MOUNT,
            NodeDirs::STAGING,
            NodeDirs::default(),
        );
        #[rustfmt::skip]
        let cases = [
            // (first RPC, goal, STAGE_UNSTAGE_VOLUME, directories)
            (S::ControllerPublish, Published, true, both),
            (S::ControllerPublish, Published, false, mount),
            (S::ControllerPublish, VolReady, true, staging),
            (S::ControllerPublish, NodeReady, true, none),
            (S::NodeStage, Published, true, both),
            (S::NodeStage, VolReady, true, staging),
            (S::NodePublish, Published, true, mount),
            (S::NodePublish, Published, false, mount),
            (S::NodeUnpublish, VolReady, true, none),
            (S::NodeUnstage, Created, true, none),
            (S::ControllerUnpublish, Created, true, none),
        ];
        for (first, goal, stage, dirs) in cases {
            assert_eq!(
                node_dirs(first, goal, stage),
                dirs,
                "{first:?} to {goal:?}, stage {stage}"
            );
        }
    }
}
