//! `cargo xtask setup`'s Go part: the real Kubernetes components, built from
//! their Go modules so that the tests and the benchmark run evpleg beside (and in
//! front of) the unmodified ones: kube-apiserver and etcd as the real control
//! plane, the stock kubelet as the proxy's client and the benchmark's rival,
//! containerd 2.x as a runtime of the matrix, crictl and critest as the CRI's own
//! clients (see docs/real-kubernetes.md).
//!
//! Each binary goes to `.tools/go/<name>-<version>/<name>` with a `stamp` file
//! holding its recipe (module, version, package, command, flags), and
//! `.tools/go/bin/<name>` links to it; the tests find it there
//! (tests/src/go_tools.rs). A binary whose stamp matches and which is executable
//! is not rebuilt: a second setup runs no Go command at all.
//!
//! Each module is built from a small wrapper module of our own under
//! `.tools/go/src/`, which requires it: `go install k8s.io/kubernetes/cmd/...@v`
//! refuses a module with replace directives, and k8s.io/kubernetes replaces its
//! `k8s.io/*` staging modules with directories of its repository. The wrapper
//! requires and replaces each of them with its published v0.X.Y instead, the
//! list read from the upstream go.mod. All are built with CGO off and
//! `-trimpath`, `-ldflags` setting the version variables, and each binary's
//! version output is checked after the build.

use std::fmt::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::util::{self, info, output, step};

/// The Kubernetes release whose kube-apiserver and kubelet are built.
pub const KUBERNETES_VERSION: &str = "v1.37.2";

/// A Go module the binaries are built from, and how its wrapper module is made.
struct Module {
    /// The module path.
    path: &'static str,
    version: &'static str,
    /// Directory name of its wrapper module under `.tools/go/src/`.
    slug: &'static str,
    /// The `go` line of the wrapper: the module's own, so that its language
    /// version applies.
    go: &'static str,
    /// Whether the wrapper replaces k8s.io/kubernetes' staging modules.
    staging: bool,
    /// Packages imported by the wrapper's tools.go besides the binaries' own,
    /// so that `go mod tidy` records the test dependencies of `go test -c`.
    extra_imports: &'static [&'static str],
}

const KUBERNETES: Module = Module {
    path: "k8s.io/kubernetes",
    version: KUBERNETES_VERSION,
    slug: "kubernetes",
    go: "1.26.0",
    staging: true,
    extra_imports: &[],
};

const ETCD: Module = Module {
    path: "go.etcd.io/etcd/server/v3",
    version: "v3.7.3",
    slug: "etcd-server",
    go: "1.26.0",
    staging: false,
    extra_imports: &[],
};

const CRI_TOOLS: Module = Module {
    path: "sigs.k8s.io/cri-tools",
    version: "v1.37.0",
    slug: "cri-tools",
    go: "1.26.6",
    staging: false,
    // critest is the test binary of cmd/critest: its test imports.
    extra_imports: &[
        "github.com/onsi/ginkgo/v2",
        "github.com/onsi/gomega",
        "sigs.k8s.io/cri-tools/pkg/benchmark",
        "sigs.k8s.io/cri-tools/pkg/validate",
    ],
};

const CONTAINERD: Module = Module {
    path: "github.com/containerd/containerd/v2",
    version: "v2.4.2",
    slug: "containerd",
    go: "1.26.6",
    staging: false,
    extra_imports: &[],
};

/// One binary built from a module.
struct Binary {
    name: &'static str,
    module: &'static Module,
    /// The main package, or the package whose test binary it is.
    package: &'static str,
    /// Built with `go test -c` (critest) rather than `go build`.
    test_binary: bool,
    /// `-X` settings of `-ldflags`: the version variables ([`expand`]).
    x_flags: &'static [&'static str],
    /// Arguments that print the version, and what that output must contain
    /// ([`expand`]).
    version_args: &'static [&'static str],
    version_shown: &'static str,
    /// Who uses it (said when it is built).
    why: &'static str,
}

const K8S_VERSION_X: &[&str] = &[
    "k8s.io/component-base/version.gitVersion={v}",
    "k8s.io/component-base/version.gitMajor={major}",
    "k8s.io/component-base/version.gitMinor={minor}",
    "k8s.io/component-base/version.gitTreeState=clean",
    "k8s.io/client-go/pkg/version.gitVersion={v}",
    "k8s.io/client-go/pkg/version.gitMajor={major}",
    "k8s.io/client-go/pkg/version.gitMinor={minor}",
    "k8s.io/client-go/pkg/version.gitTreeState=clean",
];

