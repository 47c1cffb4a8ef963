"""Transports between workers and parameter servers: in-process calls, or gRPC across processes.

gRPC runs with generic handlers over raw ``bytes`` (no generated code); payloads are
:mod:`jaxdist.ps.wire` messages. Handler errors map to gRPC status codes and back to the same
Python exceptions on the client, so a bad push fails that call only and the server keeps serving.

Security model (docs/guides/security.md has the limits, one a row):

* every call carries the job's shared token in the ``x-jaxdist-token`` metadata; a server
  interceptor compares it (constant time) from the call's metadata, before gRPC reads the request
  body, so an unauthenticated caller cannot make the server buffer a large message;
* the receive limit is sized from the model where it is known (the shard's bytes plus header
  slack), and decoding is bounded (:mod:`jaxdist.ps.wire`);
* with a :class:`TLSConfig` the channel is TLS (grpc's own ``ssl_*_credentials``), so the token
  and the arrays do not travel in clear text;
* every wait inside a handler is bounded and ends when the caller cancels.
"""

from __future__ import annotations

import dataclasses
import errno
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from typing import Any, Protocol

import grpc
import numpy as np

from jaxdist.launch.cluster import ENV_PS_TOKEN
from jaxdist.launch.receive import Cancelled, Full, Receipt, Receiver
from jaxdist.launch.receive import ReceiveLimits as ReceiveLimits
from jaxdist.ps import wire
from jaxdist.ps._retry import retry
from jaxdist.ps.optim import OptimizerSpec
from jaxdist.ps.server import (
    ParameterServer,
    PushRejected,
    PushResult,
    ServerConfig,
    UpdateRecord,
    check_number,
)

__all__ = ["ServerClient", "LocalClient", "GrpcClient", "Unavailable", "PermissionDenied",
           "serve", "serve_until_stopped", "PSService", "Channel", "PS_SERVICE", "TLSConfig",
           "Call", "ENV_TOKEN", "resolve_token", "ReceiveLimits", "CHUNK_BYTES"]

logger = logging.getLogger(__name__)

PS_SERVICE = "jaxdist.ps.ParameterServer"
ENV_TOKEN = ENV_PS_TOKEN
_TOKEN_KEY = "x-jaxdist-token"
HEADER_SLACK = 1 << 20
# Requests travel as a stream of chunks of at most this size (the server's gRPC receive limit),
# so the server sees a message's header, and checks the size it declares, before the body.
CHUNK_BYTES = 4 << 20
# Megabyte messages on a fast link: large HTTP/2 frames and a 16 MiB window from the start
# instead of 64 KiB grown by BDP probing (measured here: 0.67 -> 1.09 GB/s for 2 MiB echoes).
_HTTP2 = [("grpc.http2.max_frame_size", (1 << 24) - 1), ("grpc.http2.bdp_probe", 0),
          ("grpc.http2.initial_window_size", 16 << 20)]


class Unavailable(ConnectionError):
    """The peer is down, restarting, or not initialized yet; the call may be retried."""


class PermissionDenied(PermissionError):
    """The peer refused our token."""


class _NotReady(Exception):
    pass


def resolve_token(token: str | None, *, authenticate: bool = True) -> str | None:
    """The job's shared token: ``token`` if given, else ``$JAXDIST_PS_TOKEN``.

    Args:
      token: an explicit token, or None.
      authenticate: False turns authentication off (returns None); only for a trusted network.

    Returns:
      The token, or None when ``authenticate`` is False.

    Raises:
      ValueError: authentication is on and there is no token (or it is empty).

    >>> resolve_token("s3cret")
    's3cret'
    >>> resolve_token(None, authenticate=False) is None
    True
    """
    if not authenticate:
        return None
    token = token if token is not None else os.environ.get(ENV_TOKEN)
    if not token:
        raise ValueError(f"no token for the parameter-server job (token=None and ${ENV_TOKEN} "
                         "unset or empty). Fix: start the job with `jaxdist launch --ps N "
                         f"--workers M script.py`, which makes one, or export {ENV_TOKEN} with "
                         "the same secret on every process (e.g. python -c 'import secrets; "
                         "print(secrets.token_urlsafe(32))'); authenticate=False turns "
                         "authentication off on a trusted network")
    return token


