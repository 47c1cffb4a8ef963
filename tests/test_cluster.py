"""ClusterSpec parsing (TF_CONFIG, env, explicit), initialize and barrier across real processes."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

import jaxdist
from jaxdist.cluster import ClusterSpec
from jaxdist.launch import cluster, runtime
from jaxdist.launch import launcher as launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "_mp_scripts"


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in ("TF_CONFIG", "JAXDIST_COORDINATOR", "JAXDIST_NUM_PROCESSES",
                 "JAXDIST_PROCESS_ID", "JAX_NUM_CPU_DEVICES", "XLA_FLAGS"):
        env.pop(name, None)
    return env


@pytest.fixture
def fresh_state(monkeypatch):
    """Each test starts with no joined job and leaves none behind."""
    monkeypatch.setattr(runtime, "_current", None)
    for name in ("TF_CONFIG", "JAXDIST_COORDINATOR", "JAXDIST_NUM_PROCESSES",
                 "JAXDIST_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)


CHIEF_AND_WORKERS = {"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]}}


@pytest.mark.parametrize("task, process_id", [
    ({"type": "chief", "index": 0}, 0),
    ({"type": "worker", "index": 0}, 1),
    ({"type": "worker", "index": 1}, 2),
])
def test_tf_config_chief_is_process_zero(task, process_id):
    spec = ClusterSpec.from_tf_config({**CHIEF_AND_WORKERS, "task": task})
    assert (spec.coordinator_address, spec.num_processes, spec.process_id) == (
        "h0:2222", 3, process_id)
    assert (spec.task_type, spec.task_index) == (task["type"], task["index"])
    assert spec.workers == ("h0:2222", "h1:2222", "h2:2222")
    assert spec.is_chief == (process_id == 0)


def test_tf_config_workers_only_from_json_and_env(monkeypatch):
    config = {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    for spec in (ClusterSpec.from_tf_config(json.dumps(config)), ClusterSpec.from_tf_config(),
                 cluster.cluster_from_environment()):
        assert (spec.coordinator_address, spec.num_processes, spec.process_id) == ("a:1", 2, 1)


@pytest.mark.parametrize("task_type", ["ps", "evaluator"])
def test_tf_config_ps_and_evaluator_are_not_processes_of_the_job(task_type):
    config = {"cluster": {"chief": ["c:1"], "worker": ["w:1"], "ps": ["p:1", "p:2"],
                          "evaluator": ["e:1"]},
              "task": {"type": task_type, "index": 0}}
    spec = ClusterSpec.from_tf_config(config)
    assert (spec.process_id, spec.is_jax_process, spec.task_type) == (None, False, task_type)
    assert (spec.num_processes, spec.coordinator_address) == (2, "c:1")
    assert (spec.ps, spec.evaluator) == (("p:1", "p:2"), ("e:1",))


@pytest.mark.parametrize("config, expected", [
    ('{"cluster": ', ["not valid JSON", "Fix:"]),
    ("[1, 2]", ["expected a JSON object"]),
    ({"task": {"type": "worker", "index": 0}}, ["TF_CONFIG['cluster']", "missing"]),
    ({"cluster": {"worker": ["a:1"]}}, ["TF_CONFIG['task']", "missing"]),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}},
     ["TF_CONFIG['task']['index']", "missing"]),
    ({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 2}},
     ["TF_CONFIG['task']['index'] = 2", "out of range", "valid indexes 0..1"]),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": True}},
     ["TF_CONFIG['task']['index'] = True"]),
    ({"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker", "index": 0}},
     ["TF_CONFIG['cluster']['worker'][1] = 'a:1'", "duplicate address",
      "TF_CONFIG['cluster']['worker'][0]", "own host:port"]),
    ({"cluster": {"chief": ["a:1"], "ps": ["a:1"]}, "task": {"type": "chief", "index": 0}},
     ["TF_CONFIG['cluster']['ps'][0]", "duplicate"]),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "trainer", "index": 0}},
     ["TF_CONFIG['task']['type'] = 'trainer'", "unknown task type"]),
    ({"cluster": {"master": ["a:1"]}, "task": {"type": "master", "index": 0}},
     ["TF_CONFIG['cluster']['master']", "'master' is now 'chief'"]),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}},
     ["TF_CONFIG['task']['type'] = 'chief'", "no such job"]),
    ({"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief", "index": 0}},
     ["at most one chief"]),
    ({"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 0}},
     ["no 'chief' and no 'worker'"]),
    ({"cluster": {"worker": ["hostonly"]}, "task": {"type": "worker", "index": 0}},
     ["TF_CONFIG['cluster']['worker'][0] = 'hostonly'", "'host:port'"]),
    ({"cluster": {"worker": ["h:99999"]}, "task": {"type": "worker", "index": 0}},
     ["port '99999'", "1..65535"]),
    ({"cluster": {"worker": "a:1"}, "task": {"type": "worker", "index": 0}},
     ["expected a list"]),
])
def test_tf_config_invalid_forms_name_field_and_fix(config, expected):
    with pytest.raises(ValueError) as info:
        ClusterSpec.from_tf_config(config)
    for text in expected:
        assert text in str(info.value)
    assert "Fix" in str(info.value)


def test_tf_config_unset(fresh_state):
    with pytest.raises(ValueError, match="TF_CONFIG is not set"):
        ClusterSpec.from_tf_config()


def test_env_parsing():
    env = {"JAXDIST_COORDINATOR": "10.0.0.1:1234", "JAXDIST_NUM_PROCESSES": "4",
           "JAXDIST_PROCESS_ID": "3"}
    spec = ClusterSpec.from_env(env)
    assert spec == ClusterSpec("10.0.0.1:1234", 4, 3) and spec.to_env() == env
    with pytest.raises(ValueError, match="JAXDIST_PROCESS_ID not set.*jaxdist launch"):
        ClusterSpec.from_env({k: v for k, v in env.items() if k != "JAXDIST_PROCESS_ID"})
    with pytest.raises(ValueError, match="JAXDIST_NUM_PROCESSES = 'four': not an integer"):
        ClusterSpec.from_env({**env, "JAXDIST_NUM_PROCESSES": "four"})
    with pytest.raises(ValueError, match=r"process_id = 3: expected an integer in \[0, 2\)"):
        ClusterSpec.from_env({**env, "JAXDIST_NUM_PROCESSES": "2"})


def test_tf_config_takes_precedence_over_jaxdist_env():
    env = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["w:1"]},
                                    "task": {"type": "worker", "index": 0}}),
           "JAXDIST_COORDINATOR": "x:1", "JAXDIST_NUM_PROCESSES": "2", "JAXDIST_PROCESS_ID": "1"}
    assert cluster.cluster_from_environment(env).coordinator_address == "w:1"
    assert cluster.cluster_from_environment({}) is None


@pytest.mark.parametrize("kwargs, expected", [
    (dict(coordinator_address="h:1", num_processes=2, process_id=2),
     r"process_id = 2: expected an integer in \[0, 2\).*Fix"),
    (dict(coordinator_address="h:1", num_processes=0, process_id=0), "num_processes = 0"),
    (dict(coordinator_address="h", num_processes=2, process_id=0),
     "coordinator_address = 'h'.*'host:port'"),
    (dict(coordinator_address="::1:80", num_processes=2, process_id=0), "in brackets"),
    (dict(coordinator_address=None, num_processes=2, process_id=0), "needs a coordinator"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=0, task_type="boss"),
     "task_type = 'boss': unknown task type"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=None), "needs an id"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=1, task_type="ps"),
     "pass process_id=None"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=0, ps="p:1"),
     "ps = 'p:1': expected a sequence"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=0, workers=("h:1",)),
     "1 addresses but num_processes = 2"),
])
def test_explicit_spec_validation(kwargs, expected):
    with pytest.raises(ValueError, match=expected):
        ClusterSpec(**kwargs)


def test_explicit_spec_is_a_value():
    spec = ClusterSpec("[::1]:8476", 2, 1, ps=["p:1"], local_device_ids=[0, 1])
    assert spec.ps == ("p:1",) and spec.local_device_ids == (0, 1) and hash(spec)
    assert spec == ClusterSpec("[::1]:8476", 2, 1, ps=("p:1",), local_device_ids=(0, 1))


def test_initialize_without_runtime_is_idempotent_and_rejects_conflicts(fresh_state):
    single = runtime.initialize(ClusterSpec.single_process())
    assert runtime.initialize() is single and runtime.current_cluster() is single
    assert runtime.initialize(ClusterSpec("127.0.0.1:5", 1, 0)) is single
    with pytest.raises(RuntimeError, match="already joined.*cannot also join the job at "
                                           "127.0.0.1:1234 as process 0 of 2"):
        runtime.initialize(ClusterSpec("127.0.0.1:1234", 2, 0))
    runtime.barrier("one-process-shortcut", timeout_s=0.01)
    with pytest.raises(ValueError, match="name = 'a/b'"):
        runtime.barrier("a/b")


def test_initialize_evaluator_does_not_join(fresh_state):
    spec = ClusterSpec.from_tf_config({"cluster": {"worker": ["127.0.0.1:1"],
                                                   "evaluator": ["127.0.0.1:2"]},
                                       "task": {"type": "evaluator", "index": 0}})
    assert runtime.initialize(spec, timeout_s=0.1) is spec


def test_runtime_names_stay_reachable_where_the_docs_name_them():
    # cluster <- runtime <- launch: cluster defines the errors README names as
    # jaxdist.cluster.*, and never imports the runtime (no lazy __getattr__ cycle)
    import subprocess
    import sys

    from jaxdist.cluster import BarrierTimeoutError, CoordinatorTimeoutError
    assert (BarrierTimeoutError, CoordinatorTimeoutError) == (
        runtime.BarrierTimeoutError, runtime.CoordinatorTimeoutError)
    assert (jaxdist.initialize, jaxdist.barrier) == (runtime.initialize, runtime.barrier)
    assert not hasattr(cluster, "__getattr__")
    tool = "/work/shared/tools/import_cycles.py"
    if os.path.exists(tool):
        out = subprocess.run([sys.executable, tool, os.path.dirname(jaxdist.__file__)],
                             capture_output=True, text=True).stdout
        assert "jaxdist.cluster <-> jaxdist.launch.runtime" not in out, out


@pytest.mark.multiprocess
def test_psum_and_barrier_timeout_across_two_processes():
    result = launch.run([str(SCRIPTS / "psum_barrier.py")], num_processes=2,
                        devices_per_process=2, timeout_s=120, env=_env())
    assert result.returncode == 0, result.output
    for rank in (0, 1):
        assert f"[{rank}] process {rank}/2 devices=4 psum=10.0" in result.output
        assert f"[{rank}] conflict: jaxdist.initialize: this process already joined" \
            in result.output
        assert f"[{rank}] process {rank} finished" in result.output
        assert f"[{rank}] subset: process_ids = [{1 - rank}]: this process ({rank}) is not " \
            "one of them" in result.output
    assert "[0] missing=[1] message: barrier 'only-process-0' (call #0) timed out after 2 s " \
           "on process 0: process(es) [1] of [0, 1] did not arrive" in result.output


def _free_slurm_job_id() -> int:
    # JAX derives the coordinator port from the job id: 61440 + id % 4096.
    for job_id in range(os.getpid() % 4096, os.getpid() % 4096 + 4096):
        port = 61440 + job_id % 4096
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
                return job_id
            except OSError:
                continue
    raise RuntimeError("no free port in 61440..65535")


@pytest.mark.multiprocess
def test_initialize_defers_to_jax_cluster_detection_under_slurm():
    job_id = _free_slurm_job_id()
    slurm = {"SLURM_JOB_ID": str(job_id), "SLURM_STEP_NODELIST": "127.0.0.1",
             "SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "1", "JAX_NUM_CPU_DEVICES": "2",
             "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "psum_barrier.py")],
                              env={**_env(), **slurm, "SLURM_PROCID": str(i),
                                   "SLURM_LOCALID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for i, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, output
        assert f"spec 127.0.0.1:{61440 + job_id % 4096} 2 {i}" in output
        assert f"process {i}/2 devices=4 psum=10.0" in output


@pytest.mark.multiprocess
@pytest.mark.parametrize("process_id, returncode, expected", [
    (1, 2, "CoordinatorTimeoutError: process 1 of 2 could not reach the coordinator at "
           "127.0.0.1:{port} within 3 s"),
    (0, 1, "process 0 of 2: not all 2 processes joined the coordinator at 127.0.0.1:{port} "
           "within 3 s. None of the 1 other processes connected."),
])
def test_initialize_fails_in_bounded_time(process_id, returncode, expected):
    port = launch.free_ports(1)[0]
    proc = subprocess.run([sys.executable, str(SCRIPTS / "join_alone.py"), str(process_id),
                           str(port)], env=_env(), capture_output=True, text=True, timeout=90)
    assert proc.returncode == returncode, proc.stdout + proc.stderr
    assert expected.format(port=port) in proc.stdout + proc.stderr
    assert "Check that" in proc.stdout + proc.stderr


@pytest.mark.multiprocess
def test_initialize_timeout_names_the_processes_that_never_connected():
    """Process 0 says who came and who did not (JAX's own deadline names nobody)."""
    p0, p1 = launch.free_ports(2)
    workers = [f"127.0.0.1:{p1}", "10.255.255.1:2222"]  # the second never starts
    procs = [subprocess.Popen(
        [sys.executable, str(SCRIPTS / "join_tf_config.py"), "6"],
        env={**_env(), "TF_CONFIG": json.dumps({
            "cluster": {"chief": [f"127.0.0.1:{p0}"], "worker": workers},
            "task": {"type": task, "index": 0}})},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for task in ("chief", "worker")]
    try:
        outputs = [proc.communicate(timeout=90)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [1, 1], outputs
    assert ("1 of the 2 other processes connected (from 127.0.0.1 (1)); 1 did not. No "
            "connection seen from: process 2 (10.255.255.1:2222).") in outputs[0], outputs
    assert "Process 0's log says how many connected, and from where" in outputs[1], outputs[1]


def test_initialize_after_backend_started_says_to_call_it_first():
    code = ("import jax; jax.devices(); import jaxdist as c; "
            "c.initialize(c.ClusterSpec('127.0.0.1:1234', 2, 0))")
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                          text=True, timeout=90)
    assert proc.returncode == 1
    assert "RuntimeError: jaxdist.initialize must run before anything starts JAX's backend" \
        in proc.stderr
