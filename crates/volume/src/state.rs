//! The states a volume goes through in the actual state of the world, as
//! explicit enums with named transitions: per pod the kubelet's
//! `VolumeMountState` (`VolumeMounted`, `VolumeMountUncertain`, not mounted)
//! with its `remountRequired` flag, per volume the `DeviceMountState`
//! (`DeviceGloballyMounted`, `DeviceMountUncertain`, `DeviceNotMounted`). An
//! operation's outcome is a transition; one that makes no sense in the state
//! (a tear-down's success on a volume never set up) is refused, naming both.

use std::fmt;

/// A volume's state for one pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodMountState {
    NotMounted,
    /// A set-up failed in a way that may have mounted something: a
    /// tear-down is due before the volume is forgotten.
    Uncertain,
    /// Set up; `remount` when the pod was synced since and the plugin
    /// requires remounts (configMap and friends: refresh the files).
    Mounted {
        remount: bool,
    },
}

/// What happened to a volume for a pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodMountTransition {
    SetUpSucceeded,
    /// `uncertain`: the plugin said it may have done something.
    SetUpFailed {
        uncertain: bool,
    },
    /// The pod was synced again (the kubelet's `MarkRemountRequired`).
    RemountRequested,
    TearDownSucceeded,
    TearDownFailed,
}

/// A transition that makes no sense in the state it was applied to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("volume state {from:?} has no transition {transition:?}")]
pub struct InvalidTransition<S: fmt::Debug, T: fmt::Debug> {
    pub from: S,
    pub transition: T,
}

impl PodMountState {
    pub fn apply(
        self,
        t: PodMountTransition,
    ) -> Result<Self, InvalidTransition<Self, PodMountTransition>> {
        use PodMountState::*;
        use PodMountTransition::*;
        Ok(match (self, t) {
            (_, SetUpSucceeded) => Mounted { remount: false },
            // A failed remount keeps what was mounted (the kubelet leaves a
            // mounted volume mounted when its refresh fails).
            (Mounted { .. }, SetUpFailed { .. }) => Mounted { remount: false },
            (_, SetUpFailed { uncertain: true }) => Uncertain,
            (Uncertain, SetUpFailed { uncertain: false }) => Uncertain,
            (NotMounted, SetUpFailed { uncertain: false }) => NotMounted,
            (Mounted { .. }, RemountRequested) => Mounted { remount: true },
            (from @ (NotMounted | Uncertain), RemountRequested) => from,
            (Mounted { .. } | Uncertain, TearDownSucceeded) => NotMounted,
            (from @ (Mounted { .. } | Uncertain), TearDownFailed) => from,
            (from @ NotMounted, transition @ (TearDownSucceeded | TearDownFailed)) => {
                return Err(InvalidTransition { from, transition });
            }
        })
    }

    /// Whether containers may use it.
    pub fn is_mounted(self) -> bool {
        matches!(self, Self::Mounted { .. })
    }

    /// Whether something may be mounted (a tear-down is due once it is no
    /// longer desired).
    pub fn needs_tear_down(self) -> bool {
        !matches!(self, Self::NotMounted)
    }

    /// Whether a set-up is due while the volume is desired.
    pub fn needs_set_up(self) -> bool {
        !matches!(self, Self::Mounted { remount: false })
    }
}

/// A device-mountable volume's node-global state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceMountState {
    NotMounted,
    Uncertain,
    GloballyMounted,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceMountTransition {
    MountDeviceSucceeded,
    MountDeviceFailed { uncertain: bool },
    UnmountDeviceSucceeded,
    UnmountDeviceFailed,
}

