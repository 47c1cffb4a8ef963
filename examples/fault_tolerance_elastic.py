"""Elastic fault tolerance: lose a whole host, take a new one, end on the uninterrupted parameters.

    python examples/fault_tolerance_elastic.py [--epochs 4]

Simulates three hosts on this machine: three agents, each `jaxdist launch --nnodes 2:3
--rdzv-endpoint 127.0.0.1:PORT -n 1 --devices-per-process 2 THIS_FILE --worker ...` (on real
hosts you run that same command once per host). The job is 32 steps (4 epochs of 8). At step 6
the third host is lost (its agent and process SIGKILLed): the two others re-form the job and
resume from the newest step held in memory. At step 14 a new host starts: the job stops at a
step every process agrees on, re-forms with three hosts, and the newcomer gets the state from a
live peer over the network. The final parameters are compared with those of an uninterrupted
2-process run: results do not depend on the number of devices, so they agree to float32 rounding.

The script checks that it did what it says: the first round had all three hosts, and the
three-host round after the join trained steps (exit status 1 otherwise). The agents put the stop
step about a second of steps ahead of the newest step, and a new agent takes seconds to start
on a busy machine: so that the join lands inside the 32-step job, the two-host round waits at
step 14 (the worker's `--hold` file) until the agents have agreed on the stop step.

`--worker` is the training script itself: an ordinary `fit` with `BackupAndRestore`.
"""

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(args):
    import jaxdist

    jaxdist.initialize()  # the agent set the job up: coordinator, ranks
    import jax
    import numpy as np

    from jaxdist import models

    class Pace(jaxdist.callbacks.Callback):
        """Slows the steps so that the driver can act at a chosen step; reports progress. With
        `--hold FILE`, a two-process round waits at step `--hold-at` while FILE exists (at most
        45 s, well inside the launcher's 60 s hang timeout)."""

        def on_train_batch_end(self, info):
            time.sleep(0.1)
            if jax.process_index() == 0:
                print(f"trained step {info.step} ({jax.process_count()} processes)", flush=True)
            if args.hold and info.step == args.hold_at and jax.process_count() == 2:
                deadline = time.monotonic() + 45
                while os.path.exists(args.hold) and time.monotonic() < deadline:
                    time.sleep(0.05)

    class Announce(jaxdist.callbacks.Callback):
        """After BackupAndRestore in the list: says where this round's processes resumed."""

        def on_train_begin(self, info):
            if jax.process_index() == 0:
                print(f"{jax.process_count()} processes: resumed from {backup.restored_from} "
                      f"step {backup.restored_step}", flush=True)

    strategy = jaxdist.MultiWorkerMirroredStrategy()
    (x, y), _ = jaxdist.datasets.digits()
    state = models.create_train_state(models.MLP(hidden=(32,)), x[:1], seed=1)
    backup = jaxdist.callbacks.BackupAndRestore(args.backup, every_n_steps=100)
    history = jaxdist.fit(strategy.step(models.classifier_train_step), state,
                          strategy.distribute((x[:768], y[:768]), 96, shuffle=True, seed=5),
                          epochs=args.epochs, callbacks=[Pace(), backup, Announce()], verbose=0)
    if jax.process_index() == 0:
        np.savez(args.out, *jax.tree.leaves(jax.device_get(history.state.params)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--worker", action="store_true", help="run as one process of the job")
    ap.add_argument("--backup", help="(worker) backup directory")
    ap.add_argument("--out", help="(worker) where rank 0 writes the final parameters")
    ap.add_argument("--hold", help="(worker) wait at step --hold-at while this file exists")
    ap.add_argument("--hold-at", type=int, default=14, help="(worker) the step to wait at")
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    import numpy as np

    env = dict(os.environ, PYTHONPATH=ROOT)
    for name in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "JAX_PLATFORMS", "TF_CONFIG"):
        env.pop(name, None)
    with tempfile.TemporaryDirectory() as tmp:
        hold = os.path.join(tmp, "hold")

        def job_args(name):
            return [__file__, "--worker", "--epochs", str(args.epochs), "--backup",
                    os.path.join(tmp, name + "-backup"), "--out", os.path.join(tmp, name + ".npz")]

        print("uninterrupted run: jaxdist launch -n 2 --devices-per-process 2", flush=True)
        subprocess.run([sys.executable, "-m", "jaxdist.launch", "-n", "2",
                        "--devices-per-process", "2", *job_args("uninterrupted")], env=env,
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        agents, logs = [], []

        def start_host():
            logs.append(os.path.join(tmp, f"host{len(agents)}.log"))
            # A long last call: the first round closes as soon as all three agents have
            # registered, and a slow start (seconds on a busy machine) still makes it.
            cmd = [sys.executable, "-m", "jaxdist.launch", "--nnodes", "2:3", "--rdzv-endpoint",
                   f"127.0.0.1:{port}", "--rdzv-id", "example", "-n", "1",
                   "--devices-per-process", "2", "--max-restarts", "3", "--rdzv-last-call", "60",
                   *job_args("elastic"), "--hold", hold]
            with open(logs[-1], "wb") as f:
                agents.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))

        def wait_for(pattern, hosts=(0,)):
            """Until a line of one of `hosts`' logs matches (the agents of hosts 0 and 1 both
            watch the job: either may be the one that asks for the stop step)."""
            while not any(re.search(pattern, open(logs[h]).read()) for h in hosts):
                if agents[0].poll() is not None:
                    sys.exit(f"host 0's agent exited:\n{open(logs[0]).read()[-3000:]}")
                time.sleep(0.05)

        open(hold, "w").close()
        start_host()
        wait_for("serving the rendezvous store")  # the first agent hosts the rendezvous
        start_host()
        start_host()
        wait_for(r"trained step 6\b")
        print("step 6: host 2 is lost (its agent and process SIGKILLed)", flush=True)
        agents[2].kill()
        wait_for(r"trained step 14 \(2 processes\)")
        print("step 14: a new host starts", flush=True)
        start_host()
        wait_for(r"a host joins: asking every process to stop at step \d+", hosts=(0, 1))
        os.remove(hold)  # the stop step is agreed: the two-host round goes on to it
        codes = [a.wait(timeout=600) for a in agents]
        text = "".join(open(p).read() for p in logs)
        for line in text.splitlines():
            pattern = r"\] (round \d+:|round \d+ (failed|ended)|a host joins|stopped at)"
            if re.search(pattern, line) or "resumed from" in line:
                print(line)
        if codes[:2] != [0, 0] or codes[3] != 0:
            sys.exit(f"agents exited with {codes}:\n{text[-3000:]}")
        done = [int(s) for d in re.findall(r"last completed step per local rank \{([^}]*)\}",
                                           text) for s in re.findall(r": (\d+)", d)]
        first = re.search(r"resumed from memory step (\d+)", open(logs[0]).read())
        if done and first:
            print(f"after losing the host: steps computed again: {max(done) - int(first[1])}")
        # What the script promises, checked: three hosts at the start, and a three-host round
        # after the join that trained (the join once landed past the job's end: the agents
        # agreed to stop at step 42 of 32, and the three-host round trained nothing).
        log0 = open(logs[0]).read()  # rank 0 (host 0 keeps its place) prints the steps
        rounds = [(int(r), int(h)) for r, h in re.findall(r"round (\d+): (\d) host\(s\)", log0)]
        after_join = re.split(r"stopped at step \d+ to re-form the job", log0)[-1]
        late = [int(s) for s in re.findall(r"trained step (\d+) \(3 processes\)", after_join)]
        print(f"rounds (round, hosts): {rounds}; the three-host round after the join trained "
              f"steps {min(late, default=None)}..{max(late, default=None)}")
        with np.load(os.path.join(tmp, "uninterrupted.npz")) as a, \
                np.load(os.path.join(tmp, "elastic.npz")) as b:
            diff = max(float(np.abs(a[k] - b[k]).max()) for k in a.files)
        print(f"same parameters as the uninterrupted run (max abs difference {diff:.1e}): "
              f"{diff <= 2e-5}")
        did_its_job = bool(rounds) and rounds[0][1] == 3 and rounds[-1][1] == 3 and bool(late)
        if not did_its_job:
            print("the example did not do what it says: the first round did not have 3 hosts, or "
                  "the three-host round after the join trained no step", file=sys.stderr)
        sys.exit(0 if diff <= 2e-5 and did_its_job else 1)


if __name__ == "__main__":
    main()
