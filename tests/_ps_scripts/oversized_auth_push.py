"""Server memory under oversized AUTHENTICATED pushes (issue 19 item 3).

Usage: oversized_auth_push.py [MB] [CONCURRENT]   (default 240 MiB, 4 at once)

A server in a subprocess holds a 4 KiB shard; CONCURRENT clients with the right token push MB
each at once. Prints one JSON line: the server's RSS before, its peak (VmHWM) and its RSS after,
and the errors the clients got.
"""

import json
import subprocess
import sys
import threading

import numpy as np

from jaxdist.ps.transport import GrpcClient

SERVER = r"""
import sys, time
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
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
print(port, rss(), flush=True)
sys.stdin.readline()
time.sleep(1.0)
print(rss(), next(int(line.split()[1]) for line in open("/proc/self/status")
                  if line.startswith("VmHWM")) / 1024, flush=True)
"""

mb = float(sys.argv[1]) if len(sys.argv) > 1 else 240.0
concurrent = int(sys.argv[2]) if len(sys.argv) > 2 else 4
proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True)
errors = [None] * concurrent
try:
    port, rss_before = proc.stdout.readline().split()
    grads = {"w": np.zeros(int(mb * 2**20) // 4, np.float32)}

    def push(i):
        c = GrpcClient(f"127.0.0.1:{port}", token="t", timeout=120)
        try:
            c.push(worker=i, step_id=i, version=0, grads=grads)
        except Exception as e:  # noqa: BLE001 - reported
            errors[i] = f"{type(e).__name__}: {str(e)[:160]}"

    threads = [threading.Thread(target=push, args=(i,)) for i in range(concurrent)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    proc.stdin.write("\n")
    proc.stdin.flush()
    rss_after, peak = map(float, proc.stdout.readline().split())
finally:
    proc.kill()
    proc.wait()
print(json.dumps({"push_mb": mb, "concurrent": concurrent,
                  "server_rss_before_mb": float(rss_before), "server_peak_rss_mb": peak,
                  "server_rss_after_mb": rss_after, "errors": errors}))
