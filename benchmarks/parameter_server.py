"""Parameter-server throughput: pushes+pulls per second and server GB/s for 1, 2, 4 workers.

Each worker loops ``pull the whole model -> [compute] -> push a gradient of the same size``
against one server that applies SGD to every push (asynchronous mode). Two transports:

* ``grpc``: the server and every worker are separate processes talking over loopback gRPC;
* ``in-process``: the same loop in threads calling the server object directly (no bytes moved).

Two worker kinds: ``transport`` (no compute: the server/transport limit) and ``compute`` (each
step also spends ``--compute-ms`` away from the server, as a worker computing its gradient on its
own accelerator would; emulated with a sleep because this machine's few shared cores would
otherwise measure CPU contention, not the parameter server). Ratios compare runs of this one
invocation.

    python benchmarks/parameter_server.py [--mb 2] [--seconds 3] [--workers 1,2,4] [--tls]
    python benchmarks/parameter_server.py --quick [--tls]   # every row, 0.25 MiB, 0.5 s runs

Every call carries the job's token (authentication is on by default). ``--tls`` also starts a
second server with a self-signed certificate made for this run and measures the gRPC transport
rows over TLS, interleaved with plaintext runs (plain, TLS, TLS, plain per worker count), and
prints TLS / plaintext ratios.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxdist.launch import free_ports  # noqa: E402
from jaxdist.ps import optimizer, wire  # noqa: E402
from jaxdist.ps.server import ParameterServer, ServerConfig  # noqa: E402
from jaxdist.ps.transport import Channel, GrpcClient, LocalClient, TLSConfig, serve  # noqa: E402

TOKEN = os.environ.setdefault("JAXDIST_PS_TOKEN", secrets.token_urlsafe(16))


def self_signed(directory: str) -> dict[str, str]:
    """A self-signed certificate for 127.0.0.1 in ``directory``; returns the TLS env vars."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "jaxdist-bench")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    with open(cert_file, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_file, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return {"JAXDIST_PS_TLS_CERT": cert_file, "JAXDIST_PS_TLS_KEY": key_file,
            "JAXDIST_PS_TLS_CA": cert_file}


def start_server(addr: str, env: dict[str, str]) -> subprocess.Popen:
    cluster = json.dumps({"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": [addr]})
    return subprocess.Popen([sys.executable, "-m", "jaxdist.ps.cli", "--role", "ps",
                             "--index", "0", "--cluster", cluster], env=env,
                            stdout=subprocess.DEVNULL)


def until_up(call, seconds: float = 60.0):
    """``call()``, retried while its server cannot be reached: one starting up, or one on a
    loaded machine, where a gRPC connection has been seen to take over 20 s to open."""
    deadline = time.time() + seconds
    while True:
        try:
            return call()
        except ConnectionError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)


def init_server(addr: str, params, nbytes: int, tls) -> GrpcClient:
    client = GrpcClient(addr, token=TOKEN, timeout=30, tls=tls)
    until_up(lambda: client.init(0, params, optimizer("sgd", learning_rate=0.1),
                                 ServerConfig(max_push_bytes=2 * nbytes)))
    return client


def model(mb: float) -> dict[str, np.ndarray]:
    rows = int(mb * (1 << 20) / 4 / 2 / 512)
    return {f"w{i}": np.zeros((rows, 512), np.float32) for i in range(2)}


def worker_loop(client, index: int, seconds: float, compute_s: float, start_at: float) -> dict:
    grads = None
    pulls = pushes = moved = 0
    while time.time() < start_at:
        time.sleep(0.001)
    end = time.time() + seconds
    while time.time() < end:
        version, params = client.pull()
        if grads is None:
            grads = {k: np.full(v.shape, 1e-6, v.dtype) for k, v in params.items()}
        if compute_s:
            time.sleep(compute_s)
        client.push(worker=index, step_id=index << 32 | pushes, version=version, grads=grads)
        nbytes = sum(v.nbytes for v in params.values())
        pulls, pushes, moved = pulls + 1, pushes + 1, moved + 2 * nbytes
    return {"pulls": pulls, "pushes": pushes, "bytes": moved, "seconds": seconds}


