use super::*;

fn keyring(auths: serde_json::Value) -> Keyring {
    let mut kr = Keyring::default();
    kr.add(parse_config(&auths).unwrap()).unwrap();
    kr
}

fn users(creds: &[Credential]) -> Vec<&str> {
    creds.iter().map(|c| c.username.as_str()).collect()
}

/// The kubelet's keyring tests (`keyring_test.go`: `TestURLsMatch`,
/// `TestDockerKeyringForGlob`, `TestKeyringMiss`, `TestDockerKeyringLookup`)
/// as one table: key, image, whether the key's credentials apply.
#[test]
fn registries_match_as_the_kubelet_s_keyring() {
    let cases = [
        // Host only: any repository of the host, the same port.
        ("registry.example.com", "registry.example.com/app", true),
        (
            "https://registry.example.com",
            "registry.example.com/a/b:v1",
            true,
        ),
        (
            "http://registry.example.com/",
            "registry.example.com/app",
            true,
        ),
        (
            "registry.example.com",
            "registry.example.com:5000/app",
            false,
        ),
        (
            "registry.example.com:5000",
            "registry.example.com:5000/app",
            true,
        ),
        (
            "registry.example.com:5000",
            "registry.example.com/app",
            false,
        ),
        (
            "registry.example.com:5000",
            "registry.example.com:5001/app",
            false,
        ),
        ("127.0.0.1:5000", "127.0.0.1:5000/evpleg/busybox:v1", true),
        ("127.0.0.1", "127.0.0.1:5000/evpleg/busybox:v1", false),
        // The path is a prefix of the repository's.
        (
            "registry.example.com/team",
            "registry.example.com/team/app",
            true,
        ),
        (
            "registry.example.com/team",
            "registry.example.com/other/app",
            false,
        ),
        (
            "registry.example.com/team/",
            "registry.example.com/team/app",
            true,
        ),
        // /v1/ and /v2/ are the host itself.
        (
            "https://registry.example.com/v2/",
            "registry.example.com/app",
            true,
        ),
        (
            "registry.example.com/v1/team",
            "registry.example.com/team/app",
            true,
        ),
        (
            "registry.example.com/v1/team",
            "registry.example.com/v1/team/app",
            false,
        ),
        // Globs per host label, the same number of labels.
        ("*.example.com", "registry.example.com/app", true),
        ("*.example.com", "example.com/app", false),
        ("*.example.com", "a.registry.example.com/app", false),
        ("*.*.example.com", "a.registry.example.com/app", true),
        ("reg?stry.example.com", "registry.example.com/app", true),
        ("reg[a-j]stry.example.com", "registry.example.com/app", true),
        ("reg[^i]stry.example.com", "registry.example.com/app", false),
        ("*.example.com:5000", "registry.example.com:5000/app", true),
        ("*.example.com", "registry.example.org/app", false),
        // Short names are Docker Hub's.
        ("docker.io", "busybox", true),
        ("docker.io/library", "busybox:1.36", true),
        ("docker.io/someone", "someone/app", true),
        ("docker.io/someone", "busybox", false),
        ("localhost:5000", "localhost:5000/app", true),
        // Docker Hub's own key serves Hub images only.
        ("https://index.docker.io/v1/", "busybox", true),
        (
            "https://index.docker.io/v1/",
            "someone/app@sha256:abcd",
            true,
        ),
        ("https://index.docker.io/v1/", "quay.io/someone/app", false),
        ("https://index.docker.io/v1/", "localhost:5000/app", false),
    ];
    for (key, image, want) in cases {
        let kr = keyring(serde_json::json!({ key: {"username": "u", "password": "p"} }));
        assert_eq!(
            !kr.lookup(image).is_empty(),
            want,
            "key {key:?}, image {image:?}"
        );
    }
}

