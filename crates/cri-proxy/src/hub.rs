//! The GetContainerEvents subscribers. Each has a bounded buffer of encoded
//! events; publishing never waits: a subscriber whose buffer is full is
//! dropped, its stream ends with RESOURCE_EXHAUSTED naming why, and a warning
//! is logged, so one slow client never holds back the others or grows the
//! proxy's memory. (containerd's own stream drops a slow subscriber too, with
//! a buffer of 1000.) A subscriber that goes away is forgotten at once.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Frame;
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::grpc::{self, Body, BoxError};
use super::stats::ProxyStats;

/// The end of every stream when the proxy stops.
pub const STOPPING: &str = "the cri proxy is stopping";

/// Why a stream ended, for its trailers.
type Ending = Arc<Mutex<Option<(u32, String)>>>;

#[derive(Debug)]
struct Subscriber {
    id: u64,
    tx: mpsc::Sender<Bytes>,
    ending: Ending,
}

#[derive(Debug, Default)]
struct Inner {
    subscribers: Vec<Subscriber>,
    next_id: u64,
}

/// The subscribers.
#[derive(Debug)]
pub struct Hub {
    inner: Mutex<Inner>,
    buffer: usize,
    stats: Arc<ProxyStats>,
}

/// Forgets its subscriber when the stream is dropped (the client left).
struct Leave {
    hub: Arc<Hub>,
    id: u64,
}

impl Drop for Leave {
    fn drop(&mut self) {
        if self.hub.remove(self.id).is_some() {
            info!(subscriber = self.id, "event subscriber left");
        }
    }
}

impl Hub {
    pub fn new(buffer: usize, stats: Arc<ProxyStats>) -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::default(),
            buffer,
            stats,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn remove(&self, id: u64) -> Option<Subscriber> {
        let mut inner = self.lock();
        let i = inner.subscribers.iter().position(|s| s.id == id)?;
        self.stats.subscribers.dec();
        Some(inner.subscribers.swap_remove(i))
    }

    /// How many subscribers are connected.
    pub fn len(&self) -> usize {
        self.lock().subscribers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A new subscriber: the body of its GetContainerEvents answer, which
    /// carries every event published from now on.
    pub fn subscribe(self: &Arc<Self>) -> Body {
        let (tx, rx) = mpsc::channel(self.buffer);
        let ending = Ending::default();
        let id = {
            let mut inner = self.lock();
            inner.next_id += 1;
            let id = inner.next_id;
            inner.subscribers.push(Subscriber {
                id,
                tx,
                ending: ending.clone(),
            });
            id
        };
        self.stats.subscribers.inc();
        info!(subscriber = id, "event subscriber joined");
        let leave = Leave {
            hub: self.clone(),
            id,
        };
        let stream = futures::stream::unfold(
            (rx, ending, Some(leave)),
            |(mut rx, ending, leave)| async move {
                leave.as_ref()?;
                match rx.recv().await {
                    Some(b) => Some((Ok::<_, BoxError>(Frame::data(b)), (rx, ending, leave))),
                    None => {
                        let (code, msg) = ending
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .take()
                            .unwrap_or((grpc::UNAVAILABLE, STOPPING.into()));
                        let trailers = grpc::trailers(code, &msg);
                        // Ends after the trailers; the guard is dropped then.
                        drop(leave);
                        Some((Ok(Frame::trailers(trailers)), (rx, ending, None)))
                    }
                }
            },
        );
        http_body_util::StreamBody::new(stream).boxed()
    }

    /// Hands one encoded event to every subscriber; drops the ones whose
    /// buffer is full.
    pub fn publish(&self, event: &Bytes) {
        let mut inner = self.lock();
        let buffer = self.buffer;
        inner.subscribers.retain(|s| match s.tx.try_send(event.clone()) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.stats.subscribers.dec();
                false
            }
            Err(mpsc::error::TrySendError::Full(_)) => {
                let why = format!(
                    "subscriber too slow: {buffer} events buffered and unread; dropped, subscribe again"
                );
                warn!(subscriber = s.id, reason = %why, "dropping an event subscriber");
                *s.ending.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some((grpc::RESOURCE_EXHAUSTED, why));
                self.stats.subscribers.dec();
                self.stats.subscribers_dropped.inc();
                false
            }
        });
    }

    /// Ends every stream with UNAVAILABLE and `why` (the proxy stops, or
    /// its event sources are gone): the subscribers subscribe again.
    pub fn close(&self, why: &str) {
        let mut inner = self.lock();
        for s in inner.subscribers.drain(..) {
            *s.ending.lock().unwrap_or_else(|e| e.into_inner()) =
                Some((grpc::UNAVAILABLE, why.to_owned()));
            self.stats.subscribers.dec();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn stats() -> Arc<ProxyStats> {
        Arc::default()
    }

    #[tokio::test]
    async fn a_full_subscriber_is_dropped_and_the_others_keep_their_events() {
        let stats = stats();
        let hub = Hub::new(2, stats.clone());
        let mut slow = hub.subscribe();
        let mut fast = hub.subscribe();
        assert_eq!(stats.subscribers.get(), 2);
        for n in 0..3u8 {
            hub.publish(&Bytes::from(vec![n]));
            let f = fast.frame().await.unwrap().unwrap();
            assert_eq!(f.into_data().unwrap(), Bytes::from(vec![n]));
        }
        // The third event found the slow one's two-event buffer full.
        assert_eq!(hub.len(), 1);
        assert_eq!(stats.subscribers.get(), 1);
        assert_eq!(stats.subscribers_dropped.get(), 1);
        // Its stream gives what was buffered, then the reason.
        for n in 0..2u8 {
            let f = slow.frame().await.unwrap().unwrap();
            assert_eq!(f.into_data().unwrap(), Bytes::from(vec![n]));
        }
        let t = slow
            .frame()
            .await
            .unwrap()
            .unwrap()
            .into_trailers()
            .unwrap();
        assert_eq!(t["grpc-status"], "8");
        assert!(t["grpc-message"].to_str().unwrap().contains("too slow"));
        assert!(slow.frame().await.is_none());
        // A subscriber that leaves is forgotten at once.
        drop(fast);
        assert_eq!(hub.len(), 0);
        assert_eq!(stats.subscribers.get(), 0);
    }

    #[tokio::test]
    async fn closing_ends_every_stream_unavailable_with_the_reason() {
        let hub = Hub::new(4, stats());
        let (mut a, mut b) = (hub.subscribe(), hub.subscribe());
        hub.close("sources-gone");
        for s in [&mut a, &mut b] {
            let t = s.frame().await.unwrap().unwrap().into_trailers().unwrap();
            assert_eq!(t["grpc-status"], "14");
            assert_eq!(t["grpc-message"], "sources-gone");
        }
        assert_eq!(hub.len(), 0);
    }
}
