//! The plugin watcher and its reconciler: the kubelet's
//! `pluginmanager/pluginwatcher` (inotify on `<root-dir>/plugins_registry/`)
//! and `pluginmanager/reconciler` (desired sockets vs registered ones), for
//! CSI drivers.
//!
//! As the kubelet: the directory is created if missing and scanned at start;
//! a socket that appears is registered ([`super::registration::register`]);
//! a failed registration is tried again with the operation executor's
//! exponential back-off (500 ms doubling to 2 min 2 s); a socket that goes
//! away deregisters its driver; a socket re-created in place is deregistered
//! and registered again; files whose names start with `.` and non-sockets
//! are ignored. Differs: only the directory's top level is watched (the
//! kubelet also follows sub-directories); registrations run one at a time
//! (each bounded by the 10 s registration timeout) where the kubelet runs
//! them in parallel goroutines.

use std::collections::BTreeMap;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use inotify::{EventMask, Inotify, WatchMask};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::client::CsiClientConfig;
use super::drivers::CsiDrivers;
use super::error::CsiError;
use super::registration::{self, Registered};

/// The registration directory under the root dir, as the kubelet's.
pub const PLUGINS_REGISTRY_DIR: &str = "plugins_registry";

/// The operation executor's back-off: first wait, and the cap.
pub const BACKOFF_INITIAL: Duration = Duration::from_millis(500);
pub const BACKOFF_MAX: Duration = Duration::from_millis(122_000);

/// How often the reconciler looks at due retries without any event.
const RECONCILE_PERIOD: Duration = Duration::from_secs(1);

/// A socket's registration state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SocketState {
    /// Seen; registration due at `retry_at` (an offset from the watcher's
    /// start), after `failures` failed attempts.
    Pending {
        failures: u32,
        retry_at: Duration,
        last_error: Option<String>,
    },
    /// Its driver is in the registry.
    Registered(Registered),
}

/// What happened to a socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SocketEvent {
    /// Created (or found at the start scan).
    Appeared,
    /// Deleted or moved away.
    Removed,
    /// The reconciler's periodic look.
    Tick,
    RegistrationSucceeded(Registered),
    RegistrationFailed(String),
}

/// What the reconciler must do next for the socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SocketAction {
    Nothing,
    Register,
    Deregister(Registered),
    /// Deregister the old registration, then register again.
    Reregister(Registered),
}

/// The back-off after `failures` failed attempts.
pub fn backoff(failures: u32) -> Duration {
    let shift = failures.saturating_sub(1).min(20);
    (BACKOFF_INITIAL * (1u32 << shift)).min(BACKOFF_MAX)
}

/// The socket state machine: `state` (None: unknown socket) and `event` at
/// `now` give the next state (None: forgotten) and the action.
pub fn transition(
    state: Option<&SocketState>,
    event: &SocketEvent,
    now: Duration,
) -> (Option<SocketState>, SocketAction) {
    use SocketAction as A;
    use SocketEvent as E;
    use SocketState as S;
    let pending = |failures, retry_at, last_error| {
        Some(S::Pending {
            failures,
            retry_at,
            last_error,
        })
    };
    match (state, event) {
        (None, E::Appeared) => (pending(0, now, None), A::Register),
        (None, _) => (None, A::Nothing),
        (Some(S::Pending { .. }), E::Appeared) => (pending(0, now, None), A::Register),
        (Some(S::Pending { .. }), E::Removed) => (None, A::Nothing),
        (
            Some(
                s @ S::Pending {
                    failures, retry_at, ..
                },
            ),
            E::Tick,
        ) => {
            let action = if now >= *retry_at && *failures > 0 {
                A::Register
            } else {
                A::Nothing
            };
            (Some(s.clone()), action)
        }
        (Some(S::Pending { .. }), E::RegistrationSucceeded(r)) => {
            (Some(S::Registered(r.clone())), A::Nothing)
        }
        (Some(S::Pending { failures, .. }), E::RegistrationFailed(e)) => {
            let failures = failures + 1;
            (
                pending(failures, now + backoff(failures), Some(e.clone())),
                A::Nothing,
            )
        }
        (Some(S::Registered(r)), E::Removed) => (None, A::Deregister(r.clone())),
        (Some(S::Registered(r)), E::Appeared) => (pending(0, now, None), A::Reregister(r.clone())),
        (
            Some(s @ S::Registered(_)),
            E::Tick | E::RegistrationSucceeded(_) | E::RegistrationFailed(_),
        ) => (Some(s.clone()), A::Nothing),
    }
}

/// Whether `path` is a socket the watcher registers.
fn is_plugin_socket(path: &Path) -> bool {
    let hidden = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_none_or(|n| n.starts_with('.'));
    !hidden && std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket())
}

/// The watcher of `<root-dir>/plugins_registry/`.
#[derive(Debug)]
pub struct PluginWatcher {
    dir: PathBuf,
    drivers: CsiDrivers,
    config: CsiClientConfig,
    sockets: BTreeMap<PathBuf, SocketState>,
    start: tokio::time::Instant,
}

