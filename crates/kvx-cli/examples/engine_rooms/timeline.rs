//! The control-path breakdown of `--timeline`: a tracing layer that records kvx-engine's room
//! timeline events (`kvx_engine::timeline`) with the time it saw each, and the per-stage
//! percentiles over the measured rooms.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use kvx_engine::timeline::{DECODE_STAGES, PREFILL_STAGES, TARGET};
use tracing::field::{Field, Visit};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;

/// Every stage in order, then the embedder's receipt of `Done` (`event`, recorded by the
/// example itself).
pub fn stages() -> Vec<&'static str> {
    PREFILL_STAGES
        .iter()
        .chain(DECODE_STAGES.iter())
        .copied()
        .chain(["event"])
        .collect()
}

/// What the layer saw: (room, stage index) → the latest time (several prefill ranks pass the
/// same stage; the last one gates the room).
#[derive(Clone, Default)]
pub struct Timeline(Arc<Mutex<HashMap<(u64, usize), Instant>>>);

impl Timeline {
    /// Installs the layer as the global subscriber, taking only timeline events.
    pub fn install() -> Timeline {
        let t = Timeline::default();
        let filter =
            tracing_subscriber::filter::Targets::new().with_target(TARGET, tracing::Level::TRACE);
        tracing_subscriber::registry()
            .with(t.clone().with_filter(filter))
            .init();
        t
    }

    /// Records `stage` of `room` now.
    pub fn mark(&self, room: u64, stage: &str, at: Instant) {
        if let Some(i) = stages().iter().position(|s| *s == stage) {
            let mut m = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            let e = m.entry((room, i)).or_insert(at);
            *e = (*e).max(at);
        }
    }

    /// Per hand-off between consecutive stages a room passed (a room with no data-plane write
    /// skips the worker's stages), the durations over `rooms` in microseconds, sorted; in stage
    /// order.
    pub fn segments(&self, rooms: &[u64]) -> Vec<(String, Vec<f64>)> {
        let m = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let names = stages();
        let mut by_pair: std::collections::BTreeMap<(usize, usize), Vec<f64>> = Default::default();
        for r in rooms {
            let passed: Vec<(usize, Instant)> = (0..names.len())
                .filter_map(|i| m.get(&(*r, i)).map(|t| (i, *t)))
                .collect();
            for w in passed.windows(2) {
                let ((a, ta), (b, tb)) = (w[0], w[1]);
                let us = tb.saturating_duration_since(ta).as_secs_f64() * 1e6;
                by_pair.entry((a, b)).or_default().push(us);
            }
        }
        by_pair
            .into_iter()
            .map(|((a, b), mut v)| {
                v.sort_by(f64::total_cmp);
                (format!("{} → {}", names[a], names[b]), v)
            })
            .collect()
    }
}

impl<S: tracing::Subscriber> Layer<S> for Timeline {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        let at = Instant::now();
        let mut v = Fields::default();
        event.record(&mut v);
        if let (Some(room), Some(stage)) = (v.room, v.stage) {
            self.mark(room, &stage, at);
        }
    }
}

/// The two fields of a timeline event.
#[derive(Default)]
struct Fields {
    room: Option<u64>,
    stage: Option<String>,
}

impl Visit for Fields {
    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "room" {
            self.room = Some(value);
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "stage" {
            self.stage = Some(value.to_owned());
        }
    }

    fn record_debug(&mut self, _field: &Field, _value: &dyn std::fmt::Debug) {}
}
