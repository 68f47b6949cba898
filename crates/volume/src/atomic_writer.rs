//! The kubelet's AtomicWriter (`pkg/volume/util/atomic_writer.go`): the files
//! of a configMap, secret, downwardAPI or projected volume change all at once
//! or not at all. The payload is written into a new hidden timestamped
//! directory (`..2026_12_01_10_00_00.<n>`), a `..data_tmp` symlink to it is
//! renamed over `..data` (one `rename(2)`: the swap), and each top-level name
//! the user sees is a symlink through `..data` (`key -> ..data/key`). Only
//! then are names no longer in the payload and the old directory removed. A
//! reader opening `key` gets the old or the new file, never a mix of the two
//! payloads' files, and an update that fails before the swap leaves the old
//! `..data` whole. A payload equal to what is there is not written.
//!
//! Differences: the payload's file owner (`FsUser`) is not set (no user
//! namespaces here); the timestamped directory's suffix is a counter, not
//! `MkdirTemp`'s random one.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The symlink to the current payload.
pub const DATA_DIR: &str = "..data";
/// The symlink renamed over [`DATA_DIR`].
pub const NEW_DATA_DIR: &str = "..data_tmp";

/// A file of the payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileProjection {
    pub data: Vec<u8>,
    pub mode: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum AtomicWriteError {
    #[error("invalid path {path:?} in the volume's payload: {why}")]
    InvalidPath { path: String, why: &'static str },
    #[error("cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> AtomicWriteError + 'a {
    move |source| AtomicWriteError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// The kubelet's `validatePath`: relative, no `..` element, not starting with
/// `..`, at most 4096 bytes, elements at most 255.
pub fn validate_path(p: &str) -> Result<(), AtomicWriteError> {
    let bad = |why| {
        Err(AtomicWriteError::InvalidPath {
            path: p.to_owned(),
            why,
        })
    };
    if p.is_empty() {
        return bad("empty");
    }
    if p.len() > 4096 {
        return bad("longer than 4096 bytes");
    }
    if Path::new(p).is_absolute() {
        return bad("absolute");
    }
    if p.starts_with("..") {
        return bad("starts with '..'");
    }
    for c in Path::new(p).components() {
        match c {
            Component::ParentDir => return bad("contains '..'"),
            Component::Normal(s) if s.len() > 255 => return bad("element longer than 255 bytes"),
            _ => {}
        }
    }
    Ok(())
}

/// Writes `payload` into `target` atomically; returns whether anything was
/// written.
pub fn write(
    target: &Path,
    payload: &BTreeMap<String, FileProjection>,
) -> Result<bool, AtomicWriteError> {
    write_with(target, payload, &mut write_file)
}

fn write_file(path: &Path, f: &FileProjection) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(f.mode)
        .open(path)?;
    file.write_all(&f.data)?;
    // The mode exactly, whatever the umask.
    file.set_permissions(std::fs::Permissions::from_mode(f.mode))?;
    file.sync_all()
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// [`write`], each file written by `put` (a failure can be injected).
pub(crate) fn write_with(
    target: &Path,
    payload: &BTreeMap<String, FileProjection>,
    put: &mut dyn FnMut(&Path, &FileProjection) -> std::io::Result<()>,
) -> Result<bool, AtomicWriteError> {
    for p in payload.keys() {
        validate_path(p)?;
    }
    std::fs::create_dir_all(target).map_err(io("create", target))?;
    let data_link = target.join(DATA_DIR);
    let old_dir: Option<String> = std::fs::read_link(&data_link)
        .ok()
        .map(|p| p.to_string_lossy().into_owned());
    let new_tops: BTreeSet<&str> = payload.keys().map(|k| top(k)).collect();
    let old_paths = match &old_dir {
        Some(d) => files_under(&target.join(d)),
        None => BTreeSet::new(),
    };
    let old_tops: BTreeSet<String> = old_paths.iter().map(|k| top(k).to_owned()).collect();
    if let Some(d) = &old_dir
        && unchanged(&target.join(d), &old_paths, payload)
    {
        // Still the user-visible links (a previous write cut short).
        link_user_visible(target, &new_tops)?;
        return Ok(false);
    }
    // 1. The new payload in a new hidden directory.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let ts_name = format!(
        "..{}.{}{}",
        timestamp(now.as_secs()),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    let ts_dir = target.join(&ts_name);
    std::fs::DirBuilder::new()
        .mode(0o755)
        .create(&ts_dir)
        .map_err(io("create", &ts_dir))?;
    let written = (|| {
        for (rel, f) in payload {
            let path = ts_dir.join(rel);
            if let Some(parent) = path.parent() {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o755)
                    .create(parent)
                    .map_err(io("create", parent))?;
            }
            put(&path, f).map_err(io("write", &path))?;
        }
        Ok(())
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&ts_dir);
        return Err(e);
    }
    // 2. The user-visible names (links through ..data; new ones dangle until
    // the swap).
    link_user_visible(target, &new_tops)?;
    // 3. The swap.
    let tmp_link = target.join(NEW_DATA_DIR);
    let _ = std::fs::remove_file(&tmp_link);
    std::os::unix::fs::symlink(&ts_name, &tmp_link).map_err(io("link", &tmp_link))?;
    std::fs::rename(&tmp_link, &data_link).map_err(io("rename", &tmp_link))?;
    // 4. Names no longer in the payload, then the old directory.
    for gone in old_tops.iter().filter(|t| !new_tops.contains(t.as_str())) {
        let path = target.join(gone);
        std::fs::remove_file(&path).map_err(io("remove", &path))?;
    }
    if let Some(d) = old_dir
        && d != ts_name
    {
        let path = target.join(d);
        std::fs::remove_dir_all(&path).map_err(io("remove", &path))?;
    }
    Ok(true)
}

fn top(p: &str) -> &str {
    p.split('/')
        .find(|s| !s.is_empty() && *s != ".")
        .unwrap_or(p)
}

fn link_user_visible(target: &Path, tops: &BTreeSet<&str>) -> Result<(), AtomicWriteError> {
    for t in tops {
        let link = target.join(t);
        if std::fs::symlink_metadata(&link).is_ok() {
            continue;
        }
        let to = Path::new(DATA_DIR).join(t);
        std::os::unix::fs::symlink(&to, &link).map_err(io("link", &link))?;
    }
    Ok(())
}

/// Relative paths of the regular files under `dir`.
fn files_under(dir: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = e.path();
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(path),
                Ok(_) => {
                    if let Ok(rel) = path.strip_prefix(dir) {
                        out.insert(rel.to_string_lossy().into_owned());
                    }
                }
                Err(_) => {}
            }
        }
    }
    out
}

