"""The Strategy protocol and the mesh-backed implementation the concrete strategies share.

A strategy is a small immutable value naming *where* state lives and *how* replicas agree. All the
work happens in the functions it returns (``step``) or runs (``run``); building one touches no device.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxdist.core import PyTree, per_replica
from jaxdist.core import mesh as mesh_lib
from jaxdist.core.layout import Layout
from jaxdist.core.replica import ReduceOp
from jaxdist.core.step import DistributedStep
from jaxdist.core.values import has_per_replica
from jaxdist.input.context import DatasetFromFunction
from jaxdist.input.dataset import DistributedDataset
from jaxdist.input.local import AutoShardPolicy


class Strategy(abc.ABC):
    """What every distribution strategy offers (mirrors ``tf.distribute.Strategy``)."""

    @property
    @abc.abstractmethod
    def num_replicas_in_sync(self) -> int:
        """Replicas that take part in every step."""

    @property
    @abc.abstractmethod
    def mesh(self) -> Mesh | None:
        """The device mesh the strategy runs on."""

    @abc.abstractmethod
    def put(self, tree: PyTree) -> PyTree:
        """Places state the strategy's way (tf: creating variables under ``scope()``)."""

    @abc.abstractmethod
    def distribute(self, data: Any, global_batch_size: int, *, shuffle: bool = False, seed: int = 0,
                   drop_remainder: bool = False):
        """Turns a dataset into a stream of globally-sharded ``jaxdist.Batch`` values."""

    @abc.abstractmethod
    def step(self, fn: Callable, /, *, donate: bool = True) -> Callable:
        """Compiles a global-view ``fn(state, batch) -> (state, metrics)``."""

    @abc.abstractmethod
    def run(self, fn: Callable, /, args: tuple = (), kwargs: dict | None = None) -> PyTree:
        """Runs ``fn`` once per replica; returns its output structure of ``PerReplica`` values."""

    @abc.abstractmethod
    def reduce(self, op: ReduceOp | str, value: Any, axis: int | None = None) -> jax.Array:
        """Combines a per-replica value across replicas."""

    @abc.abstractmethod
    def local_results(self, value: Any) -> tuple:
        """This process's per-replica values, in replica order."""

    # --- tf.distribute's own spellings (migration code runs unchanged) -------------------------
    def experimental_local_results(self, value: Any) -> tuple:
        """tf.distribute's name for :meth:`local_results` (the same method).

        >>> import jax, jaxdist
        >>> s = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> len(s.experimental_local_results(s.run(lambda: jaxdist.replica_id())))
        2
        """
        return self.local_results(value)

    def experimental_distribute_dataset(self, dataset: Any, global_batch_size: int | None = None,
                                        /, **kwargs) -> Any:
        """tf.distribute's name for :meth:`distribute`, which also takes the global batch size.

        tf batches a ``tf.data`` dataset before distributing it (``ds.batch(128)``); jaxdist
        batches for you, padding the last batch with a mask, so the arrays and the global batch
        size go in together: ``strategy.experimental_distribute_dataset((x, y), 128)``.

        Args:
          dataset: what :meth:`distribute` takes (a tuple / dict of arrays, or an iterable of
            batches).
          global_batch_size: examples per step across all replicas.
          **kwargs: :meth:`distribute`'s options (``shuffle``, ``seed``, ``drop_remainder``, ...).

        Returns:
          What :meth:`distribute` returns.

        Raises:
          TypeError: no ``global_batch_size`` (the message shows the call to write).

        >>> import jax, jaxdist, numpy as np
        >>> s = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> [int(b.mask.sum()) for b in s.experimental_distribute_dataset((np.arange(6),), 4)]
        [4, 2]
        """
        if global_batch_size is None:
            raise TypeError(
                "experimental_distribute_dataset(dataset, global_batch_size): jaxdist batches the "
                "data itself (padding the last batch with a mask) instead of taking a batched "
                "tf.data dataset, so pass the unbatched arrays and the global batch size, e.g. "
                "strategy.experimental_distribute_dataset((x, y), 128) for tf's "
                "strategy.experimental_distribute_dataset(dataset.batch(128))")
        return self.distribute(dataset, global_batch_size, **kwargs)

    def scope(self) -> contextlib.AbstractContextManager:
        """tf's ``with strategy.scope():``: runs the block with this strategy's mesh as JAX's
        current mesh (``jax.set_mesh``); yields the strategy.

        What it does: inside the block ``jax.sharding.get_abstract_mesh()`` is the strategy's
        mesh, so shardings named by axis (``jax.P("data")``) resolve against it, and arrays that
        JAX computes there without a placement of their own (a model's ``init``, ``jnp.ones``)
        come out replicated over the strategy's devices. ``run``, ``reduce``, ``gather``,
        ``local_results``, ``put``, ``distribute`` and ``fit`` work inside it as outside. A
        strategy without a mesh (``ParameterServerStrategy``) makes it a no-op.

        What it does not: tf creates *variables* under ``scope()`` and places each the strategy's
        way (mirrored on every replica, or on a parameter server). JAX has no variables: state is
        a value you create anywhere and place with ``strategy.put(state)`` (a compiled step or
        ``strategy.run`` places what it is given, and ``fit`` does it for you); arrays that
        already live somewhere are not moved by the block, and leaving it changes no array. An
        array on one device (each entry of ``local_results``) can be read inside it (``float``,
        ``np.asarray``) but not computed with (JAX refuses to mix it with the mesh): do that
        after the block. There is no ``tf.distribute.get_strategy()``: pass the strategy.

        Returns:
          A context manager (re-entrant; it nests with your own ``jax.set_mesh``).

        >>> import jax, jaxdist
        >>> s = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> with s.scope() as scoped:
        ...     state = s.put({"w": 1.0})          # tf: variables created in scope
        ...     print(scoped is s, dict(jax.sharding.get_abstract_mesh().shape))
        True {'data': 2}
        """
        return mesh_scope(self, self.mesh)


