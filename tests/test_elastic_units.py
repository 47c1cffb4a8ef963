"""Fast checks of the fault-tolerance pieces, without processes: the hang detector, the rendezvous
store (the in-memory tier: tests/test_memstate.py)."""

import os

import numpy as np
import pytest

from jaxdist.launch.hang import HangDetector
from jaxdist.launch.rendezvous import RendezvousClient, RendezvousError, serve
from jaxdist.memstate import InMemoryTier, _write_atomic, heartbeat_path


def test_stop_step_is_read_from_the_agents_file(tmp_path):
    tier = InMemoryTier(str(tmp_path), rank=0)
    assert tier.stop_step() is None
    _write_atomic(str(tmp_path / "stop"), b"12")
    assert tier.stop_step() == 12


def test_hang_detector_names_the_silent_rank_once_armed(tmp_path):
    now = [0.0]
    det = HangDetector(str(tmp_path), {0: 100, 1: os.getpid()}, timeout_s=5,
                       clock=lambda: now[0])
    assert det.check([0, 1]) == []  # nothing reported: compilation may take any time
    for t, steps in [(1.0, (1, 1)), (2.0, (2, 1)), (4.0, (3, 1)), (6.5, (4, 1))]:
        now[0] = t
        for rank, s in enumerate(steps):
            _write_atomic(heartbeat_path(str(tmp_path), rank), f"{s} 0".encode())
        hung = det.check([0, 1])
    assert [(h.rank, h.last_step) for h in hung] == [(1, 1)]
    assert hung[0].silent_s == pytest.approx(5.5)


def test_the_rank_the_hung_ones_wait_for_is_named_though_its_last_report_came_later(tmp_path):
    # before: rank 1 stopped at step 6 after dispatching 5; its heartbeat (written on a timer)
    # reached the launcher after rank 0's last one (8 dispatched, then blocked in a collective),
    # so only rank 0 was named, "process sleeping", and the stopped rank not at all (CI, -n 2)
    now = [0.0]
    det = HangDetector(str(tmp_path), {0: os.getpid(), 1: 100}, timeout_s=4,
                       clock=lambda: now[0])
    for t, rank, dispatched in [(0.2, 0, 3), (0.2, 1, 3), (0.5, 0, 8), (1.0, 1, 5)]:
        now[0] = t
        _write_atomic(heartbeat_path(str(tmp_path), rank), f"{dispatched} 0".encode())
        assert det.check([0, 1]) == []
    now[0] = 4.7
    hung = det.check([0, 1])
    assert [(h.rank, h.dispatched) for h in hung] == [(0, 8), (1, 5)]
    assert hung[1].silent_s == pytest.approx(3.7)
    # every rank silent: each named; one that moves again is not
    det2 = HangDetector(str(tmp_path), {0: os.getpid(), 1: 100}, timeout_s=4,
                        clock=lambda: now[0])
    for t, dispatched in [(0.2, (3, 3)), (0.5, (8, 9))]:
        now[0] = t
        for rank in (0, 1):
            _write_atomic(heartbeat_path(str(tmp_path), rank), f"{dispatched[rank]} 0".encode())
        det2.check([0, 1])
    now[0] = 4.6
    assert [h.rank for h in det2.check([0, 1])] == [0, 1]
    _write_atomic(heartbeat_path(str(tmp_path), 1), b"10 0")
    assert [h.rank for h in det2.check([0, 1])] == [0]


def test_adaptive_hang_timeout_is_a_multiple_of_the_step_time_within_bounds(tmp_path):
    now = [0.0]
    det = HangDetector(str(tmp_path), {0: 1}, clock=lambda: now[0])
    for k in range(1, 5):
        now[0] = 10.0 * k
        _write_atomic(heartbeat_path(str(tmp_path), 0), f"{k} 0".encode())
        det.check([0])
    assert det.timeout_s == 300.0  # 50 x 10 s, capped
    assert np.isclose(det.median_step_s(), 10.0)


def test_rendezvous_store_namespaces_jobs_and_reports_ages():
    server, port = serve("127.0.0.1:0")
    try:
        a = RendezvousClient(f"127.0.0.1:{port}", "job-a")
        b = RendezvousClient(f"127.0.0.1:{port}", "job-b")
        a.set("alive/x", 1)
        assert b.get("alive/x") is None
        assert a.set_if_absent("drain", 9) == 9 and b.set_if_absent("drain", 4) == 4
        assert a.set_if_absent("drain", 11) == 9  # the first request wins
        (value, age), = a.list("alive/").values()
        assert value == 1 and 0 <= age < 5
        assert serve(f"127.0.0.1:{port}") is None  # a second agent becomes a client
    finally:
        server.stop(0)
    with pytest.raises(RendezvousError, match="rendezvous store at"):
        RendezvousClient(f"127.0.0.1:{port}", "job-a", timeout_s=0.5).get("x")


