//! Image pulls end to end (issue #10, "a real image registry"; docs/pod-lifecycle.md's
//! table "kubelet behaviour -> evpleg"): the whole agent against the real
//! containerd, which pulls from a private `docker-registry` on loopback holding
//! the busybox image as `evpleg/busybox:{v1,latest}` (tests/src/registry.rs).
//! Every pull is seen twice: in containerd's log (one `PullImage` line per
//! call) and in the registry's access log (one resolution of the tag per pull).
//! Privileged: skipped with a reason without root/BTF/the eBPF object, a
//! failure under `CI=true`.

use std::time::{Duration, Instant};

use evpleg_cri_api::v1;
use evpleg_tests::containerd::REGISTRY_MARKER;
use evpleg_tests::e2e::*;
use evpleg_tests::e2e_test;
use serde_json::Value;

/// A static pod whose containers each run `command` (`name`, image, pull
/// policy or none).
fn pod(
    name: &str,
    restart: &str,
    command: &str,
    containers: &[(&str, &str, Option<&str>)],
) -> String {
    let mut yaml = format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\nspec:\n  hostNetwork: true\n  restartPolicy: {restart}\n  terminationGracePeriodSeconds: 3\n  containers:\n"
    );
    for (c, image, policy) in containers {
        yaml.push_str(&format!(
            "    - name: {c}\n      image: {image}\n      command: [\"sh\", \"-c\", \"{command}\"]\n"
        ));
        if let Some(p) = policy {
            yaml.push_str(&format!("      imagePullPolicy: {p}\n"));
        }
    }
    yaml
}

/// `PullImage` calls of `image` that containerd finished (with an image or
/// an error), from its log.
fn runtime_pulls(e: &E2e, image: &str, outcome: &str) -> usize {
    e.runtime_log()
        .lines()
        .filter(|l| l.contains("PullImage") && l.contains(&format!("{image}\\\"")))
        .filter(|l| l.contains(outcome))
        .count()
}

const PULLED: &str = "returns image reference";
const FAILED: &str = "failed";

/// Containers named `name` that containerd created (its log records every
/// `CreateContainer`, also of containers removed since). The metadata is
/// printed `Name:app,` by containerd 1.x and `name:"app"` (the protobuf text
/// format, with a space it may add at random) by containerd 2.
fn creates(e: &E2e, name: &str) -> usize {
    let (one, two) = (format!("Name:{name},"), format!("name:\"{name}\""));
    e.runtime_log()
        .lines()
        .filter(|l| {
            l.contains("CreateContainer within sandbox") && l.contains("returns container id")
        })
        .map(|l| l.replace(['\\', ' '], ""))
        .filter(|l| l.contains(&one) || l.contains(&two))
        .count()
}

async fn image_present(e: &E2e, image: &str) -> bool {
    let spec = v1::ImageSpec {
        image: image.to_owned(),
        ..Default::default()
    };
    e.cri()
        .client()
        .await
        .image_status(&spec, false)
        .await
        .expect("ImageStatus")
        .image
        .is_some()
}

fn restart_count(pod: &Value, name: &str) -> u64 {
    container(pod, name)["restartCount"].as_u64().unwrap_or(0)
}

fn waiting(pod: &Value) -> (&str, &str) {
    let w = &container(pod, "app")["state"]["waiting"];
    (
        w["reason"].as_str().unwrap_or_default(),
        w["message"].as_str().unwrap_or_default(),
    )
}

/// Removes the pod and waits until it is gone: no start (and so no pull)
/// happens after that.
async fn remove_and_wait(e: &E2e, name: &str) {
    e.remove(&format!("{name}.yaml"));
    e.wait_gone(name).await;
}

