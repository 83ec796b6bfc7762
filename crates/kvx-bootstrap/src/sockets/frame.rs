//! A received multipart message, kept in libzmq's own buffers (no copy after the receive).

use std::ops::Deref;

/// One received ZMQ frame.
pub struct Frame(pub(crate) zmq::Message);

impl Frame {
    /// The frame's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl AsRef<[u8]> for Frame {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Deref for Frame {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b = self.as_bytes();
        match std::str::from_utf8(b) {
            Ok(s) if s.len() <= 64 => write!(f, "{s:?}"),
            _ => write!(f, "<{} bytes>", b.len()),
        }
    }
}

/// A received multipart message: its frames in order. Pass [`Multipart::frames`] to the codec's
/// parsers (they take `&[impl AsRef<[u8]>]`).
#[derive(Debug)]
pub struct Multipart {
    frames: Vec<Frame>,
}

impl Multipart {
    pub(crate) fn new(frames: Vec<Frame>) -> Self {
        Multipart { frames }
    }

    /// The frames.
    pub fn frames(&self) -> &[Frame] {
        &self.frames
    }

    /// Copies the frames out (for tests and logs).
    pub fn to_vecs(&self) -> Vec<Vec<u8>> {
        self.frames.iter().map(|f| f.as_bytes().to_vec()).collect()
    }
}
