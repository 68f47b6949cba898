//! `evpleg run` and `evpleg cri-proxy` in a process of their own, for the
//! fault tests (`tests/faults.rs`) that kill them with SIGKILL: the same
//! `Agent::start` and `CriProxy::start` the `evpleg` binary's `main` runs,
//! with the same flags. Once started it prints `ready <http address>` on
//! stdout, then runs until killed (SIGTERM stops it gracefully, as the
//! binary does). The `evpleg` binary itself is another package's, which a
//! test of this package cannot name.

use std::io::Write;

use clap::Parser;
use evpleg::agent::Agent;
use evpleg::config::{Cli, Command};
use evpleg::cri_proxy::CriProxy;

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    evpleg::telemetry::init("info", cli.log_format);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("handling SIGTERM");
    match cli.command {
        Command::Run(args) => {
            let agent = Agent::start(&args)
                .await
                .unwrap_or_else(|e| panic!("starting the agent: {e}"));
            ready(agent.addr);
            term.recv().await;
            agent.stop().await;
        }
        Command::CriProxy(args) => {
            let proxy = CriProxy::start(&args)
                .await
                .unwrap_or_else(|e| panic!("starting the cri proxy: {e}"));
            ready(proxy.http_addr);
            term.recv().await;
            proxy.stop().await;
        }
        _ => panic!("evpleg-killable runs `run` or `cri-proxy` only"),
    }
}

fn ready(addr: std::net::SocketAddr) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready {addr}").expect("stdout");
    out.flush().expect("stdout");
}
