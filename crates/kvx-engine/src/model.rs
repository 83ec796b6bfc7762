//! The synthetic model: KV-pool shapes of real models, and the deterministic byte pattern the
//! prefill writes and the decode verifies.
//!
//! A preset gives the per-rank KV layout (buffers, bytes per page per buffer). The pattern is a
//! pure function of (room, buffer, page-in-room, word), so a decode can check every byte it
//! received without talking to the prefill. The aux pool is sglang 0.5.23's default metadata
//! buffers ([`SGLANG_AUX_ROW_LENS`]): every data row carries the pattern of (room, aux buffer),
//! and the last buffer's row carries the room (sglang's `bootstrap_room`, which a sglang decode's
//! scheduler checks before it admits the request) followed by zeros.

/// A model shape preset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum ModelPreset {
    /// Llama-3-8B: MHA, 32 layers, 8 KV heads × 128, bf16 (128 KiB per token at TP1).
    #[cfg_attr(feature = "clap", value(name = "llama3-8b"))]
    Llama3_8b,
    /// Llama-3-70B: MHA, 80 layers, 8 KV heads × 128, bf16, heads split across TP.
    #[cfg_attr(feature = "clap", value(name = "llama3-70b"))]
    Llama3_70b,
    /// DeepSeek-V3: MLA, 61 layers, one 576-element bf16 latent per token and layer.
    #[cfg_attr(feature = "clap", value(name = "deepseek-v3"))]
    DeepseekV3,
    /// A tiny MHA model (2 layers, 1 KV head × 64, bf16) for quick tests.
    #[cfg_attr(feature = "clap", value(name = "tiny"))]
    Tiny,
}

/// The KV layout of one rank: what a prefill registers and a decode mirrors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Number of KV buffers (MHA: K layers then V layers; MLA: one per layer).
    pub num_buffers: usize,
    /// Bytes per page of one buffer.
    pub item_len: u64,
    /// Tokens per page.
    pub page_size: u64,
    /// Pages per buffer in the pool.
    pub pool_pages: u64,
    /// Aux rows in the pool (every aux buffer has this many rows of
    /// [`SGLANG_AUX_ROW_LENS`] bytes).
    pub aux_rows: u64,
    /// True for MLA models (one latent buffer per layer).
    pub mla: bool,
    /// KV heads of the whole model (1 for MLA latents).
    pub total_kv_heads: u32,
    /// KV heads this rank holds.
    pub heads: u32,
    /// Global index of this rank's first head.
    pub head_offset: u32,
    /// Bytes of one head of one token.
    pub head_bytes: u64,
}

impl ModelPreset {
    /// The layout of rank `tp_rank` of `tp_size` with the given page size and pool size.
    pub fn layout(self, tp_size: u32, tp_rank: u32, page_size: u64, pool_pages: u64) -> KvLayout {
        let tp = tp_size.max(1);
        let (layers, total_heads, head_dim, mla) = match self {
            ModelPreset::Llama3_8b => (32, 8u32, 128u64, false),
            ModelPreset::Llama3_70b => (80, 8, 128, false),
            ModelPreset::DeepseekV3 => (61, 1, 576, true),
            ModelPreset::Tiny => (2, 1, 64, false),
        };
        // MLA latents are replicated on every rank; MHA heads are split (and replicated when
        // there are more ranks than heads).
        let (heads, head_offset) = if mla {
            (1, 0)
        } else {
            let per_rank = (total_heads / tp).max(1);
            let offset = (u64::from(tp_rank % tp) * u64::from(total_heads) / u64::from(tp)) as u32;
            (per_rank, offset.min(total_heads - per_rank))
        };
        let num_buffers = if mla { layers } else { 2 * layers };
        KvLayout {
            num_buffers,
            item_len: page_size * u64::from(heads) * head_dim * 2,
            page_size,
            pool_pages,
            aux_rows: 1024,
            mla,
            total_kv_heads: total_heads,
            heads,
            head_offset,
            head_bytes: head_dim * 2,
        }
    }
}

impl KvLayout {
    /// Bytes of the whole KV pool (all buffers).
    pub fn pool_bytes(&self) -> u64 {
        self.num_buffers as u64 * self.pool_pages * self.item_len
    }

    /// Bytes of the aux pool (every aux buffer's rows, buffer after buffer).
    pub fn aux_bytes(&self) -> u64 {
        self.aux_rows * SGLANG_AUX_ROW_LENS.iter().sum::<u64>()
    }

    /// Aux buffer addresses given the aux pool base (sglang's `aux_data_ptrs`).
    pub fn aux_ptrs(&self, base: u64) -> Vec<u64> {
        SGLANG_AUX_ROW_LENS
            .iter()
            .scan(base, |at, len| {
                let ptr = *at;
                *at += self.aux_rows * len;
                Some(ptr)
            })
            .collect()
    }

