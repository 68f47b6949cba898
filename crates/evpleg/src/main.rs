//! The `evpleg` binary: `evpleg run` runs the node agent (`evpleg::agent`),
//! `evpleg observe` the PLEG alone next to a real kubelet (`evpleg::observe`),
//! `evpleg version` says what was built, `evpleg describe pod` shows a pod and
//! its events as a running agent knows them, `evpleg cri-proxy` serves the CRI
//! to a stock kubelet with kernel-speed events (`evpleg::cri_proxy`).

use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use evpleg::agent::Agent;
use evpleg::config::{
    Cli, Command, CriProxyArgs, Describe, DescribeArgs, ObserveArgs, OutputFormat, RunArgs,
    VersionArgs,
};
use evpleg::cri_proxy::CriProxy;
use evpleg::observe::{ObservedEvent, Observer};
use tracing::info;

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

    /// Until a signal, or `run_for` (zero: no limit).
    async fn until_stopped(&mut self, run_for: Duration) {
        let deadline = async {
            if run_for.is_zero() {
                std::future::pending::<()>().await
            } else {
                tokio::time::sleep(run_for).await
            }
        };
        tokio::select! {
            _ = self.int.recv() => info!("SIGINT: stopping"),
            _ = self.term.recv() => info!("SIGTERM: stopping"),
            () = deadline => info!(run_for = ?run_for, "run time over"),
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    evpleg::telemetry::init("info", cli.log_format);
    match cli.command {
        Command::Run(args) => run(&args).await,
        Command::Observe(args) => observe(&args).await,
        Command::Version(args) => version(&args),
        Command::Describe(args) => describe(&args).await,
        Command::CriProxy(args) => cri_proxy(&args).await,
    }
}

async fn describe(args: &DescribeArgs) -> anyhow::Result<()> {
    let Describe::Pod(pod) = &args.what;
    let text =
        evpleg::describe::describe_pod(&pod.server, &pod.pod, pod.namespace.as_deref()).await?;
    print!("{text}");
    Ok(())
}

async fn run(args: &RunArgs) -> anyhow::Result<()> {
    let mut signals = Signals::install()?;
    let agent = Agent::start(args).await.context("starting the agent")?;
    signals.until_stopped(args.common.run_for).await;
    // Workers stop, containers keep running, pending statuses go out.
    agent.stop().await;
    info!("agent stopped");
    Ok(())
}

async fn observe(args: &ObserveArgs) -> anyhow::Result<()> {
    let mut signals = Signals::install()?;
    let mut observer = Observer::start(args)
        .await
        .context("starting the observer")?;
    info!(addr = %observer.addr, "observing: /metrics, /healthz");
    let mut out = std::io::stdout().lock();
    if args.output == OutputFormat::Table {
        writeln!(out, "{}", ObservedEvent::header())?;
    }
    let stopped = signals.until_stopped(args.common.run_for);
    tokio::pin!(stopped);
    loop {
        tokio::select! {
            ev = observer.events.recv() => {
                let Some(ev) = ev else { break };
                let line = match args.output {
                    OutputFormat::Json => ev.json(),
                    OutputFormat::Table => ev.row(),
                };
                writeln!(out, "{line}").context("writing to stdout")?;
                out.flush().context("writing to stdout")?;
            }
            () = &mut stopped => break,
        }
    }
    observer.stop().await;
    info!("observer stopped");
    Ok(())
}

async fn cri_proxy(args: &CriProxyArgs) -> anyhow::Result<()> {
    let mut signals = Signals::install()?;
    let proxy = CriProxy::start(args)
        .await
        .context("starting the cri proxy")?;
    signals.until_stopped(args.run_for).await;
    proxy.stop().await;
    info!("cri proxy stopped");
    Ok(())
}

fn version(args: &VersionArgs) -> anyhow::Result<()> {
    let object = evpleg_pleg::kernel::loader::embedded_object_digest();
    if args.json {
        let v = serde_json::json!({
            "version": env!("CARGO_PKG_VERSION"),
            "target": std::env::consts::ARCH,
            "ebpf_object_bytes": object.as_ref().map(|o| o.0),
            "ebpf_object_sha256": object.as_ref().map(|o| &o.1),
        });
        println!("{v}");
    } else {
        println!("evpleg {}", env!("CARGO_PKG_VERSION"));
        match object {
            Some((bytes, sha)) => println!("eBPF object: {bytes} bytes, sha256 {sha}"),
            None => println!(
                "eBPF object: none built in (cargo xtask build); pass --bpf-object to run the ebpf pleg"
            ),
        }
    }
    Ok(())
}
