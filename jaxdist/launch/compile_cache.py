"""The persistent compilation cache ``jaxdist train`` and ``jaxdist launch`` use by default.

A second run of the same training (or a restarted process) reads its compiled steps from JAX's
persistent compilation cache instead of compiling them again: ``jaxdist train --devices 8
--epochs 1`` takes about half as long the second time on a 2-core CPU. Where it lives:

- ``JAX_COMPILATION_CACHE_DIR``, when set, is JAX's own setting and wins;
- else ``JAXDIST_COMPILE_CACHE``: a directory, or ``0`` / ``off`` to turn the cache off;
- else ``$XDG_CACHE_HOME/jaxdist/xla`` (``~/.cache/jaxdist/xla``).

Every compilation is cached (JAX's thresholds set to 0, unless already set), and the directory
is capped at ``JAXDIST_COMPILE_CACHE_MAX_BYTES`` (default 2 GiB; JAX evicts the least recently
used entries). Entries are keyed by the program, the devices and the JAX/XLA versions, so a
cache shared by different jobs or versions never hands one the other's executable.

Known limit (XLA:CPU, seen with jax 0.10.2): an executable with a collective-permute inside a loop
(``lax.ppermute`` in a ``fori_loop``) aborts the process ("Id can't be larger than the number of
participating threads") when it is read back from the cache. jaxdist's own ``ring`` all-reduce
unrolls its loop on the CPU for that reason; a step of your own that does this on the CPU needs
``JAXDIST_COMPILE_CACHE=0`` (or ``--no-compile-cache``).

Known limit (XLA:CPU, jax 0.12.x; not 0.10.2 or 0.11.2): an executable with a cross-process
collective that is read back from the cache never completes its collective (both processes wait
in it for good). A process of a multi-process job on the CPU therefore compiles without the
cache under those versions: ``jaxdist.initialize`` turns it off there and logs why
(`off_for_multiprocess_cpu`), and ``jaxdist launch`` gives such a job no cache of its own (and
says so). A script that joins with ``jax.distributed.initialize`` alone, outside the launcher or
with ``JAX_COMPILATION_CACHE_DIR`` set by hand, needs the cache off on those versions.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Mapping

__all__ = ["ENV_CACHE", "ENV_CACHE_MAX_BYTES", "cache_dir", "cache_env", "enable",
           "cache_hangs", "off_for_multiprocess_cpu"]

ENV_CACHE = "JAXDIST_COMPILE_CACHE"
ENV_CACHE_MAX_BYTES = "JAXDIST_COMPILE_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 2 << 30
_OFF = ("0", "off", "false", "no", "none")


def default_dir(environ: Mapping[str, str] | None = None) -> str:
    """``$XDG_CACHE_HOME/jaxdist/xla``, or ``~/.cache/jaxdist/xla``."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxdist", "xla")


def cache_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """The cache directory the environment asks for, or None when it turns the cache off.

    >>> cache_dir({"JAXDIST_COMPILE_CACHE": "off"}) is None
    True
    >>> cache_dir({"JAX_COMPILATION_CACHE_DIR": "/x", "JAXDIST_COMPILE_CACHE": "/y"})
    '/x'
    >>> cache_dir({"XDG_CACHE_HOME": "/c"})
    '/c/jaxdist/xla'
    """
    environ = os.environ if environ is None else environ
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return environ["JAX_COMPILATION_CACHE_DIR"]
    chosen = environ.get(ENV_CACHE, "").strip()
    if chosen.lower() in _OFF:
        return None
    return os.path.expanduser(chosen) if chosen else default_dir(environ)


def _max_bytes(environ: Mapping[str, str]) -> int:
    text = environ.get(ENV_CACHE_MAX_BYTES, "").strip()
    try:
        value = int(float(text)) if text else DEFAULT_MAX_BYTES
    except ValueError:
        value = -1
    if value < 1:
        import logging

        logging.getLogger(__name__).warning(
            "%s=%r is not a positive number of bytes; using %d", ENV_CACHE_MAX_BYTES, text,
            DEFAULT_MAX_BYTES)
        return DEFAULT_MAX_BYTES
    return value