impl DeviceMountState {
    pub fn apply(
        self,
        t: DeviceMountTransition,
    ) -> Result<Self, InvalidTransition<Self, DeviceMountTransition>> {
        use DeviceMountState::*;
        use DeviceMountTransition::*;
        Ok(match (self, t) {
            (_, MountDeviceSucceeded) => GloballyMounted,
            (_, MountDeviceFailed { uncertain: true }) => Uncertain,
            (from, MountDeviceFailed { uncertain: false }) => {
                // A device that was mounted stays so; a failure on nothing
                // leaves nothing.
                from
            }
            (GloballyMounted | Uncertain, UnmountDeviceSucceeded) => NotMounted,
            (from @ (GloballyMounted | Uncertain), UnmountDeviceFailed) => from,
            (from @ NotMounted, transition @ (UnmountDeviceSucceeded | UnmountDeviceFailed)) => {
                return Err(InvalidTransition { from, transition });
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::DeviceMountState as D;
    use super::DeviceMountTransition as DT;
    use super::PodMountState::*;
    use super::PodMountTransition::*;
    use super::*;

    const STATES: [PodMountState; 4] = [
        NotMounted,
        Uncertain,
        Mounted { remount: false },
        Mounted { remount: true },
    ];

    #[test]
    fn pod_mount_transitions_table() {
        let m = Mounted { remount: false };
        let r = Mounted { remount: true };
        let up = SetUpSucceeded;
        let fail = SetUpFailed { uncertain: false };
        let unsure = SetUpFailed { uncertain: true };
        // (from, transition, to); None: refused.
        let table: [(PodMountState, PodMountTransition, Option<PodMountState>); 20] = [
            (NotMounted, up, Some(m)),
            (NotMounted, fail, Some(NotMounted)),
            (NotMounted, unsure, Some(Uncertain)),
            (NotMounted, RemountRequested, Some(NotMounted)),
            (NotMounted, TearDownSucceeded, None),
            (NotMounted, TearDownFailed, None),
            (Uncertain, up, Some(m)),
            (Uncertain, fail, Some(Uncertain)),
            (Uncertain, unsure, Some(Uncertain)),
            (Uncertain, RemountRequested, Some(Uncertain)),
            (Uncertain, TearDownSucceeded, Some(NotMounted)),
            (Uncertain, TearDownFailed, Some(Uncertain)),
            (m, up, Some(m)),
            (m, RemountRequested, Some(r)),
            (r, up, Some(m)),
            (r, fail, Some(m)),
            (r, unsure, Some(m)),
            (r, RemountRequested, Some(r)),
            (m, TearDownSucceeded, Some(NotMounted)),
            (r, TearDownFailed, Some(r)),
        ];
        for (from, t, to) in table {
            assert_eq!(from.apply(t).ok(), to, "{from:?} --{t:?}-->");
        }
    }

    #[test]
    fn what_each_pod_state_asks_for() {
        // (state, mounted for containers, set-up due, tear-down due)
        let table = [
            (NotMounted, false, true, false),
            (Uncertain, false, true, true),
            (Mounted { remount: false }, true, false, true),
            (Mounted { remount: true }, true, true, true),
        ];
        for (s, mounted, set_up, tear_down) in table {
            assert_eq!(
                (s.is_mounted(), s.needs_set_up(), s.needs_tear_down()),
                (mounted, set_up, tear_down),
                "{s:?}"
            );
        }
        // Every state reaches NotMounted by a successful set-up then tear-down.
        for s in STATES {
            let up = s.apply(SetUpSucceeded).unwrap();
            assert_eq!(up.apply(TearDownSucceeded).unwrap(), NotMounted);
        }
    }

    #[test]
    fn device_mount_transitions_table() {
        let table = [
            (
                D::NotMounted,
                DT::MountDeviceSucceeded,
                Some(D::GloballyMounted),
            ),
            (
                D::NotMounted,
                DT::MountDeviceFailed { uncertain: false },
                Some(D::NotMounted),
            ),
            (
                D::NotMounted,
                DT::MountDeviceFailed { uncertain: true },
                Some(D::Uncertain),
            ),
            (D::NotMounted, DT::UnmountDeviceSucceeded, None),
            (D::NotMounted, DT::UnmountDeviceFailed, None),
            (
                D::Uncertain,
                DT::MountDeviceSucceeded,
                Some(D::GloballyMounted),
            ),
            (
                D::Uncertain,
                DT::MountDeviceFailed { uncertain: false },
                Some(D::Uncertain),
            ),
            (
                D::Uncertain,
                DT::UnmountDeviceSucceeded,
                Some(D::NotMounted),
            ),
            (D::Uncertain, DT::UnmountDeviceFailed, Some(D::Uncertain)),
            (
                D::GloballyMounted,
                DT::MountDeviceFailed { uncertain: false },
                Some(D::GloballyMounted),
            ),
            (
                D::GloballyMounted,
                DT::UnmountDeviceSucceeded,
                Some(D::NotMounted),
            ),
            (
                D::GloballyMounted,
                DT::UnmountDeviceFailed,
                Some(D::GloballyMounted),
            ),
        ];
        for (from, t, to) in table {
            assert_eq!(from.apply(t).ok(), to, "{from:?} --{t:?}-->");
        }
        let err = D::NotMounted.apply(DT::UnmountDeviceSucceeded).unwrap_err();
        assert_eq!(
            err.to_string(),
            "volume state NotMounted has no transition UnmountDeviceSucceeded"
        );
    }
}
