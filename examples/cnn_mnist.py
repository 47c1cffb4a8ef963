"""A CNN on MNIST-format data (the four IDX files), with @jaxdist.mirrored and fit.

    python examples/cnn_mnist.py --data-dir ~/data/mnist [--epochs 3]
    python examples/cnn_mnist.py --data-dir /tmp/digits-idx --write-from-digits   # no download

jaxdist never downloads anything: put the standard files (train-images-idx3-ubyte[.gz],
train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz]) in
`--data-dir`. `--write-from-digits` first writes such files there from scikit-learn's 8x8
digits, scaled to 28x28, so the example runs on any machine.
"""

import argparse
import os
import struct

import jax

jax.config.update("jax_num_cpu_devices", 8)  # a no-op for accelerators; simulates 8 CPU devices

import numpy as np  # noqa: E402

import jaxdist  # noqa: E402
from jaxdist import models  # noqa: E402


def write_idx(path, array):
    """Writes an unsigned-byte IDX file (the MNIST format): magic, dimensions, then the bytes."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(struct.pack(">BBBB", 0, 0, 0x08, array.ndim))
        f.write(struct.pack(f">{array.ndim}I", *array.shape))
        f.write(array.tobytes())


def write_digits_as_mnist(directory):
    """The digits data as 28x28 MNIST IDX files: each 8x8 image scaled 3x and padded by 2."""
    os.makedirs(directory, exist_ok=True)
    for (x, y), prefix in zip(jaxdist.datasets.digits(), ("train", "t10k")):
        images = np.kron(x[..., 0], np.ones((1, 3, 3), np.float32))        # [n, 24, 24] in [0, 1]
        images = np.pad(images, ((0, 0), (2, 2), (2, 2)))                  # [n, 28, 28]
        write_idx(os.path.join(directory, f"{prefix}-images-idx3-ubyte"), np.round(images * 255))
        write_idx(os.path.join(directory, f"{prefix}-labels-idx1-ubyte"), y)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True, help="directory with the four MNIST IDX files")
    ap.add_argument("--write-from-digits", action="store_true",
                    help="first write IDX files made from the bundled digits data into --data-dir")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None, help="train on the first N examples only")
    args = ap.parse_args()
    if args.write_from_digits:
        write_digits_as_mnist(args.data_dir)
    (x, y), (x_test, y_test) = jaxdist.datasets.mnist(args.data_dir)
    if args.limit:
        x, y = x[:args.limit], y[:args.limit]
    print(f"train {x.shape}, test {x_test.shape} from {args.data_dir}")

    train_step = jaxdist.mirrored(models.classifier_train_step)
    strategy = train_step.strategy
    state = models.create_train_state(models.CNN(), x[:1], learning_rate=1e-3)
    history = jaxdist.fit(train_step, state,
                          strategy.distribute((x, y), args.batch_size, shuffle=True),
                          epochs=args.epochs, eval_step=models.classifier_eval_step,
                          eval_data=strategy.distribute((x_test, y_test), args.batch_size))
    print(f"CNN, {strategy.num_replicas_in_sync} replicas: test accuracy "
          f"{history.history['val_accuracy'][-1]:.4f}")


if __name__ == "__main__":
    main()
