#!/usr/bin/env python3
"""A real Mooncake Transfer Engine peer for kvx's interop benchmark (benches/benches/interop.rs).

Same approach as crates/kvx-rdma/tests/py/mooncake_peer.py: one JSON object per line on stdout,
commands as JSON lines on stdin, the engine's own output on stderr. Both modes fill or clear
memory with cheap periodic copies so that 1 GiB is ready in well under a second.

  target    --count N --bytes B   registers N zeroed buffers of B bytes each; prints
            {"event":"ready","session":...,"buffers":[A0,A1,...]}; then answers
            {"cmd":"crc","ranges":[[addr,len],...]}  -> {"event":"crc","crcs":[...]}
            {"cmd":"clear"}                          -> {"event":"cleared"} (every buffer zeroed)
            until {"cmd":"quit"}.
  initiator --src-bytes N --pattern FILE
            registers a source buffer of N bytes holding FILE's bytes repeated (the bench writes
            the same pattern into its own source, so both initiators send identical bytes);
            prints {"event":"ready","src":A,"len":N}; then
            {"cmd":"plan","name":K,"session":S,"entries":[[src_off,dst,len],...],"batch":M}
                -> {"event":"planned","batches":B}   (lists built once, outside any timing)
            {"cmd":"run","name":K}
                -> {"event":"ran","rc":RC,"secs":T,"failed_batch":I|null}
                   every batch through batch_transfer_sync_write, one after the other; T is
                   the wall time of all of them (perf_counter)
            {"cmd":"lat","session":S,"src_off":O,"dst":D,"len":L,"count":C,"warmup":W}
                -> {"event":"lat","rc":RC,"secs":[...]}   C single-entry writes, each timed
            until {"cmd":"quit"}.
"""

import argparse
import ctypes
import json
import os
import sys
import time
import zlib

# Keep stdout for events; anything the engine prints goes to stderr.
_events = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)

from mooncake.engine import TransferEngine  # noqa: E402


def emit(**kw):
    _events.write(json.dumps(kw) + "\n")
    _events.flush()


def fail(detail):
    emit(event="error", detail=detail)
    sys.exit(2)


def engine():
    e = TransferEngine()
    rc = e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        fail(f"initialize returned {rc}")
    return e


def commands():
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        if cmd.get("cmd") == "quit":
            return
        yield cmd


def crc(addr, n):
    return zlib.crc32(ctypes.string_at(addr, n)) & 0xFFFFFFFF


def periodic_fill(addr, n, block):
    """Writes `block` repeated over [addr, addr+n): one copy, then doubling copies of whole
    periods (every copied prefix is a multiple of the period, so the period is kept)."""
    p = len(block)
    first = min(p, n)
    ctypes.memmove(addr, block, first)
    have = first
    while have < n:
        k = min(have, n - have)
        ctypes.memmove(addr + have, addr, k)
        have += k


def target(args):
    e = engine()
    bufs = [(ctypes.c_ubyte * args.bytes)() for _ in range(args.count)]
    addrs = [ctypes.addressof(b) for b in bufs]
    rc = e.batch_register_memory(addrs, [args.bytes] * args.count)
    if rc != 0:
        fail(f"batch_register_memory returned {rc}")
    session = f"127.0.0.1:{e.get_rpc_port()}"
    emit(event="ready", session=session, buffers=addrs)
    for cmd in commands():
        if cmd["cmd"] == "crc":
            emit(event="crc", crcs=[crc(a, n) for a, n in cmd["ranges"]])
        elif cmd["cmd"] == "clear":
            for a in addrs:
                ctypes.memset(a, 0, args.bytes)
            emit(event="cleared")
        else:
            emit(event="error", detail=f"unknown command {cmd}")
    del bufs


def initiator(args):
    e = engine()
    n = args.src_bytes
    src = (ctypes.c_ubyte * n)()
    addr = ctypes.addressof(src)
    with open(args.pattern, "rb") as f:
        block = f.read()
    if not block:
        fail("empty pattern file")
    periodic_fill(addr, n, block)
    rc = e.register_memory(addr, n)
    if rc != 0:
        fail(f"register_memory returned {rc}")
    emit(event="ready", src=addr, len=n)
    plans = {}
    for cmd in commands():
        c = cmd["cmd"]
        if c == "plan":
            entries, m = cmd["entries"], max(1, int(cmd["batch"]))
            batches = []
            for i in range(0, len(entries), m):
                part = entries[i:i + m]
                batches.append(([addr + off for off, _, _ in part],
                                [dst for _, dst, _ in part],
                                [ln for _, _, ln in part]))
            plans[cmd["name"]] = (cmd["session"], batches)
            emit(event="planned", batches=len(batches))
        elif c == "run":
            session, batches = plans[cmd["name"]]
            rc, failed = 0, None
            t0 = time.perf_counter()
            for i, (s, d, ln) in enumerate(batches):
                rc = e.batch_transfer_sync_write(session, s, d, ln)
                if rc != 0:
                    failed = i
                    break
            secs = time.perf_counter() - t0
            emit(event="ran", rc=rc, secs=secs, failed_batch=failed)
        elif c == "lat":
            session, s, d, ln = cmd["session"], [addr + cmd["src_off"]], [cmd["dst"]], [cmd["len"]]
            rc = 0
            for _ in range(cmd["warmup"]):
                rc = e.batch_transfer_sync_write(session, s, d, ln)
                if rc != 0:
                    break
            secs = []
            if rc == 0:
                for _ in range(cmd["count"]):
                    t0 = time.perf_counter()
                    rc = e.batch_transfer_sync_write(session, s, d, ln)
                    secs.append(time.perf_counter() - t0)
                    if rc != 0:
                        break
            emit(event="lat", rc=rc, secs=secs)
        else:
            emit(event="error", detail=f"unknown command {cmd}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["target", "initiator"])
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--bytes", type=int, default=1 << 20)
    p.add_argument("--src-bytes", type=int, default=1 << 20)
    p.add_argument("--pattern", default="")
    args = p.parse_args()
    if args.mode == "target":
        target(args)
    else:
        initiator(args)


if __name__ == "__main__":
    main()
