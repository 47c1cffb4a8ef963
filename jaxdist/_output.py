"""What jaxdist's command lines show and accept: quiet launcher output, help that gives defaults,
values checked as they are parsed, and mistakes told in one line.

**Launcher output.**

XLA's CPU collectives across processes run on gloo, whose C++ library prints one line per process
when its connections are up (``[Gloo] Rank 0 is connected to 1 peer ranks. ...``) straight to the
process's stderr; there is no switch for it. ``jaxdist launch`` drops those lines unless
``--verbose`` (or ``JAXDIST_VERBOSE=1``) asks for everything.

**gRPC's log lines.** gRPC's C core logs at INFO unless ``GRPC_VERBOSITY`` says otherwise, and
reads it as it loads: every elastic agent would print an ``I... Got goaway`` line whenever a
rendezvous store it talks to stops. ``jaxdist`` imports this module first, and it loads gRPC at
its warning level (warnings and errors stay); a ``GRPC_VERBOSITY`` the user set wins, and none is
left in the environment the job's processes inherit.

**Help.** Every ``jaxdist`` subcommand formats its ``--help`` with :class:`DefaultsHelpFormatter`,
which appends ``(default: ...)`` to each option that has a default worth showing.

**Values.** Options are parsed by the argparse types below (:func:`integer`, :func:`real`,
:func:`size`, :func:`duration`, ...), so a bad value is refused before any work starts, and
:class:`ArgumentParser` reports a mistake in one line naming the flag and a valid value, with
argparse's exit status 2. Sizes and times take units everywhere (``100MB``, ``16GiB``, ``12ms``):
:func:`parse_bytes` and :func:`parse_seconds` are the one parser of each.

>>> keep_line(b"[1] [Gloo] Rank 1 is connected to 1 peer ranks. Expected number ...\\n")
False
>>> keep_line(b"[1] [Gloo] Rank 1 is connected to 1 peer ranks.\\n", verbose=True)
True
>>> keep_line(b"[0] epoch 1: loss 0.51\\n")
True
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import sys
from collections.abc import Callable, Mapping

_USER_GRPC_VERBOSITY = os.environ.get("GRPC_VERBOSITY")
os.environ["GRPC_VERBOSITY"] = _USER_GRPC_VERBOSITY or "ERROR"
try:
    import grpc  # noqa: E402,F401  (loaded now, at that level: see the module's docstring)
finally:
    if _USER_GRPC_VERBOSITY is None:
        del os.environ["GRPC_VERBOSITY"]

__all__ = ["ArgumentParser", "DefaultsHelpFormatter", "RawDescriptionDefaultsHelpFormatter",
           "duration", "integer", "keep_line", "module_factory", "parse_bytes", "parse_seconds",
           "real", "show_defaults", "size", "usage_error", "verbose_from_env"]

_CHATTER = re.compile(rb"^(?:\[[^\]\s]*\] )?\[Gloo\] Rank \d+ is connected to \d+ peer ranks")


def verbose_from_env() -> bool:
    """True when ``JAXDIST_VERBOSE`` is set to anything but ``""``/``0``/``false``."""
    return os.environ.get("JAXDIST_VERBOSE", "").strip().lower() not in ("", "0", "false", "no")


def keep_line(line: bytes, verbose: bool = False) -> bool:
    """Whether the launcher shows ``line`` (one output line, with or without its rank prefix).

    Args:
      line: the bytes of one line as a process printed it (``"[rank] "`` prefix allowed).
      verbose: show everything, gloo's connection lines included.

    Returns:
      False for a gloo per-connection line when not ``verbose``; True otherwise.
    """
    return verbose or not _CHATTER.match(line)


_PREFIX = re.compile(rb"^(\[[^\]\s]*\] )?")
_PEER_GONE = re.compile(rb"[Gg]loo|Connection (?:closed|reset) by peer|[Ss]ocket closed|"
                        rb"[Bb]roken pipe|peer (?:process|task).*(?:died|gone|unhealthy)")
_TRACEBACK_GOES_ON = (b"Traceback (most recent call last):", b"During handling of the above",
                      b"The above exception was")


class TracebackFolder:
    r"""Folds the traceback a surviving process prints when a peer of its collective ends (a
    Gloo "Connection closed by peer" error, some 40 lines) into one line: the launcher has
    already said which process ended and why. Every other traceback passes as it is.

    ``feed`` takes one output line of a process (``"[rank] "`` prefix allowed) and returns the
    lines to show now: a traceback's lines are held until its exception line decides. ``flush``
    returns what is still held (a process that ended mid-traceback).

    >>> f = TracebackFolder()
    >>> lines = [b"[1] Traceback (most recent call last):\n", b'[1]   File "x.py", line 3\n',
    ...          b"[1] jax.errors.JaxRuntimeError: INTERNAL: Gloo: Connection closed by peer\n"]
    >>> [out for line in lines for out in f.feed(line)]  # doctest: +ELLIPSIS
    [b'[1] jax.errors.JaxRuntimeError: INTERNAL: Gloo: Connection closed by peer (a peer process ...)\n']
    >>> [out for line in [b"[0] Traceback (most recent call last):\n", b"[0] ValueError: x\n"]
    ...  for out in f.feed(line)]
    [b'[0] Traceback (most recent call last):\n', b'[0] ValueError: x\n']
    """

    def __init__(self):
        self._held: dict[bytes, list[bytes]] = {}

    def feed(self, line: bytes) -> list[bytes]:
        prefix = _PREFIX.match(line)[0]  # the pattern matches every line
        text = line[len(prefix):]
        held = self._held.get(prefix)
        if held is None:
            if not text.startswith(_TRACEBACK_GOES_ON[0]):
                return [line]
            self._held[prefix] = [line]
            return []
        if (not text.strip() or text[:1] in (b" ", b"\t") or text.startswith(_TRACEBACK_GOES_ON)):
            held.append(line)
            return []
        del self._held[prefix]  # the exception line: it decides
        if not _PEER_GONE.search(text):
            return [*held, line]
        return [prefix + text.rstrip(b"\r\n") + b" (a peer process of the collective ended, as "
                b"said above; the %d-line traceback is left out: -v shows it)\n" % len(held)]

    def flush(self) -> list[bytes]:
        held = [line for lines in self._held.values() for line in lines]
        self._held.clear()
        return held


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` with ``(default: X)`` after each option whose default is a value.

    Options whose default is ``None`` or ``False`` (flags, "not set") and help texts that already
    mention a default are left as written.

    >>> p = argparse.ArgumentParser(prog="x", formatter_class=DefaultsHelpFormatter)
    >>> _ = p.add_argument("--epochs", type=int, default=5, help="passes over the data")
    >>> _ = p.add_argument("--quiet", action="store_true", help="no progress bar")
    >>> "passes over the data (default: 5)" in p.format_help(), "(default: False)" in p.format_help()
    (True, False)
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or _unset(action.default)
                or "default" in text.lower() or isinstance(action, argparse._VersionAction)):
            return action.help
        return f"{text} (default: %(default)s)"


class RawDescriptionDefaultsHelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """:class:`DefaultsHelpFormatter` that keeps the description's and epilog's line breaks."""


def _unset(default) -> bool:
    return default is None or default is False or default is argparse.SUPPRESS


def show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Gives ``parser`` and its subcommands' parsers :class:`DefaultsHelpFormatter`; returns it.

    A parser that keeps its description's line breaks keeps them
    (:class:`RawDescriptionDefaultsHelpFormatter`).
    """
    raw = isinstance(parser.formatter_class, type) and issubclass(parser.formatter_class,
                                                                   argparse.RawDescriptionHelpFormatter)
    parser.formatter_class = RawDescriptionDefaultsHelpFormatter if raw else DefaultsHelpFormatter
    for action in parser._actions:
        if action.help is None and action.option_strings and not _unset(action.default):
            action.help = "(default: %(default)s)"  # argparse prints no help line without a text
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                show_defaults(sub)
    return parser


