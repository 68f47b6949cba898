//! A private image registry for tests, so that the agent's `PullImage` calls
//! really pull: Debian's `docker-registry` (distribution 2.8) on 127.0.0.1 with
//! a port the kernel picks, its storage, configuration and logs in one
//! directory, and the harness's locally built OCI images pushed into it with
//! `skopeo copy` (plain http on loopback).
//!
//! [`Registry::start`] writes the configuration, starts the registry, reads the
//! port it listens on from its log and waits until `/v2/` answers.
//! [`Registry::configure_containerd`] writes the `hosts.toml` that lets
//! containerd's CRI plugin pull from it over plain http (under the harness's
//! private `certs.d`, never the system's). The access log (the registry's
//! stdout) tells which requests it served after the pushes:
//! [`Registry::manifest_requests`] counts the resolutions of a tag, one per
//! pull (containerd 1.6: `HEAD /v2/<repo>/manifests/<tag>`, then the manifest
//! and blobs by digest). Dropping it (also while a
//! test panics) stops the registry by its pid and removes its directory.
//!
//! [`Registry::start_with_auth`] turns distribution's basic authentication
//! on ([`BasicAuth`]: an htpasswd file with one bcrypt entry): every request
//! without the user's credentials, `/v2/` included, is answered 401, as a
//! private registry does; the pushes carry the credentials. A kubelet node
//! pulls from real registries over TLS; here it is plain http on loopback.

use std::fs;
use std::io::{self, Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The registry binary of Debian's `docker-registry` package.
pub const DOCKER_REGISTRY: &str = "/usr/bin/docker-registry";
/// skopeo, which pushes the images.
pub const SKOPEO: &str = "/usr/bin/skopeo";

/// How long the registry may take to listen and answer `/v2/`.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long it may take to exit after SIGTERM before it gets SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// The bound of one HTTP exchange with it.
const HTTP_TIMEOUT: Duration = Duration::from_secs(2);

/// An error of the registry harness; each names the path, command or address.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// A program is not installed.
    #[error(
        "missing {path}: install it with `apt-get install {package}` (or run `cargo xtask setup`)"
    )]
    MissingTool {
        /// The program's path.
        path: &'static str,
        /// The Debian package that has it.
        package: &'static str,
    },
    /// A file system operation failed.
    #[error("cannot {action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// Why it failed.
        source: io::Error,
    },
    /// A command could not be run or exited with an error.
    #[error("`{command}` failed: {detail}")]
    Command {
        /// The command line.
        command: String,
        /// Exit status and the end of its output, or why it did not run.
        detail: String,
    },
    /// The registry exited while starting.
    #[error(
        "docker-registry serve {config} exited while starting ({status}); end of {log}:\n{tail}"
    )]
    Exited {
        /// Its configuration file.
        config: PathBuf,
        /// Its exit status.
        status: String,
        /// Its log file.
        log: PathBuf,
        /// The end of its log.
        tail: String,
    },
    /// The registry did not listen or answer `/v2/` in time.
    #[error(
        "docker-registry serve {config} did not answer GET /v2/ within {timeout:?} ({detail}); end of {log}:\n{tail}"
    )]
    NotReady {
        /// Its configuration file.
        config: PathBuf,
        /// How long the harness waited.
        timeout: Duration,
        /// The address it listened on, or that it did not say.
        detail: String,
        /// Its log file.
        log: PathBuf,
        /// The end of its log.
        tail: String,
    },
}

type Result<T, E = RegistryError> = std::result::Result<T, E>;

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> RegistryError {
    let path = path.to_path_buf();
    move |source| RegistryError::Io {
        action,
        path,
        source,
    }
}

/// A registry user for [`Registry::start_with_auth`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BasicAuth {
    pub user: &'static str,
    pub password: &'static str,
    /// `password`'s bcrypt hash, distribution's only htpasswd format.
    pub bcrypt: &'static str,
}

