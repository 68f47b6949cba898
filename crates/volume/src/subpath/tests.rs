use std::os::unix::fs::symlink;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use super::*;
use crate::tests::can_mount;

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

/// Where the descriptor points (its `/proc/self/fd` link).
fn fd_path(fd: &OwnedFd) -> PathBuf {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap()
}

/// A volume (mode 0777) holding `file`, and a directory outside it.
fn volume() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let root = tempfile::tempdir().unwrap();
    let vol = root.path().join("vol");
    let outside = root.path().join("outside");
    std::fs::create_dir(&vol).unwrap();
    std::fs::create_dir(&outside).unwrap();
    std::fs::set_permissions(&vol, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::write(vol.join("file"), "x").unwrap();
    std::fs::write(outside.join("HOST"), "host").unwrap();
    (root, vol, outside)
}

#[test]
fn sub_paths_stay_inside_their_volume() {
    let (_root, vol, outside) = volume();
    symlink("/etc", vol.join("escape")).unwrap();
    symlink("../outside", vol.join("relative-escape")).unwrap();
    symlink("file", vol.join("inside")).unwrap();
    let base = vol.canonicalize().unwrap();
    assert_eq!(fd_path(&open(&vol, "file").unwrap()), base.join("file"));
    assert_eq!(fd_path(&open(&vol, "inside").unwrap()), base.join("file"));
    // Missing directories are created with the volume's mode, exactly.
    let made = open(&vol, "a/b").unwrap();
    assert_eq!(fd_path(&made), base.join("a/b"));
    assert_eq!(mode(&vol.join("a")), 0o777);
    assert_eq!(mode(&vol.join("a/b")), 0o777);
    let cases = [
        ("/etc", "must not be an absolute path"),
        ("a/../../x", "must not contain '..'"),
        ("escape", "not within volume path"),
        ("relative-escape", "not within volume path"),
        ("relative-escape/HOST", "not within volume path"),
    ];
    for (sub, want) in cases {
        let err = open(&vol, sub).unwrap_err().to_string();
        assert!(err.contains(want), "{sub}: {err}");
    }
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 1);
}

// The issue's `link/new` with `link -> /etc`: the old code's create_dir_all
// made `/etc/new` (mode 0777) before its "not within volume" check.
#[test]
fn an_intermediate_symlink_creates_nothing_outside() {
    let (_root, vol, outside) = volume();
    std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o700)).unwrap();
    symlink(&outside, vol.join("link")).unwrap();
    symlink("../outside", vol.join("rel")).unwrap();
    std::fs::create_dir(vol.join("d")).unwrap();
    symlink(&outside, vol.join("d/deep")).unwrap();
    for sub in ["link/new", "rel/new/deeper", "d/deep/new", "link"] {
        let err = open(&vol, sub).unwrap_err().to_string();
        assert!(err.contains("not within volume path"), "{sub}: {err}");
    }
    let names: Vec<_> = std::fs::read_dir(&outside)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["HOST"], "nothing created outside the volume");
    assert_eq!(mode(&outside), 0o700, "the outside directory's mode kept");
}

/// One round of the attacker's swap: `mv d old<n>; ln -s <outside> d;
/// rm d; mkdir d`. It never waits on the code under test (which may make a
/// missing `d` itself, its right), so it cannot wedge: a round whose
/// `mv` or `ln` lost the race is just a round without a window. Whether the
/// symlink stood in `d` (the window an escape needs) is returned.
fn swap(vol: &Path, outside: &Path, n: u64) -> bool {
    let _ = std::fs::rename(vol.join("d"), vol.join(format!("old{n}")));
    let linked = symlink(outside, vol.join("d")).is_ok();
    if linked {
        std::fs::remove_file(vol.join("d")).unwrap();
    }
    let _ = std::fs::create_dir(vol.join("d"));
    linked
}

/// The attacker's thread, swapping until stopped; `windows` counts the
/// rounds in which the symlink stood in `d`.
struct Swapper {
    stop: Arc<AtomicBool>,
    windows: Arc<AtomicU64>,
    thread: std::thread::JoinHandle<()>,
}

