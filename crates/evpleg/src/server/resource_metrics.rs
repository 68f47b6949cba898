//! `/metrics/resource`: the kubelet's resource metrics
//! (`pkg/kubelet/metrics/collectors/resource_metrics.go`), which
//! metrics-server scrapes. The names are the kubelet's, without the agent's
//! `evpleg_` prefix, because metrics-server parses them by name:
//! `node_cpu_usage_seconds_total`, `node_memory_working_set_bytes`,
//! `container_cpu_usage_seconds_total`, `container_memory_working_set_bytes`,
//! `container_start_time_seconds`, `pod_cpu_usage_seconds_total`,
//! `pod_memory_working_set_bytes`, and `scrape_error` /
//! `resource_scrape_error` (1 when the stats could not be read). Each sample
//! carries the time it was read, in milliseconds, as the kubelet's. Built
//! from the CPU-and-memory summary ([`super::stats`]), which does not move
//! the `usageNanoCores` samples, as the kubelet's.
//!
//! Differences: no swap metrics.

use std::fmt::Write as _;

use k8s_openapi::jiff::Timestamp;

use super::stats::Summary;

/// The text format's content type.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A label value escaped for the text format.
fn escape(v: &str) -> String {
    v.replace('\\', r"\\")
        .replace('"', r#"\""#)
        .replace('\n', r"\n")
}

fn ms(t: Timestamp) -> i64 {
    t.as_millisecond()
}

/// One metric family: its header and samples `(labels, value, time)`.
fn family(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(String, f64, i64)]) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for (labels, value, at) in samples {
        let _ = writeln!(out, "{name}{labels} {value} {at}");
    }
}

/// The exposition of `summary` (`None`: the stats failed, only the scrape
/// error metrics, at 1).
pub fn render(summary: Option<&Summary>) -> String {
    let mut out = String::new();
    let secs = |ns: u64| ns as f64 / 1e9;
    if let Some(s) = summary {
        let node = &s.node;
        family(
            &mut out,
            "node_cpu_usage_seconds_total",
            "counter",
            "[STABLE] Cumulative cpu time consumed by the node in core-seconds",
            &[(
                String::new(),
                secs(node.cpu.usage_core_nano_seconds),
                ms(node.cpu.time),
            )],
        );
        family(
            &mut out,
            "node_memory_working_set_bytes",
            "gauge",
            "[STABLE] Current working set of the node in bytes",
            &[(
                String::new(),
                node.memory.working_set_bytes as f64,
                ms(node.memory.time),
            )],
        );
        let pod_labels = |ns: &str, pod: &str| {
            format!(r#"{{namespace="{}",pod="{}"}}"#, escape(ns), escape(pod))
        };
        let (mut c_cpu, mut c_mem, mut c_start, mut p_cpu, mut p_mem) =
            (vec![], vec![], vec![], vec![], vec![]);
        for p in &s.pods {
            let (ns, name) = (&p.pod_ref.namespace, &p.pod_ref.name);
            p_cpu.push((
                pod_labels(ns, name),
                secs(p.cpu.usage_core_nano_seconds),
                ms(p.cpu.time),
            ));
            p_mem.push((
                pod_labels(ns, name),
                p.memory.working_set_bytes as f64,
                ms(p.memory.time),
            ));
            for c in &p.containers {
                let labels = format!(
                    r#"{{container="{}",namespace="{}",pod="{}"}}"#,
                    escape(&c.name),
                    escape(ns),
                    escape(name)
                );
                c_cpu.push((
                    labels.clone(),
                    secs(c.cpu.usage_core_nano_seconds),
                    ms(c.cpu.time),
                ));
                c_mem.push((
                    labels.clone(),
                    c.memory.working_set_bytes as f64,
                    ms(c.memory.time),
                ));
                c_start.push((
                    labels,
                    c.start_time.as_nanosecond() as f64 / 1e9,
                    ms(c.start_time),
                ));
            }
        }
        family(
            &mut out,
            "container_cpu_usage_seconds_total",
            "counter",
            "[STABLE] Cumulative cpu time consumed by the container in core-seconds",
            &c_cpu,
        );
        family(
            &mut out,
            "container_memory_working_set_bytes",
            "gauge",
            "[STABLE] Current working set of the container in bytes",
            &c_mem,
        );
        family(
            &mut out,
            "container_start_time_seconds",
            "gauge",
            "[STABLE] Start time of the container since unix epoch in seconds",
            &c_start,
        );
        family(
            &mut out,
            "pod_cpu_usage_seconds_total",
            "counter",
            "[STABLE] Cumulative cpu time consumed by the pod in core-seconds",
            &p_cpu,
        );
        family(
            &mut out,
            "pod_memory_working_set_bytes",
            "gauge",
            "[STABLE] Current working set of the pod in bytes",
            &p_mem,
        );
    }
    let failed = if summary.is_some() { 0.0 } else { 1.0 };
    for (name, help) in [
        (
            "resource_scrape_error",
            "[STABLE] 1 if there was an error while getting container metrics, 0 otherwise",
        ),
        (
            "scrape_error",
            "[ALPHA] 1 if there was an error while getting container metrics, 0 otherwise",
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} gauge");
        let _ = writeln!(out, "{name} {failed}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::stats::{ContainerStats, CpuStats, MemoryStats, PodReference, PodStats};

    #[test]
    fn the_kubelet_s_names_labels_and_millisecond_times() {
        let t: Timestamp = "2026-12-02T07:00:00Z".parse().unwrap();
        let at = t.as_millisecond();
        let cpu = |ns| CpuStats {
            time: t,
            usage_nano_cores: None,
            usage_core_nano_seconds: ns,
        };
        let mem = |b| MemoryStats {
            time: t,
            working_set_bytes: b,
            ..Default::default()
        };
        let mut summary = Summary::default();
        summary.node.cpu = cpu(2_500_000_000);
        summary.node.memory = mem(1024);
        summary.pods.push(PodStats {
            pod_ref: PodReference {
                name: "p\"1".into(),
                namespace: "ns".into(),
                uid: "u".into(),
            },
            cpu: cpu(1_000_000_000),
            memory: mem(300),
            containers: vec![ContainerStats {
                name: "c".into(),
                start_time: t,
                cpu: cpu(500_000_000),
                memory: mem(200),
                ..Default::default()
            }],
            ..Default::default()
        });
        let text = render(Some(&summary));
        for line in [
            format!("node_cpu_usage_seconds_total 2.5 {at}"),
            format!("node_memory_working_set_bytes 1024 {at}"),
            format!(
                r#"container_cpu_usage_seconds_total{{container="c",namespace="ns",pod="p\"1"}} 0.5 {at}"#
            ),
            format!(
                r#"container_memory_working_set_bytes{{container="c",namespace="ns",pod="p\"1"}} 200 {at}"#
            ),
            format!(
                r#"container_start_time_seconds{{container="c",namespace="ns",pod="p\"1"}} {} {at}"#,
                t.as_second()
            ),
            format!(r#"pod_cpu_usage_seconds_total{{namespace="ns",pod="p\"1"}} 1 {at}"#),
            format!(r#"pod_memory_working_set_bytes{{namespace="ns",pod="p\"1"}} 300 {at}"#),
            "# TYPE container_cpu_usage_seconds_total counter".into(),
            "scrape_error 0".into(),
            "resource_scrape_error 0".into(),
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
        let failed = render(None);
        assert!(failed.lines().any(|l| l == "scrape_error 1"), "{failed}");
        assert!(!failed.contains("node_cpu"), "{failed}");
    }
}
