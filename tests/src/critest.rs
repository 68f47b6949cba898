//! critest, cri-tools' CRI validation suite (v1.37.0, built by `cargo xtask
//! setup`: [`crate::go_tools`]), run against the harness's containerd
//! directly or through `evpleg cri-proxy` (`tests/critest.rs`).
//!
//! critest pulls its images from `registry.k8s.io`, `k8s.gcr.io` and
//! `gcr.io/k8s-staging-cri-tools`; here they are built locally from the
//! harness's busybox image ([`build_archive`]: each image of upstream's
//! `images/build` as a busybox with a marker file `/<name>`, the user images
//! with their `USER`, the predefined-group image with its `/etc/passwd` and
//! `/etc/group`; nginx, hostnet-nginx, httpd and nonewprivs with
//! `tests/images/critest_server.c` doing what critest checks of them: HTTP
//! on their port through busybox httpd, nginx's pid file and master
//! process name, httpd's log line, a setuid root `Effective uid`), pushed
//! to the harness's registry under the same
//! repositories and tags ([`serve`]), and containerd's registry host
//! configuration sends those three hosts to it ([`Registry::mirror_in_containerd`]),
//! so that the suite's image names, repo tags included, are upstream's.
//!
//! Not built: the image upstream pulls by a fixed digest (no local build
//! has that digest); the test pulling it is skipped by name ([`SKIPPED`]).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::containerd::{
    HarnessError, LOCAL_TAG, Result, UMOCI, archive_layout, image_cache_dir, local_image_archive,
    lock_exclusive, run,
};
use crate::registry::{Registry, RegistryError};

/// The hosts critest pulls from, each served by the harness's registry.
pub const UPSTREAM_HOSTS: [&str; 3] = ["registry.k8s.io", "k8s.gcr.io", "gcr.io"];

/// Each image critest pulls by tag, and the local variant served under its
/// name (the variant's marker file is `/<variant>`).
pub const IMAGES: &[(&str, &str)] = &[
    ("registry.k8s.io/e2e-test-images/busybox:1.29-2", "busybox"),
    ("registry.k8s.io/pause:3.9", "pause"),
    ("k8s.gcr.io/pause:3.9", "pause"),
    (
        "gcr.io/k8s-staging-cri-tools/test-image-latest:latest",
        "test-image-latest",
    ),
    ("gcr.io/k8s-staging-cri-tools/test-image-tag:test", "test"),
    ("gcr.io/k8s-staging-cri-tools/test-image-tag:all", "all"),
    (
        "gcr.io/k8s-staging-cri-tools/test-image-tags:1",
        "same-image",
    ),
    (
        "gcr.io/k8s-staging-cri-tools/test-image-tags:2",
        "same-image",
    ),
    (
        "gcr.io/k8s-staging-cri-tools/test-image-tags:3",
        "same-image",
    ),
    (
        "gcr.io/k8s-staging-cri-tools/test-image-1:latest",
        "test-image-1",
    ),
    (
        "gcr.io/k8s-staging-cri-tools/test-image-2:latest",
        "test-image-2",
    ),
    (
        "gcr.io/k8s-staging-cri-tools/test-image-3:latest",
        "test-image-3",
    ),
    (
        "gcr.io/k8s-staging-cri-tools/test-image-user-uid:latest",
        "user-uid",
    ),
    (
        "gcr.io/k8s-staging-cri-tools/test-image-user-username:latest",
        "user-username",
    ),
    (
        "gcr.io/k8s-staging-cri-tools/test-image-user-uid-group:latest",
        "user-uid-group",
    ),
    (
        "gcr.io/k8s-staging-cri-tools/test-image-user-username-group:latest",
        "user-username-group",
    ),
    (
        "gcr.io/k8s-staging-cri-tools/test-image-predefined-group:latest",
        "predefined-group",
    ),
    ("registry.k8s.io/e2e-test-images/nginx:1.14-2", "nginx"),
    (
        "gcr.io/k8s-staging-cri-tools/hostnet-nginx-amd64:latest",
        "hostnet-nginx",
    ),
    ("registry.k8s.io/e2e-test-images/httpd:2.4.39-4", "httpd"),
    (
        "registry.k8s.io/e2e-test-images/nonewprivs:1.3",
        "nonewprivs",
    ),
];

