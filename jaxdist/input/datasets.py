"""Built-in offline data: real handwritten digits, MNIST from local IDX files, synthetic data.

Nothing here downloads: ``digits()`` reads the copy scikit-learn ships inside its wheel.
"""

from __future__ import annotations

import gzip
import os
import struct

import numpy as np

Split = tuple[np.ndarray, np.ndarray]


def _split(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int) -> tuple[Split, Split]:
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def digits(*, test_fraction: float = 0.2, seed: int = 0) -> tuple[Split, Split]:
    """The 1,797 real 8×8 handwritten digits (UCI), split into train and test deterministically.

    Returns:
      ``(x_train, y_train), (x_test, y_test)``: images float32 ``[n, 8, 8, 1]`` in ``[0, 1]``,
      labels int32 ``[n]`` in ``0..9``.

    >>> (x, y), (xt, yt) = digits()
    >>> x.shape, xt.shape, x.dtype.name, int(y.max())
    ((1438, 8, 8, 1), (359, 8, 8, 1), 'float32', 9)
    """
    from sklearn.datasets import load_digits  # the data ships inside scikit-learn's wheel

    d = load_digits()
    x = (d.images.astype(np.float32) / 16.0)[..., None]
    return _split(x, d.target.astype(np.int32), test_fraction, seed)


_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path: str) -> np.ndarray:
    """Reads one IDX file (the MNIST format), gzipped or not.

    Raises:
      FileNotFoundError: the file is missing.
      ValueError: the header or the size is not that of an IDX file.
    """
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise
    except (OSError, EOFError) as e:  # e.g. a truncated or non-gzip ".gz"
        raise ValueError(f"{path}: cannot read ({e}); the file is corrupt, download it again") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (bad magic number {raw[:4].hex() or 'empty'}); "
                         "expected the MNIST files train-images-idx3-ubyte[.gz] etc.")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} bytes)")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    dtype: np.dtype = np.dtype(_IDX_DTYPES[raw[2]])  # type: ignore[call-overload]
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(f"{path}: header says shape {shape} ({expected} bytes of data) but the file "
                         f"holds {len(raw) - header}; the file is truncated or corrupt")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)


_MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
                "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def _find(directory: str, stem: str) -> str:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"),
                 stem.replace("-idx", ".idx") + ".gz"):
        p = os.path.join(directory, name)
        if os.path.exists(p):
            return p
    raise FileNotFoundError(f"MNIST file {stem}[.gz] not found in {directory!r}; put the four "
                            "standard MNIST IDX files there (jaxdist never downloads them)")


def mnist(path: str) -> tuple[Split, Split]:
    """MNIST from the four standard IDX files in directory ``path`` (gzipped or not).

    Returns:
      ``(x_train, y_train), (x_test, y_test)``: float32 ``[n, 28, 28, 1]`` in ``[0, 1]``, int32 labels.

    Raises:
      FileNotFoundError: a file is missing (the message names it).
      ValueError: a file is corrupt, or images and labels disagree in count.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"mnist(path={path!r}): no such directory")
    out = []
    for split, (img_stem, lbl_stem) in _MNIST_FILES.items():
        img_path, lbl_path = _find(path, img_stem), _find(path, lbl_stem)
        images, labels = read_idx(img_path), read_idx(lbl_path)
        if images.ndim != 3 or labels.ndim != 1:
            raise ValueError(f"{split} files have shapes {images.shape} and {labels.shape}; expected "
                             "images [n, rows, cols] and labels [n]")
        if len(images) != len(labels):
            raise ValueError(f"{img_path} holds {len(images)} images but {lbl_path} holds "
                             f"{len(labels)} labels")
        out.append(((images.astype(np.float32) / 255.0)[..., None], labels.astype(np.int32)))
    return out[0], out[1]


def synthetic(num_examples: int = 1024, *, shape: tuple[int, ...] = (8, 8, 1),
              num_classes: int = 10, seed: int = 0) -> Split:
    """Learnable synthetic classification data: inputs labelled by a fixed random linear teacher.

    >>> x, y = synthetic(16, shape=(4,), num_classes=3)
    >>> x.shape, y.shape, bool((y < 3).all())
    ((16, 4), (16,), True)
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_examples, *shape)).astype(np.float32)
    teacher = rng.normal(size=(int(np.prod(shape)), num_classes)).astype(np.float32)
    y = np.argmax(x.reshape(num_examples, -1) @ teacher, axis=1).astype(np.int32)
    return x, y
