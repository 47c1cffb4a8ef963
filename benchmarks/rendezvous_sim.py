"""The rendezvous store under many hosts: a load simulator (issue 41, item 7).

Every simulated host is a real elastic agent (``jaxdist.launch.elastic.Agent``, its ``run``
unchanged: the same calls, keys and timings as on a real host) in a thread of this process; only
its processes are stand-ins (``_Proc``: a "step" every ``--step-s`` seconds written to the real
heartbeat file, a stop at the step the agents agree on, an exit when the job ends). The store is
served by ``serve()`` in one child process, with the round closer of the agent that serves it, as
on the store's host of a real job (``--store thread``: in this process).

For each size it times a round of N hosts forming, re-forming after one host is lost (its agent
freezes: no heartbeat, no call) and after one joins, and reports the store's CPU time, its memory
(RSS) and keys/bytes, and the calls per host (per round and per second of a running round), from
which the store's load at 10,000 hosts follows.

    python benchmarks/rendezvous_sim.py --hosts 64 256 1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import threading
import time
import types
from typing import Any

from jaxdist.launch import elastic, heartbeat, rendezvous, statedir

JOB = "sim"


class _Proc:
    """A stand-in for a process of the job: a step every ``step_s`` seconds in the heartbeat
    file, exit 0 at the stop step the agents asked for or at the job's end."""

    _pids = iter(range(10**7, 10**8))

    def __init__(self, launcher: _Launcher, rank: int):
        self.l, self.rank, self.pid = launcher, rank, next(self._pids)
        self.start, self.written = time.monotonic(), -1
        self.code: int | None = None
        self.exiting = False
        self.base = launcher.resume_step

    def poll(self) -> int | None:
        if self.code is not None or self.exiting:  # (one poll after its last heartbeat, as
            self.code = 0 if self.code is None else self.code  # a process takes to exit)
            return self.code
        step = self.base + int((time.monotonic() - self.start) / self.l.step_s)
        stop = statedir.read_token(statedir.stop_path(self.l.state_dir))
        if stop is not None and step >= int(stop):
            step, self.exiting = int(stop), True
        if self.l.sim.finish.is_set():
            self.exiting = True
        if step != self.written:  # what heartbeat.Heartbeat writes
            heartbeat.write_atomic(heartbeat.heartbeat_path(self.l.state_dir, self.rank),
                                   f"{step} {time.time():.3f} {step}".encode())
            self.written = step
            self.l.resume_step = step
        return None

    def stop(self) -> None:
        if self.code is None:
            self.code = -9


class _Launcher:
    """What an ``Agent`` asks of its launcher (``jaxdist.launch.group``), without processes."""

    def __init__(self, sim: Simulation, state_dir: str):
        self.sim, self.state_dir, self.step_s = sim, state_dir, sim.step_s
        self.options = types.SimpleNamespace(hang_timeout_s=1e6, devices_per_process=None)
        self.stop_signal = None
        self.restarts, self.last_failure, self.resume_step = 0, None, 0
        self.rounds: list[int] = []  # the rounds this host started its processes in

    def say(self, message: str) -> None:
        if self.sim.verbose:
            print(message, flush=True)

    def child_env(self, env, attempt, **_):
        self.rounds.append(attempt)
        self.sim.started(attempt)
        return env

    def spawn(self, label, env, readers):
        return _Proc(self, int(label))

    def end_group(self, procs, readers):
        for p in procs:
            p.stop()

    def record_failure(self, description, steps, ranks=()):
        self.last_failure = description

    def flush_survivors(self, procs):
        pass

    def dump_stacks(self, ranks):
        pass

    def repeated(self, failure):
        return False