/// The variants running `critest_server.c`: where it goes (setuid for
/// `nnp`), the page it serves, and the image's entrypoint and command.
const SERVERS: &[(&str, &str, Option<&str>, &[&str])] = &[
    (
        "nginx",
        "/usr/sbin/nginx",
        Some("/usr/share/nginx/html"),
        &["/usr/sbin/nginx"],
    ),
    (
        "hostnet-nginx",
        "/usr/sbin/nginx",
        Some("/usr/share/nginx/html"),
        &["/usr/sbin/nginx", "-p", "12003"],
    ),
    (
        "httpd",
        "/usr/local/bin/httpd-foreground",
        Some("/usr/local/apache2/htdocs"),
        &["/usr/local/bin/httpd-foreground"],
    ),
    ("nonewprivs", "/nnp", None, &["/nnp"]),
];

/// The `USER` of the user images (upstream's `images/build`).
const USERS: &[(&str, &str)] = &[
    ("user-uid", "1002"),
    ("user-username", "www-data"),
    ("user-uid-group", "1003:1004"),
    ("user-username-group", "www-data:1004"),
    ("predefined-group", "1000"),
];

/// The tests skipped by name (a `-ginkgo.skip` regular expression each), and
/// why: their image is pulled by a fixed upstream digest.
pub const SKIPPED: &[(&str, &str)] = &[(
    "public image with digest should be pulled and removed",
    "pulls gcr.io/k8s-staging-cri-tools/test-image-digest@sha256:9700f9a2...: no local build has that digest",
)];

/// Bump when the variants change, to rebuild the cached archive.
const RECIPE: u32 = 2;

/// How long one critest run may take.
pub const RUN_TIMEOUT: Duration = Duration::from_secs(1800);

/// An error of running critest or reading its report.
#[derive(Debug, thiserror::Error)]
pub enum CritestError {
    #[error(transparent)]
    Harness(#[from] HarnessError),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error("critest's report {path}: {detail}")]
    Report { path: PathBuf, detail: String },
    #[error("running {binary}: {source}")]
    Spawn {
        binary: PathBuf,
        source: std::io::Error,
    },
}

/// The archive of every variant (one OCI layout, a tag per variant), built
/// from the harness's busybox once and cached beside it.
pub fn build_archive() -> Result<PathBuf> {
    let busybox = local_image_archive("busybox")?;
    let cache = image_cache_dir();
    let lock = lock_exclusive(&cache.join(".lock"))?;
    let io = |action: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| HarnessError::Io {
            action,
            path,
            source,
        }
    };
    let base_key_path = cache.join("busybox.tar.key");
    let base_key = fs::read_to_string(&base_key_path).map_err(io("read", &base_key_path))?;
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("images/critest_server.c");
    let server_c = fs::read_to_string(&source).map_err(io("read", &source))?;
    let key = format!(
        "{base_key}; critest recipe {RECIPE}; critest_server.c {} bytes {:016x}",
        server_c.len(),
        server_c
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b))
                .wrapping_mul(0x0000_0100_0000_01b3))
    );
    let archive = cache.join("critest.tar");
    let key_path = cache.join("critest.tar.key");
    if archive.exists() && fs::read_to_string(&key_path).is_ok_and(|k| k == key) {
        return Ok(archive);
    }
    let started = Instant::now();
    let work = cache.join("critest.build");
    if work.exists() {
        fs::remove_dir_all(&work).map_err(io("remove", &work))?;
    }
    let layout = work.join("layout");
    fs::create_dir_all(&layout).map_err(io("create", &layout))?;
    run(Command::new("tar")
        .arg("-C")
        .arg(&layout)
        .arg("-xf")
        .arg(&busybox))?;
    let base = format!("{}:{LOCAL_TAG}", layout.display());
    let server = work.join("critest_server");
    run(Command::new("gcc")
        .args(["-static", "-O2", "-o"])
        .arg(&server)
        .arg(&source))?;
    let page = work.join("index.html");
    fs::write(&page, "<html><body>served for critest</body></html>\n")
        .map_err(io("write", &page))?;
    let var_run = work.join("var-run");
    fs::create_dir_all(&var_run).map_err(io("create", &var_run))?;
    let mut variants: Vec<&str> = IMAGES.iter().map(|(_, v)| *v).collect();
    variants.sort_unstable();
    variants.dedup();
    for variant in variants {
        let marker = work.join(variant);
        fs::write(&marker, format!("{variant}\n")).map_err(io("write", &marker))?;
        run(Command::new(UMOCI)
            .args(["insert", "--image", &base, "--tag", variant])
            .arg(&marker)
            .arg(format!("/{variant}")))?;
        let image = format!("{}:{variant}", layout.display());
        if variant == "predefined-group" {
            // upstream: adduser -u 1000 default-user, addgroup -g 50000
            // group-defined-in-image, the user in that group.
            let etc = work.join("predefined-etc");
            fs::create_dir_all(&etc).map_err(io("create", &etc))?;
            let passwd = etc.join("passwd");
            fs::write(
                &passwd,
                "root:x:0:0:root:/root:/bin/sh\ndefault-user:x:1000:1000::/home/default-user:/bin/sh\n",
            )
            .map_err(io("write", &passwd))?;
            let group = etc.join("group");
            fs::write(
                &group,
                "root:x:0:\ndefault-user:x:1000:\ngroup-defined-in-image:x:50000:default-user\n",
            )
            .map_err(io("write", &group))?;
            for file in [&passwd, &group] {
                let name = file.file_name().expect("a file name").to_string_lossy();
                run(Command::new(UMOCI)
                    .args(["insert", "--image", &image])
                    .arg(file)
                    .arg(format!("/etc/{name}")))?;
            }
        }
        if let Some((_, path, root, command)) = SERVERS.iter().find(|(v, ..)| *v == variant) {
            let mode = if *path == "/nnp" { 0o4755 } else { 0o755 };
            let binary = work.join(format!("{variant}-server"));
            fs::copy(&server, &binary).map_err(io("copy", &binary))?;
            use std::os::unix::fs::PermissionsExt as _;
            fs::set_permissions(&binary, fs::Permissions::from_mode(mode))
                .map_err(io("chmod", &binary))?;
            let mut inserts = vec![
                (binary, path.to_string()),
                (var_run.clone(), "/var/run".into()),
            ];
            if let Some(root) = root {
                inserts.push((page.clone(), format!("{root}/index.html")));
            }
            for (from, to) in inserts {
                run(Command::new(UMOCI)
                    .args(["insert", "--image", &image])
                    .arg(&from)
                    .arg(&to))?;
            }
            let mut config = Command::new(UMOCI);
            config.args(["config", "--image", &image, "--clear=config.cmd"]);
            config.args(["--config.entrypoint", command[0]]);
            for arg in &command[1..] {
                config.args(["--config.cmd", arg]);
            }
            run(&mut config)?;
        }
        if let Some((_, user)) = USERS.iter().find(|(v, _)| *v == variant) {
            run(Command::new(UMOCI).args(["config", "--image", &image, "--config.user", user]))?;
        }
    }
    archive_layout(&layout, &archive)?;
    fs::write(&key_path, &key).map_err(io("write", &key_path))?;
    fs::remove_dir_all(&work).map_err(io("remove", &work))?;
    tracing::info!(archive = %archive.display(), elapsed = ?started.elapsed(), "critest images built");
    drop(lock);
    Ok(archive)
}

