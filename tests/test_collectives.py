"""Tests for jaxdist.core.collectives: every implementation agrees with NumPy and with XLA's psum."""

import enum
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxdist.core.collectives import IMPLEMENTATIONS, _count_collectives, reduce_tree

AUTO = jax.sharding.AxisType.Auto
PACK_BYTES = 64  # packs the leaves under 64 bytes; the 1000-element leaves travel alone


def _mesh(shape, names):
    devices = jax.devices()[: math.prod(shape)]
    return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape), devices=devices)


def _base_tree():
    """Leaves of every kind under test; replica r reduces `_replica_value(leaf, r)`."""
    rng = np.random.default_rng(0)

    def small_ints(size, dtype):  # |x| <= 2 keeps every bf16 sum over <= 8 replicas exact
        return rng.integers(-2, 3, size).astype(dtype)

    return {
        "scalar": np.float32(1.5),
        "f32": [rng.standard_normal(size).astype(np.float32) for size in (1, 3, 7, (10, 100))],
        "bf16": {"nested": {"v7": small_ints(7, jnp.bfloat16)}, "v1000": small_ints(1000, jnp.bfloat16)},
        "i32": (
            np.int32(-7),
            rng.integers(-1000, 1000, 3).astype(np.int32),
            rng.integers(-1000, 1000, (10, 100)).astype(np.int32),
        ),
    }


def _replica_value(x, r):
    # Differs on every replica, so a reduction that pairs up the wrong replicas shows.
    return x * (r + 1) + r


def _floats(tree):
    return {k: v for k, v in tree.items() if k != "i32"}


def _reference(tree, n, op):
    def ref(x):
        total = sum(_replica_value(np.asarray(x, np.float64), r) for r in range(n))
        return total / n if op == "mean" else total

    return jax.tree.map(ref, tree)


def _reduce_all_variants(implementation, mesh_shape, names):
    """Compiles one program per (implementation, mesh) covering every variant, to keep compiles few."""
    base = _base_tree()

    def per_replica():
        r = lax.axis_index(names)
        tree = jax.tree.map(lambda x: _replica_value(jnp.asarray(x), r.astype(jnp.asarray(x).dtype)), base)

        def reduce(t, op, **kw):
            return reduce_tree(t, op, axes=names, implementation=implementation, **kw)

        out = {
            "sum": reduce(tree, "sum"),
            "mean": reduce(_floats(tree), "mean"),
            "sum_bf16": reduce(tree, "sum", compress="bf16"),
            "sum_packed": reduce(tree, "sum", pack_bytes=PACK_BYTES),
            "mean_packed_bf16": reduce(_floats(tree), "mean", pack_bytes=PACK_BYTES, compress="bf16"),
            "psum": reduce_tree(tree, "sum", axes=names, implementation="xla"),
        }
        return jax.tree.map(lambda x: x[None], out)  # one row per replica, to check they agree

    mesh = _mesh(mesh_shape, names)
    f = jax.jit(jax.shard_map(per_replica, mesh=mesh, in_specs=(), out_specs=jax.P(names), check_vma=False))
    return base, jax.device_get(f())


def _check(actual, expected, like, n, *, compressed=False):
    for a, e, x in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), jax.tree.leaves(like),
                       strict=True):
        x = np.asarray(x)
        assert a.dtype == x.dtype and a.shape == (n,) + x.shape, (a.dtype, a.shape, x.dtype, x.shape)
        for row in a[1:]:  # every replica holds the same bits
            np.testing.assert_array_equal(row, a[0])
        got = np.asarray(a[0], np.float64)
        if x.dtype != np.float32:  # integers, and bf16 holding small integers, sum exactly
            np.testing.assert_array_equal(got, e)
        elif compressed:  # bf16 keeps 8 significant bits: each of the <= n roundings costs 2**-8
            np.testing.assert_allclose(got, e, rtol=0, atol=n * 2.0**-8 * np.abs(e).max() + 1e-6)
            # The sum travelled as bf16 (and n is a power of 2, so the mean is exact in bf16 too).
            np.testing.assert_array_equal(a[0].astype(jnp.bfloat16).astype(np.float32), a[0])
        else:
            np.testing.assert_allclose(got, e, rtol=1e-5, atol=1e-5 * n)


_CASES = [(impl, (n,), ("data",)) for impl in ("xla", "ring", "one_device") for n in (1, 2, 4, 8)] + [
    ("hierarchical", (1, 4), ("host", "local")),
    ("hierarchical", (2, 2), ("host", "local")),
    ("hierarchical", (2, 4), ("host", "local")),
    ("ring", (2, 4), ("host", "local")),
    ("one_device", (2, 4), ("host", "local")),
]


