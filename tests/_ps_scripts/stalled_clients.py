"""Honest-call latency of a parameter server while N authenticated clients stall their bodies.

Usage: stalled_clients.py [N] [SECONDS]   (default 40 clients, watched for 15 s)

The server runs in a subprocess (127.0.0.1 only). Each stalled client is a raw HTTP/2 connection
(written here by hand, so the attack does not depend on a gRPC client library): it sends a Push's
headers with the right token and 16 bytes of a message that declares 1 MiB, then sends nothing
more, keeping its connection open. Meanwhile an honest client calls Status every 0.25 s (5 s
deadline). Prints one JSON line: honest latencies (max, median), errors, and the server's RSS.
"""

import json
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np

from jaxdist.ps.transport import GrpcClient

SERVER = r"""
import sys
import numpy as np
from jaxdist.ps import optimizer
from jaxdist.ps.server import ServerConfig
from jaxdist.ps.transport import PS_SERVICE, GrpcClient, PSService, serve
service = PSService(0)
server, port = serve("127.0.0.1:0", PS_SERVICE, service.methods(), token="t",
                     **({"limits": service.receive_limit}
                        if hasattr(service, "receive_limit") else {}))
c = GrpcClient(f"127.0.0.1:{port}", token="t", timeout=10)
c.init(0, {"w": np.zeros(1024, np.float32)}, optimizer("sgd", learning_rate=1.0), ServerConfig())
print(port, flush=True)
sys.stdin.read()
print(next(int(line.split()[1]) for line in open("/proc/self/status")
           if line.startswith("VmHWM")) / 1024, flush=True)
"""


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(
        ">I", stream) + payload


def _literal(name: str, value: str) -> bytes:  # HPACK: literal without indexing, new name
    n, v = name.encode(), value.encode()
    assert len(n) < 127 and len(v) < 127
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


def stall(port: int, stop: threading.Event) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b""))
    headers = b"".join(_literal(k, v) for k, v in (
        (":method", "POST"), (":scheme", "http"), (":path", "/jaxdist.ps.ParameterServer/Push"),
        (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"),
        ("te", "trailers"), ("x-jaxdist-token", "t")))
    s.sendall(_frame(1, 4, 1, headers))  # HEADERS, END_HEADERS
    s.sendall(_frame(0, 0, 1, b"\x00" + struct.pack(">I", 1 << 20) + b"\x00" * 16))

    def acks():  # answer SETTINGS and PINGs so the connection stays healthy
        buf = b""
        while not stop.is_set():
            try:
                data = s.recv(65536)
            except OSError:
                return
            if not data:
                return
            buf += data
            while len(buf) >= 9:
                length = int.from_bytes(buf[:3], "big")
                if len(buf) < 9 + length:
                    break
                kind, flags, body = buf[3], buf[4], buf[9:9 + length]
                buf = buf[9 + length:]
                try:
                    if kind == 4 and not flags & 1:
                        s.sendall(_frame(4, 1, 0, b""))
                    elif kind == 6 and not flags & 1:
                        s.sendall(_frame(6, 1, 0, body))
                except OSError:
                    return

    threading.Thread(target=acks, daemon=True).start()
    stop.wait()
    s.close()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    watch_s = float(sys.argv[2]) if len(sys.argv) > 2 else 15.0
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    stop = threading.Event()
    try:
        port = int(proc.stdout.readline())
        honest = GrpcClient(f"127.0.0.1:{port}", token="t", timeout=5)
        honest.status()
        base = []
        for _ in range(5):
            t = time.monotonic()
            honest.status(timeout=5)
            base.append(time.monotonic() - t)
        for _ in range(n):
            threading.Thread(target=stall, args=(port, stop), daemon=True).start()
        time.sleep(0.2)
        lat, errors = [], []
        end = time.monotonic() + watch_s
        while time.monotonic() < end:
            t = time.monotonic()
            try:
                honest.status(timeout=5)
                lat.append(time.monotonic() - t)
            except Exception as e:  # noqa: BLE001 - reported
                errors.append(type(e).__name__)
                lat.append(time.monotonic() - t)
            time.sleep(0.25)
        stop.set()
        proc.stdin.close()
        peak = float(proc.stdout.readline())
    finally:
        stop.set()
        proc.kill()
        proc.wait()
    print(json.dumps({"stalled_clients": n, "watched_s": watch_s,
                      "baseline_median_s": float(np.median(base)),
                      "honest_max_s": max(lat), "honest_median_s": float(np.median(lat)),
                      "honest_calls": len(lat), "honest_errors": len(errors),
                      "error_kinds": sorted(set(errors)), "server_peak_rss_mb": peak}))


if __name__ == "__main__":
    main()
