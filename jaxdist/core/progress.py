"""Training progress as the compiled steps see it, for whoever listens.

Every dispatched *training* step (one that hands back a new state: ``@jaxdist.mirrored``,
``strategy.step``, ``strategy.run``, ``fit``) calls :func:`report`. Under ``jaxdist launch`` the
launcher's heartbeat (``jaxdist.launch.heartbeat``) listens, so that hang detection works for every
loop and every state without the loop doing anything. With no listener a report costs one check.

>>> seen = []
>>> stop = listen(lambda steps, marker: seen.append(steps))
>>> report(1, None); report(3, None); stop()
>>> report(1, None); seen
[1, 3]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_listeners: list[Callable[[int, Any], None]] = []


def listen(fn: Callable[[int, Any], None]) -> Callable[[], None]:
    """Calls ``fn(steps, marker)`` after each training step is dispatched; returns a remover.

    ``marker`` is one of the step's outputs that the next step does not consume (its
    ``is_ready()`` tells when the step has completed on the devices), or None.
    """
    _listeners.append(fn)
    return lambda: _listeners.remove(fn) if fn in _listeners else None


def report(steps: int, marker: Any) -> None:
    """Reports ``steps`` training steps dispatched (one call of a compiled step may run several)."""
    for fn in _listeners:
        fn(steps, marker)
