//! The kubelet's authenticated server (issue #28) end to end: the whole agent
//! against the real containerd and the real kube-apiserver, its server on a
//! free port on loopback with the control plane's CA as `--client-ca-file`.
//! Requests made straight to it (with a token, the admin's client
//! certificate, nothing) are authenticated and authorized by the API server
//! (TokenReview, SubjectAccessReview, read back from its audit log); the real
//! `kubectl logs` reaches it through the API server, which finds it by the
//! Node's InternalIP and daemonEndpoints. Privileged: skipped with a reason
//! without root/BTF/the eBPF object, the control plane's binaries or kubectl,
//! a failure under `CI=true`.
//!
//! Every wait is bounded; nothing sleeps to synchronise.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use evpleg_tests::e2e::*;
use evpleg_tests::privileged;
use http_body_util::{BodyExt, Empty};
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Node, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::Api;
use kube::api::PostParams;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

/// Whether the test can run here.
fn real(test: &str) -> bool {
    if !privileged(test) || !evpleg_tests::control_plane::available(test) {
        return false;
    }
    if let Err(e) = evpleg_tests::go_tools::binary("kubectl") {
        evpleg_tests::skip(test, &e.to_string());
        return false;
    }
    true
}

/// The agent with its kubelet server on a free loopback port (the harness's
/// `--port 0 --address 127.0.0.1`), client certificates checked against the
/// control plane's CA.
async fn start(name: &str) -> E2e {
    let cp = evpleg_tests::control_plane::ControlPlane::shared().await;
    let ca = cp.ca().display().to_string();
    E2e::start_with_control_plane(name, &["--node-ip", "127.0.0.1", "--client-ca-file", &ca]).await
}

/// Accepts exactly the agent's certificate.
#[derive(Debug)]
struct Pinned(CertificateDer<'static>);

impl rustls::client::danger::ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        if end_entity.as_ref() == self.0.as_ref() {
            Ok(rustls::client::danger::ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General("not the agent's certificate".into()))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &rustls::crypto::ring::default_provider().signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &rustls::crypto::ring::default_provider().signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// How a request to the kubelet server authenticates.
enum Cred<'a> {
    None,
    Token(&'a str),
    /// A client certificate and its key (PEM files).
    Cert(&'a Path, &'a Path),
}

/// `GET path` on the agent's kubelet server: its status and body.
async fn get(e: &E2e, path: &str, cred: Cred<'_>) -> (u16, String) {
    let addr = e.agent().kubelet_addr.expect("the kubelet server runs");
    let pinned = CertificateDer::from_pem_file(e.args.root_dir.join("pki/kubelet.crt"))
        .expect("the agent's self-signed certificate in <root-dir>/pki");
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("tls versions")
    .dangerous()
    .with_custom_certificate_verifier(Arc::new(Pinned(pinned)));
    let config = match &cred {
        Cred::Cert(cert, key) => builder
            .with_client_auth_cert(
                CertificateDer::pem_file_iter(cert)
                    .expect("cert")
                    .collect::<Result<Vec<_>, _>>()
                    .expect("cert"),
                PrivateKeyDer::from_pem_file(key).expect("key"),
            )
            .expect("client auth"),
        _ => builder.with_no_client_auth(),
    };
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("kubelet").expect("a name"), tcp)
        .await
        .expect("tls handshake");
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .expect("http handshake");
    tokio::spawn(conn);
    let mut req = hyper::Request::get(path).header("host", "kubelet");
    if let Cred::Token(t) = cred {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let resp = tokio::time::timeout(
        DEADLINE,
        sender.send_request(req.body(Empty::<Bytes>::new()).expect("a request")),
    )
    .await
    .expect("an answer in time")
    .expect("an answer");
    let code = resp.status().as_u16();
    let body = tokio::time::timeout(DEADLINE, resp.into_body().collect())
        .await
        .expect("the body in time")
        .expect("the body")
        .to_bytes();
    (code, String::from_utf8_lossy(&body).into_owned())
}

/// A token of service account `ns/name` (made now), from TokenRequest.
async fn token(client: &kube::Client, ns: &str, name: &str) -> String {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    let account: ServiceAccount =
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))
            .expect("an account");
    accounts
        .create(&PostParams::default(), &account)
        .await
        .expect("create the service account");
    let request: TokenRequest =
        serde_json::from_value(serde_json::json!({"spec": {"audiences": []}})).expect("a request");
    let answer: TokenRequest = accounts
        .create_subresource("token", name, &PostParams::default(), &request)
        .await
        .expect("TokenRequest");
    answer.status.expect("a token").token
}