@dataclasses.dataclass(frozen=True)
class TLSConfig:
    """TLS for the job's gRPC channels (grpc's own ``ssl_server_credentials`` /
    ``ssl_channel_credentials``). The files are read from this machine's disk, never named by
    a peer.

    Attributes:
      cert_file: PEM certificate chain this process serves with.
      key_file: PEM private key of ``cert_file``.
      ca_file: PEM root certificate(s) that sign the peers' certificates.
      server_name: host name to verify in the peer's certificate instead of the address's host
        (``grpc.ssl_target_name_override``); None verifies the address's host.
    """

    cert_file: str
    key_file: str
    ca_file: str
    server_name: str | None = None

    def __post_init__(self):
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if not isinstance(path, str) or not os.path.isfile(path):
                raise ValueError(f"TLSConfig.{name} = {path!r}: not a readable file. Fix: "
                                 "point it at a PEM file on this machine")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TLSConfig | None:
        """Reads ``JAXDIST_PS_TLS_CERT``, ``_KEY``, ``_CA`` (and optional ``_SERVER_NAME``);
        None when none is set.

        Raises:
          ValueError: some but not all of the three are set, or a file is missing.

        >>> TLSConfig.from_env({}) is None
        True
        """
        environ = os.environ if environ is None else environ
        names = ("JAXDIST_PS_TLS_CERT", "JAXDIST_PS_TLS_KEY", "JAXDIST_PS_TLS_CA")
        got = [environ.get(n) for n in names]
        if not any(got):
            return None
        if not all(got):
            raise ValueError(f"TLS needs all of {names}; got "
                             f"{ {n: v for n, v in zip(names, got)} }")
        cert, key, ca = got
        return cls(cert, key, ca, server_name=environ.get("JAXDIST_PS_TLS_SERVER_NAME") or None)

    def _read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def validate(self) -> None:
        """Checks the files before anything is served: each is PEM, and the key belongs to the
        certificate (Python's ``ssl`` loads them as a server would).

        Raises:
          ValueError: one line naming the file and the cause.
        """
        import ssl

        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            try:
                text = self._read(path)
            except OSError as e:
                raise ValueError(f"TLS {name} {path}: cannot read it ({e.strerror})") from None
            if b"-----BEGIN " not in text:
                raise ValueError(f"TLS {name} {path} is not PEM (no '-----BEGIN' line); convert "
                                 "it, e.g. openssl x509 -inform der -in F -out F.pem")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except ssl.SSLError as e:
            why = ("the key does not match the certificate" if "KEY_VALUES_MISMATCH" in str(e)
                   else f"they do not load as a certificate chain and its key ({e.reason or e})")
            raise ValueError(f"TLS cert_file {self.cert_file} and key_file {self.key_file}: "
                             f"{why}") from None
        try:
            ssl.create_default_context(cafile=self.ca_file)
        except ssl.SSLError as e:
            raise ValueError(f"TLS ca_file {self.ca_file} holds no usable CA certificate "
                             f"({e.reason or e})") from None

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self._read(self.key_file),
                                             self._read(self.cert_file))])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self._read(self.ca_file))


_TO_CODE = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class Call:
    """What a handler may know about its call: whether the caller is gone, and its deadline."""

    def __init__(self, context: grpc.ServicerContext | None = None):
        self.cancelled = threading.Event()
        self._context = context
        self._hooks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        if context is not None and not context.add_callback(self._terminated):
            self.cancelled.set()  # the call had already ended

    def _terminated(self) -> None:
        with self._lock:
            self.cancelled.set()
            hooks = list(self._hooks)
        for hook in hooks:
            hook()

    def on_cancel(self, hook: Callable[[], None]) -> None:
        """Runs ``hook`` when the call ends (at once if it already has)."""
        with self._lock:
            self._hooks.append(hook)
            done = self.cancelled.is_set()
        if done:
            hook()

    def time_remaining(self) -> float | None:
        return None if self._context is None else self._context.time_remaining()


Handler = Callable[[bytes, Call], bytes]


