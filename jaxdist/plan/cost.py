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
nominal, so calibrate (`jaxdist.plan.measure.measure_allreduce`, `jaxdist plan --calibrate`)
where you can.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from jaxdist.core import collectives

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
    # Each cross_device_ops value priced by the models its descriptor names ("xla" is the runtime's
    # own all-reduce: NCCL picks ring or tree on GPUs, ICI on TPUs, gloo's ring on CPUs).
    for op, spec in collectives.OPS.items():
        by_op[op] = min((predict(param_bytes, step_time_s, batch_per_device=batch_per_device,
                                 algorithm=a, **common) for a in spec.cost_models), key=lambda x: x.step_s)
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


# --- memory per device, per zero_stage -------------------------------------------------------------
OPTIMIZER_SLOTS = {"sgd": 0, "momentum": 1, "adagrad": 1, "rmsprop": 1, "lion": 1, "adam": 2,
                   "adamw": 2, "lamb": 2}
"""Optimizer state per parameter, in parameter-sized arrays (optax's: Adam keeps ``mu`` and ``nu``)."""

PRECISIONS = {  # (stored parameter bytes, gradient bytes, compute-copy bytes made during a step)
    "float32": (4, 4, 0),
    "mixed_bfloat16": (4, 4, 2),  # float32 parameters, a bfloat16 copy for the forward pass
    "mixed_float16": (4, 4, 2),
    "bfloat16": (2, 2, 0),
}
"""Bytes per parameter under each ``jaxdist.precision`` policy: mixed policies keep float32
parameters (and float32 gradients, as ``jaxdist.precision.value_and_grad`` returns them) and cast a
16-bit copy for the computation; optimizer state has the parameters' dtype."""


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Bytes per device of one ``zero_stage`` (activations not included: they depend on the batch).

    Attributes:
      stage: the ``zero_stage``.
      params, opt_state: bytes per device kept between steps.
      step_extra: bytes per device that exist only during a step: gradients (split over the
        devices at stages 2-3), the 16-bit compute copy of mixed precision, and at stage 3 the
        parameters gathered for the forward and backward passes.
    """

    stage: int
    params: float
    opt_state: float
    step_extra: float

    @property
    def state(self) -> float:
        """Bytes kept between steps."""
        return self.params + self.opt_state

    @property
    def peak(self) -> float:
        """Bytes during a step (state plus ``step_extra``), activations aside."""
        return self.state + self.step_extra


def stage_memory(num_params: float, devices: int, *, optimizer: str = "adam",
                 precision: str = "float32", opt_bytes: float | None = None) -> list[StageMemory]:
    """Bytes per device of the train state at each ``zero_stage`` on ``devices`` replicas.

    Stage 1 divides the optimizer state by the device count, stage 2 the gradients too, stage 3
    the stored parameters too (jaxdist gathers them whole for the step's computation, as
    ``fully_shard(reshard_after_forward=False)`` does, so they count once in ``step_extra``).
    Leaves too small to shard (``jaxdist.zero.MIN_SHARD_BYTES``) are ignored here: for a model worth
    sharding they are a rounding error.

    Args:
      num_params: the parameter count.
      devices: the replicas the state is sharded over.
      optimizer: a key of ``OPTIMIZER_SLOTS``.
      precision: a key of ``PRECISIONS``.
      opt_bytes: the optimizer state's bytes when known exactly (it replaces ``optimizer``).

    Returns:
      One ``StageMemory`` per stage, 0 to 3.

    Raises:
      ValueError: an unknown optimizer or precision, or a non-positive size.

    >>> [round(m.peak / 1e9, 1) for m in stage_memory(7.5e9, 64, precision="float32")]
    [120.0, 60.9, 31.4, 31.9]
    """
    if optimizer not in OPTIMIZER_SLOTS and opt_bytes is None:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_SLOTS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {sorted(PRECISIONS)}")
    if num_params <= 0 or devices < 1:
        raise ValueError(f"need num_params > 0 and devices >= 1, got {num_params!r}, {devices!r}")
    pb, gb, cb = PRECISIONS[precision]
    p, g, c = num_params * pb, num_params * gb, num_params * cb
    o = opt_bytes if opt_bytes is not None else num_params * OPTIMIZER_SLOTS[optimizer] * pb
    n = devices
    return [StageMemory(0, p, o, g + c), StageMemory(1, p, o / n, g + c),
            StageMemory(2, p, o / n, g / n + c), StageMemory(3, p / n, o / n, g / n + c + p)]


def recommend_stage(memory: list[StageMemory], device_memory: float) -> tuple[int | None, str]:
    """The lowest ``zero_stage`` whose peak fits ``device_memory`` bytes, and why.

    Lower stages move fewer bytes (stage 3 gathers the parameters every step), so the lowest one
    that fits wins. Activations are not modelled: leave room for them.

    Args:
      memory: ``stage_memory(...)``'s result.
      device_memory: bytes of memory per device.

    Returns:
      ``(stage, reason)``; ``stage`` is None when no stage fits.

    >>> recommend_stage(stage_memory(7.5e9, 64), 40e9)[0]
    2
    """
    for m in memory:
        if m.peak <= device_memory:
            why = ("the replicated state fits" if m.stage == 0 else
                   f"replicated needs {_fmt_bytes(memory[0].peak)} per device, more than "
                   f"{_fmt_bytes(device_memory)}; zero_stage={m.stage} needs {_fmt_bytes(m.peak)}")
            return m.stage, why
    return None, (f"no stage fits {_fmt_bytes(device_memory)} per device (stage 3 needs "
                  f"{_fmt_bytes(memory[-1].peak)} before activations): use more devices, a lower "
                  "precision or a smaller optimizer state")
