//! On-demand pod relists: the kubelet's `PLEGOnDemandRelist` (a pod worker asks the
//! PLEG to relist its pod after a sync that called the runtime, so that its next
//! sync acts on a view newer than its own calls).
//!
//! Differences: the kernel merge asks too (after every kernel event, to confirm
//! it), and so does the CRI event stream. Requests are a set, one entry per pod
//! (bounded by the number of pods, however often they are made), stamped with the
//! latest request time so that a full relist that began after it serves it and the
//! pod relist is skipped. A kernel request carries a [`Watch`]: what the kernel
//! saw may not be known to the runtime yet, so such a request is not served by a
//! full relist, and the pod is relisted and then re-checked for a while.
//!
//! | request | from | [`Watch`] | re-checked |
//! |---|---|---|---|
//! | [`PodRelistQueue::request`] | a worker's sync, a certain kernel event, a CRI event | `Once` | no |
//! | [`PodRelistQueue::deferred`] | a certain kernel start or death of a container the snapshot does not hold yet | `Deferred` | until the confirmation bound (its exit waits in the cache, with re-checks of its own) |
//! | [`PodRelistQueue::doubt`] | a kernel hint: an exit the kernel cannot vouch for, a cgroup removed before its main process was seen to exit | `Doubt` | for [`super::relist::DOUBT_WATCH`] |
//! | [`PodRelistQueue::redeliver`] | a kernel event the workers' channel could not take | `Once`, never skipped, delivered as a PodSync | until delivered |
//!
//! Requests for one pod merge: the latest time, the longest watch, a
//! redelivery if any asked for one.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::Notify;

use evpleg_core::clock::SharedClock;
use evpleg_core::ids::PodUid;

/// The pending on-demand relists.
pub struct PodRelistQueue {
    clock: SharedClock,
    pending: Mutex<HashMap<PodUid, Request>>,
    notify: Notify,
}

/// How long a pod is looked at again after its on-demand relist (ordered:
/// requests for one pod keep the longest).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Watch {
    /// Relisted once (served by a full relist that began after the request,
    /// unless a kernel exit of the pod awaits the runtime's confirmation).
    Once,
    /// A certain kernel event of a container the snapshot did not hold yet:
    /// re-checked until the confirmation bound.
    Deferred,
    /// Something the kernel cannot vouch for: re-checked for
    /// [`super::relist::DOUBT_WATCH`], so that a death the runtime reports
    /// late is still reported by the relist.
    Doubt,
}

/// One pending request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// The latest request time (the clock's ns).
    pub at_ns: u64,
    /// The longest watch asked for.
    pub watch: Watch,
    /// An event of the pod was dropped: the relist is not skipped, and wakes
    /// the workers (PodSync) even if it finds no change.
    pub redeliver: bool,
    /// Something other than a hint asked (a worker after its sync, a certain
    /// kernel event, a CRI event): the pod is relisted now even while a
    /// hint's watch re-checks it, which would make a worker wait for the
    /// watch's next re-check (up to a second later).
    pub prompt: bool,
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
        self.push(uid, Watch::Once);
    }

    /// Asks for a relist of `uid` and re-checks until the confirmation bound
    /// (a certain kernel event the snapshot could not take yet).
    pub fn deferred(&self, uid: PodUid) {
        self.push(uid, Watch::Deferred);
    }

    /// Asks for a relist of `uid` and re-checks for the doubt's watch (a kernel
    /// hint: something it cannot vouch for).
    pub fn doubt(&self, uid: PodUid) {
        self.push(uid, Watch::Doubt);
    }

    /// A kernel event of pod `uid` was dropped (the workers' channel was
    /// full): the pod is relisted, whatever full relist runs meanwhile, and
    /// its workers woken (issue #25: a skipped request lost the wake-up).
    pub fn redeliver(&self, uid: PodUid) {
        self.push_as(uid, Watch::Once, true);
    }

    fn push(&self, uid: PodUid, watch: Watch) {
        self.push_as(uid, watch, false);
    }

    /// [`PodRelistQueue::request`] (`Once`), [`deferred`](Self::deferred),
    /// [`doubt`](Self::doubt) or [`redeliver`](Self::redeliver), only if the
    /// queue's lock is free now (the kernel PLEG's real-time reader never
    /// waits for it). Returns whether the request was queued.
    pub fn try_push(&self, uid: &PodUid, watch: Watch, redeliver: bool) -> bool {
        let now = self.clock.now_ns();
        let pending = match self.pending.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        Self::merge_into(pending, uid.clone(), watch, redeliver, now);
        self.notify.notify_one();
        true
    }

    fn push_as(&self, uid: PodUid, watch: Watch, redeliver: bool) {
        let now = self.clock.now_ns();
        Self::merge_into(self.lock(), uid, watch, redeliver, now);
        self.notify.notify_one();
    }

    fn merge_into(
        mut pending: std::sync::MutexGuard<'_, HashMap<PodUid, Request>>,
        uid: PodUid,
        watch: Watch,
        redeliver: bool,
        now: u64,
    ) {
        let prompt = watch != Watch::Doubt;
        let r = pending.entry(uid).or_insert(Request {
            at_ns: now,
            watch,
            redeliver,
            prompt,
        });
        r.at_ns = r.at_ns.max(now);
        r.watch = r.watch.max(watch);
        r.redeliver |= redeliver;
        r.prompt |= prompt;
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
    use evpleg_core::clock::ManualClock;

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
        q.deferred(uid(2));
        q.request(uid(2));
        q.doubt(uid(3));
        q.deferred(uid(3));
        q.request(uid(4));
        q.redeliver(uid(4));
        q.request(uid(4));
        q.doubt(uid(5));
        q.doubt(uid(6));
        q.request(uid(6));
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(q.len(), 6, "bounded by the number of pods");
        let r = |watch| Request {
            at_ns: 150,
            watch,
            redeliver: false,
            prompt: true,
        };
        assert_eq!(
            q.take(),
            vec![
                (uid(1), r(Watch::Once)),
                (uid(2), r(Watch::Deferred)),
                (uid(3), r(Watch::Doubt)),
                (
                    uid(4),
                    Request {
                        redeliver: true,
                        ..r(Watch::Once)
                    }
                ),
                (
                    uid(5),
                    Request {
                        prompt: false,
                        ..r(Watch::Doubt)
                    }
                ),
                (uid(6), r(Watch::Doubt)),
            ],
            "the longest watch is kept, a redelivery, and whether more than a hint asked"
        );
        assert!(q.is_empty());
    }
}