impl PluginWatcher {
    /// A watcher of `<root_dir>/plugins_registry`, creating the directory.
    pub fn new(
        root_dir: &Path,
        drivers: CsiDrivers,
        config: CsiClientConfig,
    ) -> Result<Self, CsiError> {
        let dir = root_dir.join(PLUGINS_REGISTRY_DIR);
        std::fs::create_dir_all(&dir)
            .map_err(|e| CsiError::io("plugin registration directory", &dir, e))?;
        Ok(Self {
            dir,
            drivers,
            config,
            sockets: BTreeMap::new(),
            start: tokio::time::Instant::now(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn now(&self) -> Duration {
        self.start.elapsed()
    }

    /// Applies `event` to `socket` and carries out the action.
    async fn apply(&mut self, socket: &Path, event: SocketEvent) {
        let now = self.now();
        let (next, action) = transition(self.sockets.get(socket), &event, now);
        self.store(socket, next);
        match action {
            SocketAction::Nothing => {}
            SocketAction::Register => self.register(socket).await,
            SocketAction::Deregister(r) => registration::deregister(&self.drivers, &r),
            SocketAction::Reregister(r) => {
                registration::deregister(&self.drivers, &r);
                self.register(socket).await;
            }
        }
    }

    async fn register(&mut self, socket: &Path) {
        let event = match registration::register(&self.drivers, socket, self.config).await {
            Ok(r) => SocketEvent::RegistrationSucceeded(r),
            Err(e) => {
                warn!(socket = %socket.display(), error = %e, "plugin registration failed");
                SocketEvent::RegistrationFailed(e.to_string())
            }
        };
        let (next, _) = transition(self.sockets.get(socket), &event, self.now());
        if next.is_some() {
            self.store(socket, next);
        }
    }

    /// Keeps the socket's new state (None: forgotten) and its gauge.
    fn store(&mut self, socket: &Path, next: Option<SocketState>) {
        let registered = matches!(next, Some(SocketState::Registered(_)));
        self.drivers.metrics().set_plugin(
            &socket.display().to_string(),
            next.is_some(),
            registered,
        );
        match next {
            Some(s) => self.sockets.insert(socket.to_owned(), s),
            None => self.sockets.remove(socket),
        };
    }

    /// The sockets' states (for tests and diagnostics).
    pub fn states(&self) -> &BTreeMap<PathBuf, SocketState> {
        &self.sockets
    }

    /// Watches until `shutdown`: the start scan, then inotify events and the
    /// periodic reconcile. An inotify failure is retried after a second.
    pub async fn run(mut self, shutdown: CancellationToken) {
        while !shutdown.is_cancelled() {
            if let Err(e) = self.session(&shutdown).await {
                warn!(dir = %self.dir.display(), error = %e, "plugin watcher: trying again in 1s");
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        }
    }

    async fn session(&mut self, shutdown: &CancellationToken) -> Result<(), CsiError> {
        use futures::StreamExt as _;
        let io = |e| CsiError::io("plugin registration directory", self.dir.clone(), e);
        std::fs::create_dir_all(&self.dir).map_err(io)?;
        let inotify = Inotify::init().map_err(io)?;
        let mask = WatchMask::CREATE
            | WatchMask::DELETE
            | WatchMask::MOVED_TO
            | WatchMask::MOVED_FROM
            | WatchMask::DELETE_SELF
            | WatchMask::MOVE_SELF
            | WatchMask::ONLYDIR;
        inotify.watches().add(&self.dir, mask).map_err(io)?;
        let mut events = inotify.into_event_stream(vec![0u8; 4096]).map_err(io)?;
        self.scan().await;
        let mut tick = tokio::time::interval(RECONCILE_PERIOD);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tick.tick() => {
                    let sockets: Vec<PathBuf> = self.sockets.keys().cloned().collect();
                    for s in sockets {
                        self.apply(&s, SocketEvent::Tick).await;
                    }
                }
                ev = events.next() => {
                    let Some(ev) = ev else { return Ok(()) };
                    let ev = ev.map_err(|e| CsiError::io("plugin registration directory", self.dir.clone(), e))?;
                    if ev.mask.contains(EventMask::Q_OVERFLOW) {
                        self.scan().await;
                        continue;
                    }
                    if ev.mask.intersects(EventMask::DELETE_SELF | EventMask::MOVE_SELF | EventMask::IGNORED) {
                        return Err(CsiError::io("plugin registration directory", self.dir.clone(), std::io::Error::other("removed")));
                    }
                    let Some(name) = ev.name else { continue };
                    let path = self.dir.join(name);
                    if ev.mask.intersects(EventMask::CREATE | EventMask::MOVED_TO) {
                        if is_plugin_socket(&path) {
                            debug!(socket = %path.display(), "plugin socket appeared");
                            self.apply(&path, SocketEvent::Appeared).await;
                        }
                    } else if ev.mask.intersects(EventMask::DELETE | EventMask::MOVED_FROM) {
                        self.apply(&path, SocketEvent::Removed).await;
                    }
                }
            }
        }
    }

    /// Reads the directory: new sockets appear, vanished ones are removed.
    async fn scan(&mut self) {
        let mut present = Vec::new();
        if let Ok(rd) = std::fs::read_dir(&self.dir) {
            for entry in rd.flatten() {
                let p = entry.path();
                if is_plugin_socket(&p) {
                    present.push(p);
                }
            }
        }
        let gone: Vec<PathBuf> = self
            .sockets
            .keys()
            .filter(|k| !present.contains(k))
            .cloned()
            .collect();
        for g in gone {
            self.apply(&g, SocketEvent::Removed).await;
        }
        for p in present {
            if !self.sockets.contains_key(&p) {
                self.apply(&p, SocketEvent::Appeared).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SocketAction as A;
    use SocketEvent as E;

    fn reg() -> Registered {
        Registered {
            driver: "d".into(),
            endpoint: "/run/d.sock".into(),
        }
    }

    fn pending(failures: u32, at_ms: u64) -> SocketState {
        SocketState::Pending {
            failures,
            retry_at: Duration::from_millis(at_ms),
            last_error: (failures > 0).then(|| "boom".to_owned()),
        }
    }

    #[test]
    fn socket_transitions_table() {
        let ms = Duration::from_millis;
        let r = SocketState::Registered(reg());
        #[rustfmt::skip]
        type Row = (Option<SocketState>, E, u64, Option<SocketState>, A);
        let table: Vec<Row> = vec![
            // A new socket is registered at once.
            (
                None,
                E::Appeared,
                0,
                Some(SocketState::Pending {
                    failures: 0,
                    retry_at: ms(0),
                    last_error: None,
                }),
                A::Register,
            ),
            (None, E::Removed, 0, None, A::Nothing),
            (None, E::Tick, 0, None, A::Nothing),
            // A failure waits for the back-off: 500 ms, then 1 s, ...
            (
                Some(SocketState::Pending {
                    failures: 0,
                    retry_at: ms(0),
                    last_error: None,
                }),
                E::RegistrationFailed("boom".into()),
                100,
                Some(pending(1, 600)),
                A::Nothing,
            ),
            (
                Some(pending(1, 600)),
                E::RegistrationFailed("boom".into()),
                700,
                Some(pending(2, 1700)),
                A::Nothing,
            ),
            (
                Some(pending(1, 600)),
                E::Tick,
                599,
                Some(pending(1, 600)),
                A::Nothing,
            ),
            (
                Some(pending(1, 600)),
                E::Tick,
                600,
                Some(pending(1, 600)),
                A::Register,
            ),
            // A pending socket that goes is forgotten; one that is re-created starts over.
            (Some(pending(3, 9000)), E::Removed, 100, None, A::Nothing),
            (
                Some(pending(3, 9000)),
                E::Appeared,
                100,
                Some(SocketState::Pending {
                    failures: 0,
                    retry_at: ms(100),
                    last_error: None,
                }),
                A::Register,
            ),
            (
                Some(pending(1, 600)),
                E::RegistrationSucceeded(reg()),
                100,
                Some(r.clone()),
                A::Nothing,
            ),
            // Registered: removal deregisters; re-creation registers again.
            (Some(r.clone()), E::Removed, 100, None, A::Deregister(reg())),
            (
                Some(r.clone()),
                E::Appeared,
                100,
                Some(SocketState::Pending {
                    failures: 0,
                    retry_at: ms(100),
                    last_error: None,
                }),
                A::Reregister(reg()),
            ),
            (Some(r.clone()), E::Tick, 100, Some(r.clone()), A::Nothing),
            (
                Some(r.clone()),
                E::RegistrationFailed("late".into()),
                100,
                Some(r.clone()),
                A::Nothing,
            ),
        ];
        for (i, (state, event, now, want_state, want_action)) in table.into_iter().enumerate() {
            let (s, a) = transition(state.as_ref(), &event, ms(now));
            assert_eq!(
                (s, a),
                (want_state, want_action),
                "row {i}: {state:?} + {event:?}"
            );
        }
    }

    #[test]
    fn backoff_doubles_to_the_cap() {
        assert_eq!(backoff(1), Duration::from_millis(500));
        assert_eq!(backoff(2), Duration::from_secs(1));
        assert_eq!(backoff(3), Duration::from_secs(2));
        assert_eq!(
            backoff(9),
            Duration::from_secs(122).min(Duration::from_millis(500 * 256))
        );
        assert_eq!(backoff(30), BACKOFF_MAX);
    }

    #[test]
    fn only_visible_sockets_are_plugins() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("d.sock");
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let hidden = dir.path().join(".d.sock");
        let _h = std::os::unix::net::UnixListener::bind(&hidden).unwrap();
        let file = dir.path().join("f.sock");
        std::fs::write(&file, "").unwrap();
        assert!(is_plugin_socket(&sock));
        assert!(!is_plugin_socket(&hidden));
        assert!(!is_plugin_socket(&file));
        assert!(!is_plugin_socket(&dir.path().join("none")));
    }
}