class _TokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the token from their metadata, before the body is received: the
    refusal is a stream-request handler that never iterates its requests."""

    def __init__(self, token: str):
        self._token = token.encode()

    def intercept_service(self, continuation, handler_call_details):
        got = dict(handler_call_details.invocation_metadata or ()).get(_TOKEN_KEY, "")
        if hmac.compare_digest(got.encode() if isinstance(got, str) else bytes(got),
                               self._token):
            return continuation(handler_call_details)

        def deny(_requests, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong token: pass the job's shared token "
                          f"(token= / {ENV_TOKEN}) to every process")
        return grpc.stream_unary_rpc_method_handler(deny)


class _Receiver(Receiver):
    """:class:`jaxdist.launch.receive.Receiver` for :mod:`jaxdist.ps.wire` messages, whose header
    declares their size (checked against the call's limit before the body is buffered)."""

    def __init__(self, limits: ReceiveLimits):
        super().__init__(limits, name="ps-receive-watch")

    def receive(self, requests, context: grpc.ServicerContext, limit: int) -> bytes | memoryview:
        """The request's bytes, assembled from its chunks.

        Raises:
          PushRejected: the message declares more than ``limit`` bytes, or too many calls are
            receiving (code ``resource_exhausted``).
          WireError: the chunks do not add up to the message they declare.
          _Gone: the call was cancelled (by its caller or the watchdog).
        """
        try:
            return self.read(requests, context,
                             lambda chunks, receipt: self._assemble(chunks, receipt, limit))
        except Full as e:
            raise PushRejected(str(e), "resource_exhausted") from None
        except Cancelled:
            raise _Gone() from None

    @staticmethod
    def _assemble(requests, receipt: Receipt, limit: int) -> bytes | memoryview:
        parts: list[bytes] = []
        have, buf, total = 0, None, None
        try:
            for chunk in requests:
                receipt.last = time.monotonic()
                if buf is None:
                    parts.append(chunk)
                    have += len(chunk)
                    need = wire.header_length(parts[0] if len(parts[0]) >= 4 else b"".join(parts))
                    if need is None or have < need:
                        if have > limit:
                            raise _too_big(limit)
                        continue
                    head = b"".join(parts)
                    parts = []
                    try:
                        total = wire.declared_size(head)
                    except wire.WireError:
                        if have > limit:  # too big first, whatever else is wrong with it
                            raise _too_big(limit) from None
                        raise
                    if total > limit:
                        raise PushRejected(f"request declares {total} bytes; this server's limit "
                                           f"for the call is {limit} (size it from the shard)",
                                           "resource_exhausted")
                    if len(head) > total:
                        raise wire.WireError(f"{len(head) - total} byte(s) past the {total} the "
                                             "message declares")
                    buf = bytearray(total)
                    buf[:len(head)] = head
                    have = len(head)
                else:
                    if have + len(chunk) > total:
                        raise wire.WireError(f"more bytes than the {total} the message declares")
                    buf[have:have + len(chunk)] = chunk
                    have += len(chunk)
        except grpc.RpcError:
            raise _Gone() from None
        if buf is None:  # shorter than its header: decode() says what is wrong with it
            return b"".join(parts)
        if have != total:
            raise wire.WireError(f"message ends after {have} of the {total} bytes it declares")
        return memoryview(buf)


def _too_big(limit: int) -> PushRejected:
    return PushRejected(f"request of more than {limit} bytes refused: this server's limit for "
                        "the call", "resource_exhausted")


class _Gone(Exception):
    """The call ended while its body was arriving."""


def _wrap(name: str, fn: Handler, receiver: _Receiver,
          limit: Callable[[str], int]) -> Callable:
    def handler(requests, context: grpc.ServicerContext) -> bytes:  # type: ignore[return]
        # (each except clause ends in context.abort, which raises)
        try:
            request = receiver.receive(requests, context, limit(name))
            return fn(request, Call(context))  # type: ignore[arg-type]  # (bytes or a memoryview of them)
        except _Gone:
            return b""  # cancelled: nobody reads the reply
        except PushRejected as e:
            context.abort(_TO_CODE[e.code], str(e))
        except wire.WireError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed message: {e}")
        except TimeoutError as e:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        except _NotReady as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except Exception as e:  # keep serving; tell the caller what broke
            logger.exception("handler %s failed", getattr(fn, "__name__", fn))
            context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
    return handler


def serve(address: str, service: str, methods: Mapping[str, Handler], *,
          token: str | None, tls: TLSConfig | None = None,
          max_receive_bytes: int = (512 << 20) + HEADER_SLACK,
          threads: int = 48, limits: Callable[[str], int] | None = None,
          receive_limits: ReceiveLimits | None = None) -> tuple[grpc.Server, int]:
    """Starts a gRPC server for ``methods`` (``name -> fn(request, call) -> bytes``).

    Args:
      address: ``host:port`` to bind (port 0 picks one).
      service: the gRPC service name.
      methods: the handlers.
      token: calls without this token in their metadata are refused before their body is
        read; None serves without authentication (logged as a warning).
      tls: serve TLS with these credentials (None: plaintext).
      max_receive_bytes: largest request accepted (size it from the model).
      threads: handler threads.
      limits: ``method name -> largest request`` (capped by ``max_receive_bytes``), asked as each
        call starts: a service sizes it from its state (a parameter server from its shard).
        It may raise ``PushRejected`` / ``_NotReady`` to refuse the call before its body.
      receive_limits: :class:`ReceiveLimits` (default: at most ``threads // 3`` calls receiving
        their bodies at once).

    Requests arrive as a stream of chunks of at most ``CHUNK_BYTES`` (gRPC's receive limit), so
    no request is buffered by gRPC before the size its header declares is checked.

    Returns:
      ``(server, port)``; ``port`` is the bound port (useful with ``"127.0.0.1:0"``).

    Raises:
      RuntimeError: the address could not be bound (the message says why: the port in use,
        an address not of this machine, ...).
      ValueError: a TLS file is not PEM, or its key does not match its certificate.

    >>> server, port = serve("127.0.0.1:0", "demo.Echo", {"Echo": lambda req, call: req},
    ...                      token="t")
    >>> Channel(f"127.0.0.1:{port}", "demo.Echo", token="t").call("Echo", b"hi", timeout=10)
    b'hi'
    >>> _ = server.stop(0)
    """
    max_receive_bytes = int(check_number("max_receive_bytes", max_receive_bytes, lo=1,
                                         integer=True))
    receiver = _Receiver(receive_limits or ReceiveLimits(max_receiving=max(1, threads // 3)))

    def limit_of(name: str) -> int:
        return min(max_receive_bytes, limits(name)) if limits is not None else max_receive_bytes

    handlers = {name: grpc.stream_unary_rpc_method_handler(_wrap(name, fn, receiver, limit_of))
                for name, fn in methods.items()}
    if token is None:
        logger.warning("%s on %s serves WITHOUT authentication: any process that can reach "
                       "the port may call it", service, address)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads),
        handlers=[grpc.method_handlers_generic_handler(service, handlers)],
        interceptors=[_TokenInterceptor(token)] if token is not None else [],
        options=[("grpc.max_receive_message_length", CHUNK_BYTES),
                 ("grpc.max_send_message_length", -1),
                 ("grpc.so_reuseport", 0), *_HTTP2])
    server._jaxdist_receiver = receiver  # noqa: SLF001 - for tests and stop()
    if tls is not None:
        tls.validate()  # a bad file would otherwise surface as "Failed to bind"
    # gRPC reports an unbindable address as a log line and a bare "Failed to bind": find the
    # cause first with a plain socket (as gRPC binds: SO_REUSEADDR, no SO_REUSEPORT)
    reason = _why_not_bound(address)
    if reason is not None:
        receiver.close()
        raise RuntimeError(f"could not bind {address}: {reason}")
    try:
        if tls is not None:
            port = server.add_secure_port(address, tls.server_credentials())
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # grpcio >= 1.5x raises where older versions returned 0
        port = 0
    if port == 0:
        receiver.close()
        raise RuntimeError(f"could not bind {address}: gRPC refused it (see its log above)")
    server.start()
    return server, port


def _why_not_bound(address: str) -> str | None:
    """Why ``address`` cannot be bound, found by binding it with a plain socket (None: it can)."""
    import socket

    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError) as e:
        return f"cannot resolve it ({e})"
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(sockaddr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} is in use by another process"
            if e.errno == errno.EADDRNOTAVAIL:
                return f"{host} is not an address of this machine"
            if e.errno == errno.EACCES:
                return f"no permission to bind port {port}"
            return e.strerror or str(e)
    return None


def serve_until_stopped(service: Any, address: str, name: str, *, token: str | None,
                        tls: TLSConfig | None = None,
                        max_receive_bytes: int = (512 << 20) + HEADER_SLACK,
                        on_serving: Callable[[int], None] | None = None) -> None:
    """Serves ``service.methods()`` on ``address`` until ``service.stopped`` is set (by the
    coordinator's ``Shutdown`` call); ``on_serving(port)`` runs once the port is bound.

    Raises:
      ValueError: a TLS file is not PEM, or the key does not match the certificate.
      RuntimeError: the address cannot be bound (the message says why: port in use, ...).
    """
    server, port = serve(address, name, service.methods(), token=token, tls=tls,
                         max_receive_bytes=max_receive_bytes,
                         limits=getattr(service, "receive_limit", None))
    if on_serving is not None:
        on_serving(port)
    service.stopped.wait()
    time.sleep(0.2)  # let the Shutdown reply leave before the server stops
    server.stop(grace=1).wait()
    server._jaxdist_receiver.close()  # noqa: SLF001


class Channel:
    """A client channel that sends bytes to ``/service/method`` and maps errors to exceptions."""

    def __init__(self, address: str, service: str, *, token: str | None = None,
                 tls: TLSConfig | None = None):
        self.address = address
        self._service = service
        self._metadata = ((_TOKEN_KEY, token),) if token is not None else ()
        options: list[tuple[str, int | str]] = [("grpc.max_receive_message_length", -1),
                   ("grpc.max_send_message_length", -1),
                   # a restarted peer is back within a second, not after gRPC's
                   # default exponential backoff (up to 2 minutes)
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000), *_HTTP2]
        if tls is not None:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            self._channel = grpc.secure_channel(address, tls.channel_credentials(), options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._plaintext = tls is None
        self._stubs: dict[str, Any] = {}

    def _stub(self, method: str):
        if method not in self._stubs:
            self._stubs[method] = self._channel.stream_unary(f"/{self._service}/{method}")
        return self._stubs[method]

    @staticmethod
    def _chunks(payload: bytes):
        if len(payload) <= CHUNK_BYTES:
            yield bytes(payload)
            return
        view = memoryview(payload)
        for i in range(0, len(view), CHUNK_BYTES):
            yield bytes(view[i:i + CHUNK_BYTES])

    def call(self, method: str, payload: bytes, *, timeout: float | None = None) -> bytes:
        if timeout is not None:
            timeout = check_number("call timeout", timeout, lo_open=True)
        try:
            return self._stub(method)(self._chunks(payload), timeout=timeout,
                                      metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e, f"{self._service}/{method} at {self.address}",
                         plaintext=self._plaintext) from None

    def future(self, method: str, payload: bytes):
        """Starts a call without a deadline; ``result()`` raises ``grpc.RpcError`` (or
        ``grpc.FutureCancelledError`` after ``cancel()``)."""
        return self._stub(method).future(self._chunks(payload), metadata=self._metadata)

    def close(self) -> None:
        self._channel.close()


def _error(e: grpc.RpcError, where: str, *, plaintext: bool = False) -> Exception:
    code, detail = e.code(), e.details()
    msg = f"{where}: {detail}"
    # what a TLS server's hang-up looks like to a plaintext client; not "Connection refused"
    # (nothing listening), which every failure to connect also reports
    if plaintext and code == grpc.StatusCode.UNAVAILABLE and any(
            s in (detail or "") for s in ("Socket closed", "Connection reset", "handshake")):
        msg += (" (this client speaks plaintext: the server may require TLS; set "
                "JAXDIST_PS_TLS_CERT / _KEY / _CA here as on the server, or pass tls=)")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return PushRejected(msg)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return PushRejected(msg, "resource_exhausted")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return PermissionDenied(msg)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(msg)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.CANCELLED):
        return Unavailable(msg)
    return RuntimeError(f"{msg} ({code.name})")


