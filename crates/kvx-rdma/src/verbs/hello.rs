//! The queue-pair handshake on the wire: the tcp backend's hello carrying a verbs payload.
//!
//! Each side sends the `tcp` backend's 16-byte hello (`docs/tcp-transport.md`, [`Hello`]) and,
//! where the tcp backend puts its segment descriptor, one [`VerbsHandshake`]. The client sets
//! bit 0 ([`HELLO_FLAG_VERBS`]) of the hello's flags; the server answers with status
//! `HELLO_OK`. A tcp listener refuses such a hello (its payload is not a descriptor) and a verbs
//! listener refuses a plain tcp hello, so the two never mistake each other.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::error::VerbsError;
use super::handshake::VerbsHandshake;
use crate::tcp::wire::{HELLO_LEN, HELLO_OK, Hello, VERSION as TCP_VERSION};

/// Flag bit in the client hello's flags field (`status` of [`Hello`]) that marks a verbs
/// handshake: the payload after the hello is a [`VerbsHandshake`], not a segment descriptor.
pub const HELLO_FLAG_VERBS: u16 = 0x1;

/// Writes the tcp backend's 16-byte hello followed by the verbs payload. A client sets
/// [`HELLO_FLAG_VERBS`] in the flags; a server answers with status `HELLO_OK`.
pub async fn send_handshake<W: AsyncWriteExt + Unpin>(
    w: &mut W,
    h: &VerbsHandshake,
    as_server: bool,
) -> Result<(), VerbsError> {
    let payload = h.encode();
    let hello = Hello {
        version: TCP_VERSION,
        status: if as_server {
            HELLO_OK
        } else {
            HELLO_FLAG_VERBS
        },
        param: 0,
        desc_len: payload.len() as u32,
    };
    let mut frame = Vec::with_capacity(HELLO_LEN + payload.len());
    frame.extend_from_slice(&hello.encode());
    frame.extend_from_slice(&payload);
    w.write_all(&frame)
        .await
        .map_err(|e| VerbsError::Handshake(format!("send: {e}")))
}

/// Reads a hello and its verbs payload. From a client the verbs flag must be set; from a server
/// the status must be `HELLO_OK`. Payload lengths above the hello's limit are refused unread.
pub async fn recv_handshake<R: AsyncReadExt + Unpin>(
    r: &mut R,
    from_server: bool,
) -> Result<VerbsHandshake, VerbsError> {
    let mut fixed = [0u8; HELLO_LEN];
    r.read_exact(&mut fixed)
        .await
        .map_err(|e| VerbsError::Handshake(format!("receive: {e}")))?;
    let hello = Hello::decode(&fixed).map_err(|e| VerbsError::Handshake(e.to_string()))?;
    if hello.version < TCP_VERSION {
        return Err(VerbsError::Handshake(format!(
            "unsupported hello version {}",
            hello.version
        )));
    }
    if from_server && hello.status != HELLO_OK {
        return Err(VerbsError::Handshake(format!(
            "peer refused the handshake (status {})",
            hello.status
        )));
    }
    if !from_server && hello.status & HELLO_FLAG_VERBS == 0 {
        return Err(VerbsError::Handshake(
            "hello without the verbs flag (a tcp client?)".into(),
        ));
    }
    let mut buf = vec![0u8; hello.desc_len as usize];
    r.read_exact(&mut buf)
        .await
        .map_err(|e| VerbsError::Handshake(format!("receive: {e}")))?;
    VerbsHandshake::decode(&buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::handshake::QpInfo;
    use crate::verbs::regions::{Region, RegionTable};
    use tokio::net::{TcpListener, TcpStream};

    fn sample() -> VerbsHandshake {
        VerbsHandshake {
            lid: 3,
            gid: [1; 16],
            mtu: 3,
            qps: vec![QpInfo { qpn: 9, psn: 10 }],
            regions: RegionTable::from_regions(vec![Region {
                base: 4096,
                len: 4096,
                key: 5,
            }])
            .unwrap(),
        }
    }

    #[tokio::test]
    async fn framed_handshake_over_a_socket() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let got = recv_handshake(&mut s, false).await.unwrap();
            send_handshake(&mut s, &got, true).await.unwrap();
            got
        });
        let mut c = TcpStream::connect(addr).await.unwrap();
        send_handshake(&mut c, &sample(), false).await.unwrap();
        assert_eq!(recv_handshake(&mut c, true).await.unwrap(), sample());
        assert_eq!(server.await.unwrap(), sample());
    }

    fn hello(status: u16, desc_len: u32) -> Vec<u8> {
        Hello {
            version: TCP_VERSION,
            status,
            param: 0,
            desc_len,
        }
        .encode()
        .to_vec()
    }

    #[tokio::test]
    async fn bad_hellos_are_refused() {
        // oversized payload: refused from the length alone
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&hello(HELLO_FLAG_VERBS, u32::MAX))
            .await
            .unwrap();
        assert!(matches!(
            recv_handshake(&mut b, false).await,
            Err(VerbsError::Handshake(_))
        ));
        // truncated payload
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&hello(HELLO_FLAG_VERBS, 100)).await.unwrap();
        a.write_all(&[0u8; 10]).await.unwrap();
        drop(a);
        assert!(matches!(
            recv_handshake(&mut b, false).await,
            Err(VerbsError::Handshake(_))
        ));
        // a plain tcp client (no verbs flag)
        let (mut a, mut b) = tokio::io::duplex(1024);
        let payload = sample().encode();
        a.write_all(&hello(0, payload.len() as u32)).await.unwrap();
        a.write_all(&payload).await.unwrap();
        assert!(matches!(
            recv_handshake(&mut b, false).await,
            Err(VerbsError::Handshake(_))
        ));
        // a server that refused
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&hello(1, 0)).await.unwrap();
        assert!(matches!(
            recv_handshake(&mut b, true).await,
            Err(VerbsError::Handshake(_))
        ));
        // bad magic
        let (mut a, mut b) = tokio::io::duplex(1024);
        let mut h = hello(HELLO_FLAG_VERBS, 0);
        h[0] = b'X';
        a.write_all(&h).await.unwrap();
        assert!(matches!(
            recv_handshake(&mut b, false).await,
            Err(VerbsError::Handshake(_))
        ));
    }

    proptest::proptest! {
        /// Whatever a peer sends, reading its hello ends in a value or a typed error.
        #[test]
        fn recv_handshake_never_panics(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            from_server in proptest::prelude::any::<bool>(),
            valid_prefix in proptest::prelude::any::<bool>(),
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            rt.block_on(async {
                let (mut a, mut b) = tokio::io::duplex(4096);
                if valid_prefix {
                    let flags = if from_server { HELLO_OK } else { HELLO_FLAG_VERBS };
                    a.write_all(&hello(flags, bytes.len() as u32)).await.unwrap();
                }
                a.write_all(&bytes).await.unwrap();
                drop(a);
                let _ = recv_handshake(&mut b, from_server).await;
            });
        }
    }
}
