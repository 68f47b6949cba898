//! Static pods with the same full name start one at a time, in the order
//! their workers were created: the kubelet's `allowStaticPodStart` with
//! `startedStaticPodsByFullname` and `waitingToStartStaticPodsByFullname`
//! (`pod_workers.go`).
//!
//! A static pod's new version (its manifest changed: a new UID, the same
//! name) is queued behind the old one when its worker is created; it may
//! start only once no other pod of that full name is started and every pod
//! queued before it has been asked to terminate (or is gone). A started pod
//! holds its full name until its worker has finished (`completeTerminated`,
//! or `cleanupUnstartedPod` for one that never started); so the old and new
//! versions never run together.
//!
//! Difference: the kubelet retries a waiting pod after its back-off period
//! (10 to 15 s) or at its next update; here the release of a full name also
//! wakes the next pod in line at once ([`StaticPods::release`] names it).

use std::collections::{HashMap, VecDeque};

use evpleg_core::ids::PodUid;

/// Who started, who waits, by full name (`namespace/name`).
#[derive(Debug, Default)]
pub struct StaticPods {
    started: HashMap<String, PodUid>,
    waiting: HashMap<String, VecDeque<PodUid>>,
}

impl StaticPods {
    /// A static pod's worker was created: it waits its turn.
    pub fn enqueue(&mut self, full_name: &str, uid: &PodUid) {
        self.waiting
            .entry(full_name.to_owned())
            .or_default()
            .push_back(uid.clone());
    }

    /// `allowStaticPodStart`: whether `uid` may start now. `gone` says
    /// whether a queued pod will never start (asked to terminate, terminated,
    /// or unknown): those are skipped. On `true`, `uid` holds the full name.
    pub fn allow_start(
        &mut self,
        full_name: &str,
        uid: &PodUid,
        gone: &dyn Fn(&PodUid) -> bool,
    ) -> bool {
        if let Some(started) = self.started.get(full_name) {
            return started == uid;
        }
        let queue = self.waiting.entry(full_name.to_owned()).or_default();
        while let Some(first) = queue.front() {
            if gone(first) {
                queue.pop_front();
                continue;
            }
            if first != uid {
                return false;
            }
            queue.pop_front();
            break;
        }
        if queue.is_empty() {
            self.waiting.remove(full_name);
        }
        self.started.insert(full_name.to_owned(), uid.clone());
        true
    }

    /// `uid`'s worker finished (or will never start): it releases the full
    /// name if it held it, and leaves the queue. Returns the pods still
    /// waiting for that name, to be woken.
    pub fn release(&mut self, full_name: &str, uid: &PodUid) -> Vec<PodUid> {
        if self.started.get(full_name) == Some(uid) {
            self.started.remove(full_name);
        }
        let Some(queue) = self.waiting.get_mut(full_name) else {
            return Vec::new();
        };
        queue.retain(|u| u != uid);
        if queue.is_empty() {
            self.waiting.remove(full_name);
            return Vec::new();
        }
        queue.iter().cloned().collect()
    }

    /// The pod holding `full_name`, if one started (the kubelet's
    /// `IsPodForMirrorPodTerminatingByFullName` reads it).
    pub fn started(&self, full_name: &str) -> Option<&PodUid> {
        self.started.get(full_name)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    fn uid(n: u8) -> PodUid {
        PodUid::parse(&format!("{n:02x}").repeat(16)).unwrap()
    }

    /// A model run: each step is an action on the table and what it must
    /// answer, with the set of pods that will never start.
    #[test]
    fn same_name_starts_are_serialised_in_creation_order() {
        enum Step {
            Enqueue(u8),
            Allow(u8, bool),
            Gone(u8),
            Release(u8, &'static [u8]),
        }
        use Step::*;
        let cases: &[(&str, &[Step])] = &[
            (
                "a new version waits for the old one's worker to finish",
                &[
                    Enqueue(1),
                    Allow(1, true),
                    Enqueue(2),
                    Allow(2, false),
                    // Asked to terminate, but not finished: still held.
                    Gone(1),
                    Allow(2, false),
                    Release(1, &[2]),
                    Allow(2, true),
                    Allow(1, false),
                ],
            ),
            (
                "the first in line starts first, whoever asks first",
                &[
                    Enqueue(1),
                    Enqueue(2),
                    Allow(2, false),
                    Allow(1, true),
                    Release(1, &[2]),
                    Allow(2, true),
                ],
            ),
            (
                "a queued pod asked to terminate before it started is skipped",
                &[
                    Enqueue(1),
                    Enqueue(2),
                    Enqueue(3),
                    Gone(1),
                    Gone(2),
                    Allow(3, true),
                ],
            ),
            (
                "a started pod may sync again",
                &[Enqueue(1), Allow(1, true), Allow(1, true)],
            ),
            (
                "releasing an unstarted pod takes it out of the line",
                &[
                    Enqueue(1),
                    Allow(1, true),
                    Enqueue(2),
                    Enqueue(3),
                    Release(2, &[3]),
                    Release(1, &[3]),
                    Allow(3, true),
                ],
            ),
        ];
        for (name, steps) in cases {
            let mut t = StaticPods::default();
            let mut gone = HashSet::new();
            for (i, step) in steps.iter().enumerate() {
                match step {
                    Enqueue(n) => t.enqueue("ns/web", &uid(*n)),
                    Gone(n) => {
                        gone.insert(uid(*n));
                    }
                    Allow(n, want) => {
                        let got = t.allow_start("ns/web", &uid(*n), &|u| gone.contains(u));
                        assert_eq!(got, *want, "{name}: step {i}, allow {n}");
                    }
                    Release(n, wake) => {
                        let got = t.release("ns/web", &uid(*n));
                        let want: Vec<PodUid> = wake.iter().map(|w| uid(*w)).collect();
                        assert_eq!(got, want, "{name}: step {i}, release {n}");
                    }
                }
            }
        }
        // Other names are not held.
        let mut t = StaticPods::default();
        t.enqueue("ns/a", &uid(1));
        t.enqueue("ns/b", &uid(2));
        assert!(t.allow_start("ns/a", &uid(1), &|_| false));
        assert!(t.allow_start("ns/b", &uid(2), &|_| false));
        assert_eq!(t.started("ns/a"), Some(&uid(1)));
    }
}
