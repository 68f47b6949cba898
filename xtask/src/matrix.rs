//! The kernel matrix (docs/kernels.md): the kernel PLEG's privileged checks inside
//! QEMU guests booting Debian's kernels, after the host tests of `cargo xtask test`
//! or alone with `cargo xtask matrix`.
//!
//! 1. Each kernel of [`KERNELS`] is fetched once with `apt-get download` (bookworm
//!    from the system's apt sources; trixie and its backports through a private
//!    apt configuration under `.cache/apt/trixie`, the system's apt untouched) and
//!    only its image is kept: `.cache/kernels/<series>/vmlinuz`. Once there, no
//!    network is needed.
//! 2. The probe (`tests/kernel-probe`, the agent's loader, reader and container
//!    index with the eBPF object embedded) is built as `cargo test --workspace`
//!    builds it ([`build_probe`]): same target dir, profile, flags and features,
//!    dynamically linked, so it reuses the test build's dependencies.
//! 3. An initramfs holds busybox-static, the probe (debug info stripped), the
//!    shared libraries and the dynamic loader it needs at their host paths, and an
//!    `/init` that mounts what the probe needs, runs it with its output on the
//!    second serial port and powers off. It is cached by the hash of its inputs
//!    (the files and their paths) under `target/kernel-matrix`.
//! 4. The guests boot under software emulation (KVM does not run these kernels
//!    here), at most [`PARALLEL_GUESTS`] at a time, each killed after the timeout.
//!    The probe prints `RESULT <check> PASS|FAIL|ABSENT <detail>` lines and a final
//!    `DONE <passed> <failed>`; any FAIL, or no DONE, fails the command with the
//!    kernel and the check named, the check's full message (the verifier's log for
//!    a rejected program) and the end of the guest's console. A guest whose kernel
//!    panicked while booting, before its `/init` ran (so before anything of
//!    evpleg ran: 6.18.15 once panicked in `inet_init` under emulation, 1 boot in
//!    dozens), is booted once more; the table marks the kernel and the report
//!    names the panic ([`panicked_before_init`]). A panic after `/init` started
//!    is never retried.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::fs;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Component, Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::str::FromStr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::util::{self, info, output, step};

/// Where a kernel package comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Archive {
    /// bookworm (and bookworm-security), from the system's own apt sources.
    System,
    /// trixie, trixie-security and trixie-backports, through the private apt
    /// configuration ([`TRIXIE_SOURCES`]).
    Trixie,
}

/// One kernel of the matrix: a Debian package and the image inside it.
#[derive(Debug)]
pub struct Kernel {
    /// What `--kernels` selects, and the cache directory's name.
    pub series: &'static str,
    pub archive: Archive,
    pub package: &'static str,
    pub version: &'static str,
    /// The image's path inside the package.
    pub image: &'static str,
}

/// The matrix: the newest Debian build of each series when this table was last
/// updated (`apt-cache madison <package>`; for trixie with the private
/// configuration's `-o` options, see [`Apt::private`]). Debian removes superseded
/// builds from the archive: a cached image keeps working, a fresh machine then
/// needs this table updated to the series' current build.
pub const KERNELS: [Kernel; 5] = [
    Kernel {
        series: "6.1",
        archive: Archive::System,
        package: "linux-image-6.1.0-56-amd64",
        version: "6.1.192-2",
        image: "./boot/vmlinuz-6.1.0-56-amd64",
    },
    Kernel {
        series: "6.12",
        archive: Archive::System,
        package: "linux-image-6.12.117+deb12-amd64",
        version: "6.12.117-1~deb12u1",
        image: "./boot/vmlinuz-6.12.117+deb12-amd64",
    },
    Kernel {
        series: "6.16",
        archive: Archive::Trixie,
        package: "linux-image-6.16.12+deb13-amd64",
        version: "6.16.12-1~bpo13+1",
        image: "./boot/vmlinuz-6.16.12+deb13-amd64",
    },
    Kernel {
        series: "6.18",
        archive: Archive::Trixie,
        package: "linux-image-6.18.15+deb13-amd64",
        version: "6.18.15-1~bpo13+1",
        image: "./boot/vmlinuz-6.18.15+deb13-amd64",
    },
    // From 7.x the image is in its own package; linux-image-* only depends on it.
    Kernel {
        series: "7.3",
        archive: Archive::Trixie,
        package: "linux-binary-7.3.4+deb13-amd64",
        version: "7.3.4-1~bpo13+1",
        image: "./usr/lib/modules/7.3.4+deb13-amd64/vmlinuz",
    },
];

/// The private apt configuration's sources (Debian's keyring package on bookworm
/// carries the trixie keys).
const TRIXIE_SOURCES: &str = "\
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie-backports main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian-security trixie-security main
";

/// Guests at a time.
pub const PARALLEL_GUESTS: usize = 2;
/// Emulated CPUs per guest: two, so that threads of one process exit on two CPUs
/// at once (the race of the exit program's last-thread decision).
const GUEST_CPUS: &str = "2";
/// Checks every guest must report (PASS, or ABSENT with a reason): a probe that
/// skipped one, e.g. the multi-threaded ones, fails the kernel.
const REQUIRED_CHECKS: [&str; 3] = ["load", "exit_group_from_thread", "leader_exits_first"];
/// Per guest; a full run takes well under a minute here.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(240);
/// A Rust binary plus the guest kernel: 128 MiB is tight.
const GUEST_MEMORY: &str = "256M";
const KERNEL_CMDLINE: &str = "console=ttyS0 panic=-1 quiet";
const BUSYBOX: &str = "/bin/busybox";
const APPLETS: [&str; 14] = [
    "sh", "true", "false", "sleep", "dd", "mount", "umount", "poweroff", "cat", "echo", "mkdir",
    "rmdir", "ls", "swapoff",
];
const PROBE_PACKAGE: &str = "evpleg-kernel-probe";
/// Where the probe is in the initramfs (the init runs it from there).
const PROBE_IN_INITRAMFS: &str = "evpleg-kernel-probe";
/// Symbolic links followed from one library path before giving up.
const MAX_SYMLINKS: usize = 40;
/// Lines of the console shown when a guest fails (a quarter of them when the
/// probe finished).
const CONSOLE_TAIL: usize = 40;
/// Lines of a failed check's message (a verifier's log) shown: the start and end.
const LOG_HEAD: usize = 10;
const LOG_TAIL: usize = 30;

