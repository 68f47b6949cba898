//! The `evpleg` binary.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use evpleg::config::Args;
use evpleg::pleg::RelistSignal;
use evpleg::pleg::kernel::{KernelPleg, monotonic_ns};
use tokio::sync::mpsc;
use tracing::info;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    evpleg::telemetry::init("info");
    let args = Args::parse();
    let (tx, mut rx) = mpsc::channel(args.event_channel);
    let relist = Arc::new(RelistSignal::new());
    let pleg = KernelPleg::start(args.kernel_pleg(), tx, relist.clone(), None)
        .context("starting the kernel pleg")?;
    info!(offsets = ?pleg.offsets(), "offsets from the kernel's btf");
    let deadline = async {
        if args.run_for_seconds == 0 {
            std::future::pending::<()>().await
        } else {
            tokio::time::sleep(Duration::from_secs(args.run_for_seconds)).await
        }
    };
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            Some(ev) = rx.recv() => {
                let latency_us = monotonic_ns().saturating_sub(ev.at_ns) as f64 / 1000.0;
                info!(
                    kind = ?ev.kind,
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
            () = relist.requested() => info!(total = relist.count(), "relist requested"),
            _ = tokio::signal::ctrl_c() => break,
            () = &mut deadline => break,
        }
    }
    let stats = pleg.stats().clone();
    pleg.stop();
    info!(?stats, "stopped");
    Ok(())
}
