"""jaxdist against its peers: the same models, data, batch and steps under every framework.

Compares, for the MLP 784-256-128-10 and the CNN Conv32(3x3, SAME)-MaxPool2-Dense64-10 (the
layers of ``jaxdist.models.CNN``), on 1 and 8 simulated devices and on 2 processes x 1 device:

  hand         hand-written JAX: ``jax.jit`` with explicit shardings, synced every 8 steps (baseline)
  global       ``@jaxdist.mirrored`` / ``strategy.step`` on pre-placed batches, plain ``for`` loop
  per_replica  ``state, m = strategy.run(step, ...)`` with the state kept per-replica (the README's loop)
  fit          ``jaxdist.fit`` over ``strategy.distribute(...)`` (input pipeline included)
  tf_mirrored  tf.distribute MirroredStrategy over logical CPU devices, Keras 3 ``fit`` (TF backend)
  keras_dp     Keras 3 ``fit`` under ``keras.distribution.DataParallel`` (JAX backend)
  torch_ddp    PyTorch DistributedDataParallel, gloo, one process per device

Every peer runs in its own subprocess (frameworks never share a process) that compiles and warms
up first, then times one window of steps per command. Rounds are interleaved and the order of the
peers alternates (reversed every other round), so load drifts hit all alike. The table gives, per
configuration, the median over rounds of (peer throughput / hand-written JAX throughput) measured
in the same round. A peer whose process dies is reported as aborted (with "rendezvous" when
XLA's rendezvous check killed it); a peer whose package is absent as "not installed".

    pip install -e ".[peers]"                       # tensorflow-cpu, keras, torch (CPU), matplotlib
    python benchmarks/peers.py                      # full run (~15-30 min on 2 cores)
    python benchmarks/peers.py --quick              # smoke test: MLP, 1 and 8 devices, seconds
    python benchmarks/peers.py --models mlp --layouts 8 --rounds 7 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

PEERS = {  # name: (label, modules it needs, layouts it has)
    "hand": ("hand-written JAX", ("jax",), ("1", "8", "2x1")),
    "global": ("jaxdist global view", ("jax",), ("1", "8", "2x1")),
    "per_replica": ("jaxdist per-replica run", ("jax",), ("1", "8", "2x1")),
    "fit": ("jaxdist.fit", ("jax",), ("1", "8", "2x1")),
    "tf_mirrored": ("tf.distribute Mirrored", ("tensorflow", "keras"), ("1", "8")),
    "keras_dp": ("Keras 3 DataParallel fit", ("keras", "jax"), ("1", "8")),
    "torch_ddp": ("PyTorch DDP (gloo)", ("torch",), ("1", "2x1")),
}
LAYOUTS = {"1": (1, 1), "8": (1, 8), "2x1": (2, 1)}  # name: (processes, devices per process)
LAYOUT_LABEL = {"1": "1 device", "8": "8 devices", "2x1": "2 proc x 1"}
MODELS = ("mlp", "cnn")


# ------------------------------------------------------------------------------------- workers
def _data(model: str, batch: int, count: int, seed: int = 0):
    """`count` distinct global batches, the same on every process and in every framework."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = (784,) if model == "mlp" else (28, 28, 1)
    x = rng.standard_normal((count * batch, *shape), dtype=np.float32)
    y = rng.integers(0, 10, count * batch).astype(np.int32)
    return x, y


