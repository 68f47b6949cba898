//! The known differences between the stock kubelet and evpleg on the corpus:
//! the single table the test tier (`tests/tests/fidelity_diff.rs`) and
//! docs/fidelity.md read. A difference is deliberate (evpleg differs on
//! purpose, and says why) or an open bug in the agent (what the kubelet does,
//! what evpleg does; fixed elsewhere, then its row goes). Any difference not
//! here fails the tier, and so does a row no difference of the run matched
//! ([`stale`]), unless it is marked intermittent (a difference of timing that
//! shows in some runs only): the table stays true.

use serde_json::Value;

use super::Mode;

/// Why a difference is allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// evpleg differs on purpose: the reason.
    Deliberate(&'static str),
    /// The oracle cannot run the case as a node would here (the stock
    /// kubelet's private mount namespace): why.
    Harness(&'static str),
    /// An open bug in the agent: what the kubelet does, what evpleg does.
    Bug {
        kubelet: &'static str,
        evpleg: &'static str,
    },
}

/// The modes a known difference shows in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Modes {
    Both,
    Static,
    Api,
}

impl Modes {
    pub fn has(self, mode: Mode) -> bool {
        matches!(
            (self, mode),
            (Self::Both, _) | (Self::Static, Mode::Static) | (Self::Api, Mode::Api)
        )
    }
}

/// Which way a difference goes, for a row that explains one way only: the
/// kernel PLEG reports starts and deaths at once, where the kubelet's
/// relist sees them up to a second late, so evpleg seeing or acting first
/// is deliberate and the other way round is not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// Every value the kubelet's list holds (states, phases, events of a
    /// reason; none at all) is in evpleg's, which holds more or in another
    /// order of first appearance.
    EvplegSawMore,
    /// evpleg's duration is the shorter.
    EvplegSooner,
    /// Every value evpleg's list holds is in the kubelet's, which holds
    /// more (an intermediate state evpleg never showed).
    KubeletSawMore,
}

impl When {
    /// Whether the difference of `kubelet` and `evpleg` goes this way.
    pub fn holds(self, kubelet: &Value, evpleg: &Value) -> bool {
        match self {
            Self::EvplegSawMore => {
                let (Some(e), k) = (evpleg.as_array(), kubelet.as_array()) else {
                    return false;
                };
                (kubelet.is_null() || k.is_some()) && k.into_iter().flatten().all(|v| e.contains(v))
            }
            Self::EvplegSooner => matches!(
                (kubelet.as_i64(), evpleg.as_i64()),
                (Some(k), Some(e)) if e < k
            ),
            Self::KubeletSawMore => Self::EvplegSawMore.holds(evpleg, kubelet),
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Self::EvplegSawMore => "evpleg saw all the kubelet saw, and more",
            Self::EvplegSooner => "evpleg's the shorter",
            Self::KubeletSawMore => "the kubelet saw all evpleg saw, and more",
        }
    }
}

/// One known difference: a case (exact, `prefix*`, or `*`: any) and a field
/// (exact, `*suffix`, `prefix*`, or `*`: any), in some modes, and when
/// `when` is set, only a difference that goes that way.
#[derive(Debug, Clone, Copy)]
pub struct Known {
    pub case: &'static str,
    pub field: &'static str,
    pub verdict: Verdict,
    pub modes: Modes,
    /// Shows in some runs only (timing): not stale when a run lacks it.
    pub intermittent: bool,
    pub when: Option<When>,
}

/// A deliberate difference in both modes.
const fn deliberate(case: &'static str, field: &'static str, why: &'static str) -> Known {
    Known {
        case,
        field,
        verdict: Verdict::Deliberate(why),
        modes: Modes::Both,
        intermittent: false,
        when: None,
    }
}

impl Known {
    /// Only in `modes`.
    const fn only(self, modes: Modes) -> Self {
        Self { modes, ..self }
    }

    /// Shows in some runs only.
    const fn intermittent(self) -> Self {
        Self {
            intermittent: true,
            ..self
        }
    }

    /// Explains only a difference that goes `when`'s way (intermittent: a
    /// difference of timing).
    const fn when(self, when: When) -> Self {
        Self {
            when: Some(when),
            intermittent: true,
            ..self
        }
    }

    /// The field as the report shows it (markdown): with the way the row
    /// explains.
    pub fn field_shown(&self) -> String {
        match self.when {
            Some(w) => format!("`{}` ({})", self.field, w.describe()),
            None => format!("`{}`", self.field),
        }
    }
}

