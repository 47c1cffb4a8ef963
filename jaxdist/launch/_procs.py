"""What the launcher and the elastic agent both say about processes and ports."""

from __future__ import annotations

import signal
import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free TCP ports on ``host`` (best effort: another process may take one).

    All ``n`` sockets are held open together so that the ports differ; ``host=""`` binds every
    interface (a port other hosts will connect to).

    >>> a, b = free_ports(2); a != b
    True
    """
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def describe_exit(returncode: int) -> str:
    """How a process ended, from its ``returncode`` (negative: the signal that killed it).

    >>> describe_exit(-9), describe_exit(3)
    ('was killed by SIGKILL (9)', 'exited with code 3')
    """
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "signal"
        return f"was killed by {name} ({-returncode})"
    return f"exited with code {returncode}"


def exit_code(returncode: int) -> int:
    """A shell's exit status for ``returncode``: 128 + N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode
