"""Where each launched process runs: its place in the job (torchrun's variables) and its GPUs.

``jaxdist launch`` (``group._Launcher.child_env``) tells every process of an SPMD job, single
host or elastic:

* its place, in torchrun's variables (``torchrun_env``), beside jaxdist's own ``JAXDIST_*``;
* on a host with GPUs, its own GPUs (``GpuPlan``): process ``i`` of the host gets GPUs
  ``i*K .. i*K+K-1`` through ``JAX_LOCAL_DEVICE_IDS``, which ``jax.distributed.initialize`` reads
  as its ``local_device_ids`` (JAX's own multi-process launcher does the same). Every GPU stays
  visible to CUDA, so NCCL can still use NVLink and CUDA IPC between the processes of a host, and
  a script written for torchrun that passes ``local_device_ids=[LOCAL_RANK]`` gets the same GPU;
* on a host with GPUs, XLA's execution deadman (``gpu_host_env``), so that a collective blocked
  on a peer that never entered it ends the process instead of hanging for ever (jax-ml/jax#38503).

Under SLURM without the launcher, ``slurm_local_device_ids`` gives ``jaxdist.initialize`` the
devices of the task where JAX's own guess (``[SLURM_LOCALID]``) is wrong: a task bound to its
own GPUs with ``--gpus-per-task`` sees them as devices 0.. (jax-ml/jax#28194), and one task per
node should drive all of the node's GPUs.

How GPUs are found, without touching CUDA: ``JAXDIST_GPU_COUNT`` when set (a stand-in: the tests
pretend to be a GPU host with it; also an override where detection fails), else ``nvidia-smi -L``,
else ``/proc/driver/nvidia/gpus``; ``CUDA_VISIBLE_DEVICES``, when set, says which of them the
processes may use.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import subprocess
from collections.abc import Mapping

ENV_GPU_COUNT = "JAXDIST_GPU_COUNT"
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"  # read by jax.distributed.initialize
# torchrun's per-process variables (GROUP_* are the host's place among the job's hosts).
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE")
DEADMAN_FLAG = "--xla_gpu_execution_terminate_timeout"
DEADMAN_DEFAULT = "30m"
# What a user sets to size JAX's GPU memory pool; jaxdist leaves the pool alone when any is set.
_POOL_VARS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
              "XLA_PYTHON_CLIENT_ALLOCATOR")
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
               "SLURM_LOCALID")  # those JAX's SLURM detection requires


def torchrun_env(rank: int, world_size: int, local_rank: int, local_world_size: int,
                 group_rank: int = 0, group_world_size: int = 1) -> dict[str, str]:
    """torchrun's variables for one process, with torchrun's meanings.

    Args:
      rank: the process's rank in the job (``jax.process_index()``).
      world_size: the job's process count.
      local_rank: its rank among the processes of its host.
      local_world_size: how many processes its host runs.
      group_rank: its host's place among the job's hosts (an elastic round's order).
      group_world_size: how many hosts the job has.

    Returns:
      ``{"RANK": ..., "LOCAL_RANK": ..., ...}`` as strings.

    >>> torchrun_env(3, 4, 1, 2, group_rank=1, group_world_size=2)["LOCAL_RANK"]
    '1'
    """
    values = (rank, local_rank, world_size, local_world_size, group_rank, group_world_size)
    return {name: str(v) for name, v in zip(TORCHRUN_VARS, values)}


def _cuda_visible(text: str) -> tuple[str, ...]:
    """The devices ``CUDA_VISIBLE_DEVICES`` names, as CUDA reads it: up to the first invalid
    entry (``-1``, or SLURM's ``NoDevFiles``), so ``""`` and ``"-1"`` name none.

    >>> _cuda_visible("4,5, 7"), _cuda_visible(""), _cuda_visible("0,-1,1")
    (('4', '5', '7'), (), ('0',))
    """
    out = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry or entry.startswith("-") or entry == "NoDevFiles":
            break
        out.append(entry)
    return tuple(out)


def _physical_gpus(environ: Mapping[str, str]) -> tuple[int, str]:
    """``(count, how it was found)`` of this host's NVIDIA GPUs (0 when there are none)."""
    given = environ.get(ENV_GPU_COUNT)
    if given is not None:
        # At most 4 digits: a host has a few GPUs, and a plan lists each (1e20 built a list
        # of 1e20 entries).
        if not (given.isascii() and given.isdigit() and len(given) <= 4):
            raise ValueError(f"{ENV_GPU_COUNT} = {given[:40]!r}: expected a GPU count (0 to "
                             f"9999). Fix: set it to this host's number of GPUs, or unset it.")
        return int(given), ENV_GPU_COUNT
    try:
        listed = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        listed = None
    smi = shutil.which("nvidia-smi", path=environ.get("PATH"))
    # With CUDA_VISIBLE_DEVICES set, only "are there GPUs at all" matters: the cheap look does.
    if smi and (listed is None or "CUDA_VISIBLE_DEVICES" not in environ):
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                return sum(line.startswith("GPU ") for line in out.stdout.splitlines()), \
                    "nvidia-smi -L"
        except (OSError, subprocess.SubprocessError):
            pass  # a broken driver install: fall back to what the kernel lists
    return listed or 0, "/proc/driver/nvidia/gpus"


def visible_gpus(environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """How many GPUs this host's processes may use, and how that was found.

    Zero where there is no NVIDIA GPU, and where ``JAX_PLATFORMS`` leaves GPUs out (e.g.
    ``JAX_PLATFORMS=cpu``: the processes run on simulated CPU devices).

    Args:
      environ: the environment the processes will get (default ``os.environ``).

    Returns:
      ``(count, a few words on where the count came from)``.

    Raises:
      ValueError: ``JAXDIST_GPU_COUNT`` is set but not a count.

    >>> visible_gpus({"JAXDIST_GPU_COUNT": "8", "CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    (4, 'JAXDIST_GPU_COUNT=8, CUDA_VISIBLE_DEVICES=4,5,6,7')
    """
    environ = os.environ if environ is None else environ
    platforms = {p.strip() for p in environ.get("JAX_PLATFORMS", "").lower().split(",")} - {""}
    if platforms and not platforms & {"cuda", "gpu"}:
        return 0, f"JAX_PLATFORMS={environ['JAX_PLATFORMS']}"
    count, how = _physical_gpus(environ)
    if how == ENV_GPU_COUNT:
        how = f"{ENV_GPU_COUNT}={count}"
    if count and "CUDA_VISIBLE_DEVICES" in environ:
        text = environ["CUDA_VISIBLE_DEVICES"]
        count, how = len(_cuda_visible(text)), f"{how}, CUDA_VISIBLE_DEVICES={text}"
    return count, how


@dataclasses.dataclass(frozen=True)
class GpuPlan:
    """Which GPUs each of a host's processes gets (see `plan_gpus`).

    Attributes:
      gpus: the GPUs the host's processes may use, numbered 0.. as CUDA numbers them.
      per_process: how many each process gets.
      nproc: the host's process count.
      visible: the ``CUDA_VISIBLE_DEVICES`` entries the launcher was given, if any.
      how: where the GPU count came from (for messages).
    """

    gpus: int
    per_process: int
    nproc: int
    visible: tuple[str, ...] | None = None
    how: str = ""

    def env(self, local_rank: int) -> dict[str, str]:
        """What local process ``local_rank`` is told.

        >>> GpuPlan(8, 2, 4).env(1)
        {'JAX_LOCAL_DEVICE_IDS': '2,3'}
        >>> GpuPlan(4, 2, 1, visible=("4", "5", "6", "7")).env(0)
        {'CUDA_VISIBLE_DEVICES': '4,5', 'JAX_LOCAL_DEVICE_IDS': '0,1'}
        """
        first = local_rank * self.per_process
        ids = range(first, first + self.per_process)
        if self.nproc == 1 and self.per_process < self.gpus:
            # A host's only process may never call jax.distributed.initialize (a one-process
            # job does not), so JAX_LOCAL_DEVICE_IDS alone would not hold it to its GPUs; with
            # no sibling process on the host, hiding the others from CUDA costs nothing.
            names = self.visible or tuple(str(i) for i in range(self.gpus))
            return {"CUDA_VISIBLE_DEVICES": ",".join(names[i] for i in ids),
                    ENV_LOCAL_DEVICE_IDS: ",".join(str(i) for i in range(self.per_process))}
        return {ENV_LOCAL_DEVICE_IDS: ",".join(str(i) for i in ids)}

    def describe(self) -> str:
        """One line for the launcher's log.

        >>> print(GpuPlan(8, 2, 3, how="nvidia-smi -L").describe())  # doctest: +NORMALIZE_WHITESPACE
        GPUs: 8 on this host (nvidia-smi -L); 2 per process (process i of the host: GPUs 2i..2i+1,
        as JAX_LOCAL_DEVICE_IDS); GPUs 6..7 unused
        """
        k = self.per_process
        which = "GPU i" if k == 1 else f"GPUs {k}i..{k}i+{k - 1}"
        used = self.nproc * k
        unused = "" if used == self.gpus else (
            f"; GPU {used} unused" if used + 1 == self.gpus else
            f"; GPUs {used}..{self.gpus - 1} unused")
        return (f"GPUs: {self.gpus} on this host ({self.how}); {k} per process (process i of the "
                f"host: {which}, as {ENV_LOCAL_DEVICE_IDS}){unused}")


def plan_gpus(environ: Mapping[str, str], nproc: int,
              devices_per_process: int | None) -> GpuPlan | None:
    """Splits this host's GPUs over its ``nproc`` processes; None on a host without GPUs.

    Args:
      environ: the environment the processes will get.
      nproc: how many processes this host runs (``-n``).
      devices_per_process: GPUs per process (``--devices-per-process``); None splits the
        host's GPUs evenly.

    Returns:
      The plan, or None (no GPU here, or ``JAX_PLATFORMS`` leaves GPUs out).

    Raises:
      ValueError: the processes need more GPUs than the host has (one line: the counts and the
        fix), or ``JAXDIST_GPU_COUNT`` is not a count.

    >>> plan_gpus({"JAXDIST_GPU_COUNT": "8"}, 4, None).per_process
    2
    >>> plan_gpus({"JAXDIST_GPU_COUNT": "0"}, 4, 2) is None
    True
    """
    gpus, how = visible_gpus(environ)
    if gpus == 0:
        return None
    per = devices_per_process or gpus // nproc
    if per == 0 or nproc * per > gpus:
        need = (f"-n {nproc} x --devices-per-process {per} needs {nproc * per} GPUs"
                if devices_per_process else f"-n {nproc} needs at least {nproc} GPUs (one each)")
        fix = (f"lower -n or --devices-per-process so that N x K <= {gpus}" if devices_per_process
               else f"use -n {gpus} or fewer")
        raise ValueError(f"{need}, but this host has {gpus} ({how}). Fix: {fix}, or set "
                         "JAX_PLATFORMS=cpu to run on simulated CPU devices instead.")
    visible = (_cuda_visible(environ["CUDA_VISIBLE_DEVICES"])
               if "CUDA_VISIBLE_DEVICES" in environ else None)
    return GpuPlan(gpus, per, nproc, visible, how)


def gpu_host_env(env: Mapping[str, str], hang_timeout_s: float | None,
                 shared: bool = False) -> dict[str, str]:
    """What jaxdist adds for a process on a GPU host, leaving what the user set alone.

    * XLA's execution deadman, appended to ``XLA_FLAGS`` unless it is there: an execution (a
      step) that runs longer than 30 minutes, or twice ``--hang-timeout`` when that is given,
      ends the process with an error instead of waiting for ever in a collective that a peer
      never entered. Compilation does not count.
    * ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` when ``shared`` (several processes use the same
      GPUs: a parameter-server job), unless any ``XLA_PYTHON_CLIENT_*`` pool setting is set:
      each process would otherwise take 75% of every GPU's memory at its start.

    Args:
      env: the process's environment so far.
      hang_timeout_s: ``--hang-timeout``, if given.
      shared: whether the host's processes share their GPUs.

    Returns:
      The variables to set.

    >>> gpu_host_env({"XLA_FLAGS": "--xla_dump_to=/tmp/d"}, 60)
    {'XLA_FLAGS': '--xla_dump_to=/tmp/d --xla_gpu_execution_terminate_timeout=120s'}
    """
    out = {}
    flags = env.get("XLA_FLAGS", "")
    if DEADMAN_FLAG not in flags:
        value = (DEADMAN_DEFAULT if hang_timeout_s is None
                 else f"{max(1, math.ceil(2 * hang_timeout_s))}s")
        out["XLA_FLAGS"] = f"{flags} {DEADMAN_FLAG}={value}".strip()
    if shared and not any(name in env for name in _POOL_VARS):
        out["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return out


def _tasks_per_node(text: str) -> list[int]:
    """SLURM's compact task counts, node by node.

    >>> _tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
    """
    out = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ValueError(part)
        out += [int(match[1])] * int(match[2] or 1)
    return out


def _local_tasks(environ: Mapping[str, str]) -> int | None:
    """How many tasks of this job step run on this node, or None when SLURM does not say."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        try:
            counts = _tasks_per_node(environ[name])
        except (KeyError, ValueError):
            continue
        node = environ.get("SLURM_NODEID")
        if node is not None and node.isdigit() and int(node) < len(counts):
            return counts[int(node)]
        if len(set(counts)) == 1:
            return counts[0]
    per = environ.get("SLURM_NTASKS_PER_NODE", "")
    return int(per) if per.isdigit() else None


def slurm_local_device_ids(environ: Mapping[str, str] | None = None) -> list[int] | None:
    """The GPUs a SLURM task should drive, where JAX's own guess is wrong; None to let JAX guess.

    JAX's SLURM detection gives task ``SLURM_LOCALID`` the one GPU of that number. That breaks
    when SLURM binds each task to its own GPUs (``--gpus-per-task``, ``--gpu-bind``): the task
    sees them as devices 0.., and a task of local id 3 asks for a device that does not exist
    (jax-ml/jax#28194). It also leaves all but one GPU idle when a node runs one task. Here the
    GPUs this task sees are split over the node's tasks: all of them when the task was bound
    to its own, an even share when every task sees every GPU, and several tasks to a GPU
    when there are more tasks than GPUs.

    Args:
      environ: the environment to read (default ``os.environ``).

    Returns:
      Device ids for ``jax.distributed.initialize(local_device_ids=...)``, or None: not a
      SLURM task, no GPU, ``JAX_LOCAL_DEVICE_IDS`` already set (JAX reads it), or a layout
      this cannot tell apart.

    >>> slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "8",
    ...          "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    ...          "SLURM_NODEID": "1", "JAXDIST_GPU_COUNT": "4"}
    >>> slurm_local_device_ids({**slurm, "SLURM_GPUS_PER_TASK": "1", "CUDA_VISIBLE_DEVICES": "1"})
    [0]
    >>> slurm_local_device_ids(slurm)  # every task sees the node's 4 GPUs
    [1]
    """
    environ = os.environ if environ is None else environ
    if not all(name in environ for name in _SLURM_VARS) or environ.get(ENV_LOCAL_DEVICE_IDS):
        return None
    try:
        gpus, _ = visible_gpus(environ)
    except ValueError:
        return None
    local_id = environ["SLURM_LOCALID"]
    if gpus == 0 or not local_id.isdigit():
        return None
    local_rank, tasks = int(local_id), _local_tasks(environ)
    per_task = re.search(r"(\d+)$", environ.get("SLURM_GPUS_PER_TASK", ""))
    if per_task and int(per_task[1]) > 0:
        k = int(per_task[1])
        if gpus == k:  # bound: this task sees its own GPUs only
            return list(range(k))
        if tasks and gpus == k * tasks:  # unbound: every task sees the node's GPUs
            return list(range(local_rank * k, local_rank * k + k))
        return None
    if not tasks or local_rank >= tasks:
        return None
    if gpus % tasks == 0:
        k = gpus // tasks
        return list(range(local_rank * k, local_rank * k + k))
    if tasks % gpus == 0:
        return [local_rank // (tasks // gpus)]
    return None
