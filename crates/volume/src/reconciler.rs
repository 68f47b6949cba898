//! The reconciler (the kubelet's `volumemanager/reconciler`): converges the
//! actual state of the world on the desired one. Each pass decides
//! ([`plan`], pure and table-tested) then starts the operations, each on its
//! own task (the kubelet's operation executor), at most one at a time per
//! volume and pod (per volume for a device operation: its
//! `nestedPendingOperations`), a failed one retried after an exponential
//! back-off (500 ms doubling to 2 min 2 s, the kubelet's). The order of a
//! pass is the kubelet's: tear down what is no longer desired, mount
//! devices and set up what is, unmount devices no pod uses. Failed set-ups
//! are FailedMount events on the pod (`MountVolume.SetUp failed for volume
//! "v" : ...`); failed tear-downs are logged, as the kubelet's.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::Shared;
use super::actual::MountedPod;
use super::plugin::{
    PluginError, PodContext, SetUpArgs, Spec, TearDownArgs, UniqueVolumeName, VolumePlugin,
};
use super::state::{DeviceMountState, DeviceMountTransition, PodMountState, PodMountTransition};
use evpleg_core::ids::PodUid;
use evpleg_record::EventType;

/// The kubelet's reconciler period: here the shortest wait between two
/// passes that no change asked for.
pub const PERIOD: Duration = Duration::from_millis(100);
/// The longest: with no operation backing off, a pass finds work only after
/// a change of the states (a pod's volumes desired or not, an operation
/// finished), and each change starts a pass at once. The kubelet's pass every
/// 100 ms was a tenth of an idle agent's CPU at 100 pods with no volumes
/// (issue #29); this one is a safety net.
pub const IDLE_PERIOD: Duration = Duration::from_secs(2);

/// The kubelet's operation back-off: initial and cap.
pub const BACKOFF_INITIAL: Duration = Duration::from_millis(500);
pub const BACKOFF_MAX: Duration = Duration::from_secs(122);

/// How long the loop waits for a change after a pass, given the end of the
/// earliest back-off still running ([`pass`]'s answer).
pub fn wait_after(backoff_end: Option<Instant>, now: Instant) -> Duration {
    backoff_end
        .map_or(IDLE_PERIOD, |at| at.saturating_duration_since(now))
        .clamp(PERIOD, IDLE_PERIOD)
}

/// The event reason of a failed mount (the kubelet's `FailedMountVolume`).
pub const FAILED_MOUNT: &str = "FailedMount";

/// One operation the reconciler starts.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Operation {
    MountDevice(UniqueVolumeName),
    SetUp(UniqueVolumeName, PodUid),
    TearDown(UniqueVolumeName, PodUid),
    UnmountDevice(UniqueVolumeName),
}

/// What operations on a volume exclude each other: one per (volume, pod);
/// a device operation (no pod) excludes every other on the volume.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct OpKey(pub UniqueVolumeName, pub Option<PodUid>);

impl Operation {
    pub fn key(&self) -> OpKey {
        match self {
            Self::MountDevice(v) | Self::UnmountDevice(v) => OpKey(v.clone(), None),
            Self::SetUp(v, p) | Self::TearDown(v, p) => OpKey(v.clone(), Some(p.clone())),
        }
    }
}

/// A desired (volume, pod), as [`plan`] sees it.
#[derive(Clone, Debug)]
pub struct Want {
    pub unique: UniqueVolumeName,
    pub pod: PodUid,
    pub device_mountable: bool,
}

/// A volume's actual state, as [`plan`] sees it.
#[derive(Clone, Debug, Default)]
pub struct Have {
    pub device: Option<DeviceMountState>,
    pub pods: BTreeMap<PodUid, PodMountState>,
}