/// Pushes every image of [`IMAGES`] to `registry` under its upstream
/// repository and tag (each repository once per tag).
pub fn serve(registry: &Registry) -> Result<(), CritestError> {
    let archive = build_archive()?;
    let mut pushed = std::collections::BTreeSet::new();
    for (upstream, variant) in IMAGES {
        let (repo, tag) = local_name(upstream);
        if pushed.insert((repo.clone(), tag.clone())) {
            registry.push(&archive, variant, &repo, &tag)?;
        }
    }
    Ok(())
}

/// Sends [`UPSTREAM_HOSTS`] of a containerd with registry `config_path`
/// `certs_dir` to `registry`.
pub fn mirror(registry: &Registry, certs_dir: &Path) -> Result<(), CritestError> {
    for host in UPSTREAM_HOSTS {
        registry.mirror_in_containerd(certs_dir, host)?;
    }
    Ok(())
}

/// An upstream reference's repository (without its host) and tag.
fn local_name(upstream: &str) -> (String, String) {
    let (_, path) = upstream.split_once('/').expect("a host and a path");
    let (repo, tag) = path.rsplit_once(':').expect("a tag");
    (repo.to_owned(), tag.to_owned())
}

/// One run's outcome: each test's full name and state (`passed`, `failed`,
/// `skipped`, ...), and how long the run took.
#[derive(Debug)]
pub struct Outcome {
    pub states: BTreeMap<String, String>,
    pub took: Duration,
}

impl Outcome {
    /// The tests in `state`.
    pub fn with_state(&self, state: &str) -> std::collections::BTreeSet<&str> {
        self.states
            .iter()
            .filter(|(_, s)| *s == state)
            .map(|(n, _)| n.as_str())
            .collect()
    }
}

