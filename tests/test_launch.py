"""`jaxdist launch`: rank prefixes, failure handling, restarts, signal forwarding."""

import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from jaxdist.launch import launcher as launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "_mp_scripts"
pytestmark = pytest.mark.multiprocess


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in ("TF_CONFIG", "JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "JAX_PLATFORMS"):
        env.pop(name, None)
    return env


def test_output_is_prefixed_by_rank_in_whole_lines():
    result = launch.run([str(SCRIPTS / "output.py")], num_processes=2, devices_per_process=3,
                        timeout_s=120, env=_env())
    assert result.returncode == 0, result.output
    lines = result.output.splitlines()
    assert all(re.match(r"\[[01]\] ", line) for line in lines), result.output
    for rank in (0, 1):
        assert re.search(rf"^\[{rank}\] env 2 {rank} 127\.0\.0\.1:\d+ devices=3$", result.output,
                         re.M)
        assert f"[{rank}] a partial line from rank {rank}" in lines
        assert f"[{rank}] to stderr from rank {rank}" in lines
        assert f"[{rank}] progress 1\r[{rank}] progress 2 of rank {rank}\r\n" in result.output
        assert f"[{rank}] no newline at the end from rank {rank}" in lines


@pytest.mark.parametrize("mode, returncode, described", [
    ("exit", 3, "rank 1 exited with code 3"),
    ("kill", 128 + signal.SIGKILL, "rank 1 was killed by SIGKILL (9)"),
])
def test_failing_rank_stops_group_and_restarts_are_bounded(mode, returncode, described):
    # Rank 0 sleeps 600 s: finishing well inside timeout_s (no 124) shows it was killed.
    result = launch.run([str(SCRIPTS / "fail_rank.py"), mode], num_processes=2, max_restarts=1,
                        timeout_s=120, grace_period_s=1, env=_env())
    assert result.returncode == returncode, result.output
    assert result.restarts == 1
    assert f"jaxdist launch: {described}; killing the other 1 running process(es)" \
        in result.output
    assert f"{described}; restarting the group (restart 1 of 1)" in result.output
    assert f"jaxdist launch: job failed: {described} (after 1 restart(s))" in result.output


def test_restart_after_first_attempt_failure_succeeds():
    result = launch.run([str(SCRIPTS / "restart.py")], num_processes=2, max_restarts=1,
                        timeout_s=120, env=_env())
    assert result.returncode == 0, result.output
    assert result.restarts == 1
    assert "rank 1 exited with code 5; restarting the group (restart 1 of 1)" in result.output
    for rank in (0, 1):
        assert f"[{rank}] rank {rank} attempt 1 ok" in result.output


def test_timeout_kills_the_group():
    result = launch.run(["-c", "import time; time.sleep(600)"], num_processes=2, timeout_s=1,
                        env=_env())
    assert result.returncode == launch.EXIT_TIMEOUT
    assert "timed out after 1 s with rank(s) [0, 1] still running" in result.output


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie awaiting its reaper
    except FileNotFoundError:
        return True


def test_sigterm_is_forwarded_then_stragglers_are_killed():
    proc = subprocess.Popen([sys.executable, "-m", "jaxdist.launch", "-n", "2", "--grace-period",
                             "1", "--timeout", "120", str(SCRIPTS / "sigterm.py")], env=_env(),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    stderr: list[str] = []
    readers = [threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout]),
               threading.Thread(target=lambda: stderr.extend(proc.stderr))]
    for reader in readers:
        reader.start()
    grandchildren, stdout = [], []
    deadline = time.monotonic() + 60
    try:
        while len(grandchildren) < 2:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            stdout.append(line)
            if match := re.search(r"ready grandchild=(\d+)", line):
                grandchildren.append(int(match.group(1)))
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        for reader in readers:
            reader.join(timeout=10)
    stdout.extend(lines.queue)
    stderr = "".join(stderr)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "[0] rank 0 got SIGTERM\n" in stdout
    assert "jaxdist launch: received SIGTERM; forwarding it to all 2 processes" in stderr
    assert "rank(s) [1] still running; killing them" in stderr
    assert all(_gone(pid) for pid in grandchildren)