def _jax_worker(args, x, y):
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jaxdist

    if args.procs > 1:
        jaxdist.initialize()
    import optax
    from jax.sharding import AxisType, NamedSharding

    from jaxdist import models

    model = models.MLP(hidden=(256, 128)) if args.model == "mlp" else models.CNN()
    b, n4 = args.batch, 4

    def train_step(state, batch):
        xb, yb = batch.data if isinstance(batch, jaxdist.Batch) else batch

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    def replica_step(state, batch):
        xb, yb = batch.data

        def loss_fn(params):  # the local mean's share of the global mean
            logits = state.apply_fn({"params": params}, xb)
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
            return per_example.mean() / jaxdist.num_replicas()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        grads = jaxdist.all_reduce(grads, "sum")
        return state.apply_gradients(grads=grads), {"loss": jaxdist.all_reduce(loss, "sum")}

    state = models.create_train_state(model, x[:1])
    batches = [(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]) for i in range(n4)]
    devices = jax.devices()  # every process's devices
    strategy = (jaxdist.MultiWorkerMirroredStrategy() if args.procs > 1
                else jaxdist.MirroredStrategy(devices[:args.devices]))
    if args.peer == "hand":
        mesh = jax.make_mesh((len(devices),), ("batch",), axis_types=(AxisType.Auto,),
                             devices=devices)
        rep, dat = NamedSharding(mesh, jax.P()), NamedSharding(mesh, jax.P("batch"))
        fn = jax.jit(train_step, in_shardings=(rep, dat), out_shardings=(rep, rep),
                     donate_argnums=0)
        placed = [jax.device_put(bt, dat) for bt in batches]
        state = jax.device_put(state, rep)
    elif args.peer in ("global", "per_replica"):
        placed = [strategy.layout.put_batch(bt) for bt in batches]
        if args.peer == "global":
            fn = strategy.step(train_step)
            state = strategy.put(state)
        else:
            def fn(state, batch):
                return strategy.run(replica_step, args=(state, jaxdist.Batch(batch, None)))
    else:  # fit: one long fit call, an epoch per window, the input pipeline included
        import numpy as np

        step = strategy.step(train_step)
        reps = args.steps // n4 + 1
        dataset = strategy.distribute((np.concatenate([x] * reps)[:args.steps * b],
                                       np.concatenate([y] * reps)[:args.steps * b]), b)

        class Pace(jaxdist.callbacks.Callback):
            def on_epoch_begin(self, info):
                self.t0 = time.perf_counter()

            def on_epoch_end(self, info):
                jax.block_until_ready(info.state)
                info.stop_training = not _report_and_wait(info.epoch, self.t0)

        return lambda: jaxdist.fit(step, state, dataset, epochs=10**6, verbose=0, callbacks=[Pace()])

    holder = [state]

    def window():  # one window of steps; the loop's own steps do the waiting
        s, m = holder[0], None
        for i in range(args.steps):
            s, m = fn(s, placed[i % n4])
            if args.peer == "hand" and i % 8 == 7:
                jax.block_until_ready(m)
        jax.block_until_ready((s, m))
        holder[0] = s
    return window


def _keras_layers(keras, model: str):
    if model == "mlp":
        return [keras.Input((784,)), keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)]
    return [keras.Input((28, 28, 1)), keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]


def _keras_fit(keras, net, args, x, y):
    """Keras `fit` for 10**6 epochs of `args.steps` steps; each epoch is one timed window."""
    import numpy as np

    net.compile(optimizer=keras.optimizers.Adam(1e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    reps = args.steps // 4 + 1
    xw = np.concatenate([x] * reps)[:args.steps * args.batch]
    yw = np.concatenate([y] * reps)[:args.steps * args.batch]

    class Pace(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            float((logs or {}).get("loss", 0.0))  # the epoch's results are on the host
            self.model.stop_training = not _report_and_wait(epoch, self.t0)

    return lambda: net.fit(xw, yw, batch_size=args.batch, epochs=10**6, shuffle=False, verbose=0,
                           callbacks=[Pace()])


def _keras_worker(args, x, y):
    os.environ["KERAS_BACKEND"] = "jax"
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import keras

    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices()[:args.devices]))
    return _keras_fit(keras, keras.Sequential(_keras_layers(keras, args.model)), args, x, y)


def _tf_worker(args, x, y):
    os.environ["KERAS_BACKEND"] = "tensorflow"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(args.devices)])
    import keras

    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.devices)])
    with strategy.scope():
        net = keras.Sequential(_keras_layers(keras, args.model))
        return _keras_fit(keras, net, args, x, y)


def _torch_worker(args, x, y):
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)  # one thread per process, as DDP is usually run (one process per core)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.procs)
    torch.manual_seed(0)
    if args.model == "mlp":
        net = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                            nn.Linear(128, 10))
    else:
        net = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Flatten(), nn.Linear(14 * 14 * 32, 64), nn.ReLU(), nn.Linear(64, 10))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    local = args.batch // args.procs
    lo = args.rank * local
    batches = []
    for i in range(4):
        xb = x[i * args.batch:(i + 1) * args.batch][lo:lo + local]
        if args.model == "cnn":
            xb = xb.transpose(0, 3, 1, 2)
        batches.append((torch.from_numpy(xb.copy()),
                        torch.from_numpy(y[i * args.batch:(i + 1) * args.batch][lo:lo + local]).long()))

    def window():
        for i in range(args.steps):
            xb, yb = batches[i % 4]
            opt.zero_grad(set_to_none=True)
            loss_fn(model(xb), yb).backward()
            opt.step()
    return window