/// One pass's operations, in the kubelet's order, skipping those `busy`
/// says are running or backing off.
pub fn plan(
    wants: &[Want],
    haves: &BTreeMap<UniqueVolumeName, Have>,
    busy: &dyn Fn(&OpKey) -> bool,
) -> Vec<Operation> {
    let wanted: HashSet<(&UniqueVolumeName, &PodUid)> =
        wants.iter().map(|w| (&w.unique, &w.pod)).collect();
    let wanted_volumes: HashSet<&UniqueVolumeName> = wants.iter().map(|w| &w.unique).collect();
    let mut ops = Vec::new();
    // 1. Tear down what is mounted for a pod that no longer wants it.
    for (v, have) in haves {
        for (pod, state) in &have.pods {
            if state.needs_tear_down() && !wanted.contains(&(v, pod)) {
                ops.push(Operation::TearDown(v.clone(), pod.clone()));
            }
        }
    }
    // 2. Mount devices and set up.
    let mut device_planned = HashSet::new();
    for w in wants {
        let have = haves.get(&w.unique);
        let device = have
            .and_then(|h| h.device)
            .unwrap_or(DeviceMountState::NotMounted);
        if w.device_mountable && device != DeviceMountState::GloballyMounted {
            if device_planned.insert(&w.unique) {
                ops.push(Operation::MountDevice(w.unique.clone()));
            }
            continue;
        }
        let state = have
            .and_then(|h| h.pods.get(&w.pod).copied())
            .unwrap_or(PodMountState::NotMounted);
        if state.needs_set_up() {
            ops.push(Operation::SetUp(w.unique.clone(), w.pod.clone()));
        }
    }
    // 3. Unmount devices no pod uses or wants.
    for (v, have) in haves {
        let device = have.device.unwrap_or(DeviceMountState::NotMounted);
        if device != DeviceMountState::NotMounted
            && !wanted_volumes.contains(v)
            && !have.pods.values().any(|s| s.needs_tear_down())
        {
            ops.push(Operation::UnmountDevice(v.clone()));
        }
    }
    // A device operation waits for the pod operations on its volume, and
    // they for it.
    let mut taken: HashSet<OpKey> = HashSet::new();
    ops.retain(|op| {
        let key = op.key();
        let conflict = |k: &OpKey| {
            busy(k)
                || taken.contains(k)
                || (k.1.is_none() && taken.iter().any(|t| t.0 == k.0))
                || taken.contains(&OpKey(k.0.clone(), None))
        };
        if conflict(&key) {
            return false;
        }
        taken.insert(key);
        true
    });
    ops
}

/// Operations running, and the back-off of those that failed.
#[derive(Debug, Default)]
pub struct Pending {
    running: HashSet<OpKey>,
    /// (failures in a row, not before).
    backoff: HashMap<OpKey, (u32, Instant)>,
}

impl Pending {
    pub fn busy(&self, key: &OpKey, now: Instant) -> bool {
        self.running.contains(key)
            || (key.1.is_none() && self.running.iter().any(|k| k.0 == key.0))
            || self.running.contains(&OpKey(key.0.clone(), None))
            || self.backoff.get(key).is_some_and(|(_, at)| now < *at)
    }

    fn finished(&mut self, key: &OpKey, ok: bool, now: Instant) {
        self.running.remove(key);
        if ok {
            self.backoff.remove(key);
        } else {
            let failures = self.backoff.get(key).map(|(n, _)| n + 1).unwrap_or(1);
            let delay = BACKOFF_INITIAL
                .saturating_mul(1 << (failures - 1).min(16))
                .min(BACKOFF_MAX);
            self.backoff.insert(key.clone(), (failures, now + delay));
        }
    }

    /// The end of the earliest back-off after `now`.
    fn next_end(&self, now: Instant) -> Option<Instant> {
        self.backoff
            .values()
            .map(|(_, at)| *at)
            .filter(|at| *at > now)
            .min()
    }

    /// Whether an operation of the pod is running.
    pub fn pod_running(&self, uid: &PodUid) -> bool {
        self.running.iter().any(|k| k.1.as_ref() == Some(uid))
    }

    /// Forgets the back-off of a pod's operations (it is gone).
    pub fn forget_pod(&mut self, uid: &PodUid) {
        self.backoff.retain(|k, _| k.1.as_ref() != Some(uid));
    }
}

/// The pod of a per-pod operation: its context, its name for the volume,
/// the volume's directory.
type PodPart = Option<(PodContext, String, PathBuf)>;

/// What an operation needs, copied out of the states under the lock.
struct Job {
    op: Operation,
    plugin: Arc<dyn VolumePlugin>,
    spec: Spec,
    pod: PodPart,
    /// The node-global directory, or why the plugin could not name it.
    device_path: Result<PathBuf, String>,
}

/// One reconciler pass: plans under the lock and spawns the operations due.
/// Returns the end of the earliest back-off still running, when a pass has
/// work again without a change (an operation started now says so by a change
/// when it ends).
pub(super) fn pass(shared: &Arc<Shared>) -> Option<Instant> {
    let now = Instant::now();
    let (jobs, backoff_end) = {
        let mut w = shared.lock();
        let wants: Vec<Want> = w
            .desired
            .volumes_to_mount()
            .map(|(p, _, v)| Want {
                unique: v.unique.clone(),
                pod: p.ctx.uid.clone(),
                device_mountable: v.device_mountable,
            })
            .collect();
        let haves: BTreeMap<UniqueVolumeName, Have> = w
            .actual
            .volumes()
            .iter()
            .map(|(k, v)| {
                let have = Have {
                    device: Some(v.device),
                    pods: v.pods.iter().map(|(u, p)| (u.clone(), p.state)).collect(),
                };
                (k.clone(), have)
            })
            .collect();
        let ops = plan(&wants, &haves, &|k| w.pending.busy(k, now));
        let mut jobs = Vec::new();
        for op in ops {
            let Some(job) = job_for(shared, &w, op) else {
                continue;
            };
            w.pending.running.insert(job.op.key());
            jobs.push(job);
        }
        (jobs, w.pending.next_end(now))
    };
    for job in jobs {
        let shared = shared.clone();
        tokio::spawn(async move { run(shared, job).await });
    }
    backoff_end
}

