"""Issue 19 item 8: one job owns a checkpoint directory; a second writer is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import jax.numpy as jnp

from jaxdist.checkpoint import CheckpointManager
from tests.conftest import REPO, run_python

WRITER = r"""
import sys, time, json
import jax.numpy as jnp
from jaxdist.checkpoint import CheckpointManager, CheckpointError
d, first, last, pause = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
mgr = CheckpointManager(d, max_to_keep=None, async_save=False)
errors = []
for step in range(first, last + 1):
    try:
        mgr.save(step, {"w": jnp.full(4, float(step))})
    except CheckpointError as e:
        errors.append(str(e))
    print("saved", step, flush=True)
    time.sleep(pause)
print(json.dumps({"errors": errors}), flush=True)
"""


def _spawn(*args):
    return subprocess.Popen([sys.executable, "-c", WRITER, *map(str, args)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_second_job_cannot_write_into_a_directory_another_job_owns(tmp_path):
    # before: two writers of steps 1..12 both exited 0; the directory ended with only one
    # writer's steps, and every save but one of the other "succeeded"
    first = _spawn(tmp_path, 1, 12, 0.3)
    try:
        assert first.stdout.readline().startswith("saved 1"), first.stderr.read()[-2000:]
        second = run_python(["-c", WRITER, str(tmp_path), "101", "104", "0"], timeout=120)
    finally:
        out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1])["errors"] == []
    errors = json.loads(second.stdout.strip().splitlines()[-1])["errors"]
    assert len(errors) == 4, second.stdout
    assert f"is owned by another running job: {{\"pid\": {first.pid}" in errors[0], errors[0]
    steps = CheckpointManager(tmp_path).all_steps()
    assert steps == list(range(1, 13)), steps


def test_a_crashed_owner_does_not_leave_the_directory_stuck(tmp_path):
    owner = _spawn(tmp_path, 1, 1000, 0.2)
    try:
        assert owner.stdout.readline().startswith("saved 1")
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(60)
    proc = run_python(["-c", WRITER, str(tmp_path), "2000", "2001", "0"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["errors"] == []


def test_managers_of_one_process_share_the_claim_and_close_gives_it_back(tmp_path):
    a = CheckpointManager(tmp_path, async_save=False)
    b = CheckpointManager(tmp_path, async_save=False)
    a.save(1, {"w": jnp.ones(2)})
    b.save(2, {"w": jnp.ones(2)})  # the same job (a callback's manager and the user's, say)
    a.close()
    b.close()
    # closed: another process may now take the directory
    proc = run_python(["-c", WRITER, str(tmp_path), "3", "3", "0"], timeout=120)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["errors"] == [], proc.stderr[-2000:]
