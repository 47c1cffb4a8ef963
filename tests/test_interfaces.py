"""The interfaces written down (docs/architecture.md, "Interfaces"): the input iterator protocol,
the cross-device op registry, the save-policy protocol."""

from __future__ import annotations

import ast
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist
from jaxdist.callbacks import AnyOf, BestMetric, EveryNEpochs, EveryNSteps, SavePolicy
from jaxdist.core import collectives
from jaxdist.input import EpochIterator, EpochSource, GroupedEpochSource
from jaxdist.plan import cost
from jaxdist.ps.fit import PSDataset
from tests.conftest import REPO


def test_the_datasets_implement_the_input_protocols():
    ds = jaxdist.MirroredStrategy(jax.devices()[:2]).distribute(np.arange(16.0), 4)
    assert isinstance(ds, GroupedEpochSource) and isinstance(ds, EpochSource)
    with ds.iterator(epoch=0, position=1) as it:
        assert isinstance(it, EpochIterator)
        next(it)
        assert it.position == 2
    assert isinstance(PSDataset(np.arange(8.0), 4), EpochSource)


def test_a_source_without_the_grouped_members_is_not_a_grouped_source():
    class Plain:
        global_batch_size = 4

        def iterator(self, *, epoch=0, position=0):
            return iter(())

    assert isinstance(Plain(), EpochSource) and not isinstance(Plain(), GroupedEpochSource)


def test_fit_calls_no_private_member_of_its_data():
    # before: evaluate and predict called dataset._next_epoch(...)
    tree = ast.parse(open(os.path.join(REPO, "jaxdist", "training", "fit.py"), encoding="utf-8").read())
    private = [f"line {n.lineno}: {n.value.id}.{n.attr}" for n in ast.walk(tree)
               if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
               and n.value.id in ("dataset", "data", "it", "eval_data") and n.attr.startswith("_")]
    assert not private, private


def test_every_cross_device_op_has_one_descriptor_that_the_planner_prices():
    assert collectives.IMPLEMENTATIONS == tuple(collectives.OPS) == (
        "xla", "ring", "hierarchical", "one_device")
    for name, op in collectives.OPS.items():
        assert op.name == name and op.summary and callable(op.reduce)
        assert op.cost_models and set(op.cost_models) <= set(cost.ALGORITHMS), name
    r = cost.recommend(1e9, 0.5, hosts=2, devices_per_host=4, intra="nvlink3", inter="ethernet-10g")
    priced = r.reasons[-2] if "global batch" in r.reasons[-1] else r.reasons[-1]
    # before: the planner's own table knew three of the four ops (no "ring")
    assert all(f"{name} " in priced for name in collectives.OPS), priced


def test_a_new_cross_device_op_is_one_entry(monkeypatch):
    planted = collectives.CrossDeviceOp("planted", "the ring, under another name",
                                        collectives.OPS["ring"].reduce, ("ring",))
    monkeypatch.setitem(collectives.OPS, "planted", planted)
    collectives.check_options("planted", None, None)  # validation takes it
    jaxdist.MirroredStrategy(jax.devices()[:2], cross_device_ops="planted")  # a strategy takes it
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    f = jax.shard_map(lambda t: collectives.reduce_tree(t, "sum", axes=("data",), implementation="planted"),
                      mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P("data"), check_vma=False)
    assert f(jnp.arange(4.0)).tolist() == [2.0, 4.0, 2.0, 4.0]  # the all-reduce runs it
    r = cost.recommend(1e8, 0.1, hosts=1, devices_per_host=8)
    assert any("planted " in reason for reason in r.reasons)  # the planner prices it
    with pytest.raises(ValueError, match="planted"):
        monkeypatch.delitem(collectives.OPS, "planted")
        collectives.check_options("planted", None, None)


def test_the_save_policies_implement_the_protocol():
    for policy in (EveryNSteps(2), EveryNEpochs(1), BestMetric("val_loss"),
                   AnyOf(EveryNSteps(2), BestMetric("val_loss"))):
        assert isinstance(policy, SavePolicy)
    assert not isinstance(object(), SavePolicy)


@pytest.mark.parametrize("data, says", [
    ([np.ones((4, 2)), np.ones(4)], "a list is not a source fit can read (it has no iterator and "
                                    "no global_batch_size"),
    ((b for b in [np.ones(4)]), "a generator is not a source"),
    (type("NoIterator", (), {"global_batch_size": 4})(), "a NoIterator is not a source fit can read "
                                                          "(it has no iterator;"),
])
def test_fit_refuses_what_is_not_a_source_at_its_call_saying_what_to_pass(data, says):
    step = jaxdist.OneDeviceStrategy().step(lambda w, b: (w, {"loss": w}))
    with pytest.raises(TypeError, match=r"^fit data: " + re.escape(says) + r".* pass "
                       r"strategy\.distribute\(data, global_batch_size\)"):
        jaxdist.fit(step, jax.numpy.float32(0.0), data, batch_size=4, verbose=0)


def test_a_source_of_ones_own_trains_in_fit_and_the_ps_dataset_conforms():
    """An ``EpochSource`` that is not a DistributedDataset trains as one does."""
    s = jaxdist.OneDeviceStrategy()
    dist = s.distribute(np.arange(12, dtype=np.float32), 4, shuffle=False)

    class Mine:  # the members of EpochSource, nothing else
        global_batch_size = 4

        def iterator(self, *, epoch=0, position=0):
            return dist.iterator(epoch=epoch, position=position)

    def step(w, batch):
        return w + jaxdist.compute_average_loss(batch.data, batch.mask), {"mean": w}

    ours = jaxdist.fit(s.step(step), jax.numpy.float32(0.0), Mine(), epochs=2, verbose=0)
    theirs = jaxdist.fit(s.step(step), jax.numpy.float32(0.0), dist, epochs=2, verbose=0)
    assert ours.history == theirs.history and float(ours.state) == float(theirs.state)
    it = PSDataset(np.arange(8.0), 4, shuffle=False).iterator()
    assert isinstance(it, EpochIterator) and [b[0].tolist() for b in it] == [[0, 1, 2, 3],
                                                                             [4, 5, 6, 7]]


def test_the_elastic_agent_uses_only_the_launcher_surface_it_declares():
    # before: Agent reached 13 members of the launcher through an untyped `self.l`
    from jaxdist.launch import elastic, group

    source = open(os.path.join(REPO, "jaxdist", "launch", "elastic.py"), encoding="utf-8").read()
    used = set(re.findall(r"self\.l\.(\w+)", source))
    declared = {n for n in dir(elastic.LauncherSurface) if not n.startswith("_")}
    declared |= set(elastic.LauncherSurface.__annotations__)
    assert used and used <= declared, used - declared
    launcher = group._Launcher(["train.py"], group._Options(num_processes=2),
                               lambda stream, data: None, {"PATH": os.environ["PATH"]}, None)
    assert isinstance(launcher, elastic.LauncherSurface)
