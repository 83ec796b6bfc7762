//! Byte-exact memories of the simulated ranks and the content pattern that makes transfers
//! checkable.
//!
//! Every rank holds an MHA KV pool (`LAYERS` K and `LAYERS` V buffers of `pages` pages) and ten
//! aux buffers (the bootstrap-room row at index 9) at synthetic addresses. A KV byte's expected
//! value is a function of (room, buffer, global token, global head, byte), so a decode can check a
//! room byte for byte whatever the two TP sizes are; an aux byte is a function of (room, buffer,
//! byte), and the room row holds the room id (u64 LE) written by the prefill's `FillRoomRow`.
//! Seeds with a state component also hold two state tensors with one slot per room (a room's
//! slot index is its aux row), a state byte a function of (room, tensor, TP rank, byte).

use kvx_core::layout::AuxLayout;
use kvx_core::layout::{StateComponent, StateKind};
use kvx_core::{Buffer, KvLayout, Room};

use crate::rng::mix;

/// Target-model layers (MHA: K and V buffer each).
pub const LAYERS: usize = 2;
/// KV buffers per rank.
pub const KV_BUFFERS: usize = 2 * LAYERS;
/// Tokens per page.
pub const PAGE_SIZE: u32 = 2;
/// Total KV heads of the model (every TP size divides it).
pub const TOTAL_HEADS: u32 = 4;
/// Bytes per head per token.
pub const HEAD_BYTES: u64 = 2;
/// Aux row lengths (sglang's ten buffers, shrunk); index 9 is the room row.
pub const AUX_ROW_LENS: [u64; 10] = [8, 8, 8, 8, 16, 16, 8, 8, 8, 8];
/// The bootstrap-room aux buffer.
pub const ROOM_INDEX: usize = 9;
/// Tensors of the one state component (a MAMBA-like slot per room).
pub const STATE_BUFFERS: usize = 2;
/// Bytes of one state slot of one tensor.
pub const STATE_ITEM: u64 = 12;

/// Bytes per KV page on a rank of attention-TP size `tp`.
pub fn item_len(tp: u32) -> u64 {
    u64::from(PAGE_SIZE) * u64::from(TOTAL_HEADS / tp) * HEAD_BYTES
}

/// Expected value of one KV byte.
pub fn kv_byte(room: Room, buf: usize, token: u64, head: u64, byte: u64) -> u8 {
    (mix(&[room.get(), buf as u64, token, head, byte]) >> 17) as u8
}

/// Expected value of one aux byte.
pub fn aux_byte(room: Room, buf: usize, byte: u64) -> u8 {
    (mix(&[room.get(), 0xa0 + buf as u64, byte]) >> 23) as u8
}

/// Expected value of one state byte of TP rank `tp_rank` (the state is sharded by TP rank, so
/// a slot landing on another rank's decode is seen).
pub fn state_byte(room: Room, buf: usize, tp_rank: u32, byte: u64) -> u8 {
    (mix(&[room.get(), 0xb0 + buf as u64, u64::from(tp_rank), byte]) >> 29) as u8
}

/// Where an address falls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loc {
    /// KV buffer `buf`, byte offset `off`.
    Kv {
        /// Buffer index.
        buf: usize,
        /// Offset in the buffer.
        off: u64,
    },
    /// Aux buffer `buf`, byte offset `off`.
    Aux {
        /// Buffer index.
        buf: usize,
        /// Offset in the buffer.
        off: u64,
    },
    /// State tensor `buf`, byte offset `off`.
    State {
        /// Tensor index.
        buf: usize,
        /// Offset in the buffer.
        off: u64,
    },
}

/// The registered memory of one rank.
#[derive(Clone, Debug)]
pub struct RankMemory {
    kv_base: u64,
    aux_base: u64,
    /// Attention-TP size of the rank.
    pub tp: u32,
    /// Attention-TP rank.
    pub tp_rank: u32,
    /// Pages per KV buffer.
    pub pages: u64,
    /// Rows per aux buffer.
    pub rows: u64,
    kv: Vec<Vec<u8>>,
    aux: Vec<Vec<u8>>,
    state: Vec<Vec<u8>>,
}

const AUX_STRIDE: u64 = 0x1_0000;
const STATE_OFFSET: u64 = 0x4000_0000;

