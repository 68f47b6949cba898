//! The server's authentication and authorization: tokens through TokenReview,
//! client certificates against `--client-ca-file`, SubjectAccessReview per
//! verb and `nodes/<subresource>`, anonymous requests.

use super::*;

/// A client certificate (`O=system:masters`, `CN=intruder`) and its key,
/// signed by a CA made here (openssl), which the agent does not trust: PEM
/// files in `dir`.
fn foreign_cert(dir: &Path) -> (PathBuf, PathBuf) {
    std::fs::create_dir_all(dir).expect("a directory for the foreign CA");
    // No argument has a space.
    let openssl = |line: &str| {
        let out = std::process::Command::new("openssl")
            .current_dir(dir)
            .args(line.split(' '))
            .output()
            .expect("run openssl");
        assert!(
            out.status.success(),
            "openssl {line}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let ec = "-nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1";
    openssl(&format!(
        "req -x509 -days 1 {ec} -subj /CN=unrelated-ca -keyout ca.key -out ca.crt"
    ));
    openssl(&format!(
        "req -new {ec} -subj /O=system:masters/CN=intruder -keyout client.key -out client.csr"
    ));
    std::fs::write(
        dir.join("client.ext"),
        "extendedKeyUsage=clientAuth\nbasicConstraints=critical,CA:FALSE\n",
    )
    .expect("write the extensions");
    openssl(
        "x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 \
         -extfile client.ext -out client.crt",
    );
    (dir.join("client.crt"), dir.join("client.key"))
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
    // /configz: configz or proxy; the kubelet's document.
    assert_eq!(get(&e, "/configz", Cred::Token(&denied)).await.0, 403);
    let (code, body) = get(&e, "/configz", Cred::Token(&allowed)).await;
    assert_eq!(code, 200, "{body}");
    let config: serde_json::Value = serde_json::from_str(&body).expect("/configz is JSON");
    assert_eq!(
        config["kubeletconfig"]["authorization"]["mode"], "Webhook",
        "{body}"
    );
    assert_eq!(
        config["kubeletconfig"]["authentication"]["anonymous"]["enabled"], false,
        "{body}"
    );
    // The admin's client certificate (system:masters): no token review.
    let (cert, key) = admin_cert(&e);
    assert_eq!(
        get(&e, logs, Cred::Cert(&cert, &key)).await,
        (200, "hello from talker\n".into())
    );
    // Cached: again, no new review (a denial for 30 s, an allowance for 5 min).
    let api = e.agent().kubelet_api.clone().expect("the kubelet server");
    let reviews = || {
        (
            api.auth
                .counts
                .token_reviews
                .load(std::sync::atomic::Ordering::Relaxed),
            access_reviews(&e, &reader, "proxy"),
            access_reviews(&e, &proxier, "proxy"),
        )
    };
    let before = reviews();
    assert_eq!(
        before.1, 1,
        "/pods' fallback to proxy was answered by the logs' cached denial"
    );
    assert_eq!(access_reviews(&e, &reader, "pods"), 1);
    assert_eq!(get(&e, logs, Cred::Token(&denied)).await.0, 403);
    assert_eq!(get(&e, logs, Cred::Token(&allowed)).await.0, 200);
    assert_eq!(before, reviews(), "answered from the caches");
    // The read-only port's /metrics and /healthz, served here with
    // credentials (the admin's certificate): 200, the agent's metrics and
    // its health.
    let (code, body) = get(&e, "/metrics", Cred::Cert(&cert, &key)).await;
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains("# TYPE evpleg_pleg_relist_duration_seconds histogram\n")
            && body.ends_with("# EOF\n"),
        "not the agent's metrics: {body}"
    );
    assert_eq!(
        get(&e, "/healthz", Cred::Cert(&cert, &key)).await,
        (200, "ok\n".into())
    );
    // A client certificate of a CA the agent does not trust, though it
    // names system:masters: refused at the handshake (TLS 1.3: the server's
    // alert reaches the client at its first read), before any request.
    let (foreign, foreign_key) = foreign_cert(&e.args.root_dir.with_file_name("foreign-ca"));
    let refused = tokio::time::timeout(DEADLINE, async {
        let mut tls = connect(&e, &Cred::Cert(&foreign, &foreign_key)).await?;
        tokio::io::AsyncReadExt::read(&mut tls, &mut [0u8; 1]).await
    })
    .await
    .expect("the server refuses the certificate or waits for a request, within the deadline");
    assert_eq!(
        refused.map_err(|e| e.to_string()),
        Err("received fatal alert: UnknownCA".into()),
        "a certificate of an unknown CA"
    );
    // The agent reviewed as the node, and the API server let it.
    assert_eq!(e.cp().refused(&format!("system:node:{NODE}")).len(), 0);
    e.finish().await;
}
