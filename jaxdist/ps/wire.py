"""Wire format of the parameter-server transport: a msgpack header plus raw array buffers.

A message is::

    u32 little-endian header length | msgpack header | array bytes, back to back

The header is a map of plain values (str, int, float, bool, lists, maps) and, under ``"arrays"``,
one ``[key, dtype, shape, offset, nbytes]`` entry per array. Decoding never runs code from the bytes
(no ``pickle``): dtypes come from a fixed allow-list and every offset is bounds-checked, and arrays
are returned as read-only ``np.frombuffer`` views into the message, so a pull copies no array bytes
in Python. Encoding copies each array once, in C, into the single ``bytes`` gRPC needs.

Decoding is strict, because the bytes come from the network: the header is at most
``max_header_bytes`` and may build at most ``max_objects`` maps and lists (a megabyte of empty
msgpack maps would otherwise become a gigabyte of Python dicts); a map may not repeat a key;
dimensions, offsets and sizes are plain integers; the arrays tile the body exactly, in order, with
no bytes before, between or after them.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import msgpack
import numpy as np

__all__ = ["WireError", "encode", "decode", "declared_size", "ALLOWED_DTYPES", "MAX_HEADER_BYTES",
           "MAX_OBJECTS"]

_LEN = struct.Struct("<I")
# A header describes a few thousand arrays at most (about 40 bytes and 2 lists each).
MAX_HEADER_BYTES = 4 << 20
MAX_OBJECTS = 200_000

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
        buffers.append(memoryview(arr.reshape(-1).view(np.uint8)))  # type: ignore[arg-type]
        offset += nbytes
    head = msgpack.packb({**header, "arrays": meta}, use_bin_type=True)
    return b"".join([_LEN.pack(len(head)), head, *buffers])


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Budget:
    """msgpack hooks that refuse repeated keys and count containers against a budget."""

    def __init__(self, max_objects: int):
        self.left = max_objects

    def _spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise WireError("header builds too many maps and lists (limit MAX_OBJECTS); "
                            "is it a decompression bomb?")

    def map(self, pairs: list) -> dict:
        self._spend()
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise WireError(f"header map repeats the key {dup!r}")
        return out

    def list(self, items: list) -> list:
        self._spend()
        return items


def _header(view: memoryview, max_header_bytes: int, max_objects: int) -> tuple[dict, int]:
    """The message's header map (its ``"arrays"`` list still in it) and where the body starts."""
    if len(view) < _LEN.size:
        raise WireError(f"message of {len(view)} bytes is shorter than its {_LEN.size}-byte prefix")
    (hlen,) = _LEN.unpack_from(view)
    if hlen > max_header_bytes:
        raise WireError(f"header of {hlen} bytes exceeds the limit of {max_header_bytes}")
    body_start = _LEN.size + hlen
    if body_start > len(view):
        raise WireError(f"header length {hlen} runs past the end of a {len(view)}-byte message")
    budget = _Budget(max_objects)
    try:
        header = msgpack.unpackb(view[_LEN.size:body_start], raw=False, strict_map_key=True,
                                 object_pairs_hook=budget.map, list_hook=budget.list)
    except WireError:
        raise
    except Exception as e:  # msgpack raises several unrelated types
        raise WireError(f"header is not valid msgpack: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("arrays", []), list):
        raise WireError(f"header must be a map with an 'arrays' list, got {type(header).__name__}")
    return header, body_start


def header_length(prefix: bytes | memoryview) -> int | None:
    """Bytes of the length prefix plus header, from a message's first bytes (None: fewer than 4).

    Raises:
      WireError: the header is longer than ``MAX_HEADER_BYTES``.
    """
    if len(prefix) < _LEN.size:
        return None
    (hlen,) = _LEN.unpack_from(prefix)
    if hlen > MAX_HEADER_BYTES:
        raise WireError(f"header of {hlen} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    return _LEN.size + hlen


def declared_size(head: bytes | memoryview, *, max_header_bytes: int = MAX_HEADER_BYTES,
                  max_objects: int = MAX_OBJECTS) -> int:
    """The full length a message declares, from its prefix and header alone (no array bytes).

    A receiver compares it with its limit before accepting the body, so an oversized message is
    refused after its header, not after it has been buffered.

    Args:
      head: at least the message's length prefix and header (more bytes are ignored).
      max_header_bytes, max_objects: as for :func:`decode`.

    Returns:
      prefix + header + the sum of the arrays' declared ``nbytes``.

    Raises:
      WireError: the header is malformed, or an array entry's size is not a non-negative int.

    >>> import numpy as np
    >>> msg = encode({"step": 3}, {"w": np.zeros(1000, np.float32)})
    >>> declared_size(msg[:64]) == len(msg)
    True
    """
    view = memoryview(head)
    need = header_length(view)
    if need is None or need > len(view):
        raise WireError(f"{len(view)} bytes do not hold the message's prefix and header")
    header, body_start = _header(view[:need], max_header_bytes, max_objects)
    total = body_start
    for entry in header.get("arrays", []):
        if not (isinstance(entry, list) and len(entry) == 5 and _is_int(entry[4])
                and entry[4] >= 0):
            raise WireError(f"malformed array entry {entry!r}; expected [key: str, dtype: str, "
                            "shape: [int, ...], offset: int, nbytes: int]")
        total += entry[4]
    return total


def decode(message: bytes | memoryview, *, max_header_bytes: int = MAX_HEADER_BYTES,
           max_objects: int = MAX_OBJECTS) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Decodes a message into its header and read-only array views.

    Args:
      message: bytes produced by :func:`encode`.
      max_header_bytes: refuse a longer msgpack header.
      max_objects: refuse a header that builds more maps and lists than this.

    Returns:
      ``(header, arrays)``; ``arrays`` maps names to read-only numpy views into ``message``.

    Raises:
      WireError: the message is truncated or has trailing bytes, its header is too long, builds
        too many objects, repeats a key or is not a msgpack map, an array entry is malformed
        (a dimension, offset or size that is not a non-negative int), uses a dtype outside
        ``ALLOWED_DTYPES``, or the arrays do not tile the body exactly.

    >>> decode(encode({"a": 1}) + b"x")
    Traceback (most recent call last):
    ...
    jaxdist.ps.wire.WireError: 1 trailing byte(s) after the last array (body of 1 bytes, arrays end at 0)
    """
    view = memoryview(message)
    header, body_start = _header(view, max_header_bytes, max_objects)
    body = view[body_start:]
    arrays: dict[str, np.ndarray] = {}
    end = 0
    for entry in header.pop("arrays", []):
        if not (isinstance(entry, list) and len(entry) == 5 and isinstance(entry[0], str)
                and isinstance(entry[2], list) and all(map(_is_int, entry[2]))
                and _is_int(entry[3]) and _is_int(entry[4])):
            raise WireError(f"malformed array entry {entry!r}; expected [key: str, dtype: str, "
                            "shape: [int, ...], offset: int, nbytes: int]")
        key, dtype_name, shape, offset, nbytes = entry
        dtype = ALLOWED_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise WireError(f"array {key!r} has dtype {dtype_name!r}; "
                            f"expected one of {sorted(ALLOWED_DTYPES)}")
        if key in arrays:
            raise WireError(f"array {key!r} appears twice")
        # math.prod on Python ints cannot overflow, unlike np.prod on int64
        if any(d < 0 for d in shape) or math.prod(shape) * dtype.itemsize != nbytes:
            raise WireError(f"array {key!r}: shape {shape} of {dtype_name} does not hold "
                            f"{nbytes} bytes")
        if offset != end or offset + nbytes > len(body):
            raise WireError(f"array {key!r} spans bytes [{offset}, {offset + nbytes}) of a "
                            f"{len(body)}-byte body; expected it to start at {end} and fit")
        end = offset + nbytes
        arrays[key] = np.frombuffer(body[offset:end], dtype=dtype).reshape(shape)
    if end != len(body):
        raise WireError(f"{len(body) - end} trailing byte(s) after the last array (body of "
                        f"{len(body)} bytes, arrays end at {end})")
    return header, arrays