/// The table: every row is a deliberate difference, the harness's, or an
/// open bug in the agent, found by this harness (docs/fidelity.md lists each
/// with both values).
pub const KNOWN: &[Known] = &[
    // Before the `*` rows: a row explains the differences it matches first.
    Known {
        case: "emptydir-subpath",
        field: "condition *",
        verdict: Verdict::Harness(
            "the stock kubelet's app exits 1 (its `app: state` row: the subPath's bind mount is in the kubelet's private mount namespace) and the pod fails: its conditions say PodFailed where evpleg's say PodCompleted, and its PodReadyToStartContainers is False once the sandbox is stopped",
        ),
        modes: Modes::Both,
        intermittent: true,
        when: None,
    },
    Known {
        case: "emptydir-subpath",
        field: "app: state*",
        verdict: Verdict::Harness(
            "the stock kubelet makes a subPath's bind mount in its private mount namespace, which containerd (in the host's) does not see: its app finds the volume's directory empty and exits 1 (`terminated:Error` in its states seen); evpleg's app reads the file",
        ),
        modes: Modes::Both,
        intermittent: false,
        when: None,
    },
    Known {
        case: "emptydir-subpath",
        field: "phases",
        verdict: Verdict::Harness(
            "the stock kubelet's app exits 1 (its `app: state` row) and its pod ends Failed; evpleg's ends Succeeded",
        ),
        modes: Modes::Both,
        intermittent: false,
        when: None,
    },
    deliberate(
        "volume-projected",
        "*",
        "the kubelet's projected volume plugin asks for its API client before it reads any source (`cannot setup projected volume ... because kube client is not configured`, pkg/volume/projected): a standalone kubelet never mounts one, and its pod stays ContainerCreating (never shown here); evpleg needs the API only for the sources that read it (configMap, secret, serviceAccountToken) and mounts a downwardAPI-only projected volume without one (docs/pod-lifecycle.md, volumes)",
    )
    .only(Modes::Static),
    deliberate(
        "volume-csi-inline",
        "*",
        "a standalone kubelet registers no CSI driver: its registration handler first publishes the driver's node id in the Node and CSINode objects (`nodeinfomanager.InstallCSIDriver`: `error getting kube client`), and without a CSIDriver object it refuses an inline volume anyway (`volume mode \"Ephemeral\" not supported by driver ... (no CSIDriver object)`, csi_mounter.go): its pod stays ContainerCreating (never shown here); evpleg registers drivers without the API server and allows inline volumes of every driver (docs/csi.md; docs/pod-lifecycle.md, volumes). In the API mode, with the driver's CSIDriver object, both mount it",
    )
    .only(Modes::Static),
    tmpfs_unseen("emptydir-memory"),
    tmpfs_unseen("volume-downward-api"),
    // In Static, the deliberate row above explains every field.
    tmpfs_unseen("volume-projected").only(Modes::Api),
    tmpfs_unseen("volume-secret"),
    deliberate(
        "volume-configmap-missing",
        "event FailedMount",
        "a sync waits for the pod's volumes 5 s in evpleg, 2 min 3 s in the kubelet (`WaitForAttachAndMount`; evpleg's pod workers cannot cancel a sync, docs/volumes.md): evpleg's `Unable to attach or mount volumes` event comes within the case, the kubelet's after it; the volume's own `MountVolume.SetUp failed` is the same",
    )
    .only(Modes::Api)
    .when(When::EvplegSawMore),
    deliberate(
        "admission-selinux",
        "*",
        "evpleg refuses at admission a field it does not implement, naming it (`UnsupportedPodSpec`: `seLinuxOptions`), where the kubelet hands the options to the runtime, and containerd on a node without SELinux runs the pod unlabelled (docs/pod-lifecycle.md, the fields the agent does not implement)",
    ),
    deliberate(
        "*",
        "event ContainerDied",
        "evpleg reports each container death its kernel PLEG saw, with its exit code and how long before the runtime reported it (docs/pod-lifecycle.md, its events table); the kubelet has no such event",
    )
    .only(Modes::Api),
    // Timing that goes the kernel PLEG's way (only that way: the other way
    // is not explained).
    deliberate("*", "*: states seen", SEEN_AT_ONCE).when(When::EvplegSawMore),
    deliberate("*", "phases", SEEN_AT_ONCE).when(When::EvplegSawMore),
    deliberate(
        "*",
        "event BackOff",
        "as for `*: states seen`: evpleg finds a crash at once, within its 1 s back-off, and records BackOff for the sync that waits; the kubelet's relist found the crash after the back-off had passed, and it restarted the container without one",
    )
    .when(When::EvplegSawMore),
    deliberate(
        "*",
        "*: restart wait ms",
        "the kernel PLEG reports the death at once, and the restart comes at the back-off's expiry plus the kubelet's jitter (1.0 to 1.5 s with the 1 s back-off); the kubelet's relist sees the death up to a second late and its retry waits for a relist newer than its failed sync (2.3 to 3.3 s; docs/pod-lifecycle.md, CrashLoopBackOff), and when it finds the crash after the back-off it restarts at once",
    )
    .when(When::EvplegSooner),
    deliberate(
        "*",
        "*: end after removal ms",
        "the kubelet's pod worker waits for the PLEG's next refresh of the pod's status (its 1 s relist) before it stops the containers of a pod going from sync to terminating (`podCache.GetNewerThan` in `pod_workers.go`, whose comment names the ~1 s this adds and a continuous PLEG as the cure); evpleg's worker gets its view from an on-demand pod relist at once",
    )
    .when(When::EvplegSooner),
    deliberate(
        "poststart-fails",
        "phases",
        "the pod is Pending between the postStart hook's failure (the container waiting, PostStartHookError) and the container's stop; the kubelet's relist sees the stop up to a second later and its Pending is written to the API server first; evpleg's kernel PLEG sees it at once, and its status manager, which writes the newest status of a pod once the write in flight returns (the kubelet's too), writes Failed in its place (standalone, its `/pods` polled every 50 ms shows the Pending)",
    )
    .only(Modes::Api)
    .intermittent(),
    deliberate("*", "phases", SHORTER_THAN_A_WRITE)
        .only(Modes::Api)
        .when(When::KubeletSawMore),
    deliberate("*", "*: states seen", SHORTER_THAN_A_WRITE)
        .only(Modes::Api)
        .when(When::KubeletSawMore),
    deliberate(
        "init-sandbox-killed",
        "*",
        "the kubelet notices a sandbox's death by relisting: here it had not when the init container completed, and it started the app container in the dead sandbox (RunContainerError, lastState terminated 128 StartError `failed to create containerd task`, a Failed event) before making a new sandbox and running the init container again; evpleg's kernel PLEG sees the pause process die, and it makes the new sandbox at once (SandboxChanged, the running init container stopped), as the kubelet does once it has noticed (docs/pod-lifecycle.md, the kernel PLEG); when the sandbox dies within some 50 ms of the init container's end, evpleg's worker may already sync on the end alone and start the app in the dead sandbox too (RunContainerError, as the kubelet usually does; seen in one API run)",
    )
    .intermittent(),
    deliberate(
        "static-updated",
        "*",
        "the kubelet starts a static pod's new version (its manifest changed in place) only at the new worker's requeue after `allowStaticPodStart` first refused it, 10 to 15 s later (`backOffPeriod` with jitter), past the case's 14 s: within them it serves the new pod without container statuses; evpleg wakes the new version as soon as the old one's worker finished (`pod_workers::static_pods`)",
    )
    .only(Modes::Static)
    .intermittent(),
    deliberate(
        "prestop-*",
        "event Unhealthy",
        "the kubelet's readiness worker reads the status manager's status, which still shows the container running after it was stopped: its exec probe errors (`Readiness probe errored and resulted in unknown state: rpc error: code = NotFound desc = failed to exec in container: ...`); evpleg's reads the PLEG's cache, which has the kernel's report of the death, and does not probe a dead container (a probe that cannot run is recorded as the kubelet's: `prober::worker`)",
    )
    .only(Modes::Api)
    .intermittent(),
    deliberate(
        "readiness-delete",
        "event Unhealthy",
        "as for `prestop-*`: the kubelet probes the stopped container's readiness on its lagging status (the probe errors); evpleg knows it died and does not",
    )
    .only(Modes::Api)
    .intermittent(),
    Known {
        case: "admission-resources",
        field: "pod reason, message",
        verdict: Verdict::Harness(ADMISSION_ORDER),
        modes: Modes::Api,
        intermittent: true,
        when: None,
    },
    Known {
        case: "admission-resources",
        field: "event OutOfcpu",
        verdict: Verdict::Harness(ADMISSION_ORDER),
        modes: Modes::Api,
        intermittent: true,
        when: None,
    },
];

