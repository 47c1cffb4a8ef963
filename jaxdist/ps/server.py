"""A parameter server: one shard of the parameters, its optimizer state, and the update loop.

The server is transport-agnostic: in-process workers call :meth:`ParameterServer.push` and
:meth:`ParameterServer.pull` directly, remote ones reach the same methods through
:mod:`jaxdist.ps.transport`. Updates follow one of three modes:

* asynchronous (default): every push is applied as it arrives;
* bounded staleness (``staleness=s``): a push computed on a version more than ``s`` updates old
  is refused with status ``"stale"`` and the worker pulls and recomputes;
* synchronous (``sync_replicas=K``): pushes computed on the current version are averaged, and
  applied once when ``K`` have arrived.

Every push carries ``(worker, step_id)``; a step id is applied at most once (re-sending a step
after a failure returns ``"duplicate"``). Each applied push is logged as an :class:`UpdateRecord`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import threading
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp

from jaxdist.ps import wire
from jaxdist.ps.optim import OptimizerSpec

__all__ = ["PushRejected", "ServerConfig", "UpdateRecord", "PushResult", "ParameterServer",
           "check_number"]

logger = logging.getLogger(__name__)

_CKPT_FORMAT = "jaxdist-ps-checkpoint/2"  # /2: Orbax steps (/1 was one wire-format file)
# Step ids, worker ids and versions are stored as int64 (checkpoints, logs).
MAX_ID = (1 << 63) - 1
NONFINITE_POLICIES = ("reject", "apply")


class PushRejected(ValueError):
    """A push that the server refuses (bad keys, shapes, dtypes, size). The server keeps serving.

    Attributes:
      code: ``"invalid_argument"`` or ``"resource_exhausted"`` (mapped to gRPC status codes).
    """

    def __init__(self, message: str, code: str = "invalid_argument"):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Update mode and limits of a parameter server.

    Attributes:
      staleness: refuse pushes computed more than this many versions ago (None: no bound).
      sync_replicas: average this many pushes per applied update (None: asynchronous).
      max_push_bytes: largest push accepted, in bytes of gradient data.
      checkpoint_dir: directory of this server's Orbax checkpoints (None: no checkpoints).
      checkpoint_every: write a checkpoint every this many applied updates.
      nonfinite: ``"reject"`` (default) refuses a push holding NaN or Inf and counts it in
        ``status()["rejected_nonfinite"]``; ``"apply"`` applies it as it is.
      max_wait_s: longest a ``pull(min_version=...)`` waits, whatever the caller asks.
      max_waiters: most pulls waiting at once; one more is refused at once with
        ``resource_exhausted`` (remote clients back off and retry), so waiting callers can
        never take every handler thread of the server.
      dedup_window: step ids remembered for exactly-once: the newest this many taken ids. An
        id older than all of them (a push delayed behind ``dedup_window`` newer updates) is
        answered ``"duplicate"`` and dropped, never applied twice.
      log_window: update records kept in ``ParameterServer.log`` (the newest);
        ``status()["applied"]`` still counts every applied push. Both windows bound memory and
        the cost of a checkpoint whatever the length of the run.
    """

    staleness: int | None = None
    sync_replicas: int | None = None
    max_push_bytes: int = 512 << 20
    checkpoint_dir: str | None = None
    checkpoint_every: int = 100
    nonfinite: str = "reject"
    max_wait_s: float = 30.0
    max_waiters: int = 16
    dedup_window: int = 100_000
    log_window: int = 10_000

    def __post_init__(self):
        # Types and finiteness first: a NaN or float here (e.g. from a remote Init) would pass
        # every comparison below and switch a bound off silently.
        for name in ("staleness", "sync_replicas"):
            if getattr(self, name) is not None:
                check_number(f"ServerConfig.{name}", getattr(self, name), integer=True,
                             hi=MAX_ID)
        for name in ("max_push_bytes", "checkpoint_every", "max_waiters", "dedup_window",
                     "log_window"):
            check_number(f"ServerConfig.{name}", getattr(self, name), integer=True, hi=MAX_ID)
        check_number("ServerConfig.max_wait_s", self.max_wait_s, lo_open=True, hi=1e9)
        if self.staleness is not None and self.staleness < 0:
            raise ValueError(f"staleness must be >= 0 or None, got {self.staleness}")
        if self.sync_replicas is not None and self.sync_replicas < 1:
            raise ValueError(f"sync_replicas must be >= 1 or None, got {self.sync_replicas}")
        if self.staleness is not None and self.sync_replicas is not None:
            raise ValueError("staleness and sync_replicas are exclusive: synchronous mode only "
                             "accepts pushes computed on the current version")
        if self.dedup_window < 1 or self.log_window < 1:
            raise ValueError(f"dedup_window ({self.dedup_window}) and log_window "
                             f"({self.log_window}) must be >= 1")
        if self.max_push_bytes < 1 or self.checkpoint_every < 1:
            raise ValueError(f"max_push_bytes ({self.max_push_bytes}) and checkpoint_every "
                             f"({self.checkpoint_every}) must be >= 1")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite={self.nonfinite!r}; expected one of "
                             f"{NONFINITE_POLICIES}")
        if not self.max_wait_s > 0 or self.max_waiters < 1:
            raise ValueError(f"max_wait_s ({self.max_wait_s}) must be > 0 and max_waiters "
                             f"({self.max_waiters}) >= 1")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class UpdateRecord:
    """One applied push: computed on ``computed_on``, applied when the server was at ``applied_at``
    (so its staleness is ``applied_at - computed_on``)."""

    step_id: int
    worker: int
    computed_on: int
    applied_at: int


