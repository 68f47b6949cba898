//! Loads and attaches the kernel programs (aya), configured for this kernel.
//!
//! Field offsets come from the running kernel's BTF ([`super::btf`]) and are written
//! into the object's `OFFSETS` global before the verifier sees it; the ring buffer's
//! size, the hierarchies reported on mkdir/rmdir and the root cgroups and path
//! prefixes of the filter are set here too.

use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use aya::maps::{Array, MapData, PerCpuArray, RingBuf};
use aya::programs::BtfTracePoint;
use aya::{Btf, Ebpf, EbpfLoader};
use evpleg_events::{KernelOffsets, MAX_PREFIXES, MAX_ROOTS, PREFIX_LEN, PathPrefix, RootFilter};

use super::btf;

/// The object built by `cargo xtask build`, or empty when it was not built.
static EMBEDDED_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/evpleg.bpf.o"));

/// Whether `cargo xtask build` had built the eBPF object when this crate was built.
pub fn embedded_object_present() -> bool {
    !EMBEDDED_OBJECT.is_empty()
}

/// The embedded object's size and SHA-256 (hex), which name the kernel
/// programs a binary carries (`evpleg version`); `None` when it has none.
pub fn embedded_object_digest() -> Option<(usize, String)> {
    use sha2::Digest;
    if EMBEDDED_OBJECT.is_empty() {
        return None;
    }
    let digest = sha2::Sha256::digest(EMBEDDED_OBJECT);
    let hex = digest.iter().map(|b| format!("{b:02x}")).collect();
    Some((EMBEDDED_OBJECT.len(), hex))
}

/// The programs attached, in attach order (cgroup reports first, so that a
/// container's cgroup is reported before any of its processes). [`EXIT_PROGRAM`]
/// stands for one of the two exit programs ([`exit_program`]).
pub const PROGRAMS: [&str; 5] = [
    "cgroup_mkdir",
    "cgroup_rmdir",
    "sched_process_exec",
    EXIT_PROGRAM,
    "mark_victim",
];

/// The place of the exit program in [`PROGRAMS`].
pub const EXIT_PROGRAM: &str = "sched_process_exit";

/// The exit program for this kernel: `sched_process_exit_group_dead` reads the
/// tracepoint's `group_dead` argument (Linux 6.16; an older verifier rejects the
/// program, as the argument does not exist), `sched_process_exit` decides the last
/// thread itself (docs/pleg.md, "Kernel differences handled").
pub fn exit_program(offsets: &KernelOffsets) -> &'static str {
    if offsets.exit_group_dead_arg != 0 {
        "sched_process_exit_group_dead"
    } else {
        "sched_process_exit"
    }
}

