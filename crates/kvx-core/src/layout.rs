//! Memory layouts: where one rank keeps its KV pages, aux (metadata) rows and state components.
//!
//! A layout is the planner's view of a rank's registered memory: a list of buffers, each with a
//! base address, a per-item length (bytes per KV page, per aux row, per state slot) and, when
//! known, its total length. The local (prefill) side always knows its lengths; a decode publishes
//! only addresses, so remote lengths are optional and the transport's registered-region check is
//! the final guard there.
//!
//! KV buffer order follows sglang: MHA lists all K layers, then all V layers, then draft-model
//! buffers; MLA lists one buffer per layer, then draft buffers.

use crate::peer::DecodeRegistration;

/// One contiguous buffer that holds fixed-size items (KV pages, aux rows or state slots).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Buffer {
    /// Base address (a virtual address, as sglang publishes it).
    pub addr: u64,
    /// Bytes per item (per page for KV, per row for aux, per slot for state).
    pub item_len: u64,
    /// Total bytes, when known (always for local buffers; usually unknown for remote ones).
    pub len: Option<u64>,
}

impl Buffer {
    /// A buffer of `len` bytes at `addr` holding items of `item_len` bytes.
    pub const fn new(addr: u64, item_len: u64, len: u64) -> Self {
        Buffer {
            addr,
            item_len,
            len: Some(len),
        }
    }

    /// A remote buffer whose total length is not known.
    pub const fn remote(addr: u64, item_len: u64) -> Self {
        Buffer {
            addr,
            item_len,
            len: None,
        }
    }

    /// How many whole items fit, when the length is known.
    pub fn capacity_items(&self) -> Option<u64> {
        match (self.len, self.item_len) {
            (Some(_), 0) => Some(0),
            (Some(len), item) => Some(len / item),
            (None, _) => None,
        }
    }
}

/// How a model stores its KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// Multi-head (and GQA) attention: a K buffer and a V buffer per layer.
    Mha,
    /// Multi-head latent attention: one latent buffer per layer, replicated across TP ranks.
    Mla,
}

/// Why a layout is inconsistent.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// `page_size` is zero.
    #[error("page size is zero")]
    ZeroPageSize,
    /// A buffer has an item length of zero.
    #[error("buffer {0} has item length 0")]
    ZeroItemLen(usize),
    /// Fewer buffers than the layer count requires.
    #[error("{kind:?} layout with {layers} layers needs {needed} buffers, has {have}")]
    TooFewBuffers {
        /// Attention kind.
        kind: AttentionKind,
        /// Declared target layers.
        layers: usize,
        /// Buffers required.
        needed: usize,
        /// Buffers present.
        have: usize,
    },
    /// Layer ids were given but not one per buffer.
    #[error("{ids} layer ids for {buffers} buffers")]
    LayerIdCount {
        /// Ids given.
        ids: usize,
        /// Buffers present.
        buffers: usize,
    },
    /// A buffer's end address overflows u64.
    #[error("buffer {0} wraps around the address space")]
    Wraps(usize),
    /// Aux layout: buffer count and row-length count differ.
    #[error("{ptrs} aux pointers for {rows} row lengths")]
    AuxCount {
        /// Pointers given.
        ptrs: usize,
        /// Row lengths configured.
        rows: usize,
    },
    /// Aux layout: the bootstrap-room buffer index is out of range or its row is shorter than 8 bytes.
    #[error("aux bootstrap_room buffer {0} is missing or shorter than 8 bytes per row")]
    AuxRoomBuffer(usize),
    /// A state component index does not exist in a registration.
    #[error("state component {0} is not in the registration")]
    NoStateComponent(usize),
}

/// The KV buffers of one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// MHA or MLA.
    pub kind: AttentionKind,
    /// Target-model layers this rank holds (MHA: K and V buffers each; MLA: one buffer each).
    pub num_layers: usize,
    /// Global id of this rank's first layer (pipeline parallelism; 0 without PP).
    pub start_layer: usize,
    /// MHA: `K_0..K_{n-1}, V_0..V_{n-1}`, then drafts. MLA: `L_0..L_{n-1}`, then drafts.
    pub buffers: Vec<Buffer>,
    /// Global layer id per buffer; empty for plain pools (ids are then implied by position).
    pub layer_ids: Vec<u32>,
    /// Tokens per page.
    pub page_size: u32,
}

