"""What `jaxdist launch` tells each process: torchrun's variables (single host and elastic, where
they change when the job re-forms) and, on a host with GPUs, its own GPUs and XLA's deadman.

No GPU is needed: ``JAXDIST_GPU_COUNT`` stands in for the host's GPUs, and the processes print
their environment instead of starting JAX (one test starts JAX to show it takes the GPUs it is
told). SLURM's layouts are checked on ``slurm_local_device_ids`` and through
``jaxdist.initialize``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from jaxdist.launch import _placement
from jaxdist.launch import launcher as launch
from jaxdist.launch.rendezvous import RendezvousClient, RendezvousError
from tests.conftest import REPO, run_python

pytestmark = pytest.mark.multiprocess

SHOWN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
         "JAXDIST_PROCESS_ID", "JAXDIST_RESTART_COUNT", "JAX_LOCAL_DEVICE_IDS",
         "CUDA_VISIBLE_DEVICES", "XLA_FLAGS", "JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES",
         "XLA_PYTHON_CLIENT_PREALLOCATE", "TF_CONFIG")
# Prints what the process was told, as one JSON line; never starts JAX.
SHOW = ("import json, os; print('ENV ' + json.dumps({k: os.environ.get(k) for k in %r}))"
        % (SHOWN,))
DEADMAN = "--xla_gpu_execution_terminate_timeout"


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=REPO)
    for name in ("TF_CONFIG", "JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "JAX_PLATFORMS",
                 "CUDA_VISIBLE_DEVICES", _placement.ENV_GPU_COUNT, *_placement.TORCHRUN_VARS):
        env.pop(name, None)
    env.update(extra)
    return env


def _told(output: str) -> dict[str, dict]:
    """``{label: environment}`` from the processes' ``[label] ENV {...}`` lines."""
    return {m[1]: json.loads(m[2]) for m in re.finditer(r"^\[([^\]]+)\] ENV (\{.*\})$",
                                                         output, re.M)}


def _run(n, *, env, **options):
    result = launch.run(["-c", SHOW], num_processes=n, timeout_s=120, env=env, **options)
    assert result.returncode == 0, result.output
    told = _told(result.output)
    assert sorted(told) == [str(r) for r in range(n)], result.output
    return told, result.output


# --- torchrun's variables -------------------------------------------------------------------

def test_every_process_gets_torchruns_variables_and_none_are_inherited():
    # A launcher started from inside another job (torchrun, an outer jaxdist launch) must not
    # pass its own LOCAL_RANK on: the in-memory tier writes replicated arrays on LOCAL_RANK 0.
    told, _ = _run(3, env=_env(LOCAL_RANK="5", RANK="9", GROUP_RANK="2"))
    for rank in range(3):
        env = told[str(rank)]
        assert {k: env[k] for k in _placement.TORCHRUN_VARS} == {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "3",
            "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"}
        assert env["RANK"] == env["JAXDIST_PROCESS_ID"]
        # No GPU here: no GPU settings, and the deadman is not added.
        assert env["JAX_LOCAL_DEVICE_IDS"] is None and env["XLA_FLAGS"] is None


def test_parameter_server_tasks_get_no_rank_variables_and_share_the_gpus_without_preallocating():
    result = launch.run(["-c", SHOW], num_ps=1, num_workers=1, timeout_s=120,
                        env=_env(LOCAL_RANK="1", **{_placement.ENV_GPU_COUNT: "2"}))
    assert result.returncode == 0, result.output
    told = _told(result.output)
    assert sorted(told) == ["chief 0", "ps 0", "worker 0"], result.output
    for env in told.values():
        assert all(env[k] is None for k in _placement.TORCHRUN_VARS), env  # TF_CONFIG names them
        assert env["TF_CONFIG"] and env["JAX_LOCAL_DEVICE_IDS"] is None
        assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"  # 3 processes on the same GPUs
        assert f"{DEADMAN}=30m" in env["XLA_FLAGS"]
    result = launch.run(["-c", SHOW], num_ps=1, num_workers=1, timeout_s=120,
                        env=_env(XLA_PYTHON_CLIENT_MEM_FRACTION=".2",
                                 **{_placement.ENV_GPU_COUNT: "2"}))
    assert all(env["XLA_PYTHON_CLIENT_PREALLOCATE"] is None
               for env in _told(result.output).values()), result.output


