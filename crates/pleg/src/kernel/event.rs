//! Decoding of the records the kernel programs put in the ring buffer.
//!
//! A record's length is checked against the layout its kind announces before any
//! field is read; a malformed record is rejected with [`DecodeError`] and counted by
//! the reader, never trusted.

use std::mem::size_of;

use evpleg_events::{
    CGROUP_PATH_LEN, COMM_LEN, CgroupEvent, EVENT_CGROUP_MKDIR, EVENT_CGROUP_RMDIR, EVENT_EXEC,
    EVENT_EXIT, EVENT_OOM_VICTIM, EXEC_FLAG_READ_ERROR, EXIT_FLAG_OOM_KILLED, EXIT_FLAG_READ_ERROR,
    EventHeader, ExecEvent, ExitEvent, FILENAME_LEN, OomVictimEvent,
};

use evpleg_core::lifecycle::ExitStatus;

/// Why a ring-buffer record was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    /// shorter than the header
    #[error("record of {len} bytes is shorter than the {header}-byte header")]
    Short { len: usize, header: usize },
    /// an unknown kind (kernel and user space built from different sources)
    #[error("record kind {kind} is unknown ({len} bytes)")]
    UnknownKind { kind: u32, len: usize },
    /// the size does not match the kind's layout
    #[error("record kind {kind} has {len} bytes, expected {expected}")]
    Size {
        kind: u32,
        len: usize,
        expected: usize,
    },
    /// a path that is not UTF-8
    #[error("cgroup path of cgroup id {cgroup_id} is not utf-8")]
    PathNotUtf8 { cgroup_id: u64 },
}

/// A decoded kernel record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelEvent {
    Exec(Exec),
    Exit(Exit),
    CgroupMkdir(CgroupChange),
    CgroupRmdir(CgroupChange),
    /// The OOM killer chose the process `tgid` (its thread-group id, as
    /// [`ProcessKey::pid`]).
    OomVictim {
        at_ns: u64,
        tgid: u32,
    },
}

impl KernelEvent {
    /// The kernel's CLOCK_MONOTONIC timestamp of the event.
    pub fn at_ns(&self) -> u64 {
        match self {
            Self::Exec(e) => e.at_ns,
            Self::Exit(e) => e.at_ns,
            Self::CgroupMkdir(c) | Self::CgroupRmdir(c) => c.at_ns,
            Self::OomVictim { at_ns, .. } => *at_ns,
        }
    }
}

/// A kernel string (a `comm`, a file name) kept as the record's bytes, up to
/// its NUL: decoding a record allocates nothing (the reader's hot path).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Name<const N: usize> {
    bytes: [u8; N],
    len: usize,
}

impl<const N: usize> Name<N> {
    pub fn new(raw: &[u8; N]) -> Self {
        Self {
            bytes: *raw,
            len: c_string(raw).len(),
        }
    }

    /// The name up to its first byte that is not UTF-8 (a kernel name is bytes).
    pub fn as_str(&self) -> &str {
        let bytes = &self.bytes[..self.len];
        match std::str::from_utf8(bytes) {
            Ok(s) => s,
            // SAFETY-free: the prefix up to `valid_up_to` is valid UTF-8.
            Err(e) => std::str::from_utf8(&bytes[..e.valid_up_to()]).unwrap_or_default(),
        }
    }
}

impl<const N: usize> From<&str> for Name<N> {
    fn from(s: &str) -> Self {
        let mut bytes = [0u8; N];
        let n = s.len().min(N);
        bytes[..n].copy_from_slice(&s.as_bytes()[..n]);
        Self::new(&bytes)
    }
}

impl<const N: usize> std::fmt::Debug for Name<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