# --- the values command lines accept ----------------------------------------------------------

_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0,
               "h": 3600.0}
_NUMBER_UNIT = re.compile(r"^([-+]?(?:\d[\d_]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*(\S*)$")


def _with_unit(text: str | float, units: Mapping[str, float], what: str, example: str) -> float:
    """A number followed by one of ``units`` (matched without regard to case) or by nothing."""
    match = _NUMBER_UNIT.match(str(text).strip())
    if match is None:
        raise ValueError(f"expected {what} such as {example}, got {str(text)!r}")
    number, unit = match.groups()
    if not unit:
        return float(number)
    scale = {k.lower(): v for k, v in units.items()}.get(unit.lower())
    if scale is None:
        raise ValueError(f"unknown unit {unit!r} in {str(text)!r}; expected one of "
                         f"{', '.join(units)} (e.g. {example})")
    return float(number) * scale


def parse_bytes(text: str | float) -> float:
    """Bytes from ``"100MB"`` (decimal units), ``"16GiB"`` (binary) or a plain number of bytes.

    Args:
      text: a number, optionally followed by B, KB, MB, GB, TB, KiB, MiB, GiB or TiB (any case,
        a space allowed).

    Returns:
      The number of bytes (a float).

    Raises:
      ValueError: not a number, or an unknown unit (the message lists the units).

    >>> parse_bytes("16GiB") == 16 * 2**30, parse_bytes("100MB"), parse_bytes("1e6")
    (True, 100000000.0, 1000000.0)
    >>> parse_bytes("2 kib")
    2048.0
    """
    return _with_unit(text, _SIZE_UNITS, "a size", "100MB, 16GiB or 1e8")


