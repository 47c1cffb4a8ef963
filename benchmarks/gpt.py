"""A GPT-style decoder (~111 M parameters) on one GPU: jaxdist's loops against hand-written JAX.

The model: token + position embeddings, pre-LayerNorm blocks (causal multi-head attention through
``jax.nn.dot_product_attention``, a 4x GELU MLP), a final LayerNorm and an output head tied to the
token embedding (Flax linen). Mixed precision as PyTorch's autocast does it: float32 parameters
and residual stream, the matmuls and attention in bfloat16 (each layer's ``dtype``), the loss in
float32; AdamW. Synthetic tokens made on the host from a fixed seed (no download).

Default: 12 layers, d 768, 12 heads, seq 1024, vocab 32768 (111.0 M parameters; GPT-2's 50257,
``--vocab 50257``, makes 124 M), batch 16 sequences = 16,384 tokens a step.
``--tiny``: 2 layers, d 64, seq 64, vocab 512: seconds on a CPU (plumbing, not performance).

Loops, all over the same batches in the same order from the same initial state, each timed after
a compile/warm-up, the same steps a window, repetitions interleaved (order rotated every
repetition), medians:

* ``hand``: ``jax.jit`` with ``in_shardings``/``out_shardings`` and the state donated, batches
  pre-placed on the device (the best a JAX user writes); the baseline every ratio divides by.
* ``hand_fed``: the same step fed from host arrays with ``jax.device_put`` every step: what a
  hand-written loop pays for its input, the fair baseline for ``fit``.
* ``mirrored``: ``@jaxdist.mirrored`` (global view), batches pre-placed.
* ``fit``: ``jaxdist.fit`` over ``strategy.distribute`` of the host arrays.
* ``zero3``: ``@jaxdist.mirrored(zero_stage=3)``, batches pre-placed.
* ``launch tier on`` / ``launch tier off``: ``jaxdist.fit`` + ``BackupAndRestore`` in a script
  started by ``python -m jaxdist.launch -n 1``, with the in-memory fault-tolerance tier on (the
  default) and off (``JAXDIST_MEMORY_TIER=0``); runs alternated. A callback records the time at
  every step's end and waits for the device only twice, when the timed window opens (after the
  2 warm-up steps) and at its last step; the script prints the times at the end. A run's step
  time is its window's time over its steps (the tier's work at each step included, the epoch-end
  backup not); the table gives the median over runs. Each launch compiles anew; a shared
  persistent compilation cache makes the later ones cheap (compile is not timed).

MFU = tokens/s x (6 N + 12 L d T) / peak, the nanoGPT / PaLM estimate: N = parameters less the
position embeddings (the tied embedding counted once, as the output head's matmul), 12 L d T the
attention's score and value matmuls without the causal saving. Peak: dense bf16 FLOP/s from a
table of known chips by ``jax.devices()[0].device_kind``; unknown chips get no MFU.

The loops must compute the same thing: after the run every loop's parameters are compared with the
hand-written loop's (the launched runs' with a hand-written run of as many steps): the L2 distance
over the L2 distance training moved them must stay under ``--tolerance``, else the script exits 3
after printing its figures (4: a launched run failed; 1: a part could not run).

    python benchmarks/gpt.py [--tiny] [--json PATH] [--parts inproc launch] [--loops ...]
    python benchmarks/gpt.py --merge A.json B.json [--json PATH]   # figures of separate runs
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOPS = ("hand", "hand_fed", "mirrored", "fit", "zero3")
DEFAULT = dict(layers=12, d_model=768, heads=12, seq=1024, vocab=32768, batch=16, steps=20,
               reps=5, launch_steps=20, launch_reps=2)
TINY = dict(layers=2, d_model=64, heads=4, seq=64, vocab=512, batch=8, steps=4, reps=2,
            launch_steps=10, launch_reps=1)
# Dense bfloat16 peak per chip (vendor data sheets), matched in order against device_kind.
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200", 989.4),
               ("H800", 989.4), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0),
               ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5e", 197.0), ("TPU v5p", 459.0),
               ("TPU v6 lite", 918.0), ("TPU v6e", 918.0))
CHILD_TAG = "GPT_BENCH_CHILD "
WARM_STEPS = 2  # the first step compiles, the second warms up; every timed window starts after them


def peak_tflops(device_kind: str) -> float | None:
    for name, tflops in PEAK_TFLOPS:
        if name.lower() in device_kind.lower():
            return tflops
    return None


# ---------------------------------------------------------------------------------------------
# The model, the data and the steps (shared by the in-process loops and the launched script).

def build(cfg: dict):
    """Model, optimizer, host-side initial state and the two train steps for ``cfg``."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax.training import train_state

    import jaxdist

    dtype = jnp.dtype(cfg["dtype"])
    d, heads, impl = cfg["d_model"], cfg["heads"], cfg["attention"]
    dense_init = nn.initializers.normal(0.02)
    # GPT-2: the residual projections scaled by 1/sqrt(2 L).
    proj_init = nn.initializers.normal(0.02 / (2 * cfg["layers"]) ** 0.5)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            b, t, _ = x.shape
            h = nn.LayerNorm(dtype=dtype)(x)
            qkv = nn.Dense(3 * d, dtype=dtype, kernel_init=dense_init)(h)
            q, k, v = jnp.split(qkv.reshape(b, t, 3 * heads, d // heads), 3, axis=2)
            a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
            x = x + nn.Dense(d, dtype=dtype, kernel_init=proj_init)(a.reshape(b, t, d))
            h = nn.LayerNorm(dtype=dtype)(x)
            h = nn.gelu(nn.Dense(4 * d, dtype=dtype, kernel_init=dense_init)(h))
            return x + nn.Dense(d, dtype=dtype, kernel_init=proj_init)(h)

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            embed = nn.Embed(cfg["vocab"], d, dtype=dtype, embedding_init=dense_init)
            pos = self.param("pos_embedding", dense_init, (cfg["seq"], d))
            x = embed(tokens).astype(jnp.float32) + pos[:tokens.shape[1]]  # float32 residual
            for _ in range(cfg["layers"]):
                x = Block()(x)
            return embed.attend(nn.LayerNorm(dtype=dtype)(x))  # tied output head

    model = GPT()
    tx = optax.adamw(cfg["lr"], b1=0.9, b2=0.95, weight_decay=0.1)
    params = jax.jit(model.init)(jax.random.key(cfg["seed"]),
                                 jnp.zeros((1, cfg["seq"]), jnp.int32))["params"]
    state = jax.device_get(train_state.TrainState.create(apply_fn=model.apply, params=params,
                                                         tx=tx))

    def per_example_loss(params, x, y):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), y).mean(axis=-1)

    def train_step(state, batch):  # the hand-written / @mirrored step over a (tokens, targets) pair
        x, y = batch
        loss, grads = jax.value_and_grad(
            lambda p: per_example_loss(p, x, y).mean())(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    def masked_step(state, batch):  # the same over what strategy.distribute yields
        (x, y), mask = batch
        loss, grads = jax.value_and_grad(
            lambda p: jaxdist.compute_average_loss(per_example_loss(p, x, y), mask))(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    rng = np.random.default_rng(cfg["seed"])
    tokens = rng.integers(0, cfg["vocab"], (cfg["num_batches"] * cfg["batch"], cfg["seq"] + 1),
                          dtype=np.int32)
    data = (np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:]))
    return state, train_step, masked_step, data