/// Lets service account `ns/name` get `nodes/proxy`.
async fn grant_node_proxy(client: &kube::Client, ns: &str, name: &str) {
    let role: ClusterRole = serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("{ns}-node-proxy")},
        "rules": [{"apiGroups": [""], "resources": ["nodes/proxy"], "verbs": ["get"]}],
    }))
    .expect("a role");
    Api::<ClusterRole>::all(client.clone())
        .create(&PostParams::default(), &role)
        .await
        .expect("create the cluster role");
    let binding: ClusterRoleBinding = serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("{ns}-node-proxy")},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": format!("{ns}-node-proxy")},
        "subjects": [{"kind": "ServiceAccount", "namespace": ns, "name": name}],
    }))
    .expect("a binding");
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&PostParams::default(), &binding)
        .await
        .expect("create the cluster role binding");
}

/// Waits until pod `default/name` runs.
async fn running(e: &E2e, name: &str) -> Pod {
    e.wait_api(name, "running", |p| {
        p.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .is_some_and(|cs| {
                cs.iter()
                    .all(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
            })
    })
    .await
}

/// The admin's client certificate and key (system:masters).
fn admin_cert(e: &E2e) -> (PathBuf, PathBuf) {
    let pki = e.cp().dir().join("pki");
    (pki.join("admin.crt"), pki.join("admin.key"))
}

/// SubjectAccessReviews the agent asked for `user` on `nodes/<sub>`.
fn access_reviews(e: &E2e, user: &str, sub: &str) -> usize {
    e.cp()
        .audit()
        .into_iter()
        .filter(|r| r.user == format!("system:node:{NODE}") && r.verb == "create")
        .filter(|r| r.path() == "/apis/authorization.k8s.io/v1/subjectaccessreviews")
        .filter(|r| {
            r.body.as_ref().is_some_and(|b| {
                b["spec"]["user"] == user && b["spec"]["resourceAttributes"]["subresource"] == sub
            })
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubelet_server_authenticates_and_authorizes_through_the_api_server() {
    let name = "the_kubelet_server_authenticates_and_authorizes_through_the_api_server";
    if !real(name) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = start("kubelet_api_auth").await;
    e.create_pod(&api_pod(
        "talker",
        "Always",
        "echo hello from talker; exec sleep 600",
    ))
    .await;
    running(&e, "talker").await;
    let admin = e.kube().await;
    let ns = e.cp().namespace("kapi").await;
    let denied = token(&admin, &ns, "reader").await;
    let allowed = token(&admin, &ns, "proxier").await;
    grant_node_proxy(&admin, &ns, "proxier").await;
    let logs = "/containerLogs/default/talker/app";

    // Nothing: 401 (anonymous requests are refused by default), on every path.
    assert_eq!(
        get(&e, logs, Cred::None).await,
        (401, "Unauthorized".into())
    );
    assert_eq!(get(&e, "/healthz", Cred::None).await.0, 401);
    // A token the API server does not know: 401.
    assert_eq!(get(&e, logs, Cred::Token("not-a-token")).await.0, 401);
    // A valid token without nodes/proxy: 403, naming what it lacks.
    let reader = format!("system:serviceaccount:{ns}:reader");
    assert_eq!(
        get(&e, logs, Cred::Token(&denied)).await,
        (
            403,
            format!(
                "Forbidden (user={reader}, verb=get, resource=nodes, subresource(s)=[proxy])\n"
            )
        )
    );
    assert_eq!(get(&e, "/pods", Cred::Token(&denied)).await.0, 403);
    // With nodes/proxy: the logs.
    let proxier = format!("system:serviceaccount:{ns}:proxier");
    assert_eq!(
        get(&e, logs, Cred::Token(&allowed)).await,
        (200, "hello from talker\n".into())
    );
    // /pods: pods denied, proxy allowed.
    let (code, body) = get(&e, "/pods", Cred::Token(&allowed)).await;
    assert_eq!(code, 200);
    assert!(body.contains("\"talker\""), "{body}");
    // The admin's client certificate (system:masters): no token review.
    let (cert, key) = admin_cert(&e);
    assert_eq!(
        get(&e, logs, Cred::Cert(&cert, &key)).await,
        (200, "hello from talker\n".into())
    );
    // Cached: again, no new review (a denial for 30 s, an allowance for 5 min).
    let api = e.agent().kubelet_api.clone().expect("the kubelet server");
    let before = (
        api.auth
            .counts
            .token_reviews
            .load(std::sync::atomic::Ordering::Relaxed),
        access_reviews(&e, &reader, "proxy"),
        access_reviews(&e, &proxier, "proxy"),
    );
    assert_eq!(
        before.1, 1,
        "/pods' fallback to proxy was answered by the logs' cached denial"
    );
    assert_eq!(access_reviews(&e, &reader, "pods"), 1);
    assert_eq!(get(&e, logs, Cred::Token(&denied)).await.0, 403);
    assert_eq!(get(&e, logs, Cred::Token(&allowed)).await.0, 200);
    let after = (
        api.auth
            .counts
            .token_reviews
            .load(std::sync::atomic::Ordering::Relaxed),
        access_reviews(&e, &reader, "proxy"),
        access_reviews(&e, &proxier, "proxy"),
    );
    assert_eq!(before, after, "answered from the caches");
    // The agent reviewed as the node, and the API server let it.
    assert_eq!(e.cp().refused(&format!("system:node:{NODE}")).len(), 0);
    e.finish().await;
}

/// The Node says where the kubelet server is and what the node is.
async fn wait_node_endpoint(e: &E2e) -> Node {
    let port = i32::from(e.agent().kubelet_addr.expect("serving").port());
    wait_object(
        &Api::<Node>::all(e.kube().await),
        NODE,
        "its kubelet endpoint",
        |n| {
            n.and_then(|n| n.status.as_ref())
                .and_then(|s| s.daemon_endpoints.as_ref())
                .and_then(|d| d.kubelet_endpoint.as_ref())
                .is_some_and(|k| k.port == port)
        },
    )
    .await
    .expect("the node")
}

/// `kubectl <args>` as the admin: its exit status, stdout and stderr.
fn kubectl(e: &E2e, args: &[&str]) -> (bool, String, String) {
    let out =
        std::process::Command::new(evpleg_tests::go_tools::binary("kubectl").expect("kubectl"))
            .arg("--kubeconfig")
            .arg(e.cp().admin_kubeconfig())
            .args(["--request-timeout", "30s", "-n", "default"])
            .args(args)
            .output()
            .expect("run kubectl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn kubectl_ok(e: &E2e, args: &[&str]) -> String {
    let (ok, out, err) = kubectl(e, args);
    assert!(ok, "kubectl {args:?} failed: {err}");
    out
}

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
    e.wait_api("restarter", "restarted once and running", |p| {
        p.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .is_some_and(|cs| {
                cs[0].restart_count == 1
                    && cs[0].state.as_ref().is_some_and(|s| s.running.is_some())
            })
    })
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
    // Written before now: nothing since now.
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
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
        code("/containerLogs/default/fixed/app?tailLines=-1")
            .await
            .0,
        422
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
