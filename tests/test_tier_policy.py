"""The in-memory tier's cadence as a policy value: ``MemoryTier``, set in code or by environment."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import jaxdist
from jaxdist.checkpoint import memstate
from jaxdist.checkpoint.memstate import StateTier
from jaxdist.checkpoint.tier_policy import MemoryTier


@pytest.mark.parametrize("kwargs, named", [
    ({"every": 0}, "every=0"), ({"every": True}, "every=True"), ({"every": 2.5}, "every=2.5"),
    ({"budget": 0}, "budget=0"), ({"budget": 1.5}, "budget=1.5"), ({"budget": "5%"}, "budget='5%'"),
    ({"enabled": "no"}, "enabled='no'")])
def test_bad_values_are_named_in_one_line(kwargs, named):
    with pytest.raises(ValueError, match=r"^MemoryTier\(" + named.replace("(", r"\(")) as e:
        MemoryTier(**kwargs)
    assert "\n" not in str(e.value) and "expected" in str(e.value)


def test_the_environment_gives_the_default(monkeypatch, caplog):
    assert MemoryTier.from_env() == MemoryTier()
    monkeypatch.setenv(memstate.ENV_EVERY, "3")
    monkeypatch.setenv(memstate.ENV_BUDGET, "0.02")
    monkeypatch.setenv("JAXDIST_MEMORY_TIER", "0")
    assert MemoryTier.from_env() == MemoryTier(every=3, budget=0.02, enabled=False)
    for off in ("off", "false", "No"):  # the launcher's spellings (issue 37)
        monkeypatch.setenv("JAXDIST_MEMORY_TIER", off)
        assert not MemoryTier.from_env().enabled
    # the tier is optional: a bad value is one warning and the default, never an error in every rank
    monkeypatch.setenv("JAXDIST_MEMORY_TIER", "maybe")
    monkeypatch.setenv(memstate.ENV_EVERY, "0")
    assert MemoryTier.from_env() == MemoryTier(every=None, budget=0.02, enabled=True)
    assert "JAXDIST_MEMORY_TIER='maybe': expected 1" in caplog.text
    assert "JAXDIST_MEMORY_TIER_EVERY='0': expected a whole number" in caplog.text


def test_a_policy_in_code_sets_the_cadence_over_the_environment(tmp_path, monkeypatch):
    # before: only JAXDIST_MEMORY_TIER_EVERY could fix the cadence (StateTier had no policy=)
    monkeypatch.setenv(memstate.ENV_EVERY, "1")
    tier = StateTier(str(tmp_path), rank=0, policy=MemoryTier(every=3))
    taken = [k for k in range(1, 11) if tier.save(k, {"w": jnp.ones(2) * k}) or tier.flush()]
    tier.close()
    assert taken == [1, 4, 7, 10]
    off = StateTier(str(tmp_path / "off"), rank=0, policy=MemoryTier(enabled=False))
    assert not off.enabled and off.save(1, {"w": jnp.ones(2)}) is False


def test_backup_and_restore_takes_the_policy(tmp_path, monkeypatch):
    monkeypatch.setenv(memstate.ENV_BUDGET, "0.02")
    b = jaxdist.callbacks.BackupAndRestore(str(tmp_path / "a"),
                                           memory_tier=jaxdist.callbacks.MemoryTier(every=2))
    assert (b.memory._every, b.memory._budget) == (2, 0.05)
    default = jaxdist.callbacks.BackupAndRestore(str(tmp_path / "b"))
    assert default.memory_tier == MemoryTier(budget=0.02)  # the environment's
    with pytest.raises(TypeError, match="memory_tier=2: expected jaxdist.callbacks.MemoryTier"):
        jaxdist.callbacks.BackupAndRestore(str(tmp_path / "c"), memory_tier=2)