/// Why evpleg shows states the kubelet can miss.
const SEEN_AT_ONCE: &str = "the kernel PLEG reports a container's start and death at once, where the kubelet's 1 s relist sees them up to a second late: evpleg shows states shorter than that period, which the kubelet's relist can pass over (the run of a container that runs about 1 s, and so the pod's Running; a CrashLoopBackOff evpleg finds within the 1 s back-off, where the kubelet finds the crash after it and restarts at once); the order of first appearance differs when the kubelet missed a first run (docs/pod-lifecycle.md, the kernel PLEG)";

/// Why evpleg's API statuses can lack a state the kubelet's show.
const SHORTER_THAN_A_WRITE: &str = "a state shorter than a status write can be missing from the API server: both status managers write a pod's newest status once the write before it returns (the kubelet's `syncBatch`, evpleg's `status::manager`), and the harness lists the pods every 50 ms; evpleg's intermediate states are the shorter, its kernel PLEG seeing the next start or death at once where the kubelet's last until its next 1 s relist (sidecar-job's Pending with its job PodInitializing lasts one container start; always-signal's CrashLoopBackOff, from the back-off's retry sync to the restarted container's start; docs/pod-lifecycle.md, the status manager). Seen in API mode only, in one of five whole runs, the same cases agreeing in the other four and alone";