/// The most specific key's credentials come first, then the others that
/// match, each key's in turn; a non-matching key's never.
#[test]
fn the_most_specific_match_comes_first() {
    let kr = keyring(serde_json::json!({
        "quay.io": {"username": "host"},
        "quay.io/coreos": {"username": "namespace"},
        "quay.io/coreos/etcd": {"username": "repo"},
        "*.quay.io": {"username": "glob"},
        "quay.io/other": {"username": "other"},
    }));
    assert_eq!(
        users(&kr.lookup("quay.io/coreos/etcd:v3")),
        ["repo", "namespace", "host"]
    );
    assert_eq!(
        users(&kr.lookup("quay.io/coreos/flannel")),
        ["namespace", "host"]
    );
    assert_eq!(users(&kr.lookup("eu.quay.io/coreos/etcd")), ["glob"]);
    assert!(kr.lookup("gcr.io/coreos/etcd").is_empty());
    // Two secrets naming the same registry: both, in the order added.
    let mut kr = keyring(serde_json::json!({"r.io": {"username": "first"}}));
    kr.add(parse_config(&serde_json::json!({"https://r.io/": {"username": "second"}})).unwrap())
        .unwrap();
    assert_eq!(users(&kr.lookup("r.io/app")), ["first", "second"]);
}

fn secret(type_: &str, key: &str, value: &serde_json::Value) -> Secret {
    let mut s = Secret {
        type_: Some(type_.to_owned()),
        ..Default::default()
    };
    s.metadata.name = Some("pull".into());
    s.metadata.namespace = Some("ns".into());
    s.data = Some(
        [(
            key.to_owned(),
            k8s_openapi::ByteString(value.to_string().into_bytes()),
        )]
        .into(),
    );
    s
}

/// Both secret types are read; `auth` wins over username/password; other
/// types (or the right key in the wrong type) give nothing; bad JSON or a
/// bad `auth` is an error naming the secret or the registry.
#[test]
fn both_secret_types_give_credentials() {
    // "alice:s3cret" in base64.
    let json = secret(
        DOCKER_CONFIG_JSON_TYPE,
        DOCKER_CONFIG_JSON_KEY,
        &serde_json::json!({"auths": {"r.io": {"username": "x", "password": "y", "auth": "YWxpY2U6czNjcmV0"}}}),
    );
    let cfg = secret(
        DOCKERCFG_TYPE,
        DOCKERCFG_KEY,
        &serde_json::json!({"old.io": {"username": "bob", "password": "pw", "email": "b@o.b"}}),
    );
    let opaque = secret(
        "Opaque",
        DOCKER_CONFIG_JSON_KEY,
        &serde_json::json!({"auths": {"r.io": {"username": "mallory"}}}),
    );
    let kr = Keyring::from_secrets(&[json, cfg, opaque]).unwrap();
    assert_eq!(
        kr.lookup("r.io/app"),
        [Credential {
            username: "alice".into(),
            password: "s3cret".into()
        }]
    );
    assert_eq!(
        kr.lookup("old.io/app")[0].auth_config(),
        v1::AuthConfig {
            username: "bob".into(),
            password: "pw".into(),
            ..Default::default()
        }
    );
    let bad = secret(
        DOCKERCFG_TYPE,
        DOCKERCFG_KEY,
        &serde_json::json!(["not", "a", "map"]),
    );
    let e = Keyring::from_secrets(&[bad]).unwrap_err();
    assert!(
        e.to_string() == "secret ns/pull: cannot parse .dockercfg: not a JSON object of registries",
        "{e}"
    );
    let bad_auth = secret(
        DOCKERCFG_TYPE,
        DOCKERCFG_KEY,
        &serde_json::json!({"r.io": {"auth": "bm8tY29sb24="}}),
    );
    assert_eq!(
        Keyring::from_secrets(&[bad_auth]).unwrap_err(),
        CredentialError::Auth {
            registry: "r.io".into()
        }
    );
}

#[test]
fn image_names_normalise_as_the_kubelet_s_parse_image_name() {
    for (image, repo) in [
        ("busybox", "docker.io/library/busybox"),
        ("busybox:1.36", "docker.io/library/busybox"),
        ("someone/app:v1", "docker.io/someone/app"),
        ("docker.io/someone/app", "docker.io/someone/app"),
        ("localhost/app", "localhost/app"),
        (
            "127.0.0.1:5000/evpleg/busybox:v1",
            "127.0.0.1:5000/evpleg/busybox",
        ),
        ("quay.io/a/b@sha256:abcd", "quay.io/a/b"),
        ("quay.io/a/b:v1@sha256:abcd", "quay.io/a/b"),
    ] {
        assert_eq!(repository(image), repo, "{image}");
    }
}