@pytest.mark.parametrize(("implementation", "mesh_shape", "names"), _CASES, ids=lambda v: str(v))
def test_matches_numpy_and_psum(implementation, mesh_shape, names):
    base, out = _reduce_all_variants(implementation, mesh_shape, names)
    n = math.prod(mesh_shape)
    sums, means, floats = _reference(base, n, "sum"), _reference(_floats(base), n, "mean"), _floats(base)
    _check(out["sum"], sums, base, n)
    _check(out["psum"], sums, base, n)
    _check(out["sum_packed"], sums, base, n)
    _check(out["mean"], means, floats, n)
    _check(out["sum_bf16"], sums, base, n, compressed=True)
    _check(out["mean_packed_bf16"], means, floats, n, compressed=True)
    for got, psum in zip(jax.tree.leaves(out["sum"]["i32"]), jax.tree.leaves(out["psum"]["i32"]),
                         strict=True):
        np.testing.assert_array_equal(got, psum)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_packing_cuts_collectives_and_keeps_values(implementation):
    names = ("host", "local")
    mesh = _mesh((2, 4), names)
    tree = [jnp.full((3,), i, jnp.float32) for i in range(50)]  # integer values: sums are exact

    def program(pack_bytes):
        def per_replica(t):
            r = lax.axis_index(names).astype(jnp.float32)
            t = [x * (r + 1) for x in t]
            out = reduce_tree(t, "sum", axes=names, implementation=implementation, pack_bytes=pack_bytes)
            return [x[None] for x in out]

        return jax.jit(jax.shard_map(per_replica, mesh=mesh, in_specs=jax.P(), out_specs=jax.P(names),
                                     check_vma=False))

    results, emitted, compiled = {}, {}, {}
    for pack_bytes in (None, 4096):
        f = program(pack_bytes)
        lowered = f.lower(tree)
        emitted[pack_bytes] = sum(_count_collectives(lowered.as_text(dialect="hlo")).values())
        compiled[pack_bytes] = sum(_count_collectives(lowered.compile().as_text()).values())
        results[pack_bytes] = jax.device_get(f(tree))
    for unpacked, packed in zip(results[None], results[4096], strict=True):
        np.testing.assert_array_equal(packed, unpacked)
    np.testing.assert_array_equal(results[4096][49], np.full((8, 3), 49 * 36.0))
    assert emitted[4096] < emitted[None], emitted
    if implementation == "xla":
        # XLA's all-reduce combiner already merges the 50 psums, so the compiled counts tie.
        assert compiled[4096] <= compiled[None], compiled
    else:
        assert compiled[4096] < compiled[None], compiled


def _trace(fn, names=("data",)):
    """Traces `fn` under a one-device shard_map: argument errors surface without a compile."""
    mesh = _mesh((1,) * len(names), names)
    return jax.make_jaxpr(jax.shard_map(fn, mesh=mesh, in_specs=(), out_specs=jax.P(), check_vma=False))()


_X = {"w": jnp.ones(3)}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"op": "max"}, ValueError, r"op must be one of \('sum', 'mean'\), got 'max'"),
        ({"implementation": "nccl"}, ValueError,
         r"implementation must be one of \('xla', 'ring'.*got 'nccl'"),
        ({"compress": "fp8"}, ValueError, r"compress must be one of \('bf16',\), got 'fp8'"),
        ({"pack_bytes": 0}, ValueError, r"pack_bytes must be a positive int .* got 0"),
        ({"pack_bytes": 1.5}, ValueError, r"pack_bytes must be a positive int .* got 1.5"),
        ({"pack_bytes": True}, ValueError, r"pack_bytes must be a positive int .* got True"),
        ({"axes": "data"}, TypeError, r"axes must be a non-empty tuple of mesh axis names.*got 'data'"),
        ({"axes": ()}, TypeError, r"axes must be a non-empty tuple"),
        ({"axes": ("data", "data")}, TypeError, r"axes must be distinct mesh axis names"),
        ({"axes": ("batch",)}, ValueError, r"must run inside jax.shard_map over a mesh that has these axes"),
        ({"implementation": "hierarchical"}, ValueError,
         r"needs axes=\(host_axis, local_axis\).*2-D \(host, local\) mesh"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_bad_arguments_raise_clear_errors(kwargs, error, match):
    kwargs = {"op": "sum", "axes": ("data",), **kwargs}
    with pytest.raises(error, match=match):
        _trace(lambda: reduce_tree(_X, **kwargs))


@pytest.mark.parametrize(
    ("tree", "op", "match"),
    [
        ({"count": jnp.int32(3)}, "mean",
         r"op='mean' on integer leaf \['count'\] \(dtype int32\) would truncate"),
        ([jnp.ones(2, bool)], "sum", r"leaf \[0\] has dtype bool.*cast it to int32"),
    ],
)
def test_bad_leaves_raise_clear_errors(tree, op, match):
    with pytest.raises(TypeError, match=match):
        _trace(lambda: reduce_tree(tree, op, axes=("data",)))


def test_outside_shard_map_raises():
    with pytest.raises(ValueError, match=r"must run inside jax.shard_map"):
        reduce_tree(_X, "sum", axes=("data",))


def test_op_accepts_str_enum_and_any_case():
    class ReduceOp(str, enum.Enum):
        SUM = "SUM"

    def per_replica():
        total = reduce_tree(_X, ReduceOp.SUM, axes=("data",))["w"]
        return total, reduce_tree(_X, "MEAN", axes=("data",))["w"]

    f = jax.shard_map(per_replica, mesh=_mesh((2,), ("data",)), in_specs=(), out_specs=jax.P(),
                      check_vma=False)
    total, mean = jax.jit(f)()
    np.testing.assert_array_equal(total, [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(mean, [1.0, 1.0, 1.0])


def test_empty_leaves_and_empty_tree():
    out = _trace(lambda: reduce_tree({"e": jnp.zeros((0, 3)), "none": None}, "mean", axes=("data",)))
    assert out.out_avals[0].shape == (0, 3)
    assert _trace(lambda: reduce_tree({}, "sum", axes=("data",), implementation="ring")).out_avals == []
