"""Parameter-server jobs across processes over gRPC: 2 servers x 3 workers x 1 coordinator,
with a worker and a server killed by SIGKILL mid-run."""

import json
import os
import signal
import time

import pytest

from jaxdist.ps.cli import launch_local
from jaxdist.ps.transport import GrpcClient
from jaxdist.ps.worker import make_step_id

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = os.path.join(os.path.dirname(__file__), "_ps_scripts", "digits_job.py")
TOKEN = "test-token"


def _wait_version(address, at_least, job, timeout=120):
    client = GrpcClient(address, token=TOKEN, timeout=5)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            assert job.procs["coordinator", 0].poll() is None, "coordinator exited early"
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


def _logs(tmp_path):
    return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in tmp_path.glob("*.log"))


def _wait_log(path, text, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.1)
    raise TimeoutError(f"{text!r} not in {path} after {timeout}s")


def test_async_job_survives_worker_sigkill_and_hang_and_applies_each_step_once(tmp_path):
    out = tmp_path / "summary.json"
    with launch_local(SCRIPT, ["--steps", "600", "--out", str(out), "--wait-workers-at", "300",
                               "--dead-after", "2"],
                      num_ps=2, num_workers=3, token=TOKEN, log_dir=str(tmp_path)) as job:
        _wait_version(job.cluster["ps"][0], 30, job)
        job.kill("worker", 1)
        job.start("worker", 1)  # a restarted worker rejoins (the job waits for it at step 300)
        # A hung worker (SIGSTOP) is found by missed heartbeats; once resumed it rejoins.
        job.procs["worker", 2].send_signal(signal.SIGSTOP)
        _wait_log(tmp_path / "coordinator0.log", "worker 2 marked dead")
        job.procs["worker", 2].send_signal(signal.SIGCONT)
        assert job.wait(timeout=240) == 0, _logs(tmp_path)
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
    with launch_local(SCRIPT, ["--steps", str(steps), "--out", str(out),
                               "--checkpoint-every", str(every)],
                      num_ps=2, num_workers=3, token=TOKEN, checkpoint_dir=str(ckpt),
                      log_dir=str(tmp_path)) as job:
        killed_at = _wait_version(job.cluster["ps"][0], 110, job)
        job.kill("ps", 0)
        job.start("ps", 0)
        assert job.wait(timeout=240) == 0, _logs(tmp_path)
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
    assert (ckpt / "ps0.ckpt").exists() and s["final_loss"] < 1.0
