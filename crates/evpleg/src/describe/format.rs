//! `kubectl describe pod`'s text (`describe.go`'s `describePod`,
//! `describeContainers`, `DescribeEvents`), from a pod and its events: pure,
//! the time given. Columns are aligned as Go's `tabwriter` (padding 2) aligns
//! a run of lines holding tabs.

use k8s_openapi::api::core::v1::{Container, ContainerState, ContainerStatus, Event, Pod, Probe};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

/// The apimachinery's `duration.HumanDuration`: `5s`, `2m30s`, `15m`, `3h20m`,
/// `2d4h`, `3y`.
pub fn human_duration(d: std::time::Duration) -> String {
    let s = d.as_secs();
    if s < 120 {
        return format!("{s}s");
    }
    let m = s / 60;
    if m < 10 {
        return match s % 60 {
            0 => format!("{m}m"),
            r => format!("{m}m{r}s"),
        };
    }
    if m < 180 {
        return format!("{m}m");
    }
    let h = s / 3600;
    if h < 8 {
        return match m % 60 {
            0 => format!("{h}h"),
            r => format!("{h}h{r}m"),
        };
    }
    if h < 48 {
        return format!("{h}h");
    }
    if h < 24 * 8 {
        return match h % 24 {
            0 => format!("{}d", h / 24),
            r => format!("{}d{r}h", h / 24),
        };
    }
    if h < 24 * 365 * 2 {
        return format!("{}d", h / 24);
    }
    if h < 24 * 365 * 8 {
        return match (h / 24) % 365 {
            0 => format!("{}y", h / 24 / 365),
            r => format!("{}y{r}d", h / 24 / 365),
        };
    }
    format!("{}y", h / 24 / 365)
}

/// How long ago `t` was, as kubectl says it (`<unknown>` without a time).
fn since(t: Option<&Timestamp>, now: Timestamp) -> String {
    match t {
        None => "<unknown>".into(),
        Some(t) => {
            let d = now.duration_since(*t);
            if d.is_negative() && d.as_secs() < -1 {
                return "<invalid>".into();
            }
            human_duration(std::time::Duration::try_from(d).unwrap_or_default())
        }
    }
}

/// RFC 1123 with a numeric zone, as kubectl prints times.
fn time(t: &Time) -> String {
    t.0.strftime("%a, %d %b %Y %H:%M:%S %z").to_string()
}

