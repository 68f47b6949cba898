//! On-demand pod relists: the kubelet's `PLEGOnDemandRelist` (a pod worker asks the
//! PLEG to relist its pod after a sync that called the runtime, so that its next
//! sync acts on a view newer than its own calls).
//!
//! Differences: the kernel merge asks too (after every kernel event, to confirm
//! it), and so does the CRI event stream. Requests are a set, one entry per pod
//! (bounded by the number of pods, however often they are made), stamped with the
//! latest request time so that a full relist that began after it serves it and the
//! pod relist is skipped. A *hint* (the kernel saw something in the pod it cannot
//! vouch for, such as an uncertain exit) is not served by a full relist: the
//! runtime may not know yet, so the pod is relisted and then re-checked until the
//! confirmation bound has passed.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::Notify;

use super::PodUid;
use crate::clock::SharedClock;

/// The pending on-demand relists.
pub struct PodRelistQueue {
    clock: SharedClock,
    pending: Mutex<HashMap<PodUid, Request>>,
    notify: Notify,
}

/// One pending request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// The latest request time (the clock's ns).
    pub at_ns: u64,
    /// A kernel hint asked for it: re-check until the confirmation bound.
    pub hint: bool,
}

impl std::fmt::Debug for PodRelistQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodRelistQueue")
            .field("pending", &self.len())
            .finish_non_exhaustive()
    }
}

impl PodRelistQueue {
    pub fn new(clock: SharedClock) -> Self {
        Self {
            clock,
            pending: Mutex::new(HashMap::new()),
            notify: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PodUid, Request>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Asks for a relist of `uid`; never blocks, callable from any task.
    pub fn request(&self, uid: PodUid) {
        self.push(uid, false);
    }

    /// Asks for a relist of `uid` and re-checks after it (a kernel hint).
    pub fn hint(&self, uid: PodUid) {
        self.push(uid, true);
    }

    fn push(&self, uid: PodUid, hint: bool) {
        let now = self.clock.now_ns();
        let mut pending = self.lock();
        let r = pending.entry(uid).or_insert(Request { at_ns: now, hint });
        r.at_ns = r.at_ns.max(now);
        r.hint |= hint;
        drop(pending);
        self.notify.notify_one();
    }

    /// How many pods wait for a relist.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes every pending request, oldest first.
    pub fn take(&self) -> Vec<(PodUid, Request)> {
        let mut out: Vec<_> = self.lock().drain().collect();
        out.sort_by(|(a, ra), (b, rb)| (ra.at_ns, a).cmp(&(rb.at_ns, b)));
        out
    }

    /// Waits until some request is pending.
    pub async fn ready(&self) {
        loop {
            let notified = self.notify.notified();
            if !self.is_empty() {
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::clock::ManualClock;

    fn uid(n: u8) -> PodUid {
        PodUid::parse(&format!("{n:02x}").repeat(16)).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn requests_are_a_set_with_the_latest_time() {
        let clock = ManualClock::new(100);
        let q = Arc::new(PodRelistQueue::new(Arc::new(clock.clone())));
        let waiter = {
            let q = q.clone();
            tokio::spawn(async move { q.ready().await })
        };
        for _ in 0..1000 {
            q.request(uid(1));
        }
        clock.advance(50);
        q.request(uid(1));
        q.hint(uid(2));
        q.request(uid(2));
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(q.len(), 2, "bounded by the number of pods");
        let r = |hint| Request { at_ns: 150, hint };
        assert_eq!(q.take(), vec![(uid(1), r(false)), (uid(2), r(true))]);
        assert!(q.is_empty());
    }
}