def parse_seconds(text: str | float) -> float:
    """Seconds from ``"12ms"``, ``"250us"``, ``"0.3s"``, ``"2min"``, ``"1h"`` or a plain number of
    seconds.

    Args:
      text: a number, optionally followed by ns, us (or µs), ms, s, min or h.

    Returns:
      The number of seconds (a float).

    Raises:
      ValueError: not a number, or an unknown unit (the message lists the units).

    >>> parse_seconds("12ms"), parse_seconds("250us"), parse_seconds("0.3s"), parse_seconds("2")
    (0.012, 0.00025, 0.3, 2.0)
    """
    return _with_unit(text, _TIME_UNITS, "a time", "12ms, 0.3s or 250us")


def _bounds(above=None, at_least=None, at_most=None, below=None) -> str:
    parts = ([f"> {above:g}"] if above is not None else []) + (
        [f">= {at_least:g}"] if at_least is not None else []) + (
        [f"<= {at_most:g}"] if at_most is not None else []) + (
        [f"< {below:g}"] if below is not None else [])
    return " and ".join(parts)


def _in_bounds(value: float, above=None, at_least=None, at_most=None, below=None) -> bool:
    return ((above is None or value > above) and (at_least is None or value >= at_least)
            and (at_most is None or value <= at_most) and (below is None or value < below))


def integer(*, at_least: int = 1, at_most: int | None = None,
            example: int | str) -> Callable[[str], int]:
    """An argparse ``type``: a whole number from ``at_least`` to ``at_most``.

    Args:
      at_least, at_most: the bounds (inclusive; ``at_most`` None: no upper bound).
      example: a valid value, quoted in the message of a bad one.

    Returns:
      The parsing function (it raises ``argparse.ArgumentTypeError`` naming the bounds).

    >>> epochs = integer(at_least=1, example=10)
    >>> epochs("3")
    3
    >>> epochs("0")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: expected a whole number >= 1 (e.g. 10), got 0
    """
    bounds = f">= {at_least}" if at_most is None else f"from {at_least} to {at_most}"

    def parse(text: str) -> int:
        try:
            value = int(str(text).strip())
        except ValueError:
            value = None
        if value is None or not _in_bounds(value, at_least=at_least, at_most=at_most):
            raise argparse.ArgumentTypeError(
                f"expected a whole number {bounds} (e.g. {example}), got {text}")
        return value

    parse.__name__ = "integer"
    return parse


def real(*, above: float | None = None, at_least: float | None = None,
         at_most: float | None = None, below: float | None = None,
         example: float | str) -> Callable[[str], float]:
    """An argparse ``type``: a finite number within the given bounds.

    Args:
      above, at_least, at_most, below: the bounds (``>``, ``>=``, ``<=``, ``<``; None: none).
      example: a valid value, quoted in the message of a bad one.

    Returns:
      The parsing function (it raises ``argparse.ArgumentTypeError`` naming the bounds).

    >>> real(above=0, example=1e-3)("-1")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: expected a number > 0 (e.g. 0.001), got -1
    """
    bounds = _bounds(above, at_least, at_most, below)

    def parse(text: str) -> float:
        try:
            value = float(str(text).strip())
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or not _in_bounds(value, above, at_least, at_most, below):
            raise argparse.ArgumentTypeError(
                f"expected a number{' ' + bounds if bounds else ''} (e.g. {example}), got {text}")
        return value

    parse.__name__ = "number"
    return parse


def _positive_with_unit(parse_fn, what: str, example: str, zero: bool = False):
    def parse(text: str) -> float:
        try:
            value = parse_fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(
                f"expected {what} {'>=' if zero else '>'} 0 (e.g. {example}), got {text}")
        return value

    parse.__name__ = what
    return parse


def size(*, example: str = "100MB") -> Callable[[str], float]:
    """An argparse ``type``: a positive number of bytes, with units (:func:`parse_bytes`).

    >>> size()("16GiB") == 16 * 2**30
    True
    >>> size()("100XB")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    argparse.ArgumentTypeError: unknown unit 'XB' in '100XB'; expected one of B, KB, MB, GB, TB,
    KiB, MiB, GiB, TiB (e.g. 100MB, 16GiB or 1e8)
    """
    return _positive_with_unit(parse_bytes, "a size", example)


