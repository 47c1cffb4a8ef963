"""The scaling planner: cost-model formulas against hand-computed values, recommendations on
clear-cut cases, calibration plumbing and the ``jaxdist plan`` command. No timed assertions."""

from __future__ import annotations

import math
import os

import jax
import pytest

from jaxdist.plan import Link, allreduce_time, predict, recommend
from jaxdist.plan import measure as plan_measure
from tests.conftest import REPO, run_python

FAST = Link("fast", latency_s=1e-5, bandwidth=1e10)
SLOW = Link("slow", latency_s=1e-4, bandwidth=1e9)
S = 8e6


def test_ring_tree_one_device_formulas_on_one_host():
    p = 8
    assert allreduce_time(S, devices_per_host=p, intra=FAST, algorithm="ring") == pytest.approx(
        2 * 7 * 1e-5 + 2 * 7 / 8 * S / 1e10)  # 0.14 ms + 1.4 ms
    assert allreduce_time(S, devices_per_host=p, intra=FAST, algorithm="tree") == pytest.approx(
        2 * 3 * (1e-5 + S / 1e10))  # log2(8) = 3 levels, up and down
    assert allreduce_time(S, devices_per_host=5, intra=FAST, algorithm="tree") == pytest.approx(
        2 * 3 * (1e-5 + S / 1e10))  # ceil(log2(5)) = 3
    assert allreduce_time(S, devices_per_host=p, intra=FAST, algorithm="one_device") == pytest.approx(
        2 * 7 * (1e-5 + S / 1e10))
    assert allreduce_time(S, intra=FAST) == 0.0  # one device: nothing to reduce


def test_flat_algorithms_across_hosts_run_at_the_slow_link_and_hierarchical_splits():
    ring = allreduce_time(S, hosts=4, devices_per_host=8, intra=FAST, inter=SLOW, algorithm="ring")
    assert ring == pytest.approx(2 * 31 * 1e-4 + 2 * 31 / 32 * S / 1e9)
    hier = allreduce_time(S, hosts=4, devices_per_host=8, intra=FAST, inter=SLOW,
                          algorithm="hierarchical")
    inside = 2 * 7 * 1e-5 + 2 * 7 / 8 * S / 1e10
    across = 2 * 3 * 1e-4 + 2 * 3 / 4 * S / 1e9
    assert hier == pytest.approx(inside + across)
    assert hier < ring  # fewer slow-latency hops
    # On one host, hierarchical is the ring inside it.
    assert allreduce_time(S, devices_per_host=8, intra=FAST, algorithm="hierarchical") == \
        pytest.approx(allreduce_time(S, devices_per_host=8, intra=FAST, algorithm="ring"))


def test_allreduce_time_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown algorithm 'butterfly'"):
        allreduce_time(S, devices_per_host=2, intra=FAST, algorithm="butterfly")
    with pytest.raises(ValueError, match="hosts and devices_per_host must be >= 1"):
        allreduce_time(S, hosts=0, intra=FAST)
    with pytest.raises(ValueError, match="need latency_s >= 0 and bandwidth > 0"):
        Link("bad", 1e-5, 0)
    with pytest.raises(ValueError, match="unknown link 'carrier-pigeon'"):
        predict(S, 0.01, devices_per_host=2, intra="carrier-pigeon")


def test_predict_compute_messages_overlap_and_shared_compute():
    kw = dict(devices_per_host=8, batch_per_device=32, intra=FAST)
    one_msg = allreduce_time(S / 6, devices_per_host=8, intra=FAST)
    p = predict(S, 0.020, num_leaves=6, **kw)
    assert p.messages == 6 and p.allreduce_s == pytest.approx(6 * one_msg)
    assert p.compute_s == pytest.approx(0.020) and p.step_s == pytest.approx(0.020 + p.allreduce_s)
    assert p.efficiency == pytest.approx(0.020 / p.step_s) and p.speedup == pytest.approx(8 * p.efficiency)
    # fused (XLA's combiner) or packed into one bucket: one message of all the bytes
    for q in (predict(S, 0.020, num_leaves=6, fused=True, **kw),
              predict(S, 0.020, num_leaves=6, pack_bytes=2**24, **kw)):
        assert q.messages == 1
        assert q.allreduce_s == pytest.approx(allreduce_time(S, devices_per_host=8, intra=FAST))
    # full overlap hides up to 2/3 of compute
    hidden = predict(S, 0.020, overlap=1.0, **kw)
    assert hidden.exposed_allreduce_s == pytest.approx(max(0.0, hidden.allreduce_s - 2 / 3 * 0.020))
    # simulated devices share the cores: eight devices compute eight devices' batches one after another
    shared = predict(S, 0.020, compute_parallelism=1, **kw)
    assert shared.compute_s == pytest.approx(8 * 0.020)
    # batch scaling: fixed part stays, the rest grows with the batch
    big = predict(S, 0.020, fixed_s=0.004, reference_batch=32,
                  **{**kw, "batch_per_device": 128})
    assert big.compute_s == pytest.approx(0.004 + 128 * 0.016 / 32)
    with pytest.raises(ValueError, match="overlap"):
        predict(S, 0.02, overlap=1.5, **kw)


