"""The in-memory tier's announced bound holds: SIGKILLs at several points, under
``steps_per_execution`` K = 1 and 4, each recompute no more steps than the launcher announced
before it, and the job resumes from memory every time (``jaxdist launch -n 2``, fit +
BackupAndRestore, a 0.9 MB state as in the report that found the bound exceeded)."""

import re

import pytest

from jaxdist import launch
from tests.test_elastic import SCRIPT, _env  # the same job and environment

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _kills(output: str) -> list[tuple[int, int | None, int, str, int | None]]:
    """For each SIGKILL: (step the killed rank completed, the bound announced last before it or
    None, the step the next attempt started from, where from, the in-memory tier's newest step
    then or None)."""
    bound, fault, found = None, None, []
    for line in output.splitlines():
        if m := re.search(r"in-memory tier \(rank 0\): .* a failure costs at most (\d+) step", line):
            bound = int(m[1])
        elif m := re.match(r"\[1\] fault kill at step (\d+)(?: \(announced at most (\d+)\))?$",
                           line):
            # The rank kills itself only once rank 0's tier has announced its bound (it read
            # the file the launcher announces from); the launcher's line may come just after.
            fault = (int(m[1]), int(m[2]) if m[2] else bound)
        elif (m := re.match(r"\[0\] attempt [1-9] started from (\w+) step (\w+) \(memory (\w+)\)$",
                            line)) and fault:
            found.append((*fault, int(m[2]) if m[2] != "None" else 0, m[1],
                          int(m[3]) if m[3] != "None" else None))
            fault = None
    return found


@pytest.mark.parametrize("k", [1, 4])
def test_sigkills_recompute_no_more_than_announced_and_resume_from_memory(tmp_path, k):
    # before: with steps_per_execution=4 the bound was announced in steps while copies came only
    # at calls' ends (asked every 5 steps, copied every 8: "at most 5" announced)
    # The kills come 4 steps after an epoch's end (at calls' ends for K = 4), whose backup is the
    # other place to resume from: wherever the bound is under 4 steps only the tier can keep it.
    result = launch.run([SCRIPT, str(tmp_path / "o.npz"), str(tmp_path / "backup"), "--fault",
                         "kill", "--rank", "1", "--at", "28,44", "--epochs", "6", "--hidden",
                         "1024", "--steps-per-execution", str(k), "--when-announced"],
                        num_processes=2, devices_per_process=2, timeout_s=300, env=_env(),
                        max_restarts=2)
    out = result.output
    assert result.returncode == 0, out[-4000:]
    kills = _kills(out)
    assert len(kills) == 2, out[-4000:]
    for fault, bound, resumed, source, memory in kills:
        assert bound is not None, f"no bound announced before the kill at {fault}:\n{out[-4000:]}"
        assert fault - resumed <= bound, (f"{fault - resumed} steps computed again after the kill "
                                          f"at step {fault}, announced at most {bound}")
        assert memory is not None, f"no in-memory state after the kill at {fault}:\n{out[-4000:]}"
        # the newer of the two is resumed from (the tier on a tie): the epoch's backup only where
        # the tier's copy is older; the bound above then holds from the epoch's end
        if source == "memory":
            assert resumed == memory, out[-4000:]
        else:
            assert source == "backup" and memory < resumed, out[-4000:]
