//! The event task's work, one queue per pod: the events of one pod are
//! served in the order they came, each after the one before it is sent; the
//! events of different pods do not wait for each other's payload reads
//! (issue #30: one after another, a death's STOPPED waited behind other
//! pods' reads, p99 56 ms of queueing in the full-agent benchmark behind
//! the proxy, on top of its own read's 42 ms).
//!
//! Containerd serves its own stream in order too, but reads each payload
//! before the next event. Keeping a pod's events in order matters to the
//! 1.26-1.36 Evented PLEG: it keeps the payload with the newest `created_at`,
//! so a later event whose payload was read before an earlier one's would
//! win with the older view.
//!
//! Each pod is `Idle` (nothing in progress: the next work may start) or
//! `Reading` (a payload read of its is in flight; its later work waits).
//!
//! | transition | from | to |
//! |---|---|---|
//! | [`PodQueues::push`] | any | unchanged (the work waits its turn) |
//! | [`PodQueues::next`] returns work | `Idle` | `Idle` (the caller may mark it `Reading`) |
//! | [`PodQueues::reading`] | `Idle` | `Reading` |
//! | [`PodQueues::read_done`] | `Reading` | `Idle` |
//!
//! A pod with nothing queued and nothing in progress is forgotten.

use std::collections::{HashMap, VecDeque};

/// Whether a pod's payload read is in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodState {
    Idle,
    Reading,
}

#[derive(Debug)]
struct Pod<W> {
    state: PodState,
    waiting: VecDeque<W>,
}

/// Work of type `W` per pod (keyed by the pod's sandbox id, or by the id of
/// a container whose sandbox is not known yet).
#[derive(Debug)]
pub struct PodQueues<W> {
    pods: HashMap<String, Pod<W>>,
}

impl<W> Default for PodQueues<W> {
    fn default() -> Self {
        Self {
            pods: HashMap::new(),
        }
    }
}

impl<W> PodQueues<W> {
    /// Queues `work` for pod `key`, behind its earlier work.
    pub fn push(&mut self, key: &str, work: W) {
        self.pod(key).waiting.push_back(work);
    }

    /// Pod `key`'s entry, made idle and empty if it had none.
    fn pod(&mut self, key: &str) -> &mut Pod<W> {
        self.pods.entry(key.to_owned()).or_insert_with(|| Pod {
            state: PodState::Idle,
            waiting: VecDeque::new(),
        })
    }

    /// The next work of pod `key`, if the pod is idle and has some; a pod
    /// left with nothing is forgotten.
    pub fn next(&mut self, key: &str) -> Option<W> {
        let pod = self.pods.get_mut(key)?;
        if pod.state == PodState::Reading {
            return None;
        }
        let work = pod.waiting.pop_front();
        if work.is_none() {
            self.pods.remove(key);
        }
        work
    }

    /// Pod `key`'s payload read began: its later work waits for
    /// [`Self::read_done`].
    pub fn reading(&mut self, key: &str) {
        self.pod(key).state = PodState::Reading;
    }

    /// Pod `key`'s read is done (its event handled): its next work may
    /// start.
    pub fn read_done(&mut self, key: &str) {
        if let Some(pod) = self.pods.get_mut(key) {
            pod.state = PodState::Idle;
        }
    }

    /// Pod `key`'s state (`None`: nothing queued or in progress).
    pub fn state(&self, key: &str) -> Option<PodState> {
        self.pods.get(key).map(|p| p.state)
    }

    /// Work queued, over every pod.
    pub fn waiting(&self) -> usize {
        self.pods.values().map(|p| p.waiting.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drains pod `key` as the event task does: work that needs no read
    /// (odd numbers here) is done at once; the first that needs one starts
    /// it and stops the drain. Returns what ran, the read last.
    fn drain(q: &mut PodQueues<u32>, key: &str) -> Vec<u32> {
        let mut ran = Vec::new();
        while let Some(w) = q.next(key) {
            ran.push(w);
            if w % 2 == 0 {
                q.reading(key);
                break;
            }
        }
        ran
    }

    /// A step: a pod, a push or a read's end, what ran, the state after.
    type Row = (&'static str, Option<u32>, &'static [u32], Option<PodState>);

    /// Each step: a push (`Some(work)`) or a read's end (`None`) for a pod,
    /// then that pod drained; what ran, and the pod's state after.
    #[test]
    fn a_pods_work_runs_in_order_and_never_waits_for_another_pods_read() {
        let mut q = PodQueues::default();
        let rows: &[Row] = &[
            // Pod a's read starts at once.
            ("a", Some(2), &[2], Some(PodState::Reading)),
            // Its next read waits for the first.
            ("a", Some(4), &[], Some(PodState::Reading)),
            // So does work that needs no read: order is kept.
            ("a", Some(5), &[], Some(PodState::Reading)),
            // Pod b does not wait for pod a.
            ("b", Some(6), &[6], Some(PodState::Reading)),
            // a's first read done: its next read starts.
            ("a", None, &[4], Some(PodState::Reading)),
            // a's second read done: 5 needs none; a is left with nothing.
            ("a", None, &[5], None),
            // Work that needs no read on an idle pod runs at once.
            ("c", Some(7), &[7], None),
            // b's read done, nothing queued: forgotten.
            ("b", None, &[], None),
        ];
        for (i, (key, push, ran, state)) in rows.iter().enumerate() {
            match push {
                Some(w) => q.push(key, *w),
                None => q.read_done(key),
            }
            assert_eq!(drain(&mut q, key), *ran, "row {i}: what ran");
            assert_eq!(q.state(key), *state, "row {i}: pod {key}'s state");
        }
        assert_eq!(q.waiting(), 0);
        assert!(
            q.pods.is_empty(),
            "every pod forgotten: {:?}",
            q.pods.keys()
        );
    }
}