/// The kubelet's `shouldWritePayload` reversed: same names and contents
/// (modes are not compared, as there: an `fsGroup` changes them after the
/// write, and a pod's modes cannot change).
fn unchanged(
    dir: &Path,
    old: &BTreeSet<String>,
    payload: &BTreeMap<String, FileProjection>,
) -> bool {
    let new: BTreeSet<String> = payload.keys().map(|k| clean(k)).collect();
    if &new != old {
        return false;
    }
    payload
        .iter()
        .all(|(k, f)| std::fs::read(dir.join(k)).is_ok_and(|d| d == f.data))
}

fn clean(p: &str) -> String {
    Path::new(p)
        .components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

/// `2006_01_02_15_04_05` of a Unix time (UTC).
fn timestamp(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}_{m:02}_{d:02}_{:02}_{:02}_{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(pairs: &[(&str, &str)]) -> BTreeMap<String, FileProjection> {
        pairs
            .iter()
            .map(|(k, v)| {
                let f = FileProjection {
                    data: v.as_bytes().to_vec(),
                    mode: 0o644,
                };
                (k.to_string(), f)
            })
            .collect()
    }

    fn read(dir: &Path, name: &str) -> Option<String> {
        std::fs::read_to_string(dir.join(name)).ok()
    }

    fn data_dir(dir: &Path) -> String {
        std::fs::read_link(dir.join(DATA_DIR))
            .unwrap()
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn files_appear_through_the_data_link_and_updates_swap_it() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("vol");
        assert!(write(&dir, &payload(&[("a", "1"), ("sub/b", "2")])).unwrap());
        assert_eq!(read(&dir, "a").as_deref(), Some("1"));
        assert_eq!(read(&dir, "sub/b").as_deref(), Some("2"));
        // The user-visible names are links through ..data.
        assert_eq!(
            std::fs::read_link(dir.join("a")).unwrap(),
            Path::new("..data/a")
        );
        assert_eq!(
            std::fs::read_link(dir.join("sub")).unwrap(),
            Path::new("..data/sub")
        );
        let first = data_dir(&dir);
        assert!(first.starts_with("..") && first.len() > "..2026_12_01_10_00_00.".len());
        // The same payload again: nothing written.
        assert!(!write(&dir, &payload(&[("a", "1"), ("sub/b", "2")])).unwrap());
        assert_eq!(data_dir(&dir), first);
        // A change: a new directory, the old one gone, removed names gone.
        assert!(write(&dir, &payload(&[("a", "9"), ("c", "3")])).unwrap());
        let second = data_dir(&dir);
        assert_ne!(second, first);
        assert!(!dir.join(&first).exists());
        assert_eq!(read(&dir, "a").as_deref(), Some("9"));
        assert_eq!(read(&dir, "c").as_deref(), Some("3"));
        assert!(std::fs::symlink_metadata(dir.join("sub")).is_err());
        // Only the links, ..data and the one payload directory remain.
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            vec![second.clone(), DATA_DIR.into(), "a".into(), "c".into()]
        );
    }

    #[test]
    fn a_mode_is_set_exactly() {
        let root = tempfile::tempdir().unwrap();
        let mut p = payload(&[("k", "v")]);
        p.get_mut("k").unwrap().mode = 0o400;
        write(root.path(), &p).unwrap();
        let m = std::fs::metadata(root.path().join("k")).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o400);
    }

    // Failure injection: the second file's write fails halfway through the
    // update. The old ..data and every old file are intact, nothing of the
    // new payload is visible, and no half-written directory is left.
    #[test]
    fn an_update_interrupted_halfway_leaves_the_old_data_intact() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path();
        write(dir, &payload(&[("a", "old-a"), ("b", "old-b")])).unwrap();
        let before = data_dir(dir);
        let mut n = 0;
        let mut put = |path: &Path, f: &FileProjection| {
            n += 1;
            if n == 2 {
                // Half the file, then the disk fills.
                std::fs::write(path, &f.data[..f.data.len() / 2])?;
                return Err(std::io::Error::other("injected: no space left on device"));
            }
            write_file(path, f)
        };
        let err = write_with(dir, &payload(&[("a", "new-a"), ("b", "new-b")]), &mut put)
            .unwrap_err()
            .to_string();
        assert!(err.contains("injected: no space left on device"), "{err}");
        assert_eq!(data_dir(dir), before);
        assert_eq!(read(dir, "a").as_deref(), Some("old-a"));
        assert_eq!(read(dir, "b").as_deref(), Some("old-b"));
        let dirs: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("..") && n != DATA_DIR)
            .collect();
        assert_eq!(dirs, vec![before]);
        // The next update goes through.
        write(dir, &payload(&[("a", "new-a"), ("b", "new-b")])).unwrap();
        assert_eq!(read(dir, "b").as_deref(), Some("new-b"));
    }

    #[test]
    fn paths_are_validated() {
        let cases = [
            ("a", None),
            ("a/b", None),
            ("", Some("empty")),
            ("/etc/passwd", Some("absolute")),
            ("..data", Some("starts with '..'")),
            ("a/../../b", Some("contains '..'")),
        ];
        for (p, why) in cases {
            let got = validate_path(p).err().map(|e| e.to_string());
            assert_eq!(got.is_some(), why.is_some(), "{p}");
            if let (Some(g), Some(w)) = (got, why) {
                assert!(g.contains(w), "{g}");
            }
        }
        assert_eq!(timestamp(0), "1970_01_01_00_00_00");
        assert_eq!(timestamp(1_796_032_800), "2026_11_30_10_00_00");
    }
}