def _report_and_wait(epoch: int, t0: float) -> bool:
    """At a fit epoch's end: READY after the warm-up epoch, else its TIME; then the next command."""
    print("READY" if epoch == 0 else f"TIME {time.perf_counter() - t0:.6f}", flush=True)
    return sys.stdin.readline().strip() == "run"


def worker_main(args) -> int:
    """One peer in this process: set up, warm up, then time one window per "run" line on stdin.

    Loops are timed around a window of steps; `fit`-style peers run one long `fit` and time each
    epoch (of `--steps` steps) from a callback that waits for the next command at the epoch's end.
    """
    if args.peer != "torch_ddp" and args.procs > 1:
        os.environ.update(JAXDIST_COORDINATOR=f"127.0.0.1:{args.port}",
                          JAXDIST_NUM_PROCESSES=str(args.procs), JAXDIST_PROCESS_ID=str(args.rank))
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    x, y = _data(args.model, args.batch, 4)
    make = {"tf_mirrored": _tf_worker, "keras_dp": _keras_worker,
            "torch_ddp": _torch_worker}.get(args.peer, _jax_worker)
    window = make(args, x, y)
    if args.peer in ("fit", "tf_mirrored", "keras_dp"):
        window()  # runs until told to stop
        return 0
    window()  # compile and warm up
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t0 = time.perf_counter()
        window()
        print(f"TIME {time.perf_counter() - t0:.6f}", flush=True)
    return 0


# ------------------------------------------------------------------------------------- driver
def installed(peer: str) -> bool:
    """Whether every package the peer needs can be imported (without importing it)."""
    return all(importlib.util.find_spec(m) is not None for m in PEERS[peer][1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeerGroup:
    """The processes of one peer in one configuration, driven line by line with timeouts."""

    def __init__(self, peer, model, layout, batch, steps, log_dir):
        self.peer, self.failure = peer, None
        procs, devices = LAYOUTS[layout]
        port = _free_port()
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
        self.procs, self.errs, self.lines = [], [], queue.Queue()
        for rank in range(procs):
            err = open(os.path.join(log_dir, f"{peer}-{model}-{layout}-{rank}.err"), "w+")
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", peer, "--model", model,
                   "--devices", str(devices), "--procs", str(procs), "--rank", str(rank),
                   "--port", str(port), "--batch", str(batch), "--steps", str(steps)]
            p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                 text=True, env=env, cwd=REPO, start_new_session=True)
            threading.Thread(target=self._read, args=(rank, p), daemon=True).start()
            self.procs.append(p)
            self.errs.append(err)

    def _read(self, rank, p):
        for line in p.stdout:
            self.lines.put((rank, line.strip()))
        self.lines.put((rank, None))

    def expect(self, prefix: str, timeout: float) -> list[str] | None:
        """One line starting with `prefix` from every rank, or None (and `failure` set)."""
        got, deadline = {}, time.monotonic() + timeout
        while len(got) < len(self.procs):
            try:
                rank, line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                self.fail("timed out")
                return None
            if line is None:
                self.procs[rank].wait(timeout=10)
                self.fail(None)
                return None
            if line.startswith(prefix):
                got[rank] = line[len(prefix):].strip()
        return [got[r] for r in sorted(got)]

    def send(self, text: str) -> None:
        for p in self.procs:
            try:
                p.stdin.write(text + "\n")
                p.stdin.flush()
            except (BrokenPipeError, OSError):
                pass

    def fail(self, why: str | None) -> None:
        if why is None:
            err = ""
            for f in self.errs:
                f.seek(0)
                err += f.read()
            codes = [p.poll() for p in self.procs]
            why = ("aborted (rendezvous)" if "rendezvous" in err.lower() else
                   f"aborted (exit {next((c for c in codes if c), codes[0])})")
            tail = err.strip().splitlines()[-1:] or [""]
            print(f"  {self.peer}: {why}: {tail[0][:200]}", flush=True)
        self.failure = why
        self.close()

    def close(self) -> None:
        self.send("quit")
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)  # our own child's session
                p.wait()
        for f in self.errs:
            f.close()