/// The row of a case whose app reads a tmpfs volume ([`TMPFS_UNSEEN`]).
const fn tmpfs_unseen(case: &'static str) -> Known {
    Known {
        case,
        field: "app: state",
        verdict: Verdict::Harness(TMPFS_UNSEEN),
        modes: Modes::Both,
        intermittent: false,
        when: None,
    }
}

/// Why the stock kubelet's app does not see a tmpfs volume's content.
const TMPFS_UNSEEN: &str = "the stock kubelet mounts a tmpfs (an emptyDir of medium Memory, and the emptyDir a downwardAPI, projected or secret volume is written in) in its private mount namespace, which containerd (in the host's) does not see: its app finds the directory on the node's disk (`ext4`) and the volume's files missing (an empty `|`); evpleg's app reads `tmpfs` and the files, as the emptydir-subpath rows";

/// Why the API pods' admission can differ in `used`.
const ADMISSION_ORDER: &str = "the corpus's API pods reach each node at once, in the order of its watch: the kubelet had admitted a pod requesting 250m before this one (`used: 250`), evpleg none yet (`used: 0`); the rejection is the same";

/// The known difference for `field` of `case` in `mode`, whose values are
/// `kubelet` and `evpleg`, if any.
pub fn lookup(
    mode: Mode,
    case: &str,
    field: &str,
    kubelet: &Value,
    evpleg: &Value,
) -> Option<&'static Known> {
    KNOWN.iter().find(|k| {
        k.modes.has(mode)
            && case_matches(k.case, case)
            && k.when.is_none_or(|w| w.holds(kubelet, evpleg))
            && match (k.field.strip_prefix('*'), k.field.strip_suffix('*')) {
                (Some(suffix), _) => field.ends_with(suffix),
                (None, Some(prefix)) => field.starts_with(prefix),
                (None, None) => k.field == field,
            }
    })
}

/// Whether a row's case pattern (exact, `prefix*`, `*`) names `case`.
pub fn case_matches(pattern: &str, case: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => case.starts_with(prefix),
        None => pattern == case,
    }
}

/// Whether row `k` is the same row as `other` (the table has no two rows of
/// the same case, field, modes and way).
pub fn same_row(k: &Known, other: &Known) -> bool {
    k.case == other.case && k.field == other.field && k.modes == other.modes && k.when == other.when
}

/// The rows of the table a run should have matched and did not: rows of
/// `mode`, not intermittent, whose case was run (`ran`), or whose case is a
/// pattern (`*`, `prefix*`) when the whole corpus was (`whole`), which no
/// difference of the run (`matched`, the rows the differences matched)
/// names.
pub fn stale(
    mode: Mode,
    ran: &[&str],
    whole: bool,
    matched: &[&'static Known],
) -> Vec<&'static Known> {
    KNOWN
        .iter()
        .filter(|k| k.modes.has(mode) && !k.intermittent)
        .filter(|k| {
            if k.case.ends_with('*') {
                whole
            } else {
                ran.contains(&k.case)
            }
        })
        .filter(|k| !matched.iter().any(|m| same_row(k, m)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::When;
    use serde_json::{Value, json};

    /// Each row: the rule, the kubelet's value, evpleg's, whether it holds.
    #[test]
    fn a_row_s_direction_holds_only_the_way_it_says() {
        let rows: &[(When, Value, Value, bool)] = &[
            (When::EvplegSawMore, json!(["a"]), json!(["a", "b"]), true),
            (When::EvplegSawMore, Value::Null, json!(["a"]), true),
            (When::EvplegSawMore, json!(["a", "b"]), json!(["a"]), false),
            (When::EvplegSawMore, json!(["a"]), Value::Null, false),
            (When::KubeletSawMore, json!(["a", "b"]), json!(["b"]), true),
            (When::KubeletSawMore, json!(["a"]), Value::Null, true),
            (When::KubeletSawMore, json!(["a"]), json!(["a", "c"]), false),
            (When::KubeletSawMore, Value::Null, json!(["a"]), false),
            (When::EvplegSooner, json!(900), json!(300), true),
            (When::EvplegSooner, json!(300), json!(900), false),
        ];
        for (i, (when, kubelet, evpleg, holds)) in rows.iter().enumerate() {
            assert_eq!(when.holds(kubelet, evpleg), *holds, "row {i}: {when:?}");
        }
    }
}