impl RankMemory {
    /// Zeroed memory at `base` for a rank of TP size `tp`.
    pub fn new(base: u64, tp: u32, tp_rank: u32, pages: u64, rows: u64) -> Self {
        let il = item_len(tp);
        RankMemory {
            kv_base: base,
            aux_base: base + 0x8000_0000,
            tp,
            tp_rank,
            pages,
            rows,
            kv: vec![vec![0; (il * pages) as usize]; KV_BUFFERS],
            aux: AUX_ROW_LENS
                .iter()
                .map(|&l| vec![0; (l * rows) as usize])
                .collect(),
            state: vec![vec![0; (STATE_ITEM * rows) as usize]; STATE_BUFFERS],
        }
    }

    /// Zeroes everything (a restarted process).
    pub fn wipe(&mut self) {
        self.kv
            .iter_mut()
            .chain(self.aux.iter_mut())
            .chain(self.state.iter_mut())
            .for_each(|b| b.fill(0));
    }

    /// Bytes per page.
    pub fn item_len(&self) -> u64 {
        item_len(self.tp)
    }

    /// Address of KV buffer `buf`.
    pub fn kv_addr(&self, buf: usize) -> u64 {
        self.kv_base + buf as u64 * self.item_len() * self.pages
    }

    /// Address of aux buffer `buf`.
    pub fn aux_addr(&self, buf: usize) -> u64 {
        self.aux_base + buf as u64 * AUX_STRIDE
    }

    /// Every KV buffer's address.
    pub fn kv_ptrs(&self) -> Vec<u64> {
        (0..KV_BUFFERS).map(|b| self.kv_addr(b)).collect()
    }

    /// Address of state tensor `buf` (one slot per aux row: a room's slot is its row).
    pub fn state_addr(&self, buf: usize) -> u64 {
        self.kv_base + STATE_OFFSET + buf as u64 * AUX_STRIDE
    }

    /// Every state tensor's address.
    pub fn state_ptrs(&self) -> Vec<u64> {
        (0..STATE_BUFFERS).map(|b| self.state_addr(b)).collect()
    }

    /// The state component the planner sees (a slot per room, like MAMBA's).
    pub fn state_component(&self) -> StateComponent {
        let buf = |b| Buffer::new(self.state_addr(b), STATE_ITEM, STATE_ITEM * self.rows);
        StateComponent::new(StateKind::Slot, (0..STATE_BUFFERS).map(buf).collect())
    }

    /// Every aux buffer's address.
    pub fn aux_ptrs(&self) -> Vec<u64> {
        (0..AUX_ROW_LENS.len()).map(|b| self.aux_addr(b)).collect()
    }

    /// The KV layout the planner sees (local lengths known).
    pub fn kv_layout(&self) -> KvLayout {
        let il = self.item_len();
        let buf = |b: usize| Buffer::new(self.kv_addr(b), il, il * self.pages);
        KvLayout::mha(
            (0..LAYERS).map(buf).collect(),
            (LAYERS..KV_BUFFERS).map(buf).collect(),
            PAGE_SIZE,
        )
    }

    /// The aux layout the planner sees.
    pub fn aux_layout(&self) -> AuxLayout {
        AuxLayout::new(&self.aux_ptrs(), &AUX_ROW_LENS, ROOM_INDEX, Some(self.rows))
            .expect("the simulated aux layout is valid")
    }

    /// Where `[addr, addr+len)` lies, when it is inside one buffer.
    pub fn locate(&self, addr: u64, len: u64) -> Option<Loc> {
        let kv_len = self.item_len() * self.pages;
        if addr >= self.kv_base && addr < self.kv_base + kv_len * KV_BUFFERS as u64 {
            let rel = addr - self.kv_base;
            let (buf, off) = ((rel / kv_len) as usize, rel % kv_len);
            return (off + len <= kv_len).then_some(Loc::Kv { buf, off });
        }
        let state = self.kv_base + STATE_OFFSET;
        if addr >= state && addr < state + STATE_BUFFERS as u64 * AUX_STRIDE {
            let rel = addr - state;
            let (buf, off) = ((rel / AUX_STRIDE) as usize, rel % AUX_STRIDE);
            return (off + len <= STATE_ITEM * self.rows).then_some(Loc::State { buf, off });
        }
        if addr >= self.aux_base {
            let rel = addr - self.aux_base;
            let (buf, off) = ((rel / AUX_STRIDE) as usize, rel % AUX_STRIDE);
            let cap = AUX_ROW_LENS.get(buf)? * self.rows;
            return (off + len <= cap).then_some(Loc::Aux { buf, off });
        }
        None
    }

