"""Trains the digits MLP with BackupAndRestore; used by the resume / preemption tests.

Runs as one process (MirroredStrategy over JAX_NUM_CPU_DEVICES devices) or under `jaxdist launch`
(MultiWorkerMirroredStrategy after jaxdist.initialize()). Optionally kills itself at a given step on
its first attempt, with SIGKILL (a crash) or SIGTERM (a preemption notice).

    python train_resume.py --backup DIR --out params.npz [--kill-at 7 --signal KILL --rank 1]
"""

import argparse
import os
import signal

import jax
import numpy as np

import jaxdist
from jaxdist import models


class KillAt(jaxdist.callbacks.Callback):
    def __init__(self, step, sig, rank):
        self.step, self.sig, self.rank = step, sig, rank

    def on_train_batch_end(self, info):
        first_attempt = os.environ.get("JAXDIST_RESTART_COUNT", "0") == "0"
        if first_attempt and info.step == self.step and jax.process_index() == self.rank:
            os.kill(os.getpid(), self.sig)


class Sleep(jaxdist.callbacks.Callback):
    """Slows steps down so that JAX's preemption sync point (~1 s after SIGTERM) comes mid-run."""

    def __init__(self, seconds):
        self.seconds = seconds

    def on_train_batch_end(self, info):
        import time

        time.sleep(self.seconds)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backup", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--kill-at", type=int, default=None)
    ap.add_argument("--signal", choices=("KILL", "TERM"), default="KILL")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--spe", type=int, default=1, help="fit's steps_per_execution")
    ap.add_argument("--keep-backup", action="store_true",
                    help="BackupAndRestore(delete_checkpoint=False): keep the backup after success")
    args = ap.parse_args()

    if "JAXDIST_NUM_PROCESSES" in os.environ:
        jaxdist.initialize()
        strategy = jaxdist.MultiWorkerMirroredStrategy()
    else:
        strategy = jaxdist.MirroredStrategy()
    (x, y), _ = jaxdist.datasets.digits()
    x, y = x[:700], y[:700]  # 700 / 96: 8 batches an epoch, the last one padded
    state = models.create_train_state(models.MLP(hidden=(32,)), x[:1], seed=1)
    callbacks = [jaxdist.callbacks.BackupAndRestore(args.backup, every_n_steps=args.every,
                                                    delete_checkpoint=not args.keep_backup)]
    if args.step_sleep:
        callbacks.insert(0, Sleep(args.step_sleep))
    if args.kill_at is not None:
        callbacks.insert(0, KillAt(args.kill_at, getattr(signal, "SIG" + args.signal), args.rank))
    hist = jaxdist.fit(strategy.step(models.classifier_train_step), state,
                       strategy.distribute((x, y), 96, shuffle=True, seed=5),
                       epochs=args.epochs, callbacks=callbacks, verbose=0,
                       steps_per_execution=args.spe)
    params = jax.device_get(hist.state.params)
    if jax.process_index() == 0:
        flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
        np.savez(args.out, step=int(hist.state.step), restored=callbacks[-1].restored_step or -1,
                 **flat)
    print("done", int(hist.state.step), flush=True)


if __name__ == "__main__":
    main()
