"""The public API of jaxdist, read from the package itself, for the API reference and its check.

``docs/conf.py`` writes one reference page per module from :func:`public_api` before Sphinx reads
the sources, and fails the build when a public name has no rendered entry or no docstring;
``tests/test_docs.py`` runs the same listing without Sphinx. A public name is one in the module's
``__all__``; a public module without ``__all__`` exposes the classes and functions it defines or
re-exports from its own subpackage. Public submodules are the modules named in
``jaxdist.__all__`` plus :data:`EXTRA_MODULES`.
"""

from __future__ import annotations

import importlib
import inspect
import os
import types

# Public modules that ``jaxdist.__all__`` does not name (imported as ``jaxdist.plan`` etc.).
EXTRA_MODULES = ("jaxdist.plan", "jaxdist.evaluator", "jaxdist.memstate")


def public_names(module: types.ModuleType) -> list[str]:
    """The public names of ``module``: its ``__all__``, or what it defines without a leading ``_``.

    Plain values of built-in types in ``__all__`` (``jaxdist.plan.LINKS``, a dict) are left out:
    their docstring would be the built-in type's; the module's own docstring describes them."""
    if hasattr(module, "__all__"):
        return [n for n in module.__all__ if not isinstance(getattr(module, n), types.ModuleType)
                and not _builtin_value(getattr(module, n))]
    names = []
    for name, obj in vars(module).items():
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        home = getattr(obj, "__module__", "") or ""
        if home == module.__name__ or home.startswith(module.__name__ + "."):
            names.append(name)
    return sorted(names)


def _builtin_value(obj: object) -> bool:
    return type(obj).__module__ == "builtins" and not callable(obj)


def public_modules() -> list[str]:
    """``jaxdist`` first, then its public submodules, sorted."""
    import jaxdist

    subs = {f"jaxdist.{n}" for n in jaxdist.__all__
            if isinstance(getattr(jaxdist, n), types.ModuleType)}
    return ["jaxdist"] + sorted(subs | set(EXTRA_MODULES))


def public_api() -> dict[str, list[str]]:
    """``{module name: [public names]}`` for every public module."""
    return {m: public_names(importlib.import_module(m)) for m in public_modules()}


def undocumented(api: dict[str, list[str]] | None = None) -> list[str]:
    """Public names whose object has no docstring of its own (``module.name`` each)."""
    missing = []
    for module, names in (api or public_api()).items():
        mod = importlib.import_module(module)
        for name in names:
            obj = getattr(mod, name)
            if not inspect.getdoc(obj) or (inspect.isclass(obj) and obj.__doc__ is None):
                missing.append(f"{module}.{name}")
    return missing


def aliases(api: dict[str, list[str]]) -> dict[str, str]:
    """``{"module.name": "first.module.name"}`` for objects already public under an earlier name.

    Sphinx documents an object once; a second public name for it (``jaxdist.ps.ParameterServerStrategy``
    is ``jaxdist.ParameterServerStrategy``) links to the first entry instead.
    """
    first: dict[int, str] = {}
    out = {}
    for module, names in api.items():
        mod = importlib.import_module(module)
        for name in names:
            obj = getattr(mod, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if id(obj) in first:
                out[f"{module}.{name}"] = first[id(obj)]
            else:
                first[id(obj)] = f"{module}.{name}"
    return out


def page(module: str, names: list[str], alias: dict[str, str]) -> str:
    """The reST source of one module's reference page."""
    own = [n for n in names if f"{module}.{n}" not in alias]
    lines = [module, "=" * len(module), "", f".. automodule:: {module}", "   :no-members:", "",
             f".. currentmodule:: {module}", ""]
    if own:
        lines += [".. autosummary::", "   :toctree: generated", "   :nosignatures:", ""]
        lines += [f"   {n}" for n in own] + [""]
    again = [n for n in names if f"{module}.{n}" in alias]
    if again:
        lines += ["Also public here, documented under their first name:", ""]
        for n in again:
            role = "class" if inspect.isclass(getattr(importlib.import_module(module), n)) else "func"
            lines.append(f"- ``{module}.{n}``: :{role}:`{alias[module + '.' + n]}`")
    return "\n".join(lines) + "\n"


def write_pages(directory: str) -> dict[str, list[str]]:
    """Write ``<module>.rst`` for every public module under ``directory``; returns the API."""
    api = public_api()
    os.makedirs(directory, exist_ok=True)
    alias = aliases(api)
    for module, names in api.items():
        text = page(module, names, alias)
        path = os.path.join(directory, f"{module}.rst")
        if not os.path.exists(path) or open(path).read() != text:
            with open(path, "w") as f:
                f.write(text)
    return api
