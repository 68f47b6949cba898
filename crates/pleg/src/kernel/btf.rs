//! A small reader of the kernel's BTF (BPF Type Format, `Documentation/bpf/btf.rst`)
//! that derives, at load time, the kernel struct field offsets our eBPF programs
//! read.
//!
//! The programs are compiled without CO-RE relocations; instead user space reads
//! the running kernel's type information (`/sys/kernel/btf/vmlinux`), computes the
//! byte offset of every field the programs touch — the same numbers libbpf's CO-RE
//! field-offset relocations would patch in — and hands them to the programs in a
//! [`KernelOffsets`] map value. Nothing is hard-coded, so layout changes between
//! kernel versions, configs and `randstruct` builds are followed automatically.
//!
//! Only what that needs is implemented: the raw BTF format (header, type section,
//! string section) in native little-endian byte order, lookup of struct/union
//! members (descending into anonymous struct/union members and adding their
//! offsets, as C does), and inspection of the `btf_trace_<tracepoint>` typedefs the
//! kernel emits for every tracepoint, to learn the tracepoints' argument lists.
//! Split BTF (kernel modules, whose type ids continue those of vmlinux) is not
//! supported. Every read is bounds-checked: malformed input gives
//! [`BtfError::Malformed`], never a panic.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use evpleg_events::KernelOffsets;

/// Where the running kernel exposes its own BTF.
pub const VMLINUX_BTF_PATH: &str = "/sys/kernel/btf/vmlinux";

/// The BTF magic number, as read in the blob's byte order.
const MAGIC: u16 = 0xEB9F;
/// The only BTF version there is.
const VERSION: u8 = 1;
/// Length of the header fields this reader knows (`hdr_len` may be larger).
const HEADER_LEN: usize = 24;
/// Length of a `struct btf_type` record, before its kind-specific data.
const TYPE_LEN: usize = 12;
/// Bound on modifier chains and anonymous-member nesting, so that cyclic
/// (malformed) type graphs end in an error instead of a hang or stack overflow.
const MAX_DEPTH: u32 = 64;
/// The origin reported for blobs given to [`Btf::parse`].
const IN_MEMORY: &str = "in-memory btf";

/// BTF type kinds (`BTF_KIND_*`).
mod kind {
    pub const INT: u8 = 1;
    pub const PTR: u8 = 2;
    pub const ARRAY: u8 = 3;
    pub const STRUCT: u8 = 4;
    pub const UNION: u8 = 5;
    pub const ENUM: u8 = 6;
    pub const FWD: u8 = 7;
    pub const TYPEDEF: u8 = 8;
    pub const VOLATILE: u8 = 9;
    pub const CONST: u8 = 10;
    pub const RESTRICT: u8 = 11;
    pub const FUNC: u8 = 12;
    pub const FUNC_PROTO: u8 = 13;
    pub const VAR: u8 = 14;
    pub const DATASEC: u8 = 15;
    pub const FLOAT: u8 = 16;
    pub const DECL_TAG: u8 = 17;
    pub const TYPE_TAG: u8 = 18;
    pub const ENUM64: u8 = 19;
}

/// Errors reading BTF or finding what the programs need in it.
#[derive(Debug, thiserror::Error)]
pub enum BtfError {
    /// The file could not be read.
    #[error("cannot read btf {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The blob does not start with the BTF magic number.
    #[error("{origin} is not btf: magic {magic:#06x}, expected 0xeb9f")]
    BadMagic { origin: String, magic: u16 },
    /// The blob is BTF in the other byte order.
    #[error("{origin} is big-endian btf; only native little-endian btf is supported")]
    BigEndian { origin: String },
    /// The header has a version other than 1.
    #[error("{origin} has btf version {version}; only version 1 is supported")]
    UnsupportedVersion { origin: String, version: u8 },
    /// The blob is inconsistent: truncated, out-of-bounds references, unknown kinds,
    /// cyclic type chains...
    #[error("malformed btf in {origin} at byte {offset}: {reason}")]
    Malformed {
        origin: String,
        /// Byte offset in the blob of the header field or type record at fault.
        offset: usize,
        reason: String,
    },
    /// No struct or union of that name.
    #[error("no struct {name} in {origin}")]
    NoStruct { name: String, origin: String },
    /// The struct exists but has no such member, even in anonymous members.
    #[error("struct {struct_name} has no member {member} in {origin}")]
    NoMember {
        struct_name: String,
        member: String,
        origin: String,
    },
    /// The member does not start on a byte boundary.
    #[error(
        "member {member} of struct {struct_name} is at bit offset {bit_offset}, \
         not on a byte boundary, in {origin}"
    )]
    Unaligned {
        struct_name: String,
        member: String,
        bit_offset: u64,
        origin: String,
    },
    /// The member is a bitfield, which has no byte offset of its own.
    #[error("member {member} of struct {struct_name} is a bitfield in {origin}")]
    Bitfield {
        struct_name: String,
        member: String,
        origin: String,
    },
    /// The member's byte offset does not fit in a `u32`.
    #[error("member {member} of struct {struct_name} has an offset past 4 GiB in {origin}")]
    OffsetOverflow {
        struct_name: String,
        member: String,
        origin: String,
    },
    /// The kernel has no such tracepoint (no `btf_trace_<name>` typedef).
    #[error("no tracepoint {name} in {origin}: typedef {typedef} not found")]
    NoTracepoint {
        name: String,
        typedef: String,
        origin: String,
    },
    /// The tracepoint's typedef does not have the shape the kernel gives it.
    #[error("tracepoint {name} in {origin}: {reason}")]
    BadTracepoint {
        name: String,
        origin: String,
        reason: String,
    },
    /// The tracepoint has fewer arguments than asked for.
    #[error("tracepoint {name} has {count} arguments, no argument {index}, in {origin}")]
    NoTracepointArg {
        name: String,
        index: usize,
        count: usize,
        origin: String,
    },
}

/// One `struct btf_type` record.
#[derive(Clone, Copy, Debug)]
struct TypeRec {
    info: u32,
    size_or_type: u32,
    /// Byte offset of the record in the blob; its kind-specific data follows.
    at: usize,
}

impl TypeRec {
    fn kind(&self) -> u8 {
        // Masked to 5 bits, so the cast is lossless.
        ((self.info >> 24) & 0x1f) as u8
    }

    fn vlen(&self) -> usize {
        (self.info & 0xffff) as usize
    }

    fn kind_flag(&self) -> bool {
        self.info >> 31 == 1
    }

    /// Byte offset of the kind-specific data.
    fn data(&self) -> usize {
        self.at + TYPE_LEN
    }
}