impl<const N: usize> std::fmt::Display for Name<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl<const N: usize> PartialEq<&str> for Name<N> {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// A process identity that survives PID reuse: the pid and its start time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProcessKey {
    pub pid: u32,
    /// `start_boottime` of the process in ns since boot.
    pub start_boottime_ns: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exec {
    pub at_ns: u64,
    pub process: ProcessKey,
    pub ppid: u32,
    pub cgroup_id: u64,
    /// The parent's cgroup2 cgroup id: inside the container for a hook or a
    /// child, outside for the runtime's init exec'ing the entrypoint.
    pub parent_cgroup_id: u64,
    /// A kernel read for the record failed: its start time, parent, parent's
    /// cgroup or file name may be zeros (a hint, never the main process).
    pub read_error: bool,
    pub comm: Name<COMM_LEN>,
    pub filename: Name<FILENAME_LEN>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exit {
    pub at_ns: u64,
    pub process: ProcessKey,
    pub cgroup_id: u64,
    pub status: ExitStatus,
    /// The raw wait status.
    pub wait_status: u32,
    /// A kernel read for the record failed: its status or start time may be
    /// zeros (a hint, never a certain death).
    pub read_error: bool,
    pub comm: Name<COMM_LEN>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupChange {
    pub at_ns: u64,
    pub hierarchy_id: u32,
    pub level: u32,
    pub cgroup_id: u64,
    pub path: String,
    /// The kernel filled the whole path buffer: the path may be cut short.
    pub truncated: bool,
}

/// Reads a `#[repr(C)]` record from `bytes`, which must be exactly its size.
fn read_record<T: Copy>(bytes: &[u8], kind: u32) -> Result<T, DecodeError> {
    let expected = size_of::<T>();
    if bytes.len() != expected {
        return Err(DecodeError::Size {
            kind,
            len: bytes.len(),
            expected,
        });
    }
    // SAFETY: the length was checked; `T` is one of the plain-integer records of
    // `evpleg_events` (every bit pattern valid); read_unaligned copes with any
    // alignment of the ring-buffer slot.
    Ok(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

fn c_string(bytes: &[u8]) -> &[u8] {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    &bytes[..end]
}

/// The CPU whose program wrote a ring-buffer record (its header's), if the
/// record holds a header.
pub fn record_cpu(bytes: &[u8]) -> Option<u32> {
    let cpu = bytes.get(4..8)?;
    Some(u32::from_ne_bytes([cpu[0], cpu[1], cpu[2], cpu[3]]))
}

/// Decodes one ring-buffer record.
pub fn decode(bytes: &[u8]) -> Result<KernelEvent, DecodeError> {
    let header_len = size_of::<EventHeader>();
    if bytes.len() < header_len {
        return Err(DecodeError::Short {
            len: bytes.len(),
            header: header_len,
        });
    }
    let kind = u32::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    match kind {
        EVENT_EXEC => {
            let e: ExecEvent = read_record(bytes, kind)?;
            Ok(KernelEvent::Exec(Exec {
                at_ns: e.header.ktime_ns,
                process: ProcessKey {
                    pid: e.pid,
                    start_boottime_ns: e.start_boottime_ns,
                },
                ppid: e.ppid,
                cgroup_id: e.cgroup_id,
                parent_cgroup_id: e.parent_cgroup_id,
                read_error: e.flags & EXEC_FLAG_READ_ERROR != 0,
                comm: Name::new(&e.comm),
                filename: Name::new(&e.filename),
            }))
        }
        EVENT_EXIT => {
            let e: ExitEvent = read_record(bytes, kind)?;
            Ok(KernelEvent::Exit(Exit {
                at_ns: e.header.ktime_ns,
                process: ProcessKey {
                    pid: e.pid,
                    start_boottime_ns: e.start_boottime_ns,
                },
                cgroup_id: e.cgroup_id,
                status: ExitStatus::from_wait_status(
                    e.exit_code,
                    e.flags & EXIT_FLAG_OOM_KILLED != 0,
                ),
                wait_status: e.exit_code,
                read_error: e.flags & EXIT_FLAG_READ_ERROR != 0,
                comm: Name::new(&e.comm),
            }))
        }
        EVENT_CGROUP_MKDIR | EVENT_CGROUP_RMDIR => {
            let e: CgroupEvent = read_record(bytes, kind)?;
            let path = std::str::from_utf8(c_string(&e.path))
                .map_err(|_| DecodeError::PathNotUtf8 {
                    cgroup_id: e.cgroup_id,
                })?
                .to_owned();
            let change = CgroupChange {
                at_ns: e.header.ktime_ns,
                hierarchy_id: e.hierarchy_id,
                level: e.level,
                cgroup_id: e.cgroup_id,
                path,
                truncated: e.path_len as usize >= CGROUP_PATH_LEN,
            };
            Ok(if kind == EVENT_CGROUP_MKDIR {
                KernelEvent::CgroupMkdir(change)
            } else {
                KernelEvent::CgroupRmdir(change)
            })
        }
        EVENT_OOM_VICTIM => {
            let e: OomVictimEvent = read_record(bytes, kind)?;
            // The older tracepoint names a thread (`OOM_VICTIM_TID_ONLY`): taken
            // as the thread group's id, which it is when the OOM killer chose
            // the group's leader, as it does unless the leader has exited. The
            // decoder runs on the real-time reader and reads no `/proc` (issue
            // #25 item 8): a victim named by another thread is not matched
            // here, and its exit's own OOM flag (`signal->oom_mm`) still tells.
            Ok(KernelEvent::OomVictim {
                at_ns: e.header.ktime_ns,
                tgid: e.tgid,
            })
        }
        _ => Err(DecodeError::UnknownKind {
            kind,
            len: bytes.len(),
        }),
    }
}

/// Encoders for tests: the exact bytes the kernel would write.
#[cfg(test)]
pub(crate) mod encode {
    use super::*;

    fn bytes_of<T: Copy>(v: &T) -> Vec<u8> {
        // SAFETY: `T` is a padding-free `#[repr(C)]` record of `evpleg_events`.
        unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }.to_vec()
    }

    fn fill<const N: usize>(s: &str) -> [u8; N] {
        let mut out = [0u8; N];
        let n = s.len().min(N);
        out[..n].copy_from_slice(&s.as_bytes()[..n]);
        out
    }

    /// The cgroup id [`exec`] gives the parent: the shim's, outside every
    /// container (a runtime's init exec'ing the entrypoint).
    pub const OUTSIDE: u64 = 2;

    /// An exec by a task whose parent (pid 1) is outside the container: the
    /// runtime's init exec'ing the entrypoint.
    pub fn exec(at: u64, pid: u32, start: u64, cgroup_id: u64, filename: &str) -> Vec<u8> {
        exec_by(at, pid, start, cgroup_id, filename, (1, OUTSIDE), 0)
    }

    /// An exec whose parent is `(ppid, parent's cgroup id)`, with `flags`
    /// (`EXEC_FLAG_*`).
    pub fn exec_by(
        at: u64,
        pid: u32,
        start: u64,
        cgroup_id: u64,
        filename: &str,
        (ppid, parent_cgroup_id): (u32, u64),
        flags: u32,
    ) -> Vec<u8> {
        bytes_of(&ExecEvent {
            header: EventHeader {
                kind: EVENT_EXEC,
                cpu: 0,
                ktime_ns: at,
            },
            pid,
            tid: pid,
            ppid,
            old_pid: pid,
            cgroup_id,
            start_boottime_ns: start,
            parent_cgroup_id,
            flags,
            _pad: 0,
            comm: fill("comm"),
            filename: fill(filename),
        })
    }

    pub fn exit(at: u64, pid: u32, start: u64, cgroup_id: u64, status: u32, flags: u32) -> Vec<u8> {
        bytes_of(&ExitEvent {
            header: EventHeader {
                kind: EVENT_EXIT,
                cpu: 1,
                ktime_ns: at,
            },
            pid,
            tid: pid,
            exit_code: status,
            flags,
            cgroup_id,
            start_boottime_ns: start,
            comm: fill("comm"),
        })
    }

    pub fn oom_victim(at: u64, id: u32, flags: u32) -> Vec<u8> {
        bytes_of(&OomVictimEvent {
            header: EventHeader {
                kind: EVENT_OOM_VICTIM,
                cpu: 0,
                ktime_ns: at,
            },
            tgid: id,
            flags,
        })
    }

    pub fn cgroup(kind: u32, at: u64, hierarchy_id: u32, cgroup_id: u64, path: &str) -> Vec<u8> {
        bytes_of(&CgroupEvent {
            header: EventHeader {
                kind,
                cpu: 0,
                ktime_ns: at,
            },
            hierarchy_id,
            level: path.matches('/').count() as u32,
            cgroup_id,
            path_len: (path.len() + 1).min(CGROUP_PATH_LEN) as u32,
            _pad: 0,
            path: fill(path),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use evpleg_events::OOM_VICTIM_TID_ONLY;

    #[test]
    fn a_records_cpu_is_its_headers() {
        assert_eq!(record_cpu(&encode::exit(10, 42, 99, 7, 0, 0)), Some(1));
        assert_eq!(
            record_cpu(&encode::exec(10, 42, 99, 7, "/bin/true")),
            Some(0)
        );
        assert_eq!(record_cpu(&[0; 6]), None, "a record too short for a header");
    }

    #[test]
    fn decodes_each_kind() {
        let exec = decode(&encode::exec(10, 42, 99, 7, "/bin/true")).unwrap();
        let KernelEvent::Exec(e) = exec else {
            panic!("not an exec: {exec:?}")
        };
        assert_eq!(
            (e.at_ns, e.process.pid, e.process.start_boottime_ns),
            (10, 42, 99)
        );
        assert_eq!((e.cgroup_id, e.filename.as_str()), (7, "/bin/true"));
        assert_eq!(e.filename, "/bin/true");
        assert_eq!(e.comm.to_string(), "comm");
        let cut: Name<4> = Name::new(&[b'a', 0xff, b'b', 0]);
        assert_eq!(cut.as_str(), "a", "the UTF-8 prefix of a kernel name");
        assert_eq!(
            (e.ppid, e.parent_cgroup_id, e.read_error),
            (1, encode::OUTSIDE, false)
        );
        let hook = decode(&encode::exec_by(
            10,
            43,
            99,
            7,
            "/hook",
            (42, 7),
            EXEC_FLAG_READ_ERROR,
        ));
        let Ok(KernelEvent::Exec(h)) = hook else {
            panic!("not an exec: {hook:?}")
        };
        assert_eq!((h.ppid, h.parent_cgroup_id, h.read_error), (42, 7, true));
        let flagged = decode(&encode::exit(11, 42, 0, 7, 0, EXIT_FLAG_READ_ERROR));
        let Ok(KernelEvent::Exit(f)) = flagged else {
            panic!("not an exit: {flagged:?}")
        };
        assert!(f.read_error);

        let exit = decode(&encode::exit(11, 42, 99, 7, 0x700, 0)).unwrap();
        let KernelEvent::Exit(x) = exit else {
            panic!("not an exit: {exit:?}")
        };
        assert_eq!(
            (x.status.code, x.status.oom_killed, x.read_error),
            (7, false, false)
        );
        let oom = decode(&encode::exit(11, 42, 99, 7, 9, EXIT_FLAG_OOM_KILLED)).unwrap();
        let KernelEvent::Exit(x) = oom else {
            panic!("not an exit: {oom:?}")
        };
        assert_eq!(
            (x.status.code, x.status.signal, x.status.oom_killed),
            (137, Some(9), true)
        );

        let mk = decode(&encode::cgroup(
            EVENT_CGROUP_MKDIR,
            12,
            0,
            5,
            "/kubepods/pod1",
        ))
        .unwrap();
        let KernelEvent::CgroupMkdir(c) = mk else {
            panic!("not a mkdir: {mk:?}")
        };
        assert_eq!(
            (c.cgroup_id, c.path.as_str(), c.truncated),
            (5, "/kubepods/pod1", false)
        );
        let long = "/a".repeat(200);
        let rm = decode(&encode::cgroup(EVENT_CGROUP_RMDIR, 12, 3, 5, &long)).unwrap();
        let KernelEvent::CgroupRmdir(c) = rm else {
            panic!("not an rmdir: {rm:?}")
        };
        assert!(c.truncated);
        assert_eq!(c.hierarchy_id, 3);
    }

    #[test]
    fn oom_victim_is_a_thread_group() {
        assert_eq!(
            decode(&encode::oom_victim(5, 4242, 0)),
            Ok(KernelEvent::OomVictim {
                at_ns: 5,
                tgid: 4242
            })
        );
        // The older form names a thread: taken as it is (the group leader's
        // id when the leader was chosen), without reading /proc/<tid> (a live
        // thread of this test process: it was resolved to the process before).
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() } as u32).expect("send");
            let _ = done_rx.recv();
        });
        let tid = rx.recv().expect("tid");
        assert_ne!(tid, std::process::id());
        assert_eq!(
            decode(&encode::oom_victim(6, tid, OOM_VICTIM_TID_ONLY)),
            Ok(KernelEvent::OomVictim {
                at_ns: 6,
                tgid: tid
            })
        );
        drop(done_tx);
        thread.join().expect("thread");
    }

    #[test]
    fn rejects_malformed_records() {
        assert_eq!(
            decode(&[1, 0, 0]),
            Err(DecodeError::Short { len: 3, header: 16 })
        );
        let mut exec = encode::exec(1, 1, 1, 1, "x");
        exec.pop();
        assert!(matches!(
            decode(&exec),
            Err(DecodeError::Size { kind: 1, .. })
        ));
        let mut unknown = encode::exit(1, 1, 1, 1, 0, 0);
        unknown[0] = 99;
        assert!(matches!(
            decode(&unknown),
            Err(DecodeError::UnknownKind { kind: 99, .. })
        ));
        let mut bad_path = encode::cgroup(EVENT_CGROUP_MKDIR, 1, 0, 9, "/kubepods");
        bad_path[40] = 0xff;
        assert_eq!(
            decode(&bad_path),
            Err(DecodeError::PathNotUtf8 { cgroup_id: 9 })
        );
    }

    #[test]
    fn never_panics_on_arbitrary_bytes() {
        // Every prefix of every valid record, and every single-byte corruption of
        // the kind field, decodes to a value or an error.
        let records = [
            encode::exec(1, 2, 3, 4, "/bin/sh"),
            encode::exit(1, 2, 3, 4, 0x100, 1),
            encode::cgroup(EVENT_CGROUP_MKDIR, 1, 0, 4, "/k8s.io/x"),
        ];
        for r in &records {
            for n in 0..=r.len() {
                let _ = decode(&r[..n]);
            }
            for k in 0..=255u8 {
                let mut c = r.clone();
                c[0] = k;
                let _ = decode(&c);
            }
        }
    }
}
