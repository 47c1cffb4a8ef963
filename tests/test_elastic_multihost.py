"""Elastic multi-host jobs: 2-3 simulated hosts (agents on 127.0.0.1, one process with 2 CPU devices
each). A lost host, a preempted host (SIGTERM to its agent) and a joining host each cost at most
one step, and the job ends on the parameters of a run that never failed."""

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxdist import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "_mp_scripts" / "ft_train.py")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/shm, prctl")]
TRAIN = ["--epochs", "4", "--sleep", "0.1"]  # 32 steps, slow enough to act at a chosen step


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in ("TF_CONFIG", "JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "JAX_PLATFORMS"):
        env.pop(name, None)
    return env


def _params(path):
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


def reference_run(tmp_path_factory):
    """The job uninterrupted (2 processes, 4 epochs): rank 0's steps and the final parameters. One
    run serves this module and test_elastic_faults.py (conftest.py's ``elastic_reference``)."""
    tmp = tmp_path_factory.mktemp("ref")
    result = launch.run([SCRIPT, str(tmp / "ref.npz"), str(tmp / "b"), "--epochs", "4"],
                        num_processes=2, devices_per_process=2, timeout_s=240, env=_env())
    assert result.returncode == 0, result.output
    steps = [tuple(map(int, m)) for m in re.findall(
        r"^\[0\] trained step (\d+) epoch (\d+) position (\d+)$", result.output, re.M)]
    return steps, _params(tmp / "ref.npz")


@pytest.fixture
def reference(elastic_reference):
    return elastic_reference


class Hosts:
    """Agents of one job, each with its log file; the first serves the rendezvous store."""

    def __init__(self, tmp, nnodes="2:3", last_call=10, rdzv_timeout=20):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.tmp, self.nnodes, self.last_call = tmp, nnodes, last_call
        self.rdzv_timeout = rdzv_timeout
        self.agents: list[subprocess.Popen] = []
        self.logs: list[pathlib.Path] = []

    def start(self, devices=2, script_args=(), train=TRAIN, launch_args=()):
        i = len(self.agents)
        log = self.tmp / f"agent{i}.log"
        cmd = [sys.executable, "-m", "jaxdist.launch", "--nnodes", self.nnodes,
               "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "test", "-n", "1",
               "--devices-per-process", str(devices), "--max-restarts", "2",
               "--rdzv-timeout", str(self.rdzv_timeout),
               "--rdzv-last-call", str(self.last_call), *launch_args, SCRIPT,
               str(self.tmp / "out.npz"),
               str(self.tmp / "backup"), *train, *script_args]
        with open(log, "wb") as f:
            self.agents.append(subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=f,
                                                stderr=subprocess.STDOUT))
        self.logs.append(log)
        if i == 0:
            self.wait_for(0, "serving the rendezvous store")

    @property
    def hold(self) -> list[str]:
        """ft_train.py's arguments that hold the job at step 8 until ``release_on_join``: a
        handshake, so that a joiner slow to start on a loaded machine still joins a running job."""
        return ["--hold-at", "8", "--hold-file", str(self.tmp / "joined")]

    def release_on_join(self) -> None:
        """Waits until an agent has seen a host join, then lets the held job go on."""
        self.wait_for(None, r"a host joins: asking every process to stop at step")
        (self.tmp / "joined").touch()

    def text(self, i=None):
        return "".join(p.read_text(errors="replace") for p in (
            self.logs if i is None else [self.logs[i]]))

    def wait_for(self, i, pattern, timeout=180):
        end = time.monotonic() + timeout
        while not re.search(pattern, self.text(i)):  # (i None: any agent's lines)
            assert time.monotonic() < end, f"no {pattern!r} in:\n{self.text()[-4000:]}"
            assert i is None or self.agents[i].poll() is None, \
                f"agent {i} exited:\n{self.text(i)[-4000:]}"
            time.sleep(0.05)

    def finish(self, timeout=180):
        try:
            return [a.wait(timeout=timeout) for a in self.agents]
        finally:
            for a in self.agents:
                a.kill()


def _check(hosts, reference, lost_at_most, rank0_logs=(0,), rank0_host_lost=False):
    ref_steps, ref_params = reference
    out = hosts.text()
    resumed = int(re.search(r"\[\d+\] attempt 1 resumed from memory step (\d+)", out)[1])
    done = [int(s) for d in re.findall(r"last completed step per local rank \{([^}]*)\}", out)
            for s in re.findall(r": (\d+)", d)]
    stopped = [int(s) for s in re.findall(r"(?:stopped at|left the job at) step (\d+)", out)]
    before = max(done + stopped)
    assert before - resumed <= lost_at_most, (before, resumed)
    # rank 0 never moves here (its host stays), so its lines list every batch trained
    rounds = [[]]
    for line in "".join(hosts.text(i) for i in rank0_logs).splitlines():
        if "] round 1: " in line:
            rounds.append([])
        elif m := re.match(r"\[0\] trained step (\d+) epoch (\d+) position (\d+)$", line):
            rounds[-1].append(tuple(map(int, m.groups())))
    first, rest = rounds
    if rank0_host_lost:  # its last lines may die with it: check what it printed, then the rest
        assert first == ref_steps[:len(first)] and len(first) >= resumed - 1, (first, resumed)
        assert rest == ref_steps[resumed:], (rest, resumed)
    else:
        assert [s for s in first if s[0] <= resumed] + rest == ref_steps
    diff = max(float(np.abs(a - b).max())
               for a, b in zip(_params(hosts.tmp / "out.npz"), ref_params))
    assert diff <= 2e-5, diff


