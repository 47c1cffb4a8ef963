"""Liveness probe of one parameter server (run in a subprocess by test_ps_security.py).

40 pulls park on a version that never comes and are then cancelled; meanwhile ``Status`` must
answer, and afterwards no waiter may remain. Then 40 honest synchronous workers (sync_replicas=40)
push and wait for their round: every one must get it. Prints one JSON line.
"""

import json
import sys
import threading
import time

import numpy as np

from jaxdist.ps import optimizer, wire
from jaxdist.ps.server import ServerConfig
from jaxdist.ps.transport import PS_SERVICE, Channel, GrpcClient, PSService, serve

N = 40


def start(config):
    service = PSService(0)
    server, port = serve("127.0.0.1:0", PS_SERVICE, service.methods(), token="t")
    addr = f"127.0.0.1:{port}"
    client = GrpcClient(addr, token="t", timeout=10)
    client.init(0, {"w": np.zeros(4, np.float32)}, optimizer("sgd", learning_rate=1.0), config)
    return server, addr, client


out = {}
server, addr, client = start(ServerConfig())
ch = Channel(addr, PS_SERVICE, token="t")
futs = [ch.future("Pull", wire.encode({"min_version": 2 ** 62})) for _ in range(N)]
time.sleep(1.0)
t = time.monotonic()
try:
    client.status(timeout=5)
    out["status_while_parked_s"] = time.monotonic() - t
except Exception as e:  # noqa: BLE001 - reported to the test
    out["status_while_parked_error"] = repr(e)
for f in futs:
    f.cancel()
deadline = time.monotonic() + 10
waiters = None
while time.monotonic() < deadline:
    try:
        waiters = client.status(timeout=2)["waiters"]
    except Exception as e:  # noqa: BLE001
        waiters = repr(e)
    if waiters == 0:
        break
    time.sleep(0.1)
out["waiters_after_cancel"] = waiters
server.stop(0)

server, addr, _ = start(ServerConfig(sync_replicas=N))
results = [None] * N


def honest(i):
    c = GrpcClient(addr, token="t", timeout=60)
    try:
        r = c.push(worker=i, step_id=i, version=0, grads={"w": np.ones(4, np.float32)})
        results[i] = c.pull(min_version=r.version, timeout=60)[0]
    except Exception as e:  # noqa: BLE001
        results[i] = repr(e)
    finally:
        c.close()


threads = [threading.Thread(target=honest, args=(i,)) for i in range(N)]
for th in threads:
    th.start()
for th in threads:
    th.join(120)
out["sync_round_versions"] = results
# VmHWM is this process's peak (ru_maxrss would include the parent's, carried across exec)
out["maxrss_mb"] = next(int(line.split()[1]) for line in open("/proc/self/status")
                        if line.startswith("VmHWM")) / 1024
server.stop(0)
print(json.dumps(out))
sys.stdout.flush()
