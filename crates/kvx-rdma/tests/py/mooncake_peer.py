#!/usr/bin/env python3
"""A real Mooncake Transfer Engine peer for kvx's mooncake interop tests.

Modes (one JSON object per line on stdout, commands as JSON lines on stdin):

  target    --buffers N,N,...   registers zeroed buffers; prints
            {"event":"ready","session":...,"buffers":[{"addr":A,"len":N},...]}
            then answers {"cmd":"crc","ranges":[[addr,len],...]} with
            {"event":"crc","crcs":[...]} (zlib crc32 of each range) until {"cmd":"quit"}.
  initiator --src-bytes N       registers a source buffer of N random bytes; prints
            {"event":"ready","src":A,"len":N}; then for
            {"cmd":"write","session":S,"entries":[[src_off,dst,len],...]} calls
            batch_transfer_sync_write and prints
            {"event":"written","rc":RC,"crcs":[crc32 of each source range],"secs":T}.

The engine's own output is sent to stderr so that stdout carries only these events.
MC_TCP_PROTO / MC_TCP_ENABLE_CONNECTION_POOL in the environment are honoured by the engine.
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


def engine():
    e = TransferEngine()
    rc = e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        emit(event="error", detail=f"initialize returned {rc}")
        sys.exit(2)
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


def target(args):
    e = engine()
    sizes = [int(s) for s in args.buffers.split(",") if s]
    bufs = [(ctypes.c_ubyte * n)() for n in sizes]
    addrs = [ctypes.addressof(b) for b in bufs]
    rc = e.batch_register_memory(addrs, sizes)
    if rc != 0:
        emit(event="error", detail=f"batch_register_memory returned {rc}")
        sys.exit(2)
    session = f"127.0.0.1:{e.get_rpc_port()}"
    emit(event="ready", session=session,
         buffers=[{"addr": a, "len": n} for a, n in zip(addrs, sizes)])
    for cmd in commands():
        if cmd["cmd"] == "crc":
            emit(event="crc", crcs=[crc(a, n) for a, n in cmd["ranges"]])
        else:
            emit(event="error", detail=f"unknown command {cmd}")
    del bufs


def initiator(args):
    e = engine()
    n = args.src_bytes
    src = (ctypes.c_ubyte * n)()
    addr = ctypes.addressof(src)
    ctypes.memmove(addr, os.urandom(n), n)
    rc = e.register_memory(addr, n)
    if rc != 0:
        emit(event="error", detail=f"register_memory returned {rc}")
        sys.exit(2)
    emit(event="ready", src=addr, len=n)
    for cmd in commands():
        if cmd["cmd"] == "write":
            entries = cmd["entries"]
            t0 = time.monotonic()
            rc = e.batch_transfer_sync_write(
                cmd["session"],
                [addr + off for off, _, _ in entries],
                [dst for _, dst, _ in entries],
                [ln for _, _, ln in entries],
            )
            secs = time.monotonic() - t0
            emit(event="written", rc=rc, secs=secs,
                 crcs=[crc(addr + off, ln) for off, _, ln in entries])
        else:
            emit(event="error", detail=f"unknown command {cmd}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["target", "initiator"])
    p.add_argument("--buffers", default="1048576")
    p.add_argument("--src-bytes", type=int, default=1 << 20)
    args = p.parse_args()
    if args.mode == "target":
        target(args)
    else:
        initiator(args)


if __name__ == "__main__":
    main()