/// The test user: the hash was made once with crypt(3)'s bcrypt
/// (`$2b$`, cost 5); a wrong hash fails every authenticated pull.
pub const TEST_USER: BasicAuth = BasicAuth {
    user: "puller",
    password: "evpleg-pull-s3cret",
    bcrypt: "$2b$05$kMHgCeCCAP1sf4J73B.W6uo/NcP04C8ah9yn4t.bxgnz2FdaFGoAG",
};

impl BasicAuth {
    /// `user:password` in base64: the value of an `Authorization: Basic`
    /// header and of a docker configuration's `auth`.
    pub fn basic(&self) -> String {
        let bytes =
            k8s_openapi::ByteString(format!("{}:{}", self.user, self.password).into_bytes());
        match serde_json::to_value(bytes) {
            Ok(serde_json::Value::String(s)) => s,
            other => unreachable!("a ByteString serialises as a string, not {other:?}"),
        }
    }
}

/// A private `docker-registry` on loopback. See the module documentation.
#[derive(Debug)]
pub struct Registry {
    dir: PathBuf,
    auth: Option<BasicAuth>,
    child: Option<Child>,
    addr: SocketAddr,
    /// Access log lines written up to the end of the last push.
    pushed_lines: AtomicUsize,
}

impl Registry {
    /// Starts a registry whose storage, configuration and logs are in `dir`
    /// (created; removed on drop), on 127.0.0.1 with a port the kernel picks,
    /// and waits until `GET /v2/` answers 200.
    pub fn start(dir: &Path) -> Result<Registry> {
        Self::start_with(dir, None)
    }

    /// [`Registry::start`] with basic authentication on: only `auth`'s
    /// user is served; `/v2/` answering 401 without credentials and 200
    /// with them is the readiness.
    pub fn start_with_auth(dir: &Path, auth: BasicAuth) -> Result<Registry> {
        Self::start_with(dir, Some(auth))
    }

    fn start_with(dir: &Path, auth: Option<BasicAuth>) -> Result<Registry> {
        for (path, package) in [(DOCKER_REGISTRY, "docker-registry"), (SKOPEO, "skopeo")] {
            if !Path::new(path).exists() {
                return Err(RegistryError::MissingTool { path, package });
            }
        }
        fs::create_dir_all(dir.join("storage")).map_err(io_err("create", dir))?;
        let config = dir.join("config.yml");
        let mut yml = config_yml(dir);
        if let Some(a) = auth {
            let htpasswd = dir.join("htpasswd");
            fs::write(&htpasswd, format!("{}:{}\n", a.user, a.bcrypt))
                .map_err(io_err("write", &htpasswd))?;
            yml.push_str(&format!(
                "auth:\n  htpasswd:\n    realm: evpleg-test\n    path: {}\n",
                htpasswd.display()
            ));
        }
        fs::write(&config, yml).map_err(io_err("write", &config))?;
        let open = |name: &str| {
            let path = dir.join(name);
            fs::File::create(&path).map_err(io_err("create", &path))
        };
        let (access, log) = (open("access.log")?, open("registry.log")?);
        let child = Command::new(DOCKER_REGISTRY)
            .arg("serve")
            .arg(&config)
            .stdin(Stdio::null())
            // distribution writes its access log to stdout, the rest to stderr.
            .stdout(access)
            .stderr(log)
            .spawn()
            .map_err(|e| RegistryError::Command {
                command: format!("{DOCKER_REGISTRY} serve {}", config.display()),
                detail: e.to_string(),
            })?;
        let mut this = Registry {
            dir: dir.to_path_buf(),
            auth,
            child: Some(child),
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            pushed_lines: AtomicUsize::new(0),
        };
        let started = Instant::now();
        this.wait_ready()?;
        tracing::info!(addr = %this.addr, dir = %dir.display(), elapsed = ?started.elapsed(), "registry: answering /v2/");
        Ok(this)
    }

    /// `127.0.0.1:<port>`, the registry host part of image references.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// The reference of `repo:tag` in this registry, e.g.
    /// `127.0.0.1:40123/evpleg/busybox:v1`.
    pub fn image(&self, repo: &str, tag: &str) -> String {
        format!("{}/{repo}:{tag}", self.host())
    }

