#!/usr/bin/env python3
"""Run sglang 0.5.23's own PD-disaggregation classes live on a CPU-only machine.

`MooncakeKVManager` (PREFILL or DECODE), `MooncakeKVSender`, `MooncakeKVReceiver` and
`MooncakeKVBootstrapServer` from `sglang.srt.disaggregation.mooncake.conn`, unmodified, with
Mooncake Transfer Engine over TCP (`--disaggregation-transfer-backend mooncake_tcp`: backend
`mooncake` with `MC_FORCE_TCP=1`), host 127.0.0.1 (`SGLANG_HOST_IP`). KV pools and sglang's
10 metadata (aux) buffers are numpy arrays of sglang's shapes; torch/triton and the GPU stack
are replaced by import stubs (`stubs/kvx_stubs.py`); nothing of sglang's transfer path is.

The pages carry kvx's synthetic pattern (`kvx_pattern.py`), so a kvx peer interoperates.

Modes (one JSON summary line on stdout at the end, logs on stderr, exit 1 on any failure):

  bootstrap  sglang's own bootstrap server (`MooncakeKVBootstrapServer`) until killed
  decode     register with a bootstrap server (sglang's or kvx's), run N rooms the way sglang's
             decode scheduler does (receiver.init, send_metadata with non-contiguous pages,
             poll, the bootstrap_room gate), verify every byte; optionally ABORT some rooms
  prefill    one prefill rank (its own bootstrap server with --serve-bootstrap): senders for
             the given rooms; when a decode's metadata arrives, fill the pages with the pattern
             and send them chunk by chunk, poll to Success
  selftest   compare the pattern with bytes kvx produced (a file of `room buffer page hex`)

Timeouts: SGLANG_DISAGGREGATION_* from the environment, or the flags below.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "stubs"))

import numpy as np  # noqa: E402

import kvx_pattern  # noqa: E402

log = logging.getLogger("sglang_live")

# KVPoll values (sglang.srt.disaggregation.base.conn.KVPoll)
FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = 0, 1, 2, 3, 4
POLL_NAMES = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}


# ---------------------------------------------------------------------------------------------
# command line


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["bootstrap", "decode", "prefill", "selftest"])
    # model shape (kvx presets; the custom flags override the preset)
    p.add_argument("--model", default="tiny", choices=sorted(kvx_pattern.PRESETS))
    p.add_argument("--layers", type=int)
    p.add_argument("--kv-heads", type=int, help="total KV heads of the model (MHA)")
    p.add_argument("--head-dim", type=int)
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--mla", action="store_true", default=None, help="one latent buffer per layer")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--pool-pages", type=int, default=256, help="pages per KV buffer (page 0 reserved)")
    p.add_argument("--aux-rows", type=int, default=64, help="rows of each metadata buffer")
    p.add_argument("--kv-cache-dtype", default="auto", help="kv_cache_dtype string (must match the peer)")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--tp-rank", type=int, default=0)
    # rooms
    p.add_argument("--rooms", type=int, default=8)
    p.add_argument("--room-base", type=int, default=None, help="rooms N, N+1, … (default random)")
    p.add_argument("--room-ids", default=None, help="comma-separated room ids (overrides --rooms)")
    p.add_argument("--tokens", type=int, default=200, help="prompt tokens per room")
    p.add_argument("--chunk-pages", type=int, default=4, help="pages per sender.send() chunk (prefill)")
    p.add_argument("--concurrency", type=int, default=4, help="rooms in flight (decode)")
    p.add_argument("--fragmentation", type=float, default=0.7, help="fraction of page-list breaks")
    p.add_argument("--seed", type=int, default=1)
    # endpoints
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--bootstrap-addr", default="127.0.0.1:8998", help="decode: the prefill's bootstrap host:port")
    p.add_argument("--bootstrap-port", type=int, default=8998, help="prefill/bootstrap: the bootstrap port")
    p.add_argument("--serve-bootstrap", action="store_true", help="prefill: also run sglang's bootstrap server")
    # behaviour
    p.add_argument("--abort-rooms", default="", help="decode: comma-separated rooms to ABORT right after send_metadata")
    p.add_argument("--abort-on", choices=["metadata", "first-write"], default="metadata",
                   help="decode: abort right after send_metadata, or once the room's first bytes landed (mid-transfer)")
    p.add_argument("--abort-after-ms", type=float, default=0.0, help="decode: delay between send_metadata and abort()")
    p.add_argument("--bad-page-rooms", default="",
                   help="decode: rooms whose last page index lies outside the registered pool (a decode bug)")
    p.add_argument("--hold-rooms", default="", help="prefill: rooms never sent (the decode times out and aborts)")
    p.add_argument("--expect-failed", default="", help="rooms expected to end Failed (aborted/held); not counted as failures")
    p.add_argument("--deferred-release", type=int, choices=[0, 1], default=None,
                   help="SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE (0.5.23 default on: 5-frame ABORT, generation ACKs)")
    p.add_argument("--waiting-timeout", type=float, default=None)
    p.add_argument("--bootstrap-timeout", type=float, default=None)
    p.add_argument("--abort-ack-timeout", type=float, default=15.0, help="decode: seconds to wait for ABORT_ACKs")
    p.add_argument("--late-write-ms", type=float, default=300.0, help="decode: after an ACK, pages must not change for this long")
    p.add_argument("--deadline", type=float, default=120.0, help="seconds before the run gives up")
    p.add_argument("--linger", type=float, default=0.0, help="prefill: seconds to keep serving after the last room")
    p.add_argument("--pattern", choices=["kvx", "shifted"], default="kvx",
                   help="prefill: kvx's pattern, or (a negative control) the KV of room+1 with correct aux rows")
    p.add_argument("--contiguous-pool", action="store_true", help="all KV buffers in one allocation, back to back")
    p.add_argument("--expect", help="selftest: file of `room buffer page hex` lines (KV) and `aux room index hex`")
    p.add_argument("--log-level", default=os.environ.get("SGLANG_LIVE_LOG", "INFO"))
    return p.parse_args(argv)


def csv_ints(s):
    return [int(x) for x in s.split(",") if x.strip()]


def room_list(args):
    if args.room_ids:
        return csv_ints(args.room_ids)
    if args.room_base is not None:
        return [args.room_base + i for i in range(args.rooms)]
    rng = random.Random(args.seed ^ 0x5EED)
    return [rng.randrange(1, 1 << 63) for _ in range(args.rooms)]


def layout_of(args) -> kvx_pattern.Layout:
    return kvx_pattern.Layout(
        model=args.model,
        page_size=args.page_size,
        tp_size=args.tp_size,
        tp_rank=args.tp_rank,
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype_bytes=args.dtype_bytes,
        mla=args.mla,
    )


def set_env(args):
    """Environment sglang reads at import / manager construction."""
    os.environ.setdefault("SGLANG_HOST_IP", args.host)
    # --disaggregation-transfer-backend mooncake_tcp == mooncake with MC_FORCE_TCP=1
    # (sglang's handle_pd_disaggregation; with model_path="dummy" resolution skips it).
    os.environ["MC_FORCE_TCP"] = "1"
    if args.deferred_release is not None:
        os.environ["SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"] = str(args.deferred_release)
    if args.waiting_timeout is not None:
        os.environ["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = str(int(max(1, args.waiting_timeout)))
    if args.bootstrap_timeout is not None:
        os.environ["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"] = str(int(max(1, args.bootstrap_timeout)))


def emit(summary: dict) -> None:
    sys.stdout.write(json.dumps(summary, sort_keys=True) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# sglang


class SingleRankGroup:
    """A one-rank process group placeholder (sglang only reads its shape with PP/TP 1)."""

    world_size = 1
    rank_in_group = 0
    rank = 0
    ranks = [0]
    is_first_rank = True
    is_last_rank = True

    def __init__(self, name):
        self.unique_name = name

    def barrier(self, *a, **k):
        pass

    def all_gather_object(self, obj, *a, **k):
        return [obj]

    def broadcast_object(self, obj=None, *a, **k):
        return obj


class Sglang:
    """The sglang 0.5.23 modules, imported once with the GPU stack stubbed."""

    def __init__(self):
        import kvx_stubs

        kvx_stubs.install()
        import sglang
        from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
        from sglang.srt.disaggregation.mooncake import conn
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as te
        from sglang.srt.runtime_context import SpawnRanks, publish
        from sglang.srt.server_args import ServerArgs

        self.version = getattr(sglang, "__version__", "?")
        self.KVArgs, self.KVPoll, self.conn = KVArgs, KVPoll, conn
        self.Mode, self.te = DisaggregationMode, te
        self.SpawnRanks, self.publish, self.ServerArgs = SpawnRanks, publish, ServerArgs
        assert (KVPoll.Failed, KVPoll.Success) == (FAILED, SUCCESS)

    def publish_args(self, args, mode: str):
        sa = self.ServerArgs(
            model_path="dummy",
            host=args.host,
            disaggregation_mode=mode,
            disaggregation_transfer_backend="mooncake",
            disaggregation_bootstrap_port=args.bootstrap_port,
            load_balance_method="round_robin",
            tp_size=args.tp_size,
            page_size=args.page_size,
        )
        self.publish(sa, role="scheduler", ranks=self.SpawnRanks(world_rank=args.tp_rank, gpu_id=0))
        # process groups: single-rank placeholders (no torch.distributed here)
        from sglang.srt.runtime_context import get_parallel

        get_parallel().override_permanently(pp_group=SingleRankGroup("pp"))
        self.te.maybe_init_shared_mooncake_transfer_engine(gpu_id=0)
        if self.te.get_mooncake_transfer_engine() is None:
            raise RuntimeError("sglang did not create its Mooncake transfer engine")
        return sa

    def manager(self, args, mode: str, pools: "Pools"):
        sa = self.publish_args(args, mode)
        lay = pools.layout
        a = self.KVArgs()
        a.engine_rank = args.tp_rank
        a.pp_rank = 0
        a.system_dp_rank = 0
        a.rust_http_port = None
        a.kv_cache_dtype_str = args.kv_cache_dtype
        a.kv_layout = None
        a.prefill_start_layer = 0
        a.prefill_end_layer = lay.layers
        a.kv_data_ptrs = [b.ctypes.data for b in pools.kv]
        a.kv_data_lens = [b.nbytes for b in pools.kv]
        a.kv_item_lens = [lay.item_len] * lay.num_buffers
        a.num_draft_entries = 0
        a.kv_layer_ids = []  # plain MHA/MLA pools: positional pairing (build_kv_layer_ids)
        if not lay.mla:
            a.kv_head_num = lay.heads
            a.total_kv_head_num = lay.total_kv_heads
        a.page_size = lay.page_size
        a.aux_data_ptrs = [b.ctypes.data for b in pools.aux]
        a.aux_data_lens = [b.nbytes for b in pools.aux]
        a.aux_item_lens = [b.shape[1] for b in pools.aux]
        a.ib_device = None
        a.gpu_id = 0
        # setup_state_kv_args for a pool without state components
        a.state_types = []
        a.state_data_ptrs = []
        a.state_data_lens = []
        a.state_item_lens = []
        a.state_dim_per_tensor = []
        a.state_slice_outer_counts = []
        a.state_layer_ids = []
        a.is_hybrid_mla_backend = False
        a.state_conv_shard_groups = []
        a.swa_kv_cache_layout = None
        a.mla_compression_ratios = None
        dmode = self.Mode.PREFILL if mode == "prefill" else self.Mode.DECODE
        return self.conn.MooncakeKVManager(a, dmode, sa, lay.mla)


# ---------------------------------------------------------------------------------------------
# memory


class Pools:
    """KV buffers (pages × item_len) and the 10 metadata buffers (rows × row bytes)."""

    def __init__(self, layout: kvx_pattern.Layout, pool_pages: int, aux_rows: int, contiguous: bool):
        self.layout = layout
        self.pool_pages = pool_pages
        if contiguous:
            backing = np.zeros((layout.num_buffers, pool_pages, layout.item_len), dtype=np.uint8)
            self.kv = [backing[b] for b in range(layout.num_buffers)]
        else:
            self.kv = [np.zeros((pool_pages, layout.item_len), dtype=np.uint8) for _ in range(layout.num_buffers)]
        # sglang's MetadataBuffers: output_ids (16 × i32), cached_tokens, logprob val/idx,
        # top logprobs val/idx (128 × 4), topk p/index, hidden states, bootstrap_room (8 × u64)
        self.aux = [np.zeros((aux_rows, n), dtype=np.uint8) for n in kvx_pattern.AUX_ROW_LENS]
        self.bootstrap_room = self.aux[kvx_pattern.AUX_ROOM_INDEX].view("<u8")  # (rows, 8)

    def fill_room(self, room: int, pages: np.ndarray, row: int, kv_room: int | None = None) -> None:
        lay = self.layout
        for b in range(lay.num_buffers):
            self.kv[b][pages] = lay.room_buffer(room if kv_room is None else kv_room, b, len(pages))
        for k, buf in enumerate(self.aux):
            buf[row] = kvx_pattern.aux_row(room, k, buf.shape[1])

    def check_room(self, room: int, pages: np.ndarray, row: int):
        """None when every byte matches, else a description of the first difference."""
        lay = self.layout
        for b in range(lay.num_buffers):
            got = self.kv[b][pages]
            want = lay.room_buffer(room, b, len(pages))
            if not np.array_equal(got, want):
                bad = np.nonzero((got != want).any(axis=1))[0]
                i = int(bad[0])
                return f"KV differs from the pattern (buffer {b}: {len(bad)} of {len(pages)} pages, first page_in_room {i})"
        for k, buf in enumerate(self.aux):
            if not np.array_equal(buf[row], kvx_pattern.aux_row(room, k, buf.shape[1])):
                return f"aux buffer {k} row {row} differs"
        return None

    def snapshot(self, pages: np.ndarray):
        return [self.kv[b][pages].copy() for b in range(self.layout.num_buffers)]

    def changed_since(self, snap, pages: np.ndarray) -> bool:
        return any(not np.array_equal(self.kv[b][pages], s) for b, s in enumerate(snap))

    def clear_room(self, pages: np.ndarray, row: int) -> None:
        for b in range(self.layout.num_buffers):
            self.kv[b][pages] = 0
        for buf in self.aux:
            buf[row] = 0

    def stray_pages(self, never_used) -> int:
        """Pages no room was given that are not zero (a write outside the room's pages)."""
        idx = np.array(sorted(never_used), dtype=np.int64)
        if len(idx) == 0:
            return 0
        return sum(int(np.count_nonzero(self.kv[b][idx].any(axis=1))) for b in range(self.layout.num_buffers))


class PageAllocator:
    """Free pages 1..pool-1 in shuffled runs, so rooms get non-contiguous page lists."""

    def __init__(self, pool_pages: int, fragmentation: float, rng: random.Random):
        pages = list(range(1, pool_pages))
        runs, run = [], []
        for p in pages:
            run.append(p)
            if rng.random() < fragmentation:
                runs.append(run)
                run = []
        if run:
            runs.append(run)
        rng.shuffle(runs)
        self.free = [p for r in runs for p in r]
        self.never_used = set(pages)

    def alloc(self, n: int):
        if n > len(self.free):
            return None
        out, self.free = self.free[:n], self.free[n:]
        self.never_used.difference_update(out)
        return np.array(out, dtype=np.int32)

    def release(self, pages) -> None:
        self.free.extend(int(p) for p in pages)


def is_contiguous(pages) -> bool:
    return len(pages) < 2 or bool(np.all(np.diff(pages) == 1))


# ---------------------------------------------------------------------------------------------
# observation (wraps, never replaces, sglang's handlers)


class Observed:
    def __init__(self):
        self.lock = threading.Lock()
        self.abort_acks = []  # (frames as text)
        self.statuses = []

    def wrap_decode(self, mgr):
        orig_ack = mgr.handle_abort_ack_message
        orig_status = mgr.parse_kv_status_message

        def ack(msg):
            if msg and msg[0] == b"ABORT_ACK":
                with self.lock:
                    self.abort_acks.append([f.decode("ascii", "replace") for f in msg])
            return orig_ack(msg)

        def status(msg):
            parsed = orig_status(msg)
            with self.lock:
                self.statuses.append({"frames": len(msg), "parsed": None if parsed is None else [str(x) for x in parsed]})
            return parsed

        mgr.handle_abort_ack_message = ack
        mgr.parse_kv_status_message = status


# ---------------------------------------------------------------------------------------------
# modes


def run_bootstrap(args, sg: Sglang):
    server = sg.conn.MooncakeKVBootstrapServer(args.host, args.bootstrap_port)
    log.info("sglang %s bootstrap server on %s:%s", sg.version, args.host, args.bootstrap_port)
    emit({"mode": "bootstrap", "ready": True, "port": args.bootstrap_port})
    try:
        while server.thread.is_alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    return 0


def wait_bootstrap_ready(addr: str, deadline: float) -> bool:
    import requests

    url = f"http://{addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    while time.time() < deadline:
        try:
            r = requests.get(url, timeout=2)
            if r.status_code == 200:
                return True
        except Exception:
            pass
        time.sleep(0.2)
    return False


def run_decode(args, sg: Sglang):
    lay = layout_of(args)
    rng = random.Random(args.seed)
    pools = Pools(lay, args.pool_pages, args.aux_rows, args.contiguous_pool)
    mgr = sg.manager(args, "decode", pools)
    obs = Observed()
    obs.wrap_decode(mgr)
    log.info("sglang %s decode, session %s, layout %s", sg.version, mgr.get_session_id(), lay.describe())
    deadline = time.time() + args.deadline
    rooms = room_list(args)
    abort_set = set(csv_ints(args.abort_rooms))
    bad_page_set = set(csv_ints(args.bad_page_rooms))
    expect_failed = set(csv_ints(args.expect_failed)) | abort_set | bad_page_set
    alloc = PageAllocator(args.pool_pages, args.fragmentation, rng)
    free_rows = list(range(args.aux_rows))
    num_pages = -(-args.tokens // lay.page_size)
    addr = args.bootstrap_addr

    result = {r: {"room": r} for r in rooms}
    summary = {
        "mode": "decode",
        "sglang": sg.version,
        "session": mgr.get_session_id(),
        "layout": lay.describe(),
        "rooms": len(rooms),
        "pages_per_room": num_pages,
        "ok": 0,
        "failed": 0,
        "corrupt": 0,
        "expected_failed": 0,
        "unexpected_success": 0,
        "non_contiguous_rooms": 0,
        "bytes_verified": 0,
        "failure_reasons": {},
        "aborted": 0,
        "aborted_mid_transfer": 0,
        "timeout_aborts": 0,
        "abort_acked": 0,
        "abort_ack_generation_matched": 0,
        "late_writes": 0,
    }

    if not wait_bootstrap_ready(addr, deadline):
        summary["error"] = f"bootstrap server {addr} never answered the sentinel route with 200"
        emit(summary)
        return 1
    # sglang's decode scheduler: _ensure_prefill_info (try_ensure_parallel_info) first.
    while not mgr.try_ensure_parallel_info(addr):
        if time.time() > deadline:
            summary["error"] = f"no prefill parallel info from {addr}"
            emit(summary)
            return 1
        time.sleep(0.2)

    pending = list(rooms)
    active = {}  # room -> state dict
    aborted = {}  # room -> (receiver, pages, row, generation, snapshot, acked_at)
    t0 = time.time()

    def do_abort(room, st, mid_transfer):
        st["recv"].abort()
        summary["aborted"] += 1
        if mid_transfer:
            summary["aborted_mid_transfer"] += 1
        aborted[room] = {
            "recv": st["recv"], "pages": st["pages"], "row": st["row"], "t0": st["t0"],
            "generation": st["recv"]._abort_generation, "acked_at": None, "snap": None,
            "aborted_at": time.time(),
        }
        result[room].update({"abort_generation": st["recv"]._abort_generation, "aborted_mid_transfer": mid_transfer})
        del active[room]

    def finish(room, st, outcome, reason=None):
        result[room].update({"outcome": outcome, "reason": reason, "ms": round(1000 * (time.time() - st["t0"]), 1)})

    while (pending or active or aborted) and time.time() < deadline:
        # admit new rooms
        while pending and len(active) < args.concurrency:
            room = pending[0]
            pages = alloc.alloc(num_pages)
            if pages is None or not free_rows:
                break
            pending.pop(0)
            row = free_rows.pop(0)
            pools.clear_room(pages, row)
            recv = sg.conn.MooncakeKVReceiver(mgr, addr, room)
            recv.init(0)  # prefill_dp_rank 0
            active[room] = {"recv": recv, "pages": pages, "row": row, "sent": False, "t0": time.time(), "gate_since": None}
            if not is_contiguous(pages):
                summary["non_contiguous_rooms"] += 1
        progressed = False
        for room in list(active):
            st = active[room]
            recv = st["recv"]
            status = recv.poll()
            if status == WAITING and not st["sent"]:
                # decode.py _send_kv_metadata: page indices, aux (metadata buffer) index
                pages = st["pages"]
                if room in bad_page_set:
                    pages = pages.copy()
                    pages[-1] = args.pool_pages + 1000
                recv.send_metadata(pages, st["row"], None, decode_prefix_len=0)
                st["sent"] = True
                progressed = True
                if room in abort_set and args.abort_on == "metadata":
                    if args.abort_after_ms:
                        time.sleep(args.abort_after_ms / 1000.0)
                    do_abort(room, st, mid_transfer=None)
                continue
            if room in abort_set and st["sent"] and args.abort_on == "first-write":
                # abort once the prefill's first bytes landed and before it reported Success:
                # the prefill is still writing the room
                first = st["pages"][:1]
                if status == SUCCESS or status == FAILED:
                    do_abort(room, st, mid_transfer=False)
                    progressed = True
                elif any(pools.kv[b][first].any() for b in range(lay.num_buffers)):
                    do_abort(room, st, mid_transfer=True)
                    progressed = True
                continue
            if status == SUCCESS:
                # _apply_metadata_gate: Success counts only once bootstrap_room[row][0] != 0
                actual = int(pools.bootstrap_room[st["row"], 0])
                if actual == 0:
                    if st["gate_since"] is None:
                        st["gate_since"] = time.time()
                    if time.time() - st["gate_since"] < 10:
                        continue
                    reason = "Success but bootstrap_room never written (metadata gate)"
                    finish(room, st, "failed", reason)
                elif actual != room:
                    finish(room, st, "corrupt", f"bootstrap_room {actual} != {room}")
                else:
                    diff = pools.check_room(room, st["pages"], st["row"])
                    if diff is None:
                        finish(room, st, "ok")
                        summary["bytes_verified"] += num_pages * lay.item_len * lay.num_buffers + sum(kvx_pattern.AUX_ROW_LENS)
                    else:
                        finish(room, st, "corrupt", diff)
                recv.clear()
                pools.bootstrap_room[st["row"], 0] = 0  # clear_slot
                alloc.release(st["pages"])
                free_rows.append(st["row"])
                del active[room]
                progressed = True
            elif status == FAILED:
                with mgr.failure_lock:
                    reason = mgr.failure_records.get(room)
                finish(room, st, "failed", reason or "Failed (no reason recorded)")
                if recv.abort_notified and recv._abort_generation is not None:
                    # the decode itself sent ABORT (waiting timeout): like sglang's deferred
                    # release, hold the pages until the generation-matched ACK
                    summary["timeout_aborts"] += 1
                    result[room]["abort_generation"] = recv._abort_generation
                    aborted[room] = {
                        "recv": recv, "pages": st["pages"], "row": st["row"], "t0": st["t0"],
                        "generation": recv._abort_generation, "acked_at": None, "snap": None,
                        "aborted_at": time.time(), "keep_outcome": True,
                    }
                    del active[room]
                    progressed = True
                    continue
                recv.clear()
                alloc.release(st["pages"])
                free_rows.append(st["row"])
                del active[room]
                progressed = True
        # aborted rooms: wait for the generation-matched ACK (is_abort_release_safe), then
        # hold the pages a little longer and check nothing writes into them after the ACK.
        for room in list(aborted):
            ab = aborted[room]
            required = mgr.required_prefill_response_num_table.get(room, 1) or 1
            if ab["acked_at"] is None:
                if mgr.enable_deferred_decode_kv_release and mgr.is_abort_release_safe(room, required):
                    ab["acked_at"] = time.time()
                    ab["snap"] = pools.snapshot(ab["pages"])
                    result[room]["abort_ack"] = "generation matched"
                    result[room]["ack_ms"] = round(1000 * (ab["acked_at"] - ab["aborted_at"]), 1)
                elif not mgr.enable_deferred_decode_kv_release and time.time() - ab["aborted_at"] > 1.0:
                    ab["acked_at"] = time.time()
                    ab["snap"] = pools.snapshot(ab["pages"])
                elif time.time() - ab["aborted_at"] > args.abort_ack_timeout:
                    result[room]["abort_ack"] = "none (timed out)"
                    if not ab.get("keep_outcome"):
                        result[room].update({"outcome": "aborted", "reason": "no generation-matched ABORT_ACK"})
                    mgr.clear_deferred_abort_state(room)
                    ab["recv"].clear()
                    del aborted[room]
                    progressed = True
                continue
            if time.time() - ab["acked_at"] >= args.late_write_ms / 1000.0:
                late = pools.changed_since(ab["snap"], ab["pages"])
                result[room]["late_write"] = late
                if not ab.get("keep_outcome"):
                    result[room]["outcome"] = "aborted"
                if late:
                    summary["late_writes"] += 1
                if result[room].get("abort_ack") == "generation matched":
                    summary["abort_acked"] += 1
                mgr.clear_deferred_abort_state(room)
                ab["recv"].clear()
                pools.clear_room(ab["pages"], ab["row"])
                alloc.release(ab["pages"])
                free_rows.append(ab["row"])
                del aborted[room]
                progressed = True
        if not progressed:
            time.sleep(0.002)

    for room in pending:
        result[room].update({"outcome": "failed", "reason": "never started (deadline)"})
    for room, st in active.items():
        result[room].update({"outcome": "failed", "reason": f"deadline in {POLL_NAMES.get(st['recv'].poll())}"})
    for room, ab in aborted.items():
        result[room]["abort_ack"] = "none (deadline)"
        if not ab.get("keep_outcome"):
            result[room].update({"outcome": "aborted", "reason": "deadline while waiting for the ABORT_ACK"})

    for room in rooms:
        r = result[room]
        outcome = r.get("outcome", "failed")
        if room in expect_failed:
            if outcome == "ok":
                summary["unexpected_success"] += 1
            else:
                summary["expected_failed"] += 1
                reason = r.get("reason") or outcome
                ef = summary.setdefault("expected_failure_reasons", {})
                ef[reason] = ef.get(reason, 0) + 1
            continue
        if outcome == "ok":
            summary["ok"] += 1
        elif outcome == "corrupt":
            summary["corrupt"] += 1
        else:
            summary["failed"] += 1
        if outcome != "ok":
            reason = r.get("reason") or outcome
            summary["failure_reasons"][reason] = summary["failure_reasons"].get(reason, 0) + 1
    with obs.lock:
        summary["abort_acks_seen"] = list(obs.abort_acks)
        summary["status_frames"] = sorted({s["frames"] for s in obs.statuses})
        reasons = sorted({s["parsed"][3] for s in obs.statuses if s["parsed"] and len(s["parsed"]) > 3 and s["parsed"][3] != "None"})
        summary["status_reasons"] = reasons
    armed = [r for r in rooms if result[r].get("abort_generation") is not None]
    for room in armed:
        gen = result[room].get("abort_generation")
        if gen is not None and any(a[1:2] == [str(room)] and a[3:4] == [str(gen)] for a in summary["abort_acks_seen"]):
            summary["abort_ack_generation_matched"] += 1
    summary["stray_pages"] = pools.stray_pages(alloc.never_used)
    summary["wall_s"] = round(time.time() - t0, 2)
    summary["results"] = [result[r] for r in rooms]
    aborts_ok = all(
        result[r].get("abort_ack") == "generation matched" and not result[r].get("late_write")
        for r in armed
    ) if mgr.enable_deferred_decode_kv_release else True
    ok = (
        summary["ok"] == len(rooms) - len(expect_failed & set(rooms))
        and summary["unexpected_success"] == 0
        and summary["stray_pages"] == 0
        and summary["late_writes"] == 0
        and aborts_ok
    )
    summary["pass"] = ok
    emit(summary)
    return 0 if ok else 1


def run_prefill(args, sg: Sglang):
    lay = layout_of(args)
    rng = random.Random(args.seed ^ 0xFEED)
    pools = Pools(lay, args.pool_pages, args.aux_rows, args.contiguous_pool)
    server = None
    if args.serve_bootstrap:
        server = sg.conn.MooncakeKVBootstrapServer(args.host, args.bootstrap_port)
    mgr = sg.manager(args, "prefill", pools)
    log.info("sglang %s prefill rank, session %s, layout %s", sg.version, mgr.get_session_id(), lay.describe())
    deadline = time.time() + args.deadline
    rooms = room_list(args)
    hold = set(csv_ints(args.hold_rooms))
    expect_failed = set(csv_ints(args.expect_failed)) | hold
    alloc = PageAllocator(args.pool_pages, args.fragmentation, rng)
    free_rows = list(range(args.aux_rows))
    num_pages = -(-args.tokens // lay.page_size)
    addr = f"{args.host}:{args.bootstrap_port}"
    emit_ready = {"mode": "prefill", "ready": True, "session": mgr.get_session_id(), "bootstrap_port": args.bootstrap_port}
    emit(emit_ready)

    # the scheduler makes a sender per request as it arrives (router: both sides get the room)
    senders = {r: sg.conn.MooncakeKVSender(mgr, addr, r) for r in rooms}
    state = {r: {"t0": time.time(), "sent": False} for r in rooms}
    result = {r: {"room": r} for r in rooms}
    summary = {
        "mode": "prefill",
        "sglang": sg.version,
        "session": mgr.get_session_id(),
        "layout": lay.describe(),
        "rooms": len(rooms),
        "pages_per_room": num_pages,
        "ok": 0,
        "failed": 0,
        "expected_failed": 0,
        "unexpected_success": 0,
        "chunks_sent": 0,
        "non_contiguous_rooms": 0,
        "failure_reasons": {},
    }
    open_rooms = set(rooms)
    t0 = time.time()
    while open_rooms and time.time() < deadline:
        progressed = False
        for room in list(open_rooms):
            s = senders[room]
            st = state[room]
            status = s.poll()
            if status == WAITING and not st["sent"] and room not in hold:
                pages = alloc.alloc(num_pages)
                if pages is None or not free_rows:
                    continue
                row = free_rows.pop(0)
                st.update({"pages": pages, "row": row, "sent": True})
                if not is_contiguous(pages):
                    summary["non_contiguous_rooms"] += 1
                # the forward pass
                pools.fill_room(room, pages, row, kv_room=room + 1 if args.pattern == "shifted" else None)
                s.init(num_pages, row)
                step = max(1, args.chunk_pages)
                for start in range(0, num_pages, step):
                    s.send(pages[start:start + step])
                    summary["chunks_sent"] += 1
                progressed = True
            elif status in (SUCCESS, FAILED):
                if status == FAILED:
                    with mgr.failure_lock:
                        reason = mgr.failure_records.get(room)
                    result[room].update({"outcome": "failed", "reason": reason or "Failed"})
                else:
                    result[room].update({"outcome": "ok"})
                result[room]["ms"] = round(1000 * (time.time() - st["t0"]), 1)
                s.clear()
                if "pages" in st:
                    alloc.release(st["pages"])
                    free_rows.append(st["row"])
                open_rooms.discard(room)
                progressed = True
        if not progressed:
            time.sleep(0.002)
    for room in open_rooms:
        result[room].update({"outcome": "failed", "reason": f"deadline in {POLL_NAMES.get(senders[room].poll())}"})
    for room in rooms:
        outcome = result[room].get("outcome")
        if room in expect_failed:
            summary["unexpected_success" if outcome == "ok" else "expected_failed"] += 1
            continue
        if outcome == "ok":
            summary["ok"] += 1
        else:
            summary["failed"] += 1
            reason = result[room].get("reason") or "?"
            summary["failure_reasons"][reason] = summary["failure_reasons"].get(reason, 0) + 1
    summary["wall_s"] = round(time.time() - t0, 2)
    summary["results"] = [result[r] for r in rooms]
    ok = summary["ok"] == len(rooms) - len(expect_failed & set(rooms)) and summary["unexpected_success"] == 0
    summary["pass"] = ok
    if args.linger > 0:
        time.sleep(args.linger)
    emit(summary)
    return 0 if ok else 1


def run_selftest(args):
    """Compare the numpy pattern with what kvx wrote (lines: `kv room buffer page hex` /
    `aux room index hex`, with the layout given by the flags)."""
    lay = layout_of(args)
    n = bad = 0
    with open(args.expect) as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            if parts[0] == "kv":
                room, buffer, page, hexs = int(parts[1]), int(parts[2]), int(parts[3]), parts[4]
                got = lay.fill_kv(room, buffer, page).hex()
            elif parts[0] == "aux":
                room, index, hexs = int(parts[1]), int(parts[2]), parts[3]
                got = kvx_pattern.aux_row(room, index, len(hexs) // 2).tobytes().hex()
            else:
                continue
            n += 1
            if got != hexs:
                bad += 1
                if bad <= 3:
                    log.error("mismatch: %s (python %s…)", " ".join(parts[:-1]), got[:32])
    emit({"mode": "selftest", "layout": lay.describe(), "checked": n, "mismatched": bad, "pass": n > 0 and bad == 0})
    return 0 if n > 0 and bad == 0 else 1


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO),
        format=f"[%(asctime)s {args.mode}] %(name)s %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    import warnings

    warnings.filterwarnings("ignore", message="Only .* support")
    if args.mode == "selftest":
        return run_selftest(args)
    set_env(args)
    sg = Sglang()
    if args.mode == "bootstrap":
        return run_bootstrap(args, sg)
    if args.mode == "decode":
        return run_decode(args, sg)
    return run_prefill(args, sg)


if __name__ == "__main__":
    sys.exit(main())
