"""Two processes x one CPU device: jaxdist against PyTorch DDP (gloo both sides), and why.

Every configuration runs as its own pair of processes joined over 127.0.0.1 (JAX:
``jax.distributed.initialize`` with its default gloo CPU collectives; torch: ``init_process_group
("gloo")``), compiles and warms up, then times one window of steps per round on command. Rounds are
interleaved and their order alternates, so load from other jobs hits every configuration alike. In
a round each configuration runs ``--repeats`` windows and keeps its fastest (time per step, slower
rank); figures are medians over rounds, and each ratio is DDP's time ÷ the configuration's time
*in the same round* (>1: faster than DDP), median over rounds.

Training steps (MLP 784-256-128-10, Adam, the same global batch split over the two processes):

  ddp                 torch DistributedDataParallel, gloo, torch.set_num_threads(1)
  torch_local         the same model and optimizer without DDP (each process on its half batch)
  hand                hand-written jax.jit over a 2-process mesh (XLA inserts the all-reduce)
  hand_flat           hand-written shard_map step: gradients and loss raveled into ONE psum
  jax_local           the jit step on each process's half batch, no collective (compute floor)
  global              jaxdist.MultiWorkerMirroredStrategy().step(train_step) (the global view)
  global_z1..3        the same with zero_stage=1, 2, 3 (sharded state)
  per_replica         strategy.run(step) with jaxdist.all_reduce, MultiWorkerMirroredStrategy()
  per_replica_leaves  the same with pack_bytes=None forced (one gloo call per gradient leaf)
  per_replica_buckets the same with pack_bytes=256 KiB: the first layer's kernel (784 KiB) in its
                      own all-reduce, the rest in another, which may overlap the first layer's
                      backward pass

Raw all-reduce of the MLP's gradients (0.94 MB float32) between the two processes:

  ar_torch            dist.all_reduce of one flat tensor
  ar_torch_leaves     dist.all_reduce of each of the six leaves
  ar_jax              a jitted psum of one flat array (one gloo call)
  ar_jax_leaves       a jitted psum of the six leaves (XLA combines them into one variadic
                      all-reduce, which XLA:CPU sends operand by operand: six gloo calls)
  ar_torch_tiny, ar_jax_tiny   one float32: the latency of one call

A configuration name may carry runtime variants after ``:``, e.g. ``hand:eigen1`` (one Eigen
thread: ``--xla_cpu_multi_thread_eigen=false``), ``hand:sync`` (no async dispatch), or
``per_replica:alt``: jaxdist imported from ``--alt-repo`` (another checkout: before/after figures
in one invocation).

    python benchmarks/multiproc.py                       # steps, 5 rounds
    python benchmarks/multiproc.py --allreduce           # the raw all-reduces instead
    python benchmarks/multiproc.py --configs ddp,hand,hand:eigen1 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = ((784, 256), (256,), (256, 128), (128,), (128, 10), (10,))  # the MLP's parameter leaves
STEP_CONFIGS = ("ddp", "torch_local", "hand", "hand_flat", "jax_local", "global", "per_replica",
                "per_replica_leaves", "per_replica_buckets", "global_z1", "global_z2", "global_z3")
ALLREDUCE_CONFIGS = ("ar_torch", "ar_torch_leaves", "ar_jax", "ar_jax_leaves", "ar_torch_tiny",
                     "ar_jax_tiny")
VARIANTS = {
    "eigen1": {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"},
    "sync": {"JAX_CPU_ENABLE_ASYNC_DISPATCH": "0"},
    "alt": {},  # PYTHONPATH=--alt-repo, set by Pair
}


# ------------------------------------------------------------------------------------- workers
def _data(batch: int, rank: int):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4 * batch, 784), dtype=np.float32)
    y = rng.integers(0, 10, 4 * batch).astype(np.int32)
    half = batch // 2
    local = [(x[i * batch:(i + 1) * batch][rank * half:(rank + 1) * half],
              y[i * batch:(i + 1) * batch][rank * half:(rank + 1) * half]) for i in range(4)]
    return x, y, local


def _torch_worker(args):
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=2)
    if args.config.startswith("ar_"):
        shapes = _allreduce_shapes(args.config)
        bufs = [torch.ones(s) for s in shapes]

        def op():
            for b in bufs:
                dist.all_reduce(b)
                b.mul_(0.5)
        return op
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                        nn.Linear(128, 10))
    model = nn.parallel.DistributedDataParallel(net) if args.config == "ddp" else net
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    batches = [(torch.from_numpy(xb.copy()), torch.from_numpy(yb).long())
               for xb, yb in _data(args.batch, args.rank)[2]]
    it = [0]

    def step():
        xb, yb = batches[it[0] % 4]
        it[0] += 1
        opt.zero_grad(set_to_none=True)
        loss_fn(model(xb), yb).backward()
        opt.step()
    return step


def _allreduce_shapes(config: str) -> tuple:
    if config.endswith("_leaves"):
        return SIZES
    return ((1,),) if config.endswith("_tiny") else ((sum(_numel(s) for s in SIZES),),)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _jax_worker(args):
    import jax

    if args.config != "jax_local":
        os.environ.update(JAXDIST_COORDINATOR=f"127.0.0.1:{args.port}", JAXDIST_NUM_PROCESSES="2",
                          JAXDIST_PROCESS_ID=str(args.rank))
        import jaxdist

        jaxdist.initialize()
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding

    import jaxdist
    from jaxdist import models

    if args.config.startswith("ar_"):
        mesh = jax.make_mesh((2,), ("p",), axis_types=(AxisType.Explicit,))
        sh = NamedSharding(mesh, jax.P("p"))
        shapes = _allreduce_shapes(args.config)
        arrays = tuple(jax.make_array_from_process_local_data(sh, np.ones((1, *s), np.float32))
                       for s in shapes)
        f = jax.jit(jax.shard_map(lambda *xs: tuple(jax.lax.psum(x, "p") * 0.5 for x in xs),
                                  mesh=mesh, in_specs=jax.P("p"), out_specs=jax.P("p")),
                    donate_argnums=tuple(range(len(arrays))))
        held = [arrays]

        def op():
            held[0] = jax.block_until_ready(f(*held[0]))
        return op

    x, y, local = _data(args.batch, args.rank)
    state = models.create_train_state(models.MLP(hidden=(256, 128)), x[:1])

    def train_step(state, batch):
        xb, yb = batch.data if isinstance(batch, jaxdist.Batch) else batch

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    def replica_step(state, batch):  # the per-replica view: local gradients, one explicit reduce
        xb, yb = batch.data

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, xb)
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
            return per_example.mean() / jaxdist.num_replicas()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        grads, loss = jaxdist.all_reduce((grads, loss), "sum")
        return state.apply_gradients(grads=grads), loss

    if args.config == "jax_local":
        fn = jax.jit(train_step, donate_argnums=0)
        placed = [jax.device_put(b) for b in local]
    elif args.config.startswith("hand"):
        mesh = jax.make_mesh((2,), ("batch",), axis_types=(AxisType.Auto,))
        rep, dat = NamedSharding(mesh, jax.P()), NamedSharding(mesh, jax.P("batch"))
        placed = [jax.tree.map(lambda a: jax.make_array_from_process_local_data(dat, a), b)
                  for b in local]
        state = jax.device_put(state, rep)
        if args.config == "hand":
            fn = jax.jit(train_step, in_shardings=(rep, dat), out_shardings=(rep, rep),
                         donate_argnums=0)
        else:
            from jax.flatten_util import ravel_pytree

            def flat_step(state, batch):
                xb, yb = batch

                def loss_fn(params):
                    logits = state.apply_fn({"params": params}, xb)
                    return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean() / 2

                loss, grads = jax.value_and_grad(loss_fn)(state.params)
                flat, unravel = ravel_pytree(grads)
                flat = jax.lax.psum(jnp.concatenate([flat, loss[None]]), "batch")
                return state.apply_gradients(grads=unravel(flat[:-1])), flat[-1]

            fn = jax.jit(jax.shard_map(flat_step, mesh=mesh, in_specs=(jax.P(), jax.P("batch")),
                                       out_specs=(jax.P(), jax.P()), check_vma=False),
                         donate_argnums=0)
    else:
        kwargs = {"per_replica_leaves": {"pack_bytes": None},
                  "per_replica_buckets": {"pack_bytes": 2**18}}.get(args.config, {})
        if args.config.startswith("global_z"):  # the global view with sharded state
            kwargs = {"zero_stage": int(args.config[-1])}
        strategy = jaxdist.MultiWorkerMirroredStrategy(**kwargs)
        placed = [_global_batch(strategy, b) for b in local]
        if args.config.startswith("global"):
            fn = strategy.step(train_step)
            state = strategy.put(state)
        else:
            def fn(state, batch):
                return strategy.run(replica_step, args=(state, jaxdist.Batch(batch, None)))
    held, it = [state], [0]

    def step():
        s, m = fn(held[0], placed[it[0] % 4])
        it[0] += 1
        if it[0] % 8 == 0:  # bounded run-ahead, as a real loop has
            jax.block_until_ready(m)
        held[0] = s
        return s, m

    def window_end():
        jax.block_until_ready(held[0])
    step.sync = window_end
    return step


def _global_batch(strategy, local_batch):
    """This process's half of a global batch, placed across both processes."""
    import jax

    sharding = strategy.layout.batch
    return jax.tree.map(lambda a: jax.make_array_from_process_local_data(sharding, a), local_batch)


