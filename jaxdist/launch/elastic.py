"""The elastic agent: one ``jaxdist launch --nnodes MIN:MAX`` per host, re-forming the job as hosts
fail, leave and arrive.

    jaxdist launch --nnodes 2:3 --rdzv-endpoint HOST:PORT --rdzv-id JOB -n K train.py ...

Each agent runs K processes of the job. The job runs in *rounds*: in round N the agents registered
in the rendezvous store (``jaxdist.launch.rendezvous``, served by the agent that can bind the endpoint)
are ordered (survivors keep their place, newcomers after them), ranks and the coordinator address
follow from that order, and every agent starts its K processes. A round ends when:

* a process fails or hangs, or an agent stops heartbeating (its host is lost): every agent kills
  its processes and registers for the next round; the job resumes from the newest step in memory
  (``jaxdist.memstate``), so at most one step is computed again;
* an agent is asked to leave (SIGTERM, a preemption notice) or a new agent registers: the agents
  agree on a stop step a little ahead of the current one (the first request wins in the store),
  every process stops exactly there (``BackupAndRestore`` saves a backup too) and the job
  re-forms without the leaver / with the newcomer, which receives the state from a live peer
  over the network: no step is lost;
* every process has finished: the job is done.

The first round closes when MAX agents have registered, or ``--rdzv-last-call`` seconds after
the first registration with at least MIN (torchrun's "last call"). If fewer than MIN agents are
alive for ``--rdzv-timeout`` seconds, the agents exit: 0 when the
last round ended cleanly (the state is in the persistent backup), 1 after a failure.

Losing the rendezvous host (the agent serving the store) does not end the job: once the store has
not answered for ``host_timeout_s``, the agents of the last round move it to the first live agent
in the round's order (``Agent._fail_over``), which serves a new store on its own address and the
rendezvous port; the round has failed, and the next resumes from memory. An agent that was in no
round yet has no one to move to and exits with status 1.
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from jaxdist.launch import compile_cache, statedir
from jaxdist.launch._procs import describe_exit, free_ports
from jaxdist.launch.cluster import ClusterSpec, join_address, split_address
from jaxdist.launch.hang import HangDetector, waited_for
from jaxdist.launch.heartbeat import heartbeat_path
from jaxdist.launch.rendezvous import RendezvousClient, RendezvousError, probe, serve
from jaxdist.launch.statedir import stop_path, write_stop

HOST_TIMEOUT_S = 3.0      # an agent silent this long is lost
_BEAT_S = 0.3
_SETTLE_S = 0.5           # close a round this long after the last registration, all present
_RESETTLE_S = 0.1         # the same for the rounds after the first
_DRAIN_LEAD_S = 1.0       # how far ahead (in time) the stop step is put
# The store answers a call in about 0.5 ms of its CPU: each agent asks it once per poll (one
# batch, its heartbeat in it), and a larger job polls less often, so that the store's load stays
# about constant: at 1,024 hosts a poll and heartbeat each second (the host timeout's third).
_POLLS_PER_S = 1000       # what all agents of a job send the store per second, at most


def _local_address(host: str, port: int) -> str:
    """This host's address as seen on the way to the rendezvous endpoint."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                           socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def _resolve(host: str, port: int, timeout_s: float) -> None:
    """Waits up to ``timeout_s`` for the endpoint's host name to resolve (a cluster's DNS name
    for the head may appear only once it is up), else one ``RendezvousError`` naming it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            return
        except (socket.gaierror, UnicodeError) as e:
            if time.monotonic() >= deadline:
                raise RendezvousError(
                    f"--rdzv-endpoint host {host!r} does not resolve ({e}) within {timeout_s:g} s"
                    f"; give the rendezvous host's name or address as every host sees it") from None
        time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))


ENV_HOST_TIMEOUT = "JAXDIST_RDZV_HOST_TIMEOUT"


def host_timeout_from_env(environ=None) -> float:
    """How long an agent may be silent before the others count its host lost: ``HOST_TIMEOUT_S``,
    or ``$JAXDIST_RDZV_HOST_TIMEOUT`` seconds (for a loaded test machine or a slow network; a
    larger value detects a lost host later). A bad value is one warning and the default.

    >>> host_timeout_from_env({}), host_timeout_from_env({"JAXDIST_RDZV_HOST_TIMEOUT": "8"})
    (3.0, 8.0)
    """
    text = (os.environ if environ is None else environ).get(ENV_HOST_TIMEOUT, "").strip()
    if not text:
        return HOST_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value >= 4 * _BEAT_S and math.isfinite(value)):
        import logging

        logging.getLogger(__name__).warning(
            "%s=%r: expected seconds >= %g (several heartbeats); using %g", ENV_HOST_TIMEOUT, text,
            4 * _BEAT_S, HOST_TIMEOUT_S)
        return HOST_TIMEOUT_S
    return value


@runtime_checkable
class LauncherSurface(Protocol):
    """What an elastic agent uses of its host's launcher (``jaxdist.launch.group._Launcher``):
    its options, how it was asked to stop, the job's state directory and failures, and how it
    starts, ends and inspects one group of processes."""

    restarts: int

    @property
    def options(self) -> Any: ...  # group._Options (group imports this module)

    @property
    def stop_signal(self) -> int | None: ...

    @property
    def state_dir(self) -> str | None: ...

    @property
    def last_failure(self) -> str: ...

    def say(self, message: str) -> None: ...

    def repeated(self, failure: str) -> bool: ...

    def child_env(self, extra: Mapping[str, str], attempt: int, *,
                  local_rank: int | None = None, group_rank: int = 0,
                  group_world_size: int = 1) -> dict[str, str]: ...

    def spawn(self, label: str, env: Mapping[str, str],
              readers: list[threading.Thread]) -> subprocess.Popen: ...

    def end_group(self, procs: list[subprocess.Popen],
                  readers: list[threading.Thread]) -> None: ...

    def record_failure(self, description: str, steps: Mapping[int, int | None],
                       ranks: Sequence[str] = ()) -> None: ...

    def flush_survivors(self, procs: Mapping[int, subprocess.Popen]) -> None: ...

    def dump_stacks(self, ranks: Mapping[int, int]) -> None: ...


class Agent:
    """One host's agent (used by ``jaxdist launch --nnodes``; ``launcher`` is its ``_Launcher``)."""

    def __init__(self, launcher: LauncherSurface, *, nnodes: tuple[int, int], endpoint: str,
                 rdzv_id: str, nproc: int, max_restarts: int, rdzv_timeout_s: float,
                 host_timeout_s: float = HOST_TIMEOUT_S, last_call_s: float = 10.0):
        self.l = launcher
        self.min, self.max = nnodes
        self.nproc = nproc
        self.max_restarts = max_restarts
        self.rdzv_timeout_s = rdzv_timeout_s
        self.host_timeout_s = host_timeout_s
        self.last_call_s = last_call_s
        self.hostname = socket.gethostname()
        self.id = f"{self.hostname}-{os.getpid()}-{secrets.token_hex(2)}"
        host, port = split_address(endpoint)
        _resolve(host, port, rdzv_timeout_s)
        self.server = serve(join_address(host, port), own_job=rdzv_id)
        self.rdzv_id, self._rdzv_port = rdzv_id, port
        self.store = RendezvousClient(endpoint, rdzv_id)
        self.addr = _local_address(host, port)
        self._round, self._members = -1, []  # type: ignore[var-annotated]  # the last round: number, [[agent id, info], ...]
        self._server_id: str | None = None  # the agent serving the store
        self._stopped = threading.Event()
        self._leaving = False
        self._quiet = False
        self._stop: int | None = None
        self._last_order: int | None = None
        self._said_quorum: int | None = None
        self._cleaned = 0  # rounds below this one have had their keys removed
        self._hosts = 1  # how many hosts the job has, as last seen (sets the polling rates)
        self._beaten = 0.0  # when this agent's heartbeat last reached the store
        self._said_lost: list = []  # the round closer's last list of lost hosts
        self.identity = _identity(launcher)

    def say(self, message: str) -> None:
        self.l.say(f"[agent {self.id}] {message}")

    def _alive_agents(self, store: RendezvousClient | None = None) -> dict[str, str]:
        """``{agent id: its host's name}`` of the agents not yet lost."""
        return {k: host for k, (host, age) in (store or self.store).list("alive/").items()
                if age < self.host_timeout_s}

    def _poll_s(self, per_s: int = _POLLS_PER_S, least: float = 0.1) -> float:
        """Seconds between this agent's polls of the store: ``least``, or more in a job so large
        that all agents together would send more than ``per_s`` polls a second."""
        return max(least, self._hosts / per_s)

    def _beat_s(self) -> float:
        """Seconds between heartbeats: as the polls, and at least three per host timeout."""
        return min(self._poll_s(least=_BEAT_S), self.host_timeout_s / 3)

    def _watch_poll_s(self) -> float:
        """Seconds between a running round's polls: each one is a heartbeat too."""
        return min(self._poll_s(), self.host_timeout_s / 3)

    def _beat_call(self) -> list[tuple[str, dict]]:
        """This agent's heartbeat as a call of a poll's batch (none while it is quiet)."""
        return [] if self._quiet else [
            ("set", {"key": f"alive/{self.id}", "value": self.hostname})]

    # -- threads -------------------------------------------------------------------------------

    def _beat(self) -> None:
        """Beats when no poll of the main loop has (a round starting its processes)."""
        while not self._stopped.wait(_BEAT_S):
            if self._quiet or time.monotonic() - self._beaten < self._beat_s():
                continue
            try:
                self.store.set(f"alive/{self.id}", self.hostname)
                self._beaten = time.monotonic()
            except RendezvousError:
                pass  # the monitor notices a store that stays silent

    def _close_rounds(self) -> None:
        """On the store's host: closes each open round once enough agents have registered."""
        try:
            self._close_rounds_loop()
        except Exception as e:  # noqa: BLE001 - say why, or every agent waits in vain
            self.say(f"the rendezvous round closer failed: {type(e).__name__}: {e}")
            raise

    def _close_rounds_loop(self) -> None:
        # On the store's own host: its reads cost no call (and nothing of the others' time).
        store = self.server[0].client(self.rdzv_id) if self.server is not None else self.store
        finals: dict[int, Any] = {}  # a round's final list, written once: read once (100 KB
        while not self._stopped.wait(0.1):  # at 1,024 hosts)
            try:
                n = store.get("open")
                regs = store.list(f"r{n}/member/")
                alive = set(self._alive_agents(store))
                leaving = set(store.list("leaving/"))
                rejected = set(store.list("rejected/"))
                if n - 1 not in finals:
                    finals = {n - 1: store.get(f"r{n - 1}/final") if n > 0 else None}
                prev = finals[n - 1]
                moved = store.get("moved") == n
                self._census(store, n - 1, prev, alive, leaving | rejected)
            except RendezvousError:
                continue
            ready = {k: v for k, (v, _) in regs.items()
                     if k in alive and k not in leaving and k not in rejected}
            ready = self._refuse_mismatched(ready, prev)
            if len(ready) < self.min or not self._quorum(n, ready, prev, leaving | rejected,
                                                         moved):
                continue
            newest = min(age for _, age in regs.values())
            oldest = max(age for _, age in regs.values())
            missing = alive - set(ready) - leaving
            # The first round also waits a little for agents still starting (torchrun's last
            # call); a later one re-forms agents that are all registered (none missing) at once.
            settle = _SETTLE_S if n == 0 else _RESETTLE_S
            if len(ready) >= self.max or (newest > settle and not missing
                                          and (n > 0 or oldest > self.last_call_s)):
                order = sorted(ready, key=lambda k: (ready[k]["order"], -regs[k][1]))[:self.max]
                store.set(f"r{n}/final", [[k, _final_entry(ready[k], lead=i == 0)]
                                          for i, k in enumerate(order)])
                store.set("open", n + 1)
                # Rounds before the last are over: their keys go (a long job keeps a few).
                for old in range(self._cleaned, n - 1):
                    store.delete_prefix(f"r{old}/")
                self._cleaned = max(self._cleaned, n - 1)

    def _census(self, store: RendezvousClient, m: int, members: list | None, alive: set,
                gone: set) -> None:
        """Publishes how many agents are alive (``alive_n``, for agents waiting for a round) and
        the hosts of the running round ``m`` that are lost (``r{m}/lost``): the store's host
        reads every heartbeat, so the other agents need not (each would read them all at each
        poll: a cost growing as the square of the hosts)."""
        if store.get("alive_n") != len(alive):
            store.set("alive_n", len(alive))
        lost = sorted(k for k, _ in members or () if k not in alive and k not in gone)
        if lost and lost != self._said_lost:
            store.set(f"r{m}/lost", lost)
            # the round has failed: said once here, rather than by each agent that reads it
            store.set_if_absent(f"r{m}/failed", f"host(s) {lost} lost (agent silent for more "
                                f"than {self.host_timeout_s:g} s)")
        self._said_lost = lost

    def _refuse_mismatched(self, ready: dict, prev: list | None) -> dict:
        """Leaves out (and marks refused) the agents whose jaxdist or JAX version or devices per
        process differ from the job's: the last round's, or for the first round the store's
        host's. A mismatched host would abort every round in its collectives."""
        # Before any round, the job is the store's host's (this agent: the closer runs there), not
        # the most common so far: with one host of each kind either could have been refused.
        job = prev[0][1].get("identity") if prev else self.identity
        if job is None:
            return ready
        out = {}
        for k, v in ready.items():
            mine = v.get("identity") or {}
            diff = [f"{name} {mine.get(name)!r} (the job's: {job.get(name)!r})"
                    for name in sorted(set(job) | set(mine)) if mine.get(name) != job.get(name)]
            if diff:
                self.store.set(f"rejected/{k}", "; ".join(diff))
                self.say(f"agent {k} refused: its {'; '.join(diff)} differ from the job's")
            else:
                out[k] = v
        return out

    def _quorum(self, n: int, ready: dict, prev: list | None, gone: set, moved: bool) -> bool:
        """Whether round ``n`` may form with ``ready``: it must hold half the hosts of the last
        round (those that left or were refused aside), or more than half when the store has
        just moved. Two sides of a network partition can then never both go on: the store's
        side needs half, the other a majority to move the store (ties go to the store's side)."""
        if not prev:
            return True
        last = {k for k, _ in prev} - gone
        if not last:
            return True
        here = len(last & set(ready))
        enough = here * 2 > len(last) if moved else here * 2 >= len(last)
        if not enough:
            quorum: dict[str, Any] = {"here": here, "of": len(last), "moved": moved}
            if self._said_quorum != n:
                self._said_quorum = n
                self.store.set("quorum", {"round": n, **quorum})
                self.say(_quorum_message(**quorum))
        return enough

    # -- rounds --------------------------------------------------------------------------------

    def run(self) -> int:
        """Runs rounds until the job is done, this agent leaves, or too few agents remain."""
        answered = False  # whether another host's store answered this one's probe
        if self.server is not None:
            self.say(f"serving the rendezvous store on {self.store.address}")
            self.store.set("server", self.id)
        else:
            try:  # a port held by another program, or another job's token: say so at once
                answered = probe(self.store.address)
            except RendezvousError as e:
                self.say(str(e))
                return 2
        try:
            self.store.set_if_absent("open", 0, timeout_s=self.rdzv_timeout_s)
            self.store.set_if_absent("done", 0)  # so that the job's end never needs a new key
        except RendezvousError as e:
            if not answered:  # no store ever answered: a wrong endpoint, or it never came up
                raise
            return self._store_went_away(e)  # a job that ended as this host arrived
        threading.Thread(target=self._beat, daemon=True).start()
        if self.server is not None:
            threading.Thread(target=self._close_rounds, daemon=True).start()
        failures, clean = 0, True
        try:
            while True:
                try:
                    joined: tuple | None = self._join()
                    if joined is not None:
                        outcome, code = self._run_round(*joined)
                except RendezvousError as e:
                    if not self._fail_over(e):
                        raise
                    joined, outcome, code = (), "failed", 1  # the round's processes are gone
                except Refused as e:
                    self.say(f"this host is refused by the job: {e}; it does not join (start "
                             "it with the job's settings). The job goes on without it")
                    return 2
                if joined is None:
                    if self.l.stop_signal is not None:
                        self.say(f"received {signal.Signals(self.l.stop_signal).name} between "
                                 "rounds; leaving")
                        return 0 if clean and self._round >= 0 else 128 + self.l.stop_signal
                    if self.store.get("done"):
                        return 0
                    quorum = self.store.get("quorum")
                    if quorum is not None and quorum.get("round") == self.store.get("open"):
                        self.say(f"{_quorum_message(quorum['here'], quorum['of'], quorum['moved'])}"
                                 f"; after {self.rdzv_timeout_s:g} s, exiting")
                        return 0 if clean and self._round >= 0 else 1
                    here = sorted(f"{host} (agent {k})" for k, host in self._alive_agents().items())
                    self.say(f"fewer than {self.min} agents registered within "
                             f"{self.rdzv_timeout_s:g} s ({len(here)} did: "
                             f"{', '.join(here) or 'none'}; {self.min - len(here)} more were "
                             "needed: start `jaxdist launch` with the same --rdzv-endpoint "
                             "and --rdzv-id on the missing hosts, or lower MIN in --nnodes); "
                             "exiting")
                    # 0 only after a round that ended cleanly (its state is in the backup): a
                    # job that never formed has not succeeded, whatever a scheduler records
                    return 0 if clean and self._round >= 0 else 1
                if outcome in ("done", "left", "signal", "refused"):
                    if outcome == "done" and self.server is not None:
                        self._linger()
                    return code
                clean = outcome == "drained"
                if not clean:
                    failures += 1
                    if failures > self.max_restarts:
                        self.say(f"job failed after {failures - 1} restart(s) of this agent")
                        return code or 1
                    if self.l.repeated(self.l.last_failure):
                        return code or 1
                    self.l.restarts += 1
        except RendezvousError as e:
            if self._round < 0:  # never in a round: no process of this host ran
                return self._store_went_away(e)
            self.say(f"lost the rendezvous store ({e}); stopping this host's processes")
            return 1
        finally:
            self._stopped.set()
            try:
                self.store.delete(f"alive/{self.id}")
            except RendezvousError:
                pass
            if self.server is not None:
                self._drain_store()
                self.server[0].stop(0)

    def _drain_store(self) -> None:
        """Keeps the store up until the other agents have gone (or have been silent a while)."""
        end = time.monotonic() + self.rdzv_timeout_s
        while time.monotonic() < end:
            try:
                others = [k for k in self._alive_agents() if k != self.id]
            except RendezvousError:
                return
            if not others:
                return
            time.sleep(0.1)

    def _join(self) -> tuple[int, list] | None:
        deadline = time.monotonic() + self.rdzv_timeout_s
        port = free_ports(1, host="")[0]
        guess = self._round + 1 if self._round >= 0 else None  # (opened as ours closed)
        while time.monotonic() < deadline:
            if guess is None:
                done, n = self.store.batch(("get", {"key": "done"}), ("get", {"key": "open"}))
                if done or self.l.stop_signal is not None:
                    return None
            else:  # after a round the next one is open: registering for it costs no call first
                n, guess = guess, None  # (the poll's reply says whether it still is)
            # Registers with the first poll. The store holds each later poll until the round
            # closes (or a heartbeat's time): no polling storm at 1,000 hosts, and the round
            # starts at once. Never more than one call per poll interval; a store that holds
            # nothing is polled as before.
            register = [("set", {"key": f"r{n}/member/{self.id}",
                                 "value": self._member_record(port)})]
            seen, next_at = None, time.monotonic()
            while time.monotonic() < deadline:
                time.sleep(max(0.0, next_at - time.monotonic()))
                next_at = time.monotonic() + self._poll_s(least=0.05)
                if self.l.stop_signal is not None:
                    return None  # SIGTERM while waiting for a round: leave now, not at the deadline
                hold = self._beat_s()
                # (the call stamps the heartbeat when it arrives and again when it is answered)
                self._beaten = time.monotonic() + hold
                replies, seen = self.store.watch(*register, *self._join_calls(),
                                                 on=self._join_watch(), seen=seen, within_s=hold)
                self._beaten = time.monotonic()
                opened, refused, done, quorum, alive_n, *_ = replies[len(register):]
                register = []
                if opened != n:
                    break
                if refused:
                    raise Refused(refused)
                if done:
                    return None  # the job ended while this agent waited: nothing to join
                if alive_n is None:  # (published by the round closer once it runs)
                    alive_n = len(self._alive_agents())
                self._hosts = max(alive_n, 1)
                waiting = quorum is not None and quorum.get("round") == n
                if alive_n >= self.min and not waiting:
                    deadline = time.monotonic() + self.rdzv_timeout_s  # a round runs or forms
            else:
                break
            final = self.store.get(f"r{n}/final")  # (the same reply for every agent)
            if final and any(k == self.id for k, _ in final):
                return n, final
        return None

    def _member_record(self, port: int) -> dict[str, Any]:
        """What this agent registers for a round: where its processes' coordinator would listen,
        how many processes it runs, its place in the last round and its versions."""
        order = self._last_order if self._last_order is not None else 1 << 30
        return {"addr": self.addr, "port": port, "nproc": self.nproc, "host": self.hostname,
                "order": order, "identity": self.identity}

    def _join_calls(self) -> list[tuple[str, dict]]:
        """One poll while waiting for a round, as one batch: the open round, whether this agent
        is refused, the job's end, a lost quorum, how many agents are alive, its heartbeat."""
        return [("get", {"key": "open"}), ("get", {"key": f"rejected/{self.id}"}),
                ("get", {"key": "done"}), ("get", {"key": "quorum"}),
                ("get", {"key": "alive_n"}), *self._beat_call()]

    def _join_watch(self) -> list[str]:
        """What a waiting agent's poll is answered on when it changes: all it reads but the
        count of live agents (which changes with every arrival)."""
        return ["open", f"rejected/{self.id}", "done", "quorum"]

    def _run_round(self, n: int, members: list) -> tuple[str, int]:
        self._round, self._members = n, members
        self._hosts = len(members)
        self._server_id = self.store.get("server")
        index = [k for k, _ in members].index(self.id)
        self._last_order = index
        first = sum(info["nproc"] for _, info in members[:index])
        world = sum(info["nproc"] for _, info in members)
        lead = members[0][1]
        coordinator = join_address(lead["addr"], lead["port"])
        ids = [k for k, _ in members]
        self.say(f"round {n}: {len(members)} host(s) {[m['host'] for _, m in members]}, "
                 f"ranks {first}..{first + self.nproc - 1} of {world}, coordinator "
                 f"{coordinator}")
        state_dir = self.l.state_dir
        for path in [stop_path(state_dir)] + [
                p for r in range(first, first + self.nproc)
                for p in (heartbeat_path(state_dir, r), statedir.outcome_path(state_dir, r))]:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        procs, readers = [], []  # type: ignore[var-annotated]
        try:
            for i in range(self.nproc):
                env = self.l.child_env(ClusterSpec(coordinator, world, first + i).to_env(), n,
                                       local_rank=i, group_rank=index,
                                       group_world_size=len(members))
                procs.append(self.l.spawn(str(first + i), env, readers))
            return self._watch(n, ids, first, procs)
        finally:
            self.l.end_group(procs, readers)

    def _watch(self, n: int, ids: list[str], first: int, procs: list) -> tuple[str, int]:
        ranks = {first + i: p.pid for i, p in enumerate(procs)}
        detector = HangDetector(self.l.state_dir, ranks,
                                timeout_s=self.l.options.hang_timeout_s)
        poller = _RoundPoller(self, n, detector)
        try:
            return self._watch_round(n, ids, first, procs, detector, poller)
        finally:
            poller.stop()

    def _watch_round(self, n: int, ids: list[str], first: int, procs: list,
                     detector: HangDetector, poller: _RoundPoller) -> tuple[str, int]:
        """Watches this host's processes (every 0.1 s) and the round's news from the store
        until the round ends here: done, drained, failed (here or elsewhere), left."""
        local = {first + i: p for i, p in enumerate(procs)}
        state_dir = self.l.state_dir
        draining = False
        store_ok = time.monotonic()
        silent_said = False

        def fail(reason: str, code: int = 1, ranks_at_fault=(), told=False) -> tuple[str, int]:
            self.say(f"round {n} failed: {reason}; last completed step per local rank "
                     f"{detector.last_steps()}")
            self.l.record_failure(reason, detector.last_steps(), [str(r) for r in ranks_at_fault])
            try:  # first, so that the other hosts' survivors write their copies meanwhile
                if not told:  # (the store knows already: the closer said a host was lost)
                    self.store.set_if_absent(f"r{n}/failed", reason)
            finally:  # a silent store raises: see _fail_over
                self.l.flush_survivors(local)
            return "failed", code

        while True:
            time.sleep(0.1)
            codes = [p.poll() for p in procs]
            if self.l.stop_signal is not None and not self._leaving and self._leave():
                return "signal", 128 + signal.SIGKILL
            outcomes = {r: statedir.read_outcome(state_dir, r) for r, c in zip(local, codes)
                        if c is not None}
            refused = next((o["rejected"] for o in outcomes.values() if o and "rejected" in o),
                           None)
            if refused is not None:
                self.store.set(f"rejected/{self.id}", refused)
                self.say(f"this host is refused by the job: {refused}. It leaves; the job "
                         "re-forms without it")
                return "refused", 2
            for i, code in enumerate(codes):
                if code not in (None, 0) and (not draining or None not in codes):
                    return fail(f"rank {first + i} on host {self.hostname} "
                                f"{describe_exit(code)}", code if code > 0 else 128 - code,
                                [first + i])
            if all(code == 0 for code in codes):
                return self._ended(n, outcomes, detector, draining)
            hung = detector.check([first + i for i, c in enumerate(codes) if c is None])
            if hung and not draining:
                for h in hung:
                    self.say(h.describe(self.hostname, detector.timeout_s))
                self.say(waited_for(self._job_progress(n, detector)))
                self.l.dump_stacks({r: p.pid for r, p in local.items() if p.poll() is None})
                return fail(f"rank(s) {[h.rank for h in hung]} on host {self.hostname} hung",
                            ranks_at_fault=[h.rank for h in hung])
            news = poller.take()
            if news is None:
                continue
            if not isinstance(news, RendezvousError):
                failed, leaving_now, rejected, registered, stop, done, silent, *_ = news
                leaving = set(leaving_now) | set(rejected)
                joiners = [k for k in registered if k not in ids]
                store_ok, silent_said = time.monotonic(), False
            else:
                if time.monotonic() - store_ok > self.host_timeout_s and not silent_said:
                    silent_said = True
                    # This host's processes do not need the store: they go on (and finish, or
                    # save their last backup); only a failure needs it, to re-form.
                    self.say(f"round {n}: the rendezvous store is silent; this host's processes "
                             "go on, and the job re-forms only if one of them fails")
                continue
            if done:
                continue  # another host's processes finished: ours are finishing too
            # the store's host reads the heartbeats (Agent._census) and names the lost hosts
            lost = [k for k in silent or () if k in ids and k != self.id and k not in leaving]
            if lost:
                return fail(f"host(s) {lost} lost (agent silent for more than "
                            f"{self.host_timeout_s:g} s)", told=bool(failed))
            if failed:
                self.say(f"round {n} ended by a failure elsewhere: {failed}; last completed "
                         f"step per local rank {detector.last_steps()}")
                if "hung" in failed:
                    self.l.dump_stacks({r: p.pid for r, p in local.items() if p.poll() is None})
                self.l.flush_survivors(local)
                self.l.record_failure(failed, detector.last_steps())
                return "failed", 1
            if stop is None and (joiners or self._leaving or (leaving & set(ids))):
                stop = self._ask_stop(n, detector, "a host joins" if joiners else "a host leaves")
            if stop is not None and not draining:
                draining, self._stop = True, stop
                try:
                    write_stop(self.l.state_dir, stop)
                except OSError as e:  # a full /dev/shm: the tier never takes the agent down
                    self.say(f"could not ask this host's processes to stop at step {stop} ({e})")

    def _round_watch(self, n: int) -> list[str]:
        """What a running round's poll is answered on when it changes: a failure, hosts leaving,
        refused or joining, the agreed stop step, the job's end, the lost hosts."""
        return [f"r{n}/failed", "leaving/", "rejected/", f"r{n + 1}/member/", f"r{n}/drain",
                "done", f"r{n}/lost"]

    def _leave(self) -> bool:
        """This host was asked to stop: True for SIGKILL (at once), else it announces that it
        leaves at a step every process agrees on."""
        if self.l.stop_signal == signal.SIGKILL:
            return True
        self._leaving = True
        self.say(f"received {signal.Signals(self.l.stop_signal).name}: this host leaves the job "
                 "at a step every process agrees on")
        self.store.set(f"leaving/{self.id}", 1)
        return False

    def _round_calls(self, n: int, detector: HangDetector, publish: bool) -> list:
        """One poll of a running round, as one batch: a failure, hosts leaving, refused or
        joining, the agreed stop step, the job's end, the lost hosts, this host's heartbeat and
        (``publish``) its ranks' progress, for naming the rank a hang waits for."""
        calls = [("get", {"key": f"r{n}/failed"}), ("list", {"prefix": "leaving/"}),
                 ("list", {"prefix": "rejected/"}), ("list", {"prefix": f"r{n + 1}/member/"}),
                 ("get", {"key": f"r{n}/drain"}), ("get", {"key": "done"}),
                 ("get", {"key": f"r{n}/lost"}), *self._beat_call()]
        if publish:
            calls.append(("set", {"key": f"r{n}/progress/{self.id}", "value": {
                str(r): (b.dispatched if b is not None else None)
                for r, b in detector.progress().items()}}))
        return calls

    def _ended(self, n: int, outcomes: dict, detector: HangDetector,
               draining: bool) -> tuple[str, int]:
        """What a round whose processes on this host all exited with status 0 came to."""
        if any(o and "reform" in o for o in outcomes.values()):
            self.say(f"round {n}: a host was refused (another state than the job's); "
                     "the job re-forms without it")
            return "drained", 0
        if self._leaving:
            self.say(f"left the job at step {self._stop if draining else 'end'}")
            if self.server is not None:
                self._serve_until_done()
            return "left", 0
        if draining and self._reached(detector, self._stop):
            self.say(f"stopped at step {self._stop} to re-form the job")
            return "drained", 0
        # every process finished training (before any stop step that was asked for)
        try:
            self.store.set("done", 1)
        except RendezvousError:
            pass  # a silent store: the agents that still need it learn it from JAX
        return "done", 0

    def _ask_stop(self, n: int, detector: HangDetector, why: str) -> int | None:
        """Proposes a stop step a little ahead of this host's progress (the first proposal in
        the store wins); None while no step has run to count from."""
        steps = [b.dispatched for b in detector.progress().values() if b is not None]
        if not steps:
            return None
        step_s = detector.median_step_s() or 0.05
        # at least two calls ahead: a call may run several steps (steps_per_execution), and the
        # stop is seen at a call's end
        ahead = max(4, 2 * detector.largest_jump, math.ceil(_DRAIN_LEAD_S / max(step_s, 1e-3)))
        stop = self.store.set_if_absent(f"r{n}/drain", max(steps) + ahead)
        self.say(f"{why}: asking every process to stop at step {stop}")
        return stop

    def _reached(self, detector: HangDetector, stop: int | None) -> bool:
        """Whether this host's processes stopped at the agreed step (not earlier: they finished
        training first, when the step asked for lies past the end)."""
        steps = [b.dispatched for b in detector.progress().values() if b is not None]
        return stop is not None and bool(steps) and max(steps) >= stop

    def _job_progress(self, n: int, detector: HangDetector) -> dict[int, int | None]:
        """Every rank's dispatched steps in round ``n``: this host's from its heartbeats, the
        others' as their agents last published them."""
        steps: dict[int, int | None] = {}
        try:
            for _, (ranks, _) in self.store.list(f"r{n}/progress/").items():
                steps.update({int(r): s for r, s in (ranks or {}).items()})
        except RendezvousError:
            pass
        steps.update({r: (b.dispatched if b is not None else None)
                      for r, b in detector.progress().items()})
        return steps

    def _fail_over(self, error: RendezvousError) -> bool:
        """Moves the store to the next agent of the last round when its host is lost.

        Only a store silent for the host timeout is moved (an answer in that time keeps it: the
        round has failed and the job re-forms on it). Every agent of the last round then walks
        the round's order (the serving agent left out) and takes the first agent that can serve:
        that agent serves a new store on its own address and the rendezvous port, the others
        wait up to twice the host timeout for it to answer, then try the next. The round that
        was running has failed; the next one resumes from memory. Returns False when there is
        no one to move to (this agent served the store itself, was not in a round yet, or no
        candidate answered).
        """
        if self.server is not None or not self._members or self._server_id is None:
            return False
        old = self.store.address
        # One call past its deadline is not a lost host (a stall, a slow network): only a store
        # that stays silent for the host timeout is moved, or two stores could split the job.
        if self._answers(old, self.host_timeout_s):
            self.say(f"the rendezvous store answered again ({error}); the round is failed, the "
                     "job re-forms on the same store")
            return True
        for k, info in self._members:
            if k == self._server_id:
                continue
            address = join_address(info["addr"], self._rdzv_port)
            if k == self.id:
                self.server = serve(address, own_job=self.rdzv_id)
                if self.server is None:
                    self.say(f"cannot serve the rendezvous store on {address} (port taken)")
                    return False
                self._use_store(address)
                local = self.server[0].client(self.rdzv_id)  # (a large round's list is big)
                local.set("server", self.id)
                # The next round needs a majority of the last one (see _quorum).
                local.set(f"r{self._round}/final", self._members)
                local.set("moved", self._round + 1)
                local.set("open", self._round + 1)
                local.set_if_absent("done", 0)
                threading.Thread(target=self._close_rounds, daemon=True).start()
                self.say(f"the rendezvous store on {old} is lost ({error}); this agent serves "
                         f"it now on {address} (new agents: --rdzv-endpoint {address})")
                return True
            if self._answers(address, 2 * self.host_timeout_s, server=k):
                self._use_store(address)
                self.say(f"the rendezvous store on {old} is lost ({error}); agent {k} serves it "
                         f"now on {address}")
                return True
        return False

    def _answers(self, address: str, within_s: float, server: str | None = None) -> bool:
        """Whether the store at ``address`` answers within ``within_s`` (served by ``server``,
        when given), asked with a short deadline every 0.1 s."""
        probe = RendezvousClient(address, self.rdzv_id, timeout_s=0.5)
        end = time.monotonic() + within_s
        try:
            while time.monotonic() < end:
                try:
                    found = probe.get("server")  # any answer, or the expected server's
                    if server is None or found == server:
                        return True
                except RendezvousError:
                    pass
                time.sleep(0.1)
            return False
        finally:
            probe.close()

    def _use_store(self, address: str) -> None:
        """Talks to the store at ``address`` from now on (the usual deadline); the old channel
        is closed, so a thread still using it gets a RendezvousError."""
        self.store.close()
        self.store = RendezvousClient(address, self.rdzv_id)

    def _store_went_away(self, e: RendezvousError) -> int:
        self.say(f"the rendezvous store went away before this host joined a round ({e}): the "
                 "job has ended, or its store's host is gone; nothing ran here")
        return 0

    def _linger(self) -> None:
        """The job is done: the serving agent keeps the store up until the other agents have
        read that and left (or their heartbeats stopped), at most two host timeouts, so that a
        host that registered as the job ended learns it ended rather than losing the store (and
        exiting 1)."""
        deadline = time.monotonic() + 2 * self.host_timeout_s
        while time.monotonic() < deadline:
            try:
                if not [k for k in self._alive_agents() if k != self.id]:
                    return
            except RendezvousError:
                return
            time.sleep(0.1)

    def _serve_until_done(self) -> None:
        """A leaving agent that serves the store keeps serving it (without processes) until the
        job is done or no other agent is left, so that the others can re-form."""
        self.say("still serving the rendezvous store for the other hosts")
        self._quiet = True
        self.store.delete(f"alive/{self.id}")
        quiet_since = None
        while not self.store.get("done"):
            others = [k for k in self._alive_agents() if k != self.id]
            if others:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > self.rdzv_timeout_s:
                return
            time.sleep(0.2)