// IfNotPresent with an image only in the registry: the first start pulls it
// (containerd did not have it), the restarts do not.
e2e_test!(
    if_not_present_pulls_an_image_only_in_the_registry_once,
    registry,
    |e| Box::pin(async move {
        let image = e.registry().image(REGISTRY_REPO, "v1");
        assert!(
            !image_present(e, &image).await,
            "{image} is only in the registry"
        );
        e.write(
            "once.yaml",
            &pod(
                "once",
                "Always",
                // Exit 1 in the registry's image, 2 in any other.
                &format!("test -f {REGISTRY_MARKER} || exit 2; exit 1"),
                &[("app", &image, Some("IfNotPresent"))],
            ),
        );
        let pod = e
            .wait_for("once", "two restarts", |p| restart_count(p, "app") >= 2)
            .await;
        assert_eq!(container(&pod, "app")["image"], image.as_str(), "{pod:#}");
        assert_eq!(
            container(&pod, "app")["lastState"]["terminated"]["exitCode"],
            1,
            "the container ran the registry's image: {pod:#}"
        );
        assert!(image_present(e, &image).await, "{image} pulled");
        // The pull transferred what containerd did not have: the manifest, the
        // config and the marker's layer (busybox's own layer was imported).
        let requests = e.registry().requests();
        let gets = |what: &str| {
            requests
                .iter()
                .filter(|(m, p, s)| m == "GET" && p.contains(what) && *s == 200)
                .count()
        };
        assert_eq!(
            (gets("/manifests/sha256:"), gets("/blobs/sha256:")),
            (1, 2),
            "{requests:?}"
        );
        assert!(creates(e, "app") >= 3, "three starts at least");
        assert_eq!(runtime_pulls(e, &image, PULLED), 1, "one PullImage");
        assert_eq!(
            e.registry().manifest_requests(REGISTRY_REPO, "v1"),
            1,
            "the registry resolved the tag once: {:?}",
            e.registry().requests()
        );
    })
);

// Always: every container start pulls, restarts included.
e2e_test!(always_pulls_at_every_container_start, registry, |e| {
    Box::pin(async move {
        let image = e.registry().image(REGISTRY_REPO, "v1");
        e.write(
            "always.yaml",
            &pod(
                "always",
                "Always",
                "exit 1",
                &[("app", &image, Some("Always"))],
            ),
        );
        e.wait_for("always", "two restarts", |p| restart_count(p, "app") >= 2)
            .await;
        remove_and_wait(e, "always").await;
        let starts = creates(e, "app");
        assert!(starts >= 3, "three starts at least, not {starts}");
        assert_eq!(
            runtime_pulls(e, &image, PULLED),
            starts,
            "a PullImage per start"
        );
        assert_eq!(
            e.registry().manifest_requests(REGISTRY_REPO, "v1"),
            starts,
            "the registry resolved the tag once per start: {:?}",
            e.registry().requests()
        );
    })
});

// An unset policy is the kubelet's default: Always for `:latest`, IfNotPresent
// for another tag; the static pod's spec shows it.
e2e_test!(
    an_unset_policy_is_always_for_latest_and_if_not_present_otherwise,
    registry,
    |e| Box::pin(async move {
        let latest = e.registry().image(REGISTRY_REPO, "latest");
        let tagged = e.registry().image(REGISTRY_REPO, "v1");
        e.write(
            "defaults.yaml",
            &pod(
                "defaults",
                "Always",
                "exit 1",
                &[("latest", &latest, None), ("tagged", &tagged, None)],
            ),
        );
        let pod = e
            .wait_for("defaults", "two restarts of each", |p| {
                restart_count(p, "latest") >= 2 && restart_count(p, "tagged") >= 2
            })
            .await;
        let policies: Vec<&str> = pod["spec"]["containers"]
            .as_array()
            .expect("containers")
            .iter()
            .map(|c| c["imagePullPolicy"].as_str().unwrap_or_default())
            .collect();
        assert_eq!(policies, ["Always", "IfNotPresent"], "{pod:#}");
        remove_and_wait(e, "defaults").await;
        let (latest_starts, tagged_starts) = (creates(e, "latest"), creates(e, "tagged"));
        assert!(
            latest_starts >= 3 && tagged_starts >= 3,
            "{latest_starts}, {tagged_starts}"
        );
        let registry = e.registry();
        assert_eq!(
            registry.manifest_requests(REGISTRY_REPO, "latest"),
            latest_starts,
            ":latest pulled at every start: {:?}",
            registry.requests()
        );
        assert_eq!(
            registry.manifest_requests(REGISTRY_REPO, "v1"),
            1,
            ":v1 pulled once: {:?}",
            registry.requests()
        );
        assert_eq!(runtime_pulls(e, &latest, PULLED), latest_starts);
        assert_eq!(runtime_pulls(e, &tagged, PULLED), 1);
    })
);

