"""kvx's synthetic model in numpy: shapes of the `--model` presets and the byte pattern.

A transcription of `crates/kvx-cli/src/model.rs` (`ModelPreset::layout`, `KvLayout::fill_kv` /
`check_kv`, `fill_page`, `fill_aux`) and of how `forward.rs` fills a room and `decode.rs`
verifies it, so that a sglang peer driven by `sglang_live.py` writes and checks exactly the
bytes a kvx peer writes and checks:

* KV: page `i` of a room (the room's i-th page, counted from its first page) of buffer `b` is
  `page_size × heads` head slots of `head_bytes`; slot `s` holds token `t = i·page_size + s //
  heads` and global head `h = head_offset + s % heads`, and its bytes are
  `fill_page(room ^ (h << 56), b, t)`: 64-bit little-endian words `seed ^ (w · φ)` with
  `seed = mix(room' ^ mix((b << 32) | t))` (splitmix64 `mix`, φ = 0x9E3779B97F4A7C15), cut
  to the slot's length.
* aux: the row of data buffer `k` (0..8) is `fill_page(room, u32::MAX - k, 0)` over the row
  length; the row of the last buffer (index 9, sglang's `bootstrap_room`) is the room as a u64
  little-endian then zeros.

Everything is vectorised: a room's buffer is computed as one (tokens, heads, words) array.
"""

from __future__ import annotations

import numpy as np

U64 = np.uint64
PHI = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1

# sglang 0.5.23's default metadata buffers (row bytes) and the index of `bootstrap_room`.
AUX_ROW_LENS = (64, 64, 64, 64, 512, 512, 64, 128, 64, 64)
AUX_ROOM_INDEX = len(AUX_ROW_LENS) - 1

# name: (layers, total KV heads, head dim, MLA) as in model.rs; bf16 (2 bytes) everywhere.
PRESETS = {
    "llama3-8b": (32, 8, 128, False),
    "llama3-70b": (80, 8, 128, False),
    "deepseek-v3": (61, 1, 576, True),
    "tiny": (2, 1, 64, False),
}


def _u64(x) -> np.ndarray:
    return np.asarray(x, dtype=U64)


def mix(z: np.ndarray) -> np.ndarray:
    """splitmix64 on a uint64 array (wrapping arithmetic)."""
    z = _u64(z)
    z = z + _u64(PHI)
    z = (z ^ (z >> _u64(30))) * _u64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _u64(27))) * _u64(0x94D049BB133111EB)
    return z ^ (z >> _u64(31))


def words(seed: np.ndarray, nbytes: int) -> np.ndarray:
    """The pattern bytes of each seed: shape seed.shape + (nbytes,), uint8."""
    seed = _u64(seed)
    n = -(-nbytes // 8)
    w = np.arange(n, dtype=U64) * _u64(PHI)
    out = (seed[..., None] ^ w).astype("<u8", copy=False)
    return out.view(np.uint8).reshape(seed.shape + (n * 8,))[..., :nbytes]


def fill_page(nbytes: int, room: int, buffer: int, page_in_room: int) -> bytes:
    """model.rs `fill_page` for one slice (scalar form, for tests)."""
    inner = mix(_u64((buffer << 32) | page_in_room))
    seed = mix(_u64(room & MASK) ^ inner)
    return words(seed, nbytes).tobytes()


def aux_row(room: int, index: int, row_len: int) -> np.ndarray:
    """The bytes of one aux row of buffer `index` for `room` (uint8, `row_len`)."""
    if index == AUX_ROOM_INDEX:
        row = np.zeros(row_len, dtype=np.uint8)
        row[:8] = np.frombuffer((room & MASK).to_bytes(8, "little"), dtype=np.uint8)
        return row
    buffer = 0xFFFFFFFF - index
    return np.frombuffer(fill_page(row_len, room, buffer, 0), dtype=np.uint8).copy()


class Layout:
    """One rank's KV layout (model.rs `ModelPreset::layout`), optionally a custom shape."""

    def __init__(
        self,
        model: str = "tiny",
        page_size: int = 16,
        tp_size: int = 1,
        tp_rank: int = 0,
        layers: int | None = None,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype_bytes: int = 2,
        mla: bool | None = None,
    ):
        p_layers, p_heads, p_dim, p_mla = PRESETS[model]
        self.model = model
        self.layers = layers if layers is not None else p_layers
        self.total_kv_heads = kv_heads if kv_heads is not None else p_heads
        self.head_dim = head_dim if head_dim is not None else p_dim
        self.mla = mla if mla is not None else p_mla
        if self.mla:
            self.total_kv_heads = 1
        self.dtype_bytes = dtype_bytes
        self.page_size = page_size
        tp = max(tp_size, 1)
        if self.mla:
            self.heads, self.head_offset = 1, 0
        else:
            per_rank = max(self.total_kv_heads // tp, 1)
            offset = (tp_rank % tp) * self.total_kv_heads // tp
            self.heads = per_rank
            self.head_offset = min(offset, self.total_kv_heads - per_rank)
        self.num_buffers = self.layers if self.mla else 2 * self.layers
        self.head_bytes = self.head_dim * dtype_bytes
        self.item_len = page_size * self.heads * self.head_bytes

    def describe(self) -> dict:
        return {
            "model": self.model,
            "mla": self.mla,
            "layers": self.layers,
            "buffers": self.num_buffers,
            "heads": self.heads,
            "head_offset": self.head_offset,
            "head_bytes": self.head_bytes,
            "page_size": self.page_size,
            "item_len": self.item_len,
        }

    def room_buffer(self, room: int, buffer: int, num_pages: int) -> np.ndarray:
        """The room's pattern in buffer `buffer` for pages 0..num_pages: (num_pages, item_len)."""
        tokens = np.arange(num_pages * self.page_size, dtype=U64)
        heads = self.head_offset + np.arange(self.heads, dtype=U64)
        inner = mix((_u64(buffer) << _u64(32)) | tokens)  # (T,)
        room_h = _u64(room & MASK) ^ (heads << _u64(56))  # (H,)
        seed = mix(room_h[None, :] ^ inner[:, None])  # (T, H)
        data = words(seed, self.head_bytes)  # (T, H, head_bytes)
        return data.reshape(num_pages, self.item_len)

    def fill_kv(self, room: int, buffer: int, page_in_room: int) -> bytes:
        """model.rs `KvLayout::fill_kv` of one page (for tests)."""
        full = self.room_buffer(room, buffer, page_in_room + 1)
        return full[page_in_room].tobytes()