const CRI_TOOLS_X: &[&str] = &["sigs.k8s.io/cri-tools/pkg/version.Version={n}"];

const CONTAINERD_X: &[&str] = &["github.com/containerd/containerd/v2/version.Version={v}"];

/// Every binary the tests and the benchmark use, in build order (the control
/// plane first).
const BINARIES: &[Binary] = &[
    Binary {
        name: "kube-apiserver",
        module: &KUBERNETES,
        package: "k8s.io/kubernetes/cmd/kube-apiserver",
        test_binary: false,
        x_flags: K8S_VERSION_X,
        version_args: &["--version"],
        version_shown: "Kubernetes {v}",
        why: "the real control plane of the API tests",
    },
    Binary {
        name: "etcd",
        module: &ETCD,
        package: "go.etcd.io/etcd/server/v3",
        test_binary: false,
        // The version is a constant of go.etcd.io/etcd/api/v3/version.
        x_flags: &[],
        version_args: &["--version"],
        version_shown: "etcd Version: {n}",
        why: "kube-apiserver's storage",
    },
    Binary {
        name: "kubelet",
        module: &KUBERNETES,
        package: "k8s.io/kubernetes/cmd/kubelet",
        test_binary: false,
        x_flags: K8S_VERSION_X,
        version_args: &["--version"],
        version_shown: "Kubernetes {v}",
        why: "the stock kubelet: the CRI proxy's client and the benchmark's rival",
    },
    Binary {
        name: "kubectl",
        module: &KUBERNETES,
        package: "k8s.io/kubernetes/cmd/kubectl",
        test_binary: false,
        x_flags: K8S_VERSION_X,
        version_args: &["version", "--client"],
        version_shown: "Client Version: {v}",
        why: "`kubectl logs` through the real API server to the agent's kubelet server",
    },
    Binary {
        name: "crictl",
        module: &CRI_TOOLS,
        package: "sigs.k8s.io/cri-tools/cmd/crictl",
        test_binary: false,
        x_flags: CRI_TOOLS_X,
        version_args: &["--version"],
        version_shown: "crictl version {n}",
        why: "the CRI's command-line client, for the proxy's tests",
    },
    Binary {
        name: "critest",
        module: &CRI_TOOLS,
        package: "sigs.k8s.io/cri-tools/cmd/critest",
        test_binary: true,
        x_flags: CRI_TOOLS_X,
        version_args: &["--version"],
        version_shown: "critest version: {n}",
        why: "the CRI validation suite, for the proxy's tests",
    },
    Binary {
        name: "containerd",
        module: &CONTAINERD,
        package: "github.com/containerd/containerd/v2/cmd/containerd",
        test_binary: false,
        x_flags: CONTAINERD_X,
        version_args: &["--version"],
        version_shown: "containerd github.com/containerd/containerd/v2 {v}",
        why: "containerd 2.x in the runtime matrix",
    },
    Binary {
        name: "containerd-shim-runc-v2",
        module: &CONTAINERD,
        package: "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
        test_binary: false,
        x_flags: CONTAINERD_X,
        version_args: &["-v"],
        version_shown: "Version:  {v}",
        why: "containerd 2.x's runc shim",
    },
];

/// `.tools/go`: the binaries, their links and the wrapper modules.
pub fn go_dir(root: &Path) -> PathBuf {
    util::tools_dir(root).join("go")
}

/// `template` with the module's version put in: `{v}` as tagged (v1.37.2),
/// `{n}` without the v, `{major}` and `{minor}` its first two numbers.
fn expand(template: &str, version: &str) -> String {
    let n = version.strip_prefix('v').unwrap_or(version);
    let mut parts = n.split('.');
    let major = parts.next().unwrap_or_default();
    let minor = parts.next().unwrap_or_default();
    template
        .replace("{v}", version)
        .replace("{n}", n)
        .replace("{major}", major)
        .replace("{minor}", minor)
}