    /// The directory holding its configuration, storage and logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The access log (one line per request, combined log format).
    pub fn access_log_path(&self) -> PathBuf {
        self.dir.join("access.log")
    }

    /// Pushes the OCI image archive `archive` (an OCI layout in a tar, its image
    /// tagged `source_tag`) as `repo:tag` with `skopeo copy` over plain http.
    pub fn push(&self, archive: &Path, source_tag: &str, repo: &str, tag: &str) -> Result<()> {
        let started = Instant::now();
        let tmp = self.dir.join("skopeo-tmp");
        fs::create_dir_all(&tmp).map_err(io_err("create", &tmp))?;
        let mut cmd = Command::new(SKOPEO);
        cmd.env("TMPDIR", &tmp)
            // No signature policy from /etc/containers: nothing is verified here.
            .args([
                "--insecure-policy",
                "copy",
                "--quiet",
                "--dest-tls-verify=false",
            ])
            .args(
                self.auth
                    .map(|a| format!("--dest-creds={}:{}", a.user, a.password)),
            )
            .arg(format!("oci-archive:{}:{source_tag}", archive.display()))
            .arg(format!("docker://{}", self.image(repo, tag)));
        run(&mut cmd)?;
        self.pushed_lines
            .store(self.access_log().lines().count(), Ordering::SeqCst);
        tracing::info!(image = self.image(repo, tag), elapsed = ?started.elapsed(), "registry: pushed");
        Ok(())
    }

    /// Writes `<certs_dir>/<host:port>/hosts.toml`, telling containerd (whose
    /// CRI plugin has `registry.config_path = certs_dir`) to pull from this
    /// registry over plain http.
    pub fn configure_containerd(&self, certs_dir: &Path) -> Result<()> {
        let dir = certs_dir.join(self.host());
        fs::create_dir_all(&dir).map_err(io_err("create", &dir))?;
        let path = dir.join("hosts.toml");
        fs::write(&path, hosts_toml(self.addr)).map_err(io_err("write", &path))
    }

    /// Writes `<certs_dir>/<name>/hosts.toml`, telling containerd to pull
    /// images named `<name>/<repo>:<tag>` (e.g. `registry.k8s.io/pause:3.9`)
    /// from this registry's `<repo>:<tag>` over plain http, and never from
    /// `name` itself: the images a suite pulls under their upstream names,
    /// served locally.
    pub fn mirror_in_containerd(&self, certs_dir: &Path, name: &str) -> Result<()> {
        let dir = certs_dir.join(name);
        fs::create_dir_all(&dir).map_err(io_err("create", &dir))?;
        let path = dir.join("hosts.toml");
        fs::write(&path, hosts_toml(self.addr)).map_err(io_err("write", &path))
    }

    /// The requests the registry served since the last [`push`](Self::push)
    /// ended (the pulls): `(method, path, status)`.
    pub fn requests(&self) -> Vec<(String, String, u16)> {
        self.access_log()
            .lines()
            .skip(self.pushed_lines.load(Ordering::SeqCst))
            .filter_map(parse_access_line)
            .collect()
    }

    fn access_log(&self) -> String {
        fs::read_to_string(self.access_log_path()).unwrap_or_default()
    }

    /// How many times since the last push the tag (or digest) `reference` of
    /// `repo` was resolved
    /// (`HEAD` or `GET /v2/<repo>/manifests/<reference>`), whatever the answer:
    /// containerd resolves the tag once per pull.
    pub fn manifest_requests(&self, repo: &str, reference: &str) -> usize {
        let path = format!("/v2/{repo}/manifests/{reference}");
        self.requests()
            .iter()
            .filter(|(method, p, _)| (method == "HEAD" || method == "GET") && *p == path)
            .count()
    }

    /// How many requests since the last push concerned `repo` at all
    /// (manifests and blobs).
    pub fn repo_requests(&self, repo: &str) -> usize {
        let prefix = format!("/v2/{repo}/");
        self.requests()
            .iter()
            .filter(|(_, p, _)| p.starts_with(&prefix))
            .count()
    }