class _RoundPoller:
    """A running round's polls of the store (``Agent._round_calls``), on a thread of their own:
    the store holds each until something the round watches changes (a failure, a lost host, a
    joiner, a stop step, the job's end) or for one poll interval, so the agent, which looks at
    its processes every 0.1 s, learns of a change as it is written, with no more calls than a
    poll each interval. ``take`` gives the newest reply (or the error of the last poll) once."""

    def __init__(self, agent: Agent, n: int, detector: HangDetector):
        self.agent, self.n, self.detector = agent, n, detector
        self._news: list | RendezvousError | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        threading.Thread(target=self._run, daemon=True, name=f"round-{n}-poll").start()

    def _run(self) -> None:
        agent, seen, published = self.agent, None, 0.0
        next_at = time.monotonic() + agent._watch_poll_s()
        while not self._stopped.wait(max(0.0, next_at - time.monotonic())):
            hold = agent._watch_poll_s()
            next_at = time.monotonic() + hold
            publish = time.monotonic() - published > 1.0
            published = time.monotonic() if publish else published
            news: list | RendezvousError
            try:
                agent._beaten = time.monotonic() + hold  # (stamped on arrival and on answer)
                news, seen = agent.store.watch(
                    *agent._round_calls(self.n, self.detector, publish),
                    on=agent._round_watch(self.n), seen=seen, within_s=hold)
                agent._beaten = time.monotonic()
            except RendezvousError as e:
                news, seen = e, None
            with self._lock:
                self._news = news
        agent.store.end_session()  # this thread's stream (LocalClient and older stores: none)

    def take(self) -> list | RendezvousError | None:
        with self._lock:
            news, self._news = self._news, None
        return news

    def stop(self) -> None:
        """No more polls (one held at the store ends within an interval, unread)."""
        self._stopped.set()


