//! Process instances in endpoints: which process a session id was published by.
//!
//! A decode publishes its listener's endpoint as its session id, and a prefill may reach that
//! address long after it learned the id (metadata delayed in the network, an idle session
//! reopened). If the decode restarted on the same address in between, the new process's memory
//! sits where the old one's did, and writes for the old process's rooms would land in pages the
//! new process handed to other requests. So kvx's listeners name a fresh random instance in
//! their endpoint (`host:port#instance`, see [`kvx_core::peer::split_instance`]) and say it again
//! in every handshake; a sender dials the address part and refuses a peer whose handshake names
//! another instance ([`TransportError::PeerRestarted`]) before anything is written.

use std::hash::{BuildHasher, Hasher};

use kvx_core::peer::{INSTANCE_SEPARATOR, split_instance};

use crate::TransportError;

/// A fresh instance name: 16 hex digits, random per call (the standard library's OS-seeded
/// hasher keys, mixed with the process id and the time).
pub fn fresh() -> String {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    format!("{:016x}", h.finish())
}

/// `addr` naming `instance`.
pub fn name(addr: &str, instance: &str) -> String {
    format!("{addr}{INSTANCE_SEPARATOR}{instance}")
}

/// The address to dial for `peer` (its instance, if any, removed).
pub fn address(peer: &str) -> &str {
    split_instance(peer).0
}

/// Checks that the endpoint a peer's handshake announced (`announced`) is the instance `peer`
/// names. A `peer` naming no instance accepts any.
pub fn check(peer: &str, announced: &str) -> Result<(), TransportError> {
    let (_, wanted) = split_instance(peer);
    let (_, found) = split_instance(announced);
    match wanted {
        Some(w) if Some(w) != found => Err(TransportError::PeerRestarted {
            peer: peer.to_owned(),
            found: found.unwrap_or_default().to_owned(),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_instances_differ_and_round_trip() {
        let (a, b) = (fresh(), fresh());
        assert_ne!(a, b);
        assert_eq!(a.len(), 16);
        let id = name("127.0.0.1:9000", &a);
        assert_eq!(address(&id), "127.0.0.1:9000");
        assert_eq!(split_instance(&id).1, Some(a.as_str()));
    }

    #[test]
    fn check_refuses_another_instance_only() {
        let old = name("127.0.0.1:9000", "aaaa");
        let new = name("127.0.0.1:9000", "bbbb");
        assert!(check(&old, &old).is_ok());
        assert!(
            check("127.0.0.1:9000", &new).is_ok(),
            "an id naming none accepts any"
        );
        let e = check(&old, &new).unwrap_err();
        assert!(e.is_peer_failure());
        assert!(matches!(e, TransportError::PeerRestarted { ref found, .. } if found == "bbbb"));
        assert!(matches!(
            check(&old, "127.0.0.1:9000"),
            Err(TransportError::PeerRestarted { .. })
        ));
    }
}
