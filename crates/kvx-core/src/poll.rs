//! `KVPoll`: the status of a room as sglang's schedulers see it.
//!
//! The numeric values are sglang's and they matter: schedulers MIN-reduce polls across ranks, so
//! Failed anywhere wins and the slowest rank gates progress. Updates follow sglang's
//! `update_status`: Failed is sticky; otherwise the stored value never goes down.

/// Status of a room (sglang's `KVPoll`, same integer values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum KVPoll {
    /// The transfer failed; sticky.
    Failed = 0,
    /// Waiting for the peer's metadata.
    Bootstrapping = 1,
    /// Metadata complete; waiting for KV chunks from the forward pass.
    WaitingForInput = 2,
    /// Writes are in flight.
    Transferring = 3,
    /// Every write of the room landed.
    Success = 4,
}

impl KVPoll {
    /// Every state, in numeric order.
    pub const ALL: [KVPoll; 5] = [
        KVPoll::Failed,
        KVPoll::Bootstrapping,
        KVPoll::WaitingForInput,
        KVPoll::Transferring,
        KVPoll::Success,
    ];

    /// The state for an integer value, `None` outside `0..=4`.
    pub fn from_i64(v: i64) -> Option<Self> {
        match v {
            0 => Some(KVPoll::Failed),
            1 => Some(KVPoll::Bootstrapping),
            2 => Some(KVPoll::WaitingForInput),
            3 => Some(KVPoll::Transferring),
            4 => Some(KVPoll::Success),
            _ => None,
        }
    }

    /// The integer value (sglang's).
    pub fn as_u8(self) -> u8 {
        self as u8
    }

    /// The state after storing `new` over `self`: Failed is sticky, otherwise the maximum.
    #[must_use]
    pub fn update(self, new: KVPoll) -> KVPoll {
        if self == KVPoll::Failed || new == KVPoll::Failed {
            KVPoll::Failed
        } else {
            self.max(new)
        }
    }

    /// The state an unknown room gets when `new` is stored for it, following the later sglang rule
    /// (only the "opening" states Bootstrapping and WaitingForInput create a room); `None` means
    /// the update is ignored, so a late Failed or Success cannot resurrect a cleared room.
    pub fn create_unknown(new: KVPoll) -> Option<KVPoll> {
        match new {
            KVPoll::Bootstrapping | KVPoll::WaitingForInput => Some(new),
            _ => None,
        }
    }

    /// True for Failed and Success.
    pub fn is_terminal(self) -> bool {
        matches!(self, KVPoll::Failed | KVPoll::Success)
    }

    /// MIN-reduce across ranks, as sglang's schedulers all-reduce polls. `None` for no input.
    pub fn min_reduce<I: IntoIterator<Item = KVPoll>>(polls: I) -> Option<KVPoll> {
        polls.into_iter().min()
    }
}

impl std::fmt::Display for KVPoll {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            KVPoll::Failed => "Failed",
            KVPoll::Bootstrapping => "Bootstrapping",
            KVPoll::WaitingForInput => "WaitingForInput",
            KVPoll::Transferring => "Transferring",
            KVPoll::Success => "Success",
        };
        write!(f, "KVPoll.{name}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn poll() -> impl Strategy<Value = KVPoll> {
        proptest::sample::select(KVPoll::ALL.to_vec())
    }

    #[test]
    fn values_match_sglang() {
        assert_eq!(KVPoll::Failed.as_u8(), 0);
        assert_eq!(KVPoll::Success.as_u8(), 4);
        assert_eq!(KVPoll::from_i64(5), None);
        assert_eq!(KVPoll::create_unknown(KVPoll::Failed), None);
        assert_eq!(KVPoll::create_unknown(KVPoll::Success), None);
        assert_eq!(
            KVPoll::min_reduce([KVPoll::Success, KVPoll::WaitingForInput]),
            Some(KVPoll::WaitingForInput)
        );
    }

    proptest! {
        #[test]
        fn never_goes_down_and_failed_sticks(updates in proptest::collection::vec(poll(), 1..20)) {
            let mut s = updates[0];
            for &u in &updates[1..] {
                let next = s.update(u);
                if s == KVPoll::Failed {
                    prop_assert_eq!(next, KVPoll::Failed);
                } else if u != KVPoll::Failed {
                    prop_assert!(next >= s);
                }
                s = next;
            }
        }
    }
}
