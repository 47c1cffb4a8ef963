"""The side-car evaluator against a real training process (jaxdist evaluate --watch, TF_CONFIG)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxdist import evaluator
from jaxdist.checkpoint import CheckpointManager
from tests.conftest import REPO

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _popen(args, env=None):
    full = {**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1", "JAX_NUM_CPU_DEVICES": "2",
            **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "jaxdist.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=full, cwd=REPO)


def _wait(proc, timeout):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"did not finish within {timeout}s:\n{out[-3000:]}")
    return proc.returncode, out


def test_evaluators_follow_a_real_training_process(tmp_path):
    ckpt = tmp_path / "ckpt"
    # Two evaluators start first and wait for checkpoints: `jaxdist evaluate --watch` and a TF_CONFIG
    # evaluator task (`jaxdist train` on an evaluator task evaluates instead of training).
    watcher = _popen(["evaluate", "--watch", str(ckpt), "--batch-size", "64", "--tensorboard",
                      str(tmp_path / "tb"), "--log", str(tmp_path / "watch.jsonl"), "--poll", "0.3",
                      "--timeout", "240"])
    tf_config = json.dumps({"cluster": {"chief": ["127.0.0.1:1"], "evaluator": ["127.0.0.1:2"]},
                            "task": {"type": "evaluator", "index": 0}})
    sidecar = _popen(["train", "--checkpoint-dir", str(ckpt), "--batch-size", "64"],
                     env={"TF_CONFIG": tf_config})
    trainer = _popen(["train", "--devices", "2", "--epochs", "4", "--batch-size", "64", "--quiet",
                      "--checkpoint-dir", str(ckpt)])
    code, out = _wait(trainer, 300)
    assert code == 0, out[-3000:]
    final = evaluator.final_step(ckpt)
    assert final == 4 * 23  # 1438 rows / 64 -> 23 steps an epoch
    saved = CheckpointManager(ckpt).all_steps()
    for proc, log in ((watcher, tmp_path / "watch.jsonl"), (sidecar, ckpt / "eval_log.jsonl")):
        code, out = _wait(proc, 240)
        assert code == 0, out[-3000:]
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        steps = [r["step"] for r in lines]
        assert steps == sorted(steps) and steps[-1] == final, out[-2000:]
        assert set(saved) <= set(steps)  # every checkpoint still on disk was evaluated
        assert all("accuracy" in r and "loss" in r for r in lines)
        assert lines[-1]["accuracy"] >= 0.9
        assert f"the final one was step {final}" in out
    assert "TF_CONFIG evaluator task 0" in out
    assert any(f.name.startswith("events.out.tfevents") for f in (tmp_path / "tb").rglob("*"))


def test_watch_times_out_naming_the_directory(tmp_path):
    with pytest.raises(TimeoutError, match=str(tmp_path)):
        evaluator.watch(tmp_path, lambda mgr, step: {}, poll_s=0.05, timeout_s=0.2)
