//! The ring-buffer reader's real-time budget (issue #24, item 7): an exec
//! storm inside a pod makes records, and at SCHED_FIFO the reader would
//! spend as much CPU on them as they take, ahead of every normal task of the
//! node. The kubelet has no real-time thread, so no counterpart.
//!
//! Time is cut in windows ([`RtBudgetConfig::window`], 100 ms); once the
//! reader's own CPU time (CLOCK_THREAD_CPUTIME_ID) within a window exceeds
//! [`RtBudgetConfig::budget`] (20 ms: a fifth of one CPU), it drops to
//! SCHED_OTHER until the window ends, then goes back to SCHED_FIFO. It keeps
//! reading meanwhile, at normal priority: nothing is lost, events are only
//! later. Each drop is counted (`evpleg_pleg_kernel_rt_throttled_total`).
//! The reader samples its CPU time once [`CHECK_EVERY`] records were handled
//! since the last sample (counted across the passes of its loop) and at the
//! first pass after a window ends ([`RtBudget::sample_due`]), so a window's
//! real-time CPU is at most the budget plus one check's worth of records. A
//! pass with fewer records reads no clock: CLOCK_THREAD_CPUTIME_ID is a
//! syscall, and one per wake-up was a tenth of the reader's CPU at 1 000
//! exits/s (issue #29).
//!
//! [`RtBudget`] is the decision alone, a pure state machine over (now, CPU
//! time) samples.

use std::time::Duration;

/// Records handled between two budget checks.
pub const CHECK_EVERY: usize = 32;

/// The budget: at most `budget` of the reader's CPU per `window` at
/// real-time priority.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtBudgetConfig {
    pub window: Duration,
    pub budget: Duration,
}

impl Default for RtBudgetConfig {
    fn default() -> Self {
        Self {
            window: Duration::from_millis(100),
            budget: Duration::from_millis(20),
        }
    }
}

/// What the reader does after a check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Switch {
    Stay,
    /// The budget is spent: SCHED_OTHER until the window ends.
    ToNormal,
    /// A new window after a throttled one: SCHED_FIFO again.
    ToRealtime,
}

/// The budget's state: the current window and whether it is spent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtBudget {
    config: RtBudgetConfig,
    window_start_ns: u64,
    cpu_at_start_ns: u64,
    throttled: bool,
}

impl RtBudget {
    /// A first window starting at `now_ns`, with the thread's CPU time
    /// `cpu_ns` then.
    pub fn new(config: RtBudgetConfig, now_ns: u64, cpu_ns: u64) -> Self {
        Self {
            config,
            window_start_ns: now_ns,
            cpu_at_start_ns: cpu_ns,
            throttled: false,
        }
    }

    /// A sample: CLOCK_MONOTONIC `now_ns`, the thread's CPU time `cpu_ns`.
    pub fn check(&mut self, now_ns: u64, cpu_ns: u64) -> Switch {
        let window = self.config.window.as_nanos() as u64;
        if now_ns.saturating_sub(self.window_start_ns) >= window {
            self.window_start_ns = now_ns;
            self.cpu_at_start_ns = cpu_ns;
            return match std::mem::replace(&mut self.throttled, false) {
                true => Switch::ToRealtime,
                false => Switch::Stay,
            };
        }
        let used = cpu_ns.saturating_sub(self.cpu_at_start_ns);
        if !self.throttled && used > self.config.budget.as_nanos() as u64 {
            self.throttled = true;
            return Switch::ToNormal;
        }
        Switch::Stay
    }

    /// Whether the reader samples its CPU time now, at CLOCK_MONOTONIC
    /// `now_ns`, having handled `records` records since the last sample: once
    /// [`CHECK_EVERY`] records went by, or the window ended (a throttled one
    /// switches back then).
    pub fn sample_due(&self, now_ns: u64, records: usize) -> bool {
        records >= CHECK_EVERY
            || now_ns.saturating_sub(self.window_start_ns) >= self.config.window.as_nanos() as u64
    }

    /// When a throttled window ends (the reader's wait is cut to it, so it
    /// is back at SCHED_FIFO before it sleeps past it); `None` when not
    /// throttled.
    pub fn throttled_until_ns(&self) -> Option<u64> {
        self.throttled
            .then(|| self.window_start_ns + self.config.window.as_nanos() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// Each row: (now ms, CPU ms, expected switch, throttled until ms).
    #[test]
    fn the_budget_table() {
        let config = RtBudgetConfig {
            window: Duration::from_millis(100),
            budget: Duration::from_millis(20),
        };
        let mut b = RtBudget::new(config, 1000 * MS, 500 * MS);
        let rows: &[(u64, u64, Switch, Option<u64>)] = &[
            (1010, 510, Switch::Stay, None),           // 10 ms used
            (1050, 520, Switch::Stay, None),           // exactly the budget: allowed
            (1060, 521, Switch::ToNormal, Some(1100)), // over it
            (1070, 560, Switch::Stay, Some(1100)),     // counted once per window
            (1099, 599, Switch::Stay, Some(1100)),
            (1100, 600, Switch::ToRealtime, None), // the window ends
            (1150, 610, Switch::Stay, None),       // a quiet window
            (1200, 611, Switch::Stay, None),       // ends without a switch
            (1210, 640, Switch::ToNormal, Some(1300)), // a storm: spent at once
            (1450, 641, Switch::ToRealtime, None), // long idle: one new window
            (1460, 650, Switch::Stay, None),
        ];
        for (i, &(now, cpu, switch, until)) in rows.iter().enumerate() {
            assert_eq!(b.check(now * MS, cpu * MS), switch, "row {i}");
            assert_eq!(b.throttled_until_ns(), until.map(|u| u * MS), "row {i}");
        }
    }

    /// Each row: (now ms, records since the last sample, due). The window
    /// started at 1 000 ms.
    #[test]
    fn a_sample_is_due_after_a_check_s_records_or_at_the_window_s_end() {
        let b = RtBudget::new(RtBudgetConfig::default(), 1000 * MS, 0);
        let rows: &[(u64, usize, bool)] = &[
            (1001, 1, false), // a wake-up with one record: no clock read
            (1050, CHECK_EVERY - 1, false),
            (1050, CHECK_EVERY, true), // a check's worth, over several passes
            (1099, 0, false),
            (1100, 0, true), // the window ended: a new one starts
            (5000, 1, true), // the first wake-up after a long sleep
        ];
        for (i, &(now, records, due)) in rows.iter().enumerate() {
            assert_eq!(b.sample_due(now * MS, records), due, "row {i}");
        }
    }

    /// A clock sample going backwards (a CPU clock read before the window's
    /// start on another path) is no use of the budget.
    #[test]
    fn samples_before_the_window_spend_nothing() {
        let mut b = RtBudget::new(RtBudgetConfig::default(), 100 * MS, 50 * MS);
        assert_eq!(b.check(90 * MS, 40 * MS), Switch::Stay);
        assert_eq!(b.throttled_until_ns(), None);
    }
}
