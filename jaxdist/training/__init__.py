"""Training on top of a strategy: the Keras-like ``fit`` / ``evaluate`` / ``predict`` loop, the
built-in models, mixed precision, gradient accumulation, learning-rate scaling rules, and the
``jaxdist train`` command. Public paths: ``jaxdist.fit``, ``jaxdist.models``,
``jaxdist.precision``, ``jaxdist.schedules``.
"""
