//! Walks of the cgroup tree off the real-time reader (issue #29).
//!
//! A view that lists a running container the tracker does not know waits for
//! a rescan ([`super::rescan`]). Walking the tree means a `readdir` and a
//! `stat` of every cgroup below the roots: about a second at 21 000 cgroups
//! on this project's machines, during which a reader that walked it itself
//! read no record (the benchmark's deaths waited up to 3.5 s). So that walk
//! runs on a thread of its own, at normal priority: the reader asks for it
//! with a `try_send` on a one-slot channel (no allocation, no lock while the
//! walker waits), and gets the cgroups found back as a
//! [`Command::Walked`](super::reader::Command) through its command channel,
//! woken by its eventfd. It learns from them the cgroups of the containers
//! the waiting views list ([`super::scan::Scanner::learn`]): a hash lookup
//! per cgroup, and `cgroup.procs` read only for those.
//!
//! A walk is older than the records read while it ran, and than some still
//! unread: a cgroup removed since is skipped (its directory is gone), one made
//! since is learned from its mkdir record, other unknown cgroups are left to
//! their records (learned from the tree, a container is never `Fresh`: one
//! whose exec record was still unread would lose the certainty of its main
//! process, its death a hint), and a view
//! listed after the walk began is not told its unknown containers are
//! missing (it waits for the next walk). The rescans a
//! task record asks for (its cgroup unknown, a root made late) stay on the
//! reader: that record is handled again right after, with what the rescan
//! found. The kubelet has no counterpart (it never indexes cgroups).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;

use super::index::{ScanError, ScannedCgroup, scan};
use super::reader::{Command, Wake};
use evpleg_core::clock::monotonic_ns;

/// What a walk found, and when it ran (CLOCK_MONOTONIC ns).
#[derive(Debug)]
pub struct Walk {
    pub cgroups: Result<Vec<ScannedCgroup>, ScanError>,
    pub started_ns: u64,
    pub ended_ns: u64,
}

/// The reader's end: asks for walks.
#[derive(Debug)]
pub(super) struct WalkRequests(SyncSender<()>);

/// Why a walk was not asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Refused {
    /// One is asked for already and has not reported.
    Pending,
    /// The walker thread is gone (it failed to start, or stopped): the
    /// reader walks itself.
    Gone,
}

impl WalkRequests {
    /// Asks for a walk; never blocks nor allocates.
    pub fn request(&self) -> Result<(), Refused> {
        self.0.try_send(()).map_err(|e| match e {
            TrySendError::Full(()) => Refused::Pending,
            TrySendError::Disconnected(()) => Refused::Gone,
        })
    }
}

/// Starts the walker thread over the tree below `roots` of the cgroup2
/// hierarchy at `mount`. It reports each walk to `commands`, waking the
/// reader with `wake`, and stops when the reader drops its [`WalkRequests`].
pub(super) fn spawn(
    mount: PathBuf,
    roots: Vec<String>,
    commands: Sender<Command>,
    wake: Arc<Wake>,
) -> std::io::Result<(WalkRequests, JoinHandle<()>)> {
    let (tx, rx) = sync_channel(1);
    let thread = std::thread::Builder::new()
        .name("evpleg-pleg-walk".into())
        .spawn(move || run(&rx, &mount, &roots, &commands, &wake))?;
    Ok((WalkRequests(tx), thread))
}

fn run(
    requests: &Receiver<()>,
    mount: &std::path::Path,
    roots: &[String],
    commands: &Sender<Command>,
    wake: &Wake,
) {
    while requests.recv().is_ok() {
        let started_ns = monotonic_ns();
        let cgroups = scan(mount, roots);
        let walk = Walk {
            cgroups,
            started_ns,
            ended_ns: monotonic_ns(),
        };
        if commands.send(Command::Walked(walk)).is_err() {
            return;
        }
        wake.wake();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_walk_reports_the_tree_below_the_roots() {
        let base = std::env::temp_dir().join(format!("evpleg-walker-{}", std::process::id()));
        std::fs::create_dir_all(base.join("kubepods/a/b")).unwrap();
        let (cmd_tx, cmd_rx) = std::sync::mpsc::channel();
        let wake = Arc::new(Wake::new().unwrap());
        let (requests, thread) =
            spawn(base.clone(), vec!["/kubepods".into()], cmd_tx, wake.clone()).unwrap();
        requests.request().unwrap();
        let walked = cmd_rx.recv_timeout(std::time::Duration::from_secs(10));
        let Ok(Command::Walked(walk)) = walked else {
            panic!("no walk reported: {walked:?}");
        };
        let mut paths: Vec<String> = walk.cgroups.unwrap().into_iter().map(|c| c.path).collect();
        paths.sort();
        assert_eq!(paths, ["/kubepods", "/kubepods/a", "/kubepods/a/b"]);
        assert!(walk.started_ns <= walk.ended_ns);
        drop(requests);
        thread.join().unwrap();
        std::fs::remove_dir_all(&base).unwrap();
        // The walker stopped with the reader's end: nothing more is reported.
        assert!(cmd_rx.try_recv().is_err());
    }

    #[test]
    fn a_request_to_a_stopped_walker_is_refused_as_gone() {
        let (tx, rx) = sync_channel(1);
        let requests = WalkRequests(tx);
        assert_eq!(requests.request(), Ok(()));
        assert_eq!(requests.request(), Err(Refused::Pending));
        drop(rx);
        assert_eq!(requests.request(), Err(Refused::Gone));
    }
}
