//! sglang's packed-int-lists encoding (spec §3, `CU:37-67`) for list-of-lists fields (state
//! pointers, item lengths, layer ids, state indices): `u32 n`, then `n` × `u32 byte_len`, then the
//! payloads back to back, all little-endian. An empty outer list is zero bytes; `[[]]` is
//! `01 00 00 00 00 00 00 00`. [`PackedLists`] validates the whole layout once and then hands out
//! borrowed [`LeSlice`]s; [`encode_packed`] writes the format.

use std::fmt;

use super::le::{LeInt, LeSlice};
use super::{CodecError, PackedError};

/// A validated, borrowed packed-int-lists field.
#[derive(Clone, Copy)]
pub struct PackedLists<'a, T> {
    /// The `n` little-endian u32 byte lengths.
    lens: LeSlice<'a, u32>,
    /// All payloads back to back.
    payload: &'a [u8],
    _t: std::marker::PhantomData<T>,
}

impl<'a, T: LeInt> PackedLists<'a, T> {
    /// Validates `bytes`. Empty input is the empty outer list.
    pub fn parse(bytes: &'a [u8], field: &'static str) -> Result<Self, CodecError> {
        let err = |reason| CodecError::Packed { field, reason };
        if bytes.is_empty() {
            return Ok(Self::empty());
        }
        let (head, rest) = bytes
            .split_first_chunk::<4>()
            .ok_or(err(PackedError::HeaderTruncated))?;
        let count = u32::from_le_bytes(*head);
        let table_len = (count as usize)
            .checked_mul(4)
            .filter(|&l| l <= rest.len())
            .ok_or(err(PackedError::LengthsTruncated { count }))?;
        let (table, payload) = rest.split_at(table_len);
        let lens = LeSlice::<u32>::new(table, field)?;
        let mut needed: u64 = 0;
        for (index, len) in (0u32..).zip(lens.iter()) {
            if !(len as usize).is_multiple_of(T::WIDTH) {
                return Err(err(PackedError::Misaligned {
                    index,
                    len,
                    width: T::WIDTH,
                }));
            }
            needed += u64::from(len);
        }
        let available = payload.len() as u64;
        if needed > available {
            return Err(err(PackedError::PayloadTruncated { needed, available }));
        }
        if needed < available {
            return Err(err(PackedError::Trailing {
                extra: available - needed,
            }));
        }
        Ok(PackedLists {
            lens,
            payload,
            _t: std::marker::PhantomData,
        })
    }

    /// The empty outer list.
    pub fn empty() -> Self {
        PackedLists {
            lens: LeSlice::empty(),
            payload: &[],
            _t: std::marker::PhantomData,
        }
    }

    /// Number of inner lists.
    pub fn len(&self) -> usize {
        self.lens.len()
    }

    /// True when the outer list is empty.
    pub fn is_empty(&self) -> bool {
        self.lens.is_empty()
    }

    /// Iterates the inner lists.
    pub fn iter(&self) -> PackedIter<'a, T> {
        PackedIter {
            lens: self.lens.iter(),
            rest: self.payload,
            _t: std::marker::PhantomData,
        }
    }

    /// Copies into owned vectors.
    pub fn to_vecs(&self) -> Vec<Vec<T>> {
        self.iter().map(|l| l.to_vec()).collect()
    }
}

impl<T: LeInt> PartialEq for PackedLists<'_, T> {
    fn eq(&self, other: &Self) -> bool {
        self.lens == other.lens && self.payload == other.payload
    }
}

impl<T: LeInt> Eq for PackedLists<'_, T> {}

impl<T: LeInt> fmt::Debug for PackedLists<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// Iterator over the inner lists of a [`PackedLists`].
#[derive(Clone, Debug)]
pub struct PackedIter<'a, T> {
    lens: super::le::LeIter<'a, u32>,
    rest: &'a [u8],
    _t: std::marker::PhantomData<T>,
}

impl<'a, T: LeInt> Iterator for PackedIter<'a, T> {
    type Item = LeSlice<'a, T>;
    fn next(&mut self) -> Option<LeSlice<'a, T>> {
        let len = self.lens.next()? as usize;
        // Validated in `parse`: lengths sum to the payload and are multiples of the width.
        let (head, tail) = self.rest.split_at_checked(len)?;
        self.rest = tail;
        LeSlice::new(head, "packed").ok()
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        self.lens.size_hint()
    }
}