def test_losing_a_whole_host_costs_at_most_one_step(tmp_path, reference):
    hosts = Hosts(tmp_path)
    for _ in range(3):
        hosts.start()
    hosts.wait_for(0, r"\[0\] trained step 6 ")
    hosts.agents[2].kill()  # the agent and (by its death signal) its process
    codes = hosts.finish()
    assert codes[:2] == [0, 0], hosts.text()
    assert re.search(r"round 1: 2 host\(s\)", hosts.text(0))
    # found by the agents (silent agent) or first by JAX's runtime (a peer died: SIGABRT)
    assert re.search(r"round 0 failed: (host\(s\) \['[^']+'\] lost|rank \d)", hosts.text())
    _check(hosts, reference, lost_at_most=1)


def test_losing_the_rendezvous_host_moves_the_store_and_the_job_goes_on(tmp_path, reference):
    hosts = Hosts(tmp_path)
    for _ in range(3):
        hosts.start()
    hosts.wait_for(0, r"\[0\] trained step 6 ")
    hosts.agents[0].kill()  # the agent serving the store, and (by its death signal) rank 0
    codes = hosts.finish()
    assert codes[1:] == [0, 0], hosts.text()
    serves = [i for i in (1, 2) if re.search(
        r"the rendezvous store on 127\.0\.0\.1:\d+ is lost .*; this agent serves it now on "
        r"127\.0\.0\.1:\d+", hosts.text(i))]
    assert len(serves) == 1, hosts.text()
    (new,) = serves
    other = 3 - new
    # the other agent names the new server, or (when its watch found the store silent before the
    # new one served) says its processes go on; either way it joins the next round there
    assert re.search(r"is lost .*; agent \S+ serves it now|the rendezvous store is silent; this "
                     r"host's processes go on", hosts.text(other)), hosts.text(other)
    assert re.search(r"round 1: 2 host\(s\)", hosts.text(other)), hosts.text(other)
    assert re.search(r"round 1: 2 host\(s\)", hosts.text(new))
    # rank 0 was on the lost host in round 0; the agent next in order serves the store and
    # runs rank 0 in round 1
    assert re.search(r"round 1: .*ranks 0\.\.0 of 2", hosts.text(new)), hosts.text(new)
    _check(hosts, reference, lost_at_most=1, rank0_logs=(0, new), rank0_host_lost=True)


def test_sigterm_to_an_agent_makes_its_host_leave_at_an_agreed_step(tmp_path, reference):
    hosts = Hosts(tmp_path)
    for _ in range(3):
        hosts.start()
    hosts.wait_for(0, r"\[0\] trained step 6 ")
    hosts.agents[2].send_signal(signal.SIGTERM)
    codes = hosts.finish()
    assert codes == [0, 0, 0], hosts.text()
    assert re.search(r"left the job at step \d+", hosts.text(2))
    assert re.search(r"round 1: 2 host\(s\)", hosts.text(0))
    _check(hosts, reference, lost_at_most=0)


def test_a_host_joins_at_a_step_boundary_with_the_state_of_a_live_peer(tmp_path, reference):
    hosts = Hosts(tmp_path, last_call=1)
    # The job holds at step 8 until the joiner has been seen (a joiner slow to start on a loaded
    # machine once arrived after the job had ended, and ran nothing)
    for _ in range(2):
        hosts.start(script_args=hosts.hold)
    hosts.wait_for(0, r"round 0: 2 host\(s\)")
    hosts.wait_for(0, r"\[0\] trained step 4 ")
    hosts.start(script_args=hosts.hold)  # its host has no state: it gets the step from a peer
    hosts.release_on_join()
    codes = hosts.finish()
    assert codes == [0, 0, 0], hosts.text()
    assert re.search(r"a host joins: asking every process to stop at step \d+", hosts.text())
    assert re.search(r"round 1: 3 host\(s\)", hosts.text(2))
    _check(hosts, reference, lost_at_most=0)


def test_below_min_a_preempted_job_saves_and_exits_cleanly(tmp_path):
    from jaxdist.checkpoint import CheckpointManager

    hosts = Hosts(tmp_path, nnodes="2:2", rdzv_timeout=5)
    for _ in range(2):
        hosts.start()
    hosts.wait_for(0, r"\[0\] trained step 6 ")
    hosts.agents[1].send_signal(signal.SIGTERM)
    codes = hosts.finish()
    assert codes == [0, 0], hosts.text()
    stop = int(re.search(r"left the job at step (\d+)", hosts.text(1))[1])
    assert re.search(r"fewer than 2 agents registered within 5 s \(1 did: \S+ \(agent [^)]+\); "
                     r"1 more were needed: start `jaxdist launch`", hosts.text(0)), hosts.text(0)
    # the state of the agreed step is on disk for a later start
    assert CheckpointManager(tmp_path / "backup").latest_step() == stop
