//! Ports for the servers the harness starts as child processes (the stock
//! kubelet's three, etcd's and kube-apiserver's), which must be named on
//! their command lines before they bind them.
//!
//! A port the kernel picks for `127.0.0.1:0` is in its ephemeral range, the
//! range every outgoing connection's source port is also taken from: between
//! the pick and the child's bind, a connection of this process (the harness
//! polls the very servers it is starting) can take it, and the kubelet exits
//! 1 on a port it cannot listen on. So the ports here are chosen below that
//! range, where nothing binds without naming the port, each checked free by
//! binding it, and none handed out twice in one process.

use std::net::{Ipv4Addr, TcpListener};
use std::sync::atomic::{AtomicU32, Ordering};

/// The lowest port handed out.
const FLOOR: u16 = 20_000;
/// The kernel's ephemeral range's start when it cannot be read (its default).
const DEFAULT_EPHEMERAL_START: u16 = 32_768;
const RANGE_FILE: &str = "/proc/sys/net/ipv4/ip_local_port_range";

/// How many ports handed out so far in this process (the next one's offset).
static HANDED_OUT: AtomicU32 = AtomicU32::new(0);

/// A port on 127.0.0.1 that was free just now, below the kernel's ephemeral
/// range, not handed out before by this process.
pub fn free_port() -> std::io::Result<u16> {
    let range = std::fs::read_to_string(RANGE_FILE).ok();
    let start = range
        .as_deref()
        .and_then(ephemeral_start)
        .unwrap_or(DEFAULT_EPHEMERAL_START);
    let Some(span) = start.checked_sub(FLOOR).filter(|s| *s > 0) else {
        // No room below the range: the kernel's pick, as before.
        return TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
            .local_addr()
            .map(|a| a.port());
    };
    let seed = std::process::id();
    let mut last = None;
    for _ in 0..span {
        let n = HANDED_OUT.fetch_add(1, Ordering::Relaxed);
        let port = candidate(seed, n, span);
        match TcpListener::bind((Ipv4Addr::LOCALHOST, port)) {
            Ok(_) => return Ok(port),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no port below the ephemeral range")))
}

/// The first port of the kernel's ephemeral range, from
/// `ip_local_port_range`'s text ("32768\t60999").
fn ephemeral_start(text: &str) -> Option<u16> {
    text.split_whitespace().next()?.parse().ok()
}

/// The `n`th port this process tries: its own offset into the span (processes
/// started together seldom collide), then consecutive ports.
fn candidate(seed: u32, n: u32, span: u16) -> u16 {
    let span = u32::from(span);
    let offset = seed.wrapping_mul(2_654_435_761) % span;
    // Below FLOOR + span <= u16::MAX by construction.
    FLOOR + ((offset + n) % span) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ephemeral_range_is_read_from_its_file_s_text() {
        assert_eq!(ephemeral_start("32768\t60999\n"), Some(32768));
        assert_eq!(ephemeral_start("1024 65535"), Some(1024));
        assert_eq!(ephemeral_start(""), None);
        assert_eq!(ephemeral_start("x 1"), None);
    }

    #[test]
    fn candidates_stay_below_the_range_and_do_not_repeat_within_it() {
        let span = DEFAULT_EPHEMERAL_START - FLOOR;
        let ports: std::collections::HashSet<u16> = (0..u32::from(span))
            .map(|n| candidate(4242, n, span))
            .collect();
        assert_eq!(ports.len(), usize::from(span));
        assert!(
            ports
                .iter()
                .all(|p| (FLOOR..DEFAULT_EPHEMERAL_START).contains(p))
        );
    }

    #[test]
    fn a_handed_out_port_is_bindable_and_not_handed_out_again() {
        let a = free_port().expect("a port");
        let b = free_port().expect("another port");
        assert_ne!(a, b);
        let start = std::fs::read_to_string(RANGE_FILE)
            .ok()
            .as_deref()
            .and_then(ephemeral_start)
            .unwrap_or(DEFAULT_EPHEMERAL_START);
        assert!(a < start && b < start, "{a} {b} not below {start}");
        TcpListener::bind((Ipv4Addr::LOCALHOST, a)).expect("bind the port handed out");
    }
}