def count(cfg: dict, state) -> tuple[int, int]:
    """(all parameters, FLOPs per token by 6 N + 12 L d T)."""
    import jax

    total = sum(x.size for x in jax.tree.leaves(state.params))
    n = total - cfg["seq"] * cfg["d_model"]
    return total, 6 * n + 12 * cfg["layers"] * cfg["d_model"] * cfg["seq"]


def describe(cfg: dict, devices, state) -> dict:
    """What ran where: the device, the versions, the model's size."""
    import jax

    import jaxdist

    total, flops_per_token = count(cfg, state)
    return dict(device_kind=devices[0].device_kind, platform=devices[0].platform,
                num_devices=len(devices), jax=jax.__version__, jaxdist=jaxdist.__version__,
                attention=cfg["attention"], params=total, flops_per_token=flops_per_token)


def pick_attention(choice: str, cfg: dict) -> str:
    """``auto``: cuDNN's fused attention where it compiles for these shapes (GPU), else XLA's."""
    import jax
    import jax.numpy as jnp

    if choice != "auto":
        return choice
    if jax.default_backend() != "gpu":
        return "xla"
    q = jnp.zeros((1, cfg["seq"], cfg["heads"], cfg["d_model"] // cfg["heads"]), cfg["dtype"])
    def loss(q):
        return jax.nn.dot_product_attention(
            q, q, q, is_causal=True, implementation="cudnn").astype(jnp.float32).sum()

    try:
        jax.jit(jax.grad(loss)).lower(q).compile()
        return "cudnn"
    except Exception as e:  # noqa: BLE001 - any failure means: not for these shapes here
        print(f"cuDNN attention does not compile here ({type(e).__name__}: {str(e)[:200]}); "
              "using XLA's", flush=True)
        return "xla"


def distance(a_leaves, b_leaves) -> float:
    """The L2 norm of the difference of two lists of arrays, all elements together."""
    import numpy as np

    return float(np.sqrt(sum(np.sum(np.square(np.asarray(a, np.float64) - b))
                             for a, b in zip(a_leaves, b_leaves))))


def relative_distance(final, reference, init) -> float:
    """|final - reference| / |reference - init| (L2 over every parameter): 0 for the same numbers;
    a run that saw other batches, or one step more or less, is a sizeable fraction of 1."""
    moved = distance(reference, init)
    return distance(final, reference) / moved if moved else float("inf")


# ---------------------------------------------------------------------------------------------
# Part 1: the in-process loops.

def run_inproc(cfg: dict, loops: list[str], ref_path: str | None) -> dict:
    import jax

    if cfg.get("devices"):
        jax.config.update("jax_num_cpu_devices", cfg["devices"])
    import numpy as np
    from jax.sharding import AxisType, NamedSharding

    import jaxdist

    cfg["attention"] = pick_attention(cfg["attention"], cfg)
    print(f"attention: {cfg['attention']}", flush=True)
    host_state, train_step, masked_step, (x, y) = build(cfg)
    devices = jax.devices()  # --devices N: N simulated CPU devices (set above)
    b, steps = cfg["batch"], cfg["steps"]

    mesh = jax.make_mesh((len(devices),), ("batch",), axis_types=(AxisType.Auto,), devices=devices)
    rep, dat = NamedSharding(mesh, jax.P()), NamedSharding(mesh, jax.P("batch"))
    hand = jax.jit(train_step, in_shardings=(rep, dat), out_shardings=(rep, rep), donate_argnums=0)
    mirrored = jaxdist.mirrored(devices=devices)(train_step)
    zero3 = jaxdist.mirrored(devices=devices, zero_stage=3)(train_step)
    strategy = mirrored.strategy
    fit_step = strategy.step(masked_step)
    dataset = strategy.distribute((x, y), b)
    host_batches = [(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]) for i in range(cfg["num_batches"])]
    placed = {"hand": [jax.device_put(hb, dat) for hb in host_batches],
              "mirrored": [strategy.layout.put_batch(hb) for hb in host_batches],
              "zero3": [zero3.strategy.layout.put_batch(hb) for hb in host_batches]}

    def over(step, batches, sync_every=None):
        def run(state, n):
            for i in range(n):
                state, m = step(state, batches[i])
                if sync_every and i % sync_every == sync_every - 1:
                    jax.block_until_ready(m)  # as a hand-written loop bounds its run-ahead
            return state, m
        return run

    def hand_fed(state, n):
        for i in range(n):
            state, m = hand(state, jax.device_put(host_batches[i], dat))
            if i % 8 == 7:
                jax.block_until_ready(m)
        return state, m

    def fit(state, n):
        history = jaxdist.fit(fit_step, state, dataset, epochs=1, steps_per_epoch=n, verbose=0)
        return history.state, history.state.step

    run = {"hand": over(hand, placed["hand"], 8), "hand_fed": hand_fed,
           "mirrored": over(mirrored, placed["mirrored"]), "fit": fit,
           "zero3": over(zero3, placed["zero3"])}
    place = {"hand": lambda s: jax.device_put(s, rep), "hand_fed": lambda s: jax.device_put(s, rep),
             "mirrored": strategy.put, "fit": strategy.put, "zero3": zero3.strategy.put}
    states = {}
    for name in loops:  # compile + warm up on the first two batches, every loop alike
        t = time.perf_counter()
        states[name], m = run[name](place[name](host_state), 2)
        jax.block_until_ready(m)
        print(f"{name}: compiled and warmed up in {time.perf_counter() - t:.1f} s", flush=True)

    speed = {n: [] for n in loops}
    cpu = {n: [] for n in loops}
    for r in range(cfg["reps"]):
        order = loops[r % len(loops):] + loops[:r % len(loops)]
        for name in order:
            t, c = time.perf_counter(), time.process_time()
            states[name], m = run[name](states[name], steps)
            jax.block_until_ready((states[name], m))
            elapsed = time.perf_counter() - t
            cpu[name].append((time.process_time() - c) / steps)
            speed[name].append(steps * b * cfg["seq"] / elapsed)
        print(f"rep {r} ({' > '.join(order)}): " + "  ".join(
            f"{n} {speed[n][-1]:,.0f} tok/s" for n in loops), flush=True)

    init = [np.asarray(a) for a in jax.tree.leaves(host_state.params)]
    final = {n: [np.asarray(a) for a in jax.tree.leaves(jax.device_get(states[n].params))]
             for n in loops}
    same = {n: relative_distance(final[n], final["hand"], init) for n in loops if n != "hand"}
    del states, final
    out = {"loops": {n: {"tokens_per_s": speed[n], "cpu_s_per_step": cpu[n]} for n in loops},
           "same_numbers": same}
    if ref_path:  # what the launched runs must end with: the hand-written loop's launch_steps
        state, _ = run["hand"](place["hand"](host_state), cfg["launch_steps"])
        leaves = [np.asarray(a) for a in jax.tree.leaves(jax.device_get(state.params))]
        np.savez(ref_path, *leaves)
        out["reference_moved"] = distance(leaves, init)
    out.update(describe(cfg, devices, host_state))
    return out


# ---------------------------------------------------------------------------------------------
# Part 2: fit + BackupAndRestore under `jaxdist launch -n 1`, the memory tier on and off.

def child(cfg: dict, params_path: str | None) -> None:
    """The launched training script: prints its step-end times on one line at the end."""
    import logging

    # INFO: the lines jaxdist logs about its fault-tolerance tier reach the output (and the table).
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    import jaxdist

    jaxdist.initialize()
    import jax
    import numpy as np

    cfg["attention"] = pick_attention(cfg["attention"], cfg)
    host_state, _, masked_step, data = build(cfg)

    class StepTimes(jaxdist.callbacks.Callback):
        """Step-end times by the host's clock; it waits for the device twice only: when the timed
        window opens (after WARM_STEPS) and at its last step. Listed after BackupAndRestore, so
        the window holds the tier's work of each of its steps, and not the epoch-end backup."""

        def __init__(self):
            self.times: list[float] = []
            self.window: list[float] = []

        def on_train_batch_end(self, info):
            self.times.append(time.perf_counter())
            if info.step in (WARM_STEPS, cfg["launch_steps"]):
                jax.block_until_ready(info.state)
                self.window.append(time.perf_counter())

    strategy = jaxdist.MultiWorkerMirroredStrategy(zero_stage=cfg.get("zero_stage", 0))
    timer = StepTimes()
    # The backup directory outlives a killed attempt (the restarted one must not find it empty
    # of the run's own name): one per launched run, given by the parent.
    backup = jaxdist.callbacks.BackupAndRestore(
        cfg.get("backup_dir") or tempfile.mkdtemp(prefix="gpt-bench-backup-"),
        every_n_steps=10_000, delete_on_success=True)

    class Kill(jaxdist.callbacks.Callback):
        """The kill part: SIGKILL after step ``kill_at`` on the first attempt (the launcher
        restarts the process, which resumes from what the tier holds). It first prints the bound
        the tier had announced by then (its ``tier.json``, what the launcher prints): the kill is
        held to that, not to a bound announced later."""

        def on_train_batch_end(self, info):
            if (cfg.get("kill_at") and os.environ.get("JAXDIST_RESTART_COUNT", "0") == "0"
                    and info.step >= cfg["kill_at"]):
                jax.block_until_ready(info.state)
                from jaxdist.launch.statedir import read_tier

                tier = getattr(backup, "memory", None)
                announced = read_tier(tier.directory, 0) if tier and tier.directory else None
                print(f"killed after step {info.step}; announced before the kill: "
                      + json.dumps({k: (announced or {}).get(k) for k in ("bound", "bound_all")}),
                      flush=True)
                os.kill(os.getpid(), 9)

    history = jaxdist.fit(strategy.step(masked_step), host_state,
                          strategy.distribute(data, cfg["batch"]), epochs=1,
                          steps_per_epoch=cfg["launch_steps"], callbacks=[backup, timer, Kill()],
                          verbose=0)
    leaves = [np.asarray(a) for a in jax.tree.leaves(jax.device_get(history.state.params))]
    if jax.process_index() == 0:
        if params_path:
            np.savez(params_path, *leaves)
        print(CHILD_TAG + json.dumps({
            "times": timer.times, "window": timer.window,
            # Whether the tier ran, where this jaxdist says so (not public API: None if not).
            "tier": getattr(getattr(backup, "memory", None), "enabled", None),
            "restored": [backup.restored_from, backup.restored_step],
            "moved": distance(leaves, jax.tree.leaves(host_state.params)),
            "describe": describe(cfg, strategy.mesh.devices.flat, host_state)}), flush=True)


def launch_once(cfg: dict, tier: bool, params_path: str | None, timeout: float,
                restarts: int = 0) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.pop("JAXDIST_MEMORY_TIER", None)
    if not tier:
        env["JAXDIST_MEMORY_TIER"] = "0"
    cmd = [sys.executable, "-m", "jaxdist.launch", "-n", "1", "--timeout", str(timeout),
           "--max-restarts", str(restarts),
           *(["--devices-per-process", str(cfg["devices"])] if cfg.get("devices") else []),
           os.path.abspath(__file__), "--child", "--config-json", json.dumps(cfg),
           *(["--params-out", params_path] if params_path else [])]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout + 60)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"the launched run (tier {'on' if tier else 'off'}) did not end "
                           f"within {timeout + 60:.0f} s") from e
    output = proc.stdout  # stderr merged in: the lines in the order written
    found = [line for line in output.splitlines() if CHILD_TAG in line]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"the launched run (tier {'on' if tier else 'off'}) failed with exit "
                           f"code {proc.returncode}; its output ends:\n{output[-4000:]}")
    got = json.loads(found[-1].split(CHILD_TAG, 1)[1])
    times = got["times"]
    # A killed and resumed run times nothing (its window opened in the first attempt).
    start, end = got["window"] if len(got["window"]) == 2 else (0.0, 0.0)
    # Step-end to step-end without a sync: fit keeps a few steps in flight and reads their
    # metrics a few at a time, so single intervals alternate between dispatch and wait (kept for
    # inspection); the step time is the synced window's.
    intervals = [b - a for a, b in zip(times, times[1:])]
    # Whatever the tier logs about itself (today's and the redesigned tier's lines alike).
    tier_log = sorted({re.sub(r"^\[\d+\]\s*", "", line).strip() for line in output.splitlines()
                       if re.search(r"memory tier|memory state tier|in-memory|at most \d+ step",
                                    line, re.IGNORECASE)})
    killed = re.search(r"killed after step (\d+); announced before the kill: (\{.*\})", output)
    # One process (-n 1): no survivor writes its newest copy, so the bound that holds is the
    # one for "no process of the job survives it" (what was written to the state directory).
    bounds = [(int(a), int(b)) for a, b in re.findall(
        r"at most (\d+) step\(s\), or (\d+) when no process of the job survives", output)]
    return {"step_s": (end - start) / (cfg["launch_steps"] - WARM_STEPS), "intervals": intervals,
            "restored": got.get("restored"), "killed_after": int(killed[1]) if killed else None,
            "announced_before_kill": json.loads(killed[2]) if killed else None,
            "bounds": [a for a, _ in bounds], "bounds_all": [b for _, b in bounds],
            "tier_enabled": got["tier"], "tier_log": tier_log, "moved": got["moved"],
            "describe": got["describe"], "wall_s": time.perf_counter() - t}


