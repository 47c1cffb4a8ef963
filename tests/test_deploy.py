"""The deployment recipes in examples/deploy/ form the right cluster, reproduced with 2 local processes.

Each test gives two processes the environment the recipe's scheduler would give them (SLURM's
variables through the sbatch script itself, with stand-ins for `srun` and `scontrol`; a
Kubernetes Indexed Job pod's variables from the manifest; a Cloud TPU VM's metadata server) and
checks that `jaxdist.initialize()` joins both into one job (ids, count, an all-gather across
them). The manifests must parse and name the same script and port as the docs.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading

import pytest

from tests.conftest import REPO

yaml = pytest.importorskip("yaml")

DEPLOY = os.path.join(REPO, "examples", "deploy")
PROBE = os.path.join("tests", "_deploy", "probe.py")
TIMEOUT = 180
pytestmark = pytest.mark.multiprocess


def free_ports(n):
    import socket
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAXDIST_", "SLURM_", "TPU_", "TF_CONFIG", "KUBERNETES_"))}
    env.update(PYTHONPATH=REPO, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2")
    env.update(extra)
    return env


def _wait(procs):
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT)
            outputs.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        pytest.fail(f"a process did not finish within {TIMEOUT}s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rc, out, err in outputs:
        assert rc == 0, f"exit {rc}\n{out[-2000:]}\n{err[-3000:]}"
    reports = [json.loads(line) for _, out, _ in outputs for line in out.splitlines()
               if line.startswith("{")]
    # Every process prints one report (under the stand-in srun, one pipe carries them all).
    expected = sum(out.count('"process_index"') for _, out, _ in outputs)
    assert len(reports) == expected, "a report was not on a line of its own:\n" + "\n".join(
        f"--- process {i} stdout:\n{out[-2000:]}" for i, (_, out, _) in enumerate(outputs))
    return reports


def _start(cmd, env):
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _check_joined(reports, n=2, coordinator=None):
    assert sorted(r["process_id"] for r in reports) == list(range(n)), reports
    for r in reports:
        assert r["process_index"] == r["process_id"] and r["process_count"] == n
        assert r["num_processes"] == n and r["gathered"] == list(range(n))
        assert r["shutdown_at_exit"]  # jax.distributed.shutdown() is registered to run at exit
        if coordinator:
            assert r["coordinator"] == coordinator


# --- SLURM ------------------------------------------------------------------------------------

FAKE_SRUN = """#!/usr/bin/env bash
# Stands in for srun: starts SLURM_NTASKS copies of the command with the variables a step sets.
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST "$@" &
  pids+=($!)
done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
# Stands in for `scontrol show hostnames LIST` for a one-node LIST.
echo "$3"
"""


def _fake_slurm_bin(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return str(bin_dir)


@pytest.mark.parametrize("recipe", ["per_host.sbatch", "per_gpu.sbatch"])
def test_slurm_sbatch_scripts_form_the_cluster(recipe, tmp_path):
    (port,) = free_ports(1)
    env = _env(PATH=_fake_slurm_bin(tmp_path) + os.pathsep + os.environ["PATH"],
               SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="localhost", SLURM_NTASKS="2",
               JAXDIST_PORT=str(port))
    script = os.path.join(DEPLOY, "slurm", recipe)
    reports = _wait([_start(["bash", script, PROBE], env)])
    _check_joined(reports, coordinator=f"localhost:{port}")
    for r in reports:
        assert r["from_environment"]["coordinator"] == f"localhost:{port}"
        # one process per GPU sees only its own GPU; one per host sees all of them
        expected = str(r["process_id"]) if recipe == "per_gpu.sbatch" else None
        assert r["cuda_visible_devices"] == expected


def test_plain_srun_uses_jax_slurm_detection(tmp_path):
    """`srun python train.py` (no JAXDIST_*): jaxdist.initialize() defers to JAX's SLURM detection."""
    (port,) = free_ports(1)
    procs = [_start([sys.executable, PROBE], _env(
        SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
        SLURM_PROCID=str(i), SLURM_LOCALID=str(i), JAX_COORDINATOR_PORT=str(port)))
        for i in range(2)]
    reports = _wait(procs)
    _check_joined(reports, coordinator=f"localhost:{port}")
    assert all(r["from_environment"] is None for r in reports)


def test_sbatch_scripts_name_the_documented_script_and_port():
    readme = open(os.path.join(DEPLOY, "README.md")).read()
    for recipe in ("per_host.sbatch", "per_gpu.sbatch"):
        text = open(os.path.join(DEPLOY, "slurm", recipe)).read()
        assert "SCRIPT=${1:-examples/multi_worker.py}" in text and "${JAXDIST_PORT:-8476}" in text
        assert f"sbatch examples/deploy/slurm/{recipe}" in readme
        directives = dict(re.findall(r"#SBATCH --([\w-]+)=(\S+)", text))
        assert directives["gpus-per-node"] == "8"
        assert directives["ntasks-per-node"] == ("1" if recipe == "per_host.sbatch" else "8")


# --- Kubernetes -------------------------------------------------------------------------------

def _manifest():
    with open(os.path.join(DEPLOY, "kubernetes", "indexed-job.yaml")) as f:
        docs = {d["kind"]: d for d in yaml.safe_load_all(f)}
    return docs["Service"], docs["Job"]


