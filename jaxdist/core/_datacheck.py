"""Checks on input values that JAX would otherwise accept silently.

* **Values that do not fit the dtype JAX will use.** Without ``jax_enable_x64``, JAX stores int64,
  uint64 and float64 as their 32-bit counterparts, so a uint64 label of 2**63 would arrive as 0.
  Such leaves are refused with an error naming the leaf (precision lost by float64 -> float32 is
  expected and allowed; values beyond float32's range, which would become inf, are refused).
* **NaN / inf in in-memory float data.** Warned about (``RuntimeWarning``), not refused: NaN is a
  legitimate encoding of "missing" that a model may mask or impute, as Keras and tf.data accept it;
  but unhandled it trains silently to NaN, so the warning names the leaf, the count, and
  ``jaxdist.callbacks.TerminateOnNaN``.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np

from jaxdist.core._types import PyTree

_CHUNK = 1 << 22  # elements per pass, so a check never allocates more than a few MB


def _name(path) -> str:
    return "data" + "".join(str(k) for k in path)


def _host_leaves(tree: PyTree):
    """(path, numpy array) for leaves not yet in JAX (a ``jax.Array`` already has JAX's dtype)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(leaf, jax.Array) and hasattr(leaf, "dtype"):
            yield path, np.asarray(leaf)


def _chunks(a: np.ndarray):
    flat = a.reshape(-1)
    for i in range(0, flat.size, _CHUNK):
        yield flat[i:i + _CHUNK]


def check_fits_jax_dtype(tree: PyTree, *, what: str) -> None:
    """Refuses leaves whose values change when JAX converts them to its (32-bit) dtype.

    Args:
      tree: a pytree of numpy arrays (``jax.Array`` leaves are skipped: they are already in JAX).
      what: how the error names the tree ("dataset", "batch 3 of the dataset").

    Raises:
      ValueError: naming the leaf, its dtype, the offending value, JAX's dtype and the fixes.

    >>> import numpy as np
    >>> check_fits_jax_dtype({"y": np.array([1, 2], np.int64)}, what="dataset")  # fits int32
    >>> try:
    ...     check_fits_jax_dtype({"y": np.array([2**63], np.uint64)}, what="dataset")
    ... except ValueError as e:
    ...     print(str(e)[:60])
    dataset leaf data['y'] (uint64) holds 9223372036854775808, w
    """
    for path, a in _host_leaves(tree):
        if a.size == 0 or a.dtype.kind not in "iuf":
            continue
        target = np.dtype(jax.dtypes.canonicalize_dtype(a.dtype))
        if target == a.dtype:
            continue
        info = np.iinfo(target) if target.kind in "iu" else np.finfo(target)
        for chunk in _chunks(a):
            finite = chunk[np.isfinite(chunk)] if a.dtype.kind == "f" else chunk
            if finite.size == 0:
                continue
            lo, hi = finite.min(), finite.max()
            bad = lo if lo < info.min else hi if hi > info.max else None
            if bad is not None:
                raise ValueError(
                    f"{what} leaf {_name(path)} ({a.dtype}) holds {bad.item()!r}, which does not "
                    f"fit {target}, the dtype JAX uses for {a.dtype} when 64-bit mode is off (its "
                    f"range is {info.min}..{info.max}); the value would change silently. Fix: "
                    f"remap the values into that range (e.g. label ids 0..n-1), or enable 64-bit "
                    f"mode with jax.config.update('jax_enable_x64', True) before creating arrays")


def warn_non_finite(tree: PyTree, *, what: str) -> None:
    """Warns (``RuntimeWarning``) about NaN / inf in the floating leaves of an in-memory dataset.

    Args:
      tree: a pytree of numpy arrays.
      what: how the warning names the tree.

    >>> import numpy as np, warnings
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     warn_non_finite({"x": np.array([1.0, np.nan])}, what="dataset")
    >>> print(str(w[0].message)[:48])
    dataset leaf data['x'] (float64) has 1 NaN and 0
    """
    for path, a in _host_leaves(tree):
        if a.dtype.kind not in "fc" or a.size == 0:
            continue
        nan = inf = 0
        for chunk in _chunks(a):
            nan += int(np.count_nonzero(np.isnan(chunk)))
            inf += int(np.count_nonzero(np.isinf(chunk)))
        if nan or inf:
            warnings.warn(
                f"{what} leaf {_name(path)} ({a.dtype}) has {nan} NaN and {inf} inf value(s) in "
                f"{a.size}; unless the model masks them, training will produce NaN. Clean the "
                f"data (e.g. np.nan_to_num), and consider callbacks=[jaxdist.callbacks."
                f"TerminateOnNaN()] to stop as soon as the loss is NaN",
                RuntimeWarning, stacklevel=4)
