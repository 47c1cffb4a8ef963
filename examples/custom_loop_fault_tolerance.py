"""Fault tolerance in your own training loop: TieredCheckpointManager gives it what fit has.

    python examples/custom_loop_fault_tolerance.py [--epochs 3] [--backup DIR]
    jaxdist launch -n 2 --devices-per-process 2 --max-restarts 1 \\
        examples/custom_loop_fault_tolerance.py --kill-at 7

A `@jaxdist.mirrored` step over `strategy.distribute`, and one manager over both tiers: the
in-memory copy (under `jaxdist launch`; off in a plain process) and the persistent backup.
`restore_latest` at the start resumes from the newer of the two (state, step and input position,
said in one line), `save` after each step lets each tier save by its own policy, and
`should_stop` / `stop` end the process cleanly, both tiers written, on a preemption notice
(SIGTERM) or a stop the elastic launcher agreed on. `--kill-at N` makes process 1 SIGKILL itself
after step N on the job's first attempt: the launcher restarts the group and the loop resumes
from memory, ending on the parameters of a run that never failed.
"""

import argparse
import logging
import os
import signal
import tempfile

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "2")  # a plain run simulates 2 devices; a launcher sets its own

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxdist  # noqa: E402 - under `jaxdist launch`, importing it joins the job
from jaxdist import models  # noqa: E402
from jaxdist.checkpoint import TieredCheckpointManager  # noqa: E402


@jaxdist.mirrored
def train_step(state, batch):  # written for one device over the global batch
    return models.classifier_train_step(state, batch)


def crash_if_asked(step, state, kill_at):
    """Stands in for a crash: process 1 dies with SIGKILL (no chance to save) once ``step`` has
    run, on the job's first attempt."""
    first_attempt = os.environ.get("JAXDIST_RESTART_COUNT", "0") == "0"
    if kill_at and step == kill_at and first_attempt and jax.process_index() == 1:
        jax.block_until_ready(state)
        os.kill(os.getpid(), signal.SIGKILL)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--backup", default=os.path.join(tempfile.gettempdir(), "jaxdist-custom-loop-backup"),
                    help="backup folder, shared by every process (removed when training completes)")
    ap.add_argument("--backup-every", type=int, default=5, help="back up every N steps")
    ap.add_argument("--kill-at", type=int, default=0, help="process 1 dies after this step (first attempt)")
    ap.add_argument("--out", help="where process 0 writes the final parameters (.npz)")
    args = ap.parse_args()
    # force: importing Orbax has already given the root logger absl's default handler
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("jaxdist.checkpoint.tiered").setLevel(logging.INFO)  # its one resume line

    strategy = train_step.strategy
    (x, y), (x_test, y_test) = jaxdist.datasets.digits()
    state = models.create_train_state(models.MLP(hidden=(64,)), x[:1], learning_rate=3e-3, seed=1)
    dataset = strategy.distribute((x, y), 128, shuffle=True, seed=5)

    with TieredCheckpointManager(args.backup, every_n_steps=args.backup_every) as ckpt:
        step, first_epoch, position = 0, 0, 0
        restored = ckpt.restore_latest(state, strategy)  # every process, at the start
        if restored is not None:
            state, step = restored.state, restored.step
            first_epoch, position = restored.position["epoch"], restored.position["position"]
        if jax.process_index() == 0:
            print(f"attempt {os.environ.get('JAXDIST_RESTART_COUNT', '0')}: "
                  + (f"resumed from {restored.source} step {step}" if restored else "fresh start"),
                  flush=True)
        for epoch in range(first_epoch, args.epochs):
            with dataset.iterator(epoch=epoch, position=position) as it:
                for batch in it:
                    state, _ = train_step(state, batch)  # (metrics: read them every N steps)
                    step += 1
                    if ckpt.should_stop(step):  # a preemption, or the launcher's stop step
                        ckpt.stop(step, state, it.state())  # both tiers written: exit cleanly
                        return
                    ckpt.save(step, state, it.state())  # each tier decides by its own policy
                    crash_if_asked(step, state, args.kill_at)
            position = 0
        ckpt.finish(delete=True)  # completed: a rerun trains again

    params = jax.device_get(state.params)  # every process holds the whole (replicated) state
    if jax.process_index() == 0:
        accuracy = float((np.argmax(state.apply_fn({"params": params}, x_test), -1) == y_test).mean())
        print(f"finished at step {step} on {strategy.num_replicas_in_sync} replicas: test accuracy "
              f"{accuracy:.4f}", flush=True)
        if args.out:
            np.savez(args.out, *jax.tree.leaves(params))


if __name__ == "__main__":
    main()