fn job_for(shared: &Shared, w: &super::Worlds, op: Operation) -> Option<Job> {
    let device_path =
        |plugin: &Arc<dyn VolumePlugin>, spec: &Spec, v: &UniqueVolumeName| match plugin
            .device_mount_path(spec, &shared.root_dir)
        {
            Ok(Some(p)) => Ok(p),
            Ok(None) => Ok(super::device_mount_path(&shared.root_dir, plugin.name(), v)),
            Err(e) => Err(e.to_string()),
        };
    match &op {
        Operation::MountDevice(v) => {
            let (_, _, d) = w
                .desired
                .volumes_to_mount()
                .find(|(_, _, d)| &d.unique == v)?;
            Some(Job {
                device_path: device_path(&d.plugin, &d.spec, v),
                plugin: d.plugin.clone(),
                spec: d.spec.clone(),
                pod: None,
                op,
            })
        }
        Operation::SetUp(v, uid) => {
            let p = w.desired.pod(uid)?;
            let (outer, d) = p.volumes.iter().find(|(_, d)| &d.unique == v)?;
            Some(Job {
                device_path: device_path(&d.plugin, &d.spec, v),
                plugin: d.plugin.clone(),
                spec: d.spec.clone(),
                pod: Some((
                    p.ctx.clone(),
                    outer.clone(),
                    super::pod_volume_dir(&shared.root_dir, uid, d.plugin.name(), outer),
                )),
                op,
            })
        }
        Operation::TearDown(v, uid) => {
            let a = w.actual.volumes().get(v)?;
            let p = a.pods.get(uid)?;
            Some(Job {
                device_path: device_path(&a.plugin, &a.spec, v),
                plugin: a.plugin.clone(),
                spec: a.spec.clone(),
                pod: Some((p.ctx.clone(), p.outer.clone(), p.dir.clone())),
                op,
            })
        }
        Operation::UnmountDevice(v) => {
            let a = w.actual.volumes().get(v)?;
            Some(Job {
                device_path: match &a.device_path {
                    Some(p) => Ok(p.clone()),
                    None => device_path(&a.plugin, &a.spec, v),
                },
                plugin: a.plugin.clone(),
                spec: a.spec.clone(),
                pod: None,
                op,
            })
        }
    }
}

async fn run(shared: Arc<Shared>, job: Job) {
    let Job {
        op,
        plugin,
        spec,
        pod,
        device_path,
    } = job;
    let device_path = match device_path {
        Ok(p) => p,
        Err(e) => {
            finish(
                &shared,
                op,
                (plugin, spec, pod),
                Err(PluginError::Failed(e)),
                PathBuf::new(),
            );
            return;
        }
    };
    let started = Instant::now();
    let result: Result<(), PluginError> = match (&op, &pod) {
        (Operation::MountDevice(_), _) => match device_path.parent().map(std::fs::create_dir_all) {
            Some(Err(e)) => Err(PluginError::io("create", &device_path)(e)),
            _ => plugin.mount_device(&spec, &device_path).await,
        },
        (Operation::UnmountDevice(_), _) => plugin.unmount_device(&spec, &device_path).await,
        (Operation::SetUp(..), Some((ctx, _, dir))) => {
            let device = plugin
                .device_mountable(&spec)
                .then_some(device_path.as_path());
            set_up(&*plugin, &spec, ctx, dir, device).await
        }
        (Operation::TearDown(..), Some((ctx, outer, dir))) => {
            // The volume's subPath bind mounts first (the kubelet's
            // CleanSubPaths in UnmountVolume).
            let pod_dir = shared.root_dir.join("pods").join(ctx.uid.as_str());
            match super::subpath::clean_sub_paths(&pod_dir, outer) {
                Err(e) => Err(PluginError::Failed(e.to_string())),
                Ok(()) => {
                    let args = TearDownArgs {
                        spec: &spec,
                        pod_uid: &ctx.uid,
                        dir,
                    };
                    plugin.tear_down(args).await
                }
            }
        }
        _ => Ok(()),
    };
    let labels = super::metrics::OperationLabels {
        volume_plugin: plugin.name().to_owned(),
        operation_name: match op {
            Operation::MountDevice(_) => "mount_device",
            Operation::SetUp(..) => "volume_mount",
            Operation::TearDown(..) => "volume_unmount",
            Operation::UnmountDevice(_) => "unmount_device",
        },
        status: if result.is_ok() {
            "success"
        } else {
            "fail-unknown"
        },
        migrated: "false",
    };
    (shared.metrics.duration.get_or_create(&labels)).observe(started.elapsed().as_secs_f64());
    finish(&shared, op, (plugin, spec, pod), result, device_path);
}