    /// Row length per aux buffer (sglang's `aux_item_lens`).
    pub fn aux_item_lens(&self) -> Vec<u64> {
        SGLANG_AUX_ROW_LENS.to_vec()
    }

    /// Bytes of one aux row across every aux buffer.
    pub fn aux_row_bytes(&self) -> u64 {
        SGLANG_AUX_ROW_LENS.iter().sum()
    }

    /// Bytes one page carries across all buffers.
    pub fn bytes_per_page(&self) -> u64 {
        self.num_buffers as u64 * self.item_len
    }

    /// Pages needed for `tokens` tokens.
    pub fn pages_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.page_size.max(1))
    }

    /// Address of buffer `b` given the pool base.
    pub fn buffer_addr(&self, base: u64, b: usize) -> u64 {
        base + b as u64 * self.pool_pages * self.item_len
    }

    /// Fills page `page_in_room` of buffer `buffer` (`dst`, one page, NHD: token, head, bytes)
    /// with the room's pattern. The pattern of a head is a function of the global token and
    /// head, so ranks with different TP layouts agree on every byte.
    pub fn fill_kv(&self, dst: &mut [u8], room: u64, buffer: u32, page_in_room: u32) {
        self.for_heads(dst.len(), page_in_room, |off, token, head| {
            if let Some(h) = dst.get_mut(off..off + self.head_bytes as usize) {
                fill_page(h, room ^ (u64::from(head) << 56), buffer, token);
            }
            true
        });
    }

    /// True when `src` (one page of buffer `buffer`) holds exactly the room's pattern.
    pub fn check_kv(&self, src: &[u8], room: u64, buffer: u32, page_in_room: u32) -> bool {
        src.len() as u64 == self.item_len
            && self.for_heads(src.len(), page_in_room, |off, token, head| {
                src.get(off..off + self.head_bytes as usize)
                    .is_some_and(|h| check_page(h, room ^ (u64::from(head) << 56), buffer, token))
            })
    }

    /// Calls `f(byte offset, global token, global head)` for every head slot of a page.
    fn for_heads(
        &self,
        len: usize,
        page_in_room: u32,
        mut f: impl FnMut(usize, u32, u32) -> bool,
    ) -> bool {
        let hb = self.head_bytes.max(1) as usize;
        let heads = self.heads.max(1) as usize;
        for slot in 0..len / hb {
            let token = page_in_room as usize * self.page_size as usize + slot / heads;
            let head = self.head_offset as usize + slot % heads;
            if !f(slot * hb, token as u32, head as u32) {
                return false;
            }
        }
        true
    }

    /// The per-buffer addresses, as sglang's `kv_data_ptrs`.
    pub fn kv_ptrs(&self, base: u64) -> Vec<u64> {
        (0..self.num_buffers)
            .map(|b| self.buffer_addr(base, b))
            .collect()
    }
}

/// Row bytes of sglang 0.5.23's default metadata buffers, in registration order: output ids,
/// cached tokens, token logprob values and indices, top logprob values and indices, top-k
/// probabilities and indices, hidden states, and last `bootstrap_room` (`u64 × 8`). A sglang
/// prefill refuses a decode whose aux buffer count differs from its own.
pub const SGLANG_AUX_ROW_LENS: [u64; 10] = [64, 64, 64, 64, 512, 512, 64, 128, 64, 64];
/// Index of the aux buffer whose rows carry the room (sglang's `bootstrap_room`).
pub const AUX_ROOM_INDEX: usize = SGLANG_AUX_ROW_LENS.len() - 1;
/// Row length of the aux room buffer (index [`AUX_ROOM_INDEX`]): the room as a little-endian
/// `u64`, then zeros.
pub const AUX_ROOM_LEN: u64 = SGLANG_AUX_ROW_LENS[AUX_ROOM_INDEX];

/// splitmix64: a cheap, well-mixed 64-bit hash.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The seed of one page of one buffer of one room.
fn page_seed(room: u64, buffer: u32, page_in_room: u32) -> u64 {
    mix(room ^ mix((u64::from(buffer) << 32) | u64::from(page_in_room)))
}