/// A member found by name, with its offset from the start of the outer struct.
#[derive(Clone, Copy, Debug)]
struct Found {
    bit_offset: u64,
    bitfield_size: u32,
}

/// A parsed BTF blob, typically the running kernel's (`/sys/kernel/btf/vmlinux`).
///
/// Parsing validates the header and walks the type section once, recording where
/// each type is and indexing struct, union and typedef names; members, parameters
/// and strings are read from the blob on demand.
pub struct Btf {
    /// The path the blob came from, or [`IN_MEMORY`]; named in errors.
    origin: String,
    data: Vec<u8>,
    /// The string section, as a byte range of `data`.
    str_start: usize,
    str_end: usize,
    /// Type id `n` is `types[n - 1]` (id 0 is `void`).
    types: Vec<TypeRec>,
    /// Ids of the structs, unions and typedefs of each name.
    names: HashMap<Box<[u8]>, Vec<u32>>,
}

impl fmt::Debug for Btf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Btf")
            .field("origin", &self.origin)
            .field("bytes", &self.data.len())
            .field("types", &self.types.len())
            .finish_non_exhaustive()
    }
}

/// Reads a little-endian `u32` at `at`, if in bounds.
fn u32_at(data: &[u8], at: usize) -> Option<u32> {
    let bytes = data.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(bytes.try_into().ok()?))
}

impl Btf {
    /// Reads and parses the running kernel's BTF, [`VMLINUX_BTF_PATH`].
    pub fn from_sys_fs() -> Result<Self, BtfError> {
        Self::from_file(Path::new(VMLINUX_BTF_PATH))
    }