def run_launch(cfg: dict, tmp: str, ref_path: str | None, ref_moved: float | None,
               timeout: float, res: dict, save) -> None:
    """The launched runs, tier on and off alternated; each one's figures go into ``res`` (and
    ``save()`` is called) as soon as it ends, so a time limit keeps the runs done before it."""
    import numpy as np

    runs = res.setdefault("launch", {"on": [], "off": []})
    errors = res.setdefault("launch_errors", [])
    params: dict[str, str] = {}
    for r in range(cfg["launch_reps"]):
        for tier in ((True, False) if r % 2 == 0 else (False, True)):
            key = "on" if tier else "off"
            path = None if key in params else os.path.join(tmp, f"launch-{key}.npz")
            try:
                run = launch_once(cfg, tier, path, timeout)
            except RuntimeError as e:  # the other runs still tell something
                print(f"launch rep {r}, tier {key}: {e}", flush=True)
                errors.append(f"rep {r}, tier {key}: {str(e)[:2000]}")
                save()
                continue
            if path:
                params[key] = path
            for k, v in run.pop("describe").items():
                res.setdefault(k, v)
            runs[key].append(run)
            print(f"launch rep {r}, tier {key}: {run['step_s'] * 1e3:.2f} ms a step "
                  f"(run {run['wall_s']:.0f} s with start-up and compile)", flush=True)
            for line in run["tier_log"]:
                print(f"  tier log: {line}", flush=True)
            save()

    def load(path):
        with np.load(path) as f:
            return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]

    # Without the in-process part, the tier-on run is held to the tier-off one.
    if ref_path or "off" in params:
        reference = load(ref_path) if ref_path else load(params["off"])
        moved = ref_moved if ref_path else runs["off"][0]["moved"]
        res["launch_same_numbers"] = {f"launch_{key}": distance(load(path), reference) / moved
                                      for key, path in params.items() if ref_path or key != "off"}
        res["launch_reference"] = "hand-written" if ref_path else "launch tier off"
    save()