def run_raw_echo(params: dict[str, np.ndarray], seconds: float) -> float:
    """Ceiling of Python gRPC here: GB/s of a bare echo server (another process) that returns a
    pull's bytes per Pull and swallows a push per Push, with the transport's channel options."""
    nbytes = sum(v.nbytes for v in params.values())
    # framed as a push is: the server reads a request's header (and the size it declares) first
    payload = wire.encode({"worker": 0, "step_id": 0, "version": 0}, params)
    addr = f"127.0.0.1:{free_ports(1)[0]}"
    proc = subprocess.Popen([sys.executable, __file__, "--_echo", addr, "--_bytes",
                             str(len(payload))], stdout=subprocess.DEVNULL)
    try:
        ch = Channel(addr, "bench.Echo", token=TOKEN)
        until_up(lambda: ch.call("Pull", b"", timeout=5))
        cycles, end = 0, time.time() + seconds
        while time.time() < end:
            ch.call("Pull", b"")
            ch.call("Push", payload)
            cycles += 1
        ch.close()
        return 2 * nbytes * cycles / seconds / 1e9
    finally:
        proc.kill()
        proc.wait()


def _echo_server(addr: str, nbytes: int) -> None:
    payload = b"\0" * nbytes
    server, _ = serve(addr, "bench.Echo", {"Pull": lambda r, call: payload,
                                           "Push": lambda r, call: b""}, token=TOKEN)
    server.wait_for_termination()


def _total(results: list[dict], seconds: float) -> tuple[float, float, float]:
    ops = sum(r["pulls"] + r["pushes"] for r in results) / seconds
    updates = sum(r["pushes"] for r in results) / seconds
    gbs = sum(r["bytes"] for r in results) / seconds / 1e9
    return ops, updates, gbs


