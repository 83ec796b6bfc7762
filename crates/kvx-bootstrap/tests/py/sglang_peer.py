#!/usr/bin/env python3
"""A stand-in for sglang's PD-disaggregation peer, speaking its wire format with pyzmq and
requests the way sglang's Mooncake connector does (spec: sglang-protocol.md §1.2, §2, §3).

Modes:
  http     check a bootstrap server's routes, codes, texts and JSON bytes as sglang sees them
  decode   act as a decode rank against a kvx prefill rank (ZMQ + HTTP)
  prefill  act as a prefill rank against a kvx decode rank (ZMQ + HTTP)

Every event is one JSON line on stdout (frames as hex) so the Rust test can check the bytes;
any mismatch exits non-zero with the reason on stderr.
"""

import argparse
import dataclasses
import json
import struct
import sys
from typing import List, Optional

import requests
import zmq

TIMEOUT_MS = 20000


def emit(**event):
    print(json.dumps(event), flush=True)


def fail(msg):
    print(f"sglang_peer: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def hexes(frames):
    return [f.hex() for f in frames]


# --- sglang's encodings ---------------------------------------------------------------------

def pack_int_lists(lists, fmt):
    """Packed int lists: u32 count, u32 byte length per list, then the payloads (all LE)."""
    if not lists:
        return b""
    payloads = [struct.pack(f"<{len(l)}{fmt}", *l) for l in lists]
    return (struct.pack("<I", len(lists))
            + b"".join(struct.pack("<I", len(p)) for p in payloads)
            + b"".join(payloads))


def unpack_int_lists(data, fmt):
    if not data:
        return []
    (n,) = struct.unpack_from("<I", data, 0)
    lens = struct.unpack_from(f"<{n}I", data, 4)
    off = 4 + 4 * n
    width = struct.calcsize(fmt)
    out = []
    for ln in lens:
        out.append(list(struct.unpack_from(f"<{ln // width}{fmt}", data, off)))
        off += ln
    return out


def ascii_int(n):
    return str(n).encode("ascii")


@dataclasses.dataclass
class PrefillServerInfo:
    """The sentinel answer as sglang's decode builds it: PrefillServerInfo(**json)."""
    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: Optional[int]
    kv_cache_dtype: Optional[str]
    follow_bootstrap_room: bool
    enable_dsa_cache_layer_split: bool = False
    prefill_http_port: Optional[int] = None
    target_tp_rank: Optional[int] = None
    target_tp_ranks: Optional[List[int]] = None
    target_cp_ranks: Optional[List[int]] = None
    target_pp_ranks: Optional[List[int]] = None
    required_dst_info_num: Optional[int] = None
    required_prefill_response_num: Optional[int] = None


def route_put_body(tp_size, tp_rank, rank_ip, rank_port):
    return {
        "attn_tp_size": tp_size, "attn_tp_rank": tp_rank,
        "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": 1, "attn_dp_rank": 0,
        "pp_size": 1, "pp_rank": 0,
        "system_dp_size": 1, "system_dp_rank": 0,
        "rank_ip": rank_ip, "rank_port": rank_port,
        "page_size": 64, "kv_cache_dtype": "auto",
        "load_balance_method": "follow_bootstrap_room",
        "enable_dsa_cache_layer_split": False,
        "prefill_http_port": 30000,
    }


def route_url(base, dp, cp, tp, pp):
    return (f"{base}/route?prefill_dp_rank={dp}&prefill_cp_rank={cp}"
            f"&target_tp_rank={tp}&target_pp_rank={pp}")


def tcp_addr(host, port):
    """sglang's format_tcp_address: IPv6 hosts bracketed."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def pull_socket(ctx, host):
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    if ":" in host:
        pull.setsockopt(zmq.IPV6, 1)
        return pull, pull.bind_to_random_port(f"tcp://[{host}]")
    return pull, pull.bind_to_random_port(f"tcp://{host}")


def session():
    s = requests.Session()
    s.trust_env = False  # never a proxy
    return s


# --- http mode ------------------------------------------------------------------------------

def run_http(base, room):
    s = session()
    r = s.get(f"{base}/health", timeout=(2, 3))
    check((r.status_code, r.text) == (200, "OK"), f"health: {r.status_code} {r.text!r}")
    r = s.get(route_url(base, -1, -1, -1, -1), timeout=5)
    check((r.status_code, r.text) ==
          (503, "Prefill server not fully registered yet (0 workers registered)."),
          f"not-ready sentinel: {r.status_code} {r.text!r}")
    r = s.get(f"{base}/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0", timeout=5)
    check((r.status_code, r.text) == (400, "Missing inputs for bootstrap server."),
          f"missing inputs: {r.status_code} {r.text!r}")
    for method in ("POST", "DELETE"):
        r = s.request(method, f"{base}/route", timeout=5)
        check((r.status_code, r.text) == (405, "Method not allowed"),
              f"{method} /route: {r.status_code} {r.text!r}")

    for tp_rank in (0, 1):
        r = s.put(f"{base}/route", json=route_put_body(2, tp_rank, "127.0.0.1", 7000 + tp_rank),
                  timeout=5)
        check((r.status_code, r.text) == (200, "OK"), f"PUT /route: {r.status_code} {r.text!r}")

    r = s.get(route_url(base, -1, -1, -1, -1), timeout=5)
    check(r.status_code == 200, f"sentinel: {r.status_code} {r.text!r}")
    try:
        info = PrefillServerInfo(**r.json())  # what sglang's decode does: unknown keys raise
    except TypeError as e:
        fail(f"PrefillServerInfo(**json) raised {e}")
    check(r.text == json.dumps(dataclasses.asdict(info)),
          f"sentinel bytes differ from aiohttp's json_response: {r.text!r}")
    check((info.attn_tp_size, info.dp_size, info.page_size, info.kv_cache_dtype,
           info.follow_bootstrap_room, info.prefill_http_port) == (2, 1, 64, "auto", True, 30000),
          f"topology {info}")
    emit(event="sentinel", body=r.text)

    r = s.get(route_url(base, 0, 0, 1, 0), timeout=5)
    check(r.status_code == 200 and r.json() == {"rank_ip": "127.0.0.1", "rank_port": 7001},
          f"rank route: {r.status_code} {r.text!r}")
    check(r.text == json.dumps(r.json()), f"rank route bytes: {r.text!r}")
    r = s.get(route_url(base, 0, 0, 2, 0), timeout=5)
    check((r.status_code, r.text) ==
          (404, "Bootstrap info not found for dp_rank=0 cp_rank=0 tp_rank=2 pp_rank=0"),
          f"unknown rank: {r.status_code} {r.text!r}")

    r = s.post(f"{base}/register_dp_rank", json={"bootstrap_room": room, "dp_rank": 0}, timeout=5)
    check((r.status_code, r.text) == (200, "OK"), f"register_dp_rank: {r.status_code}")
    r = s.post(f"{base}/query_dp_ranks", json={"bootstrap_rooms": [room, 5]}, timeout=5)
    check(r.status_code == 200 and r.json() == {str(room): 0}, f"query_dp_ranks: {r.text!r}")
    check(r.text == json.dumps({str(room): 0}), f"query_dp_ranks bytes: {r.text!r}")
    emit(event="done", ok=True)


# --- decode mode: Python is the decode, kvx the prefill ---------------------------------------

REG = dict(
    kv_ptrs=[0x7F12A0000000, 0x7F12B0000000],
    aux_ptrs=[0x7F1300000000 + 0x1000 * i for i in range(3)],
    state_ptrs=[[0x7F1400000000]],
    tp_rank=0, tp_size=1, kv_item_len=2048,
    state_item_lens=[[4096]], state_dims=[[128]],
    kv_layer_ids=[0, 0], state_layer_ids=[[3]],
    dcp_size=1, dcp_rank=0,
)


def registration_frames(ip, port, sess):
    r = REG
    return [
        b"None", ip.encode("ascii"), ascii_int(port), sess.encode("ascii"),
        b"".join(struct.pack("Q", p) for p in r["kv_ptrs"]),
        b"".join(struct.pack("Q", p) for p in r["aux_ptrs"]),
        pack_int_lists(r["state_ptrs"], "Q"),
        ascii_int(r["tp_rank"]), ascii_int(r["tp_size"]), ascii_int(r["kv_item_len"]),
        pack_int_lists(r["state_item_lens"], "I"),
        pack_int_lists(r["state_dims"], "I"),
        struct.pack(f"<{len(r['kv_layer_ids'])}I", *r["kv_layer_ids"]),
        pack_int_lists(r["state_layer_ids"], "I"),
        b"", b"",
        ascii_int(r["dcp_size"]), ascii_int(r["dcp_rank"]),
    ]


def metadata_frames(room, ip, port, sess, pages, aux, state, dummy=False):
    if dummy:
        dst = [b"", b"", b""]
    else:
        dst = [struct.pack(f"<{len(pages)}i", *pages), ascii_int(aux), pack_int_lists(state, "i")]
    return [ascii_int(room), ip.encode("ascii"), ascii_int(port), sess.encode("ascii"),
            *dst, b"1", b"0", b""]


def run_decode(base, room, dummy_room, host):
    s = session()
    r = s.get(route_url(base, -1, -1, -1, -1), timeout=5)
    check(r.status_code == 200, f"sentinel: {r.status_code} {r.text!r}")
    try:
        info = PrefillServerInfo(**r.json())
    except TypeError as e:
        fail(f"PrefillServerInfo(**json) raised {e}")
    r = s.get(route_url(base, 0, 0, 0, 0), timeout=5)
    check(r.status_code == 200, f"rank route: {r.status_code} {r.text!r}")
    rank = r.json()
    emit(event="route", info=dataclasses.asdict(info), rank=rank)

    ctx = zmq.Context()
    pull, my_port = pull_socket(ctx, host)
    sess = f"[{host}]:15234" if ":" in host else f"{host}:15234"

    push = ctx.socket(zmq.PUSH)  # S3: decode -> prefill
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDTIMEO, 1000)
    if ":" in rank["rank_ip"]:
        push.setsockopt(zmq.IPV6, 1)
    push.connect(tcp_addr(rank["rank_ip"], rank["rank_port"]))

    sent = [
        [b"hello kvx"],  # garbage first: the prefill inbox must drop it and live on
        registration_frames(host, my_port, sess),
        metadata_frames(room, host, my_port, sess, [5, 6, 7, 12], 17, [[42]]),
        metadata_frames(dummy_room, host, my_port, sess, [], 0, [], dummy=True),
        [b"ABORT", ascii_int(dummy_room), host.encode("ascii"), ascii_int(my_port)],
    ]
    for frames in sent:
        push.send_multipart(frames)
        emit(event="sent", frames=hexes(frames))

    # What sglang K's decode thread does with each message.
    for _ in range(2):
        try:
            msg = pull.recv_multipart()
        except zmq.Again:
            fail("no reply from the kvx prefill")
        if msg[0] == b"ABORT_ACK":
            parsed = {"kind": "abort_ack", "room": int(msg[1].decode("ascii"))}
        else:
            try:
                b_room, status, prefill_rank = msg  # K unpacks exactly three frames
            except ValueError:
                fail(f"status with {len(msg)} frames would kill a K decode thread")
            parsed = {"kind": "status", "room": int(b_room.decode("ascii")),
                      "status": int(status.decode("ascii")),
                      "prefill_rank": int(prefill_rank.decode("ascii"))}
        emit(event="recv", frames=hexes(msg), parsed=parsed)
    emit(event="done", ok=True)


# --- prefill mode: Python is the prefill, kvx the decode --------------------------------------

def parse_registration(msg):
    """sglang's KVArgsRegisterInfo.from_zmq, restated."""
    n = len(msg)
    return {
        "room": msg[0].decode("ascii"),
        "endpoint": msg[1].decode("ascii"),
        "dst_port": int(msg[2].decode("ascii")),
        "session": msg[3].decode("ascii"),
        "kv_ptrs": list(struct.unpack(f"{len(msg[4]) // 8}Q", msg[4])),
        "aux_ptrs": list(struct.unpack(f"{len(msg[5]) // 8}Q", msg[5])),
        "state_ptrs": unpack_int_lists(msg[6], "Q"),
        "tp_rank": int(msg[7].decode("ascii")),
        "tp_size": int(msg[8].decode("ascii")),
        "kv_item_len": int(msg[9].decode("ascii")),
        "state_item_lens": unpack_int_lists(msg[10], "I") if n > 10 else [],
        "state_dims": unpack_int_lists(msg[11], "I") if n > 11 else [],
        "kv_layer_ids": list(struct.unpack(f"<{len(msg[12]) // 4}I", msg[12])) if n > 12 else [],
        "state_layer_ids": unpack_int_lists(msg[13], "I") if n > 13 else [],
        "staging": len(msg[14]) == 8 or (n > 15 and len(msg[15]) > 0) if n > 14 else False,
        "dcp_size": int(msg[16].decode("ascii")) if n > 16 and msg[16] else 1,
        "dcp_rank": int(msg[17].decode("ascii")) if n > 17 and msg[17] else 0,
        "frames": n,
    }


def parse_metadata(msg):
    """sglang's TransferInfo.from_zmq, restated."""
    dummy = msg[4] == b"" and msg[5] == b""
    return {
        "room": int(msg[0].decode("ascii")),
        "endpoint": msg[1].decode("ascii"),
        "dst_port": int(msg[2].decode("ascii")),
        "session": msg[3].decode("ascii"),
        "dst_kv_indices": list(struct.unpack(f"<{len(msg[4]) // 4}i", msg[4])),
        "dst_aux_index": None if dummy else int(msg[5].decode("ascii")),
        "dst_state_indices": [] if dummy else unpack_int_lists(msg[6], "i"),
        "required_dst_info_num": int(msg[7].decode("ascii")),
        "is_dummy": dummy,
        "decode_prefix_len": int(msg[8].decode("ascii")) if len(msg) > 8 and msg[8] else None,
        "frames": len(msg),
    }


def run_prefill(base, room, dummy_room):
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    my_port = pull.bind_to_random_port("tcp://127.0.0.1")

    s = session()
    r = s.put(f"{base}/route", json=route_put_body(1, 0, "127.0.0.1", my_port), timeout=5)
    check((r.status_code, r.text) == (200, "OK"), f"PUT /route: {r.status_code} {r.text!r}")
    emit(event="registered", port=my_port)

    decode = None
    for _ in range(3):
        try:
            msg = pull.recv_multipart()
        except zmq.Again:
            fail("nothing from the kvx decode")
        head = msg[0]
        if head == b"None":
            parsed = parse_registration(msg)
            decode = (parsed["endpoint"], parsed["dst_port"])
        elif head == b"ABORT":
            parsed = {"room": int(msg[1].decode("ascii")), "endpoint": msg[2].decode("ascii"),
                      "dst_port": int(msg[3].decode("ascii"))}
        else:
            parsed = parse_metadata(msg)
        emit(event="recv", frames=hexes(msg), parsed=parsed)
    check(decode is not None, "no registration received")

    push = ctx.socket(zmq.PUSH)  # S4: prefill -> decode, sglang's options
    push.setsockopt(zmq.RECONNECT_IVL, -1)
    push.setsockopt(zmq.SNDTIMEO, 30000)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.TCP_KEEPALIVE, 1)
    push.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
    push.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 5)
    push.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
    push.connect(f"tcp://{decode[0]}:{decode[1]}")
    row = bytes(range(8))
    out = [
        [b"AUX_DATA", ascii_int(room), b"0", b"17", struct.pack(">I", len(row)), row],
        [ascii_int(room), b"4", b"0"],
        [b"garbage"],
        [b"ABORT_ACK", ascii_int(dummy_room), b"0"],
        [ascii_int(dummy_room), b"0", b"0", b"Aborted by the decode."],
        [b"CHUNK_READY", ascii_int(room), b"0", b"0", b"4", b"127.0.0.1:15234", b"0"],
    ]
    for frames in out:
        push.send_multipart(frames)
        emit(event="sent", frames=hexes(frames))
    emit(event="done", ok=True)
    # Let libzmq flush before the process exits (LINGER=0 would drop queued messages).
    pull.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    try:
        pull.recv_multipart()  # the kvx side sends a final "bye" once it has read everything
    except zmq.Again:
        fail("the kvx decode never confirmed")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["http", "decode", "prefill"])
    ap.add_argument("--bootstrap", required=True, help="host:port of the bootstrap server")
    ap.add_argument("--room", type=int, default=1234567890123456789)
    ap.add_argument("--dummy-room", type=int, default=987654321)
    ap.add_argument("--host", default="127.0.0.1", help="this peer's IP (IPv6 without brackets)")
    a = ap.parse_args()
    base = f"http://{a.bootstrap}"  # host:port, IPv6 hosts already bracketed
    if a.mode == "http":
        run_http(base, a.room)
    elif a.mode == "decode":
        run_decode(base, a.room, a.dummy_room, a.host)
    else:
        run_prefill(base, a.room, a.dummy_room)


if __name__ == "__main__":
    main()
