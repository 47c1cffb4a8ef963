"""The host's state directory (``JAXDIST_STATE_DIR``) as the launcher and a process's in-memory
tier share it: the step to stop at (``stop``), a request to write the newest copy now (``flush``,
answered in ``<rank>/flushed``), what a tier does (``<rank>/tier.json``), why a process ended early
(``<rank>/outcome.json``), and the tier's slot files by name and whether a slot holds a complete
snapshot (``<rank>/slot-<i>.json`` and ``.bin``: :func:`slots`). What a slot holds, its checksums
and its writer are the tier's own (``jaxdist.checkpoint._slots``); the launcher only asks whether
a failed job left a snapshot to keep."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

from jaxdist.launch.heartbeat import write_atomic

DEFAULT_BUDGET = 0.05
ENV_TIER = "JAXDIST_MEMORY_TIER"
"""``0`` (or false/off/no) switches the in-memory tier off."""


def tier_on(text: str | None) -> bool:
    """Whether a ``JAXDIST_MEMORY_TIER`` value leaves the in-memory tier on (the default).

    Raises:
      ValueError: a value that is none of the spellings, named with what is expected.

    >>> tier_on(None), tier_on("off"), tier_on("1"), tier_on("No")
    (True, False, True, False)
    """
    word = (text or "").strip().lower()
    if word in ("0", "false", "off", "no"):
        return False
    if word in ("1", "true", "on", "yes", ""):
        return True
    raise ValueError(f"{ENV_TIER}={text!r}: expected 1 (on, the default) or 0 "
                     "(also true/false, on/off, yes/no)")
"""The share of steps/s the tier may cost by default."""


def stop_path(directory: str) -> str:
    """Where the elastic agent writes the step every process of this host stops at."""
    return os.path.join(directory, "stop")


def write_stop(directory: str, step: int) -> None:
    """Asks every process of this host to stop after ``step`` (read by ``InMemoryTier.stop_step``)."""
    write_atomic(stop_path(directory), str(int(step)).encode())


def flush_path(directory: str) -> str:
    """Where the launcher asks every process of its host to write its newest copy now."""
    return os.path.join(directory, "flush")


def request_flush(directory: str) -> str:
    """Asks this host's processes to write their newest copy; returns the request's token (each
    process answers in ``<rank>/flushed``)."""
    token = f"{time.time_ns()}"
    write_atomic(flush_path(directory), token.encode())
    return token


def flushed(directory: str, rank: int | str, token: str) -> bool:
    """Whether process ``rank`` has answered flush request ``token``."""
    return read_token(os.path.join(directory, str(rank), "flushed")) == token


def watches_flush(directory: str, rank: int | str) -> bool:
    """Whether process ``rank`` has a tier that answers flush requests."""
    return os.path.exists(os.path.join(directory, str(rank), "flush-watch"))


def read_token(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().split()[0].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return None


def tier_path(directory: str, rank: int | str) -> str:
    """Where process ``rank`` says what its tier does (size, cadence, the bound on lost steps)."""
    return os.path.join(directory, str(rank), "tier.json")


def read_tier(directory: str, rank: int | str) -> dict | None:
    """Process ``rank``'s ``tier.json`` (None before its tier measured itself)."""
    return _read_json(tier_path(directory, rank))


def describe_tier(info: Mapping[str, Any]) -> str:
    """The launcher's line for a tier's ``tier.json``.

    >>> print(describe_tier({"bytes": 245e6, "copy_every": 2, "every": 8, "bound": 2, "bound_all": 9,
    ...                      "cost_s": 0.012, "step_s": 0.3, "budget": 0.05, "fixed": False}))
    ... # doctest: +NORMALIZE_WHITESPACE
    in-memory tier (rank 0): 245.0 MB, copied to host memory every 2 step(s) and written to the
    state directory every 8, costing about 0.012 s a step against 0.3 s steps (budget 5% of
    steps/s); a failure costs at most 2 step(s), or 9 when no process of the job survives it
    """
    if info.get("fixed"):
        why = "as JAXDIST_MEMORY_TIER_EVERY asks"
    else:
        why = f"budget {info.get('budget', DEFAULT_BUDGET):.0%} of steps/s"
    return (f"in-memory tier (rank 0): {format_bytes(info.get('bytes', 0))}, copied to host memory every "
            f"{info.get('copy_every')} step(s) and written to the state directory every "
            f"{info.get('every')}, costing about {info.get('cost_s') or 0:.2g} s a step against "
            f"{info.get('step_s') or 0:.2g} s steps ({why}); a failure costs at most "
            f"{info.get('bound')} step(s), or {info.get('bound_all')} when no process of the job "
            "survives it")


def outcome_path(directory: str, rank: int | str) -> str:
    """Where process ``rank`` says why it ended early: refused (another state than the job's),
    or ending so that the job re-forms without a refused process."""
    return os.path.join(directory, str(rank), "outcome.json")


def read_outcome(directory: str, rank: int | str) -> dict | None:
    """Process ``rank``'s ``outcome.json`` (None if it wrote none)."""
    return _read_json(outcome_path(directory, rank))


def failing_path(directory: str, rank: int | str) -> str:
    """Where process ``rank`` says when it began to fail (`mark_failing`)."""
    return os.path.join(directory, str(rank), "failing")


def mark_failing(directory: str, rank: int | str) -> None:
    """Process ``rank`` says when it began to fail (its uncaught exception or non-zero
    ``sys.exit``), before its exit handlers run: the launcher names the process that failed
    first, not a peer whose collective failed when this one left the job and that exited sooner."""
    write_atomic(failing_path(directory, rank), repr(time.time()).encode())


def failing_since(directory: str, rank: int | str) -> float | None:
    """When process ``rank`` began to fail (`mark_failing`), or None."""
    try:
        with open(failing_path(directory, rank)) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


def _read_json(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read())
        return value if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None


def format_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


# The in-memory tier's slots (``jaxdist.checkpoint._slots`` writes and reads them): two per
# process, each a data file and a header; a slot is valid only while its header exists.
FORMAT = 1
SLOTS = 2


def header_path(rank_dir: str, slot: int) -> str:
    return os.path.join(rank_dir, f"slot-{slot}.json")


def data_path(rank_dir: str, slot: int) -> str:
    return os.path.join(rank_dir, f"slot-{slot}.bin")


def read_header(rank_dir: str, slot: int) -> dict | None:
    """The slot's header, or None when the slot holds no complete snapshot."""
    try:
        with open(header_path(rank_dir, slot), "rb") as f:
            header = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        return None
    try:
        if os.path.getsize(data_path(rank_dir, slot)) < int(header["bytes"]):
            return None  # truncated behind our back
    except (OSError, KeyError, TypeError, ValueError):
        return None
    return header


def slots(directory: str) -> Iterator[tuple[str, int, dict]]:
    """Every valid slot on this host: ``(rank dir, slot, header)``, any rank's."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in sorted(names):
        rank_dir = os.path.join(directory, name)
        if not name.isdigit() or not os.path.isdir(rank_dir):
            continue
        for slot in range(SLOTS):
            header = read_header(rank_dir, slot)
            if header is not None:
                yield rank_dir, slot, header
