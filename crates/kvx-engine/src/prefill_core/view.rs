//! What the embedder of a prefill rank reads without a round trip to its loop: room statuses
//! and failure reasons as of the core's last step, the number of rooms held, the fatal error once
//! published. The core refreshes it after each event; the engine's handle reads it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use kvx_core::{KVPoll, Room};

use crate::fault::TransferThreadFailed;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the embedder reads without a round trip: room statuses and failure reasons as of the
/// loop's last step, the number of rooms held, the fatal error once published.
#[derive(Default)]
pub(crate) struct View {
    rooms: Mutex<HashMap<Room, (KVPoll, Option<String>)>>,
    held: AtomicUsize,
    fatal: Mutex<Option<Arc<TransferThreadFailed>>>,
}

impl View {
    pub(crate) fn poll(&self, room: Room) -> Option<KVPoll> {
        lock(&self.rooms).get(&room).map(|v| v.0)
    }

    pub(crate) fn failure(&self, room: Room) -> Option<String> {
        lock(&self.rooms).get(&room).and_then(|v| v.1.clone())
    }

    /// Rooms the view holds that are not terminal yet.
    pub(crate) fn open_rooms(&self) -> Vec<Room> {
        lock(&self.rooms)
            .iter()
            .filter(|(_, (status, _))| !status.is_terminal())
            .map(|(room, _)| *room)
            .collect()
    }

    pub(crate) fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    pub(crate) fn fatal(&self) -> Option<Arc<TransferThreadFailed>> {
        lock(&self.fatal).clone()
    }

    /// The room table, for the core's refresh.
    pub(crate) fn rooms(&self) -> MutexGuard<'_, HashMap<Room, (KVPoll, Option<String>)>> {
        lock(&self.rooms)
    }

    pub(crate) fn set_held(&self, n: usize) {
        self.held.store(n, Ordering::Relaxed);
    }

    /// Rooms by status (indexed by `KVPoll::as_u8`).
    pub(crate) fn counts(&self) -> [usize; 5] {
        let mut counts = [0usize; 5];
        for (status, _) in lock(&self.rooms).values() {
            counts[status.as_u8() as usize] += 1;
        }
        counts
    }

    pub(crate) fn publish_fatal(&self, err: &Arc<TransferThreadFailed>) {
        lock(&self.fatal).get_or_insert_with(|| err.clone());
    }
}