def run_kill(cfg: dict, tmp: str, timeout: float, res: dict, save) -> None:
    """The kill part: for replicated state and ``zero_stage=3``, an uninterrupted launched run
    and one whose process is SIGKILLed after step ``kill_at`` (restarted once by the launcher):
    the steps computed again against the bound the tier announced, and the parameters against
    the uninterrupted run's (exact in the deterministic pass)."""
    import numpy as np

    def load(path):
        with np.load(path) as f:
            return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]

    out = res.setdefault("kill", {})
    errors = res.setdefault("launch_errors", [])
    kill_at = max(WARM_STEPS + 1, cfg["launch_steps"] * 2 // 3)
    for zero in (0, 3):
        name = f"zero_stage={zero}"
        paths = {k: os.path.join(tmp, f"kill-{zero}-{k}.npz") for k in ("whole", "killed")}
        try:
            whole = launch_once({**cfg, "zero_stage": zero}, True, paths["whole"], timeout)
            killed = launch_once({**cfg, "zero_stage": zero, "kill_at": kill_at,
                                  "backup_dir": os.path.join(tmp, f"kill-{zero}-backup")},
                                 True, paths["killed"], timeout, restarts=1)
        except RuntimeError as e:
            print(f"kill, {name}: {e}", flush=True)
            errors.append(f"kill, {name}: {str(e)[:2000]}")
            save()
            continue
        source, step = killed["restored"] or (None, None)
        after = killed["killed_after"]
        before = killed["announced_before_kill"] or {}
        row = {"killed_after": after, "resumed_from": source, "resumed_step": step,
               "recomputed": None if after is None or step is None else after - step,
               "announced": before.get("bound_all"), "announced_survivor": before.get("bound"),
               "tier_enabled": killed["tier_enabled"],
               "distance": distance(load(paths["killed"]), load(paths["whole"])) / whole["moved"]}
        out[name] = row
        print(f"kill, {name}: killed after step {after}, resumed from {source} step {step}: "
              f"{row['recomputed']} step(s) computed again (announced at most "
              f"{row['announced']} when no process survives); parameters "
              f"{row['distance']:.1e} from the uninterrupted run's", flush=True)
        save()


# ---------------------------------------------------------------------------------------------
# The report.

def summarize(res: dict) -> dict:
    """Medians and ratios from the raw figures (also for ``--merge``d files)."""
    cfg = res["config"]
    tokens_per_step = cfg["batch"] * cfg["seq"]
    peak = peak_tflops(res.get("device_kind", "")) if cfg["dtype"] == "bfloat16" else None
    devices = res.get("num_devices", 1)
    loops = res.get("loops", {})
    rows = {}
    for name, raw in loops.items():
        speed = raw["tokens_per_s"]
        row = {"tokens_per_s": statistics.median(speed), "min": min(speed), "max": max(speed),
               "step_s": tokens_per_step / statistics.median(speed),
               "cpu_ms_per_step": 1e3 * statistics.median(raw["cpu_s_per_step"])}
        if "hand" in loops:  # same-repetition ratios
            row["ratio_to_hand"] = statistics.median(
                s / h for s, h in zip(speed, loops["hand"]["tokens_per_s"]))
        if name == "fit" and "hand_fed" in loops:
            row["ratio_to_hand_fed"] = statistics.median(
                s / h for s, h in zip(speed, loops["hand_fed"]["tokens_per_s"]))
        rows[name] = row
    for key, runs in res.get("launch", {}).items():
        if not runs:
            continue
        step = statistics.median(r["step_s"] for r in runs)
        row = {"tokens_per_s": tokens_per_step / step, "step_s": step,
               "min": tokens_per_step / max(r["step_s"] for r in runs),
               "max": tokens_per_step / min(r["step_s"] for r in runs)}
        if "hand" in rows:  # another process: a ratio of medians
            row["ratio_to_hand"] = row["tokens_per_s"] / rows["hand"]["tokens_per_s"]
        rows[f"launch_tier_{key}"] = row
    for row in rows.values():
        if peak and "flops_per_token" in res:
            row["mfu"] = row["tokens_per_s"] * res["flops_per_token"] / (peak * 1e12 * devices)
    summary = {"rows": rows, "peak_tflops": peak}
    launch = res.get("launch", {})
    if launch.get("on") and launch.get("off"):
        on, off = rows["launch_tier_on"]["step_s"], rows["launch_tier_off"]["step_s"]
        summary["tier_step_time_ratio"] = on / off
        summary["tier_steps_per_s_ratio"] = off / on
    same = {**res.get("same_numbers", {}), **res.get("launch_same_numbers", {}),
            **{f"kill_{k}": v["distance"] for k, v in res.get("kill", {}).items()}}
    summary["same_numbers"] = same
    # Compared only where the numbers are deterministic (--deterministic, or a CPU): the fast
    # pass's cuDNN attention and scatter-add gradients differ run to run on a GPU.
    summary["same_numbers_checked"] = not cfg.get("timing_only")
    summary["same_numbers_ok"] = (not summary["same_numbers_checked"]
                                  or all(v <= cfg["tolerance"] for v in same.values()))
    # A deterministic resume is bit-exact: the killed run ends on the uninterrupted one's
    # parameters (1e-6 of the distance training moved them), not merely near them.
    summary["kill_tolerance"] = 1e-6 if cfg.get("deterministic") else cfg["tolerance"]
    kills = res.get("kill", {}).values()
    summary["kill_ok"] = all(
        k["resumed_from"] == "memory" and k["recomputed"] is not None and k["announced"] is not None
        and k["distance"] <= summary["kill_tolerance"] for k in kills)
    # The bound is the tier's estimate from the copies and writes it timed: a write slower than
    # any timed (a loaded CPU) can break it. Held on a device; on a CPU, a figure (see main).
    summary["kill_within_bound"] = all(
        k["recomputed"] is not None and k["announced"] is not None
        and k["recomputed"] <= k["announced"] for k in kills)
    on = res.get("launch", {}).get("on", [])
    summary["tier_enabled_ok"] = all(r["tier_enabled"] is True for r in on) and all(
        r["tier_enabled"] is not True for r in res.get("launch", {}).get("off", []))
    return summary


def report(res: dict) -> str:
    cfg, s = res["config"], res["summary"]
    what = ("CPU tiny configuration: plumbing, not performance"
            if cfg["tiny"] or res.get("platform") == "cpu" else "performance run")
    lines = [
        f"GPT decoder, {res.get('params', 0) / 1e6:.1f} M parameters ({cfg['layers']} layers, "
        f"d {cfg['d_model']}, {cfg['heads']} heads, seq {cfg['seq']}, vocab {cfg['vocab']}, tied "
        f"head), batch {cfg['batch']} ({cfg['batch'] * cfg['seq']:,} tokens a step), "
        f"{cfg['dtype']} compute / float32 params, AdamW; attention: {res.get('attention', '?')}",
        f"device: {res.get('num_devices', '?')} x {res.get('device_kind', '?')} "
        f"({res.get('platform', '?')}); jax {res.get('jax', '?')}, "
        f"jaxdist {res.get('jaxdist', '?')}; {what}",
        f"{cfg['steps']} steps a window x {cfg['reps']} interleaved reps; launched runs: "
        f"{cfg['launch_steps']} steps x {cfg['launch_reps']} rep(s) each, alternated; "
        f"MFU = tokens/s x (6 N + 12 L d T) = {res.get('flops_per_token', 0) / 1e6:.1f} MFLOP a "
        f"token / peak " + (f"{s['peak_tflops']:.0f} TFLOP/s (dense bf16)" if s["peak_tflops"]
                            else "(unknown chip or not bf16: no MFU)"),
        f"load average: {res.get('load', '?')}", "",
        "| loop | tokens/s (median) | min..max | ÷ hand-written | MFU | step ms "
        "| host CPU ms/step |",
        "|---|---|---|---|---|---|---|"]
    for name, r in s["rows"].items():
        ratio = f"{r['ratio_to_hand']:.3f}" if "ratio_to_hand" in r else "–"
        if "ratio_to_hand_fed" in r:
            ratio += f" (÷ hand_fed {r['ratio_to_hand_fed']:.3f})"
        mfu = f"{r['mfu']:.1%}" if "mfu" in r else "–"
        cpu = f"{r['cpu_ms_per_step']:.2f}" if "cpu_ms_per_step" in r else "–"
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {r['min']:,.0f}..{r['max']:,.0f} | "
                     f"{ratio} | {mfu} | {r['step_s'] * 1e3:.2f} | {cpu} |")
    if "tier_step_time_ratio" in s:
        lines += ["", "in-memory tier cost (fit + BackupAndRestore, `jaxdist launch -n 1`): "
                      f"median step {s['rows']['launch_tier_on']['step_s'] * 1e3:.2f} ms on vs "
                      f"{s['rows']['launch_tier_off']['step_s'] * 1e3:.2f} ms off: step time x"
                      f"{s['tier_step_time_ratio']:.3f}, steps/s on ÷ off "
                      f"{s['tier_steps_per_s_ratio']:.3f}"]
        for key in ("on", "off"):
            logs = sorted({line for r in res["launch"][key] for line in r["tier_log"]})
            lines += [f"tier {key}, log: {line}" for line in logs] or [
                f"tier {key}, log: (no line about the tier)"]
    if any(k.startswith("launch_") for k in s["rows"]):
        lines += ["launch rows: a step is the synced window's time over its steps, median over "
                  "runs; their ratio to hand-written is one of medians (other processes)"]
    for name, k in res.get("kill", {}).items():
        lines += [f"SIGKILL under `jaxdist launch -n 1` ({name}): killed after step "
                  f"{k['killed_after']}, resumed from {k['resumed_from']} step {k['resumed_step']}, "
                  f"{k['recomputed']} step(s) computed again (announced before the kill: at most "
                  f"{k['announced']} when no process survives); "
                  f"parameters {k['distance']:.1e} from the uninterrupted run's"]
    lines += [f"launched run failed: {e}" for e in res.get("launch_errors", [])]
    same = ", ".join(f"{k} {v:.1e}" for k, v in s["same_numbers"].items())
    ref = res.get("launch_reference", "hand-written")
    lines += ["", f"same numbers (|params - reference| / |reference - initial|, L2 over all "
                  f"parameters; reference: the hand-written loop, for launch rows {ref}; "
                  f"tolerance {cfg['tolerance']:g}): {same or 'not checked'} -> "
                  + ("not held to it (--timing-only: the fast pass is not deterministic on a GPU)"
                     if not s.get("same_numbers_checked", True)
                     else 'OK' if s['same_numbers_ok'] else 'MISMATCH')]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="2 layers, d 64, seq 64: seconds on a CPU")
    for name, default in DEFAULT.items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                        help=f"default {default}; --tiny: {TINY[name]}")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="compute dtype (parameters stay float32)")
    ap.add_argument("--attention", default="auto", choices=("auto", "xla", "cudnn"),
                    help="jax.nn.dot_product_attention's implementation; auto: cudnn where it "
                         "compiles (GPU), else xla")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--devices", type=int, default=None,
                    help="simulated CPU devices (on an accelerator every local device is used)")
    ap.add_argument("--parts", nargs="+", default=["inproc", "launch"],
                    choices=("inproc", "launch", "kill"),
                    help="the in-process loops, the launched runs (tier on / off), a SIGKILL "
                         "under the launcher (replicated and zero_stage=3; --deterministic)")
    ap.add_argument("--deterministic", action="store_true",
                    help="XLA_FLAGS=--xla_gpu_deterministic_ops=true and XLA attention: the pass "
                         "whose numbers are compared (cuDNN attention and scatter-add gradients "
                         "differ run to run on GPUs, and AdamW amplifies it)")
    ap.add_argument("--timing-only", action="store_true",
                    help="the fast pass: numbers are reported, not held to --tolerance")
    ap.add_argument("--loops", nargs="+", default=list(LOOPS), choices=LOOPS,
                    help="in-process loops (hand always runs)")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="largest |params - hand-written's| / |hand-written's - initial| (L2) "
                         "(default 0.05 for bfloat16, 1e-3 for float32)")
    ap.add_argument("--part-timeout", type=float, default=600,
                    help="seconds for the in-process part, and for each launched run")
    ap.add_argument("--json", help="write the figures (raw and summary) to this file")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="report the union of earlier --json files (e.g. one per part)")
    # Internal: the parts' own processes.
    ap.add_argument("--inproc-out", help=argparse.SUPPRESS)
    ap.add_argument("--ref-out", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config-json", help=argparse.SUPPRESS)
    ap.add_argument("--params-out", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.config_json:
        cfg = json.loads(args.config_json)
        if args.child:
            return child(cfg, args.params_out)
        out = run_inproc(cfg, cfg["loops"], args.ref_out)
        with open(args.inproc_out, "w") as f:
            json.dump(out, f)
        return

    if args.merge:
        res: dict = {}
        for path in args.merge:
            with open(path) as f:
                part = json.load(f)
            part.pop("summary", None)
            load = "; ".join(x for x in (res.get("load"), part.get("load")) if x)
            res = {**res, **part, "config": {**res.get("config", {}), **part["config"]},
                   "load": load}
    else:
        cfg = dict(TINY if args.tiny else DEFAULT)
        cfg.update({k: getattr(args, k) for k in DEFAULT if getattr(args, k) is not None})
        if args.deterministic:  # before any JAX import: the children inherit it
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                       + " --xla_gpu_deterministic_ops=true").strip()
            args.attention = "xla"
        cfg.update(tiny=args.tiny, dtype=args.dtype, attention=args.attention, lr=args.lr,
                   deterministic=args.deterministic, timing_only=args.timing_only,
                   seed=args.seed, devices=args.devices,
                   loops=["hand", *[n for n in args.loops if n != "hand"]],
                   tolerance=args.tolerance if args.tolerance is not None
                   else (0.05 if args.dtype == "bfloat16" else 1e-3))
        if cfg["steps"] < 1 or cfg["reps"] < 1 or cfg["launch_reps"] < 1 \
                or cfg["launch_steps"] <= WARM_STEPS:
            raise SystemExit(f"--steps {cfg['steps']}, --reps {cfg['reps']}, --launch-reps "
                             f"{cfg['launch_reps']}, --launch-steps {cfg['launch_steps']}: "
                             f"expected >= 1 each and --launch-steps > {WARM_STEPS} (the warm-up "
                             "steps)")
        cfg["num_batches"] = max(cfg["steps"], cfg["launch_steps"], WARM_STEPS)
        res = {"benchmark": "gpt", "config": cfg, "command": " ".join(sys.argv),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": _load()}

        def save():
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(res, f, indent=1)

        tmp = tempfile.mkdtemp(prefix="jaxdist-gpt-bench-")
        # Later compiles of the same program (the launched runs' especially) read the first's.
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tmp, "xla-cache"))
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        try:  # the runs' parameters, backups and (unless one was set) compilation cache
            ref = None
            if "inproc" in args.parts:
                out = os.path.join(tmp, "inproc.json")
                ref = os.path.join(tmp, "reference.npz") if "launch" in args.parts else None
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                    p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
                # A process of its own: its device memory is given back before the launched runs.
                try:
                    code = subprocess.run([sys.executable, os.path.abspath(__file__), "--config-json",
                                           json.dumps(cfg), "--inproc-out", out,
                                           *(["--ref-out", ref] if ref else [])], env=env, cwd=ROOT,
                                          timeout=args.part_timeout).returncode
                except subprocess.TimeoutExpired:
                    raise SystemExit(f"the in-process loops did not end within --part-timeout "
                                     f"{args.part_timeout:g} s") from None
                if code != 0:
                    raise SystemExit(f"the in-process loops failed (exit code {code}; output above)")
                with open(out) as f:
                    res.update(json.load(f))
                cfg["attention"] = res["attention"]  # what "auto" chose
                save()
            if "launch" in args.parts:
                run_launch(cfg, tmp, ref, res.get("reference_moved"), args.part_timeout, res, save)
            if "kill" in args.parts:
                run_kill(cfg, tmp, args.part_timeout, res, save)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        res["load"] = (f"{' + '.join(args.parts)}: {res['load']} at the start, {_load()} at the "
                       "end")
    res["summary"] = summarize(res)
    print(report(res), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    # Exit codes after a printed report: 3 the loops disagree, 5 a SIGKILL did not resume from
    # memory exactly (or, on a device, computed more again than announced), 4 a launched run
    # failed (a part that could not run at all exits 1, as any Python error does).
    if not res["summary"]["same_numbers_ok"]:
        print("the loops did not compute the same thing (see 'same numbers' above): their figures "
              "do not compare like with like", file=sys.stderr)
        raise SystemExit(3)
    if not res["summary"]["kill_ok"]:
        print("a SIGKILL did not resume from memory, or not on the uninterrupted run's "
              "parameters (see 'SIGKILL' above)", file=sys.stderr)
        raise SystemExit(5)
    if not res["summary"]["kill_within_bound"]:
        on_cpu = cfg["tiny"] or res.get("platform") == "cpu"
        print("a SIGKILL computed more steps again than the tier announced (see 'SIGKILL' "
              f"above){': on a shared CPU, timing, not plumbing' if on_cpu else ''}",
              file=sys.stderr)
        if not on_cpu:
            raise SystemExit(5)
    if res.get("launch_errors"):
        print(f"{len(res['launch_errors'])} launched run(s) failed (see above)", file=sys.stderr)
        raise SystemExit(4)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
