//! Pairs each transition the observed PLEG reports with the same transition
//! reported by the comparison relist, so that every line `evpleg observe`
//! prints says how much earlier the PLEG saw it, or that one side never did.
//!
//! A transition (a container's start or death) moves through explicit states:
//!
//! | state | event | next | output |
//! |---|---|---|---|
//! | none | `pleg` | `PlegOnly` | |
//! | none | `relist` | `RelistOnly` | |
//! | `PlegOnly` | `relist` | `Reported` | matched, the lead is relist - pleg |
//! | `RelistOnly` | `pleg` | `Reported` | matched, the lead is negative (the relist was first) |
//! | `PlegOnly` | `tick` past `relist_patience` | `Reported` | the relist missed it |
//! | `RelistOnly` | `tick` past `pleg_patience` | `Reported` | the PLEG missed it |
//! | `Reported` | `pleg` or `relist` | `Reported` | nothing: a late duplicate |
//! | `Reported` | `tick` past `memory` | none | |
//!
//! A relist misses a container that lived shorter than its period (the
//! kubelet's relist reports only the death of such a container); the PLEG
//! misses what its kernel path lost and its own relist has not yet repaired.
//! Exit codes are compared when both sides know one.

use std::collections::HashMap;
use std::time::Duration;

use evpleg_core::ids::{ContainerId, PodUid};
use evpleg_core::lifecycle::{EventKind, EventSource};

/// Which transition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transition {
    Started,
    Died,
}

impl Transition {
    /// The container transitions of a lifecycle event; sandboxes, removals
    /// and hints are not compared.
    pub fn of(kind: EventKind) -> Option<Self> {
        match kind {
            EventKind::ContainerStarted => Some(Self::Started),
            EventKind::ContainerDied => Some(Self::Died),
            _ => None,
        }
    }

    pub fn kind(self) -> EventKind {
        match self {
            Self::Started => EventKind::ContainerStarted,
            Self::Died => EventKind::ContainerDied,
        }
    }
}

/// One side's observation of a transition.
#[derive(Clone, Debug, PartialEq)]
pub struct Seen {
    pub pod_uid: Option<PodUid>,
    pub container_id: ContainerId,
    pub transition: Transition,
    /// CLOCK_MONOTONIC ns: the kernel's timestamp for a kernel event, the
    /// moment the event was received otherwise.
    pub at_ns: u64,
    pub source: EventSource,
    /// The exit code, for a death, when this side knows it.
    pub exit_code: Option<i32>,
    /// The terminating signal and the OOM kill, as the kernel saw them.
    pub signal: Option<i32>,
    pub oom_killed: bool,
}

/// A finished comparison: what `observe` prints.
#[derive(Clone, Debug, PartialEq)]
pub struct Compared {
    /// The PLEG's observation, if it made one.
    pub pleg: Option<Seen>,
    /// The comparison relist's observation, if it made one.
    pub relist: Option<Seen>,
    /// relist - pleg, when both saw it (negative: the relist was first).
    pub lead_ns: Option<i64>,
    /// What the two sides disagree on, in words.
    pub disagreement: Option<String>,
}

impl Compared {
    /// The observation this line is about (the PLEG's, else the relist's).
    pub fn first(&self) -> &Seen {
        self.pleg
            .as_ref()
            .or(self.relist.as_ref())
            .expect("a comparison holds at least one observation")
    }
}

#[derive(Clone, Debug, PartialEq)]
enum State {
    PlegOnly(Seen),
    RelistOnly(Seen),
    /// Already printed; remembered until `until_ns` so a late duplicate is
    /// not printed as a miss.
    Reported {
        until_ns: u64,
    },
}

/// Who reported a transition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The PLEG under observation.
    Pleg,
    /// The comparison relist.
    Relist,
}

/// How long each side is waited for.
#[derive(Clone, Copy, Debug)]
pub struct Patience {
    /// How long the relist has to report what the PLEG saw: a little over
    /// two of its periods.
    pub relist: Duration,
    /// How long the PLEG has to report what the relist saw.
    pub pleg: Duration,
    /// How long a printed transition is remembered.
    pub memory: Duration,
}

impl Patience {
    /// For a comparison relist of `period`.
    pub fn for_period(period: Duration) -> Self {
        Self {
            relist: period * 2 + Duration::from_millis(500),
            pleg: Duration::from_secs(1),
            memory: Duration::from_secs(300).max(period * 10),
        }
    }
}