/// Builds what is missing or stale, and links `.tools/go/bin/<name>` to each.
pub fn ensure(root: &Path) -> Result<()> {
    let dir = go_dir(root);
    let mut tidied: Vec<&str> = Vec::new();
    for binary in BINARIES {
        let out_dir = dir.join(format!("{}-{}", binary.name, binary.module.version));
        let exe = out_dir.join(binary.name);
        let stamp = out_dir.join("stamp");
        let recipe = recipe(binary);
        let current = std::fs::read_to_string(&stamp).ok().as_deref() == Some(recipe.as_str())
            && is_executable(&exe);
        if !current {
            let wrapper = dir
                .join("src")
                .join(format!("{}-{}", binary.module.slug, binary.module.version));
            announce(binary);
            if !tidied.contains(&binary.module.slug) {
                ensure_wrapper(binary.module, &wrapper)?;
                tidied.push(binary.module.slug);
            }
            build(binary, &wrapper, &out_dir, &recipe)?;
        }
        link(&dir, binary)?;
        if current {
            info(&format!(
                "{} {} ({}): {}",
                binary.name,
                binary.module.version,
                binary.module.path,
                exe.display()
            ));
        }
    }
    Ok(())
}

/// What the stamp holds: a change of any of it rebuilds the binary.
fn recipe(binary: &Binary) -> String {
    let module = binary.module;
    let mut r = String::new();
    let _ = writeln!(r, "module {} {}", module.path, module.version);
    let _ = writeln!(r, "wrapper go {} staging {}", module.go, module.staging);
    let _ = writeln!(r, "package {}", binary.package);
    let _ = writeln!(
        r,
        "command {}",
        build_args(binary, Path::new("OUT")).join(" ")
    );
    let _ = writeln!(
        r,
        "env {}",
        GO_ENV.map(|(k, v)| format!("{k}={v}")).join(" ")
    );
    r
}

/// The environment of every go command: CGO off (static binaries), and the Go
/// installed here (no toolchain download).
const GO_ENV: [(&str, &str); 2] = [("CGO_ENABLED", "0"), ("GOTOOLCHAIN", "local")];

fn go(dir: &Path) -> Command {
    let mut cmd = Command::new("go");
    cmd.current_dir(dir).envs(GO_ENV);
    cmd
}

fn build_args(binary: &Binary, out: &Path) -> Vec<String> {
    let mut ldflags = String::from("-s -w");
    for x in binary.x_flags {
        let _ = write!(ldflags, " -X {}", expand(x, binary.module.version));
    }
    let mut args: Vec<String> = if binary.test_binary {
        vec!["test".into(), "-c".into()]
    } else {
        vec!["build".into()]
    };
    args.extend([
        "-trimpath".into(),
        "-buildvcs=false".into(),
        format!("-ldflags={ldflags}"),
        "-o".into(),
        out.display().to_string(),
        binary.package.into(),
    ]);
    args
}