/// Runs `binary` (critest) on the CRI endpoint `endpoint` (`unix://...`),
/// skipping [`SKIPPED`], its output and JSON report under `dir`; returns the
/// report's tests. critest exits non-zero when a test fails: only the report
/// counts.
pub fn run_suite(binary: &Path, endpoint: &str, dir: &Path) -> Result<Outcome, CritestError> {
    let report = dir.join("report.json");
    let io = |action: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| HarnessError::Io {
            action,
            path,
            source,
        }
    };
    fs::create_dir_all(dir).map_err(io("create", dir))?;
    let output = dir.join("critest.log");
    let log = fs::File::create(&output).map_err(io("create", &output))?;
    let skip = SKIPPED
        .iter()
        .map(|(name, _)| *name)
        .collect::<Vec<_>>()
        .join("|");
    let started = Instant::now();
    let status = Command::new("timeout")
        .arg(RUN_TIMEOUT.as_secs().to_string())
        .arg(binary)
        .arg(format!("--runtime-endpoint={endpoint}"))
        .arg(format!("--image-endpoint={endpoint}"))
        .arg(format!("--config={}", dir.join("crictl.yaml").display()))
        .arg(format!("--ginkgo.skip={skip}"))
        .arg(format!("--ginkgo.json-report={}", report.display()))
        .arg("--ginkgo.no-color")
        .current_dir(dir)
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone().map_err(io("duplicate", &output))?)
        .stderr(log)
        .status()
        .map_err(|source| CritestError::Spawn {
            binary: binary.to_path_buf(),
            source,
        })?;
    let took = started.elapsed();
    tracing::info!(%endpoint, ?status, ?took, log = %output.display(), "critest ran");
    let text = fs::read_to_string(&report).map_err(|e| CritestError::Report {
        path: report.clone(),
        detail: format!("{e} (critest {status}; its output: {})", output.display()),
    })?;
    Ok(Outcome {
        states: parse_report(&text).map_err(|detail| CritestError::Report {
            path: report.clone(),
            detail,
        })?,
        took,
    })
}

/// Each `It` of a ginkgo JSON report: its containers' texts and its own,
/// joined by spaces, and its state.
pub fn parse_report(text: &str) -> Result<BTreeMap<String, String>, String> {
    let suites: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let mut states = BTreeMap::new();
    for suite in suites.as_array().ok_or("not an array of suites")? {
        let specs = suite["SpecReports"]
            .as_array()
            .ok_or("a suite without SpecReports")?;
        for spec in specs.iter().filter(|s| s["LeafNodeType"] == "It") {
            let mut name: Vec<&str> = spec["ContainerHierarchyTexts"]
                .as_array()
                .map(|c| c.iter().filter_map(|t| t.as_str()).collect())
                .unwrap_or_default();
            name.push(spec["LeafNodeText"].as_str().ok_or("an It without text")?);
            let state = spec["State"].as_str().ok_or("an It without State")?;
            states.insert(name.join(" "), state.to_owned());
        }
    }
    Ok(states)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reports_its_are_named_by_their_containers() {
        let report = r#"[{"SpecReports":[
            {"LeafNodeType":"BeforeSuite","LeafNodeText":"","State":"passed"},
            {"LeafNodeType":"It","ContainerHierarchyTexts":["[k8s.io] Image Manager"],
             "LeafNodeText":"public image with tag","State":"passed"},
            {"LeafNodeType":"It","ContainerHierarchyTexts":["[k8s.io] Container","log"],
             "LeafNodeText":"reopen","State":"failed"}]}]"#;
        let states = parse_report(report).unwrap();
        assert_eq!(
            states.into_iter().collect::<Vec<_>>(),
            vec![
                (
                    "[k8s.io] Container log reopen".to_owned(),
                    "failed".to_owned()
                ),
                (
                    "[k8s.io] Image Manager public image with tag".to_owned(),
                    "passed".to_owned()
                ),
            ]
        );
        assert!(parse_report("{}").is_err());
    }

    #[test]
    fn upstream_names_become_the_registrys_repositories() {
        assert_eq!(
            local_name("gcr.io/k8s-staging-cri-tools/test-image-tags:2"),
            (
                "k8s-staging-cri-tools/test-image-tags".to_owned(),
                "2".to_owned()
            )
        );
        assert_eq!(
            local_name("registry.k8s.io/pause:3.9"),
            ("pause".to_owned(), "3.9".to_owned())
        );
    }
}
