//! Timeouts and the reconnection backoff of the CRI client.

use std::time::Duration;

/// How long CRI calls may take and how the client waits between attempts while
/// the runtime is unreachable.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CriClientConfig {
    /// Timeout of calls that change state (`RunPodSandbox`, `CreateContainer`,
    /// `StartContainer`, `Stop*`, `Remove*`): the kubelet's
    /// `--runtime-request-timeout`, 2 min by default. `StopContainer` gets the
    /// container's grace period on top, as in the kubelet.
    pub request_timeout: Duration,
    /// Timeout of read-only calls (`Version`, `Status`, `List*`, `*Status`),
    /// which the PLEG makes every relist: 10 s by default. The kubelet uses
    /// `request_timeout` for these too.
    pub query_timeout: Duration,
    /// Timeout of `PullImage`: 10 min by default. The kubelet sets none.
    pub pull_timeout: Duration,
    /// Timeout of one attempt to connect to the socket: 5 s by default, the
    /// kubelet's minimum connection timeout.
    pub connect_timeout: Duration,
    /// How long [`CriClient::connect`](super::CriClient::connect) waits for the
    /// runtime to answer `Version`: 20 s by default.
    pub startup_timeout: Duration,
    /// The delays between attempts while the runtime is unreachable.
    pub backoff: BackoffConfig,
}

impl Default for CriClientConfig {
    fn default() -> Self {
        Self {
            request_timeout: Duration::from_secs(120),
            query_timeout: Duration::from_secs(10),
            pull_timeout: Duration::from_secs(600),
            connect_timeout: Duration::from_secs(5),
            startup_timeout: Duration::from_secs(20),
            backoff: BackoffConfig::default(),
        }
    }
}

/// Which timeout a call gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CallKind {
    /// Read-only: [`CriClientConfig::query_timeout`].
    Query,
    /// State-changing: [`CriClientConfig::request_timeout`].
    Request,
    /// `PullImage`: [`CriClientConfig::pull_timeout`].
    Pull,
}

impl CriClientConfig {
    /// The timeout of a call of this kind.
    pub(crate) fn timeout(&self, kind: CallKind) -> Duration {
        match kind {
            CallKind::Query => self.query_timeout,
            CallKind::Request => self.request_timeout,
            CallKind::Pull => self.pull_timeout,
        }
    }

    /// The timeout of `StopContainer` with a grace period of `grace_s` seconds:
    /// the request timeout plus the grace period, as the kubelet does (the
    /// runtime waits that long before it kills the container).
    pub(crate) fn stop_container_timeout(&self, grace_s: i64) -> Duration {
        let grace = Duration::from_secs(u64::try_from(grace_s).unwrap_or(0));
        self.request_timeout.saturating_add(grace)
    }
}

/// Capped exponential backoff with jitter, gRPC's connection backoff with the
/// kubelet's parameters: 100 ms, times 1.6 per attempt, at most 3 s, +-20 %.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BackoffConfig {
    /// The first delay.
    pub base: Duration,
    /// The largest delay (before jitter).
    pub max: Duration,
    /// The factor between consecutive delays (at least 1).
    pub multiplier: f64,
    /// The relative spread of each delay, in `[0, 1)`.
    pub jitter: f64,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        Self {
            base: Duration::from_millis(100),
            max: Duration::from_secs(3),
            multiplier: 1.6,
            jitter: 0.2,
        }
    }
}

/// The delays of one call's retries.
#[derive(Debug)]
pub struct Backoff {
    config: BackoffConfig,
    next: Duration,
    rng: u64,
}

impl Backoff {
    /// A fresh sequence, starting at `config.base`.
    pub fn new(config: BackoffConfig) -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        Self {
            config,
            next: config.base.min(config.max),
            // Never zero: xorshift would stay at zero.
            rng: u64::from(seed) | 1,
        }
    }

    /// The next delay: the current one with jitter applied; the one after is
    /// `multiplier` times larger, capped at `max`.
    pub fn next_delay(&mut self) -> Duration {
        let current = self.next;
        let multiplier = self.config.multiplier.max(1.0);
        self.next = current.mul_f64(multiplier).min(self.config.max);
        let jitter = self.config.jitter.clamp(0.0, 0.99);
        // A uniform factor in [1 - jitter, 1 + jitter].
        let unit = (self.random() >> 11) as f64 / (1u64 << 53) as f64;
        current.mul_f64(1.0 - jitter + 2.0 * jitter * unit)
    }

    /// xorshift64: enough to spread clients apart, no cryptography needed.
    fn random(&mut self) -> u64 {
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_kubelet() {
        let c = CriClientConfig::default();
        assert_eq!(c.request_timeout, Duration::from_secs(120));
        assert_eq!(c.timeout(CallKind::Request), Duration::from_secs(120));
        assert_eq!(c.timeout(CallKind::Query), Duration::from_secs(10));
        assert_eq!(c.timeout(CallKind::Pull), Duration::from_secs(600));
        assert_eq!(c.connect_timeout, Duration::from_secs(5));
        assert_eq!(c.backoff.base, Duration::from_millis(100));
        assert_eq!(c.backoff.max, Duration::from_secs(3));
    }

    #[test]
    fn stop_container_gets_the_grace_period_on_top() {
        let c = CriClientConfig {
            request_timeout: Duration::from_secs(2),
            ..CriClientConfig::default()
        };
        assert_eq!(c.stop_container_timeout(30), Duration::from_secs(32));
        assert_eq!(c.stop_container_timeout(0), Duration::from_secs(2));
        assert_eq!(c.stop_container_timeout(-5), Duration::from_secs(2));
        assert_eq!(
            CriClientConfig {
                request_timeout: Duration::MAX,
                ..c
            }
            .stop_container_timeout(i64::MAX),
            Duration::MAX
        );
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        let config = BackoffConfig {
            jitter: 0.0,
            ..BackoffConfig::default()
        };
        let mut b = Backoff::new(config);
        let delays: Vec<u128> = (0..12).map(|_| b.next_delay().as_millis()).collect();
        for (got, want) in delays.iter().zip([100, 160, 256, 409]) {
            assert!(got.abs_diff(want) <= 1, "{delays:?}");
        }
        assert!(delays.windows(2).all(|w| w[0] <= w[1]), "{delays:?}");
        assert_eq!(*delays.last().unwrap(), 3000);
    }

    #[test]
    fn backoff_jitter_stays_in_bounds() {
        let mut b = Backoff::new(BackoffConfig::default());
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..200 {
            let d = b.next_delay();
            assert!(d >= Duration::from_millis(80), "{d:?}");
            assert!(d <= Duration::from_millis(3600), "{d:?}");
            seen.insert(d);
        }
        assert!(seen.len() > 10, "jitter varies the delays");
    }
}
