"""The rendezvous store of elastic jobs: a small key-value service over gRPC, hosted by one agent.

``jaxdist launch --nnodes MIN:MAX --rdzv-endpoint HOST:PORT`` runs one agent per host; the agent
that can bind HOST:PORT serves this store (as torchrun's c10d rendezvous hosts its TCPStore in an
agent), the others are its clients. Agents use it to register for a round of the job, to publish
heartbeats (the store stamps each key with its own clock, so agents' clocks never need to agree)
and to ask for a drain. Messages are JSON over gRPC's unary calls (the transport jaxdist already
uses for parameter servers); nothing is unpickled.

Why not JAX's own coordination service: its clients' ``connect`` waits until a fixed number of
tasks have registered, and a task that stops heartbeating is reported as a fatal error to every
other task; elastic membership (tasks leaving and arriving) is exactly what it does not model.

Like torchrun's store, it has no authentication: run it on a trusted network. Keys are namespaced
by the rendezvous id, so jobs sharing an endpoint do not mix.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent import futures
from typing import Any

import grpc

_SERVICE = "jaxdist.Rendezvous"


class RendezvousError(RuntimeError):
    """The rendezvous store is unreachable or answered with an error."""


class _Store:
    def __init__(self):
        self._data: dict[str, tuple[Any, float]] = {}
        self._lock = threading.Lock()

    def handle(self, method: str, req: dict) -> Any:
        now = time.monotonic()
        with self._lock:
            if method == "set":
                self._data[req["key"]] = (req["value"], now)
                return True
            if method == "set_if_absent":
                if req["key"] not in self._data:
                    self._data[req["key"]] = (req["value"], now)
                return self._data[req["key"]][0]
            if method == "get":
                item = self._data.get(req["key"])
                return None if item is None else item[0]
            if method == "list":  # {key: [value, seconds since it was set]}
                return {k: [v, now - t] for k, (v, t) in self._data.items()
                        if k.startswith(req["prefix"])}
            if method == "delete":
                self._data.pop(req["key"], None)
                return True
        raise ValueError(f"unknown method {method!r}")


def serve(address: str) -> tuple[grpc.Server, int] | None:
    """Serves a store on ``address`` (``host:port``); None if the port is taken (another agent).

    >>> server, port = serve("127.0.0.1:0")
    >>> client = RendezvousClient(f"127.0.0.1:{port}", "job")
    >>> client.set("a", 1); client.get("a"), client.get("b")
    (1, None)
    >>> _ = server.stop(0)
    """
    store = _Store()

    def handler(method):
        def call(request: bytes, context) -> bytes:
            try:
                return json.dumps(store.handle(method, json.loads(request))).encode()
            except (ValueError, KeyError, TypeError) as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return grpc.unary_unary_rpc_method_handler(call)

    methods = ("set", "set_if_absent", "get", "list", "delete")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         handlers=[grpc.method_handlers_generic_handler(
                             _SERVICE, {m: handler(m) for m in methods})],
                         options=[("grpc.so_reuseport", 0)])
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
    """

    def __init__(self, address: str, rdzv_id: str, *, timeout_s: float = 5.0):
        self.address = address
        self._prefix = f"{rdzv_id}/"
        self._timeout = timeout_s
        self._channel = grpc.insecure_channel(address, options=[
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000)])
        self._stubs: dict[str, Any] = {}

    def _call(self, method: str, timeout_s: float | None = None, **req) -> Any:
        if method not in self._stubs:
            self._stubs[method] = self._channel.unary_unary(f"/{_SERVICE}/{method}")
        try:
            reply = self._stubs[method](json.dumps(req).encode(),
                                        timeout=timeout_s or self._timeout, wait_for_ready=True)
        except grpc.RpcError as e:
            raise RendezvousError(f"rendezvous store at {self.address}: {method} failed: "
                                  f"{e.code().name}: {e.details()}") from None
        return json.loads(reply)

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