impl Swapper {
    fn start(vol: &Path, outside: &Path) -> Self {
        let (stop, windows) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
        );
        let (vol, outside) = (vol.to_owned(), outside.to_owned());
        let (s, w) = (stop.clone(), windows.clone());
        let thread = std::thread::spawn(move || {
            let mut n = 0;
            while !s.load(Relaxed) {
                n += 1;
                w.fetch_add(u64::from(swap(&vol, &outside, n)), Relaxed);
            }
        });
        Self {
            stop,
            windows,
            thread,
        }
    }

    fn windows(&self) -> u64 {
        self.windows.load(Relaxed)
    }

    /// Whether the race ran its course: `attempts` made and at least
    /// `windows` windows open, failing after 60 s.
    fn raced(&self, attempts: u32, done: u32, windows: u64, deadline: Instant) -> bool {
        assert!(
            Instant::now() < deadline,
            "60 s: {done} attempts, {} windows",
            self.windows()
        );
        done >= attempts && self.windows() >= windows
    }

    fn stop(self) {
        self.stop.store(true, Relaxed);
        self.thread.join().unwrap();
    }
}

// A container swapping `d` for a symlink out of the volume while subPaths
// under it are made and opened: nothing is ever created or opened outside.
// The opener goes on until at least 3000 attempts ran and the symlink stood
// in `d` at least 300 times, so a busy machine cannot make it vacuous.
#[test]
fn a_swapped_symlink_is_never_followed_out() {
    let (_root, vol, outside) = volume();
    let base = vol.canonicalize().unwrap();
    std::fs::create_dir(vol.join("d")).unwrap();
    let swapper = Swapper::start(&vol, &outside);
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut opened, mut refused, mut i) = (0, 0, 0);
    while !swapper.raced(3000, i, 300, deadline) {
        match open(&vol, &format!("d/n{i}/m")) {
            Ok(fd) => {
                let p = fd_path(&fd);
                assert!(p.starts_with(&base), "attempt {i} opened {p:?}");
                opened += 1;
            }
            Err(e) => {
                let e = e.to_string();
                assert!(
                    e.contains("not within volume path")
                        || e.contains("No such file")
                        || e.contains("Not a directory"),
                    "attempt {i}: {e}"
                );
                refused += 1;
            }
        }
        i += 1;
    }
    swapper.stop();
    let names: Vec<_> = std::fs::read_dir(&outside)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["HOST"], "nothing created outside the volume");
    assert!(opened > 0, "{opened} opened, {refused} refused");
}

#[test]
fn names_that_are_no_path_component_are_refused() {
    let dir = Path::new("/pods/u");
    for (vol, c) in [
        ("..", "c"),
        ("a/b", "c"),
        ("v", ".."),
        ("v", ""),
        ("v", "x/y"),
    ] {
        let sp = SubPath {
            volume_path: dir,
            sub_path: "s",
            pod_dir: dir,
            volume_name: vol,
            container_name: c,
            index: 0,
        };
        let err = bind_target(&sp).unwrap_err().to_string();
        assert!(err.contains("cannot name a directory"), "{vol} {c}: {err}");
    }
}

fn same_file(a: &Path, b: &Path) -> bool {
    let (a, b) = (std::fs::metadata(a).unwrap(), std::fs::metadata(b).unwrap());
    (a.dev(), a.ino()) == (b.dev(), b.ino())
}

