"""Training on top of a strategy: the Keras-like ``fit`` / ``evaluate`` / ``predict`` loop, the
built-in models, mixed precision, gradient accumulation, learning-rate scaling rules, and the
``jaxdist train`` command. Public paths: ``jaxdist.fit``, ``jaxdist.models``,
``jaxdist.precision``, ``jaxdist.schedules``.
"""

# The modules are this package's faces (``fit`` is both a module here and the function
# ``jaxdist.fit``, so the functions are not re-exported over the module names).
__all__ = ["accumulate", "cli", "fit", "models", "precision", "schedules"]