impl KvLayout {
    /// An MHA layout from per-layer K and V buffers (equal counts), no drafts, start layer 0.
    pub fn mha(k: Vec<Buffer>, v: Vec<Buffer>, page_size: u32) -> Self {
        let num_layers = k.len().min(v.len());
        let mut buffers = k;
        buffers.extend(v);
        KvLayout {
            kind: AttentionKind::Mha,
            num_layers,
            start_layer: 0,
            buffers,
            layer_ids: Vec::new(),
            page_size,
        }
    }

    /// An MLA layout with one buffer per layer, no drafts, start layer 0.
    pub fn mla(layers: Vec<Buffer>, page_size: u32) -> Self {
        KvLayout {
            kind: AttentionKind::Mla,
            num_layers: layers.len(),
            start_layer: 0,
            buffers: layers,
            layer_ids: Vec::new(),
            page_size,
        }
    }

    /// An MHA layout of `layers` K and V buffers laid out back to back from `base`, each holding
    /// `pages` pages of `item_len` bytes (handy for tests, benches and the local TCP backend).
    pub fn mha_contiguous(
        base: u64,
        layers: usize,
        item_len: u64,
        pages: u64,
        page_size: u32,
    ) -> Self {
        let size = item_len * pages;
        let buf = |i: usize| Buffer::new(base + size * i as u64, item_len, size);
        KvLayout::mha(
            (0..layers).map(buf).collect(),
            (layers..2 * layers).map(buf).collect(),
            page_size,
        )
    }

    /// The decode's KV layout as its registration describes it: every buffer gets the published
    /// `dst_kv_item_len`, lengths are unknown. `num_layers` defaults to "all buffers are target
    /// layers" (MHA: half of them).
    pub fn from_registration(
        reg: &DecodeRegistration,
        kind: AttentionKind,
        num_layers: Option<usize>,
        page_size: u32,
    ) -> Self {
        let buffers: Vec<Buffer> = reg
            .kv_ptrs
            .iter()
            .map(|&p| Buffer::remote(p, reg.dst_kv_item_len))
            .collect();
        let default_layers = match kind {
            AttentionKind::Mha => buffers.len() / 2,
            AttentionKind::Mla => buffers.len(),
        };
        KvLayout {
            kind,
            num_layers: num_layers.unwrap_or(default_layers),
            start_layer: 0,
            buffers,
            layer_ids: reg.kv_layer_ids.clone(),
            page_size,
        }
    }

    /// Sets the first global layer (pipeline parallelism).
    #[must_use]
    pub fn with_start_layer(mut self, start_layer: usize) -> Self {
        self.start_layer = start_layer;
        self
    }

    /// Sets explicit global layer ids (one per buffer).
    #[must_use]
    pub fn with_layer_ids(mut self, ids: Vec<u32>) -> Self {
        self.layer_ids = ids;
        self
    }

    /// Appends draft-model buffers after the target layers.
    #[must_use]
    pub fn with_drafts(mut self, drafts: Vec<Buffer>) -> Self {
        self.buffers.extend(drafts);
        self
    }

    /// Buffers that belong to the target model (`2·n` for MHA, `n` for MLA).
    pub fn target_buffers(&self) -> usize {
        match self.kind {
            AttentionKind::Mha => 2 * self.num_layers,
            AttentionKind::Mla => self.num_layers,
        }
    }

    /// The draft-model buffers (after the target layers).
    pub fn drafts(&self) -> &[Buffer] {
        self.buffers.get(self.target_buffers()..).unwrap_or(&[])
    }

    /// Bytes per page of the first buffer (sglang's `kv_item_lens[0]`), 0 without KV.
    pub fn item_len(&self) -> u64 {
        self.buffers.first().map_or(0, |b| b.item_len)
    }

