"""What a failure costs: steps lost, seconds to the next completed step, parameters vs no failure.

    python benchmarks/fault_tolerance.py [--out benchmarks/results/fault_tolerance.md]

Simulated hosts on this machine: 3 elastic agents (``jaxdist launch --nnodes 2:3``) x 1 process
x 2 CPU devices, the README MLP (``models.MLP()``, 64-256-128-10 on digits), global batch 96,
4 epochs of 8 steps, ``BackupAndRestore(every_n_steps=8)``, JAX's persistent compilation cache
shared by the agents (as a job's cache directory would be). Each scenario acts at step 6:

* SIGKILL of one process (rank 1), the other hosts' agents stay;
* loss of a whole host (its agent SIGKILLed; its process dies with it);
* loss of the rendezvous store's host (agent 0 SIGKILLed: the store moves to the next agent);
* SIGSTOP of one process (a hang; ``--hang-timeout 5``);
* SIGTERM to an agent (a preemption notice: its host leaves at an agreed step);
* a host joining (2 agents running, a third started at step 4);
* the same SIGKILL under the single-host launcher (``jaxdist launch -n 3``, no rendezvous);
* today's restart-all for comparison: ``jaxdist launch -n 3`` with the in-memory tier off
  (``JAXDIST_MEMORY_TIER=0``) and no compilation cache, rank 1 SIGKILLed at step 6; the group
  restarts from the last persistent backup (step 0 here, as the first backup is at step 8).

"Seconds to the next step" runs from the failure (the fault's own timestamp, or the signal sent)
to the first step of the re-formed job on rank 0 (its callback; the state of the step before it
is then written). It includes detection (a dead process: at once; a lost host: <= 3 s; a hang:
the hang timeout), stopping the old processes, the rendezvous, starting Python and JAX, the
resume, and compiling (from the persistent cache where there is one). For SIGTERM and a joining
host it includes running on to the agreed stop step (about one second of steps ahead). A
slowdown (``--sleep``, 0.1 s per step) lets the driver act at a chosen step.

``--tier-cost`` measures what the in-memory tier costs a job whose state is the size users run
(and what a failure then costs): 2 processes under ``jaxdist launch -n 2`` (1 CPU device each),
MLP 784-4096-4096-10 with Adam (about 240 MB of train state per process), global batch 256 of
synthetic data, ``fit`` + ``BackupAndRestore`` (no backup inside the timed steps), the tier on
(default) and off (``JAXDIST_MEMORY_TIER=0``) in alternation; each run times a window of steps
synced at both ends (single step intervals are not step times: ``fit`` runs ahead of the
devices). Then rank 1 is SIGKILLed mid-run and the steps computed again are set against the
bound the launcher announced. ``--quick`` runs the same plumbing on a small model in seconds
(CI: ``tests/test_benchmarks.py``).

``--overhead-only`` measures the tier on tiny steps (1.5 MB of state, about 10 ms a step, where
a copy's fixed costs weigh most): ``fit`` off and on in turn in one process, 12 pairs, the median
of the pairs' ratios (on this 2-core machine one process differs from the next by more than the
tier costs; the scenario run ends with the same figure).

``--worker`` and ``--tier-worker`` are the training scripts themselves.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(args) -> None:
    import jaxdist

    jaxdist.initialize()
    import jax
    import numpy as np

    from jaxdist import models

    attempt = int(os.environ.get("JAXDIST_RESTART_COUNT", "0"))
    me = jax.process_index()

    class Report(jaxdist.callbacks.Callback):
        def on_train_batch_end(self, info):
            time.sleep(args.sleep)
            if me == 0:
                print(f"trained step {info.step} t={time.time():.3f}", flush=True)

    class Fault(jaxdist.callbacks.Callback):
        def on_train_batch_end(self, info):
            if attempt == 0 and me == 1 and info.step == args.at and args.fault != "none":
                jax.block_until_ready(info.state)
                print(f"fault {args.fault} t={time.time():.3f} step {info.step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)

    strategy = jaxdist.MultiWorkerMirroredStrategy()
    (x, y), _ = jaxdist.datasets.digits()
    state = models.create_train_state(models.MLP(), x[:1], seed=1)
    backup = jaxdist.callbacks.BackupAndRestore(args.backup, every_n_steps=8)
    data = strategy.distribute((x[:768], y[:768]), 96, shuffle=True, seed=5)
    history = jaxdist.fit(strategy.step(models.classifier_train_step), state, data,
                          epochs=args.epochs, callbacks=[Report(), backup, Fault()], verbose=0)
    if me == 0:
        print(f"resumed from {backup.restored_from} step {backup.restored_step}", flush=True)
        np.savez(args.out, *jax.tree.leaves(jax.device_get(history.state.params)))


def tier_worker(args) -> None:
    """One process of the ``--tier-cost`` job."""
    import jaxdist

    jaxdist.initialize()
    import jax
    import numpy as np

    from jaxdist import models

    attempt = int(os.environ.get("JAXDIST_RESTART_COUNT", "0"))
    me = jax.process_index()
    times: list[float] = []

    class Clock(jaxdist.callbacks.Callback):
        """Syncs twice: when the timed window opens and at its last step."""

        def on_train_batch_end(self, info):
            if info.step in (args.warmup, args.steps):
                jax.block_until_ready(info.state)
                times.append(time.perf_counter())
            if me == 0:
                print(f"trained step {info.step} t={time.time():.3f}", flush=True)

    class Fault(jaxdist.callbacks.Callback):
        def on_train_batch_end(self, info):
            if attempt == 0 and me == 1 and info.step == args.at and args.fault == "kill":
                jax.block_until_ready(info.state)
                print(f"fault kill t={time.time():.3f} step {info.step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch * 4, 784), dtype=np.float32)
    y = rng.integers(0, 10, args.batch * 4).astype(np.int32)
    strategy = jaxdist.MultiWorkerMirroredStrategy()
    state = models.create_train_state(models.MLP(hidden=(args.hidden, args.hidden)), x[:1],
                                      seed=1)
    if me == 0:
        nbytes = sum(a.nbytes for a in jax.tree.leaves(state) if hasattr(a, "nbytes"))
        print(f"state {nbytes / 1e6:.1f} MB per process", flush=True)
    backup = jaxdist.callbacks.BackupAndRestore(args.backup, every_n_steps=10**6)
    data = strategy.distribute((x, y), args.batch, shuffle=True, seed=5)
    jaxdist.fit(strategy.step(models.classifier_train_step), state, data,
                epochs=-(-args.steps // len(data)), steps_per_epoch=None,
                callbacks=[Clock(), backup, Fault()], verbose=0)
    if me == 0:
        if len(times) == 2:
            rate = (args.steps - args.warmup) / (times[1] - times[0])
            print(f"steps/s {rate:.4f}", flush=True)
        print(f"resumed from {backup.restored_from} step {backup.restored_step}", flush=True)


def tier_cost(args) -> str:
    """The ``--tier-cost`` table: steps/s with the tier on and off, and a SIGKILL's cost."""
    import statistics

    tmp = tempfile.mkdtemp(prefix="jaxdist-tier-cost-")
    cache = os.path.join(tmp, "xla-cache")
    size = (["--hidden", "64", "--batch", "64", "--steps", "12", "--warmup", "4"] if args.quick
            else ["--hidden", "4096", "--batch", "256", "--steps", str(args.tier_steps),
                  "--warmup", "5"])

    def launch(name, *extra, env=None, restarts=0):
        job = Job(tmp, name, cache, env)
        job.start(["-n", "2", "--devices-per-process", "1", "--max-restarts", str(restarts)],
                  "--tier-worker", *size, *extra)
        code = job.finish(timeout=1800)[0]
        if code != 0:
            raise RuntimeError(f"{name} failed ({code}):\n{job.text()[-3000:]}")
        return job

    rates: dict[str, list[float]] = {"on": [], "off": []}
    announced, state = None, None
    for rep in range(args.reps):
        for mode in ("on", "off") if rep % 2 == 0 else ("off", "on"):
            print(f"tier {mode}, run {rep + 1} of {args.reps} ...", flush=True)
            job = launch(f"{mode}-{rep}", env={"JAXDIST_MEMORY_TIER": "0"} if mode == "off"
                         else None)
            out = job.text()
            rates[mode].append(float(re.search(r"steps/s ([\d.]+)", out)[1]))
            state = re.search(r"state ([\d.]+ MB) per process", out)[1]
            if mode == "on":
                announced = re.findall(r"in-memory tier \(rank 0\): .*", out)[-1]
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    bound = int(re.search(r"a failure costs at most (\d+) step", announced)[1])
    kill_at = 8 if args.quick else max(12, args.tier_steps // 2)
    print(f"SIGKILL of rank 1 at step {kill_at} ...", flush=True)
    job = launch("kill", "--fault", "kill", "--at", str(kill_at), restarts=1)
    out = job.text()
    resumed = re.search(r"resumed from (\w+) step (\w+)", out.split("trained step")[-1])
    lost = kill_at - (int(resumed[2]) if resumed[2] != "None" else 0)
    kill_line = [line for line in re.findall(r"in-memory tier \(rank 0\): .*", out)][:1]
    return "\n".join([
        "| tier | steps/s (median) | runs | ratio to off |", "|---|---|---|---|",
        f"| off (`JAXDIST_MEMORY_TIER=0`) | {off:.3f} | "
        f"{', '.join(f'{r:.3f}' for r in rates['off'])} | 1 |",
        f"| on (default) | {on:.3f} | {', '.join(f'{r:.3f}' for r in rates['on'])} | "
        f"{on / off:.3f} |", "",
        f"State: {state} per process. The launcher announced: {announced}", "",
        f"SIGKILL of rank 1 after step {kill_at}: resumed from {resumed[1]} step {resumed[2]}, "
        f"{lost} step(s) computed again (announced bound: {bound}; "
        f"{'within' if lost <= bound else 'BEYOND'} it). "
        + (f"That run's tier line: {kill_line[0]}" if kill_line else "")])


_OVERHEAD = """
import os, sys, tempfile, time
import jax, jaxdist
from jaxdist import models
from jaxdist.launch import heartbeat
(x, y), _ = jaxdist.datasets.digits()
strategy = jaxdist.MirroredStrategy()
data = strategy.distribute((x, y), 96, shuffle=True, seed=5)
step = strategy.step(models.classifier_train_step)
shm = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
def run(epochs, on):
    # on: what `jaxdist launch` sets up (a state directory: the tier and the heartbeat), a tier
    # of its own each run (never resuming another run's snapshot); off: neither (tier off)
    if on:
        os.environ["JAXDIST_STATE_DIR"] = tempfile.mkdtemp(dir=shm)
    else:
        os.environ.pop("JAXDIST_STATE_DIR", None)
    state = models.create_train_state(models.MLP(), x[:1], seed=1)
    backup = jaxdist.callbacks.BackupAndRestore(tempfile.mkdtemp(), every_n_steps=10**6)
    t = time.perf_counter()
    h = jaxdist.fit(step, state, data, epochs=epochs, callbacks=[backup], verbose=0)
    jax.block_until_ready(h.state)
    rate = len(data) * epochs / (time.perf_counter() - t)
    if heartbeat._current is not None:  # the next run starts without one, or with its own
        heartbeat._current.close()
        heartbeat._current = None
    return rate
run(1, False); run(1, True)  # compile; first use of every path
for _ in range(int(sys.argv[2])):
    print(run(int(sys.argv[1]), False), run(int(sys.argv[1]), True), flush=True)
"""


def overhead(repeats: int = 12, epochs: int = 10) -> tuple[float, float, float]:
    """Steps/s of ``fit`` + ``BackupAndRestore`` with the memory tier off and on (one process,
    2 devices, the README MLP, batch 96): runs of ``epochs`` epochs, off and on in turn in one
    process (separate processes differ by more than the tier costs on this machine), ``repeats``
    pairs. Returns the medians of off and on and the median of the pairs' ratios."""
    import statistics
    import subprocess as sp

    env = dict(os.environ, PYTHONPATH=ROOT, JAX_NUM_CPU_DEVICES="2")
    env.pop("JAXDIST_STATE_DIR", None)
    out = sp.run([sys.executable, "-c", _OVERHEAD, str(epochs), str(repeats)], env=env,
                 capture_output=True, text=True, check=True, timeout=1200).stdout
    pairs = [tuple(map(float, line.split())) for line in out.splitlines() if line.strip()]
    return (statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs),
            statistics.median(p[1] / p[0] for p in pairs))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    def __init__(self, tmp: str, name: str, cache: str | None, env_extra=None):
        self.dir = os.path.join(tmp, name)
        os.makedirs(self.dir)
        self.env = dict(os.environ, PYTHONPATH=ROOT, **(env_extra or {}))
        for k in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "JAX_PLATFORMS", "TF_CONFIG"):
            self.env.pop(k, None)
        if cache:
            self.env["JAX_COMPILATION_CACHE_DIR"] = cache
        self.port = _free_port()
        self.procs: list[subprocess.Popen] = []
        self.logs: list[str] = []

    def worker_args(self, *extra):
        role = [] if "--tier-worker" in extra else ["--worker"]
        return [__file__, *role, "--out", os.path.join(self.dir, "out.npz"), "--backup",
                os.path.join(self.dir, "backup"), *extra]

    def start(self, launcher_args, *extra):
        log = os.path.join(self.dir, f"agent{len(self.procs)}.log")
        with open(log, "wb") as f:
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "jaxdist.launch", *launcher_args,
                 *self.worker_args(*extra)], env=self.env, cwd=ROOT, stdout=f,
                stderr=subprocess.STDOUT))
        self.logs.append(log)

    def start_agent(self, *extra, last_call=10, hang=None):
        self.start(["--nnodes", "2:3", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "-n", "1",
                    "--devices-per-process", "2", "--max-restarts", "2", "--rdzv-timeout", "30",
                    "--rdzv-last-call", str(last_call),
                    *(["--hang-timeout", str(hang)] if hang else [])], *extra)
        if len(self.procs) == 1:
            self.wait_for(0, "serving the rendezvous store")

    def text(self, i=None) -> str:
        return "".join(open(p, errors="replace").read()
                       for p in (self.logs if i is None else [self.logs[i]]))

    def wait_for(self, i, pattern, timeout=300):
        end = time.monotonic() + timeout
        while not re.search(pattern, self.text(i)):
            if time.monotonic() > end or self.procs[i].poll() is not None:
                raise RuntimeError(f"no {pattern!r}:\n{self.text()[-3000:]}")
            time.sleep(0.02)

    def finish(self, timeout=300):
        codes = [p.wait(timeout=timeout) for p in self.procs]
        return codes

    def result(self, failure_t, reference, rank0=0):
        """The row of a finished job; `rank0` is the agent whose log has rank 0 after the failure."""
        import numpy as np

        out = self.text(rank0)
        m = re.search(r"resumed from (\w+) step (\w+)", out.split("trained step")[-1])
        resumed = int(m[2]) if m[2] != "None" else 0
        done = [int(s) for d in re.findall(r"last completed step per local rank \{([^}]*)\}",
                                           self.text()) for s in re.findall(r": (\d+)", d)]
        stopped = [int(s) for s in re.findall(r"(?:stopped at|left the job at) step (\d+)",
                                               self.text())]
        faults = [int(s) for s in re.findall(r"fault \w+ t=[\d.]+ step (\d+)", self.text())]
        before = max(done + stopped + faults, default=0)
        if failure_t is None:
            failure_t = float(re.search(r"fault \w+ t=([\d.]+)", self.text())[1])
        # the first step of the re-formed job (after the agent's next round / the restart)
        marker = re.search(r"\] round 1: |restarting the group", out)
        after = [(int(s), float(t)) for s, t in
                 re.findall(r"trained step (\d+) t=([\d.]+)", out[marker.end():] if marker
                            else "")]
        recovery = after[0][1] - failure_t if after else float("nan")
        with np.load(os.path.join(self.dir, "out.npz")) as f:
            params = [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]
        diff = (max(float(np.abs(a - b).max()) for a, b in zip(params, reference))
                if reference is not None else 0.0)
        return dict(lost=before - resumed, resumed=f"{m[1]} step {resumed}",
                    recovery=recovery, diff=diff, params=params)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--backup")
    ap.add_argument("--fault", default="none")
    ap.add_argument("--at", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--sleep", type=float, default=0.1)
    ap.add_argument("--overhead-only", action="store_true",
                    help="only measure the in-memory tier's cost per step (small state)")
    ap.add_argument("--tier-cost", action="store_true",
                    help="the tier's cost at ~240 MB of state per process, and a SIGKILL's")
    ap.add_argument("--tier-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true",
                    help="with --tier-cost: a small model, one repetition (plumbing, seconds)")
    ap.add_argument("--reps", type=int, default=3, help="--tier-cost: runs per mode")
    ap.add_argument("--tier-steps", type=int, default=40, help="--tier-cost: steps per run")
    ap.add_argument("--hidden", type=int, default=4096, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=40, help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=5, help=argparse.SUPPRESS)
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "fault_tolerance.md"))
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.tier_worker:
        return tier_worker(args)
    if args.tier_cost:
        if args.quick:
            args.reps = 1
        table = tier_cost(args)
        print(table)
        if args.results and not args.quick:
            with open(args.results.replace(".md", "_tier.md"), "w") as f:
                f.write("# The in-memory tier's cost at a state size users run\n\n"
                        f"`python benchmarks/fault_tolerance.py --tier-cost` "
                        f"({time.strftime('%Y-%m-%d %H:%M')}, CPU only, 2 cores, load "
                        f"{os.getloadavg()[0]:.1f} at the end; see the script's docstring).\n\n"
                        + table + "\n")
        return
    if args.overhead_only:
        off, on, ratio = overhead()
        print(f"fit steps/s, memory tier off {off:.1f}, on {on:.1f}; on/off per pair, median "
              f"{ratio:.3f} ({ratio - 1:+.1%})")
        return

    tmp = tempfile.mkdtemp(prefix="jaxdist-ft-bench-")
    cache = os.path.join(tmp, "xla-cache")
    rows = []

    def agents(name, n=3, **kw):
        job = Job(tmp, name, cache)
        for _ in range(n):
            job.start_agent(**kw)
        return job

    print("uninterrupted run ...", flush=True)
    ref = agents("uninterrupted")
    assert ref.finish() == [0, 0, 0], ref.text()[-3000:]
    reference = ref.result(0.0, None)["params"]

    print("SIGKILL of one process ...", flush=True)
    job = Job(tmp, "kill", cache)
    for _ in range(3):
        job.start_agent("--fault", "kill")
    assert job.finish()[:3] == [0, 0, 0], job.text()[-3000:]
    rows.append(("SIGKILL of one process", job.result(None, reference)))

    print("loss of a whole host ...", flush=True)
    job = agents("host")
    job.wait_for(0, r"trained step 6 ")
    t = time.time()
    job.procs[2].kill()
    assert job.finish()[:2] == [0, 0], job.text()[-3000:]
    rows.append(("loss of a whole host (agent + process SIGKILLed)", job.result(t, reference)))

    print("loss of the rendezvous store's host ...", flush=True)
    job = agents("store-host")
    job.wait_for(0, r"trained step 6 ")
    t = time.time()
    job.procs[0].kill()  # the agent serving the store (and rank 0's host)
    assert job.finish()[1:3] == [0, 0], job.text()[-3000:]
    (successor,) = [i for i in (1, 2) if "this agent serves it now" in job.text(i)]
    rows.append(("loss of the rendezvous store's host (store moves to the next agent)",
                 job.result(t, reference, rank0=successor)))

    print("SIGSTOP of one process ...", flush=True)
    job = Job(tmp, "stop", cache)
    for _ in range(3):
        job.start_agent("--fault", "stop", hang=5)
    assert job.finish()[:3] == [0, 0, 0], job.text()[-3000:]
    rows.append(("SIGSTOP of one process (hang, --hang-timeout 5)", job.result(None, reference)))

    print("SIGTERM to an agent ...", flush=True)
    job = agents("sigterm")
    job.wait_for(0, r"trained step 6 ")
    t = time.time()
    job.procs[2].send_signal(signal.SIGTERM)
    assert job.finish() == [0, 0, 0], job.text()[-3000:]
    rows.append(("SIGTERM to an agent (preemption)", job.result(t, reference)))

    print("a host joining ...", flush=True)
    job = agents("join", n=2, last_call=1)
    job.wait_for(0, r"trained step 4 ")
    t = time.time()
    job.start_agent(last_call=1)
    assert job.finish() == [0, 0, 0], job.text()[-3000:]
    rows.append(("a host joining (2 -> 3 hosts)", job.result(t, reference)))

    print("single-host launcher, SIGKILL of one process ...", flush=True)
    job = Job(tmp, "single-host", cache)
    job.start(["-n", "3", "--devices-per-process", "2", "--max-restarts", "1"],
              "--fault", "kill")
    assert job.finish() == [0], job.text()[-3000:]
    rows.append(("single host, `jaxdist launch -n 3`: SIGKILL of one process",
                 job.result(None, reference)))

    print("today's restart-all ...", flush=True)
    job = Job(tmp, "restart-all", None, {"JAXDIST_MEMORY_TIER": "0"})
    job.start(["-n", "3", "--devices-per-process", "2", "--max-restarts", "1"],
              "--fault", "kill")
    assert job.finish() == [0], job.text()[-3000:]
    rows.append(("today: restart-all from the last backup (no memory tier, no compile cache)",
                 job.result(None, reference)))

    lines = ["| scenario | steps lost | resumed from | seconds to the next step | "
             "max abs param diff vs uninterrupted |", "|---|---|---|---|---|"]
    for name, r in rows:
        lines.append(f"| {name} | {r['lost']} | {r['resumed']} | {r['recovery']:.1f} | "
                     f"{r['diff']:.1e} |")
    table = "\n".join(lines)
    off, on, ratio = overhead()
    table += (f"\n\nCost of the in-memory tier on tiny steps (one process, 2 devices, same MLP, "
              f"batch 96, `fit` + `BackupAndRestore`, 12 pairs of 10-epoch runs off and on in "
              f"turn in one process, each with a tier of its own): {off:.1f} steps/s without, "
              f"{on:.1f} with; on/off per pair, median {ratio:.3f} ({ratio - 1:+.1%}).")
    print(table)
    if args.results:
        with open(args.results, "w") as f:
            f.write("# Fault tolerance: what a failure costs\n\n"
                    f"`python benchmarks/fault_tolerance.py` ({time.strftime('%Y-%m-%d')}, "
                    "CPU only, 2 cores shared with other jobs; 3 simulated hosts = 3 agents x 1 "
                    "process x 2 devices, MLP 64-256-128-10 on digits, global batch 96, 32 "
                    "steps, failure at step 6; see the script's docstring).\n\n"
                    + table + "\n")


if __name__ == "__main__":
    main()