    /// The KV buffers (`[K layers…, V layers…]`), as staging's gather and scatter take them.
    pub fn kv_bufs(&self) -> &[Vec<u8>] {
        &self.kv
    }

    /// The KV buffers, mutable (a decode's scatter).
    pub fn kv_bufs_mut(&mut self) -> &mut [Vec<u8>] {
        &mut self.kv
    }

    /// True when `len` bytes at `loc` lie inside its buffer.
    pub fn bytes_checked(&self, loc: Loc, len: u64) -> bool {
        let (buf, off) = match loc {
            Loc::Kv { buf, off } => (self.kv.get(buf), off),
            Loc::Aux { buf, off } => (self.aux.get(buf), off),
            Loc::State { buf, off } => (self.state.get(buf), off),
        };
        buf.is_some_and(|b| off.checked_add(len).is_some_and(|e| e <= b.len() as u64))
    }

    /// The bytes at a location.
    pub fn bytes(&self, loc: Loc, len: u64) -> &[u8] {
        match loc {
            Loc::Kv { buf, off } => &self.kv[buf][off as usize..(off + len) as usize],
            Loc::Aux { buf, off } => &self.aux[buf][off as usize..(off + len) as usize],
            Loc::State { buf, off } => &self.state[buf][off as usize..(off + len) as usize],
        }
    }

    /// Mutable bytes at a location.
    pub fn bytes_mut(&mut self, loc: Loc, len: u64) -> &mut [u8] {
        match loc {
            Loc::Kv { buf, off } => &mut self.kv[buf][off as usize..(off + len) as usize],
            Loc::Aux { buf, off } => &mut self.aux[buf][off as usize..(off + len) as usize],
            Loc::State { buf, off } => &mut self.state[buf][off as usize..(off + len) as usize],
        }
    }

    fn heads(&self) -> u64 {
        u64::from(TOTAL_HEADS / self.tp)
    }

    /// Writes (or with `check`, compares) room `room`'s suffix page `k` held in page `page`.
    /// Returns false on the first mismatch.
    pub fn kv_page(&mut self, room: Room, k: u64, page: u64, check: bool) -> bool {
        let (il, heads) = (self.item_len(), self.heads());
        let first_head = u64::from(self.tp_rank) * heads;
        for buf in 0..KV_BUFFERS {
            for t in 0..u64::from(PAGE_SIZE) {
                for j in 0..heads {
                    for d in 0..HEAD_BYTES {
                        let off = page * il + t * heads * HEAD_BYTES + j * HEAD_BYTES + d;
                        let token = k * u64::from(PAGE_SIZE) + t;
                        let want = kv_byte(room, buf, token, first_head + j, d);
                        let cell = &mut self.kv[buf][off as usize];
                        if check {
                            if *cell != want {
                                return false;
                            }
                        } else {
                            *cell = want;
                        }
                    }
                }
            }
        }
        true
    }

    /// Writes (or with `check`, compares) room `room`'s state in slot `slot` of every tensor.
    pub fn state_slot(&mut self, room: Room, slot: u64, check: bool) -> bool {
        let tp_rank = self.tp_rank;
        for (buf, tensor) in self.state.iter_mut().enumerate() {
            for b in 0..STATE_ITEM {
                let want = state_byte(room, buf, tp_rank, b);
                let Some(cell) = tensor.get_mut((slot * STATE_ITEM + b) as usize) else {
                    return false;
                };
                if check {
                    if *cell != want {
                        return false;
                    }
                } else {
                    *cell = want;
                }
            }
        }
        true
    }

    /// Writes (or compares) room `room`'s aux row `row` in every buffer but the room row, and
    /// with `check` also compares the room row (room id LE, zero tail).
    pub fn aux_row(&mut self, room: Room, row: u64, check: bool) -> bool {
        for (buf, &l) in AUX_ROW_LENS.iter().enumerate() {
            for b in 0..l {
                let cell = &mut self.aux[buf][(row * l + b) as usize];
                let want = if buf == ROOM_INDEX {
                    if !check {
                        continue;
                    }
                    room.get()
                        .to_le_bytes()
                        .get(b as usize)
                        .copied()
                        .unwrap_or(0)
                } else {
                    aux_byte(room, buf, b)
                };
                if check {
                    if *cell != want {
                        return false;
                    }
                } else {
                    *cell = want;
                }
            }
        }
        true
    }
}