/// Which kernels `--kernels` selected: `all`, `none` or a comma-separated list of
/// series.
#[derive(Clone, Debug)]
pub struct Selection(Vec<&'static Kernel>);

impl FromStr for Selection {
    type Err = String;

    fn from_str(spec: &str) -> Result<Self, String> {
        match spec.trim() {
            "all" => return Ok(Self(KERNELS.iter().collect())),
            "none" => return Ok(Self(Vec::new())),
            _ => {}
        }
        let mut chosen: Vec<&'static Kernel> = Vec::new();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let kernel = KERNELS.iter().find(|k| k.series == item).ok_or_else(|| {
                format!(
                    "unknown kernel {item:?}: use all, none or a comma-separated list of {}",
                    series_list(KERNELS.iter())
                )
            })?;
            if !chosen.iter().any(|k| k.series == kernel.series) {
                chosen.push(kernel);
            }
        }
        if chosen.is_empty() {
            return Err("no kernel given: use all, none or e.g. 6.1,6.18".to_owned());
        }
        // The table's order, whatever the order given.
        chosen.sort_by_key(|k| KERNELS.iter().position(|x| x.series == k.series));
        Ok(Self(chosen))
    }
}

impl Selection {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

fn series_list<'a>(kernels: impl Iterator<Item = &'a Kernel>) -> String {
    kernels.map(|k| k.series).collect::<Vec<_>>().join(", ")
}

/// How to run the matrix.
#[derive(Debug)]
pub struct Options {
    pub kernels: Selection,
    /// Load this object in the guests instead of the probe's embedded one.
    pub bpf_object: Option<PathBuf>,
    pub timeout: Duration,
}

