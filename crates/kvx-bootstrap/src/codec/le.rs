//! Little-endian integer arrays as sglang sends them (numpy `tobytes()` of i32 pages, `struct`
//! `Q`/`I` concatenations): no header, no alignment. [`LeSlice`] is a validated, borrowed view
//! over the frame bytes that decodes elements on the fly, so the hot metadata path copies nothing;
//! [`LeSlice::to_vec`] gives the owned form.

use std::fmt;
use std::iter::FusedIterator;
use std::marker::PhantomData;
use std::slice::ChunksExact;

use super::CodecError;

mod sealed {
    pub trait Sealed {}
    impl Sealed for i32 {}
    impl Sealed for u32 {}
    impl Sealed for u64 {}
}

/// An integer type that appears in little-endian arrays on the wire: `i32` (`i`), `u32` (`I`)
/// and `u64` (`Q`).
pub trait LeInt: Copy + fmt::Debug + PartialEq + sealed::Sealed + 'static {
    /// Width in bytes.
    const WIDTH: usize;
    /// Decodes one element from the first `WIDTH` bytes of `chunk` (0 if it is shorter, which
    /// callers rule out by construction).
    fn read_le(chunk: &[u8]) -> Self;
    /// Appends the little-endian bytes of `self`.
    fn write_le(self, out: &mut Vec<u8>);
    /// Decodes every whole element of `bytes` into `out` (a bulk form of [`LeInt::read_le`]).
    fn extend_from_le(bytes: &[u8], out: &mut Vec<Self>);
    /// Appends the little-endian bytes of every value (a bulk form of [`LeInt::write_le`]).
    fn extend_le(values: &[Self], out: &mut Vec<u8>);
}

macro_rules! le_int {
    ($t:ty, $w:literal) => {
        impl LeInt for $t {
            const WIDTH: usize = $w;
            #[inline]
            fn read_le(chunk: &[u8]) -> Self {
                chunk
                    .first_chunk::<$w>()
                    .map_or(0, |a| <$t>::from_le_bytes(*a))
            }
            #[inline]
            fn write_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn extend_from_le(bytes: &[u8], out: &mut Vec<Self>) {
                let (whole, _) = bytes.as_chunks::<$w>();
                out.extend(whole.iter().map(|a| <$t>::from_le_bytes(*a)));
            }
            fn extend_le(values: &[Self], out: &mut Vec<u8>) {
                let start = out.len();
                out.resize(start + values.len() * $w, 0);
                let (dst, _) = out[start..].as_chunks_mut::<$w>();
                for (d, v) in dst.iter_mut().zip(values) {
                    *d = v.to_le_bytes();
                }
            }
        }
    };
}
le_int!(i32, 4);
le_int!(u32, 4);
le_int!(u64, 8);

/// A borrowed little-endian array of `T` whose length has been checked to be a multiple of the
/// element width.
#[derive(Clone, Copy)]
pub struct LeSlice<'a, T> {
    bytes: &'a [u8],
    _t: PhantomData<T>,
}

impl<'a, T: LeInt> LeSlice<'a, T> {
    /// Validates `bytes` as an array of `T`.
    pub fn new(bytes: &'a [u8], field: &'static str) -> Result<Self, CodecError> {
        if !bytes.len().is_multiple_of(T::WIDTH) {
            return Err(CodecError::TruncatedArray {
                field,
                len: bytes.len(),
                width: T::WIDTH,
            });
        }
        Ok(LeSlice {
            bytes,
            _t: PhantomData,
        })
    }

    /// An empty array.
    pub fn empty() -> Self {
        LeSlice {
            bytes: &[],
            _t: PhantomData,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / T::WIDTH
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Element `i`, if in range.
    pub fn get(&self, i: usize) -> Option<T> {
        let start = i.checked_mul(T::WIDTH)?;
        let chunk = self.bytes.get(start..start.checked_add(T::WIDTH)?)?;
        Some(T::read_le(chunk))
    }

    /// The raw bytes (exactly what was on the wire).
    pub fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Iterates the elements in order.
    pub fn iter(&self) -> LeIter<'a, T> {
        LeIter {
            chunks: self.bytes.chunks_exact(T::WIDTH),
            _t: PhantomData,
        }
    }

    /// Copies the elements into a vector.
    pub fn to_vec(&self) -> Vec<T> {
        let mut out = Vec::with_capacity(self.len());
        T::extend_from_le(self.bytes, &mut out);
        out
    }
}

impl<T: LeInt> PartialEq for LeSlice<'_, T> {
    fn eq(&self, other: &Self) -> bool {
        self.bytes == other.bytes
    }
}

impl<T: LeInt> Eq for LeSlice<'_, T> {}

impl<T: LeInt> fmt::Debug for LeSlice<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<'a, T: LeInt> IntoIterator for LeSlice<'a, T> {
    type Item = T;
    type IntoIter = LeIter<'a, T>;
    fn into_iter(self) -> LeIter<'a, T> {
        self.iter()
    }
}

/// Iterator over a [`LeSlice`].
#[derive(Clone, Debug)]
pub struct LeIter<'a, T> {
    chunks: ChunksExact<'a, u8>,
    _t: PhantomData<T>,
}

impl<T: LeInt> Iterator for LeIter<'_, T> {
    type Item = T;
    #[inline]
    fn next(&mut self) -> Option<T> {
        self.chunks.next().map(T::read_le)
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        self.chunks.size_hint()
    }
}

impl<T: LeInt> DoubleEndedIterator for LeIter<'_, T> {
    fn next_back(&mut self) -> Option<T> {
        self.chunks.next_back().map(T::read_le)
    }
}

impl<T: LeInt> ExactSizeIterator for LeIter<'_, T> {}
impl<T: LeInt> FusedIterator for LeIter<'_, T> {}

/// Encodes integers as a headerless little-endian array.
pub fn encode_le<T: LeInt>(values: &[T]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * T::WIDTH);
    T::extend_le(values, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn reads_unaligned() {
        let mut buf = vec![0xAAu8];
        buf.extend_from_slice(&encode_le(&[5i32, -1, 12]));
        let view = LeSlice::<i32>::new(&buf[1..], "f").unwrap();
        assert_eq!(view.to_vec(), vec![5, -1, 12]);
        assert_eq!(view.get(1), Some(-1));
        assert_eq!(view.get(3), None);
        assert_eq!(view.iter().rev().collect::<Vec<_>>(), vec![12, -1, 5]);
        assert_eq!(
            LeSlice::<u64>::new(&buf[..7], "f").map_err(|e| e.kind()),
            Err("truncated_array")
        );
    }

    proptest! {
        #[test]
        fn round_trip_u64(v in proptest::collection::vec(any::<u64>(), 0..16)) {
            let bytes = encode_le(&v);
            prop_assert_eq!(LeSlice::<u64>::new(&bytes, "f").unwrap().to_vec(), v);
        }

        #[test]
        fn round_trip_i32(v in proptest::collection::vec(any::<i32>(), 0..16)) {
            let bytes = encode_le(&v);
            let view = LeSlice::<i32>::new(&bytes, "f").unwrap();
            prop_assert_eq!(view.len(), v.len());
            prop_assert_eq!(view.to_vec(), v);
        }
    }
}
