"""The GPU session's targets, each PASS or MISS, from the parts' JSON files.

``benchmarks/gpu_session.sh`` runs the parts (the input path, the tier's cost, a SIGKILL, the GPT
loops) and then this over their files: one line per target, the figure against its threshold, and
an exit code that is not 0 when any target is missed or its part left no figure (the parts
missed are named on the last line). A target's threshold can be changed for one run
(``--target tier.steps_per_s=0.99``, or ``GPU_TARGETS="name=value ..."``), which is also how a
check is shown to fail: set one out of reach.

``--dry-run`` is the session's run at tiny sizes on a CPU: its speeds say nothing, so the targets
a device's speed sets (the ratios, the bounds the tier derives from what its copies cost, and
whether a SIGKILL stayed within the bound announced before it: a write slower than any the tier
timed, as a loaded CPU has, breaks that estimate) only ask for a figure unless one is set
explicitly; every correctness target (same numbers, bit-exact resume from memory, the tier
switched on) holds as on a GPU.

    python benchmarks/gpu_verdict.py DIR [--dry-run] [--target NAME=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Callable
from typing import Any

# "part.name": (file, what it is, "min" / "max" / "true", threshold, set by the device's speed?)
TARGETS: dict[str, tuple[str, str, str, float, bool]] = {
    "input.fit_mlp": ("overhead_mlp.json", "fit / hand-written loop on placed batches, "
                      "MLP 784-256-128-10 batch 512, steps/s", "min", 0.9, True),
    "input.fit_k_tiny": ("overhead_tiny.json", "fit(steps_per_execution=9) / hand-written "
                         "loop, MLP 64-32-10 batch 32, steps/s", "min", 1.0, True),
    "input.same_numbers": ("overhead_mlp.json", "every loop ends on the hand-written "
                           "loop's parameters (every leaf)", "true", 1, False),
    "tier.steps_per_s": ("gpt_launch.json", "in-memory tier on / off, steps/s over the "
                         "launched runs' windows", "min", 0.97, True),
    "tier.enabled": ("gpt_launch.json", "the tier ran in every tier-on run and in no "
                     "tier-off run", "true", 1, False),
    "tier.bound": ("gpt_launch.json", "steps a failure costs with a survivor, as "
                   "announced (largest)", "max", 2, True),
    "tier.bound_all": ("gpt_launch.json", "steps a failure costs with no survivor, as "
                       "announced (largest)", "max", 8, True),
    "kill.within_bound": ("gpt_kill.json", "steps computed again after the SIGKILL, less "
                          "the bound announced before it (replicated and zero_stage=3)", "max", 0,
                          True),
    "kill.from_memory": ("gpt_kill.json", "resumed from the memory tier, tier on "
                         "(replicated and zero_stage=3)", "true", 1, False),
    "kill.exact": ("gpt_kill.json", "parameters after the kill / uninterrupted run's, "
                   "distance over distance moved (deterministic pass)", "max", 1e-6, False),
    "gpt.same_numbers": ("gpt_check.json", "every GPT loop ends on the hand-written loop's "
                         "parameters (deterministic pass)", "true", 1, False),
    "gpt.mirrored": ("gpt_inproc.json", "@mirrored / hand-written, tokens/s", "min", 0.99,
                     True),
    "gpt.fit": ("gpt_inproc.json", "fit / hand-written, tokens/s", "min", 0.99, True),
    "gpt.zero3": ("gpt_inproc.json", "zero_stage=3 / hand-written, tokens/s", "min", 0.99,
                  True),
}


def _row(res: dict, loop: str, key: str = "vs_hand") -> float | None:
    return next((r[key] for r in res.get("table", []) if r["loop"] == loop), None)


def _kills(res: dict) -> list[dict]:
    kills = list(res.get("kill", {}).values())
    return kills if len(kills) == 2 else []  # both stages, or no figure


def _within(res: dict) -> float | None:
    kills = _kills(res)
    if not kills or any(k["recomputed"] is None or k["announced"] is None for k in kills):
        return None
    return max(k["recomputed"] - k["announced"] for k in kills)


def _rows(res: dict, loop: str) -> float | None:
    return res.get("summary", {}).get("rows", {}).get(loop, {}).get("ratio_to_hand")


FIGURES: dict[str, Callable[[dict], Any]] = {
    "input.fit_mlp": lambda r: _row(r, "fit"),
    "input.fit_k_tiny": lambda r: _row(r, "fit_k"),
    "input.same_numbers": lambda r: "same_numbers" in r,
    "tier.steps_per_s": lambda r: r.get("summary", {}).get("tier_steps_per_s_ratio"),
    "tier.enabled": lambda r: bool(r.get("launch", {}).get("on")) and r.get(
        "summary", {}).get("tier_enabled_ok"),
    "tier.bound": lambda r: max((b for x in r.get("launch", {}).get("on", [])
                                 for b in x.get("bounds", [])), default=None),
    "tier.bound_all": lambda r: max((b for x in r.get("launch", {}).get("on", [])
                                     for b in x.get("bounds_all", [])), default=None),
    "kill.within_bound": _within,
    "kill.from_memory": lambda r: bool(_kills(r)) and all(
        k["resumed_from"] == "memory" and k.get("tier_enabled") is True for k in _kills(r)),
    "kill.exact": lambda r: max((k["distance"] for k in _kills(r)), default=None),
    "gpt.same_numbers": lambda r: bool(r.get("summary", {}).get("same_numbers")) and r[
        "summary"].get("same_numbers_ok") and r["summary"].get("same_numbers_checked"),
    "gpt.mirrored": lambda r: _rows(r, "mirrored"),
    "gpt.fit": lambda r: _rows(r, "fit"),
    "gpt.zero3": lambda r: _rows(r, "zero3"),
}


def _overrides(given: list[str]) -> dict[str, float]:
    out = {}
    for item in given:
        name, sep, value = item.partition("=")
        if not sep or name not in TARGETS:
            raise SystemExit(f"--target {item!r}: expected NAME=VALUE with NAME one of "
                             f"{', '.join(TARGETS)}")
        try:
            out[name] = float(value)
        except ValueError:
            raise SystemExit(f"--target {item!r}: {value!r} is not a number") from None
    return out


def verdict(directory: str, *, dry_run: bool = False,
            overrides: dict[str, float] | None = None) -> tuple[list[str], list[str]]:
    """``(lines, parts missed)`` for the JSON files in ``directory``."""
    overrides = overrides or {}
    lines, missed = [], []
    for name, (file, what, kind, threshold, speed) in TARGETS.items():
        part = name.partition(".")[0]
        if dry_run and speed:  # a figure, any figure: the plumbing ran
            threshold = 0.0 if kind == "min" else float("inf")
        threshold = overrides.get(name, threshold)
        path = os.path.join(directory, file)
        try:
            with open(path) as f:
                figure = FIGURES[name](json.load(f))
        except (OSError, ValueError, KeyError, TypeError):
            figure = None
        if figure is None:
            ok, shown = False, f"no figure ({file} missing or incomplete: the part did not finish)"
        elif kind == "true":
            ok, shown = bool(figure), f"{bool(figure)}"
        elif kind == "min":
            ok, shown = figure >= threshold, f"{figure:.4g} (target >= {threshold:g})"
        else:
            ok, shown = figure <= threshold, f"{figure:.4g} (target <= {threshold:g})"
        lines.append(f"{'PASS' if ok else 'MISS'}  {name}: {what}: {shown}")
        if not ok and part not in missed:
            missed.append(part)
    return lines, missed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory", help="where the parts wrote their JSON files")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny sizes on a CPU: speed targets only ask for a figure")
    ap.add_argument("--target", action="append", default=[], metavar="NAME=VALUE",
                    help="another threshold for one target (repeatable)")
    args = ap.parse_args()
    given = shlex.split(os.environ.get("GPU_TARGETS", "")) + args.target
    lines, missed = verdict(args.directory, dry_run=args.dry_run, overrides=_overrides(given))
    print("\n".join(lines))
    if missed:
        print(f"MISS in part(s): {', '.join(missed)}")
        sys.exit(6)
    print(f"every target PASS{' (dry run: speeds not held)' if args.dry_run else ''}")


if __name__ == "__main__":
    main()