    /// Reads and parses a raw BTF file (such as a copy of `/sys/kernel/btf/vmlinux`).
    pub fn from_file(path: &Path) -> Result<Self, BtfError> {
        let data = std::fs::read(path).map_err(|source| BtfError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::parse_owned(data, path.display().to_string())
    }

    /// Parses a raw BTF blob held in memory; errors name it "in-memory btf".
    pub fn parse(bytes: &[u8]) -> Result<Self, BtfError> {
        Self::parse_owned(bytes.to_vec(), IN_MEMORY.to_owned())
    }

    /// Where the blob came from: its path, or "in-memory btf".
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The number of types, not counting `void` (id 0).
    pub fn type_count(&self) -> usize {
        self.types.len()
    }

    fn parse_owned(data: Vec<u8>, origin: String) -> Result<Self, BtfError> {
        let malformed = |offset: usize, reason: String| BtfError::Malformed {
            origin: origin.clone(),
            offset,
            reason,
        };
        let (Some(&m0), Some(&m1)) = (data.first(), data.get(1)) else {
            return Err(malformed(
                0,
                format!("{} bytes, shorter than the btf header", data.len()),
            ));
        };
        let magic = u16::from_le_bytes([m0, m1]);
        if magic != MAGIC {
            if magic == MAGIC.swap_bytes() {
                return Err(BtfError::BigEndian { origin });
            }
            return Err(BtfError::BadMagic { origin, magic });
        }
        if data.len() < HEADER_LEN {
            return Err(malformed(
                0,
                format!("{} bytes, shorter than the btf header", data.len()),
            ));
        }
        let version = data.get(2).copied().unwrap_or_default();
        if version != VERSION {
            return Err(BtfError::UnsupportedVersion { origin, version });
        }
        let field = |at: usize| {
            u32_at(&data, at)
                .map(|v| v as usize)
                .ok_or_else(|| malformed(at, "truncated header".to_owned()))
        };
        let hdr_len = field(4)?;
        if hdr_len < HEADER_LEN || hdr_len > data.len() {
            return Err(malformed(
                4,
                format!(
                    "header length {hdr_len} outside {HEADER_LEN}..={}",
                    data.len()
                ),
            ));
        }
        let section = |what: &str, off_at: usize| -> Result<(usize, usize), BtfError> {
            let (off, len) = (field(off_at)?, field(off_at + 4)?);
            let start = hdr_len.checked_add(off);
            let end = start.and_then(|s| s.checked_add(len));
            match (start, end) {
                (Some(start), Some(end)) if end <= data.len() => Ok((start, end)),
                _ => Err(malformed(
                    off_at,
                    format!(
                        "{what} section (offset {off}, length {len}) runs past the end \
                         of the {} byte blob",
                        data.len()
                    ),
                )),
            }
        };
        let (type_start, type_end) = section("type", 8)?;
        let (str_start, str_end) = section("string", 16)?;

        let mut btf = Btf {
            origin: origin.clone(),
            data: Vec::new(),
            str_start,
            str_end,
            types: Vec::new(),
            names: HashMap::new(),
        };
        let mut at = type_start;
        while at < type_end {
            let id = btf.types.len() + 1;
            let (Some(name_off), Some(info), Some(size_or_type)) = (
                u32_at(&data, at).filter(|_| type_end - at >= TYPE_LEN),
                u32_at(&data, at + 4),
                u32_at(&data, at + 8),
            ) else {
                return Err(malformed(at, format!("type id {id}: truncated record")));
            };
            let rec = TypeRec {
                info,
                size_or_type,
                at,
            };
            let vlen = rec.vlen();
            let extra = match rec.kind() {
                kind::PTR
                | kind::FWD
                | kind::TYPEDEF
                | kind::VOLATILE
                | kind::CONST
                | kind::RESTRICT
                | kind::FUNC
                | kind::FLOAT
                | kind::TYPE_TAG => 0,
                kind::INT | kind::VAR | kind::DECL_TAG => 4,
                kind::ARRAY => 12,
                kind::STRUCT | kind::UNION | kind::DATASEC | kind::ENUM64 => vlen * 12,
                kind::ENUM | kind::FUNC_PROTO => vlen * 8,
                other => {
                    return Err(malformed(at, format!("type id {id}: unknown kind {other}")));
                }
            };
            let next = at + TYPE_LEN + extra;
            if next > type_end {
                return Err(malformed(
                    at,
                    format!(
                        "type id {id}: {extra} bytes of kind-specific data run past the \
                         type section"
                    ),
                ));
            }
            btf.types.push(rec);
            if matches!(rec.kind(), kind::STRUCT | kind::UNION | kind::TYPEDEF) && name_off != 0 {
                let name = btf.name_in(&data, name_off, at)?;
                // Ids fit in u32: each record takes at least 12 of the blob's bytes,
                // and section bounds were computed from u32 fields.
                let id = u32::try_from(id)
                    .map_err(|_| malformed(at, "more than 2^32 types".to_owned()))?;
                btf.names.entry(name.into()).or_default().push(id);
            }
            at = next;
        }
        btf.data = data;
        Ok(btf)
    }

    /// The NUL-terminated string at `name_off` in the string section of `data`.
    /// `at` is the offset of the record naming it, for errors.
    fn name_in<'a>(&self, data: &'a [u8], name_off: u32, at: usize) -> Result<&'a [u8], BtfError> {
        if name_off == 0 {
            return Ok(b"");
        }
        let start = self.str_start.checked_add(name_off as usize);
        let section = start
            .filter(|&s| s < self.str_end)
            .and_then(|s| data.get(s..self.str_end));
        let Some(section) = section else {
            return Err(self.malformed(
                at,
                format!("name offset {name_off} past the string section"),
            ));
        };
        match section.iter().position(|&b| b == 0) {
            Some(len) => Ok(section.get(..len).unwrap_or_default()),
            None => Err(self.malformed(
                at,
                format!("name at offset {name_off} is not NUL-terminated"),
            )),
        }
    }

    fn name(&self, name_off: u32, at: usize) -> Result<&[u8], BtfError> {
        self.name_in(&self.data, name_off, at)
    }

    fn malformed(&self, offset: usize, reason: String) -> BtfError {
        BtfError::Malformed {
            origin: self.origin.clone(),
            offset,
            reason,
        }
    }

    /// The type `id` (not 0), referenced by the record at `at`.
    fn ty(&self, id: u32, at: usize) -> Result<TypeRec, BtfError> {
        (id as usize)
            .checked_sub(1)
            .and_then(|i| self.types.get(i))
            .copied()
            .ok_or_else(|| {
                self.malformed(
                    at,
                    format!("reference to type id {id}, not in 1..={}", self.types.len()),
                )
            })
    }

    /// Follows typedef, const, volatile, restrict and type tag modifiers from `id`
    /// (referenced by the record at `at`) to the underlying type; 0 is `void`.
    fn skip_modifiers(&self, mut id: u32, mut at: usize) -> Result<u32, BtfError> {
        for _ in 0..MAX_DEPTH {
            if id == 0 {
                return Ok(0);
            }
            let t = self.ty(id, at)?;
            match t.kind() {
                kind::TYPEDEF | kind::CONST | kind::VOLATILE | kind::RESTRICT | kind::TYPE_TAG => {
                    id = t.size_or_type;
                    at = t.at;
                }
                _ => return Ok(id),
            }
        }
        Err(self.malformed(at, "modifier chain too long or cyclic".to_owned()))
    }

    /// The `u32` word `index` of the kind-specific data of `t`.
    fn word(&self, t: &TypeRec, index: usize) -> Result<u32, BtfError> {
        index
            .checked_mul(4)
            .and_then(|o| o.checked_add(t.data()))
            .and_then(|o| u32_at(&self.data, o))
            .ok_or_else(|| self.malformed(t.at, "kind-specific data out of bounds".to_owned()))
    }

    /// The struct, union or typedef ids named `name` whose kind is in `kinds`.
    fn named<'a>(&'a self, name: &str, kinds: &'a [u8]) -> impl Iterator<Item = u32> + 'a {
        self.names
            .get(name.as_bytes())
            .into_iter()
            .flatten()
            .copied()
            .filter(move |&id| {
                (id as usize)
                    .checked_sub(1)
                    .and_then(|i| self.types.get(i))
                    .is_some_and(|t| kinds.contains(&t.kind()))
            })
    }

    /// Searches struct or union `t` for `member`, descending into anonymous struct
    /// and union members.
    fn find_member(
        &self,
        t: &TypeRec,
        member: &[u8],
        depth: u32,
    ) -> Result<Option<Found>, BtfError> {
        if depth >= MAX_DEPTH {
            return Err(self.malformed(
                t.at,
                "anonymous members nested too deeply or cyclic".to_owned(),
            ));
        }
        for i in 0..t.vlen() {
            let name_off = self.word(t, i * 3)?;
            let type_id = self.word(t, i * 3 + 1)?;
            let offset = self.word(t, i * 3 + 2)?;
            let (bit_offset, bitfield_size) = if t.kind_flag() {
                (offset & 0x00ff_ffff, offset >> 24)
            } else {
                (offset, 0)
            };
            if name_off != 0 {
                if self.name(name_off, t.at)? == member {
                    return Ok(Some(Found {
                        bit_offset: u64::from(bit_offset),
                        bitfield_size,
                    }));
                }
                continue;
            }
            let inner_id = self.skip_modifiers(type_id, t.at)?;
            if inner_id == 0 {
                continue;
            }
            let inner = self.ty(inner_id, t.at)?;
            if matches!(inner.kind(), kind::STRUCT | kind::UNION)
                && let Some(found) = self.find_member(&inner, member, depth + 1)?
            {
                return Ok(Some(Found {
                    bit_offset: u64::from(bit_offset) + found.bit_offset,
                    bitfield_size: found.bitfield_size,
                }));
            }
        }
        Ok(None)
    }

    /// Byte offset of `member` in `struct struct_name` (or a union of that name),
    /// searching anonymous nested struct/union members and adding their offsets —
    /// what a CO-RE field-offset relocation of `s->member` would resolve to.
    ///
    /// Errors when there is no such struct or member, or when the member is a
    /// bitfield or does not start on a byte boundary.
    pub fn member_offset(&self, struct_name: &str, member: &str) -> Result<u32, BtfError> {
        let mut any = false;
        for id in self.named(struct_name, &[kind::STRUCT, kind::UNION]) {
            any = true;
            let t = self.ty(id, 0)?;
            let Some(found) = self.find_member(&t, member.as_bytes(), 0)? else {
                continue;
            };
            if found.bitfield_size != 0 {
                return Err(BtfError::Bitfield {
                    struct_name: struct_name.to_owned(),
                    member: member.to_owned(),
                    origin: self.origin.clone(),
                });
            }
            if found.bit_offset % 8 != 0 {
                return Err(BtfError::Unaligned {
                    struct_name: struct_name.to_owned(),
                    member: member.to_owned(),
                    bit_offset: found.bit_offset,
                    origin: self.origin.clone(),
                });
            }
            return u32::try_from(found.bit_offset / 8).map_err(|_| BtfError::OffsetOverflow {
                struct_name: struct_name.to_owned(),
                member: member.to_owned(),
                origin: self.origin.clone(),
            });
        }
        if any {
            Err(BtfError::NoMember {
                struct_name: struct_name.to_owned(),
                member: member.to_owned(),
                origin: self.origin.clone(),
            })
        } else {
            Err(BtfError::NoStruct {
                name: struct_name.to_owned(),
                origin: self.origin.clone(),
            })
        }
    }

    /// The function prototype behind tracepoint `name`.
    ///
    /// The kernel declares, for each tracepoint,
    /// `typedef void (*btf_trace_<name>)(void *__data, <TP_PROTO args>)`, so this is
    /// the typedef's pointee and its parameter 0 is the context pointer, not a
    /// tracepoint argument.
    fn tracepoint_proto(&self, name: &str) -> Result<TypeRec, BtfError> {
        let typedef = format!("btf_trace_{name}");
        let bad = |reason: String| BtfError::BadTracepoint {
            name: name.to_owned(),
            origin: self.origin.clone(),
            reason,
        };
        let Some(id) = self.named(&typedef, &[kind::TYPEDEF]).next() else {
            return Err(BtfError::NoTracepoint {
                name: name.to_owned(),
                typedef,
                origin: self.origin.clone(),
            });
        };
        let td = self.ty(id, 0)?;
        let ptr_id = self.skip_modifiers(td.size_or_type, td.at)?;
        let ptr = (ptr_id != 0)
            .then(|| self.ty(ptr_id, td.at))
            .transpose()?
            .filter(|t| t.kind() == kind::PTR)
            .ok_or_else(|| bad(format!("typedef {typedef} is not a function pointer")))?;
        let proto_id = self.skip_modifiers(ptr.size_or_type, ptr.at)?;
        let proto = (proto_id != 0)
            .then(|| self.ty(proto_id, ptr.at))
            .transpose()?
            .filter(|t| t.kind() == kind::FUNC_PROTO)
            .ok_or_else(|| bad(format!("typedef {typedef} is not a function pointer")))?;
        if proto.vlen() == 0 {
            return Err(bad(format!("typedef {typedef} has no context parameter")));
        }
        Ok(proto)
    }

    /// For the tracepoint `name`: whether its argument `index` (0 is the first
    /// `TP_PROTO` argument, after the hidden context pointer) is a pointer, looking
    /// through typedefs and const/volatile/restrict/type-tag modifiers.
    ///
    /// E.g. `mark_victim`'s argument 0 is a `struct task_struct *` on newer kernels
    /// (and on Debian's 6.1.192, which has the change backported) and an `int pid`
    /// on older ones: which one is read here, never assumed from the version.
    pub fn tracepoint_arg_is_pointer(&self, name: &str, index: usize) -> Result<bool, BtfError> {
        let proto = self.tracepoint_proto(name)?;
        let count = proto.vlen() - 1;
        if index >= count {
            return Err(BtfError::NoTracepointArg {
                name: name.to_owned(),
                index,
                count,
                origin: self.origin.clone(),
            });
        }
        // Parameters are (name_off, type) pairs; parameter index + 1 skips the context.
        let type_id = self.word(&proto, (index + 1) * 2 + 1)?;
        let id = self.skip_modifiers(type_id, proto.at)?;
        Ok(id != 0 && self.ty(id, proto.at)?.kind() == kind::PTR)
    }

    /// The number of arguments of tracepoint `name` (its `TP_PROTO` arguments, not
    /// counting the hidden context pointer); errors when the kernel has no such
    /// tracepoint. E.g. `sched_process_exit` gains `group_dead` as a second argument
    /// in Linux 6.16.
    pub fn tracepoint_arg_count(&self, name: &str) -> Result<usize, BtfError> {
        Ok(self.tracepoint_proto(name)?.vlen() - 1)
    }
}

