"""Learning-rate schedules for data parallelism: the linear scaling rule with a gradual warm-up.

Goyal et al., "Accurate, Large Minibatch SGD" (2017): when the global batch grows ``k``-fold (more
replicas, same per-replica batch), multiply the learning rate by ``k``; start from the small-batch
rate and ramp up linearly over the first steps, because the scaled rate is unstable while the
network changes fast. This is the seeds' batch-size exercise, as an optax schedule.
"""

from __future__ import annotations

from collections.abc import Callable

import optax


def linear_scaling_rule(base_learning_rate: float, *, base_batch_size: int, global_batch_size: int,
                        warmup_steps: int = 0,
                        after: Callable[[float], optax.Schedule] | None = None) -> optax.Schedule:
    """An optax schedule: ``base_learning_rate x global / base``, reached by a linear warm-up.

    Args:
      base_learning_rate: the rate tuned for ``base_batch_size``.
      base_batch_size: the batch size that rate was tuned for.
      global_batch_size: the batch of one optimizer step now (per-replica batch x
        ``strategy.num_replicas_in_sync``, times the accumulation steps).
      warmup_steps: steps to go linearly from ``base_learning_rate`` to the scaled rate (Goyal et
        al. use 5 epochs); 0 starts at the scaled rate.
      after: ``after(peak) -> schedule`` for the steps after the warm-up (counted from its end),
        e.g. ``lambda peak: optax.cosine_decay_schedule(peak, 1000)``; default constant.

    Returns:
      ``schedule(step) -> learning rate``, for any optax optimizer's ``learning_rate``.

    Raises:
      ValueError: non-positive batch sizes or rate, negative warm-up.

    >>> s = linear_scaling_rule(0.1, base_batch_size=256, global_batch_size=2048, warmup_steps=100)
    >>> [round(float(s(t)), 4) for t in (0, 50, 100, 1000)]
    [0.1, 0.45, 0.8, 0.8]
    """
    if base_batch_size <= 0 or global_batch_size <= 0 or base_learning_rate <= 0:
        raise ValueError(
            f"linear_scaling_rule(base_learning_rate={base_learning_rate}, base_batch_size="
            f"{base_batch_size}, global_batch_size={global_batch_size}) needs positive values")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
    peak = base_learning_rate * global_batch_size / base_batch_size
    tail = optax.constant_schedule(peak) if after is None else after(peak)
    if warmup_steps == 0:
        return tail
    warmup = optax.linear_schedule(base_learning_rate, peak, warmup_steps)
    return optax.join_schedules([warmup, tail], [warmup_steps])
