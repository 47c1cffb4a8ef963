"""Faults that come back, and faults of the job's own machinery, in elastic jobs (simulated hosts:
agents on 127.0.0.1, one process with 2 CPU devices each): a joining host that does not match the
job is refused while the job goes on; a frozen rendezvous store does not cost the finished state;
a host that comes back after the job ended does not start a round; and a minority of the last
round's hosts never goes on by itself (a network partition cannot make two jobs)."""

import re
import signal
import sys
import time

import pytest

from jaxdist.checkpoint import CheckpointManager
from tests.test_elastic_multihost import Hosts, reference  # noqa: F401

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/shm, prctl")]


def test_a_joining_host_that_does_not_match_is_refused_and_the_job_goes_on(tmp_path, reference):
    # before: every round aborted in gloo ("collective mismatch"), or in a reshape for another
    # device count, until every agent had spent its restarts; the healthy hosts' state was lost.
    # Both kinds of mismatch, in one job: a joiner with another model (refused by its process's
    # state check, in a round) and one with another device count (refused by the round closer).
    # The job holds at step 8 until both joiners have been seen (Hosts.hold: a handshake, not a
    # pace that a joiner slow to start on a loaded machine could miss, or arrive after the end)
    train = ["--epochs", "4", "--sleep", "0.1"]  # 32 steps
    hosts = Hosts(tmp_path, last_call=1)
    for _ in range(2):
        hosts.start(script_args=hosts.hold, train=train)
    hosts.wait_for(0, r"round 0: 2 host\(s\)")
    hosts.wait_for(0, r"\[0\] trained step 4 ")
    # The model's joiner first: while it is the only joiner, the job's agents' "a host joins"
    # proves that it has registered for the next round (a joining agent prints nothing then)
    hosts.start(script_args=["--hidden", "64", *hosts.hold], train=train)  # agent 2
    hosts.wait_for(None, r"a host joins: asking every process to stop at step")
    hosts.start(devices=3, script_args=hosts.hold, train=train)  # agent 3
    # the store's agent refuses it as it registers (agent 3 exits then: wait on agent 0's line)
    hosts.wait_for(0, r"agent \S+ refused: its devices_per_process 3 \(the job's: 2\)")
    hosts.release_on_join()
    codes = hosts.finish()
    assert codes[:2] == [0, 0], hosts.text()
    assert codes[2:] == [2, 2], hosts.text(2) + hosts.text(3)
    assert re.search(r"this host is refused by the job: this process's train state differs "
                     r"from the job's \(.*\(64,\) float32 here, \(32,\) float32 in the job",
                     hosts.text(2)), hosts.text(2)
    assert re.search(r"this host is refused by the job: devices_per_process 3 \(the job's: "
                     r"2\)", hosts.text(3)), hosts.text(3)
    # each refusal re-forms the job cleanly: no round fails (a refused process that skipped
    # jax.distributed.shutdown left its peers in its barrier until JAX's heartbeat timeout, ~100 s)
    assert not re.search(r"round \d+ failed", hosts.text(0)), hosts.text(0)
    # the two hosts stopped at the agreed step for the joiners (one stop for both, or one each
    # had they come in different rounds), then went on from exactly there each time
    stops = {int(s) for s in re.findall(r"a host joins: asking every process to stop at step "
                                        r"(\d+)", hosts.text())}
    resumed = [int(s) for s in re.findall(r"attempt \d+ resumed from memory step (\d+)",
                                          hosts.text(0))]
    assert stops and resumed == sorted(stops), hosts.text(0)
    _check_final(hosts, reference)


def test_a_frozen_store_host_does_not_cost_the_finished_state(tmp_path, reference):
    # before: the other agents declared the round failed and killed their processes; the final
    # backup was left as a *.orbax-checkpoint-tmp directory and no parameters were written
    hosts = Hosts(tmp_path, nnodes="2:4", last_call=1)
    for _ in range(3):
        hosts.start(train=["--epochs", "4", "--sleep", "0.4"])
    # Every host in the round first: the first round closes as soon as two have registered (the
    # store's agent registered before the others started), so a third can come in a round later.
    _wait_after(hosts, r"round \d+: 3 host\(s\)", r"\[0\] trained step \d+ ")
    hosts.agents[0].send_signal(signal.SIGSTOP)  # the store's agent (its processes go on)
    try:
        hosts.wait_for(1, r"the rendezvous store is silent; this host's processes go on")
        time.sleep(8)
    finally:
        hosts.agents[0].send_signal(signal.SIGCONT)
    codes = hosts.finish()
    assert codes == [0, 0, 0], hosts.text()
    assert not list((tmp_path / "backup").glob("*tmp*")), list((tmp_path / "backup").iterdir())
    assert CheckpointManager(tmp_path / "backup").latest_step() == 32
    _check_final(hosts, reference)