def test_recommend_keeps_xla_on_a_fast_single_host_and_needs_no_bigger_batch():
    r = recommend(100e6, 0.3, devices_per_host=8, batch_per_device=32, num_leaves=1,
                  intra="nvlink3", fused=True)
    assert r.cross_device_ops == "xla"
    assert r.pack_bytes is None  # one fused all-reduce: nothing to pack
    assert r.global_batch == 8 * 32  # compute-bound already
    assert r.prediction.efficiency > 0.95


def test_recommend_hierarchical_packing_and_a_larger_batch_on_a_slow_cluster():
    r = recommend(400e6, 0.2, hosts=16, devices_per_host=8, batch_per_device=32, num_leaves=300,
                  intra="nvlink3", inter="ethernet-10g")
    assert r.cross_device_ops == "hierarchical"
    assert r.pack_bytes == 64 * 2**20  # 10 * p * alpha * B = 80 MB, capped at 64 MiB
    assert r.global_batch > 16 * 8 * 32  # comm-bound: a larger per-device batch is recommended
    assert r.global_batch % (16 * 8) == 0
    assert any("cross_device_ops='hierarchical'" in reason for reason in r.reasons)


def test_recommend_packs_a_small_many_leaf_model_into_one_bucket():
    r = recommend(1e6, 0.002, devices_per_host=8, num_leaves=50, intra=SLOW)
    assert r.pack_bytes == 2**20 and r.prediction.messages == 1
    assert math.log2(r.pack_bytes).is_integer()


def test_fit_link_recovers_the_ring_parameters():
    truth = Link("t", 3e-5, 2e9)
    sizes = [2**16, 2**20, 2**22]
    times = [allreduce_time(s, devices_per_host=4, intra=truth) for s in sizes]
    fitted = plan_measure.fit_link("f", sizes, times, 4)
    assert fitted.latency_s == pytest.approx(3e-5) and fitted.bandwidth == pytest.approx(2e9)


def test_measure_allreduce_and_model_size_in_process():
    link = plan_measure.measure_allreduce(jax.devices()[:2], sizes=(2**12, 2**16), reps=2)
    assert link.latency_s >= 0 and link.bandwidth > 0 and "2 cpu devices" in link.name
    with pytest.raises(ValueError, match="needs >= 2 devices"):
        plan_measure.measure_allreduce(jax.devices()[:1])
    assert plan_measure.model_size("cnn")[1] == 6


