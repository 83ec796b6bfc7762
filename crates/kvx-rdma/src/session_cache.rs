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
        let s = Arc::new(open().await?);
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(peer.to_owned(), s.clone());
        Ok(s as Arc<dyn Session>)
    }
}
