//! The per-peer session cache of the socket backends (`tcp`, `mooncake`): `Transport::connect`
//! hands out one live session per peer and opens a fresh one once it is broken.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use crate::error::TransportError;
use crate::transport::Session;

/// Live sessions by peer name.
pub(crate) struct SessionCache<S>(Mutex<HashMap<String, Arc<S>>>);

impl<S: Session> SessionCache<S> {
    /// An empty cache.
    pub(crate) fn new() -> Self {
        SessionCache(Mutex::new(HashMap::new()))
    }

    /// The cached session to `peer` while it is alive, else `open()`'s, cached.
    pub(crate) async fn get_or_open<Fut>(
        &self,
        peer: &str,
        open: impl FnOnce() -> Fut,
    ) -> Result<Arc<dyn Session>, TransportError>
    where
        Fut: Future<Output = Result<S, TransportError>>,
    {
        let cached = self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(peer)
            .filter(|s| s.is_alive())
            .cloned();
        if let Some(s) = cached {
            return Ok(s as Arc<dyn Session>);
        }
        // Sessions of departed peers are not kept: the cache is bounded by the live peers.
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, s| s.is_alive());
        let s = Arc::new(open().await?);
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(peer.to_owned(), s.clone());
        Ok(s as Arc<dyn Session>)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::segment::SegmentDescriptor;
    use crate::transport::{BatchReport, BoxFuture};
    use kvx_core::TransferOp;

    /// A session whose liveness the test sets.
    struct Fake {
        peer: String,
        desc: SegmentDescriptor,
        alive: AtomicBool,
    }

    impl Session for Fake {
        fn peer(&self) -> &str {
            &self.peer
        }
        fn remote(&self) -> &SegmentDescriptor {
            &self.desc
        }
        fn write_batch(
            &self,
            _ops: Vec<TransferOp>,
        ) -> BoxFuture<'static, Result<BatchReport, TransportError>> {
            Box::pin(async { Err(TransportError::Closed) })
        }
        fn is_alive(&self) -> bool {
            self.alive.load(Ordering::Relaxed)
        }
    }

    fn fake(peer: &str) -> Fake {
        Fake {
            peer: peer.to_owned(),
            desc: SegmentDescriptor {
                endpoint: peer.to_owned(),
                regions: Vec::new(),
            },
            alive: AtomicBool::new(true),
        }
    }

    #[tokio::test]
    async fn dead_sessions_of_departed_peers_are_not_kept() {
        let cache: SessionCache<Fake> = SessionCache::new();
        let mut held = Vec::new();
        for n in 0..100 {
            let peer = format!("10.0.0.1:{n}");
            let s = cache
                .get_or_open(&peer, || async { Ok(fake(&peer)) })
                .await
                .unwrap();
            held.push(s);
        }
        assert_eq!(cache.0.lock().unwrap().len(), 100);
        // Every peer departs; before, their 100 sessions stayed cached forever.
        for s in cache.0.lock().unwrap().values() {
            s.alive.store(false, Ordering::Relaxed);
        }
        cache
            .get_or_open("10.0.0.2:1", || async { Ok(fake("10.0.0.2:1")) })
            .await
            .unwrap();
        assert_eq!(cache.0.lock().unwrap().len(), 1);
    }
}
