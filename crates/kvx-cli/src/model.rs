//! The synthetic model: KV-pool shapes of real models, and the deterministic byte pattern the
//! prefill writes and the decode verifies.
//!
//! A preset gives the per-rank KV layout (buffers, bytes per page per buffer). The pattern is a
//! pure function of (room, buffer, page-in-room, word), so a decode can check every byte it
//! received without talking to the prefill. Aux rows start with the room (sglang's
//! `bootstrap_room` slot) followed by pattern words.

use clap::ValueEnum;

/// A model shape preset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModelPreset {
    /// Llama-3-8B: MHA, 32 layers, 8 KV heads × 128, bf16 (128 KiB per token at TP1).
    #[value(name = "llama3-8b")]
    Llama3_8b,
    /// Llama-3-70B: MHA, 80 layers, 8 KV heads × 128, bf16, heads split across TP.
    #[value(name = "llama3-70b")]
    Llama3_70b,
    /// DeepSeek-V3: MLA, 61 layers, one 576-element bf16 latent per token and layer.
    #[value(name = "deepseek-v3")]
    DeepseekV3,
    /// A tiny MHA model (2 layers, 1 KV head × 64, bf16) for quick tests.
    #[value(name = "tiny")]
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
    /// Bytes per row of the aux data buffer (aux buffer 0; the room buffer, aux buffer 1, has
    /// 8-byte rows holding sglang's `bootstrap_room`).
    pub aux_item_len: u64,
    /// Aux rows in the pool.
    pub aux_rows: u64,
    /// True for MLA models (one latent buffer per layer).
    pub mla: bool,
    /// KV heads of the whole model (1 for MLA latents).
    pub total_kv_heads: u32,
}

impl ModelPreset {
    /// The layout of rank `tp_rank` of `tp_size` with the given page size and pool size.
    pub fn layout(self, tp_size: u32, page_size: u64, pool_pages: u64) -> KvLayout {
        let tp = u64::from(tp_size.max(1));
        let (layers, elems_per_token, mla, heads) = match self {
            ModelPreset::Llama3_8b => (32, (8 / tp).max(1) * 128, false, 8),
            ModelPreset::Llama3_70b => (80, (8 / tp).max(1) * 128, false, 8),
            ModelPreset::DeepseekV3 => (61, 576, true, 1),
            ModelPreset::Tiny => (2, 64, false, 1),
        };
        let num_buffers = if mla { layers } else { 2 * layers };
        KvLayout {
            num_buffers,
            item_len: page_size * elems_per_token * 2,
            page_size,
            pool_pages,
            aux_item_len: 64,
            aux_rows: 1024,
            mla,
            total_kv_heads: heads,
        }
    }
}

impl KvLayout {
    /// Bytes of the whole KV pool (all buffers).
    pub fn pool_bytes(&self) -> u64 {
        self.num_buffers as u64 * self.pool_pages * self.item_len
    }

    /// Bytes of the aux pool (data rows, then room rows).
    pub fn aux_bytes(&self) -> u64 {
        self.aux_rows * (self.aux_item_len + AUX_ROOM_LEN)
    }

    /// Aux buffer addresses given the aux pool base: data rows, then room rows.
    pub fn aux_ptrs(&self, base: u64) -> Vec<u64> {
        vec![base, base + self.aux_rows * self.aux_item_len]
    }

    /// Row length per aux buffer.
    pub fn aux_item_lens(&self) -> Vec<u64> {
        vec![self.aux_item_len, AUX_ROOM_LEN]
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

    /// The per-buffer addresses, as sglang's `kv_data_ptrs`.
    pub fn kv_ptrs(&self, base: u64) -> Vec<u64> {
        (0..self.num_buffers)
            .map(|b| self.buffer_addr(base, b))
            .collect()
    }
}

/// Row length of the aux room buffer (index [`AUX_ROOM_INDEX`]).
pub const AUX_ROOM_LEN: u64 = 8;
/// Index of the aux buffer whose rows carry the room (sglang's `bootstrap_room`).
pub const AUX_ROOM_INDEX: usize = 1;

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

/// Fills an aux data row with the room's pattern.
pub fn fill_aux(dst: &mut [u8], room: u64) {
    fill_page(dst, room, u32::MAX, 0);
}

/// True when an aux data row holds the room's pattern.
pub fn check_aux(src: &[u8], room: u64) -> bool {
    check_page(src, room, u32::MAX, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_8b_is_128_kib_per_token() {
        let l = ModelPreset::Llama3_8b.layout(1, 1, 16);
        assert_eq!(l.bytes_per_page(), 128 * 1024);
        let d = ModelPreset::DeepseekV3.layout(1, 1, 16);
        assert_eq!((d.num_buffers, d.item_len), (61, 1152));
        let l70 = ModelPreset::Llama3_70b.layout(4, 16, 16);
        assert_eq!(l70.item_len, 16 * 2 * 128 * 2);
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
        fill_aux(&mut aux, 99);
        assert!(check_aux(&aux, 99));
        assert!(!check_aux(&aux, 98));
    }
}