def test_kubernetes_manifest_parses_and_agrees_with_itself_and_the_docs():
    service, job = _manifest()
    spec = job["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    n = int(env["JAXDIST_NUM_PROCESSES"]["value"])
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == n
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert pod["subdomain"] == service["metadata"]["name"]
    host, port = env["JAXDIST_COORDINATOR"]["value"].rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"  # pod 0's DNS name
    assert [p["port"] for p in service["spec"]["ports"]] == [int(port)]
    assert [p["containerPort"] for p in container["ports"]] == [int(port)]
    assert env["JAXDIST_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert container["command"][:2] == ["python", "examples/multi_worker.py"]
    readme = open(os.path.join(DEPLOY, "README.md")).read()
    assert "kubectl apply -f examples/deploy/kubernetes/indexed-job.yaml" in readme
    assert "examples/multi_worker.py" in readme and f":{port}" in readme


def test_kubernetes_pod_environment_forms_the_cluster():
    """Each pod's variables, as the manifest defines them (pod 0's name and the port made local)."""
    _, job = _manifest()
    (container,) = job["spec"]["template"]["spec"]["containers"]
    (port,) = free_ports(1)
    procs = []
    for index in range(2):
        pod_env = {}
        for e in container["env"]:
            if "value" in e:
                pod_env[e["name"]] = e["value"]
            else:  # the Job controller's completion-index annotation, through the downward API
                assert "job-completion-index" in e["valueFrom"]["fieldRef"]["fieldPath"]
                pod_env[e["name"]] = str(index)
        host = pod_env["JAXDIST_COORDINATOR"].rsplit(":", 1)[0]
        pod_env["JAXDIST_COORDINATOR"] = f"127.0.0.1:{port}"  # what {host} resolves to in the cluster
        assert host.endswith(".jaxdist-train")
        procs.append(_start([sys.executable, PROBE], _env(**pod_env)))
    _check_joined(_wait(procs), coordinator=f"127.0.0.1:{port}")


# --- Cloud TPU VM -----------------------------------------------------------------------------

class _Metadata(http.server.BaseHTTPRequestHandler):
    """The part of a TPU VM's metadata server that JAX's cluster detection reads."""

    values: dict = {}

    def do_GET(self):
        key = self.path.rsplit("/", 1)[-1]
        if self.headers.get("Metadata-Flavor") != "Google" or key not in self.values:
            self.send_response(404)
            self.end_headers()
            return
        body = self.values[key].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _metadata_server(worker_number, hosts):
    handler = type("Handler", (_Metadata,), {"values": {
        "agent-worker-number": str(worker_number), "worker-network-endpoints": ",".join(hosts),
        "tpu-env": "ACCELERATOR_TYPE: 'v4-16'\n"}})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_tpu_vm_slice_metadata_forms_the_cluster():
    """Two hosts of a slice: each asks its VM's metadata for its worker number and the workers."""
    pytest.importorskip("requests")  # what JAX's TPU detection reads the metadata with
    (port,) = free_ports(1)
    servers = [_metadata_server(i, ["127.0.0.1", "127.0.0.1"]) for i in range(2)]
    try:
        procs = [_start([sys.executable, PROBE, "--pretend-cloud-tpu-vm"], _env(
            GCE_METADATA_IP=f"127.0.0.1:{s.server_address[1]}", JAX_COORDINATOR_PORT=str(port)))
            for s in servers]
        reports = _wait(procs)
    finally:
        for s in servers:
            s.shutdown()
    _check_joined(reports, coordinator=f"127.0.0.1:{port}")
    assert all(r["from_environment"] is None for r in reports)  # found by JAX, not TF_CONFIG/env


def test_tpu_vm_script_runs_the_documented_command_on_every_worker():
    text = open(os.path.join(DEPLOY, "tpu", "tpu_vm.sh")).read()
    assert "--worker=all" in text and "SCRIPT=${2:-examples/tpu.py}" in text
    assert "pip install -q -e '.[tpu]'" in text
    assert "examples/deploy/tpu/tpu_vm.sh" in open(os.path.join(DEPLOY, "README.md")).read()


# --- one GPU host -----------------------------------------------------------------------------

def test_gpu_host_script_runs_a_training_script_with_its_settings():
    """No GPU here: the recipe's flags must still parse and the script must run (on the CPU)."""
    env = _env()
    env.pop("JAX_PLATFORMS")
    out = subprocess.run(["bash", os.path.join(DEPLOY, "gpu", "train_gpu.sh"), PROBE], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    (report,) = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in report["xla_flags"]
    assert report["num_processes"] == 1 and report["local_devices"] == 2


def test_every_recipe_file_is_described_in_the_deploy_readme():
    readme = open(os.path.join(DEPLOY, "README.md")).read()
    for root, _, files in os.walk(DEPLOY):
        for name in files:
            if name != "README.md":
                rel = os.path.relpath(os.path.join(root, name), DEPLOY)
                assert rel in readme, f"examples/deploy/README.md does not mention {rel}"
    for section in ("## One GPU host", "## Cloud TPU VM", "## SLURM", "## Kubernetes"):
        assert section in readme
    assert shutil.which("bash")
