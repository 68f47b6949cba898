use super::*;
use std::sync::Arc;

/// Tokens `good-<name>` are user `<name>`; `<name>` may do what `allowed`
/// lists; `fail` fails every review.
#[derive(Debug, Default)]
struct Fake {
    allowed: Mutex<Vec<(String, &'static str)>>,
    fail: std::sync::atomic::AtomicBool,
}

impl Reviewer for Arc<Fake> {
    async fn token_review(&self, token: &str) -> Result<Option<User>, String> {
        if self.fail.load(Ordering::Relaxed) {
            return Err("connection refused".into());
        }
        Ok(token.strip_prefix("good-").map(|name| User {
            name: name.into(),
            groups: vec!["team".into()],
            ..User::default()
        }))
    }

    async fn access_review(
        &self,
        user: &User,
        node: &str,
        attrs: &Attributes,
    ) -> Result<bool, String> {
        if self.fail.load(Ordering::Relaxed) {
            return Err("connection refused".into());
        }
        assert_eq!(node, "n1");
        let allowed = self.allowed.lock().unwrap();
        Ok(allowed
            .iter()
            .any(|(u, s)| *u == user.name && *s == attrs.subresource))
    }
}

fn config(anonymous: bool) -> AuthConfig {
    AuthConfig {
        node_name: "n1".into(),
        anonymous,
        token_webhook: true,
        token_ttl: TOKEN_TTL,
        mode: AuthzMode::Webhook,
        authorized_ttl: AUTHORIZED_TTL,
        unauthorized_ttl: UNAUTHORIZED_TTL,
    }
}

#[test]
fn paths_map_to_the_kubelet_s_subresources() {
    let subs = |m, p| {
        attributes(m, p)
            .into_iter()
            .map(|a| (a.verb, a.subresource))
            .collect::<Vec<_>>()
    };
    assert_eq!(subs("GET", "/stats/summary"), [("get", "stats")]);
    assert_eq!(subs("GET", "/metrics/resource"), [("get", "metrics")]);
    assert_eq!(subs("GET", "/logs/syslog"), [("get", "log")]);
    assert_eq!(subs("GET", "/pods"), [("get", "pods"), ("get", "proxy")]);
    assert_eq!(
        subs("GET", "/healthz"),
        [("get", "healthz"), ("get", "proxy")]
    );
    assert_eq!(subs("GET", "/containerLogs/ns/p/c"), [("get", "proxy")]);
    assert_eq!(subs("POST", "/exec/ns/p/c"), [("create", "proxy")]);
    // A prefix is not a parent path.
    assert_eq!(subs("GET", "/statsfoo"), [("get", "proxy")]);
    assert_eq!(subs("DELETE", "/x"), [("delete", "proxy")]);
}

#[tokio::test]
async fn certificates_tokens_and_anonymous_authenticate_as_the_kubelet_s() {
    let fake = Arc::new(Fake::default());
    let auth = Auth::new(config(false), Some(fake.clone()));
    let cert = User {
        name: "kube-apiserver-kubelet-client".into(),
        groups: vec!["system:masters".into()],
        ..User::default()
    };
    let u = auth
        .authenticate(Some(&cert), Some("Bearer good-x"))
        .await
        .unwrap();
    assert_eq!(
        u.name, "kube-apiserver-kubelet-client",
        "the certificate first"
    );
    assert_eq!(u.groups, ["system:masters", "system:authenticated"]);
    let u = auth
        .authenticate(None, Some("Bearer good-alice"))
        .await
        .unwrap();
    assert_eq!((u.name.as_str(), u.groups.len()), ("alice", 2));
    assert!(matches!(
        auth.authenticate(None, Some("Bearer bad")).await,
        Err(AuthError::Unauthenticated)
    ));
    assert!(matches!(
        auth.authenticate(None, None).await,
        Err(AuthError::Unauthenticated)
    ));
    let open = Auth::new(config(true), Some(fake.clone()));
    assert_eq!(
        open.authenticate(None, None).await.unwrap(),
        User::anonymous()
    );
    // A bad token is not anonymous.
    assert!(open.authenticate(None, Some("Bearer bad")).await.is_err());
    fake.fail.store(true, Ordering::Relaxed);
    assert!(matches!(
        auth.authenticate(None, Some("Bearer good-bob")).await,
        Err(AuthError::TokenReview(_))
    ));
}

#[tokio::test(start_paused = true)]
async fn token_reviews_are_cached_for_the_kubelet_s_ttl() {
    let fake = Arc::new(Fake::default());
    let auth = Auth::new(config(false), Some(fake.clone()));
    let reviews = || auth.counts.token_reviews.load(Ordering::Relaxed);
    auth.authenticate(None, Some("Bearer good-a"))
        .await
        .unwrap();
    auth.authenticate(None, Some("Bearer bad"))
        .await
        .unwrap_err();
    assert_eq!(reviews(), 2);
    tokio::time::advance(TOKEN_TTL - Duration::from_secs(1)).await;
    auth.authenticate(None, Some("Bearer good-a"))
        .await
        .unwrap();
    auth.authenticate(None, Some("Bearer bad"))
        .await
        .unwrap_err();
    assert_eq!(reviews(), 2, "both answers cached");
    tokio::time::advance(Duration::from_secs(2)).await;
    auth.authenticate(None, Some("Bearer good-a"))
        .await
        .unwrap();
    assert_eq!(reviews(), 3, "asked again past the ttl");
}

#[tokio::test(start_paused = true)]
async fn access_reviews_are_cached_5m_when_allowed_and_30s_when_denied() {
    let fake = Arc::new(Fake::default());
    let auth = Auth::new(config(false), Some(fake.clone()));
    let reviews = || auth.counts.access_reviews.load(Ordering::Relaxed);
    let alice = User {
        name: "alice".into(),
        ..User::default()
    };
    let err = auth
        .authorize(&alice, "GET", "/containerLogs/a/b/c")
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "Forbidden (user=alice, verb=get, resource=nodes, subresource(s)=[proxy])"
    );
    assert_eq!(reviews(), 1);
    fake.allowed.lock().unwrap().push(("alice".into(), "proxy"));
    tokio::time::advance(UNAUTHORIZED_TTL - Duration::from_secs(1)).await;
    assert!(
        auth.authorize(&alice, "GET", "/containerLogs/a/b/c")
            .await
            .is_err(),
        "denial cached"
    );
    tokio::time::advance(Duration::from_secs(2)).await;
    auth.authorize(&alice, "GET", "/containerLogs/a/b/c")
        .await
        .unwrap();
    assert_eq!(reviews(), 2);
    fake.allowed.lock().unwrap().clear();
    tokio::time::advance(AUTHORIZED_TTL - Duration::from_secs(1)).await;
    auth.authorize(&alice, "GET", "/containerLogs/a/b/c")
        .await
        .unwrap();
    assert_eq!(reviews(), 2, "allowance cached");
    tokio::time::advance(Duration::from_secs(2)).await;
    assert!(
        auth.authorize(&alice, "GET", "/containerLogs/a/b/c")
            .await
            .is_err()
    );
    // /pods: pods denied, then proxy asked (past the denial's 30 s).
    fake.allowed.lock().unwrap().push(("alice".into(), "proxy"));
    tokio::time::advance(UNAUTHORIZED_TTL).await;
    auth.authorize(&alice, "GET", "/pods").await.unwrap();
    let err = auth
        .authorize(&User::anonymous(), "GET", "/pods")
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "Forbidden (user=system:anonymous, verb=get, resource=nodes, subresource(s)=[pods proxy])"
    );
    fake.fail.store(true, Ordering::Relaxed);
    assert!(matches!(
        auth.authorize(&User::anonymous(), "GET", "/stats/summary")
            .await,
        Err(AuthError::Review { .. })
    ));
    let always = Auth::<Arc<Fake>>::new(
        AuthConfig {
            mode: AuthzMode::AlwaysAllow,
            ..config(false)
        },
        None,
    );
    always
        .authorize(&User::anonymous(), "POST", "/exec/a/b/c")
        .await
        .unwrap();
}
