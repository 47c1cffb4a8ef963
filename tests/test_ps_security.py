"""Issue 11, parameter-server service: no client can hang, starve, flood or poison a server.

The hang and memory probes run in subprocesses with a timeout and assert an RSS bound.
"""

import datetime
import ipaddress
import json
import os
import re

import msgpack
import numpy as np
import pytest

from jaxdist.ps import optimizer, wire
from jaxdist.ps.server import ParameterServer, PushRejected, ServerConfig
from jaxdist.ps.transport import PS_SERVICE, Channel, GrpcClient, PSService, TLSConfig, Unavailable, serve
from tests.conftest import REPO, run_python

SCRIPTS = os.path.join(REPO, "tests", "_ps_scripts")


def _g(value=1.0):
    return {"w": np.full(4, value, np.float32)}


def test_parked_pulls_cannot_hang_the_server_and_honest_sync_workers_are_not_starved():
    # before: 40 pulls on a far version parked all 32 handler threads forever; Status timed
    # out, and 40 sync workers starved each other
    proc = run_python([os.path.join(SCRIPTS, "hang_probe.py")], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "status_while_parked_error" not in out, out
    assert out["waiters_after_cancel"] == 0, out
    assert out["sync_round_versions"] == [1] * 40, out["sync_round_versions"]
    assert out["maxrss_mb"] < 1500, out


def test_every_wait_is_bounded_by_the_server_whatever_the_caller_asks():
    ps = ParameterServer(0, _g(0.0), optimizer("sgd", learning_rate=1.0),
                         ServerConfig(max_wait_s=0.2, max_waiters=1))
    with pytest.raises(TimeoutError, match="for 0.2s"):
        ps.pull(min_version=5, timeout=1e9)
    with pytest.raises(PushRejected, match="min_version must be in"):
        ps.pull(min_version=-1)


def test_unauthenticated_oversized_push_is_refused_before_the_server_buffers_it():
    # before: gRPC buffered the whole message (limit 1 GiB) before the handler compared tokens
    proc = run_python([os.path.join(SCRIPTS, "oversized_push.py"), "300"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] and "PermissionDenied" in out["error"], out
    assert out["server_peak_rss_mb"] < out["server_rss_before_mb"] + 100, out


def test_receive_limit_refuses_an_authenticated_message_larger_than_the_model():
    service = PSService(0)
    server, port = serve("127.0.0.1:0", PS_SERVICE, service.methods(), token="t",
                         max_receive_bytes=1 << 20)
    try:
        ch = Channel(f"127.0.0.1:{port}", PS_SERVICE, token="t")
        with pytest.raises(PushRejected) as e:
            ch.call("Push", b"\0" * (4 << 20), timeout=30)
        assert e.value.code == "resource_exhausted"
    finally:
        server.stop(0)


def test_decoder_refuses_a_header_that_would_expand_into_gigabytes():
    # before: 16 MB of empty msgpack maps expanded to 1.38 GB of dicts
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork + exec from the (large) parent
    code = ("import struct, msgpack\n"
            "from jaxdist.ps import wire\n"
            "head = msgpack.packb([{}] * (4 << 20))\n"
            "msg = struct.pack('<I', len(head)) + head\n"
            "try:\n    wire.decode(msg, max_header_bytes=64 << 20)\n"
            "except wire.WireError as e:\n    print('refused:', e)\n"
            "print(next(int(line.split()[1]) for line in open('/proc/self/status')\n"
            "           if line.startswith('VmHWM')) // 1024)\n")
    proc = run_python(code, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    refused, rss = proc.stdout.strip().splitlines()[-2:]
    assert "too many maps and lists" in refused
    assert int(rss) < 600, rss
    with pytest.raises(wire.WireError, match="exceeds the limit"):
        wire.decode(b"\xff\xff\xff\x7f" + b"\0" * 16)


@pytest.mark.parametrize("field,value", [("step_id", 2 ** 63), ("step_id", -1),
                                         ("version", -1), ("worker", -3)])
def test_ids_and_versions_are_validated_at_the_boundary(tmp_path, field, value):
    # before: step id 2**63 was applied and then broke every later checkpoint and Log call
    ps = ParameterServer(0, _g(0.0), optimizer("sgd", learning_rate=1.0),
                         ServerConfig(checkpoint_dir=str(tmp_path), checkpoint_every=1))
    args = {"worker": 0, "step_id": 1, "version": 0, field: value}
    with pytest.raises(PushRejected, match=f"{field} must be in"):
        ps.push(**args, grads=_g())
    assert ps.push(worker=0, step_id=1, version=0, grads=_g()).status == "applied"
    back = ParameterServer.restore(str(tmp_path), 0)
    assert back.version == 1 and [r.step_id for r in back.log] == [1]


def test_nonfinite_gradients_are_rejected_by_default_and_counted():
    ps = ParameterServer(0, _g(0.0), optimizer("sgd", learning_rate=1.0))
    for bad in (np.nan, np.inf):
        with pytest.raises(PushRejected, match="hold NaN or Inf"):
            ps.push(worker=0, step_id=int(bad == np.inf), version=0, grads=_g(bad))
    assert ps.status()["rejected_nonfinite"] == 2 and ps.version == 0
    np.testing.assert_array_equal(ps.pull()[1]["w"], 0.0)
    lax = ParameterServer(0, _g(0.0), optimizer("sgd", learning_rate=1.0),
                          ServerConfig(nonfinite="apply"))
    assert lax.push(worker=0, step_id=0, version=0, grads=_g(np.nan)).status == "applied"


def test_a_remote_init_cannot_choose_a_filesystem_path(tmp_path):
    # before: Init's config chose checkpoint_dir and the server created /any/path/ps0.ckpt
    service = PSService(0)
    server, port = serve("127.0.0.1:0", PS_SERVICE, service.methods(), token="t")
    target = tmp_path / "planted"
    try:
        ch = Channel(f"127.0.0.1:{port}", PS_SERVICE, token="t")
        config = dict(ServerConfig().to_dict(), checkpoint_dir=str(target))
        with pytest.raises(PushRejected, match="checkpoint_dir is set on its own command"):
            ch.call("Init", wire.encode({"index": 0, "config": config, "optimizer": optimizer(
                "sgd", learning_rate=1.0).to_dict()}, _g()), timeout=10)
        assert not target.exists() and service.server is None
        greedy = dict(ServerConfig(max_waiters=10 ** 6, max_wait_s=1e9).to_dict())
        del greedy["checkpoint_dir"]
        ch.call("Init", wire.encode({"index": 0, "config": greedy, "optimizer": optimizer(
            "sgd", learning_rate=1.0).to_dict()}, _g()), timeout=10)
        cfg = service.server.config  # a remote Init cannot lift the server's waiting limits
        assert cfg.max_waiters <= 24 and cfg.max_wait_s <= 300
    finally:
        server.stop(0)


def test_a_multiprocess_strategy_refuses_to_start_without_a_token(monkeypatch):
    from jaxdist.cluster import ClusterSpec
    from jaxdist.ps.strategy import ParameterServerStrategy
    monkeypatch.delenv("JAXDIST_PS_TOKEN", raising=False)
    cluster = ClusterSpec.from_tf_config({"cluster": {"chief": ["127.0.0.1:1"], "worker": [
        "127.0.0.1:2"], "ps": ["127.0.0.1:3"]}, "task": {"type": "chief", "index": 0}})
    with pytest.raises(ValueError, match="no token for the parameter-server job"):
        ParameterServerStrategy(cluster)
    assert ParameterServerStrategy(cluster, authenticate=False).token is None
    monkeypatch.setenv("JAXDIST_PS_TOKEN", "from-env")
    assert ParameterServerStrategy(cluster).token == "from-env"


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "jaxdist-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return TLSConfig(str(cert_file), str(key_file), str(cert_file))


def test_tls_channels_work_and_plaintext_clients_are_refused(tmp_path):
    tls = _self_signed(tmp_path)
    service = PSService(0)
    server, port = serve("127.0.0.1:0", PS_SERVICE, service.methods(), token="t", tls=tls)
    addr = f"127.0.0.1:{port}"
    try:
        client = GrpcClient(addr, token="t", tls=tls, timeout=10)
        client.init(0, _g(0.0), optimizer("sgd", learning_rate=1.0), ServerConfig())
        assert client.push(worker=0, step_id=1, version=0, grads=_g()).status == "applied"
        assert client.pull()[0] == 1
        plain = GrpcClient(addr, token="t", timeout=3)
        with pytest.raises((Unavailable, TimeoutError)):
            plain.status()
        client.close()
        plain.close()
    finally:
        server.stop(0)
    env = {"JAXDIST_PS_TLS_CERT": tls.cert_file, "JAXDIST_PS_TLS_KEY": tls.key_file,
           "JAXDIST_PS_TLS_CA": tls.ca_file}
    assert TLSConfig.from_env(env) == tls
    with pytest.raises(ValueError, match="TLS needs all of"):
        TLSConfig.from_env({"JAXDIST_PS_TLS_CERT": tls.cert_file})


@pytest.mark.parametrize("entry,match", [
    (["w", "float32", [1.7], 0, 4], "malformed array entry"),
    (["w", "float32", ["1"], 0, 4], "malformed array entry"),
    (["w", "float32", [True], 0, 4], "malformed array entry"),
    (["w", "float32", [2 ** 62, 2 ** 62], 0, 4], "does not hold 4 bytes"),
    (["w", "float32", [1], 0.0, 4], "malformed array entry"),
])
def test_decoder_is_strict_about_array_entries(entry, match):
    head = msgpack.packb({"arrays": [entry]})
    msg = len(head).to_bytes(4, "little") + head + b"\0" * 4
    with pytest.raises(wire.WireError, match=match):
        wire.decode(msg)


def test_decoder_refuses_duplicate_keys_and_trailing_bytes():
    head = b"\x82\xa1a\x01\xa1a\x02"  # {"a": 1, "a": 2}
    with pytest.raises(wire.WireError, match="repeats the key 'a'"):
        wire.decode(len(head).to_bytes(4, "little") + head)
    good = wire.encode({"x": 1}, {"w": np.ones(2, np.float32)})
    with pytest.raises(wire.WireError, match="3 trailing byte"):
        wire.decode(good + b"abc")
    with pytest.raises(wire.WireError, match="not valid msgpack"):
        wire.decode((2).to_bytes(4, "little") + b"\x80\x80")  # two maps: trailing in header


_CLUSTER = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}


@pytest.mark.parametrize("args,tf_config,match", [
    (["--role", "ps", "--index", "0", "--cluster", json.dumps(dict(_CLUSTER, ps=[
        "127.0.0.1:70000"]))], None, r"port '70000' is not an integer in 1..65535"),
    ([], "{not json", "TF_CONFIG is not valid JSON"),
    (["--role", "ps", "--index", "3", "--cluster", json.dumps(_CLUSTER)], None,
     r"out of range: cluster\['ps'\] has 1 address"),
    (["--role", "ps", "--cluster", "{oops"], None, "--cluster is not valid JSON"),
    (["--role", "ps", "--index", "0", "--cluster", json.dumps(_CLUSTER)], None,
     "no token for the parameter-server job"),
])
def test_ps_cli_gives_clear_errors_not_tracebacks(args, tf_config, match):
    # before: port 70000 was "served" on 4464; bad TF_CONFIG and a bad index gave tracebacks
    env = {"JAXDIST_PS_TOKEN": ""}
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config
    proc = run_python(["-m", "jaxdist.ps.cli", *args], timeout=120, env=env)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and re.search(match, proc.stderr), proc.stderr


def test_the_launcher_makes_one_token_per_parameter_server_job(tmp_path):
    from jaxdist import launch
    script = tmp_path / "task.py"
    script.write_text("import hashlib, json, os\n"
                      "task = json.loads(os.environ['TF_CONFIG'])['task']\n"
                      "token = os.environ.get('JAXDIST_PS_TOKEN', '')\n"
                      "print(task['type'], len(token), hashlib.sha256(token.encode()).hexdigest())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("JAXDIST_PS_TOKEN", "TF_CONFIG")}
    env["PYTHONPATH"] = REPO
    result = launch.run([str(script)], num_ps=2, num_workers=2, timeout_s=120, env=env,
                        grace_period_s=60)
    assert result.returncode == 0, result.output
    rows = re.findall(r"^\[(\w+) (\d)\] (\w+) (\d+) (\w+)$", result.output, re.M)
    assert sorted((r[0], r[1]) for r in rows) == [("chief", "0"), ("ps", "0"), ("ps", "1"),
                                                  ("worker", "0"), ("worker", "1")], result.output
    assert {int(r[3]) for r in rows} == {43} and len({r[4] for r in rows}) == 1