@contextlib.contextmanager
def mesh_scope(strategy: Any, mesh: Mesh | None) -> Iterator[Any]:
    """``strategy.scope()``'s body: yields ``strategy`` with ``mesh`` set (nothing set for None)."""
    if mesh is None:
        yield strategy
        return
    with jax.set_mesh(mesh):
        yield strategy


def check_global_batch_size(global_batch_size: Any, what: str = "strategy.distribute") -> None:
    """Refuses tf's and Keras's ``distribute(x, y)`` habit (two arrays where one tuple goes) with
    the call to write; other bad sizes are left to the dataset's own check."""
    if np.ndim(global_batch_size) > 0 or isinstance(global_batch_size, (list, tuple)):
        shape = tuple(np.shape(global_batch_size))
        raise TypeError(
            f"{what}(data, global_batch_size) got an array of shape {shape} as global_batch_size: "
            f"the dataset is one argument, so pass features and labels as one tuple, "
            f"{what}((x, y), 128), not {what}(x, y, ...)")


class MeshStrategy(Strategy):
    """A strategy whose replicas are the devices of a mesh, state replicated, batch on the data axes.

    Subclasses are frozen dataclasses that define ``_build_mesh()``; everything else derives from
    the ``layout`` (built lazily, ``functools.cached_property``, so constructing a strategy does no
    device work). The work itself is done by ``jaxdist.input``, ``jaxdist.core.step`` and
    ``jaxdist.core.per_replica``, which take the layout.
    """

    # --- what subclasses provide --------------------------------------------------------------
    @abc.abstractmethod
    def _build_mesh(self) -> Mesh: ...

    _implementation: str = "xla"
    _pack_bytes: int | None = None
    _compress: str | None = None

    def _data_axes(self, mesh: Mesh) -> tuple[str, ...]:
        return tuple(mesh.axis_names)

    def _layout_hooks(self, mesh: Mesh, data_axes: tuple[str, ...]) -> dict[str, Any]:
        """Where state lives between steps and how a step is adapted to it (mirrored: defaults)."""
        return {}

    # --- derived --------------------------------------------------------------------------------
    @functools.cached_property
    def layout(self) -> Layout:
        """Where this strategy keeps state and batches: mesh, data axes, shardings, step adapter."""
        user = getattr(self, "_user_mesh", None)
        if user is not None:  # the user's own mesh, run on its Auto twin (same devices, no copies)
            mesh = mesh_lib.with_auto_axes(user)
            data_axes = self.data_axes  # type: ignore[attr-defined]  # (UserMeshStrategy's, checked and put in mesh order at construction)
        else:
            mesh = self._build_mesh()
            data_axes = self._data_axes(mesh)
        return Layout(mesh, data_axes, implementation=self._implementation,
                      pack_bytes=self._pack_bytes, compress=self._compress,
                      **self._layout_hooks(mesh, data_axes))

    @property
    def mesh(self) -> Mesh:
        return self.layout.mesh

    @property
    def num_replicas_in_sync(self) -> int:
        return self.layout.num_replicas

    @functools.cached_property
    def _run_cache(self) -> per_replica.RunCache:
        return per_replica.RunCache()

    def put(self, tree: PyTree) -> PyTree:
        """Places every leaf of ``tree`` the strategy's way (a copy on each replica's device).

        Leaves already placed that way are returned as they are (no copy), and a train step then
        donates them; any other leaf is copied, so the caller's own arrays stay valid. Per-replica
        values the replicas agree on (a state from ``strategy.run``) become one mirrored value.

        >>> import jax, jaxdist
        >>> s = jaxdist.OneDeviceStrategy(jax.devices()[0])
        >>> s.put({"w": 1.0})["w"].sharding.is_fully_replicated
        True
        """
        layout = self.layout
        if layout.is_placed(tree):
            return tree
        if has_per_replica(tree):
            tree = self.to_mirrored(tree)
        return layout.put_state(tree)

    def distribute(self, data: Any, global_batch_size: int, *, shuffle: bool = False, seed: int = 0,
                   drop_remainder: bool = False, prefetch: int | None = None,
                   auto_shard_policy: AutoShardPolicy | str = AutoShardPolicy.AUTO,
                   sync_timeout_s: float = 300.0, on_device: bool | None = None):
        """Shards ``data`` into global batches laid out on the replicas.

        Create the dataset once and iterate it once per epoch: each new iteration is the next epoch,
        reshuffled (when ``shuffle``) in an order that depends only on ``(seed, epoch)``.

        Args:
          data: an in-memory dataset (a tuple / dict / pytree of numpy arrays with a common leading
            example axis), or an iterable of such batches (a generator function, a grain
            ``MapDataset.batch(...)``), each with at most ``global_batch_size`` examples.
            In-memory arrays are taken as they are at this call, as ``tf.data`` takes them:
            writable numpy arrays are copied (the host holds the dataset twice), so changing
            them afterwards changes no batch, on the host or the devices alike; read-only arrays
            (``a.setflags(write=False)``, ``np.load(..., mmap_mode="r")``) and JAX arrays are
            used as they are, without a copy.
          global_batch_size: examples per step across all replicas; must divide evenly over them.
          shuffle: reshuffle in-memory data every epoch, deterministically from ``seed``.
          seed: shuffling seed.
          drop_remainder: drop a final partial batch instead of padding it (padded rows carry
            ``mask == False``, so no example is dropped or counted twice either way).
          prefetch: batches prepared ahead on a background thread (bounded; for in-memory arrays,
            chunks of up to 32 batches, see the input guide); ``0`` makes them
            on the loop's thread when they are asked for. Default: ``0`` for in-memory arrays (a
            gather and a transfer per chunk of batches, cheaper than a thread's hand-over), ``2``
            for an iterable, whose batches may take time to make.
          auto_shard_policy: how several processes split an iterable source
            (``jaxdist.AutoShardPolicy``: ``AUTO`` = ``FILE`` for a source with ``shard(index,
            count)`` such as ``jaxdist.FileSource``, else ``DATA``; ``OFF``); tf's meanings.
          sync_timeout_s: with ``FILE`` / ``OFF`` across processes, how long a step waits for the
            other processes to say whether their pipelines still have data.
          on_device: in-memory arrays only. ``None`` (default): when they fit a budget (a quarter
            of a device's memory, ``jaxdist.input.dataset.ON_DEVICE_FRACTION``; on CPU devices,
            1 GiB for all local copies, ``ON_DEVICE_HOST_BYTES``), they are placed on the devices
            once, a full copy on each local device, and every batch is gathered there from indices
            the host sends: the same batches, order, padding and masks as from the host. Checked
            again at the first batch against the room the devices have left (beside the state
            placed by then); arrays that do not fit stay on the host, as one line says.
            ``True``: always (a ``MemoryError`` of one line where they do not fit); ``False``:
            gather batches on the host and send them each epoch.

        Returns:
          A ``jaxdist.DistributedDataset``; iterating it yields ``jaxdist.Batch(data, mask)``.

        Raises:
          ValueError: the batch size does not divide over the replicas, leaves are not arrays,
            their leading dimensions differ, a list of arrays (``[x, y]``: pass a tuple), or a
            policy that does not fit the source.
          TypeError: an array as ``global_batch_size`` (``distribute(x, y)``: pass ``(x, y)``).

        >>> import jax, jaxdist, numpy as np
        >>> s = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> [int(b.mask.sum()) for b in s.distribute((np.arange(10),), 4)]
        [4, 4, 2]
        """
        check_global_batch_size(global_batch_size)
        return DistributedDataset(self, data, global_batch_size, shuffle=shuffle, seed=seed,
                                  drop_remainder=drop_remainder, prefetch=prefetch,
                                  auto_shard_policy=auto_shard_policy,
                                  sync_timeout_s=sync_timeout_s, on_device=on_device)

    def distribute_datasets_from_function(self, fn: Callable, /, *,
                                          global_batch_size: int | None = None, prefetch: int = 2,
                                          sync_timeout_s: float = 300.0) -> DatasetFromFunction:
        """Global batches from a pipeline each process builds itself (tf's method of this name).

        Every process calls ``fn(ctx)`` once with its ``jaxdist.InputContext`` and reads only what
        it returns: a dataset batched with ``ctx.get_per_replica_batch_size(global_batch_size)``
        holding this process's share (e.g. a grain ``MapDataset`` sliced by
        ``ctx.input_pipeline_id``). Each step takes one batch per local replica. Short or missing
        batches are padded with ``mask`` False, and processes whose pipelines end at different steps
        keep stepping (with padding) until every pipeline has ended, so no example is lost.

        Args:
          fn: ``fn(jaxdist.InputContext) -> iterable of per-replica batches``; called once (again
            for later epochs only when it returns a one-shot iterator).
          global_batch_size: fixes the per-replica batch size; by default read from the first batch
            (and checked to agree across processes).
          prefetch: steps prepared ahead on a background thread (bounded).
          sync_timeout_s: across processes, how long a step waits for the others to report.

        Returns:
          A ``jaxdist.DistributedDataset`` yielding ``jaxdist.Batch(data, mask)``: iterate it once
          per epoch; it has no ``len``.

        Raises:
          ValueError: a batch larger than the per-replica batch size, an empty batch, or
            pipelines that disagree on the batch size. ``jaxdist.InputSyncTimeoutError``: a process
            did not report within ``sync_timeout_s``.

        >>> import jax, jaxdist, numpy as np
        >>> s = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> def fn(ctx):
        ...     size = ctx.get_per_replica_batch_size(4)
        ...     return [(np.arange(i, min(i + size, 5)),) for i in range(0, 5, size)]
        >>> [b.mask.tolist() for b in s.distribute_datasets_from_function(fn)]
        [[True, True, True, True], [True, False, False, False]]
        """
        return DatasetFromFunction(self, fn, global_batch_size=global_batch_size,
                                   prefetch=prefetch, sync_timeout_s=sync_timeout_s)

    def experimental_distribute_datasets_from_function(self, fn: Callable, /, **kwargs):
        """tf.distribute's older name for :meth:`distribute_datasets_from_function` (the same
        method, the same options)."""
        return self.distribute_datasets_from_function(fn, **kwargs)

    # --- the two views ----------------------------------------------------------------------------
    def step(self, fn: Callable, /, *, donate: bool = True, max_in_flight: int = 8) -> Callable:
        """Compiles a global-view ``fn(state, batch) -> (state, metrics)`` for this strategy.

        Args:
          fn: the step, written for one device over the global batch.
          donate: let the step reuse the state's buffers for the new state.
          max_in_flight: the most calls left running before a call waits for an older one.

        Returns:
          A ``DistributedStep``, called like ``fn``.
        """
        return DistributedStep(fn, self, donate=donate, max_in_flight=max_in_flight)

    def run(self, fn: Callable, /, args: tuple = (), kwargs: dict | None = None) -> PyTree:
        """Runs ``fn(*args, **kwargs)`` once per replica under ``jax.shard_map``.

        Distributed arguments (a ``jaxdist.Batch`` from ``distribute``, or ``PerReplica`` values from
        an earlier ``run``, anywhere in the arguments) are split so that each replica sees its own
        slice, without leaving the devices; everything else is copied to every replica, as
        tf.distribute does with plain tensors. Gradients taken inside ``fn`` are *local* to the
        replica: combine them with ``jaxdist.all_reduce``.

        When ``fn`` returns ``(new_state, ...)`` with the layout of its first argument, the
        per-replica values of that argument are donated (their buffers hold the new state), so
        ``state, loss = strategy.run(step, args=(state, batch))`` updates the state in place.

        Returns:
          ``fn``'s own output structure with a ``jaxdist.PerReplica`` in place of each array.

        Raises:
          NotImplementedError: the strategy shards its state (``zero_stage`` > 0): per-replica
            code reads a whole copy of the state on every replica, which sharded state does not
            keep. The message names the global view to use instead.
        """
        stage = getattr(self, "zero_stage", 0)
        if stage:
            raise NotImplementedError(
                f"{type(self).__name__}(zero_stage={stage}).run: the per-replica view needs a full "
                "copy of the state on every replica, and zero_stage shards it. Write the step for "
                "the global view and call strategy.step(train_step) (or @jaxdist.mirrored("
                f"zero_stage={stage}), or jaxdist.fit), which gives the same numbers; or keep "
                "strategy.run with zero_stage=0.")
        return per_replica.run(self.layout, self._run_cache, fn, args,
                               {} if kwargs is None else kwargs)

    # --- reading results on the host ---------------------------------------------------------------
    def reduce(self, op: ReduceOp | str, value: Any, axis: int | None = None) -> PyTree:
        """Combines per-replica values across replicas, as ``tf.distribute.Strategy.reduce``.

        Args:
          op: ``"sum"`` or ``"mean"``.
          value: any nest of ``PerReplica`` values (what ``strategy.run`` returned, or part of it),
            or a value that is the same on every replica.
          axis: ``None`` reduces across replicas only; an int also reduces along that axis of each
            replica's value (``"mean"`` then averages over all those elements, the global batch mean).

        As in tf: a per-example value that ``run`` returned for a ``jaxdist.Batch`` (one row per
        example: its leading size is the replica's share of the batch) counts only the batch's
        real rows along ``axis=0``, so a padded last batch of 13 rows in batches of 8 gives the
        mean of its 5 real rows; and a value that is not per-replica is held by every replica, so
        ``"sum"`` along an axis is the sum over the replicas of its sum (``[1, 2, 3]`` on 2
        replicas: 12), while ``"sum"`` with ``axis=None`` is refused as tf refuses it.

        Returns:
          The nest with each per-replica value reduced to one replicated array.

        Raises:
          ValueError: ``"sum"`` of a plain value with ``axis=None``; or, along ``axis=0``, a
            per-example value from a ``run`` given several batches of its size whose padding
            differs (which rows are real is not known).
        """
        with self.layout.mesh_context():
            return per_replica.reduce(self.layout, op, value, axis)

    def gather(self, value: Any, axis: int) -> PyTree:
        """Concatenates every replica's value along ``axis`` (tf: ``Strategy.gather``).

        Args:
          value: any nest of ``PerReplica`` values; with one replica also a plain value.
          axis: the axis of each replica's value to concatenate along.

        Returns:
          The nest with each per-replica value replaced by the concatenation, in replica order,
          replicated on every device (every process sees all of it). Along ``axis=0``, a
          per-example value of a padded batch keeps only the real rows (as tf, whose replicas
          get fewer rows); reading which rows are real waits for the batch's mask.

        Raises:
          ValueError: along ``axis=0``, a per-example value from a ``run`` given several batches
            of its size whose padding differs (which rows are real is not known).
        """
        with self.layout.mesh_context():
            return per_replica.gather(self.layout, value, axis)

    def local_results(self, value: Any) -> tuple:
        """This process's per-replica values as a tuple (one nest per local replica, in order).

        As tf's ``experimental_local_results``: each ``PerReplica`` in the nest is replaced by that
        replica's value; a value with no ``PerReplica`` in it is returned as a 1-tuple.
        """
        # Each replica's value is read onto its own device; with a mesh in context (``scope()``,
        # ``jax.set_mesh``) JAX refuses to slice a one-device array there, so none is set here.
        with jax.set_mesh(None):
            return per_replica.local_results(self.layout, value)

    def to_mirrored(self, value: Any, *, check: bool = False) -> PyTree:
        """One replicated value from per-replica values that every replica agrees on.

        The state after an all-reduced update is the same on every replica; this turns each
        ``PerReplica`` in the nest into one array replicated over the mesh (tf's mirrored values),
        for checkpointing, evaluation or a global-view step. Each device's own copy becomes its
        shard of the result: nothing is copied between devices or through the host.

        Args:
          value: a nest of ``PerReplica`` values (other leaves are placed replicated).
          check: verify on the devices that the replicas really agree (bitwise); costs one
            all-reduce per leaf.

        Raises:
          ValueError: with ``check=True``, naming the leaves whose replicas differ.
        """
        with self.layout.mesh_context():
            return per_replica.to_mirrored(self.layout, value, check=check)