class _Busy(Exception):
    pass


class ServerClient(Protocol):
    """What a worker (and the coordinator) needs from one parameter server."""

    def pull(self, *, min_version: int | None = None,
             timeout: float | None = None) -> tuple[int, dict[str, Any]]: ...

    def push(self, *, worker: int, step_id: int, version: int,
             grads: Mapping[str, Any]) -> PushResult: ...

    def status(self) -> dict[str, Any]: ...

    def log(self) -> list[UpdateRecord]: ...


class LocalClient:
    """In-process client: direct calls on a :class:`ParameterServer` (no serialization)."""

    def __init__(self, server: ParameterServer):
        self.server = server

    def pull(self, *, min_version=None, timeout=None):
        return self.server.pull(min_version=min_version, timeout=timeout)

    def push(self, *, worker, step_id, version, grads):
        return self.server.push(worker=worker, step_id=step_id, version=version, grads=grads)

    def status(self):
        return self.server.status()

    def log(self):
        return list(self.server.log)


class GrpcClient:
    """Client of one remote parameter server (see :class:`PSService`)."""

    def __init__(self, address: str, *, token: str | None = None, timeout: float = 60.0,
                 tls: TLSConfig | None = None):
        self.timeout = check_number("GrpcClient timeout", timeout, lo_open=True)
        self._ch = Channel(address, PS_SERVICE, token=token, tls=tls)
        self.address = address

    def pull(self, *, min_version=None, timeout=None):
        if min_version is None:
            reply = self._ch.call("Pull", wire.encode({}), timeout=self.timeout)
        else:
            def attempt(left: float) -> bytes:
                try:
                    return self._ch.call("Pull", wire.encode(
                        {"min_version": min_version, "timeout": left}),
                        timeout=left + self.timeout)
                except PushRejected as e:
                    if e.code == "resource_exhausted":  # too many waiters there: back off
                        raise _Busy(str(e)) from None
                    raise
            # the server bounds each wait (ServerConfig.max_wait_s); keep asking until ours ends
            try:
                reply = retry(attempt, timeout_s=timeout if timeout is not None else self.timeout,
                              retry_on=(_Busy, TimeoutError), max_delay_s=0.5)
            except _Busy as e:
                raise TimeoutError(f"{e} (still busy when the wait of {timeout}s ended)") from None
        header, arrays = wire.decode(reply)
        return header["version"], arrays

    def push(self, *, worker, step_id, version, grads):
        reply = self._ch.call("Push", wire.encode(
            {"worker": worker, "step_id": step_id, "version": version}, grads),
            timeout=self.timeout)
        h, _ = wire.decode(reply)
        return PushResult(h["status"], h["version"], h["incarnation"], h["restored_version"])

    def status(self, *, timeout: float | None = None) -> dict[str, Any]:
        return wire.decode(self._ch.call("Status", b"", timeout=timeout or self.timeout))[0]

    def log(self) -> list[UpdateRecord]:
        _, arrays = wire.decode(self._ch.call("Log", b"", timeout=self.timeout))
        return [UpdateRecord(*map(int, r)) for r in arrays["log"]]

    def init(self, index: int, params: Mapping[str, Any], optimizer: OptimizerSpec,
             config: ServerConfig) -> dict[str, Any]:
        # where a server keeps its checkpoint is the server's own choice (its command line)
        remote_config = {k: v for k, v in config.to_dict().items() if k != "checkpoint_dir"}
        reply = self._ch.call("Init", wire.encode(
            {"index": index, "optimizer": optimizer.to_dict(), "config": remote_config},
            params), timeout=self.timeout)
        return wire.decode(reply)[0]

    def shutdown(self) -> None:
        self._ch.call("Shutdown", b"", timeout=self.timeout)

    def close(self) -> None:
        self._ch.close()