// Never with an image the runtime does not have: ErrImageNeverPull naming the
// image, and no pull at all.
e2e_test!(
    never_with_an_absent_image_is_err_image_never_pull_without_a_pull,
    registry,
    |e| Box::pin(async move {
        let image = e.registry().image(REGISTRY_REPO, "v1");
        let mut history = History::new(e, "never");
        e.write(
            "never.yaml",
            &pod(
                "never",
                "Always",
                "sleep 600",
                &[("app", &image, Some("Never"))],
            ),
        );
        let pod = history
            .until("ErrImageNeverPull", |p| waiting(p).0 == "ErrImageNeverPull")
            .await;
        assert_eq!(
            waiting(&pod).1,
            format!("Container image {image:?} is not present with pull policy of Never"),
            "{pod:#}"
        );
        assert_eq!(pod["status"]["phase"], "Pending", "{pod:#}");
        assert_eq!(runtime_pulls(e, &image, ""), 0, "no PullImage");
        assert_eq!(
            e.registry().repo_requests(REGISTRY_REPO),
            0,
            "the registry was not asked: {:?}",
            e.registry().requests()
        );
        assert!(!image_present(e, &image).await);
        assert_eq!(creates(e, "app"), 0);
    })
);

// An image the registry does not have: ErrImagePull naming it, then
// ImagePullBackOff; the next pull waits for the back-off (2 s here, where the
// worker's own error back-off alone would retry after 0.5 s).
e2e_test!(
    an_image_missing_from_the_registry_is_err_image_pull_then_back_off,
    registry,
    |e| Box::pin(async move {
        let image = e.registry().image("evpleg/absent", "v1");
        let mut history = History::new(e, "missing");
        e.write(
            "missing.yaml",
            &pod("missing", "Always", "sleep 600", &[("app", &image, None)]),
        );
        let first = wait_pulls(e, &image, 1).await;
        let pod = history
            .until("ErrImagePull", |p| waiting(p).0 == "ErrImagePull")
            .await;
        // The runtime's error as the kubelet's CRI client gives it: containerd
        // answers NotFound, so `rpc error: code = NotFound desc = <its text>`
        // (the event adds "Failed to pull image").
        let message = waiting(&pod).1;
        assert!(
            message.starts_with(&format!(
                "rpc error: code = NotFound desc = failed to pull and unpack image {image:?}"
            )),
            "{message}"
        );
        assert!(
            e.registry().manifest_requests("evpleg/absent", "v1") >= 1,
            "the registry was asked: {:?}",
            e.registry().requests()
        );
        let pod = history
            .until("ImagePullBackOff", |p| waiting(p).0 == "ImagePullBackOff")
            .await;
        // The back-off's message carries the last pull's error.
        assert_eq!(
            waiting(&pod).1,
            format!("Back-off pulling image {image:?}: ErrImagePull: {message}")
        );
        let second = wait_pulls(e, &image, 2).await;
        let gap = second - first;
        assert!(
            gap >= Duration::from_millis(1500),
            "the second pull came {gap:?} after the first, inside the 2 s back-off"
        );
        assert_eq!(creates(e, "app"), 0, "nothing to create without the image");
    })
);