def _wait_after(hosts, first, then, steps=1, timeout=240):
    """Waits for ``first`` in agent 0's log, then for ``steps`` lines matching ``then`` after it;
    returns ``first``'s first group as an int (or None)."""
    hosts.wait_for(0, first, timeout=timeout)
    text = hosts.text(0)
    found = re.search(first, text)
    end = time.monotonic() + timeout
    while len(re.findall(then, hosts.text(0)[found.end():])) < steps:
        assert time.monotonic() < end, hosts.text()[-4000:]
        assert hosts.agents[0].poll() is None, hosts.text(0)[-4000:]
        time.sleep(0.05)
    return int(found.group(1)) if found.groups() else None


def _check_final(hosts, reference):
    import numpy as np

    from tests.test_elastic_multihost import _params

    diff = max(float(np.abs(a - b).max())
               for a, b in zip(_params(hosts.tmp / "out.npz"), reference[1]))
    assert diff <= 2e-5, diff


def test_a_host_that_comes_back_after_the_end_starts_no_round(tmp_path):
    # before: its registration asked the others for a stop at a step past the end, and an
    # extra round ran with 0 steps
    hosts = Hosts(tmp_path, nnodes="1:2", last_call=1)
    hosts.start(train=["--epochs", "1", "--sleep", "0.3"])  # 8 steps
    hosts.wait_for(0, r"\[0\] trained step 7 ")
    hosts.start(train=["--epochs", "1"])
    codes = hosts.finish()
    assert codes == [0, 0], hosts.text()
    assert "round 1" not in hosts.text(), hosts.text()


def test_a_minority_of_the_last_round_does_not_go_on_alone(tmp_path):
    # before: any survivors moved the store and went on; had the lost half been cut off by the
    # network rather than gone, it would have gone on too: two jobs training
    # all four in one round: it closes as soon as the fourth (the most) has registered, and the
    # long last call waits for an agent slow to start (with 1 s, a loaded machine once formed a
    # round of 2, then another of 2, and the test never saw 4)
    hosts = Hosts(tmp_path, nnodes="2:4", last_call=120, rdzv_timeout=8)
    for _ in range(4):
        hosts.start()
    full = _wait_after(hosts, r"round (\d+): 4 host\(s\)", r"\[0\] trained step \d+ ", steps=2)
    hosts.agents[0].kill()  # the store's host and one more: 2 of 4 left, without the store
    hosts.agents[1].kill()
    codes = hosts.finish()
    assert codes[2:] == [1, 1], hosts.text()
    assert re.search(r"only 2 of the last round's 4 host\(s\) are here: a network partition "
                     r"may be splitting the job", hosts.text(2) + hosts.text(3)), hosts.text()
    assert f"round {full + 1}:" not in hosts.text(2) + hosts.text(3)


def test_a_rank_stuck_on_another_host_is_named_by_every_host(tmp_path, reference):
    # before: each agent saw only its own ranks, none was named, and no stack was shown
    hosts = Hosts(tmp_path, last_call=1)
    for _ in range(2):
        hosts.start(script_args=["--fault", "stuck", "--rank", "1", "--at", "5"],
                    launch_args=["--hang-timeout", "6"])
    codes = hosts.finish()
    assert codes == [0, 0], hosts.text()
    out = hosts.text()
    assert re.search(r"rank 1 is the one the others wait for: it dispatched \d+ steps, ranks "
                     r"\[0\] dispatched \d+", out), out
    assert re.search(r"\[1\]   File \".*ft_train\.py\", line \d+ in "
                     r"wait_for_input_that_never_comes", out), out
    assert re.search(r"\[0\]   File \".*\", line \d+ in ", out), out  # the waiting host's too
    _check_final(hosts, reference)


def test_a_host_joins_a_sharded_job_and_the_state_is_put_together_over_the_network(
        tmp_path, reference):
    # before: zero_stage 1-3 switched the tier off: the re-formed job went back to the backup
    train = ["--epochs", "4", "--sleep", "0.1", "--zero-stage", "1"]
    hosts = Hosts(tmp_path, last_call=1)
    for _ in range(2):
        hosts.start(script_args=hosts.hold, train=train)
    hosts.wait_for(0, r"round 0: 2 host\(s\)")
    hosts.wait_for(0, r"\[0\] trained step 4 ")
    hosts.start(script_args=hosts.hold, train=train)
    hosts.release_on_join()
    codes = hosts.finish()
    assert codes == [0, 0, 0], hosts.text()
    stop = int(re.search(r"asking every process to stop at step (\d+)", hosts.text())[1])
    assert re.search(rf"attempt 1 resumed from memory step {stop}\b", hosts.text(0)), hosts.text(0)
    assert "in-memory state tier is off" not in hosts.text()
    _check_final(hosts, reference)