/// Fetches, builds and runs; fails naming every failed kernel and check.
pub fn run(root: &Path, options: &Options) -> Result<()> {
    if options.kernels.is_empty() {
        step("kernel matrix: skipped (--kernels none)");
        return Ok(());
    }
    let kernels = &options.kernels.0;
    let started = Instant::now();
    step(&format!(
        "kernel matrix: {} under QEMU (docs/kernels.md)",
        series_list(kernels.iter().copied())
    ));
    check_tools()?;
    let mut images = Vec::new();
    for kernel in kernels {
        images.push(ensure_image(root, kernel)?);
    }
    info(&format!(
        "kernel images ready after {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    let building = Instant::now();
    let probe = build_probe(root)?;
    let initramfs = build_initramfs(root, &probe, options.bpf_object.as_deref())?;
    info(&format!(
        "probe and initramfs ready in {:.1} s",
        building.elapsed().as_secs_f64()
    ));
    step(&format!(
        "kernel matrix: booting {} guest(s), {PARALLEL_GUESTS} at a time, {} s timeout each",
        kernels.len(),
        options.timeout.as_secs()
    ));
    let runs = run_guests(root, kernels, &images, &initramfs, options.timeout)?;
    let total = started.elapsed();
    let summary = summary(&runs, total, options.bpf_object.as_deref());
    eprint!("{summary}");
    let out = out_dir(root).join("summary.md");
    fs::write(&out, &summary).with_context(|| format!("cannot write {}", out.display()))?;
    let failures: Vec<String> = runs.iter().flat_map(GuestRun::failures).collect();
    if failures.is_empty() {
        info(&format!(
            "kernel matrix passed in {:.0} s (summary: {})",
            total.as_secs_f64(),
            out.display()
        ));
        return Ok(());
    }
    for run in runs.iter().filter(|r| !r.failures().is_empty()) {
        run.print_diagnosis();
    }
    bail!("kernel matrix failed:\n  {}", failures.join("\n  "))
}

fn out_dir(root: &Path) -> PathBuf {
    root.join("target/kernel-matrix")
}

fn check_tools() -> Result<()> {
    let mut missing = Vec::new();
    for (tool, package) in [
        ("qemu-system-x86_64", "qemu-system-x86"),
        ("cpio", "cpio"),
        ("gzip", "gzip"),
        ("dpkg-deb", "dpkg"),
        ("tar", "tar"),
        ("apt-get", "apt"),
        ("ldd", "libc-bin"),
        ("strip", "binutils"),
        ("chroot", "coreutils"),
    ] {
        if output(Command::new("sh").args(["-c", &format!("command -v {tool}")])).is_none() {
            missing.push(format!("{tool} (package {package})"));
        }
    }
    if !Path::new(BUSYBOX).is_file() {
        missing.push(format!("{BUSYBOX} (package busybox-static)"));
    }
    if !missing.is_empty() {
        bail!(
            "the kernel matrix needs {}: install them (`cargo xtask setup` installs \
             QEMU, cpio and busybox-static)",
            missing.join(", ")
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Kernel images

/// apt with either the system's configuration or the project's private one.
struct Apt {
    options: Vec<String>,
    name: &'static str,
}

impl Apt {
    fn system() -> Self {
        Self {
            options: Vec::new(),
            name: "the system's apt sources (bookworm)",
        }
    }

    /// A private configuration: sources list, package lists and caches under
    /// `.cache/apt/<name>`, so the system's apt stays untouched.
    fn private(root: &Path, name: &str, sources_text: &str, label: &'static str) -> Result<Self> {
        let dir = root.join(".cache/apt").join(name);
        for sub in ["sources.list.d", "lists/partial", "cache/archives/partial"] {
            fs::create_dir_all(dir.join(sub))
                .with_context(|| format!("cannot create {}", dir.join(sub).display()))?;
        }
        let sources = dir.join("sources.list");
        if fs::read_to_string(&sources).ok().as_deref() != Some(sources_text) {
            fs::write(&sources, sources_text)
                .with_context(|| format!("cannot write {}", sources.display()))?;
        }
        let opt = |k: &str, v: &Path| format!("{k}={}", v.display());
        Ok(Self {
            options: vec![
                opt("Dir::Etc::SourceList", &sources),
                opt("Dir::Etc::SourceParts", &dir.join("sources.list.d")),
                opt("Dir::State::Lists", &dir.join("lists")),
                opt("Dir::Cache", &dir.join("cache")),
                // Its directories belong to root, not to apt's _apt user.
                "APT::Sandbox::User=root".to_owned(),
            ],
            name: label,
        })
    }

    fn for_archive(root: &Path, archive: Archive) -> Result<Self> {
        match archive {
            Archive::System => Ok(Self::system()),
            Archive::Trixie => Self::private(
                root,
                "trixie",
                TRIXIE_SOURCES,
                "the private apt configuration (trixie, trixie-backports)",
            ),
        }
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        for o in &self.options {
            cmd.args(["-o", o]);
        }
        cmd
    }

    /// Whether the package lists know `package` at `version`.
    fn knows(&self, kernel: &Kernel) -> bool {
        let mut cmd = self.command("apt-cache");
        cmd.args(["madison", kernel.package]);
        output(&mut cmd).is_some_and(|out| {
            out.lines()
                .any(|l| l.split('|').nth(1).map(str::trim) == Some(kernel.version))
        })
    }

    fn update(&self) -> Result<()> {
        info(&format!("apt-get update with {}", self.name));
        let mut cmd = self.command("apt-get");
        cmd.args(["update", "-q"]);
        util::run(&mut cmd)
    }
}

/// The kernel's image in the project's cache, fetched when missing or when the
/// table names another build; no network once cached.
fn ensure_image(root: &Path, kernel: &Kernel) -> Result<PathBuf> {
    let dir = root.join(".cache/kernels").join(kernel.series);
    let image = dir.join("vmlinuz");
    let stamp = dir.join("package");
    let wanted = format!("{} {}\n", kernel.package, kernel.version);
    if image.is_file() && fs::read_to_string(&stamp).ok().as_deref() == Some(wanted.as_str()) {
        info(&format!(
            "{}: cached {} ({} {})",
            kernel.series,
            image.display(),
            kernel.package,
            kernel.version
        ));
        return Ok(image);
    }
    info(&format!(
        "{}: fetching {} {} (apt-get download, once)",
        kernel.series, kernel.package, kernel.version
    ));
    let apt = Apt::for_archive(root, kernel.archive)?;
    if !apt.knows(kernel) {
        apt.update()?;
        if !apt.knows(kernel) {
            bail!(
                "{} {} is not in {}: Debian removed superseded builds. Find the series' \
                 current build with `apt-cache madison` (or `apt-cache search --names-only`) \
                 and update KERNELS in xtask/src/matrix.rs",
                kernel.package,
                kernel.version,
                apt.name
            );
        }
    }
    let download = dir.join("download");
    let _ = fs::remove_dir_all(&download);
    fs::create_dir_all(&download)
        .with_context(|| format!("cannot create {}", download.display()))?;
    let mut cmd = apt.command("apt-get");
    cmd.current_dir(&download)
        .args(["-q", "-o", "APT::Sandbox::User=root", "download"])
        .arg(format!("{}={}", kernel.package, kernel.version));
    util::run(&mut cmd)?;
    let deb = fs::read_dir(&download)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .with_context(|| format!("apt-get download left no .deb in {}", download.display()))?;
    // Only the image is extracted: the packages are 15-170 MB of modules.
    let mut dpkg = Command::new("dpkg-deb")
        .arg("--fsys-tarfile")
        .arg(&deb)
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot start dpkg-deb")?;
    let tar = Command::new("tar")
        .arg("-x")
        .arg("-C")
        .arg(&download)
        .arg(kernel.image)
        .stdin(dpkg.stdout.take().expect("piped"))
        .status()
        .context("cannot start tar")?;
    let dpkg = dpkg.wait()?;
    if !tar.success() || !dpkg.success() {
        bail!(
            "extracting {} from {} failed (tar: {tar}, dpkg-deb: {dpkg})",
            kernel.image,
            deb.display()
        );
    }
    fs::rename(download.join(kernel.image), &image)
        .with_context(|| format!("cannot move the image to {}", image.display()))?;
    fs::write(&stamp, wanted)?;
    fs::remove_dir_all(&download)?;
    info(&format!(
        "{}: {} ({} bytes)",
        kernel.series,
        image.display(),
        fs::metadata(&image)?.len()
    ));
    Ok(image)
}

// ---------------------------------------------------------------------------
// Probe and initramfs

/// Builds the probe with the test build: `cargo test --workspace --no-run`, the
/// command `cargo xtask test` runs its tests with, minus the run. The probe
/// package's integration test (`tests/kernel-probe/tests/probe_cli.rs`) makes
/// cargo build its binary there (the `test` profile, i.e. `dev` with its
/// per-package overrides; dynamically linked), so after `cargo xtask test`'s tests
/// this is a no-op, and on a fresh machine the probe is one more binary of that
/// build. A narrower command builds other variants of the same crates: `cargo
/// build -p evpleg-kernel-probe` resolves features for the probe alone (tokio
/// without the dev-dependencies' `test-util`: tokio and the 20-odd crates above
/// it again), and even `--workspace --test probe_cli` leaves out the test targets
/// that make cargo share the build scripts' dependencies (tempfile, rustix...) with
/// the target's, so prost-build, the CRI API crate, the agent and the test support
/// crate are built again. The binary embeds the eBPF object at
/// `target/ebpf/evpleg.bpf.o` (crates/pleg/build.rs), which the caller has built.
fn build_probe(root: &Path) -> Result<PathBuf> {
    step("kernel matrix: building the probe with the test build (cargo test --workspace --no-run)");
    let mut cmd = util::cargo(root);
    cmd.args(["test", "--workspace", "--no-run"])
        .arg("--message-format=json-render-diagnostics")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let out = cmd
        .output()
        .with_context(|| format!("cannot start {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", out.status);
    }
    let probe = String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(probe_executable)
        .with_context(|| {
            format!(
                "{cmd:?} built no {PROBE_PACKAGE} binary (its integration test, \
                 tests/kernel-probe/tests/probe_cli.rs, is what makes cargo build it)"
            )
        })?;
    let size = fs::metadata(&probe)
        .with_context(|| format!("cannot read {}", probe.display()))?
        .len();
    info(&format!("probe: {} ({} MiB)", probe.display(), size >> 20));
    Ok(probe)
}

/// The probe's binary in one line of cargo's JSON messages: the artifact whose
/// `executable` is named after the package (test harnesses are
/// `deps/<name>-<hash>`).
fn probe_executable(line: &str) -> Option<PathBuf> {
    if !line.contains(r#""reason":"compiler-artifact""#) {
        return None;
    }
    let start = line.find(r#""executable":""#)? + r#""executable":""#.len();
    let mut path = String::new();
    let mut chars = line[start..].chars();
    loop {
        match chars.next()? {
            '"' => break,
            '\\' => path.push(chars.next()?),
            c => path.push(c),
        }
    }
    let path = PathBuf::from(path);
    (path.file_name()? == PROBE_PACKAGE).then_some(path)
}

/// The dynamic loader a 64-bit little-endian x86-64 ELF file asks for (its
/// PT_INTERP program header): `Some(None)` for a static binary, `None` when it is
/// not such a file.
fn elf_interpreter(elf: &[u8]) -> Option<Option<String>> {
    fn u16_at(b: &[u8], at: usize) -> Option<usize> {
        Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?) as usize)
    }
    fn u32_at(b: &[u8], at: usize) -> Option<u32> {
        Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
    }
    fn u64_at(b: &[u8], at: usize) -> Option<usize> {
        usize::try_from(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?)).ok()
    }
    if elf.get(..6)? != b"\x7fELF\x02\x01" || u16_at(elf, 18)? != 62 {
        return None;
    }
    let (phoff, phentsize, phnum) = (u64_at(elf, 32)?, u16_at(elf, 54)?, u16_at(elf, 56)?);
    for i in 0..phnum {
        let header = phoff.checked_add(i.checked_mul(phentsize)?)?;
        if u32_at(elf, header)? == 3 {
            // p_offset and p_filesz; the path ends with a NUL.
            let (offset, size) = (u64_at(elf, header + 8)?, u64_at(elf, header + 32)?);
            let raw = elf.get(offset..offset.checked_add(size)?)?;
            let path = raw.split(|b| *b == 0).next()?;
            return Some(Some(String::from_utf8(path.to_vec()).ok()?));
        }
    }
    Some(None)
}

/// The shared libraries the host's loader resolves for `binary` (`ldd`), and the
/// loader itself (`interpreter`, the binary's PT_INTERP): absolute host paths. A
/// library ldd cannot find is an error.
fn shared_libraries(binary: &Path, interpreter: &str) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .context("cannot start ldd")?;
    if !out.status.success() {
        bail!(
            "ldd {} failed ({}): {}",
            binary.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let mut libraries = parse_ldd(&String::from_utf8_lossy(&out.stdout)).map_err(|missing| {
        anyhow::anyhow!(
            "{}: the host's loader cannot find {}",
            binary.display(),
            missing.join(", ")
        )
    })?;
    let interpreter = PathBuf::from(interpreter);
    if !libraries.contains(&interpreter) {
        libraries.insert(0, interpreter);
    }
    Ok(libraries)
}

/// The paths in ldd's output (`libc.so.6 => /lib/.../libc.so.6 (0x...)`, and the
/// loader's own `/lib64/ld-linux-x86-64.so.2 (0x...)`; the vDSO has none), or the
/// names of the libraries it did not find.
fn parse_ldd(text: &str) -> Result<Vec<PathBuf>, Vec<String>> {
    let mut found: Vec<PathBuf> = Vec::new();
    let mut missing = Vec::new();
    for line in text.lines().map(str::trim) {
        let (name, path) = match line.split_once("=>") {
            Some((name, path)) => (name.trim(), path.trim()),
            None => (line, line),
        };
        if path.starts_with("not found") {
            missing.push(name.to_owned());
        } else if let Some(path) = path
            .split_whitespace()
            .next()
            .filter(|p| p.starts_with('/'))
        {
            let path = PathBuf::from(path);
            if !found.contains(&path) {
                found.push(path);
            }
        }
    }
    if missing.is_empty() {
        Ok(found)
    } else {
        Err(missing)
    }
}

/// One entry of the initramfs, by its absolute path there.
#[derive(Debug, PartialEq, Eq)]
enum Node {
    Dir,
    File { bytes: Vec<u8>, mode: u32 },
    Symlink(PathBuf),
}

/// Adds the host file `path` at the same path in the initramfs, with its
/// directories. A symbolic link stays one, with the same target, and what it
/// points to is added the same way: the loader's `/lib64/ld-linux-x86-64.so.2`,
/// the binaries' PT_INTERP, is a link to `/lib/x86_64-linux-gnu/...` on Debian.
/// Linked directories on the way (`/lib` -> `usr/lib`) become plain ones.
fn add_host_file(nodes: &mut BTreeMap<PathBuf, Node>, path: &Path) -> Result<()> {
    let mut path = lexical(path);
    for _ in 0..MAX_SYMLINKS {
        if !path.is_absolute() {
            bail!("{}: not an absolute path", path.display());
        }
        if nodes.contains_key(&path) {
            return Ok(());
        }
        let meta = fs::symlink_metadata(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let next = if meta.file_type().is_symlink() {
            let target = fs::read_link(&path)?;
            let next = lexical(&path.parent().unwrap_or(Path::new("/")).join(&target));
            add_node(nodes, &path, Node::Symlink(target));
            next
        } else if meta.is_file() {
            let bytes =
                fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
            let mode = meta.permissions().mode() & 0o7777;
            add_node(nodes, &path, Node::File { bytes, mode });
            return Ok(());
        } else {
            bail!("{} is not a file", path.display());
        };
        path = next;
    }
    bail!(
        "{}: more than {MAX_SYMLINKS} symbolic links",
        path.display()
    )
}

/// Puts `node` at `path`, with the directories above it.
fn add_node(nodes: &mut BTreeMap<PathBuf, Node>, path: &Path, node: Node) {
    for dir in path.ancestors().skip(1) {
        if dir != Path::new("/") {
            nodes.entry(dir.to_path_buf()).or_insert(Node::Dir);
        }
    }
    nodes.insert(path.to_path_buf(), node);
}

/// `path` with `.` and `..` resolved as names, without asking the file system.
fn lexical(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

fn is_root() -> bool {
    fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(2))
            == Some("0")
    })
}

/// The guest's `/init`: mounts, the probe with its results on the second serial
/// port, power off.
fn init_script(with_object: bool) -> String {
    let args = if with_object {
        " --object /evpleg.bpf.o"
    } else {
        ""
    };
    format!(
        r#"#!/bin/sh
# The kernel matrix's guest init (generated by xtask/src/matrix.rs).
export PATH=/bin
mount -t devtmpfs devtmpfs /dev
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t bpf bpf /sys/fs/bpf
if [ -d /sys/kernel/tracing ]; then mount -t tracefs tracefs /sys/kernel/tracing; fi
swapoff -a 2>/dev/null
echo "init: $(cat /proc/sys/kernel/osrelease): running the probe"
/{PROBE_IN_INITRAMFS}{args} >/dev/ttyS1
status=$?
echo "EXIT $status" >/dev/ttyS1
echo "init: probe exited with $status; powering off"
poweroff -f
"#
    )
}

/// FNV-1a, 64 bits: the initramfs cache key (not security-relevant).
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    fn add(&mut self, bytes: &[u8]) {
        for b in (bytes.len() as u64).to_le_bytes().iter().chain(bytes) {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// The initramfs (newc cpio, gzip), rebuilt only when an input changed: busybox,
/// the init, the probe without its debug info, the libraries and loader it needs
/// at their host paths, the optional object.
fn build_initramfs(root: &Path, probe: &Path, object: Option<&Path>) -> Result<PathBuf> {
    let read = |p: &Path| fs::read(p).with_context(|| format!("cannot read {}", p.display()));
    let busybox = read(Path::new(BUSYBOX))?;
    if elf_interpreter(&busybox) != Some(None) {
        bail!("{BUSYBOX} is not statically linked: install busybox-static");
    }
    let dir = out_dir(root);
    fs::create_dir_all(&dir)?;
    // The test build's binary carries its debug info (about 125 MB); the guest
    // unpacks the initramfs into its 256 MiB. The symbols stay.
    let stripped = dir.join(PROBE_IN_INITRAMFS);
    util::run(
        Command::new("strip")
            .args(["--strip-debug", "-o"])
            .arg(&stripped)
            .arg(probe),
    )?;
    let probe = read(&stripped)?;
    let libraries = match elf_interpreter(&probe) {
        Some(Some(loader)) => shared_libraries(&stripped, &loader)?,
        Some(None) => Vec::new(),
        None => bail!("{} is not an x86-64 ELF binary", stripped.display()),
    };
    let mut nodes: BTreeMap<PathBuf, Node> = BTreeMap::new();
    for library in &libraries {
        add_host_file(&mut nodes, library)?;
    }
    for d in ["bin", "dev", "proc", "sys", "tmp", "root"] {
        add_node(&mut nodes, &Path::new("/").join(d), Node::Dir);
    }
    let init = init_script(object.is_some());
    let file = |bytes: Vec<u8>, mode: u32| Node::File { bytes, mode };
    add_node(
        &mut nodes,
        Path::new("/init"),
        file(init.into_bytes(), 0o755),
    );
    add_node(&mut nodes, Path::new("/bin/busybox"), file(busybox, 0o755));
    let probe_path = Path::new("/").join(PROBE_IN_INITRAMFS);
    add_node(&mut nodes, &probe_path, file(probe, 0o755));
    if let Some(object) = object {
        add_node(
            &mut nodes,
            Path::new("/evpleg.bpf.o"),
            file(read(object)?, 0o644),
        );
    }
    for applet in APPLETS {
        let link = Path::new("/bin").join(applet);
        add_node(&mut nodes, &link, Node::Symlink("busybox".into()));
    }
    info(&format!(
        "initramfs: the probe's loader and libraries: {}",
        libraries
            .iter()
            .map(|l| l.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ));

    // The key: every entry's path, kind, and content or target.
    let mut hash = Fnv::new();
    for (path, node) in &nodes {
        hash.add(path.as_os_str().as_encoded_bytes());
        match node {
            Node::Dir => hash.add(b"d"),
            Node::File { bytes, mode } => {
                hash.add(format!("f{mode:o}").as_bytes());
                hash.add(bytes);
            }
            Node::Symlink(target) => {
                hash.add(b"l");
                hash.add(target.as_os_str().as_encoded_bytes());
            }
        }
    }
    let name = format!("initramfs-{:016x}.cpio.gz", hash.0);
    let out = dir.join(&name);
    if out.is_file() {
        info(&format!("initramfs: {} (cached)", out.display()));
        return Ok(out);
    }
    for old in fs::read_dir(&dir)?.filter_map(|e| e.ok()) {
        let n = old.file_name().to_string_lossy().into_owned();
        if n.starts_with("initramfs-") && n.ends_with(".cpio.gz") {
            let _ = fs::remove_file(old.path());
        }
    }
    let stage = dir.join("initramfs-root");
    let _ = fs::remove_dir_all(&stage);
    fs::create_dir_all(&stage)?;
    let mut entries: Vec<String> = vec![".".into()];
    for (path, node) in &nodes {
        let relative = path.strip_prefix("/").unwrap_or(path);
        let p = stage.join(relative);
        match node {
            Node::Dir => fs::create_dir_all(&p)?,
            Node::File { bytes, mode } => {
                fs::write(&p, bytes).with_context(|| format!("cannot write {}", p.display()))?;
                fs::set_permissions(&p, fs::Permissions::from_mode(*mode))?;
            }
            Node::Symlink(target) => {
                symlink(target, &p).with_context(|| format!("cannot create {}", p.display()))?
            }
        }
        entries.push(relative.to_string_lossy().into_owned());
    }
    check_staged_probe(&stage)?;
    entries.sort();
    let cpio_path = dir.join("initramfs.cpio");
    let mut cpio = Command::new("cpio")
        .args([
            "--null",
            "--create",
            "--format=newc",
            "--reproducible",
            "--quiet",
        ])
        .current_dir(&stage)
        .stdin(Stdio::piped())
        .stdout(fs::File::create(&cpio_path)?)
        .spawn()
        .context("cannot start cpio")?;
    {
        use std::io::Write as _;
        let mut stdin = cpio.stdin.take().expect("piped");
        for e in &entries {
            stdin.write_all(e.as_bytes())?;
            stdin.write_all(b"\0")?;
        }
    }
    let status = cpio.wait()?;
    if !status.success() {
        bail!("cpio failed: {status}");
    }
    util::run(
        Command::new("gzip")
            .args(["-n", "-6", "-f"])
            .arg(&cpio_path),
    )?;
    fs::rename(dir.join("initramfs.cpio.gz"), &out)?;
    fs::remove_dir_all(&stage)?;
    info(&format!(
        "initramfs: {} ({} KiB)",
        out.display(),
        fs::metadata(&out)?.len() / 1024
    ));
    Ok(out)
}

/// Starts the staged probe (`--help`) chrooted in the staged tree, when root: the
/// initramfs's loader and libraries and nothing of the host's, so that a library
/// missing from the initramfs fails here at once rather than in every guest.
fn check_staged_probe(stage: &Path) -> Result<()> {
    if !is_root() {
        info("initramfs: not root, so the probe's libraries are not tried in a chroot");
        return Ok(());
    }
    let out = Command::new("chroot")
        .arg(stage)
        .arg(format!("/{PROBE_IN_INITRAMFS}"))
        .arg("--help")
        .output()
        .context("cannot start chroot")?;
    if !out.status.success() {
        bail!(
            "the probe does not start with the initramfs's libraries (chroot {} /{PROBE_IN_INITRAMFS} \
             --help: {}): {}",
            stage.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Guests

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Pass,
    Fail,
    Absent,
}

#[derive(Debug)]
struct Check {
    name: String,
    state: State,
    detail: String,
}

/// What the probe printed on the results port.
#[derive(Debug, Default)]
struct Results {
    release: Option<String>,
    /// (name, present, detail)
    features: Vec<(String, bool, String)>,
    checks: Vec<Check>,
    /// (check, line): a failure's full message.
    logs: Vec<(String, String)>,
    done: Option<(u32, u32)>,
    exit: Option<String>,
}

fn parse_results(text: &str) -> Results {
    let mut r = Results::default();
    for line in text.lines().map(|l| l.trim_end_matches('\r')) {
        let (tag, rest) = line.split_once(' ').unwrap_or((line, ""));
        match tag {
            "KERNEL" => r.release = Some(rest.to_owned()),
            "FEATURE" => {
                let mut it = rest.splitn(3, ' ');
                if let (Some(name), Some(state)) = (it.next(), it.next()) {
                    let detail = it.next().unwrap_or("").to_owned();
                    r.features
                        .push((name.to_owned(), state == "PRESENT", detail));
                }
            }
            "RESULT" => {
                let mut it = rest.splitn(3, ' ');
                if let (Some(name), Some(state)) = (it.next(), it.next()) {
                    let state = match state {
                        "PASS" => State::Pass,
                        "ABSENT" => State::Absent,
                        _ => State::Fail,
                    };
                    let detail = it.next().unwrap_or("").to_owned();
                    r.checks.push(Check {
                        name: name.to_owned(),
                        state,
                        detail,
                    });
                }
            }
            "LOG" => {
                let (check, text) = rest.split_once(' ').unwrap_or((rest, ""));
                r.logs.push((check.to_owned(), text.to_owned()));
            }
            "DONE" => {
                let mut it = rest.split_whitespace().map(|n| n.parse::<u32>().ok());
                if let (Some(Some(p)), Some(Some(f))) = (it.next(), it.next()) {
                    r.done = Some((p, f));
                }
            }
            "EXIT" => r.exit = Some(rest.to_owned()),
            _ => {}
        }
    }
    r
}

#[derive(Debug)]
struct GuestRun {
    kernel: &'static Kernel,
    took: Duration,
    timed_out: bool,
    qemu: Option<ExitStatus>,
    results: Results,
    console: PathBuf,
    results_path: PathBuf,
    /// Boots thrown away because the kernel panicked before `/init` ran: the
    /// panic's line and the saved console.
    boot_panics: Vec<(String, PathBuf)>,
}

impl GuestRun {
    fn count(&self, state: State) -> usize {
        self.results
            .checks
            .iter()
            .filter(|c| c.state == state)
            .count()
    }

    /// One line per failure, naming the kernel and the check.
    fn failures(&self) -> Vec<String> {
        let k = self.kernel;
        let who = format!("{} ({} {})", k.series, k.package, k.version);
        let mut out: Vec<String> = self
            .results
            .checks
            .iter()
            .filter(|c| c.state == State::Fail)
            .map(|c| format!("{who}: {}: {}", c.name, c.detail))
            .collect();
        match self.results.done {
            None => {
                let why = if self.timed_out {
                    format!(
                        "the guest was killed after {:.0} s",
                        self.took.as_secs_f64()
                    )
                } else {
                    match self.qemu {
                        Some(s) => format!("the guest stopped early (qemu: {s})"),
                        None => "the guest could not be run".to_owned(),
                    }
                };
                out.push(format!(
                    "{who}: no DONE line from the probe: {why}; console: {}",
                    self.console.display()
                ));
            }
            Some((_, failed)) if failed as usize != self.count(State::Fail) => out.push(format!(
                "{who}: the probe counted {failed} failure(s) but reported {}; results: {}",
                self.count(State::Fail),
                self.results_path.display()
            )),
            Some(_) => {
                for name in REQUIRED_CHECKS {
                    if !self.results.checks.iter().any(|c| c.name == name) {
                        out.push(format!(
                            "{who}: {name}: the probe did not run it; results: {}",
                            self.results_path.display()
                        ));
                    }
                }
                let cpus = self
                    .results
                    .features
                    .iter()
                    .find(|(n, _, _)| n == "smp")
                    .map(|(_, present, _)| *present);
                if cpus != Some(true) {
                    out.push(format!(
                        "{who}: the guest did not run on {GUEST_CPUS} CPUs (FEATURE smp: {cpus:?}); results: {}",
                        self.results_path.display()
                    ));
                }
            }
        }
        out
    }

    /// The failed checks' full messages and the end of the console.
    fn print_diagnosis(&self) {
        let k = self.kernel;
        step(&format!(
            "kernel matrix: {} ({} {}) failed",
            k.series, k.package, k.version
        ));
        for c in self
            .results
            .checks
            .iter()
            .filter(|c| c.state == State::Fail)
        {
            eprintln!("RESULT {} FAIL {}", c.name, c.detail);
            // A verifier's log runs to thousands of lines: its start and its end
            // (the verdict) here, all of it in results.log.
            let log: Vec<&str> = self
                .results
                .logs
                .iter()
                .filter(|(n, _)| *n == c.name)
                .map(|(_, l)| l.as_str())
                .collect();
            let (head, tail) = if log.len() > LOG_HEAD + LOG_TAIL + 10 {
                (LOG_HEAD, LOG_TAIL)
            } else {
                (log.len(), 0)
            };
            for l in &log[..head] {
                eprintln!("    {l}");
            }
            if tail > 0 {
                eprintln!(
                    "    [... {} more lines in {} ...]",
                    log.len() - head - tail,
                    self.results_path.display()
                );
                for l in &log[log.len() - tail..] {
                    eprintln!("    {l}");
                }
            }
        }
        // The whole console matters when the guest crashed or hung.
        let tail = if self.results.done.is_none() {
            CONSOLE_TAIL
        } else {
            CONSOLE_TAIL / 4
        };
        let console = fs::read_to_string(&self.console).unwrap_or_default();
        let lines: Vec<&str> = console.lines().collect();
        eprintln!(
            "--- last {} lines of {} ---",
            tail.min(lines.len()),
            self.console.display()
        );
        for l in &lines[lines.len().saturating_sub(tail)..] {
            eprintln!("{}", l.trim_end_matches('\r'));
        }
        eprintln!("--- results: {} ---", self.results_path.display());
    }
}

fn run_guests(
    root: &Path,
    kernels: &[&'static Kernel],
    images: &[PathBuf],
    initramfs: &Path,
    timeout: Duration,
) -> Result<Vec<GuestRun>> {
    let queue: Mutex<VecDeque<(&'static Kernel, &PathBuf)>> =
        Mutex::new(kernels.iter().copied().zip(images).collect());
    let runs: Mutex<Vec<Result<GuestRun>>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..PARALLEL_GUESTS.min(kernels.len()) {
            s.spawn(|| {
                loop {
                    let next = queue.lock().unwrap_or_else(|e| e.into_inner()).pop_front();
                    let Some((kernel, image)) = next else { break };
                    let run = run_guest(root, kernel, image, initramfs, timeout);
                    if let Ok(r) = &run {
                        info(&format!(
                            "{}: {} passed, {} failed, {} absent{} in {:.1} s",
                            kernel.series,
                            r.count(State::Pass),
                            r.count(State::Fail),
                            r.count(State::Absent),
                            if r.results.done.is_none() {
                                ", no DONE"
                            } else {
                                ""
                            },
                            r.took.as_secs_f64()
                        ));
                    }
                    runs.lock().unwrap_or_else(|e| e.into_inner()).push(run);
                }
            });
        }
    });
    let mut runs = runs
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    runs.sort_by_key(|r| KERNELS.iter().position(|k| k.series == r.kernel.series));
    Ok(runs)
}

/// The line of a kernel panic on `console` that came before the guest's
/// `/init` printed anything: the kernel failed to boot, before the probe or
/// any of evpleg ran.
fn panicked_before_init(console: &str) -> Option<String> {
    console
        .lines()
        .map(|l| l.trim_end_matches('\r'))
        .take_while(|l| !l.starts_with("init: "))
        .find(|l| l.contains("Kernel panic"))
        .map(|l| l.trim().to_owned())
}

/// Boots one guest and reads its results; a boot whose kernel panicked before
/// `/init` ran is tried once more ([`panicked_before_init`]).
fn run_guest(
    root: &Path,
    kernel: &'static Kernel,
    image: &Path,
    initramfs: &Path,
    timeout: Duration,
) -> Result<GuestRun> {
    let run = boot_guest(root, kernel, image, initramfs, timeout)?;
    if run.results.done.is_some() {
        return Ok(run);
    }
    let console = fs::read_to_string(&run.console).unwrap_or_default();
    let Some(panic) = panicked_before_init(&console) else {
        return Ok(run);
    };
    let saved = run.console.with_file_name("console-panicked-boot.log");
    fs::rename(&run.console, &saved)?;
    info(&format!(
        "{}: the kernel panicked while booting, before /init ran ({panic}; {}): booting it once more",
        kernel.series,
        saved.display()
    ));
    let mut again = boot_guest(root, kernel, image, initramfs, timeout)?;
    again.took += run.took;
    again.boot_panics.push((panic, saved));
    Ok(again)
}

/// Boots one guest and reads its results; the guest is killed after `timeout`.
fn boot_guest(
    root: &Path,
    kernel: &'static Kernel,
    image: &Path,
    initramfs: &Path,
    timeout: Duration,
) -> Result<GuestRun> {
    let dir = out_dir(root).join(kernel.series);
    fs::create_dir_all(&dir)?;
    let console = dir.join("console.log");
    let results_path = dir.join("results.log");
    for f in [&console, &results_path] {
        let _ = fs::remove_file(f);
    }
    let qemu_log = fs::File::create(dir.join("qemu.log"))?;
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd
        // KVM does not run these stock kernels on this host's nested KVM.
        .args(["-accel", "tcg", "-cpu", "max", "-machine", "pc"])
        .args(["-m", GUEST_MEMORY, "-smp", GUEST_CPUS, "-nic", "none"])
        .args(["-display", "none", "-monitor", "none", "-no-reboot"])
        .arg("-serial")
        .arg(format!("file:{}", console.display()))
        .arg("-serial")
        .arg(format!("file:{}", results_path.display()))
        .arg("-kernel")
        .arg(image)
        .arg("-initrd")
        .arg(initramfs)
        .args(["-append", KERNEL_CMDLINE])
        .stdin(Stdio::null())
        .stdout(qemu_log.try_clone()?)
        .stderr(qemu_log);
    // To run it again by hand.
    fs::write(dir.join("qemu.cmd"), format!("{cmd:?}\n"))?;
    let started = Instant::now();
    let mut child = cmd.spawn().context("cannot start qemu-system-x86_64")?;
    let (qemu, timed_out) = loop {
        if let Some(status) = child.try_wait()? {
            break (Some(status), false);
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            break (None, true);
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let took = started.elapsed();
    let results = parse_results(&fs::read_to_string(&results_path).unwrap_or_default());
    Ok(GuestRun {
        kernel,
        took,
        timed_out,
        qemu,
        results,
        console,
        results_path,
        boot_panics: Vec::new(),
    })
}

/// The matrix as a markdown table with each kernel's features, as
/// docs/kernels.md shows it.
fn summary(runs: &[GuestRun], total: Duration, object: Option<&Path>) -> String {
    let date = output(Command::new("date").args(["-u", "+%Y-%m-%d"])).unwrap_or_default();
    let object = match object {
        Some(o) => format!("eBPF object {}", o.display()),
        None => "the embedded eBPF object".to_owned(),
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\nKernel matrix, {} (UTC), {object}, {:.0} s in all, {PARALLEL_GUESTS} guests at a time:\n",
        date.trim(),
        total.as_secs_f64()
    );
    let _ = writeln!(
        s,
        "| kernel | package | version | result | pass | fail | absent | group_dead | mark_victim arg | guest time |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
    for r in runs {
        let feature = |name: &str, yes: &str, no: &str| {
            r.results
                .features
                .iter()
                .find(|f| f.0 == name)
                .map(|f| if f.1 { yes } else { no })
                .unwrap_or("?")
                .to_owned()
        };
        let result = match (r.failures().is_empty(), r.boot_panics.len()) {
            (false, _) => "FAIL",
            (true, 0) => "PASS",
            (true, _) => "PASS (booted twice)",
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {result} | {} | {} | {} | {} | {} | {:.0} s |",
            r.kernel.series,
            r.kernel.package,
            r.kernel.version,
            r.count(State::Pass),
            r.count(State::Fail),
            r.count(State::Absent),
            feature("sched_process_exit.group_dead", "present", "absent"),
            feature("mark_victim.task_arg", "task_struct *", "pid"),
            r.took.as_secs_f64()
        );
    }
    for r in runs {
        for (panic, console) in &r.boot_panics {
            let _ = writeln!(
                s,
                "\n{}: booted twice: the first boot's kernel panicked before /init ran ({panic}; {})",
                r.kernel.series,
                console.display()
            );
        }
        for c in r.results.checks.iter().filter(|c| c.state == State::Absent) {
            let _ = writeln!(s, "\n{}: {} ABSENT: {}", r.kernel.series, c.name, c.detail);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selections() {
        let all: Selection = "all".parse().unwrap();
        assert_eq!(all.0.len(), KERNELS.len());
        assert!("none".parse::<Selection>().unwrap().is_empty());
        let some: Selection = "6.18, 6.1,6.18".parse().unwrap();
        let series: Vec<_> = some.0.iter().map(|k| k.series).collect();
        assert_eq!(series, ["6.1", "6.18"]);
        let err = "6.2".parse::<Selection>().unwrap_err();
        assert!(err.contains("6.1, 6.12, 6.16, 6.18, 7.3"), "{err}");
        assert!(",".parse::<Selection>().is_err());
    }

    #[test]
    fn none_runs_nothing() {
        // No tool, image, build or guest: the root does not even exist.
        let options = Options {
            kernels: "none".parse().unwrap(),
            bpf_object: None,
            timeout: DEFAULT_TIMEOUT,
        };
        run(Path::new("/nonexistent/evpleg"), &options).unwrap();
    }

    #[test]
    fn results_are_parsed() {
        let r = parse_results(
            "KERNEL 6.1.0-56-amd64\r\nFEATURE sched_process_exit.group_dead ABSENT has 1 argument\r\n\
             RESULT load FAIL program sched_process_exit: rejected\r\nLOG load line 1\r\n\
             LOG load line 2\r\nRESULT oom_kill ABSENT no memory controller\r\nDONE 0 1\r\nEXIT 1\r\n",
        );
        assert_eq!(r.release.as_deref(), Some("6.1.0-56-amd64"));
        assert_eq!(
            r.features,
            [(
                "sched_process_exit.group_dead".to_owned(),
                false,
                "has 1 argument".to_owned()
            )]
        );
        assert_eq!(r.checks.len(), 2);
        assert_eq!(r.checks[0].state, State::Fail);
        assert_eq!(r.checks[0].detail, "program sched_process_exit: rejected");
        assert_eq!(r.checks[1].state, State::Absent);
        assert_eq!(r.logs.len(), 2);
        assert_eq!(r.done, Some((0, 1)));
    }

    #[test]
    fn a_guest_without_the_thread_checks_or_two_cpus_fails() {
        let run = |text: &str| GuestRun {
            kernel: &KERNELS[0],
            took: Duration::from_secs(1),
            timed_out: false,
            qemu: None,
            results: parse_results(text),
            console: PathBuf::from("console.log"),
            results_path: PathBuf::from("results.log"),
            boot_panics: Vec::new(),
        };
        let all = "FEATURE smp PRESENT 2 CPU(s)\nRESULT load PASS x\n\
                   RESULT exit_group_from_thread PASS x\nRESULT leader_exits_first PASS x\nDONE 3 0\n";
        assert!(run(all).failures().is_empty(), "{:?}", run(all).failures());
        let missing = all.replace("RESULT leader_exits_first PASS x\n", "");
        let failures = run(&missing).failures();
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(failures[0].contains("leader_exits_first: the probe did not run it"));
        let one_cpu = all.replace("smp PRESENT", "smp ABSENT");
        let failures = run(&one_cpu).failures();
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(
            failures[0].contains("did not run on 2 CPUs"),
            "{failures:?}"
        );
    }

    #[test]
    fn only_a_panic_before_init_is_a_failed_boot() {
        // From a guest of 6.18.15 under TCG (the CI run of 2026-12-04).
        let boot = "[    1.092617]  ip_rt_init+0x206/0x260\r\n\
                    [    1.092617] Kernel panic - not syncing: Fatal exception in interrupt\r\n";
        assert_eq!(
            panicked_before_init(boot).as_deref(),
            Some("[    1.092617] Kernel panic - not syncing: Fatal exception in interrupt")
        );
        // Once /init ran, a panic may be the probe's doing: never retried.
        let after_init = format!("init: 6.18.15+deb13-amd64: running the probe\n{boot}");
        assert_eq!(panicked_before_init(&after_init), None);
        assert_eq!(
            panicked_before_init("init: 6.1.0: running the probe\ninit: probe exited with 0\n"),
            None
        );
        assert_eq!(panicked_before_init(""), None);
    }

    #[test]
    fn static_binaries_are_told_apart() {
        let busybox = fs::read(BUSYBOX);
        if let Ok(b) = busybox {
            assert_eq!(elf_interpreter(&b), Some(None), "busybox-static");
        }
        let dynamic = fs::read("/bin/ls").expect("/bin/ls");
        let loader = elf_interpreter(&dynamic).flatten().expect("a PT_INTERP");
        assert!(
            loader.starts_with('/') && loader.contains("ld-linux"),
            "{loader}"
        );
        assert_eq!(elf_interpreter(b"#!/bin/sh\n"), None);
    }

    #[test]
    fn ldd_output_is_parsed() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
            \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f91)\n\
            \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f92)\n\
            \t/lib64/ld-linux-x86-64.so.2 (0x00007f93)\n";
        let found = parse_ldd(text).unwrap();
        let found: Vec<_> = found.iter().map(|p| p.to_str().unwrap()).collect();
        assert_eq!(
            found,
            [
                "/lib/x86_64-linux-gnu/libgcc_s.so.1",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2"
            ]
        );
        let missing =
            parse_ldd("\tlibfoo.so.1 => not found\n\tlibc.so.6 => /lib/libc.so.6 (0x1)\n");
        assert_eq!(missing.unwrap_err(), ["libfoo.so.1"]);
    }

    #[test]
    fn the_probe_is_found_in_cargo_messages() {
        let probe = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/tests/kernel-probe#evpleg-kernel-probe@0.1.0","target":{"kind":["bin"],"name":"evpleg-kernel-probe"},"profile":{"test":false},"executable":"/w/target/debug/evpleg-kernel-probe","fresh":true}"#;
        let test = r#"{"reason":"compiler-artifact","target":{"kind":["test"],"name":"probe_cli"},"executable":"/w/target/debug/deps/probe_cli-0123abcd","fresh":true}"#;
        let lib = r#"{"reason":"compiler-artifact","target":{"kind":["lib"],"name":"evpleg"},"executable":null,"fresh":true}"#;
        assert_eq!(
            probe_executable(probe),
            Some(PathBuf::from("/w/target/debug/evpleg-kernel-probe"))
        );
        assert_eq!(probe_executable(test), None);
        assert_eq!(probe_executable(lib), None);
        assert_eq!(
            probe_executable(r#"{"reason":"build-finished","success":true}"#),
            None
        );
    }

    #[test]
    fn libraries_keep_their_paths_and_links() {
        let dir = std::env::temp_dir().join(format!("evpleg-matrix-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("lib/x86_64-linux-gnu")).unwrap();
        fs::create_dir_all(dir.join("lib64")).unwrap();
        let real = dir.join("lib/x86_64-linux-gnu/ld-2.36.so");
        fs::write(&real, b"loader").unwrap();
        // An absolute link to a relative one to the file.
        symlink(
            "ld-2.36.so",
            dir.join("lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"),
        )
        .unwrap();
        let loader = dir.join("lib64/ld-linux-x86-64.so.2");
        symlink(
            dir.join("lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"),
            &loader,
        )
        .unwrap();
        let mut nodes = BTreeMap::new();
        add_host_file(&mut nodes, &loader).unwrap();
        add_host_file(
            &mut nodes,
            &dir.join("lib64/../lib/x86_64-linux-gnu/ld-2.36.so"),
        )
        .unwrap();
        let _ = fs::remove_dir_all(&dir);
        assert_eq!(
            nodes[&loader],
            Node::Symlink(dir.join("lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"))
        );
        assert_eq!(
            nodes[&dir.join("lib/x86_64-linux-gnu/ld-linux-x86-64.so.2")],
            Node::Symlink("ld-2.36.so".into())
        );
        let Node::File { bytes, .. } = &nodes[&real] else {
            panic!("{:?}", nodes[&real]);
        };
        assert_eq!(bytes, b"loader");
        assert_eq!(nodes[&dir.join("lib64")], Node::Dir);
        assert_eq!(nodes[&dir.join("lib")], Node::Dir);
        // Files, links and the directories above them, nothing else.
        assert_eq!(nodes.len(), 3 + dir.ancestors().count() + 2);
    }
}
