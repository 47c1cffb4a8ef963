"""Every benchmark's ``--quick`` mode: it starts, measures every configuration it names, prints
its ratios. Plumbing, not figures: no ratio's value is asserted, only that each one is there and is
a finite positive number (or, for the planner's errors, a finite one).

overhead.py and cnn_pool.py are in test_bench_smoke.py, peers.py in test_peers_bench.py,
multiproc.py in test_multiproc_bench.py, sharding.py in test_zero_bench.py, gpt.py (``--tiny``) in
test_gpt_bench.py. fault_tolerance.py's scenarios (minutes of elastic jobs) are covered by
the tests they came from (test_elastic*.py); its `--tier-cost --quick` is here.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest

from tests.conftest import REPO, run_python

pytestmark = [pytest.mark.slow]

NUM = r"(\S+?)"  # a printed number; parsed and checked by _positive / _finite


def _bench(name: str, *args: str, timeout: float = 300, launch: int = 0):
    """Runs ``benchmarks/NAME.py --quick ARGS`` (under ``jaxdist launch -n LAUNCH`` if given)."""
    script = [os.path.join(REPO, "benchmarks", f"{name}.py"), "--quick", *args]
    if launch:
        script = ["-m", "jaxdist.launch", "-n", str(launch), "--devices-per-process", "2", *script]
    proc = run_python(script, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _finite(text: str, what: str) -> float:
    try:
        value = float(text.rstrip("x%"))
    except ValueError:
        raise AssertionError(f"{what}: {text!r} is not a number") from None
    assert math.isfinite(value), f"{what}: {text!r}"
    return value


def _positive(text: str, what: str) -> float:
    value = _finite(text, what)
    assert value > 0, f"{what}: {text!r} is not positive"
    return value


def _rows(pattern: str, out: str) -> dict[str, tuple[str, ...]]:
    """``{first group: the other groups}`` of every line matching ``pattern``."""
    rows = {}
    for line in out.splitlines():
        m = re.fullmatch(pattern, line.rstrip())
        if m:
            rows[m.group(1)] = m.groups()[1:]
    return rows


def test_allreduce_quick_times_every_implementation_and_packing():
    out = _bench("allreduce")
    impls = ("xla", "ring", "hierarchical", "one_device")
    cell = r"\s+(\S+) ms\s+\S+ GB/s x\s*(\S+)"
    sizes = _rows(r"\s*(\d+ KiB)" + cell * len(impls), out)
    assert list(sizes) == ["4 KiB", "16 KiB", "64 KiB"], out
    for size, cells in sizes.items():
        for impl, t, ratio in zip(impls, cells[::2], cells[1::2]):
            _positive(t, f"{size} {impl} ms")
            _positive(ratio, f"{size} {impl} busbw / xla")
        assert cells[1] == "1.00"  # xla is the baseline
    packing = _rows(r"\s*(\w+) .* -> .*\s(\S+) ms\s+(\S+) ms\s+(\S+)x", out)
    assert sorted(packing) == sorted(impls), out
    for impl, (unpacked, packed, speedup) in packing.items():
        _positive(unpacked, impl), _positive(packed, impl), _positive(speedup, f"{impl} speed-up")


def test_checkpoint_quick_saves_and_restores_in_every_mode():
    out = _bench("checkpoint")
    modes = _rows(rf"  (\S+)\s*: blocking {NUM} s, total {NUM} s \((\d+) MB/s\), restore {NUM} s",
                  out)
    assert sorted(modes) == ["async", "async-nodigest", "sync", "sync-nodigest"], out
    for mode, values in modes.items():
        for v in values[:2] + values[3:]:
            _positive(v, mode)
    m = re.search(rf"async blocking / sync save time = {NUM}\s", out)
    assert m, out
    _positive(m.group(1), "async blocking / sync save")
    m = re.search(rf"with / without digests: async blocking {NUM}, async total {NUM}, "
                  rf"sync save {NUM}, restore {NUM}$", out, re.MULTILINE)
    assert m, out
    for ratio in m.groups():
        _positive(ratio, "with / without digests")


def test_precision_quick_measures_every_policy_and_accumulation():
    out = _bench("precision")
    timed = rf"  (\S+)\s+{NUM} ms/step  time x\s*{NUM}  temp\s+{NUM} MiB \(x{NUM}\).*"
    policies = _rows(timed, out.split("[accumulation]")[0])
    assert list(policies) == ["float32", "mixed_bfloat16", "mixed_float16"], out
    steps = _rows(timed, out.split("[accumulation]")[1].split("[memory only")[0])
    assert list(steps) == ["k=1", "k=2", "k=4", "k=8"], out
    for name, values in {**policies, **steps}.items():
        for v in values:
            _positive(v, name)
    memory = re.findall(rf"^  (\S+)\s+(k=\d)  temp\s+{NUM} MiB \(x{NUM}\)  args\s+{NUM} MiB$",
                        out.split("[memory only")[1], re.MULTILINE)
    assert [f"{p} {k}" for p, k, *_ in memory] == [
        "float32 k=1", "mixed_bfloat16 k=1", "mixed_float16 k=1", "float32 k=2", "float32 k=4",
        "float32 k=8", "mixed_bfloat16 k=8"], out
    for p, k, *values in memory:
        for v in values:
            _positive(v, f"{p} {k}")


def test_ps_bookkeeping_quick_prints_a_row_per_history_size():
    out = _bench("ps_bookkeeping")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["updates"] for r in rows] == [0, 3000], out
    assert rows[0]["100_pushes_vs_first"] == 1.0
    for r in rows:
        _positive(str(r["100_pushes_with_1_checkpoint_s"]), "100 pushes")
        _positive(str(r["100_pushes_vs_first"]), "100 pushes vs the first N")
        _finite(str(r["rss_growth_mb"]), "RSS growth")


@pytest.mark.multiprocess
def test_input_sync_quick_compares_both_input_paths_across_processes():
    out = _bench("input_sync", launch=2)
    m = re.search(rf"2 process\(es\) x 2 devices, .*: distribute\(arrays\) {NUM}, "
                  rf"distribute_datasets_from_function {NUM}, ratio {NUM}, difference", out)
    assert m, out
    for v in m.groups():
        _positive(v, "input_sync")


@pytest.mark.multiprocess
def test_parameter_server_quick_measures_every_row_and_the_echo_ceiling():
    # (not --tls: its 12 more gRPC runs would double the test; tests/test_ps_security.py has TLS;
    # not 4 workers: the same plumbing as 2, and 8 more worker processes, 15 s of 41)
    out = _bench("parameter_server", "--workers", "1,2", timeout=420)
    rows = _rows(r"((?:grpc|in-process)\s+(?:transport|compute)\s+\d+)\s+(\S+)\s+(\S+)\s+\S+", out)
    want = [f"{t:<11} {k:<9} {n:>7}" for k in ("transport", "compute") for n in (1, 2)
            for t in ("grpc", "in-process")]
    assert sorted(rows) == sorted(want), out
    for name, (ops, updates) in rows.items():
        _positive(ops, name), _positive(updates, name)
    ratios = _rows(r"  ((?:grpc|in-process)\s+(?:transport|compute))\s+(\S+)x", out)
    assert len(ratios) == 4, out
    for name, (ratio,) in ratios.items():
        _positive(ratio, f"{name} 2 workers / 1")
    m = re.search(rf"parameter server 1 worker / echo: {NUM}$", out, re.MULTILINE)
    assert m, out
    _positive(m.group(1), "parameter server / echo")


@pytest.mark.multiprocess
def test_planner_quick_predicts_and_measures_every_job():
    out = _bench("planner", timeout=480)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if re.match(r"\| \d (simulated devices|processes)", line)]
    # each job, then the 4-process one again with the start cost fitted on the 2-process step
    assert [r[0].split(" (")[0] for r in rows] == [
        "8 simulated devices, 1 process", "2 processes x 1 device", "4 processes x 1 device",
        "4 processes x 1 device"], out
    for r in rows:
        for v in r[2:7]:  # compute parallelism, predicted compute/all-reduce/step, measured step
            _positive(v, r[0])
        _finite(r[7], f"{r[0]} error")


@pytest.mark.multiprocess
def test_fault_tolerance_tier_cost_quick_times_the_tier_on_and_off_and_a_sigkill():
    out = _bench("fault_tolerance", "--tier-cost", timeout=900)
    rows = _rows(r"\| (off|on) [^|]*\| " + NUM + r" \| [^|]* \| " + NUM + r" \|", out)
    assert sorted(rows) == ["off", "on"], out
    for mode, (rate, ratio) in rows.items():
        _positive(rate, f"{mode} steps/s")
        _positive(ratio, f"{mode} ratio")
    assert re.search(r"The launcher announced: in-memory tier \(rank 0\): .* a failure costs at "
                     r"most \d+ step", out), out
    m = re.search(r"SIGKILL of rank 1 after step (\d+): resumed from memory step (\d+), (\d+) "
                  r"step\(s\) computed again \(announced bound: (\d+); within it\)", out)
    assert m, out