/// Records an operation's outcome in the actual state.
fn finish(
    shared: &Arc<Shared>,
    op: Operation,
    (plugin, spec, pod): (Arc<dyn VolumePlugin>, Spec, PodPart),
    result: Result<(), PluginError>,
    device_path: PathBuf,
) {
    let now = Instant::now();
    let mut w = shared.lock();
    let ok = result.is_ok();
    let uncertain = result.as_ref().is_err_and(|e| e.is_uncertain());
    let outcome = match (&op, pod) {
        (Operation::MountDevice(v) | Operation::UnmountDevice(v), _) => {
            let t = match (&op, ok) {
                (Operation::MountDevice(_), true) => DeviceMountTransition::MountDeviceSucceeded,
                (Operation::MountDevice(_), false) => {
                    DeviceMountTransition::MountDeviceFailed { uncertain }
                }
                (_, true) => DeviceMountTransition::UnmountDeviceSucceeded,
                (_, false) => DeviceMountTransition::UnmountDeviceFailed,
            };
            w.actual
                .device_transition(v, (&plugin, &spec, &device_path), t)
        }
        (Operation::SetUp(v, _) | Operation::TearDown(v, _), Some((ctx, outer, dir))) => {
            let t = match (&op, ok) {
                (Operation::SetUp(..), true) => PodMountTransition::SetUpSucceeded,
                (Operation::SetUp(..), false) => PodMountTransition::SetUpFailed { uncertain },
                (_, true) => PodMountTransition::TearDownSucceeded,
                (_, false) => PodMountTransition::TearDownFailed,
            };
            let mounted = MountedPod {
                host_path: plugin.host_path(&spec, &dir),
                attributes: plugin.attributes(&spec),
                ctx: ctx.clone(),
                outer: outer.clone(),
                state: PodMountState::NotMounted,
                dir,
            };
            if let Err(e) = &result {
                let what = if matches!(op, Operation::SetUp(..)) {
                    "MountVolume.SetUp"
                } else {
                    "UnmountVolume.TearDown"
                };
                let message = format!("{what} failed for volume {outer:?} : {e}");
                warn!(pod = %ctx.uid, volume = %v, error = %e, "{what} failed");
                if matches!(op, Operation::SetUp(..)) {
                    shared.events.record(
                        &ctx.pod,
                        None,
                        EventType::Warning,
                        FAILED_MOUNT,
                        message.clone(),
                    );
                    w.last_errors
                        .insert((ctx.uid.clone(), outer.clone()), message);
                }
            } else {
                w.last_errors.remove(&(ctx.uid.clone(), outer.clone()));
                debug!(pod = %ctx.uid, volume = %v, ?op, "volume operation succeeded");
            }
            w.actual.pod_transition(v, (&plugin, &spec), mounted, t)
        }
        _ => Ok(()),
    };
    if let (Operation::MountDevice(v) | Operation::UnmountDevice(v), Err(e)) = (&op, &result) {
        warn!(volume = %v, error = %e, ?op, "device operation failed");
    }
    if let Err(e) = outcome {
        warn!(error = %e, "volume state transition refused");
    }
    if ok && matches!(op, Operation::TearDown(..) | Operation::UnmountDevice(..)) {
        info!(?op, "volume torn down");
    }
    w.pending.finished(&op.key(), ok, now);
    drop(w);
    shared.changed();
}

async fn set_up(
    plugin: &dyn VolumePlugin,
    spec: &Spec,
    ctx: &PodContext,
    dir: &std::path::Path,
    device_mount_path: Option<&std::path::Path>,
) -> Result<(), PluginError> {
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(PluginError::io("create", parent))?;
    }
    let args = SetUpArgs {
        spec,
        pod: ctx,
        dir,
        device_mount_path,
    };
    plugin.set_up(args).await?;
    if plugin.attributes(spec).managed
        && let Some(gid) = ctx.fs_group()
    {
        let path = plugin.host_path(spec, dir);
        super::util::set_volume_ownership(&path, gid, plugin.attributes(spec).read_only)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