// What the container mounts is the directory that was checked: swapping the
// subPath for a symlink to a host directory afterwards changes nothing; the
// bind mounts go with the volume's clean-up.
#[test]
fn the_bind_mount_is_what_was_checked() {
    if !can_mount("the_bind_mount_is_what_was_checked") {
        return;
    }
    let (root, vol, outside) = volume();
    let pod_dir = root.path().join("pod");
    std::fs::create_dir(&pod_dir).unwrap();
    std::fs::create_dir(vol.join("d")).unwrap();
    std::fs::write(vol.join("d/mine"), "mine").unwrap();
    let sp = |index, sub_path| SubPath {
        volume_path: &vol,
        sub_path,
        pod_dir: &pod_dir,
        volume_name: "shared",
        container_name: "app",
        index,
    };
    let target = prepare(&sp(0, "d")).unwrap();
    let file = prepare(&sp(1, "file")).unwrap();
    assert_eq!(target, pod_dir.join("volume-subpaths/shared/app/0"));
    assert_eq!(mode(&pod_dir.join("volume-subpaths")), 0o750);
    std::fs::rename(vol.join("d"), vol.join("d2")).unwrap();
    symlink(&outside, vol.join("d")).unwrap();
    assert!(
        same_file(&target, &vol.join("d2")),
        "still the checked directory"
    );
    assert!(
        !target.join("HOST").exists(),
        "the host directory is not mounted"
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "x");
    // Prepared again: the symlink now in place is refused, the mount kept.
    let err = prepare(&sp(0, "d")).unwrap_err().to_string();
    assert!(err.contains("not within volume path"), "{err}");
    assert!(crate::util::is_mounted(&target).unwrap());
    std::fs::remove_file(vol.join("d")).unwrap();
    std::fs::rename(vol.join("d2"), vol.join("d")).unwrap();
    assert_eq!(prepare(&sp(0, "d")).unwrap(), target, "kept when the same");
    // A pod directory with mounts is not removed across them.
    let err = crate::util::remove_all_one_filesystem(&pod_dir).unwrap_err();
    assert!(err.to_string().contains("is mounted"), "{err}");
    clean_sub_paths(&pod_dir, "shared").unwrap();
    assert!(!crate::util::is_mounted(&target).unwrap());
    assert!(!crate::util::is_mounted(&file).unwrap());
    assert!(!pod_dir.join("volume-subpaths").exists());
    assert_eq!(std::fs::read_to_string(vol.join("d/mine")).unwrap(), "mine");
}

// The race of the issue, in process: a thread swaps `d` for a symlink to a
// host directory while the subPath is bound again and again; the mount is
// never the host directory.
#[test]
fn a_swap_race_never_mounts_the_host_directory() {
    if !can_mount("a_swap_race_never_mounts_the_host_directory") {
        return;
    }
    let (root, vol, outside) = volume();
    let pod_dir = root.path().join("pod");
    std::fs::create_dir(&pod_dir).unwrap();
    std::fs::create_dir(vol.join("d")).unwrap();
    let swapper = Swapper::start(&vol, &outside);
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut bound, mut index) = (0, 0);
    while !swapper.raced(500, index, 100, deadline) {
        let sp = SubPath {
            volume_path: &vol,
            sub_path: "d",
            pod_dir: &pod_dir,
            volume_name: "shared",
            container_name: "app",
            index: index as usize,
        };
        if let Ok(target) = prepare(&sp) {
            bound += 1;
            assert!(
                !same_file(&target, &outside),
                "attempt {index}: host mounted"
            );
            assert!(
                !target.join("HOST").exists(),
                "attempt {index}: host mounted"
            );
        }
        index += 1;
    }
    swapper.stop();
    eprintln!("{bound} of {index} bound during the race");
    // With the swapper stopped (its last round ends with `d` a directory)
    // the subPath binds, and to the volume's own directory (a busy machine
    // may have let no attempt bind during the race).
    assert!(vol.join("d").is_dir() && !vol.join("d").is_symlink());
    let sp = SubPath {
        volume_path: &vol,
        sub_path: "d",
        pod_dir: &pod_dir,
        volume_name: "shared",
        container_name: "app",
        index: index as usize,
    };
    let target = prepare(&sp).expect("the subPath binds once the race is over");
    assert!(same_file(&target, &vol.join("d")), "bound {target:?}");
    clean_pod_sub_paths(&pod_dir).unwrap();
    assert!(!pod_dir.join("volume-subpaths").exists());
}