def duration(*, example: str = "12ms", zero: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a positive time in seconds (``zero``: or 0), with units
    (:func:`parse_seconds`).

    >>> duration()("12ms")
    0.012
    >>> duration()("0")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: expected a time > 0 (e.g. 12ms), got 0
    """
    return _positive_with_unit(parse_seconds, "a time", example, zero)


_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def module_factory(*, builtins: tuple[str, ...] = (), example: str) -> Callable[[str], str]:
    """An argparse ``type``: one of ``builtins`` or ``MODULE:FACTORY`` (checked for form only).

    >>> model = module_factory(builtins=("mlp", "cnn"), example="mypkg.models:make")
    >>> model("cnn"), model("mypkg.models:make")
    ('cnn', 'mypkg.models:make')
    >>> model("resnet")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: expected mlp, cnn or MODULE:FACTORY (e.g. mypkg.models:make), got resnet
    """
    choices = ", ".join(builtins) + (" or " if builtins else "")

    def parse(text: str) -> str:
        if text in builtins or _SPEC.match(text):
            return text
        raise argparse.ArgumentTypeError(
            f"expected {choices}MODULE:FACTORY (e.g. {example}), got {text}")

    parse.__name__ = "module:factory"
    return parse


def _can_create(text: str, path: str) -> None:
    """Creates and removes ``path`` once: a folder where nothing can be made (``/proc``, a
    read-only mount) is one usage line now, not a traceback once training has begun."""
    try:
        os.mkdir(path)
    except FileExistsError:  # another process of the job made it meanwhile
        return
    except OSError as e:
        raise argparse.ArgumentTypeError(
            f"{text}: cannot create a directory there ({e.strerror or e})") from None
    try:
        os.rmdir(path)
    except OSError:  # another process of the job has begun to fill it: it stays
        pass


def directory(*, exists: bool) -> Callable[[str], str]:
    """An argparse ``type``: a directory that exists (``exists=True``), or a path that can become
    one (not a file, in a folder that exists)."""

    def parse(text: str) -> str:
        path = os.path.expanduser(text)
        if exists and not os.path.isdir(path):
            raise argparse.ArgumentTypeError(
                f"{text} is not a directory" + ("" if os.path.exists(path) else
                                                 " (it does not exist)"))
        if not exists:
            parent = os.path.dirname(os.path.abspath(path))
            if os.path.exists(path) and not os.path.isdir(path):
                raise argparse.ArgumentTypeError(f"{text} is a file; expected a directory")
            if not os.path.isdir(parent):
                raise argparse.ArgumentTypeError(
                    f"the parent directory {parent} of {text} does not exist")
            if not os.path.exists(path):
                _can_create(text, path)
        return path

    parse.__name__ = "directory"
    return parse


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` whose mistakes are one line on stderr, exit status 2.

    argparse prints its usage block above the error, a dozen lines for ``jaxdist train``; this
    prints ``PROG: error: MESSAGE`` alone, with the closest option or choice for a typo.
    Subcommands' parsers are of this class too (argparse makes them with the parent's class), and
    an unrecognized option is reported by the subcommand it was given to.

    >>> p = ArgumentParser(prog="jaxdist train")
    >>> _ = p.add_argument("--batch-size", type=integer(example=128))
    >>> p.parse_args(["--batchsize", "5"])  # doctest: +SKIP
    jaxdist train: error: unrecognized arguments: --batchsize 5 (did you mean --batch-size?)
    """

    def error(self, message: str):
        usage_error(self.prog, " ".join(message.split()) + self._suggestion(message))

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            self._chosen(parsed).error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed

    def _chosen(self, parsed) -> "ArgumentParser":
        """The (sub)parser that read the options: the innermost subcommand chosen."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                sub = action.choices.get(getattr(parsed, action.dest, None) or "")
                if isinstance(sub, ArgumentParser):
                    return sub._chosen(parsed)
        return self

    def _suggestion(self, message: str) -> str:
        options = [s for s in self._option_string_actions if s.startswith("--")]
        if message.startswith("unrecognized arguments:"):
            guesses = [difflib.get_close_matches(word.split("=")[0], options, n=1, cutoff=0.6)
                       for word in message.split()[2:] if word.startswith("-")]
            close = [g[0] for g in guesses if g]
            return f" (did you mean {' / '.join(close)}?)" if close else ""
        match = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if match:
            choices = {c.lower(): c for c in re.findall(r"'([^']*)'", match[2])}
            close = difflib.get_close_matches(match[1].lower(), list(choices), n=1)
            return f" (did you mean {choices[close[0]]!r}?)" if close else ""
        return ""


def usage_error(prog: str, message: str):
    """Ends the command as argparse does for a bad argument: one line, ``PROG: error: MESSAGE``,
    on stderr and exit status 2 (for checks that involve several options or the data)."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(2)
