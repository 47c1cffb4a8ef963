"""Placing a parameter tree's leaves on parameter-server shards.

Leaves are named by their ``jax.tree_util.keystr`` path. A large leaf can be partitioned along its
first axis into pieces stored on different shards (``"<path>#<i>"``); workers see whole leaves
again through :meth:`Placement.assemble`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["Piece", "Placement", "plan", "flatten", "unflatten", "METHODS"]

METHODS = ("greedy", "round_robin")


def flatten(tree: Any) -> tuple[dict[str, Any], Any]:
    """Flattens a pytree into ``{keystr path: leaf}`` (in tree order) and its treedef.

    >>> flat, treedef = flatten({"b": 1, "a": {"w": 2}})
    >>> list(flat)
    ["['a']['w']", "['b']"]
    """
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(p): leaf for p, leaf in with_path}, treedef


def unflatten(treedef: Any, flat: Mapping[str, Any]) -> Any:
    """Inverse of :func:`flatten`; ``flat`` must be in tree order, as ``flatten`` and
    :meth:`Placement.assemble` return it."""
    if len(flat) != treedef.num_leaves:
        raise ValueError(f"got {len(flat)} leaves for a tree of {treedef.num_leaves}")
    return jax.tree_util.tree_unflatten(treedef, list(flat.values()))


@dataclasses.dataclass(frozen=True)
class Piece:
    """One array stored on one shard: a whole leaf, or rows ``[start, stop)`` of it."""

    key: str
    leaf: str
    shard: int
    start: int | None
    stop: int | None
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where every leaf (or leaf piece) of a parameter tree lives.

    Attributes:
      num_shards: number of parameter servers.
      method: ``"greedy"`` or ``"round_robin"``.
      leaves: ``{path: (shape, dtype name)}`` of the whole leaves, in tree order.
      pieces: every stored array.
    """

    num_shards: int
    method: str
    leaves: Mapping[str, tuple[tuple[int, ...], str]]
    pieces: tuple[Piece, ...]

    def shard_pieces(self, shard: int) -> tuple[Piece, ...]:
        return tuple(p for p in self.pieces if p.shard == shard)

    def loads(self) -> list[int]:
        """Bytes stored on each shard."""
        out = [0] * self.num_shards
        for p in self.pieces:
            out[p.shard] += p.nbytes
        return out

    def split(self, flat: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
        """Splits ``{path: array}`` into one ``{key: array}`` per shard (row slices are views)."""
        missing = set(self.leaves) - set(flat)
        if missing:
            raise KeyError(f"leaves {sorted(missing)} are missing from the tree to split; "
                           f"the placement was planned for {list(self.leaves)}")
        out: list[dict[str, np.ndarray]] = [{} for _ in range(self.num_shards)]
        for p in self.pieces:
            arr = np.asarray(flat[p.leaf])
            out[p.shard][p.key] = arr if p.start is None else arr[p.start:p.stop]
        return out

    def assemble(self, per_shard: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Inverse of :meth:`split`: whole leaves from per-shard pieces, in tree order."""
        parts: dict[str, list[np.ndarray]] = {leaf: [] for leaf in self.leaves}
        for p in self.pieces:  # pieces of a leaf are stored in row order
            parts[p.leaf].append(per_shard[p.shard][p.key])
        # A partitioned leaf always has >= 2 pieces, so a single piece is the whole leaf.
        return {leaf: ps[0] if len(ps) == 1 else np.concatenate(ps) for leaf, ps in parts.items()}

    def report(self) -> str:
        """A table of leaf -> shard (rows for partitioned leaves) and each shard's load."""
        lines = [f"placement: {self.method}, {self.num_shards} shard(s)"]
        for p in self.pieces:
            rows = "" if p.start is None else f" rows [{p.start}:{p.stop})"
            lines.append(f"  {p.leaf}{rows} {p.dtype}{list(p.shape)} -> ps{p.shard} "
                         f"({p.nbytes} B)")
        for i, load in enumerate(self.loads()):
            lines.append(f"  ps{i}: {load} B in {len(self.shard_pieces(i))} array(s)")
        return "\n".join(lines)


def _row_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    edges = np.linspace(0, rows, parts + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def plan(tree: Any, num_shards: int, *, method: str = "greedy",
         max_shard_bytes: int | None = None, num_partitions: int | None = None) -> Placement:
    """Plans where each leaf of ``tree`` lives across ``num_shards`` parameter servers.

    Args:
      tree: pytree of arrays (or ``jax.ShapeDtypeStruct`` values).
      num_shards: number of parameter servers (>= 1).
      method: ``"round_robin"`` (leaves in tree order onto shards 0, 1, ...) or ``"greedy"``
        (largest piece first onto the least-loaded shard by bytes; ties go to the lower index).
      max_shard_bytes: leaves larger than this are partitioned along their first axis into
        ``ceil(nbytes / max_shard_bytes)`` pieces (or ``num_partitions`` when given).
      num_partitions: partition leaves into this many row blocks (all leaves with a first axis
        when ``max_shard_bytes`` is None, else only those larger than it).

    Returns:
      A :class:`Placement`.

    Raises:
      ValueError: on an unknown method or non-positive sizes.

    >>> import numpy as np
    >>> tree = {"a": np.zeros(10, np.float32), "b": np.zeros(30, np.float32),
    ...         "c": np.zeros(20, np.float32)}
    >>> [p.shard for p in plan(tree, 2).pieces]  # b (120 B) -> 0, c (80 B) -> 1, a (40 B) -> 1
    [1, 0, 1]
    >>> [p.shard for p in plan(tree, 2, method="round_robin").pieces]
    [0, 1, 0]
    """
    if method not in METHODS:
        raise ValueError(f"placement method {method!r} is unknown; expected one of {METHODS}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    for name, v in (("max_shard_bytes", max_shard_bytes), ("num_partitions", num_partitions)):
        if v is not None:  # an integer: NaN or 2.5 would pass a plain `v < 1` check
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1 or None, got {v!r}")
    flat, _ = flatten(tree)
    leaves = {k: (tuple(int(d) for d in np.shape(v)), np.dtype(v.dtype).name)
              for k, v in flat.items()}
    pending: list[Piece] = []
    for leaf, (shape, dtype) in leaves.items():
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        parts = 1
        if shape and (max_shard_bytes is None or nbytes > max_shard_bytes):
            if num_partitions is not None:
                parts = num_partitions
            elif max_shard_bytes is not None:
                parts = -(-nbytes // max_shard_bytes)
        parts = max(1, min(parts, shape[0] if shape else 1))
        if parts == 1:
            pending.append(Piece(leaf, leaf, -1, None, None, shape, dtype))
            continue
        for i, (a, b) in enumerate(_row_bounds(shape[0], parts)):
            pending.append(Piece(f"{leaf}#{i}", leaf, -1, a, b, (b - a, *shape[1:]), dtype))

    loads = [0] * num_shards
    shard_of: dict[str, int] = {}
    if method == "round_robin":
        for i, p in enumerate(pending):
            shard_of[p.key] = i % num_shards
    else:
        held: dict[str, set[int]] = {}
        for p in sorted(pending, key=lambda p: -p.nbytes):  # stable: ties keep tree order
            taken = held.setdefault(p.leaf, set())
            free = [s for s in range(num_shards) if s not in taken] or list(range(num_shards))
            shard = min(free, key=lambda s: (loads[s], s))
            shard_of[p.key] = shard
            loads[shard] += p.nbytes
            taken.add(shard)
    pieces = tuple(dataclasses.replace(p, shard=shard_of[p.key]) for p in pending)
    return Placement(num_shards, method, leaves, pieces)