    /// Checks the layout for internal consistency.
    pub fn validate(&self) -> Result<(), LayoutError> {
        if self.page_size == 0 {
            return Err(LayoutError::ZeroPageSize);
        }
        let needed = self.target_buffers();
        if self.buffers.len() < needed {
            return Err(LayoutError::TooFewBuffers {
                kind: self.kind,
                layers: self.num_layers,
                needed,
                have: self.buffers.len(),
            });
        }
        if !self.layer_ids.is_empty() && self.layer_ids.len() != self.buffers.len() {
            return Err(LayoutError::LayerIdCount {
                ids: self.layer_ids.len(),
                buffers: self.buffers.len(),
            });
        }
        for (i, b) in self.buffers.iter().enumerate() {
            if b.item_len == 0 {
                return Err(LayoutError::ZeroItemLen(i));
            }
            if b.addr.checked_add(b.len.unwrap_or(0)).is_none() {
                return Err(LayoutError::Wraps(i));
            }
        }
        Ok(())
    }
}

/// sglang's default aux row lengths (no speculative decoding, sampling mask off, no DSA), in
/// buffer order: output_ids, cached_tokens, logprob val/idx, top-logprobs val/idx, topk p/index,
/// hidden states, bootstrap_room.
pub const SGLANG_DEFAULT_AUX_ROW_LENS: [u64; 10] = [64, 64, 64, 64, 512, 512, 64, 128, 64, 64];

/// Index of the `bootstrap_room` buffer in sglang's default aux layout.
pub const SGLANG_DEFAULT_AUX_ROOM_INDEX: usize = 9;

/// The aux (metadata) buffers of one rank: one row per in-flight request in each buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuxLayout {
    /// One buffer per metadata field; `item_len` is the row length.
    pub buffers: Vec<Buffer>,
    /// Which buffer is `bootstrap_room` (row\[0\] = room as u64 LE).
    pub room_index: usize,
}

impl AuxLayout {
    /// A layout from pointers and row lengths; `rows` is the row count per buffer when known.
    pub fn new(
        ptrs: &[u64],
        row_lens: &[u64],
        room_index: usize,
        rows: Option<u64>,
    ) -> Result<Self, LayoutError> {
        if ptrs.len() != row_lens.len() {
            return Err(LayoutError::AuxCount {
                ptrs: ptrs.len(),
                rows: row_lens.len(),
            });
        }
        let buffers = ptrs
            .iter()
            .zip(row_lens)
            .enumerate()
            .map(|(i, (&addr, &item_len))| {
                let len = match rows {
                    Some(r) => Some(r.checked_mul(item_len).ok_or(LayoutError::Wraps(i))?),
                    None => None,
                };
                Ok(Buffer {
                    addr,
                    item_len,
                    len,
                })
            })
            .collect::<Result<Vec<Buffer>, LayoutError>>()?;
        match buffers.get(room_index) {
            Some(b) if b.item_len >= 8 => {}
            _ => return Err(LayoutError::AuxRoomBuffer(room_index)),
        }
        for (i, b) in buffers.iter().enumerate() {
            if b.item_len == 0 {
                return Err(LayoutError::ZeroItemLen(i));
            }
            if b.addr.checked_add(b.len.unwrap_or(0)).is_none() {
                return Err(LayoutError::Wraps(i));
            }
        }
        Ok(AuxLayout {
            buffers,
            room_index,
        })
    }

    /// sglang's default layout (10 buffers, [`SGLANG_DEFAULT_AUX_ROW_LENS`], room at index 9).
    pub fn sglang_default(ptrs: &[u64], rows: Option<u64>) -> Result<Self, LayoutError> {
        Self::new(
            ptrs,
            &SGLANG_DEFAULT_AUX_ROW_LENS,
            SGLANG_DEFAULT_AUX_ROOM_INDEX,
            rows,
        )
    }

    /// The row lengths, in buffer order.
    pub fn row_lens(&self) -> Vec<u64> {
        self.buffers.iter().map(|b| b.item_len).collect()
    }

    /// Address and length of the `bootstrap_room` row `row`, where the room id must be written
    /// (see [`fill_room_row`]) before the aux rows are sent. `None` if the row is out of range.
    pub fn room_row(&self, row: u64) -> Option<(u64, u64)> {
        let b = self.buffers.get(self.room_index)?;
        if b.capacity_items().is_some_and(|cap| row >= cap) {
            return None;
        }
        let addr = b.addr.checked_add(row.checked_mul(b.item_len)?)?;
        Some((addr, b.item_len))
    }
}

