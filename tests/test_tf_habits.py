"""tf.distribute habits, checked against the values TensorFlow 2.21 gives for the same programs.

The tf values were measured with tensorflow-cpu 2.21 (MirroredStrategy over 2, 4 and 8 logical
CPU devices; TFConfigClusterResolver + multi_worker_util for TF_CONFIG) by
tests/_scripts/tf_habits_values.py: see the comments.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist
from tests.conftest import REPO, run_python

REPLICAS = [1, 2, 4, 8]


def _strategy(n):
    return jaxdist.MirroredStrategy(jax.devices()[:n])


# --- reductions and gathers over a padded last batch ---------------------------------------------

@pytest.mark.parametrize("n", REPLICAS)
def test_reduce_and_gather_count_real_rows_of_a_partial_batch(n):
    # tf: 13 rows np.arange(13) batched by 8; per-example values x * 1.0.
    #   reduce(MEAN, axis=0): [3.5, 10.0]; reduce(SUM, axis=0): [28.0, 50.0];
    #   gather(axis=0): 8 rows, then the 5 real rows [8..12] (on 2, 4 and 8 replicas alike).
    s = _strategy(n)
    means, sums, gathers = [], [], []
    for batch in s.distribute((np.arange(13, dtype=np.float32),), 8):
        per_example = s.run(lambda b: b.data[0] * 1.0, args=(batch,))
        means.append(float(s.reduce("mean", per_example, axis=0)))
        sums.append(float(s.reduce("sum", per_example, axis=0)))
        gathers.append(np.asarray(s.gather(per_example, axis=0)).tolist())
    assert means == [3.5, 10.0]
    assert sums == [28.0, 50.0]
    assert gathers == [list(range(8)), [8.0, 9.0, 10.0, 11.0, 12.0]]


def test_masked_rows_are_not_the_new_state():
    # The state a step hands back is not per-example, whatever its shape: never masked.
    s = _strategy(8)
    batch = list(s.distribute((np.arange(13, dtype=np.float32),), 8))[1]
    state = s.run(lambda: jnp.ones(1) * jaxdist.replica_id())  # one row per replica
    state, rows = s.run(lambda st, b: (st + 1.0, b.data[0]), args=(state, batch))
    assert np.asarray(s.gather(state, axis=0)).tolist() == [float(r + 1) for r in range(8)]
    assert np.asarray(s.gather(rows, axis=0)).tolist() == [8.0, 9.0, 10.0, 11.0, 12.0]


def test_a_run_given_several_batches_counts_real_rows_or_refuses():
    # A step given two batches: an output with one batch's row count counts that batch's real
    # rows; when several batches of its size differ in padding it cannot know which, and says so
    # (it used to count the padding: 9.625 instead of tf's 10.0).
    s = _strategy(2)
    first = list(s.distribute((np.arange(13, dtype=np.float32),), 8))
    second = list(s.distribute((np.arange(100, 113, dtype=np.float32),), 8))
    small = list(s.distribute((np.arange(6, dtype=np.float32),), 4))
    both = lambda a, b: (a.data[0] * 1.0, b.data[0] * 1.0)  # noqa: E731
    x, y = s.run(both, args=(first[1], small[1]))          # 8 and 4 rows: each knows its own
    assert float(s.reduce("mean", x, axis=0)) == 10.0 and float(s.reduce("mean", y, axis=0)) == 4.5
    x, y = s.run(both, args=(first[1], second[1]))         # the same padding: either mask will do
    assert float(s.reduce("mean", x, axis=0)) == 10.0
    assert np.asarray(s.gather(y, axis=0)).tolist() == [108.0, 109.0, 110.0, 111.0, 112.0]
    x, y = s.run(both, args=(first[0], second[0]))         # no padding at all
    assert float(s.reduce("mean", x, axis=0)) == 3.5
    x, y = s.run(both, args=(first[1], second[0]))         # 5 real rows and 8: which are x's?
    with pytest.raises(ValueError, match="which of its rows are real is not known"):
        s.reduce("mean", x, axis=0)
    with pytest.raises(ValueError, match="a strategy.run of its own"):
        s.gather(y, axis=0)
    # Across replicas only (axis=None): every row of each replica's block, as before.
    assert np.asarray(s.reduce("sum", x)).tolist() == [8.0 + 12, 9.0 + 8, 10.0 + 9, 11.0 + 10]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_reduce_of_a_plain_value_along_an_axis(n):
    # tf: reduce(SUM, tf.constant([1, 2, 3]), axis=0) = 12 / 24 / 48 on 2 / 4 / 8 replicas;
    # reduce(MEAN, ..., axis=0) = 2.0; axis=None with SUM: ValueError in tf as here.
    s = _strategy(n)
    assert float(s.reduce("sum", jnp.array([1.0, 2.0, 3.0]), axis=0)) == 6.0 * n
    assert float(s.reduce("mean", jnp.array([1.0, 2.0, 3.0]), axis=0)) == 2.0
    with pytest.raises(ValueError, match="not per-replica"):
        s.reduce("sum", jnp.array([1.0, 2.0, 3.0]))


def test_reduce_op_from_its_name():
    # tf: tf.distribute.ReduceOp("SUM") is ReduceOp.SUM.
    assert jaxdist.ReduceOp("SUM") is jaxdist.ReduceOp.SUM
    assert jaxdist.ReduceOp("Mean") is jaxdist.ReduceOp.MEAN
    with pytest.raises(ValueError):
        jaxdist.ReduceOp("max")


# --- compute_average_loss ----------------------------------------------------------------------

def test_compute_average_loss_sample_weight_is_tfs():
    loss = jnp.array([1.0, 2.0, 3.0, 4.0])
    # tf.nn.compute_average_loss([1, 2, 3, 4], sample_weight=[1, 0, 1, 0.5]) = 1.5 (6 / 4).
    assert float(jaxdist.compute_average_loss(
        loss, sample_weight=jnp.array([1.0, 0.0, 1.0, 0.5]))) == 1.5
    assert float(jaxdist.compute_average_loss(loss, sample_weight=2.0)) == 5.0
    # Padding still counts for nothing: the padded row's weight and loss are ignored.
    mask = jnp.array([True, True, True, False])
    assert float(jaxdist.compute_average_loss(loss, mask, sample_weight=jnp.array(
        [1.0, 0.0, 1.0, 0.5]))) == pytest.approx(4.0 / 3.0, rel=1e-6)
    # A float mask used to give 3.2 silently: refused now, naming sample_weight.
    with pytest.raises(TypeError, match="sample_weight"):
        jaxdist.compute_average_loss(loss, jnp.array([1.0, 0.0, 1.0, 0.5]))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_weighted_loss_in_the_per_replica_view_sums_to_tfs(n):
    s = _strategy(n)
    loss = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    w = np.array([1.0, 0.0, 1.0, 0.5], np.float32)
    batch = next(iter(s.distribute((loss, w), 4)))
    out = s.run(lambda b: jaxdist.compute_average_loss(b.data[0], b.mask, sample_weight=b.data[1]),
                args=(batch,))
    assert float(s.reduce("sum", out)) == 1.5


# --- a Batch unpacked as its data --------------------------------------------------------------------

def _matmul_step(w, batch):
    xb, yb = batch       # the mistake: batch is Batch(data=(x, y), mask)
    return w, jnp.mean((xb @ w - yb) ** 2)      # TypeError: 'tuple' @ array


def _reshape_step(w, batch):
    xb, yb = batch       # as a model that flattens its input: 'tuple' has no attribute 'reshape'
    return w, jnp.mean((xb.reshape(xb.shape[0], -1) @ w - yb) ** 2)


@pytest.mark.parametrize("step", [_matmul_step, _reshape_step])
def test_unpacking_a_batch_as_xy_says_what_a_batch_is(step):
    s = _strategy(2)
    batch = next(iter(s.distribute((np.ones((4, 3), np.float32), np.ones(4, np.float32)), 4)))
    with pytest.raises((TypeError, AttributeError)) as info:
        s.step(step)(jnp.ones(3), batch)
    assert "(xb, yb), mask = batch" in "\n".join(getattr(info.value, "__notes__", []))


# --- TF_CONFIG ------------------------------------------------------------------------------------

def test_tf_config_two_evaluators_refused():
    # tf: "There must be at most one 'evaluator' job."
    with pytest.raises(ValueError, match="at most one evaluator"):
        jaxdist.ClusterSpec.from_tf_config({
            "cluster": {"worker": ["h0:2222"], "evaluator": ["h1:2222", "h2:2222"]},
            "task": {"type": "worker", "index": 0}})


def test_tf_config_sparse_job_form():
    # tf: {"worker": {"0": "h0:2222", "1": "h1:2222"}} resolves to ["h0:2222", "h1:2222"].
    spec = jaxdist.ClusterSpec.from_tf_config({
        "cluster": {"worker": {"1": "h1:2222", "0": "h0:2222"}},
        "task": {"type": "worker", "index": 1}})
    assert (spec.workers, spec.num_processes, spec.process_id) == (("h0:2222", "h1:2222"), 2, 1)
    with pytest.raises(ValueError, match=r"task indexes \[1\] are missing"):
        jaxdist.ClusterSpec.from_tf_config({"cluster": {"worker": {"0": "h0:1", "2": "h2:1"}},
                                            "task": {"type": "worker", "index": 0}})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "TF_CONFIG"))}
    env.update(PYTHONPATH=REPO, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", **extra)
    return env


def test_multi_worker_strategy_refuses_a_cluster_it_can_no_longer_join():
    config = {"cluster": {"worker": [f"127.0.0.1:{_free_port()}", "127.0.0.1:1"]},
              "task": {"type": "worker", "index": 0}}
    proc = run_python("import jax, jaxdist; jax.devices(); jaxdist.MultiWorkerMirroredStrategy()",
                      timeout=120, env=_clean_env(TF_CONFIG=json.dumps(config)))
    assert proc.returncode != 0
    assert "jaxdist.initialize()" in proc.stderr and "TF_CONFIG" in proc.stderr


@pytest.mark.multiprocess
def test_multi_worker_strategy_reads_tf_config_itself():
    port = _free_port()
    code = ("import jax, jaxdist; s = jaxdist.MultiWorkerMirroredStrategy(); "
            "print('replicas', s.num_replicas_in_sync, 'processes', jax.process_count())")
    procs = []
    for i in range(2):
        config = {"cluster": {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]},
                  "task": {"type": "worker", "index": i}}
        procs.append(subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=_clean_env(TF_CONFIG=json.dumps(config), JAX_NUM_CPU_DEVICES="2"), cwd=REPO))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=180))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("the two TF_CONFIG workers did not finish within 180 s")
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "replicas 4 processes 2" in out, (out, err[-2000:])