/// Computes every offset in [`KernelOffsets`] from `btf`: what libbpf CO-RE would
/// relocate the programs' field accesses to, derived at load time.
///
/// `oom_victim_arg_is_task` is 1 when the `mark_victim` tracepoint's first argument
/// is a pointer (`struct task_struct *`, newer and some backported kernels) and 0
/// when it is the victim's pid. `exit_group_dead_arg` is 1 when
/// `sched_process_exit` has the `group_dead` argument (from 6.16; the same kernel
/// change moved the tracepoint before `exit_mm`), which decides the exit program
/// the loader attaches.
pub fn kernel_offsets(btf: &Btf) -> Result<KernelOffsets, BtfError> {
    let off = |s: &str, m: &str| btf.member_offset(s, m);
    let offsets = KernelOffsets {
        task_tgid: off("task_struct", "tgid")?,
        task_real_parent: off("task_struct", "real_parent")?,
        task_group_leader: off("task_struct", "group_leader")?,
        task_exit_code: off("task_struct", "exit_code")?,
        task_signal: off("task_struct", "signal")?,
        task_start_boottime: off("task_struct", "start_boottime")?,
        signal_live: off("signal_struct", "live")?,
        signal_oom_mm: off("signal_struct", "oom_mm")?,
        binprm_filename: off("linux_binprm", "filename")?,
        cgroup_kn: off("cgroup", "kn")?,
        cgroup_level: off("cgroup", "level")?,
        cgroup_root: off("cgroup", "root")?,
        kernfs_node_id: off("kernfs_node", "id")?,
        cgroup_root_hierarchy_id: off("cgroup_root", "hierarchy_id")?,
        oom_victim_arg_is_task: u32::from(btf.tracepoint_arg_is_pointer("mark_victim", 0)?),
        task_pid: off("task_struct", "pid")?,
        signal_flags: off("signal_struct", "flags")?,
        signal_group_exit_code: off("signal_struct", "group_exit_code")?,
        task_mm: off("task_struct", "mm")?,
        exit_group_dead_arg: u32::from(btf.tracepoint_arg_count("sched_process_exit")? >= 2),
        task_cgroups: off("task_struct", "cgroups")?,
        css_set_dfl_cgrp: off("css_set", "dfl_cgrp")?,
    };
    tracing::debug!(
        origin = btf.origin(),
        ?offsets,
        "kernel struct offsets from btf"
    );
    Ok(offsets)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds synthetic BTF blobs: strings plus type records.
    struct Builder {
        strings: Vec<u8>,
        types: Vec<u8>,
        next_id: u32,
    }

    impl Builder {
        fn new() -> Self {
            Builder {
                strings: vec![0],
                types: Vec::new(),
                next_id: 1,
            }
        }

        fn string(&mut self, s: &str) -> u32 {
            if s.is_empty() {
                return 0;
            }
            let off = self.strings.len() as u32;
            self.strings.extend_from_slice(s.as_bytes());
            self.strings.push(0);
            off
        }

        fn record(
            &mut self,
            name: &str,
            kind: u8,
            kind_flag: bool,
            vlen: usize,
            size_or_type: u32,
            extra: &[u32],
        ) -> u32 {
            let name_off = self.string(name);
            let info = vlen as u32 | u32::from(kind) << 24 | u32::from(kind_flag) << 31;
            for w in [name_off, info, size_or_type].iter().chain(extra) {
                self.types.extend_from_slice(&w.to_le_bytes());
            }
            self.next_id += 1;
            self.next_id - 1
        }

        fn int(&mut self, name: &str, size: u32) -> u32 {
            self.record(name, kind::INT, false, 0, size, &[size * 8])
        }

        fn modifier(&mut self, kind: u8, name: &str, to: u32) -> u32 {
            self.record(name, kind, false, 0, to, &[])
        }

        fn ptr(&mut self, to: u32) -> u32 {
            self.modifier(kind::PTR, "", to)
        }

        fn typedef(&mut self, name: &str, to: u32) -> u32 {
            self.modifier(kind::TYPEDEF, name, to)
        }

        /// A struct or union; members are (name, type, bit offset[, bitfield size]).
        fn composite(
            &mut self,
            kind: u8,
            name: &str,
            size: u32,
            kind_flag: bool,
            members: &[(&str, u32, u32, u32)],
        ) -> u32 {
            let mut extra = Vec::new();
            for &(n, t, off, bits) in members {
                extra.extend([
                    self.string(n),
                    t,
                    if kind_flag { bits << 24 | off } else { off },
                ]);
            }
            self.record(name, kind, kind_flag, members.len(), size, &extra)
        }

        fn struct_(&mut self, name: &str, size: u32, members: &[(&str, u32, u32)]) -> u32 {
            let m: Vec<_> = members.iter().map(|&(n, t, o)| (n, t, o, 0)).collect();
            self.composite(kind::STRUCT, name, size, false, &m)
        }

        fn union_(&mut self, name: &str, size: u32, members: &[(&str, u32, u32)]) -> u32 {
            let m: Vec<_> = members.iter().map(|&(n, t, o)| (n, t, o, 0)).collect();
            self.composite(kind::UNION, name, size, false, &m)
        }

        fn func_proto(&mut self, ret: u32, params: &[(&str, u32)]) -> u32 {
            let mut extra = Vec::new();
            for &(n, t) in params {
                extra.extend([self.string(n), t]);
            }
            self.record("", kind::FUNC_PROTO, false, params.len(), ret, &extra)
        }

        /// `typedef void (*btf_trace_<name>)(void *__data, params...)`.
        fn tracepoint(&mut self, name: &str, params: &[(&str, u32)]) -> u32 {
            let void_ptr = self.ptr(0);
            let mut all = vec![("__data", void_ptr)];
            all.extend_from_slice(params);
            let proto = self.func_proto(0, &all);
            let ptr = self.ptr(proto);
            self.typedef(&format!("btf_trace_{name}"), ptr)
        }

        fn build_with(&self, hdr_len: u32, gap: u32) -> Vec<u8> {
            let mut out = Vec::new();
            out.extend_from_slice(&MAGIC.to_le_bytes());
            out.push(VERSION);
            out.push(0);
            let type_len = self.types.len() as u32;
            let str_off = type_len + gap;
            for w in [hdr_len, 0, type_len, str_off, self.strings.len() as u32] {
                out.extend_from_slice(&w.to_le_bytes());
            }
            out.resize(hdr_len as usize, 0);
            out.extend_from_slice(&self.types);
            out.resize(out.len() + gap as usize, 0xAA);
            out.extend_from_slice(&self.strings);
            out
        }

        fn build(&self) -> Vec<u8> {
            self.build_with(HEADER_LEN as u32, 0)
        }
    }

    /// The offsets [`fake_kernel`] lays out.
    const FAKE: KernelOffsets = KernelOffsets {
        task_tgid: 1236,
        task_real_parent: 1248,
        task_group_leader: 1264,
        task_exit_code: 1232,
        task_signal: 1800,
        task_start_boottime: 1700,
        signal_live: 4,
        signal_oom_mm: 200,
        binprm_filename: 96,
        cgroup_kn: 256,
        cgroup_level: 180,
        cgroup_root: 264,
        kernfs_node_id: 88,
        cgroup_root_hierarchy_id: 8,
        oom_victim_arg_is_task: 0,
        task_pid: 1240,
        signal_flags: 96,
        signal_group_exit_code: 100,
        task_mm: 1280,
        exit_group_dead_arg: 0,
        task_cgroups: 1320,
        css_set_dfl_cgrp: 136,
    };

    /// A blob shaped like vmlinux's parts we use: `task_struct` wraps its fields in
    /// an anonymous struct (as randomized layouts do) holding an anonymous union,
    /// with bitfields, modifier chains and every BTF kind sprinkled in. A newer
    /// kernel (`mark_victim` takes the task) also has `group_dead` in
    /// `sched_process_exit`; an older one does not.
    fn fake_kernel(mark_victim_takes_task: bool) -> Vec<u8> {
        let mut b = Builder::new();
        let int = b.int("int", 4);
        let u64_ = b.int("unsigned long long", 8);
        let uint = b.int("unsigned int", 4);
        let char_ = b.int("char", 1);
        let pid_t = b.typedef("pid_t", int);
        let uid_t = b.typedef("uid_t", uint);
        let const_pid = b.modifier(kind::CONST, "", pid_t);
        let volatile_int = b.modifier(kind::VOLATILE, "", int);
        let fwd_task = b.record("task_struct", kind::FWD, false, 0, 0, &[]);
        let task_ptr_fwd = b.ptr(fwd_task);
        // Other kinds, which must be skipped correctly.
        b.record("", kind::ARRAY, false, 0, 0, &[char_, int, 16]);
        b.record(
            "state",
            kind::ENUM,
            false,
            2,
            4,
            &[b.strings.len() as u32, 0, 0, 1],
        );
        b.record("big", kind::ENUM64, false, 1, 8, &[0, 1, 2]);
        b.record("double", kind::FLOAT, false, 0, 8, &[]);
        let fp = b.func_proto(int, &[("x", int)]);
        let func = b.record("do_thing", kind::FUNC, false, 0, fp, &[]);
        let var = b.record("jiffies", kind::VAR, false, 0, u64_, &[1]);
        b.record(".data", kind::DATASEC, false, 1, 8, &[var, 0, 8]);
        b.record("tag", kind::DECL_TAG, false, 0, func, &[u32::MAX]);
        let tagged = b.modifier(kind::TYPE_TAG, "user", char_);
        let restrict = b.modifier(kind::RESTRICT, "", tagged);
        let char_ptr = b.ptr(restrict);

        let signal = b.struct_(
            "signal_struct",
            1024,
            &[
                ("sigcnt", int, 0),
                ("live", volatile_int, 32),
                ("flags", uint, 96 * 8),
                ("group_exit_code", int, 100 * 8),
                ("oom_mm", char_ptr, 1600),
            ],
        );
        let signal_ptr = b.ptr(signal);
        let fwd_cgroup = b.record("cgroup", kind::FWD, false, 0, 0, &[]);
        let cgroup_ptr = b.ptr(fwd_cgroup);
        let css_set = b.struct_(
            "css_set",
            512,
            &[("refcount", int, 0), ("dfl_cgrp", cgroup_ptr, 136 * 8)],
        );
        let css_set_ptr = b.ptr(css_set);
        // Bitfields (kind_flag) before the anonymous part.
        let flags = b.composite(
            kind::STRUCT,
            "",
            8,
            true,
            &[
                ("in_execve", uint, 0, 1),
                ("in_iowait", uint, 1, 1),
                ("pad", uint, 32, 0),
            ],
        );
        // Anonymous union at +8 bytes of the anonymous struct: pid/tgid alias.
        let ids = b.union_("", 8, &[("", 0, 0), ("pid", const_pid, 64)]);
        let ids_const = b.modifier(kind::CONST, "", ids);
        let inner = b.struct_(
            "",
            600,
            &[
                ("exit_code", int, 0),
                ("tgid", pid_t, 32),
                ("", ids_const, 0),
                ("real_parent", task_ptr_fwd, 128),
                ("group_leader", task_ptr_fwd, 256),
                ("mm", char_ptr, 384),
                ("cgroups", css_set_ptr, (1320 - 1232) * 8),
                ("start_boottime", u64_, (1700 - 1232) * 8),
            ],
        );
        let task = b.composite(
            kind::STRUCT,
            "task_struct",
            4096,
            true,
            &[
                ("", flags, 64, 0),
                ("__state", uint, 0, 0),
                ("in_execve", uint, 32, 1),
                ("", inner, 1232 * 8, 0),
                ("signal", signal_ptr, 1800 * 8, 0),
            ],
        );
        let task_ptr = b.ptr(task);
        let const_task_ptr = b.modifier(kind::CONST, "", task_ptr);
        b.struct_(
            "linux_binprm",
            400,
            &[("mm", char_ptr, 0), ("filename", char_ptr, 96 * 8)],
        );
        let kn = b.struct_(
            "kernfs_node",
            128,
            &[("count", int, 0), ("id", u64_, 88 * 8)],
        );
        let kn_ptr = b.ptr(kn);
        let root = b.struct_(
            "cgroup_root",
            8192,
            &[("kf_root", char_ptr, 0), ("hierarchy_id", int, 64)],
        );
        let root_ptr = b.ptr(root);
        let level = b.typedef("level_t", int);
        b.struct_(
            "cgroup",
            2048,
            &[
                ("level", level, 180 * 8),
                ("kn", kn_ptr, 256 * 8),
                ("root", root_ptr, 264 * 8),
            ],
        );
        // An empty struct of another name, and a forward declaration of cgroup.
        b.struct_("empty", 0, &[]);
        b.record("cgroup", kind::FWD, false, 0, 0, &[]);
        if mark_victim_takes_task {
            let typedef_task = b.typedef("task_ptr_t", const_task_ptr);
            b.tracepoint("mark_victim", &[("task", typedef_task), ("uid", uid_t)]);
        } else {
            b.tracepoint("mark_victim", &[("pid", int)]);
        }
        let bool_ = b.int("_Bool", 1);
        if mark_victim_takes_task {
            b.tracepoint(
                "sched_process_exit",
                &[("p", task_ptr), ("group_dead", bool_)],
            );
        } else {
            b.tracepoint("sched_process_exit", &[("p", task_ptr)]);
        }
        b.build()
    }

    /// Runs every query; used to check that nothing panics on corrupted input.
    fn exercise(btf: &Btf) {
        let _ = kernel_offsets(btf);
        let _ = btf.member_offset("task_struct", "in_execve");
        let _ = btf.member_offset("task_struct", "nope");
        let _ = btf.member_offset("nope", "x");
        let _ = btf.tracepoint_arg_count("sched_process_exit");
        let _ = btf.tracepoint_arg_is_pointer("sched_process_exit", 1);
        let _ = btf.tracepoint_arg_is_pointer("mark_victim", 5);
        let _ = format!("{btf:?}");
    }

    #[test]
    fn offsets_of_fake_kernel_with_pid_mark_victim() {
        let btf = Btf::parse(&fake_kernel(false)).expect("parse");
        assert_eq!(kernel_offsets(&btf).expect("offsets"), FAKE);
        assert!(
            !btf.tracepoint_arg_is_pointer("mark_victim", 0)
                .expect("arg")
        );
        assert_eq!(btf.tracepoint_arg_count("mark_victim").expect("count"), 1);
    }

    #[test]
    fn offsets_of_fake_kernel_with_task_mark_victim() {
        let btf = Btf::parse(&fake_kernel(true)).expect("parse");
        let want = KernelOffsets {
            oom_victim_arg_is_task: 1,
            exit_group_dead_arg: 1,
            ..FAKE
        };
        assert_eq!(kernel_offsets(&btf).expect("offsets"), want);
        assert_eq!(btf.tracepoint_arg_count("mark_victim").expect("count"), 2);
        // uid_t is a typedef of an int, not a pointer.
        assert!(
            !btf.tracepoint_arg_is_pointer("mark_victim", 1)
                .expect("arg")
        );
        let err = btf.tracepoint_arg_is_pointer("mark_victim", 2).unwrap_err();
        assert!(
            matches!(
                err,
                BtfError::NoTracepointArg {
                    count: 2,
                    index: 2,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            "tracepoint mark_victim has 2 arguments, no argument 2, in in-memory btf"
        );
    }

    #[test]
    fn tracepoint_through_typedef_chain() {
        let mut b = Builder::new();
        let int = b.int("int", 4);
        let proto = b.func_proto(0, &[("__data", 0), ("a", int)]);
        let ptr = b.ptr(proto);
        let c = b.modifier(kind::CONST, "", ptr);
        let t1 = b.typedef("inner_fn", c);
        b.typedef("btf_trace_chained", t1);
        let btf = Btf::parse(&b.build()).expect("parse");
        assert_eq!(btf.tracepoint_arg_count("chained").expect("count"), 1);
        assert!(!btf.tracepoint_arg_is_pointer("chained", 0).expect("arg"));
    }

    #[test]
    fn tracepoint_of_wrong_shape() {
        let mut b = Builder::new();
        let int = b.int("int", 4);
        b.typedef("btf_trace_notptr", int);
        let ptr = b.ptr(int);
        b.typedef("btf_trace_ptrint", ptr);
        let proto = b.func_proto(0, &[]);
        let ptr = b.ptr(proto);
        b.typedef("btf_trace_noctx", ptr);
        b.typedef("btf_trace_void", 0);
        let btf = Btf::parse(&b.build()).expect("parse");
        for name in ["notptr", "ptrint", "noctx", "void"] {
            let err = btf.tracepoint_arg_count(name).unwrap_err();
            assert!(
                matches!(err, BtfError::BadTracepoint { .. }),
                "{name}: {err}"
            );
            assert!(
                err.to_string().contains(&format!("btf_trace_{name}")),
                "{err}"
            );
        }
    }

    #[test]
    fn missing_mark_victim_is_named() {
        let mut b = Builder::new();
        let int = b.int("int", 4);
        for s in ["task_struct", "signal_struct", "linux_binprm", "cgroup"] {
            let m: Vec<_> = [
                "tgid",
                "real_parent",
                "group_leader",
                "exit_code",
                "signal",
                "start_boottime",
                "pid",
                "live",
                "oom_mm",
                "filename",
                "kn",
                "level",
                "root",
            ]
            .iter()
            .enumerate()
            .map(|(i, &n)| (n, int, i as u32 * 32))
            .collect();
            b.struct_(s, 64, &m);
        }
        b.struct_("kernfs_node", 8, &[("id", int, 0)]);
        b.struct_("cgroup_root", 8, &[("hierarchy_id", int, 0)]);
        let btf = Btf::parse(&b.build()).expect("parse");
        let err = kernel_offsets(&btf).unwrap_err();
        assert!(matches!(err, BtfError::NoTracepoint { .. }), "{err}");
        assert_eq!(
            err.to_string(),
            "no tracepoint mark_victim in in-memory btf: typedef btf_trace_mark_victim not found"
        );
    }

    #[test]
    fn missing_struct_and_member() {
        let btf = Btf::parse(&fake_kernel(true)).expect("parse");
        let err = btf.member_offset("mm_struct", "pgd").unwrap_err();
        assert!(matches!(err, BtfError::NoStruct { .. }));
        assert_eq!(err.to_string(), "no struct mm_struct in in-memory btf");
        let err = btf.member_offset("task_struct", "comm").unwrap_err();
        assert!(matches!(err, BtfError::NoMember { .. }));
        assert_eq!(
            err.to_string(),
            "struct task_struct has no member comm in in-memory btf"
        );
        // Typedefs and forward declarations are not structs.
        assert!(matches!(
            btf.member_offset("pid_t", "x").unwrap_err(),
            BtfError::NoStruct { .. }
        ));
        // The forward declaration of cgroup does not hide the definition.
        assert_eq!(btf.member_offset("cgroup", "kn").expect("kn"), 256);
        assert!(matches!(
            btf.member_offset("empty", "x").unwrap_err(),
            BtfError::NoMember { .. }
        ));
    }

    #[test]
    fn bitfields() {
        let btf = Btf::parse(&fake_kernel(false)).expect("parse");
        // A bitfield directly in task_struct and one in an anonymous member.
        for m in ["in_execve", "in_iowait"] {
            let err = btf.member_offset("task_struct", m).unwrap_err();
            assert!(matches!(err, BtfError::Bitfield { .. }), "{m}: {err}");
            assert!(err.to_string().contains(m), "{err}");
        }
        // A kind_flag member with bitfield size 0 is a plain member.
        assert_eq!(btf.member_offset("task_struct", "pad").expect("pad"), 12);
        assert_eq!(
            btf.member_offset("task_struct", "__state").expect("state"),
            0
        );
    }

    #[test]
    fn unaligned_member() {
        let mut b = Builder::new();
        let int = b.int("int", 4);
        b.struct_("odd", 8, &[("a", int, 0), ("b", int, 36)]);
        let btf = Btf::parse(&b.build()).expect("parse");
        let err = btf.member_offset("odd", "b").unwrap_err();
        assert!(
            matches!(err, BtfError::Unaligned { bit_offset: 36, .. }),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            "member b of struct odd is at bit offset 36, not on a byte boundary, in in-memory btf"
        );
    }

    #[test]
    fn unions_and_deep_nesting() {
        let mut b = Builder::new();
        let int = b.int("int", 4);
        let l3 = b.struct_("", 8, &[("x", int, 0), ("deep", int, 32)]);
        let l2 = b.union_("", 8, &[("y", int, 0), ("", l3, 0)]);
        let l1 = b.struct_("", 16, &[("z", int, 0), ("", l2, 64)]);
        b.struct_("outer", 32, &[("w", int, 0), ("", l1, 128)]);
        b.union_("u", 8, &[("a", int, 0), ("", l3, 0)]);
        let btf = Btf::parse(&b.build()).expect("parse");
        assert_eq!(
            btf.member_offset("outer", "deep").expect("deep"),
            16 + 8 + 4
        );
        assert_eq!(btf.member_offset("outer", "z").expect("z"), 16);
        assert_eq!(btf.member_offset("u", "deep").expect("union"), 4);
    }

    #[test]
    fn cycles_are_errors() {
        let mut b = Builder::new();
        // Type 1 is a typedef of itself; type 2 a struct whose anonymous member is
        // itself.
        b.typedef("btf_trace_loop", 1);
        let own_id = b.next_id;
        b.struct_("selfish", 8, &[("", own_id, 0)]);
        let btf = Btf::parse(&b.build()).expect("parse");
        let err = btf.tracepoint_arg_count("loop").unwrap_err();
        assert!(matches!(err, BtfError::Malformed { .. }), "{err}");
        let err = btf.member_offset("selfish", "x").unwrap_err();
        assert!(matches!(err, BtfError::Malformed { .. }), "{err}");
    }

    #[test]
    fn dangling_type_reference() {
        let mut b = Builder::new();
        b.struct_("s", 8, &[("", 99, 0)]);
        let btf = Btf::parse(&b.build()).expect("parse");
        let err = btf.member_offset("s", "x").unwrap_err();
        assert!(err.to_string().contains("type id 99"), "{err}");
    }

    #[test]
    fn larger_header_and_gaps() {
        let mut b = Builder::new();
        let int = b.int("int", 4);
        b.struct_("s", 8, &[("a", int, 0), ("b", int, 32)]);
        let btf = Btf::parse(&b.build_with(32, 12)).expect("parse");
        assert_eq!(btf.member_offset("s", "b").expect("b"), 4);
        assert_eq!(btf.type_count(), 2);
    }

    #[test]
    fn bad_header() {
        let good = fake_kernel(true);

        let mut bad = good.clone();
        bad[0] = 0x12;
        let err = Btf::parse(&bad).unwrap_err();
        assert!(
            matches!(err, BtfError::BadMagic { magic: 0xeb12, .. }),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            "in-memory btf is not btf: magic 0xeb12, expected 0xeb9f"
        );

        let mut bad = good.clone();
        bad.swap(0, 1);
        assert!(matches!(
            Btf::parse(&bad).unwrap_err(),
            BtfError::BigEndian { .. }
        ));

        let mut bad = good.clone();
        bad[2] = 2;
        assert!(matches!(
            Btf::parse(&bad).unwrap_err(),
            BtfError::UnsupportedVersion { version: 2, .. }
        ));

        let mut bad = good.clone();
        bad[4..8].copy_from_slice(&8u32.to_le_bytes());
        assert!(matches!(
            Btf::parse(&bad).unwrap_err(),
            BtfError::Malformed { offset: 4, .. }
        ));

        // String section past the end.
        let mut bad = good.clone();
        bad[20..24].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Btf::parse(&bad).unwrap_err(),
            BtfError::Malformed { offset: 16, .. }
        ));

        assert!(matches!(
            Btf::parse(&[]).unwrap_err(),
            BtfError::Malformed { offset: 0, .. }
        ));
    }

    #[test]
    fn unknown_kind_is_malformed() {
        let mut b = Builder::new();
        b.int("int", 4);
        b.record("x", 20, false, 0, 0, &[]);
        let err = Btf::parse(&b.build()).unwrap_err();
        assert!(err.to_string().contains("unknown kind 20"), "{err}");
    }

    #[test]
    fn truncation_never_panics() {
        for blob in [fake_kernel(false), fake_kernel(true)] {
            for len in 0..blob.len() {
                // Truncating the blob, or shrinking the type section length.
                if let Ok(btf) = Btf::parse(&blob[..len]) {
                    exercise(&btf);
                }
                let mut short = blob.clone();
                short[12..16].copy_from_slice(&(len as u32).to_le_bytes());
                if let Ok(btf) = Btf::parse(&short) {
                    exercise(&btf);
                }
            }
        }
    }

    #[test]
    fn corruption_never_panics() {
        let blob = fake_kernel(true);
        for i in 0..blob.len() {
            for v in [0x00, 0xff, 0x80, 0x7f, 0x01, blob[i] ^ 0x10] {
                let mut bad = blob.clone();
                bad[i] = v;
                if let Ok(btf) = Btf::parse(&bad) {
                    exercise(&btf);
                }
            }
        }
        // Random multi-byte corruption (xorshift, fixed seed).
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..20_000 {
            let mut bad = blob.clone();
            for _ in 0..1 + next() % 8 {
                let at = (next() % bad.len() as u64) as usize;
                bad[at] = next() as u8;
            }
            if let Ok(btf) = Btf::parse(&bad) {
                exercise(&btf);
            }
        }
    }

    #[test]
    fn missing_file_is_io_error() {
        let err = Btf::from_file(Path::new("/nonexistent/btf")).unwrap_err();
        assert!(matches!(err, BtfError::Io { .. }));
        assert!(
            err.to_string()
                .starts_with("cannot read btf /nonexistent/btf: "),
            "{err}"
        );
    }

    #[test]
    fn real_vmlinux() {
        let path = Path::new(VMLINUX_BTF_PATH);
        if !path.exists() {
            eprintln!("skipping: {VMLINUX_BTF_PATH} does not exist on this host");
            return;
        }
        let started = std::time::Instant::now();
        let btf = match Btf::from_sys_fs() {
            Ok(btf) => btf,
            Err(BtfError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::PermissionDenied =>
            {
                eprintln!("skipping: {VMLINUX_BTF_PATH} is not readable: {source}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        eprintln!("parsed {btf:?} in {:?}", started.elapsed());
        let o = kernel_offsets(&btf).expect("kernel offsets");
        eprintln!("{o:#?}");
        assert!(o.task_exit_code != 0 && o.task_exit_code < 16384, "{o:?}");
        let task = [
            o.task_tgid,
            o.task_pid,
            o.task_real_parent,
            o.task_group_leader,
            o.task_exit_code,
            o.task_signal,
            o.task_start_boottime,
            o.task_mm,
            o.task_cgroups,
        ];
        for (i, a) in task.iter().enumerate() {
            assert!(*a != 0 && *a < 16384, "{o:?}");
            assert!(
                task[i + 1..].iter().all(|b| b != a),
                "duplicate offsets: {o:?}"
            );
        }
        let signal = [
            o.signal_live,
            o.signal_oom_mm,
            o.signal_flags,
            o.signal_group_exit_code,
        ];
        for (i, a) in signal.iter().enumerate() {
            assert!(*a < 4096, "{o:?}");
            assert!(
                signal[i + 1..].iter().all(|b| b != a),
                "duplicate offsets: {o:?}"
            );
        }
        assert!(o.signal_oom_mm != 0 && o.signal_oom_mm < 4096, "{o:?}");
        assert!(o.binprm_filename < 1024, "{o:?}");
        assert!(o.css_set_dfl_cgrp < 1024, "{o:?}");
        let cg = [o.cgroup_kn, o.cgroup_level, o.cgroup_root];
        assert!(cg.iter().all(|&v| v < 8192), "{o:?}");
        assert!(cg[0] != cg[1] && cg[1] != cg[2] && cg[0] != cg[2], "{o:?}");
        assert!(
            o.kernfs_node_id < 512 && o.cgroup_root_hierarchy_id < 8192,
            "{o:?}"
        );
        assert!(o.oom_victim_arg_is_task <= 1);
        let exit_args = btf
            .tracepoint_arg_count("sched_process_exit")
            .expect("exit");
        assert!((1..=2).contains(&exit_args), "{exit_args}");
        assert_eq!(o.exit_group_dead_arg, u32::from(exit_args == 2));
        eprintln!("sched_process_exit has {exit_args} args");

        // A few truncations of the real blob.
        let data = std::fs::read(path).expect("read");
        for len in [0, 3, 23, 24, 100, 4099, data.len() / 3, data.len() - 1] {
            assert!(Btf::parse(&data[..len]).is_err(), "truncated at {len}");
        }
    }
}