@dataclasses.dataclass(frozen=True)
class PushResult:
    """The server's answer to a push.

    Attributes:
      status: ``"applied"``, ``"pending"`` (sync mode: waiting for the round to fill),
        ``"duplicate"`` (this step id was already taken) or ``"stale"`` (pull and recompute).
      version: the server's version after handling the push (sync: the version the round produces).
      incarnation: random id of this server process; changes on restart.
      restored_version: version this incarnation was restored from (-1 for a fresh start, so
        a restart from the version-0 checkpoint still counts as a restart).
    """

    status: str
    version: int
    incarnation: int
    restored_version: int


def check_number(name: str, value: Any, *, lo: float = 0.0, hi: float = math.inf,
                 integer: bool = False, lo_open: bool = False, error: type = ValueError):
    """``value`` as a finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``), or raises.

    Every number that reaches the parameter-server code from a caller or the network goes
    through here: NaN passes ``min``/``max`` clamps and ``<``/``>`` checks unnoticed (a NaN
    timeout made ``Condition.wait_for`` spin), so finiteness is checked first.

    Args:
      name: the parameter's name, for the message.
      value: the value to check (``bool`` is refused: it is not a count or a duration).
      lo, hi: the accepted range.
      integer: require an ``int`` (or numpy integer).
      lo_open: exclude ``lo`` itself.
      error: the exception type to raise.

    Returns:
      ``value`` as ``int`` (``integer=True``) or ``float``.

    Raises:
      ValueError: (or ``error``) ``value`` is not a number, not finite or out of range.

    >>> check_number("timeout", 2)
    2.0
    >>> check_number("timeout", float("nan"))
    Traceback (most recent call last):
    ...
    ValueError: timeout must be a finite number in [0, inf], got nan
    """
    kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    hi_s = "2**63-1" if integer and hi == MAX_ID else f"{hi:g}"
    rng = f"{'(' if lo_open else '['}{lo:g}, {hi_s}]"
    what = "an integer" if integer else "a finite number"
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise error(f"{name} must be {what} in {rng}, got {type(value).__name__} {value!r}")
    if not integer and not math.isfinite(float(value)):
        raise error(f"{name} must be {what} in {rng}, got {value!r}")
    if not (lo < value if lo_open else lo <= value) or not value <= hi:
        raise error(f"{name} must be {what} in {rng}, got {value!r}")
    return int(value) if integer else float(value)


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise PushRejected(f"{name} must be an integer, got {type(value).__name__}")
    if not 0 <= value <= MAX_ID:
        raise PushRejected(f"{name} must be in [0, 2**63), got {value}")
    return int(value)