/// Writes `room` as u64 little-endian into the first 8 bytes of a `bootstrap_room` row and zeroes
/// the rest of the row. Returns false (writing nothing) if the row is shorter than 8 bytes.
pub fn fill_room_row(row: &mut [u8], room: crate::Room) -> bool {
    let Some((head, tail)) = row.split_first_chunk_mut::<8>() else {
        return false;
    };
    *head = room.get().to_le_bytes();
    tail.fill(0);
    true
}

/// How a state component is indexed (sglang's `StateType` families).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StateKind {
    /// One slot per request (MAMBA): exactly one index per side.
    Slot,
    /// Page-indexed like KV (SWA, DSA, …); unequal index lists are truncated to the shorter.
    Paged,
    /// Page-indexed, lists must match exactly (SWA ring, C128 state).
    PagedExact,
}

/// One state component: its kind, buffers (one per tensor/layer) and optional layer ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateComponent {
    /// Indexing family.
    pub kind: StateKind,
    /// One buffer per tensor/layer entry.
    pub buffers: Vec<Buffer>,
    /// Layer id per buffer; empty when entries pair by position.
    pub layer_ids: Vec<u32>,
}

impl StateComponent {
    /// A component from buffers, no layer ids.
    pub fn new(kind: StateKind, buffers: Vec<Buffer>) -> Self {
        StateComponent {
            kind,
            buffers,
            layer_ids: Vec::new(),
        }
    }

    /// The decode's component `index` as its registration describes it (`state_ptrs[index]`,
    /// `state_item_lens[index]`, `state_layer_ids[index]`); `kind` is the local component's kind.
    /// Missing item lengths are read as 0 (the planner uses the prefill's item lengths anyway).
    pub fn from_registration(
        reg: &DecodeRegistration,
        index: usize,
        kind: StateKind,
    ) -> Result<Self, LayoutError> {
        let ptrs = reg
            .state_ptrs
            .get(index)
            .ok_or(LayoutError::NoStateComponent(index))?;
        let lens = reg.state_item_lens.get(index);
        let buffers = ptrs
            .iter()
            .enumerate()
            .map(|(i, &p)| {
                let item = lens.and_then(|l| l.get(i)).copied().unwrap_or(0);
                Buffer::remote(p, u64::from(item))
            })
            .collect();
        Ok(StateComponent {
            kind,
            buffers,
            layer_ids: reg.state_layer_ids.get(index).cloned().unwrap_or_default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Room;

    #[test]
    fn mha_layout_order_and_validation() {
        let l = KvLayout::mha_contiguous(0x1000, 2, 2048, 64, 1);
        assert_eq!(l.buffers.len(), 4);
        assert_eq!(l.buffers[2].addr, 0x1000 + 2 * 2048 * 64);
        assert!(l.validate().is_ok());
        assert!(l.drafts().is_empty());
        let bad = l.clone().with_layer_ids(vec![0, 1]);
        assert_eq!(
            bad.validate(),
            Err(LayoutError::LayerIdCount { ids: 2, buffers: 4 })
        );
        let mut short = l;
        short.num_layers = 3;
        assert!(matches!(
            short.validate(),
            Err(LayoutError::TooFewBuffers { .. })
        ));
    }

    #[test]
    fn aux_default_and_room_row() {
        let ptrs: Vec<u64> = (0..10).map(|i| 0x10_0000 * (i + 1)).collect();
        let aux = AuxLayout::sglang_default(&ptrs, Some(4)).unwrap();
        assert_eq!(aux.row_lens()[4], 512);
        assert_eq!(aux.room_row(3), Some((0xa0_0000 + 3 * 64, 64)));
        assert_eq!(aux.room_row(4), None);
        assert!(AuxLayout::sglang_default(&ptrs[..9], None).is_err());
        // rows × row length beyond u64 is an error, not an overflow
        assert_eq!(
            AuxLayout::sglang_default(&ptrs, Some(u64::MAX / 64 + 1)),
            Err(LayoutError::Wraps(0))
        );
        let mut row = [0xffu8; 64];
        assert!(fill_room_row(
            &mut row,
            Room::new(0x0102_0304_0506_0708).unwrap()
        ));
        assert_eq!(&row[..8], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert!(row[8..].iter().all(|&b| b == 0));
        assert!(!fill_room_row(&mut [0u8; 7], Room::new(1).unwrap()));
    }
}
