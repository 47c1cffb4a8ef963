"""Parameter-server semantics: versions, exactly-once step ids, staleness, sync rounds,
checkpoints, and bad pushes over gRPC."""

import dataclasses
import time

import jax
import numpy as np
import optax
import pytest

from jaxdist.ps import optimizer, wire
from jaxdist.ps.server import ParameterServer, PushRejected, ServerConfig
from jaxdist.ps.transport import PS_SERVICE, GrpcClient, PermissionDenied, PSService, Unavailable, serve


def _g(value=1.0, n=4):
    return {"w": np.full(n, value, np.float32)}


def test_staleness_bound_refuses_old_gradients_and_logs_versions():
    ps = ParameterServer(0, _g(0.0), optax.sgd(1.0), ServerConfig(staleness=1))
    assert ps.push(worker=0, step_id=1, version=0, grads=_g()).status == "applied"
    assert ps.push(worker=1, step_id=2, version=0, grads=_g()).status == "applied"  # 1 old
    r = ps.push(worker=2, step_id=3, version=0, grads=_g())  # 2 versions old
    assert (r.status, r.version) == ("stale", 2)
    assert ps.push(worker=2, step_id=3, version=2, grads=_g()).status == "applied"  # retried
    assert ps.push(worker=0, step_id=9, version=7, grads=_g()).status == "stale"  # from the future
    assert [(u.step_id, u.computed_on, u.applied_at) for u in ps.log] == [
        (1, 0, 0), (2, 0, 1), (3, 2, 2)]
    np.testing.assert_allclose(ps.pull()[1]["w"], -3.0)


def test_sync_mode_averages_a_round_then_applies_once():
    ps = ParameterServer(0, _g(0.0), optax.sgd(1.0), ServerConfig(sync_replicas=2))
    r = ps.push(worker=0, step_id=10, version=0, grads=_g(1.0))
    assert (r.status, r.version) == ("pending", 1)
    assert ps.push(worker=0, step_id=10, version=0, grads=_g(1.0)).status == "duplicate"
    with pytest.raises(TimeoutError, match="stayed at version 0"):
        ps.pull(min_version=1, timeout=0.05)
    assert ps.push(worker=1, step_id=11, version=0, grads=_g(3.0)).status == "applied"
    version, params = ps.pull(min_version=1, timeout=1)
    assert version == 1
    np.testing.assert_allclose(params["w"], -2.0)  # mean of 1 and 3
    assert ps.push(worker=1, step_id=12, version=0, grads=_g()).status == "stale"
    assert sorted(u.step_id for u in ps.log) == [10, 11]


def test_checkpoint_restores_params_optimizer_state_and_step_ids(tmp_path):
    cfg = ServerConfig(checkpoint_dir=str(tmp_path), checkpoint_every=2)
    spec = optimizer("adam", learning_rate=0.1)
    ps = ParameterServer(0, _g(0.5), spec, cfg)
    ref = ParameterServer(0, _g(0.5), spec)  # the same 4 pushes, no checkpoints
    for step in range(5):
        g = _g(float(step + 1))
        ps.push(worker=0, step_id=step, version=ps.version, grads=g)
        if step < 4:
            ref.push(worker=0, step_id=step, version=ref.version, grads=g)
    back = ParameterServer.restore(str(tmp_path), 0)
    assert (back.version, back.restored_version) == (4, 4)  # step 4 was lost: <= every
    assert back.incarnation != ps.incarnation
    np.testing.assert_array_equal(back.pull()[1]["w"], ref.pull()[1]["w"])
    for a, b in zip(jax.tree.leaves(back._opt_state), jax.tree.leaves(ref._opt_state)):
        np.testing.assert_array_equal(a, b)
    assert back.push(worker=0, step_id=3, version=4, grads=_g()).status == "duplicate"
    assert back.push(worker=0, step_id=4, version=4, grads=_g(5.0)).status == "applied"
    ref.push(worker=0, step_id=4, version=4, grads=_g(5.0))
    np.testing.assert_array_equal(back.pull()[1]["w"], ref.pull()[1]["w"])
    assert [u.step_id for u in back.log] == [0, 1, 2, 3, 4]
    assert ParameterServer.restore(str(tmp_path), 1) is None