/// The correlator: pure, driven by the caller's clock.
#[derive(Debug)]
pub struct Correlator {
    patience: Patience,
    states: HashMap<(ContainerId, Transition), State>,
}

fn as_ns(d: Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128) as u64
}

fn compare(pleg: Seen, relist: Seen) -> Compared {
    let lead_ns = relist.at_ns as i64 - pleg.at_ns as i64;
    let disagreement = match (pleg.exit_code, relist.exit_code) {
        (Some(k), Some(r)) if k != r => {
            Some(format!("exit code {k} from the pleg, {r} from the runtime"))
        }
        _ => None,
    };
    Compared {
        pleg: Some(pleg),
        relist: Some(relist),
        lead_ns: Some(lead_ns),
        disagreement,
    }
}

impl Correlator {
    pub fn new(patience: Patience) -> Self {
        Self {
            patience,
            states: HashMap::new(),
        }
    }

    fn key(seen: &Seen) -> (ContainerId, Transition) {
        (seen.container_id.clone(), seen.transition)
    }

    /// The PLEG reported a transition at `now_ns`.
    pub fn pleg(&mut self, seen: Seen, now_ns: u64) -> Option<Compared> {
        self.report(Side::Pleg, seen, now_ns)
    }

    /// The comparison relist reported a transition at `now_ns`.
    pub fn relist(&mut self, seen: Seen, now_ns: u64) -> Option<Compared> {
        self.report(Side::Relist, seen, now_ns)
    }

    /// `side` reported a transition: the first report waits for the other
    /// side's, the other side's completes the comparison, a second report from
    /// the same side (or after the comparison) is dropped.
    pub fn report(&mut self, side: Side, seen: Seen, now_ns: u64) -> Option<Compared> {
        let key = Self::key(&seen);
        match (side, self.states.remove(&key)) {
            (Side::Pleg, None) => {
                self.states.insert(key, State::PlegOnly(seen));
                None
            }
            (Side::Relist, None) => {
                self.states.insert(key, State::RelistOnly(seen));
                None
            }
            (Side::Pleg, Some(State::RelistOnly(relist))) => {
                self.reported(key, now_ns);
                Some(compare(seen, relist))
            }
            (Side::Relist, Some(State::PlegOnly(pleg))) => {
                self.reported(key, now_ns);
                Some(compare(pleg, seen))
            }
            (_, Some(kept)) => {
                self.states.insert(key, kept);
                None
            }
        }
    }

    fn reported(&mut self, key: (ContainerId, Transition), now_ns: u64) {
        let until_ns = now_ns.saturating_add(as_ns(self.patience.memory));
        self.states.insert(key, State::Reported { until_ns });
    }

    /// Ends the waits that ran out by `now_ns`: what one side never saw.
    pub fn tick(&mut self, now_ns: u64) -> Vec<Compared> {
        let mut out = Vec::new();
        let (relist_wait, pleg_wait) = (as_ns(self.patience.relist), as_ns(self.patience.pleg));
        let memory = as_ns(self.patience.memory);
        self.states.retain(|_, state| match state {
            State::Reported { until_ns } => *until_ns > now_ns,
            State::PlegOnly(seen) if now_ns >= seen.at_ns.saturating_add(relist_wait) => {
                out.push(Compared {
                    pleg: Some(seen.clone()),
                    relist: None,
                    lead_ns: None,
                    disagreement: Some(format!(
                        "the relist did not report it within {}",
                        crate::config::duration::format(Duration::from_nanos(relist_wait))
                    )),
                });
                *state = State::Reported {
                    until_ns: now_ns.saturating_add(memory),
                };
                true
            }
            State::RelistOnly(seen) if now_ns >= seen.at_ns.saturating_add(pleg_wait) => {
                out.push(Compared {
                    pleg: None,
                    relist: Some(seen.clone()),
                    lead_ns: None,
                    disagreement: Some(format!(
                        "the pleg did not report it within {} of the relist",
                        crate::config::duration::format(Duration::from_nanos(pleg_wait))
                    )),
                });
                *state = State::Reported {
                    until_ns: now_ns.saturating_add(memory),
                };
                true
            }
            _ => true,
        });
        out.sort_by_key(|c| c.first().at_ns);
        out
    }