class _MeshOption:
    """The ``mesh=`` option of a strategy: given, the user's own mesh; read back, the mesh the
    strategy runs on (``Strategy.mesh``, built lazily), so that the option does not hide it."""

    def __get__(self, obj, owner=None):
        if obj is None:
            return None  # the dataclass default
        return obj.layout.mesh

    def __set__(self, obj, value):
        if value is self or value is None:
            value = None
        elif not isinstance(value, Mesh):
            raise TypeError(f"{type(obj).__name__}(mesh=...) expects a jax.sharding.Mesh with "
                            "devices, such as jax.make_mesh((8,), ('data',)), got "
                            f"{type(value).__name__}")
        object.__setattr__(obj, "_user_mesh", value)


@dataclasses.dataclass(frozen=True, repr=False)
class UserMeshStrategy(MeshStrategy):
    """A mesh strategy that may run on a mesh the user already has (``mesh=``, ``data_axes=``).

    ``MirroredStrategy(mesh=m, data_axes=("data",))`` runs its replicas over the ``data`` axis of
    ``m`` (``jax.make_mesh`` gives Explicit axes; Auto works too): batches are split over
    ``data_axes``, state is replicated over them, and a state leaf the user sharded over the mesh's
    other axes keeps that sharding, so jaxdist composes with code that shards a model axis.
    Batches already on ``m`` are used without a copy; ``put`` copies state even when it is
    already placed, so that a donating step never deletes the caller's arrays.
    (``CentralStorageStrategy`` keeps its one copy in host memory split over ``data_axes`` only.)

    Both options are keyword-only; ``data_axes`` defaults to every axis of ``m``.
    """

    _user_mesh: Mesh | None = dataclasses.field(default=None, init=False, repr=False)
    mesh: Mesh | None = dataclasses.field(default=_MeshOption(), kw_only=True, compare=False,  # type: ignore[assignment]
                                          repr=False)
    data_axes: tuple[str, ...] | str | None = dataclasses.field(default=None, kw_only=True)

    def _check_mesh_options(self, devices: Any = None) -> None:
        """Validates ``mesh=`` / ``data_axes=`` at construction (touches no device)."""
        what = type(self).__name__
        if self._user_mesh is None:
            if self.data_axes is not None:
                raise ValueError(f"{what}(data_axes={self.data_axes!r}) names axes of a mesh of "
                                 "your own: pass it too (mesh=jax.make_mesh(...))")
            return
        if devices is not None:
            raise ValueError(f"{what}: pass devices= or mesh=, not both (the mesh names its "
                             "devices)")
        axes = mesh_lib.check_user_mesh(self._user_mesh, self.data_axes, what)
        object.__setattr__(self, "data_axes", axes)

    # ``mesh`` (the dataclass option above) replaced ``Strategy.mesh`` on this class: reads are the
    # same (the descriptor returns the layout's mesh), so nothing else changes.

    def __repr__(self) -> str:
        # The strategy's own options first, then the mesh options only when a mesh was given
        # (subclasses are declared with repr=False so that this one is kept).
        own = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
               if f.repr and f.name not in ("_user_mesh", "mesh", "data_axes")]
        if self._user_mesh is not None:
            own += [f"mesh={self._user_mesh!r}", f"data_axes={self.data_axes!r}"]
        return f"{type(self).__name__}({', '.join(own)})"