def worker_main(args) -> int:
    """Set up one side of a pair, warm up, then time one window per "run" line on stdin."""
    if args.config in ("ddp", "torch_local") or args.config.startswith("ar_torch"):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        op = _torch_worker(args)
    else:
        op = _jax_worker(args)
    sync = getattr(op, "sync", lambda: None)

    def window():
        t0 = time.perf_counter()
        for _ in range(args.steps):
            op()
        sync()
        return (time.perf_counter() - t0) / args.steps

    window()
    window()  # compile and warm up
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        # The fastest of a few windows: other jobs' bursts on a shared machine inflate single ones.
        print(f"TIME {min(window() for _ in range(args.repeats)):.9f}", flush=True)
    return 0


# -------------------------------------------------------------------------------------- driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _python_for(config: str) -> str:
    """torch lives in the peers' venv on this machine; JAX in whatever runs this script."""
    if config in ("ddp", "torch_local") or config.startswith("ar_torch"):
        return os.environ.get("MULTIPROC_TORCH_PYTHON", sys.executable)
    return sys.executable


class Pair:
    """The two processes of one configuration, driven line by line with timeouts."""

    def __init__(self, spec: str, args, log_dir: str):
        config, *variants = spec.split(":")
        self.spec, self.failure, self.lines, self.procs, self.errs = spec, None, queue.Queue(), [], []
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "PYTHONUNBUFFERED": "1"}
        for v in variants:
            env.update(VARIANTS[v])
        if "alt" in variants:
            if not args.alt_repo:
                raise SystemExit(f"{spec}: the 'alt' variant needs --alt-repo PATH")
            env["PYTHONPATH"] = os.path.abspath(args.alt_repo)
        port = _free_port()
        for rank in range(2):
            err = open(os.path.join(log_dir, f"{spec.replace(':', '-')}-{rank}.err"), "w+")
            script = os.path.abspath(__file__)
            if "alt" in variants:  # its own worker too, so the two sides differ only in jaxdist
                script = os.path.join(os.path.abspath(args.alt_repo), "benchmarks", "multiproc.py")
            cmd = [_python_for(config), script, "--worker", config,
                   "--rank", str(rank), "--port", str(port), "--batch", str(args.batch),
                   "--steps", str(args.steps), "--repeats", str(args.repeats)]
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
        got, deadline = {}, time.monotonic() + timeout
        while len(got) < 2:
            try:
                rank, line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                return self.fail("timed out")
            if line is None:
                self.procs[rank].wait(timeout=10)
                return self.fail(f"exited {self.procs[rank].returncode}")
            if line.startswith(prefix):
                got[rank] = line[len(prefix):].strip()
        return [got[0], got[1]]

    def send(self, text: str) -> None:
        for p in self.procs:
            try:
                p.stdin.write(text + "\n")
                p.stdin.flush()
            except (BrokenPipeError, OSError):
                pass

    def fail(self, why: str) -> None:
        tail = ""
        for f in self.errs:
            f.seek(0)
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
            tail = tail or (lines[-1][:200] if lines else "")
        self.failure = f"{why}: {tail}"
        print(f"  {self.spec}: {self.failure}", flush=True)
        self.close()
        return None

    def close(self) -> None:
        self.send("quit")
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)  # our own child's session
                p.wait()
        for f in self.errs:
            f.close()


