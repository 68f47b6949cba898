//! `/exec`, `/attach`, `/portForward` and `/run`, through `kubectl` and the
//! API server (SPDY and WebSocket upgrades proxied to the runtime's
//! streaming server).

use super::*;

/// `kubectl <args>` as the admin, `input` on its stdin: its exit code,
/// stdout and stderr.
fn kubectl_with_input(e: &E2e, args: &[&str], input: &[u8]) -> (Option<i32>, String, String) {
    use std::io::Write;
    let mut child =
        std::process::Command::new(evpleg_tests::go_tools::binary("kubectl").expect("kubectl"))
            .arg("--kubeconfig")
            .arg(e.cp().admin_kubeconfig())
            .args(["--request-timeout", "30s", "-n", "default"])
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run kubectl");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(input).expect("write kubectl's stdin");
    drop(stdin);
    let out = child.wait_with_output().expect("kubectl's output");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A long-running `kubectl <args>` as the admin, killed when dropped.
fn kubectl_spawn(e: &E2e, args: &[&str]) -> tokio::process::Child {
    tokio::process::Command::new(evpleg_tests::go_tools::binary("kubectl").expect("kubectl"))
        .arg("--kubeconfig")
        .arg(e.cp().admin_kubeconfig())
        .args(["-n", "default"])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn kubectl")
}

/// Waits until the agent proxies no streaming session.
async fn no_open_streams(e: &E2e, what: &str) {
    let api = e.agent().kubelet_api.clone().expect("the kubelet server");
    let deadline = Instant::now() + DEADLINE;
    while api.streams.open() != 0 {
        assert!(Instant::now() < deadline, "{what}: the session outlived it");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `cat` processes in the cgroups of container `id` (any hierarchy).
fn cats_in(id: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|p| p.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c == "cat\n")
        })
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
                .is_ok_and(|cg| cg.lines().any(|l| l.ends_with(id)))
        })
        .collect()
}

