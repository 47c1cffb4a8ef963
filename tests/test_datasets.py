"""Built-in offline data and models."""

from __future__ import annotations

import gzip
import struct

import jax
import numpy as np
import pytest

from jaxdist import datasets, models


def test_digits_is_real_and_deterministic():
    (x, y), (xt, yt) = datasets.digits()
    assert x.shape == (1438, 8, 8, 1) and xt.shape == (359, 8, 8, 1)
    assert 0.0 <= x.min() and x.max() <= 1.0 and set(np.unique(y)) == set(range(10))
    (x2, _), _ = datasets.digits()
    np.testing.assert_array_equal(x, x2)


def _write_idx(path, array, gz):
    codes = {np.uint8: 0x08, np.int32: 0x0C}
    header = bytes([0, 0, codes[array.dtype.type], array.ndim]) + struct.pack(
        f">{array.ndim}I", *array.shape)
    data = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    # Closed before the reader opens it: gzip buffers its writes (Python 3.12 holds them all
    # until close), so an unclosed file can be read back empty.
    with (gzip.open if gz else open)(path + (".gz" if gz else ""), "wb") as f:
        f.write(data)


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_reads_idx_files(tmp_path, gz):
    rng = np.random.default_rng(0)
    imgs = {s: rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8) for s, n in (("train", 6), ("t10k", 3))}
    labels = {s: rng.integers(0, 10, size=len(imgs[s]), dtype=np.uint8) for s in imgs}
    for s in imgs:
        _write_idx(str(tmp_path / f"{s}-images-idx3-ubyte"), imgs[s], gz)
        _write_idx(str(tmp_path / f"{s}-labels-idx1-ubyte"), labels[s], gz)
    (x, y), (xt, yt) = datasets.mnist(str(tmp_path))
    assert x.shape == (6, 28, 28, 1) and xt.shape == (3, 28, 28, 1)
    np.testing.assert_allclose(x[..., 0] * 255, imgs["train"], atol=1e-3)
    np.testing.assert_array_equal(yt, labels["t10k"])


def test_mnist_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        datasets.mnist(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte.*never downloads"):
        datasets.mnist(str(tmp_path))
    bad = tmp_path / "x-idx1-ubyte"
    bad.write_bytes(b"\x00\x00\x08\x01" + struct.pack(">I", 10) + b"\x01" * 4)
    with pytest.raises(ValueError, match=r"shape \(10,\) \(10 bytes of data\) but the file holds 4"):
        datasets.read_idx(str(bad))
    bad.write_bytes(b"GIF89a")
    with pytest.raises(ValueError, match="not an IDX file"):
        datasets.read_idx(str(bad))
    gzbad = tmp_path / "y-idx1-ubyte.gz"
    gzbad.write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="corrupt"):
        datasets.read_idx(str(gzbad))
    # images and labels that disagree in count
    _write_idx(str(tmp_path / "train-images-idx3-ubyte"), np.zeros((4, 2, 2), np.uint8), False)
    _write_idx(str(tmp_path / "train-labels-idx1-ubyte"), np.zeros(3, np.uint8), False)
    with pytest.raises(ValueError, match="holds 4 images but .* holds 3 labels"):
        datasets.mnist(str(tmp_path))


def test_models_and_synthetic_data():
    x, y = datasets.synthetic(32, shape=(8, 8, 1))
    for name in ("mlp", "cnn"):
        state = models.create_train_state(models.get(name), x[:1])
        assert state.apply_fn({"params": state.params}, x).shape == (32, 10)
    with pytest.raises(ValueError, match="unknown model 'rnn'"):
        models.get("rnn")
    assert jax.tree.leaves(models.create_train_state(models.MLP(), x[:1]).params)[0].dtype == np.float32