def _settings(environ: Mapping[str, str]) -> dict[str, str]:
    """Every JAX variable of the cache ``environ`` asks for ({} when off): ``environ``'s own
    values where it has them, jaxdist's defaults elsewhere."""
    where = cache_dir(environ)
    if where is None:
        return {}
    wanted = {"JAX_COMPILATION_CACHE_DIR": where,
              "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    # JAX's size cap needs filelock (a dependency of jaxdist); without it JAX would fail at the
    # first compilation, so the cache then goes uncapped rather than break the run.
    if importlib.util.find_spec("filelock") is not None:
        wanted["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(_max_bytes(environ))
    return {k: environ.get(k) or v for k, v in wanted.items()}


def cache_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to add to ``environ`` to give a JAX process the cache it asks for ({} when
    off); JAX's own settings already in ``environ`` are left as they are.

    >>> sorted(cache_env({"JAXDIST_COMPILE_CACHE": "/c"}).items())  # doctest: +NORMALIZE_WHITESPACE
    [('JAX_COMPILATION_CACHE_DIR', '/c'), ('JAX_COMPILATION_CACHE_MAX_SIZE', '2147483648'),
     ('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0'),
     ('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')]
    """
    environ = os.environ if environ is None else environ
    return {k: v for k, v in _settings(environ).items() if not environ.get(k)}


def heal(where: str) -> int:
    """Gives every entry in cache directory ``where`` the access-time file JAX's size cap reads;
    returns how many lacked one.

    A process that wrote to the directory without the cap (plain JAX with only
    ``JAX_COMPILATION_CACHE_DIR`` set) leaves entries without it, and from then on every capped
    process fails to write any entry (JAX warns "Error writing persistent compilation cache
    entry ... -atime"): the cache would stop growing for good.
    """
    try:
        names = set(os.listdir(where))
    except OSError:
        return 0
    healed = 0
    stamp = time.time_ns().to_bytes(8, "little")
    for name in names:
        if name.endswith("-cache") and name[:-len("-cache")] + "-atime" not in names:
            try:
                with open(os.path.join(where, name[:-len("-cache")] + "-atime"), "wb") as f:
                    f.write(stamp)
                healed += 1
            except OSError:
                continue
    return healed


def enable(environ: Mapping[str, str] | None = None) -> str | None:
    """Turns the cache on in this process (before its first compilation); returns its directory,
    or None when the environment turns it off (or JAX cannot use it: said in the log)."""
    import jax

    environ = os.environ if environ is None else environ
    settings = _settings(environ)
    where = settings.get("JAX_COMPILATION_CACHE_DIR")
    if where is None:
        return None
    try:
        os.makedirs(where, exist_ok=True)
        heal(where)
    except OSError as e:
        import logging

        logging.getLogger(__name__).warning("no compilation cache: %s (%s); set %s to a writable "
                                            "directory, or 0 to turn it off", where, e, ENV_CACHE)
        return None
    options = {"JAX_COMPILATION_CACHE_DIR": ("jax_compilation_cache_dir", str),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS":
                   ("jax_persistent_cache_min_compile_time_secs", float),
               "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES":
                   ("jax_persistent_cache_min_entry_size_bytes", int),
               "JAX_COMPILATION_CACHE_MAX_SIZE": ("jax_compilation_cache_max_size", int)}
    for var, value in settings.items():
        option, kind = options[var]
        jax.config.update(option, kind(value))
    return where


# The first JAX release whose CPU executables, read back from the persistent cache, hang in
# cross-process collectives (0.11.2 does not; 0.12.1 does, and no later release is known to be
# fixed).
_CPU_MULTIPROCESS_BROKEN_FROM = (0, 12)


def _version(text: str) -> tuple[int, ...]:
    """``"0.12.1"`` -> ``(0, 12, 1)``; a suffix (``rc1``, ``.dev``) ends the number.

    >>> _version("0.12.1"), _version("0.13.0rc1"), _version("0.12.dev20260101")
    ((0, 12, 1), (0, 13, 0), (0, 12))
    """
    parts = []
    for part in text.split("."):
        digits = part[:len(part) - len(part.lstrip("0123456789"))]
        if not digits:
            break
        parts.append(int(digits))
        if digits != part:
            break
    return tuple(parts)


def _runs_on_cpu(platforms: str | None = None) -> bool:
    """Whether JAX will run on the CPU, decided without starting its backend: the first platform
    JAX is told to use (``platforms``, else this process's ``jax_platforms``), else whether an
    accelerator's plugin (CUDA, ROCm, TPU) is installed for JAX to pick.

    >>> _runs_on_cpu("cpu"), _runs_on_cpu("cuda,cpu")
    (True, False)
    """
    import importlib.metadata

    if platforms is None:
        import jax

        platforms = str(getattr(jax.config, "jax_platforms", None) or "")
    if platforms.strip():
        return platforms.split(",")[0].strip().lower() == "cpu"
    if importlib.metadata.entry_points(group="jax_plugins"):
        return False
    return importlib.util.find_spec("libtpu") is None


def installed_jax_version() -> str | None:
    """JAX's version as installed (its distribution's metadata), read without importing JAX (the
    launcher's processes never do); None where JAX is not installed as a distribution."""
    import importlib.metadata

    try:
        return importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        return None


def cache_hangs(num_processes: int, platforms: str | None = None,
                jax_version: str | None = None) -> bool:
    """Whether a job of ``num_processes`` processes would hang reading its executables from the
    persistent cache: several processes on the CPU (``platforms`` as ``JAX_PLATFORMS`` reads;
    None: this process's setting) under JAX 0.12 or later (``jax_version``; None: the installed
    one, read without importing JAX).

    >>> cache_hangs(1, "cpu", "0.12.1"), cache_hangs(2, "cpu", "0.11.2")
    (False, False)
    >>> cache_hangs(2, "cpu", "0.12.1"), cache_hangs(2, "cuda", "0.12.1")
    (True, False)
    """
    if num_processes <= 1:
        return False
    if jax_version is None:
        jax_version = installed_jax_version()
        if jax_version is None:
            return False
    if _version(jax_version) < _CPU_MULTIPROCESS_BROKEN_FROM:
        return False
    return _runs_on_cpu(platforms)


def off_for_multiprocess_cpu(num_processes: int) -> bool:
    """Turns the persistent cache off in this process when it is one of a multi-process job
    whose cached executables would hang (`cache_hangs`); returns whether it did. Call it after
    joining, before the first compilation (``jaxdist.initialize`` does)."""
    import jax

    if not cache_hangs(num_processes, jax_version=jax.__version__):
        return False
    if not (getattr(jax.config, "jax_enable_compilation_cache", True)
            and getattr(jax.config, "jax_compilation_cache_dir", None)):
        return False
    jax.config.update("jax_enable_compilation_cache", False)
    import logging

    logging.getLogger(__name__).info(
        "persistent compilation cache off in this process: on jax %s, CPU executables read back "
        "from it hang in cross-process collectives (a job of %d processes)", jax.__version__,
        num_processes)
    return True