/// Encodes lists in the packed-int-lists format. Fails only when a count or a list's byte
/// length does not fit in a u32.
pub fn encode_packed<T: LeInt, L: AsRef<[T]>>(
    lists: &[L],
    field: &'static str,
) -> Result<Vec<u8>, CodecError> {
    if lists.is_empty() {
        return Ok(Vec::new());
    }
    let oversized = |len: usize| CodecError::Oversized {
        field,
        len,
        max: u32::MAX as usize,
    };
    let total: usize = lists.iter().map(|l| l.as_ref().len() * T::WIDTH).sum();
    let mut out = Vec::with_capacity(4 + 4 * lists.len() + total);
    let count = u32::try_from(lists.len()).map_err(|_| oversized(lists.len()))?;
    out.extend_from_slice(&count.to_le_bytes());
    for l in lists {
        let bytes = l.as_ref().len() * T::WIDTH;
        let len = u32::try_from(bytes).map_err(|_| oversized(bytes))?;
        out.extend_from_slice(&len.to_le_bytes());
    }
    for l in lists {
        T::extend_le(l.as_ref(), &mut out);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn spec_examples() {
        let none: [Vec<u64>; 0] = [];
        assert_eq!(encode_packed(&none, "f").unwrap(), Vec::<u8>::new());
        let one_empty: [Vec<u64>; 1] = [vec![]];
        assert_eq!(
            encode_packed(&one_empty, "f").unwrap(),
            vec![1, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(
            encode_packed(&[vec![42i32]], "f").unwrap(),
            vec![1, 0, 0, 0, 4, 0, 0, 0, 42, 0, 0, 0]
        );
        assert!(PackedLists::<u64>::parse(&[], "f").unwrap().is_empty());
        let p = PackedLists::<u64>::parse(&[1, 0, 0, 0, 0, 0, 0, 0], "f").unwrap();
        assert_eq!(p.to_vecs(), vec![Vec::<u64>::new()]);
    }

    #[test]
    fn malformed() {
        let kind = |b: &[u8]| {
            PackedLists::<u32>::parse(b, "f")
                .map(|p| p.to_vecs())
                .map_err(|e| match e {
                    CodecError::Packed { reason, .. } => reason,
                    other => panic!("unexpected {other:?}"),
                })
        };
        assert_eq!(kind(&[1, 0]), Err(PackedError::HeaderTruncated));
        assert_eq!(
            kind(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]),
            Err(PackedError::LengthsTruncated { count: u32::MAX })
        );
        assert_eq!(
            kind(&[1, 0, 0, 0, 8, 0, 0, 0, 1, 0, 0, 0]),
            Err(PackedError::PayloadTruncated {
                needed: 8,
                available: 4
            })
        );
        assert_eq!(
            kind(&[1, 0, 0, 0, 3, 0, 0, 0, 1, 0, 0]),
            Err(PackedError::Misaligned {
                index: 0,
                len: 3,
                width: 4
            })
        );
        assert_eq!(
            kind(&[1, 0, 0, 0, 0, 0, 0, 0, 9]),
            Err(PackedError::Trailing { extra: 1 })
        );
        assert_eq!(kind(&[0, 0, 0, 0]), Ok(vec![]));
    }

    proptest! {
        #[test]
        fn round_trip_i32(lists in proptest::collection::vec(proptest::collection::vec(any::<i32>(), 0..6), 0..5)) {
            let bytes = encode_packed(&lists, "f").unwrap();
            prop_assert_eq!(PackedLists::<i32>::parse(&bytes, "f").unwrap().to_vecs(), lists);
        }

        #[test]
        fn round_trip_u64(lists in proptest::collection::vec(proptest::collection::vec(any::<u64>(), 0..6), 0..5)) {
            let bytes = encode_packed(&lists, "f").unwrap();
            let p = PackedLists::<u64>::parse(&bytes, "f").unwrap();
            prop_assert_eq!(p.len(), lists.len());
            prop_assert_eq!(p.to_vecs(), lists);
        }

        #[test]
        fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(p) = PackedLists::<u64>::parse(&bytes, "f") {
                let total: usize = p.iter().map(|l| l.len()).sum();
                prop_assert!(total * 8 <= bytes.len());
            }
        }
    }
}