    /// Transitions waiting for the other side.
    pub fn pending(&self) -> usize {
        self.states
            .values()
            .filter(|s| !matches!(s, State::Reported { .. }))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn seen(n: u8, t: Transition, at_ms: u64, source: EventSource, code: Option<i32>) -> Seen {
        Seen {
            pod_uid: PodUid::parse(&format!("{n:032x}")),
            container_id: ContainerId::parse(&format!("{n:064x}")).unwrap(),
            transition: t,
            at_ns: at_ms * MS,
            source,
            exit_code: code,
            signal: None,
            oom_killed: false,
        }
    }

    fn correlator() -> Correlator {
        Correlator::new(Patience::for_period(Duration::from_secs(1)))
    }

    use EventSource::{Kernel, Relist};
    use Transition::{Died, Started};

    /// The state table of the module docs, row by row.
    #[test]
    fn the_state_table() {
        // none --pleg--> PlegOnly --relist--> matched.
        let mut c = correlator();
        assert_eq!(c.pleg(seen(1, Died, 100, Kernel, Some(3)), 100 * MS), None);
        assert_eq!(c.pending(), 1);
        let m = c
            .relist(seen(1, Died, 640, Relist, Some(3)), 640 * MS)
            .expect("matched");
        assert_eq!(m.lead_ns, Some(540 * MS as i64));
        assert_eq!(m.disagreement, None);
        assert_eq!(c.pending(), 0);
        // Reported: a late duplicate from either side prints nothing.
        assert_eq!(
            c.relist(seen(1, Died, 700, Relist, Some(3)), 700 * MS),
            None
        );
        assert_eq!(c.pleg(seen(1, Died, 700, Kernel, Some(3)), 700 * MS), None);
        assert!(c.tick(10_000 * MS).is_empty());

        // none --relist--> RelistOnly --pleg--> matched, negative lead.
        let m = {
            assert_eq!(
                c.relist(seen(2, Started, 100, Relist, None), 100 * MS),
                None
            );
            c.pleg(seen(2, Started, 150, Relist, None), 150 * MS)
                .expect("matched")
        };
        assert_eq!(m.lead_ns, Some(-50 * MS as i64));

        // Different exit codes are a disagreement.
        c.pleg(seen(3, Died, 100, Kernel, Some(137)), 100 * MS);
        let m = c
            .relist(seen(3, Died, 900, Relist, Some(1)), 900 * MS)
            .unwrap();
        assert_eq!(
            m.disagreement.as_deref(),
            Some("exit code 137 from the pleg, 1 from the runtime")
        );
    }

    #[test]
    fn a_side_that_never_reports_is_named_once_its_wait_ran_out() {
        let mut c = correlator();
        c.pleg(seen(1, Started, 0, Kernel, None), 0);
        c.relist(seen(2, Died, 0, Relist, Some(0)), 0);
        // The PLEG gets 1 s, the relist 2.5 s (two 1 s periods and a half).
        assert!(c.tick(999 * MS).is_empty());
        let missed = c.tick(1_000 * MS);
        assert_eq!(missed.len(), 1);
        assert_eq!(missed[0].pleg, None);
        assert_eq!(
            missed[0].disagreement.as_deref(),
            Some("the pleg did not report it within 1s of the relist")
        );
        assert!(c.tick(2_499 * MS).is_empty());
        let missed = c.tick(2_500 * MS);
        assert_eq!(missed.len(), 1);
        assert_eq!(missed[0].relist, None);
        assert_eq!(
            missed[0].disagreement.as_deref(),
            Some("the relist did not report it within 2.5s")
        );
        // Remembered: the late relist report is not a second line.
        assert_eq!(
            c.relist(seen(1, Started, 2_600, Relist, None), 2_600 * MS),
            None
        );
        assert_eq!(c.pending(), 0);
        // Forgotten after the memory (5 min): the state map does not grow.
        c.tick(400_000 * MS);
        assert!(c.states.is_empty());
    }

    #[test]
    fn starts_and_deaths_of_one_container_are_compared_separately() {
        let mut c = correlator();
        c.pleg(seen(1, Started, 0, Kernel, None), 0);
        c.pleg(seen(1, Died, 10, Kernel, Some(0)), 10 * MS);
        assert_eq!(c.pending(), 2);
        let d = c.relist(seen(1, Died, 800, Relist, Some(0)), 800 * MS);
        assert_eq!(d.unwrap().first().transition, Died);
        // The relist never saw the 10 ms run: the start is the relist's miss.
        let missed = c.tick(3_000 * MS);
        assert_eq!(missed.len(), 1);
        assert_eq!(missed[0].first().transition, Started);
    }
}