def measure(specs: list[str], baseline: str, args) -> dict[str, dict]:
    """Interleaved rounds; per spec the median step time and median same-round ratio to baseline."""
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="jaxdist-multiproc-")
    times = {s: [] for s in specs}
    ratios = {s: [] for s in specs}
    failures = {}
    # Pairs start one after another: JAX compiles on both cores, and starting ten at once on a
    # loaded 2-core machine pushes some past the setup timeout.
    pairs = {}
    for s in specs:
        pairs[s] = Pair(s, args, log_dir)
        if pairs[s].expect("READY", args.setup_timeout) is None:
            failures[s] = pairs.pop(s).failure
    for r in range(args.rounds):
        order = list(pairs) if r % 2 == 0 else list(pairs)[::-1]
        this = {}
        for s in order:
            pairs[s].send("run")
            got = pairs[s].expect("TIME", args.run_timeout)
            if got is None:
                failures[s] = pairs.pop(s).failure
                continue
            this[s] = max(float(t) for t in got)  # a step ends when the slower rank ends it
        for s, t in this.items():
            times[s].append(t)
            if baseline in this:
                ratios[s].append(this[baseline] / t)
        print(f"  round {r}: " + "  ".join(
            f"{s} {t * 1e3:.2f} ms" + (f" ({this[baseline] / t:.2f})" if baseline in this else "")
            for s, t in this.items()), flush=True)
    for p in pairs.values():
        p.close()
    out = {}
    for s in specs:
        if times[s]:
            out[s] = {"ms": statistics.median(times[s]) * 1e3, "min_ms": min(times[s]) * 1e3,
                      "ratio": statistics.median(ratios[s]) if ratios[s] else None}
        else:
            out[s] = {"failed": failures.get(s, "no data")}
    return out