@pytest.mark.parametrize("argv, options, target", [
    (["-n", "2", "--port", "5", "train.py", "-n", "3"], ["-n", "2", "--port", "5"],
     ["train.py", "-n", "3"]),
    (["-n", "2", "-m", "pkg.mod", "--flag"], ["-n", "2"], ["-m", "pkg.mod", "--flag"]),
    (["-n", "2", "--", "-weird.py"], ["-n", "2"], ["-weird.py"]),
])
def test_command_line_splits_launcher_options_from_the_script(argv, options, target):
    assert launch._split_argv(argv) == (options, target)


def test_command_line_errors(capsys):
    for argv in (["-n", "2"], ["-n", "0", "x.py"], ["x.py"]):
        with pytest.raises(SystemExit) as info:
            launch.main(argv)
        assert info.value.code == 2
    assert "num_processes = 0: expected an integer >= 1" in capsys.readouterr().err


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_for_pids(launcher, pid_dir, n):
    """The pids ``n`` processes wrote to ``pid_dir`` (each a file), while the launcher runs."""
    pids = []
    deadline = time.monotonic() + 60
    while len(pids) < n:
        assert time.monotonic() < deadline, "ranks did not start"
        assert launcher.poll() is None, "launcher exited early"
        pids = [int(p.read_text()) for p in pid_dir.iterdir() if p.suffix != ".tmp"]
        time.sleep(0.1)
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_sigkill_of_the_launcher_takes_its_ranks_with_it(tmp_path):
    # before: the ranks kept running under PID 1
    env = dict(_env(), PID_DIR=str(tmp_path))
    launcher = subprocess.Popen([sys.executable, "-m", "jaxdist.launch", "-n", "2",
                                 str(SCRIPTS / "sleep_forever.py")], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = []
    try:
        pids = _wait_for_pids(launcher, tmp_path, 2)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 15
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, pids)), f"ranks {pids} outlived their launcher"
    finally:
        launcher.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("clear_env", ["0", "1"])
def test_daemons_a_rank_started_in_their_own_session_end_with_the_job(tmp_path, clear_env):
    # before (issue 19 item 11): the setsid daemons were left under PID 1, and the launcher took
    # 30 s to exit because they held its output pipes; a daemon without the job's environment
    # tag (CLEAR_ENV=1) was still left under PID 1 after the first fix
    env = dict(_env(), PID_DIR=str(tmp_path), CLEAR_ENV=clear_env)
    launcher = subprocess.Popen([sys.executable, "-m", "jaxdist.launch", "-n", "2",
                                 "--grace-period", "1", str(SCRIPTS / "spawn_daemon.py")],
                                env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
    pids = []
    try:
        pids = _wait_for_pids(launcher, tmp_path, 2)
        start = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=60)  # EOF on its stdout: nothing holds the pipe
        assert time.monotonic() - start < 15, "the launcher waited on pipes its daemons held"
        assert launcher.returncode == 128 + signal.SIGTERM, out
        assert not any(map(_alive, pids)), f"daemons {pids} outlived the job"
    finally:
        launcher.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="stacks are asked for with SIGUSR1")
