"""Placement of parameter leaves on servers, and the wire format."""

import jax
import ml_dtypes
import msgpack
import numpy as np
import pytest

from jaxdist.ps import placement as pl
from jaxdist.ps import wire


def _tree():
    # bytes: a 400, b 4000, c 1200, d 40, e 2000 (float32)
    return {"a": np.zeros(100, np.float32), "b": np.zeros((10, 100), np.float32),
            "c": np.zeros((30, 10), np.float32), "d": np.zeros(10, np.float32),
            "e": {"w": np.zeros((50, 10), np.float32)}}


def _assignment(p):
    return {piece.key: piece.shard for piece in p.pieces}


def test_round_robin_follows_tree_order():
    p = pl.plan(_tree(), 3, method="round_robin")
    assert _assignment(p) == {"['a']": 0, "['b']": 1, "['c']": 2, "['d']": 0,
                              "['e']['w']": 1}


def test_greedy_puts_largest_first_on_least_loaded():
    p = pl.plan(_tree(), 2, method="greedy")
    # b(4000)->0; e(2000)->1; c(1200)->1 (2000<4000); a(400)->1 (3200<4000); d(40)->1 (3600<4000)
    assert _assignment(p) == {"['b']": 0, "['e']['w']": 1, "['c']": 1, "['a']": 1, "['d']": 1}
    assert p.loads() == [4000, 3640]
    report = p.report()
    assert "['b'] float32[10, 100] -> ps0 (4000 B)" in report
    assert "ps1: 3640 B in 4 array(s)" in report


def test_greedy_balances_better_than_round_robin():
    tree = _tree()
    greedy, rr = pl.plan(tree, 3), pl.plan(tree, 3, method="round_robin")
    assert max(greedy.loads()) <= max(rr.loads())
    assert sum(greedy.loads()) == sum(rr.loads()) == 7640


@pytest.mark.parametrize("kwargs, parts", [
    ({"max_shard_bytes": 1000}, {"['b']": 4, "['e']['w']": 2, "['c']": 2}),
    ({"num_partitions": 3, "max_shard_bytes": 1500}, {"['b']": 3, "['e']['w']": 3}),
])
def test_partitioned_leaves_reassemble_exactly(kwargs, parts):
    rng = np.random.default_rng(0)
    tree = jax.tree.map(lambda v: rng.standard_normal(v.shape).astype(v.dtype), _tree())
    flat, treedef = pl.flatten(tree)
    p = pl.plan(tree, 3, **kwargs)
    counts = {}
    for piece in p.pieces:
        counts[piece.leaf] = counts.get(piece.leaf, 0) + 1
    assert {k: v for k, v in counts.items() if v > 1} == parts
    for leaf, n in parts.items():  # pieces of one leaf land on different servers
        assert len({q.shard for q in p.pieces if q.leaf == leaf}) == min(n, 3)
    shards = p.split(flat)
    assert sum(a.nbytes for s in shards for a in s.values()) == sum(v.nbytes for v in flat.values())
    back = p.assemble(shards)
    assert list(back) == list(flat)
    for k in flat:
        np.testing.assert_array_equal(back[k], flat[k])
    rebuilt = pl.unflatten(treedef, back)
    np.testing.assert_array_equal(rebuilt["e"]["w"], flat["['e']['w']"])


def test_plan_rejects_bad_options():
    with pytest.raises(ValueError, match="placement method 'best'"):
        pl.plan(_tree(), 2, method="best")
    with pytest.raises(ValueError, match="num_shards must be >= 1"):
        pl.plan(_tree(), 0)


def test_wire_round_trip_is_zero_copy_and_typed():
    arrays = {"f": np.arange(6, dtype=np.float32).reshape(2, 3),
              "b": np.ones(3, ml_dtypes.bfloat16), "i": np.array(7, np.int64),
              "t": np.arange(5, dtype=np.float64)[::2]}  # non-contiguous input
    msg = wire.encode({"version": 4, "worker": 1}, arrays)
    header, out = wire.decode(msg)
    assert header == {"version": 4, "worker": 1}
    for k, v in arrays.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape
        np.testing.assert_array_equal(out[k], v)
    assert not out["f"].flags.writeable and not out["f"].flags.owndata  # a view into msg


@pytest.mark.parametrize("mutate, match", [
    (lambda h: h["arrays"][0].__setitem__(1, "object"), "dtype 'object'"),
    (lambda h: h["arrays"][0].__setitem__(3, 10 ** 6), "spans bytes"),
    (lambda h: h["arrays"][0].__setitem__(2, [5]), "does not hold"),
    (lambda h: h["arrays"].__setitem__(0, "junk"), "malformed array entry"),
])
def test_wire_rejects_malformed_headers(mutate, match):
    msg = wire.encode({}, {"w": np.zeros(4, np.float32)})
    hlen = int.from_bytes(msg[:4], "little")
    header = msgpack.unpackb(msg[4:4 + hlen])
    mutate(header)
    head = msgpack.packb(header)
    with pytest.raises(wire.WireError, match=match):
        wire.decode(len(head).to_bytes(4, "little") + head + msg[4 + hlen:])


def test_wire_rejects_garbage_and_unsendable_dtypes():
    with pytest.raises(wire.WireError, match="shorter than"):
        wire.decode(b"\x01")
    with pytest.raises(wire.WireError, match="runs past the end"):
        wire.decode(b"\xff\x00\x00\x00abc")
    with pytest.raises(wire.WireError, match="cannot be sent"):
        wire.encode({}, {"o": np.array([object()])})
