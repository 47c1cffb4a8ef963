"""The in-memory tier's cadence as a policy value: ``MemoryTierPolicy``, set in code or by environment."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import jaxdist
from jaxdist.checkpoint import InMemoryTier, memstate
from jaxdist.checkpoint.tier_policy import MemoryTierPolicy


@pytest.mark.parametrize("kwargs, named", [
    ({"every": 0}, "every=0"), ({"every": True}, "every=True"), ({"every": 2.5}, "every=2.5"),
    ({"budget": 0}, "budget=0"), ({"budget": 1.5}, "budget=1.5"), ({"budget": "5%"}, "budget='5%'"),
    ({"enabled": "no"}, "enabled='no'")])
def test_bad_values_are_named_in_one_line(kwargs, named):
    with pytest.raises(ValueError, match=r"^MemoryTierPolicy\(" + named.replace("(", r"\(")) as e:
        MemoryTierPolicy(**kwargs)
    assert "\n" not in str(e.value) and "expected" in str(e.value)


def test_the_environment_gives_the_default(monkeypatch, caplog):
    assert MemoryTierPolicy.from_env() == MemoryTierPolicy()
    monkeypatch.setenv(memstate.ENV_EVERY, "3")
    monkeypatch.setenv(memstate.ENV_BUDGET, "0.02")
    monkeypatch.setenv("JAXDIST_MEMORY_TIER", "0")
    assert MemoryTierPolicy.from_env() == MemoryTierPolicy(every=3, budget=0.02, enabled=False)
    for off in ("off", "false", "No"):  # the launcher's spellings (issue 37)
        monkeypatch.setenv("JAXDIST_MEMORY_TIER", off)
        assert not MemoryTierPolicy.from_env().enabled
    # the tier is optional: a bad value is one warning and the default, never an error in every rank
    monkeypatch.setenv("JAXDIST_MEMORY_TIER", "maybe")
    monkeypatch.setenv(memstate.ENV_EVERY, "0")
    assert MemoryTierPolicy.from_env() == MemoryTierPolicy(every=None, budget=0.02, enabled=True)
    assert "JAXDIST_MEMORY_TIER='maybe': expected 1" in caplog.text
    assert "JAXDIST_MEMORY_TIER_EVERY='0': expected a whole number" in caplog.text


def test_a_policy_in_code_sets_the_cadence_over_the_environment(tmp_path, monkeypatch):
    # before: only JAXDIST_MEMORY_TIER_EVERY could fix the cadence (InMemoryTier had no policy=)
    monkeypatch.setenv(memstate.ENV_EVERY, "1")
    tier = InMemoryTier(str(tmp_path), rank=0, policy=MemoryTierPolicy(every=3))
    taken = [k for k in range(1, 11) if tier.save(k, {"w": jnp.ones(2) * k}) or tier.flush()]
    tier.close()
    assert taken == [1, 4, 7, 10]
    off = InMemoryTier(str(tmp_path / "off"), rank=0, policy=MemoryTierPolicy(enabled=False))
    assert not off.enabled and off.save(1, {"w": jnp.ones(2)}) is False


def test_backup_and_restore_takes_the_policy(tmp_path, monkeypatch):
    monkeypatch.setenv(memstate.ENV_BUDGET, "0.02")
    b = jaxdist.callbacks.BackupAndRestore(str(tmp_path / "a"),
                                           memory_tier=jaxdist.checkpoint.MemoryTierPolicy(every=2))
    assert (b.memory._every, b.memory._budget) == (2, 0.05)
    default = jaxdist.callbacks.BackupAndRestore(str(tmp_path / "b"))
    assert default.memory_tier == MemoryTierPolicy(budget=0.02)  # the environment's
    with pytest.raises(TypeError, match="memory_tier=2: expected jaxdist.checkpoint.MemoryTierPolicy"):
        jaxdist.callbacks.BackupAndRestore(str(tmp_path / "c"), memory_tier=2)


def test_the_old_names_of_the_tier_and_its_policy_warn_and_are_the_new_ones():
    # before: MemoryTier was the policy and StateTier the tier, under four import paths
    from jaxdist.checkpoint import InMemoryTier as tier
    from jaxdist.checkpoint import MemoryTierPolicy as policy
    with pytest.warns(DeprecationWarning, match=r"jaxdist\.callbacks\.MemoryTier is "
                      r"jaxdist\.checkpoint\.MemoryTierPolicy .* goes in 0\.5\.0"):
        assert jaxdist.callbacks.MemoryTier is policy
    with pytest.warns(DeprecationWarning, match=r"StateTier is jaxdist\.checkpoint\.InMemoryTier"):
        assert jaxdist.memstate.StateTier is tier
    with pytest.warns(DeprecationWarning, match=r"tier_policy\.MemoryTier is"):
        from jaxdist.checkpoint.tier_policy import MemoryTier
    assert MemoryTier is policy
    assert "MemoryTierPolicy" not in jaxdist.callbacks.__all__  # one public path each
    with pytest.raises(AttributeError):
        jaxdist.callbacks.NoSuchThing  # noqa: B018


def test_the_policys_decision_is_pure_and_is_what_the_tier_uses():
    from jaxdist.checkpoint._cadence import TierChoice, TierMeasurements, _Cadence

    m = TierMeasurements(step_s=0.041, loop_s=0.008, copy_s=0.06, land_s=0.028, lost_s=0.001,
                         persist_cpu_s=0.3, persist_s=0.115, probe=12, copies_timed=9,
                         call_steps=1, copy_gaps=(1, 1), write_gaps=(3, 3))
    policy = MemoryTierPolicy(budget=0.05)
    first = policy.decide(m, host_is_device=False)
    assert first == policy.decide(m, host_is_device=False) == TierChoice(1, 3, 1, 5)
    assert MemoryTierPolicy(every=4).decide(m, host_is_device=False)[:2] == (4, 4)
    asked = []  # the stateful part measures and feeds the policy; the policy's answer is kept
    cadence = _Cadence(None, 0.05, host_is_device=True, nbytes=100_000_000,
                       decide=lambda m, **kw: asked.append((m, kw)) or TierChoice(2, 6, 2, 9))
    cadence._steps.extend([1.0, 1.0] + [0.1] * 10)
    cadence.on_copy(0.001)
    for _ in range(2):
        cadence.on_persist(cpu_s=0.05, wall_s=0.05)
    assert asked and asked[-1][1] == {"host_is_device": True}
    assert isinstance(asked[-1][0], TierMeasurements) and asked[-1][0].step_s == pytest.approx(0.1)
    assert (cadence.copy_every, cadence.k, cadence.bound, cadence.bound_all) == (2, 6, 2, 9)
