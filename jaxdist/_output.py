"""What jaxdist's command lines show: quiet launcher output, help that gives defaults.

**Launcher output.**

XLA's CPU collectives across processes run on gloo, whose C++ library prints one line per process
when its connections are up (``[Gloo] Rank 0 is connected to 1 peer ranks. ...``) straight to the
process's stderr; there is no switch for it. ``jaxdist launch`` drops those lines unless
``--verbose`` (or ``JAXDIST_VERBOSE=1``) asks for everything.

**Help.** Every ``jaxdist`` subcommand formats its ``--help`` with :class:`DefaultsHelpFormatter`,
which appends ``(default: ...)`` to each option that has a default worth showing.

>>> keep_line(b"[1] [Gloo] Rank 1 is connected to 1 peer ranks. Expected number ...\\n")
False
>>> keep_line(b"[1] [Gloo] Rank 1 is connected to 1 peer ranks.\\n", verbose=True)
True
>>> keep_line(b"[0] epoch 1: loss 0.51\\n")
True
"""

from __future__ import annotations

import argparse
import os
import re

__all__ = ["DefaultsHelpFormatter", "RawDescriptionDefaultsHelpFormatter", "keep_line", "show_defaults",
           "verbose_from_env"]

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
    raw = issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter)
    parser.formatter_class = RawDescriptionDefaultsHelpFormatter if raw else DefaultsHelpFormatter
    for action in parser._actions:
        if action.help is None and action.option_strings and not _unset(action.default):
            action.help = "(default: %(default)s)"  # argparse prints no help line without a text
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                show_defaults(sub)
    return parser
