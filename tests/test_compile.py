"""One compilation per step shape: the steady-state loop never recompiles."""

from __future__ import annotations

import jax
import numpy as np

import jaxdist
from jaxdist import models


def test_one_compilation_over_many_steps(digits, count_compiles):
    (x, y), _ = digits
    s = jaxdist.MirroredStrategy(jax.devices()[:4])
    state = models.create_train_state(models.MLP(hidden=(32,)), x[:1])
    step = s.step(models.classifier_train_step)
    dist = s.distribute((x[:300], y[:300]), 64, shuffle=True)  # 5 batches, the last one padded
    state, _ = step(state, next(iter(dist)))  # compiles
    with count_compiles() as compiles:
        for _ in range(3):
            for batch in dist:
                state, metrics = step(state, batch)
        jax.block_until_ready(state)
    assert compiles() == 0
    assert len(step._compiled) == 1


def test_per_replica_run_compiles_once(count_compiles):
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    dist = s.distribute((np.arange(40, dtype=np.float32),), 8)

    def fn(b):
        return jaxdist.all_reduce(jax.numpy.sum(b.data[0]), "sum")

    s.local_results(s.run(fn, args=(next(iter(dist)),)))  # compiles the step and the slicing
    with count_compiles() as compiles:
        total = sum(float(s.local_results(s.run(fn, args=(b,)))[0]) for b in dist)
    assert total == sum(range(40))
    assert compiles() == 0
