//! The known differences between the stock kubelet and evpleg on the corpus:
//! the single table the test tier (`tests/tests/fidelity_diff.rs`) and
//! docs/fidelity.md read. A difference is deliberate (evpleg differs on
//! purpose, and says why) or an open bug in the agent (what the kubelet does,
//! what evpleg does; fixed elsewhere, then its row goes). Any difference not
//! here fails the tier, and so does a row no difference of the run matched
//! ([`stale`]), unless it is marked intermittent (a difference of timing that
//! shows in some runs only): the table stays true.

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

/// One known difference: a case (exact, `prefix*`, or `*`: any) and a field
/// (exact, `*suffix`, `prefix*`, or `*`: any), in some modes.
#[derive(Debug, Clone, Copy)]
pub struct Known {
    pub case: &'static str,
    pub field: &'static str,
    pub verdict: Verdict,
    pub modes: Modes,
    /// Shows in some runs only (timing): not stale when a run lacks it.
    pub intermittent: bool,
}

/// An open bug in both modes, seen in every run.
const fn bug(
    case: &'static str,
    field: &'static str,
    kubelet: &'static str,
    evpleg: &'static str,
) -> Known {
    Known {
        case,
        field,
        verdict: Verdict::Bug { kubelet, evpleg },
        modes: Modes::Both,
        intermittent: false,
    }
}