def run_config(model, layout, peers, args) -> dict[str, object]:
    """Rounds for one (model, layout): {peer: [ratio per round] | reason string}."""
    batch = args.batch or (128 if layout == "2x1" else 512)
    steps = args.steps or (64 if model == "mlp" else 16)
    print(f"\n== {model}, {LAYOUT_LABEL[layout]}, global batch {batch}, {steps} steps per window",
          flush=True)
    result: dict[str, object] = {}
    groups = {}
    for peer in peers:
        if layout not in PEERS[peer][2]:
            result[peer] = "n/a"
        elif not installed(peer):
            result[peer] = "not installed"
        else:
            groups[peer] = PeerGroup(peer, model, layout, batch, steps, args.log_dir)
    for peer, g in list(groups.items()):  # they compiled side by side; now each must be ready
        if g.expect("READY", args.setup_timeout) is None:
            result[peer] = g.failure
            del groups[peer]
    if "hand" not in groups:
        for g in groups.values():
            g.close()
        return {p: result.get(p, "no baseline") for p in peers}
    speed = {p: [] for p in groups}
    ratios = {p: [] for p in groups}
    for r in range(args.rounds):
        order = list(groups) if r % 2 == 0 else list(groups)[::-1]
        this = {}
        for peer in order:
            g = groups[peer]
            g.send("run")
            times = g.expect("TIME", args.run_timeout)
            if times is None:
                result[peer] = g.failure
                del groups[peer]
                continue
            this[peer] = steps * batch / max(float(t) for t in times)
        if "hand" not in this:
            break
        for peer, v in this.items():
            speed[peer].append(v)
            ratios[peer].append(v / this["hand"])
        print(f"  round {r}: " + "  ".join(f"{p} {this[p]:,.0f} ex/s ({this[p] / this['hand']:.2f})"
                                           for p in this), flush=True)
    for g in groups.values():
        g.close()
    for peer in groups:
        if ratios[peer]:
            result[peer] = {"ratio": statistics.median(ratios[peer]),
                            "examples_per_s": statistics.median(speed[peer]),
                            "ratios": ratios[peer]}
    return {p: result.get(p, "no data") for p in peers}


def _cell(v) -> str:
    return f"{v['ratio']:.2f}" if isinstance(v, dict) else str(v)


def table(results, peers, what="ratio") -> str:
    head = "| model, layout | " + " | ".join(PEERS[p][0] for p in peers) + " |"
    lines = [head, "|---|" + "---|" * len(peers)]
    for (model, layout), row in results.items():
        cells = [(_cell(row[p]) if what == "ratio" else
                  f"{row[p]['examples_per_s']:,.0f}" if isinstance(row[p], dict) else str(row[p]))
                 for p in peers]
        lines.append(f"| {model.upper()}, {LAYOUT_LABEL[layout]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(results, peers, path) -> str:
    """A grouped bar chart of the ratios; returns a note when matplotlib is absent."""
    if importlib.util.find_spec("matplotlib") is None:
        return "chart: not written (matplotlib not installed; pip install jaxdist[peers])"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(keys) + 2), 4.2))
    width = 0.8 / len(peers)
    for i, p in enumerate(peers):
        vals = [results[k][p]["ratio"] if isinstance(results[k][p], dict) else 0 for k in keys]
        bars = ax.bar([j + i * width for j in range(len(keys))], vals, width, label=PEERS[p][0])
        for b, k in zip(bars, keys):
            if not isinstance(results[k][p], dict):
                ax.text(b.get_x() + width / 2, 0.02, {"n/a": "–"}.get(results[k][p], "×"),
                        ha="center", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))])
    ax.set_xticklabels([f"{m.upper()}\n{LAYOUT_LABEL[lay]}" for m, lay in keys])
    ax.set_ylabel("throughput / hand-written JAX (median of rounds)")
    ax.set_title("jaxdist and peers, same model, data, batch and steps (× = aborted/absent)")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"chart: {path}"


def versions() -> str:
    out = []
    for m in ("jax", "tensorflow", "keras", "torch"):
        if importlib.util.find_spec(m) is not None:
            try:
                from importlib.metadata import version

                out.append(f"{m} {version({'tensorflow': 'tensorflow-cpu'}.get(m, m))}")
            except Exception:  # noqa: BLE001 - a package without metadata
                out.append(f"{m} (version unknown)")
        else:
            out.append(f"{m} not installed")
    return ", ".join(out)


