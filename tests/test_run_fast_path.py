"""strategy.run's steady state: per-replica results kept as concatenated blocks, and the per-call
fast path that reuses the previous call's classification while the arguments match it."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist
from jaxdist.core import per_replica


def _mirrored(n):
    return jaxdist.MirroredStrategy(jax.devices()[:n])


def _step(state, g):
    """An Adam-like update: the new moments feed the new parameters and are returned too."""
    g = jaxdist.all_reduce(g, "mean")
    mu = 0.9 * state["mu"] + 0.1 * g
    nu = 0.99 * state["nu"] + 0.01 * g * g
    p = state["p"] - 0.001 * mu / (jnp.sqrt(nu) + 1e-8)
    return {"p": p, "mu": mu, "nu": nu, "t": state["t"] + 1}, jnp.sum(p)


def _state():
    return {"p": jnp.ones((64, 32)), "mu": jnp.zeros((64, 32)), "nu": jnp.zeros((64, 32)),
            "t": jnp.int32(0)}


@pytest.mark.parametrize("n", [1, 2, 8])
def test_run_results_are_blocks_that_read_as_stacks(n):
    s = _mirrored(n)
    rid = lambda: jaxdist.replica_id().astype(jnp.float32)  # noqa: E731
    out = s.run(lambda: {"row": jnp.arange(3.0) + 10 * rid(), "scalar": rid()})
    (leaf,) = jax.tree.leaves(out["row"])
    assert leaf.shape == (3 * n,)  # each device's shard is exactly its replica's value
    assert {sh.data.shape for sh in leaf.addressable_shards} == {(3,)}
    stacked = out["row"].stacked
    assert stacked.shape == (n, 3) and stacked.sharding.is_equivalent_to(s.layout.batch, 2)
    expected = np.arange(3.0)[None] + 10 * np.arange(n)[:, None]
    np.testing.assert_array_equal(np.asarray(stacked), expected)
    assert out["scalar"].stacked.shape == (n,)
    assert repr(out["row"]) == f"PerReplica(({n}, 3))"
    for r, v in enumerate(s.local_results(out)):
        np.testing.assert_array_equal(np.asarray(v["row"]), expected[r])
    np.testing.assert_allclose(np.asarray(s.reduce("sum", out["row"])), expected.sum(0))
    np.testing.assert_allclose(np.asarray(s.reduce("mean", out["row"], axis=0)), expected.mean())
    np.testing.assert_array_equal(np.asarray(s.gather(out["row"], 0)), expected.reshape(-1))
    # Blocks and hand-built stacks go back into run alike, and mean the same per-replica values.
    again = s.run(lambda a, b: a - b, args=(out["row"], jaxdist.PerReplica(jnp.asarray(expected))))
    np.testing.assert_array_equal(np.asarray(again.stacked), np.zeros((n, 3)))


@pytest.mark.parametrize("n", [1, 2])
def test_a_per_replica_update_compiles_without_copying_the_state(n):
    # A reshape between the update and its donated output made XLA:CPU recompute the moments in
    # the parameters' fusion and copy mu, nu and p every step (3 copies here, 15 for an MLP).
    s = _mirrored(n)
    state, _ = s.run(_step, args=(_state(), jnp.ones((64, 32))))
    text = per_replica.lower(s, _step, args=(state, jnp.ones((64, 32)))).compile().as_text()
    assert "input_output_alias" in text  # the state is donated...
    assert re.findall(r"= \S+ copy\(", text) == []  # ...and updated in place, with no copy


def test_steady_state_calls_skip_classification(monkeypatch):
    s = _mirrored(2)
    state, _ = s.run(_step, args=(_state(), jnp.ones((64, 32))))
    g = s.layout.put_replicated(jnp.ones((64, 32)))
    state, _ = s.run(_step, args=(state, g))
    calls = []
    classify = per_replica._classify
    monkeypatch.setattr(per_replica, "_classify", lambda *a: calls.append(1) or classify(*a))
    for _ in range(3):
        state, _ = s.run(_step, args=(state, g))
    assert calls == []
    state, _ = s.run(_step, args=(state, np.ones((64, 32), np.float32)))  # placed, still fast
    assert calls == []
    state, _ = s.run(_step, args=(state, g), kwargs={})  # the same structure, spelled out
    assert calls == [] and int(s.local_results(state["t"])[0]) == 7
    s.run(lambda st, g, k: _step(st, g), args=(state, g, 1))  # another function: classified
    assert len(calls) == 6  # four per-replica leaves of the state, g and 1


def test_changed_structure_between_calls_recompiles_and_stays_correct(count_compiles):
    s = _mirrored(2)
    g = jnp.ones((64, 32))
    a, _ = s.run(_step, args=(_state(), g))
    a, _ = s.run(_step, args=(a, g))
    b = {**_state(), "extra": jnp.zeros(3)}

    def step_extra(state, g):
        new, out = _step({k: v for k, v in state.items() if k != "extra"}, g)
        return {**new, "extra": state["extra"] + 1}, out

    with count_compiles() as compiles:
        b, _ = s.run(step_extra, args=(b, g))
        b, _ = s.run(step_extra, args=(b, g))
        a, _ = s.run(_step, args=(a, g))  # back to the first structure: compiled already
    assert compiles() == 2
    np.testing.assert_array_equal(np.asarray(s.to_mirrored(b)["extra"]), np.full(3, 2.0))
    ma, mb = s.to_mirrored(a, check=True), s.to_mirrored(b, check=True)
    assert int(ma["t"]) == 3 and int(mb["t"]) == 2
    ref = _state()
    for _ in range(3):
        ref, _ = _step_reference(ref, np.ones((64, 32)))
    np.testing.assert_allclose(np.asarray(ma["p"]), ref["p"], rtol=1e-6)


def _step_reference(state, g):
    mu = 0.9 * np.asarray(state["mu"]) + 0.1 * g
    nu = 0.99 * np.asarray(state["nu"]) + 0.01 * g * g
    return {"p": np.asarray(state["p"]) - 0.001 * mu / (np.sqrt(nu) + 1e-8), "mu": mu, "nu": nu}, 0


def test_changed_placement_and_values_between_calls_stay_correct():
    s = _mirrored(2)
    scale = lambda v, k, mode: v * k * (2 if mode == "double" else 3)  # noqa: E731
    v = s.run(lambda: jaxdist.replica_id().astype(jnp.float32) + 1)
    for k, mode, want in [
        (s.layout.put_replicated(jnp.float32(1)), "double", [2, 4]),
        (s.layout.put_replicated(jnp.float32(2)), "double", [4, 8]),
        (np.float32(1), "double", [2, 4]),  # a host value: placed, not taken as it is
        (jax.device_put(jnp.float32(1), jax.devices()[1]), "double", [2, 4]),  # one device
        (jnp.float32(1), "triple", [3, 6]),  # another static value: another program
    ]:
        out = s.run(scale, args=(v, k, mode))
        assert [float(r) for r in s.local_results(out)] == want
    # A stack built by hand where blocks were: the same per-replica values.
    out = s.run(scale, args=(jaxdist.PerReplica(jnp.array([1.0, 2.0])), 1.0, "double"))
    assert [float(r) for r in s.local_results(out)] == [2, 4]


def test_mismatched_per_replica_values_still_raise_after_a_fast_path():
    s = _mirrored(2)
    v = s.run(lambda: jnp.ones(3))
    v = s.run(lambda x: x + 1, args=(v,))
    v = s.run(lambda x: x + 1, args=(v,))
    with pytest.raises(ValueError, match="made by a strategy with 4 replicas, but this .* has 2"):
        s.run(lambda x: x + 1, args=(_mirrored(4).run(lambda: jnp.ones(3)),))
    h = jaxdist.PerReplica(jnp.ones((2, 3)))
    h = s.run(lambda x: x, args=(h,))
    with pytest.raises(ValueError, match="leading axis must be 2"):
        s.run(lambda x: x, args=(jaxdist.PerReplica(np.ones((4, 3), np.float32)),))


def test_methods_of_unhashable_objects_take_the_fast_path_too(monkeypatch):
    import dataclasses

    @dataclasses.dataclass  # eq=True, so instances are not hashable
    class Trainer:
        scale: float = 2.0

        def step(self, v):
            return v * self.scale

    s, t = _mirrored(2), Trainer()
    v = s.run(t.step, args=(jnp.float32(1),))
    v = s.run(t.step, args=(v,))
    calls = []
    classify = per_replica._classify
    monkeypatch.setattr(per_replica, "_classify", lambda *a: calls.append(1) or classify(*a))
    v = s.run(t.step, args=(v,))
    assert calls == [] and [float(r) for r in s.local_results(v)] == [8.0, 8.0]