/// Errors of loading and configuring the programs.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// no object embedded and none given
    #[error("eBPF object not built: run `cargo xtask build` (or pass --bpf-object)")]
    NotBuilt,
    /// reading a given object file failed
    #[error("cannot read eBPF object {path}: {source}")]
    ReadObject {
        path: PathBuf,
        source: std::io::Error,
    },
    /// the kernel's BTF is missing or lacks a field
    #[error("kernel btf: {0}")]
    Btf(#[from] btf::BtfError),
    /// aya could not read the kernel's BTF
    #[error("cannot read /sys/kernel/btf/vmlinux: {0}")]
    AyaBtf(#[from] aya::BtfError),
    /// the verifier or the kernel rejected the object
    #[error("loading the eBPF object failed: {0}")]
    Load(#[from] aya::EbpfError),
    /// a program is missing from the object
    #[error("program {0} is missing from the eBPF object")]
    MissingProgram(&'static str),
    /// loading or attaching one program failed (the verifier's log is in the source)
    #[error("program {name}: {source}")]
    Program {
        name: &'static str,
        source: aya::programs::ProgramError,
    },
    /// the kernel would not say how often it skipped a program
    #[error("program {name}: cannot read its info (recursion_misses): {source}")]
    ProgramInfo {
        name: &'static str,
        source: std::io::Error,
    },
    /// a map is missing or has the wrong type
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        source: aya::maps::MapError,
    },
    /// a map is missing from the object
    #[error("map {0} is missing from the eBPF object")]
    MissingMap(&'static str),
    /// more roots or prefixes than the kernel side holds, or a prefix too long
    #[error("filter: {0}")]
    Filter(String),
}

/// How to load the programs.
#[derive(Clone, Debug)]
pub struct LoaderConfig {
    /// An object file to load instead of the embedded one.
    pub object: Option<PathBuf>,
    /// Ring buffer size in bytes (a power of two, a multiple of the page size).
    pub ring_buffer_bytes: u32,
    /// Root cgroups (paths relative to the hierarchy root): tasks below them are
    /// reported, and cgroups at or below them on mkdir/rmdir.
    pub roots: Vec<String>,
    /// Hierarchy ids reported on mkdir/rmdir (0 is cgroup2).
    pub hierarchies: Vec<u32>,
    /// Where cgroup2 is mounted.
    pub cgroup2_mount: PathBuf,
}

/// The loaded programs and the maps the reader uses.
pub struct Loaded {
    /// Owns the programs and their links: dropping it detaches everything.
    pub ebpf: Ebpf,
    pub ring: RingBuf<MapData>,
    pub counters: PerCpuArray<MapData, u64>,
    pub roots: RootsMap,
    pub offsets: KernelOffsets,
    /// The attached programs' descriptors, in [`PROGRAMS`] order, for
    /// [`recursion_misses`]; owned by `ebpf`, valid while it lives.
    pub program_fds: [RawFd; PROGRAMS.len()],
}

impl Loaded {
    /// The sum of the attached programs' [`recursion_misses`]. Each was read
    /// once at load; a later read of a live descriptor cannot fail, and if it
    /// did the program would add nothing until the next poll.
    pub fn recursion_misses(&self) -> u64 {
        self.program_fds
            .iter()
            .filter_map(|&fd| recursion_misses(fd).ok())
            .sum()
    }
}

/// How many times the kernel skipped the program with descriptor `fd` because
/// it was already running on that CPU (`bpf_prog_info.recursion_misses`, Linux
/// 5.12; 0 before). A skipped run is a lost record. Where tracepoint programs
/// run with preemption disabled this needs an interrupt inside a program;
/// where they run with only migration disabled, a task preempted inside a
/// program makes the next task on that CPU skip it (docs/pleg.md, "a program
/// run skipped by the kernel"). One `bpf(BPF_OBJ_GET_INFO_BY_FD)`, no
/// allocation: callable on the reader thread.
pub fn recursion_misses(fd: RawFd) -> std::io::Result<u64> {
    use aya_obj::generated::{bpf_attr, bpf_cmd, bpf_prog_info};
    // SAFETY: a plain C struct of integers, valid when zeroed.
    let mut info: bpf_prog_info = unsafe { std::mem::zeroed() };
    // SAFETY: a C union of such structs, valid when zeroed.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    attr.info.bpf_fd = fd as u32;
    attr.info.info_len = std::mem::size_of::<bpf_prog_info>() as u32;
    attr.info.info = &mut info as *mut bpf_prog_info as u64;
    // SAFETY: the kernel writes at most `info_len` bytes into `info`, which
    // outlives the call; `attr` is read only.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            bpf_cmd::BPF_OBJ_GET_INFO_BY_FD as libc::c_long,
            &mut attr as *mut bpf_attr,
            std::mem::size_of::<bpf_attr>() as libc::c_long,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(info.recursion_misses)
}

/// The `ROOTS` map: which cgroup2 cgroups' descendants are reported.
pub struct RootsMap {
    map: Array<MapData, RootFilter>,
    entries: Vec<RootFilter>,
}

impl RootsMap {
    /// Adds a root (idempotent); returns whether it was not in the filter yet.
    pub fn add(&mut self, cgroup_id: u64, level: u32) -> Result<bool, LoadError> {
        if self.entries.iter().any(|r| r.cgroup_id == cgroup_id) {
            return Ok(false);
        }
        if self.entries.len() >= MAX_ROOTS as usize {
            return Err(LoadError::Filter(format!(
                "more than {MAX_ROOTS} root cgroups; cgroup id {cgroup_id} not added"
            )));
        }
        self.entries.push(RootFilter {
            cgroup_id,
            level,
            _pad: 0,
        });
        self.sync().map(|()| true)
    }

    /// Removes a root.
    pub fn remove(&mut self, cgroup_id: u64) -> Result<(), LoadError> {
        self.entries.retain(|r| r.cgroup_id != cgroup_id);
        self.sync()
    }

    /// Writes the entries densely (the kernel stops at the first unused one).
    fn sync(&mut self) -> Result<(), LoadError> {
        for i in 0..MAX_ROOTS {
            let entry = self.entries.get(i as usize).copied().unwrap_or_default();
            self.map.set(i, entry, 0).map_err(|source| LoadError::Map {
                name: "ROOTS",
                source,
            })?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("offsets", &self.offsets)
            .field("roots", &self.roots)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for RootsMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RootsMap")
            .field("entries", &self.entries)
            .finish_non_exhaustive()
    }
}

/// The root's depth below the hierarchy root: `/kubepods` is 1.
pub fn level_of(path: &str) -> u32 {
    path.split('/').filter(|c| !c.is_empty()).count() as u32
}

fn prefix_entry(path: &str) -> Result<PathPrefix, LoadError> {
    let bytes = path.trim_end_matches('/').as_bytes();
    if bytes.is_empty() || bytes.len() >= PREFIX_LEN || !path.starts_with('/') {
        return Err(LoadError::Filter(format!(
            "root cgroup {path:?} must be an absolute path shorter than {PREFIX_LEN} bytes"
        )));
    }
    let mut entry = PathPrefix {
        len: bytes.len() as u32,
        _pad: 0,
        bytes: [0; PREFIX_LEN],
    };
    entry.bytes[..bytes.len()].copy_from_slice(bytes);
    Ok(entry)
}

fn take<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, LoadError>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf.take_map(name).ok_or(LoadError::MissingMap(name))?;
    T::try_from(map).map_err(|source| LoadError::Map { name, source })
}

/// The object to load: the given file, else the embedded one, else an error naming
/// the command that builds it.
fn object_bytes<'a>(
    path: Option<&Path>,
    embedded: &'a [u8],
) -> Result<std::borrow::Cow<'a, [u8]>, LoadError> {
    match path {
        Some(path) => std::fs::read(path)
            .map(std::borrow::Cow::Owned)
            .map_err(|source| LoadError::ReadObject {
                path: path.to_owned(),
                source,
            }),
        None if embedded.is_empty() => Err(LoadError::NotBuilt),
        None => Ok(std::borrow::Cow::Borrowed(embedded)),
    }
}

/// Loads, configures and attaches the programs.
pub fn load(config: &LoaderConfig) -> Result<Loaded, LoadError> {
    let object = object_bytes(config.object.as_deref(), EMBEDDED_OBJECT)?;
    if config.roots.len() > MAX_PREFIXES as usize {
        return Err(LoadError::Filter(format!(
            "{} root cgroups given, at most {MAX_PREFIXES}",
            config.roots.len()
        )));
    }
    let prefixes = config
        .roots
        .iter()
        .map(|r| prefix_entry(r))
        .collect::<Result<Vec<_>, _>>()?;

    let kernel_btf = btf::Btf::from_sys_fs()?;
    let offsets = btf::kernel_offsets(&kernel_btf)?;
    let mut mask = 0u64;
    for h in &config.hierarchies {
        if *h < 64 {
            mask |= 1 << h;
        }
    }
    let aya_btf = Btf::from_sys_fs()?;
    let mut ebpf = EbpfLoader::new()
        .btf(Some(&aya_btf))
        .override_global("OFFSETS", &offsets, true)
        .override_global("HIERARCHY_MASK", &mask, true)
        .map_max_entries("EVENTS", config.ring_buffer_bytes)
        .load(&object)?;

    // Filters first, so nothing outside them is reported once attached.
    let mut prefix_map: Array<MapData, PathPrefix> = take(&mut ebpf, "PREFIXES")?;
    for (i, p) in prefixes.iter().enumerate() {
        prefix_map
            .set(i as u32, p, 0)
            .map_err(|source| LoadError::Map {
                name: "PREFIXES",
                source,
            })?;
    }
    let mut roots = RootsMap {
        map: take(&mut ebpf, "ROOTS")?,
        entries: Vec::new(),
    };
    for root in &config.roots {
        if let Some(id) = cgroup_id(&config.cgroup2_mount, root) {
            roots.add(id, level_of(root))?;
        }
    }
    // The tracepoint is each program's function name, except for the exit
    // program, of which there are two.
    let mut program_fds = [0; PROGRAMS.len()];
    for (tracepoint, fd) in PROGRAMS.into_iter().zip(&mut program_fds) {
        let name = if tracepoint == EXIT_PROGRAM {
            exit_program(&offsets)
        } else {
            tracepoint
        };
        let program: &mut BtfTracePoint = ebpf
            .program_mut(name)
            .ok_or(LoadError::MissingProgram(name))?
            .try_into()
            .map_err(|source| LoadError::Program { name, source })?;
        program
            .load(tracepoint, &aya_btf)
            .map_err(|source| LoadError::Program { name, source })?;
        program
            .attach()
            .map_err(|source| LoadError::Program { name, source })?;
        *fd = program
            .fd()
            .map_err(|source| LoadError::Program { name, source })?
            .as_fd()
            .as_raw_fd();
        // Read once here, so that a kernel which will not tell fails the
        // load instead of leaving the skipped runs silently uncounted.
        recursion_misses(*fd).map_err(|source| LoadError::ProgramInfo { name, source })?;
    }
    let ring = take(&mut ebpf, "EVENTS")?;
    let counters = take(&mut ebpf, "COUNTERS")?;
    Ok(Loaded {
        ebpf,
        ring,
        counters,
        roots,
        offsets,
        program_fds,
    })
}

/// The cgroup2 id of `path` (its directory's inode number), if it exists.
pub fn cgroup_id(mount: &Path, path: &str) -> Option<u64> {
    std::fs::metadata(mount.join(path.trim_start_matches('/')))
        .ok()
        .filter(|m| m.is_dir())
        .map(|m| m.ino())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_and_levels() {
        assert_eq!(level_of("/kubepods"), 1);
        assert_eq!(level_of("/kubepods.slice/kubepods-besteffort.slice/"), 2);
        let p = prefix_entry("/k8s.io/").unwrap();
        assert_eq!(&p.bytes[..p.len as usize], b"/k8s.io");
        assert!(prefix_entry("relative").is_err());
        assert!(prefix_entry(&format!("/{}", "x".repeat(70))).is_err());
    }

    #[test]
    fn exit_program_follows_the_group_dead_argument() {
        let mut offsets = KernelOffsets::default();
        assert_eq!(exit_program(&offsets), "sched_process_exit");
        offsets.exit_group_dead_arg = 1;
        assert_eq!(exit_program(&offsets), "sched_process_exit_group_dead");
    }

    #[test]
    fn missing_object_names_the_command() {
        let err = object_bytes(None, &[]).unwrap_err();
        assert!(err.to_string().contains("cargo xtask build"), "{err}");
        let err = object_bytes(Some(Path::new("/nonexistent/evpleg.o")), &[1]).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/evpleg.o"), "{err}");
        assert_eq!(&*object_bytes(None, &[1, 2]).unwrap(), &[1, 2]);
    }
}