@pytest.fixture
def grpc_server():
    service = PSService(0)
    server, port = serve("127.0.0.1:0", PS_SERVICE, service.methods(), token="right")
    params = {"w": np.zeros((8, 8), np.float32), "b": np.zeros(8, np.float32)}
    client = GrpcClient(f"127.0.0.1:{port}", token="right", timeout=10)
    try:
        with pytest.raises(Unavailable, match="not initialized"):
            client.pull()
        client.init(0, params, optimizer("sgd", learning_rate=1.0),
                    ServerConfig(max_push_bytes=400))
        yield client, port, params
    finally:
        client.close()
        server.stop(0)


def test_bad_pushes_are_rejected_and_the_server_keeps_serving(grpc_server):
    client, port, params = grpc_server
    good = {"w": np.ones((8, 8), np.float32), "b": np.ones(8, np.float32)}
    bad = [
        ({"w": np.ones((8, 7), np.float32), "b": good["b"]},
         PushRejected, r"gradient 'w' is float32\[8, 7\], expected float32\[8, 8\]"),
        ({"w": np.ones((8, 8), np.float64)[:4], "b": good["b"]},
         PushRejected, r"gradient 'w' is float64\[4, 8\], expected float32\[8, 8\]"),
        ({"w": good["w"], "b": good["b"], "extra": np.ones(1, np.float32)},
         PushRejected, r"unknown keys \['extra'\]"),
        ({"w": good["w"]}, PushRejected, r"lacks keys \['b'\]"),
        ({"w": np.ones((64, 8), np.float32), "b": good["b"]},
         PushRejected, "exceeds ps0's limit of 400"),
    ]
    for i, (grads, exc, match) in enumerate(bad):
        with pytest.raises(exc, match=match):
            client.push(worker=0, step_id=100 + i, version=0, grads=grads)
    with pytest.raises(PushRejected, match="malformed message"):
        client._ch.call("Push", b"\x05\x00\x00\x00garbage")
    with pytest.raises(PushRejected, match="step_id must be an integer"):
        client._ch.call("Push", wire.encode({"worker": 0, "step_id": "x", "version": 0}, good))
    for token in ("wrong", None):
        intruder = GrpcClient(f"127.0.0.1:{port}", token=token, timeout=10)
        with pytest.raises(PermissionDenied, match="missing or wrong token"):
            intruder.push(worker=0, step_id=1, version=0, grads=good)
        intruder.close()
    # still serving, and none of the refused pushes touched the parameters
    np.testing.assert_array_equal(client.pull()[1]["w"], 0.0)
    assert client.push(worker=0, step_id=1, version=0, grads=good).status == "applied"
    version, pulled = client.pull()
    assert version == 1
    np.testing.assert_array_equal(pulled["w"], -1.0)
    assert [tuple(r) for r in map(dataclasses.astuple, client.log())] == [(1, 0, 0, 0)]


def test_lost_updates_count_acknowledged_versions_past_the_restored_checkpoint():
    from jaxdist.ps.coordinator import ClusterCoordinator
    coord = ClusterCoordinator([], servers=[], placement=None, treedef=None)
    try:
        # ps0: fresh run acknowledged up to version 57, restarted from its checkpoint at 40
        # (versions 41..57 lost), then ran on to 90; ps1 never restarted.
        coord._record_acks([[0, 111, -1, 50], [1, 333, -1, 60]])
        coord._record_acks([[0, 111, -1, 57], [0, 222, 40, 90]])
        assert coord.lost_updates() == {0: 17, 1: 0}
    finally:
        coord.shutdown()