/// Waits until containerd finished `n` failed pulls of `image`; returns when
/// the harness saw the n-th (within 20 ms of it).
async fn wait_pulls(e: &E2e, image: &str, n: usize) -> Instant {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let done = runtime_pulls(e, image, FAILED);
        if done >= n {
            return Instant::now();
        }
        assert!(
            Instant::now() < deadline,
            "{n} failed pulls of {image} not within {DEADLINE:?}: {done}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A docker configuration giving `user:password` for `registry`.
fn docker_config(registry: &str, user: &str, password: &str) -> Value {
    let basic = k8s_openapi::ByteString(format!("{user}:{password}").into_bytes());
    serde_json::json!({ registry: {"auth": serde_json::to_value(basic).expect("base64")} })
}

/// A pull secret of `type_` (`.dockerconfigjson` or `.dockercfg`) holding
/// `config`.
fn pull_secret(name: &str, json: bool, config: Value) -> k8s_openapi::api::core::v1::Secret {
    let (type_, key, body) = if json {
        (
            "kubernetes.io/dockerconfigjson",
            ".dockerconfigjson",
            serde_json::json!({ "auths": config }),
        )
    } else {
        ("kubernetes.io/dockercfg", ".dockercfg", config)
    };
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": "default"},
        "type": type_,
        "stringData": { key: body.to_string() },
    }))
    .expect("a secret")
}

