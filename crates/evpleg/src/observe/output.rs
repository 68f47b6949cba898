//! What `evpleg observe` prints: one [`ObservedEvent`] per transition, as a
//! JSON object per line or as a row of an aligned table.

use serde::Serialize;

use super::correlate::Compared;
use evpleg_core::clock::monotonic_to_unix_ns;
use evpleg_core::container::PodStatus;
use evpleg_core::lifecycle::EventSource;

/// One container transition as observed, with the comparison.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ObservedEvent {
    /// When it was first seen (RFC 3339, UTC): the kernel's timestamp for a
    /// kernel event.
    pub time: String,
    /// `ContainerStarted` or `ContainerDied`.
    pub kind: String,
    /// Who saw it first: `kernel`, `relist` or `cri`; `relist` alone when
    /// the PLEG never reported it.
    pub source: &'static str,
    pub pod_uid: Option<String>,
    pub namespace: Option<String>,
    pub pod: Option<String>,
    pub container: Option<String>,
    pub container_id: String,
    /// The exit code of a death (the PLEG's, else the runtime's).
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub oom_killed: bool,
    /// How much earlier the PLEG saw it than the comparison relist, in
    /// milliseconds (negative: the relist was first); absent when one side
    /// never saw it.
    pub relist_lead_ms: Option<f64>,
    /// The runtime's exit code as the comparison relist read it.
    pub relist_exit_code: Option<i32>,
    /// What the two disagree on, if anything.
    pub disagreement: Option<String>,
    /// From the first sighting to this line, in milliseconds.
    pub age_ms: f64,
}

fn source_name(s: EventSource) -> &'static str {
    match s {
        EventSource::Kernel => "kernel",
        EventSource::Relist => "relist",
        EventSource::Cri => "cri",
    }
}

impl ObservedEvent {
    /// The line for `c`, with names from `status` when it has them.
    pub fn new(c: &Compared, status: Option<&PodStatus>, now_ns: u64) -> Self {
        let first = c.first();
        let container = status.and_then(|s| s.container(&first.container_id));
        let time = k8s_openapi::jiff::Timestamp::from_nanosecond(
            monotonic_to_unix_ns(first.at_ns) as i128
        )
        .map(|t| t.to_string())
        .unwrap_or_default();
        let named = |s: &str| (!s.is_empty()).then(|| s.to_owned());
        Self {
            time,
            kind: format!("{:?}", first.transition.kind()),
            source: source_name(first.source),
            pod_uid: first.pod_uid.as_ref().map(|u| u.as_str().to_owned()),
            namespace: status.and_then(|s| named(&s.namespace)),
            pod: status.and_then(|s| named(&s.name)),
            container: container.and_then(|c| named(&c.name)),
            container_id: first.container_id.as_str().to_owned(),
            exit_code: c
                .pleg
                .as_ref()
                .and_then(|p| p.exit_code)
                .or_else(|| c.relist.as_ref().and_then(|r| r.exit_code)),
            signal: first.signal,
            oom_killed: first.oom_killed,
            relist_lead_ms: c.lead_ns.map(|ns| ns as f64 / 1e6),
            relist_exit_code: c.relist.as_ref().and_then(|r| r.exit_code),
            disagreement: c.disagreement.clone(),
            age_ms: now_ns.saturating_sub(first.at_ns) as f64 / 1e6,
        }
    }

    /// One JSON object.
    pub fn json(&self) -> String {
        serde_json::to_string(self).expect("an event always serialises")
    }

    /// The table's header ([`ObservedEvent::row`]).
    pub fn header() -> String {
        format!(
            "{:<24} {:<16} {:<6} {:<40} {:<13} {:>5} {:>11}  {}",
            "TIME", "EVENT", "SOURCE", "POD", "CONTAINER", "EXIT", "LEAD", "NOTE"
        )
    }

    /// One row of the table.
    pub fn row(&self) -> String {
        let pod = match (&self.namespace, &self.pod, &self.pod_uid) {
            (Some(ns), Some(name), _) => format!("{ns}/{name}"),
            (_, _, Some(uid)) => uid.clone(),
            _ => "-".into(),
        };
        let container = self
            .container
            .clone()
            .unwrap_or_else(|| self.container_id.chars().take(13).collect());
        let exit = self.exit_code.map(|c| c.to_string()).unwrap_or_default();
        let lead = self
            .relist_lead_ms
            .map(|ms| format!("{ms:.1}ms"))
            .unwrap_or_else(|| "-".into());
        format!(
            "{:<24} {:<16} {:<6} {:<40} {:<13} {:>5} {:>11}  {}",
            self.time.chars().take(24).collect::<String>(),
            self.kind,
            self.source,
            pod,
            container,
            exit,
            lead,
            self.disagreement.as_deref().unwrap_or("")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::correlate::{Seen, Transition};
    use evpleg_core::container::{ContainerState, ContainerStatus};
    use evpleg_core::ids::{ContainerId, PodUid};

    #[test]
    fn a_matched_death_names_the_pod_and_the_lead() {
        let id = ContainerId::parse(&"c".repeat(64)).unwrap();
        let uid = PodUid::parse(&"a".repeat(32)).unwrap();
        let seen = |source, at_ns, code| Seen {
            pod_uid: Some(uid.clone()),
            container_id: id.clone(),
            transition: Transition::Died,
            at_ns,
            source,
            exit_code: Some(code),
            signal: None,
            oom_killed: false,
        };
        let c = Compared {
            pleg: Some(seen(EventSource::Kernel, 1_000_000_000, 3)),
            relist: Some(seen(EventSource::Relist, 1_420_500_000, 3)),
            lead_ns: Some(420_500_000),
            disagreement: None,
        };
        let status = PodStatus {
            uid: Some(uid.clone()),
            name: "web".into(),
            namespace: "default".into(),
            ips: vec![],
            sandboxes: vec![],
            containers: vec![ContainerStatus::new(
                id.clone(),
                "app",
                ContainerState::Exited,
                EventSource::Relist,
            )],
        };
        let line = ObservedEvent::new(&c, Some(&status), 1_500_000_000);
        let v: serde_json::Value = serde_json::from_str(&line.json()).unwrap();
        assert_eq!(v["kind"], "ContainerDied");
        assert_eq!(v["source"], "kernel");
        assert_eq!(v["pod_uid"], "a".repeat(32));
        assert_eq!(v["pod"], "web");
        assert_eq!(v["container"], "app");
        assert_eq!(v["exit_code"], 3);
        assert_eq!(v["relist_lead_ms"], 420.5);
        assert_eq!(v["age_ms"], 500.0);
        assert!(v["disagreement"].is_null());
        let row = line.row();
        assert!(
            row.contains("default/web") && row.contains("420.5ms"),
            "{row}"
        );
        assert_eq!(
            ObservedEvent::header().split_whitespace().count(),
            8,
            "eight columns"
        );
    }
}