class ParameterServer:
    """Holds one shard's parameters and optimizer state and applies pushed gradients.

    Args:
      index: this server's shard index.
      params: ``{key: array}`` of this shard (see :class:`jaxdist.ps.placement.Placement`).
      optimizer: an :class:`OptimizerSpec` (required for multi-process servers, which rebuild it
        from their checkpoint) or any ``optax.GradientTransformation``.
      config: :class:`ServerConfig`.

    >>> import numpy as np, optax
    >>> ps = ParameterServer(0, {"w": np.ones(2, np.float32)}, optax.sgd(0.5))
    >>> ps.push(worker=0, step_id=7, version=0, grads={"w": np.ones(2, np.float32)}).status
    'applied'
    >>> ps.push(worker=1, step_id=7, version=0, grads={"w": np.ones(2, np.float32)}).status
    'duplicate'
    >>> ps.pull()[0], ps.pull()[1]["w"].tolist()
    (1, [0.5, 0.5])
    """

    def __init__(self, index: int, params: Mapping[str, Any],
                 optimizer: OptimizerSpec | optax.GradientTransformation,
                 config: ServerConfig = ServerConfig(), *, _state: tuple | None = None):
        self.index = index
        self.config = config
        self._spec = optimizer if isinstance(optimizer, OptimizerSpec) else None
        self._tx = optimizer.build() if isinstance(optimizer, OptimizerSpec) else optimizer
        self._params = {k: jax.numpy.asarray(v) for k, v in params.items()}
        self._shapes = {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in self._params.items()}
        #: bytes of one gradient push to this shard (what a receiver needs to accept)
        self.shard_bytes = sum(math.prod(s) * d.itemsize for s, d in self._shapes.values())
        self._opt_state = self._tx.init(self._params)
        self._apply = jax.jit(self._apply_fn)
        self.incarnation = int.from_bytes(os.urandom(6), "little")
        self.version = 0
        self.restored_version = -1
        # Exactly-once within a window: the newest dedup_window taken (applied or pending) step
        # ids, in the order taken; ids at or below _floor fell out of it and count as taken.
        self._taken: set[int] = set()
        self._order: collections.deque[int] = collections.deque()
        self._floor = -1
        self._pending: dict[int, tuple[int, int, Mapping[str, np.ndarray]]] = {}
        # the newest log_window UpdateRecords, a ring of int64 rows; _applied counts them all
        self._log = np.full((config.log_window, 4), -1, np.int64)
        self._applied = 0
        self.rejected_nonfinite = 0
        self._waiters = 0
        self._cond = threading.Condition()
        self._ckpt: ocp.CheckpointManager | None = None
        if _state is not None:
            self._load_state(*_state)
        elif config.checkpoint_dir:
            self._save()

    # --- update loop -------------------------------------------------------------------------

    def _apply_fn(self, params, opt_state, grads):
        updates, opt_state = self._tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def _validate(self, grads: Mapping[str, Any]) -> None:
        nbytes = sum(int(np.prod(np.shape(g))) * np.dtype(g.dtype).itemsize
                     for g in grads.values())
        if nbytes > self.config.max_push_bytes:
            raise PushRejected(f"push of {nbytes} bytes exceeds ps{self.index}'s limit of "
                               f"{self.config.max_push_bytes} (ServerConfig.max_push_bytes)",
                               "resource_exhausted")
        unknown = sorted(set(grads) - set(self._shapes))
        missing = sorted(set(self._shapes) - set(grads))
        if unknown or missing:
            raise PushRejected(f"push to ps{self.index} has unknown keys {unknown} and lacks "
                               f"keys {missing}; this shard holds {sorted(self._shapes)}. "
                               "Check that the worker uses the same placement as the servers.")
        for k, g in grads.items():
            shape, dtype = self._shapes[k]
            if tuple(np.shape(g)) != shape or np.dtype(g.dtype) != dtype:
                raise PushRejected(
                    f"push to ps{self.index}: gradient {k!r} is {np.dtype(g.dtype).name}"
                    f"{list(np.shape(g))}, expected {dtype.name}{list(shape)}")
        if self.config.nonfinite == "reject":
            bad = [k for k, g in grads.items() if np.issubdtype(np.dtype(g.dtype), np.inexact)
                   and not np.isfinite(g).all()]
            if bad:
                with self._cond:
                    self.rejected_nonfinite += 1
                raise PushRejected(f"push to ps{self.index}: gradient(s) {bad} hold NaN or Inf; "
                                   "refused (ServerConfig.nonfinite='reject'). Check the loss "
                                   "for overflow, or lower the learning rate")

    def push(self, *, worker: int, step_id: int, version: int,
             grads: Mapping[str, Any]) -> PushResult:
        """Offers gradients computed by ``worker`` for ``step_id`` on parameter ``version``.

        Raises:
          PushRejected: wrong keys, shapes, dtypes, or over ``max_push_bytes``.
        """
        worker, step_id, version = (_check_int(n, v) for n, v in
                                    (("worker", worker), ("step_id", step_id),
                                     ("version", version)))
        self._validate(grads)
        with self._cond:
            sync = self.config.sync_replicas
            if step_id in self._taken or step_id <= self._floor:
                status = "duplicate"
            elif version > self.version or (
                    self.config.staleness is not None
                    and self.version - version > self.config.staleness) or (
                    sync is not None and version != self.version):
                # A version from the future means this server restarted from a checkpoint.
                status = "stale"
            elif sync is not None:
                self._take(step_id)
                self._pending[step_id] = (worker, version, grads)
                status = "pending"
                if len(self._pending) >= sync:
                    pend = self._pending
                    self._pending = {}
                    mean: dict[str, Any] = {}
                    for k, (_, dtype) in self._shapes.items():
                        acc = np.result_type(dtype, np.float32)  # bf16/f16 sum in f32, f64 in f64
                        total: Any = sum(np.asarray(g[k], acc) for _, _, g in pend.values())
                        mean[k] = (total / len(pend)).astype(dtype)
                    self._update(mean, [(s, w, v) for s, (w, v, _) in pend.items()])
                    status = "applied"
            else:
                self._take(step_id)
                self._update(grads, [(step_id, worker, version)])
                status = "applied"
            version_out = self.version + (1 if status == "pending" else 0)
            return PushResult(status, version_out, self.incarnation, self.restored_version)

    def _take(self, step_id: int) -> None:
        self._taken.add(step_id)
        self._order.append(step_id)
        while len(self._order) > self.config.dedup_window:
            old = self._order.popleft()
            self._taken.discard(old)
            self._floor = max(self._floor, old)

    @property
    def log(self) -> list[UpdateRecord]:
        """The newest ``ServerConfig.log_window`` applied pushes, oldest first."""
        with self._cond:
            return [UpdateRecord(*map(int, r)) for r in self._log_rows()]

    def _log_rows(self) -> np.ndarray:
        n, cap = self._applied, len(self._log)
        if n <= cap:
            return self._log[:n].copy()
        return np.roll(self._log, -(n % cap), axis=0)

    def _update(self, grads: Mapping[str, Any], records: list[tuple[int, int, int]]) -> None:
        self._params, self._opt_state = self._apply(self._params, self._opt_state, dict(grads))
        cap = len(self._log)
        for s, w, v in records:
            self._log[self._applied % cap] = (s, w, v, self.version)
            self._applied += 1
        self.version += 1
        self._cond.notify_all()
        if self.config.checkpoint_dir and self.version % self.config.checkpoint_every == 0:
            self._save()

    def pull(self, *, min_version: int | None = None, timeout: float | None = None,
             cancelled: threading.Event | None = None) -> tuple[int, dict[str, np.ndarray]]:
        """Returns ``(version, {key: read-only array})``, first waiting for ``version >=
        min_version`` when given (a synchronous worker waiting for its round).

        The wait lasts at most ``timeout`` seconds and never more than
        ``ServerConfig.max_wait_s``; it ends early when ``cancelled`` is set (the remote caller
        went away). At most ``ServerConfig.max_waiters`` pulls wait at once.

        Raises:
          TimeoutError: ``min_version`` was not reached in time (or the wait was cancelled).
          PushRejected: ``min_version`` is not an integer in [0, 2**63), ``timeout`` is not a
            finite number >= 0, or
            ``max_waiters`` pulls are already waiting (code ``resource_exhausted``).
        """
        if min_version is not None:
            min_version = _check_int("min_version", min_version)
        wait_s = self.config.max_wait_s if timeout is None else min(
            check_number("pull timeout", timeout, hi=math.inf, error=PushRejected),
            self.config.max_wait_s)
        with self._cond:
            if min_version is not None and self.version < min_version:
                if self._waiters >= self.config.max_waiters:
                    raise PushRejected(f"ps{self.index} already has {self._waiters} pulls "
                                       "waiting (ServerConfig.max_waiters); retry later",
                                       "resource_exhausted")
                self._waiters += 1
                try:
                    self._cond.wait_for(lambda: self.version >= min_version or (
                        cancelled is not None and cancelled.is_set()), wait_s)
                finally:
                    self._waiters -= 1
                if self.version < min_version:
                    raise TimeoutError(f"ps{self.index} stayed at version {self.version} < "
                                       f"{min_version} for {wait_s:g}s: too few workers pushing "
                                       f"for sync_replicas={self.config.sync_replicas}?")
            version, params = self.version, self._params
        return version, {k: np.asarray(v) for k, v in params.items()}

    def wake(self) -> None:
        """Wakes waiting pulls so they re-check their ``cancelled`` event."""
        with self._cond:
            self._cond.notify_all()

    def status(self) -> dict[str, Any]:
        with self._cond:
            return {"index": self.index, "version": self.version,
                    "incarnation": self.incarnation, "restored_version": self.restored_version,
                    "pending": len(self._pending), "applied": self._applied,
                    "rejected_nonfinite": self.rejected_nonfinite, "waiters": self._waiters,
                    "keys": {k: [d.name, list(s)] for k, (s, d) in self._shapes.items()}}

    # --- checkpoints ---------------------------------------------------------------------------

    @staticmethod
    def checkpoint_path(directory: str, index: int) -> str:
        """Where server ``index`` keeps its Orbax checkpoints: ``<directory>/ps<index>/<version>``."""
        return os.path.join(os.path.abspath(directory), f"ps{index}")

    @classmethod
    def _manager(cls, directory: str, index: int) -> ocp.CheckpointManager:
        # Synchronous: a push that crosses checkpoint_every returns once its checkpoint is on
        # disk, so a killed server loses at most checkpoint_every acknowledged updates.
        return ocp.CheckpointManager(
            cls.checkpoint_path(directory, index), item_names=("state", "meta"),
            options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True,
                                                 enable_async_checkpointing=False))

    def _arrays(self, n_taken: int, n_log: int, like=None) -> dict[str, Any]:
        """The saved pytree (or, with ``like=np.zeros``, a numpy target of its shapes).

        Orbax refuses zero-size arrays, so ``taken`` and ``log`` carry one leading -1 row.
        """
        if like is None:
            taken = np.fromiter(self._order, np.int64, len(self._order))  # in taken order
            log = self._log_rows()
            return {"params": {k: np.asarray(v) for k, v in self._params.items()},
                    "opt_state": [np.asarray(v) for v in
                                  jax.tree_util.tree_leaves(self._opt_state)],
                    "taken": np.concatenate([[-1], taken]).astype(np.int64),
                    "log": np.concatenate([np.full((1, 4), -1, np.int64), log])}
        return {"params": {k: like(s, d) for k, (s, d) in self._shapes.items()},
                "opt_state": [like(np.shape(v), np.asarray(v).dtype)
                              for v in jax.tree_util.tree_leaves(self._opt_state)],
                "taken": like((n_taken + 1,), np.int64), "log": like((n_log + 1, 4), np.int64)}

    def _save(self) -> None:
        """Writes params, optimizer state, version, taken step ids and the log as Orbax step
        ``version`` (Orbax writes to a temporary directory and renames it when complete)."""
        if self._ckpt is None:
            self._ckpt = self._manager(self.config.checkpoint_dir, self.index)
        meta = {"format": _CKPT_FORMAT, "index": self.index, "version": self.version,
                "optimizer": self._spec.to_dict() if self._spec else None,
                "config": self.config.to_dict(), "n_taken": len(self._order),
                "n_log": min(self._applied, len(self._log)), "applied": self._applied,
                "floor": self._floor,
                "params": {k: [d.name, list(s)] for k, (s, d) in self._shapes.items()}}
        self._ckpt.save(self.version, args=ocp.args.Composite(
            state=ocp.args.StandardSave(self._arrays(0, 0)), meta=ocp.args.JsonSave(meta)),
            force=True)
        logger.debug("ps%d: checkpoint at version %d -> %s", self.index, self.version,
                     self.checkpoint_path(self.config.checkpoint_dir, self.index))

    def _load_state(self, mgr: ocp.CheckpointManager, step: int, meta: dict) -> None:
        want = {k: [d.name, list(s)] for k, (s, d) in self._shapes.items()}
        if meta["params"] != want:
            raise ValueError(f"checkpoint of ps{self.index} holds {meta['params']}, expected "
                             f"{want}: it belongs to another model or placement; clear the "
                             "checkpoint directory")
        target = self._arrays(meta["n_taken"], meta["n_log"], like=np.zeros)
        state = mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target)))["state"]
        treedef = jax.tree_util.tree_structure(self._opt_state)
        self._opt_state = jax.tree_util.tree_unflatten(
            treedef, [jax.numpy.asarray(v) for v in state["opt_state"]])
        self._params = {k: jax.numpy.asarray(v) for k, v in state["params"].items()}
        self.version = self.restored_version = int(meta["version"])
        # (a checkpoint written before the windows holds every id and record: keep the newest)
        self._floor = int(meta.get("floor", -1))
        for step_id in state["taken"][1:].tolist():
            self._take(step_id)
        rows = state["log"][1:][-len(self._log):]
        self._applied = int(meta.get("applied", len(state["log"]) - 1))
        for j, row in enumerate(rows):  # ring positions of applied pushes applied-k .. applied-1
            self._log[(self._applied - len(rows) + j) % len(self._log)] = row
        self._ckpt = mgr

    @classmethod
    def restore(cls, directory: str, index: int, *,
                optimizer: optax.GradientTransformation | None = None,
                config: ServerConfig | None = None) -> ParameterServer | None:
        """Rebuilds server ``index`` from its newest checkpoint in ``directory`` (None if there
        is none).

        The optimizer comes from the checkpoint when it was an :class:`OptimizerSpec`, else from
        ``optimizer``; the config from the checkpoint unless ``config`` is given.

        Raises:
          ValueError: the checkpoint is not a jaxdist parameter-server checkpoint of shard
            ``index``, or it needs an ``optimizer`` argument.
        """
        path = cls.checkpoint_path(directory, index)
        if not os.path.isdir(path):
            return None
        mgr = cls._manager(directory, index)
        step = mgr.latest_step()
        if step is None:
            mgr.close()
            return None
        meta = dict(mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
        if meta.get("format") != _CKPT_FORMAT or meta.get("index") != index:
            raise ValueError(f"{path}/{step} is not a checkpoint of ps{index} "
                             f"(format {meta.get('format')!r}, index {meta.get('index')!r})")
        if meta["optimizer"] is not None:
            opt: Any = OptimizerSpec.from_dict(meta["optimizer"])
        elif optimizer is not None:
            opt = optimizer
        else:
            raise ValueError(f"{path} was written with a plain optax transformation; pass "
                             "optimizer= to restore it, or use jaxdist.ps.optimizer(...)")
        config = config or ServerConfig(**meta["config"])
        params = {k: np.zeros(shape, np.dtype(wire.ALLOWED_DTYPES[d]))
                  for k, (d, shape) in meta["params"].items()}
        server = cls(index, params, opt, config, _state=(mgr, step, meta))
        logger.warning("ps%d restored from %s at version %d", index, path, server.version)
        return server