def run_inprocess(params, n: int, seconds: float, compute_s: float):
    server = ParameterServer(0, params, optimizer("sgd", learning_rate=0.1).build())
    client = LocalClient(server)
    worker_loop(client, 99, 0.3, 0.0, time.time())  # compile the update outside the timing
    results: list[dict] = []
    start = time.time() + 0.2
    threads = [threading.Thread(target=lambda i=i: results.append(
        worker_loop(client, i, seconds, compute_s, start))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return _total(results, seconds)


def run_grpc(params, n: int, seconds: float, compute_s: float, server_addr: str,
             tls_env: dict[str, str] | None = None):
    client = GrpcClient(server_addr, token=TOKEN, timeout=30,
                        tls=TLSConfig.from_env(tls_env) if tls_env else None)
    worker_loop(client, 99, 0.3, 0.0, time.time())  # warm the channel and the update
    client.close()
    start = time.time() + 2.0  # workers are started and connected by then
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--_worker", server_addr, "--_index", str(i),
         "--seconds", str(seconds), "--compute-ms", str(compute_s * 1e3),
         "--_start", repr(start)], stdout=subprocess.PIPE, env=dict(os.environ, **(tls_env or {})))
        for i in range(n)]
    results = []
    for i, p in enumerate(procs):
        out, _ = p.communicate(timeout=seconds + 120)
        lines = out.decode().strip().splitlines()
        if p.returncode or not lines:
            raise RuntimeError(f"gRPC worker {i} of {n} exited with {p.returncode} and no result "
                               "(its traceback is above)")
        results.append(json.loads(lines[-1]))
    return _total(results, seconds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=2.0, help="model size in MiB")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--compute-ms", type=float, default=20.0)
    ap.add_argument("--tls", action="store_true",
                    help="also measure the gRPC transport over TLS (ratio TLS / plaintext)")
    ap.add_argument("--quick", action="store_true",
                    help="a check of the plumbing: every row with a 0.25 MiB model, 0.5 s runs, "
                         "5 ms of compute")
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--_start", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--_echo", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_bytes", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.quick:  # options given explicitly still win
        ap.set_defaults(mb=0.25, seconds=0.5, compute_ms=5.0)
        a = ap.parse_args(argv)
    if a._echo:
        _echo_server(a._echo, a._bytes)
        return 0
    if a._worker:
        client = GrpcClient(a._worker, token=TOKEN, timeout=30, tls=TLSConfig.from_env())
        until_up(client.status)
        print(json.dumps(worker_loop(client, a._index, a.seconds, a.compute_ms / 1e3,
                                     a._start)))
        return 0

    params = model(a.mb)
    nbytes = sum(v.nbytes for v in params.values())
    counts = [int(n) for n in a.workers.split(",")]
    port = free_ports(1)[0]
    addr = f"127.0.0.1:{port}"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get(
        "PYTHONPATH")])))
    server = start_server(addr, env)
    tls_dir = tempfile.TemporaryDirectory() if a.tls else None
    tls_env = self_signed(tls_dir.name) if a.tls else None
    tls_addr = f"127.0.0.1:{free_ports(1)[0]}"
    tls_server = start_server(tls_addr, dict(env, **tls_env)) if a.tls else None
    try:
        client = init_server(addr, params, nbytes, None)
        tls_client = (init_server(tls_addr, params, nbytes, TLSConfig.from_env(tls_env))
                      if a.tls else None)
        print(f"model {nbytes / 2**20:.2f} MiB (2 float32 leaves), 1 server applying SGD, "
              f"{a.seconds:g} s per run, compute kind = sleep {a.compute_ms:g} ms per step")
        print(f"{'transport':<11} {'kind':<9} {'workers':>7} {'ops/s':>9} {'updates/s':>10} "
              f"{'server GB/s':>11}")
        table = {}
        for kind, compute_s in (("transport", 0.0), ("compute", a.compute_ms / 1e3)):
            for n in counts:
                for name, fn, extra in (("grpc", run_grpc, (addr,)), ("in-process", run_inprocess, ())):
                    ops, ups, gbs = table[name, kind, n] = fn(params, n, a.seconds, compute_s, *extra)
                    print(f"{name:<11} {kind:<9} {n:>7} {ops:>9.1f} {ups:>10.1f} {gbs:>11.3f}",
                          flush=True)
        if 1 in counts and 2 in counts:
            print("ratios, 2 workers / 1 worker (updates/s):")
            for name in ("grpc", "in-process"):
                for kind in ("transport", "compute"):
                    r = table[name, kind, 2][1] / table[name, kind, 1][1]
                    print(f"  {name:<11} {kind:<9} {r:.2f}x")
        print("(in-process workers get the server's arrays by reference: its GB/s counts bytes "
              "served, not bytes copied)")
        best = max(v[2] for (name, _, _), v in table.items() if name == "grpc")
        raw = run_raw_echo(params, a.seconds)
        print(f"best gRPC server throughput: {best:.3f} GB/s; bare Python gRPC echo of the same "
              f"messages, 1 client: {raw:.3f} GB/s; parameter server 1 worker / echo: "
              f"{table['grpc', 'transport', counts[0]][2] / raw:.2f}")
        if a.tls:
            print("TLS / plaintext, gRPC transport rows (plain, TLS, TLS, plain per count):")
            for n in counts:
                plain, tls = [], []
                for run in (plain, tls, tls, plain):
                    run.append(run_grpc(params, n, a.seconds, 0.0, tls_addr if run is tls
                                        else addr, tls_env if run is tls else None)[1])
                print(f"  {n} worker(s): plaintext {sum(plain) / 2:.1f} updates/s, TLS "
                      f"{sum(tls) / 2:.1f} updates/s, ratio {sum(tls) / sum(plain):.2f}",
                      flush=True)
            tls_client.shutdown()
            tls_client.close()
        client.shutdown()
        client.close()
    finally:
        for proc in (server, tls_server):
            if proc is None:
                continue
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        if tls_dir is not None:
            tls_dir.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