/// A deliberate difference in both modes.
const fn deliberate(case: &'static str, field: &'static str, why: &'static str) -> Known {
    Known {
        case,
        field,
        verdict: Verdict::Deliberate(why),
        modes: Modes::Both,
        intermittent: false,
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
}

/// The table: every row is an open bug in the agent or a deliberate
/// difference, found by this harness (docs/fidelity.md lists each with both
/// values).
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
    },
    Known {
        case: "emptydir-subpath",
        field: "app: state*",
        verdict: Verdict::Harness(
            "the stock kubelet makes a subPath's bind mount in its private mount namespace, which containerd (in the host's) does not see: its app finds the volume's directory empty and exits 1 (`terminated:Error` in its states seen); evpleg's app reads the file",
        ),
        modes: Modes::Both,
        intermittent: false,
    },
    Known {
        case: "emptydir-subpath",
        field: "phases",
        verdict: Verdict::Harness(
            "the stock kubelet's app exits 1 (its `app: state` row) and its pod ends Failed; evpleg's ends Succeeded",
        ),
        modes: Modes::Both,
        intermittent: false,
    },
    bug(
        "*",
        "phases",
        "serves Running while a container that runs 1 s runs (in some runs not, as in `*: states seen`), and a static pod it rejects at admission first as Pending",
        "goes from Pending to Succeeded/Failed without a Running status seen (its statuses polled every 50 ms) when the container runs about 1 s and its pod relists queue (less often since a relist's inspections run together; the counts in `*: states seen`), and serves a rejected pod Failed at once",
    )
    .intermittent(),
    bug(
        "*",
        "*: states seen",
        "serves each state in turn: `running` for a container that runs 1 s (though with the whole corpus at once its 1 s relist can miss the run: rows where only the kubelet missed `running`, Static 0 and 13, Api 1 and 2 in the whole runs at 393de01 and a2b4519); `terminated` between a crash and CrashLoopBackOff; after the init containers, PodInitializing until the app container runs",
        "misses `running` for a container that runs about 1 s (or the crash's `terminated` before CrashLoopBackOff) with the whole corpus at once, when its workers wait for their pod relists: rows where only evpleg missed `running` Static 16 and Api 28 at 393de01, Static 5 and Api 8 at a2b4519, since a relist inspects its pods 8 at a time (`relist::INSPECTIONS_AT_ONCE`), not one after another; the first relists after 48 pods start still take up to 1 s while containerd makes their sandboxes. It served ContainerCreating after the init containers too, and a created container's ContainerCreating where the kubelet gives no reason: fixed (`status::generate`, the kubelet's default waiting reasons)",
    )
    .intermittent(),
    bug(
        "sidecar-job",
        "sidecar: *",
        "stops the sidecar once the pod's regular containers have ended under restartPolicy Never: SIGTERM, here handled, so `terminated` Completed, exit 0, not ready",
        "still served the sidecar running (ready, started) 2 s after the pod's phase became Succeeded in most runs (stopped in time in some)",
    )
    .intermittent(),
    bug(
        "*",
        "*: end after removal ms",
        "ends a deleted static pod's containers 2.2 to 4.4 s after its manifest's removal (its file source noticing, the preStop hook, then SIGTERM and the grace period)",
        "ends them 1.1 to 4.1 s later than the kubelet in some runs (readiness-delete 3.6 to 3.9 s against 2.2 to 2.4 s; prestop-graceful once 6.3 s against 2.4 s; prestop-fails once 8.6 s against 4.4 s), the same within 0.7 s in others",
    )
    .intermittent(),
    bug(
        "never-signal",
        "app: state",
        "reported exit code 1 for a shell that sent itself SIGTERM in a shared pid namespace (to investigate: which pid namespace each set up)",
        "reported 143 (killed by SIGTERM), and once `signal: 15`",
    )
    .intermittent(),
    bug(
        "image-pull-fails",
        "app: state",
        "at 15 s: ImagePullBackOff with the message `Back-off pulling image \"...\": ErrImagePull: <the runtime's error>` (in another run still ErrImagePull with the runtime's error)",
        "the same messages since the pull's error is kept for the back-off (`kuberuntime::images::PullErrors`); which of the two states a side serves at 15 s is timing (its 10 s pull back-off against its pod syncs)",
    )
    .intermittent(),
    deliberate(
        "init-sandbox-killed",
        "*",
        "the kubelet notices a sandbox's death by relisting: here it had not when the init container completed, and it started the app container in the dead sandbox (RunContainerError, lastState terminated 128 StartError `failed to create containerd task`, a Failed event) before making a new sandbox and running the init container again; evpleg's kernel PLEG sees the pause process die, and it makes the new sandbox at once (SandboxChanged, the running init container stopped), as the kubelet does once it has noticed (docs/pod-lifecycle.md, the kernel PLEG)",
    )
    .intermittent(),
    deliberate(
        "static-updated",
        "*",
        "the kubelet starts a static pod's new version (its manifest changed in place) only at the new worker's requeue after `allowStaticPodStart` first refused it, 10 to 15 s later (`backOffPeriod` with jitter), past the case's 14 s: within them it serves the new pod without container statuses; evpleg wakes the new version as soon as the old one's worker finished (`pod_workers::static_pods`)",
    )
    .only(Modes::Static)
    .intermittent(),
    bug(
        "sidecar-restarts",
        "*",
        "restarts the sidecar after its first exit at once (no back-off entry yet), and shows its second exit, found by its 1 s relist, after the case's 2 s; its status shows a back-off one sync after the sync that found it (the status is generated before SyncPod, from the reason cache SyncPod fills)",
        "starts the app as the kubelet does (same start order: the earlier text here, that it had not, is not what the records show); its kernel PLEG reports the sidecar's second exit at once, within the case's 2 s, and it shows the back-off (`waiting:CrashLoopBackOff`) in the status of the sync that found it, one sync before the kubelet would: to fix, with the back-off kept in the reason cache as the kubelet's; no BackOff event in some whole runs: its queued pod relists (as for `event BackOff`)",
    )
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
    bug(
        "image-pull-fails",
        "event Failed",
        "the pull's messages of the runtime",
        "differ (to compare: only the first entries were printed)",
    )
    .only(Modes::Api)
    .intermittent(),
    deliberate(
        "*",
        "event ContainerDied",
        "evpleg reports each container death its kernel PLEG saw, with its exit code and how long before the runtime reported it (docs/pod-lifecycle.md, its events table); the kubelet has no such event",
    )
    .only(Modes::Api),
    bug(
        "*",
        "condition PodReadyToStartContainers",
        "sets it False (PodSandboxNotReady, `pod sandbox is not ready`) once a finished pod's sandbox is stopped, within the 2 s a case waits after its end",
        "writes the same once it has stopped the sandbox, and does within the 2 s when a case runs alone; with the whole corpus at once on this 2-core machine its pod relists queue behind one another (the worker waits for a view newer than its terminal sync before stopping the sandbox): 2 to 3 s from the terminal status to the sandbox's stop, so the case ends with it still True (22 of 48 cases in a mode)",
    )
    .intermittent(),
    bug(
        "*",
        "*: restart wait ms",
        "restarts a crashed container 2.3 to 3.3 s after its end (CrashLoopBackOff 1 s): its 1 s relist sees the death up to 1 s late, and the sync after its back-off error waits for a relist newer than that sync and for its 1 s sync ticker, then `wait.Jitter` 0.5 of the wait left",
        "when a case runs alone, at the back-off's expiry plus the kubelet's jitter, 1.0 to 1.5 s, which is deliberate (docs/pod-lifecycle.md: the kernel PLEG reports the death at once, and a sync that only finds the back-off calls no runtime, so the next one acts on the same view) and differs by more than the 1.5 s tolerance when the kubelet's relist came late; the bug is under the whole corpus at once: 3.8 to 8.4 s (its queued pod relists, as for PodReadyToStartContainers)",
    )
    .intermittent(),
    bug(
        "*",
        "event Unhealthy",
        "recorded a probe's failure before the container could answer in some whole runs (`connection refused` before an HTTP server listened, a startup probe's empty failure before its file existed)",
        "recorded none of these in the same runs: whether its first probe comes later than the kubelet's under load is to investigate (startup-gating, sidecar-job-fails, liveness-http-fails; one to three cases a run)",
    )
    .intermittent(),
    Known {
        case: "admission-resources",
        field: "pod reason, message",
        verdict: Verdict::Harness(ADMISSION_ORDER),
        modes: Modes::Api,
        intermittent: true,
    },
    Known {
        case: "admission-resources",
        field: "event OutOfcpu",
        verdict: Verdict::Harness(ADMISSION_ORDER),
        modes: Modes::Api,
        intermittent: true,
    },
    bug(
        "*",
        "event BackOff",
        "records BackOff when a sync finds a crashed container within its CrashLoopBackOff (1 s here)",
        "recorded none for onfailure-retries in one whole run (API): the worker, having started the container, waits for a pod relist newer than that sync; with the whole corpus at once its pod relists took up to 2 s (`no pod status newer than the last sync yet`), so its sync after the kernel's report of the death came after the 1 s back-off had passed (the same queued relists as `*: states seen`)",
    )
    .intermittent(),
];

/// Why the API pods' admission can differ in `used`.
const ADMISSION_ORDER: &str = "the corpus's API pods reach each node at once, in the order of its watch: the kubelet had admitted a pod requesting 250m before this one (`used: 250`), evpleg none yet (`used: 0`); the rejection is the same";

/// The known difference for `field` of `case` in `mode`, if any.
pub fn lookup(mode: Mode, case: &str, field: &str) -> Option<&'static Known> {
    KNOWN.iter().find(|k| {
        k.modes.has(mode)
            && case_matches(k.case, case)
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
/// the same case, field and modes).
pub fn same_row(k: &Known, other: &Known) -> bool {
    k.case == other.case && k.field == other.field && k.modes == other.modes
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
