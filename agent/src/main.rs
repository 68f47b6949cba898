//! The `evpleg` binary.
//!
//! With `--cri-endpoint` it runs the whole agent (`evpleg::agent`): pods from the
//! configured sources run on that runtime, driven by the PLEG of `--pleg`, with
//! statuses at `/pods`. Without it, the kernel PLEG alone, logging every lifecycle
//! event of the containers on the host.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use evpleg::agent::Agent;
use evpleg::clock::MonotonicClock;
use evpleg::config::Args;
use evpleg::metrics::Metrics;
use evpleg::pleg::kernel::{KernelPleg, monotonic_ns};
use evpleg::pleg::{PodLifecycleEvent, RelistSignal};
use evpleg::server::{self, ServerState};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::info;

fn log_event(ev: &PodLifecycleEvent) {
    let latency_us = monotonic_ns().saturating_sub(ev.at_ns) as f64 / 1000.0;
    info!(
        kind = ?ev.kind,
        source = ?ev.source,
        pod = ev.pod_uid.as_ref().map(|u| u.as_str()).unwrap_or("-"),
        container = ev.container_id.as_ref().map(|c| c.as_str()).unwrap_or("-"),
        pid = ev.pid,
        exit_code = ev.exit.map(|e| e.code),
        signal = ev.exit.and_then(|e| e.signal),
        oom_killed = ev.exit.is_some_and(|e| e.oom_killed),
        latency_us,
        "pod lifecycle event"
    );
}

/// SIGTERM and SIGINT, caught from the start: one that arrives while the agent
/// starts is kept and stops it once it runs (never the default kill).
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("handling SIGTERM")?,
            int: signal(SignalKind::interrupt()).context("handling SIGINT")?,
        })
    }
}

async fn until_stopped(signals: &mut Signals, run_for_seconds: u64) {
    let deadline = async {
        if run_for_seconds == 0 {
            std::future::pending::<()>().await
        } else {
            tokio::time::sleep(Duration::from_secs(run_for_seconds)).await
        }
    };
    tokio::select! {
        _ = signals.int.recv() => info!("SIGINT: stopping"),
        _ = signals.term.recv() => info!("SIGTERM: stopping"),
        () = deadline => info!(run_for_seconds, "run time over"),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    evpleg::telemetry::init("info");
    let args = Args::parse();
    let mut signals = Signals::install()?;
    let (tx, mut rx) = mpsc::channel(args.event_channel);
    let printer = tokio::spawn(async move {
        while let Some(ev) = rx.recv().await {
            log_event(&ev);
        }
    });
    match &args.cri_endpoint {
        Some(_) => {
            drop(tx);
            let agent = Agent::start(&args).await.context("starting the agent")?;
            until_stopped(&mut signals, args.run_for_seconds).await;
            // Workers stop, containers keep running, pending statuses go out.
            agent.stop().await;
            info!("agent stopped");
        }
        None => {
            let relist = Arc::new(RelistSignal::new());
            let pleg = KernelPleg::start(args.kernel_pleg(), tx, relist.clone())
                .context("starting the kernel pleg")?;
            info!(offsets = ?pleg.offsets(), "kernel pleg running without a container runtime");
            let metrics = Arc::new(Metrics::new(None, Some(pleg.stats().clone())));
            let state = ServerState::new(metrics, None, Arc::new(MonotonicClock), Duration::ZERO);
            let shutdown = CancellationToken::new();
            let server = tokio::spawn(server::serve(
                args.listen,
                server::router(state),
                shutdown.clone(),
            ));
            until_stopped(&mut signals, args.run_for_seconds).await;
            shutdown.cancel();
            server
                .await
                .context("http server")?
                .with_context(|| format!("serving on {}", args.listen))?;
            let stats = pleg.stats().clone();
            pleg.stop();
            info!(
                records = stats.records.load(Ordering::Relaxed),
                events = stats.events.load(Ordering::Relaxed),
                kernel_dropped = stats.kernel_dropped.load(Ordering::Relaxed),
                kernel_filtered = stats.kernel_filtered.load(Ordering::Relaxed),
                discarded = stats.discarded.load(Ordering::Relaxed),
                relist_requests = relist.count(),
                "stopped"
            );
        }
    }
    printer.await.context("event printer")?;
    Ok(())
}