def test_jaxdist_plan_command_prints_a_table_and_a_recommendation():
    proc = run_python(["-m", "jaxdist.cli", "plan", "--model", "mlp", "--step-time", "2ms",
                       "--hosts", "4", "--devices-per-host", "8", "--intra", "nvlink3",
                       "--inter", "ethernet-25g"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "918.5 KiB of gradients in 6 leaves" in out
    assert "| 4 x 8 |" in out and "| 1 x 1 | 2.00 | 0.00 | 0.00 | 100.0% | 1.00 |" in out
    # Four hosts are one job of four processes: MultiWorkerMirroredStrategy (issue 18: the plan
    # used to name MirroredStrategy, which runs one independent job per host).
    assert ("-> jaxdist.MultiWorkerMirroredStrategy(cross_device_ops='hierarchical', "
            "pack_bytes=1048576)") in out
    assert "memory per device over 32 devices (235,146 parameters, adam, float32" in out
    assert "| 1 | 918.5 KiB | 57.41 KiB |" in out  # Adam's 1.794 MiB over 32 devices
    proc = run_python(["-m", "jaxdist.cli", "plan", "--model", "mlp"], timeout=120)
    assert proc.returncode != 0 and "give --step-time" in proc.stderr
    proc = run_python(["-m", "jaxdist.cli", "plan", "--model", "mlp", "--step-time", "1ms",
                       "--intra", "measured"], timeout=120)
    assert proc.returncode != 0 and "--intra measured needs --calibrate" in proc.stderr


def test_jaxdist_plan_calibrates_here():
    proc = run_python(["-m", "jaxdist.cli", "plan", "--model", "mlp", "--calibrate",
                       "--calibrate-devices", "2", "--devices-per-host", "2", "--intra", "measured",
                       "--compute-parallelism", "1", "--batch", "32"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "measured here: one device, mlp at batch 32" in proc.stdout
    assert "measured here: psum over 2 cpu devices" in proc.stdout
    assert "| 1 x 2 |" in proc.stdout


def test_stage_memory_arithmetic():
    from jaxdist.plan import recommend_stage, stage_memory

    n, p = 8, 1e9
    m = stage_memory(p, n, optimizer="adam", precision="float32")
    assert [x.stage for x in m] == [0, 1, 2, 3]
    assert (m[0].params, m[0].opt_state, m[0].step_extra) == (4 * p, 8 * p, 4 * p)
    assert (m[1].params, m[1].opt_state, m[1].step_extra) == (4 * p, 8 * p / n, 4 * p)
    assert (m[2].params, m[2].opt_state, m[2].step_extra) == (4 * p, 8 * p / n, 4 * p / n)
    # stage 3 stores 1/n of everything and gathers the parameters for the step
    assert (m[3].params, m[3].opt_state, m[3].step_extra) == (4 * p / n, 8 * p / n, 4 * p / n + 4 * p)
    mixed = stage_memory(p, n, optimizer="sgd", precision="mixed_float16")
    assert mixed[0].opt_state == 0 and mixed[0].step_extra == 6 * p  # f32 grads + f16 copy
    assert stage_memory(p, n, opt_bytes=123.0)[0].opt_state == 123.0
    assert recommend_stage(m, 16 * p)[0] == 0
    assert recommend_stage(m, 15.9 * p)[0] == 1
    assert recommend_stage(m, 6 * p)[0] == 2
    stage, why = recommend_stage(m, 1 * p)
    assert stage is None and "no stage fits" in why
    with pytest.raises(ValueError, match="unknown optimizer"):
        stage_memory(p, n, optimizer="adamax2")
    with pytest.raises(ValueError, match="unknown precision"):
        stage_memory(p, n, precision="int8")


FACTORY = """
import jax, jax.numpy as jnp, optax
from flax.training import train_state

def make_state():
    params = {"w": jnp.zeros((1000, 1000)), "b": jnp.zeros(1000), "v": jnp.zeros((1000, 8))}
    return train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))

def make_params():
    return {"w": jnp.zeros((10, 10), jnp.bfloat16)}

def make_nothing():
    return "a string"
"""


def test_jaxdist_plan_reads_the_users_model_and_recommends_a_stage(tmp_path):
    (tmp_path / "my_models.py").write_text(FACTORY)
    env = {"PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"}
    proc = run_python(["-m", "jaxdist.cli", "plan", "--model", "my_models:make_state",
                       "--step-time", "5ms", "--devices-per-host", "8",
                       "--device-memory", "10MB"], timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    params = 1000 * 1000 + 1000 + 8000
    assert f"{params * 4 / 2**20:.4g} MiB of gradients in 3 leaves" in out
    assert f"({params:,} parameters, optimizer state as measured, float32" in out
    # 16 bytes a parameter replicated (16.1 MB) does not fit 10 MB; stage 1 (4 + 1 + 4) does
    assert "memory: replicated needs" in out
    assert "-> jaxdist.MirroredStrategy(cross_device_ops='xla', pack_bytes=" in out
    assert "zero_stage=1)" in out
    proc = run_python(["-m", "jaxdist.cli", "plan", "--model", "my_models:make_params",
                       "--step-time", "1ms"], timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "200 B of gradients in 1 leaves" in proc.stdout and "(100 parameters, adam" in proc.stdout
    for spec, msg in (("my_models:make_nothing", "no arrays"), ("my_models", "MODULE:FACTORY"),
                      ("no_such_module:f", "No module named")):
        proc = run_python(["-m", "jaxdist.cli", "plan", "--model", spec, "--step-time", "1ms"],
                          timeout=120, env=env)
        assert proc.returncode != 0 and msg in proc.stderr, (spec, proc.stderr[-1000:])


STATES = """
import equinox as eqx, jax, jax.numpy as jnp, optax
from flax import nnx

class Net(nnx.Module):
    def __init__(self, *, rngs):
        self.hidden = nnx.Linear(64, 32, rngs=rngs)
        self.out = nnx.Linear(32, 10, rngs=rngs)

def nnx_state():
    model = Net(rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

def eqx_state():
    model = eqx.nn.MLP(64, 10, 32, 1, key=jax.random.key(0))
    return model, optax.adam(1e-3).init(eqx.filter(model, eqx.is_array))

def optax_state():
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32), "w2": jnp.zeros((32, 10)),
              "b2": jnp.zeros(10)}
    return params, optax.adam(1e-3).init(params)

def dict_state():
    params, opt_state = optax_state()
    return {"params": params, "opt": opt_state, "name": "probe"}
"""


@pytest.mark.parametrize("factory", ["nnx_state", "eqx_state", "optax_state", "dict_state"])
def test_plan_counts_the_optimizer_beside_the_model_as_optimizer_state(factory, tmp_path,
                                                                        monkeypatch):
    # The states docs/guides/your_own_jax.md teaches hold the optimizer beside the model: its
    # slots are optimizer state, not parameters (they were counted as 7,231 parameters).
    from jaxdist.plan.measure import factory_size

    (tmp_path / "my_states.py").write_text(STATES)
    monkeypatch.syspath_prepend(str(tmp_path))
    param_bytes, leaves, opt_bytes, params = factory_size(f"my_states:{factory}")
    assert (params, leaves, param_bytes) == (2410, 4, 2410 * 4)
    # Adam's mu and nu in float32, its int32 count, and NNX's own step counter
    assert opt_bytes == 2 * 2410 * 4 + 4 + (4 if factory == "nnx_state" else 0)
