//! The CSI plugin's state machines, pure: a staged volume (the kubelet's
//! device mount of a CSI volume, shared by the pods that use it) and one
//! publication (a pod's mount of it), with named transitions.
//!
//! As the kubelet's actual state of the world: a call that failed with a
//! non-final error (timeout, Unavailable, ...) leaves the volume
//! *uncertain*, and an uncertain volume is undone (NodeUnpublishVolume /
//! NodeUnstageVolume) like a certain one, because the driver may have done
//! the work; a final error leaves nothing to undo. (When to unstage, after
//! the last pod's publication, is the volume manager's decision.) Staging is
//! skipped when the driver lacks `STAGE_UNSTAGE_VOLUME`.

/// A staged volume's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StageState {
    /// Not staged: NodeStageVolume is due before the next publish.
    Unstaged,
    /// NodeStageVolume failed with a non-final error: may be staged.
    Uncertain,
    /// NodeStageVolume succeeded.
    Staged,
    /// The driver does not stage (no STAGE_UNSTAGE_VOLUME): only the
    /// kubelet's staging dir and vol_data.json exist.
    NotNeeded,
}

/// What happened to a staged volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StageEvent {
    StageSucceeded,
    /// `uncertain`: a non-final error.
    StageFailed {
        uncertain: bool,
    },
    /// The driver lacks STAGE_UNSTAGE_VOLUME.
    StageSkipped,
    UnstageSucceeded,
    UnstageFailed,
}

impl StageState {
    /// Whether NodeStageVolume must be called before publishing.
    pub fn needs_stage(self) -> bool {
        matches!(self, Self::Unstaged | Self::Uncertain)
    }

    /// Whether the volume can be published now.
    pub fn publishable(self) -> bool {
        matches!(self, Self::Staged | Self::NotNeeded)
    }

    /// Whether NodeUnstageVolume must be called once nothing publishes it.
    pub fn needs_unstage(self) -> bool {
        matches!(self, Self::Staged | Self::Uncertain)
    }

    pub fn on(self, event: &StageEvent) -> Self {
        use StageEvent as E;
        match (self, event) {
            (_, E::StageSucceeded) => Self::Staged,
            (_, E::StageSkipped) => Self::NotNeeded,
            // A failed stage of a staged volume cannot happen (no call is
            // made); of an uncertain one it stays uncertain unless final.
            (Self::Staged, E::StageFailed { .. }) => Self::Staged,
            (Self::Uncertain, E::StageFailed { uncertain: false }) => Self::Unstaged,
            (_, E::StageFailed { uncertain: true }) => Self::Uncertain,
            (_, E::StageFailed { uncertain: false }) => Self::Unstaged,
            (_, E::UnstageSucceeded) => Self::Unstaged,
            // The kubelet keeps the device mounted (and tries again).
            (s, E::UnstageFailed) => s,
        }
    }
}

/// One publication's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PublishState {
    Unpublished,
    /// NodePublishVolume failed with a non-final error: may be published.
    Uncertain,
    Published,
}

/// What happened to a publication.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PublishEvent {
    PublishSucceeded,
    PublishFailed { uncertain: bool },
    UnpublishSucceeded,
    UnpublishFailed,
}

impl PublishState {
    pub fn on(self, event: &PublishEvent) -> Self {
        use PublishEvent as E;
        match (self, event) {
            (_, E::PublishSucceeded) => Self::Published,
            (Self::Published, E::PublishFailed { .. }) => Self::Published,
            (_, E::PublishFailed { uncertain: true }) => Self::Uncertain,
            (_, E::PublishFailed { uncertain: false }) => Self::Unpublished,
            (_, E::UnpublishSucceeded) => Self::Unpublished,
            (s, E::UnpublishFailed) => s,
        }
    }

    /// Whether NodeUnpublishVolume is due at tear-down.
    pub fn needs_unpublish(self) -> bool {
        matches!(self, Self::Published | Self::Uncertain)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use PublishEvent as PE;
    use PublishState as P;
    use StageEvent as E;
    use StageState as S;

    #[test]
    fn stage_transitions_table() {
        let failed = |uncertain| E::StageFailed { uncertain };
        #[rustfmt::skip]
        let table = [
            (S::Unstaged, E::StageSucceeded, S::Staged),
            (S::Unstaged, failed(false), S::Unstaged),
            (S::Unstaged, failed(true), S::Uncertain),
            (S::Unstaged, E::StageSkipped, S::NotNeeded),
            (S::Uncertain, E::StageSucceeded, S::Staged),
            (S::Uncertain, failed(true), S::Uncertain),
            // A final answer after an uncertain one: the driver says not staged.
            (S::Uncertain, failed(false), S::Unstaged),
            (S::Staged, failed(true), S::Staged),
            (S::Staged, E::UnstageSucceeded, S::Unstaged),
            (S::Staged, E::UnstageFailed, S::Staged),
            (S::Uncertain, E::UnstageSucceeded, S::Unstaged),
            (S::Uncertain, E::UnstageFailed, S::Uncertain),
            (S::NotNeeded, E::UnstageSucceeded, S::Unstaged),
        ];
        for (from, event, to) in table {
            assert_eq!(from.on(&event), to, "{from:?} + {event:?}");
        }
    }

    #[test]
    fn stage_decisions_table() {
        // (state, needs_stage, publishable, needs_unstage)
        let table = [
            (S::Unstaged, true, false, false),
            (S::Uncertain, true, false, true),
            (S::Staged, false, true, true),
            (S::NotNeeded, false, true, false),
        ];
        for (s, stage, publish, unstage) in table {
            assert_eq!(
                (s.needs_stage(), s.publishable(), s.needs_unstage()),
                (stage, publish, unstage),
                "{s:?}"
            );
        }
    }

    #[test]
    fn publish_transitions_table() {
        let failed = |uncertain| PE::PublishFailed { uncertain };
        #[rustfmt::skip]
        let table = [
            (P::Unpublished, PE::PublishSucceeded, P::Published, true),
            (P::Unpublished, failed(false), P::Unpublished, false),
            (P::Unpublished, failed(true), P::Uncertain, true),
            (P::Uncertain, failed(false), P::Unpublished, false),
            (P::Uncertain, PE::PublishSucceeded, P::Published, true),
            (P::Published, failed(false), P::Published, true),
            (P::Published, PE::UnpublishSucceeded, P::Unpublished, false),
            (P::Published, PE::UnpublishFailed, P::Published, true),
            (P::Uncertain, PE::UnpublishSucceeded, P::Unpublished, false),
        ];
        for (from, event, to, unpublish) in table {
            let got = from.on(&event);
            assert_eq!(got, to, "{from:?} + {event:?}");
            assert_eq!(got.needs_unpublish(), unpublish, "{got:?}");
        }
    }
}