// imagePullSecrets (issue #27; the kubelet's `getPullSecretsForPod`, its
// credential keyring and `PullImage`'s attempts) against the registry with
// basic authentication on, through the real API server as the node: without
// a secret, or with a wrong password, the pull fails with the registry's
// 401 (ErrImagePull); with the right one the pod runs, also when the
// credentials come from a secret of the pod's ServiceAccount (the API
// server's ServiceAccount admission copies them into the pod) or after a
// secret that cannot be read (a FailedToRetrieveImagePullSecret Warning
// names it), or after a wrong one for the same registry (each tried in
// turn, the more specific first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_secrets_give_the_registry_credentials() {
    let name = "pull_secrets_give_the_registry_credentials";
    if !evpleg_tests::privileged(name) || !evpleg_tests::control_plane::available(name) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = E2e::start_with_private_registry("pull_secrets", &[]).await;
    let kube = e.cp().admin().await;
    let host = e.registry().host();
    let user = evpleg_tests::registry::TEST_USER;
    let image = e.registry().image(REGISTRY_REPO, "v1");
    let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> =
        kube::Api::namespaced(kube.clone(), "default");
    let repo_key = format!("{host}/{REGISTRY_REPO}");
    for secret in [
        pull_secret(
            "right",
            true,
            docker_config(&host, user.user, user.password),
        ),
        pull_secret("wrong", false, docker_config(&host, user.user, "not-it")),
        // More specific than `right`'s host: tried first, refused, then `right`.
        pull_secret(
            "wrong-repo",
            true,
            docker_config(&repo_key, user.user, "nope"),
        ),
    ] {
        secrets
            .create(&Default::default(), &secret)
            .await
            .unwrap_or_else(|e| panic!("create secret: {e}"));
    }
    let account: k8s_openapi::api::core::v1::ServiceAccount =
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "puller", "namespace": "default"},
            "automountServiceAccountToken": false,
            "imagePullSecrets": [{"name": "right"}],
        }))
        .expect("an account");
    kube::Api::namespaced(kube.clone(), "default")
        .create(&Default::default(), &account)
        .await
        .unwrap_or_else(|e| panic!("create account: {e}"));
    let pod = |name: &str, secrets: &[&str], account: Option<&str>| {
        let mut p = api_pod(name, "Always", "exec sleep 600");
        let spec = p.spec.as_mut().expect("spec");
        spec.containers[0].image = Some(image.clone());
        spec.containers[0].image_pull_policy = Some("Always".into());
        spec.image_pull_secrets = Some(
            secrets
                .iter()
                .map(|s| {
                    serde_json::from_value(serde_json::json!({"name": s})).expect("a reference")
                })
                .collect(),
        );
        spec.service_account_name = account.map(Into::into);
        p
    };
    let waiting_api = |p: &k8s_openapi::api::core::v1::Pod| {
        let s = p
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref());
        let w = s
            .and_then(|s| s.first())
            .and_then(|c| c.state.as_ref()?.waiting.clone());
        w.map(|w| (w.reason.unwrap_or_default(), w.message.unwrap_or_default()))
    };
    let running = |p: &k8s_openapi::api::core::v1::Pod| {
        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
    };
    for (name, refs) in [("none", &[][..]), ("wrong", &["wrong"][..])] {
        e.create_pod(&pod(name, refs, None)).await;
        let p = e
            .wait_api(name, "ErrImagePull", |p| {
                waiting_api(p).is_some_and(|(r, _)| r == "ErrImagePull")
            })
            .await;
        let (_, message) = waiting_api(&p).expect("waiting");
        // containerd 1.x words the refusal "401 Unauthorized", 2.x "no
        // basic auth credentials"; the agent passes it on as it is.
        assert!(
            message.starts_with(&format!("failed to pull and unpack image {image:?}"))
                && (message.contains("401 Unauthorized")
                    || message.contains("authorization failed: no basic auth credentials")),
            "{name}: {message}"
        );
    }
    e.create_pod(&pod("by-account", &[], Some("puller"))).await;
    let p = e.wait_api("by-account", "Running", running).await;
    let copied = p
        .spec
        .and_then(|s| s.image_pull_secrets)
        .unwrap_or_default();
    assert_eq!(copied.len(), 1, "{copied:?}");
    assert_eq!(copied[0].name, "right");
    e.create_pod(&pod("right", &["missing", "wrong-repo", "right"], None))
        .await;
    e.wait_api("right", "Running", running).await;
    // The wrong-repo attempt came first, refused with 401, then right's.
    let refused = e
        .registry()
        .requests()
        .iter()
        .filter(|(_, path, status)| path.contains("/manifests/v1") && *status == 401)
        .count();
    assert!(
        refused >= 3,
        "401s for none, wrong and wrong-repo: {:?}",
        e.registry().requests()
    );
    let events: kube::Api<k8s_openapi::api::events::v1::Event> =
        kube::Api::namespaced(kube.clone(), "default");
    wait_list(&events, "FailedToRetrieveImagePullSecret for right", |evs| {
        evs.iter().any(|ev| {
            ev.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("right")
                && ev.reason.as_deref() == Some("FailedToRetrieveImagePullSecret")
                && ev.type_.as_deref() == Some("Warning")
                && ev.note.as_deref()
                    == Some("Unable to retrieve some image pull secrets (missing); attempting to pull the image may not succeed.")
        })
    })
    .await;
    for name in ["none", "wrong", "by-account", "right"] {
        kube::Api::<k8s_openapi::api::core::v1::Pod>::namespaced(kube.clone(), "default")
            .delete(name, &kube::api::DeleteParams::default().grace_period(0))
            .await
            .unwrap_or_else(|e| panic!("delete {name}: {e}"));
    }
    for name in ["right", "wrong", "wrong-repo"] {
        secrets
            .delete(name, &Default::default())
            .await
            .unwrap_or_else(|e| panic!("delete secret {name}: {e}"));
    }
    let accounts: kube::Api<k8s_openapi::api::core::v1::ServiceAccount> =
        kube::Api::namespaced(kube.clone(), "default");
    accounts
        .delete("puller", &Default::default())
        .await
        .unwrap_or_else(|e| panic!("delete account puller: {e}"));
    let refused = e.cp().refused(&format!("system:node:{NODE}"));
    assert!(refused.is_empty(), "refused: {refused:#?}");
    e.finish().await;
}
