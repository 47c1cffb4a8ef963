"""Fault tolerance: kill a worker mid-run, restart the job, and end exactly where an uninterrupted run ends.

    python examples/fault_tolerance.py [--epochs 3] [--kill-at 7]

Runs the same 2-process job (`jaxdist launch -n 2 --devices-per-process 2`) twice: once
undisturbed, once with process 1 SIGKILLed at step `--kill-at` on its first attempt. The
launcher sees the dead rank, stops the other one and starts the group again
(`--max-restarts 1`); `BackupAndRestore` restores the state, the step and the input position of
the newest step held in memory (the launcher's in-memory tier: at most one step is computed
again; the backups on disk are the fallback), and the job finishes. The two runs' parameters are
compared bit for bit. For several hosts, a lost or joining host, see
`examples/fault_tolerance_elastic.py`.

`--worker` is the training script itself (what `jaxdist launch` runs on every process).
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile


def worker(args):
    import jaxdist

    jaxdist.initialize()  # before any other JAX call
    import jax
    import numpy as np

    from jaxdist import models

    class KillAt(jaxdist.callbacks.Callback):
        """Stands in for a crash: process 1 dies with SIGKILL (no chance to save) on its first attempt."""

        def on_train_batch_end(self, info):
            first_attempt = os.environ.get("JAXDIST_RESTART_COUNT", "0") == "0"
            if first_attempt and info.step == args.kill_at and jax.process_index() == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    strategy = jaxdist.MultiWorkerMirroredStrategy()
    (x, y), _ = jaxdist.datasets.digits()
    x, y = x[:700], y[:700]
    state = models.create_train_state(models.MLP(hidden=(32,)), x[:1], seed=1)
    backup = jaxdist.callbacks.BackupAndRestore(args.backup, every_n_steps=2)
    callbacks = [KillAt(), backup] if args.kill_at else [backup]
    history = jaxdist.fit(strategy.step(models.classifier_train_step), state,
                          strategy.distribute((x, y), 96, shuffle=True, seed=5),
                          epochs=args.epochs, callbacks=callbacks, verbose=0)
    params = jax.tree.leaves(jax.device_get(history.state.params))
    if jax.process_index() == 0:
        np.savez(args.out, *params)
        print(f"attempt {os.environ.get('JAXDIST_RESTART_COUNT', '0')}: resumed from "
              f"{backup.restored_from} step {backup.restored_step}, finished at step "
              f"{int(history.state.step)}", flush=True)


def launch(script_args, restarts):
    cmd = [sys.executable, "-m", "jaxdist.launch", "-n", "2", "--devices-per-process", "2",
           "--max-restarts", str(restarts), "--timeout", "600", __file__, "--worker", *script_args]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--kill-at", type=int, default=7, help="the step at which process 1 dies")
    ap.add_argument("--worker", action="store_true", help="run as one process of the job")
    ap.add_argument("--backup", help="(worker) backup directory")
    ap.add_argument("--out", help="(worker) where process 0 writes the final parameters")
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name, kill_at in [("uninterrupted", 0), ("killed", args.kill_at)]:
            out = os.path.join(tmp, name + ".npz")
            launch(["--epochs", str(args.epochs), "--kill-at", str(kill_at),
                    "--backup", os.path.join(tmp, name), "--out", out], restarts=1)
            with np.load(out) as f:
                runs[name] = [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]
        # Exact, not a tolerance: on CPU the resumed run repeats the same float32 operations
        # in the same order from the restored state and input position (DESIGN: resume is
        # bitwise exact on CPU); any difference means a step was lost or repeated.
        exact = all(np.array_equal(a, b) for a, b in zip(*runs.values()))
        print(f"killed-and-resumed run bitwise equal to the uninterrupted run: {exact}")
        sys.exit(0 if exact else 1)


if __name__ == "__main__":
    main()