# --- one process per GPU --------------------------------------------------------------------

def test_on_a_gpu_host_each_process_gets_its_own_gpus_and_the_deadman():
    told, output = _run(4, env=_env(**{_placement.ENV_GPU_COUNT: "8"}))
    assert "jaxdist launch: GPUs: 8 on this host (JAXDIST_GPU_COUNT=8); 2 per process" in output
    for rank in range(4):
        env = told[str(rank)]
        assert env["JAX_LOCAL_DEVICE_IDS"] == f"{2 * rank},{2 * rank + 1}"
        assert env["CUDA_VISIBLE_DEVICES"] is None  # every GPU stays visible to CUDA (NCCL P2P)
        assert env["XLA_FLAGS"] == f"{DEADMAN}=30m"
        assert env["JAX_PLATFORMS"] is None and env["JAX_NUM_CPU_DEVICES"] is None
    told, output = _run(2, devices_per_process=3, hang_timeout_s=45,
                        env=_env(XLA_FLAGS="--xla_dump_to=/tmp/x",
                                 **{_placement.ENV_GPU_COUNT: "8"}))
    assert [told[r]["JAX_LOCAL_DEVICE_IDS"] for r in "01"] == ["0,1,2", "3,4,5"]
    assert "GPUs 6..7 unused" in output
    assert told["0"]["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {DEADMAN}=90s"  # 2 x --hang-timeout
    told, _ = _run(1, env=_env(XLA_FLAGS=f"{DEADMAN}=5m", **{_placement.ENV_GPU_COUNT: "8"}))
    assert told["0"]["XLA_FLAGS"] == f"{DEADMAN}=5m"  # the user's own value stays
    assert told["0"]["JAX_LOCAL_DEVICE_IDS"] == "0,1,2,3,4,5,6,7"


def test_the_gpus_a_scheduler_left_visible_are_the_ones_split():
    env = _env(CUDA_VISIBLE_DEVICES="4,5,6,7", **{_placement.ENV_GPU_COUNT: "8"})
    told, _ = _run(2, env=env)
    assert [told[r]["JAX_LOCAL_DEVICE_IDS"] for r in "01"] == ["0,1", "2,3"]  # CUDA's numbering
    assert told["1"]["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    # A host's only process may never call jax.distributed.initialize: CUDA hides the rest.
    told, _ = _run(1, devices_per_process=2, env=env)
    assert (told["0"]["CUDA_VISIBLE_DEVICES"], told["0"]["JAX_LOCAL_DEVICE_IDS"]) == ("4,5", "0,1")


def test_simulated_cpu_devices_where_there_is_no_gpu_or_jax_platforms_says_cpu():
    for extra in ({}, {"JAX_PLATFORMS": "cpu", _placement.ENV_GPU_COUNT: "8"}):
        told, output = _run(2, devices_per_process=3, env=_env(**extra))
        assert "GPUs:" not in output
        for env in told.values():
            assert (env["JAX_NUM_CPU_DEVICES"], env["JAX_PLATFORMS"]) == ("3", "cpu")
            assert env["JAX_LOCAL_DEVICE_IDS"] is None and env["XLA_FLAGS"] is None


def test_more_processes_than_gpus_is_one_line_before_anything_starts(tmp_path):
    marker = tmp_path / "started"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = _env(**{_placement.ENV_GPU_COUNT: "8"})
    with pytest.raises(ValueError, match=r"^-n 3 x --devices-per-process 3 needs 9 GPUs, but this "
                                         r"host has 8 \(JAXDIST_GPU_COUNT=8\)\. Fix: lower -n"):
        launch.run([str(script)], num_processes=3, devices_per_process=3, env=env)
    proc = run_python(["-m", "jaxdist.launch", "-n", "9", str(script)], timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr
    error = [line for line in proc.stderr.splitlines() if not line.startswith("usage:")]
    assert error == ["jaxdist launch: error: -n 9 needs at least 9 GPUs (one each), but this host "
                     "has 8 (JAXDIST_GPU_COUNT=8). Fix: use -n 8 or fewer, or set "
                     "JAX_PLATFORMS=cpu to run on simulated CPU devices instead."], proc.stderr
    assert not marker.exists()


def test_jax_takes_the_gpus_each_process_is_told():
    # On this CPU machine JAX has no GPU to open, but jax.distributed.initialize (through
    # jaxdist.initialize) still records the GPUs it would use: JAX_LOCAL_DEVICE_IDS is read.
    code = ("import jaxdist; jaxdist.initialize(); from jax._src import xla_bridge; "
            "print('visible', xla_bridge.CUDA_VISIBLE_DEVICES.value)")
    result = launch.run(["-c", code], num_processes=2, timeout_s=180,
                        env=_env(**{_placement.ENV_GPU_COUNT: "4"}))
    assert result.returncode == 0, result.output
    assert re.search(r"^\[0\] visible 0,1$", result.output, re.M), result.output
    assert re.search(r"^\[1\] visible 2,3$", result.output, re.M), result.output


# --- SLURM ----------------------------------------------------------------------------------

SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "8",
         "SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
         "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}


@pytest.mark.parametrize("layout, extra, ids", [
    # --gpus-per-task=1: SLURM binds each task to its GPU, seen as device 0 (jax#28194: JAX
    # would ask for device 2)
    ("gpus-per-task=1, bound", {"SLURM_GPUS_PER_TASK": "1", "CUDA_VISIBLE_DEVICES": "2"}, [0]),
    ("gpus-per-task=2, bound", {"SLURM_GPUS_PER_TASK": "2", "CUDA_VISIBLE_DEVICES": "4,5"},
     [0, 1]),
    ("gpus-per-task=2, --gpu-bind=none", {"SLURM_GPUS_PER_TASK": "gpu:2"}, [4, 5]),
    ("4 tasks see the node's 4 GPUs", {"JAXDIST_GPU_COUNT": "4"}, [2]),
    ("one task per node drives all 8", {"SLURM_STEP_TASKS_PER_NODE": "1(x8)",
                                        "SLURM_LOCALID": "0", "JAXDIST_GPU_COUNT": "8"},
     list(range(8))),
    ("more tasks than GPUs", {"JAXDIST_GPU_COUNT": "2"}, [1]),
    ("--gpu-bind=single:1", {"CUDA_VISIBLE_DEVICES": "2"}, [0]),
    ("the user's JAX_LOCAL_DEVICE_IDS", {"JAX_LOCAL_DEVICE_IDS": "3"}, None),
    ("no GPU", {"JAXDIST_GPU_COUNT": "0"}, None),
    ("JAX_PLATFORMS=cpu", {"JAX_PLATFORMS": "cpu"}, None),
    ("3 GPUs over 4 tasks", {"JAXDIST_GPU_COUNT": "3"}, None),
])
def test_slurm_tasks_drive_the_gpus_they_were_given(layout, extra, ids):
    env = {**SLURM, "JAXDIST_GPU_COUNT": "8", **extra}
    assert _placement.slurm_local_device_ids(env) == ids, layout
    assert _placement.slurm_local_device_ids({"JAXDIST_GPU_COUNT": "8"}) is None  # not SLURM


@pytest.mark.parametrize("how, extra, ids", [
    # srun python train.py: JAX's SLURM detection; a task bound by --gpus-per-task=1
    ("srun alone", {"SLURM_GPUS_PER_TASK": "1", "CUDA_VISIBLE_DEVICES": "2"}, [0]),
    # examples/deploy/slurm/per_gpu.sbatch: JAXDIST_* and CUDA_VISIBLE_DEVICES=$SLURM_LOCALID
    ("per_gpu.sbatch", {"CUDA_VISIBLE_DEVICES": "2", "JAXDIST_PROCESS_ID": "0"}, [0]),
    # per_host.sbatch: one task per node, which should drive every GPU of its node
    ("per_host.sbatch", {"SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
                         "SLURM_NTASKS": "2", "JAXDIST_PROCESS_ID": "0"}, [0, 1, 2, 3]),
])
def test_jaxdist_initialize_under_slurm_passes_the_tasks_gpus_to_jax(how, extra, ids):
    # JAX alone gives a SLURM task the GPU numbered SLURM_LOCALID (2 here, or 0 for a lone
    # task), whether jaxdist found the job itself or the JAXDIST_* variables named it.
    # jax.distributed.initialize is replaced: it records its arguments.
    code = ("import json, jax\n"
            "seen = []\n"
            "def fake(**kw):\n"
            "    seen.append(kw)\n"
            "    if 'coordinator_address' not in kw:\n"
            "        raise ValueError('coordinator_address should be defined.')\n"
            "jax.distributed.initialize = fake\n"
            "import jaxdist\n"
            "jaxdist.initialize()\n"
            "print('ids', json.dumps(seen[0].get('local_device_ids')))\n")
    env = _env(**SLURM, **{_placement.ENV_GPU_COUNT: "4"})
    for name in ("JAXDIST_COORDINATOR", "JAXDIST_NUM_PROCESSES", "JAXDIST_PROCESS_ID"):
        env.pop(name, None)
    if "JAXDIST_PROCESS_ID" in extra:
        (port,) = launch.free_ports(1)
        env.update(JAXDIST_COORDINATOR=f"127.0.0.1:{port}", JAXDIST_NUM_PROCESSES="2")
    env.update(extra)
    proc = run_python(code, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.split("ids ")[1]) == ids, (how, proc.stdout)


# --- elastic: the variables follow the job as it re-forms ----------------------------------

# Round 0: the agent started with FAIL=1 fails; the others' processes wait to be stopped.
# Round 1 (the job re-formed without that host): every process says what it is told and ends.
ELASTIC = (f"import os, sys, time\n{SHOW}\n"
           "if os.environ['JAXDIST_RESTART_COUNT'] == '0':\n"
           "    if os.environ.get('FAIL'):\n"
           "        sys.exit(3)\n"
           "    time.sleep(120)\n")


def test_torchrun_variables_follow_an_elastic_job_as_it_re_forms(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "show.py"
    script.write_text(ELASTIC)
    store = RendezvousClient(f"127.0.0.1:{port}", "gpus", timeout_s=2)
    agents, logs = [], []

    def start(name, restarts, **extra):
        logs.append(tmp_path / f"{name}.log")
        cmd = [sys.executable, "-m", "jaxdist.launch", "--nnodes", "2:3", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--rdzv-id", "gpus", "-n", "2", "--max-restarts",
               str(restarts), "--rdzv-timeout", "30", "--rdzv-last-call", "30", str(script)]
        with open(logs[-1], "wb") as f:
            agents.append(subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                           env=_env(**{_placement.ENV_GPU_COUNT: "4"}, **extra)))
        # Registered in this order, the hosts keep it: a, b, c are groups 0, 1, 2.
        end = time.monotonic() + 120
        while True:
            try:
                if len(store.list("r0/member/")) == len(agents):
                    return
            except RendezvousError:
                pass
            assert time.monotonic() < end and all(a.poll() is None for a in agents), \
                "".join(p.read_text() for p in logs)
            time.sleep(0.1)
    try:
        start("a", 1)
        start("b", 0, FAIL="1")
        start("c", 1)
        codes = [a.wait(timeout=180) for a in agents]
    finally:
        for a in agents:
            a.kill()
        store.close()
    text = [p.read_text(errors="replace") for p in logs]
    assert codes == [0, 3, 0], "\n".join(text)
    c = {(env["JAXDIST_RESTART_COUNT"], env["LOCAL_RANK"]): env for env in _told(text[2]).values()}
    for local in "01":
        before, after = c["0", local], c["1", local]
        assert {k: before[k] for k in ("RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                                       "LOCAL_WORLD_SIZE")} == {
            "RANK": str(4 + int(local)), "WORLD_SIZE": "6", "GROUP_RANK": "2",
            "GROUP_WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2"}
        assert {k: after[k] for k in ("RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                                      "LOCAL_WORLD_SIZE")} == {
            "RANK": str(2 + int(local)), "WORLD_SIZE": "4", "GROUP_RANK": "1",
            "GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        for env in (before, after):  # the host's GPUs, split the same way every round
            assert env["RANK"] == env["JAXDIST_PROCESS_ID"]
            assert env["JAX_LOCAL_DEVICE_IDS"] == ("0,1" if local == "0" else "2,3")
            assert env["XLA_FLAGS"] == f"{DEADMAN}=30m"
    a = {(env["JAXDIST_RESTART_COUNT"], env["RANK"]) for env in _told(text[0]).values()}
    assert {("1", "0"), ("1", "1")} <= a, text[0]