/// Fills `dst` (one page of one buffer) with the pattern of (room, buffer, page_in_room).
pub fn fill_page(dst: &mut [u8], room: u64, buffer: u32, page_in_room: u32) {
    let seed = page_seed(room, buffer, page_in_room);
    let mut chunks = dst.chunks_exact_mut(8);
    let mut w = 0u64;
    for c in &mut chunks {
        c.copy_from_slice(&(seed ^ w.wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes());
        w += 1;
    }
    let rest = chunks.into_remainder();
    let last = (seed ^ w.wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes();
    let n = rest.len();
    rest.copy_from_slice(&last[..n]);
}

/// True when `src` holds exactly the pattern of (room, buffer, page_in_room).
pub fn check_page(src: &[u8], room: u64, buffer: u32, page_in_room: u32) -> bool {
    let seed = page_seed(room, buffer, page_in_room);
    let mut chunks = src.chunks_exact(8);
    let mut w = 0u64;
    let mut bad = 0u64;
    for c in &mut chunks {
        let mut b = [0u8; 8];
        b.copy_from_slice(c);
        bad |= u64::from_le_bytes(b) ^ (seed ^ w.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        w += 1;
    }
    let rest = chunks.remainder();
    let last = (seed ^ w.wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes();
    bad == 0 && rest == &last[..rest.len()]
}

/// The pattern's buffer id of aux data buffer `index` (KV buffers count up from 0, aux
/// buffers down from `u32::MAX`).
fn aux_buffer_id(index: usize) -> u32 {
    u32::MAX - index as u32
}

/// Fills a row of aux data buffer `index` with the room's pattern.
pub fn fill_aux(dst: &mut [u8], room: u64, index: usize) {
    fill_page(dst, room, aux_buffer_id(index), 0);
}

/// True when a row of aux data buffer `index` holds the room's pattern.
pub fn check_aux(src: &[u8], room: u64, index: usize) -> bool {
    check_page(src, room, aux_buffer_id(index), 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_8b_is_128_kib_per_token() {
        let l = ModelPreset::Llama3_8b.layout(1, 0, 1, 16);
        assert_eq!(l.bytes_per_page(), 128 * 1024);
        let d = ModelPreset::DeepseekV3.layout(1, 0, 1, 16);
        assert_eq!((d.num_buffers, d.item_len), (61, 1152));
        let l70 = ModelPreset::Llama3_70b.layout(4, 3, 16, 16);
        assert_eq!((l70.item_len, l70.head_offset), (16 * 2 * 128 * 2, 6));
    }

    #[test]
    fn head_slices_agree_across_tp_layouts() {
        // A TP1 page holds heads 0..8; the TP2 rank 1 page holds heads 4..8 of the same tokens.
        let full = ModelPreset::Llama3_8b.layout(1, 0, 2, 4);
        let half = ModelPreset::Llama3_8b.layout(2, 1, 2, 4);
        let mut a = vec![0u8; full.item_len as usize];
        full.fill_kv(&mut a, 7, 3, 1);
        assert!(full.check_kv(&a, 7, 3, 1));
        let mut b = vec![0u8; half.item_len as usize];
        half.fill_kv(&mut b, 7, 3, 1);
        let hb = half.head_bytes as usize;
        for token in 0..2 {
            for h in 0..4 {
                let from_half = &b[(token * 4 + h) * hb..][..hb];
                let from_full = &a[(token * 8 + 4 + h) * hb..][..hb];
                assert_eq!(from_half, from_full);
            }
        }
        a[5] ^= 1;
        assert!(!full.check_kv(&a, 7, 3, 1));
    }

    #[test]
    fn pattern_round_trips_and_detects_flips() {
        let mut page = vec![0u8; 1003];
        fill_page(&mut page, 42, 3, 7);
        assert!(check_page(&page, 42, 3, 7));
        assert!(!check_page(&page, 42, 3, 8));
        assert!(!check_page(&page, 43, 3, 7));
        for i in [0usize, 500, 1002] {
            page[i] ^= 1;
            assert!(!check_page(&page, 42, 3, 7));
            page[i] ^= 1;
        }
        let mut aux = vec![0u8; 64];
        fill_aux(&mut aux, 99, 3);
        assert!(check_aux(&aux, 99, 3));
        assert!(!check_aux(&aux, 98, 3));
        assert!(!check_aux(&aux, 99, 4));
    }

    #[test]
    fn aux_pool_is_sglangs_default() {
        let l = ModelPreset::Tiny.layout(1, 0, 1, 16);
        let ptrs = l.aux_ptrs(0x1000);
        assert_eq!(ptrs.len(), 10);
        assert_eq!(AUX_ROOM_INDEX, 9);
        assert_eq!(ptrs[1] - ptrs[0], l.aux_rows * 64);
        assert_eq!(ptrs[5] - ptrs[4], l.aux_rows * 512);
        assert_eq!(ptrs[9] + l.aux_rows * AUX_ROOM_LEN, 0x1000 + l.aux_bytes());
        assert_eq!(l.aux_item_lens()[7], 128);
    }
}