    /// Reads the port from the log (`listening on 127.0.0.1:<port>`), then polls
    /// `GET /v2/` until it answers 200, the registry exits or the bound passes.
    fn wait_ready(&mut self) -> Result<()> {
        let config = self.dir.join("config.yml");
        let log = self.dir.join("registry.log");
        let deadline = Instant::now() + START_TIMEOUT;
        let mut detail = String::from("it did not log the address it listens on");
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.child = None;
                return Err(RegistryError::Exited {
                    config,
                    status: status.to_string(),
                    tail: tail(&log),
                    log,
                });
            }
            if self.addr.port() == 0
                && let Some(addr) = listening_addr(&fs::read_to_string(&log).unwrap_or_default())
            {
                self.addr = addr;
            }
            if self.addr.port() != 0 {
                let with = self.auth.map(|a| a.basic());
                let answer = http_status(self.addr, "GET", "/v2/", with.as_deref());
                // With authentication on, a request without credentials is refused.
                let unauthenticated = self
                    .auth
                    .map(|_| http_status(self.addr, "GET", "/v2/", None));
                let url = format!("http://{}/v2/", self.addr);
                match (answer, unauthenticated) {
                    (Ok(200), None | Some(Ok(401))) => return Ok(()),
                    (Ok(200), Some(Ok(status))) => {
                        detail = format!("GET {url} without credentials: {status}")
                    }
                    (Ok(200), Some(Err(e))) => {
                        detail = format!("GET {url} without credentials: {e}")
                    }
                    (Ok(status), _) => detail = format!("GET {url}: {status}"),
                    (Err(e), _) => detail = format!("GET {url}: {e}"),
                }
            }
            if Instant::now() > deadline {
                return Err(RegistryError::NotReady {
                    config,
                    timeout: START_TIMEOUT,
                    detail,
                    tail: tail(&log),
                    log,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = child.id();
        if let Ok(pid) = libc::pid_t::try_from(pid) {
            // SAFETY: kill has no memory-safety preconditions; the pid is our
            // child's, not yet waited for.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => {
                    tracing::info!(pid, %status, "registry: stopped");
                    return;
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                _ => {
                    tracing::warn!(pid, "registry: no exit after SIGTERM; SIGKILL");
                    let _ = child.kill();
                    let _ = child.wait();
                    return;
                }
            }
        }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop();
        match fs::remove_dir_all(&self.dir) {
            Ok(()) => tracing::info!(dir = %self.dir.display(), "registry: removed"),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(dir = %self.dir.display(), "registry: cannot remove: {e}"),
        }
    }
}

/// The registry's configuration: loopback only, a port the kernel picks,
/// storage under `dir`, access log on.
fn config_yml(dir: &Path) -> String {
    format!(
        "# Written by evpleg's test harness (tests/src/registry.rs).
version: 0.1
log:
  level: info
  accesslog:
    disabled: false
storage:
  filesystem:
    rootdirectory: {}/storage
  delete:
    enabled: true
http:
  addr: 127.0.0.1:0
  secret: evpleg-test-registry
",
        dir.display()
    )
}

/// containerd's `hosts.toml` for a plain-http registry at `addr`.
fn hosts_toml(addr: SocketAddr) -> String {
    format!(
        "# Written by evpleg's test harness (tests/src/registry.rs).
server = \"http://{addr}\"

[host.\"http://{addr}\"]
  capabilities = [\"pull\", \"resolve\"]
  skip_verify = true
"
    )
}

/// The address of distribution's `listening on <addr>` log line.
fn listening_addr(log: &str) -> Option<SocketAddr> {
    log.lines().find_map(|l| {
        let rest = &l[l.find("listening on ")? + "listening on ".len()..];
        rest.split(|c: char| c == '"' || c.is_whitespace())
            .next()?
            .parse()
            .ok()
    })
}

/// `(method, path, status)` of one combined-log-format line:
/// `127.0.0.1 - - [date] "HEAD /v2/x/manifests/v1 HTTP/1.1" 200 0 "" "agent"`.
fn parse_access_line(line: &str) -> Option<(String, String, u16)> {
    let mut quoted = line.split('"');
    let _ = quoted.next()?;
    let request = quoted.next()?;
    let status = quoted.next()?.split_whitespace().next()?.parse().ok()?;
    let mut parts = request.split_whitespace();
    let method = parts.next()?.to_owned();
    let path = parts.next()?.to_owned();
    Some((method, path, status))
}

/// One HTTP/1.1 exchange; returns the response's status code.
fn http_status(addr: SocketAddr, method: &str, path: &str, basic: Option<&str>) -> io::Result<u16> {
    let mut s = TcpStream::connect_timeout(&addr, HTTP_TIMEOUT)?;
    s.set_read_timeout(Some(HTTP_TIMEOUT))?;
    s.set_write_timeout(Some(HTTP_TIMEOUT))?;
    let auth = basic.map_or(String::new(), |b| format!("Authorization: Basic {b}\r\n"));
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n"
    )?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head)?;
    std::str::from_utf8(&head[9..12])
        .ok()
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "not an HTTP/1.1 response"))
}