class Refused(RuntimeError):
    """This agent was refused by the job (its settings differ from the job's)."""


def _identity(launcher: Any) -> dict[str, Any]:
    """What must match across the job's hosts: the versions and devices per process (JAX's
    version as installed: an agent never imports JAX)."""
    from jaxdist._version import __version__

    jax_version = compile_cache.installed_jax_version()
    if jax_version is None:  # not installed as a distribution
        import jax

        jax_version = jax.__version__
    return {"jaxdist": __version__, "jax": jax_version,
            "devices_per_process": launcher.options.devices_per_process}


def _final_entry(record: dict[str, Any], *, lead: bool) -> dict[str, Any]:
    """A member's record in a round's final list, which every agent reads: the first member's
    whole (its coordinator's port, the job's identity), the others' address, processes and host
    name only (100 bytes rather than 250: at 1,024 hosts the list every agent reads is 100 KB)."""
    return record if lead else {k: record[k] for k in ("addr", "nproc", "host")}


def _quorum_message(here: int, of: int, moved: bool) -> str:
    """Why a round waits: too few of the last round's hosts.

    >>> _quorum_message(1, 3, False).split(":")[0]
    "only 1 of the last round's 3 host(s) are here"
    """
    return (f"only {here} of the last round's {of} host(s) are here: a network partition may be "
            f"splitting the job, and only a side with half of them (with the rendezvous store) "
            f"or more than half (moving the store) may go on, so the two sides can never both "
            f"train. If the others are gone for good, start the job again on these hosts: it "
            f"resumes from the in-memory state or the backup")


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"MIN:MAX"`` or ``"N"`` as ``(min, max)``.

    >>> parse_nnodes("2:3"), parse_nnodes("2")
    ((2, 3), (2, 2))
    """
    lo, _, hi = text.partition(":")
    try:
        lo_n, hi_n = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--nnodes {text!r}: expected MIN:MAX or N (integers)") from None
    if not 1 <= lo_n <= hi_n:
        raise ValueError(f"--nnodes {text!r}: expected 1 <= MIN <= MAX")
    return lo_n, hi_n
