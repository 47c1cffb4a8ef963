"""Layout-independent digests of a pytree of global arrays, for checkpoint integrity checks.

A leaf's digest is two 32-bit lanes, each ``sum_i word_i * h_lane(i) mod 2**32`` over the leaf's
32-bit words (every element widened or split into ``uint32``), where ``i`` is the word's row-major
position in the *global* array and ``h_lane`` an odd hash of it. Integer addition is associative
and the position is global, so the value does not depend on how the array is sharded, on how many
devices or processes hold it, or on the order XLA reduces in: a state saved by 2 processes x 4
devices and restored on 1 device digests the same. Because every multiplier is odd, changing any
single word (every single-bit flip) always changes lane 0; other corruptions are missed with
probability about 2**-64.

It runs as one jitted reduction per group of leaves that live on the same devices; on several
processes it is a collective (XLA all-reduces the partial sums), so every process must call it,
as every process calls ``CheckpointManager.save`` and ``restore``. A fully replicated leaf is
first resharded over its mesh (a local slice, no communication), so each device hashes only its
part instead of all of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdist.core import PyTree

_SALTS = (0x9E3779B9, 0x85EBCA77)


def _fmix32(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: a cheap bijective mix of every input bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The leaf's bits as ``uint32`` (an extra trailing axis for 64-bit and complex dtypes)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if jnp.iscomplexobj(x):
        return jnp.stack([_words(jnp.real(x)), _words(jnp.imag(x))], axis=-1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    bits = jax.dtypes.itemsize_bits(x.dtype)
    if bits == 32:
        return lax.bitcast_convert_type(x, jnp.uint32)
    if bits in (8, 16):
        return lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}")).astype(jnp.uint32)
    if bits == 64:
        return lax.bitcast_convert_type(x, jnp.uint32)  # shape (..., 2)
    # Sub-byte types (int4, float4...): widening is exact and keeps every value distinct.
    wide = jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else jnp.int32
    return lax.bitcast_convert_type(x.astype(wide), jnp.uint32)


def _leaf_digest(x: jax.Array, spread: jax.sharding.NamedSharding | None) -> jax.Array:
    w = _words(x)
    if spread is not None:  # replicated: reshape is free, and the constraint is a local slice
        w = lax.with_sharding_constraint(w.reshape(-1), spread)
    index = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for d in range(w.ndim - 1, -1, -1):
        step = jnp.uint32(stride & 0xFFFFFFFF)
        index = index + lax.broadcasted_iota(jnp.uint32, w.shape, d) * step
        stride *= w.shape[d]
    lanes = [jnp.sum(w * (_fmix32(index ^ jnp.uint32(s)) | jnp.uint32(1)), dtype=jnp.uint32)
             for s in _SALTS]
    return jnp.stack(lanes)


def _digest_group(leaves, spreads):
    return [_leaf_digest(x, s) for x, s in zip(leaves, spreads, strict=True)]


_digest_group_jit = jax.jit(_digest_group, static_argnums=1)


def _spread(x) -> jax.sharding.NamedSharding | None:
    s = getattr(x, "sharding", None)
    if (isinstance(s, jax.sharding.NamedSharding) and s.is_fully_replicated
            and s.mesh.size > 1 and np.size(x) >= s.mesh.size):
        return jax.sharding.NamedSharding(s.mesh, jax.P(tuple(s.mesh.axis_names)))
    return None


def _in_device_memory(x: jax.Array) -> jax.Array:
    """``x`` itself, or a copy in device memory when it lives in host memory (as
    ``CentralStorageStrategy`` keeps state): XLA computes on device memory only."""
    s = x.sharding
    kind = s.memory_kind
    device = next(iter(s.device_set))  # (jax.Device: its stub lacks default_memory)
    default = device.default_memory().kind  # type: ignore[attr-defined]
    return x if kind is None or kind == default else jax.device_put(x, s.with_memory_kind(default))


def dispatch_digests(tree: PyTree) -> dict[str, jax.Array]:
    """Starts computing the digests of ``tree``'s leaves; returns without waiting for them.

    The computation holds its inputs, so the caller may donate or delete ``tree`` right after.
    Pass the result to ``materialize``. A collective: every process calls it with its tree.
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    groups: dict[object, list[int]] = {}
    leaves = []
    for i, (_, leaf) in enumerate(flat):
        if not isinstance(leaf, jax.Array):
            leaf = jnp.asarray(leaf)
            key: object = None  # uncommitted: runs on the default device
        else:
            leaf = _in_device_memory(leaf)
            key = frozenset(leaf.sharding.device_set)
        leaves.append(leaf)
        groups.setdefault(key, []).append(i)
    out: dict[str, jax.Array] = {}
    for members in groups.values():
        group = [leaves[i] for i in members]
        results = _digest_group_jit(group, tuple(_spread(x) for x in group))
        for i, r in zip(members, results, strict=True):
            out[path_name(flat[i][0])] = r
    return out


def path_name(path) -> str:
    """A leaf's path as ``params/Dense_0/bias``, whatever the containers along it.

    ``keystr`` would write a dataclass field as ``.params`` and a dict key as ``['params']``; a
    state saved as a flax ``TrainState`` and restored without a template (as nested dicts) must
    still find its digests.
    """
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def materialize(pending: dict[str, jax.Array]) -> dict[str, list[int]]:
    """Waits for ``dispatch_digests``'s results; ``{path_name(path): [lane0, lane1]}`` as ints."""
    return {k: [int(v) for v in np.asarray(r.addressable_data(0))] for k, r in pending.items()}


def tree_digests(tree: PyTree) -> dict[str, list[int]]:
    """``{path_name(path): [lane0, lane1]}`` for every array leaf of ``tree`` (collective).

    Args:
      tree: a pytree of ``jax.Array`` (any sharding or memory kind, any number of processes),
        numpy arrays or scalars.

    Returns:
      The digests as plain ints, the same on every process.

    >>> import jax.numpy as jnp
    >>> a = tree_digests({"w": jnp.arange(4.0)})
    >>> a == tree_digests({"w": jnp.arange(4.0)}), a == tree_digests({"w": jnp.arange(4.0) + 1})
    (True, False)
    """
    return materialize(dispatch_digests(tree))
