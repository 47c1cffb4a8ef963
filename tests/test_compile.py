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


def test_a_masked_step_on_distribute_batches_has_the_collectives_of_an_unmasked_one():
    # The count compute_average_loss divides by comes from the replicated mask without a
    # collective, so the step's only all-reduce is the gradients' (with the loss in it).
    import optax

    from jaxdist.core.collectives import _count_collectives

    s = jaxdist.MirroredStrategy(jax.devices()[:8])
    x = np.random.default_rng(0).normal(size=(64, 6)).astype(np.float32)
    y = np.arange(64) % 3

    def make(masked):
        def step(state, batch):
            (xb, yb), mask = batch

            def loss_fn(p):
                per = optax.softmax_cross_entropy_with_integer_labels(
                    state.apply_fn({"params": p}, xb), yb)
                return jaxdist.compute_average_loss(per, mask) if masked else per.mean()

            loss, g = jax.value_and_grad(loss_fn)(state.params)
            return state.apply_gradients(grads=g), {"loss": loss}
        return s.step(step)

    batch = next(iter(s.distribute((x, y), 32)))
    counts = {}
    for masked in (False, True):
        step = make(masked)
        state = s.put(models.create_train_state(models.MLP(hidden=(8,), num_classes=3), x[:1]))
        step(state, batch)
        (compiled, _), = step._compiled.values()
        text = compiled.lower(state, batch).compile().as_text()
        counts[masked] = _count_collectives(text)["all-reduce"]
    assert counts[True] == counts[False] == 1, counts