def keras_abort_check(args) -> str:
    """Keras 3 DataParallel fit, MLP, 8 devices, `--keras-probe-steps` steps in one fit call."""
    if not installed("keras_dp"):
        return "not checked (keras not installed)"
    g = PeerGroup("keras_dp", "mlp", "8", 512, args.keras_probe_steps, args.log_dir)
    ok = g.expect("READY", args.setup_timeout) is not None  # the warm-up is one full fit call
    g.close()
    return "completed" if ok else g.failure


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: MLP, 1 and 8 devices, short windows, 2 rounds")
    ap.add_argument("--models", default=None, help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--layouts", default=None, help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (5)")
    ap.add_argument("--steps", type=int, default=None, help="steps per window (MLP 64, CNN 16)")
    ap.add_argument("--batch", type=int, default=None, help="global batch (512; 128 on 2x1)")
    ap.add_argument("--setup-timeout", type=float, default=600)
    ap.add_argument("--run-timeout", type=float, default=300)
    ap.add_argument("--keras-probe-steps", type=int, default=200,
                    help="steps of the Keras rendezvous check (0: skip it)")
    ap.add_argument("--out", default=None, help="directory for peers.md and peers.png")
    ap.add_argument("--log-dir", default=None, help="workers' stderr (default: a temp dir)")
    for name in ("--worker", "--model"):
        ap.add_argument(name, help=argparse.SUPPRESS)
    for name in ("--devices", "--procs", "--rank", "--port"):
        ap.add_argument(name, type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.peer = args.worker
        return worker_main(args)
    if args.quick:  # explicit options still win
        args.models, args.layouts = args.models or "mlp", args.layouts or "1,8"
        args.rounds, args.steps, args.batch = args.rounds or 2, args.steps or 8, args.batch or 128
        args.keras_probe_steps = 0
    args.models, args.layouts = args.models or ",".join(MODELS), args.layouts or ",".join(LAYOUTS)
    args.rounds = args.rounds or 5
    if args.log_dir is None:
        import tempfile

        args.log_dir = tempfile.mkdtemp(prefix="jaxdist-peers-")
    os.makedirs(args.log_dir, exist_ok=True)  # the README's command names one that may not exist
    peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in peers if p not in PEERS] + [
        m for m in args.models.split(",") if m not in MODELS] + [
        lay for lay in args.layouts.split(",") if lay not in LAYOUTS]
    if unknown:
        raise SystemExit(f"peers.py: unknown {unknown}; peers {list(PEERS)}, models {list(MODELS)}, "
                         f"layouts {list(LAYOUTS)}")
    peers = ["hand"] + [p for p in peers if p != "hand"]
    load = os.getloadavg()[0]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
               f"load average {load:.1f} at start")
    print(f"{stamp}; {machine}\n{versions()}", flush=True)
    t0 = time.perf_counter()
    results = {(m, lay): run_config(m, lay, peers, args)
               for m in args.models.split(",") for lay in args.layouts.split(",")}
    probe = keras_abort_check(args) if args.keras_probe_steps else None
    end_load = os.getloadavg()[0]
    text = [f"# jaxdist and its peers ({stamp})", "",
            f"Machine: {machine}, {end_load:.1f} at the end. {versions()}.", "",
            f"Throughput ÷ hand-written JAX's in the same round, median of {args.rounds} interleaved "
            "rounds (order alternating), compile and warm-up excluded; same data, global batch and "
            "steps per window for every peer.", "", table(results, peers), "",
            "Median examples per second:", "", table(results, peers, "speed"), ""]
    if probe:
        text += [f"Keras 3 DataParallel `fit`, MLP, 8 devices, {args.keras_probe_steps} steps in one "
                 f"`fit` call: **{probe}**.", ""]
    text.append(f"(run took {time.perf_counter() - t0:.0f} s; "
                f"`python benchmarks/peers.py {' '.join(argv if argv is not None else sys.argv[1:])}`)")
    report = "\n".join(text)
    print("\n" + report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out or args.log_dir, "peers.png")
    print(chart(results, peers, png))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "peers.md"), "w") as f:
            f.write(report + "\n\n![ratios](peers.png)\n")
        print(f"wrote {os.path.join(args.out, 'peers.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