def _own_connection(client: rendezvous.RendezvousClient) -> None:
    """A connection of its own for a simulated host, as each real host has (gRPC shares one
    between channels of one process to one address, and with it MAX_STREAMS calls at a time)."""
    import grpc

    client._channel.close()
    client._channel = grpc.insecure_channel(client.address, options=[
        ("grpc.use_local_subchannel_pool", 1), ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.max_receive_message_length", rendezvous.MAX_REPLY_BYTES)])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(endpoint: str, nnodes: tuple[int, int], conn, host_timeout_s: float,
           root: str) -> None:
    """The store's host: ``serve()`` and the round closer of the agent that serves it (this
    agent runs no round of its own). Answers ``("min", k)`` and ``("stats",)`` on ``conn``."""
    sim = types.SimpleNamespace(step_s=1.0, verbose=False, started=lambda n: None)
    agent = elastic.Agent(_Launcher(sim, tempfile.mkdtemp(dir=root)), nnodes=nnodes,
                          endpoint=endpoint,
                          rdzv_id=JOB, nproc=1, max_restarts=10**6, rdzv_timeout_s=600,
                          host_timeout_s=host_timeout_s, last_call_s=0.0)
    assert agent.server is not None, f"could not serve {endpoint}"
    local = agent.server[0].client(JOB)
    local.set_if_absent("open", 0)
    local.set_if_absent("done", 0)
    threading.Thread(target=agent._close_rounds, daemon=True).start()
    if conn is None:
        return agent  # type: ignore[return-value]
    # Every simulated host calls from 127.0.0.1, where each real host has an address of its own:
    # the bounds on one peer's calls waiting for their message, sessions and held calls are the
    # store's whole bounds here (in this child process only).
    rendezvous.MAX_WAITING_PER_PEER = rendezvous.MAX_WAITING
    rendezvous.MAX_SESSIONS_PER_PEER = rendezvous.MAX_SESSIONS
    rendezvous.MAX_HOLDING_PER_PEER = rendezvous.MAX_HOLDING
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "min":
            agent.min = msg[1]
        elif msg[0] == "stats":
            conn.send(_store_stats(agent.server[0]))
        elif msg[0] == "stop":
            agent._stopped.set()
            agent.server[0].stop(0)
            conn.send("stopped")
            return


def _store_stats(server) -> dict:
    store = server._store
    with store._lock:
        keys, size = len(store._data), store._bytes
    return {"keys": keys, "bytes": size}


class _Harness:
    """The store (``_serve``, in a child process or a thread) and the rounds' accounting that both
    kinds of simulated hosts share."""

    def __init__(self, hosts: int, *, step_s: float = 0.25, store: str = "process",
                 host_timeout_s: float = elastic.HOST_TIMEOUT_S, verbose: bool = False):
        self.n, self.step_s, self.verbose = hosts, step_s, verbose
        self.host_timeout_s = host_timeout_s
        self.finish = threading.Event()
        self._lock = threading.Condition()
        self._started: dict[int, int] = {}  # round: hosts that started their processes in it
        self.root = tempfile.mkdtemp(prefix="jaxdist-rdzv-sim-")
        self.endpoint = f"127.0.0.1:{_free_port()}"
        nnodes = (hosts, hosts + 1)  # the first round waits for all N; then min is lowered
        if store == "process":
            ctx = mp.get_context("spawn")
            self._conn, child = ctx.Pipe()
            self._proc = ctx.Process(target=_serve, args=(self.endpoint, nnodes, child,
                                                          host_timeout_s, self.root), daemon=True)
            self._proc.start()
            if not self._conn.poll(120):
                raise RuntimeError("the store's process did not start within 120 s")
            self._conn.recv()
            self._closer = None
        else:
            self._proc = None
            self._closer = _serve(self.endpoint, nnodes, None, host_timeout_s, self.root)
        self.client = rendezvous.RendezvousClient(self.endpoint, JOB, timeout_s=30)
        self.calls = self.retries = 0
        self.codes: dict[str, Any] = {}

    def started(self, n: int) -> None:
        with self._lock:
            self._started[n] = self._started.get(n, 0) + 1
            self._lock.notify_all()

    def wait_round(self, n: int, hosts: int, timeout_s: float) -> float:
        """Waits until ``hosts`` hosts have started their processes in round ``n``; the time."""
        if self.verbose:
            print(f"waiting for round {n} of {hosts} hosts", flush=True)
        with self._lock:
            if not self._lock.wait_for(lambda: self._started.get(n, 0) >= hosts, timeout_s):
                raise TimeoutError(
                    f"round {n}: {self._started.get(n, 0)} of {hosts} hosts started within "
                    f"{timeout_s:g} s (registered: {len(self.client.list(f'r{n}/member/'))}, "
                    f"alive: {self.client.get('alive_n')}, open: {self.client.get('open')}; "
                    f"ended: {sorted(set(map(str, self.codes.values())))[:5]}; store "
                    f"{self.store_usage()}, this process's CPU {sum(os.times()[:2]):.1f} s)")
        return time.monotonic()

    def round_members(self, n: int) -> int:
        return len(self.client.get(f"r{n}/final") or ())

    # -- the store --------------------------------------------------------------------------

    def set_min(self, k: int) -> None:
        if self._proc is not None:
            self._conn.send(("min", k))
        else:
            self._closer.min = k

    def store_usage(self) -> dict:
        """The store's process: CPU seconds so far, RSS; the store's keys and bytes."""
        if self._proc is not None:
            self._conn.send(("stats",))
            stats = self._conn.recv()
            pid = self._proc.pid
        else:
            stats = _store_stats(self._closer.server[0])
            pid = os.getpid()
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
        return {"cpu_s": cpu, "rss_mb": rss, **stats}

    def _stop_store(self) -> None:
        if self._proc is not None:
            self._conn.send(("stop",))
            self._conn.poll(30)
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
        else:
            self._closer._stopped.set()
            self._closer.server[0].stop(0)
        self.client.close()
        shutil.rmtree(self.root, ignore_errors=True)


class Simulation(_Harness):
    """N real agents (``elastic.Agent``, in threads of this process) against one store: the
    agents' code as it runs, for up to about 128 hosts on a 2-core machine (``--agents real``)."""

    def __init__(self, hosts: int, **kw):
        super().__init__(hosts, **kw)
        self.agents: list[elastic.Agent] = []
        self.threads: list[threading.Thread] = []
        self._count_calls()
        # The agents' local ticks (a look at their processes every 0.1 s) cost each real host its
        # own CPU; here every host shares one process, so at scale they tick less often (their
        # store polls keep their own rate: at 256 hosts and more they are 0.25 s apart or more).
        tick = 0.1 if hosts < 256 else 0.25
        self._time = elastic.time
        elastic.time = types.SimpleNamespace(  # type: ignore[attr-defined]
            monotonic=time.monotonic, time=time.time, sleep=lambda s: time.sleep(max(s, tick)))

    # -- the hosts --------------------------------------------------------------------------

    def _count_calls(self) -> None:
        sim, original = self, rendezvous.RendezvousClient._call

        def counted(client, method, timeout_s=None, **req):
            if getattr(client, "_sim_host", False):
                sim.calls += 1  # (under the GIL; a lost count or two is no matter)
            return original(client, method, timeout_s, **req)
        self._original_call = original
        rendezvous.RendezvousClient._call = counted  # type: ignore[method-assign]

    def add_host(self) -> elastic.Agent:
        launcher = _Launcher(self, tempfile.mkdtemp(dir=self.root))
        agent = elastic.Agent(launcher, nnodes=(1, self.n + 1), endpoint=self.endpoint,
                              rdzv_id=JOB, nproc=1, max_restarts=10**6, rdzv_timeout_s=120,
                              host_timeout_s=self.host_timeout_s, last_call_s=0.0)
        _own_connection(agent.store)
        agent.store._sim_host = True  # type: ignore[attr-defined]
        self.agents.append(agent)
        return agent

    def start(self, agent: elastic.Agent) -> None:
        def run():
            try:
                self.codes[agent.id] = agent.run()
            except Exception as e:  # noqa: BLE001 - a frozen host's calls end in errors
                self.codes[agent.id] = repr(e)  # type: ignore[assignment]
        t = threading.Thread(target=run, daemon=True, name=f"host-{len(self.threads)}")
        self.threads.append(t)
        t.start()

    def freeze(self, agent: elastic.Agent) -> None:
        """The host is lost: its agent makes no call any more (no heartbeat), until ``close``."""
        def frozen(*_, **__):
            self.finish.wait()
            raise rendezvous.RendezvousError("this simulated host is lost")
        agent.store._call = frozen  # type: ignore[method-assign]
        agent.l.stop_signal = None

    def close(self) -> None:
        for agent in self.agents:
            if "_call" in vars(agent.store):  # a lost host: its agent gives up, no fail-over
                agent._members = []
        self.finish.set()
        end = time.monotonic() + 60
        for t in self.threads:
            t.join(timeout=max(0.0, end - time.monotonic()))
        self._stop_store()
        rendezvous.RendezvousClient._call = self._original_call  # type: ignore[method-assign]
        elastic.time = self._time  # type: ignore[attr-defined]


# -- light hosts: many in one event loop (the default) ---------------------------------------

class _Progress:
    """What ``Agent._round_calls`` reads of a hang detector: each rank's dispatched steps."""

    def __init__(self, host: _LightHost):
        self.host = host

    def progress(self) -> dict:
        return {self.host.index: types.SimpleNamespace(dispatched=self.host.step())}


_CALL_TIMEOUT_S = rendezvous.RendezvousClient.__init__.__kwdefaults__["timeout_s"]


class _LightHost:
    """One simulated host as a coroutine: the calls of ``elastic.Agent`` (its poll batches, member
    record and timings are the agent's own methods), at a fraction of a thread's cost. Its one
    process is a step counter (a step every ``step_s``); it stops at the step the agents agree on."""

    _poll_s = elastic.Agent._poll_s
    _beat_s = elastic.Agent._beat_s
    _watch_poll_s = elastic.Agent._watch_poll_s
    _beat_call = elastic.Agent._beat_call
    _join_calls = elastic.Agent._join_calls
    _join_watch = elastic.Agent._join_watch
    _round_calls = elastic.Agent._round_calls
    _round_watch = elastic.Agent._round_watch
    _member_record = elastic.Agent._member_record

    def __init__(self, sim: LightSimulation, index: int):
        self.sim, self.index = sim, index
        self.hostname = f"sim-host-{index}"
        self.id = f"{self.hostname}-{index}"
        self.addr, self.nproc, self.identity = "127.0.0.1", 1, sim.identity
        self.host_timeout_s = sim.host_timeout_s
        self._hosts, self._quiet, self._beaten, self._last_order = 1, False, 0.0, None
        self.last_round = -1
        self._prefix = f"{JOB}/"
        self.base, self.started_at, self.stop_at = 0, time.monotonic(), None
        self.frozen = False
        self.sessions: dict[str, Any] = {}  # lane: its session (RendezvousClient's, per thread)
        self.tasks: list[asyncio.Task] = []

    def step(self) -> int:
        step = self.base + int((time.monotonic() - self.started_at) / self.sim.step_s)
        return step if self.stop_at is None else min(step, self.stop_at)

    # -- calls: the RendezvousClient's requests and replies, over grpc.aio --------------------

    async def call(self, method: str, lane: str = "main", **req) -> Any:
        """One request over this host's session of ``lane`` (the agent's threads each have
        theirs: its main loop, its heartbeat)."""
        if self.frozen:
            await asyncio.Event().wait()  # a lost host makes no call any more
        import grpc

        request = rendezvous._dumps(  # a session's message, as RendezvousClient._send's
            {"m": method, **{f: self._prefix + v if f in ("key", "prefix") else v
                             for f, v in req.items()}})
        held = req["watch"]["s"] if "watch" in req else 0.0  # as RendezvousClient.watch
        end = time.monotonic() + held + _CALL_TIMEOUT_S
        while True:  # as RendezvousClient._call: a busy store's refusals are tried again
            try:
                if lane not in self.sessions:
                    self.sessions[lane] = self.sim.channel(self.index).stream_stream(
                        f"/{rendezvous._SERVICE}/session")(wait_for_ready=True)
                async with asyncio.timeout(max(0.01, end - time.monotonic())):
                    await self.sessions[lane].write(request)
                    reply = await self.sessions[lane].read()
                if reply is grpc.aio.EOF:
                    raise ConnectionError("the store ended the session")
                break
            except (grpc.aio.AioRpcError, ConnectionError, TimeoutError) as e:
                session = self.sessions.pop(lane, None)
                if session is not None:
                    session.cancel()
                code = e.code() if isinstance(e, grpc.aio.AioRpcError) else None
                busy = (code == grpc.StatusCode.RESOURCE_EXHAUSTED
                        and "max_receiving" in str(e.details()))
                if not (busy or isinstance(e, ConnectionError) or code in (
                        grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)) \
                        or time.monotonic() >= end - 0.05:
                    raise
                self.sim.retries += 1
                await asyncio.sleep(0.05)
        self.sim.calls += 1
        return self.sim.decode(reply)

    async def batch(self, *calls: tuple[str, dict], watch: dict | None = None) -> Any:
        ops = [[m, {f: self._prefix + v if f in ("key", "prefix") else v for f, v in r.items()}]
               for m, r in calls]
        if watch is None:
            replies, seen = await self.call("batch", ops=ops), None
        else:  # RendezvousClient.watch
            watch = {**watch, "on": [self._prefix + w for w in watch["on"]]}
            reply = await self.call("batch", ops=ops, watch=watch)
            replies, seen = reply["replies"], reply["seen"]
        self._beaten = time.monotonic()
        out = [{k[len(self._prefix + r["prefix"]):]: va for k, va in got.items()}
               if m == "list" else got for (m, r), got in zip(calls, replies)]
        return out if watch is None else (out, seen)

    # -- the agent's loop ---------------------------------------------------------------------

    async def run(self) -> None:
        await self.call("set_if_absent", key="open", value=0)
        await self.call("set_if_absent", key="done", value=0)
        self.tasks.append(asyncio.ensure_future(self._beat()))
        while True:
            joined = await self._join()
            if joined is None:
                return
            await self._round(*joined)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(elastic._BEAT_S)
            if time.monotonic() - self._beaten >= self._beat_s():
                await self.call("set", lane="beat", key=f"alive/{self.id}", value=self.hostname)
                self._beaten = time.monotonic()

    async def _join(self) -> tuple[int, list] | None:
        guess = self.last_round + 1 if self.last_round >= 0 else None
        while True:  # as Agent._join
            if guess is None:
                done, n = await self.batch(("get", {"key": "done"}), ("get", {"key": "open"}))
                if done:
                    return None
            else:
                n, guess = guess, None
            register = [("set", {"key": f"r{n}/member/{self.id}",
                                 "value": self._member_record(0)})]
            seen, next_at = None, time.monotonic()
            while True:
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                next_at = time.monotonic() + self._poll_s(least=0.05)
                hold = self._beat_s()
                self._beaten = time.monotonic() + hold
                replies, seen = await self.batch(
                    *register, *self._join_calls(),
                    watch={"on": self._join_watch(), "seen": seen, "s": hold})
                opened, _, done, _, alive_n, *_ = replies[len(register):]
                register = []
                if opened != n:
                    break
                if done:
                    return None
                if alive_n is None:
                    alive_n = len(await self.call("list", prefix="alive/"))
                self._hosts = max(alive_n, 1)
            final = await self.call("get", key=f"r{n}/final")
            if final and any(k == self.id for k, _ in final):
                return n, final

    async def _round(self, n: int, members: list) -> None:
        self._hosts, self.last_round = len(members), n
        ids = [k for k, _ in members]
        self._last_order = ids.index(self.id)
        self.base, self.started_at, self.stop_at = self.step(), time.monotonic(), None
        self.sim.started(n)
        progress, published, seen = _Progress(self), 0.0, None
        next_at = time.monotonic() + self._watch_poll_s()
        while True:  # as elastic._RoundPoller, and Agent._watch_round on its news
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            hold = self._watch_poll_s()
            next_at = time.monotonic() + hold
            publish = time.monotonic() - published > 1.0
            published = time.monotonic() if publish else published
            self._beaten = time.monotonic() + hold
            (failed, leaving, rejected, registered, stop_now, done, silent, *_), seen = \
                await self.batch(*self._round_calls(n, progress, publish), watch={
                    "on": self._round_watch(n), "seen": seen, "s": hold})
            if done or failed:
                return
            if any(k in ids and k != self.id for k in silent or ()):
                await self.call("set_if_absent", key=f"r{n}/failed", value="a host lost")
                return
            if stop_now is None and any(k not in ids for k in registered):
                stop_now = await self.call("set_if_absent", key=f"r{n}/drain",
                                           value=self.step() + max(4, math.ceil(
                                               elastic._DRAIN_LEAD_S / self.sim.step_s)))
            if stop_now is not None:  # its process stops there (the agent sees it in 0.1 s)
                self.stop_at = stop_now
                while self.base + int((time.monotonic() - self.started_at)
                                      / self.sim.step_s) < stop_now:
                    await asyncio.sleep(0.1)
                return


class LightSimulation(_Harness):
    """N light hosts (``_LightHost``) on one event loop in a thread of this process, each with a
    connection of its own, against the store in a child process (``_serve``: ``serve()`` and the
    serving agent's round closer, as on a real job's store host)."""

    def __init__(self, hosts: int, **kw):
        super().__init__(hosts, **kw)
        self.identity = elastic._identity(types.SimpleNamespace(
            options=types.SimpleNamespace(devices_per_process=None)))  # as _serve's agent's
        self.agents: list[_LightHost] = []
        self._channels: list[Any] = []
        self._decoded: dict[bytes, Any] = {}
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="light-hosts")
        self._thread.start()

    def channel(self, index: int) -> Any:
        """Host ``index``'s channel: a connection of its own, as each real host has (gRPC would
        share one between channels of one process to one address)."""
        import grpc

        while len(self._channels) <= index:
            self._channels.append(grpc.aio.insecure_channel(self.endpoint, options=[
                ("grpc.use_local_subchannel_pool", 1),
                ("grpc.max_receive_message_length", rendezvous.MAX_REPLY_BYTES)]))
        return self._channels[index]

    def decode(self, reply: bytes) -> Any:
        """A reply as ``RendezvousClient`` reads it (``_loads``); a large one (a round's member
        list, which every host reads once) is parsed once for all the hosts of this process,
        as each real host would parse it on its own CPU at the same time."""
        if len(reply) < 4096:
            return rendezvous._loads(reply)
        if reply not in self._decoded:
            if len(self._decoded) > 8:
                self._decoded.clear()
            self._decoded[reply] = rendezvous._loads(reply)
        return self._decoded[reply]

    def add_host(self) -> _LightHost:
        host = _LightHost(self, len(self.agents))
        self.agents.append(host)
        return host

    def start(self, host: _LightHost) -> None:
        async def run():
            try:
                await host.run()
                self.codes[host.id] = 0
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - said in wait_round's error
                self.codes[host.id] = repr(e)
        self.loop.call_soon_threadsafe(lambda: host.tasks.append(self.loop.create_task(run())))

    def freeze(self, host: _LightHost) -> None:
        """The host is lost: it makes no call any more (no heartbeat)."""
        host.frozen = True

    def close(self) -> None:
        async def end():
            tasks = [t for h in self.agents for t in h.tasks]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for channel in self._channels:
                await channel.close()
        asyncio.run_coroutine_threadsafe(end(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self._stop_store()


def run(hosts: int, *, step_s: float = 0.25, store: str = "process", steady_s: float = 5.0,
        host_timeout_s: float = elastic.HOST_TIMEOUT_S, join: bool = True,
        agents: str = "light", verbose: bool = False) -> dict[str, Any]:
    """Forms a round of ``hosts``, loses one, adds one (``join``); the times and the store's
    costs. Raises if a round does not form with the hosts expected."""
    kind = {"light": LightSimulation, "real": Simulation}[agents]
    sim = kind(hosts, step_s=step_s, store=store, host_timeout_s=host_timeout_s,
               verbose=verbose)
    out: dict[str, Any] = {"hosts": hosts, "agents": agents}
    try:
        for _ in range(hosts):
            sim.add_host()
        u0 = sim.store_usage()
        out["rss_mb_empty"] = u0["rss_mb"]
        calls0, t0 = sim.calls, time.monotonic()
        out["cpu_s_start"] = sum(os.times()[:2])
        for agent in sim.agents:
            sim.start(agent)
        out["form_s"] = sim.wait_round(0, hosts, 120) - t0
        out["form_sim_cpu_s"] = sum(os.times()[:2]) - out.pop("cpu_s_start")
        out["form_calls_per_host"] = (sim.calls - calls0) / hosts
        u1 = sim.store_usage()
        out["form_store_cpu_s"] = u1["cpu_s"] - u0["cpu_s"]
        assert sim.round_members(0) == hosts, sim.round_members(0)
        sim.set_min(hosts - 1)

        time.sleep(min(1.0, steady_s))  # the round runs: its steady cost per host and second
        calls0, t0, u0 = sim.calls, time.monotonic(), sim.store_usage()
        time.sleep(steady_s)
        dt, u1 = time.monotonic() - t0, sim.store_usage()
        out["steady_calls_per_host_s"] = (sim.calls - calls0) / hosts / dt
        out["steady_store_cpu_per_s"] = (u1["cpu_s"] - u0["cpu_s"]) / dt
        out["steady_store_cpu_per_call_us"] = (
            (u1["cpu_s"] - u0["cpu_s"]) / max(1, sim.calls - calls0) * 1e6)
        out.update(rss_mb=u1["rss_mb"], keys=u1["keys"], bytes=u1["bytes"])

        lost = sim.agents[hosts // 2]  # not the round's first (the coordinator's host)
        u0, t0 = sim.store_usage(), time.monotonic()
        sim.freeze(lost)
        out["reform_after_loss_s"] = sim.wait_round(1, hosts - 1, 120) - t0
        out["reform_store_cpu_s"] = sim.store_usage()["cpu_s"] - u0["cpu_s"]
        assert sim.round_members(1) == hosts - 1, sim.round_members(1)
        out["round_sizes"] = [hosts, hosts - 1]
        if not join:
            return out
        time.sleep(2 * step_s)
        joiner = sim.add_host()
        t0 = time.monotonic()
        sim.start(joiner)
        out["reform_after_join_s"] = sim.wait_round(2, hosts, 120) - t0
        assert sim.round_members(2) == hosts, sim.round_members(2)
        out["round_sizes"].append(hosts)
        out["rss_mb_end"] = sim.store_usage()["rss_mb"]
        out["sim_cpu_s"] = sum(os.times()[:2])
        out["retries"] = sim.retries
    finally:
        sim.close()
    return out


# -- slow connections (issue 41, item 4) ------------------------------------------------------

def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big")
            + payload)


_HEADERS = (b"\x83\x86" + bytes([4, 23]) + b"/jaxdist.Rendezvous/get" + bytes([1, 9])
            + b"127.0.0.1" + b"\x0f\x10" + bytes([16]) + b"application/grpc"
            + b"\x00\x02te\x08trailers")  # HPACK literals: POST, http, :path, host, type, te


class _SlowHost:
    """``n`` connections from ``source``, each keeping ``rendezvous.MAX_STREAMS`` calls open
    whose message (announced as 100 bytes) never completes: new ones as the store cuts them."""

    def __init__(self, port: int, n: int, source: str = "127.0.0.2"):
        self.conns, self.next_id = [], []
        for _ in range(n):
            c = socket.socket()
            c.bind((source, 0))
            c.connect(("127.0.0.1", port))
            c.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0))
            c.settimeout(10)
            c.recv(65536)
            c.sendall(_frame(4, 1, 0))
            c.setblocking(False)
            self.conns.append(c)
            self.next_id.append(1)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for i, c in enumerate(self.conns):
                out = b""
                for _ in range(rendezvous.MAX_STREAMS):
                    sid = self.next_id[i]
                    self.next_id[i] += 2
                    out += _frame(1, 4, sid, _HEADERS)
                    out += _frame(0, 0, sid, b"\x00" + (100).to_bytes(4, "big") + b"{" * 10)
                try:
                    c.sendall(out)
                    while c.recv(65536):
                        pass
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    continue
            self.stop.wait(1.0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        for c in self.conns:
            c.close()


def _serve_only(conn) -> None:
    server, port = rendezvous.serve("127.0.0.1:0", own_job=JOB)
    conn.send(port)
    conn.recv()
    server.stop(0)


def slow_connections(n: int = 200, calls: int = 200, rounds: int = 3) -> dict[str, Any]:
    """Honest call latency (a set then a get, each timed) with no attack and under ``n`` slow
    connections from another host address, interleaved ``rounds`` times; the store in a child."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_serve_only, args=(there,), daemon=True)
    proc.start()
    port = here.recv()
    client = rendezvous.RendezvousClient(f"127.0.0.1:{port}", JOB)  # its usual 5 s deadline
    times: dict[str, list[float]] = {"none": [], "slow": []}
    failed = {"none": 0, "slow": 0}
    try:
        for _ in range(rounds):
            for kind in ("none", "slow"):
                attack = _SlowHost(port, n) if kind == "slow" else None
                if attack is not None:
                    time.sleep(1.0)  # every connection's calls open
                for i in range(calls // 2):
                    for method, args in (("set", (f"k{i}", i)), ("get", (f"k{i}",))):
                        t = time.perf_counter()
                        try:
                            getattr(client, method)(*args)
                            times[kind].append(time.perf_counter() - t)
                        except rendezvous.RendezvousError:
                            failed[kind] += 1
                if attack is not None:
                    attack.close()
    finally:
        client.close()
        here.send("stop")
        proc.join(timeout=30)
    out: dict[str, Any] = {"connections": n, "calls_per_round": calls, "rounds": rounds}
    for kind, ts in times.items():
        ts.sort()
        out[kind] = {"answered": len(ts), "failed": failed[kind],
                     "median_ms": 1e3 * ts[len(ts) // 2] if ts else None,
                     "p99_ms": 1e3 * ts[int(len(ts) * 0.99)] if ts else None}
    return out


def _table(rows: list[dict]) -> str:
    head = ("| hosts | forms (s) | re-forms after a loss (s) | after a join (s) | store CPU: "
            "forming (s) | running (CPU s/s) | per call (us) | calls/host: forming | "
            "running (/s) | store RSS (MB) | keys | bytes |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['hosts']} | {r['form_s']:.2f} | {r['reform_after_loss_s']:.2f} | "
            f"{r['reform_after_join_s']:.2f} | {r['form_store_cpu_s']:.2f} | "
            f"{r['steady_store_cpu_per_s']:.2f} | {r['steady_store_cpu_per_call_us']:.0f} | "
            f"{r['form_calls_per_host']:.1f} | {r['steady_calls_per_host_s']:.2f} | "
            f"{r['rss_mb']:.0f} | {r['keys']} | {r['bytes']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--step-s", type=float, default=0.25,
                        help="seconds per simulated training step")
    parser.add_argument("--store", choices=["process", "thread"], default="process")
    parser.add_argument("--agents", choices=["light", "real"], default="light",
                        help="light: coroutines making the agents' calls (the default; 1,024 "
                        "hosts fit one process); real: elastic.Agent in threads (to ~128)")
    parser.add_argument("--steady-s", type=float, default=5.0)
    parser.add_argument("--verbose", action="store_true", help="print the agents' lines")
    parser.add_argument("--slow", type=int, default=0, metavar="N",
                        help="instead: honest call latency under N slow connections vs none")
    parser.add_argument("--calls", type=int, default=200, help="with --slow: calls per round")
    parser.add_argument("--rounds", type=int, default=3, help="with --slow: rounds of each")
    args = parser.parse_args(argv)
    with open("/proc/loadavg") as f:
        print(f"load average at the start: {' '.join(f.read().split()[:3])}")
    if args.slow:
        print(json.dumps(slow_connections(args.slow, args.calls, args.rounds)))
        with open("/proc/loadavg") as f:
            print(f"load average at the end: {' '.join(f.read().split()[:3])}")
        return
    rows = []
    for n in args.hosts:
        row = run(n, step_s=args.step_s, store=args.store, steady_s=args.steady_s,
                  agents=args.agents, verbose=args.verbose)
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open("/proc/loadavg") as f:
        print(f"load average at the end: {' '.join(f.read().split()[:3])}")
    print(_table(rows))


if __name__ == "__main__":
    main()
