//! SIGINT and SIGTERM stop the benchmark between two of its steps, so that
//! what it started is removed as on any error: its private containerd with
//! the pods and shims it runs (the harness's teardown), the agents, kubelets
//! and control plane it spawned. Killed by the default action instead, all of
//! that stayed running and was measured as orphans by the next run.
//!
//! The first signal sets a flag; every repetition, window, count and part
//! checks it ([`check`]) and returns [`Interrupted`], which unwinds the run
//! with its `Drop`s. A second signal exits at once (130), saying what may be
//! left.

use std::sync::atomic::{AtomicBool, Ordering};

use tokio::signal::unix::{SignalKind, signal};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// The run was interrupted by a signal.
#[derive(Debug, thiserror::Error)]
#[error("interrupted by a signal: the run stopped before its next step")]
pub struct Interrupted;

/// Watches SIGINT and SIGTERM on `rt` from now on.
pub fn watch(rt: &tokio::runtime::Runtime) -> std::io::Result<()> {
    let _entered = rt.enter();
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    rt.spawn(async move {
        loop {
            let name = tokio::select! {
                Some(()) = int.recv() => "SIGINT",
                Some(()) = term.recv() => "SIGTERM",
                else => return,
            };
            if INTERRUPTED.swap(true, Ordering::SeqCst) {
                crate::progress(&format!(
                    "{name} again: exiting now; the benchmark's containerd (its socket under \
                     /tmp/evpleg-containerd-<pid>-*), its pods and shims and the pod cgroups \
                     under kubepods may be left"
                ));
                std::process::exit(130);
            }
            crate::progress(&format!(
                "{name}: stopping after the current step, then removing the pods, shims and \
                 containerd the benchmark started (a second signal exits at once)"
            ));
        }
    });
    Ok(())
}

/// [`Interrupted`] once a signal came.
pub fn check() -> Result<(), Interrupted> {
    match INTERRUPTED.load(Ordering::SeqCst) {
        true => Err(Interrupted),
        false => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A SIGTERM to the process makes the next check fail (and does not kill
    /// the process: the watcher took it).
    #[test]
    fn a_signal_makes_the_next_check_fail() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        watch(&rt).expect("watching the signals");
        assert!(check().is_ok());
        // SAFETY: raise() sends a signal to this thread; tokio's handler is installed.
        assert_eq!(unsafe { libc::raise(libc::SIGTERM) }, 0);
        let deadline = Instant::now() + Duration::from_secs(10);
        rt.block_on(async {
            while check().is_ok() {
                assert!(
                    Instant::now() < deadline,
                    "the signal was not seen within 10 s"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        assert!(check().unwrap_err().to_string().contains("interrupted"));
    }
}
