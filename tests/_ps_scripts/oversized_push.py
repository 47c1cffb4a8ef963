"""An unauthenticated client pushes an oversized message at a parameter server in another process.

Usage: oversized_push.py MB. Prints one JSON line: the server's RSS before and its peak after, how
long the refusal took, and the error the client got.
"""

import json
import subprocess
import sys
import time

import numpy as np

from jaxdist.ps import wire
from jaxdist.ps.transport import PS_SERVICE, Channel

SERVER = r"""
import sys
import numpy as np
from jaxdist.ps import optimizer
from jaxdist.ps.server import ServerConfig
from jaxdist.ps.transport import PS_SERVICE, GrpcClient, PSService, serve
service = PSService(0)
server, port = serve("127.0.0.1:0", PS_SERVICE, service.methods(), token="right")
c = GrpcClient(f"127.0.0.1:{port}", token="right", timeout=10)
c.init(0, {"w": np.zeros(1024, np.float32)}, optimizer("sgd", learning_rate=1.0), ServerConfig())
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
print(port, rss(), flush=True)
sys.stdin.read()
print(next(int(line.split()[1]) for line in open("/proc/self/status")
           if line.startswith("VmHWM")) / 1024, flush=True)
"""

mb = float(sys.argv[1])
proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True)
try:
    port, rss_before = proc.stdout.readline().split()
    payload = wire.encode({"worker": 0, "step_id": 1, "version": 0},
                          {"w": np.zeros(int(mb * 2**20) // 4, np.float32)})
    ch = Channel(f"127.0.0.1:{port}", PS_SERVICE, token=None)
    t = time.monotonic()
    try:
        ch.call("Push", payload, timeout=120)
        error = None
    except Exception as e:  # noqa: BLE001 - reported
        error = f"{type(e).__name__}: {e}"
    refuse_s = time.monotonic() - t
    del payload
    proc.stdin.close()
    peak = float(proc.stdout.readline())
finally:
    proc.kill()
    proc.wait()
print(json.dumps({"server_rss_before_mb": float(rss_before), "server_peak_rss_mb": peak,
                  "refuse_s": refuse_s, "error": error}))
