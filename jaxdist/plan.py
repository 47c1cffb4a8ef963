"""A scaling planner: predicted step time and efficiency of data-parallel training on N x M devices.

The model is the standard alpha-beta (latency-bandwidth) cost of collectives: sending a message of
``b`` bytes over a link costs ``alpha + b / bandwidth`` (Hockney's model). For an all-reduce of
``S`` bytes per device over ``p`` devices (Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH", IJHPCA 2005; Patarasuk & Yuan, "Bandwidth optimal all-reduce
algorithms for clusters of workstations", JPDC 2009):

* ring (reduce-scatter then all-gather): ``2(p-1) alpha + 2(p-1)/p * S / B``; ``2(p-1)/p * S / t``
  is what nccl-tests calls bus bandwidth;
* tree (binomial reduce, then broadcast): ``2 ceil(log2 p) * (alpha + S / B)``;
* hierarchical over ``N`` hosts of ``M`` devices (reduce-scatter inside each host, ring across
  hosts on each device's ``1/M`` share with the host's ``M`` devices sharing its network link,
  all-gather inside each host): ``2(M-1) a_in + 2(M-1)/M * S / B_in + 2(N-1) a_out + 2(N-1)/N * S / B_out``;
* one device (tf's ``ReductionToOneDevice``): ``2(p-1) * (alpha + S / B)``.

A step is compute plus the all-reduces that are not hidden behind the backward pass; compute for a
per-device batch ``b`` is ``fixed + b * per_example``, scaled by how many devices really compute in
parallel (``compute_parallelism``: simulated CPU devices and local processes share the same cores,
so there it is 1, and compute does not scale with the device count). Every gradient leaf is one
message unless packed (``pack_bytes``) or fused by XLA (the global view on GPU/TPU).

Interconnect figures (`LINKS`) are nominal per-direction bandwidths from the vendors' documents
(named on each entry) and typical software latencies; measured bus bandwidth is usually 70-90% of
nominal, so calibrate (`measure_allreduce`) where you can.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence

logger = logging.getLogger(__name__)

ALGORITHMS = ("ring", "tree", "hierarchical", "one_device")


@dataclasses.dataclass(frozen=True)
class Link:
    """One level of interconnect: per-message latency (s) and per-device bandwidth (bytes/s, one way).

    ``sync_s`` is paid once per step and per other participant (``(p-1) * sync_s``) when a step's
    collectives span this link: starting a program whose first collective waits for every
    participant (dispatch, and across processes the first rendezvous, which waits for the last
    process to be scheduled). Negligible for NCCL/ICI; milliseconds between CPU processes
    (measured by `measure_allreduce`).

    >>> round(Link("example", latency_s=1e-5, bandwidth=1e9).transfer_s(1e6), 8)
    0.00101
    """

    name: str
    latency_s: float
    bandwidth: float
    source: str = ""
    sync_s: float = 0.0

    def __post_init__(self):
        if not (self.latency_s >= 0 and self.bandwidth > 0 and self.sync_s >= 0):
            raise ValueError(f"Link {self.name!r}: need latency_s >= 0 and bandwidth > 0, got "
                             f"latency_s={self.latency_s!r}, bandwidth={self.bandwidth!r}")

    def transfer_s(self, nbytes: float) -> float:
        """``alpha + nbytes / bandwidth``: one message of ``nbytes`` over this link."""
        return self.latency_s + nbytes / self.bandwidth


GB = 1e9
LINKS = {  # nominal one-way bandwidth per device; latencies are typical software figures (NCCL/MPI)
    "nvlink2": Link("NVLink 2 (V100, 6 links)", 5e-6, 150 * GB,
                    "NVIDIA NVLink page / DGX-1 V100 whitepaper: 6 links x 25 GB/s each way, 300 GB/s total"),
    "nvlink3": Link("NVLink 3 (A100, 12 links)", 5e-6, 300 * GB,
                    "NVIDIA A100 datasheet: 600 GB/s total GPU-to-GPU"),
    "nvlink4": Link("NVLink 4 (H100, 18 links)", 5e-6, 450 * GB,
                    "NVIDIA H100 datasheet: 900 GB/s total GPU-to-GPU"),
    "pcie3": Link("PCIe 3.0 x16", 1e-5, 15.75 * GB, "PCI-SIG: 8 GT/s x 16 lanes, 128b/130b"),
    "pcie4": Link("PCIe 4.0 x16", 1e-5, 31.5 * GB, "PCI-SIG: 16 GT/s x 16 lanes, 128b/130b"),
    "tpu-v4-ici": Link("TPU v4 ICI", 5e-6, 1.1e15 / 4096,
                       "Google Cloud TPU v4 docs: all-reduce bandwidth 1.1 PB/s per 4096-chip pod"),
    "ethernet-10g": Link("10 Gbit/s Ethernet (TCP)", 5e-5, 1.25 * GB, "IEEE 802.3ae line rate"),
    "ethernet-25g": Link("25 Gbit/s Ethernet / RoCE", 2e-5, 3.125 * GB,
                         "IEEE 802.3by line rate (Horovod's 512-GPU benchmark network)"),
    "ethernet-100g": Link("100 Gbit/s Ethernet", 2e-5, 12.5 * GB, "IEEE 802.3bj line rate"),
    "ib-edr": Link("InfiniBand EDR (100 Gbit/s)", 5e-6, 12.5 * GB, "InfiniBand Trade Association roadmap"),
    "ib-hdr": Link("InfiniBand HDR (200 Gbit/s)", 5e-6, 25 * GB, "InfiniBand Trade Association roadmap"),
}


def _log2ceil(p: int) -> int:
    return max(0, math.ceil(math.log2(p))) if p > 1 else 0


def allreduce_time(nbytes: float, *, hosts: int = 1, devices_per_host: int = 1, intra: Link,
                   inter: Link | None = None, algorithm: str = "ring") -> float:
    """Seconds for one all-reduce of ``nbytes`` per device under the alpha-beta model.

    Args:
      nbytes: bytes each device contributes (and receives reduced).
      hosts, devices_per_host: the job's shape, ``p = hosts * devices_per_host``.
      intra: the link between devices of one host.
      inter: the link between hosts (its bandwidth is the host's, shared by its devices);
        defaults to `intra`.
      algorithm: one of `ALGORITHMS`. Flat algorithms run at the slowest link's speed once they
        span several hosts.

    Returns:
      seconds (0 for a single device).

    Raises:
      ValueError: an unknown algorithm or a non-positive shape.

    >>> ring = allreduce_time(1e6, devices_per_host=4, intra=Link("l", 1e-5, 1e9))
    >>> round(ring * 1e6, 1)  # 2*3*10 us + 2*3/4 * 1 ms
    1560.0
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    if hosts < 1 or devices_per_host < 1:
        raise ValueError(f"hosts and devices_per_host must be >= 1, got {hosts} x {devices_per_host}")
    inter = inter or intra
    p, m, n = hosts * devices_per_host, devices_per_host, hosts
    if p == 1:
        return 0.0
    if algorithm == "hierarchical":
        inside = 2 * (m - 1) * intra.latency_s + 2 * (m - 1) / m * nbytes / intra.bandwidth
        across = (2 * (n - 1) * inter.latency_s + 2 * (n - 1) / n * nbytes / inter.bandwidth
                  if n > 1 else 0.0)
        return inside + across
    slow = inter if n > 1 and inter.bandwidth < intra.bandwidth else intra
    alpha = max(intra.latency_s, inter.latency_s) if n > 1 else intra.latency_s
    if algorithm == "ring":
        return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / slow.bandwidth
    if algorithm == "tree":
        return 2 * _log2ceil(p) * (alpha + nbytes / slow.bandwidth)
    return 2 * (p - 1) * (alpha + nbytes / slow.bandwidth)  # one_device


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A predicted step: its parts, and the scaling against one device with the same per-device batch."""

    hosts: int
    devices_per_host: int
    batch_per_device: int
    algorithm: str
    messages: int
    compute_s: float
    allreduce_s: float
    exposed_allreduce_s: float
    step_s: float
    single_device_step_s: float

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host

    @property
    def efficiency(self) -> float:
        """Throughput on all devices / (devices x one device's throughput): ``T(1) / T(N)``."""
        return self.single_device_step_s / self.step_s

    @property
    def speedup(self) -> float:
        return self.devices * self.efficiency

    @property
    def examples_per_s(self) -> float:
        return self.devices * self.batch_per_device / self.step_s


def _messages(param_bytes: float, num_leaves: int, pack_bytes: int | None, fused: bool) -> int:
    if fused:
        return 1
    if pack_bytes is None:
        return max(1, num_leaves)
    # leaves smaller than pack_bytes share buckets: with leaves of mean size, about this many
    mean = param_bytes / max(1, num_leaves)
    if mean >= pack_bytes:
        return max(1, num_leaves)
    return max(1, min(num_leaves, math.ceil(param_bytes / pack_bytes)))


def predict(param_bytes: float, step_time_s: float, *, hosts: int = 1, devices_per_host: int = 1,
            batch_per_device: int = 1, reference_batch: int | None = None, fixed_s: float = 0.0,
            num_leaves: int = 1, intra: Link | str = "nvlink3", inter: Link | str | None = None,
            algorithm: str = "ring", pack_bytes: int | None = None, fused: bool = False,
            overlap: float = 0.0, compute_parallelism: float | None = None) -> Prediction:
    """Predicts one data-parallel training step on ``hosts x devices_per_host`` devices.

    Args:
      param_bytes: bytes of the gradients all-reduced each step (parameter bytes, float32: 4 per
        parameter).
      step_time_s: one device's step time on ``reference_batch`` examples, without communication.
      hosts, devices_per_host: the job's shape.
      batch_per_device: the per-device batch of the prediction.
      reference_batch: the batch `step_time_s` was measured on (default: `batch_per_device`).
      fixed_s: the part of `step_time_s` that does not grow with the batch (dispatch, optimizer
        update); compute is ``fixed_s + batch * (step_time_s - fixed_s) / reference_batch``.
      num_leaves: gradient leaves: each is one all-reduce unless packed or fused.
      intra, inter: links (a `Link` or a key of `LINKS`) inside a host and between hosts.
      algorithm: one of `ALGORITHMS`.
      pack_bytes: leaves smaller than this are packed into buckets (``MirroredStrategy(pack_bytes=)``).
      fused: all gradients go in one all-reduce (XLA's all-reduce combiner in the global view on
        GPU/TPU; False on XLA:CPU across processes, which sends leaf by leaf).
      overlap: fraction in [0, 1] of the all-reduce hidden behind the backward pass (taken as 2/3
        of compute): 0 for a step that reduces after the backward pass (XLA:CPU), ~1 for DDP's
        bucketed overlap when buckets are ready early.
      compute_parallelism: how many devices compute truly in parallel, in units of the device that
        measured `step_time_s`; None means every device is its own processor. Simulated CPU devices
        or processes on one machine share its cores: pass 1 and compute does not scale.

    Returns:
      a `Prediction`.

    Raises:
      ValueError: a non-positive size or time, or overlap outside [0, 1].

    >>> p = predict(4e6, 0.010, devices_per_host=8, batch_per_device=64, intra=Link("l", 1e-5, 1e9))
    >>> round(p.allreduce_s * 1e3, 2), round(p.efficiency, 3)  # 14*10us + 7/4*4ms = 7.14 ms
    (7.14, 0.583)
    """
    if param_bytes <= 0 or step_time_s <= 0 or batch_per_device < 1:
        raise ValueError(f"need param_bytes > 0, step_time_s > 0 and batch_per_device >= 1; got "
                         f"{param_bytes!r}, {step_time_s!r}, {batch_per_device!r}")
    if not 0 <= overlap <= 1 or not 0 <= fixed_s < step_time_s:
        raise ValueError(f"need 0 <= overlap <= 1 and 0 <= fixed_s < step_time_s; got overlap="
                         f"{overlap!r}, fixed_s={fixed_s!r} (step_time_s={step_time_s!r})")
    intra, inter = _link(intra), _link(inter) if inter is not None else None
    ref = reference_batch or batch_per_device
    per_example = (step_time_s - fixed_s) / ref
    one = fixed_s + batch_per_device * per_example
    p = hosts * devices_per_host
    share = p / min(p, compute_parallelism) if compute_parallelism else 1.0
    compute = one * share
    messages = _messages(param_bytes, num_leaves, pack_bytes, fused)
    per_message = param_bytes / messages
    comm = messages * allreduce_time(per_message, hosts=hosts, devices_per_host=devices_per_host,
                                     intra=intra, inter=inter, algorithm=algorithm)
    if p > 1:
        comm += (p - 1) * (inter if hosts > 1 and inter is not None else intra).sync_s
    exposed = max(0.0, comm - overlap * min(comm, 2 / 3 * compute))
    return Prediction(hosts, devices_per_host, batch_per_device, algorithm, messages, compute, comm,
                      exposed, compute + exposed, one)


def _link(link: Link | str) -> Link:
    if isinstance(link, Link):
        return link
    if link not in LINKS:
        raise ValueError(f"unknown link {link!r}; expected a jaxdist.plan.Link or one of {sorted(LINKS)}")
    return LINKS[link]


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """What to pass to ``MirroredStrategy`` / ``MultiWorkerMirroredStrategy`` and a global batch."""

    cross_device_ops: str
    pack_bytes: int | None
    global_batch: int
    prediction: Prediction
    by_algorithm: dict
    reasons: tuple[str, ...]


# jaxdist's cross_device_ops and the model that describes each: "xla" is the runtime's own
# all-reduce (NCCL picks ring or tree on GPUs, ICI on TPUs, gloo's ring on CPUs).
_OPS = {"xla": ("ring", "tree"), "hierarchical": ("hierarchical",), "one_device": ("one_device",)}


def recommend(param_bytes: float, step_time_s: float, *, hosts: int = 1, devices_per_host: int = 1,
              batch_per_device: int = 32, num_leaves: int = 1, target_efficiency: float = 0.9,
              max_batch_per_device: int | None = None, **kwargs) -> Recommendation:
    """Recommends ``cross_device_ops``, ``pack_bytes`` and a global batch for a job.

    Takes `predict`'s arguments. The all-reduce with the lowest predicted time wins, but "xla" (the
    default, and the only one in the global view) is kept unless another is at least 10% faster.
    ``pack_bytes`` is set when there are several leaves: buckets large enough that each one's
    latency is at most 10% of its transfer (``b >= 10 p alpha B``), capped at 64 MiB, and all
    gradients in one bucket when they are smaller. The global batch is the smallest power-of-two
    multiple of `batch_per_device` (up to `max_batch_per_device`, default 16x) whose predicted
    efficiency reaches `target_efficiency`, times the device count.

    Returns:
      a `Recommendation`.

    Raises:
      ValueError: as `predict`.

    >>> r = recommend(1e9, 0.5, hosts=16, devices_per_host=8, num_leaves=300,
    ...               intra="nvlink3", inter="ethernet-10g")
    >>> r.cross_device_ops, r.pack_bytes == 64 * 2**20
    ('hierarchical', True)
    """
    kwargs = {k: v for k, v in kwargs.items() if k not in ("algorithm", "pack_bytes")}
    intra = _link(kwargs.pop("intra", "nvlink3"))
    inter = _link(kwargs.pop("inter", None) or intra)
    p = hosts * devices_per_host
    reasons = []
    pack = None
    if num_leaves > 1 and not kwargs.get("fused"):
        slow = inter if hosts > 1 else intra
        bucket = 10 * p * slow.latency_s * slow.bandwidth
        pack = int(2 ** math.ceil(math.log2(max(bucket, 2**16))))
        pack = min(pack, 64 * 2**20)
        if pack >= param_bytes:
            pack = int(2 ** math.ceil(math.log2(param_bytes + 1)))
            reasons.append(f"pack_bytes={pack}: all {num_leaves} leaves in one all-reduce "
                           f"({_fmt_bytes(param_bytes)} in all)")
        else:
            reasons.append(f"pack_bytes={pack}: buckets of {_fmt_bytes(pack)} keep each one's latency "
                           f"under 10% of its transfer")
    common = dict(hosts=hosts, devices_per_host=devices_per_host, num_leaves=num_leaves,
                  intra=intra, inter=inter, pack_bytes=pack, **kwargs)
    by_op = {}
    for op, algs in _OPS.items():
        by_op[op] = min((predict(param_bytes, step_time_s, batch_per_device=batch_per_device,
                                 algorithm=a, **common) for a in algs), key=lambda x: x.step_s)
    best = min(by_op, key=lambda o: by_op[o].allreduce_s)
    op = best if by_op[best].allreduce_s < 0.9 * by_op["xla"].allreduce_s else "xla"
    reasons.append(f"cross_device_ops={op!r}: predicted all-reduce " + ", ".join(
        f"{o} {by_op[o].allreduce_s * 1e3:.3g} ms" for o in by_op))
    algorithm = by_op[op].algorithm
    cap = max_batch_per_device or 16 * batch_per_device
    b = batch_per_device
    pred = predict(param_bytes, step_time_s, batch_per_device=b, reference_batch=batch_per_device,
                   algorithm=algorithm, **common)
    while pred.efficiency < target_efficiency and b * 2 <= cap:
        b *= 2
        pred = predict(param_bytes, step_time_s, batch_per_device=b,
                       reference_batch=batch_per_device, algorithm=algorithm, **common)
    reasons.append(f"global batch {b * p} ({b} per device): predicted efficiency "
                   f"{pred.efficiency:.1%}" + ("" if pred.efficiency >= target_efficiency else
                                               f", below the {target_efficiency:.0%} target even at "
                                               f"{cap} per device"))
    return Recommendation(op, pack, b * p, pred, by_op, tuple(reasons))


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:.4g} {unit}"
        b /= 1024
    raise AssertionError


def fit_link(name: str, sizes: Sequence[float], times: Sequence[float], participants: int) -> Link:
    """The `Link` whose ring all-reduce over `participants` best fits measured (size, time) pairs.

    A least-squares line ``t = a + c * S`` gives ``alpha = a / (2(p-1))`` and
    ``bandwidth = 2(p-1)/p / c``.

    >>> link = fit_link("x", [1e6, 3e6], [0.0016, 0.0046], 4)
    >>> round(link.latency_s * 1e6, 2), round(link.bandwidth / 1e9, 3)
    (16.67, 1.0)
    """
    if participants < 2 or len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError(f"need >= 2 participants and >= 2 (size, time) pairs; got {participants} "
                         f"participants, {len(sizes)} sizes, {len(times)} times")
    n = len(sizes)
    ms, mt = sum(sizes) / n, sum(times) / n
    var = sum((s - ms) ** 2 for s in sizes)
    c = sum((s - ms) * (t - mt) for s, t in zip(sizes, times)) / var if var else 0.0
    a = max(0.0, mt - c * ms)
    c = max(c, 1e-15)
    k = participants
    return Link(name, a / (2 * (k - 1)), 2 * (k - 1) / k / c, "measured here")


def measure_allreduce(devices=None, sizes: Sequence[int] = (2**16, 2**20, 2**22), reps: int = 5,
                      name: str | None = None, iters: int = 8) -> Link:
    """Measures XLA's all-reduce (psum) over `devices` and fits a `Link` to it (`fit_link`).

    Works in one process (simulated or real devices) and across processes (every process calls it
    with the same arguments; the default `devices` is ``jax.devices()``). As
    ``benchmarks/allreduce.py`` does, each call runs `iters` dependent all-reduces back to back, so
    that dispatching the program (paid once per step, not per collective) is not counted as
    latency. Compile is excluded; each size is the median of `reps` calls.

    Returns:
      the fitted `Link`.

    Raises:
      ValueError: fewer than two devices.

    >>> import jax
    >>> measure_allreduce(jax.devices()[:2], sizes=(2**12, 2**14), reps=1).bandwidth > 0
    True
    """
    import jax
    import numpy as np

    devices = list(devices or jax.devices())
    if len(devices) < 2:
        raise ValueError(f"measure_allreduce needs >= 2 devices, got {len(devices)}; on CPU set "
                         "jax.config.update('jax_num_cpu_devices', N) before JAX starts")
    k = len(devices)
    mesh = jax.make_mesh((k,), ("d",), devices=devices, axis_types=(jax.sharding.AxisType.Explicit,))
    sharding = jax.sharding.NamedSharding(mesh, jax.P("d"))

    def body(x):  # mean keeps values bounded; each reduction depends on the previous one
        return jax.lax.fori_loop(0, iters, lambda _, v: jax.lax.psum(v, "d") / k, x)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("d"), out_specs=jax.P("d"),
                               check_vma=False))
    mine = sum(d.process_index == jax.process_index() for d in devices)
    times = []
    for size in sizes:
        n = size // 4
        x = jax.make_array_from_process_local_data(sharding, np.ones((n * mine,), np.float32),
                                                   (n * k,))
        jax.block_until_ready(fn(x))
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            samples.append((time.perf_counter() - t0) / iters)
        times.append(sorted(samples)[len(samples) // 2])
    link = fit_link(name or f"psum over {k} {devices[0].platform} devices", sizes, times, k)
    # one small all-reduce per call: what a step pays once to start its collectives
    once = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=jax.P("d"),
                                 out_specs=jax.P("d"), check_vma=False))
    x = jax.make_array_from_process_local_data(sharding, np.ones((1024 * mine,), np.float32),
                                               (1024 * k,))
    jax.block_until_ready(once(x))
    samples = []
    for _ in range(max(reps, 5)):
        t0 = time.perf_counter()
        jax.block_until_ready(once(x))
        samples.append(time.perf_counter() - t0)
    call = sorted(samples)[len(samples) // 2]
    sync = max(0.0, call - allreduce_time(4096, devices_per_host=k, intra=link)) / (k - 1)
    link = dataclasses.replace(link, sync_s=sync)
    logger.info("measured %s: %s; one call %.3g s", link.name, list(zip(sizes, times)), call)
    return link


def measure_step(model: str = "mlp", batch: int = 64, *, steps: int = 20,
                 reps: int = 3) -> tuple[float, float]:
    """One device's step time for a built-in model (Adam, cross-entropy) and its batch-independent part.

    Times ``batch`` and ``2 * batch`` on ``jax.devices()[0]`` (compile excluded, median of `reps`
    windows of `steps`), and splits the step as ``fixed + batch * per_example``.

    Returns:
      ``(step_time_s at batch, fixed_s)``.

    >>> step_s, fixed_s = measure_step("mlp", 8, steps=2, reps=1)
    >>> step_s > 0 and 0 <= fixed_s < step_s
    True
    """
    import jax
    import numpy as np
    import optax

    from jaxdist import models

    net = models.get(model)
    shape = (784,) if model == "mlp" else (28, 28, 1)

    def loss_fn(params, x, y):
        logits = net.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(state, x, y):
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, x, y))

    fn = jax.jit(step, donate_argnums=0)
    out = {}
    for b in (batch, 2 * batch):
        rng = np.random.default_rng(0)
        x = jax.device_put(rng.standard_normal((b, *shape), dtype=np.float32))
        y = jax.device_put(rng.integers(0, 10, b).astype(np.int32))
        state = fn(models.create_train_state(net, x[:1]), x, y)
        jax.block_until_ready(state)
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(steps):
                state = fn(state, x, y)
            jax.block_until_ready(state)
            samples.append((time.perf_counter() - t0) / steps)
        out[b] = sorted(samples)[len(samples) // 2]
    per_example = max(0.0, (out[2 * batch] - out[batch]) / batch)
    fixed = min(max(0.0, out[batch] - batch * per_example), 0.95 * out[batch])
    return out[batch], fixed


def model_size(model: str) -> tuple[int, int]:
    """``(parameter bytes, leaf count)`` of a built-in model (``"mlp"`` or ``"cnn"``), float32.

    >>> model_size("mlp")  # 784*256+256 + 256*128+128 + 128*10+10 parameters
    (940584, 6)
    """
    import jax
    import jax.numpy as jnp

    from jaxdist import models

    shape = (1, 784) if model == "mlp" else (1, 28, 28, 1)
    params = jax.eval_shape(lambda: models.get(model).init(jax.random.key(0), jnp.zeros(shape)))
    leaves = jax.tree.leaves(params)
    return sum(4 * x.size for x in leaves), len(leaves)


def scaling_table(param_bytes: float, step_time_s: float, *, hosts: int, devices_per_host: int,
                  algorithm: str, **kwargs) -> str:
    """A markdown table of predictions from one device up to ``hosts x devices_per_host``.

    >>> print(scaling_table(4e6, 0.01, hosts=1, devices_per_host=2, algorithm="ring",
    ...                     intra=Link("l", 1e-5, 1e9)).splitlines()[-1])
    | 1 x 2 | 14.02 | 4.02 | 4.02 | 71.3% | 1.43 |
    """
    shapes = [(1, m) for m in _powers(devices_per_host)] + [(n, devices_per_host)
                                                          for n in _powers(hosts) if n > 1]
    lines = ["| hosts x devices | step ms | all-reduce ms | exposed ms | efficiency | speed-up |",
             "|---|---|---|---|---|---|"]
    for n, m in shapes:
        p = predict(param_bytes, step_time_s, hosts=n, devices_per_host=m, algorithm=algorithm,
                    **kwargs)
        lines.append(f"| {n} x {m} | {p.step_s * 1e3:.2f} | {p.allreduce_s * 1e3:.2f} | "
                     f"{p.exposed_allreduce_s * 1e3:.2f} | {p.efficiency:.1%} | {p.speedup:.2f} |")
    return "\n".join(lines)


def _powers(n: int) -> list[int]:
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    return out + [n]


def _seconds(text: str) -> float:
    text = str(text).strip().lower()
    for suffix, scale in (("ms", 1e-3), ("us", 1e-6), ("s", 1.0)):
        if text.endswith(suffix):
            return float(text[:-len(suffix)]) * scale
    return float(text)


def run_cli(args) -> str:
    """``jaxdist plan``: the report for parsed command-line arguments (see ``jaxdist plan -h``).

    Raises:
      SystemExit: missing or contradictory options, with what to pass instead.

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> add_arguments(parser)
    >>> print(run_cli(parser.parse_args(["--model", "mlp", "--step-time", "2ms"])).splitlines()[0])
    model: 918.5 KiB of gradients in 6 leaves; one device: 2.000 ms per step at batch 64
    """
    lines = []
    if args.calibrate:
        import jax

        jax.config.update("jax_num_cpu_devices", max(2, args.calibrate_devices))
    param_bytes, leaves = (model_size(args.model) if args.model else (None, None))
    param_bytes = float(args.param_bytes) if args.param_bytes else param_bytes
    leaves = args.leaves or leaves or 1
    if param_bytes is None:
        raise SystemExit("jaxdist plan: give --model {mlp,cnn} or --param-bytes N (and --leaves L)")
    fixed = args.fixed_time and _seconds(args.fixed_time) or 0.0
    if args.step_time:
        step = _seconds(args.step_time)
    elif args.calibrate and args.model:
        step, fixed = measure_step(args.model, args.batch)
        lines.append(f"measured here: one device, {args.model} at batch {args.batch}: "
                     f"{step * 1e3:.3f} ms per step, of which {fixed * 1e3:.3f} ms batch-independent")
    else:
        raise SystemExit("jaxdist plan: give --step-time (one device's step, e.g. 12ms) or "
                         "--calibrate with --model to measure it here")
    intra, inter = args.intra, args.inter
    if args.calibrate:
        import jax

        link = measure_allreduce(jax.devices()[:args.calibrate_devices])
        lines.append(f"measured here: {link.name}: alpha {link.latency_s * 1e6:.1f} us, "
                     f"bandwidth {link.bandwidth / 1e9:.3f} GB/s (ring fit), "
                     f"{link.sync_s * 1e6:.0f} us per step to start")
        intra = link if intra == "measured" else intra
        inter = link if inter == "measured" else inter
    for name, link in (("intra", intra), ("inter", inter)):
        if link == "measured":
            raise SystemExit(f"jaxdist plan: --{name} measured needs --calibrate")
    rec = recommend(param_bytes, step, hosts=args.hosts, devices_per_host=args.devices_per_host,
                    batch_per_device=args.batch, num_leaves=leaves, intra=intra, inter=inter,
                    fixed_s=fixed, overlap=args.overlap, fused=args.fused,
                    compute_parallelism=args.compute_parallelism,
                    target_efficiency=args.target_efficiency)
    lines += [f"model: {_fmt_bytes(param_bytes)} of gradients in {leaves} leaves; one device: "
              f"{step * 1e3:.3f} ms per step at batch {args.batch}",
              f"job: {args.hosts} host(s) x {args.devices_per_host} device(s); links: "
              f"{_link(intra).name} inside a host, {_link(inter or intra).name} between hosts", "",
              f"predicted with cross_device_ops={rec.cross_device_ops!r}, pack_bytes={rec.pack_bytes}, "
              f"batch {args.batch} per device:", "",
              scaling_table(param_bytes, step, hosts=args.hosts, devices_per_host=args.devices_per_host,
                            algorithm=rec.by_algorithm[rec.cross_device_ops].algorithm,
                            batch_per_device=args.batch, num_leaves=leaves, intra=intra, inter=inter,
                            fixed_s=fixed, overlap=args.overlap, fused=args.fused,
                            pack_bytes=rec.pack_bytes, compute_parallelism=args.compute_parallelism),
              "", "recommendation:"]
    lines += [f"  {r}" for r in rec.reasons]
    lines.append(f"  -> jaxdist.MirroredStrategy(cross_device_ops={rec.cross_device_ops!r}, "
                 f"pack_bytes={rec.pack_bytes}) with global batch {rec.global_batch}")
    return "\n".join(lines)


def add_arguments(p) -> None:
    """The options of ``jaxdist plan`` on an ``argparse`` parser.

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> add_arguments(parser)
    >>> parser.parse_args(["--model", "cnn"]).devices_per_host
    8
    """
    p.add_argument("--model", choices=("mlp", "cnn"), help="a built-in model (sizes from it)")
    p.add_argument("--param-bytes", help="gradient bytes all-reduced per step (e.g. 102e6)")
    p.add_argument("--leaves", type=int, default=None, help="gradient leaves (arrays)")
    p.add_argument("--step-time", help="one device's step time at --batch (e.g. 12ms, 0.3s)")
    p.add_argument("--fixed-time", help="the part of --step-time that does not grow with the batch")
    p.add_argument("--batch", type=int, default=64, help="per-device batch of --step-time")
    p.add_argument("--hosts", type=int, default=1)
    p.add_argument("--devices-per-host", type=int, default=8)
    p.add_argument("--intra", default="nvlink3",
                   help=f"link inside a host: one of {', '.join(sorted(LINKS))} or 'measured'")
    p.add_argument("--inter", default=None, help="link between hosts (default: --intra)")
    p.add_argument("--overlap", type=float, default=0.0,
                   help="fraction of the all-reduce hidden behind the backward pass (0..1)")
    p.add_argument("--fused", action="store_true",
                   help="all gradients in one all-reduce (XLA's combiner on GPU/TPU)")
    p.add_argument("--compute-parallelism", type=float, default=None,
                   help="devices that compute truly in parallel (1 for simulated CPU devices)")
    p.add_argument("--target-efficiency", type=float, default=0.9)
    p.add_argument("--calibrate", action="store_true",
                   help="measure here: one device's step time (--model) and XLA's all-reduce "
                        "over --calibrate-devices simulated devices (use with --intra measured)")
    p.add_argument("--calibrate-devices", type=int, default=8)
