"""A fault-tolerance test job: an MLP on digits with BackupAndRestore, and one injected fault.

    ft_train.py OUT BACKUP [--fault kill|stop|stuck|raise|none] [--rank R] [--at STEP] [--epochs E]
        [--zero-stage K] [--hidden H] [--steps-per-execution K]

On its first attempt (``JAXDIST_RESTART_COUNT=0``; ``--at A,B``: on the first two, the second at
step B) rank R completes step STEP (the first call's end at or past it), then SIGKILLs or
SIGSTOPs itself, or gets stuck in its own Python (``stuck``: a loop that never returns, as an
input pipeline that waits for ever; its peers wait inside the next step's collective), or raises
a ValueError (``raise``: on every attempt, a fault that comes back). Rank 0 prints
``trained step N epoch E position P`` after each step, the step it
resumed from (and whether from memory or from the backup), and writes the final parameters to OUT.
The backup period is longer than the run, so only the in-memory tier can save work.
"""
import argparse
import os
import signal
import time

import jaxdist

jaxdist.initialize()
import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxdist import models  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("backup")
ap.add_argument("--fault", default="none")
ap.add_argument("--rank", type=int, default=1)
ap.add_argument("--at", default="5", help="the step of the fault; a comma list: one per attempt")
ap.add_argument("--epochs", type=int, default=2)
ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step (an outside actor "
                "can then act at a chosen step)")
ap.add_argument("--zero-stage", type=int, default=0)
ap.add_argument("--hidden", type=int, default=32)
ap.add_argument("--steps-per-execution", type=int, default=1)
ap.add_argument("--when-announced", action="store_true",
                help="the fault waits (training on) for the first step at or after --at at which "
                     "rank 0's in-memory tier has announced its bound, and prints that bound")
ap.add_argument("--hold-at", type=int, default=None,
                help="rank 0 waits after this step until --hold-file exists (a handshake: the "
                     "job cannot end before the test's outside actor has acted; at most 120 s)")
ap.add_argument("--hold-file", default=None)
args = ap.parse_args()
attempt = int(os.environ.get("JAXDIST_RESTART_COUNT", "0"))
at = [int(a) for a in args.at.split(",")]
me = jax.process_index()


class Report(jaxdist.callbacks.Callback):
    """First in the list: a step at which BackupAndRestore stops the job is reported too."""

    started = False

    def on_train_batch_end(self, info):
        time.sleep(args.sleep)
        if me == 0 and args.hold_at is not None and info.step == args.hold_at:
            end = time.monotonic() + 120
            while not os.path.exists(args.hold_file) and time.monotonic() < end:
                time.sleep(0.05)
        if me == 0 and not self.started:
            self.started = True
            print(f"attempt {attempt} started from {backup.restored_from} step "
                  f"{backup.restored_step} (memory {backup.memory_step})", flush=True)
        if me == 0:
            print(f"trained step {info.step} epoch {info.epoch} position {info.position}",
                  flush=True)


class Fault(jaxdist.callbacks.Callback):
    def on_train_batch_end(self, info):
        # A fault that comes back: every step from at[0] on raises (a restart may resume at
        # at[0] itself when the in-memory tier wrote that step before the raise reached it).
        if args.fault == "raise" and me == args.rank and info.step >= at[0]:
            raise ValueError(f"rank {me} found bad data (every batch from step {at[0]} on)")
        if (attempt < len(at) and me == args.rank and info.step >= at[attempt]
                and args.fault not in ("none", "raise")):
            said = ""
            if args.when_announced:  # a handshake: the bound the launcher announces exists
                tier = read_tier(backup.memory.directory, 0) if backup.memory.directory else None
                if not tier or tier.get("bound") is None:
                    return
                said = f" (announced at most {tier['bound']})"
            jax.block_until_ready(info.state)
            print(f"fault {args.fault} at step {info.step}{said}", flush=True)
            if args.fault == "stuck":
                wait_for_input_that_never_comes()
            os.kill(os.getpid(), signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)


def read_tier(directory, rank):
    from jaxdist.launch.statedir import read_tier

    return read_tier(directory, rank)


def wait_for_input_that_never_comes():
    while True:
        time.sleep(0.2)


strategy = jaxdist.MultiWorkerMirroredStrategy(zero_stage=args.zero_stage)
(x, y), _ = jaxdist.datasets.digits()
x, y = x[:700], y[:700]
state = models.create_train_state(models.MLP(hidden=(args.hidden,)), x[:1], seed=1)
# The tests read the backup after the job (its last step, no temporary folder left): kept.
backup = jaxdist.callbacks.BackupAndRestore(args.backup, every_n_steps=1000, delete_checkpoint=False)
history = jaxdist.fit(strategy.step(models.classifier_train_step), state,
                      strategy.distribute((x, y), 96, shuffle=True, seed=5),
                      epochs=args.epochs, callbacks=[Report(), backup, Fault()], verbose=0,
                      steps_per_execution=args.steps_per_execution)
if me == 0:
    print(f"attempt {attempt} resumed from {backup.restored_from} step {backup.restored_step}",
          flush=True)
    np.savez(args.out, *jax.tree.leaves(jax.device_get(history.state.params)))