fn is_executable(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Writes the wrapper module (go.mod, tools.go) and resolves it (`go mod tidy`,
/// which downloads what the module cache lacks).
fn ensure_wrapper(module: &Module, dir: &Path) -> Result<()> {
    if output(Command::new("go").arg("version")).is_none() {
        bail!(
            "`go` is not on the PATH: Go >= {} is needed to build {} {} (the real \
             Kubernetes parts the tests run); install it and run setup again",
            module.go,
            module.path,
            module.version
        );
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut go_mod = format!(
        "// Generated by `cargo xtask setup` (xtask/src/gotools.rs).\nmodule evpleg.local/{}-wrapper\n\ngo {}\n\nrequire {} {}\n",
        module.slug, module.go, module.path, module.version
    );
    if module.staging {
        let upstream = upstream_go_mod(module, dir)?;
        go_mod.push_str(&staging_requires(&upstream, module.version)?);
    }
    let mut imports: Vec<&str> = BINARIES
        .iter()
        .filter(|b| std::ptr::eq(b.module, module))
        .map(|b| b.package)
        .chain(module.extra_imports.iter().copied())
        .collect();
    imports.sort_unstable();
    let mut tools = String::from(
        "//go:build tools\n\n// The packages built from this module.\npackage tools\n\nimport (\n",
    );
    for import in imports {
        let _ = writeln!(tools, "\t_ \"{import}\"");
    }
    tools.push_str(")\n");
    // `go mod tidy` rewrites go.mod: what was generated is kept beside it, and a
    // wrapper generated alike and resolved (go.sum) is not resolved again.
    let generated = format!("{go_mod}\n{tools}");
    let generated_path = dir.join("generated");
    if std::fs::read_to_string(&generated_path).ok().as_deref() == Some(generated.as_str())
        && dir.join("go.sum").exists()
    {
        return Ok(());
    }
    let _ = std::fs::remove_file(&generated_path);
    for (name, text) in [("go.mod", &go_mod), ("tools.go", &tools)] {
        let path = dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    info(&format!(
        "resolving {} {} (go mod tidy in {})",
        module.path,
        module.version,
        dir.display()
    ));
    util::run(go(dir).args(["mod", "tidy"]))?;
    std::fs::write(&generated_path, generated)
        .with_context(|| format!("cannot write {}", generated_path.display()))
}

/// The go.mod of `module` as published, read from the module cache.
fn upstream_go_mod(module: &Module, dir: &Path) -> Result<String> {
    let json = output(go(dir).args([
        "mod",
        "download",
        "-json",
        &format!("{}@{}", module.path, module.version),
    ]))
    .with_context(|| format!("go mod download {}@{} failed", module.path, module.version))?;
    let path = json
        .lines()
        .find_map(|l| l.trim().strip_prefix("\"GoMod\": \""))
        .and_then(|rest| rest.strip_suffix("\","))
        .with_context(|| {
            format!(
                "go mod download -json {}@{} names no GoMod file",
                module.path, module.version
            )
        })?;
    std::fs::read_to_string(path).with_context(|| format!("cannot read {path}"))
}

/// The wrapper's requirements for k8s.io/kubernetes `version`: each staging
/// module that the upstream go.mod both requires (at v0.0.0) and replaces with
/// a directory of its repository, at its published version (v1.37.2 → v0.37.2),
/// required and replaced so that the upstream's v0.0.0 resolves to it.
fn staging_requires(upstream: &str, version: &str) -> Result<String> {
    let staging_version = version
        .strip_prefix("v1.")
        .map(|rest| format!("v0.{rest}"))
        .with_context(|| format!("kubernetes version {version} does not start with v1."))?;
    let replaced: Vec<&str> = upstream
        .lines()
        .filter_map(|l| {
            let (module, target) = l.split_once("=>")?;
            target
                .trim()
                .starts_with("./staging/")
                .then(|| module.trim())
        })
        .collect();
    let required: Vec<&str> = upstream
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let module = words.next()?;
            (words.next()? == "v0.0.0" && replaced.contains(&module)).then_some(module)
        })
        .collect();
    if required.is_empty() {
        bail!("the go.mod of k8s.io/kubernetes {version} requires no staging module");
    }
    let mut text = String::from("\nrequire (\n");
    for m in &required {
        let _ = writeln!(text, "\t{m} {staging_version}");
    }
    text.push_str(")\n\nreplace (\n");
    for m in &required {
        let _ = writeln!(text, "\t{m} => {m} {staging_version}");
    }
    text.push_str(")\n");
    Ok(text)
}

/// Says what is built, from which module, and why.
fn announce(binary: &Binary) {
    let module = binary.module;
    step(&format!(
        "building {} {} from {} ({}, `go {}`)",
        binary.name,
        module.version,
        module.path,
        binary.why,
        if binary.test_binary {
            "test -c"
        } else {
            "build"
        }
    ));
}

/// Builds `binary` into `out_dir`, checks its version, then writes the stamp.
fn build(binary: &Binary, wrapper: &Path, out_dir: &Path, recipe: &str) -> Result<()> {
    let module = binary.module;
    std::fs::create_dir_all(out_dir)
        .with_context(|| format!("cannot create {}", out_dir.display()))?;
    let stamp = out_dir.join("stamp");
    let _ = std::fs::remove_file(&stamp);
    let tmp = out_dir.join(format!("{}.new", binary.name));
    let started = Instant::now();
    util::run(go(wrapper).args(build_args(binary, &tmp)))?;
    let secs = started.elapsed().as_secs_f64();
    let shown = output(Command::new(&tmp).args(binary.version_args)).unwrap_or_default();
    let wanted = expand(binary.version_shown, module.version);
    if !shown.contains(&wanted) {
        bail!(
            "{} {} does not report its version: `{} {}` printed {shown:?}, expected {:?}",
            binary.name,
            module.version,
            tmp.display(),
            binary.version_args.join(" "),
            wanted
        );
    }
    let exe = out_dir.join(binary.name);
    std::fs::rename(&tmp, &exe).with_context(|| format!("cannot rename to {}", exe.display()))?;
    std::fs::write(&stamp, recipe).with_context(|| format!("cannot write {}", stamp.display()))?;
    let size = std::fs::metadata(&exe)?.len();
    info(&format!(
        "built {} {} in {secs:.0} s ({:.0} MiB): {}",
        binary.name,
        module.version,
        size as f64 / (1 << 20) as f64,
        exe.display()
    ));
    Ok(())
}

/// Points `.tools/go/bin/<name>` at the versioned binary (a relative link,
/// replaced atomically).
fn link(dir: &Path, binary: &Binary) -> Result<()> {
    let bin = dir.join("bin");
    let target = PathBuf::from(format!(
        "../{}-{}/{}",
        binary.name, binary.module.version, binary.name
    ));
    let link = bin.join(binary.name);
    if std::fs::read_link(&link).ok().as_deref() == Some(target.as_path()) {
        return Ok(());
    }
    std::fs::create_dir_all(&bin).with_context(|| format!("cannot create {}", bin.display()))?;
    let tmp = bin.join(format!(".{}.link", binary.name));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&target, &tmp)
        .with_context(|| format!("cannot create {}", tmp.display()))?;
    std::fs::rename(&tmp, &link).with_context(|| format!("cannot replace {}", link.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const UPSTREAM: &str = "module k8s.io/kubernetes\n\ngo 1.26.0\n\nrequire (\n\
        \tgithub.com/foo/bar v1.2.3\n\
        \tk8s.io/api v0.0.0\n\
        \tk8s.io/kube-openapi v0.0.0-20260721132016-d427ff9ee9ad\n\
        \tk8s.io/sample-apiserver v0.0.0\n\
        )\n\nrequire k8s.io/utils v0.0.0 // indirect\n\nreplace (\n\
        \tk8s.io/api => ./staging/src/k8s.io/api\n\
        \tk8s.io/sample-apiserver => ./staging/src/k8s.io/sample-apiserver\n\
        \tk8s.io/sample-cli-plugin => ./staging/src/k8s.io/sample-cli-plugin\n\
        \tgithub.com/foo/baz => github.com/foo/baz v1.0.0\n\
        )\n";

    #[test]
    fn staging_modules_required_upstream_are_required_and_replaced_at_their_version() {
        let text = staging_requires(UPSTREAM, "v1.37.2").unwrap();
        assert_eq!(
            text,
            "\nrequire (\n\tk8s.io/api v0.37.2\n\tk8s.io/sample-apiserver v0.37.2\n)\n\n\
             replace (\n\tk8s.io/api => k8s.io/api v0.37.2\n\
             \tk8s.io/sample-apiserver => k8s.io/sample-apiserver v0.37.2\n)\n"
        );
    }

    #[test]
    fn a_go_mod_without_staging_modules_is_an_error() {
        let err = staging_requires("module k8s.io/kubernetes\n", "v1.37.2").unwrap_err();
        assert!(
            err.to_string().contains("requires no staging module"),
            "{err}"
        );
        let err = staging_requires(UPSTREAM, "1.37.2").unwrap_err();
        assert!(err.to_string().contains("1.37.2"), "{err}");
    }

    #[test]
    fn templates_take_the_version_as_tagged_without_v_and_its_numbers() {
        assert_eq!(
            expand("{v} {n} {major}.{minor} x", "v1.37.2"),
            "v1.37.2 1.37.2 1.37 x"
        );
        assert_eq!(expand("etcd Version: {n}", "v3.7.3"), "etcd Version: 3.7.3");
    }

    #[test]
    fn the_recipe_names_the_version_and_every_flag() {
        let r = recipe(&BINARIES[0]);
        assert!(r.contains("module k8s.io/kubernetes v1.37.2\n"), "{r}");
        assert!(
            r.contains("-X k8s.io/component-base/version.gitVersion=v1.37.2"),
            "{r}"
        );
        assert!(
            r.contains("-X k8s.io/component-base/version.gitMinor=37 "),
            "{r}"
        );
        assert!(r.contains("env CGO_ENABLED=0 GOTOOLCHAIN=local\n"), "{r}");
        let critest = BINARIES.iter().find(|b| b.name == "critest").unwrap();
        assert!(
            recipe(critest).contains("command test -c -trimpath"),
            "{critest:?}",
            critest = recipe(critest)
        );
    }
}
