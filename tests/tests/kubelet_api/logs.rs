//! `/containerLogs` and `kubectl logs`: its query parameters, `previous`,
//! and the container log manager's rotation by size.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_logs_reaches_the_agent_through_the_api_server() {
    let name = "kubectl_logs_reaches_the_agent_through_the_api_server";
    if !real(name) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = start("kubelet_api_logs").await;
    let node = wait_node_endpoint(&e).await;
    let status = node.status.expect("status");
    let addresses: Vec<(String, String)> = status
        .addresses
        .unwrap_or_default()
        .into_iter()
        .map(|a| (a.type_, a.address))
        .collect();
    assert_eq!(addresses[0], ("InternalIP".into(), "127.0.0.1".into()));
    assert_eq!(addresses[1].0, "Hostname");
    let info = status.node_info.expect("nodeInfo");
    assert!(
        info.container_runtime_version.starts_with("containerd://"),
        "{info:?}"
    );
    assert_eq!(
        info.kernel_version,
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap()
            .trim()
    );

    e.create_pod(&api_pod(
        "fixed",
        "Always",
        "for i in 1 2 3 4 5; do echo line $i; done; exec sleep 600",
    ))
    .await;
    // Restarts once: run 1 exits, run 2 stays (its count in an emptyDir).
    let mut restarter = api_pod(
        "restarter",
        "Always",
        "n=$(cat /data/n 2>/dev/null || echo 0); n=$((n+1)); echo $n > /data/n; echo run $n; \
         if [ $n -lt 2 ]; then exit 3; fi; exec sleep 600",
    );
    let spec = restarter.spec.as_mut().expect("spec");
    spec.volumes = Some(vec![
        serde_json::from_value(serde_json::json!({"name": "data", "emptyDir": {}}))
            .expect("a volume"),
    ]);
    spec.containers[0].volume_mounts = Some(vec![
        serde_json::from_value(serde_json::json!({"name": "data", "mountPath": "/data"}))
            .expect("a mount"),
    ]);
    e.create_pod(&restarter).await;
    e.create_pod(&api_pod(
        "counter",
        "Always",
        "i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.05; done",
    ))
    .await;
    running(&e, "fixed").await;
    running(&e, "counter").await;
    e.wait_api(
        "restarter",
        "restarted once and running",
        restarted_once_and_running,
    )
    .await;

    assert_eq!(
        kubectl_ok(&e, &["logs", "fixed"]),
        "line 1\nline 2\nline 3\nline 4\nline 5\n"
    );
    assert_eq!(
        kubectl_ok(&e, &["logs", "fixed", "--tail=2"]),
        "line 4\nline 5\n"
    );
    assert_eq!(
        kubectl_ok(&e, &["logs", "fixed", "--limit-bytes=9"]),
        "line 1\nli"
    );
    assert_eq!(
        kubectl_ok(&e, &["logs", "fixed", "--since=1h"]),
        "line 1\nline 2\nline 3\nline 4\nline 5\n"
    );
    // Written before now: nothing since now. kubectl sends `sinceTime` in
    // whole seconds (a metav1.Time), so "now" is the next whole second: a
    // truncation cannot bring it back before the lines (it did, when the
    // lines were written less than a second before).
    let now = k8s_openapi::jiff::Timestamp::now().as_second() + 1;
    let now = k8s_openapi::jiff::Timestamp::from_second(now)
        .expect("a time")
        .to_string();
    assert_eq!(
        kubectl_ok(&e, &["logs", "fixed", &format!("--since-time={now}")]),
        ""
    );
    let stamped = kubectl_ok(&e, &["logs", "fixed", "--timestamps", "--tail=1"]);
    let (time, line) = stamped.split_once(' ').expect("a timestamp first");
    let time: k8s_openapi::jiff::Timestamp = time.parse().expect("an RFC 3339 time");
    assert!(time < now.parse().unwrap(), "{stamped}");
    assert_eq!(line, "line 5\n");
    assert_eq!(kubectl_ok(&e, &["logs", "restarter"]), "run 2\n");
    assert_eq!(
        kubectl_ok(&e, &["logs", "restarter", "--previous"]),
        "run 1\n"
    );
    let (ok, _, err) = kubectl(&e, &["logs", "fixed", "--previous"]);
    assert!(!ok);
    assert!(
        err.contains(r#"previous terminated container \"app\" in pod \"fixed\" not found"#)
            || err.contains(r#"previous terminated container "app" in pod "fixed" not found"#),
        "{err}"
    );
    let (ok, _, err) = kubectl(&e, &["logs", "fixed", "-c", "nope"]);
    assert!(!ok && err.contains("nope"), "{err}");

    // -f: lines written after it started arrive; the stream ends with the
    // client, and the agent's reader with it.
    let mut follow =
        tokio::process::Command::new(evpleg_tests::go_tools::binary("kubectl").expect("kubectl"))
            .arg("--kubeconfig")
            .arg(e.cp().admin_kubeconfig())
            .args(["-n", "default", "logs", "-f", "counter", "--tail=1"])
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("kubectl logs -f");
    let api = e.agent().kubelet_api.clone().expect("the kubelet server");
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(
        follow.stdout.take().expect("stdout"),
    ));
    let tick = |l: &str| -> u64 {
        l.strip_prefix("tick ")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("not a tick: {l:?}"))
    };
    type Out = tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>;
    async fn next(lines: &mut Out) -> String {
        tokio::time::timeout(DEADLINE, lines.next_line())
            .await
            .expect("a line within the deadline")
            .expect("read")
            .expect("a line")
    }
    let first = tick(&next(&mut lines).await);
    let mut last = first;
    for _ in 0..20 {
        let n = tick(&next(&mut lines).await);
        assert_eq!(n, last + 1, "in order, none lost");
        last = n;
    }
    assert_eq!(
        api.log_streams.load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    follow.kill().await.expect("kill kubectl");
    let deadline = Instant::now() + DEADLINE;
    while api.log_streams.load(std::sync::atomic::Ordering::Relaxed) != 0 {
        assert!(
            Instant::now() < deadline,
            "the log stream outlived its client"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Straight to the kubelet server (the admin's certificate): the
    // kubelet's codes for bad input.
    let (cert, key) = admin_cert(&e);
    let code = async |path: &str| get(&e, path, Cred::Cert(&cert, &key)).await;
    assert_eq!(
        code("/containerLogs/default/nope/app").await,
        (404, r#"pod "nope" does not exist"#.into())
    );
    assert_eq!(
        code("/containerLogs/default/fixed/nope").await,
        (404, r#"container "nope" not found in pod "fixed""#.into())
    );
    assert_eq!(
        code("/containerLogs/default/fixed/app?tailLines=-1").await,
        (422, r#"{"message": "Invalid request."}"#.into())
    );
    assert_eq!(
        code("/containerLogs/default/fixed/app?limitBytes=99999999999999999999")
            .await
            .0,
        400
    );
    assert_eq!(
        code("/containerLogs/default/fixed/app?limitBytes=9223372036854775807").await,
        (200, "line 1\nline 2\nline 3\nline 4\nline 5\n".into())
    );
    e.finish().await;
}

/// The numbers `n` of the `line <n>` messages of a CRI log file's text.
fn numbered(cri_log: &str) -> Vec<u64> {
    cri_log
        .lines()
        .map(|l| {
            let content = l
                .splitn(4, ' ')
                .nth(3)
                .unwrap_or_else(|| panic!("a CRI line: {l:?}"));
            content
                .strip_prefix("line ")
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("not a numbered line: {l:?}"))
        })
        .collect()
}

/// `nums` go up by one.
fn consecutive(what: &str, nums: &[u64]) {
    if let Some(w) = nums.windows(2).find(|w| w[1] != w[0] + 1) {
        panic!("{what}: {} then {}: lines lost or repeated", w[0], w[1]);
    }
}

/// A container's log files (`<log>` and `<log>.*`), sorted, `.tmp` left out.
fn log_files(log: &Path) -> Vec<PathBuf> {
    let prefix = format!("{}.", log.file_name().expect("a name").to_string_lossy());
    let mut out: Vec<PathBuf> = std::fs::read_dir(log.parent().expect("a directory"))
        .expect("the log directory")
        .map(|e| e.expect("an entry").path())
        .filter(|p| {
            let n = p
                .file_name()
                .expect("a name")
                .to_string_lossy()
                .into_owned();
            n.starts_with(&prefix) && !n.ends_with(".tmp")
        })
        .collect();
    out.sort();
    out.push(log.to_owned());
    out
}

/// The rotated files (oldest first, gunzipped) and the live one, read
/// while no rotation happened (the listing the same before and after).
async fn log_snapshot(log: &Path) -> Vec<(PathBuf, String)> {
    use std::io::Read as _;
    let deadline = Instant::now() + DEADLINE;
    loop {
        assert!(
            Instant::now() < deadline,
            "no quiet moment between rotations"
        );
        let files = log_files(log);
        let read = |p: &PathBuf| -> Option<String> {
            let f = std::fs::File::open(p).ok()?;
            let mut text = String::new();
            if p.extension().is_some_and(|e| e == "gz") {
                flate2::read::GzDecoder::new(f)
                    .read_to_string(&mut text)
                    .ok()?;
            } else {
                std::io::BufReader::new(f).read_to_string(&mut text).ok()?;
            }
            Some(text)
        };
        let texts: Option<Vec<String>> = files.iter().map(read).collect();
        if let Some(texts) = texts
            && log_files(log) == files
        {
            return files.into_iter().zip(texts).collect();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_logs_rotate_by_size_and_kubectl_logs_follows_the_live_file() {
    let name = "container_logs_rotate_by_size_and_kubectl_logs_follows_the_live_file";
    if !real(name) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let cp = evpleg_tests::control_plane::ControlPlane::shared().await;
    let ca = cp.ca().display().to_string();
    const MAX_FILES: usize = 3;
    let mut e = E2e::start_with_control_plane(
        "kubelet_api_rotation",
        &[
            "--node-ip",
            "127.0.0.1",
            "--client-ca-file",
            &ca,
            "--container-log-max-size",
            "16Ki",
            "--container-log-max-files",
            "3",
            "--container-log-monitor-interval",
            "1s",
        ],
    )
    .await;
    // About 60 KB/s of numbered lines.
    e.create_pod(&api_pod(
        "rotator",
        "Always",
        "i=0; while true; do j=0; while [ $j -lt 50 ]; do echo line $i; i=$((i+1)); j=$((j+1)); done; sleep 0.05; done",
    ))
    .await;
    let pod = running(&e, "rotator").await;
    let uid = pod.metadata.uid.clone().expect("a uid");
    let log = e
        .args
        .pod_log_dir
        .join(format!("default_rotator_{uid}/app/0.log"));

    // Rotations: renamed with a time stamp, the older ones gzipped, never
    // more than max-files, until three rotated names were seen.
    let mut seen = std::collections::BTreeSet::new();
    let deadline = Instant::now() + DEADLINE;
    while seen.len() < 3 {
        assert!(Instant::now() < deadline, "rotated only {seen:?}");
        let files = log_files(&log);
        assert!(files.len() <= MAX_FILES, "{files:?}");
        for f in &files[..files.len() - 1] {
            let n = f
                .file_name()
                .expect("a name")
                .to_string_lossy()
                .into_owned();
            let stamp = n
                .trim_start_matches("0.log.")
                .trim_end_matches(".gz")
                .to_owned();
            assert!(
                stamp.len() == 15
                    && stamp.as_bytes()[8] == b'-'
                    && stamp.replace('-', "").bytes().all(|b| b.is_ascii_digit()),
                "the kubelet's YYYYMMDD-hhmmss: {n}"
            );
            seen.insert(stamp);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Everything kept, oldest to newest, has no gap: a line written during
    // a rotation went to the renamed file, not nowhere.
    let snapshot = log_snapshot(&log).await;
    assert_eq!(
        snapshot.len(),
        MAX_FILES,
        "{:?}",
        snapshot.iter().map(|s| &s.0).collect::<Vec<_>>()
    );
    assert!(
        snapshot[0].0.to_string_lossy().ends_with(".gz"),
        "the oldest compressed"
    );
    assert!(
        !snapshot[1].0.to_string_lossy().ends_with(".gz"),
        "the newest rotated one plain"
    );
    let all: Vec<u64> = snapshot.iter().flat_map(|(_, t)| numbered(t)).collect();
    consecutive("the kept files", &all);
    assert!(all[0] > 0, "the first lines were rotated out and removed");

    // kubectl logs reads the live file, from its first line on: checked
    // when no rotation happened while it ran.
    let check_kubectl = async |e: &E2e| {
        let deadline = Instant::now() + DEADLINE;
        loop {
            assert!(
                Instant::now() < deadline,
                "kubectl logs never ran between rotations"
            );
            let before = log_files(&log);
            let out = kubectl_ok(e, &["logs", "rotator"]);
            let after = log_snapshot(&log).await;
            if after.iter().map(|s| &s.0).eq(before.iter()) {
                let got: Vec<u64> = out
                    .lines()
                    .map(|l| {
                        l.strip_prefix("line ")
                            .and_then(|n| n.parse().ok())
                            .unwrap_or_else(|| panic!("{l:?}"))
                    })
                    .collect();
                let live = numbered(&after.last().expect("the live file").1);
                assert!(
                    !got.is_empty() && got.len() <= live.len(),
                    "{} lines, the file {}",
                    got.len(),
                    live.len()
                );
                assert_eq!(
                    got,
                    live[..got.len()],
                    "kubectl logs is the live file from its start"
                );
                return;
            }
        }
    };
    check_kubectl(&e).await;

    // An agent restart: rotation goes on from the files, bounded the same.
    e.restart_agent().await;
    wait_node_endpoint(&e).await;
    let newest = seen.last().cloned().expect("a rotation");
    let deadline = Instant::now() + DEADLINE;
    loop {
        assert!(Instant::now() < deadline, "no rotation after the restart");
        let files = log_files(&log);
        assert!(files.len() <= MAX_FILES, "{files:?}");
        let later = files.iter().any(|f| {
            let n = f
                .file_name()
                .expect("a name")
                .to_string_lossy()
                .into_owned();
            n.starts_with("0.log.")
                && n.trim_start_matches("0.log.").trim_end_matches(".gz") > newest.as_str()
        });
        if later {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let all: Vec<u64> = log_snapshot(&log)
        .await
        .iter()
        .flat_map(|(_, t)| numbered(t))
        .collect();
    consecutive("the kept files after the restart", &all);
    check_kubectl(&e).await;

    // A restart of the container: --previous reads its last live file.
    let id = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .expect("statuses")[0]
        .container_id
        .clone()
        .expect("an id");
    let pid = find_container_pid(id.split_once("://").expect("runtime://id").1).expect("its pid");
    // SAFETY: kill(2) of the container's own process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    e.wait_api("rotator", "restarted", restarted_once_and_running)
        .await;
    let previous = std::fs::read_to_string(&log).expect("the previous attempt's live file");
    let want: Vec<String> = numbered(&previous)
        .iter()
        .map(|n| format!("line {n}"))
        .collect();
    assert!(!want.is_empty());
    let got = kubectl_ok(&e, &["logs", "rotator", "--previous"]);
    assert_eq!(
        got.lines().collect::<Vec<_>>(),
        want,
        "--previous is the last live file"
    );
    e.finish().await;
}

/// The pod's first container restarted once and runs again.
fn restarted_once_and_running(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .is_some_and(|cs| {
            cs[0].restart_count == 1 && cs[0].state.as_ref().is_some_and(|s| s.running.is_some())
        })
}
