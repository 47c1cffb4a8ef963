"""Root conftest: every test and doctest sees 8 simulated CPU devices, and the suite's processes
share one persistent compilation cache.

This must run before anything starts JAX's backend, hence here and not in tests/.

The cache (``~/.cache/jaxdist/tests-xla``, or ``JAXDIST_TEST_COMPILE_CACHE``; kept between runs,
capped by JAX at 1 GiB) serves the pytest process and every process the suite starts: this
process's environment carries it, and ``_with_cache`` below adds it to every explicit ``env=`` a
test hands to ``subprocess`` (``launch.run`` and notebook kernels start theirs the same way), so a
test that builds a minimal environment still compiles nothing another process already compiled.
A test that checks a process's own cache handling sets ``JAXDIST_TEST_OWN_CACHE=1`` in the
environment it passes, and gets exactly that environment.
"""

import os
import subprocess

import jax

jax.config.update("jax_num_cpu_devices", 8)

from jaxdist.launch import compile_cache  # noqa: E402 - after the device count

_CACHE = os.environ.get("JAXDIST_TEST_COMPILE_CACHE") or os.path.join(
    compile_cache.default_dir(), os.pardir, "tests-xla")
os.environ.setdefault(compile_cache.ENV_CACHE, os.path.normpath(_CACHE))
os.environ.setdefault(compile_cache.ENV_CACHE_MAX_BYTES, str(1 << 30))
CACHE_ENV = {compile_cache.ENV_CACHE: os.environ[compile_cache.ENV_CACHE],
             compile_cache.ENV_CACHE_MAX_BYTES: os.environ[compile_cache.ENV_CACHE_MAX_BYTES]}
CACHE_ENV.update(compile_cache.cache_env(os.environ))
os.environ.update(CACHE_ENV)
compile_cache.enable()

_popen_init = subprocess.Popen.__init__


def _with_cache(self, args, *rest, env=None, **kw):
    if env is not None and not env.get("JAXDIST_TEST_OWN_CACHE"):
        env = {**CACHE_ENV, **env}
    _popen_init(self, args, *rest, env=env, **kw)


subprocess.Popen.__init__ = _with_cache  # type: ignore[method-assign]

# A deprecated path's stub module warns when imported (a DeprecationWarning, an error in this
# suite): the doctest collector must not import it. tests/test_layout.py imports every moved path.
collect_ignore = ["jaxdist/launch/memstate.py", "jaxdist/launch/slot_files.py"]