/// The last lines of a log file, for error messages.
fn tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_else(|e| format!("(cannot read: {e})"));
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Runs `cmd` to completion; an error names it, with its status and output.
fn run(cmd: &mut Command) -> Result<()> {
    let line = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| RegistryError::Command {
            command: line.clone(),
            detail: e.to_string(),
        })?;
    if !out.status.success() {
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let lines: Vec<&str> = text.lines().collect();
        return Err(RegistryError::Command {
            command: line,
            detail: format!(
                "{}: {}",
                out.status,
                lines[lines.len().saturating_sub(10)..].join("\n")
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listening_address_is_read_from_the_log() {
        let log = "time=\"x\" level=info msg=\"redis not configured\"\n\
                   time=\"x\" level=info msg=\"listening on 127.0.0.1:39527\" go.version=go1.19.8\n";
        assert_eq!(
            listening_addr(log),
            Some(SocketAddr::from(([127, 0, 0, 1], 39527)))
        );
        assert_eq!(listening_addr("level=info msg=\"starting\"\n"), None);
    }

    #[test]
    fn access_lines_are_parsed() {
        let line = "127.0.0.1 - - [01/Dec/2026:00:54:02 +0000] \"HEAD /v2/evpleg/busybox/manifests/v1 HTTP/1.1\" 200 0 \"\" \"containerd/1.6.20\"";
        assert_eq!(
            parse_access_line(line),
            Some((
                "HEAD".to_owned(),
                "/v2/evpleg/busybox/manifests/v1".to_owned(),
                200
            ))
        );
        assert_eq!(parse_access_line("time=x level=info msg=y"), None);
    }

    #[test]
    fn containerd_is_told_plain_http_on_loopback() {
        let toml = hosts_toml(SocketAddr::from(([127, 0, 0, 1], 5001)));
        assert!(
            toml.contains("server = \"http://127.0.0.1:5001\""),
            "{toml}"
        );
        assert!(toml.contains("[host.\"http://127.0.0.1:5001\"]"), "{toml}");
        let config = config_yml(Path::new("/tmp/evpleg-r"));
        assert!(config.contains("addr: 127.0.0.1:0"), "{config}");
        assert!(
            config.contains("rootdirectory: /tmp/evpleg-r/storage"),
            "{config}"
        );
    }

    #[test]
    fn errors_name_what_failed() {
        let e = RegistryError::MissingTool {
            path: SKOPEO,
            package: "skopeo",
        };
        assert_eq!(
            e.to_string(),
            "missing /usr/bin/skopeo: install it with `apt-get install skopeo` (or run `cargo xtask setup`)"
        );
        let e = io_err("create", Path::new("/nope"))(io::Error::from(io::ErrorKind::NotFound));
        assert_eq!(e.to_string(), "cannot create /nope: entity not found");
    }
}