def test_the_stacks_header_comes_before_every_stack_line(tmp_path, monkeypatch):
    # before: the launcher signalled the ranks and only then said "their Python stacks follow";
    # on a loaded machine (CI) a rank's stack reached the output first, above its header
    from jaxdist.launch import group, hang

    lines, ready = [], threading.Event()

    def emit(stream, data):
        lines.append(data.decode())
        if b"waiting to be asked" in data:
            ready.set()

    script = tmp_path / "registered.py"
    script.write_text("import sys, time\n"
                      "from jaxdist.launch import heartbeat\n"
                      "heartbeat.enable_stack_dumps(sys.argv[1], 0)\n"
                      "print('waiting to be asked', flush=True)\n"
                      "time.sleep(60)\n")
    launcher = group._Launcher([str(script), str(tmp_path)], group._Options(num_processes=1),
                               emit, _env(), None)
    launcher._state_dir = str(tmp_path)
    readers = []
    proc = launcher.spawn("0", _env(), readers)
    real_kill = os.kill

    def kill_then_fall_behind(pid, sig):
        # The launcher's thread loses the CPU right after the signal, until the stack is out.
        real_kill(pid, sig)
        deadline = time.monotonic() + 20
        while not any("[0]   File" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.01)

    try:
        assert ready.wait(60), "".join(lines)
        monkeypatch.setattr(hang.os, "kill", kill_then_fall_behind)
        launcher.dump_stacks({0: proc.pid})
        monkeypatch.undo()
        text = "".join(lines)
        # (line 4 when the signal lands before the print has returned: once under -n 2; else 5)
        assert re.search(r"\[0\]   File \".*registered\.py\", line [45] in <module>", text), text
        header = text.index("rank(s) [0]: their Python stacks follow")
        assert header < text.index("[0] Current thread"), text
    finally:
        proc.kill()
        proc.wait()


def test_the_failure_named_is_the_process_that_began_to_fail_first(tmp_path):
    # jax 0.12.1 on the CPU: rank 1 raises; rank 0's collective fails as soon as rank 1 leaves
    # the job, and rank 0 exited first while rank 1 ran its exit handlers: the launcher named
    # rank 0 ("rank 0 exited with code 1"). Each failing process marks when it began to fail.
    from jaxdist.launch import group, statedir

    class Proc:
        def __init__(self, code, exits_after=0.0):
            self.code, self.at = code, time.monotonic() + exits_after

        def poll(self):
            return self.code if time.monotonic() >= self.at else None

    launcher = group._Launcher(["train.py"], group._Options(num_processes=3),
                               lambda stream, data: None, _env(), None)
    launcher._state_dir = str(tmp_path)
    since = time.time() - 1
    procs = [Proc(1), Proc(3, exits_after=0.3), Proc(None, exits_after=1e9)]
    assert launcher._first_failure(procs, [(0, 1)], since) == (0, 1)  # no marks: as before
    statedir.mark_failing(str(tmp_path), 1)
    time.sleep(0.01)
    statedir.mark_failing(str(tmp_path), 0)
    assert launcher._first_failure(procs, [(0, 1)], since) == (1, 3)  # waited for rank 1's exit
    # an earlier attempt's marks do not count
    assert launcher._first_failure(procs, [(0, 1)], time.time() + 1) == (0, 1)


def test_an_error_that_comes_back_is_the_same_fault_whichever_rank_raised_it_first():
    # before: the signature held the rank, so when every rank raised the same error and another
    # rank happened to exit first, the launcher restarted once more (CI: restarts == 2, not 1)
    import collections

    from jaxdist.launch import group

    launcher = group._Launcher(["train.py"], group._Options(num_processes=2),
                               lambda stream, data: None, _env(), None)
    for rank in ("0", "1"):
        launcher._tails[rank] = collections.deque(["ValueError: the data from step 3 on is bad"])
    launcher.record_failure("rank 1 exited with code 1", {0: 5, 1: 5}, ["1"])
    launcher.record_failure("rank 0 exited with code 1", {0: 5, 1: 5}, ["0"])
    assert launcher.repeated("rank 0 exited with code 1")
    # another error is another fault; a signal is the same only at the same rank and step
    launcher._tails["0"] = collections.deque(["KeyError: 'labels'"])
    launcher.record_failure("rank 0 exited with code 1", {0: 5, 1: 5}, ["0"])
    assert not launcher.repeated("rank 0 exited with code 1")
    launcher._tails.clear()
    launcher.record_failure("rank 1 was killed by SIGKILL (9)", {0: 5, 1: 5}, ["1"])
    launcher.record_failure("rank 0 was killed by SIGKILL (9)", {0: 5, 1: 5}, ["0"])
    assert not launcher.repeated("rank 0 was killed by SIGKILL (9)")
    launcher.record_failure("rank 0 was killed by SIGKILL (9)", {0: 5, 1: 5}, ["0"])
    assert launcher.repeated("rank 0 was killed by SIGKILL (9)")
