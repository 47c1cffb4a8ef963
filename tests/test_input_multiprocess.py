"""Per-process input across real processes (jaxdist launch, 2 processes x 2 devices)."""

from __future__ import annotations

import json
import os

import grain
import pytest

from jaxdist import launch
from tests.conftest import REPO

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = os.path.join(REPO, "tests", "_mp_scripts", "input_pipelines.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("input")
    res = launch.run([SCRIPT, str(out)], num_processes=2, devices_per_process=2, timeout_s=300,
                     grace_period_s=10, env={"PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1",
                                             "PATH": os.environ.get("PATH", "")}, cwd=REPO)
    assert res.returncode == 0, res.output[-4000:]
    return [json.load(open(out / f"rank{r}.json")) for r in range(2)]


def test_file_policy_reads_each_file_on_one_process_and_ends_together(ranks):
    r0, r1 = ranks[0]["file"], ranks[1]["file"]
    assert r0["policy"] == r1["policy"] == "file"
    assert r0["files"] == [0, 2, 4] and r1["files"] == [1, 3]  # what each process read
    # Process 0 holds 20 rows (5 steps of 4), process 1 holds 7 (2 steps): both take 5 steps,
    # process 1 padding once its files are done, and every example counts once.
    assert r0["reals"] == r1["reals"] == [8, 7, 4, 4, 4]
    assert sorted(r0["ids"] + r1["ids"]) == list(range(27))
    assert r0["count"] == 27 and r0["sum"] == sum(range(27))


def test_data_policy_reads_everything_on_every_process(ranks):
    r0, r1 = ranks[0]["data"], ranks[1]["data"]
    assert r0["files"] == r1["files"] == [0, 1, 2, 3, 4]
    assert sorted(r0["ids"] + r1["ids"]) == list(range(27)) and r0["count"] == 27


def test_off_policy_takes_each_process_stream_as_its_own(ranks):
    r0, r1 = ranks[0]["off"], ranks[1]["off"]
    assert r0["ids"] == list(range(10)) and r1["ids"] == [100, 101, 102]
    assert r0["reals"] == r1["reals"] == [7, 4, 2] and r0["count"] == 13


def test_grain_input_function_gives_each_process_its_slice_reshuffled_per_epoch(ranks):
    assert ranks[0]["context"] == [2, 0, 4] and ranks[1]["context"] == [2, 1, 4]
    for e in range(2):
        ids0, ids1 = ranks[0]["grain"][e]["ids"], ranks[1]["grain"][e]["ids"]
        assert all(i % 2 == 0 for i in ids0) and all(i % 2 == 1 for i in ids1)
        assert sorted(ids0 + ids1) == list(range(45))
        assert ranks[0]["grain"][e]["count"] == 45 and ranks[0]["grain"][e]["sum"] == 990
    for r in range(2):
        assert ranks[r]["grain"][0]["ids"] != ranks[r]["grain"][1]["ids"]
        assert ranks[r]["grain_again_epoch1"]["ids"] == ranks[r]["grain"][1]["ids"]
        # Epoch 1 of process r is grain's epoch 1 of its shuffled slice.
        ref = grain.MapDataset.range(45)[r::2].shuffle(seed=3)
        assert ranks[r]["grain"][1]["ids"] == [int(ref[i]) for i in range(len(ref), 2 * len(ref))]


def test_pipelines_of_different_lengths_neither_deadlock_nor_drop(ranks):
    r0, r1 = ranks[0]["uneven"], ranks[1]["uneven"]
    assert r0["ids"] == list(range(30)) and r1["ids"] == list(range(1000, 1006))
    assert r0["reals"] == r1["reals"] == [8, 6, 4, 4, 4, 4, 4, 2]
    assert r0["sum"] == sum(range(30)) + sum(range(1000, 1006)) and r0["count"] == 36


def test_a_failing_pipeline_is_reported_to_the_other_process_at_once(ranks):
    assert ranks[1]["failing"] == "OSError: disk went away"
    assert ranks[0]["failing"].startswith(
        "RuntimeError: the input pipeline of process 1 failed at step 1 (OSError)")
    assert ranks[0]["failing_s"] < 60  # told, not timed out (the timeout was 120 s)


def test_a_dataset_read_on_one_process_only_times_out_naming_the_other(ranks):
    assert ranks[0]["alone"].startswith(
        "input step 0: process(es) [1] of [0, 1] did not report within 3 s")


def test_in_memory_batches_gathered_on_the_devices_are_the_hosts_across_processes(ranks):
    for r in ranks:
        for where, (host, device) in r["in_memory"].items():
            assert host and host == device, where  # rows, mask, position, real counts
    # Each process holds its own rows of every batch: together, each example once an epoch.
    ids = [row for r in ranks for batch in r["in_memory"]["{}"][1] for row, real in
           zip(batch[0][0], batch[1][r["rank"] * 4:(r["rank"] + 1) * 4]) if real]
    assert sorted(ids) == list(range(45))
