"""Parameter-server jobs across processes over gRPC, started by the one launcher
(``jaxdist launch --ps 2 --workers 3``): a worker and a server killed by SIGKILL mid-run are
restarted alone by the launcher."""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from jaxdist.ps.transport import GrpcClient
from jaxdist.ps.worker import make_step_id
from tests.conftest import REPO

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = os.path.join(os.path.dirname(__file__), "_ps_scripts", "digits_job.py")
TOKEN = "test-token"


class _Job:
    """``python -m jaxdist.launch --ps 2 --workers 3 ...`` with its output read line by line."""

    def __init__(self, script_args, *, max_restarts=3):
        env = dict(os.environ, PYTHONPATH=REPO, JAXDIST_PS_TOKEN=TOKEN)
        env.pop("TF_CONFIG", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxdist.launch", "--ps", "2", "--workers", "3",
             "--max-restarts", str(max_restarts), "--timeout", "400", SCRIPT, *script_args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.cluster = json.loads(self.wait_for(r"cluster (\{.*\})").group(1))

    def _read(self):
        for line in self.proc.stdout:
            self._q.put(line)
        self._q.put(None)

    def wait_for(self, pattern, timeout=120):
        """Returns the match of the first new output line matching ``pattern``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"job ended before {pattern!r}:\n{self.output()}")
            self.lines.append(line)
            if m := re.search(pattern, line):
                return m
        raise TimeoutError(f"{pattern!r} not seen in {timeout}s:\n{self.output()}")

    def pid(self, task):
        return int(next(re.search(r"pid (\d+)", line).group(1) for line in reversed(self.lines)
                        if f"jaxdist launch: {task} started" in line))

    def output(self):
        return "".join(self.lines[-200:])

    def wait(self, timeout):
        code = self.proc.wait(timeout)
        while self._q.get() is not None:
            pass
        return code

    def close(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # the launcher stops every task
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _wait_version(address, at_least, job, timeout=120):
    client = GrpcClient(address, token=TOKEN, timeout=5)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            assert job.proc.poll() is None, f"job exited early:\n{job.output()}"
            try:
                version = client.status()["version"]
                if version >= at_least:
                    return version
            except (ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{address} did not reach version {at_least} in {timeout}s")
    finally:
        client.close()


def test_async_job_survives_worker_sigkill_and_hang_and_applies_each_step_once(tmp_path):
    out = tmp_path / "summary.json"
    job = _Job(["--steps", "600", "--out", str(out), "--wait-workers-at", "300",
                "--dead-after", "2"])
    try:
        for task in ("chief 0", "worker 0", "worker 1", "worker 2", "ps 0", "ps 1"):
            job.wait_for(f"{task} started")
        _wait_version(job.cluster["ps"][0], 30, job)
        os.kill(job.pid("worker 1"), signal.SIGKILL)  # the launcher restarts it alone
        job.wait_for(r"worker 1 was killed by SIGKILL .*; restarting it")
        # A hung worker (SIGSTOP) is found by missed heartbeats; once resumed it rejoins.
        os.kill(job.pid("worker 2"), signal.SIGSTOP)
        job.wait_for("worker 2 marked dead")
        os.kill(job.pid("worker 2"), signal.SIGCONT)
        assert job.wait(timeout=300) == 0, job.output()
    finally:
        job.close()
    s = json.loads(out.read_text())
    assert s["accuracy"] >= 0.95, s["accuracy"]
    assert s["rescheduled"] >= 1
    expected = sorted(make_step_id(c) for c in s["closure_ids"])
    for shard, log in enumerate(s["logs"]):
        assert sorted(r[0] for r in log) == expected, f"ps{shard}: a step applied != once"
    for w in (1, 2):
        assert any(r[1] == w and r[3] >= 300 for r in s["logs"][0]), f"worker {w} not back"


def test_server_sigkill_resumes_from_checkpoint_and_reports_lost_updates(tmp_path):
    out, every, steps = tmp_path / "summary.json", 20, 300
    ckpt = tmp_path / "ckpt"
    job = _Job(["--steps", str(steps), "--out", str(out), "--checkpoint-every", str(every),
                "--checkpoint-dir", str(ckpt)])
    try:
        job.wait_for("ps 0 started")
        killed_at = _wait_version(job.cluster["ps"][0], 110, job)
        os.kill(job.pid("ps 0"), signal.SIGKILL)
        job.wait_for(r"ps 0 was killed by SIGKILL .*; restarting it")
        assert job.wait(timeout=300) == 0, job.output()
    finally:
        job.close()
    s = json.loads(out.read_text())
    lost = s["lost_updates"].get("0", 0)
    assert 0 <= lost <= every
    log0 = s["logs"][0]
    # the restored log holds every step up to the checkpoint, then those applied after it
    assert steps <= len(log0) + lost <= steps + 3, (len(log0), lost)
    assert len({r[0] for r in log0}) == len(log0)  # never twice within what survived
    assert any(r[3] < killed_at - every for r in log0) and log0[-1][3] >= steps - lost - 1
    expected = sorted(make_step_id(c) for c in s["closure_ids"])
    assert sorted(r[0] for r in s["logs"][1]) == expected  # the other server lost nothing
    assert s["final_loss"] < 1.0
