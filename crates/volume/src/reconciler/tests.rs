//! The reconciler's table and model-based tests.
use crate::reconciler::*;
use DeviceMountState as D;
use Operation::*;
use PodMountState as S;

fn v(s: &str) -> UniqueVolumeName {
    UniqueVolumeName(s.into())
}
fn p(s: &str) -> PodUid {
    PodUid::parse(s).unwrap()
}
fn want(vol: &str, pod: &str, dev: bool) -> Want {
    Want {
        unique: v(vol),
        pod: p(pod),
        device_mountable: dev,
    }
}
fn have(device: D, pods: &[(&str, S)]) -> Have {
    Have {
        device: Some(device),
        pods: pods.iter().map(|(u, s)| (p(u), *s)).collect(),
    }
}

const M: S = S::Mounted { remount: false };

#[test]
fn plan_table() {
    let none: &[(&str, Have)] = &[];
    type Case<'a> = (&'a str, Vec<Want>, Vec<(&'a str, Have)>, Vec<Operation>);
    let cases: Vec<Case> = vec![
        ("nothing", vec![], vec![], vec![]),
        (
            "a new volume is set up",
            vec![want("e", "a1", false)],
            none.to_vec(),
            vec![SetUp(v("e"), p("a1"))],
        ),
        (
            "a mounted one is left",
            vec![want("e", "a1", false)],
            vec![("e", have(D::NotMounted, &[("a1", M)]))],
            vec![],
        ),
        (
            "a remount is a set-up",
            vec![want("e", "a1", false)],
            vec![(
                "e",
                have(D::NotMounted, &[("a1", S::Mounted { remount: true })]),
            )],
            vec![SetUp(v("e"), p("a1"))],
        ),
        (
            "an uncertain one is set up again",
            vec![want("e", "a1", false)],
            vec![("e", have(D::NotMounted, &[("a1", S::Uncertain)]))],
            vec![SetUp(v("e"), p("a1"))],
        ),
        (
            "no longer desired: torn down",
            vec![],
            vec![("e", have(D::NotMounted, &[("a1", M)]))],
            vec![TearDown(v("e"), p("a1"))],
        ),
        (
            "uncertain and not desired: torn down",
            vec![],
            vec![("e", have(D::NotMounted, &[("a1", S::Uncertain)]))],
            vec![TearDown(v("e"), p("a1"))],
        ),
        (
            "device first, no set-up before it",
            vec![want("c", "a1", true), want("c", "b2", true)],
            vec![],
            vec![MountDevice(v("c"))],
        ),
        (
            "device uncertain: mounted again",
            vec![want("c", "a1", true)],
            vec![("c", have(D::Uncertain, &[]))],
            vec![MountDevice(v("c"))],
        ),
        (
            "device mounted: set-ups",
            vec![want("c", "a1", true), want("c", "b2", true)],
            vec![("c", have(D::GloballyMounted, &[]))],
            vec![SetUp(v("c"), p("a1")), SetUp(v("c"), p("b2"))],
        ),
        (
            "one pod leaves a shared device",
            vec![want("c", "b2", true)],
            vec![("c", have(D::GloballyMounted, &[("a1", M), ("b2", M)]))],
            vec![TearDown(v("c"), p("a1"))],
        ),
        (
            "device kept while a pod has it mounted",
            vec![],
            vec![("c", have(D::GloballyMounted, &[("a1", M)]))],
            vec![TearDown(v("c"), p("a1"))],
        ),
        (
            "device unmounted after the last pod",
            vec![],
            vec![("c", have(D::GloballyMounted, &[]))],
            vec![UnmountDevice(v("c"))],
        ),
        (
            "uncertain device unmounted too",
            vec![],
            vec![("c", have(D::Uncertain, &[]))],
            vec![UnmountDevice(v("c"))],
        ),
        (
            "a pod moving in while another leaves",
            vec![want("e", "b2", false)],
            vec![("e", have(D::NotMounted, &[("a1", M)]))],
            vec![TearDown(v("e"), p("a1")), SetUp(v("e"), p("b2"))],
        ),
    ];
    for (name, wants, haves, expected) in cases {
        let haves: BTreeMap<_, _> = haves.into_iter().map(|(k, h)| (v(k), h)).collect();
        assert_eq!(plan(&wants, &haves, &|_| false), expected, "{name}");
    }
}

/// Applies an operation's outcome to the model of the actual state
/// with the state machines' transitions.
fn apply(haves: &mut BTreeMap<UniqueVolumeName, Have>, op: &Operation, outcome: u8) {
    use super::super::state::{DeviceMountTransition as DT, PodMountTransition as PT};
    // 0: success, 1: failure, 2: uncertain failure.
    let (ok, uncertain) = (outcome == 0, outcome == 2);
    match op {
        MountDevice(v) | UnmountDevice(v) => {
            let h = haves.entry(v.clone()).or_default();
            let t = match (op, ok) {
                (MountDevice(_), true) => DT::MountDeviceSucceeded,
                (MountDevice(_), false) => DT::MountDeviceFailed { uncertain },
                (_, true) => DT::UnmountDeviceSucceeded,
                (_, false) => DT::UnmountDeviceFailed,
            };
            h.device = Some(
                h.device
                    .unwrap_or(D::NotMounted)
                    .apply(t)
                    .expect("a valid device transition"),
            );
        }
        SetUp(v, pod) | TearDown(v, pod) => {
            let h = haves.entry(v.clone()).or_default();
            let t = match (op, ok) {
                (SetUp(..), true) => PT::SetUpSucceeded,
                (SetUp(..), false) => PT::SetUpFailed { uncertain },
                (_, true) => PT::TearDownSucceeded,
                (_, false) => PT::TearDownFailed,
            };
            let from = h.pods.get(pod).copied().unwrap_or(S::NotMounted);
            let to = from.apply(t).expect("a valid pod transition");
            if to == S::NotMounted {
                h.pods.remove(pod);
            } else {
                h.pods.insert(pod.clone(), to);
            }
        }
    }
}

fn check_plan(wants: &[Want], haves: &BTreeMap<UniqueVolumeName, Have>, ops: &[Operation]) {
    let mut keys = HashSet::new();
    for op in ops {
        assert!(
            keys.insert(op.key()),
            "two operations on {:?}: {ops:?}",
            op.key()
        );
        let have = haves.get(&op.key().0).cloned().unwrap_or_default();
        let device = have.device.unwrap_or(D::NotMounted);
        match op {
            SetUp(v, _) => {
                let w = wants
                    .iter()
                    .find(|w| &w.unique == v)
                    .expect("a set-up is desired");
                assert!(
                    !w.device_mountable || device == D::GloballyMounted,
                    "set-up before the device: {op:?}"
                );
                assert!(!ops.contains(&MountDevice(v.clone())), "{ops:?}");
            }
            UnmountDevice(_) => {
                assert!(
                    !have.pods.values().any(|s| s.needs_tear_down()),
                    "device unmounted under a pod: {op:?} {have:?}"
                );
            }
            _ => {}
        }
    }
}

proptest::proptest! {
    // Model-based: whatever the desired states, operation outcomes and
    // device operations still running,
    // a plan never sets up before its device, never unmounts a device a
    // pod still uses, never runs two operations on one key; and once
    // the desired state holds still and operations succeed, the actual
    // state converges on it (then nothing is planned).
    #[test]
    fn the_reconciler_converges(
        steps in proptest::collection::vec(
            (
                proptest::collection::vec((0u8..3, 0u8..3), 0..5),
                proptest::collection::vec(0u8..3, 0..8),
                proptest::bool::ANY,
            ),
            1..12,
        ),
        final_wants in proptest::collection::vec((0u8..3, 0u8..3), 0..5),
    ) {
        // Volume 0 is device-mountable and shared; 1 and 2 are per pod.
        let to_wants = |pairs: &[(u8, u8)]| -> Vec<Want> {
            let mut seen = HashSet::new();
            pairs.iter().filter(|p| seen.insert(**p)).map(|(vol, pod)| Want {
                unique: v(&format!("v{vol}")),
                pod: p(&format!("a{pod}")),
                device_mountable: *vol == 0,
            }).collect()
        };
        let mut haves: BTreeMap<UniqueVolumeName, Have> = BTreeMap::new();
        for (wants, outcomes, device_busy) in &steps {
            let wants = to_wants(wants);
            // The shared volume's device operation may be running (or
            // backing off) during a pass.
            let busy = |k: &OpKey| *device_busy && *k == OpKey(v("v0"), None);
            let ops = plan(&wants, &haves, &busy);
            check_plan(&wants, &haves, &ops);
            for (op, outcome) in ops.iter().zip(outcomes.iter().chain(std::iter::repeat(&0))) {
                apply(&mut haves, op, *outcome);
            }
        }
        let wants = to_wants(&final_wants);
        let mut passes = 0;
        loop {
            let ops = plan(&wants, &haves, &|_| false);
            check_plan(&wants, &haves, &ops);
            if ops.is_empty() {
                break;
            }
            for op in &ops {
                apply(&mut haves, op, 0);
            }
            passes += 1;
            proptest::prop_assert!(passes <= 4, "not converged: {haves:?}");
        }
        for w in &wants {
            let h = &haves[&w.unique];
            proptest::prop_assert_eq!(h.pods.get(&w.pod), Some(&M));
            if w.device_mountable {
                proptest::prop_assert_eq!(h.device, Some(D::GloballyMounted));
            }
        }
        for (vol, h) in &haves {
            let wanted: Vec<&PodUid> = wants.iter().filter(|w| &w.unique == vol).map(|w| &w.pod).collect();
            proptest::prop_assert!(h.pods.keys().all(|p| wanted.contains(&p)), "{vol}: {h:?}");
            if wanted.is_empty() {
                proptest::prop_assert!(h.device.unwrap_or(D::NotMounted) == D::NotMounted, "{vol}: {h:?}");
            }
        }
    }
}

#[test]
fn busy_operations_wait() {
    let wants = vec![want("e", "a1", false), want("c", "b2", true)];
    let haves = BTreeMap::new();
    // The pod operation is running; the device operation is backing off.
    let busy = |k: &OpKey| *k == OpKey(v("e"), Some(p("a1"))) || *k == OpKey(v("c"), None);
    assert_eq!(plan(&wants, &haves, &busy), vec![]);
    let mut pending = Pending::default();
    let now = Instant::now();
    let key = OpKey(v("e"), Some(p("a1")));
    pending.running.insert(key.clone());
    assert!(pending.busy(&key, now));
    assert!(pending.pod_running(&p("a1")) && !pending.pod_running(&p("b2")));
    // A device operation on the volume waits for the pod's.
    assert!(pending.busy(&OpKey(v("e"), None), now));
    assert!(!pending.busy(&OpKey(v("e"), Some(p("b2"))), now));
    pending.finished(&key, false, now);
    assert!(pending.busy(&key, now + BACKOFF_INITIAL - Duration::from_millis(1)));
    assert!(!pending.busy(&key, now + BACKOFF_INITIAL));
    pending.running.insert(key.clone());
    pending.finished(&key, false, now);
    assert!(pending.busy(&key, now + BACKOFF_INITIAL));
    assert!(!pending.busy(&key, now + 2 * BACKOFF_INITIAL));
    pending.forget_pod(&p("a1"));
    assert!(!pending.busy(&key, now));
}

/// After a pass, the loop waits for a change at most until the earliest
/// back-off ends, never less than the kubelet's period, never more than the
/// idle period (nothing backing off).
#[test]
fn the_loop_waits_for_a_change_until_a_back_off_ends() {
    let now = Instant::now();
    let ms = Duration::from_millis;
    let rows: &[(Option<Duration>, Duration)] = &[
        (None, IDLE_PERIOD),      // nothing backing off
        (Some(ms(500)), ms(500)), // a first failure's back-off
        (Some(ms(20)), PERIOD),   // never sooner than the kubelet's period
        (Some(ms(0)), PERIOD),    // just over
        (Some(ms(60_000)), IDLE_PERIOD),
    ];
    for (i, &(end, wait)) in rows.iter().enumerate() {
        assert_eq!(wait_after(end.map(|d| now + d), now), wait, "row {i}");
    }
    let mut pending = Pending::default();
    assert_eq!(pending.next_end(now), None);
    let key = OpKey(v("e"), Some(p("a1")));
    pending.running.insert(key.clone());
    pending.finished(&key, false, now);
    let other = OpKey(v("f"), Some(p("a1")));
    pending.running.insert(other.clone());
    pending.finished(&other, false, now - ms(400));
    assert_eq!(
        pending.next_end(now),
        Some(now + ms(100)),
        "the earliest, still to come"
    );
    assert_eq!(pending.next_end(now + ms(100)), Some(now + BACKOFF_INITIAL));
    assert_eq!(pending.next_end(now + BACKOFF_INITIAL), None, "all over");
}
