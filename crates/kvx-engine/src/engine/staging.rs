//! Liveness probes of staging decodes. A staged room can wait on its decode with nothing in
//! flight (for ring space, for a watermark), so no failed write would reveal a decode that died;
//! the core asks for a probe of each decode inbox staged rooms wait on
//! ([`Output::Probe`](crate::prefill_core::Output::Probe), every
//! [`PROBE_PERIOD`](crate::prefill_core::PROBE_PERIOD)). A probe is a TCP connection to the inbox
//! (closed at once, which ZMQ ignores); two refused or silent ones in a row are reported as
//! [`Input::SessionLost`], and the manager fails the session's open rooms at once instead of
//! after the staging wait timeout.

use std::time::Duration;

use kvx_core::{Endpoint, SessionId};

use super::owner::{Input, Owner};

/// How long a probe's TCP connect may take before the decode counts as gone.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

impl Owner {
    /// Probes the decode inbox behind `session` on the runtime; reports it lost to the loop.
    pub(super) fn probe(&self, session: SessionId, inbox: Endpoint) {
        let inputs = self.inputs.clone();
        self.workers.rt.spawn(async move {
            // Two failed connects in a row, half a second apart: one refused SYN on a busy
            // host does not fail rooms.
            for attempt in 0..2 {
                if attempt > 0 {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                if kvx_bootstrap::http::tcp_alive(&inbox.host, inbox.port, PROBE_TIMEOUT).await {
                    return;
                }
            }
            metrics::counter!("kvx_staging_sessions_lost_total").increment(1);
            tracing::warn!(
                %session,
                inbox = %inbox,
                "decode inbox does not answer: failing the staged rooms waiting on it"
            );
            // A full input queue drops the report; the next probe repeats it.
            let _ = inputs.try_send(Input::SessionLost(session));
        });
    }
}