def table(results: dict[str, dict], baseline: str, unit: str) -> str:
    rows = [f"| configuration | median {unit} (ms) | fastest round (ms) | {baseline} ÷ it, same round |",
            "|---|---|---|---|"]
    for s, r in results.items():
        if "failed" in r:
            rows.append(f"| {s} | {r['failed']} | | |")
        else:
            ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
            rows.append(f"| {s} | {r['ms']:.2f} | {r['min_ms']:.2f} | {ratio} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=None,
                    help=f"comma-separated; steps: {', '.join(STEP_CONFIGS)}; all-reduce: "
                         f"{', '.join(ALLREDUCE_CONFIGS)}; variants after ':' ({', '.join(VARIANTS)})")
    ap.add_argument("--allreduce", action="store_true", help="the raw all-reduce configurations")
    ap.add_argument("--baseline", default=None, help="ratios against it (ddp, or ar_torch)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32, help="steps (or all-reduces) per window")
    ap.add_argument("--repeats", type=int, default=3,
                    help="windows per round and configuration; the fastest counts")
    ap.add_argument("--batch", type=int, default=128, help="global batch (64 per process)")
    ap.add_argument("--setup-timeout", type=float, default=300)
    ap.add_argument("--run-timeout", type=float, default=120)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--out", default=None, help="also write the report (markdown) to this file")
    ap.add_argument("--alt-repo", default=None, help="a jaxdist checkout for the ':alt' variant")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.config = args.worker
        return worker_main(args)
    default = ALLREDUCE_CONFIGS if args.allreduce else STEP_CONFIGS
    specs = [s for s in (args.configs or ",".join(default)).split(",") if s]
    known = STEP_CONFIGS + ALLREDUCE_CONFIGS
    bad = [s for s in specs if s.split(":")[0] not in known
           or any(v not in VARIANTS for v in s.split(":")[1:])]
    if bad:
        raise SystemExit(f"multiproc.py: unknown {bad}; configurations {list(known)}, "
                         f"variants {list(VARIANTS)}")
    baseline = args.baseline or ("ar_torch" if specs[0].startswith("ar_") else "ddp")
    if baseline not in specs:
        specs.insert(0, baseline)
    load = os.getloadavg()
    header = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, "
              f"{os.cpu_count()} CPU cores, Python {platform.python_version()}, {_versions()}; "
              f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start; global batch "
              f"{args.batch}, {args.steps} per window, best of {args.repeats} per round, "
              f"{args.rounds} rounds")
    print(header, flush=True)
    results = measure(specs, baseline, args)
    unit = "all-reduce" if baseline.startswith("ar_") else "step"
    load = os.getloadavg()
    report = (f"{header}\n\n{table(results, baseline, unit)}\n\nload average at the end "
              f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; `python benchmarks/multiproc.py "
              f"{' '.join(argv if argv is not None else sys.argv[1:])}`\n")
    print("\n" + report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


def _versions() -> str:
    import importlib.metadata as md

    found = []
    for name in ("jax", "torch"):
        try:
            found.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(found)


if __name__ == "__main__":
    sys.exit(main())