def resolve_devices(devices: Sequence[jax.Device | str] | None, what: str, *,
                    lazy: bool = False) -> tuple[jax.Device, ...]:
    """Validates an explicit device list (or returns this process's devices for None).

    Entries are ``jax.Device`` objects or tf.distribute device strings (``"/gpu:0"``). With
    ``lazy`` (at construction) strings are only checked for form and kept: resolving them starts
    JAX's backend, which must wait for ``jaxdist.initialize()``.
    """
    if devices is None:
        return tuple(jax.local_devices())
    if isinstance(devices, (str, jax.Device)):
        raise TypeError(f"{what}(devices=...) expects a list of devices, got one {devices!r}: "
                        f"wrap it in a list")
    devices = tuple(devices)
    if not devices:
        raise ValueError(f"{what}(devices=()) got no devices; pass None for all local devices")
    devices = tuple((mesh_lib.check_device_string(d) if lazy else mesh_lib.device_from_string(d))
                    if isinstance(d, str) else d for d in devices)
    if lazy and any(isinstance(d, str) for d in devices):
        return devices
    if not all(isinstance(d, jax.Device) for d in devices):
        bad = [type(d).__name__ for d in devices if not isinstance(d, jax.Device)]
        raise TypeError(f"{what}(devices=...) expects jax.Device objects (e.g. jax.devices()[:4]) "
                        "or device strings ('/gpu:0'), "
                        f"got {bad}")
    if len(set(devices)) != len(devices):
        raise ValueError(f"{what}(devices=...) lists a device more than once: {list(devices)}")
    return devices
