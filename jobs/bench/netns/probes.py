"""Tiny TCP tools run inside the namespaces (``python -c``) to measure the link: a bulk
sender and a receiver that times the bytes it got, and a 1-byte echo server with its ping
client. Each prints one JSON line (the receiver and the echo server print ``ready`` first)."""

from __future__ import annotations

import textwrap

__all__ = ["ECHO", "PING", "RECEIVER", "SENDER"]

RECEIVER = textwrap.dedent("""
    import json, socket, sys, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
    print("ready", flush=True)
    c, _ = s.accept(); c.settimeout(60)
    n, first, last = 0, None, None
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        now = time.perf_counter()
        first = now if first is None else first
        last, n = now, n + len(b)
    print(json.dumps({"bytes": n, "seconds": max(1e-9, (last or 0) - (first or 0))}), flush=True)
""")

SENDER = textwrap.dedent("""
    import socket, sys, time
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
    buf, end = b"x" * (64 << 10), time.perf_counter() + float(sys.argv[3])
    while time.perf_counter() < end:
        c.sendall(buf)
    c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
""")

ECHO = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
    print("ready", flush=True)
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        b = c.recv(1)
        if not b:
            break
        c.sendall(b)
""")

PING = textwrap.dedent("""
    import json, socket, statistics, sys, time
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(int(sys.argv[3])):
        t = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtts.append(time.perf_counter() - t)
    c.close()
    print(json.dumps({"median_s": statistics.median(rtts), "min_s": min(rtts), "count": len(rtts)}))
""")