def test_state_directories_of_dead_launchers_are_removed(tmp_path, monkeypatch):
    import tempfile

    from jaxdist.launch import _owned
    from jaxdist.launch import group as launch_group

    monkeypatch.setattr(os.path, "isdir", lambda p: False if p == "/dev/shm" else
                        os.path.exists(p) and not os.path.isfile(p))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess_pid_that_exited()
    gone, fd = _owned.make(f"jaxdist-state-{dead}-", str(tmp_path))
    os.close(fd)  # its launcher died: the lock is free
    live, live_fd = _owned.make(f"jaxdist-state-{dead}-", str(tmp_path))
    # issue 37: a live job in another PID namespace (its pid looks dead from here) keeps its state
    # and compile cache; one never marked as owned (older launchers) cannot be proven stale
    cache, cache_fd = _owned.make(f"jaxdist-xla-cache-{dead}-", str(tmp_path))
    (tmp_path / f"jaxdist-state-{dead}-unmarked").mkdir()
    try:
        made, made_fd = launch_group._make_state_dir()
        os.close(made_fd)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [os.path.basename(live), os.path.basename(cache), f"jaxdist-state-{dead}-unmarked",
             os.path.basename(made)])
        assert not os.path.exists(gone)
    finally:
        os.close(live_fd)
        os.close(cache_fd)


def subprocess_pid_that_exited() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_rendezvous_store_refuses_hostile_requests_and_wrong_tokens(monkeypatch):
    import grpc

    from jaxdist.launch import rendezvous

    server, port = serve("127.0.0.1:0", token="s3cret")
    try:
        addr = f"127.0.0.1:{port}"
        good = RendezvousClient(addr, "job", token="s3cret")
        good.set("k", 1)
        assert good.get("k") == 1
        with pytest.raises(RendezvousError, match="UNAUTHENTICATED"):
            RendezvousClient(addr, "job", token="wrong").get("k")
        with pytest.raises(RendezvousError, match="UNAUTHENTICATED"):
            RendezvousClient(addr, "job", token="").get("k")
        with pytest.raises(RendezvousError, match="RESOURCE_EXHAUSTED"):  # before it is decoded
            good.set("big", "x" * (rendezvous.MAX_REQUEST_BYTES + 1))
        with pytest.raises(RendezvousError, match="at most"):
            good.set("k" * (rendezvous.MAX_KEY_CHARS + 1), 1)
        channel = grpc.insecure_channel(addr)
        raw = channel.unary_unary("/jaxdist.Rendezvous/set")
        for body in (b'{"key": "job/n", "value": NaN}', b"[1, 2]", b"not json",
                     b'{"key": "job/n", "value": ' + b"[" * 20000 + b"]" * 20000 + b"}",
                     b'{"key": "job/n", "value": ' + b"[" * 40 + b"]" * 40 + b"}"):
            with pytest.raises(grpc.RpcError) as e:
                raw(body, timeout=5, metadata=(("x-jaxdist-rdzv-token", "s3cret"),))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, body
        channel.close()
        monkeypatch.setattr(rendezvous, "MAX_KEYS", 3)
        good.set("a", 1)
        with pytest.raises(RendezvousError, match="RESOURCE_EXHAUSTED"):
            good.set("b", 1)
            good.set("c", 1)
        good.set("a", 2)  # an existing key may still change
        monkeypatch.setattr(rendezvous, "MAX_KEYS", 4096)
        monkeypatch.setattr(rendezvous, "MAX_STORE_BYTES", 100_000)
        for i in range(3):  # 3 x ~40 KB: the third passes the store's byte limit
            if i < 2:
                good.set(f"v{i}", "x" * 40_000)
            else:
                with pytest.raises(RendezvousError, match="RESOURCE_EXHAUSTED"):
                    good.set(f"v{i}", "x" * 40_000)
        good.delete("v0")
        good.set("v2", "x" * 40_000)  # deleting gave the bytes back
        assert len(good.list("v")) == 2
        good.delete("v1"), good.delete("v2")
        with pytest.raises(RendezvousError, match="RESOURCE_EXHAUSTED"):
            for i in range(100):  # keys count as their JSON (an emoji is 12 bytes there)
                good.set("\U0001F600" * 100 + str(i), 1)
        assert len(good.list("")) < 100  # so a list reply stays within the limit
    finally:
        server.stop(0)


def test_a_host_whose_store_went_away_as_it_arrived_exits_0_saying_so(monkeypatch):
    # before: a host that arrived as the job ended (its store answered the probe, then its agent
    # finished and stopped serving) failed its first call after --rdzv-timeout with
    # "jaxdist launch: error: ... set_if_absent failed: DEADLINE_EXCEEDED" and exit status 1
    # (seen once the agent started in 0.2 s rather than 2 s: tests/test_elastic_faults.py's
    # host that comes back after the end)
    import types

    from jaxdist.launch import elastic

    server, port = serve("127.0.0.1:0")
    said = []
    launcher = types.SimpleNamespace(say=said.append, stop_signal=None, restarts=0,
                                     options=types.SimpleNamespace(devices_per_process=1))
    agent = elastic.Agent(launcher, nnodes=(1, 2), endpoint=f"127.0.0.1:{port}", rdzv_id="job",
                          nproc=1, max_restarts=0, rdzv_timeout_s=1.0)
    assert agent.server is None  # the port is the other host's store: this agent is a client

    real_probe = elastic.probe

    def probe_then_the_job_ends(address):
        assert real_probe(address) is True  # a store answers
        server.stop(0)
        return True
    monkeypatch.setattr(elastic, "probe", probe_then_the_job_ends)
    try:
        assert agent.run() == 0
    finally:
        agent.store.close()
    assert any("the rendezvous store went away before this host joined a round" in s and
               "nothing ran here" in s for s in said), said
