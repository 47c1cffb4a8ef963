"""``ParameterServerStrategy``: parameters sharded over servers, gradients pushed by workers.

One API, two deployments:

* in-process: ``ParameterServerStrategy(LocalCluster(num_ps=2, num_workers=3))`` runs servers
  and workers as threads of this process (one machine, fast tests);
* multi-process: ``ParameterServerStrategy(spec)`` with a :class:`jaxdist.ClusterSpec` that has
  ``chief``, ``worker`` and ``ps`` jobs (``None`` reads ``TF_CONFIG`` through
  :meth:`jaxdist.ClusterSpec.from_tf_config`, the package's one validated reader). Every process
  runs the same script; :meth:`ParameterServerStrategy.start` returns the coordinator on the
  chief and serves (then exits the process) on ``ps`` and ``worker`` tasks, like TF's
  ``server.join()``. ``jaxdist launch --ps N --workers M script.py`` starts such a job locally.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from typing import Any

import jax
import numpy as np
import optax

from jaxdist.launch.cluster import ClusterSpec
from jaxdist.ps import placement as placement_lib
from jaxdist.ps._retry import retry
from jaxdist.ps.coordinator import ClusterCoordinator, GrpcWorker, LocalWorker
from jaxdist.ps.optim import OptimizerSpec
from jaxdist.ps.server import ParameterServer, ServerConfig, check_number
from jaxdist.ps.transport import (
    HEADER_SLACK,
    PS_SERVICE,
    GrpcClient,
    LocalClient,
    PSService,
    TLSConfig,
    Unavailable,
    resolve_token,
    serve_until_stopped,
)
from jaxdist.ps.worker import WORKER_SERVICE, GradFn, WorkerRuntime, WorkerService, strategy_grad_fn
from jaxdist.strategy import check_global_batch_size, mesh_scope

__all__ = ["ParameterServerStrategy", "LocalCluster"]

logger = logging.getLogger(__name__)

# TF_CONFIG's task types: the chief runs the ClusterCoordinator (as in tf.distribute), so there
# is no separate "coordinator" role.
ROLES = ("chief", "ps", "worker")


@dataclasses.dataclass(frozen=True)
class LocalCluster:
    """Servers and workers as threads of this process."""

    num_ps: int
    num_workers: int

    def __post_init__(self):
        if self.num_ps < 1 or self.num_workers < 1:
            raise ValueError(f"need >= 1 server and worker, got num_ps={self.num_ps}, "
                             f"num_workers={self.num_workers}")


def _remote_roles(spec: ClusterSpec) -> tuple[str, int, tuple[str, ...], tuple[str, ...]]:
    """(role, index, ps addresses, worker addresses) of a parameter-server job's spec.

    The roles are TF_CONFIG's: ``chief`` runs the coordinator, ``worker`` tasks compute,
    ``ps`` tasks serve.
    """
    if not spec.ps or not spec.chief or not spec.worker_tasks:
        raise ValueError(
            f"a parameter-server cluster needs 'chief', 'worker' and 'ps' jobs; got chief="
            f"{list(spec.chief)} worker={list(spec.worker_tasks)} ps={list(spec.ps)}. Fix: "
            'TF_CONFIG {"cluster": {"chief": ["h0:p"], "worker": ["h1:p", ...], "ps": '
            '["h2:p", ...]}, "task": {...}}, or start the job with `jaxdist launch --ps N '
            "--workers M script.py`")
    if spec.task_type not in ROLES:
        raise ValueError(f"task type {spec.task_type!r} has no part in a parameter-server "
                         f"job; expected one of {ROLES}")
    return spec.task_type, spec.task_index, spec.ps, spec.worker_tasks


class ParameterServerStrategy:
    """Parameters live sharded on parameter servers; workers push gradients asynchronously.

    Args:
      cluster: :class:`LocalCluster`, a :class:`jaxdist.ClusterSpec` with ``chief``, ``worker``
        and ``ps`` jobs, or None to read ``TF_CONFIG``.
      placement: ``"greedy"`` or ``"round_robin"`` (see :func:`jaxdist.ps.placement.plan`).
      staleness: bound on how many versions old a pushed gradient may be (None: unbounded).
      sync_replicas: average this many pushes per update (synchronous mode).
      max_shard_bytes, num_partitions: partition large leaves along their first axis.
      token: shared secret checked on every RPC (default: ``$JAXDIST_PS_TOKEN``, which
        ``jaxdist launch`` sets); a multi-process job without one refuses to start.
      authenticate: False serves without a token (a trusted network only).
      tls: :class:`~jaxdist.ps.transport.TLSConfig` for every channel of the job (default:
        ``TLSConfig.from_env()``, i.e. ``$JAXDIST_PS_TLS_CERT`` / ``_KEY`` / ``_CA``).
      nonfinite: what servers do with a gradient holding NaN/Inf: ``"reject"`` (default,
        counted in ``server_status()``) or ``"apply"``.
      checkpoint_dir, checkpoint_every: server checkpoints (every N applied updates).
      max_push_bytes: largest gradient push a server accepts.
      heartbeat_s, dead_after_s: worker liveness checks.
      retry_timeout_s: how long workers retry a server that is down.
      worker_strategy: a local jaxdist strategy (e.g. ``MirroredStrategy()``) whose compiled
        step computes each worker's gradients on the worker's devices; default: ``jax.jit``.

    >>> s = ParameterServerStrategy(LocalCluster(num_ps=2, num_workers=3))
    >>> s.num_replicas_in_sync, s.mesh
    (3, None)
    """

    def __init__(self, cluster: Any = None, *, placement: str = "greedy",
                 staleness: int | None = None, sync_replicas: int | None = None,
                 max_shard_bytes: int | None = None, num_partitions: int | None = None,
                 token: str | None = None, authenticate: bool = True,
                 tls: TLSConfig | None = None, nonfinite: str = "reject",
                 checkpoint_dir: str | None = None,
                 checkpoint_every: int = 100, max_push_bytes: int = 512 << 20,
                 heartbeat_s: float = 0.5, dead_after_s: float = 5.0,
                 retry_timeout_s: float = 60.0, worker_strategy: Any = None):
        if cluster is None:
            cluster = ClusterSpec.from_tf_config()
        if not isinstance(cluster, (LocalCluster, ClusterSpec)):
            raise TypeError(f"cluster must be a LocalCluster, a jaxdist.ClusterSpec or None "
                            f"(TF_CONFIG), got {type(cluster).__name__}")
        self.cluster = cluster
        self.placement_method = placement
        self.max_shard_bytes, self.num_partitions = max_shard_bytes, num_partitions
        self.config = ServerConfig(staleness=staleness, sync_replicas=sync_replicas,
                                   max_push_bytes=max_push_bytes, checkpoint_dir=checkpoint_dir,
                                   checkpoint_every=checkpoint_every, nonfinite=nonfinite)
        self._liveness = dict(heartbeat_s=check_number("heartbeat_s", heartbeat_s, lo_open=True),
                              dead_after_s=check_number("dead_after_s", dead_after_s,
                                                        lo_open=True))
        self.retry_timeout_s = check_number("retry_timeout_s", retry_timeout_s)
        self.worker_strategy = worker_strategy
        self.placement: placement_lib.Placement | None = None
        if isinstance(cluster, LocalCluster):  # threads of this process: no network, no token
            self.num_ps, self.num_workers = cluster.num_ps, cluster.num_workers
            self.role, self.task_index = "chief", 0
            self.token, self.tls = None, None
        else:
            self.role, self.task_index, self.ps_addresses, self.worker_addresses = (
                _remote_roles(cluster))
            self.num_ps, self.num_workers = len(self.ps_addresses), len(self.worker_addresses)
            self.token = resolve_token(token, authenticate=authenticate)
            self.tls = tls if tls is not None else TLSConfig.from_env()
        if placement not in placement_lib.METHODS:
            raise ValueError(f"placement={placement!r} is unknown; expected one of "
                             f"{placement_lib.METHODS}")

    @property
    def mesh(self) -> None:
        """None: parameters live on server processes, not on a device mesh."""
        return None

    @property
    def num_replicas_in_sync(self) -> int:
        return self.num_workers

    def step(self, fn: Any, /, *, optimizer: OptimizerSpec | optax.GradientTransformation
             | None = None, donate: bool = False) -> Any:
        """A step for :func:`jaxdist.fit`: ``fn`` is the loss, ``fn(params, batch) -> scalar``.

        Workers compute its gradient; servers apply ``optimizer`` (see :mod:`jaxdist.ps.fit`).
        Passing a step this returned gives it back (``fit`` calls ``strategy.step`` on it).

        Args:
          fn: the loss function, or a step from this method.
          optimizer: what servers apply (:func:`jaxdist.ps.optimizer` across processes).
          donate: ignored (the servers own the parameters).

        Returns:
          A :class:`jaxdist.ps.fit.PSStep`.

        Raises:
          ValueError: no ``optimizer`` (also what ``fit(eval_step=...)`` meets: validation
            inside ``fit`` is not supported with parameter servers).

        >>> import numpy as np, optax, jaxdist
        >>> s = ParameterServerStrategy(LocalCluster(num_ps=1, num_workers=2))
        >>> x = np.linspace(-1, 1, 64, dtype=np.float32)
        >>> step = s.step(lambda p, b: ((p["w"] * b[0] - b[1]) ** 2).mean(),
        ...               optimizer=optax.sgd(0.5))
        >>> h = jaxdist.fit(step, {"w": np.zeros((), np.float32)}, (x, 3 * x), batch_size=16,
        ...                 epochs=5, verbose=0)
        >>> round(float(h.state["w"]), 2), len(h.history["loss"])
        (3.0, 5)
        """
        from jaxdist.ps.fit import PSStep
        if isinstance(fn, PSStep):
            return fn
        if optimizer is None:
            raise ValueError("ParameterServerStrategy.step(loss_fn, optimizer=...) needs the "
                             "optimizer the servers apply; an eval_step inside jaxdist.fit is "
                             "not supported with parameter servers: evaluate history.state "
                             "afterwards")
        return PSStep(self, fn, optimizer)

    def distribute(self, data: Any, global_batch_size: int, *, shuffle: bool = True,
                   seed: int = 0) -> Any:
        """Batches of ``data`` for :func:`jaxdist.fit`: each is one worker step's batch.

        Returns:
          A :class:`jaxdist.ps.fit.PSDataset`.
        """
        from jaxdist.ps.fit import PSDataset
        check_global_batch_size(global_batch_size)
        return PSDataset(data, global_batch_size, shuffle=shuffle, seed=seed)

    def experimental_distribute_dataset(self, dataset: Any, global_batch_size: int | None = None,
                                        /, **kwargs) -> Any:
        """tf.distribute's name for :meth:`distribute` (which takes the global batch size too:
        jaxdist batches the data itself).

        Raises:
          TypeError: no ``global_batch_size``.
        """
        if global_batch_size is None:
            raise TypeError("experimental_distribute_dataset(dataset, global_batch_size): pass the "
                            "unbatched arrays and the global batch size, e.g. "
                            "strategy.experimental_distribute_dataset((x, y), 128)")
        return self.distribute(dataset, global_batch_size, **kwargs)

    def scope(self):
        """tf's ``with strategy.scope():``, a no-op here: tf creates the variables it places on
        the parameter servers under it; jaxdist's servers receive the parameters you pass to
        :meth:`start` (or to ``fit``), wherever they were created. Yields the strategy.

        >>> s = ParameterServerStrategy(LocalCluster(num_ps=1, num_workers=2))
        >>> with s.scope() as scoped:
        ...     scoped is s
        True
        """
        return mesh_scope(self, None)

    def placement_report(self) -> str:
        """Which leaf lives on which server, and each server's load (after :meth:`start`)."""
        if self.placement is None:
            raise RuntimeError("no placement yet: call strategy.start(params, ...) first")
        return self.placement.report()

    def _plan(self, params: Any) -> tuple[placement_lib.Placement, Any]:
        self.placement = placement_lib.plan(
            params, self.num_ps, method=self.placement_method,
            max_shard_bytes=self.max_shard_bytes, num_partitions=self.num_partitions)
        return self.placement, placement_lib.flatten(params)[1]

    def start(self, params: Any, optimizer: OptimizerSpec | optax.GradientTransformation,
              loss_fn=None, *, grad_fn: GradFn | None = None) -> ClusterCoordinator:
        """Creates the servers and workers and returns the coordinator.

        Args:
          params: initial parameter tree (every process must build the same structure).
          optimizer: :func:`jaxdist.ps.optimizer` spec (required across processes) or, in
            process, any optax transformation.
          loss_fn: ``loss_fn(params, batch) -> scalar``; workers compute
            ``jax.jit(jax.value_and_grad(loss_fn))``.
          grad_fn: instead of ``loss_fn``, ``(params, batch) -> (loss, grads)`` (e.g. a local
            strategy's compiled step).

        Returns:
          A :class:`ClusterCoordinator` on the coordinator. On ``ps`` and ``worker`` tasks this
          serves until the coordinator shuts the job down, then exits the process.

        Raises:
          ValueError: neither or both of ``loss_fn`` and ``grad_fn``.
          TypeError: a plain optax transformation for servers in other processes.

        >>> import numpy as np, optax
        >>> s = ParameterServerStrategy(LocalCluster(num_ps=1, num_workers=2))
        >>> loss = lambda p, b: ((p["w"] * b) ** 2).sum()
        >>> with s.start({"w": np.ones(3, np.float32)}, optax.sgd(0.1), loss) as coord:
        ...     v = coord.schedule(lambda worker, b: worker.step(b), args=(np.ones(3),))
        ...     coord.join()
        ...     print(v.fetch(), coord.fetch_params()["w"].tolist())
        3.0 [0.800000011920929, 0.800000011920929, 0.800000011920929]
        """
        if (loss_fn is None) == (grad_fn is None):
            raise ValueError("pass exactly one of loss_fn= and grad_fn=")
        if grad_fn is None:
            grad_fn = (jax.jit(jax.value_and_grad(loss_fn)) if self.worker_strategy is None
                       else strategy_grad_fn(self.worker_strategy, loss_fn))
        placement, treedef = self._plan(params)
        shards = placement.split(placement_lib.flatten(params)[0])
        if isinstance(self.cluster, LocalCluster):
            return self._start_local(shards, optimizer, placement, treedef, grad_fn)
        if not isinstance(optimizer, OptimizerSpec):
            raise TypeError("servers in other processes rebuild the optimizer by name: pass "
                            "jaxdist.ps.optimizer('adam', learning_rate=...) instead of an "
                            f"optax transformation (got {type(optimizer).__name__})")
        if self.role == "ps":
            # the largest message is an Init or a Push of this shard: size the limit from it
            shard = shards[self.task_index]
            nbytes = sum(int(np.asarray(v).nbytes) for v in shard.values())
            self._serve(PSService(self.task_index, checkpoint_dir=self.config.checkpoint_dir),
                        self.ps_addresses[self.task_index], PS_SERVICE,
                        max_receive_bytes=min(nbytes, self.config.max_push_bytes) + HEADER_SLACK)
        clients = [GrpcClient(a, token=self.token, tls=self.tls) for a in self.ps_addresses]
        if self.role == "worker":
            runtime = WorkerRuntime(self.task_index, clients, placement, treedef, grad_fn,
                                    retry_timeout_s=self.retry_timeout_s)
            self._serve(WorkerService(runtime), self.worker_addresses[self.task_index],
                        WORKER_SERVICE, max_receive_bytes=HEADER_SLACK)
        return self._start_coordinator(clients, shards, optimizer, placement, treedef)

    def _start_local(self, shards, optimizer, placement, treedef, grad_fn):
        servers = [ParameterServer(i, shard, optimizer, self.config)
                   for i, shard in enumerate(shards)]
        clients = [LocalClient(s) for s in servers]
        workers = [LocalWorker(WorkerRuntime(i, clients, placement, treedef, grad_fn,
                                             retry_timeout_s=self.retry_timeout_s))
                   for i in range(self.num_workers)]
        return ClusterCoordinator(workers, servers=clients, placement=placement,
                                  treedef=treedef, **self._liveness)

    def _serve(self, service, address: str, name: str, *, max_receive_bytes: int):
        logger.info("%s %d serving on %s", self.role, self.task_index, address)
        serve_until_stopped(service, address, name, token=self.token, tls=self.tls,
                            max_receive_bytes=max_receive_bytes)
        sys.exit(0)

    def _start_coordinator(self, clients, shards, optimizer, placement, treedef):
        deadline = time.monotonic() + self.retry_timeout_s

        def left() -> float:
            return max(0.0, deadline - time.monotonic())
        for i, (client, shard) in enumerate(zip(clients, shards)):
            retry(lambda _, c=client, i=i, sh=shard: c.init(i, sh, optimizer, self.config),
                  timeout_s=left(), retry_on=Unavailable)
        workers = [GrpcWorker(i, a, token=self.token, tls=self.tls)
                   for i, a in enumerate(self.worker_addresses)]
        for w in workers:
            retry(lambda _, w=w: w.ping(timeout=2.0), timeout_s=left(),
                  retry_on=ConnectionError)

        def stop_servers():
            for c in clients:
                try:
                    c.shutdown()
                except Exception as e:  # a server already gone is fine at shutdown
                    logger.debug("ps shutdown: %s", e)
                c.close()
        return ClusterCoordinator(workers, servers=clients, placement=placement,
                                  treedef=treedef, on_shutdown=stop_servers, **self._liveness)