class _FlakyWorker:
    """A worker handle that loses every closure but keeps answering heartbeats."""

    index = 0

    def __init__(self):
        self.runs = 0

    def check(self, closure_id, fn, args, kwargs):
        pass

    def run(self, closure_id, fn, args, kwargs):
        from jaxdist.ps.coordinator import WorkerLost
        self.runs += 1
        raise WorkerLost("connection reset")

    def create_dataset(self, ds, num_workers):
        pass

    def ping(self, timeout):
        return 7

    def abort(self):
        pass

    def shutdown(self):
        pass

    def close(self):
        pass


def test_a_closure_that_keeps_losing_its_worker_fails_after_max_attempts():
    from jaxdist.ps.coordinator import ClosureError, ClusterCoordinator
    flaky = _FlakyWorker()
    coord = ClusterCoordinator([flaky], servers=[], placement=None, treedef=None,
                               heartbeat_s=0.05, max_attempts=3)
    try:
        value = coord.schedule(lambda worker: 1)
        with pytest.raises(ClosureError, match="lost a worker on each of its 3 attempts"):
            coord.join(timeout=60)
        assert flaky.runs == 3 and coord.rescheduled == 2 and value.done()
        deadline = time.monotonic() + 30
        while coord.live_workers() != [0]:  # heartbeats bring it back
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        coord.shutdown()


def test_multiprocess_schedule_refuses_unregistered_functions_and_odd_arguments():
    from jaxdist.ps import remote
    from jaxdist.ps.coordinator import ClusterCoordinator, GrpcWorker

    @remote
    def registered(worker, x):
        return x

    worker = GrpcWorker(0, "127.0.0.1:9", token=None)  # never contacted: nothing is scheduled
    coord = ClusterCoordinator([worker], servers=[], placement=None, treedef=None,
                               heartbeat_s=60)
    try:
        with pytest.raises(ValueError, match="not registered for remote execution"):
            coord.schedule(lambda worker: 1)
        with pytest.raises(ValueError, match="cannot be sent to a worker process"):
            coord.schedule(registered, args=(object(),))
        assert coord.done()
    finally:
        coord.shutdown()


class _ProtocolOnlyServer:
    """A ServerClient with nothing beyond the protocol (no ``.server`` to peek at)."""

    def __init__(self, server):
        self._server = server

    def pull(self, *, min_version=None, timeout=None):
        return self._server.pull(min_version=min_version, timeout=timeout)

    def push(self, *, worker, step_id, version, grads):
        return self._server.push(worker=worker, step_id=step_id, version=version, grads=grads)

    def status(self):
        return self._server.status()

    def log(self):
        return list(self._server.log)


class _PickyWorker(_FlakyWorker):
    """A worker handle that refuses, at schedule time, closures it could never run."""

    def check(self, closure_id, fn, args, kwargs):
        if args:
            raise ValueError("this worker takes no arguments")


def test_coordinator_reaches_workers_and_servers_only_through_their_protocols():
    # before: server_logs peeked at `.server` (hasattr) and schedule only validated GrpcWorker
    # (isinstance); RemoteValue.live_workers raised AttributeError
    from jaxdist.ps.coordinator import ClusterCoordinator, RemoteValue
    ps = ParameterServer(0, _g(0.0), optax.sgd(1.0))
    ps.push(worker=0, step_id=5, version=0, grads=_g())
    coord = ClusterCoordinator([_PickyWorker()], servers=[_ProtocolOnlyServer(ps)],
                               placement=None, treedef=None, heartbeat_s=60)
    try:
        assert [[r.step_id for r in log] for log in coord.server_logs()] == [[5]]
        with pytest.raises(ValueError, match="takes no arguments"):
            coord.schedule(lambda worker, x: x, args=(1,))
        assert coord.done() and coord.live_workers() == [0]
    finally:
        coord.shutdown()
    assert not hasattr(RemoteValue, "live_workers")  # the coordinator's, not a value's
