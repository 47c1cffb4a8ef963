"""Wire format of the parameter-server transport: a msgpack header plus raw array buffers.

A message is::

    u32 little-endian header length | msgpack header | array bytes, back to back

The header is a map of plain values (str, int, float, bool, lists, maps) and, under ``"arrays"``,
one ``[key, dtype, shape, offset, nbytes]`` entry per array. Decoding never runs code from the bytes
(no ``pickle``): dtypes come from a fixed allow-list and every offset is bounds-checked, and arrays
are returned as read-only ``np.frombuffer`` views into the message, so a pull copies no array bytes
in Python. Encoding copies each array once, in C, into the single ``bytes`` gRPC needs.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import msgpack
import numpy as np

__all__ = ["WireError", "encode", "decode", "ALLOWED_DTYPES"]

_LEN = struct.Struct("<I")

# Only plain numeric dtypes may cross the wire: an object dtype in np.frombuffer would read
# pointers out of untrusted bytes.
ALLOWED_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in ("float64", "float32", "float16", "int64", "int32", "int16", "int8",
                 "uint64", "uint32", "uint16", "uint8", "bool")
}
ALLOWED_DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)


class WireError(ValueError):
    """A message that is not a well-formed jaxdist parameter-server message."""


def _dtype_name(dtype: np.dtype) -> str:
    name = dtype.name
    if name not in ALLOWED_DTYPES:
        raise WireError(
            f"dtype {name!r} cannot be sent to a parameter server; "
            f"expected one of {sorted(ALLOWED_DTYPES)}. Cast the array first.")
    return name


def encode(header: Mapping[str, Any], arrays: Mapping[str, Any] | None = None) -> bytes:
    """Encodes a header and named arrays into one message.

    Args:
      header: msgpack-serializable map (must not use the key ``"arrays"``).
      arrays: name -> array-like (numpy, jax.Array on CPU); sent as raw C-contiguous bytes.

    Returns:
      The message as ``bytes``.

    Raises:
      WireError: an array has a dtype outside ``ALLOWED_DTYPES``, or the header uses ``"arrays"``.

    >>> import numpy as np
    >>> msg = encode({"step": 3}, {"w": np.arange(4, dtype=np.float32)})
    >>> h, a = decode(msg)
    >>> h["step"], a["w"].tolist()
    (3, [0.0, 1.0, 2.0, 3.0])
    """
    if "arrays" in header:
        raise WireError('the header key "arrays" is reserved for array metadata')
    meta = []
    buffers = []
    offset = 0
    for key, value in (arrays or {}).items():
        arr = np.asarray(value)  # a view (no copy) of numpy and CPU jax arrays
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)  # (this one would also turn 0-d into 1-d)
        nbytes = arr.nbytes
        meta.append([key, _dtype_name(arr.dtype), list(arr.shape), offset, nbytes])
        # A uint8 view exports a plain byte buffer for every dtype (bfloat16 included).
        buffers.append(memoryview(arr.reshape(-1).view(np.uint8)))
        offset += nbytes
    head = msgpack.packb({**header, "arrays": meta}, use_bin_type=True)
    return b"".join([_LEN.pack(len(head)), head, *buffers])


def decode(message: bytes | memoryview) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Decodes a message into its header and read-only array views.

    Args:
      message: bytes produced by :func:`encode`.

    Returns:
      ``(header, arrays)``; ``arrays`` maps names to read-only numpy views into ``message``.

    Raises:
      WireError: the message is truncated, its header is not a msgpack map, an array entry is
        malformed, uses a dtype outside ``ALLOWED_DTYPES``, or points outside the message.
    """
    view = memoryview(message)
    if len(view) < _LEN.size:
        raise WireError(f"message of {len(view)} bytes is shorter than its {_LEN.size}-byte prefix")
    (hlen,) = _LEN.unpack_from(view)
    body_start = _LEN.size + hlen
    if body_start > len(view):
        raise WireError(f"header length {hlen} runs past the end of a {len(view)}-byte message")
    try:
        header = msgpack.unpackb(view[_LEN.size:body_start], raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise WireError(f"header is not valid msgpack: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("arrays", []), list):
        raise WireError(f"header must be a map with an 'arrays' list, got {type(header).__name__}")
    body = view[body_start:]
    arrays: dict[str, np.ndarray] = {}
    for entry in header.pop("arrays", []):
        try:
            key, dtype_name, shape, offset, nbytes = entry
            shape = tuple(int(d) for d in shape)
            offset, nbytes = int(offset), int(nbytes)
        except (TypeError, ValueError):
            raise WireError(f"malformed array entry {entry!r}; expected "
                            "[key, dtype, shape, offset, nbytes]") from None
        dtype = ALLOWED_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise WireError(f"array {key!r} has dtype {dtype_name!r}; "
                            f"expected one of {sorted(ALLOWED_DTYPES)}")
        if any(d < 0 for d in shape) or int(np.prod(shape)) * dtype.itemsize != nbytes:
            raise WireError(f"array {key!r}: shape {shape} of {dtype_name} does not hold "
                            f"{nbytes} bytes")
        if offset < 0 or offset + nbytes > len(body):
            raise WireError(f"array {key!r} spans bytes [{offset}, {offset + nbytes}) of a "
                            f"{len(body)}-byte body")
        arrays[str(key)] = np.frombuffer(body[offset:offset + nbytes], dtype=dtype).reshape(shape)
    return header, arrays
