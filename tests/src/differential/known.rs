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
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Self::EvplegSawMore => "evpleg saw all the kubelet saw, and more",
            Self::EvplegSooner => "evpleg's the shorter",
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
        when: None,
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
        "*",
        "event ContainerDied",
        "evpleg reports each container death its kernel PLEG saw, with its exit code and how long before the runtime reported it (docs/pod-lifecycle.md, its events table); the kubelet has no such event",
    )
    .only(Modes::Api),
    // Timing that goes the kernel PLEG's way: before the rows of the bugs
    // that go the other way.
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
    bug(
        "*",
        "phases",
        "serves Running while a container that runs 1 s runs (in some runs not: its 1 s relist can pass over the run, a deliberate row above when evpleg saw it), and a static pod it rejects at admission first as Pending",
        "goes from Pending to Succeeded/Failed without a Running status seen while the container ran (its statuses polled every 50 ms) when the container runs about 1 s, with the whole corpus at once: its first status after the start comes after the run (as for `*: states seen`); and serves a rejected pod Failed at once",
    )
    .intermittent(),
    bug(
        "*",
        "*: states seen",
        "serves each state in turn: `running` for a container that runs 1 s (its relist can pass over it: a deliberate row above when evpleg saw it); `terminated` between a crash and the restart; after the init containers, PodInitializing until the app container runs",
        "misses `running` for a container that runs about 1 s, with the whole corpus at once on 2 cores, when its first status after the start comes after the run: the sync that started it goes on to start the pod's next container or run its postStart hook (the kubelet's SyncPod does the same, and each took 0.9 to 2.5 s under this load), or the worker's pod relist after the start comes late (a relist batch waited up to 2.4 s, then 1.7 s, on containerd's verbose sandbox statuses: asked once per pid since, and never while the pod's shim creates a task, `evpleg_cri::runtime`; at most 0.44 s since). Stale displays are not counted (the kubelet's relist and containerd's exit lag showed many such runs `running` after they had ended). It served ContainerCreating after the init containers too, and a created container's ContainerCreating where the kubelet gives no reason: fixed (`status::generate`, the kubelet's default waiting reasons)",
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
        "ends a deleted static pod's containers 2.0 to 4.7 s after its manifest's removal (its file source noticing, its worker waiting for the PLEG's next refresh, the preStop hook, then SIGTERM and the grace period)",
        "ended them later than the kubelet, by more than the 0.7 s tolerance, in some earlier whole runs (readiness-delete 3.6 to 3.9 s against 2.2 to 2.4 s; prestop-graceful once 6.3 s against 2.4 s); sooner is the deliberate row above",
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
    bug(
        "sidecar-restarts",
        "*",
        "restarts the sidecar after its first exit at once (no back-off entry yet), and shows its second exit, found by its 1 s relist, after the case's 2 s; its status shows a back-off one sync after the sync that found it (the status is generated before SyncPod, from the reason cache SyncPod fills)",
        "starts the app as the kubelet does (same start order: the earlier text here, that it had not, is not what the records show); its kernel PLEG reports the sidecar's second exit at once, within the case's 2 s (and the back-off, once shown in the status of the sync that found it, now shows one sync later as the kubelet's: the reason cache, `kuberuntime::reasons`); no BackOff event in some whole runs: its pod relists under the whole corpus (as for `event BackOff`)",
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
    bug(
        "*",
        "*: restart wait ms",
        "restarts a crashed container 2.1 to 3.4 s after its end (CrashLoopBackOff 1 s): its 1 s relist sees the death up to 1 s late, and the sync after its back-off error waits for a relist newer than that sync, then `wait.Jitter` 0.5 of the wait left; a first crash (no back-off yet) once its relist saw it",
        "restarted later than the kubelet by more than the 1.5 s tolerance in some whole runs (3.8 to 8.4 s before the pod relists stopped asking known pids again; sidecar-restarts' sidecar 2.9 s against 1.1 s in a static run since; onfailure-retries 4.4 s against 1.3 s and liveness-tcp-fails 3.3 s against 0.8 s in the static run at 3500d22, where a restart after a death only the kernel had reported waited for containerd's report, 4.3 s late: it waits at most `kuberuntime::actions::REAP_SLACK` past the back-off since); sooner is the deliberate row above",
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
    bug(
        "*",
        "event Killing",
        "records no Killing for an init container that had completed: its relist saw the exit",
        "recorded `Stopping container init` for an init container that had completed, in one API run: containerd reported the exit 3.5 s after the kernel, past the PLEG's confirmation bound (`relist::CONFIRM_BOUND`, then 2 s), so the runtime's view won (the container running again in the cache, the status's regression refused) and the pod's kill stopped it. containerd's exit reports lagged up to 3.5 s under the whole corpus (p50 1.4 s, p90 2.5 s in that run); the bound is 5 s since: the row stays until whole runs no longer show it",
    )
    .intermittent(),
    bug(
        "*",
        "event BackOff",
        "records BackOff when a sync finds a crashed container within its CrashLoopBackOff (1 s here)",
        "recorded none for onfailure-retries in one whole run (API): the worker, having started the container, waits for a pod relist newer than that sync; with the whole corpus at once its pod relists took up to 2 s (`no pod status newer than the last sync yet`), so its sync after the kernel's report of the death came after the 1 s back-off had passed (the same queued relists as `*: states seen`)",
    )
    .intermittent(),
];

/// Why evpleg shows states the kubelet can miss.
const SEEN_AT_ONCE: &str = "the kernel PLEG reports a container's start and death at once, where the kubelet's 1 s relist sees them up to a second late: evpleg shows states shorter than that period, which the kubelet's relist can pass over (the run of a container that runs about 1 s, and so the pod's Running; a CrashLoopBackOff evpleg finds within the 1 s back-off, where the kubelet finds the crash after it and restarts at once); the order of first appearance differs when the kubelet missed a first run (docs/pod-lifecycle.md, the kernel PLEG)";

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