/// Aligns runs of lines holding tabs: each column as wide as its widest cell
/// plus 2 (the last cell of a line is not padded).
pub fn tabwrite(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < lines.len() {
        if !lines[i].contains('\t') {
            out.push_str(lines[i].trim_end());
            out.push('\n');
            i += 1;
            continue;
        }
        let end = (i..lines.len())
            .find(|j| !lines[*j].contains('\t'))
            .unwrap_or(lines.len());
        let rows: Vec<Vec<&str>> = lines[i..end]
            .iter()
            .map(|l| l.split('\t').collect())
            .collect();
        let mut widths: Vec<usize> = Vec::new();
        for row in &rows {
            for (c, cell) in row.iter().enumerate().take(row.len() - 1) {
                let w = cell.chars().count();
                if widths.len() <= c {
                    widths.push(w);
                } else {
                    widths[c] = widths[c].max(w);
                }
            }
        }
        for row in &rows {
            let mut line = String::new();
            for (c, cell) in row.iter().enumerate() {
                if c + 1 == row.len() {
                    line.push_str(cell);
                } else {
                    line.push_str(&format!("{cell:<w$}", w = widths[c] + 2));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        i = end;
    }
    out
}

fn or_none(s: Option<&str>) -> &str {
    s.filter(|s| !s.is_empty()).unwrap_or("<none>")
}

fn state(out: &mut String, label: &str, s: Option<&ContainerState>) {
    let Some(s) = s else {
        out.push_str(&format!("    {label}:\t<none>\n"));
        return;
    };
    if let Some(r) = &s.running {
        out.push_str(&format!("    {label}:\tRunning\n"));
        if let Some(t) = &r.started_at {
            out.push_str(&format!("      Started:\t{}\n", time(t)));
        }
    } else if let Some(w) = &s.waiting {
        out.push_str(&format!("    {label}:\tWaiting\n"));
        out.push_str(&format!(
            "      Reason:\t{}\n",
            w.reason.as_deref().unwrap_or("")
        ));
        if let Some(m) = w.message.as_deref().filter(|m| !m.is_empty()) {
            out.push_str(&format!("      Message:\t{m}\n"));
        }
    } else if let Some(t) = &s.terminated {
        out.push_str(&format!("    {label}:\tTerminated\n"));
        out.push_str(&format!(
            "      Reason:\t{}\n",
            t.reason.as_deref().unwrap_or("")
        ));
        if let Some(m) = t.message.as_deref().filter(|m| !m.is_empty()) {
            out.push_str(&format!("      Message:\t{m}\n"));
        }
        out.push_str(&format!("      Exit Code:\t{}\n", t.exit_code));
        if let Some(sig) = t.signal.filter(|s| *s > 0) {
            out.push_str(&format!("      Signal:\t{sig}\n"));
        }
        for (name, at) in [("Started", &t.started_at), ("Finished", &t.finished_at)] {
            if let Some(at) = at {
                out.push_str(&format!("      {name}:\t{}\n", time(at)));
            }
        }
    } else {
        out.push_str(&format!("    {label}:\t<none>\n"));
    }
}

/// kubectl's `DescribeProbe`: `exec [cmd] delay=0s timeout=1s period=10s
/// #success=1 #failure=3`.
pub fn probe(p: &Probe) -> String {
    let attrs = format!(
        "delay={}s timeout={}s period={}s #success={} #failure={}",
        p.initial_delay_seconds.unwrap_or(0),
        p.timeout_seconds.unwrap_or(1),
        p.period_seconds.unwrap_or(10),
        p.success_threshold.unwrap_or(1),
        p.failure_threshold.unwrap_or(3)
    );
    let port = |p: &k8s_openapi::apimachinery::pkg::util::intstr::IntOrString| match p {
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n) => n.to_string(),
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(s) => s.clone(),
    };
    if let Some(e) = &p.exec {
        format!(
            "exec [{}] {attrs}",
            e.command.clone().unwrap_or_default().join(" ")
        )
    } else if let Some(h) = &p.http_get {
        let scheme = h.scheme.as_deref().unwrap_or("HTTP").to_lowercase();
        let host = h.host.as_deref().unwrap_or("");
        let path = h.path.as_deref().unwrap_or("");
        format!("http-get {scheme}://{host}:{}{path} {attrs}", port(&h.port))
    } else if let Some(t) = &p.tcp_socket {
        format!(
            "tcp-socket {}:{} {attrs}",
            t.host.as_deref().unwrap_or(""),
            port(&t.port)
        )
    } else if let Some(g) = &p.grpc {
        format!(
            "grpc <pod>:{} {} {attrs}",
            g.port,
            g.service.as_deref().unwrap_or("")
        )
    } else {
        format!("unknown {attrs}")
    }
}

fn container(out: &mut String, c: &Container, s: Option<&ContainerStatus>) {
    out.push_str(&format!("  {}:\n", c.name));
    if let Some(id) = s.and_then(|s| s.container_id.as_deref()) {
        out.push_str(&format!("    Container ID:\t{id}\n"));
    }
    out.push_str(&format!(
        "    Image:\t{}\n",
        c.image.as_deref().unwrap_or("")
    ));
    if let Some(id) = s.map(|s| s.image_id.as_str()).filter(|i| !i.is_empty()) {
        out.push_str(&format!("    Image ID:\t{id}\n"));
    }
    if let Some(cmd) = c.command.as_ref().filter(|c| !c.is_empty()) {
        out.push_str("    Command:\n");
        for part in cmd {
            out.push_str(&format!("      {part}\n"));
        }
    }
    state(out, "State", s.and_then(|s| s.state.as_ref()));
    if let Some(last) = s.and_then(|s| s.last_state.as_ref()) {
        state(out, "Last State", Some(last));
    }
    let ready = s.is_some_and(|s| s.ready);
    out.push_str(&format!(
        "    Ready:\t{}\n",
        if ready { "True" } else { "False" }
    ));
    out.push_str(&format!(
        "    Restart Count:\t{}\n",
        s.map(|s| s.restart_count).unwrap_or(0)
    ));
    if let Some(started) = s.and_then(|s| s.started) {
        out.push_str(&format!(
            "    Started:\t{}\n",
            if started { "True" } else { "False" }
        ));
    }
    for (name, p) in [
        ("Liveness", &c.liveness_probe),
        ("Readiness", &c.readiness_probe),
        ("Startup", &c.startup_probe),
    ] {
        if let Some(p) = p {
            out.push_str(&format!("    {name}:\t{}\n", probe(p)));
        }
    }
}

/// The events table: type, reason, age (`5s`, or `2m (x4 over 5m)`), from,
/// message; oldest last time first.
pub fn events_table(events: &[Event], now: Timestamp) -> String {
    if events.is_empty() {
        return "Events:\t<none>\n".into();
    }
    let mut sorted: Vec<&Event> = events.iter().collect();
    sorted.sort_by_key(|e| {
        e.last_timestamp
            .as_ref()
            .map(|t| t.0)
            .or(e.event_time.as_ref().map(|t| t.0))
    });
    let mut out = String::from(
        "Events:\n  Type\tReason\tAge\tFrom\tMessage\n  ----\t------\t----\t----\t-------\n",
    );
    for e in sorted {
        let first = e
            .first_timestamp
            .as_ref()
            .map(|t| t.0)
            .or(e.event_time.as_ref().map(|t| t.0));
        let first_since = since(first.as_ref(), now);
        let count = e.count.unwrap_or(1);
        let age = if count > 1 {
            let last = e.last_timestamp.as_ref().map(|t| t.0);
            format!(
                "{} (x{count} over {first_since})",
                since(last.as_ref(), now)
            )
        } else {
            first_since
        };
        let from = e
            .source
            .as_ref()
            .and_then(|s| s.component.clone())
            .or(e.reporting_component.clone())
            .filter(|c| !c.is_empty())
            .unwrap_or_else(|| "<unknown>".into());
        out.push_str(&format!(
            "  {}\t{}\t{age}\t{from}\t{}\n",
            e.type_.as_deref().unwrap_or(""),
            e.reason.as_deref().unwrap_or(""),
            e.message.as_deref().unwrap_or("").trim()
        ));
    }
    out
}

/// The whole `describe pod` text.
pub fn describe_pod(pod: &Pod, events: &[Event], now: Timestamp) -> String {
    let m = &pod.metadata;
    let spec = pod.spec.clone().unwrap_or_default();
    let status = pod.status.clone().unwrap_or_default();
    let mut out = String::new();
    out.push_str(&format!("Name:\t{}\n", m.name.as_deref().unwrap_or("")));
    out.push_str(&format!(
        "Namespace:\t{}\n",
        m.namespace.as_deref().unwrap_or("default")
    ));
    out.push_str(&format!("UID:\t{}\n", m.uid.as_deref().unwrap_or("")));
    let node = or_none(spec.node_name.as_deref());
    match status.host_ip.as_deref().filter(|i| !i.is_empty()) {
        Some(ip) => out.push_str(&format!("Node:\t{node}/{ip}\n")),
        None => out.push_str(&format!("Node:\t{node}\n")),
    }
    if let Some(t) = &status.start_time {
        out.push_str(&format!("Start Time:\t{}\n", time(t)));
    }
    let labels = m.labels.as_ref().map(|l| {
        l.iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    });
    out.push_str(&format!("Labels:\t{}\n", or_none(labels.as_deref())));
    let phase = if m.deletion_timestamp.is_some() {
        "Terminating"
    } else {
        status.phase.as_deref().unwrap_or("Unknown")
    };
    out.push_str(&format!("Status:\t{phase}\n"));
    if let Some(r) = status.reason.as_deref() {
        out.push_str(&format!("Reason:\t{r}\n"));
    }
    if let Some(msg) = status.message.as_deref() {
        out.push_str(&format!("Message:\t{msg}\n"));
    }
    out.push_str(&format!(
        "IP:\t{}\n",
        status.pod_ip.as_deref().unwrap_or("")
    ));
    let find = |list: &Option<Vec<ContainerStatus>>, name: &str| -> Option<ContainerStatus> {
        list.as_ref()
            .and_then(|l| l.iter().find(|s| s.name == name).cloned())
    };
    if let Some(init) = spec.init_containers.as_ref().filter(|i| !i.is_empty()) {
        out.push_str("Init Containers:\n");
        for c in init {
            container(
                &mut out,
                c,
                find(&status.init_container_statuses, &c.name).as_ref(),
            );
        }
    }
    out.push_str("Containers:\n");
    for c in &spec.containers {
        container(
            &mut out,
            c,
            find(&status.container_statuses, &c.name).as_ref(),
        );
    }
    let conditions = status.conditions.clone().unwrap_or_default();
    if !conditions.is_empty() {
        out.push_str("Conditions:\n  Type\tStatus\n");
        for c in &conditions {
            out.push_str(&format!("  {}\t{}\n", c.type_, c.status));
        }
    }
    if let Some(q) = &status.qos_class {
        out.push_str(&format!("QoS Class:\t{q}\n"));
    }
    out.push_str(&events_table(events, now));
    tabwrite(&out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn human_durations_as_the_apimachinery_s() {
        let cases = [
            (0, "0s"),
            (119, "119s"),
            (120, "2m"),
            (150, "2m30s"),
            (600, "10m"),
            (3 * 3600 + 20 * 60, "3h20m"),
            (8 * 3600 + 59 * 60, "8h"),
            (2 * 86400 + 4 * 3600, "2d4h"),
            (30 * 86400, "30d"),
            (3 * 365 * 86400 + 86400, "3y1d"),
            (10 * 365 * 86400, "10y"),
        ];
        for (secs, want) in cases {
            assert_eq!(
                human_duration(std::time::Duration::from_secs(secs)),
                want,
                "{secs}"
            );
        }
    }

    fn pod() -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "crasher", "namespace": "default", "uid": "u-1"},
            "spec": {
                "nodeName": "node-1",
                "containers": [{
                    "name": "app", "image": "busybox", "command": ["sh", "-c", "exit 2"],
                    "livenessProbe": {"exec": {"command": ["true"]}, "periodSeconds": 5},
                }],
            },
            "status": {
                "phase": "Running",
                "hostIP": "10.0.0.1",
                "startTime": "2026-12-01T03:00:00Z",
                "conditions": [
                    {"type": "Initialized", "status": "True"},
                    {"type": "Ready", "status": "False"},
                ],
                "containerStatuses": [{
                    "name": "app", "image": "busybox", "imageID": "sha256:abc",
                    "containerID": "containerd://c1", "ready": false, "restartCount": 3,
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                    "lastState": {"terminated": {"exitCode": 2, "reason": "Error",
                        "startedAt": "2026-12-01T03:04:00Z", "finishedAt": "2026-12-01T03:04:01Z"}},
                }],
                "qosClass": "BestEffort",
            },
        }))
        .unwrap()
    }

    fn event(kind: &str, reason: &str, count: i32, first: &str, last: &str, msg: &str) -> Event {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "x"},
            "involvedObject": {"kind": "Pod", "name": "crasher"},
            "type": kind, "reason": reason, "count": count, "message": msg,
            "firstTimestamp": first, "lastTimestamp": last,
            "source": {"component": "kubelet", "host": "node-1"},
        }))
        .unwrap()
    }

    #[test]
    fn a_crash_looping_pod_described_as_kubectl_does() {
        let events = [
            event(
                "Warning",
                "BackOff",
                7,
                "2026-12-01T03:01:00Z",
                "2026-12-01T03:04:30Z",
                "Back-off restarting failed container app in pod crasher_default(u-1)",
            ),
            event(
                "Normal",
                "Pulled",
                1,
                "2026-12-01T03:00:01Z",
                "2026-12-01T03:00:01Z",
                "Container image \"busybox\" already present on machine and can be accessed by the pod",
            ),
        ];
        let text = describe_pod(&pod(), &events, ts("2026-12-01T03:05:00Z"));
        let want = "\
Name:        crasher
Namespace:   default
UID:         u-1
Node:        node-1/10.0.0.1
Start Time:  Tue, 01 Dec 2026 03:00:00 +0000
Labels:      <none>
Status:      Running
IP:
Containers:
  app:
    Container ID:  containerd://c1
    Image:         busybox
    Image ID:      sha256:abc
    Command:
      sh
      -c
      exit 2
    State:          Waiting
      Reason:       CrashLoopBackOff
      Message:      back-off 40s
    Last State:     Terminated
      Reason:       Error
      Exit Code:    2
      Started:      Tue, 01 Dec 2026 03:04:00 +0000
      Finished:     Tue, 01 Dec 2026 03:04:01 +0000
    Ready:          False
    Restart Count:  3
    Liveness:       exec [true] delay=0s timeout=1s period=5s #success=1 #failure=3
Conditions:
  Type         Status
  Initialized  True
  Ready        False
QoS Class:     BestEffort
Events:
  Type     Reason   Age               From     Message
  ----     ------   ----              ----     -------
  Normal   Pulled   4m59s             kubelet  Container image \"busybox\" already present on machine and can be accessed by the pod
  Warning  BackOff  30s (x7 over 4m)  kubelet  Back-off restarting failed container app in pod crasher_default(u-1)
";
        assert_eq!(text, want, "got:\n{text}");
    }

    #[test]
    fn no_events_and_no_status_are_said() {
        let mut p = pod();
        p.status = None;
        let text = describe_pod(&p, &[], ts("2026-12-01T03:05:00Z"));
        let words: Vec<String> = text
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect();
        for line in [
            "Status: Unknown",
            "State: <none>",
            "Ready: False",
            "Events: <none>",
        ] {
            assert!(words.iter().any(|w| w == line), "{line}: {text}");
        }
    }
}