/// A free TCP port on the host (the pods share its network).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_exec_attach_and_port_forward_reach_the_agent_through_the_api_server() {
    let name = "kubectl_exec_attach_and_port_forward_reach_the_agent_through_the_api_server";
    if !real(name) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = start("kubelet_api_streaming").await;
    wait_node_endpoint(&e).await;
    let port = free_port();
    // A pod bound to another node, created before the ones that run here:
    // in the API server, never among the agent's pods.
    let mut elsewhere = api_pod("elsewhere", "Always", "exec sleep 600");
    elsewhere.spec.as_mut().expect("spec").node_name = Some("another-node".into());
    e.create_pod(&elsewhere).await;
    e.create_pod(&api_pod("shell", "Always", "exec sleep 600"))
        .await;
    e.create_pod(&api_pod(
        "ticker",
        "Always",
        "i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.2; done",
    ))
    .await;
    // Greets each connection, then echoes it.
    e.create_pod(&api_pod(
        "echo",
        "Always",
        &format!(
            "printf '#!/bin/sh\\necho hello from the pod\\nexec cat\\n' > /tmp/serve; \
             chmod +x /tmp/serve; exec nc -ll -p {port} -e /tmp/serve"
        ),
    ))
    .await;
    let shell = running(&e, "shell").await;
    for pod in ["ticker", "echo"] {
        running(&e, pod).await;
    }
    let api = e.agent().kubelet_api.clone().expect("the kubelet server");

    // exec: a command, its output and its exit code.
    let (code, out, err) = kubectl_with_input(
        &e,
        &[
            "exec",
            "shell",
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; exit 3",
        ],
        b"",
    );
    assert_eq!((code, out.as_str()), (Some(3), "out\n"), "{err}");
    assert!(err.contains("err\n"), "{err}");
    // exec with stdin.
    let (code, out, err) = kubectl_with_input(
        &e,
        &["exec", "-i", "shell", "--", "sh", "-c", "tr a-z A-Z"],
        b"piped through the pod\n",
    );
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "PIPED THROUGH THE POD\n"),
        "{err}"
    );
    // exec with a TTY: kubectl under `script`, which gives it a terminal,
    // sized 33x101 here; kubectl sends that size on, which the runtime
    // applies once the command runs (as with the kubelet): the command waits
    // for it (bounded; busybox's `stty size`, its output redirected, exits 0
    // without a size: its output is the test), then prints it.
    let kubectl = evpleg_tests::go_tools::binary("kubectl").expect("kubectl");
    let line = format!(
        "stty rows 33 cols 101; exec {} --kubeconfig {} -n default exec -it shell -- sh -c \
         'tty; i=0; until [ -n \"$(stty size 2>/dev/null)\" ] || [ $i -ge 100 ]; do sleep 0.05; i=$((i+1)); done; stty size'",
        kubectl.display(),
        e.cp().admin_kubeconfig().display()
    );
    let mut script = tokio::process::Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run script");
    // Open until script ends (its end of input would reach the terminal).
    let script_stdin = script.stdin.take().expect("stdin");
    let tty = tokio::time::timeout(DEADLINE, script.wait_with_output())
        .await
        .expect("kubectl exec -it within the deadline")
        .expect("script's output");
    drop(script_stdin);
    let text = String::from_utf8_lossy(&tty.stdout).into_owned();
    // `tty`'s line then `stty size`'s "<rows> <columns>", the terminal's CRLFs.
    let lines: Vec<&str> = text.lines().map(|l| l.trim_end_matches('\r')).collect();
    assert_eq!(tty.status.code(), Some(0), "{text:?}");
    assert!(
        matches!(lines[..], [pts, "33 101"] if pts.starts_with("/dev/pts/")),
        "a terminal of kubectl's size in the container: {text:?}"
    );
    no_open_streams(&e, "exec").await;

    // exec dropped mid-way: `cat` runs, its stdin held open here, and
    // kubectl is killed; the session ends, and `cat` with it.
    let shell_id = shell
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs[0].container_id.clone())
        .expect("the container's id");
    let shell_id = shell_id.split_once("://").expect("runtime://id").1;
    let mut dropped = tokio::process::Command::new(&kubectl)
        .arg("--kubeconfig")
        .arg(e.cp().admin_kubeconfig())
        .args(["-n", "default", "exec", "-i", "shell", "--", "cat"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn kubectl exec");
    let mut stdin = dropped.stdin.take().expect("stdin");
    let deadline = Instant::now() + DEADLINE;
    while api.streams.open() != 1 {
        assert!(Instant::now() < deadline, "the exec session never opened");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::io::AsyncWriteExt::write_all(&mut stdin, b"through cat\n")
        .await
        .expect("write kubectl's stdin");
    let mut out = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(
        dropped.stdout.take().expect("stdout"),
    ));
    let echoed = tokio::time::timeout(DEADLINE, out.next_line())
        .await
        .expect("cat's line within the deadline")
        .expect("read")
        .expect("a line");
    assert_eq!(echoed, "through cat");
    let cats = cats_in(shell_id);
    assert_eq!(cats.len(), 1, "the exec's cat in the container: {cats:?}");
    dropped.kill().await.expect("kill kubectl exec");
    no_open_streams(&e, "kubectl exec killed").await;
    let deadline = Instant::now() + DEADLINE;
    loop {
        let left = cats_in(shell_id);
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the exec's cat outlived its session: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(stdin);

    // attach: the running container's output; the session ends with the
    // client killed mid-way.
    let mut attach = kubectl_spawn(&e, &["attach", "ticker"]);
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(
        attach.stdout.take().expect("stdout"),
    ));
    for _ in 0..3 {
        let line = tokio::time::timeout(DEADLINE, lines.next_line())
            .await
            .expect("a line within the deadline")
            .expect("read")
            .expect("a line");
        assert!(line.starts_with("tick "), "{line}");
    }
    assert_eq!(api.streams.open(), 1, "one attach session");
    attach.kill().await.expect("kill kubectl attach");
    no_open_streams(&e, "kubectl attach killed").await;

    // port-forward: data both ways through the container's port.
    let mut forward = kubectl_spawn(&e, &["port-forward", "echo", &format!(":{port}")]);
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(
        forward.stdout.take().expect("stdout"),
    ));
    let line = tokio::time::timeout(DEADLINE, lines.next_line())
        .await
        .expect("kubectl port-forward says where within the deadline")
        .expect("read")
        .expect("a line");
    // "Forwarding from 127.0.0.1:<local> -> <port>"
    let local: u16 = line
        .strip_prefix("Forwarding from 127.0.0.1:")
        .and_then(|r| r.split_once(' '))
        .and_then(|(p, _)| p.parse().ok())
        .unwrap_or_else(|| panic!("not kubectl's forwarding line: {line:?}"));
    {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
        let conn = tokio::net::TcpStream::connect(("127.0.0.1", local))
            .await
            .expect("connect to the forwarded port");
        let (rx, mut tx) = conn.into_split();
        let mut rx = tokio::io::BufReader::new(rx).lines();
        let mut next = async || {
            tokio::time::timeout(DEADLINE, rx.next_line())
                .await
                .expect("a line within the deadline")
                .expect("read")
                .expect("a line")
        };
        assert_eq!(next().await, "hello from the pod");
        tx.write_all(b"ping from the client\n")
            .await
            .expect("write");
        assert_eq!(next().await, "ping from the client");
    }
    assert_eq!(api.streams.open(), 1, "one port-forward session");
    forward.kill().await.expect("kill kubectl port-forward");
    no_open_streams(&e, "kubectl port-forward killed").await;

    // /run: a command's output, without a stream.
    let (cert, key) = admin_cert(&e);
    let admin = || Cred::Cert(&cert, &key);
    assert_eq!(
        request(
            &e,
            "POST",
            "/run/default/shell/app?cmd=echo+ran+here",
            admin()
        )
        .await,
        (200, "ran here\n".into())
    );
    assert_eq!(
        request(&e, "POST", "/run/default/shell/app?cmd=false", admin()).await,
        (500, "command 'false' exited with 1: ".into())
    );

    // Bad input, with the kubelet's codes and texts.
    let exec = "?command=true&output=1";
    assert_eq!(
        get(&e, &format!("/exec/default/nope/app{exec}"), admin()).await,
        (404, "pod does not exist".into())
    );
    assert_eq!(
        get(&e, &format!("/attach/default/nope/app{exec}"), admin()).await,
        (404, "pod does not exist".into())
    );
    assert_eq!(
        get(&e, "/portForward/default/nope", admin()).await,
        (404, "pod does not exist".into())
    );
    // The pod of another node, still there, bound there: the same answers
    // as for a pod that does not exist (the kubelet's), nothing served.
    let bound = Api::<Pod>::namespaced(e.kube().await, "default")
        .get("elsewhere")
        .await
        .expect("the pod of another node");
    assert_eq!(
        bound.spec.and_then(|s| s.node_name).as_deref(),
        Some("another-node")
    );
    assert_eq!(
        get(&e, "/containerLogs/default/elsewhere/app", admin()).await,
        (404, r#"pod "elsewhere" does not exist"#.into())
    );
    for stream in ["exec", "attach"] {
        assert_eq!(
            request(
                &e,
                "POST",
                &format!("/{stream}/default/elsewhere/app{exec}"),
                admin()
            )
            .await,
            (404, "pod does not exist".into()),
            "{stream}"
        );
    }
    assert_eq!(
        request(&e, "POST", "/portForward/default/elsewhere", admin()).await,
        (404, "pod does not exist".into())
    );
    assert_eq!(
        get(&e, &format!("/exec/default/shell/nope{exec}"), admin()).await,
        (500, r#"container not found ("nope")"#.into())
    );
    assert_eq!(
        get(&e, "/exec/default/shell/app?command=true", admin()).await,
        (
            400,
            "you must specify at least 1 of stdin, stdout, stderr".into()
        )
    );
    assert_eq!(
        get(&e, &format!("/exec/default/shell/app{exec}"), admin()).await,
        (500, "Upgrade request required\n".into())
    );
    assert_eq!(
        request(&e, "GET", "/run/default/shell/app?cmd=true", admin())
            .await
            .0,
        405
    );

    // A token without nodes/proxy: 403 on exec.
    let ns = e.cp().namespace("kstream").await;
    let denied = token(&e.kube().await, &ns, "reader").await;
    assert_eq!(
        request(
            &e,
            "POST",
            &format!("/exec/default/shell/app{exec}"),
            Cred::Token(&denied)
        )
        .await,
        (
            403,
            format!(
                "Forbidden (user=system:serviceaccount:{ns}:reader, verb=create, resource=nodes, subresource(s)=[proxy])\n"
            )
        )
    );
    assert_eq!(api.streams.open(), 0);
    e.finish().await;
}