# what a remote Init may set; checkpoint_dir is not among them (no peer picks a path here)
_REMOTE_CONFIG = frozenset(f.name for f in dataclasses.fields(ServerConfig)) - {"checkpoint_dir"}
# ...and the waiting limits it may not raise past what keeps handler threads free (serve()
# runs 48, at most 16 of them receiving bodies: at most 24 may wait) or make a wait unbounded
# in practice
_MAX_WAITERS, _MAX_WAIT_S = 24, 300.0
# ...nor grow its bookkeeping past a few tens of MB
_MAX_WINDOW = 1 << 20


class PSService:
    """The gRPC face of one parameter-server process.

    The process starts empty; the coordinator's ``Init`` creates the shard (or, when a checkpoint
    of this index exists in ``checkpoint_dir``, the server restores from it at start-up and
    ``Init`` only checks that the keys match). ``checkpoint_dir`` is this process's option; an
    ``Init`` naming one is refused.
    """

    def __init__(self, index: int, *, checkpoint_dir: str | None = None):
        self.index = index
        self.checkpoint_dir = checkpoint_dir
        self.server: ParameterServer | None = None
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        if checkpoint_dir:
            self.server = ParameterServer.restore(checkpoint_dir, index)

    def methods(self) -> dict[str, Handler]:
        return {"Init": self.init, "Pull": self.pull, "Push": self.push,
                "Status": self.status, "Log": self.log, "Shutdown": self.shutdown}

    def receive_limit(self, method: str) -> int:
        """Largest request ``method`` may send, from the shard once there is one (asked before
        the request's body arrives; a push before ``Init`` is refused then).

        Raises:
          _NotReady: a ``Push`` before the server is initialized.
        """
        server = self.server
        shard = None if server is None else server.shard_bytes
        if method == "Push":
            if server is None:
                self._ready()
            return min(shard, server.config.max_push_bytes) + HEADER_SLACK
        if method == "Init":
            return (1 << 62) if shard is None else shard + HEADER_SLACK
        return HEADER_SLACK

    def _ready(self) -> ParameterServer:
        server = self.server
        if server is None:
            raise _NotReady(f"ps{self.index} is not initialized yet (waiting for the "
                            "coordinator's Init)")
        return server

    def _reply(self, result: PushResult) -> bytes:
        return wire.encode({"status": result.status, "version": result.version,
                            "incarnation": result.incarnation,
                            "restored_version": result.restored_version})

    def init(self, request: bytes, call: Call | None = None) -> bytes:
        header, params = wire.decode(request)
        if header.get("index") != self.index:
            raise PushRejected(f"Init for ps{header.get('index')} reached ps{self.index}: the "
                               "cluster's ps address list differs between processes")
        config = header.get("config")
        if not isinstance(config, dict) or not set(config) <= _REMOTE_CONFIG:
            raise PushRejected(f"Init config must be a map of {sorted(_REMOTE_CONFIG)}; got "
                               f"{sorted(config) if isinstance(config, dict) else config!r} "
                               "(a server's checkpoint_dir is set on its own command line)")
        with self._lock:
            if self.server is None:
                try:
                    cfg = ServerConfig(**config, checkpoint_dir=self.checkpoint_dir)
                    cfg = dataclasses.replace(
                        cfg, max_waiters=min(cfg.max_waiters, _MAX_WAITERS),
                        max_wait_s=min(cfg.max_wait_s, _MAX_WAIT_S),
                        dedup_window=min(cfg.dedup_window, _MAX_WINDOW),
                        log_window=min(cfg.log_window, _MAX_WINDOW))
                    opt = OptimizerSpec.from_dict(header.get("optimizer"))
                except (TypeError, ValueError, KeyError, AttributeError) as e:
                    raise PushRejected(f"Init: bad config or optimizer: {e!r}") from None
                self.server = ParameterServer(
                    self.index, {k: v.copy() for k, v in params.items()}, opt, cfg)
            else:
                want = {k: [v.dtype.name, list(v.shape)] for k, v in params.items()}
                if self.server.status()["keys"] != want:
                    raise PushRejected(f"ps{self.index} already holds "
                                       f"{self.server.status()['keys']}, not {want}")
        return wire.encode(self.server.status())

    def pull(self, request: bytes, call: Call | None = None) -> bytes:
        h, _ = wire.decode(request)
        server = self._ready()
        timeout = h.get("timeout")
        if timeout is not None:  # NaN and inf included: a NaN wait would spin (issue 19)
            timeout = check_number("Pull timeout", timeout, error=PushRejected)
        cancelled = None
        if call is not None:
            cancelled = call.cancelled
            call.on_cancel(server.wake)
            left = call.time_remaining()
            if left is not None:
                timeout = left if timeout is None else min(timeout, left)
        version, params = server.pull(min_version=h.get("min_version"), timeout=timeout,
                                      cancelled=cancelled)
        return wire.encode({"version": version, "incarnation": server.incarnation,
                            "restored_version": server.restored_version}, params)

    def push(self, request: bytes, call: Call | None = None) -> bytes:
        server = self._ready()
        if len(request) > server.config.max_push_bytes + HEADER_SLACK:
            raise PushRejected(f"push of {len(request)} bytes exceeds ps{self.index}'s limit of "
                               f"{server.config.max_push_bytes} (ServerConfig.max_push_bytes)",
                               "resource_exhausted")
        h, grads = wire.decode(request)
        return self._reply(server.push(worker=h.get("worker"), step_id=h.get("step_id"),
                                       version=h.get("version"), grads=grads))

    def status(self, request: bytes, call: Call | None = None) -> bytes:
        return wire.encode(self._ready().status())

    def log(self, request: bytes, call: Call | None = None) -> bytes:
        rows = [dataclasses.astuple(r) for r in self._ready().log]
        return wire.encode({}, {"log": np.array(rows, np.int64).reshape(-1, 4)})

    def shutdown(self, request: bytes, call: Call | None = None) -> bytes:
        self.stopped.set()
        return b""
